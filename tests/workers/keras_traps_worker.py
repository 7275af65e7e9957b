"""What a new user of keras-ring runs into, for tests/test_keras_traps.py.

`keras-ring-run -np 2 python tests/workers/keras_traps_worker.py SCENARIO OUT_DIR`.
Each scenario is one job: it does what a user would, and prints one line per
rank, `<scenario> rank <r>: ok` or `<scenario> rank <r>: FAILED: <why>`, that
the test reads. Scenarios whose job must fail print what each rank raised.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys

import keras
import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras_ring as kr  # noqa: E402

SEED = 7


def small_model():
    keras.utils.set_random_seed(SEED + kr.rank())
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def compile_distributed(model, lr=0.05):
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    return model


def data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


def unknown_length(out_dir):
    """Data of unknown length, 17 batches on rank 0 and 16 on the others: an error, not a hang."""
    x, y = data(17 * 8)
    batches = 17 if kr.rank() == 0 else 16

    def rows():
        for i in range(batches * 8):
            yield x[i], y[i]

    spec = (tf.TensorSpec((3,), tf.float32), tf.TensorSpec((1,), tf.float32))
    dataset = tf.data.Dataset.from_generator(rows, output_signature=spec).batch(8)
    model = compile_distributed(small_model())
    try:
        model.fit(dataset, epochs=2, verbose=0,
                  callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    except Exception as e:  # noqa: BLE001 -- what the user sees is what is tested
        return f"raised {type(e).__name__}: {' '.join(str(e).split())}"
    return "FAILED: fit returned"


SCENARIOS = {"unknown_length": unknown_length}


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    kr.init()
    outcome = SCENARIOS[scenario](out_dir)
    print(f"{scenario} rank {kr.rank()}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
