"""Soak: a long run's memory, threads, file descriptors and shared memory stay flat.

    python benchmarks/soak.py [--cached 10000] [--unique 10000] [--steps 2000]

One 2-rank job under keras-ring-run runs three phases: eager allreduces of one
name (the response cache's case), allreduces of a new name each (every one
negotiated, the cache evicting), then `model.fit` steps with a
DistributedOptimizer. Each rank samples its resident memory (VmRSS), its
threads, its open file descriptors and the /dev/shm files it maps as it goes. The
baseline, in the same run, is the same `fit` in plain Keras, one process: what
TensorFlow itself grows by. A phase's growth is counted from a tenth of the way
in (first calls build kernels and caches) to its end. Prints a table, writes
JSON and a PNG plot to benchmarks/results/; tests/test_soak.py runs a short
form and checks the same figures.
"""

import argparse
import json
import os
import subprocess
import sys

from _report import save_plot, write_results

RESULT_PREFIX = "SOAK_RESULT "
FEATURES, BATCH = 32, 16
SHM = "/dev/shm"


def sample(iteration):
    """This process's (iteration, RSS in MiB, threads, open fds, /dev/shm files it maps)."""
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/maps") as f:
        # Its own: /dev/shm is the machine's, where other jobs come and go.
        shared = {line.split()[-1] for line in f if f" {SHM}/" in line}
    return (iteration, rss_kib / 1024, len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")), len(shared))


def samples_every(count):
    return max(1, count // 50)


def fit_phase(model, steps, callbacks=()):
    """Runs `steps` fit steps with `callbacks`, sampling as they go."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * 8, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    every, series = samples_every(steps), []

    class Sampler(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % every == 0:
                series.append(sample(batch + 1))

    model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=[*callbacks, Sampler()],
              verbose=0)
    return series


def model_for(optimizer):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def worker(args):
    """One process of the soak: prints its phases' samples as a tagged JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    phases = {}
    if args.plain:
        phases["fit"] = fit_phase(model_for(keras.optimizers.SGD(0.01)), args.steps)
        print(RESULT_PREFIX + json.dumps({"rank": 0, "phases": phases}), flush=True)
        return
    import keras_ring as kr

    kr.init()
    value = np.full(1024, kr.rank() + 1, np.float32)  # 4 KiB: the engine's work, not copying
    expected = np.full(1024, sum(range(1, kr.size() + 1)), np.float32)
    for phase, count in (("cached", args.cached), ("unique", args.unique)):
        every, series = samples_every(count), []
        for i in range(count):
            name = "soak.cached" if phase == "cached" else f"soak.unique.{i}"
            result = kr.allreduce(value, op=kr.Sum, name=name).numpy()
            if not np.array_equal(result, expected):
                raise SystemExit(f"rank {kr.rank()}: {phase} allreduce {i} gave {result[:4]}")
            if (i + 1) % every == 0:
                series.append(sample(i + 1))
        phases[phase] = series
    optimizer = kr.DistributedOptimizer(keras.optimizers.SGD(0.01))
    phases["fit"] = fit_phase(model_for(optimizer), args.steps,
                              [kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    print(RESULT_PREFIX + json.dumps({"rank": kr.rank(), "phases": phases}), flush=True)


def growth(series):
    """(RSS MiB, threads, fds, /dev/shm files mapped) at a tenth of the way in, and at the end."""
    start = series[max(0, len(series) // 10 - 1)]
    return {"from_iteration": start[0], "to_iteration": series[-1][0],
            "rss_mib": [start[1], series[-1][1]], "threads": [start[2], series[-1][2]],
            "fds": [start[3], series[-1][3]], "shm_files": [start[4], series[-1][4]]}


def run(command):
    """Runs one job; returns each reporting process's result, by rank."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def soak(args, np_ranks=2):
    """Runs the soak and its baseline; returns the rows of the table."""
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--cached", str(args.cached),
          "--unique", str(args.unique), "--steps", str(args.steps)]
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")
    rows = []
    for result in run([launcher, "-np", str(np_ranks)] + me):
        for phase, series in result["phases"].items():
            rows.append({"config": f"keras-ring rank {result['rank']}", "phase": phase,
                         "series": series, **growth(series)})
    (plain,) = run(me + ["--plain"])
    rows.append({"config": "plain Keras", "phase": "fit", "series": plain["phases"]["fit"],
                 **growth(plain["phases"]["fit"])})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--cached", type=int, default=10000)
    parser.add_argument("--unique", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = soak(args)
    print(f"\nsoak: {args.cached} cached and {args.unique} uniquely named allreduces of 4 KiB, "
          f"{args.steps} fit steps; 2 ranks, 1 intra-op thread each; from a tenth of each phase "
          "to its end")
    print(f"{'configuration':<20}{'phase':<8}{'RSS MiB':>16}{'growth':>9}{'threads':>10}"
          f"{'fds':>10}{'shm maps':>10}")
    for r in rows:
        a, b = r["rss_mib"]
        pair = {k: f"{r[k][0]} -> {r[k][1]}" for k in ("threads", "fds", "shm_files")}
        print(f"{r['config']:<20}{r['phase']:<8}{f'{a:.0f} -> {b:.0f}':>16}{b - a:>+9.1f}"
              f"{pair['threads']:>10}{pair['fds']:>10}{pair['shm_files']:>10}")
    fig, axes = write_results(args.out, "soak", {"cached": args.cached, "unique": args.unique,
                                                  "steps": args.steps, "rows": rows},
                              ncols=3, figsize=(12, 3.5))
    for ax, phase in zip(axes, ("cached", "unique", "fit")):
        for r in rows:
            if r["phase"] == phase:
                series = r["series"]
                ax.plot([s[0] for s in series], [s[1] - series[0][1] for s in series],
                        label=r["config"])
        ax.set_ylim(-2, max(10, ax.get_ylim()[1]))  # a flat line looks flat
        ax.set_title(phase)
        ax.set_xlabel("iteration")
        ax.set_ylabel("RSS since the phase's first sample (MiB)")
        ax.legend(fontsize=7)
    save_plot(fig, args.out, "soak")


if __name__ == "__main__":
    main()
