"""keras_ring.elastic's states across 3 ranks (workers/elastic_state_worker.py).

The states move through the engine's collectives, which know nothing of the world below them
(tests/test_engine_multirank.py and test_tcp_world.py run those on both): the job runs on the
TCP world, the one `keras-ring-run --elastic` starts.
"""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "elastic_state_worker.py"
SCENARIOS = ["sync", "object_state", "tensorflow_state", "different_models", "host_update",
             "run_reset", "resumed_epoch"]


@pytest.mark.multirank
def test_elastic_states(run_ranks):
    result = run_ranks(3, WORKER, *SCENARIOS, timeout=300, transport="tcp")
    for scenario in SCENARIOS:
        assert f"{scenario}: " in result.stdout, result.stdout
