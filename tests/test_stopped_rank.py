"""A rank that is alive but stuck (SIGSTOP), or killed behind a shell, mid-training.

Every other rank must fail within KERAS_RING_TIMEOUT (plus a small margin) with
an error naming that rank; the job must end with a non-zero exit soon after,
leaving no process and no shared-memory segment behind.
"""

import concurrent.futures
import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from conftest import RANK_THREAD_ENV, _tail

from keras_ring.launcher._main import forker_segment_paths

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
TIMEOUT = 6
# Short stall settings, as the other tests': a tensor the stopped rank never submitted fails
# after 3 s; then the exit's shutdown waits up to TIMEOUT for the stopped rank.
ENV = {
    "KERAS_RING_TIMEOUT": str(TIMEOUT),
    "KERAS_RING_STALL_CHECK_TIME": "1",
    "KERAS_RING_STALL_SHUTDOWN_TIME": "3",
}
# Rank 0 stopped: the others hear nothing from the coordinator for KERAS_RING_TIMEOUT + 5 s.
COORDINATOR_GRACE = 5
# Scheduling on a busy 2-core machine.
MARGIN = 4
# From the stop to the job's end: the others' error, their exit (a shutdown bounded by
# TIMEOUT after a stall), and the launcher ending the stopped rank (2 s, then SIGTERM).
JOB_END_SECONDS = TIMEOUT + COORDINATOR_GRACE + TIMEOUT + 10
JOB_LIMIT_SECONDS = 120


def _leftovers(marker, session):
    """The processes of the job still running: by its marker, or in its session."""
    found = set()
    for args in (["-f", marker], ["-s", str(session)]):
        result = subprocess.run(["pgrep", *args], capture_output=True, text=True, check=False)
        found.update(int(pid) for pid in result.stdout.split())
    found.discard(os.getpid())
    return found


def _run(command, marker, env=None):
    """Runs a job in its own session, with `env` added to ENV.

    Returns (exit code, output, end time, leftover processes, whether it ran past
    JOB_LIMIT_SECONDS). Leftovers are continued and killed after being recorded,
    so that a failing test does not leave stopped ranks on the machine.
    """
    env = {**os.environ, **RANK_THREAD_ENV, **ENV, **(env or {})}
    with tempfile.TemporaryFile() as output:
        job = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            job.wait(timeout=JOB_LIMIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        ended = time.time()
        timed_out = job.returncode is None
        time.sleep(0.5)  # a rank the forker has just signalled
        left = _leftovers(marker, job.pid)
        for pid in left:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        output.seek(0)
        text = output.read().decode(errors="replace")
    return job.returncode, text, ended, left, timed_out


def _check_segments(text):
    ranks = re.findall(r"rank \d+ pid (\d+) forker (\d+)", text)
    left = [name for name in os.listdir("/dev/shm")
            if any(name.startswith(f"kr-{pid}x") for pid, _ in ranks)]
    left += [path for forker in {f for _, f in ranks}
             for path in forker_segment_paths(int(forker)) if os.path.exists(path)]
    assert not left, left
    return len(ranks)


def _check_job(np_, culprit, run, fail_within, end_within=JOB_END_SECONDS):
    """Checks a job's run (what _run returned): every other rank's error, the job's end and what
    it left.

    Returns the job's output.
    """
    returncode, text, ended, left, timed_out = run
    if timed_out:
        pytest.fail(f"the job ran past {JOB_LIMIT_SECONDS} s; left running: {sorted(left)}. "
                    f"Output tail:\n{_tail(text)}")
    assert not left, f"left running: {sorted(left)}\n{_tail(text)}"
    assert returncode != 0, text
    assert _check_segments(text) == np_, text
    stopped_at = re.search(rf"rank {culprit} stopping at ([\d.]+)", text)
    assert stopped_at, text
    stopped_at = float(stopped_at[1])
    delays = {}
    for rank in sorted(set(range(np_)) - {culprit}):
        failed = re.search(rf"^rank {rank} failed at ([\d.]+): (.*)$", text, re.MULTILINE)
        if failed:
            failed_at = float(failed[1])
        else:
            # Its print cut short by the launcher's SIGINT: the engine's own log line says it.
            failed = re.search(rf"^\[([\d-]+ [\d:.]+) UTC rank {rank} [^]]*\] keras-ring error: "
                               r"the engine stopped: (.*)$", text, re.MULTILINE)
            assert failed, f"rank {rank} did not fail:\n{_tail(text)}"
            failed_at = datetime.datetime.strptime(failed[1], "%Y-%m-%d %H:%M:%S.%f").replace(
                tzinfo=datetime.timezone.utc).timestamp()
        delays[rank] = failed_at - stopped_at
        # Its own wait for the culprit, the stall of a tensor the culprit never submitted, or
        # another rank's such failure, passed on: the culprit is named as the cause. A stall may
        # name a bystander too: one still in the last collective, waiting on the culprit (the
        # ring's next rank, whose last receive the culprit never sent), has not submitted either.
        # MPI may fail a transfer the culprit died in the middle of, before any wait ends.
        assert re.search(rf"\brank {culprit} (is stuck or stopped|\(pid \d+\) died)|ranks "
                         rf"\[(\d+, )*{culprit}(, \d+)*\] to submit|"
                         rf"MPI_Test \((receive from|send to) rank {culprit}\) failed",
                         failed[2]), failed[2]
        assert delays[rank] < fail_within, (delays, text)
    assert ended - stopped_at < end_within, (ended - stopped_at, text)
    print(f"after the stop: failed after {delays} s, the job ended after "
          f"{ended - stopped_at:.1f} s")
    return text


def _worker_command(np_, *args, shell=False, transport="mpi"):
    marker = f"kr-stopped-{uuid.uuid4().hex[:12]}"
    worker = [sys.executable, os.path.join(WORKERS, args[0]), *map(str, args[1:]), marker]
    if shell:
        # Started through a shell that does not exec: the MPI launcher sees sh, not python.
        worker = ["sh", "-c", " ".join(worker) + "; exit $?"]
    run = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")
    return [run, "-np", str(np_), "--transport", transport, "--", *worker], marker


# At 3 ranks each stopped rank (the coordinator, one in the middle, the last) has bystanders as
# well as the coordinator to fail; 2 ranks run the cases 3 do not (rank 0 stopped in a large
# allreduce, the ring over MPI). Case -> (ranks, the stopped rank, size, shared memory, world).
STOPPED_CASES = {
    "2-rank0-large": (2, 0, "large", True, "mpi"),
    "2-rank1-mpi": (2, 1, "large", False, "mpi"),
    "3-rank2-small": (3, 2, "small", True, "mpi"),
    "3-rank1-large": (3, 1, "large", True, "mpi"),
    "3-rank0-small": (3, 0, "small", True, "mpi"),
    "3-rank2-small-tcp": (3, 2, "small", True, "tcp"),
    "3-rank1-tcp-ring": (3, 1, "large", False, "tcp"),
}


@pytest.fixture(scope="module")
def stopped_jobs():
    """Every case's job, all at once: after the stop they only wait out the timeouts."""

    def run(case):
        np_, stopped, size, shm, transport = STOPPED_CASES[case]
        command, marker = _worker_command(np_, "stopped_rank_worker.py", stopped, size, "STOP",
                                          transport=transport)
        return _run(command, marker, env=None if shm else {"KERAS_RING_SHM": "0"})

    with concurrent.futures.ThreadPoolExecutor(len(STOPPED_CASES)) as pool:
        return dict(zip(STOPPED_CASES, pool.map(run, STOPPED_CASES)))


@pytest.mark.multirank
@pytest.mark.timeout(JOB_LIMIT_SECONDS + 30)
@pytest.mark.parametrize("case", STOPPED_CASES)
def test_a_stopped_rank_fails_the_others_naming_it_and_the_job_ends(case, stopped_jobs):
    np_, stopped, _, _, _ = STOPPED_CASES[case]
    grace = COORDINATOR_GRACE if stopped == 0 else 0
    _check_job(np_, stopped, stopped_jobs[case], fail_within=TIMEOUT + grace + MARGIN)


@pytest.mark.multirank
@pytest.mark.timeout(JOB_LIMIT_SECONDS + 30)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "mpi"])
def test_a_rank_killed_behind_a_shell_ends_the_job_at_once(shm):
    command, marker = _worker_command(2, "stopped_rank_worker.py", 1, "large", "KILL",
                                      shell=True)
    # sh exits 137 (128 + SIGKILL): the launcher names rank 1 with that code, and ends with it.
    # Rank 0 fails on its own first, naming rank 1, while the launcher holds its stop back
    # (3 s): through shared memory it sees rank 1's pid gone within a second. Over MPI it sees
    # only silence: a transfer rank 1 was in the middle of fails after KERAS_RING_TIMEOUT and 1 s
    # for an answer (here 2 s), a tensor rank 1 never submitted stalls (1 s), or MPI fails the
    # transfer itself.
    env = {} if shm else {"KERAS_RING_SHM": "0", "KERAS_RING_TIMEOUT": "1",
                          "KERAS_RING_STALL_SHUTDOWN_TIME": "1"}
    run = _run(command, marker, env=env)
    text = _check_job(2, 1, run, fail_within=2 + MARGIN, end_within=10)
    assert run[0] == 137, text
    assert re.search(r"^keras-ring-run: rank 1 exited with code 137; the launcher stopped the "
                     r"other ranks\.$", text, re.MULTILINE), text


@pytest.mark.multirank
@pytest.mark.timeout(JOB_LIMIT_SECONDS + 30)
def test_a_rank_stopped_in_model_fit_fails_rank_0_naming_it():
    command, marker = _worker_command(2, "stopped_fit_worker.py", 5)
    _check_job(2, 1, _run(command, marker), fail_within=TIMEOUT + MARGIN)
