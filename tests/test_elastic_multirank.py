"""keras_ring.elastic's states across 3 ranks on both worlds (workers/elastic_state_worker.py)."""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "elastic_state_worker.py"
SCENARIOS = ["sync", "object_state", "tensorflow_state", "different_models", "host_update",
             "run_reset", "resumed_epoch"]


@pytest.mark.multirank
@pytest.mark.parametrize("np, transport", [(3, "tcp"), (3, "mpi")])
def test_elastic_states(run_ranks, np, transport):
    result = run_ranks(np, WORKER, *SCENARIOS, timeout=300, transport=transport)
    for scenario in SCENARIOS:
        assert f"{scenario}: " in result.stdout, result.stdout
