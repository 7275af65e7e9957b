"""DistributedOptimizer, DistributedGradientTape, Compression and load_model in one process.

A job of size 1: every reduction is the identity, so a distributed optimizer
must train exactly as the plain one. That checks the wrapping of each kind of
optimizer, saving, mixed precision, the guards and the argument checks
without MPI processes; tests/workers/keras_equivalence_worker.py checks the
values across ranks.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr

BATCH = 8
STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def initialized():
    kr.init()


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


class ScaledSGD(keras.optimizers.SGD):
    """A user's optimizer: SGD whose steps are scaled, with a config key of its own."""

    def __init__(self, scale=0.5, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate * self.scale)

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


@keras.saving.register_keras_serializable(package="keras_ring_tests")
class RegisteredSGD(ScaledSGD):
    """The same, registered, so that Keras finds it when loading."""


# Fixed names: Keras numbers automatic ones, and configs are compared.
OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1, momentum=0.9, name="opt"),
    "Adam": lambda: keras.optimizers.Adam(0.01, name="opt"),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, name="opt"),
    "LossScaleOptimizer": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, name="inner"), name="opt"
    ),
    "subclass": lambda: ScaledSGD(learning_rate=0.1, name="opt"),
}


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
    return x, rng.normal(size=(STEPS * BATCH, 1)).astype("float32")


def train(optimizer, batch_size=BATCH, **compile_args):
    model = build_model()
    model.compile(optimizer=optimizer, loss="mse", **compile_args)
    model.fit(*data(), batch_size=batch_size, shuffle=False, verbose=0)
    return model


def assert_same_state(model, expected):
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    got = [v.numpy() for v in model.optimizer.variables]
    want = [v.numpy() for v in expected.optimizer.variables]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


# Wrapping


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_wraps_in_place_and_trains_as_the_plain_optimizer(kind):
    optimizer = OPTIMIZERS[kind]()
    base = type(optimizer)
    distributed = kr.DistributedOptimizer(optimizer)
    assert distributed is optimizer
    assert type(distributed).__name__ == f"Distributed{base.__name__}"
    assert isinstance(distributed, base)
    # What Keras's serialisation sees.
    assert distributed.__class__ is base
    assert_same_state(train(distributed), train(OPTIMIZERS[kind]()))


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_adds_no_config_keys_and_no_variables(kind):
    plain = train(OPTIMIZERS[kind]()).optimizer
    # Even with local accumulation, which keeps its sums out of Keras's sight.
    distributed = train(
        kr.DistributedOptimizer(OPTIMIZERS[kind](), backward_passes_per_step=2),
        batch_size=BATCH // 2,
    ).optimizer
    assert keras.saving.serialize_keras_object(distributed) == (
        keras.saving.serialize_keras_object(plain)
    )

    def variables(optimizer):
        return [(tuple(v.shape), v.dtype) for v in optimizer.variables]

    assert variables(distributed) == variables(plain)


def test_refuses_what_is_not_a_keras_optimizer():
    with pytest.raises(TypeError, match=r"Received: optimizer='adam'$"):
        kr.DistributedOptimizer("adam")


def test_refuses_to_distribute_twice():
    optimizer = kr.DistributedOptimizer(keras.optimizers.SGD(name="twice"))
    with pytest.raises(ValueError, match=r"already distributed. Received: optimizer='twice'$"):
        kr.DistributedOptimizer(optimizer)


# Argument checks, shared by the optimizer and the tape.

INVALID = [
    ({"op": kr.Max}, "op=Max"),
    ({"op": True}, "op=True"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor=0.0"),
    ({"gradient_predivide_factor": "2"}, "gradient_predivide_factor='2'"),
    ({"gradient_predivide_factor": 2.0, "op": kr.Sum}, "gradient_predivide_factor=2.0, op=Sum"),
    ({"compression": "fp16"}, "compression='fp16'"),
    ({"sparse_as_dense": 1}, "sparse_as_dense=1"),
    ({"groups": 0}, "groups=0"),
    ({"groups": [1, 2]}, "groups=[1, 2]"),
    ({"num_groups": -1}, "num_groups=-1"),
    ({"groups": 2, "num_groups": 2}, "groups=2, num_groups=2"),
    ({"process_set": "all"}, "process_set='all'"),
    ({"device_dense": None}, "device_dense=None"),
]
INVALID_FOR_OPTIMIZER = [
    ({"name": ""}, "name=''"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step=0"),
    ({"backward_passes_per_step": True}, "backward_passes_per_step=True"),
    ({"average_aggregated_gradients": 1}, "average_aggregated_gradients=1"),
]


def received(shown):
    return rf"Received: {re.escape(shown)}$"


@pytest.mark.parametrize(
    "kwargs, shown", INVALID + INVALID_FOR_OPTIMIZER, ids=lambda v: str(v)[:40]
)
def test_optimizer_arguments_are_checked(kwargs, shown):
    optimizer = keras.optimizers.SGD()
    with pytest.raises(ValueError, match=received(shown)):
        kr.DistributedOptimizer(optimizer, **kwargs)
    # Checked before the optimizer is changed.
    assert type(optimizer) is keras.optimizers.SGD


@pytest.mark.parametrize("kwargs, shown", INVALID, ids=lambda v: str(v)[:40])
def test_tape_arguments_are_checked(kwargs, shown):
    with pytest.raises(ValueError, match=received(shown)):
        kr.DistributedGradientTape(tf.GradientTape(), **kwargs)


def test_adasum_is_refused():
    refused = "Adasum is not offered by keras-ring: use op=keras_ring.Average"
    with pytest.raises(NotImplementedError, match=refused):
        kr.DistributedOptimizer(keras.optimizers.SGD(), op=kr.Adasum)
    with pytest.raises(NotImplementedError, match=refused):
        kr.DistributedGradientTape(tf.GradientTape(), op=kr.Adasum)


def test_bucket_bytes_setting_is_checked(monkeypatch):
    monkeypatch.setenv("KERAS_RING_BUCKET_BYTES", "4MiB")
    v = tf.Variable(1.0)
    with tf.GradientTape() as plain:
        loss = v * 2.0
    tape = kr.DistributedGradientTape(plain)
    with pytest.raises(ValueError, match="KERAS_RING_BUCKET_BYTES must be a number of bytes"):
        tape.gradient(loss, [v])


# Saving and loading


def test_saved_model_loads_without_keras_ring(tmp_path):
    model = train(kr.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert_same_state(loaded, model)


def test_registered_subclass_loads_without_keras_ring(tmp_path):
    model = train(kr.DistributedOptimizer(RegisteredSGD(learning_rate=0.1, scale=0.25)))
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer) is RegisteredSGD
    assert loaded.optimizer.scale == 0.25
    assert_same_state(loaded, model)


def test_load_model_distributes_and_keeps_the_state(tmp_path):
    model = train(kr.DistributedOptimizer(ScaledSGD(learning_rate=0.1, momentum=0.9)))
    model.save(tmp_path / "model.keras")
    restored = kr.load_model(
        tmp_path / "model.keras",
        custom_optimizers=[ScaledSGD],
        compression=kr.Compression.fp16,
    )
    assert type(restored.optimizer).__name__ == "DistributedScaledSGD"
    assert_same_state(restored, model)
    # Training goes on from the saved state, as with the model in memory.
    restored.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    model.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    for got, want in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)  # fp16 on the wire


def test_load_model_finds_custom_optimizers_under_their_registered_name(tmp_path, monkeypatch):
    model = train(kr.DistributedOptimizer(RegisteredSGD(learning_rate=0.1, scale=0.25)))
    model.save(tmp_path / "model.keras")
    # As where Keras has no registration to go by: it looks for "keras_ring_tests>RegisteredSGD".
    name = keras.saving.get_registered_name(RegisteredSGD)
    assert name == "keras_ring_tests>RegisteredSGD"
    monkeypatch.delitem(keras.saving.get_custom_objects(), name)
    restored = kr.load_model(tmp_path / "model.keras", custom_optimizers=[RegisteredSGD])
    assert type(restored.optimizer).__name__ == "DistributedRegisteredSGD"
    assert restored.optimizer.scale == 0.25
    assert_same_state(restored, model)


def test_load_model_keeps_the_loss_scale_inside(tmp_path, mixed_float16):
    train(kr.DistributedOptimizer(keras.optimizers.Adam())).save(tmp_path / "model.keras")
    optimizer = kr.load_model(tmp_path / "model.keras").optimizer
    assert type(optimizer).__name__ == "DistributedLossScaleOptimizer"
    assert type(optimizer.inner_optimizer) is keras.optimizers.Adam


# Mixed precision


def test_compile_leaves_the_loss_scale_inside(mixed_float16):
    optimizer = kr.DistributedOptimizer(keras.optimizers.Adam(name="adam"))
    model = train(optimizer)
    assert model.optimizer is optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert type(optimizer).__name__ == "DistributedLossScaleOptimizer"
    assert type(optimizer.inner_optimizer) is keras.optimizers.Adam
    assert int(optimizer.iterations.numpy()) == STEPS


def test_wraps_a_loss_scale_optimizer_from_outside():
    loss_scale = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    assert kr.DistributedOptimizer(loss_scale) is loss_scale
    assert type(loss_scale.inner_optimizer) is keras.optimizers.Adam


def test_broadcast_callback_refuses_a_loss_scale_put_around_ours_by_compile():
    # The model's own dtype policy (not the global one) makes compile() wrap
    # its loss scale around the distributed optimizer: one rank could then
    # skip a step alone, so training must not start.
    kr.init()

    class MixedModel(keras.Model):
        def __init__(self):
            super().__init__(dtype="mixed_float16")
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = MixedModel()
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x = np.zeros((8, 4), "float32")
    with pytest.raises(ValueError, match="LossScaleOptimizer wraps a distributed optimizer"):
        model.fit(x, x[:, :1], epochs=1, verbose=0,
                  callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])


def test_adds_no_loss_scale_without_mixed_float16():
    optimizer = kr.DistributedOptimizer(keras.optimizers.Adam())
    assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def test_refuses_a_loss_scale_optimizer_around_a_distributed_one():
    inside = keras.optimizers.LossScaleOptimizer(
        kr.DistributedOptimizer(keras.optimizers.Adam()), name="outer"
    )
    with pytest.raises(ValueError, match=r"Wrap the other way round.*Received: optimizer='outer'$"):
        kr.DistributedOptimizer(inside)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_non_finite_gradients_skip_the_step(mode):
    variable = keras.Variable([1.0, 2.0])
    optimizer = kr.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    )

    def apply(grad):
        optimizer.apply([grad], [variable])

    apply = tf.function(apply) if mode == "function" else apply
    apply(tf.constant([np.nan, 1.0]))
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    assert float(optimizer.dynamic_scale.numpy()) == 2.0
    apply(tf.constant([2.0, 4.0]))  # unscaled by 2: a step of [1, 2]
    np.testing.assert_array_equal(variable.numpy(), [0.0, 0.0])
    assert int(optimizer.iterations.numpy()) == 1


# Local accumulation


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("average, step", [(True, 2.0), (False, 6.0)])
def test_backward_passes_per_step_updates_every_nth_pass(mode, average, step):
    variable = keras.Variable([10.0, 20.0])
    optimizer = kr.DistributedOptimizer(
        keras.optimizers.SGD(1.0),
        backward_passes_per_step=3,
        average_aggregated_gradients=average,
    )

    def apply(grad):
        optimizer.apply([grad], [variable])

    apply = tf.function(apply) if mode == "function" else apply
    for n in (1.0, 2.0, 3.0):
        np.testing.assert_array_equal(variable.numpy(), [10.0, 20.0])
        apply(tf.constant([n, n]))
    np.testing.assert_array_equal(variable.numpy(), [10.0 - step, 20.0 - step])
    # Iterations count batches (passes), as Horovod's.
    assert int(optimizer.iterations.numpy()) == 3


def test_backward_passes_match_a_larger_batch_counted_in_batches():
    passes = kr.DistributedOptimizer(
        keras.optimizers.Adam(0.01), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    model = train(passes, batch_size=BATCH // 2)
    # Adam at twice the batch, its step count (which its bias correction
    # reads) advanced by the pass that only accumulated.
    reference = build_model()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    skipped_pass = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: reference.optimizer.iterations.assign_add(1)
    )
    reference.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[skipped_pass])
    assert_same_state(model, reference)
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


@pytest.mark.parametrize("average", [True, False])
def test_backward_passes_count_batches_as_horovod(average):
    # Horovod's test_gradient_aggregation in Keras 3: an optimizer that adds
    # the gradient, a sparse gradient made dense, ten batches of four passes.
    class AddGradient(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_add(gradient)

    passes = 4
    optimizer = kr.DistributedOptimizer(
        AddGradient(learning_rate=0.1),
        backward_passes_per_step=passes,
        average_aggregated_gradients=average,
        sparse_as_dense=True,
    )
    x, y = keras.Variable([0.0]), keras.Variable([1.0, 2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = x - tf.gather(y, [0])  # d/dx = 1, d/dy = [-1, 0] as IndexedSlices
        optimizer.apply(tape.gradient(loss, [x, y]), [x, y])

    for batch in range(10):
        step()
        change = (batch + 1) // passes * (1 if average else passes)
        np.testing.assert_array_equal(x.numpy(), [change])
        np.testing.assert_array_equal(y.numpy(), [1.0 - change, 2.0])
        assert int(optimizer.iterations.numpy()) == batch + 1


def test_learning_rate_schedules_see_batches():
    # Updates at batches 1 and 3 (two passes each): rates schedule(1) and schedule(3).
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [1.0, 0.5])
    variable = keras.Variable([0.0])
    optimizer = kr.DistributedOptimizer(
        keras.optimizers.SGD(schedule), backward_passes_per_step=2
    )
    for _ in range(4):
        optimizer.apply([tf.constant([1.0])], [variable])
    np.testing.assert_array_equal(variable.numpy(), [-(2.0 * 1.0 + 2.0 * 0.5)])


def test_refuses_two_kinds_of_accumulation():
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=received(
        "backward_passes_per_step=2, gradient_accumulation_steps=2"
    )):
        kr.DistributedOptimizer(optimizer, backward_passes_per_step=2)
    kr.DistributedOptimizer(optimizer)


def test_variables_of_the_build_serve_apply_without_variables():
    variable = keras.Variable([1.0])
    optimizer = kr.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    optimizer.build([variable])
    optimizer.apply([tf.constant([1.0])])
    optimizer.apply([tf.constant([1.0])])
    np.testing.assert_array_equal(variable.numpy(), [-1.0])


@pytest.mark.parametrize(
    "options",
    [
        lambda variable: {"backward_passes_per_step": 2},
        lambda variable: {"groups": [[variable]]},
    ],
    ids=["backward_passes_per_step", "groups"],
)
def test_apply_without_variables_explains_what_it_needs(options):
    variable = keras.Variable([1.0])
    plain = keras.optimizers.SGD(1.0)
    plain.build([variable])  # built before it was distributed: its variables are unknown
    optimizer = kr.DistributedOptimizer(plain, **options(variable))
    with pytest.raises(ValueError, match="needs the variables of the gradients"):
        optimizer.apply([tf.constant([1.0])])
    optimizer.apply([tf.constant([1.0])], [variable])


def test_groups_and_two_optimizers_in_one_step():
    model = build_model()
    kernels = model.trainable_variables[::2]
    other = build_model()
    # A predivide factor (a power of two: exact) makes one rank run the
    # collectives, which it skips otherwise.
    first = kr.DistributedOptimizer(
        keras.optimizers.SGD(0.1), groups=[kernels], gradient_predivide_factor=2.0
    )
    second = kr.DistributedOptimizer(
        keras.optimizers.SGD(0.1), num_groups=3, gradient_predivide_factor=2.0
    )
    expected_first, expected_second = build_model(), build_model()
    plain_first, plain_second = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    x, y = data()

    def step(pairs):
        with tf.GradientTape(persistent=True) as tape:
            losses = [tf.reduce_mean((m(x) - y) ** 2) for m, _ in pairs]
        for loss, (m, opt) in zip(losses, pairs):
            opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)

    # Both optimizers' collectives run in one graph, under distinct names.
    tf.function(step)([(model, first), (other, second)])
    step([(expected_first, plain_first), (expected_second, plain_second)])
    for got, want in zip(
        model.get_weights() + other.get_weights(),
        expected_first.get_weights() + expected_second.get_weights(),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def collectives_run():
    from keras_ring.core import _engine

    return _engine.stats()["collectives"]


@pytest.mark.parametrize(
    "options, reduces",
    [
        ({}, False),
        ({"compression": kr.Compression.fp16}, True),
        ({"gradient_predivide_factor": 2.0}, True),
    ],
)
def test_one_rank_skips_the_reduction_unless_it_changes_values(options, reduces):
    # Alone, a rank's average is its own gradient: no collective runs (as in
    # Horovod), unless compression or scaling would change the values.
    before = collectives_run()
    model = train(kr.DistributedOptimizer(keras.optimizers.SGD(0.1), **options))
    assert (collectives_run() > before) == reduces
    expected = train(keras.optimizers.SGD(0.1))
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-2 if reduces else 1e-6, atol=1e-3)


# Guards


def test_jit_compile_is_refused_with_an_actionable_message():
    model = build_model()
    model.compile(
        optimizer=kr.DistributedOptimizer(keras.optimizers.SGD()), loss="mse", jit_compile=True
    )
    with pytest.raises(ValueError, match=r"no XLA kernel.*jit_compile=False"):
        model.fit(*data(), batch_size=BATCH, verbose=0)


def test_xla_is_refused_for_the_tape():
    variable = tf.Variable(1.0)

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = variable * variable
        return kr.DistributedGradientTape(tape).gradient(loss, variable)

    with pytest.raises(ValueError, match=r"DistributedGradientTape cannot reduce.*XLA"):
        step()


def test_tf_distribute_strategy_is_refused():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    message = r"strategy \(OneDeviceStrategy is active\): keras-ring replaces tf.distribute"
    with strategy.scope():
        with pytest.raises(ValueError, match=message):
            kr.DistributedOptimizer(keras.optimizers.SGD())
        with pytest.raises(ValueError, match=message):
            kr.DistributedGradientTape(tf.GradientTape())
        model = build_model()
    # Made outside the scope, run inside it by fit.
    optimizer = kr.DistributedOptimizer(keras.optimizers.SGD())
    with strategy.scope():
        model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match=message):
        model.fit(*data(), batch_size=BATCH, verbose=0)


# Compression


@pytest.mark.parametrize(
    "compression, wire",
    [
        (kr.Compression.none, None),
        (kr.Compression.fp16, tf.float16),
        (kr.Compression.bf16, tf.bfloat16),
    ],
    ids=["none", "fp16", "bf16"],
)
@pytest.mark.parametrize(
    "dtype",
    [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64],
    ids=lambda d: d.name,
)
def test_compression_round_trip(compression, wire, dtype):
    values = [[0.5, -1.25], [3.0, 96.0]] if dtype.is_floating else [[1, -2], [3, 96]]
    tensor = tf.constant(values, dtype)  # exact in every dtype
    sent, ctx = compression.compress(tensor)
    assert sent.dtype == (wire if wire is not None and dtype.is_floating else dtype)
    restored = compression.decompress(sent, ctx)
    assert restored.dtype == dtype
    np.testing.assert_array_equal(restored.numpy(), tensor.numpy())


def test_compression_rounds_to_the_wire_precision():
    tensor = tf.constant([1.0 + 2.0**-9], tf.float32)
    for compression, kept in ((kr.Compression.fp16, True), (kr.Compression.bf16, False)):
        restored = compression.decompress(*compression.compress(tensor))
        assert (restored.numpy()[0] == tensor.numpy()[0]) == kept


# DistributedGradientTape


def embedding_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 2),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_tape_returns_the_gradients_in_the_structure_of_sources(mode, sparse_as_dense):
    model = embedding_model()
    embeddings, kernel, bias = model.trainable_variables
    unused = tf.Variable(1.0)
    x = tf.constant([[1, 2, 2], [3, 1, 0]])
    sources = {"embeddings": embeddings, "dense": [kernel, bias], "unused": unused}

    def gradients():
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x))
        distributed = kr.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return distributed.gradient(loss, sources), tape.gradient(loss, sources)

    got, expected = tf.function(gradients)() if mode == "function" else gradients()
    assert got["unused"] is None
    assert isinstance(got["embeddings"], tf.IndexedSlices) != sparse_as_dense
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        if g is not None:
            np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(e))


def test_tape_is_a_context_manager_and_forwards_the_tape_api():
    x = tf.constant(3.0)
    with kr.DistributedGradientTape(tf.GradientTape()) as tape:
        tape.watch(x)
        y = x * x
    assert tape.gradient(y, x).numpy() == 6.0


def test_tape_refuses_what_is_not_a_tape():
    with pytest.raises(TypeError, match=r"Received: gradtape=None$"):
        kr.DistributedGradientTape(None)


# Local variables and layers. With one rank a local gradient is the
# gradient itself (divided by a size of 1): the values across ranks are
# checked by tests/workers/local_variables_worker.py.


def test_partial_optimizer_trains_as_the_plain_optimizer_and_saves_as_it(tmp_path):
    model = build_model()
    optimizer = kr.PartialDistributedOptimizer(
        keras.optimizers.Adam(0.01, name="opt"), local_layers=model.layers[0]
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    plain = train(keras.optimizers.Adam(0.01, name="opt"))
    assert_same_state(model, plain)
    assert keras.saving.serialize_keras_object(optimizer) == (
        keras.saving.serialize_keras_object(plain.optimizer)
    )
    model.save(tmp_path / "model.keras")
    restored = kr.load_model(tmp_path / "model.keras")
    assert type(restored.optimizer).__name__ == "DistributedAdam"
    assert_same_state(restored, model)
    restored.optimizer.register_local_var(restored.layers[0].kernel)
    restored.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)


@pytest.mark.parametrize(
    "local_layers", ["dense", [keras.layers.Dense(1), "dense"], keras.Variable(1.0)],
    ids=["string", "list with a string", "variable"],
)
def test_local_layers_are_checked(local_layers):
    optimizer = keras.optimizers.SGD()
    with pytest.raises(ValueError, match=r"`local_layers` must be a keras.layers.Layer"):
        kr.PartialDistributedOptimizer(optimizer, local_layers=local_layers)
    assert type(optimizer) is keras.optimizers.SGD
    with pytest.raises(ValueError, match=r"`local_layers` must be a keras.layers.Layer"):
        kr.PartialDistributedGradientTape(tf.GradientTape(), local_layers=local_layers)


@pytest.mark.parametrize("api", ["optimizer", "tape"])
def test_scale_local_gradients_is_checked(api):
    with pytest.raises(ValueError, match=received("scale_local_gradients=1")):
        if api == "optimizer":
            kr.DistributedOptimizer(keras.optimizers.SGD(), scale_local_gradients=1)
        else:
            kr.DistributedGradientTape(tf.GradientTape(), scale_local_gradients=1)


def test_local_variables_need_the_variables_of_the_gradients():
    variable = keras.Variable([1.0])
    plain = keras.optimizers.SGD(1.0)
    plain.build([variable])
    optimizer = kr.DistributedOptimizer(plain)
    optimizer.register_local_var(variable)
    with pytest.raises(ValueError, match="has local variables, so it needs the variables"):
        optimizer.apply([tf.constant([1.0])])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_splits_local_and_global_gradients(mode):
    model = embedding_model()
    embeddings, kernel, bias = model.trainable_variables
    x = tf.constant([[1, 2, 2], [3, 1, 0]])

    paths = {}

    def gradients():
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x))
        partial = kr.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
        local, shared = partial.get_local_and_global_gradients(loss, model.trainable_variables)
        paths.update(local=[v.path for v, _ in local], shared=[v.path for v, _ in shared])
        split = [g for _, g in local + shared]
        return split, tape.gradient(loss, model.trainable_variables)

    split, plain = tf.function(gradients)() if mode == "function" else gradients()
    assert paths == {"local": [kernel.path, bias.path], "shared": [embeddings.path]}
    for g, expected in zip(split, plain[1:] + plain[:1]):
        np.testing.assert_array_equal(tf.convert_to_tensor(g), tf.convert_to_tensor(expected))


def test_local_layers_built_after_wrapping_count():
    layer = keras.layers.Dense(1)
    model = keras.Sequential([keras.layers.Dense(2), layer])
    with kr.PartialDistributedGradientTape(tf.GradientTape(), local_layers=layer) as tape:
        loss = tf.reduce_sum(model(tf.ones([1, 3])))
    first_kernel = model.layers[0].kernel
    tape.register_local_source(first_kernel)
    local, shared = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    assert [v.path for v, _ in local] == [first_kernel.path, layer.kernel.path, layer.bias.path]
    assert [v.path for v, _ in shared] == [model.layers[0].bias.path]
