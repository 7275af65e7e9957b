"""Horovod's `DistributedOptimizer` for PyTorch: gradients reduced as the backward pass makes them.

`DistributedOptimizer(optimizer, ...)` returns the same optimizer, now of a
subclass of its own class that adds the reduction: a hook on each parameter
(`register_post_accumulate_grad_hook`) starts that gradient's allreduce, in
place, the moment autograd has accumulated it, so communication overlaps the
rest of the backward pass; `step()` waits for them all and then takes the
wrapped optimizer's step. The engine matches gradients across ranks by name,
so the order in which the hooks fire may differ from rank to rank.

The wrapped optimizer keeps its own state, hyperparameters and hooks (the
subclass takes them over as they are): an optimizer whose state was loaded or
broadcast before it was wrapped keeps it.
"""

import contextlib
import warnings

import torch

from keras_ring.core import _compression, _errors, _objects
from keras_ring.core._collective_args import reduce_args
from keras_ring.core._process_sets import global_process_set, process_set_id
from keras_ring.core._reduce_ops import Average
from keras_ring.torch import _ops


class _Reducing:
    """What `DistributedOptimizer` adds to the class of the optimizer it wraps."""

    def _kr_setup(self, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set):
        self._kr_names = _parameter_names(self.param_groups, named_parameters)
        self._kr_compression = compression
        self._kr_op = op
        self._kr_prescale, self._kr_postscale = (
            (1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == Average
            else (1.0, 1.0))
        self._kr_sparse_as_dense = sparse_as_dense
        self._kr_process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._kr_params = [p for group in self.param_groups for p in group["params"]
                           if p.requires_grad]
        self._kr_delay = {p: backward_passes_per_step for p in self._kr_params}
        self._kr_pending = {}  # a parameter, or a group's tuple -> a function that finishes it
        self._kr_ready = {}    # a group's tuple -> its parameters whose gradients are ready
        self._kr_synchronized = False
        self._kr_should_synchronize = True
        self._kr_hooks = []
        self._kr_group_of = {}
        if not process_set.included():
            return
        for group in _parameter_groups(self._kr_params, groups, self._kr_names, process_set):
            for p in group:
                self._kr_group_of[p] = group if len(group) > 1 else None
        for p in self._kr_params:
            self._kr_hooks.append(p.register_post_accumulate_grad_hook(self._kr_on_gradient))

    # --- the hooks ----------------------------------------------------------------------

    def _kr_on_gradient(self, p):
        if self._kr_delay[p] <= 0:
            raise AssertionError(
                f"keras-ring: the gradient of {self._kr_names[p]!r} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "optimizer.step() or optimizer.synchronize(). Raise backward_passes_per_step "
                "to accumulate gradients locally over several backward passes."
            )
        self._kr_delay[p] -= 1
        if self._kr_delay[p] > 0:
            return
        group = self._kr_group_of[p]
        if group is None:
            self._kr_pending[p] = self._kr_start([p])
            return
        ready = self._kr_ready.setdefault(group, set())
        ready.add(p)
        if len(ready) == len(group):
            del self._kr_ready[group]
            self._kr_pending[group] = self._kr_start(list(group))

    def _kr_start(self, params):
        """Starts the allreduce of the parameters' gradients; returns what finishes it."""
        for p in params:
            if p.grad is None:
                # Unused in this rank's forward pass; another rank may have used it.
                p.grad = torch.zeros_like(p)
        sparse = [p for p in params if p.grad.is_sparse and not self._kr_sparse_as_dense]
        if sparse:
            if len(params) > 1:
                raise ValueError(
                    "keras-ring: a sparse gradient cannot be reduced in a group; pass "
                    "sparse_as_dense=True or leave its parameter "
                    f"({self._kr_names[sparse[0]]!r}) out of `groups`.")
            return self._kr_start_sparse(params[0])
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
        name = self._kr_names[params[0]]
        wait = _ops.allreduce_gradients_async(
            grads, name, self._kr_op, self._kr_prescale, self._kr_postscale,
            process_set_id(self._kr_process_set), self._kr_compression)

        def finish():
            for p, reduced in zip(params, wait()):
                if p.grad.is_sparse:
                    p.grad.zero_().add_(reduced.to_sparse())
                elif reduced is not p.grad:
                    p.grad.copy_(reduced)
        return finish

    def _kr_start_sparse(self, p):
        wait = _ops.sparse_allreduce_async(p.grad, self._kr_names[p], self._kr_op,
                                           self._kr_process_set)

        def finish():
            p.grad.zero_().add_(wait())
        return finish

    # --- Horovod's API ------------------------------------------------------------------

    def synchronize(self):
        """Waits for every gradient's allreduce; starts those no hook has started.

        A parameter whose gradient this rank did not compute (unused in its
        forward pass) is reduced as zeros, as other ranks may have computed
        it. After `synchronize()`, take the step inside `skip_synchronize()`.
        """
        if not self._kr_process_set.included():
            self._kr_synchronized = True
            return
        started = set()
        for key in self._kr_pending:
            started.update(key if isinstance(key, tuple) else (key,))
        for p in self._kr_params:
            if p in started:
                continue
            group = self._kr_group_of[p]
            if group is None:
                self._kr_pending[p] = self._kr_start([p])
            elif group not in self._kr_pending:
                self._kr_ready.pop(group, None)
                self._kr_pending[group] = self._kr_start(list(group))
                started.update(group)
        try:
            for finish in self._kr_pending.values():
                finish()
        finally:
            self._kr_pending.clear()
            self._kr_ready.clear()
            for p in self._kr_delay:
                self._kr_delay[p] = self.backward_passes_per_step
        self._kr_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """A context in which `step()` does not synchronize (after an explicit `synchronize()`).

        ```python
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # on the reduced gradients
        with optimizer.skip_synchronize():
            optimizer.step()
        ```
        """
        self._kr_should_synchronize = False
        try:
            yield
        finally:
            self._kr_should_synchronize = True

    def step(self, closure=None):
        """Waits for the gradients' allreduces, then takes the wrapped optimizer's step."""
        if self._kr_should_synchronize:
            if self._kr_synchronized:
                # Horovod's words first: filters of its warning by message match it too.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize() (keras-ring): the gradients are reduced a second "
                    "time, which costs another allreduce (and with op=Sum multiplies them by the "
                    "number of ranks). Take the step inside `with optimizer.skip_synchronize():` "
                    "after calling synchronize().", stacklevel=2)
            self.synchronize()
        self._kr_synchronized = False
        return super().step(closure)

    # The wrapped class's `step` runs the optimizer's step hooks (torch wraps it
    # once per class); this one must not run them a second time.
    step.hooked = True

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's `zero_grad`; refused while allreduces are in flight."""
        if self._kr_pending:
            raise AssertionError(
                "keras-ring: optimizer.zero_grad() was called after loss.backward() and before "
                "optimizer.step() or optimizer.synchronize(), while gradients' allreduces are "
                "writing into them. Call zero_grad() before the backward pass or after step().")
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes):
        """Sets how many backward passes `step()` follows; restarts the count."""
        _check_passes(passes)
        self.backward_passes_per_step = passes
        for p in self._kr_delay:
            self._kr_delay[p] = passes

    def load_state_dict(self, state_dict):
        """The wrapped optimizer's `load_state_dict`; restarts the pass count."""
        if self._kr_pending:
            raise AssertionError("keras-ring: optimizer.load_state_dict() while gradients' "
                                 "allreduces are in flight; call it before the backward pass.")
        self._kr_synchronized = False
        for p in self._kr_delay:
            self._kr_delay[p] = self.backward_passes_per_step
        return super().load_state_dict(state_dict)

    def _kr_end_lost(self):
        """Waits out the allreduces in flight of a world a lost worker ended; restarts the count."""
        try:
            for finish in self._kr_pending.values():
                try:
                    finish()
                except Exception as error:  # noqa: BLE001 -- the lost world's errors end here
                    if _errors.worker_lost(error) is None:
                        raise
        finally:
            self._kr_pending.clear()
            self._kr_ready.clear()
            self._kr_synchronized = False
            for p in self._kr_delay:
                self._kr_delay[p] = self.backward_passes_per_step


def end_lost_allreduces(optimizer):
    """Has a `DistributedOptimizer` drop what a lost worker left in flight (an elastic reset).

    Its gradients' allreduces of the step the loss interrupted end with the
    world's error; the next backward pass starts afresh. Other optimizers
    have nothing in flight.
    """
    if isinstance(optimizer, _Reducing):
        optimizer._kr_end_lost()


def _parameter_names(param_groups, named_parameters):
    """The collective name of each parameter the optimizer updates, checked."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named_parameters = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
               for item in named_parameters):
        raise ValueError(
            "keras-ring: named_parameters must be a sequence of (name, parameter) tuples, as "
            "model.named_parameters() gives. Received: "
            f"{[type(item).__name__ for item in named_parameters[:3]]}...")
    seen, duplicates = set(), []
    for name, _ in named_parameters:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError("keras-ring: parameter names in named_parameters must be unique: "
                         f"the collectives are matched across ranks by them. Found twice: "
                         f"{', '.join(duplicates)}")
    names = {p: name for name, p in named_parameters}
    unnamed = [p for p in params if p not in names]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError(
            f"keras-ring: named_parameters leaves out {len(unnamed)} of the optimizer's "
            f"{len(params)} parameters (shapes {shapes}): every parameter needs a name, the "
            "same on every rank. Pass model.named_parameters() of the model whose parameters "
            "the optimizer updates.")
    return names


def _parameter_groups(params, groups, names, process_set):
    """The parameters' reduction groups: each reduced as one grouped allreduce.

    `groups` is None (one allreduce per gradient), a number of groups to split
    the parameters into (in rank 0's order, so that every rank forms the same
    groups), or lists of parameters (each list a group; the rest alone).
    """
    if groups is None:
        return [(p,) for p in params]
    if isinstance(groups, int):
        order = _objects.broadcast_object([names[p] for p in params], root_rank=0,
                                      process_set=process_set)
        position = {name: i for i, name in enumerate(order)}
        ordered = sorted(params, key=lambda p: position.get(names[p], len(position)))
        count = min(groups, len(ordered))
        return [tuple(ordered[i * len(ordered) // count:(i + 1) * len(ordered) // count])
                for i in range(count)]
    wanted = {id(p) for p in params}
    result, grouped = [], set()
    for group in groups:
        members = tuple(p for p in group if id(p) in wanted)
        grouped.update(id(p) for p in members)
        if members:
            result.append(members)
    return result + [(p,) for p in params if id(p) not in grouped]


def _check_passes(passes):
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError("keras-ring: backward_passes_per_step must be a positive integer. "
                         f"Received: {passes!r}")


def _check_groups(groups):
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError("keras-ring: groups must be a positive integer or a list of lists of "
                         f"parameters. Received: {groups!r}")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("keras-ring: groups must hold lists of parameters "
                                     f"(torch.Tensor). Received: {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("keras-ring: a parameter appears twice in groups.")
                seen.add(id(p))


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=_compression.Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps a `torch.optim.Optimizer` so that `step()` applies gradients averaged over ranks.

    Each gradient's allreduce starts from an autograd hook as soon as the
    backward pass has produced it; `step()` waits for them and takes the
    wrapped optimizer's step. Call `optimizer.synchronize()` to have the
    reduced gradients before the step (to clip them), then step inside
    `with optimizer.skip_synchronize():`.

    Args:
        optimizer: The `torch.optim.Optimizer` to wrap. It is taken over, with
            its state and hyperparameters: use the returned one.
        named_parameters: `model.named_parameters()`: the names match the
            gradients across ranks (and show in the timeline). Every
            parameter of the optimizer needs one, unique. Without it, names
            come from the parameters' positions in the optimizer's groups.
        compression: `Compression.none`, `fp16` or `bf16` (the gradients
            travel in that type), or a `Compressor`.
        backward_passes_per_step: Backward passes between steps: the
            gradients accumulate locally (as torch does) and are reduced after
            the last pass.
        op: `Average` (the default) or `Sum`.
        gradient_predivide_factor: With `Average`, gradients are multiplied
            by `1 / factor` before the sum and by `factor / size` after it.
        num_groups: Deprecated: `groups`.
        groups: A number of groups, or lists of parameters: the gradients of a
            group are reduced as one grouped allreduce once all are ready.
        sparse_as_dense: Reduce sparse gradients (an `Embedding(sparse=True)`)
            as dense tensors; otherwise their rows are gathered.
        process_set: Reduce among this `ProcessSet`'s ranks only.

    Returns:
        The optimizer, now reducing its gradients.

    Raises:
        ValueError: For named parameters that leave one out or name one
            twice, and for bad `groups`, `backward_passes_per_step` or
            `gradient_predivide_factor`.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("keras_ring.torch.DistributedOptimizer wraps a torch.optim.Optimizer. "
                        f"Received: {type(optimizer).__name__}")
    if isinstance(optimizer, _Reducing):
        raise ValueError("keras_ring.torch.DistributedOptimizer: this optimizer is already a "
                         "DistributedOptimizer; wrap the plain optimizer once.")
    op, compressor, _, _ = reduce_args(op, None, compression, 1.0, 1.0)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("keras-ring: gradient_predivide_factor needs op=Average. Received: "
                         f"gradient_predivide_factor={gradient_predivide_factor}")
    if not gradient_predivide_factor > 0:
        raise ValueError("keras-ring: gradient_predivide_factor must be positive. Received: "
                         f"{gradient_predivide_factor}")
    if num_groups:
        warnings.warn("keras-ring: num_groups is deprecated; pass groups=", DeprecationWarning,
                      stacklevel=2)
        groups = num_groups if groups is None else groups
    _check_passes(backward_passes_per_step)
    _check_groups(groups)
    cls = type(type(optimizer).__name__, (_Reducing, type(optimizer)),
               {"__module__": type(optimizer).__module__})
    wrapped = cls.__new__(cls)
    # An instance-level `step` is a wrapper an LR scheduler bound to the old object.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._kr_setup(named_parameters, compressor, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped
