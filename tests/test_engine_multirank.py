"""The engine's collectives under the launcher, through the NumPy binding."""

import os

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_worker.py")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "settings",
    [{}, {"KERAS_RING_FUSION_THRESHOLD": "0"}, {"KERAS_RING_CYCLE_TIME": "2"},
     {"KERAS_RING_CACHE_CAPACITY": "0"}, {"KERAS_RING_CPU_KERNELS": "generic"}],
    ids=["fusion", "no-fusion", "cycle-time", "no-cache", "generic-kernels"],
)
@pytest.mark.parametrize("np_", [2, 3])
def test_engine_collectives(run_ranks, np_, settings):
    env = {"KR_TEST_EXPECTED_SIZE": str(np_), **settings}
    result = run_ranks(np_, WORKER, timeout=600, env=env)
    for rank in range(np_):
        assert f"rank {rank}: test_restart ok" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_exits_fails_the_others_instead_of_hanging(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "early_exit_worker.py")
    result = run_ranks(np_, worker, timeout=120, check=False)
    assert result.returncode != 0
    for rank in [0] + list(range(2, np_)):
        assert f"rank {rank} error: keras-ring: rank 1 shut down" in result.stdout, result.stdout
        assert "'never.joined'" in result.stdout
    assert "completed without rank 1" not in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [2, 3])
def test_a_stalled_tensor_is_reported_then_fails_on_the_waiting_ranks(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "stall_worker.py")
    env = {"KERAS_RING_STALL_CHECK_TIME": "1", "KERAS_RING_STALL_SHUTDOWN_TIME": "3"}
    result = run_ranks(np_, worker, timeout=120, env=env)
    waiting = "0" if np_ == 2 else "0, 2"
    assert (f"] keras-ring warning: stall: ranks [{waiting}] have been waiting 1 s for ranks [1] "
            "to submit tensor 'stalled'") in result.stdout, result.stdout
    for rank in [0] + list(range(2, np_)):
        assert f"rank {rank} error: keras-ring: stalled: ranks [{waiting}]" in result.stdout
    for rank in range(np_):
        assert f"rank {rank}: after ok" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [2, 3])
def test_a_killed_rank_ends_the_job_and_is_named(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "killed_rank_worker.py")
    result = run_ranks(np_, worker, timeout=120, check=False)
    assert result.returncode == 128 + 9, result.stdout
    assert "rank 1 died of signal 9 (Killed)" in result.stdout
    assert "completed without rank 1" not in result.stdout
