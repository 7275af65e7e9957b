"""The TensorFlow collectives in one process (a job of size 1, no launcher).

With one rank every reduction is the identity up to the scale factors, which
makes the kernels, the Python API, the gradients and the argument checks
testable without MPI processes; tests/workers/tf_ops_worker.py checks the
values across ranks.
"""

import functools
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring.tensorflow import _build as _tf_build
from keras_ring.tensorflow import _ops

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64]
# Moved unchanged by allgather, broadcast and alltoall; not reduced.
MOVED_DTYPES = [tf.int16, tf.uint16, tf.bool]
OPS = [kr.Average, kr.Sum, kr.Min, kr.Max, kr.Product]
MODES = ["eager", "function"]


@pytest.fixture(autouse=True, scope="module")
def initialized():
    kr.init()


def run(mode, fn, *args):
    """Calls fn eagerly or as a tf.function."""
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


def sample(dtype, shape=(2, 3)):
    start = 0 if dtype in (tf.uint8, tf.uint16) else -3
    values = np.arange(start, start + np.prod(shape)).reshape(shape)
    if dtype == tf.bool:
        values = values % 3 == 0
    return tf.constant(values.astype(dtype.as_numpy_dtype))


def assert_equal(actual, expected):
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_is_identity_for_every_op(dtype, mode):
    x = sample(dtype)
    for op in OPS:
        assert_equal(run(mode, functools.partial(kr.allreduce, op=op), x), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_scales(dtype, mode):
    x = sample(dtype)
    actual = run(
        mode, lambda t: kr.allreduce(t, op=kr.Sum, prescale_factor=0.5, postscale_factor=3.0), x
    )
    if dtype.is_integer:
        # Each scaling truncates toward zero.
        expected = np.trunc(np.trunc(x.numpy() * 0.5) * 3.0).astype(dtype.as_numpy_dtype)
    else:
        expected = (x.numpy().astype(np.float64) * 1.5).astype(dtype.as_numpy_dtype)
    assert_equal(actual, tf.constant(expected))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(0,), (0, 4), (), (1,)])
def test_allreduce_shapes(shape, mode):
    x = tf.ones(shape)
    assert_equal(run(mode, kr.allreduce, x), x)


def test_allreduce_leaves_its_input_intact_in_place():
    @tf.function
    def fn(x):
        doubled = x * 2.0  # consumed only by the allreduce: may be reduced in place
        return x, kr.allreduce(doubled, op=kr.Sum, postscale_factor=0.5)

    x = tf.range(5.0)
    before, after = fn(x)
    assert_equal(before, x)
    assert_equal(after, x)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_mixed_dtypes(mode):
    tensors = [sample(dtype, shape=(i + 1,)) for i, dtype in enumerate(DTYPES)]
    for op in OPS:
        outputs = run(mode, functools.partial(kr.grouped_allreduce, op=op, name="g"), tensors)
        assert len(outputs) == len(tensors)
        for out, x in zip(outputs, tensors):
            assert_equal(out, x)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_with_indexed_slices(mode):
    def fn(dense, values, indices):
        slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([10, 2], tf.int64))
        return kr.grouped_allreduce([dense, slices, dense], op=kr.Sum)

    dense = tf.constant([1.0, 2.0])
    values = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    indices = tf.constant([3, 7], tf.int64)
    first, slices, last = run(mode, fn, dense, values, indices)
    assert_equal(first, dense)
    assert_equal(last, dense)
    assert isinstance(slices, tf.IndexedSlices)
    assert_equal(slices.values, values)
    assert_equal(slices.indices, indices)


def test_grouped_allreduce_scales_indexed_slices_for_the_optimizer_only():
    # As Horovod, the API refuses scale factors with tf.IndexedSlices; the
    # gradient reducer's predivide factor scales them as the dense tensors.
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([3], tf.int64))
    with pytest.raises(NotImplementedError, match="postscale_factor=2.0"):
        kr.grouped_allreduce([tf.ones([2]), slices], op=kr.Sum, postscale_factor=2.0)
    inputs = [tf.ones([2]), slices]
    none = kr.Compression.none
    dense, sparse = _ops._grouped_allreduce(
        inputs, kr.Sum, none, 0.5, 6.0, "g.scaled", kr.global_process_set
    )
    assert_equal(dense, tf.fill([2], 3.0))
    assert_equal(sparse.values, slices.values * 3)


def test_grouped_allreduce_of_nothing():
    assert kr.grouped_allreduce([]) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES + MOVED_DTYPES, ids=lambda d: d.name)
def test_allgather_is_identity(dtype, mode):
    for shape in [(2, 3), (0, 3), (5,)]:
        x = sample(dtype, shape)
        assert_equal(run(mode, kr.allgather, x), x)


def test_allgather_first_dimension_is_unknown_in_graphs():
    fn = tf.function(kr.allgather).get_concrete_function(tf.TensorSpec([4, 3], tf.float32))
    assert fn.structured_outputs.shape.as_list() == [None, 3]


def test_allgather_of_a_scalar_fails():
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1 or more"):
        kr.allgather(tf.constant(1.0))
    with pytest.raises(ValueError, match="rank"):
        tf.function(kr.allgather)(tf.constant(1.0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES + MOVED_DTYPES, ids=lambda d: d.name)
def test_broadcast_is_identity(dtype, mode):
    x = sample(dtype)
    assert_equal(run(mode, lambda t: kr.broadcast(t, root_rank=0), x), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reducescatter_is_identity_for_every_op(dtype, mode):
    for shape in [(2, 3), (0, 3), (1,), (5,)]:
        x = sample(dtype, shape)
        for op in OPS:
            assert_equal(run(mode, functools.partial(kr.reducescatter, op=op), x), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reducescatter_scales(dtype, mode):
    x = sample(dtype)
    actual = run(
        mode,
        lambda t: kr.reducescatter(t, op=kr.Sum, prescale_factor=0.5, postscale_factor=3.0),
        x,
    )
    if dtype.is_integer:
        expected = np.trunc(np.trunc(x.numpy() * 0.5) * 3.0).astype(dtype.as_numpy_dtype)
    else:
        expected = (x.numpy().astype(np.float64) * 1.5).astype(dtype.as_numpy_dtype)
    assert_equal(actual, tf.constant(expected))


def test_reducescatter_first_dimension_is_unknown_in_graphs():
    spec = tf.TensorSpec([4, 3], tf.float32)
    fn = tf.function(kr.reducescatter).get_concrete_function(spec)
    assert fn.structured_outputs.shape.as_list() == [None, 3]
    fn = tf.function(lambda t: kr.grouped_reducescatter([t, t[:, 0]])).get_concrete_function(spec)
    assert [t.shape.as_list() for t in fn.structured_outputs] == [[None, 3], [None]]


def test_reducescatter_of_a_scalar_fails():
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1 or more"):
        kr.reducescatter(tf.constant(1.0))
    with pytest.raises(ValueError, match="rank"):
        tf.function(kr.reducescatter)(tf.constant(1.0))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_reducescatter_mixed_dtypes(mode):
    tensors = [sample(dtype, shape=(i, 2)) for i, dtype in enumerate(DTYPES)]
    for op in OPS:
        outputs = run(
            mode,
            functools.partial(kr.grouped_reducescatter, op=op, postscale_factor=2.0, name="g"),
            tensors,
        )
        assert len(outputs) == len(tensors)
        for out, x in zip(outputs, tensors):
            assert_equal(out, x * 2)


def test_reducescatter_rejects_indexed_slices():
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]))
    with pytest.raises(TypeError, match=r"Received: tensor=tf.IndexedSlices .* shape \(1, 2\)"):
        kr.reducescatter(slices)
    with pytest.raises(TypeError, match=r"Received: tensors\[1\]=tf.IndexedSlices"):
        kr.grouped_reducescatter([tf.ones([2]), slices])


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_mixed_dtypes(mode):
    tensors = [sample(dtype, shape=(i, 2)) for i, dtype in enumerate(DTYPES)]
    outputs = run(mode, functools.partial(kr.grouped_allgather, name="g"), tensors)
    assert len(outputs) == len(tensors)
    for out, x in zip(outputs, tensors):
        assert_equal(out, x)


def test_grouped_allgather_first_dimensions_are_unknown_in_graphs():
    fn = tf.function(lambda a, b: kr.grouped_allgather([a, b])).get_concrete_function(
        tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([2], tf.int64)
    )
    assert [t.shape.as_list() for t in fn.structured_outputs] == [[None, 3], [None]]


@pytest.mark.parametrize("fn", [kr.grouped_allgather, kr.grouped_reducescatter])
def test_grouped_of_nothing(fn):
    assert fn([]) == []
    assert fn(()) == []


@pytest.mark.parametrize("fn", [kr.grouped_allgather, kr.grouped_reducescatter])
@pytest.mark.parametrize("tensors", [tf.ones([2, 2]), np.ones(2), 3, "ab"], ids=repr)
def test_grouped_needs_a_list(fn, tensors):
    with pytest.raises(TypeError, match="list of tensors. Received: tensors="):
        fn(tensors)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES + MOVED_DTYPES, ids=lambda d: d.name)
def test_alltoall_is_identity(dtype, mode):
    for shape in [(2, 3), (0, 3), (5,)]:
        x = sample(dtype, shape)
        # Without splits only the output is returned, as in Horovod.
        assert_equal(run(mode, kr.alltoall, x), x)
        out, received = run(mode, lambda t: kr.alltoall(t, splits=[shape[0]]), x)
        assert_equal(out, x)
        assert_equal(received, tf.constant([shape[0]], tf.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "splits",
    [[4], (4,), np.array([4], np.int64), tf.constant([4]), tf.constant([4], tf.int64)],
    ids=["list", "tuple", "numpy", "int32", "int64"],
)
def test_alltoall_splits_forms(splits, mode):
    x = tf.reshape(tf.range(8.0), [4, 2])
    out, received = run(mode, lambda t: kr.alltoall(t, splits=splits), x)
    assert_equal(out, x)
    assert_equal(received, tf.constant([4], tf.int32))


def test_alltoall_shapes_in_graphs():
    def fn(t, s):
        return kr.alltoall(t, splits=s)

    out, received = tf.function(fn).get_concrete_function(
        tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int32)
    ).structured_outputs
    assert out.shape.as_list() == [None, 3]
    assert received.shape.as_list() == [1]
    # The op alone knows the number of ranks only from the splits' length.
    library = _ops._library()
    received = tf.function(
        lambda t, s: library.keras_ring_alltoall(t, s, "")[1]
    ).get_concrete_function(
        tf.TensorSpec([4], tf.float32), tf.TensorSpec([None], tf.int32)
    ).structured_outputs
    assert received.shape.as_list() == [None]


def test_alltoall_with_splits_computed_in_a_graph():
    @tf.function
    def fn(t):
        return kr.alltoall(t, splits=tf.shape(t)[:1])

    out, received = fn(tf.ones([3, 2]))
    assert_equal(out, tf.ones([3, 2]))
    assert_equal(received, tf.constant([3], tf.int32))


@pytest.mark.parametrize(
    "splits, error, match",
    [
        ([], ValueError, r"one entry per rank \(1\). Received: splits=\[\]"),
        ([2, 2], ValueError, r"one entry per rank \(1\). Received: splits=\[2, 2\]"),
        ([-4], ValueError, r"no negative entries. Received: splits=\[-4\]"),
        ([3], ValueError, r"add up to the first dimension of `tensor`, 4. Received: splits=\[3\]"),
        ([[4]], ValueError, r"vector \(rank 1\). Received: splits with shape \(1, 1\)"),
        (4, ValueError, r"vector \(rank 1\). Received: splits with shape \(\)"),
        ([4.0], TypeError, "integers. Received: splits with dtype=float32"),
        ([True], TypeError, "integers. Received: splits with dtype=bool"),
        ("4", TypeError, "integers. Received: splits with dtype=string"),
        ([2**40], ValueError, r"at most 2147483647. Received: splits=\[1099511627776\]"),
    ],
)
def test_alltoall_splits_errors(splits, error, match):
    with pytest.raises(error, match=match):
        kr.alltoall(tf.ones([4, 2]), splits=splits)
    with pytest.raises(error, match=match):
        tf.function(lambda t: kr.alltoall(t, splits=splits))(tf.ones([4, 2]))


def test_alltoall_splits_of_a_known_length_are_checked_when_tracing():
    fn = tf.function(lambda t, s: kr.alltoall(t, splits=s))
    with pytest.raises(ValueError, match=r"one entry per rank \(1\). .* shape \(2,\)"):
        fn.get_concrete_function(tf.TensorSpec([4]), tf.TensorSpec([2], tf.int32))


def test_alltoall_splits_known_only_when_running_are_checked_by_the_engine():
    fn = tf.function(
        lambda t, s: kr.alltoall(t, splits=s, name="a2a.bad"),
        input_signature=[tf.TensorSpec([4, 2]), tf.TensorSpec(None, tf.int32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(tf.ones([4, 2]), tf.constant([3]))
    assert "'a2a.bad'" in info.value.message
    assert "splits must add up to the first dimension" in info.value.message
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(tf.ones([4, 2]), tf.constant([[4]]))
    assert "'a2a.bad'" in info.value.message and "splits must be a vector" in info.value.message
    assert_equal(fn(tf.ones([4, 2]), tf.constant([4]))[0], tf.ones([4, 2]))


def test_alltoall_of_a_scalar_fails():
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1 or more"):
        kr.alltoall(tf.constant(1.0))
    with pytest.raises(ValueError, match="rank"):
        tf.function(kr.alltoall)(tf.constant(1.0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [kr.Average, kr.Sum])
def test_allreduce_of_indexed_slices_gathers(op, mode):
    def fn(values, indices):
        slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([10], tf.int64))
        return kr.allreduce(slices, op=op)

    values = tf.constant([1.0, 2.0])
    indices = tf.constant([4, 1], tf.int64)
    result = run(mode, fn, values, indices)
    assert isinstance(result, tf.IndexedSlices)
    assert_equal(result.values, values)
    assert_equal(result.indices, indices)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype, averaged", [(tf.int32, tf.float64), (tf.uint8, tf.float32), (tf.float16, tf.float16)]
)
def test_average_of_indexed_slices_divides_truly(dtype, averaged, mode):
    # As Horovod: integer values become floating point (TF's true division).
    slices = tf.IndexedSlices(tf.constant([3, 5], dtype), tf.constant([0, 1]))
    result = run(mode, functools.partial(kr.allreduce, op=kr.Average), slices)
    assert_equal(result.values, tf.constant([3, 5], averaged))


@pytest.mark.parametrize("op", [kr.Min, kr.Max, kr.Product])
def test_allreduce_of_indexed_slices_rejects_nonlinear_ops(op):
    slices = tf.IndexedSlices(tf.ones([1]), tf.constant([0]))
    with pytest.raises(NotImplementedError, match="Received: op="):
        kr.allreduce(slices, op=op)
    with pytest.raises(NotImplementedError, match="Received: op="):
        kr.grouped_allreduce([tf.ones([1]), slices], op=op)


@pytest.mark.parametrize("scale", ["prescale_factor", "postscale_factor"])
def test_allreduce_of_indexed_slices_rejects_scale_factors(scale):
    slices = tf.IndexedSlices(tf.ones([1]), tf.constant([0]))
    with pytest.raises(NotImplementedError, match=f"{scale}=0.5"):
        kr.allreduce(slices, op=kr.Sum, **{scale: 0.5})


ADASUM_REFUSED = r"Adasum is not offered by keras-ring: use op=keras_ring.Average"


@pytest.mark.parametrize(
    "collective",
    [
        lambda: kr.allreduce(tf.ones([2]), op=kr.Adasum),
        lambda: kr.allreduce(tf.IndexedSlices(tf.ones([1]), tf.constant([0])), op=kr.Adasum),
        lambda: kr.grouped_allreduce([tf.ones([2])], op=kr.Adasum),
        lambda: kr.reducescatter(tf.ones([2]), op=kr.Adasum),
        lambda: kr.grouped_reducescatter([tf.ones([2])], op=kr.Adasum),
    ],
    ids=["allreduce", "allreduce_slices", "grouped_allreduce", "reducescatter",
         "grouped_reducescatter"],
)
def test_adasum_is_refused(collective):
    with pytest.raises(NotImplementedError, match=ADASUM_REFUSED):
        collective()


def gradient(mode, fn, x, upstream):
    """d sum(fn(x) * upstream) / dx, eagerly or in a tf.function."""

    def compute(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x, output_gradients=upstream)

    return run(mode, compute, x)


@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    w = tf.constant([[0.5, -1.0], [2.0, 3.0]])
    def scaled(t):
        return kr.allreduce(t, op=kr.Sum, prescale_factor=2.0, postscale_factor=3.0)

    assert_equal(gradient(mode, scaled, x, w), w * 6)
    assert_equal(gradient(mode, kr.allreduce, x, w), w)
    assert_equal(gradient(mode, kr.allgather, x, w), w)
    assert_equal(gradient(mode, lambda t: kr.broadcast(t, 0), x, w), w)


@pytest.mark.parametrize("mode", MODES)
def test_new_collective_gradients(mode):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w = tf.constant([[0.5, -1.0], [2.0, 3.0], [-4.0, 0.25]])

    def scaled(t):
        return kr.reducescatter(t, op=kr.Sum, prescale_factor=2.0, postscale_factor=3.0)

    def grouped_scaled(t):
        return kr.grouped_reducescatter([t, t], op=kr.Average, postscale_factor=0.5)[1]

    assert_equal(gradient(mode, scaled, x, w), w * 6)
    assert_equal(gradient(mode, kr.reducescatter, x, w), w)
    assert_equal(gradient(mode, grouped_scaled, x, w), w * 0.5)
    assert_equal(gradient(mode, lambda t: kr.grouped_allgather([t, t])[0], x, w), w)
    assert_equal(gradient(mode, kr.alltoall, x, w), w)
    assert_equal(gradient(mode, lambda t: kr.alltoall(t, splits=[3])[0], x, w), w)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_gradients_of_new_collectives_skip_integer_outputs(mode):
    def compute(a, b, n):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            ya, yn, yb = kr.grouped_reducescatter([a, n, b], op=kr.Sum, postscale_factor=2.0)
            za, zn, zb = kr.grouped_allgather([a, n, b])
            loss = (
                tf.reduce_sum(ya)
                + tf.reduce_sum(zb * 3.0)
                + tf.cast(tf.reduce_sum(yn) + tf.reduce_sum(zn), tf.float64)
            )
        return tape.gradient(loss, [a, b])

    a, b = tf.constant([1.0, 2.0], tf.float64), tf.constant([[3.0], [4.0]], tf.float64)
    grad_a, grad_b = run(mode, compute, a, b, tf.constant([5, 6]))
    assert_equal(grad_a, tf.constant([2.0, 2.0], tf.float64))
    assert_equal(grad_b, tf.fill([2, 1], tf.constant(3.0, tf.float64)))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_gradients_skip_integer_outputs(mode):
    def compute(a, b, n):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            ya, yn, yb = kr.grouped_allreduce([a, n, b], op=kr.Sum, postscale_factor=2.0)
            loss = (
                tf.reduce_sum(ya) + tf.reduce_sum(yb * b) + tf.cast(tf.reduce_sum(yn), tf.float32)
            )
        return tape.gradient(loss, [a, b])

    a, b = tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])
    grad_a, grad_b = run(mode, compute, a, b, tf.constant([5, 6]))
    assert_equal(grad_a, tf.constant([2.0, 2.0]))
    # yb = 2b, so d(yb * b)/db = 2 * b (through yb) + yb (directly) = 4b.
    assert_equal(grad_b, b * 4)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_of_sparse_upstream(mode):
    x = tf.constant([1.0, 2.0, 3.0])
    grad = gradient(
        mode,
        lambda t: tf.gather(kr.allreduce(t, op=kr.Sum), [2, 0, 2]),
        x,
        tf.constant([1.0, 10.0, 100.0]),
    )
    assert_equal(tf.convert_to_tensor(grad), tf.constant([10.0, 0.0, 101.0]))


@pytest.mark.parametrize("op", [kr.Min, kr.Max, kr.Product])
def test_gradient_of_nonlinear_ops_is_undefined(op):
    x = tf.constant([1.0, 2.0])
    with pytest.raises(LookupError, match="No gradient"):
        gradient("eager", lambda t: kr.allreduce(t, op=op), x, x)
    with pytest.raises(LookupError, match="No gradient"):
        gradient("eager", lambda t: kr.grouped_allreduce([t], op=op)[0], x, x)
    with pytest.raises(LookupError, match="No gradient.*reducescatter"):
        gradient("eager", lambda t: kr.reducescatter(t, op=op), x, x)
    with pytest.raises(LookupError, match="No gradient.*grouped_reducescatter"):
        gradient("eager", lambda t: kr.grouped_reducescatter([t], op=op)[0], x, x)


def test_names():
    x = tf.ones([2])

    @tf.function
    def fn(x):
        with tf.name_scope("scope"):
            return (
                kr.allreduce(x, name="a"),
                kr.allreduce(x, name="a", ignore_name_scope=True),
                kr.grouped_allreduce([x, x], name="a.group"),
                kr.allgather(x, name="b"),
                kr.broadcast(x, 0, name="c"),
                kr.grouped_allgather([x], name="d"),
                kr.reducescatter(x, name="e"),
                kr.grouped_reducescatter([x], name="f", ignore_name_scope=True),
                kr.alltoall(x, name="g"),
            )

    graph = fn.get_concrete_function(x).graph
    names = sorted(
        (op.type, tf.get_static_value(op.inputs[-1]).item().decode())
        for op in graph.get_operations()
        if op.type.startswith("KerasRing")
    )
    assert names == [
        ("KerasRingAllgather", "scope/b"),
        ("KerasRingAllreduce", "a"),
        ("KerasRingAllreduce", "scope/a"),
        ("KerasRingAlltoall", "scope/g"),
        ("KerasRingBroadcast", "scope/c"),
        ("KerasRingGroupedAllgather", "scope/d"),
        ("KerasRingGroupedAllreduce", "scope/a.group"),
        ("KerasRingGroupedReducescatter", "f"),
        ("KerasRingReducescatter", "scope/e"),
    ]
    fn(x)
    with tf.name_scope("eager"):
        assert_equal(kr.allreduce(x, name="a"), x)
        assert_equal(kr.alltoall(x, name="a"), x)


def test_average_is_a_deprecated_alias():
    x = tf.constant([1, 2, 3])
    with pytest.warns(DeprecationWarning, match="average"):
        assert_equal(kr.allreduce(x, average=False), x)
    with pytest.warns(DeprecationWarning, match="average"):
        assert_equal(kr.grouped_allreduce([x], average=True)[0], x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"op": 7}, "Received: op=7"),
        ({"op": "sum"}, "Received: op='sum'"),
        ({"op": True}, "Received: op=True"),
        ({"op": kr.Sum, "average": True}, "Received: op=1, average=True"),
        ({"compression": "fp16"}, "Received: compression='fp16'"),
        ({"prescale_factor": "x"}, "Received: prescale_factor='x'"),
        ({"postscale_factor": None}, "Received: postscale_factor=None"),
    ],
)
def test_reduce_argument_errors(kwargs, match):
    for fn in (kr.allreduce, lambda t, **kw: kr.grouped_allreduce([t], **kw)):
        with pytest.raises(ValueError, match=match):
            fn(tf.ones([2]), **kwargs)
    if "average" in kwargs:
        return  # reducescatter has no `average`, as in Horovod
    for fn in (kr.reducescatter, lambda t, **kw: kr.grouped_reducescatter([t], **kw)):
        with pytest.raises(ValueError, match=match):
            fn(tf.ones([2]), **kwargs)


@pytest.mark.parametrize("compression", [None, kr.Compression.none, kr.Compression.fp16,
                                         kr.Compression.bf16])
def test_compression_sends_a_narrower_type_and_returns_the_input_type(compression):
    x = tf.constant([1.5, -2.25, 3.0])
    for reduce in (lambda t: kr.allreduce(t, compression=compression),
                   lambda t: kr.grouped_allreduce([t], compression=compression)[0],
                   lambda t: kr.reducescatter(t, compression=compression),
                   lambda t: kr.grouped_reducescatter([t], compression=compression)[0]):
        got = reduce(x)
        assert got.dtype == tf.float32
        assert_equal(got, x)  # exact in float16 and bfloat16
    # Integers travel as they are.
    assert_equal(kr.allreduce(tf.constant([7]), compression=compression), tf.constant([7]))


def test_process_set_must_be_a_registered_process_set():
    with pytest.raises(TypeError, match="must be a keras_ring.ProcessSet"):
        kr.allreduce(tf.ones([2]), process_set=[0])
    with pytest.raises(ValueError, match="add_process_set"):
        kr.allgather(tf.ones([2]), process_set=kr.ProcessSet([0]))
    solo = kr.add_process_set([0])
    try:
        assert_equal(kr.allreduce(tf.ones([2]), process_set=solo), tf.ones([2]))
        assert_equal(kr.alltoall(tf.ones([2]), splits=[2], process_set=solo)[1], tf.constant([2]))
    finally:
        kr.remove_process_set(solo)


@pytest.mark.parametrize("root_rank", [1, -1, 0.0, True, "0"])
def test_broadcast_root_rank_errors(root_rank):
    with pytest.raises(ValueError, match="Received: root_rank="):
        kr.broadcast(tf.ones([2]), root_rank=root_rank)


def test_name_must_be_a_string():
    for call in [
        lambda: kr.allreduce(tf.ones([2]), name=3),
        lambda: kr.reducescatter(tf.ones([2]), name=3),
        lambda: kr.grouped_reducescatter([tf.ones([2])], name=3),
        lambda: kr.grouped_allgather([tf.ones([2])], name=3),
        lambda: kr.alltoall(tf.ones([2]), name=3),
    ]:
        with pytest.raises(TypeError, match="Received: name=3"):
            call()


@pytest.mark.parametrize("value", [[1 + 2j], ["a"]], ids=["complex128", "string"])
def test_unsupported_dtypes(value):
    dtype = tf.constant(value).dtype.name
    calls = [
        lambda t: kr.allreduce(t),
        lambda t: kr.grouped_allreduce([tf.ones([1]), t]),
        lambda t: kr.allgather(t),
        lambda t: kr.broadcast(t, 0),
        lambda t: kr.grouped_allgather([tf.ones([1]), t]),
        lambda t: kr.reducescatter(t),
        lambda t: kr.grouped_reducescatter([tf.ones([1]), t]),
        lambda t: kr.alltoall(t),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=f"dtype {dtype}"):
            call(tf.constant(value))


@pytest.mark.parametrize("dtype", MOVED_DTYPES, ids=lambda d: d.name)
def test_reductions_refuse_the_dtypes_that_are_only_moved(dtype):
    calls = [
        lambda t: kr.allreduce(t),
        lambda t: kr.grouped_allreduce([tf.ones([1]), t]),
        lambda t: kr.reducescatter(t),
        lambda t: kr.grouped_reducescatter([tf.ones([1]), t]),
    ]
    match = (
        f"does not support dtype {dtype.name}: reductions take float16, .*, int64; "
        "int16, uint16, bool only allgather, broadcast and alltoall"
    )
    for call in calls:
        with pytest.raises(TypeError, match=match):
            call(sample(dtype))


def test_engine_errors_reach_python_verbatim():
    library = _ops._library()
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        library.keras_ring_allreduce(
            tf.ones([2]),
            reduce_op=2,
            prescale_factor=1.0,
            postscale_factor=1.0,
            tensor_name="bad.op",
        )
    # The engine's own words, naming the tensor.
    assert "'bad.op'" in info.value.message and "reduce op 2" in info.value.message


def test_compile_errors_explain_what_to_do(tmp_path, monkeypatch):
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'fatal error: no such header' >&2\nexit 3\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("KERAS_RING_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="(?s)exit code 3.*no such header.*keras-ring-build"):
        _tf_build.build()
    assert not any(_tf_build.library_path().parent.glob("*.so"))


def test_missing_compiler_is_explained(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _tf_build.library_path()


def test_cache_key_follows_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_RING_CACHE_DIR", str(tmp_path))
    default = _tf_build.library_path()
    assert default.parent.parent == tmp_path
    assert default.parent.name.startswith(f"tf-{tf.__version__}-")
    monkeypatch.setenv("CXX", "c++ -O1")
    assert _tf_build.library_path() != default


def test_stale_library_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_RING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_tf_build, "_loaded", None)
    # A cached library whose symbols this TensorFlow lacks, as after an ABI change.
    target = _tf_build.library_path()
    target.parent.mkdir(parents=True)
    source = tmp_path / "stale.cc"
    source.write_text('extern "C" void gone(); extern "C" void f() { gone(); }')
    subprocess.run(["c++", "-shared", "-fPIC", source, "-o", target], check=True)
    with pytest.raises(RuntimeError, match="(?s)undefined symbol.*stale.*keras-ring-build"):
        _tf_build.load()


def test_load_returns_one_module():
    assert _tf_build.load() is _tf_build.load()


# Last: it shuts keras-ring down and starts it again.
def test_errors_when_not_initialized():
    x = tf.ones([2])
    allreduce = tf.function(kr.allreduce).get_concrete_function(x)
    kr.shutdown()
    try:
        for call in [
            lambda: kr.allreduce(x),
            lambda: kr.grouped_allreduce([x]),
            lambda: kr.allgather(x),
            lambda: kr.broadcast(x, 0),
            lambda: kr.grouped_allgather([x]),
            lambda: kr.reducescatter(x),
            lambda: kr.grouped_reducescatter([x]),
            lambda: kr.alltoall(x),
        ]:
            with pytest.raises(ValueError, match="init\\(\\)"):
                call()
        # A graph traced before shutdown reaches the engine, which refuses.
        with pytest.raises(tf.errors.FailedPreconditionError, match="not initialised"):
            allreduce(x)
    finally:
        kr.init()
    assert_equal(allreduce(x), x)


def test_broadcast_variables_assigns_tf_and_keras_variables():
    kr.init()
    tf_var = tf.Variable([1.0, 2.0])
    keras_var = keras.Variable(np.ones((2, 2), "float32"))
    kr.broadcast_variables([tf_var, keras_var], root_rank=0)
    np.testing.assert_array_equal(tf_var.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(keras_var.numpy(), np.ones((2, 2)))
    with pytest.raises(ValueError, match="Received: root_rank=1"):
        kr.broadcast_variables([tf_var], root_rank=1)


def test_horovods_build_checks_and_topology_ops():
    for check in (kr.gloo_built, kr.gloo_enabled, kr.ccl_built, kr.ddl_built, kr.rocm_built):
        assert check() is False and check.__name__ in kr.__all__
    ops = tf.function(lambda: [kr.size_op(), kr.rank_op(), kr.local_size_op(),
                               kr.local_rank_op(), kr.process_set_included_op()])
    assert [int(t) for t in ops()] == [1, 0, 1, 0, 1]


def test_broadcast_global_variables_is_refused_eagerly():
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        kr.broadcast_global_variables(0)
