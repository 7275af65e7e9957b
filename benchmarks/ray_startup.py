"""Seconds from asking for a job to its first training step: on Ray against keras-ring-run.

    python benchmarks/ray_startup.py [--np 2] [--repeats 3]

The same training function (a small MLP, one `model.fit` step with
`kr.DistributedOptimizer`, under KERAS_BACKEND=torch) is started, in turn and
alternated, by:

- `keras-ring-run -np NP` (the baseline: fresh processes on the TCP world);
- `RayExecutor(num_workers=NP)`: `start()` then `run()`, on a Ray cluster
  started beforehand (its start is not counted);
- `KerasRingTrainer` with `ScalingConfig(num_workers=NP)`: `fit()`, on the
  same cluster.

Each measures from the call that asks for the job to the end of the slowest
worker's first step, read from the time the workers record. Prints a table,
and writes JSON and a PNG plot to benchmarks/results/.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def first_step():
    """One worker: kr.init(), a model given rank 0's weights, one step; the wall time at its end."""
    import keras
    import numpy as np
    import torch

    import keras_ring as kr

    torch.set_num_threads(1)
    kr.init()
    x = np.random.default_rng(kr.rank()).normal(size=(32, 64)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    return time.time()


def _trainer_loop(config):
    done = first_step()
    with open(os.path.join(config["dir"], f"{os.getpid()}.json"), "w") as f:
        json.dump(done, f)


def launcher_run(args, out):
    start = time.time()
    subprocess.run(["keras-ring-run", "-np", str(args.np), "--transport", "tcp",
                    sys.executable, os.path.abspath(__file__), "--worker", out], check=True,
                   stdout=subprocess.DEVNULL)
    return _slowest(out) - start


def executor_run(args, out):
    from keras_ring.ray import RayExecutor

    start = time.time()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=args.np)
    executor.start()
    try:
        done = executor.run(first_step)
    finally:
        executor.shutdown()
    return max(done) - start


def trainer_run(args, out):
    from ray.train import RunConfig, ScalingConfig

    from keras_ring.ray import KerasRingTrainer

    start = time.time()
    result = KerasRingTrainer(_trainer_loop, train_loop_config={"dir": out},
                              scaling_config=ScalingConfig(num_workers=args.np),
                              run_config=RunConfig(storage_path=out)).fit()
    if result.error is not None:
        raise result.error
    return _slowest(out) - start


def _slowest(out):
    times = []
    for name in os.listdir(out):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                times.append(json.load(f))
    return max(times)


RUNS = {"keras-ring-run": launcher_run, "RayExecutor": executor_run,
        "KerasRingTrainer": trainer_run}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.worker:
        done = first_step()
        with open(os.path.join(args.worker, f"{os.getpid()}.json"), "w") as f:
            json.dump(done, f)
        return
    import ray

    # Ray's workers start in the driver's directory and import this file's functions by value.
    here, scratch = os.getcwd(), tempfile.mkdtemp(prefix="kr-ray-startup-")
    os.chdir(scratch)
    ray.init(num_cpus=args.np + 1, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    seconds = {name: [] for name in RUNS}
    for repeat in range(args.repeats):
        # Alternated: each method goes first in turn.
        names = list(RUNS)[repeat % len(RUNS):] + list(RUNS)[:repeat % len(RUNS)]
        for name in names:
            with tempfile.TemporaryDirectory() as out:
                seconds[name].append(RUNS[name](args, out))
    ray.shutdown()
    os.chdir(here)
    shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.median(seconds["keras-ring-run"])
    print(f"{'start':>17} {'median s':>9} {'runs s':>22} {'/ keras-ring-run':>17}")
    for name, values in seconds.items():
        median = statistics.median(values)
        runs = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:>17} {median:>9.1f} {runs:>22} {median / base:>17.2f}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import save_plot, write_results

    fig, ax = write_results(args.out, "ray_startup", {"np": args.np, "seconds": seconds},
                            figsize=(6, 4))
    for i, (name, values) in enumerate(seconds.items()):
        ax.bar(i, statistics.median(values), 0.6)
        ax.plot([i] * len(values), values, "k.")
    ax.set_xticks(range(len(seconds)))
    ax.set_xticklabels(list(seconds))
    ax.set_ylabel(f"seconds to the first step, {args.np} workers")
    save_plot(fig, args.out, "ray_startup")


if __name__ == "__main__":
    main()
