"""Data-parallel training under Keras's mixed_float16 policy.

    keras-ring-run -np 2 python examples/mixed_precision.py

With `mixed_float16`, Keras computes in float16, keeps float32 variables and
wraps the optimizer in a LossScaleOptimizer. keras-ring's DistributedOptimizer
must sit outside the loss-scale wrapper: the global (averaged) gradients are
what the finiteness check sees, so all ranks skip or apply a step together.
The script trains on scikit-learn's digits and fails below 0.93 test accuracy
or if the ranks' weights differ.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_ring as kr  # noqa: E402


def main():
    kr.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(kr.rank())
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target, test_size=0.25, random_state=0,
        stratify=digits.target)
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .apply(lambda ds: kr.shard_dataset(ds, drop_remainder=True))
             .shuffle(1000, seed=0).batch(32, drop_remainder=True).repeat())
    steps = len(x_train) // (32 * kr.size())
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),  # logits in float32
    ])
    model.compile(
        optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3 * kr.size())),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if kr.rank() == 0:
        print(f"optimizer: {type(model.optimizer).__name__} wrapping "
              f"{type(getattr(model.optimizer, 'inner_optimizer', model.optimizer)).__name__}")
    model.fit(train, epochs=20, steps_per_epoch=steps, verbose=kr.rank_zero_verbose(2),
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                         kr.callbacks.MetricAverageCallback()])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    spread = float(tf.reduce_max(kr.allreduce(weights, op=kr.Max)
                                 - kr.allreduce(weights, op=kr.Min)))
    if kr.rank() == 0:
        print(f"test accuracy {accuracy:.4f}; weight difference between ranks {spread:.2e}")
    if accuracy < 0.93 or spread != 0.0:
        raise SystemExit(f"rank {kr.rank()}: accuracy {accuracy}, spread {spread}")


if __name__ == "__main__":
    main()
