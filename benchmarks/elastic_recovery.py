"""Seconds from a worker's SIGKILL to the next training step, against restarting the job.

    python benchmarks/elastic_recovery.py [--np 3] [--kill-at 40] [--repeats 2] [--on ray]

Runs this file's training (an MLP fitted with `model.fit` on synthetic data,
kr.elastic's state and callbacks, a commit every 5 steps) as an elastic job
(`keras-ring-run --elastic -np NP --min-np NP-1`), SIGKILLs one worker once
the job has done `--kill-at` steps, and reads from the workers' step logs:

- recovery: seconds from the kill to the first step finished in the new world;
- throughput (steps per second) before the kill and after the recovery.

With `--on ray`, the elastic job is an `ElasticRayExecutor` run on a local Ray
cluster of NP CPUs instead (the baseline stays `keras-ring-run`'s).

The baseline, measured in the same run: what a job that restarts every worker
from a checkpoint pays at least (MultiWorkerMirroredStrategy's and torchrun's
way): seconds from starting a fresh job of NP-1 workers (`keras-ring-run
--transport tcp`: Python, TensorFlow, the engine, the model) to its first
step, with no checkpoint to load. Prints a table and writes JSON and a PNG
plot to benchmarks/results/.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

STEPS_PER_EPOCH = 20
BATCH = 64


def worker(log_dir, epochs, elastic):
    """One worker's training; logs `{"t", "generation", "size", "iterations"}` per step."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    import keras_ring as kr
    from keras_ring.core import _elastic_world

    kr.init()
    name = os.environ.get("KERAS_RING_WORKER", f"rank{kr.rank()}").replace(":", "_")
    log = open(os.path.join(log_dir, name + ".jsonl"), "a", encoding="utf-8")
    log.write(json.dumps({"pid": os.getpid()}) + "\n")
    log.flush()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 256)).astype(np.float32)
    y = rng.integers(0, 10, size=4096)

    def dataset():
        data = tf.data.Dataset.from_tensor_slices((x, y))
        return kr.shard_dataset(data).repeat().batch(BATCH)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Log(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            log.write(json.dumps({"t": time.time(), "generation": _elastic_world.generation(),
                                  "size": kr.size(),
                                  "iterations": int(self.model.optimizer.iterations.numpy())})
                      + "\n")
            log.flush()

    if not elastic:
        model.fit(dataset(), steps_per_epoch=1, epochs=1, verbose=0, callbacks=[Log()])
        return
    state = kr.elastic.KerasState(model, batch=0, epoch=0)

    @kr.elastic.run
    def train(state):
        model.fit(dataset(), steps_per_epoch=STEPS_PER_EPOCH, epochs=epochs - state.epoch,
                  verbose=0,
                  callbacks=[kr.elastic.CommitStateCallback(state, batches_per_commit=5),
                             kr.elastic.UpdateBatchStateCallback(state),
                             kr.elastic.UpdateEpochStateCallback(state), Log()])

    train(state)


def _read(log_dir):
    logs = {}
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), encoding="utf-8") as f:
            logs[name] = [json.loads(line) for line in f if line.strip()]
    return logs


def _launch(args, log_dir, extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = ["keras-ring-run", *extra, sys.executable, os.path.abspath(__file__), "--worker",
               log_dir, "--epochs", str(args.epochs)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


class _RayJob:
    """An ElasticRayExecutor run in a thread, with `_launch`'s job's poll() and communicate()."""

    def __init__(self, args, log_dir):
        import threading

        from keras_ring.ray import ElasticRayExecutor

        self.executor = ElasticRayExecutor(
            ElasticRayExecutor.create_settings(min_num_proc=args.np - 1, max_num_proc=args.np),
            env_vars={"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.executor.start()
        self.returncode = self.error = None
        self.thread = threading.Thread(target=self._run, args=(log_dir, args.epochs))
        self.thread.start()

    def _run(self, log_dir, epochs):
        try:
            self.executor.run(lambda: worker(log_dir, epochs, elastic=True))
            self.returncode = 0
        except Exception as e:  # noqa: BLE001 -- reported as a launcher's exit would be
            self.returncode, self.error = 1, e

    def poll(self):
        return None if self.thread.is_alive() else self.returncode

    def communicate(self, timeout):
        self.thread.join(timeout)
        self.executor.shutdown()
        return None, str(self.error)


def elastic_run(args):
    """(recovery seconds, steps/s before, steps/s after) of one killed elastic job."""
    with tempfile.TemporaryDirectory() as log_dir:
        if args.on == "ray":
            job = _RayJob(args, log_dir)
        else:
            job = _launch(args, log_dir, ["--elastic", "-np", str(args.np), "--min-np",
                                          str(args.np - 1)])
        killed_at = None
        deadline = time.monotonic() + 600
        while killed_at is None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
            logs = _read(log_dir)
            steps = [e for events in logs.values() for e in events if "iterations" in e]
            if max((e["iterations"] for e in steps), default=0) >= args.kill_at:
                victim = next(e["pid"] for name, events in sorted(logs.items())
                              for e in events if "pid" in e and name.endswith("_1.jsonl"))
                os.kill(victim, signal.SIGKILL)
                killed_at = time.time()
        _, stderr = job.communicate(timeout=600)
        if job.returncode != 0 or killed_at is None:
            raise SystemExit(f"the elastic job failed (exit {job.returncode}):\n{stderr[-4000:]}")
        steps = sorted((e for events in _read(log_dir).values() for e in events
                        if "iterations" in e), key=lambda e: e["t"])
    before = [e for e in steps if e["generation"] == 0]
    after = [e for e in steps if e["generation"] > 0]
    recovery = after[0]["t"] - killed_at

    def rate(events):
        events = events[len(events) // 4:]  # past the warm-up (and the first compiled step)
        return (len(events) - 1) / (events[-1]["t"] - events[0]["t"])

    return recovery, rate(before), rate(after)


def restart_run(args):
    """Seconds from starting a fresh job of np-1 workers to its first step."""
    with tempfile.TemporaryDirectory() as log_dir:
        start = time.time()
        job = _launch(args, log_dir, ["--transport", "tcp", "-np", str(args.np - 1)])
        _, stderr = job.communicate(timeout=600)
        if job.returncode != 0:
            raise SystemExit(f"the restarted job failed (exit {job.returncode}):\n{stderr[-4000:]}")
        first = min(e["t"] for events in _read(log_dir).values() for e in events if "t" in e)
    return first - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--on", choices=["keras-ring-run", "ray"], default="keras-ring-run",
                        help="what runs the elastic job")
    parser.add_argument("--worker", metavar="LOG_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.epochs, elastic="KERAS_RING_ELASTIC" in os.environ)
    name = "elastic_recovery"
    if args.on == "ray":
        import ray

        name = "elastic_recovery_ray"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(num_cpus=args.np, include_dashboard=False, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rows = []
    for repeat in range(args.repeats):
        recovery, before, after = elastic_run(args)
        restart = restart_run(args)
        rows.append({"repeat": repeat, "recovery_s": recovery, "restart_s": restart,
                     "steps_per_s_before": before, "steps_per_s_after": after})
    print(f"{'run':>4} {'recovery s':>11} {'restart s':>10} {'restart/recovery':>17} "
          f"{'steps/s before':>15} {'steps/s after':>14}")
    for r in rows:
        print(f"{r['repeat']:>4} {r['recovery_s']:>11.2f} {r['restart_s']:>10.2f} "
              f"{r['restart_s'] / r['recovery_s']:>17.1f} {r['steps_per_s_before']:>15.1f} "
              f"{r['steps_per_s_after']:>14.1f}")
    sys.path.insert(0, os.path.dirname(__file__))
    from _report import save_plot, write_results

    fig, ax = write_results(args.out, name,
                            {"np": args.np, "kill_at": args.kill_at, "on": args.on,
                             "rows": rows},
                            figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["recovery_s"] for r in rows], 0.4,
           label=f"elastic on {args.on}: kill to next step")
    ax.bar([x + 0.2 for x in xs], [r["restart_s"] for r in rows], 0.4,
           label=f"restart: fresh {args.np - 1}-worker job to first step")
    ax.set_xlabel("run")
    ax.set_ylabel("seconds")
    ax.set_ylim(0, 1.4 * max(r["restart_s"] for r in rows))  # room for the legend
    ax.set_xticks(list(xs))
    ax.legend()
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
