"""A custom training loop with tf.GradientTape, data-parallel with keras-ring.

    keras-ring-run -np 2 python examples/custom_training_loop.py

Each rank trains on its shard of a synthetic regression problem (y = X w* +
noise); `DistributedGradientTape` averages the gradients across ranks, so all
ranks take the same steps. Rank 0 prints the loss; the script fails unless
the learned weights are close to w* and identical on every rank.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402

STEPS = 200


def main():
    kr.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rng = np.random.default_rng(0)  # the same problem on every rank
    true_w = rng.standard_normal((16, 1)).astype("float32")
    x = rng.standard_normal((4096, 16)).astype("float32")
    y = x @ true_w + 0.01 * rng.standard_normal((4096, 1)).astype("float32")
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .apply(kr.shard_dataset)
        .shuffle(1024, seed=kr.rank())
        .batch(32)
        .repeat()
    )

    keras.utils.set_random_seed(kr.rank())  # different initial weights: the broadcast fixes that
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
    kr.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = kr.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return kr.allreduce(loss, op=kr.Average, name="loss")

    for step, (xb, yb) in enumerate(data.take(STEPS)):
        loss = train_step(xb, yb)
        if kr.rank() == 0 and step % 50 == 0:
            print(f"step {step}: loss {float(loss):.5f}", flush=True)

    w = model.layers[0].kernel.numpy()
    spread = float(tf.reduce_max(kr.allreduce(w, op=kr.Max) - kr.allreduce(w, op=kr.Min)))
    error = float(np.abs(w - true_w).max())
    if kr.rank() == 0:
        print(f"final loss {float(loss):.5f}; |w - w*| max {error:.4f}; "
              f"weight difference between ranks {spread:.2e}")
    if error > 0.05 or spread != 0.0:
        raise SystemExit(f"rank {kr.rank()}: did not converge (error {error}, spread {spread})")


if __name__ == "__main__":
    main()
