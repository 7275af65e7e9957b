"""A training-like loop under KERAS_RING_AUTOTUNE: every step the same named
tensors (several sizes, allreduce and allgather), each result checked against
NumPy while the autotuner changes fusion, cycle time, segment size and
crossover under it. At the end every rank writes its final settings, which the
test compares across ranks.

Usage: autotune_worker.py STEPS OUT_DIR (each rank writes OUT_DIR/final.<rank>.json)
"""

import json
import os
import sys

import numpy as np

from keras_ring.core import _engine

SIZES = {"grad.small": 257, "grad.medium": 30001, "grad.large": 600_011}


def main():
    steps = int(sys.argv[1])
    _engine.init()
    rank, size = _engine.topology()["rank"], _engine.topology()["size"]
    seen = set()
    for step in range(steps):
        handles = {}
        for name, n in SIZES.items():
            x = np.arange(n, dtype=np.float32) % 13 + rank + step
            handles[name] = _engine.submit(_engine.ALLREDUCE, x, name)
        rows = np.full((rank + 1, 3), step, dtype=np.int32)
        handles["rows"] = _engine.submit(_engine.ALLGATHER, rows, "rows")
        for name, n in SIZES.items():
            want = size * (np.arange(n, dtype=np.float32) % 13 + step) + sum(range(size))
            got = handles[name].wait()
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                sys.exit(f"rank {rank} step {step} {name}[{bad}]: {got[bad]} != {want[bad]}")
        gathered = handles["rows"].wait()
        if gathered.shape != (size * (size + 1) // 2, 3) or not (gathered == step).all():
            sys.exit(f"rank {rank} step {step}: allgather gave {gathered.tolist()}")
        params = _engine.parameters()
        seen.add(json.dumps({k: v for k, v in params.items() if k != "autotune"}))
    final = {"rank": rank, "params": _engine.parameters(), "settings_seen": len(seen)}
    with open(os.path.join(sys.argv[2], f"final.{rank}.json"), "w") as f:
        json.dump(final, f)
    _engine.shutdown()


if __name__ == "__main__":
    main()
