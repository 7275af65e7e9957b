"""Many small allreduces at once: fused by the engine, unfused, one big one, mpi4py one by one.

    keras-ring-run -np 2 python benchmarks/fusion.py [--iters 20]

For 100 x 4 KiB and 1000 x 1 KiB float32 tensors submitted together, rank 0
prints the median time of: keras-ring through the engine binding, all
tensors in one `run()` call as one group (agreed as one name), as separate
tensors with fusion (KERAS_RING_FUSION_THRESHOLD's default) and without
(threshold 0), and with one `submit()` per tensor; keras-ring's
`grouped_allreduce` TF op (one op whose tensors form a group, as gradient
reduction submits them), eagerly and in a `tf.function`, with one TF
allreduce of the total in a `tf.function` to compare with; one keras-ring
allreduce of the same total bytes;
and one mpi4py `Allreduce` per tensor (what a naive per-gradient hook
costs). Each is shown as a multiple of one mpi4py
`Allreduce` of the total bytes and of one keras-ring allreduce of the total
(the performance issue's target: at most 1.5x). The engine alone (the group
and the total prepared once through `_engine._PreparedRun`, without the
binding's work per array) is timed too and compared the same way. Writes JSON
and a PNG plot to benchmarks/results/.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin otherwise

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _report import save_plot, write_results  # noqa: E402
from _timing import median_seconds  # noqa: E402
from mpi4py import MPI  # noqa: E402  (initialises MPI first; keras-ring shares it)

import keras_ring as kr  # noqa: E402
from keras_ring.core import _engine  # noqa: E402

CASES = [(100, 4096), (1000, 1024)]
ENGINE_GROUP = "keras-ring engine alone, one group"
ENGINE_TOTAL = "keras-ring engine alone, one allreduce of the total"


def engine_many(tensors, tag, group=""):
    names = [f"{tag}.{i}" for i in range(len(tensors))]

    def run():  # one call for all: the caller's thread runs the engine while it waits
        _engine.run(_engine.ALLREDUCE, tensors, names, op=kr.Sum, group=group)
    return run


def engine_one_by_one(tensors, tag):
    def run():
        handles = [_engine.submit(_engine.ALLREDUCE, t, f"{tag}.{i}", op=kr.Sum)
                   for i, t in enumerate(tensors)]
        for h in handles:
            h.wait()
    return run


def measure(comm, iters, fusion):
    """Times every method for every case with fusion on or off (engine re-initialised)."""
    kr.shutdown()
    os.environ["KERAS_RING_FUSION_THRESHOLD"] = str(64 << 20) if fusion else "0"
    # Room in the response cache for every method's names, as a training loop's
    # names (one set, step after step) would have.
    os.environ["KERAS_RING_CACHE_CAPACITY"] = "8192"
    kr.init()
    rows = []
    for count, nbytes in CASES:
        tensors = [np.full(nbytes // 4, 1.0, np.float32) for _ in range(count)]
        big = np.concatenate(tensors)
        out = np.empty_like(big)
        label = f"{count} x {nbytes // 1024} KiB"
        methods = {f"keras-ring, run(), fusion {'on' if fusion else 'off'}":
                   engine_many(tensors, f"{label}.{fusion}")}
        if fusion:
            methods["keras-ring, run(), one group"] = engine_many(
                tensors, f"{label}.group", group=f"{label}.group")
            methods["keras-ring, one submit() per tensor"] = engine_one_by_one(
                tensors, f"{label}.submit")
            tf_tensors = [tf.constant(t) for t in tensors]
            methods["keras-ring, grouped_allreduce TF op"] = lambda: kr.grouped_allreduce(
                tf_tensors, op=kr.Sum, name=f"{label}.grouped")
            # As a training step runs it: in a tf.function that returns one tensor (a step
            # returns its loss; 100 results handed to Python would cost more than the op).
            methods["keras-ring, grouped op in a tf.function"] = tf.function(
                lambda: kr.grouped_allreduce(tf_tensors, op=kr.Sum, name=f"{label}.fn")[0])
            tf_big = tf.constant(big)
            methods["keras-ring, one TF op of the total, tf.function"] = tf.function(
                lambda: kr.allreduce(tf_big, op=kr.Sum, name=f"{label}.fn.total"))
            methods["keras-ring, one allreduce of the total"] = lambda: _engine.run(
                _engine.ALLREDUCE, [big], ["total"], op=kr.Sum)
            # The engine alone: requests prepared once from the arrays, so that NumPy's and
            # Python's work per array (reading it, making its output) is left out.
            methods[ENGINE_GROUP] = _engine._PreparedRun(
                _engine.ALLREDUCE, tensors, [f"{label}.prep.{i}" for i in range(count)],
                op=kr.Sum, group=f"{label}.prep").run
            methods[ENGINE_TOTAL] = _engine._PreparedRun(
                _engine.ALLREDUCE, [big], ["prep.total"], op=kr.Sum).run
            methods["mpi4py, one Allreduce per tensor"] = lambda: [
                comm.Allreduce(t, out[: t.size], op=MPI.SUM) for t in tensors]
            methods["mpi4py, one Allreduce of the total"] = lambda: comm.Allreduce(
                big, out, op=MPI.SUM)
        for name, fn in methods.items():
            fn()  # warm up
            rows.append({"case": label, "method": name, "seconds": median_seconds(fn, iters, comm)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    kr.init()
    rows = measure(comm, args.iters, fusion=True) + measure(comm, args.iters, fusion=False)
    if kr.rank() != 0:
        return
    base = {r["case"]: r["seconds"] for r in rows
            if r["method"] == "mpi4py, one Allreduce of the total"}
    print(f"\nsmall-tensor allreduce, float32, {kr.size()} ranks, median of {args.iters}")
    ours = {r["case"]: r["seconds"] for r in rows
            if r["method"] == "keras-ring, one allreduce of the total"}
    print(f"{'case':<16}{'method':<50}{'time ms':>10}{'x one mpi4py':>14}{'x one ours':>12}")
    for r in sorted(rows, key=lambda r: (r["case"], r["seconds"])):
        r["vs_one_mpi4py_allreduce"] = r["seconds"] / base[r["case"]]
        r["vs_one_keras_ring_allreduce"] = r["seconds"] / ours[r["case"]]
        print(f"{r['case']:<16}{r['method']:<50}{r['seconds'] * 1e3:>10.2f}"
              f"{r['vs_one_mpi4py_allreduce']:>14.2f}{r['vs_one_keras_ring_allreduce']:>12.2f}")
    for count, nbytes in CASES:
        label = f"{count} x {nbytes // 1024} KiB"
        engine = {r["method"]: r["seconds"] for r in rows if r["case"] == label}
        print(f"{label}: the engine alone (requests prepared once), one group against one "
              f"allreduce of the total: {engine[ENGINE_GROUP] / engine[ENGINE_TOTAL]:.2f}x")
    name = f"fusion_{kr.size()}ranks"
    fig, axes = write_results(args.out, name,
                              {"ranks": kr.size(), "iters": args.iters, "rows": rows},
                              ncols=len(CASES), figsize=(12, 4.2))
    for ax, (count, nbytes) in zip(axes, CASES):
        label = f"{count} x {nbytes // 1024} KiB"
        pts = sorted((r for r in rows if r["case"] == label), key=lambda r: r["seconds"])
        ax.barh([r["method"] for r in pts], [r["seconds"] * 1e3 for r in pts])
        ax.set_title(label)
        ax.set_xlabel("ms")
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
