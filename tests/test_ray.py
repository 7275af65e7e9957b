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
import ray_jobs
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
WORKERS = pathlib.Path(__file__).parent / "workers"
CPUS = 3
DOC_EPILOGUE = """
assert [rank for rank, _ in results] == [0, 1], results
assert all(np.array_equal(a, b) for a, b in zip(results[0][1], results[1][1]))
print("the Ray page's job ran on", len(results), "workers")
"""
ELASTIC_EPILOGUE = """
import numpy as np
# One worker per CPU of this machine, up to max_num_proc.
assert [r[:2] for r in results] == [(rank, len(results)) for rank in range(len(results))]
assert len(results) >= 2, results
assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(results[0][2], r[2]))
print("the Ray page's elastic job ran on", len(results), "workers")
"""
TRAINER_EPILOGUE = """
assert result.error is None and np.isfinite(result.metrics["loss"]), result
with result.checkpoint.as_directory() as directory:
    assert os.listdir(directory) == ["model.keras"]
print("the Ray page's trainer ran")
"""


def run_page_script(tmp_path, index, text):
    """The Ray page's `index`-th Python script as written, with `text` after it, in a process
    (and Ray cluster) of its own."""
    script = re.findall(r"```python\n(.*?)```", (ROOT / "docs/ray.md").read_text(), re.DOTALL)
    (tmp_path / "job.py").write_text(script[index] + text)
    result = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL,
                            env={**os.environ, **RANK_THREAD_ENV, "KERAS_BACKEND": "torch",
                                 "RAY_USAGE_STATS_ENABLED": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


# First in this file, before the cluster of this process: the page's ray.init() starts one.
def test_the_ray_pages_script_runs_as_written(tmp_path):
    assert "the Ray page's job ran on 2 workers" in run_page_script(
        tmp_path, 0, "import numpy as np\n" + DOC_EPILOGUE)


def test_the_ray_pages_elastic_script_runs_as_written(tmp_path):
    assert "the Ray page's elastic job ran on" in run_page_script(tmp_path, 1, ELASTIC_EPILOGUE)


def test_the_ray_pages_trainer_script_runs_as_written(tmp_path):
    assert "the Ray page's trainer ran" in run_page_script(tmp_path, 2, TRAINER_EPILOGUE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ray's workers start in the driver's directory: not the source tree, which has no engine.
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    # Ray Train pickles functions by reference to their module, which its workers cannot
    # import: by value instead, as it pickles a script's own functions.
    ray.cloudpickle.register_pickle_by_value(ray_jobs)
    yield
    ray.shutdown()
    os.chdir(here)


@pytest.fixture
def executor(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    yield ex
    ex.shutdown()


def test_results_come_back_in_rank_order(executor):
    assert [r[:4] for r in executor.run(ray_jobs.ranks)] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert ray.get(executor.run_remote(ray_jobs.ranks))[1][0] == 1
    assert executor.execute_single(lambda _: ray_jobs.ranks()[0]) == 0


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_workers_that_start_from_different_weights_end_identical(executor, backend):
    (start0, end0), (start1, end1) = executor.run(ray_jobs.fit, kwargs={"seed": 3,
                                                                        "backend": backend})
    assert not all(np.array_equal(a, b) for a, b in zip(start0, start1))
    assert all(np.array_equal(a, b) for a, b in zip(end0, end1))


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


def _leave_on_rank_1():
    import keras_ring as kr

    kr.init()
    if kr.rank() == 1:
        raise ValueError("rank 1 leaves")
    return kr.allgather_object(kr.rank())  # waits for rank 1, which never comes


def test_a_rank_that_raises_fails_the_others_collectives_at_once(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()  # KERAS_RING_TIMEOUT's default: 300 s
    try:
        first, second = ex.run_remote(_leave_on_rank_1)
        with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 leaves"):
            ray.get(second)
        # Rank 0 hears that rank 1 has shut its engine down, as if its process had ended.
        with pytest.raises(ray.exceptions.RayTaskError,
                           match=r"shut down \(shutdown\(\) or its process exiting\)"):
            ray.get(first, timeout=200)
    finally:
        ex.shutdown()


def _die_on_rank_1_before_init():
    if os.environ["KERAS_RING_RANK"] == "1":
        os._exit(1)
    return ray_jobs.ranks()


def test_an_actor_that_dies_before_init_is_named(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    # Rank 0's kr.init() waits this long for rank 1 before it fails too.
    ex.start(extra_env_vars={"KERAS_RING_TIMEOUT": "5"})
    try:
        with pytest.raises(RuntimeError, match=r"the Ray actor of rank 1 \(of 2\) died before "
                                               r"its function returned"):
            ex.run(_die_on_rank_1_before_init)
    finally:
        ex.shutdown()


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
        ex.run(ray_jobs.ranks)
    ex.start()
    ex.shutdown()
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(ray_jobs.ranks)


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
        executor.run(ray_jobs.ranks, callbacks=[print])


def run_elastic_on_ray(tmp_path, capfd, env, horovod_0_28=False, **settings):
    """Runs the elastic training script on the cluster's 3 slots; returns (result, logs), as
    test_elastic.run_elastic does: result.returncode 0 with the workers' names in rank order,
    1 with the error; result.stdout the driver's lines. With `horovod_0_28`, through Horovod
    0.28's form, `RayExecutor(min_workers=...)`, with `settings` in its arguments' names."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    env = {**RANK_THREAD_ENV, "KR_TEST_LOG": str(log_dir), "KR_TEST_EPOCHS": str(EPOCHS),
           "KR_TEST_STEPS": str(STEPS), "KERAS_BACKEND": "torch",
           # Long enough for the three actors to start and ask before the first world forms.
           "KERAS_RING_TIMEOUT": "30", **env}
    before = shm_segments()
    if horovod_0_28:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), **settings)
        executor.start(extra_env_vars=env)
    else:
        executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(**settings),
                                      env_vars=env)
        executor.start()
    try:
        code, value = 0, executor.run(ray_jobs.train_script)
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
    # The RAISE job runs through Horovod 0.28's elastic RayExecutor, the same driver.
    settings = {"min_workers": 2} if fault == "RAISE" else {"min_num_proc": 2}
    result, names, logs = run_elastic_on_ray(tmp_path, capfd, {"KR_TEST_FAULT": f"11:1:{fault}"},
                                             horovod_0_28=fault == "RAISE", **settings)
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


def test_the_elastic_form_of_ray_executor_refuses_what_it_cannot_do(cluster):
    with pytest.raises(ValueError, match="needs a positive `min_workers`"):
        RayExecutor(RayExecutor.create_settings(), max_workers=3)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(RayExecutor.create_settings(), num_workers=2, min_workers=2)
    executor = RayExecutor(RayExecutor.create_settings(), min_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        executor.run(_size)
    with pytest.raises(NotImplementedError, match="not an executable_cls"):
        executor.start(executable_cls=_Counter)
    executor.start()
    for call in (lambda: executor.run_remote(_size), lambda: executor.execute(_size),
                 lambda: executor.execute_single(_size)):
        with pytest.raises(NotImplementedError, match="has only run"):
            call()
    executor.shutdown()


def test_elastic_run_before_start_gpus_and_callbacks_are_refused(cluster):
    with pytest.raises(RuntimeError, match="call start"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings()).run(ray_jobs.train_script)
    with pytest.raises(NotImplementedError, match="take no callbacks"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings()).run(ray_jobs.train_script, [print])
    with pytest.raises(ValueError, match="CPUs only"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), use_gpu=True)


# Ray Data warns of its own deprecated settings as it copies its context.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_the_trainer_trains_on_ray_train_workers_and_restarts_from_the_last_checkpoint(
        cluster, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from keras_ring.ray import KerasRingTrainer

    data = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    dataset = ray.data.from_items([{"x": row, "y": int(row.sum() > 0)} for row in data])
    starts = tmp_path / "starts"
    result = KerasRingTrainer(
        ray_jobs.trainer_loop,
        train_loop_config={"seed": 3, "epochs": 4, "starts": str(starts), "die_at": 2,
                           "backend": "torch"},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="trainer",
                             failure_config=FailureConfig(max_failures=1)),
        datasets={"train": dataset}).fit()
    assert result.error is None, result.error
    # The first group started at epoch 0; after rank 1 died, Ray Train started a second group,
    # a new keras-ring job, from the last checkpoint it had registered (of epoch 1, or 0 if
    # its controller was late).
    first, second = (sorted(lines) for lines in np.reshape(
        starts.read_text().splitlines(), (2, 2)))
    assert first == ["0 0", "1 0"], first
    assert second in (["0 1", "1 1"], ["0 2", "1 2"]), second
    metrics = result.metrics
    assert metrics["epoch"] == 3
    # keras-ring's ranks are Ray Train's; both workers share this node's memory.
    assert [(r["rank"], r["size"], r["local"]) for r in metrics["ranks"]] == [
        (0, 2, (0, 2)), (1, 2, (1, 2))]
    assert all(r["ray"] == (r["rank"], 2, r["rank"], 2) for r in metrics["ranks"])
    # Each worker fit its own shard of the dataset, and they hold the same weights.
    assert sum(r["rows"] for r in metrics["ranks"]) == 64
    assert metrics["identical"]
    assert np.isfinite(metrics["loss"])
    with result.checkpoint.as_directory() as directory:
        assert sorted(os.listdir(directory)) == ["epoch", "model.weights.h5"]
        assert pathlib.Path(directory, "epoch").read_text() == "3"


@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_the_trainer_trains_under_tensorflow_too(cluster, tmp_path):
    # PyTorch's is the test above, JAX's test_ray_netns.py's.
    backend = "tensorflow"
    from ray.train import RunConfig, ScalingConfig

    from keras_ring.ray import KerasRingTrainer

    data = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    result = KerasRingTrainer(
        ray_jobs.trainer_loop,
        train_loop_config={"seed": 3, "epochs": 2, "starts": str(tmp_path / "starts"),
                           "die_at": None, "backend": backend},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="trainer"),
        datasets={"train": ray.data.from_items([{"x": row, "y": int(row.sum() > 0)}
                                                for row in data])}).fit()
    assert result.error is None, result.error
    assert result.metrics["epoch"] == 1 and result.metrics["identical"], result.metrics
    assert [r["rank"] for r in result.metrics["ranks"]] == [0, 1]


def test_the_trainer_refuses_gpus():
    from ray.train import ScalingConfig

    from keras_ring.ray import KerasRingTrainer

    with pytest.raises(ValueError, match="does not support GPUs"):
        KerasRingTrainer(ray_jobs.trainer_loop, scaling_config=ScalingConfig(num_workers=2,
                                                                     use_gpu=True))


def test_elastic_a_node_added_grows_the_job_up_to_max_num_proc(tmp_path):
    # Its own cluster of several nodes, in its own driver (tests/workers/ray_grow_driver.py).
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    result = subprocess.run(
        [sys.executable, str(WORKERS / "ray_grow_driver.py")],
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
