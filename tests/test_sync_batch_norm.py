"""kr.SyncBatchNormalization: across 3 ranks (tests/workers/sync_batch_norm_worker.py),
and in one process, where it must be keras.layers.BatchNormalization exactly and save and load."""

import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring.keras import _sync_batch_norm

WORKER = pathlib.Path(__file__).parent / "workers" / "sync_batch_norm_worker.py"
BATCH = 8
STEPS = 3


@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_sync_batch_norm_across_ranks(run_ranks, np):
    result = run_ranks(np, WORKER, timeout=300)
    assert f"passed on {np} ranks" in result.stdout, result.stdout


@pytest.fixture(params=["not initialized", "one rank"])
def job(request):
    """Outside a job (no kr.init()) and in a job of one rank; restores the state after."""
    was_initialized = kr.is_initialized()
    if request.param == "one rank":
        kr.init()
    elif was_initialized:
        kr.shutdown()
    yield request.param
    if was_initialized and not kr.is_initialized():
        kr.init()


def build_model(normalization, **options):
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((3, 2, 4)),
            keras.layers.Dense(4),
            normalization(axis=1, momentum=0.8, **options),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(loc=1.0, size=(BATCH * STEPS, 3, 2, 4)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 2)).astype("float32")
    return x, y


def fit(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    model.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("options", [{}, {"renorm": True}], ids=["plain", "renorm"])
def test_is_batch_normalization_with_one_process(job, options):
    reference = fit(build_model(keras.layers.BatchNormalization, **options))
    model = build_model(kr.SyncBatchNormalization, **options)
    model.set_weights(build_model(keras.layers.BatchNormalization, **options).get_weights())
    fit(model)
    assert isinstance(model.layers[1], keras.layers.BatchNormalization)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, expected)
    x = data()[0][:5]
    np.testing.assert_array_equal(model(x, training=False), reference(x, training=False))


def test_masks_and_mixed_precision_as_batch_normalization(job):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 5, 4)).astype("float16")
    mask = rng.uniform(size=(6, 5)) < 0.6
    results = []
    for normalization in (keras.layers.BatchNormalization, kr.SyncBatchNormalization):
        layer = normalization(momentum=0.5, dtype="mixed_float16")
        outputs = layer(x, training=True, mask=mask)
        assert outputs.dtype == tf.float16 and layer.moving_mean.dtype == "float32"
        results.append([outputs.numpy(), layer.moving_mean.numpy(), layer.moving_variance.numpy()])
    for got, expected in zip(*results):
        np.testing.assert_array_equal(got, expected)


def test_config_and_save_and_load(tmp_path):
    kr.init()
    model = fit(build_model(kr.SyncBatchNormalization, epsilon=0.01, center=False))
    layer = model.layers[1]
    config = layer.get_config()
    assert config["axis"] == 1 and config["epsilon"] == 0.01 and config["synchronized"] is False
    assert keras.saving.get_registered_name(type(layer)) == "keras_ring>SyncBatchNormalization"
    clone = kr.SyncBatchNormalization.from_config(config)
    assert type(clone) is kr.SyncBatchNormalization and clone.get_config() == config

    path = tmp_path / "model.keras"
    model.save(path)
    x = data()[0][:5]
    expected = model.predict(x, verbose=0)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[1]) is kr.SyncBatchNormalization
    assert loaded.layers[1].get_config() == config
    for got, saved in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, saved)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)

    # New processes: `import keras_ring` after `import keras` registers the class with
    # Keras; kr.load_model does, in either import order.
    np.save(tmp_path / "x.npy", x)
    for imports, load in (("import keras, keras_ring as kr", "keras.models.load_model"),
                          ("import keras_ring as kr, keras", "kr.load_model")):
        script = f"""
import json, numpy as np
{imports}
model = {load}({str(path)!r})
layer = model.layers[1]
prediction = model.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
print(json.dumps([type(layer).__module__ + "." + type(layer).__name__, prediction.tolist()]))
"""
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        name, prediction = json.loads(result.stdout.strip().splitlines()[-1])
        assert name == "keras_ring.keras._sync_batch_norm.SyncBatchNormalization"
        np.testing.assert_array_equal(np.asarray(prediction, np.float32), expected)


def test_a_copy_with_batch_normalization_loads_and_predicts_without_keras_ring(tmp_path):
    kr.init()
    trained = fit(build_model(kr.SyncBatchNormalization, epsilon=0.01))
    # Nested in a functional model, as a block of a larger network would be.
    inputs = keras.Input((3, 2, 4))
    model = keras.Model(inputs, keras.layers.Activation("tanh")(trained(inputs)))
    copy = kr.SyncBatchNormalization.to_batch_normalization(model)
    layer = copy.layers[1].layers[1]
    assert type(layer) is keras.layers.BatchNormalization, copy.layers
    assert layer.get_config() == trained.layers[1].get_config()
    x = data()[0][:5]
    expected = model.predict(x, verbose=0)
    np.testing.assert_array_equal(copy.predict(x, verbose=0), expected)
    path = tmp_path / "serve.keras"
    copy.save(path)
    np.save(tmp_path / "x.npy", x)
    script = f"""
import json, sys, numpy as np, keras
model = keras.models.load_model({str(path)!r})
prediction = model.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
print(json.dumps(["keras_ring" in sys.modules, prediction.tolist()]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    imported, prediction = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported is False
    np.testing.assert_array_equal(np.asarray(prediction, np.float32), expected)
    with pytest.raises(ValueError, match="needs a built model"):
        kr.SyncBatchNormalization.to_batch_normalization(
            keras.Sequential([kr.SyncBatchNormalization()]))


def test_synchronized_true_is_refused():
    with pytest.raises(ValueError, match="synchronized=True"):
        kr.SyncBatchNormalization(synchronized=True)
    assert kr.SyncBatchNormalization(synchronized=False).synchronized is False


def test_a_keras_without_the_hook_is_refused(monkeypatch):
    monkeypatch.delattr(keras.layers.BatchNormalization, "_moments")
    with pytest.raises(RuntimeError, match="_moments"):
        kr.SyncBatchNormalization()


def test_a_keras_that_bypasses_the_hook_is_refused(monkeypatch):
    # As if a Keras release computed the statistics elsewhere: with several
    # ranks the layer would silently normalise by local statistics.
    def call(self, inputs, training=None, mask=None):
        mean, variance = tf.nn.moments(inputs, self._reduction_axes)
        return tf.nn.batch_normalization(inputs, mean, variance, None, None, self.epsilon)

    monkeypatch.setattr(keras.layers.BatchNormalization, "call", call)
    monkeypatch.setattr(_sync_batch_norm, "_synchronizing", lambda: True)
    layer = kr.SyncBatchNormalization()
    with pytest.raises(RuntimeError, match="without calling"):
        layer(np.ones((2, 3), "float32"), training=True)
    layer(np.ones((2, 3), "float32"), training=False)
