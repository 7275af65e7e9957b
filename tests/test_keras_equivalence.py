"""The decisive test of the Keras layer: N ranks at batch b train as 1 rank at batch N*b.

The checks and their tolerances are in tests/workers/keras_equivalence_worker.py;
it runs under each Keras backend keras-ring supports.
"""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "keras_equivalence_worker.py"


SUITES = ["core", "options", "lazy"]


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
# 3 ranks on one host; the 2-rank case runs across two hosts (test_multihost.py). The Keras
# layer is the same at either count; the engine's schedules, which differ, are tested at both.
@pytest.mark.parametrize("np", [3])
def test_keras_equivalence(run_ranks, np, backend):
    # One job runs every suite: the ranks start the framework once.
    result = run_ranks(np, WORKER, *SUITES, timeout=600, env={"KERAS_BACKEND": backend})
    for suite in SUITES:
        assert f"keras_equivalence_worker: {suite} passed on {np} ranks" in result.stdout, (
            result.stdout)
