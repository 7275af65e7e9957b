"""keras-ring's collectives on `jax.Array`s: an XLA FFI custom call each under a trace.

Inside `jax.jit` (and under any transformation that traces) a collective is
a custom call into the engine (custom_ops/jax/ffi.cc); none goes through a
Python callback. Eagerly, a collective of up to 1 MiB goes to the engine
through its NumPy binding, over the arrays' host buffers, as keras_ring.torch's
ops do: a custom call run eagerly compiles an XLA program for each new shape
(about 20 ms here) and costs twice the binding's call on every later one.
Larger arrays stay custom calls, which write into XLA's buffers where the
binding's results would be copied.

Ranks match collectives by name. Without a `name`, a collective traced inside
`jax.jit` is numbered in the order this process traced it, which is the same
on every rank that traces the same functions; an eager collective waits for
its result before it returns, so eager ones run one at a time and share a
name per kind.

XLA allocates a result before the call runs, so its shape is fixed when it
is traced. Eagerly, allgather and alltoall first learn the other ranks' rows;
inside `jax.jit` every rank must gather the same number of rows, and
alltoall takes only an even split. A rank whose traced shape does not match
what it receives fails with an error that names the tensor and both shapes.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from keras_ring.core import _basics, _compression, _errors
from keras_ring.core._collective_args import reduce_args
from keras_ring.core._process_sets import describe, global_process_set, root_index
from keras_ring.core._reduce_ops import NAMES as _REDUCE_OP_NAMES
from keras_ring.core._reduce_ops import Average, Sum
from keras_ring.jax import _build

# The engine's collectives (kr_collective in c_api.h).
_ALLREDUCE, _ALLGATHER, _BROADCAST, _REDUCESCATTER, _ALLTOALL = 0, 1, 2, 3, 4
_KINDS = {
    _ALLREDUCE: "allreduce", _ALLGATHER: "allgather", _BROADCAST: "broadcast",
    _REDUCESCATTER: "reducescatter", _ALLTOALL: "alltoall",
}
_REDUCED_DTYPES = tuple(
    np.dtype(d) for d in
    ("float16", jnp.bfloat16, "float32", "float64", "int8", "uint8", "int32", "int64")
)
_MOVED_DTYPES = tuple(np.dtype(d) for d in ("int16", "uint16", "bool"))
_FLOAT_DTYPES = _REDUCED_DTYPES[:4]
_ENGINE_COMPRESSION = _compression.ENGINE_CODES

# Names of collectives traced without one: "jax.<kind>.<n>".
_traced = itertools.count()


@dataclasses.dataclass(frozen=True)
class _Call:
    """One custom call's static arguments (hashable: they key JAX's caches)."""

    collective: int
    name: str
    set_id: int
    set_size: int
    set_rank: int
    grouped: bool = False
    reduce_op: int = Average
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    compression: int = 0
    root_rank: int = 0
    # Allgather: every rank's rows, per tensor. Reducescatter: each input's rows.
    rows: tuple = None
    # Alltoall: the rows sent to and received from each rank (None: an even split).
    splits: tuple = None
    received: tuple = None

    def renamed(self, suffix, **changes):
        return dataclasses.replace(self, name=f"{self.name}.{suffix}", **changes)


def _is_traced(values):
    """Whether any value is abstract: traced by `jax.jit` rather than computed.

    Under `jax.grad` alone the values are concrete, and collectives behave
    as eager ones.
    """
    return any(isinstance(v, jax.core.Tracer) and v.to_concrete_value() is None
               for v in values)


def _name(name, kind, traced):
    if name is None:
        return f"jax.{kind}.{next(_traced)}" if traced else f"jax.{kind}"
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string or None. Received: name={name!r}")
    return name


@functools.lru_cache(maxsize=1024)
def _name_bytes(name):
    """The name operand: its UTF-8 bytes, NUL-padded to a multiple of 16 (few shapes)."""
    raw = name.encode()
    padded = np.zeros(-(-(len(raw) + 1) // 16) * 16, np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, np.uint8)
    padded.flags.writeable = False
    return padded


@functools.lru_cache(maxsize=1024)
def _name_on_device(name):
    """`_name_bytes` on the device, once: an eager call with this name transfers nothing."""
    # Made eagerly even where a trace is under way, so that no tracer is kept.
    with jax.ensure_compile_time_eval():
        return jax.device_put(_name_bytes(name), jax.devices("cpu")[0])


def _array(value, api, reduces=False):
    if not isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        raise TypeError(
            f"keras_ring.jax.{api} takes a jax.Array (or a NumPy array). "
            f"Received: {type(value).__name__}"
        )
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        platforms = {d.platform for d in value.devices()}
        if platforms != {"cpu"}:
            raise ValueError(
                f"keras_ring.jax.{api} takes arrays on the CPU only: the engine does not "
                f"reach accelerators yet. Received: an array on {sorted(platforms)}; move it "
                "with jax.device_put(x, jax.devices('cpu')[0])"
            )
        if len(value.devices()) > 1:
            raise ValueError(
                f"keras_ring.jax.{api} takes arrays on one device: keras-ring runs one "
                "process per device (jax.pmap and shard_map over several local devices are "
                f"not supported). Received: an array sharded over {len(value.devices())} devices"
            )
    # An array as it is: jnp.asarray of one is an XLA program, compiled per shape.
    array = value if isinstance(value, jax.Array) else jnp.asarray(value)
    dtype = np.dtype(array.dtype)
    if dtype in _REDUCED_DTYPES or (dtype in _MOVED_DTYPES and not reduces):
        return array
    reduced = ", ".join(d.name for d in _REDUCED_DTYPES)
    moved = ", ".join(d.name for d in _MOVED_DTYPES)
    if dtype in _MOVED_DTYPES:
        why = (f"reductions take {reduced}; {moved} only allgather, broadcast and alltoall "
               "(which move them unchanged)")
    else:
        why = f"it supports {reduced}" + ("" if reduces else f", {moved}")
    raise TypeError(
        f"keras_ring.jax.{api} does not support dtype {dtype.name}: {why}. "
        f"Received: an array with dtype={dtype.name}"
    )


def _array_list(values, api, reduces=False):
    if isinstance(values, (jax.Array, np.ndarray)) or not isinstance(values, (list, tuple)):
        raise TypeError(
            f"keras_ring.jax.{api} takes a list of arrays. Received: {type(values).__name__}"
        )
    return [_array(v, api, reduces) for v in values]


def _raise_from(error):
    """Re-raises a failed custom call as the engine's binding raises its errors."""
    message = str(error)
    code, _, text = message.partition(": ")
    text = text if text.startswith("keras-ring:") else message
    lost = _errors.worker_lost(error)
    if lost is not None:
        raise lost from None
    if code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        raise ValueError(text) from None
    raise RuntimeError(text) from None


def _function(call, outputs):
    """The custom call of `call` as a function of its operands, its attributes bound."""
    function = jax.ffi.ffi_call(
        _build.TARGET, outputs,
        # Every rank must run every call: XLA drops a call whose results are
        # unused, or empty (a reducescatter of fewer rows than ranks), unless
        # it has a side effect, and the other ranks would wait for it.
        has_side_effect=True,
        # Under jax.vmap an allreduce or broadcast of the batched array is
        # the batch of them; the other collectives refuse a batch dimension.
        vmap_method="broadcast_all" if call.collective in (_ALLREDUCE, _BROADCAST) else None,
        # Allreduce and broadcast write over their inputs: where an input is a
        # value of the step (a gradient), XLA needs no new buffer for the result.
        **({"input_output_aliases": {i: i for i in range(len(outputs))}}
           if call.collective in (_ALLREDUCE, _BROADCAST) else {}),
    )
    attributes = dict(
        collective=np.int64(call.collective),
        reduce_op=np.int64(call.reduce_op),
        prescale_factor=np.float64(call.prescale_factor),
        postscale_factor=np.float64(call.postscale_factor),
        compression=np.int64(call.compression),
        root_rank=np.int64(call.root_rank),
        process_set=np.int64(call.set_id),
        grouped=np.int64(call.grouped),
    )
    return lambda *operands: function(*operands, **attributes)


@functools.lru_cache(maxsize=256)
def _eager_function(call, outputs):
    """`_function` compiled once per signature: eager calls then dispatch as fast as jax.jit.

    `call` comes without its name, which is an operand.
    """
    return jax.jit(_function(call, [_struct(shape, jnp.dtype(name)) for shape, name in outputs]))


# Above this, an eager collective is a custom call: the engine then writes into XLA's own
# buffer, where the binding's result would be copied into a new one (at 4 MiB that copy made
# the call 1.3x as long as the custom call's; at 1 MiB they were equal).
_BINDING_BYTES = 1 << 20


def _through_binding(call, arrays):
    """Runs one collective of concrete arrays through the engine's binding, as a torch op does.

    No program is compiled for the call's shapes, and none is dispatched: an eager collective
    costs what the engine's own call does. Tensor i of several is `<name>.<i>`, and a grouped
    call's tensors are one engine group of its name, as in the custom call. The binding takes
    the arrays' host buffers as NumPy arrays (bfloat16 as ml_dtypes' type, as JAX holds it).
    """
    engine = _basics._engine()
    count = len(arrays)
    names = [f"{call.name}.{i}" if call.grouped or count > 1 else call.name
             for i in range(count)]
    args = dict(op=call.reduce_op, prescale_factor=call.prescale_factor,
                postscale_factor=call.postscale_factor, root_rank=call.root_rank,
                process_set=call.set_id, compression=call.compression,
                group=call.name if call.grouped and count > 1 else "")
    views = [np.asarray(a) for a in arrays]
    if call.collective == _ALLTOALL:
        handle = engine.submit(engine.ALLTOALL, views, names, splits=list(call.splits or ()),
                               **args)
        results = [*handle.wait(), np.asarray(handle.received_splits()[0], np.int32)]
    else:
        results = engine.run(call.collective, views, names, **args)
    return [jnp.asarray(r) for r in results]


def _run(call, arrays, outputs):
    """Runs one collective; eagerly, waits for it and raises the engine's error.

    Arrays of up to `_BINDING_BYTES` go through the engine's binding; larger ones, and tracers
    (of `jax.jit`, `jax.vmap` or any transformation that gets here with one), through the
    custom call.
    """
    if (not any(isinstance(a, jax.core.Tracer) for a in arrays)
            and sum(a.nbytes for a in arrays) <= _BINDING_BYTES):
        return _through_binding(call, arrays)
    _build.load()
    operands = list(arrays)
    if call.collective == _ALLTOALL:
        operands.append(np.asarray(call.splits or (), np.int32))
    traced = _is_traced(arrays)
    operands.append(_name_bytes(call.name) if traced else _name_on_device(call.name))
    try:
        if traced:
            return _function(call, outputs)(*operands)
        signature = tuple((tuple(o.shape), np.dtype(o.dtype).name) for o in outputs)
        results = _eager_function(dataclasses.replace(call, name=""), signature)(*operands)
        jax.block_until_ready(results)
    except jax.errors.JaxRuntimeError as error:
        _raise_from(error)
    return results


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _even_rows(rows, size, index):
    """This rank's rows of a first dimension split as the engine splits it (Horovod's)."""
    return rows // size + (1 if index < rows % size else 0)


def _forward(call, arrays):
    """The collective's results, without the custom VJP."""
    if call.collective in (_ALLREDUCE, _BROADCAST):
        return tuple(_run(call, arrays, [_struct(a.shape, a.dtype) for a in arrays]))
    if call.collective == _ALLGATHER:
        structs = [_struct((sum(rows),) + a.shape[1:], a.dtype)
                   for a, rows in zip(arrays, call.rows)]
        return tuple(_run(call, arrays, structs))
    if call.collective == _REDUCESCATTER:
        structs = [
            _struct((_even_rows(a.shape[0], call.set_size, call.set_rank),) + a.shape[1:],
                    a.dtype)
            for a in arrays
        ]
        return tuple(_run(call, arrays, structs))
    # Alltoall: the array, then the received splits.
    (array,) = arrays
    rows = sum(call.received) if call.received is not None else array.shape[0]
    structs = [_struct((rows,) + array.shape[1:], array.dtype),
               _struct((call.set_size,), np.int32)]
    return tuple(_run(call, arrays, structs))


def _collective(call, arrays):
    """The collective's results; differentiable under JAX's transformations."""
    if not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return _forward(call, arrays)  # no transformation: the custom VJP would only cost
    return _differentiable(call, arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(call, arrays):
    return _forward(call, arrays)


def _collective_fwd(call, arrays):
    # What the gradient needs is static, in `call`.
    return _forward(call, arrays), None


def _floating(dtype):
    # Integer outputs' cotangents have dtype float0, which NumPy cannot name.
    return dtype != jax.dtypes.float0 and np.dtype(dtype) in _FLOAT_DTYPES


def _scale(array, factor):
    """`array * factor`, computed in float32 at least, as the engine scales."""
    if factor == 1.0:
        return array
    wide = array.dtype if array.dtype.itemsize >= 4 else jnp.float32
    return (array.astype(wide) * factor).astype(array.dtype)


def _collective_bwd(call, _, grads):
    kind = _KINDS[call.collective]
    if call.collective in (_ALLREDUCE, _REDUCESCATTER) and call.reduce_op not in (Average, Sum):
        raise LookupError(
            f"No gradient is defined for keras_ring.jax.{kind} with "
            f"op={_REDUCE_OP_NAMES.get(call.reduce_op, call.reduce_op)}; only Sum and Average "
            "are differentiable."
        )
    # Which outputs carry a gradient depends only on dtypes, which agree
    # across ranks, so every rank runs the same collectives.
    count = len(grads) - (call.collective == _ALLTOALL)  # alltoall: received splits too
    present = [i for i in range(count) if _floating(grads[i].dtype)]
    results = [None] * count
    if not present:
        return (tuple(results),)
    values = tuple(grads[i] for i in present)
    if call.collective == _ALLREDUCE:
        # Every rank's output is the same linear map of every rank's input.
        reduced = _forward(call.renamed("grad"), values)
    elif call.collective == _BROADCAST:
        # Only the root's input reaches the outputs.
        summed = _forward(call.renamed("grad", collective=_ALLREDUCE, reduce_op=Sum), values)
        reduced = summed if call.set_rank == call.root_rank else [
            jnp.zeros_like(s) for s in summed]
    elif call.collective == _ALLGATHER:
        # This rank's rows feed every rank's output: sum every rank's
        # gradient, then keep this rank's rows.
        summed = _forward(call.renamed("grad", collective=_ALLREDUCE, reduce_op=Sum,
                                       grouped=len(values) > 1, rows=None), values)
        reduced = []
        for i, total in zip(present, summed):
            rows = call.rows[i]
            start = sum(rows[: call.set_rank])
            reduced.append(jax.lax.slice_in_dim(total, start, start + rows[call.set_rank]))
    elif call.collective == _REDUCESCATTER:
        # Every rank's output rows are a linear map of every rank's input:
        # gather every rank's output gradient, times the map's factor.
        scale = call.prescale_factor * call.postscale_factor
        if call.reduce_op == Average:
            scale /= call.set_size
        rows = tuple(tuple(_even_rows(call.rows[i], call.set_size, r)
                           for r in range(call.set_size)) for i in present)
        gathered = _forward(call.renamed("grad", collective=_ALLGATHER, compression=0,
                                         rows=rows), values)
        reduced = [_scale(g, scale) for g in gathered]
    else:
        # Alltoall: each output row goes back to the rank it came from.
        back = call.renamed("grad", splits=call.received, received=call.splits)
        reduced = _forward(back, values)[:1]
    for i, r in zip(present, reduced):
        results[i] = r
    return (tuple(results),)


_differentiable.defvjp(_collective_fwd, _collective_bwd)


def _reduction_call(collective, arrays, api, op, average, compression, prescale_factor,
                    postscale_factor, name, process_set, grouped):
    op, compressor, prescale_factor, postscale_factor = reduce_args(
        op, average, compression, prescale_factor, postscale_factor
    )
    set_id, set_size, set_rank = describe(process_set)
    traced = _is_traced(arrays)
    code = _ENGINE_COMPRESSION.get(compressor, 0)
    call = _Call(collective, _name(name, api, traced), set_id, set_size, set_rank,
                 grouped=grouped, reduce_op=op, prescale_factor=prescale_factor,
                 postscale_factor=postscale_factor, compression=code,
                 rows=tuple(a.shape[0] for a in arrays) if collective == _REDUCESCATTER else None)
    compressed = [_compress(compressor, a, code) for a in arrays]
    outputs = _collective(call, tuple(c for c, _ in compressed))
    return [_decompress(compressor, out, ctx) for out, (_, ctx) in zip(outputs, compressed)]


_IN_ENGINE = object()  # marks an array the engine converts


def _compress(compressor, array, code):
    if code and np.dtype(array.dtype) in (np.dtype("float32"), np.dtype("float64")):
        return array, _IN_ENGINE
    if compressor in _ENGINE_COMPRESSION:
        if _floating(array.dtype):
            return array.astype(compressor.wire_dtype), array.dtype
        return array, None
    return compressor.compress(array)


def _decompress(compressor, array, ctx):
    if ctx is _IN_ENGINE or (compressor in _ENGINE_COMPRESSION and ctx is None):
        return array
    if compressor in _ENGINE_COMPRESSION:
        return array.astype(ctx)
    return compressor.decompress(array, ctx)


def allreduce(tensor, op=None, compression=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, average=None):
    """Reduces an array over all ranks; every rank receives the result.

    The array must have the same shape and dtype on every rank. Inside
    `jax.jit` it is one XLA custom call into the engine.

    Args:
        tensor: A `jax.Array` (or NumPy array) on the CPU.
        op: `keras_ring.Average` (the default), `Sum`, `Min`, `Max` or
            `Product`.
        compression: A `keras_ring.Compression` member: `fp16` or `bf16`
            send floating-point arrays in that type.
        prescale_factor: Multiplies each rank's input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        name: The name that matches this collective across ranks.
        process_set: Run among this `ProcessSet`'s ranks only.
        average: Deprecated; `True` means `op=Average`, `False` `op=Sum`.

    Returns:
        An array of the same shape and dtype. Differentiable for `Average`
        and `Sum`: the gradient is the same reduction of the gradients.

    Example:

    ```python
    import keras_ring.jax as krj
    krj.init()
    total = jax.jit(lambda x: krj.allreduce(x, op=krj.Sum))(jnp.ones(3))  # 2 ranks: [2, 2, 2]
    ```
    """
    _basics._require_initialized("allreduce()")
    array = _array(tensor, "allreduce", reduces=True)
    return _reduction_call(_ALLREDUCE, [array], "allreduce", op, average, compression,
                           prescale_factor, postscale_factor, name, process_set, False)[0]


def grouped_allreduce(tensors, op=None, compression=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=global_process_set,
                      average=None):
    """Reduces a list of arrays (of any dtypes) as one group: one custom call.

    The ranks agree on the group as one unit and the engine fuses it into as
    few transfers as its fusion threshold allows. Arguments as `allreduce`.

    Returns:
        A list of arrays, one per input.

    Example:

    ```python
    w_grad, b_grad = krj.grouped_allreduce([w_grad, b_grad], name="grads")
    ```
    """
    _basics._require_initialized("grouped_allreduce()")
    arrays = _array_list(tensors, "grouped_allreduce", reduces=True)
    if not arrays:
        return []
    return _reduction_call(_ALLREDUCE, arrays, "grouped_allreduce", op, average, compression,
                           prescale_factor, postscale_factor, name, process_set, True)


def reducescatter(tensor, op=None, compression=None, prescale_factor=1.0,
                  postscale_factor=1.0, name=None, process_set=global_process_set):
    """Reduces an array over all ranks; each rank receives its rows of the result.

    The first dimension is split as Horovod splits it: as evenly as possible,
    the first `rows % size` ranks getting one row more. Arguments as
    `allreduce` (`op` is `Average` or `Sum`).

    Returns:
        This rank's rows of the reduction. Differentiable.

    Example:

    ```python
    mine = krj.reducescatter(jnp.ones((5, 2)), op=krj.Sum)  # 2 ranks: 3 rows, then 2
    ```
    """
    _basics._require_initialized("reducescatter()")
    array = _array(tensor, "reducescatter", reduces=True)
    _check_rows(array, "reducescatter")
    return _reduction_call(_REDUCESCATTER, [array], "reducescatter", op, None, compression,
                           prescale_factor, postscale_factor, name, process_set, False)[0]


def grouped_reducescatter(tensors, op=None, compression=None, prescale_factor=1.0,
                          postscale_factor=1.0, name=None, process_set=global_process_set):
    """`reducescatter` of a list of arrays in one custom call; returns a list.

    Example:

    ```python
    a, b = krj.grouped_reducescatter([jnp.ones((4, 2)), jnp.ones(4)], op=krj.Sum)
    ```
    """
    _basics._require_initialized("grouped_reducescatter()")
    arrays = _array_list(tensors, "grouped_reducescatter", reduces=True)
    for a in arrays:
        _check_rows(a, "grouped_reducescatter")
    if not arrays:
        return []
    return _reduction_call(_REDUCESCATTER, arrays, "grouped_reducescatter", op, None,
                           compression, prescale_factor, postscale_factor, name, process_set,
                           False)


def _check_rows(array, api):
    if array.ndim == 0:
        raise ValueError(
            f"keras_ring.jax.{api} needs an array with a first dimension to split or "
            "concatenate. Received: a scalar (shape ())"
        )


def _gather_call(arrays, api, name, process_set):
    set_id, set_size, set_rank = describe(process_set)
    traced = _is_traced(arrays)
    tensor_name = _name(name, api, traced)
    if traced:
        # Inside jax.jit every rank gathers as many rows as this one.
        rows = tuple((a.shape[0],) * set_size for a in arrays)
    else:
        # Eagerly, the ranks first tell each other their rows.
        mine = np.asarray([a.shape[0] for a in arrays], np.int32)[np.newaxis]
        count = _Call(_ALLGATHER, f"{tensor_name}.rows", set_id, set_size, set_rank,
                      rows=((1,) * set_size,))
        every = np.asarray(_forward(count, (jnp.asarray(mine),))[0])
        rows = tuple(tuple(int(r) for r in every[:, i]) for i in range(len(arrays)))
    call = _Call(_ALLGATHER, tensor_name, set_id, set_size, set_rank, rows=rows)
    return list(_collective(call, tuple(arrays)))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's array along the first dimension, in rank order.

    Eagerly, the ranks' first dimensions may differ; inside `jax.jit` they
    must be equal (the result's shape is fixed when tracing).

    Returns:
        The gathered array. Differentiable: a rank's gradient is the sum of
        every rank's gradient for its rows.

    Example:

    ```python
    every = krj.allgather(jnp.full((1, 3), krj.rank()))  # 2 ranks: rows of 0s, then 1s
    ```
    """
    _basics._require_initialized("allgather()")
    array = _array(tensor, "allgather")
    _check_rows(array, "allgather")
    return _gather_call([array], "allgather", name, process_set)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """`allgather` of a list of arrays in one custom call; returns a list.

    Example:

    ```python
    xs, ys = krj.grouped_allgather([x, y])
    ```
    """
    _basics._require_initialized("grouped_allgather()")
    arrays = _array_list(tensors, "grouped_allgather")
    for a in arrays:
        _check_rows(a, "grouped_allgather")
    if not arrays:
        return []
    return _gather_call(arrays, "grouped_allgather", name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Every rank receives the array of `root_rank` (a rank of the job).

    Returns:
        The root's array. Differentiable: the root's gradient is the sum of
        every rank's, the others' zero.

    Example:

    ```python
    seed = krj.broadcast(jnp.asarray(np.random.randint(1 << 30)), root_rank=0)
    ```
    """
    _basics._require_initialized("broadcast()")
    array = _array(tensor, "broadcast")
    return _broadcast_arrays([array], root_rank, name, process_set, "broadcast")[0]


def _broadcast_arrays(arrays, root_rank, name, process_set, api):
    set_id, set_size, set_rank = describe(process_set)
    call = _Call(_BROADCAST, _name(name, api, _is_traced(arrays)), set_id, set_size, set_rank,
                 root_rank=root_index(process_set, root_rank))
    return list(_collective(call, tuple(arrays)))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends `splits[j]` rows of the array to rank `j`; receives rows from each rank.

    Without `splits` the first dimension is split evenly (it must divide by
    the number of ranks). Inside `jax.jit` only the even split is taken: the
    rows a rank receives fix its result's shape.

    Returns:
        The received rows in rank order; with `splits`, as Horovod does, also
        the rows received from each rank (an int32 array). Differentiable.

    Example:

    ```python
    mixed = jax.jit(krj.alltoall)(jnp.arange(4.0))   # 2 ranks: rows 0-1 stay, 2-3 go
    rows, received = krj.alltoall(x, splits=[1, 3])  # eagerly, any splits
    ```
    """
    _basics._require_initialized("alltoall()")
    array = _array(tensor, "alltoall")
    _check_rows(array, "alltoall")
    set_id, set_size, set_rank = describe(process_set)
    traced = _is_traced([array])
    tensor_name = _name(name, "alltoall", traced)
    if splits is None:
        if array.shape[0] % set_size:
            raise ValueError(
                f"keras_ring.jax.alltoall without splits needs a first dimension that "
                f"divides by the number of ranks ({set_size}). Received: shape {array.shape}"
            )
        call = _Call(_ALLTOALL, tensor_name, set_id, set_size, set_rank)
        return _collective(call, (array,))[0]
    if traced or _is_traced([splits]):
        raise ValueError(
            "keras_ring.jax.alltoall takes splits only outside jax.jit: the rows a rank "
            "receives fix its result's shape, which jax.jit needs when tracing. Inside "
            "jax.jit, split evenly (splits=None)"
        )
    sent = np.asarray(splits, np.int64).reshape(-1)
    # The ranks first tell each other how many rows each will receive. That
    # exchange takes one value per rank whatever `splits` holds; the engine
    # then checks the splits themselves and, if one rank's are wrong, fails
    # the tensor on every rank, naming that rank.
    counts = np.zeros(set_size, np.int32)
    counts[: min(set_size, sent.size)] = np.clip(sent[:set_size], -1, np.iinfo(np.int32).max)
    count = _Call(_ALLTOALL, f"{tensor_name}.splits", set_id, set_size, set_rank)
    received = tuple(max(0, int(r)) for r in np.asarray(_forward(count, (jnp.asarray(counts),))[0]))
    call = _Call(_ALLTOALL, tensor_name, set_id, set_size, set_rank,
                 splits=tuple(int(v) for v in sent), received=received)
    return _collective(call, (array,))
