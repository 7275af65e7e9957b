"""model.fit throughput: plain Keras, keras-ring on 1 rank, keras-ring on 2 ranks.

    python benchmarks/keras_fit.py [--steps 60] [--batch 64] [--backend tensorflow|jax]

The driver starts each configuration as its own job in one run (plain Keras
as a plain process, keras-ring under keras-ring-run), every process with one
intra-op thread, the same synthetic data and model (an MLP of about 2.4M
parameters). It prints samples/s per configuration, the overhead of the
DistributedOptimizer at 1 rank (relative to plain Keras) and the scaling
efficiency at 2 ranks (total samples/s / (2 x 1-rank samples/s)), and writes
JSON and a PNG plot to benchmarks/results/. As the machine's ceiling it also
runs two plain Keras processes at once that share nothing: whatever they lose
against one alone (cores, caches and memory bandwidth shared) no amount of
communication can win back. `--backend jax` runs every configuration under
Keras's JAX backend (NumPy data, Keras's default `jit_compile`) and writes
`keras_fit_jax.*`.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from _report import save_plot, write_results

RESULT_PREFIX = "KERAS_FIT_RESULT "


def worker(args):
    """One training job: prints its samples/s (rank 0) as a tagged JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = args.backend
    # One thread for XLA's CPU computations, as TF gets one intra-op thread.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                          "intra_op_parallelism_threads=1")
    import keras
    import numpy as np

    if args.backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    distributed = args.mode == "keras-ring"
    rank, size = 0, 1
    if distributed:
        import keras_ring as kr

        kr.init()
        rank, size = kr.rank(), kr.size()
    keras.utils.set_random_seed(rank)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch * 8, 512)).astype("float32")
    y = rng.integers(0, 10, args.batch * 8)
    if args.backend == "tensorflow":
        data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()}
    else:
        steps = args.warmup + args.steps
        data = {"x": np.tile(x, (-(-steps // 8), 1)), "y": np.tile(y, -(-steps // 8)),
                "batch_size": args.batch}
    model = keras.Sequential([
        keras.Input((512,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    optimizer = keras.optimizers.SGD(0.01)
    callbacks = []
    if distributed:
        optimizer = kr.DistributedOptimizer(optimizer)
        callbacks.append(kr.callbacks.BroadcastGlobalVariablesCallback(0))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Timer(keras.callbacks.Callback):
        # The first steps trace the function and build the op library: skip them.
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup:
                self.start = time.perf_counter()
                if distributed:  # the settings the timed steps start with
                    from keras_ring.core import _engine

                    self.parameters = _engine.parameters()

        def on_train_end(self, logs=None):
            self.seconds = time.perf_counter() - self.start

    timer = Timer()
    model.fit(**data, epochs=1, steps_per_epoch=args.warmup + args.steps,
              callbacks=callbacks + [timer], verbose=0)
    per_rank = args.steps * args.batch / timer.seconds
    total = per_rank * size
    if distributed:
        total = float(sum(kr.allgather_object(per_rank)))
    result = {"ranks": size, "samples_per_s": total, "samples_per_s_per_rank": total / size}
    if distributed:
        from keras_ring.core import _engine

        result["parameters"] = _engine.parameters()  # the settings in use at the end
        result["parameters_at_start"] = timer.parameters
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_jobs(command, copies=1, env=None):
    """Runs `copies` of one job at once (with `env` added to the environment); returns each
    copy's rank-0 result."""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=None if env is None else {**os.environ, **env})
             for _ in range(copies)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{' '.join(command)} failed:\n{stdout[-3000:]}{stderr[-3000:]}")
        results.append(json.loads(lines[0][len(RESULT_PREFIX):]))
    return results


def run_job(command, env=None):
    """Runs one job (with `env` added to the environment); returns rank 0's result."""
    return run_jobs(command, 1, env)[0]


def independent_pair(command):
    """Two plain Keras processes at once, sharing nothing: what two processes get out of this
    machine's cores and memory without communicating (the ceiling for 2 ranks)."""
    results = run_jobs(command, copies=2)
    total = sum(r["samples_per_s"] for r in results)
    return {"ranks": 2, "samples_per_s": total, "samples_per_s_per_rank": total / 2}


def driver(args):
    me = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
          "--batch", str(args.batch), "--warmup", str(args.warmup), "--backend", args.backend]
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")
    rows = [
        {"config": "plain Keras", **run_job(me + ["--mode", "plain"])},
        {"config": "keras-ring, 1 rank", **run_job([launcher, "-np", "1"] + me
                                                    + ["--mode", "keras-ring"])},
        {"config": "keras-ring, 2 ranks", **run_job([launcher, "-np", "2"] + me
                                                     + ["--mode", "keras-ring"])},
        {"config": "2 x plain, no comm.", **independent_pair(me + ["--mode", "plain"])},
    ]
    plain, one, two, pair = (r["samples_per_s"] for r in rows)
    summary = {"overhead_at_1_rank": plain / one - 1.0,
               "scaling_efficiency_at_2_ranks": two / (2 * one),
               "scaling_ceiling_at_2_processes": pair / (2 * plain),
               "of_the_ceiling_at_2_ranks": two / pair}
    print(f"\nmodel.fit on {args.backend}, MLP 512-1024-1024-512-10, batch {args.batch} per "
          f"rank, {args.steps} timed steps, 1 intra-op thread per process")
    print(f"{'configuration':<22}{'samples/s':>12}{'per rank':>12}")
    for r in rows:
        print(f"{r['config']:<22}{r['samples_per_s']:>12.0f}{r['samples_per_s_per_rank']:>12.0f}")
    print(f"overhead of keras-ring at 1 rank: {summary['overhead_at_1_rank'] * 100:+.1f}% time "
          f"per sample; scaling efficiency at 2 ranks: "
          f"{summary['scaling_efficiency_at_2_ranks'] * 100:.0f}%")
    print(f"two plain Keras processes at once, sharing nothing, reach "
          f"{summary['scaling_ceiling_at_2_processes'] * 100:.0f}% of twice one alone (this "
          f"machine's ceiling); keras-ring at 2 ranks reaches "
          f"{summary['of_the_ceiling_at_2_ranks'] * 100:.0f}% of that pair")
    name = "keras_fit" if args.backend == "tensorflow" else f"keras_fit_{args.backend}"
    fig, ax = write_results(
        args.out, name, {"backend": args.backend, "steps": args.steps, "batch": args.batch,
                         "rows": rows, **summary}, figsize=(7, 3.5))
    ax.bar([r["config"] for r in rows], [r["samples_per_s"] for r in rows])
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"model.fit throughput ({args.backend})")
    save_plot(fig, args.out, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["plain", "keras-ring"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backend", choices=["tensorflow", "jax"], default="tensorflow")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.mode:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
