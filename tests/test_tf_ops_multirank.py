"""The TensorFlow collectives across 3 ranks (tests/workers/tf_ops_worker.py)."""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "tf_ops_worker.py"


# At 3 ranks only: 2 and 3 ranks differ in the engine's schedules, which test_engine_multirank
# and test_tcp_world run at both; this layer passes tensors through unchanged by the count.
@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_tf_ops(run_ranks, np):
    run_ranks(np, WORKER, timeout=600)
