"""Horovod's PyTorch collectives (`horovod.torch`) on CPU tensors, over the engine.

Every collective is a torch operator, `torch.ops.keras_ring.<name>`, defined
with `torch.library`: differentiable (`register_autograd`), with the same
gradient conventions as the TF ops and `keras_ring.jax`, and opaque to
`torch.compile`, whose fake kernels give the results' shapes. Its CPU kernel
hands the engine NumPy views of the tensors, so the engine reads the inputs
and writes allreduce and broadcast results where torch keeps them, and the
other collectives' results become tensors without a copy. Where neither
autograd nor `torch.compile` is involved the kernel is called directly: the
dispatcher's round trip through Python costs more than a small collective.

The `_async` forms hand the collective to the engine's thread and return a
handle at once: `synchronize(handle)` waits and returns the result,
`poll(handle)` says whether it has finished. The forms ending in `_` write
the result into their input.
"""

import collections
import itertools

import torch

from keras_ring.core import _basics, _compression, _objects
from keras_ring.core._collective_args import reduce_args
from keras_ring.core._process_sets import global_process_set, process_set_id, root_index
from keras_ring.core._reduce_ops import NAMES as _REDUCE_OP_NAMES
from keras_ring.core._reduce_ops import Average, Sum

_REDUCED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                   torch.uint8, torch.int32, torch.int64)
# Moved unchanged by allgather, broadcast and alltoall; reductions refuse them.
_MOVED_DTYPES = (torch.int16, torch.uint16, torch.bool)
# The engine's codes (kr_dtype), by the torch dtype they hold.
_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3, torch.int8: 4,
          torch.uint8: 5, torch.int32: 6, torch.int64: 7, torch.int16: 8, torch.uint16: 9,
          torch.bool: 10}
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

# Unnamed collectives: Python calls on one rank run in program order, so a
# counter gives every rank the same sequence of names; one counter per process
# set, as only its members call its collectives.
_unnamed = collections.defaultdict(itertools.count)


def _name(name, kind, set_id):
    if name is None:
        return f"{kind}.noname.{next(_unnamed[set_id])}"
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string or None. Received: name={name!r}")
    return name


def _checked(tensor, api, reduces=False):
    """`tensor` as the engine takes it: a dense, contiguous CPU tensor of a dtype it knows."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"keras_ring.torch.{api} takes a torch.Tensor. "
                        f"Received: {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"keras_ring.torch.{api} takes CPU tensors only: the engine does not reach GPUs "
            f"yet. Received: a tensor on {tensor.device}; move it with tensor.cpu()"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"keras_ring.torch.{api} takes dense tensors. Received: layout "
                         f"{tensor.layout} (sparse gradients: sparse_allreduce_async)")
    if tensor.dtype in _REDUCED_DTYPES or (tensor.dtype in _MOVED_DTYPES and not reduces):
        return tensor.contiguous()
    reduced = ", ".join(str(d).removeprefix("torch.") for d in _REDUCED_DTYPES)
    moved = ", ".join(str(d).removeprefix("torch.") for d in _MOVED_DTYPES)
    if tensor.dtype in _MOVED_DTYPES:
        why = (f"reductions take {reduced}; {moved} only allgather, broadcast and alltoall "
               "(which move them unchanged)")
    else:
        why = f"supported: {reduced} and, by allgather, broadcast and alltoall only, {moved}"
    raise TypeError(f"keras_ring.torch.{api} does not support dtype "
                    f"{str(tensor.dtype).removeprefix('torch.')}: {why}")


def _refuse_scalars(tensors, api, why):
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"keras_ring.torch.{api} needs tensors of at least one dimension, "
                         f"{why}. Received: a scalar")


def _view(tensor):
    """A NumPy view of a contiguous CPU tensor's memory (bfloat16 as int16)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _tensor(array, dtype):
    """A tensor over a NumPy array the engine returned (no copy)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _engine():
    return _basics._engine()


def _start(collective, tensors, names, outputs=None, group="", **args):
    """Hands the collective of each tensor to the engine; returns its handle."""
    engine = _engine()
    return engine.submit(
        collective, [_view(t) for t in tensors], names, group=group,
        dtypes=[_CODES[t.dtype] for t in tensors],
        outputs=None if outputs is None else [_view(o) for o in outputs], **args)


def _run(collective, tensors, names, outputs=None, group="", **args):
    """Runs the collective of each tensor, this thread driving the engine meanwhile."""
    engine = _engine()
    try:
        return engine.run(
            collective, [_view(t) for t in tensors], names, group=group,
            dtypes=[_CODES[t.dtype] for t in tensors],
            outputs=None if outputs is None else [_view(o) for o in outputs], **args)
    except ValueError as e:
        raise _as_runtime_error(e) from None


def _as_runtime_error(error):
    # The engine says ValueError for a bad or mismatched request; torch ops (and
    # Horovod's) raise RuntimeError.
    return RuntimeError(str(error)) if type(error) is ValueError else error


# --- the operators' kernels: positional arguments, engine codes --------------------------


def _allreduce_kernel(tensors, name, op, prescale, postscale, process_set, compression,
                      outputs=None):
    outputs = [torch.empty_like(t) for t in tensors] if outputs is None else outputs
    if tensors:
        engine = _engine()
        names = [name] if len(tensors) == 1 else [f"{name}.{i}" for i in range(len(tensors))]
        _run(engine.ALLREDUCE, tensors, names, outputs=outputs, op=op, prescale_factor=prescale,
             postscale_factor=postscale, process_set=process_set, compression=compression,
             group=name if len(tensors) > 1 else "")
    return outputs


def _allgather_kernel(tensors, name, process_set):
    engine = _engine()
    names = [name] if len(tensors) == 1 else [f"{name}.{i}" for i in range(len(tensors))]
    results = _run(engine.ALLGATHER, tensors, names, process_set=process_set)
    return [_tensor(r, t.dtype) for r, t in zip(results, tensors)]


def _broadcast_kernel(tensor, root, name, process_set, output=None):
    output = torch.empty_like(tensor) if output is None else output
    engine = _engine()
    _run(engine.BROADCAST, [tensor], [name], outputs=[output], root_rank=root,
         process_set=process_set)
    return output


def _reducescatter_kernel(tensors, name, op, prescale, postscale, process_set, compression):
    engine = _engine()
    names = [name] if len(tensors) == 1 else [f"{name}.{i}" for i in range(len(tensors))]
    results = _run(engine.REDUCESCATTER, tensors, names, op=op, prescale_factor=prescale,
                   postscale_factor=postscale, process_set=process_set, compression=compression)
    return [_tensor(r, t.dtype) for r, t in zip(results, tensors)]


def _alltoall_kernel(tensor, splits, name, process_set):
    engine = _engine()
    handle = engine.submit(engine.ALLTOALL, _view(tensor), name, dtypes=[_CODES[tensor.dtype]],
                           splits=[int(s) for s in splits], process_set=process_set)
    try:
        output = _tensor(handle.wait(), tensor.dtype)
    except ValueError as e:
        raise _as_runtime_error(e) from None
    return output, torch.tensor(handle.received_splits(), dtype=torch.int32)


_LIB = torch.library.Library("keras_ring", "DEF")
_REDUCTION_ARGS = "str name, int op, float prescale, float postscale, int process_set, " \
                  "int compression"
_LIB.define(f"allreduce(Tensor tensor, {_REDUCTION_ARGS}) -> Tensor")
_LIB.define(f"grouped_allreduce(Tensor[] tensors, {_REDUCTION_ARGS}) -> Tensor[]")
_LIB.define("allgather(Tensor tensor, str name, int process_set) -> Tensor")
_LIB.define("grouped_allgather(Tensor[] tensors, str name, int process_set) -> Tensor[]")
_LIB.define("broadcast(Tensor tensor, int root, str name, int process_set) -> Tensor")
_LIB.define(f"reducescatter(Tensor tensor, {_REDUCTION_ARGS}) -> Tensor")
_LIB.define(f"grouped_reducescatter(Tensor[] tensors, {_REDUCTION_ARGS}) -> Tensor[]")
_LIB.define("alltoall(Tensor tensor, int[] splits, str name, int process_set) "
            "-> (Tensor, Tensor)")

_KERNELS = {
    "allreduce": lambda tensor, *args: _allreduce_kernel([tensor], *args)[0],
    "grouped_allreduce": lambda tensors, *args: _allreduce_kernel(list(tensors), *args),
    "allgather": lambda tensor, *args: _allgather_kernel([tensor], *args)[0],
    "grouped_allgather": lambda tensors, *args: _allgather_kernel(list(tensors), *args),
    "broadcast": _broadcast_kernel,
    "reducescatter": lambda tensor, *args: _reducescatter_kernel([tensor], *args)[0],
    "grouped_reducescatter": lambda tensors, *args: _reducescatter_kernel(list(tensors), *args),
    "alltoall": _alltoall_kernel,
}
for _op, _kernel in _KERNELS.items():
    _LIB.impl(_op, _kernel, "CPU")


def _set_size_and_rank(set_id):
    ranks = _engine().process_set_ranks(set_id)
    return len(ranks), ranks.index(_basics.rank())


def _scattered_rows(rows, size, index):
    """The rows of a reducescatter result on the set's `index`-th rank (Horovod's split)."""
    return rows // size + (1 if index < rows % size else 0)


def _fake_gathered(tensor):
    rows = torch.library.get_ctx().new_dynamic_size()
    return tensor.new_empty((rows, *tensor.shape[1:]))


def _fake_scattered(tensor, process_set):
    size, index = _set_size_and_rank(process_set)
    return tensor.new_empty((_scattered_rows(tensor.shape[0], size, index), *tensor.shape[1:]))


_FAKES = {
    "allreduce": lambda tensor, *args: torch.empty_like(tensor),
    "grouped_allreduce": lambda tensors, *args: [torch.empty_like(t) for t in tensors],
    "allgather": lambda tensor, *args: _fake_gathered(tensor),
    "grouped_allgather": lambda tensors, *args: [_fake_gathered(t) for t in tensors],
    "broadcast": lambda tensor, *args: torch.empty_like(tensor),
    "reducescatter": lambda tensor, name, op, pre, post, ps, comp: _fake_scattered(tensor, ps),
    "grouped_reducescatter": lambda tensors, name, op, pre, post, ps, comp: [
        _fake_scattered(t, ps) for t in tensors],
    "alltoall": lambda tensor, splits, name, ps: (
        _fake_gathered(tensor), tensor.new_empty((len(splits),), dtype=torch.int32)),
}
for _op, _fake in _FAKES.items():
    torch.library.register_fake(f"keras_ring::{_op}", _fake, lib=_LIB)


# --- gradients, as the TF ops' ------------------------------------------------------------


def _differentiable_op(op):
    if op not in (Average, Sum):
        raise LookupError(
            f"No gradient is defined for keras_ring.torch collectives with "
            f"op={_REDUCE_OP_NAMES.get(op, op)}; only Sum and Average are differentiable."
        )


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.rows = [t.shape[0] if t.dim() else 1 for t in
                (inputs[0] if isinstance(inputs[0], (list, tuple)) else [inputs[0]])]


def _allreduce_grad(ctx, grad):
    name, op, pre, post, ps, comp = ctx.args
    _differentiable_op(op)
    return (torch.ops.keras_ring.allreduce(grad.contiguous(), f"{name}.grad", op, pre, post, ps,
                                           comp), *[None] * 6)


def _grouped_allreduce_grad(ctx, grads):
    name, op, pre, post, ps, comp = ctx.args
    _differentiable_op(op)
    return (torch.ops.keras_ring.grouped_allreduce([g.contiguous() for g in grads],
                                                   f"{name}.grad", op, pre, post, ps, comp),
            *[None] * 6)


def _own_rows(grads, name, ps, rows):
    """This rank's rows of the summed gradients of a gather (its rows feed every rank's output)."""
    summed = torch.ops.keras_ring.grouped_allreduce(
        [g.contiguous() for g in grads], f"{name}.grad", Sum, 1.0, 1.0, ps, 0)
    size, index = _set_size_and_rank(ps)
    every = torch.ops.keras_ring.allgather(torch.tensor(rows, dtype=torch.int64),
                                           f"{name}.grad.rows", ps).view(size, len(rows))
    starts = every[:index].sum(dim=0).tolist()
    return [s.narrow(0, start, count) for s, start, count in zip(summed, starts, rows)]


def _allgather_grad(ctx, grad):
    name, ps = ctx.args
    return _own_rows([grad], name, ps, ctx.rows)[0], None, None


def _grouped_allgather_grad(ctx, grads):
    name, ps = ctx.args
    return _own_rows(grads, name, ps, ctx.rows), None, None


def _broadcast_grad(ctx, grad):
    # Only the root's input reaches the outputs.
    root, name, ps = ctx.args
    summed = torch.ops.keras_ring.allreduce(grad.contiguous(), f"{name}.grad", Sum, 1.0, 1.0, ps,
                                            0)
    _, index = _set_size_and_rank(ps)
    return (summed if index == root else torch.zeros_like(summed)), None, None, None


def _scattered_grads(grads, name, op, pre, post, ps):
    # Every rank's output rows are a linear map of every rank's input: gather
    # every rank's output gradient, times the map's factor.
    _differentiable_op(op)
    scale = pre * post / (_set_size_and_rank(ps)[0] if op == Average else 1)
    gathered = torch.ops.keras_ring.grouped_allgather([g.contiguous() for g in grads],
                                                      f"{name}.grad", ps)
    return [g * scale if scale != 1.0 else g for g in gathered]


def _reducescatter_grad(ctx, grad):
    name, op, pre, post, ps, _ = ctx.args
    return _scattered_grads([grad], name, op, pre, post, ps)[0], *[None] * 6


def _grouped_reducescatter_grad(ctx, grads):
    name, op, pre, post, ps, _ = ctx.args
    return _scattered_grads(grads, name, op, pre, post, ps), *[None] * 6


def _keep_alltoall(ctx, inputs, output):
    ctx.args = inputs[2:]
    ctx.received = output[1].tolist()


def _alltoall_grad(ctx, grad, _):
    # Each output row goes back to the rank it came from.
    name, ps = ctx.args
    back, _ = torch.ops.keras_ring.alltoall(grad.contiguous(), ctx.received, f"{name}.grad", ps)
    return back, None, None, None


for _op, _grad in {"allreduce": _allreduce_grad, "grouped_allreduce": _grouped_allreduce_grad,
                   "allgather": _allgather_grad, "grouped_allgather": _grouped_allgather_grad,
                   "broadcast": _broadcast_grad, "reducescatter": _reducescatter_grad,
                   "grouped_reducescatter": _grouped_reducescatter_grad}.items():
    torch.library.register_autograd(f"keras_ring::{_op}", _grad, setup_context=_keep_args,
                                    lib=_LIB)
torch.library.register_autograd("keras_ring::alltoall", _alltoall_grad,
                                setup_context=_keep_alltoall, lib=_LIB)


def _call(op, tensors, *args):
    """`torch.ops.keras_ring.<op>(...)`, or its kernel where the dispatcher adds nothing."""
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        first = tensors if op.startswith("grouped_") else tensors[0]
        return getattr(torch.ops.keras_ring, op)(first, *args)
    return _KERNELS[op](tensors if op.startswith("grouped_") else tensors[0], *args)


# --- compression ------------------------------------------------------------------------


def _compress(compressor, tensor):
    """(tensor to send, context to decompress with); the engine converts float32 and float64."""
    code = _compression.ENGINE_CODES.get(compressor)
    if code is not None:
        if tensor.dtype in (torch.float32, torch.float64):
            return tensor, None
        wire = _WIRE_DTYPES[compressor.wire_dtype]
        if tensor.dtype in _FLOATING and tensor.dtype != wire:
            return tensor.to(wire), tensor.dtype
        return tensor, None
    if compressor is _compression.NoneCompressor:
        return tensor, None
    return compressor.compress(tensor)


def _decompress(compressor, tensor, ctx):
    if compressor in _compression.ENGINE_CODES or compressor is _compression.NoneCompressor:
        return tensor if ctx is None else tensor.to(ctx)
    return compressor.decompress(tensor, ctx)


def _reduction(api, op, average, compression, prescale_factor, postscale_factor):
    op, compressor, pre, post = reduce_args(op, average, compression, prescale_factor,
                                            postscale_factor)
    return op, compressor, _compression.ENGINE_CODES.get(compressor, 0), pre, post


# --- Horovod's API ----------------------------------------------------------------------


def allreduce(tensor, average=None, name=None, compression=_compression.Compression.none,
              op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set):
    """Reduces a tensor over all ranks; every rank receives the result.

    The tensor must have the same shape and dtype on every rank. The input is
    not modified.

    Args:
        tensor: A CPU tensor.
        average: Deprecated; `True` means `op=Average`, `False` `op=Sum`.
        name: The name that matches this collective across ranks.
        compression: `keras_ring.torch.Compression.none`, `fp16` or `bf16`
            (floating-point tensors travel in that type), or a `Compressor`.
        op: `Average` (the default), `Sum`, `Min`, `Max` or `Product`.
        prescale_factor: Multiplies each rank's input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        process_set: Run among this `ProcessSet`'s ranks only.

    Returns:
        A tensor of the same shape and dtype. Differentiable for `Average`
        and `Sum`: the gradient is the same reduction of the gradients.

    Example:

    ```python
    import keras_ring.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum)  # 2 ranks: [2., 2., 2.]
    ```
    """
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set, api="allreduce")[0]


def grouped_allreduce(tensors, average=None, name=None, compression=_compression.Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, api="grouped_allreduce"):
    """Reduces a list of tensors as one group: agreed once, fused into few transfers.

    Every rank passes the same number of tensors, in the same order, with the
    same shapes and dtypes. Arguments as `allreduce`'s.

    Returns:
        The reduced tensors, in order.
    """
    _basics._require_initialized(f"{api}()")
    op, compressor, code, pre, post = _reduction(api, op, average, compression,
                                                 prescale_factor, postscale_factor)
    tensors = [_checked(t, api, reduces=True) for t in tensors]
    compressed = [_compress(compressor, t) for t in tensors]
    sent = [c for c, _ in compressed]
    set_id = process_set_id(process_set)
    args = (_name(name, api, set_id), op, pre, post, set_id, code)
    if len(sent) == 1:
        outputs = [_call("allreduce", sent, *args)]
    else:
        outputs = _call("grouped_allreduce", sent, *args) if sent else []
    return [_decompress(compressor, o, ctx) for o, (_, ctx) in zip(outputs, compressed)]


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """`allreduce` into the tensor itself (which must be contiguous); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """`grouped_allreduce` into the tensors themselves; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's tensor along the first dimension, in rank order.

    The first dimension may differ between ranks; the others and the dtype
    must agree.

    Returns:
        The gathered tensor. Differentiable: a rank's gradient is the sum of
        every rank's gradient for its rows.
    """
    return grouped_allgather([tensor], name, process_set, api="allgather")[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set,
                      api="grouped_allgather"):
    """`allgather` of each tensor, agreed and run together."""
    _basics._require_initialized(f"{api}()")
    tensors = [_checked(t, api) for t in tensors]
    _refuse_scalars(tensors, api, "to concatenate")
    set_id = process_set_id(process_set)
    args = (_name(name, api, set_id), set_id)
    if len(tensors) == 1:
        return [_call("allgather", tensors, *args)]
    return _call("grouped_allgather", tensors, *args) if tensors else []


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Every rank receives `root_rank`'s tensor (same shape and dtype everywhere).

    Returns:
        The root's tensor; the input is not modified. Differentiable: the
        root's gradient is the sum of every rank's gradient, the others' zero.
    """
    _basics._require_initialized("broadcast()")
    tensor = _checked(tensor, "broadcast")
    return _call("broadcast", [tensor], root_index(process_set, root_rank),
                 _name(name, "broadcast", process_set_id(process_set)),
                 process_set_id(process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """`broadcast` into the tensor itself (which must be contiguous); returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def reducescatter(tensor, name=None, compression=_compression.Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces a tensor over the ranks; each rank keeps a slice of the first dimension.

    Rank r of n receives rows [start_r, start_r + rows_r) of the reduction:
    the first d % n ranks get d // n + 1 rows, the others d // n.

    Returns:
        This rank's rows. Differentiable for `Average` and `Sum`.
    """
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor, api="reducescatter")[0]


def grouped_reducescatter(tensors, name=None, compression=_compression.Compression.none,
                          op=Average, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, api="grouped_reducescatter"):
    """`reducescatter` of each tensor, agreed and run together."""
    _basics._require_initialized(f"{api}()")
    op, compressor, code, pre, post = _reduction(api, op, None, compression, prescale_factor,
                                                 postscale_factor)
    tensors = [_checked(t, api, reduces=True) for t in tensors]
    _refuse_scalars(tensors, api, "to split among the ranks")
    compressed = [_compress(compressor, t) for t in tensors]
    sent = [c for c, _ in compressed]
    set_id = process_set_id(process_set)
    args = (_name(name, api, set_id), op, pre, post, set_id, code)
    if len(sent) == 1:
        outputs = [_call("reducescatter", sent, *args)]
    else:
        outputs = _call("grouped_reducescatter", sent, *args) if sent else []
    return [_decompress(compressor, o, ctx) for o, (_, ctx) in zip(outputs, compressed)]


def _splits_list(splits, tensor, process_set):
    if splits is None:
        return []
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    size = len(_engine().process_set_ranks(process_set_id(process_set)))
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(
            f"keras_ring.torch.alltoall needs `splits` of {size} non-negative row counts "
            f"summing to the tensor's first dimension ({tensor.shape[0]}). Received: {splits}"
        )
    return splits


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends `splits[j]` rows of the tensor to rank j; receives each rank's rows for this one.

    Without `splits`, the first dimension is split evenly (it must divide by
    the number of ranks).

    Returns:
        The received rows, in rank order, and, where `splits` was given, a
        tensor of the rows received from each rank (Horovod's return).
        Differentiable: each row's gradient goes back to the rank it came from.
    """
    _basics._require_initialized("alltoall()")
    tensor = _checked(tensor, "alltoall")
    output, received = _call("alltoall", [tensor], _splits_list(splits, tensor, process_set),
                             _name(name, "alltoall", process_set_id(process_set)),
                             process_set_id(process_set))
    return output if splits is None else (output, received)


# --- handles ----------------------------------------------------------------------------

_handles = {}
_handle_ids = itertools.count(1)


def _handle(engine_handle, finish, key):
    """A Horovod handle: an int that `synchronize` and `poll` take."""
    handle = next(_handle_ids)
    _handles[handle] = (engine_handle, finish, key)
    return handle


def _pending(handle):
    try:
        return _handles[handle]
    except (KeyError, TypeError):
        raise ValueError(f"keras-ring: {handle!r} is not the handle of a collective in flight "
                         "(synchronize() takes each handle once)") from None


def poll(handle):
    """Whether the collective of `handle` has finished (`synchronize` then returns at once)."""
    return _pending(handle)[0].done()


def synchronize(handle):
    """Waits for the collective of `handle`; returns its result (raises its error)."""
    engine_handle, finish, key = _pending(handle)
    del _handles[handle]
    if _in_flight.get(key) is engine_handle:
        del _in_flight[key]
    try:
        return finish(engine_handle.wait())
    except ValueError as e:
        raise _as_runtime_error(e) from None


# The engine handle of each name in flight, by process set: a name given again
# before its collective ends is refused at the call, as Horovod's are (the
# engine itself would fail the second one only once its thread takes it).
_in_flight = {}


def _async(collective, tensors, name, kind, finish, outputs=None, group=False, **args):
    _basics._require_initialized(f"{kind}()")
    engine = _engine()
    name = _name(name, kind, args.get("process_set", 0))
    key = (args.get("process_set", 0), name)
    previous = _in_flight.get(key)
    if previous is not None and not previous.done():
        raise ValueError(f"keras-ring: {kind}: tensor {name!r} was submitted again while a "
                         "collective of the same name is still in flight on this rank; names "
                         "must be unique among concurrent operations (pass name=...)")
    names = [name] if len(tensors) == 1 else [f"{name}.{i}" for i in range(len(tensors))]
    handle = _start(getattr(engine, collective), tensors, names, outputs=outputs,
                    group=name if group and len(tensors) > 1 else "", **args)
    _in_flight[key] = handle
    return _handle(handle, finish, key)


def _reduction_async(tensors, outputs, kind, average, name, op, prescale_factor,
                     postscale_factor, process_set, finish):
    op, _, _, pre, post = _reduction(kind, op, average, None, prescale_factor, postscale_factor)
    tensors = [_checked(t, kind, reduces=True) for t in tensors]
    outputs = [torch.empty_like(t) for t in tensors] if outputs is None else outputs
    return _async("ALLREDUCE", tensors, name, kind, lambda _: finish(outputs), outputs=outputs,
                  group=True, op=op, prescale_factor=pre, postscale_factor=post,
                  process_set=process_set_id(process_set))


def _in_place(tensors, kind):
    for t in tensors:
        _checked(t, kind)
        if not t.is_contiguous():
            raise ValueError(f"keras_ring.torch.{kind} writes into its input, which must be "
                             "contiguous. Received: a non-contiguous tensor")
    return tensors


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts `allreduce`; returns a handle for `synchronize` (not differentiable)."""
    return _reduction_async([tensor], None, "allreduce", average, name, op, prescale_factor,
                            postscale_factor, process_set, lambda outputs: outputs[0])


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts `allreduce_` (into the tensor); `synchronize` returns the tensor."""
    (tensor,) = _in_place([tensor], "allreduce_")
    return _reduction_async([tensor], [tensor], "allreduce", average, name, op, prescale_factor,
                            postscale_factor, process_set, lambda outputs: outputs[0])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts `grouped_allreduce`; `synchronize` returns the list of results."""
    return _reduction_async(list(tensors), None, "grouped_allreduce", average, name, op,
                            prescale_factor, postscale_factor, process_set, list)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Starts `grouped_allreduce_` (into the tensors); `synchronize` returns them."""
    tensors = _in_place(list(tensors), "grouped_allreduce_")
    return _reduction_async(tensors, tensors, "grouped_allreduce", average, name, op,
                            prescale_factor, postscale_factor, process_set, list)


def _gathered(tensors):
    return lambda results: [_tensor(r, t.dtype) for r, t in zip(results, tensors)]


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts `allgather`; returns a handle for `synchronize`."""
    tensor = _checked(tensor, "allgather")
    return _async("ALLGATHER", [tensor], name, "allgather",
                  lambda results: _gathered([tensor])(results)[0],
                  process_set=process_set_id(process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts `grouped_allgather`; `synchronize` returns the list of results."""
    tensors = [_checked(t, "grouped_allgather") for t in tensors]
    return _async("ALLGATHER", tensors, name, "grouped_allgather", _gathered(tensors),
                  process_set=process_set_id(process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts `broadcast`; returns a handle for `synchronize`."""
    tensor = _checked(tensor, "broadcast")
    output = torch.empty_like(tensor)
    return _async("BROADCAST", [tensor], name, "broadcast", lambda _: output, outputs=[output],
                  root_rank=root_index(process_set, root_rank),
                  process_set=process_set_id(process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts `broadcast_` (into the tensor); `synchronize` returns the tensor."""
    (tensor,) = _in_place([tensor], "broadcast_")
    return _async("BROADCAST", [tensor], name, "broadcast", lambda _: tensor, outputs=[tensor],
                  root_rank=root_index(process_set, root_rank),
                  process_set=process_set_id(process_set))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts `reducescatter`; returns a handle for `synchronize`."""
    return _reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                postscale_factor, "reducescatter", lambda r: r[0])


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts `grouped_reducescatter`; `synchronize` returns the list of results."""
    return _reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                postscale_factor, "grouped_reducescatter", list)


def _reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor,
                         kind, pick):
    op, _, _, pre, post = _reduction(kind, op, None, None, prescale_factor, postscale_factor)
    tensors = [_checked(t, kind, reduces=True) for t in tensors]
    gathered = _gathered(tensors)
    return _async("REDUCESCATTER", tensors, name, kind, lambda results: pick(gathered(results)),
                  op=op, prescale_factor=pre, postscale_factor=post,
                  process_set=process_set_id(process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts `alltoall`; `synchronize` returns what `alltoall` would."""
    tensor = _checked(tensor, "alltoall")
    given = _splits_list(splits, tensor, process_set)
    holder = {}

    def finish(results):
        output = _tensor(results[0], tensor.dtype)
        if splits is None:
            return output
        return output, torch.tensor(holder["handle"].received_splits()[0], dtype=torch.int32)

    handle = _async("ALLTOALL", [tensor], name, "alltoall", finish, splits=given,
                    process_set=process_set_id(process_set))
    holder["handle"] = _handles[handle][0]
    return handle


def allreduce_gradients_async(tensors, name, op, prescale, postscale, set_id, compressor):
    """Starts the allreduce of gradients, as one group, in place where they travel as they are.

    Returns:
        A function that waits and returns the reduced tensors: the inputs
        themselves where no compression or copy came between.
    """
    compressed = [_compress(compressor, _checked(t, "DistributedOptimizer", reduces=True))
                  for t in tensors]
    sent = [c.contiguous() for c, _ in compressed]
    names = [name] if len(sent) == 1 else [f"{name}.{i}" for i in range(len(sent))]
    handle = _start(_engine().ALLREDUCE, sent, names, outputs=sent,
                    group=name if len(sent) > 1 else "", op=op, prescale_factor=prescale,
                    postscale_factor=postscale, process_set=set_id,
                    compression=_compression.ENGINE_CODES.get(compressor, 0))

    def wait():
        try:
            handle.wait()
        except ValueError as e:
            raise _as_runtime_error(e) from None
        return [_decompress(compressor, s, ctx) for s, (_, ctx) in zip(sent, compressed)]

    return wait


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts the reduction of a sparse COO tensor: every rank's entries, gathered.

    Returns:
        A function that waits and returns the sparse sum (divided by the set's
        size for `Average`), Horovod's handle for sparse gradients.
    """
    tensor = tensor.coalesce()
    indices = allgather_async(tensor.indices().t().contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(tensor.values(), name=f"{name}.values", process_set=process_set)

    def wait():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       check_invariants=False)

    return wait


def join(device=-1):
    """This rank has no more data; waits for every rank to join.

    Until then, this rank takes part in the others' allreduces with zeros.

    Returns:
        The rank that joined last.
    """
    del device  # the CPU
    return _objects.join()


def barrier(process_set=global_process_set):
    """Waits until every rank of `process_set` has called `barrier`."""
    _objects.barrier(process_set=process_set)
