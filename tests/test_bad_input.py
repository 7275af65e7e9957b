"""Odd and bad input under the launcher: the right result or a clear error, on every rank.

The cases run in one 2-rank job of workers/bad_input_worker.py (ranks start
TensorFlow once): NaN and infinities through every reduce op, empty and 0-d
tensors, string tensors, a tensor of more than 2 GiB (each rank holds about
5.5 GiB at its peak), and shutdown() while another thread waits for a
collective. Mismatched shapes, dtypes, ops and roots across ranks are
tf_ops_worker.py's (check_mismatch_errors); a process set with a rank out of
range is test_process_sets.py's.
"""

import os
import re
import sys

import pytest
from conftest import run_job

pytestmark = pytest.mark.multirank

CASES = ["nan_and_inf", "empty_and_scalar", "strings", "over_2_gib",
         "shutdown_with_a_pending_op"]


WORKER = os.path.join(os.path.dirname(__file__), "workers", "bad_input_worker.py")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    command = [os.path.join(os.path.dirname(sys.executable), "keras-ring-run"), "-np", "2",
               "--", sys.executable, WORKER, *CASES]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("bad_input"))  # away from the source tree
        result = run_job(command, "2-rank job bad_input_worker.py", timeout=600)
    return dict(re.findall(r"^rank (\d: \w+) (.*)$", result.stdout, re.MULTILINE)), result


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_as_documented(outcomes, case):
    found, result = outcomes
    for rank in (0, 1):
        assert found.get(f"{rank}: {case}") == "ok", result.stdout[-4000:]
