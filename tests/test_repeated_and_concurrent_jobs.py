"""A job run again gives the same bits; two jobs at once on one host give correct results."""

import os
import re
import sys
import threading

import pytest
from conftest import run_job

pytestmark = pytest.mark.multirank

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")


def job(transport, worker, np_=2):
    return [LAUNCHER, "-np", str(np_), "--transport", transport, "--", sys.executable,
            os.path.join(WORKERS, worker)]


def test_the_same_fit_run_three_times_gives_the_same_bits_on_every_rank():
    runs = []
    for run in range(3):
        result = run_job(job("mpi", "repeat_fit_worker.py"), f"2-rank fit, run {run + 1}")
        runs.append(dict(re.findall(r"^rank (\d): (trainable \d+ all \d+)$", result.stdout,
                                    re.MULTILINE)))
        assert sorted(runs[-1]) == ["0", "1"], result.stdout
    assert runs[0] == runs[1] == runs[2], runs
    trainable = {line.split()[1] for line in runs[0].values()}
    assert len(trainable) == 1, runs[0]  # the same on both ranks


@pytest.mark.parametrize("transports", [("mpi", "mpi"), ("mpi", "tcp")], ids=["mpi+mpi", "mpi+tcp"])
def test_two_jobs_at_once_on_one_host_each_get_correct_results(transports, tmp_path):
    # The randomised stress of every collective, checked against NumPy: two at once share
    # the cores, /dev/shm and the loopback, and must not see each other's segments or ports.
    results = {}

    def run(i, transport):
        env = {"KR_STRESS_SEED": str(40 + i), "KR_STRESS_REPORTS": str(tmp_path / str(i)),
               "KR_TEST_EXPECTED_SIZE": "2"}
        (tmp_path / str(i)).mkdir()
        results[i] = run_job(job(transport, "stress_worker.py"), f"stress job {i} over "
                             f"{transport}", timeout=600, env=env, check=False)

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(transports)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1], results  # a job that timed out left no result
    for i, result in results.items():
        assert result.returncode == 0, result.stdout[-4000:]
        for rank in (0, 1):
            assert f"rank {rank}: stress ok" in result.stdout, result.stdout[-4000:]
