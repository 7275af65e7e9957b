"""Rank 1 exits at once; every other rank is waiting in an allreduce it never joins.

The waiting ranks must fail with an error that names rank 1, not hang; so must
what they submit after their engines stopped.
"""

import sys

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

kr.init()
if kr.rank() == 1:
    sys.exit(3)
try:
    _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "never.joined").wait()
except RuntimeError as e:
    print(f"rank {kr.rank()} error: {e}", flush=True)
    rank = kr.rank()
    try:
        _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "after.stop").wait()
    except RuntimeError as later:
        print(f"rank {rank} later: {later}", flush=True)
    sys.exit(4)
print(f"rank {kr.rank()}: allreduce completed without rank 1", flush=True)
