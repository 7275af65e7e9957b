"""TorchState: PyTorch models, optimizers and samplers kept across an elastic job's resets."""

import copy

import torch

from keras_ring.core import _objects
from keras_ring.elastic._object_state import ObjectState
from keras_ring.torch import _functions, _optimizer
from keras_ring.torch._elastic_sampler import ElasticSampler


class TorchState(ObjectState):
    """A PyTorch model and optimizer, plus attributes such as the epoch (Horovod's `TorchState`).

    `save()` (and `commit()`) keeps a copy of `model.state_dict()` and
    `optimizer.state_dict()` in host memory, with the attributes; `restore()`
    loads the copy back; `sync()` gives every rank rank 0's parameters,
    buffers and optimizer state (`broadcast_parameters`,
    `broadcast_optimizer_state`), then its saved attributes, and saves.
    Keyword arguments that are modules, optimizers or `ElasticSampler`s are
    kept the same way, so several models and optimizers can be kept; an
    `ElasticSampler`'s sync joins the indices every rank recorded as
    processed. Assigning a new object to one of them (`state.model = m`)
    keeps the new one from then on.

    Args:
        model: A `torch.nn.Module` (optional).
        optimizer: A `torch.optim.Optimizer`, a `DistributedOptimizer` or
            not (optional).
        **kwargs: More modules, optimizers and samplers, and attributes as
            for `ObjectState` (`epoch=0, batch=0`).

    Example:

    ```python
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)
    ```
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        objects = {"model": model, "optimizer": optimizer, **kwargs}
        handled = {name: value for name, value in objects.items() if _kind(value) is not None}
        attributes = {name: value for name, value in kwargs.items() if name not in handled}
        kept = {name: _Kept(value) for name, value in handled.items()}
        object.__setattr__(self, "_objects", kept)
        for name, kept in self._objects.items():
            object.__setattr__(self, name, kept.value)
        super().__init__(**attributes)

    def __setattr__(self, name, value):
        kept = self.__dict__.get("_objects", {}).get(name)
        if kept is not None:
            kept.replace(value)
        super().__setattr__(name, value)

    def save(self):
        """Copies the state dicts into host memory, and saves the attributes."""
        for kept in self._objects.values():
            kept.save()
        super().save()

    def restore(self):
        """Loads the state dicts and attributes of the last save or commit."""
        for kept in self._objects.values():
            kept.restore()
        super().restore()

    def sync(self):
        """Gives every rank rank 0's models, optimizers, samplers and attributes. Collective."""
        for kept in self._objects.values():
            kept.sync()
        super().sync()


def _kind(value):
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, ElasticSampler):
        return "sampler"
    return None


class _Kept:
    """One module, optimizer or sampler of a `TorchState`, and its saved state dict."""

    def __init__(self, value):
        self.value = value
        self.kind = _kind(value)
        self.save()

    def replace(self, value):
        if _kind(value) != self.kind:
            raise TypeError(f"keras-ring: TorchState keeps a {self.kind} here; it cannot keep "
                            f"{type(value).__name__} in its place. Received: {value!r}")
        self.value = value

    def save(self):
        # A deep copy: the saved tensors do not follow the model's in-place updates.
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        if self.kind == "optimizer":
            _optimizer.end_lost_allreduces(self.value)
        self.value.load_state_dict(self.saved)

    def sync(self):
        if self.kind == "module":
            _functions.broadcast_parameters(self.value.state_dict(), root_rank=0)
        elif self.kind == "optimizer":
            _functions.broadcast_optimizer_state(self.value, root_rank=0)
        else:
            # Rank 0's epoch, with the indices every rank in that epoch recorded
            # (record_indices keeps a rank's own); `reset` shards what is left over
            # the new world.
            every = _objects.allgather_object(self.value.state_dict(),
                                              name="keras_ring.elastic.sync.sampler")
            epoch = every[0]["epoch"]
            processed = set().union(*(s["processed_indices"] for s in every if s["epoch"] == epoch))
            self.value.load_state_dict({"epoch": epoch, "processed_indices": processed})
        self.save()
