"""Collective ops on TensorFlow tensors, mirroring `horovod.tensorflow`.

Ranks match collectives by name, so independent collectives may run in a
different order on each rank. Without a `name`, a collective inside a
`tf.function` is named after its graph node, which is the same on every rank
that traced the same function; eager collectives run one at a time, so they
may share a name.
"""

import functools

import numpy as np
import tensorflow as tf

from keras_ring.core import _basics, _compression, _process_sets
from keras_ring.core._collective_args import reduce_args as _reduce_args
from keras_ring.core._process_sets import describe, global_process_set, root_index
from keras_ring.core._reduce_ops import NAMES as _REDUCE_OP_NAMES
from keras_ring.core._reduce_ops import Average, Max, Min, Product, Sum, refuse_adasum  # noqa: F401
from keras_ring.tensorflow import _build

# The reductions that are linear: differentiable, and computable on
# tf.IndexedSlices by gathering.
_LINEAR_OPS = (Average, Sum)
# The dtypes that reductions take; the collectives that only move bytes
# (allgather, broadcast, alltoall) take _MOVED_DTYPES too, as Horovod's do.
_REDUCED_DTYPES = (
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int8,
    tf.uint8,
    tf.int32,
    tf.int64,
)
_MOVED_DTYPES = (tf.int16, tf.uint16, tf.bool)


# The built-in compressors whose casts the engine does itself for float32 and
# float64 tensors, as it copies them into and out of its buffers: no cast ops,
# no extra copies. Other compressors (and other dtypes) run in the graph.
_ENGINE_COMPRESSION = _compression.ENGINE_CODES
_ENGINE_COMPRESSIBLE = (tf.float32, tf.float64)
_IN_ENGINE = object()  # marks a tensor the engine converts


def _reduction(kernel, tensors, compressor, grouped, **attrs):
    """Runs a reduction kernel on the compressed tensors and decompresses its outputs."""
    code = _ENGINE_COMPRESSION.get(compressor, 0)
    attrs["compression"] = code
    compressed = [
        (t, _IN_ENGINE) if code and t.dtype in _ENGINE_COMPRESSIBLE else compressor.compress(t)
        for t in tensors
    ]
    inputs = [t for t, _ in compressed]
    outputs = kernel(inputs, **attrs) if grouped else [kernel(inputs[0], **attrs)]
    return [
        out if ctx is _IN_ENGINE else compressor.decompress(out, ctx)
        for out, (_, ctx) in zip(outputs, compressed)
    ]


def _set_of_op(op):
    """The process set a keras-ring op ran in, for its gradient."""
    return _process_sets.by_id(op.get_attr("process_set_id"))


def _tensor_name(name, ignore_name_scope):
    # "" lets the kernel use its node name.
    if name is None:
        return ""
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string or None. Received: name={name!r}")
    scope = "" if ignore_name_scope else tf.get_current_name_scope()
    return f"{scope}/{name}" if scope else name


def _name_input(tensor_name):
    """The ops' `tensor_name` input (see custom_ops/tensorflow/ops.cc): a kept tensor when eager."""
    return _eager_name(tensor_name) if tf.executing_eagerly() else tensor_name


# A name used again costs no conversion to a tensor (about 10 us a call).
@functools.lru_cache(maxsize=1024)
def _eager_name(tensor_name):
    return tf.constant(tensor_name)


def _to_tensor(tensor, api, reduces=False):
    tensor = tf.convert_to_tensor(tensor)
    dtype = tensor.dtype
    if dtype in _REDUCED_DTYPES or (dtype in _MOVED_DTYPES and not reduces):
        return tensor
    reduced = ", ".join(d.name for d in _REDUCED_DTYPES)
    moved = ", ".join(d.name for d in _MOVED_DTYPES)
    if dtype in _MOVED_DTYPES:
        why = (
            f"reductions take {reduced}; {moved} only allgather, broadcast and alltoall "
            "(which move them unchanged)"
        )
    else:
        why = f"it supports {reduced}" + ("" if reduces else f", {moved}")
    raise TypeError(
        f"keras_ring.{api} does not support dtype {dtype.name}: {why}. "
        f"Received: tensor with dtype={dtype.name}"
    )


# Its first call may build the library; autograph must not try to convert
# that (it warns about every os.path function it cannot read the source of).
@tf.autograph.experimental.do_not_convert
def _library():
    return _build.load()


def _tensor_list(tensors, api):
    error = f"keras_ring.{api} takes a list of tensors. Received: tensors="
    # A tensor or array is iterable too; taking its rows for the list would
    # run a collective per row instead of failing.
    if tf.is_tensor(tensors) or hasattr(tensors, "dtype"):
        shape = getattr(tensors, "shape", None)
        raise TypeError(f"{error}a {type(tensors).__name__} of shape {shape}")
    if isinstance(tensors, (str, bytes)):
        raise TypeError(f"{error}{tensors!r}")
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(f"{error}{tensors!r}") from None


def _dense_input(tensor, api, arg="tensor", reduces=False):
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(
            f"keras_ring.{api} does not support tf.IndexedSlices; convert them with "
            f"tf.convert_to_tensor first. Received: {arg}=tf.IndexedSlices with values of "
            f"shape {tensor.values.shape}"
        )
    return _to_tensor(tensor, api, reduces)


def _allgather(tensor, tensor_name, set_id=0):
    return _library().keras_ring_allgather(
        _to_tensor(tensor, "allgather"), tensor_name=_name_input(tensor_name), process_set_id=set_id
    )


def _check_indexed_slices(op, prescale_factor, postscale_factor):
    """Horovod's refusals for tf.IndexedSlices, before any collective runs."""
    if op not in _LINEAR_OPS:
        raise NotImplementedError(
            "For tf.IndexedSlices (sparse gradients) keras-ring supports only "
            "op=keras_ring.Average or op=keras_ring.Sum. "
            f"Received: op={_REDUCE_OP_NAMES[op]}"
        )
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "For tf.IndexedSlices (sparse gradients) keras-ring supports no "
            "prescale_factor or postscale_factor. Received: "
            f"prescale_factor={prescale_factor}, postscale_factor={postscale_factor}"
        )


def _allreduce_indexed_slices(slices, op, scale, tensor_name, process_set):
    # Ranks hold different indices, so the rows are gathered, not reduced;
    # summing duplicate indices is left to whoever applies the slices.
    set_id, set_size, _ = describe(process_set)
    values = _allgather(slices.values, tensor_name and f"{tensor_name}.values", set_id)
    indices = _allgather(slices.indices, tensor_name and f"{tensor_name}.indices", set_id)
    if op == Average:
        # True division, as Horovod's: integer values become floating point, so
        # that each rank's share stays whole until duplicates are summed.
        values = values / tf.cast(set_size, values.dtype)
    return tf.IndexedSlices(_scale(values, scale), indices, dense_shape=slices.dense_shape)


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """Reduces a tensor over all ranks; every rank receives the result.

    The tensor must have the same shape and dtype on every rank. A
    `tf.IndexedSlices` is gathered instead, as Horovod gathers it: values and
    indices of all ranks, for `Average` the values divided by the number of
    ranks (with true division: integer values become floating point).

    Args:
        tensor: The tensor (or `tf.IndexedSlices`) to reduce.
        average: Deprecated; `True` means `op=Average`, `False` `op=Sum`.
        device_dense: Device on which to reduce dense tensors.
        device_sparse: Device on which to gather `tf.IndexedSlices`.
        compression: A `keras_ring.Compression` member: `none` (also
            `None`), `fp16` or `bf16` send floating-point tensors in that
            type and convert the result back.
        op: `keras_ring.Average` (the default), `Sum`, `Min`, `Max` or
            `Product`.
        prescale_factor: Multiplies each rank's input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        name: The name that matches this collective across ranks, prefixed
            by the current name scope. By default, the graph node's name.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.
        ignore_name_scope: If `True`, `name` is used without the name scope.

    Returns:
        A tensor of the same shape and dtype (or a `tf.IndexedSlices`).

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If the dtype is not supported (int16, uint16 and bool
            are not reduced).
        NotImplementedError: For a `tf.IndexedSlices` with an op other than
            `Average` and `Sum`, or with a scale factor.

    Example:

    ```python
    kr.init()
    total = kr.allreduce(tf.constant([1.0, 2.0]), op=kr.Sum)  # 2 ranks: [2.0, 4.0]
    mean_loss = kr.allreduce(loss, op=kr.Average, name="loss")
    ```
    """
    _basics._require_initialized("allreduce()")
    op, compressor, prescale_factor, postscale_factor = _reduce_args(
        op, average, compression, prescale_factor, postscale_factor
    )
    tensor_name = _tensor_name(name, ignore_name_scope)
    if isinstance(tensor, tf.IndexedSlices):
        _check_indexed_slices(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            return _allreduce_indexed_slices(tensor, op, 1.0, tensor_name, process_set)
    with tf.device(device_dense):
        return _reduction(
            _library().keras_ring_allreduce,
            [_to_tensor(tensor, "allreduce", reduces=True)],
            compressor,
            grouped=False,
            reduce_op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            tensor_name=_name_input(tensor_name),
            process_set_id=describe(process_set)[0],
        )[0]


def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """Reduces a list of tensors over all ranks as one operation.

    The tensors may have different dtypes; each must agree in shape and dtype
    with its counterpart on the other ranks. The dense tensors form one
    group, which the ranks agree on as a unit (one name to negotiate instead
    of one per tensor) and the engine fuses up to its fusion threshold: every
    rank must pass the same tensors in the same order, and if one rank's
    differ, every rank's call fails with an error naming the first tensor
    that differs. `tf.IndexedSlices` are gathered as in `allreduce`.

    Args:
        tensors: A list of tensors (or `tf.IndexedSlices`).
        average: Deprecated; `True` means `op=Average`, `False` `op=Sum`.
        device_dense: Device on which to reduce dense tensors.
        device_sparse: Device on which to gather `tf.IndexedSlices`.
        compression: A `keras_ring.Compression` member: `none` (also
            `None`), `fp16` or `bf16` send floating-point tensors in that
            type and convert the result back.
        op: `keras_ring.Average` (the default), `Sum`, `Min`, `Max` or
            `Product`.
        prescale_factor: Multiplies each rank's inputs before the reduction.
        postscale_factor: Multiplies the results after the reduction.
        name: The name that matches this group across ranks, prefixed by the
            current name scope; tensor `i` is matched as `<name>.<i>`. By
            default, the graph node's name.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.
        ignore_name_scope: If `True`, `name` is used without the name scope.

    Returns:
        A list of the reduced tensors, in the order of `tensors`.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If a dtype is not supported (int16, uint16 and bool are
            not reduced).
        NotImplementedError: If `tensors` holds a `tf.IndexedSlices` and
            `op` is not `Average` or `Sum`, or a scale factor is given.

    Example:

    ```python
    kr.init()
    # One collective for both tensors, whatever their dtypes.
    a, b = kr.grouped_allreduce([tf.ones([2]), tf.ones([3], tf.int32)], op=kr.Sum)
    # 2 ranks: a == [2.0, 2.0], b == [2, 2, 2]
    ```
    """
    _basics._require_initialized("grouped_allreduce()")
    op, compressor, prescale_factor, postscale_factor = _reduce_args(
        op, average, compression, prescale_factor, postscale_factor
    )
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        _check_indexed_slices(op, prescale_factor, postscale_factor)
    return _grouped_allreduce(
        tensors,
        op,
        compressor,
        prescale_factor,
        postscale_factor,
        _tensor_name(name, ignore_name_scope),
        process_set,
        device_dense,
        device_sparse,
    )


def _grouped_allreduce(
    tensors,
    op,
    compressor,
    prescale_factor,
    postscale_factor,
    tensor_name,
    process_set,
    device_dense="",
    device_sparse="",
):
    """`grouped_allreduce` of checked arguments, whose tf.IndexedSlices take scale factors too.

    `DistributedOptimizer`'s `gradient_predivide_factor` scales its sparse
    gradients as the dense ones (by a product of 1), where Horovod refuses.
    """
    set_id = describe(process_set)[0]
    results = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    with tf.device(device_dense):
        # Converted before any collective starts, so a bad dtype fails alone.
        dense_inputs = [_to_tensor(tensors[i], "grouped_allreduce", reduces=True) for i in dense]
    with tf.device(device_sparse):
        for i in sparse:
            # `.values`/`.indices` suffixes keep these apart from `<name>.<k>`.
            results[i] = _allreduce_indexed_slices(
                tensors[i],
                op,
                prescale_factor * postscale_factor,
                tensor_name and f"{tensor_name}.{i}",
                process_set,
            )
    if dense:
        with tf.device(device_dense):
            outputs = _reduction(
                _library().keras_ring_grouped_allreduce,
                dense_inputs,
                compressor,
                grouped=True,
                reduce_op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                tensor_name=_name_input(tensor_name),
                process_set_id=set_id,
            )
        for i, output in zip(dense, outputs):
            results[i] = output
    return results


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates the tensors of all ranks along the first dimension.

    The first dimension may differ between ranks (and be 0); the other
    dimensions and the dtype must agree.

    Args:
        tensor: A tensor of rank 1 or more.
        name: The name that matches this collective across ranks, prefixed
            by the current name scope. By default, the graph node's name.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.

    Returns:
        A tensor holding every rank's rows, in rank order.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If the dtype is not supported.

    Example:

    ```python
    kr.init()
    gathered = kr.allgather(tf.fill([kr.rank() + 1], kr.rank()))
    # 2 ranks: [0, 1, 1] (rank 0's one row, then rank 1's two)
    ```
    """
    _basics._require_initialized("allgather()")
    return _allgather(tensor, _tensor_name(name, ignore_name_scope), describe(process_set)[0])


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Copies the tensor of `root_rank` to every rank.

    Args:
        tensor: The value to send on the root; elsewhere only its shape and
            dtype matter, and they must agree with the root's.
        root_rank: The rank whose tensor is broadcast: a rank of the job,
            which must be a member of `process_set` (as in Horovod).
        name: The name that matches this collective across ranks, prefixed
            by the current name scope. By default, the graph node's name.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        process_set: Run among this `ProcessSet`'s ranks only; by default
            every rank.

    Returns:
        The root's tensor.

    Raises:
        ValueError: If keras-ring is not initialized or `root_rank` is not a
            rank of the set.
        TypeError: If the dtype is not supported.

    Example:

    ```python
    kr.init()
    seed = kr.broadcast(tf.random.uniform([], maxval=2**31 - 1, dtype=tf.int64), root_rank=0)
    # Every rank now holds rank 0's random number.
    ```
    """
    _basics._require_initialized("broadcast()")
    set_id = describe(process_set)[0]
    root = root_index(process_set, root_rank)
    return _library().keras_ring_broadcast(
        _to_tensor(tensor, "broadcast"),
        root_rank=root,
        tensor_name=_name_input(_tensor_name(name, ignore_name_scope)),
        process_set_id=set_id,
    )


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Allgathers a list of tensors as one operation.

    The tensors may have different dtypes. Each one's first dimension may
    differ between ranks (and be 0); its other dimensions and its dtype must
    agree with its counterpart on the other ranks.

    Args:
        tensors: A list of tensors, each of rank 1 or more.
        name: The name that matches this group across ranks, prefixed by the
            current name scope; tensor `i` is matched as `<name>.<i>`. By
            default, the graph node's name.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.

    Returns:
        A list of tensors in the order of `tensors`, each holding every
        rank's rows of its tensor, in rank order.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If `tensors` is not a list or a dtype is not supported.

    Example:

    ```python
    kr.init()
    a, b = kr.grouped_allgather([tf.ones([2, 3]), tf.range(kr.rank() + 1)])
    # 2 ranks: a has shape [4, 3]; b == [0, 0, 1]
    ```
    """
    _basics._require_initialized("grouped_allgather()")
    set_id = describe(process_set)[0]
    tensor_name = _tensor_name(name, ignore_name_scope)
    tensors = [
        _to_tensor(t, "grouped_allgather") for t in _tensor_list(tensors, "grouped_allgather")
    ]
    if not tensors:
        return []
    return list(_library().keras_ring_grouped_allgather(
        tensors, tensor_name=_name_input(tensor_name), process_set_id=set_id
    ))


def reducescatter(
    tensor,
    device_dense="",
    compression=None,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduces a tensor over all ranks; each rank receives its rows of the result.

    The tensor must have the same shape and dtype on every rank. The result
    is split along the first dimension as evenly as possible, in rank order:
    with `d` rows, the first `d % size()` ranks get `d // size() + 1` rows
    and the others `d // size()` (Horovod's split).

    Args:
        tensor: The tensor to reduce, of rank 1 or more.
        device_dense: Device on which to reduce the tensor.
        compression: A `keras_ring.Compression` member: `none` (also
            `None`), `fp16` or `bf16` send floating-point tensors in that
            type and convert the result back.
        op: `keras_ring.Average` (the default), `Sum`, `Min`, `Max` or
            `Product`.
        name: The name that matches this collective across ranks, prefixed
            by the current name scope. By default, the graph node's name.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        prescale_factor: Multiplies each rank's input before the reduction.
        postscale_factor: Multiplies the result after the reduction.

    Returns:
        This rank's rows of the reduction: the shape of `tensor` but for the
        first dimension, and its dtype.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If the dtype is not supported or `tensor` is a
            `tf.IndexedSlices`.

    Example:

    ```python
    kr.init()
    part = kr.reducescatter(tf.ones([2 * kr.size(), 3]), op=kr.Sum)
    # Each rank gets 2 rows of the sum: shape [2, 3], every entry kr.size()
    ```
    """
    _basics._require_initialized("reducescatter()")
    op, compressor, prescale_factor, postscale_factor = _reduce_args(
        op, None, compression, prescale_factor, postscale_factor
    )
    tensor_name = _tensor_name(name, ignore_name_scope)
    with tf.device(device_dense):
        return _reduction(
            _library().keras_ring_reducescatter,
            [_dense_input(tensor, "reducescatter", reduces=True)],
            compressor,
            grouped=False,
            reduce_op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            tensor_name=_name_input(tensor_name),
            process_set_id=describe(process_set)[0],
        )[0]


def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=None,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reducescatters a list of tensors as one operation.

    The tensors may have different dtypes; each must agree in shape and dtype
    with its counterpart on the other ranks, and is split along its first
    dimension as in `reducescatter`.

    Args:
        tensors: A list of tensors, each of rank 1 or more.
        device_dense: Device on which to reduce the tensors.
        compression: A `keras_ring.Compression` member: `none` (also
            `None`), `fp16` or `bf16` send floating-point tensors in that
            type and convert the result back.
        op: `keras_ring.Average` (the default), `Sum`, `Min`, `Max` or
            `Product`.
        name: The name that matches this group across ranks, prefixed by the
            current name scope; tensor `i` is matched as `<name>.<i>`. By
            default, the graph node's name.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        prescale_factor: Multiplies each rank's inputs before the reduction.
        postscale_factor: Multiplies the results after the reduction.

    Returns:
        A list of this rank's rows of each reduction, in the order of
        `tensors`.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid.
        TypeError: If `tensors` is not a list, a dtype is not supported or a
            tensor is a `tf.IndexedSlices`.

    Example:

    ```python
    kr.init()
    n = kr.size()
    a, b = kr.grouped_reducescatter([tf.ones([n, 2]), tf.ones([2 * n], tf.int32)], op=kr.Sum)
    # Each rank: a has shape [1, 2], b shape [2], every entry n
    ```
    """
    _basics._require_initialized("grouped_reducescatter()")
    op, compressor, prescale_factor, postscale_factor = _reduce_args(
        op, None, compression, prescale_factor, postscale_factor
    )
    set_id = describe(process_set)[0]
    tensor_name = _tensor_name(name, ignore_name_scope)
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    with tf.device(device_dense):
        # Converted before the collective starts, so a bad input fails alone.
        inputs = [
            _dense_input(t, "grouped_reducescatter", f"tensors[{i}]", reduces=True)
            for i, t in enumerate(tensors)
        ]
        if not inputs:
            return []
        return _reduction(
            _library().keras_ring_grouped_reducescatter,
            inputs,
            compressor,
            grouped=True,
            reduce_op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            tensor_name=_name_input(tensor_name),
            process_set_id=set_id,
        )


def _alltoall_splits(splits, tensor, size):
    """`splits` as an int32 vector, checked as far as it is known before running."""
    rows = tensor.shape[0] if tensor.shape.rank else None
    if splits is None:
        if rows is not None and rows % size:
            raise ValueError(
                "Without `splits`, alltoall splits the first dimension of `tensor` evenly, so "
                f"it must be divisible by the number of ranks ({size}); it is {rows}. "
                "Received: splits=None"
            )
        # Empty: the engine splits the first dimension evenly.
        return tf.zeros([0], tf.int32)
    if isinstance(splits, tf.IndexedSlices):
        raise TypeError(f"`splits` must be a vector of integers. Received: splits={splits!r}")
    if not tf.is_tensor(splits):
        try:
            splits = tf.convert_to_tensor(splits)
        except (TypeError, ValueError):
            raise TypeError(
                f"`splits` must be a vector of integers. Received: splits={splits!r}"
            ) from None
        if splits.shape == [0]:
            splits = tf.zeros([0], tf.int32)  # [] converts to float32
    if not splits.dtype.is_integer:
        raise TypeError(
            "`splits` must be a vector of integers. "
            f"Received: splits with dtype={splits.dtype.name}"
        )
    if splits.shape.rank is not None and splits.shape.rank != 1:
        raise ValueError(
            f"`splits` must be a vector (rank 1). Received: splits with shape {splits.shape}"
        )
    values = tf.get_static_value(splits)
    if values is not None:
        values = [int(v) for v in values]
        if len(values) != size:
            why = f"one entry per rank ({size})"
        elif any(v < 0 for v in values):
            why = "no negative entries"
        elif max(values) > tf.int32.max:
            why = f"entries of at most {tf.int32.max}"
        elif rows is not None and sum(values) != rows:
            why = f"entries that add up to the first dimension of `tensor`, {rows}"
        else:
            why = None
        if why:
            raise ValueError(f"`splits` must have {why}. Received: splits={values}")
    elif splits.shape.rank == 1 and splits.shape[0] not in (None, size):
        raise ValueError(
            f"`splits` must have one entry per rank ({size}). "
            f"Received: splits with shape {splits.shape}"
        )
    return tf.cast(splits, tf.int32)


def _alltoall(tensor, splits, tensor_name, set_id, set_size):
    output, received_splits = _library().keras_ring_alltoall(
        tensor, splits, tensor_name=_name_input(tensor_name), process_set_id=set_id
    )
    received_splits.set_shape([set_size])
    return output, received_splits


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends rows of the tensor to every rank and receives rows from every rank.

    This rank sends its first `splits[0]` rows to rank 0, the next
    `splits[1]` to rank 1, and so on; every rank concatenates the rows it
    receives in rank order. The first dimension may differ between ranks;
    the other dimensions and the dtype must agree.

    As in Horovod (0.21 and later), the received splits are returned only
    when `splits` is given.

    Args:
        tensor: A tensor of rank 1 or more.
        splits: A vector of integers (a list, an array or an integer
            tensor), one per rank, adding up to the first dimension of
            `tensor`: the rows for each rank. `None` splits the first
            dimension evenly; it must then be divisible by `size()`.
        name: The name that matches this collective across ranks, prefixed
            by the current name scope. By default, the graph node's name.
        ignore_name_scope: If `True`, `name` is used without the name scope.
        process_set: Run among this `ProcessSet`'s ranks only (ranks and
            sizes count within it); by default every rank.

    Returns:
        With `splits`, a tuple `(output, received_splits)`: the rows received
        from every rank in rank order, and an int32 vector of how many came
        from each rank. Without `splits`, only `output`.

    Raises:
        ValueError: If keras-ring is not initialized or an argument is
            invalid (as far as it is known before running; wrong splits
            computed inside a `tf.function` fail when it runs, naming the
            tensor).
        TypeError: If the dtype is not supported, `tensor` is a
            `tf.IndexedSlices` or `splits` does not hold integers.

    Example:

    ```python
    kr.init()
    n = kr.size()
    # Rank r sends elements 2i and 2i + 1 of its tensor to rank i.
    output, received = kr.alltoall(tf.range(2 * n) + 100 * kr.rank(), splits=[2] * n)
    # 2 ranks, rank 0: output == [0, 1, 100, 101], received == [2, 2]
    ```
    """
    _basics._require_initialized("alltoall()")
    tensor_name = _tensor_name(name, ignore_name_scope)
    tensor = _dense_input(tensor, "alltoall")
    set_id, set_size, _ = describe(process_set)
    output, received_splits = _alltoall(
        tensor, _alltoall_splits(splits, tensor, set_size), tensor_name, set_id, set_size
    )
    return output if splits is None else (output, received_splits)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False,
                        name="keras_ring.broadcast_variables"):
    """Assigns every variable the value it has on `root_rank`.

    Variables are matched by their position in the list (Keras's variable
    paths follow per-process counters and may differ between ranks), so every
    rank must pass the same variables in the same order.

    Args:
        variables: A list of `tf.Variable` objects or Keras variables.
        root_rank: The rank whose values every rank receives: a rank of the
            job, and a member of `process_set` (as in Horovod).
        process_set: Broadcast among this `ProcessSet`'s ranks only; default:
            every rank.
        inplace: Accepted for Horovod's scripts: the variables are always
            assigned in place.
        name: The prefix of the collectives' names; variable i is `<name>.<i>`.

    Returns:
        The op that assigns them, to run in a TF1-style graph (as Horovod's);
        `None` when executing eagerly, where they are assigned on return.

    Example:

    ```python
    kr.init()
    optimizer.build(model.trainable_variables)
    kr.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    ```
    """
    del inplace  # every broadcast here assigns in place
    return tf.group(*[
        variable.assign(broadcast(variable, root_rank, name=f"{name}.{i}",
                                  ignore_name_scope=True, process_set=process_set))
        for i, variable in enumerate(variables)
    ])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast: assigns every variable its value on `root_rank`.

    As `broadcast_variables`, for scripts written against Horovod's
    `horovod.tensorflow.broadcast_`.

    Args:
        variables: A list of `tf.Variable` objects.
        root_rank: The rank whose values every rank receives.
        name: The prefix of the collectives' names.
        process_set: The `ProcessSet` to broadcast in; default: every rank.

    Returns:
        The variables' values after the broadcast.

    Example:

    ```python
    kr.init()
    v = tf.Variable([float(kr.rank())])
    kr.broadcast_([v], root_rank=0)  # v is [0.] on every rank
    ```
    """
    assigned = broadcast_variables(variables, root_rank, process_set=process_set,
                                   name=name or "keras_ring.broadcast_")
    # In a graph, the values are read after the assignments.
    with tf.control_dependencies([] if assigned is None else [assigned]):
        return [tf.identity(v) for v in variables]


def broadcast_global_variables(root_rank):
    """Horovod's TF1 broadcast of `tf.compat.v1.global_variables()`; refused in eager mode.

    TF2 code keeps its variables in Keras models and optimizers, not in a
    global collection: broadcast those with `broadcast_variables`, or pass
    `keras_ring.callbacks.BroadcastGlobalVariablesCallback` to `fit`.

    Args:
        root_rank: The rank whose values every rank receives.

    Returns:
        In a TF1 graph, the op that broadcasts the graph's global variables.

    Raises:
        RuntimeError: When executing eagerly (as Horovod does).

    Example:

    ```python
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=1.0)
        bcast = kr.broadcast_global_variables(0)
    ```
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() does not run eagerly (TF2 has no global variable "
            "collection): call keras_ring.broadcast_variables(model.variables + "
            "optimizer.variables, root_rank) instead."
        )
    variables = tf.compat.v1.global_variables()
    return tf.group(*[v.assign(broadcast(v, root_rank, name=f"keras_ring.global.{i}",
                                         ignore_name_scope=True))
                      for i, v in enumerate(variables)])


def _topology_op(value, name):
    """A scalar int32 op whose value `value()` gives when the graph runs, not when it is built."""
    result = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True,
                               name=name or "keras_ring_topology")
    return tf.ensure_shape(result, [])


def size_op(process_set_id=0, name=None):
    """Horovod's op for the number of ranks (of a process set), read when the graph runs.

    Args:
        process_set_id: The `process_set_id` of a `ProcessSet`; 0: every rank.
        name: The op's name.

    Returns:
        An int32 scalar tensor.

    Example:

    ```python
    kr.init()
    tf.function(lambda: kr.size_op())()  # 2 in a 2-rank job
    ```
    """
    return _topology_op(lambda: _process_sets.by_id(process_set_id).size(), name)


def local_size_op(name=None):
    """Horovod's op for the number of ranks on this host, read when the graph runs.

    Example:

    ```python
    kr.init()
    tf.function(lambda: kr.local_size_op())()
    ```
    """
    return _topology_op(_basics.local_size, name)


def rank_op(name=None):
    """Horovod's op for this process's rank, read when the graph runs.

    Example:

    ```python
    kr.init()
    tf.function(lambda: kr.rank_op())()  # 0 on rank 0
    ```
    """
    return _topology_op(_basics.rank, name)


def local_rank_op(name=None):
    """Horovod's op for this process's rank among the ranks of its host, read when it runs.

    Example:

    ```python
    kr.init()
    tf.function(lambda: kr.local_rank_op())()
    ```
    """
    return _topology_op(_basics.local_rank, name)


def process_set_included_op(process_set_id=0, name=None):
    """Horovod's op: 1 if this rank belongs to the process set, else 0; read when it runs.

    Args:
        process_set_id: The `process_set_id` of a `ProcessSet`; 0: every rank.
        name: The op's name.

    Returns:
        An int32 scalar tensor. Where Horovod returns an error code (not
        initialised, an unknown set), running the op raises the error instead.

    Example:

    ```python
    subset = kr.add_process_set([0, 1])
    tf.function(lambda: kr.process_set_included_op(subset.process_set_id))()
    ```
    """
    return _topology_op(lambda: _process_sets.by_id(process_set_id).included(), name)


def _gradient_reduction(op, api):
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in _LINEAR_OPS:
        raise LookupError(
            f"No gradient is defined for keras_ring.{api} with "
            f"op={_REDUCE_OP_NAMES.get(reduce_op, reduce_op)}; only Sum and "
            "Average are differentiable."
        )
    # The gradient travels compressed as the forward values did.
    code = op.get_attr("compression")
    compression = next((c for c, k in _ENGINE_COMPRESSION.items() if k == code), None)
    return {
        "op": reduce_op,
        "prescale_factor": op.get_attr("prescale_factor"),
        "postscale_factor": op.get_attr("postscale_factor"),
        "process_set": _set_of_op(op),
        "compression": compression,
    }


# Each op's last input is the tensor name (custom_ops/tensorflow/ops.cc): its gradient is None.


@tf.RegisterGradient("KerasRingAllreduce")
def _allreduce_grad(op, grad):
    # Every rank's loss depends on every rank's input through the same
    # linear map, so the gradient is the same reduction of the gradients.
    return allreduce(grad, **_gradient_reduction(op, "allreduce")), None


@tf.RegisterGradient("KerasRingGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    # Outputs without a gradient (integers) depend only on dtypes, which
    # agree across ranks, so every rank reduces the same subset.
    present = [i for i, g in enumerate(grads) if g is not None]
    reduced = grouped_allreduce(
        [grads[i] for i in present], **_gradient_reduction(op, "grouped_allreduce")
    )
    results = [None] * len(op.inputs)
    for i, g in zip(present, reduced):
        results[i] = g
    return results


@tf.RegisterGradient("KerasRingAllgather")
def _allgather_grad(op, grad):
    # This rank's rows feed every rank's loss: sum the gradients of all
    # ranks, then keep this rank's rows.
    process_set = _set_of_op(op)
    grad = allreduce(tf.convert_to_tensor(grad), op=Sum, process_set=process_set)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    offset = tf.reduce_sum(allgather(rows, process_set=process_set)[: describe(process_set)[2]])
    return grad[offset : offset + rows[0]], None


@tf.RegisterGradient("KerasRingBroadcast")
def _broadcast_grad(op, grad):
    # Only the root's input reaches the outputs (horovod's definition).
    process_set = _set_of_op(op)
    reduced = allreduce(tf.convert_to_tensor(grad), op=Sum, process_set=process_set)
    if describe(process_set)[2] == op.get_attr("root_rank"):
        return reduced, None
    # Zeros that wait for the allreduce: in a graph a bare zeros_like is a constant, and a
    # session would never run this rank's part of the collective.
    with tf.control_dependencies([reduced]):
        return tf.zeros_like(reduced), None


def _scale(tensor, factor):
    # In float64, as the kernels scale.
    if factor == 1.0:
        return tensor
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


def _differentiable(op, grads):
    """The indices of `op`'s floating-point outputs and their gradients.

    Which outputs take part depends only on dtypes, which agree across ranks,
    so every rank runs the same collectives even where its loss ignores an
    output: a missing gradient becomes zeros.
    """
    indices, values = [], []
    for i, (output, grad) in enumerate(zip(op.outputs, grads)):
        if not output.dtype.is_floating:
            continue
        grad = tf.zeros_like(output) if grad is None else tf.convert_to_tensor(grad)
        indices.append(i)
        values.append(tf.cast(grad, output.dtype))
    return indices, values


def _reducescatter_gradient_scale(op, api):
    reduction = _gradient_reduction(op, api)
    scale = reduction["prescale_factor"] * reduction["postscale_factor"]
    if reduction["op"] == Average:
        scale /= describe(reduction["process_set"])[1]
    return scale


@tf.RegisterGradient("KerasRingReducescatter")
def _reducescatter_grad(op, grad):
    # Every rank's output rows are a linear map of every rank's input: the
    # input gradient is every rank's output gradient, gathered in rank order,
    # times the map's factor.
    scale = _reducescatter_gradient_scale(op, "reducescatter")
    return _scale(allgather(tf.convert_to_tensor(grad), process_set=_set_of_op(op)), scale), None


@tf.RegisterGradient("KerasRingGroupedReducescatter")
def _grouped_reducescatter_grad(op, *grads):
    scale = _reducescatter_gradient_scale(op, "grouped_reducescatter")
    indices, values = _differentiable(op, grads)
    results = [None] * len(op.inputs)
    for i, g in zip(indices, grouped_allgather(values, process_set=_set_of_op(op))):
        results[i] = _scale(g, scale)
    return results


@tf.RegisterGradient("KerasRingGroupedAllgather")
def _grouped_allgather_grad(op, *grads):
    # As _allgather_grad, per tensor; one allgather finds every tensor's offset.
    indices, values = _differentiable(op, grads)
    results = [None] * len(op.inputs)
    if not indices:
        return results
    process_set = _set_of_op(op)
    summed = grouped_allreduce(values, op=Sum, process_set=process_set)
    rows = tf.stack([tf.shape(op.inputs[i], out_type=tf.int64)[0] for i in indices])
    gathered = allgather(rows[tf.newaxis], process_set=process_set)
    offsets = tf.reduce_sum(gathered[: describe(process_set)[2]], axis=0)
    for k, (i, g) in enumerate(zip(indices, summed)):
        results[i] = g[offsets[k] : offsets[k] + rows[k]]
    return results


@tf.RegisterGradient("KerasRingAlltoall")
def _alltoall_grad(op, grad, _received_splits_grad):
    # Each output row came from one row of one rank's input: the gradient
    # rows go back the way they came, received_splits[j] of them to rank j.
    if grad is None:
        return [None, None, None]
    set_id, set_size, _ = describe(_set_of_op(op))
    output, _ = _alltoall(tf.convert_to_tensor(grad), op.outputs[1], "", set_id, set_size)
    return [output, None, None]
