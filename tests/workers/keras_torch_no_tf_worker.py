"""A Keras script under KERAS_BACKEND=torch: TensorFlow is never imported, nor needed.

It trains with every piece of keras-ring's Keras layer that a torch user meets
(DistributedOptimizer, the callbacks, SyncBatchNormalization, uneven shards,
kr.evaluate, kr.elastic's KerasState) and prints whether TensorFlow or JAX got
imported. With the argument `hide`, TensorFlow cannot be imported at all, as
where it is not installed. Run under `keras-ring-run`, with KERAS_BACKEND=torch.
"""

import sys

if sys.argv[1:] == ["hide"]:
    # `import tensorflow` then fails as if it were not installed.
    sys.modules["tensorflow"] = None

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_ring as kr  # noqa: E402

torch.set_num_threads(1)
kr.init()
rng = np.random.default_rng(kr.rank())
rows = 64 + 8 * kr.rank()  # uneven shards: the ranks join each other's last steps
x = rng.normal(size=(rows, 6)).astype("float32")
y = rng.normal(size=(rows, 1)).astype("float32")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), kr.SyncBatchNormalization(),
                          keras.layers.Activation("tanh"), keras.layers.Dense(1)])
model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3 * kr.size())),
              loss="mse", metrics=["mae"])
state = kr.elastic.KerasState(model, epoch=0, batch=0)
model.fit(x, y, batch_size=8, epochs=2,
          callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                     kr.callbacks.MetricAverageCallback()],
          verbose=kr.rank_zero_verbose(1))
state.commit()
results = kr.evaluate(model, x, y, batch_size=8, verbose=0, return_dict=True)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
same = all(np.array_equal(w, weights) for w in kr.allgather_object(weights))
print(f"rank {kr.rank()}: same weights {same}, loss {results['loss']:.4f}, "
      f"tensorflow imported: {sys.modules.get('tensorflow') is not None}, "
      f"jax imported: {'jax' in sys.modules}",
      flush=True)
