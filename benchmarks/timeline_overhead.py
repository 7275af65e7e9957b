"""The timeline's cost: the same collectives with the timeline off and on, alternating in one job.

    keras-ring-run -np 2 python benchmarks/timeline_overhead.py [--rounds 15] [--iters 20]

Runs separate jobs for "off" and "on" and the machine's load changes between
them; here every round times a block of calls with the timeline off, then a
block with it on (`kr.start_timeline` / `kr.stop_timeline` between blocks),
so both see the same conditions. Rank 0 prints, per case, the median block
time of each and the median of the rounds' on/off ratios. Writes JSON and a
PNG plot to benchmarks/results/.
"""

import argparse
import os
import tempfile

import numpy as np
from _report import save_plot, write_results
from _timing import median_seconds
from mpi4py import MPI  # initialises MPI first; keras-ring shares it

import keras_ring as kr
from keras_ring import _engine

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
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
        off, on = [], []
        for _ in range(args.rounds):
            off.append(median_seconds(run, args.iters, comm))
            kr.start_timeline(trace)
            on.append(median_seconds(run, args.iters, comm))
            kr.stop_timeline()
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
