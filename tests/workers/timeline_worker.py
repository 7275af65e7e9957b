"""A known sequence of collectives under a timeline; run with keras-ring-run -np 2.

    timeline_worker.py env PATH       KERAS_RING_TIMELINE=PATH is set by the test
    timeline_worker.py runtime PATH   kr.start_timeline / kr.stop_timeline while running
    timeline_worker.py killed PATH    rank 1 is killed (SIGKILL) while recording

The sequence: three allreduces submitted together ("fused.*", held back by
the cycle time so that they fuse), a group ("grp.*": float32, int64,
float32), one allreduce alone ("single"), an allgather ("gather", one more
row on rank 1) and a broadcast ("bcast").
"""

import os
import signal
import sys
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

mode, path = sys.argv[1], sys.argv[2]


def sequence(step=""):
    handles = [
        _engine.submit(_engine.ALLREDUCE, np.full(5, i, np.float32), f"fused.{k}{step}")
        for i, k in enumerate("abc")
    ]
    for h in handles:
        h.wait()
    # A group of float32, int64, float32: the two float32 tensors run fused, the int64 alone.
    group = [np.ones(3, np.float32), np.ones(2, np.int64), np.ones(4, np.float32)]
    _engine.run(_engine.ALLREDUCE, group, [f"grp.{k}{step}" for k in "abc"], group=f"grp{step}")
    _engine.submit(_engine.ALLREDUCE, np.ones(7, np.float64), f"single{step}").wait()
    rows = np.ones((kr.rank() + 1, 2), np.int32)
    _engine.submit(_engine.ALLGATHER, rows, f"gather{step}").wait()
    _engine.submit(_engine.BROADCAST, np.arange(4, dtype=np.int64), f"bcast{step}").wait()


kr.init()
if mode == "env":
    sequence()
elif mode == "runtime":
    _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "before.start").wait()
    kr.start_timeline(path)
    try:
        kr.start_timeline(path)
        print(f"rank {kr.rank()}: FAIL a second start_timeline was accepted", flush=True)
        sys.exit(1)
    except ValueError as e:
        print(f"rank {kr.rank()}: second start refused: {e}", flush=True)
    sequence()
    # The engine records a collective's end just after its completion wakes
    # the caller: one more operation lets "bcast" end before the timeline does.
    _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "last").wait()
    kr.stop_timeline()
    kr.stop_timeline()  # twice is harmless
    _engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), "after.stop").wait()
elif mode == "killed":
    sequence()
    time.sleep(0.5)  # past the writer's interval: the events are in the file
    if kr.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(100000):  # until the launcher stops this rank
        sequence(f".{step}")
print(f"rank {kr.rank()}: done", flush=True)
