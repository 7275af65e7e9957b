"""Allreduce time: keras_ring.jax's custom call against the TF op, in one job.

    keras-ring-run -np 2 python benchmarks/jax_vs_tf.py [--sizes-kib 4 1024 65536] [--iters 30]

Every rank holds TensorFlow and JAX; each size is reduced by the TF op
eagerly and inside a `tf.function`, and by `keras_ring.jax.allreduce`
eagerly and inside `jax.jit`, one method after the other, each call started
together on every rank (an mpi4py barrier). "JAX jit donated" donates its
argument (`donate_argnums`), so XLA reduces it in place; the plain jitted
call's input belongs to the caller, so XLA first copies it into a fresh
result buffer, as for any value it may not overwrite. Rank 0 prints the
median times and JAX's as a ratio to the TF op's (eager against eager, jit
against `tf.function`, donated jit against the eager op), and writes JSON
and a PNG plot to benchmarks/results/.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _report import save_plot, write_results  # noqa: E402
from _timing import median_seconds  # noqa: E402
from mpi4py import MPI  # noqa: E402  (initialises MPI before keras-ring, which then shares it)

import keras_ring as kr  # noqa: E402
import keras_ring.jax as krj  # noqa: E402

METHODS = ("TF op eager", "TF op tf.function", "JAX eager", "JAX jax.jit", "JAX jit donated")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 1024, 16384, 65536])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    kr.init()
    comm = MPI.COMM_WORLD
    rows = []
    for kib in args.sizes_kib:
        values = np.random.default_rng(kr.rank()).random(kib * 256, np.float32)
        tf_value, jax_value = tf.constant(values), jnp.asarray(values)
        tf_function = tf.function(lambda t: kr.allreduce(t, name="bench.tf"))
        jitted = jax.jit(lambda a: krj.allreduce(a, name="bench.jax"))
        donating = jax.jit(lambda a: krj.allreduce(a, op=kr.Average, name="bench.jax.donated"),
                           donate_argnums=0)
        donated = [jnp.array(values)]

        def reduce_donated():
            donated[0] = donating(donated[0]).block_until_ready()

        calls = {
            "TF op eager": lambda: kr.allreduce(tf_value, name="bench.tf.eager").numpy(),
            "TF op tf.function": lambda: tf_function(tf_value).numpy(),
            "JAX eager": lambda: krj.allreduce(jax_value, name="bench.jax.eager"),
            "JAX jax.jit": lambda: jitted(jax_value).block_until_ready(),
            "JAX jit donated": reduce_donated,
        }
        times = {}
        for method in METHODS:
            calls[method]()  # builds, traces and compiles outside the timing
            times[method] = median_seconds(calls[method], args.iters, comm)
        rows.append({"kib": kib, **{m: times[m] for m in METHODS}})
    kr.shutdown()
    if comm.rank != 0:
        return
    header = f"{'size':>10} " + " ".join(f"{m:>18}" for m in METHODS)
    print(f"allreduce, {comm.size} ranks, median of {args.iters} (us)")
    print(header + f" {'JAX/TF eager':>13} {'jit/tf.function':>16} {'donated/TF eager':>17}")
    for row in rows:
        print(f"{row['kib']:>7} KiB " + " ".join(f"{row[m] * 1e6:>18.1f}" for m in METHODS)
              + f" {row['JAX eager'] / row['TF op eager']:>13.2f}"
              + f" {row['JAX jax.jit'] / row['TF op tf.function']:>16.2f}"
              + f" {row['JAX jit donated'] / row['TF op eager']:>17.2f}")
    payload = {"ranks": comm.size, "iters": args.iters, "rows": rows}
    fig, ax = write_results(args.out, "jax_vs_tf", payload, figsize=(7, 4))
    sizes = [row["kib"] for row in rows]
    for method in METHODS:
        ax.plot(sizes, [row[method] * 1e6 for row in rows], marker="o", label=method)
    ax.set(xscale="log", yscale="log", xlabel="KiB per rank", ylabel="median time (us)",
           title=f"keras-ring allreduce, TF op and JAX custom call, {comm.size} ranks")
    ax.legend()
    save_plot(fig, args.out, "jax_vs_tf")


if __name__ == "__main__":
    main()
