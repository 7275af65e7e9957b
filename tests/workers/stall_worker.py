"""Rank 1 never submits "stalled"; run with a short stall check and stall shutdown time.

The other ranks must get an error naming rank 1 and the tensor; rank 0 must
report the stall on stderr first; afterwards the engine still works.
"""

import sys
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

kr.init()
rank, size = kr.rank(), kr.size()
if rank != 1:
    try:
        _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "stalled").wait()
        print(f"rank {rank}: FAIL the stalled allreduce completed", flush=True)
        sys.exit(1)
    except RuntimeError as e:
        print(f"rank {rank} error: {e}", flush=True)
else:
    # Past the others' stall shutdown time (3 s), well inside their next one.
    time.sleep(4)
got = _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "after", op=kr.Sum).wait()
if not np.array_equal(got, np.full(3, size)):
    print(f"rank {rank}: FAIL engine broken after a stall: {got}", flush=True)
    sys.exit(1)
print(f"rank {rank}: after ok", flush=True)
