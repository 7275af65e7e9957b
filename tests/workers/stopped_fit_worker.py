"""Rank 1 stops itself (SIGSTOP) at a batch of `model.fit`; rank 0 must fail naming it.

`stopped_fit_worker.py BATCH MARKER`: a tiny model trains on synthetic data with
`DistributedOptimizer` and `BroadcastGlobalVariablesCallback`; rank 1 stops at
the end of batch BATCH of the first epoch, printing the time. Rank 0 prints the
time of its error and the error. MARKER is only there for the test's pgrep.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import signal
import sys
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras  # noqa: E402
from forker_pid import forker_pid  # noqa: E402

import keras_ring as kr  # noqa: E402

stop_batch = int(sys.argv[1])
kr.init()
rank = kr.rank()
print(f"rank {rank} pid {os.getpid()} forker {forker_pid()}", flush=True)


class StopAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == stop_batch:
            print(f"rank {rank} stopping at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


keras.utils.set_random_seed(1 + rank)
rng = np.random.default_rng(rank)
x = rng.normal(size=(4096, 8)).astype(np.float32)
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
callbacks = [kr.callbacks.BroadcastGlobalVariablesCallback(0)]
if rank == 1:
    callbacks.append(StopAt())
try:
    model.fit(x, y, batch_size=16, epochs=20, callbacks=callbacks, verbose=0)
except Exception as e:  # noqa: BLE001 - what the user sees, whatever its type
    print(f"rank {rank} failed at {time.time():.3f}: {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
print(f"rank {rank}: FAIL model.fit finished without rank 1", flush=True)
