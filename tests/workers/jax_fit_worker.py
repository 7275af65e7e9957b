"""A whole Keras job under KERAS_BACKEND=jax that must never import TensorFlow.

TensorFlow is installed where the tests run; any attempt to import it fails
this script. NumPy data, sharded with `kr.shard_arrays`; the README's
optimizer and callbacks, warmup, `kr.evaluate`, `kr.unshard`, `kr.shard_py_dataset` and a
`SyncBatchNormalization` layer, in Keras's JAX trainer at its defaults; then
LearningRateScheduleCallback, and `backward_passes_per_step` in fit, saved, and in an eager
`apply`.
"""

import os
import sys
import traceback

os.environ["KERAS_BACKEND"] = "jax"


class _NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            traceback.print_stack()
            raise ImportError(f"jax_fit_worker: {name} was imported under KERAS_BACKEND=jax")


sys.meta_path.insert(0, _NoTensorFlow())

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ring as kr  # noqa: E402

kr.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(600, 8)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
x_train, y_train = kr.shard_arrays(x[:512], y[:512])
model = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                          kr.SyncBatchNormalization(),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-2 * kr.size())),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
steps = len(x_train) // 32
history = model.fit(
    x_train, y_train, batch_size=32, epochs=4, validation_data=kr.shard_arrays(x[512:], y[512:]),
    callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
               kr.callbacks.MetricAverageCallback(),
               kr.callbacks.LearningRateWarmupCallback(1e-2 * kr.size(), warmup_epochs=1,
                                                       steps_per_epoch=steps)],
    verbose=kr.rank_zero_verbose(1))
results = kr.evaluate(model, *kr.shard_arrays(x[512:], y[512:]), return_dict=True, verbose=0)
predictions = kr.unshard(model.predict(kr.shard_arrays(x[512:]), verbose=0))
assert predictions.shape == (88, 2), predictions.shape
weights = np.concatenate([w.ravel() for w in model.get_weights()])
every = kr.allgather_object((weights, history.history["val_loss"], results))
assert all(np.array_equal(w, every[0][0]) for w, _, _ in every), "the ranks' weights differ"
assert all(v == every[0][1] for _, v, _ in every), "the ranks' val_loss differ"
assert all(r == every[0][2] for _, _, r in every), "kr.evaluate differs between ranks"
assert history.history["loss"][-1] < history.history["loss"][0], history.history["loss"]


class Batches(keras.utils.PyDataset):
    """Batch i of the whole data holds rows [16i, 16i + 16); 9 batches for 2 or 3 ranks."""

    def __len__(self):
        return 9

    def __getitem__(self, index):
        rows = slice(16 * index, 16 * index + 16)
        return x[rows], y[rows]


shard = kr.shard_py_dataset(Batches())
assert len(shard) == len(range(kr.rank(), 9, kr.size())), len(shard)
firsts = [float(shard[i][0][0, 0]) for i in range(len(shard))]
assert firsts == [float(x[16 * b, 0]) for b in range(kr.rank(), 9, kr.size())], firsts
even = kr.shard_py_dataset(Batches(), drop_remainder=True)
assert len(even) == 9 // kr.size(), len(even)
model.fit(shard, epochs=1, callbacks=[kr.callbacks.MetricAverageCallback()], verbose=0)

# LearningRateScheduleCallback assigns the rate between the jitted steps, per epoch and
# per batch: a multiplier of 0 from epoch 1 (from halfway through it) stops the weights.
for staircase, stop in ((True, 1.0), (False, 1.5)):
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    kernels = []
    model.fit(x_train, y_train, batch_size=32, epochs=3, verbose=0, callbacks=[
        kr.callbacks.LearningRateScheduleCallback(
            0.1, multiplier=lambda epoch, stop=stop: float(epoch < stop), staircase=staircase),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: kernels.append(model.get_weights()[0].copy()))])
    moved = [bool(np.any(after != before)) for before, after in zip(kernels, kernels[1:])]
    assert moved == [not staircase, False], (staircase, moved)
    assert float(model.optimizer.learning_rate.numpy()) == 0.0

# backward_passes_per_step: the sums are optimizer variables while training (Keras's JAX
# trainer threads them through its step) and stay out of saved models.
passes = kr.DistributedOptimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
model.compile(optimizer=passes, loss="sparse_categorical_crossentropy")
model.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0)
assert int(passes.iterations.numpy()) == steps, (int(passes.iterations.numpy()), steps)
plain = keras.optimizers.Adam(1e-2)
plain.build(model.trainable_variables)
assert len(passes.variables) > len(plain.variables)
path = f"{os.environ.get('TMPDIR', '/tmp')}/jax_fit_worker.{os.getpid()}.keras"
model.save(path)
loaded = keras.models.load_model(path, custom_objects={"SyncBatchNormalization":
                                                       kr.SyncBatchNormalization})
os.remove(path)
assert len(loaded.optimizer.variables) == len(plain.variables), len(loaded.optimizer.variables)
# Called eagerly, apply() updates at every third pass with the average of three.
variable = keras.Variable([10.0, 20.0])
eager = kr.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=3,
                                average_aggregated_gradients=True)
for n in (1.0, 2.0, 3.0):
    assert variable.numpy().tolist() == [10.0, 20.0], variable.numpy()
    eager.apply([np.full(2, n, "float32")], [variable])
assert variable.numpy().tolist() == [8.0, 18.0], variable.numpy()
print(f"jax_fit_worker: rank {kr.rank()} finished, accuracy {results['accuracy']:.3f}, "
      f"tensorflow imported: {'tensorflow' in sys.modules}", flush=True)
