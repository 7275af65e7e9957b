"""keras_ring.ray on a local Ray cluster (3 CPUs): Horovod's RayExecutor and ElasticRayExecutor.

The elastic jobs run tests/workers/elastic_train_worker.py, the script of
test_elastic.py's jobs, as each worker's function, and check its logs as
those tests do (elastic_checks.py).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import RANK_THREAD_ENV
from elastic_checks import (
    EPOCHS,
    STEPS,
    check_training_went_on,
    events_of,
    losses_continue,
    read_logs,
    resets_of,
    shm_segments,
)

ray = pytest.importorskip("ray")

from keras_ring.ray import ElasticRayExecutor, RayExecutor  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
ELASTIC_WORKER = pathlib.Path(__file__).parent / "workers" / "elastic_train_worker.py"
CPUS = 3
DOC_EPILOGUE = """
assert [rank for rank, _ in results] == [0, 1], results
assert all(np.array_equal(a, b) for a, b in zip(results[0][1], results[1][1]))
print("the Ray page's job ran on", len(results), "workers")
"""


def test_the_ray_pages_script_runs_as_written(tmp_path):
    # First in this file: the page's ray.init() starts a cluster of its own.
    text = (ROOT / "docs/ray.md").read_text()
    script = re.search(r"```python\n(.*?)```", text, re.DOTALL)[1]
    (tmp_path / "job.py").write_text("import numpy as np\n" + script + DOC_EPILOGUE)
    result = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL,
                            env={**os.environ, **RANK_THREAD_ENV, "KERAS_BACKEND": "torch",
                                 "RAY_USAGE_STATS_ENABLED": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "the Ray page's job ran on 2 workers" in result.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ray's workers start in the driver's directory: not the source tree, which has no engine.
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    os.chdir(here)


@pytest.fixture
def executor(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    yield ex
    ex.shutdown()


def _ranks():
    import keras_ring as kr

    kr.init()
    return kr.rank(), kr.size(), kr.local_rank(), kr.local_size()


def test_results_come_back_in_rank_order(executor):
    assert executor.run(_ranks) == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert ray.get(executor.run_remote(_ranks))[1][0] == 1
    assert executor.execute_single(lambda _: _ranks()[0]) == 0


def _fit(seed):
    os.environ["KERAS_BACKEND"] = "torch"
    import keras
    import torch

    import keras_ring as kr

    torch.set_num_threads(1)
    kr.init()
    keras.utils.set_random_seed(seed + kr.rank())  # each rank starts from its own weights
    x = np.random.default_rng(kr.rank()).normal(size=(64, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model.get_weights()


def test_workers_that_start_from_different_weights_end_identical(executor):
    first, second = executor.run(_fit, kwargs={"seed": 3})
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def _fail_on_rank_1():
    import keras_ring as kr

    kr.init()
    if kr.rank() == 1:
        raise ValueError("rank 1 says no")


def test_a_workers_exception_comes_back_with_its_rank_and_traceback(executor):
    with pytest.raises(ValueError, match="rank 1 says no") as info:
        executor.run(_fail_on_rank_1)
    assert "keras-ring: raised on rank 1 of 2" in info.value.__notes__
    assert "Traceback on rank 1" in str(info.value.__cause__)


class _Counter:
    def __init__(self, start):
        self.count = start

    def bump(self):
        self.count += 1
        return self.count


def test_execute_calls_each_workers_executable(cluster):
    ex = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    ex.start(executable_cls=_Counter, executable_args=[10])
    try:
        assert ex.execute(lambda counter: counter.bump()) == [11, 11]
        assert ex.execute_single(lambda counter: counter.bump()) == 12
        assert ex.execute(lambda counter: counter.count) == [12, 11]
    finally:
        ex.shutdown()


def test_run_before_start_and_after_shutdown_is_refused(cluster):
    ex = RayExecutor(RayExecutor.create_settings(), num_workers=1)
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(_ranks)
    ex.start()
    ex.shutdown()
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(_ranks)


def test_more_workers_than_the_cluster_can_place_time_out_and_leave_nothing(cluster):
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=5)
    with pytest.raises(TimeoutError, match="could not place 5 bundles"):
        ex.start()
    ex.shutdown()
    assert ray.available_resources().get("CPU") == CPUS


def test_gpus_and_callbacks_are_refused(executor):
    with pytest.raises(ValueError, match="CPUs only"):
        RayExecutor(RayExecutor.create_settings(), num_workers=1, use_gpu=True)
    with pytest.raises(NotImplementedError, match="take no callbacks"):
        executor.run(_ranks, callbacks=[print])


def _train_script():
    import runpy

    runpy.run_path(str(ELASTIC_WORKER), run_name="__main__")
    return os.environ["KERAS_RING_WORKER"]


def run_elastic_on_ray(tmp_path, capfd, env, **settings):
    """Runs the elastic training script on the cluster's 3 slots; returns (result, logs), as
    test_elastic.run_elastic does: result.returncode 0 with the workers' names in rank order,
    1 with the error; result.stdout the driver's lines."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    env = {**RANK_THREAD_ENV, "KR_TEST_LOG": str(log_dir), "KR_TEST_EPOCHS": str(EPOCHS),
           "KR_TEST_STEPS": str(STEPS), "KERAS_BACKEND": "torch",
           # Long enough for the three actors to start and ask before the first world forms.
           "KERAS_RING_TIMEOUT": "30", **env}
    before = shm_segments()
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(**settings), env_vars=env)
    executor.start()
    try:
        code, value = 0, executor.run(_train_script)
    except RuntimeError as e:
        code, value = 1, e
    finally:
        executor.shutdown()
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    out = capfd.readouterr().err
    assert ray.available_resources().get("CPU") == CPUS, f"actors left behind\n{out[-6000:]}"
    assert shm_segments() - before == set(), out[-6000:]
    return subprocess.CompletedProcess("ElasticRayExecutor.run", code, out), value, read_logs(
        log_dir)


@pytest.mark.parametrize("fault", ["KILL", "RAISE"])
def test_elastic_a_lost_worker_leaves_the_others_training_from_the_last_commit(
        cluster, tmp_path, capfd, fault):
    result, names, logs = run_elastic_on_ray(tmp_path, capfd, {"KR_TEST_FAULT": f"11:1:{fault}"},
                                             min_num_proc=2)
    check_training_went_on(result, logs, survivors=2)
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["size"] == 2 for r in resets), resets
    assert all(r["iterations"] == 10 for r in resets), resets  # the last commit before step 11
    losses_continue(logs)
    # The results are the last world's, in rank order: the workers started first and third.
    assert [name.split(":")[1:] for name in names] == [["0", "0"], ["2", "2"]], names
    lost = re.search(r"lost worker (\S+):1 \(rank 1 of generation 0\): (.*)", result.stdout)
    assert lost, result.stdout[-6000:]
    assert lost[2].startswith("its Ray actor (pid " if fault == "KILL" else
                              "raised RuntimeError: the test's fault"), lost[2]
    assert "generation 1: 2 workers" in result.stdout


def test_elastic_below_min_num_proc_fails_naming_the_lost_worker_and_leaves_nothing(
        cluster, tmp_path, capfd):
    result, error, logs = run_elastic_on_ray(tmp_path, capfd, {"KR_TEST_FAULT": "11:2:KILL"},
                                             min_num_proc=3, elastic_timeout=3)
    assert result.returncode == 1, result.stdout[-6000:]
    assert re.fullmatch(r"keras-ring: the elastic job failed: fewer than min_num_proc 3 workers "
                        r"for 3 s \(elastic_timeout\); waiting: .*\. Lost workers: \S+:2 \(its "
                        r"Ray actor \(pid \d+\) died: .*\)\.", str(error)), error
    assert not any(events_of(events, "end") for events in logs.values())


def _size():
    import keras_ring as kr

    kr.init()
    return kr.size()


@ray.remote(num_cpus=1)
class _Holder:
    def ready(self):
        return True


def test_elastic_an_actor_ray_cannot_start_in_time_is_left_out_and_the_others_train(
        cluster, capfd):
    holder = _Holder.remote()  # holds one of the cluster's 3 CPUs: the third slot's actor waits
    ray.get(holder.ready.remote())
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=2,
                                                                     timeout_s=3),
                                  env_vars={**RANK_THREAD_ENV, "KERAS_RING_TIMEOUT": "60"})
    try:
        executor.start()
        assert executor.run(_size) == [2, 2]
        # A second run serves a store of its own: none of the first run's answers are read.
        ray.kill(holder)
        assert executor.run(_size) == [3, 3, 3]
    finally:
        ray.kill(holder)
        executor.shutdown()
    err = capfd.readouterr().err
    assert re.search(r"lost worker \S+:2 \(not in a world\): Ray did not start its actor within "
                     r"timeout_s=3 s \(1 CPUs on node \w+ asked for\)", err), err[-4000:]


def test_elastic_run_before_start_gpus_and_callbacks_are_refused(cluster):
    with pytest.raises(RuntimeError, match="call start"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings()).run(_train_script)
    with pytest.raises(NotImplementedError, match="take no callbacks"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings()).run(_train_script, [print])
    with pytest.raises(ValueError, match="CPUs only"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), use_gpu=True)


def test_elastic_a_node_added_grows_the_job_up_to_max_num_proc(tmp_path):
    # Its own cluster of several nodes, in its own driver (tests/workers/ray_grow_driver.py).
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    result = subprocess.run(
        [sys.executable, str(ELASTIC_WORKER.parent / "ray_grow_driver.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, **RANK_THREAD_ENV, "KERAS_BACKEND": "torch",
             "RAY_USAGE_STATS_ENABLED": "0", "KR_TEST_LOG": str(log_dir),
             "KR_TEST_EPOCHS": str(EPOCHS), "KR_TEST_STEPS": str(STEPS),
             "KR_TEST_HOSTS_FILE": str(tmp_path / "grow"), "KR_TEST_HOSTS_FROM": "1",
             # Rank 0's steps last this much more until the world has grown: 46 s in all.
             "KR_TEST_HOSTS_STEP_SECONDS": "1.5",
             "KR_TEST_HOSTS_PHASES": json.dumps([["a node is added", 3]]),
             "KERAS_RING_TIMEOUT": "30"})
    result.stdout += result.stderr
    logs = read_logs(log_dir)
    check_training_went_on(result, logs, survivors=3)
    resets = resets_of(logs)
    # The two first workers go back to a commit and go on with the newcomer (whose first
    # world starts with a reset too): 3 workers, not 4.
    assert [r["size"] for r in resets] == [3, 3, 3], resets
    names = json.loads(next(line for line in result.stdout.splitlines() if line.startswith('["')))
    assert len(names) == 3 and len({n.rsplit(":", 2)[0] for n in names}) == 2, names
    assert "workers were added" in result.stdout or "generation 1: 3 workers" in result.stdout
