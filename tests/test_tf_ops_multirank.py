"""The TensorFlow collectives across 2 and 3 ranks (tests/workers/tf_ops_worker.py)."""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "tf_ops_worker.py"


@pytest.mark.multirank
@pytest.mark.parametrize("np", [2, 3])
def test_tf_ops(run_ranks, np):
    run_ranks(np, WORKER, timeout=600)
