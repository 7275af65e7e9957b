"""The driver of a job on a Ray cluster of network-namespace hosts (tests/test_ray_netns.py):
`python ray_netns_driver.py executor|trainer|elastic`, run in the head's host.

It joins the cluster RAY_ADDRESS names, runs one scenario's job on it and prints what the
test checks as one JSON line, after `RESULT`:

- executor: `RayExecutor` with 3 workers packed onto the nodes, then 2 hosts of one worker:
  each worker's ranks and host name, and `tests/ray_jobs.fit`'s starting and final weights;
- trainer: `KerasRingTrainer` with a worker on each node, under JAX: its last report;
- elastic: `ElasticRayExecutor(min_num_proc=2)` running tests/workers/elastic_train_worker.py
  (KR_TEST_* in the environment say its fault): the last world's workers, or the error.
"""

import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import ray

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
import ray_jobs  # noqa: E402

from keras_ring.ray import ElasticRayExecutor, RayExecutor  # noqa: E402

RESULT = "driver's result: "  # the start of its line, among the workers' lines Ray prints


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def executor():
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=3)
    ex.start()
    try:
        ranks = ex.run(ray_jobs.ranks)
        fits = ex.run(ray_jobs.fit, kwargs={"seed": 3})
    finally:
        ex.shutdown()
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                     num_workers_per_host=1)
    ex.start()
    try:
        hosts = ex.run(ray_jobs.ranks)
    finally:
        ex.shutdown()
    return {"ranks": ranks, "hosts": hosts,
            "starts_differ": [not same(fits[0][0], start) for start, _ in fits[1:]],
            "ends_identical": [same(fits[0][1], end) for _, end in fits[1:]]}


def trainer():
    from ray.train import RunConfig, ScalingConfig

    from keras_ring.ray import KerasRingTrainer

    storage = tempfile.mkdtemp(dir=os.environ["KR_TEST_LOG"])
    data = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    result = KerasRingTrainer(
        ray_jobs.trainer_loop,
        train_loop_config={"seed": 3, "epochs": 2, "starts": os.path.join(storage, "starts"),
                           "die_at": None, "backend": "jax"},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=storage, name="trainer"),
        datasets={"train": ray.data.from_items([{"x": row, "y": int(row.sum() > 0)}
                                                for row in data])}).fit()
    if result.error is not None:
        raise result.error
    return result.metrics


def elastic():
    executor = ElasticRayExecutor(
        ElasticRayExecutor.create_settings(min_num_proc=2),
        env_vars=ray_jobs.elastic_env())
    executor.start()
    try:
        return {"names": executor.run(ray_jobs.train_script)}
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        executor.shutdown()


ray.init()  # the workers' output comes here, as a user's driver has it
try:
    # Ray's workers cannot import ray_jobs: it travels by value.
    ray.cloudpickle.register_pickle_by_value(ray_jobs)
    outcome = {"executor": executor, "trainer": trainer, "elastic": elastic}[sys.argv[1]]()
    print(RESULT + json.dumps(outcome, default=lambda a: a.tolist()), flush=True)
finally:
    ray.shutdown()
