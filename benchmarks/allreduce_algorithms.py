"""Where recursive doubling stops beating the ring: allreduce over MPI point-to-point by size.

    keras-ring-run -np 2 python benchmarks/allreduce_algorithms.py [--reps 3] [--iters 30]

Shared memory is turned off (KERAS_RING_SHM=0) so that both algorithms run
over MPI, as they do between hosts. Each repetition starts the engine once
with the ring forced (KERAS_RING_SMALL_ALLREDUCE_BYTES=0) and once with
recursive doubling forced, measuring every size in both, so that the noise of
this shared machine hits both alike; the best of the repetitions' medians is
kept. Rank 0 prints a table with the ratio recursive doubling / ring (below 1:
recursive doubling is faster), and writes JSON and a PNG to benchmarks/results/.
The default crossover (KERAS_RING_SMALL_ALLREDUCE_BYTES) comes from this.
"""

import argparse
import os

os.environ["KERAS_RING_SHM"] = "0"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin otherwise

import numpy as np  # noqa: E402
from _report import save_plot, write_results  # noqa: E402
from _timing import median_seconds  # noqa: E402
from mpi4py import MPI  # noqa: E402

import keras_ring as kr  # noqa: E402
from keras_ring.core import _engine  # noqa: E402

ALGORITHMS = {"ring": 0, "recursive doubling": 1 << 40}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 16, 64, 256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    best = {(a, s): float("inf") for a in ALGORITHMS for s in args.sizes_kib}
    for _ in range(args.reps):
        for algorithm, small_bytes in ALGORITHMS.items():
            os.environ["KERAS_RING_SMALL_ALLREDUCE_BYTES"] = str(small_bytes)
            kr.init()  # reads the setting
            for kib in args.sizes_kib:
                x = np.ones(kib * 256, np.float32)

                def allreduce():
                    _engine.submit(_engine.ALLREDUCE, x, "bench").wait()

                allreduce()
                seconds = median_seconds(allreduce, args.iters)
                best[algorithm, kib] = min(best[algorithm, kib], seconds)
            kr.shutdown()
    if MPI.COMM_WORLD.rank != 0:
        return
    size = MPI.COMM_WORLD.size
    rows = [
        {
            "KiB": kib,
            **{f"{a} us": best[a, kib] * 1e6 for a in ALGORITHMS},
            "ratio": best["recursive doubling", kib] / best["ring", kib],
        }
        for kib in args.sizes_kib
    ]
    print(
        f"\nallreduce float32 over MPI, {size} ranks, best of {args.reps} medians of {args.iters}"
    )
    print(f"{'KiB':>8}{'ring us':>12}{'rec. doubling us':>18}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['KiB']:>8}{r['ring us']:>12.1f}{r['recursive doubling us']:>18.1f}"
            f"{r['ratio']:>8.2f}"
        )
    name = f"allreduce_algorithms_{size}ranks"
    fig, ax = write_results(
        args.out,
        name,
        {"ranks": size, "reps": args.reps, "iters": args.iters, "rows": rows},
        figsize=(6, 4),
    )
    for algorithm in ALGORITHMS:
        ax.plot(args.sizes_kib, [r[f"{algorithm} us"] for r in rows], "o-", label=algorithm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (KiB)")
    ax.set_ylabel("time (us)")
    ax.set_title(f"allreduce over MPI, {size} ranks")
    ax.legend()
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
