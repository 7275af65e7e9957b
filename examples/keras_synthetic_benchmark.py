"""Synthetic model.fit benchmark in the style of Horovod's: samples/s per rank and in total.

    keras-ring-run -np 2 python examples/keras_synthetic_benchmark.py [--batch-size 32]

Random images and labels (nothing is downloaded), a small convolutional
network, `DistributedOptimizer`; every rank times the same number of batches
after a warm-up, and rank 0 prints the mean and spread of samples/s per rank
and the total over ranks.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup-batches", type=int, default=5)
    parser.add_argument("--batches-per-iter", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    kr.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(kr.rank())
    shape = (args.image_size, args.image_size, 3)
    x = np.random.default_rng(kr.rank()).random((args.batch_size,) + shape, np.float32)
    y = np.random.default_rng(kr.rank()).integers(0, 10, args.batch_size)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()

    model = keras.Sequential([
        keras.Input(shape),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.01 * kr.size())),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = [kr.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(data, steps_per_epoch=args.warmup_batches, epochs=1, callbacks=callbacks,
              verbose=0)

    rates = []
    for i in range(args.iters):
        start = time.perf_counter()
        model.fit(data, steps_per_epoch=args.batches_per_iter, epochs=1, verbose=0)
        rate = args.batch_size * args.batches_per_iter / (time.perf_counter() - start)
        rates.append(rate)
        if kr.rank() == 0:
            print(f"iter {i}: {rate:.1f} samples/s per rank", flush=True)
    per_rank = float(kr.allreduce(np.mean(rates), op=kr.Average, name="rate"))
    if kr.rank() == 0:
        print(f"samples/s per rank: {per_rank:.1f} +- {1.96 * np.std(rates):.1f}")
        print(f"total samples/s on {kr.size()} ranks: {per_rank * kr.size():.1f}")


if __name__ == "__main__":
    main()
