"""keras_ring.ray on a local Ray cluster (2 CPUs): Horovod's RayExecutor API."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import RANK_THREAD_ENV

ray = pytest.importorskip("ray")

from keras_ring.ray import RayExecutor  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
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
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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
    assert ray.available_resources().get("CPU") == 2


def test_gpus_are_refused(cluster):
    with pytest.raises(ValueError, match="CPUs only"):
        RayExecutor(RayExecutor.create_settings(), num_workers=1, use_gpu=True)
