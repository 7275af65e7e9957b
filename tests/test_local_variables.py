"""Local layers and variables across 3 ranks (tests/workers/local_variables_worker.py).

The optimizer's and the tape's local gradients, and the broadcast callback's
`local_variables`, against a simulation of the whole job in plain Keras.
"""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "local_variables_worker.py"


@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_local_variables(run_ranks, np):
    result = run_ranks(np, WORKER, timeout=420)
    assert f"local_variables_worker: passed on {np} ranks" in result.stdout
    # Local weights differ by design: the callbacks' divergence check leaves them out.
    assert "have diverged" not in result.stdout, result.stdout
