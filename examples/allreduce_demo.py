"""The smallest keras-ring job: every rank contributes its rank number.

    keras-ring-run -np 2 python examples/allreduce_demo.py

Each rank prints its place in the job and the first elements of the sum over
ranks (0 + 1 + ... + size-1), computed eagerly and inside a tf.function.
"""

import tensorflow as tf

import keras_ring as kr

kr.init()
x = tf.fill([1000], float(kr.rank()))
y = kr.allreduce(x, op=kr.Sum)


@tf.function
def average(t):
    return kr.allreduce(t, op=kr.Average)


z = average(x)
expected_sum = sum(range(kr.size()))
print(
    f"rank {kr.rank()} of {kr.size()} (local rank {kr.local_rank()}): "
    f"sum {y[:3].numpy()} average {z[:3].numpy()}",
    flush=True,
)
if not (all(y.numpy() == expected_sum) and all(abs(z.numpy() - expected_sum / kr.size()) < 1e-6)):
    raise SystemExit(f"rank {kr.rank()}: wrong result")
