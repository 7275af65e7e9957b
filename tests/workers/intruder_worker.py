"""A TCP job whose bootstrap waits for an intruder (tests/test_tcp_world.py).

Rank 1 starts only once the file named by KR_TEST_GO exists (the test writes
it after it has tried the store and rank 0's port without the secret), so
rank 0 is listening for the mesh meanwhile; then both allreduce, as if
nothing had happened.
"""

import os
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

if os.environ["KERAS_RING_RANK"] == "1":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["KR_TEST_GO"]) and time.monotonic() < deadline:
        time.sleep(0.05)
kr.init()
got = _engine.submit(_engine.ALLREDUCE, np.full(4, kr.rank() + 1.0, np.float32), "after").wait()
assert got.tolist() == [3.0] * 4, got
print(f"rank {kr.rank()}: allreduce ok after the intruders", flush=True)
