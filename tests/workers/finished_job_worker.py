"""Every rank finishes its work and shuts down; rank 0 then exits at once, the
others a few seconds later.

MPICH's launchers take a rank that exits without MPI_Finalize for a failed one,
and the forker interrupts (SIGINT) every rank still running: the sleep of
ranks 1.. would end in a KeyboardInterrupt. So the job exits 0 only if rank 0
finalized MPI, whether the engine was started by `kr.init()` or by the
binding's own `init()` (as benchmarks do).

Usage: finished_job_worker.py kr|binding
"""

import sys
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

SIZES = (1, 7, 1000)


def main():
    if sys.argv[1] == "kr":
        kr.init()
    else:
        _engine.init()
    rank, size = _engine.topology()["rank"], _engine.topology()["size"]
    for step in range(50):
        handles = [
            _engine.submit(_engine.ALLREDUCE, np.full(n, rank + step, np.float32), f"t{n}")
            for n in SIZES
        ]
        for n, handle in zip(SIZES, handles):
            got, want = handle.wait(), size * step + sum(range(size))
            if not (got == want).all():
                sys.exit(f"rank {rank} step {step} t{n}: {got.tolist()} != {want}")
    _engine.shutdown()
    print(f"rank {rank}: done", flush=True)
    if rank != 0:
        time.sleep(3)


if __name__ == "__main__":
    main()
