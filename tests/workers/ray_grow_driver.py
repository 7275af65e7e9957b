"""The driver of an elastic Ray job that grows: `python ray_grow_driver.py`.

It makes a Ray cluster of one node of 2 CPUs on this machine (`ray.cluster_utils.Cluster`),
runs tests/workers/elastic_train_worker.py on it under
`ElasticRayExecutor(min_num_proc=2, max_num_proc=3)`, adds a node with 2 CPUs once rank 0
writes KR_TEST_HOSTS_FILE (the worker then slows down until the world has grown, as its
KR_TEST_HOSTS_PHASES say), and prints the results as one JSON line.
"""

import json
import os
import pathlib
import runpy
import threading
import time

import ray
from ray.cluster_utils import Cluster

from keras_ring.ray import ElasticRayExecutor

WORKER = pathlib.Path(__file__).parent / "elastic_train_worker.py"


def train():
    runpy.run_path(str(WORKER), run_name="__main__")
    return os.environ["KERAS_RING_WORKER"]


def run(executor, results):
    try:
        results.append(executor.run(train))
    except BaseException as e:  # noqa: BLE001 -- raised again by the main thread
        results.append(e)


# Ray adds nodes from the main thread only: the job runs in another.
cluster = Cluster(initialize_head=True, connect=True,
                  head_node_args={"num_cpus": 2, "include_dashboard": False})
try:
    executor = ElasticRayExecutor(
        ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3, elastic_timeout=60),
        env_vars={k: os.environ[k] for k in os.environ if k.startswith(("KR_TEST", "KERAS"))
                  or k in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")})
    executor.start()
    results = []
    job = threading.Thread(target=run, args=(executor, results))
    job.start()
    while job.is_alive():
        if os.path.exists(os.environ["KR_TEST_HOSTS_FILE"]):
            cluster.add_node(num_cpus=2)
            break
        time.sleep(0.2)
    job.join()
    executor.shutdown()
    if isinstance(results[0], BaseException):
        raise results[0]
    print(json.dumps(results[0]), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
