"""Rank 1 ends mid-job (argv[1]: `kill` itself, `exit` with code 0, or `raise`) while the others
wait for its next submission; they must fail with an error naming it."""

import os
import signal
import sys
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

kr.init()
if kr.rank() == 1:
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif sys.argv[1] == "exit":
        os._exit(0)
    raise RuntimeError("rank 1 fails")
_engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "never.joined").wait()
print(f"rank {kr.rank()}: allreduce completed without rank 1", flush=True)
