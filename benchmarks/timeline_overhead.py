"""The timeline's cost: the same collectives with the timeline off and on, alternating in one job.

    keras-ring-run -np 2 python benchmarks/timeline_overhead.py [--rounds 15] [--iters 20]

Separate jobs for "off" and "on" see different machine loads; here every
round times a block of `iters` calls with the timeline off, then a block with
it on, from `kr.start_timeline` to the return of `kr.stop_timeline` (which
waits for the writer thread to format and write the block's events), so
the writing counts too; blocks last 50 ms at least. Rank 0 prints, per case,
the median time per call of each and the median of the rounds' on/off
ratios. Writes JSON and a PNG plot to benchmarks/results/.
"""

import argparse
import math
import os
import tempfile
import time

import numpy as np
from _report import save_plot, write_results
from mpi4py import MPI  # initialises MPI first; keras-ring shares it

import keras_ring as kr
from keras_ring.core import _engine

CASES = [(1, 4096), (100, 4096), (1000, 1024), (1, 16 << 20)]


def many(tensors, tag):
    def run():
        handles = [
            _engine.submit(_engine.ALLREDUCE, t, f"{tag}.{i}", op=kr.Sum)
            for i, t in enumerate(tensors)
        ]
        for h in handles:
            h.wait()

    return run


def block_seconds(fn, iters, comm, trace=None):
    """Seconds per call of `iters` calls (with a timeline into `trace`), slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    if trace:
        kr.start_timeline(trace)
    for _ in range(iters):
        fn()
    if trace:
        kr.stop_timeline()
    seconds = (time.perf_counter() - start) / iters
    return comm.allreduce(seconds, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20, help="calls per block, at least")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    kr.init()
    trace = os.path.join(tempfile.mkdtemp(), "overhead.json")
    rows = []
    for count, nbytes in CASES:
        tensors = [np.full(nbytes // 4, 1.0, np.float32) for _ in range(count)]
        label = f"{count} x {nbytes // 1024} KiB"
        run = many(tensors, label)
        run()  # warm up (and fill the response cache)
        # Blocks of at least 50 ms: starting and stopping the timeline is then noise.
        iters = max(args.iters, math.ceil(0.05 / block_seconds(run, 3, comm)))
        off, on = [], []
        for _ in range(args.rounds):
            off.append(block_seconds(run, iters, comm))
            on.append(block_seconds(run, iters, comm, trace))
        ratios = [b / a for a, b in zip(off, on)]
        rows.append(
            {
                "case": label,
                "off_seconds": float(np.median(off)),
                "on_seconds": float(np.median(on)),
                "on_over_off": float(np.median(ratios)),
            }
        )
    if kr.rank() == 0:
        print(
            f"\ntimeline off vs on, float32 allreduce, {kr.size()} ranks, "
            f"{args.rounds} rounds of {args.iters}"
        )
        print(f"{'case':<18}{'off ms':>10}{'on ms':>10}{'on/off':>10}")
        for r in rows:
            print(
                f"{r['case']:<18}{r['off_seconds'] * 1e3:>10.3f}{r['on_seconds'] * 1e3:>10.3f}"
                f"{r['on_over_off']:>10.3f}"
            )
        name = f"timeline_overhead_{kr.size()}ranks"
        payload = {"ranks": kr.size(), "rounds": args.rounds, "iters": args.iters, "rows": rows}
        fig, ax = write_results(args.out, name, payload, figsize=(6, 3))
        ax.bar([r["case"] for r in rows], [r["on_over_off"] for r in rows])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("time with / without timeline")
        save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
