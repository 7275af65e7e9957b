"""The examples run as a user runs them: under the launcher, on 2 ranks, and check themselves.

Each example exits non-zero when its own success criterion fails (accuracy,
convergence, identical weights on every rank).
"""

import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "script, expected",
    [
        ("allreduce_demo.py", "rank 1 of 2"),
        ("keras_digits.py", "test accuracy"),
        ("custom_training_loop.py", "weight difference between ranks 0.00e+00"),
        ("mixed_precision.py", "weight difference between ranks 0.00e+00"),
        ("keras_synthetic_benchmark.py", "total samples/s on 2 ranks"),
    ],
)
def test_example_runs_on_two_ranks(run_ranks, script, expected):
    args = ["--iters", "2"] if script == "keras_synthetic_benchmark.py" else []
    result = run_ranks(2, os.path.join(EXAMPLES, script), *args, timeout=300)
    assert expected in result.stdout, result.stdout[-3000:]
