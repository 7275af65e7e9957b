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
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

from keras_ring.ray import ElasticRayExecutor

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
import ray_jobs  # noqa: E402


def run(executor, results):
    try:
        results.append(executor.run(ray_jobs.train_script))
    except BaseException as e:  # noqa: BLE001 -- raised again by the main thread
        results.append(e)


# Ray's workers cannot import ray_jobs: it travels by value.
ray.cloudpickle.register_pickle_by_value(ray_jobs)
# Ray adds nodes from the main thread only: the job runs in another.
cluster = Cluster(initialize_head=True, connect=True,
                  head_node_args={"num_cpus": 2, "include_dashboard": False})
try:
    executor = ElasticRayExecutor(
        ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3, elastic_timeout=60),
        env_vars=ray_jobs.elastic_env())
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
