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
from keras_ring import _ops, _tf_build

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64]
OPS = [kr.Average, kr.Sum, kr.Min, kr.Max, kr.Product]
MODES = ["eager", "function"]


@pytest.fixture(autouse=True, scope="module")
def initialized():
    kr.init()


def run(mode, fn, *args):
    """Calls fn eagerly or as a tf.function."""
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


def sample(dtype, shape=(2, 3)):
    start = 0 if dtype == tf.uint8 else -3
    values = np.arange(start, start + np.prod(shape)).reshape(shape)
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
        return kr.grouped_allreduce([dense, slices, dense], op=kr.Sum, postscale_factor=2.0)

    dense = tf.constant([1.0, 2.0])
    values = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    indices = tf.constant([3, 7], tf.int64)
    first, slices, last = run(mode, fn, dense, values, indices)
    assert_equal(first, dense * 2)
    assert_equal(last, dense * 2)
    assert isinstance(slices, tf.IndexedSlices)
    assert_equal(slices.values, values * 2)
    assert_equal(slices.indices, indices)


def test_grouped_allreduce_of_nothing():
    assert kr.grouped_allreduce([]) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
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
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_broadcast_is_identity(dtype, mode):
    x = sample(dtype)
    assert_equal(run(mode, lambda t: kr.broadcast(t, root_rank=0), x), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [kr.Average, kr.Sum])
def test_allreduce_of_indexed_slices_gathers(op, mode):
    def fn(values, indices):
        slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([10], tf.int64))
        return kr.allreduce(slices, op=op, prescale_factor=3.0)

    values = tf.constant([1.0, 2.0])
    indices = tf.constant([4, 1], tf.int64)
    result = run(mode, fn, values, indices)
    assert isinstance(result, tf.IndexedSlices)
    assert_equal(result.values, values * 3)
    assert_equal(result.indices, indices)


@pytest.mark.parametrize("op", [kr.Min, kr.Max, kr.Product])
def test_allreduce_of_indexed_slices_rejects_nonlinear_ops(op):
    slices = tf.IndexedSlices(tf.ones([1]), tf.constant([0]))
    with pytest.raises(ValueError, match="Received: op="):
        kr.allreduce(slices, op=op)


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
            )

    graph = fn.get_concrete_function(x).graph
    names = sorted(
        (op.type, op.get_attr("tensor_name").decode())
        for op in graph.get_operations()
        if op.type.startswith("KerasRing")
    )
    assert names == [
        ("KerasRingAllgather", "scope/b"),
        ("KerasRingAllreduce", "a"),
        ("KerasRingAllreduce", "scope/a"),
        ("KerasRingBroadcast", "scope/c"),
        ("KerasRingGroupedAllreduce", "scope/a.group"),
    ]
    fn(x)
    with tf.name_scope("eager"):
        assert_equal(kr.allreduce(x, name="a"), x)


def test_average_is_a_deprecated_alias():
    x = tf.constant([1, 2, 3])
    with pytest.warns(DeprecationWarning, match="average"):
        assert_equal(kr.allreduce(x, average=False), x)
    with pytest.warns(DeprecationWarning, match="average"):
        assert_equal(kr.grouped_allreduce([x], average=True)[0], x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"op": 2}, "Received: op=2"),
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


@pytest.mark.parametrize("root_rank", [1, -1, 0.0, True, "0"])
def test_broadcast_root_rank_errors(root_rank):
    with pytest.raises(ValueError, match="Received: root_rank="):
        kr.broadcast(tf.ones([2]), root_rank=root_rank)


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="Received: name=3"):
        kr.allreduce(tf.ones([2]), name=3)


@pytest.mark.parametrize(
    "value", [[True, False], [1 + 2j], ["a"]], ids=["bool", "complex128", "string"]
)
def test_unsupported_dtypes(value):
    dtype = tf.constant(value).dtype.name
    calls = [
        lambda t: kr.allreduce(t),
        lambda t: kr.grouped_allreduce([tf.ones([1]), t]),
        lambda t: kr.allgather(t),
        lambda t: kr.broadcast(t, 0),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=f"dtype {dtype}"):
            call(tf.constant(value))


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
