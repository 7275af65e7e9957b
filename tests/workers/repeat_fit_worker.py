"""One 2-rank `fit` whose weights must come out bit for bit the same every run.

`keras-ring-run -np 2 python tests/workers/repeat_fit_worker.py`: Adam, batch
normalisation, dropout and an uneven last batch, 3 epochs on each rank's shard
of the same seeded data, with the callbacks of the README; then each rank
prints `rank <r>: trainable <crc32> all <crc32>` (checksums of the trainable
weights with the optimizer's variables, and of every model weight), which
tests/test_repeated_and_concurrent_jobs.py compares across runs and ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import zlib

import keras
import numpy as np
import tensorflow as tf

# 2 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras_ring as kr  # noqa: E402


def main():
    kr.init()
    keras.utils.set_random_seed(100 + kr.rank())  # ranks start apart: the broadcast evens them
    rng = np.random.default_rng(0)
    x = rng.standard_normal((250, 8)).astype("float32")
    y = (x @ rng.standard_normal((8, 1))).astype("float32")
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3 * kr.size())),
                  loss="mse")
    shard = slice(kr.rank(), None, kr.size())
    model.fit(x[shard], y[shard], batch_size=16, epochs=3, verbose=0,
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                         kr.callbacks.MetricAverageCallback()])
    # Every rank holds the same trainable weights and optimizer state; the batch
    # normalisation statistics are each rank's own, the same from run to run.
    shared = model.trainable_weights + model.optimizer.variables
    print(f"rank {kr.rank()}: trainable {digest(shared)} all {digest(model.weights)}", flush=True)


def digest(variables):
    value = 0
    for variable in variables:
        value = zlib.crc32(np.ascontiguousarray(keras.ops.convert_to_numpy(variable)), value)
    return value


if __name__ == "__main__":
    main()
