"""The engine's collectives under the launcher, through the NumPy binding."""

import os

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_worker.py")


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [2, 3])
def test_engine_collectives(run_ranks, np_):
    result = run_ranks(np_, WORKER, timeout=600, env={"KR_TEST_EXPECTED_SIZE": str(np_)})
    for rank in range(np_):
        assert f"rank {rank}: test_restart ok" in result.stdout
