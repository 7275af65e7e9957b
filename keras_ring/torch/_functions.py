"""Horovod's start-of-training helpers for PyTorch: a model's and an optimizer's state."""

import torch

from keras_ring.core import _basics, _objects
from keras_ring.core._process_sets import global_process_set, process_set_id, root_index
from keras_ring.torch import _ops


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites the tensors, on every rank, with `root_rank`'s, in place.

    Typically `model.state_dict()` (parameters and buffers), or
    `model.named_parameters()` or `model.parameters()`. All go in one
    request to the engine; a `state_dict` is matched across ranks by its
    sorted names.

    Args:
        params: A dict of name to tensor, or an iterable of tensors or of
            (name, tensor) pairs.
        root_rank: The rank whose values every rank receives.
        process_set: Broadcast among this `ProcessSet`'s ranks only.

    Raises:
        ValueError: For `params` of another kind, or tensors whose names,
            shapes or dtypes differ between the ranks (naming them).
    """
    _basics._require_initialized("broadcast_parameters()")
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise ValueError("keras_ring.torch.broadcast_parameters takes a dict of tensors "
                         "(model.state_dict()) or an iterable of tensors or (name, tensor) "
                         f"pairs (model.named_parameters()). Received: {type(params).__name__}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    if not items:
        return
    tensors = [_ops._checked(t, "broadcast_parameters") for _, t in items]
    names = [f"broadcast_parameters.{i}" if name is None else f"broadcast_parameters.{name}"
             for i, (name, _) in enumerate(items)]
    handle = _ops._start(_ops._engine().BROADCAST, tensors, names, outputs=tensors,
                         root_rank=root_index(process_set, root_rank),
                         process_set=process_set_id(process_set))
    try:
        handle.wait()
    except ValueError as e:
        raise _ops._as_runtime_error(e) from None
    with torch.no_grad():
        for (_, original), received in zip(items, tensors):
            if received is not original:  # a non-contiguous tensor, received as a copy
                original.copy_(received)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Gives every rank `root_rank`'s optimizer state and hyperparameters.

    The root's `optimizer.state_dict()` (moments, step counts, learning
    rates of each parameter group) is loaded on the other ranks. A fresh
    optimizer has no state yet, and then every rank keeps none.

    Args:
        optimizer: A `torch.optim.Optimizer`, wrapped or not, over the same
            parameter groups on every rank.
        root_rank: The rank whose state every rank receives.
        model: Accepted for Horovod's signature; not needed.
        process_set: Broadcast among this `ProcessSet`'s ranks only.
    """
    del model  # the state dict says all there is
    _basics._require_initialized("broadcast_optimizer_state()")
    state = _objects.broadcast_object(optimizer.state_dict(), root_rank,
                                      name="broadcast_optimizer_state", process_set=process_set)
    if _basics.rank() != root_rank:
        optimizer.load_state_dict(state)
