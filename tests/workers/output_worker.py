"""What a rank writes as a user's script would: Keras's real progress bar, UTF-8 text, long output.

`python output_worker.py` (under a launcher), or `train()` through `kr.run`.
Rank 0 trains with `verbose=kr.rank_zero_verbose(1)` (Keras's progress bar,
drawn with U+2501), then every rank prints LINES lines of non-ASCII text to
stdout and to stderr and a last line, `done <rank> ✓`, that the tests look for.
"""

import os
import sys

LINES = 2000


def train():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ring as kr

    tf.config.threading.set_intra_op_parallelism_threads(1)
    kr.init()
    rng = np.random.default_rng(kr.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=8, epochs=2,
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                         kr.callbacks.MetricAverageCallback()],
              verbose=kr.rank_zero_verbose(1))
    for i in range(LINES):
        print(f"rank {kr.rank()} line {i}: é ━ ✓ 日本語")
        print(f"rank {kr.rank()} err {i}: é ━", file=sys.stderr)
    print(f"done {kr.rank()} ✓", flush=True)
    return kr.rank()


if __name__ == "__main__":
    train()
