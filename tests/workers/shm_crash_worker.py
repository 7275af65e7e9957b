"""Rank 1 is killed (SIGKILL) while every rank loops over shared-memory allreduces.

Each rank prints its pid and its parent's (the forker, after which MPICH names
its segment) first, so that the test can look for shared-memory segments the
job left behind: there must be none, and the job must end.
"""

import os
import signal
import threading
import time

import numpy as np
from forker_pid import forker_pid

import keras_ring as kr
from keras_ring.core import _engine

kr.init()
print(f"rank {kr.rank()} pid {os.getpid()} forker {forker_pid()}", flush=True)
if kr.rank() == 1:
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
x = np.ones(2**21, np.float32)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    _engine.submit(_engine.ALLREDUCE, x, "big").wait()
print(f"rank {kr.rank()}: ran a minute without rank 1", flush=True)
