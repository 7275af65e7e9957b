"""Process sets: the Python API alone, and collectives within sets under the launcher."""

import os

import pytest

import keras_ring as kr

WORKER = os.path.join(os.path.dirname(__file__), "workers", "process_set_worker.py")


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [2, 3])
def test_process_sets(run_ranks, np_):
    result = run_ranks(np_, WORKER, timeout=300)
    for rank in range(np_):
        assert f"rank {rank}: test_init_with_process_sets ok" in result.stdout, result.stdout


def test_process_set_arguments_are_checked():
    with pytest.raises(TypeError, match="sequence of integer ranks"):
        kr.ProcessSet("ab")
    with pytest.raises(ValueError, match="must not repeat"):
        kr.ProcessSet([0, 0])
    unregistered = kr.ProcessSet([0])
    with pytest.raises(ValueError, match="add_process_set"):
        unregistered.size()
    assert kr.global_process_set.process_set_id == 0
    assert not kr.remove_process_set(unregistered)


def test_a_job_of_one_has_process_sets_too():
    kr.init()
    try:
        solo = kr.add_process_set([0])
        assert (solo.size(), solo.rank(), solo.included()) == (1, 0, True)
        assert kr.allgather_object("x", process_set=solo) == ["x"]
        assert kr.global_process_set.ranks == [0]
        with pytest.raises(TypeError, match="must be a keras_ring.ProcessSet"):
            kr.barrier(process_set=[0])
        with pytest.raises(ValueError, match=r"ranks must lie in \[0, 1\)"):
            kr.add_process_set([1])
        assert kr.remove_process_set(solo)
    finally:
        kr.shutdown()
