"""Ranks started with different settings: every rank runs with rank 0's, as Horovod does.

Rank 1 turns fusion off in its own environment; the ranks must still cut their groups into the
same collectives (a rank that cut them differently would exchange the wrong bytes or hang).
Run under the launcher with 2 or 3 ranks.
"""

import os
import sys

import numpy as np

RANK = int(os.environ["PMI_RANK"])
os.environ["KERAS_RING_FUSION_THRESHOLD"] = "0" if RANK == 1 else str(64 << 20)

import keras_ring as kr  # noqa: E402
from keras_ring.core import _engine  # noqa: E402


def fail(message):
    print(f"rank {RANK}: FAIL {message}", flush=True)
    sys.exit(1)


kr.init()
size = kr.size()
threshold = _engine.parameters()["fusion_threshold"]
if threshold != 64 << 20:
    fail(f"fusion threshold {threshold}, expected rank 0's {64 << 20}")
for step in range(3):
    xs = [np.full(n, RANK + step, np.float32) for n in (1000, 1, 77)]
    before = _engine.stats()["collectives"]
    got = _engine.run(_engine.ALLREDUCE, xs, ["s.0", "s.1", "s.2"], op=kr.Sum, group="s")
    if _engine.stats()["collectives"] - before != 1:
        fail(f"step {step}: the group ran as {_engine.stats()['collectives'] - before} "
             "collectives, expected 1 (fused, as rank 0's settings say)")
    for x, out in zip(xs, got):
        want = np.full(x.shape, sum(r + step for r in range(size)), np.float32)
        if not np.array_equal(out, want):
            fail(f"step {step}: got {out[:3]}, expected {want[:3]}")
print(f"rank {RANK}: settings ok", flush=True)
