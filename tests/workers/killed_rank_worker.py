"""Rank 1 is killed (SIGKILL: no exit code runs) while the others wait in an allreduce.

The job must end, not hang, and say which rank died. Each rank prints its pid
and its parent's (the forker, after which MPICH names its segment) first, so
that the test can look for shared-memory segments left behind.
"""

import os
import signal
import time

import numpy as np
from forker_pid import forker_pid

import keras_ring as kr
from keras_ring.core import _engine

kr.init()
print(f"rank {kr.rank()} pid {os.getpid()} forker {forker_pid()}", flush=True)
if kr.rank() == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
_engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "never.joined").wait()
print(f"rank {kr.rank()}: allreduce completed without rank 1", flush=True)
