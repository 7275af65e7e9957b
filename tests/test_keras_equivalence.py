"""The decisive test of the Keras layer: N ranks at batch b train as 1 rank at batch N*b.

The checks and their tolerances are in tests/workers/keras_equivalence_worker.py.
"""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "keras_equivalence_worker.py"


@pytest.mark.multirank
@pytest.mark.parametrize("suite", ["core", "options", "lazy"])
@pytest.mark.parametrize("np", [2, 3])
def test_keras_equivalence(run_ranks, np, suite):
    run_ranks(np, WORKER, suite, timeout=300)
