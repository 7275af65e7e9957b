"""One rank stops itself (SIGSTOP: alive, but never runs again) in a loop of allreduces.

`stopped_rank_worker.py STOPPED SIZE SIGNAL MARKER`: rank STOPPED sends itself
SIGNAL ("STOP", or "KILL": then it is dead), from another thread, about a
second into a loop of allreduces of SIZE ("small": 3 floats; "large": 8 MiB,
through shared memory unless KERAS_RING_SHM=0); MARKER is only there for the
test to find the job's processes with pgrep. Every other rank must fail with
an error naming rank STOPPED within the timeout (KERAS_RING_TIMEOUT, or the
stall shutdown time for a tensor the stopped rank never submitted).

Each rank prints its pid and its parent's (MPICH names its segments after the
forker) first; the stopped rank prints the time it stops and every other rank
the time of its error, so that the test can measure the delay.
"""

import os
import signal
import sys
import threading
import time

import numpy as np
from forker_pid import forker_pid

import keras_ring as kr
from keras_ring.core import _engine

stopped, size_name, signal_name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
kr.init()
rank = kr.rank()
print(f"rank {rank} pid {os.getpid()} forker {forker_pid()}", flush=True)


def stop():
    print(f"rank {rank} stopping at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))


if rank == stopped:
    threading.Timer(1.0, stop).start()
x = np.ones(3 if size_name == "small" else 2**21, np.float32)
deadline = time.monotonic() + 120
try:
    while time.monotonic() < deadline:
        _engine.submit(_engine.ALLREDUCE, x, size_name).wait()
except RuntimeError as e:
    print(f"rank {rank} failed at {time.time():.3f}: {e}", flush=True)
    sys.exit(1)
print(f"rank {rank}: FAIL ran two minutes without rank {stopped}", flush=True)
