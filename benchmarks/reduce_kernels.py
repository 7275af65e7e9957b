"""Reduction kernel speed: each CPU kernel level this machine has, against NumPy.

    python benchmarks/reduce_kernels.py [--sizes-kib 64 1024 16384] [--rounds 15]

Times `dst = dst + src` (ReduceInto with Sum, through the binding, which
repeats it in one call) for each dtype and size, with every kernel level the
CPU can run, and NumPy's `np.add(dst, src, out=dst)` as the baseline,
interleaved round by round so that the machine's noise hits all methods alike.
GB/s counts the bytes of one buffer per call. Prints a table (median GB/s,
and the speed relative to the generic kernels and to NumPy) and writes JSON
and a PNG plot to benchmarks/results/. One process, one thread: no launcher
needed.
"""

import argparse
import os
import time

import ml_dtypes
import numpy as np
from _report import save_plot, write_results

import keras_ring as kr
from keras_ring.core import _engine

LEVELS = ["generic", "avx2", "avx512"]
DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int32": np.int32,
    "float64": np.float64,
    "int8": np.int8,
}
BATCH_SECONDS = 5e-3  # each timing covers at least this long, so that timer cost is negligible


def per_call_seconds(fn, calls):
    """Seconds per reduction of `fn(calls)`, which runs `calls` reductions."""
    start = time.perf_counter()
    fn(calls)
    return (time.perf_counter() - start) / calls


def numpy_add(dst, src):
    def run(calls):
        for _ in range(calls):
            np.add(dst, src, out=dst)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "bfloat16", "int32"],
        choices=sorted(DTYPES),
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    levels = [level for level in LEVELS if _engine._cpu_supports_kernels(level)]
    rng = np.random.default_rng(0)
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for kib in args.sizes_kib:
            n = kib * 1024 // np.dtype(dtype).itemsize
            # Small values: sums stay finite however often the buffer is reduced into.
            dst = rng.integers(-3, 4, n).astype(dtype)
            src = np.zeros(n, dtype)
            # The binding repeats the kernel itself: its ~2.5 us per call would
            # dominate at 64 KiB. NumPy's time includes its own ~1 us per call.
            methods = {
                f"keras-ring {level}": (
                    lambda calls, level=level: _engine._reduce_into(
                        dst, src, kr.Sum, level, repeat=calls
                    )
                )
                for level in levels
            }
            methods["numpy np.add"] = numpy_add(dst, src)
            calls = {}
            for name, fn in methods.items():  # warm up, and size each method's batch
                fn(1)
                calls[name] = max(1, int(BATCH_SECONDS / per_call_seconds(fn, 3)))
            times = {name: [] for name in methods}
            for _ in range(args.rounds):
                for name, fn in methods.items():
                    times[name].append(per_call_seconds(fn, calls[name]))
            for name in methods:
                seconds = float(np.median(times[name]))
                rows.append(
                    {
                        "dtype": dtype_name,
                        "bytes": n * np.dtype(dtype).itemsize,
                        "method": name,
                        "seconds": seconds,
                        "GBps": n * np.dtype(dtype).itemsize / seconds / 1e9,
                    }
                )

    def speed(dtype_name, size, method):
        return next(
            r["GBps"]
            for r in rows
            if (r["dtype"], r["bytes"], r["method"]) == (dtype_name, size, method)
        )

    print(
        f"\nReduceInto (sum) GB/s, median of {args.rounds} rounds; kernels in use by default: "
        f"{_engine._cpu_kernels()}"
    )
    print(f"{'dtype':<10}{'KiB':>8}  {'method':<20}{'GB/s':>8}{'x generic':>11}{'x numpy':>9}")
    for r in rows:
        r["vs_generic"] = r["GBps"] / speed(r["dtype"], r["bytes"], "keras-ring generic")
        r["vs_numpy"] = r["GBps"] / speed(r["dtype"], r["bytes"], "numpy np.add")
        print(
            f"{r['dtype']:<10}{r['bytes'] // 1024:>8}  {r['method']:<20}{r['GBps']:>8.2f}"
            f"{r['vs_generic']:>11.2f}{r['vs_numpy']:>9.2f}"
        )

    name = "reduce_kernels"
    fig, axes = write_results(
        args.out,
        name,
        {"rounds": args.rounds, "levels": levels, "rows": rows},
        ncols=len(args.dtypes),
        figsize=(3.2 * len(args.dtypes), 3.6),
        squeeze=False,
    )
    for ax, dtype_name in zip(axes[0], args.dtypes):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [r for r in rows if r["method"] == method and r["dtype"] == dtype_name]
            ax.plot([r["bytes"] / 1024 for r in pts], [r["GBps"] for r in pts], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer size (KiB)")
        ax.set_title(dtype_name)
    axes[0][0].set_ylabel("GB/s (one buffer's bytes per call)")
    axes[0][0].legend(fontsize="small")
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
