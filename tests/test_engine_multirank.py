"""The engine's collectives under the launcher, through the NumPy binding."""

import os
import re
import shlex
import sys

import pytest
from conftest import run_job

from keras_ring.launcher._main import forker_segment_paths

WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_worker.py")
# A fault at 3 ranks has a culprit, the coordinator and a bystander; 2 ranks add no case.
FAULT_RANKS = 3


# Every collective at 2 and 3 ranks on both data paths (shared memory, the ring over MPI), whose
# schedules differ between a power of two and not; the settings that change only the engine's
# scheduling or its kernels at 3 ranks, the more general count.
@pytest.mark.multirank
@pytest.mark.parametrize(
    "np_, settings",
    [
        (2, {"KR_TEST_PATH": "shm"}),
        (3, {"KR_TEST_PATH": "shm"}),
        (2, {"KERAS_RING_SHM": "0", "KR_TEST_PATH": "network"}),
        (3, {"KERAS_RING_SHM": "0", "KR_TEST_PATH": "network"}),
        (3, {"KERAS_RING_FUSION_THRESHOLD": "0"}),
        (3, {"KERAS_RING_CYCLE_TIME": "2"}),
        (3, {"KERAS_RING_CACHE_CAPACITY": "0"}),
        (3, {"KERAS_RING_CPU_KERNELS": "generic"}),
    ],
    ids=["2-fusion", "3-fusion", "2-mpi-ring", "3-mpi-ring", "3-no-fusion", "3-cycle-time",
         "3-no-cache", "3-generic-kernels"],
)
def test_engine_collectives(run_ranks, np_, settings):
    env = {"KR_TEST_EXPECTED_SIZE": str(np_), **settings}
    result = run_ranks(np_, WORKER, timeout=600, env=env)
    for rank in range(np_):
        assert f"rank {rank}: test_restart ok" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize(
    "hosts, settings, path",
    [("2,2", {}, "hierarchical"), ("2,2", {"KERAS_RING_HIERARCHICAL_ALLREDUCE": "0"}, "network"),
     ("2,1", {}, "network")],
    ids=["hierarchical", "hierarchical-off", "uneven-hosts"],
)
def test_engine_collectives_across_pretended_hosts(run_ranks, hosts, settings, path):
    # Hierarchical allreduce (shared memory within a host, MPI across) needs
    # the same number of ranks on every host; otherwise the ring runs over MPI.
    np_ = sum(int(n) for n in hosts.split(","))
    fake_hosts = os.path.join(os.path.dirname(__file__), "workers", "fake_hosts.py")
    env = {"KR_TEST_EXPECTED_SIZE": str(np_), "KR_TEST_PATH": path, **settings}
    result = run_ranks(np_, fake_hosts, hosts, WORKER, timeout=600, env=env)
    for rank in range(np_):
        assert f"rank {rank}: test_restart ok" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [FAULT_RANKS])
def test_a_rank_that_exits_fails_the_others_instead_of_hanging(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "early_exit_worker.py")
    result = run_ranks(np_, worker, timeout=120, check=False)
    assert result.returncode != 0
    for rank in [0] + list(range(2, np_)):
        assert f"rank {rank} error: keras-ring: rank 1 shut down" in result.stdout, result.stdout
        assert "'never.joined'" in result.stdout
        # Submitted after the engine stopped: refused, naming the rank.
        assert (
            f"rank {rank} later: keras-ring: rank 1 shut down (shutdown() or its process "
            "exiting), which stops the engine of every rank; init() starts it again (tensor "
            "'after.stop')"
        ) in result.stdout, result.stdout
    assert "completed without rank 1" not in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("start", ["kr", "binding"])
@pytest.mark.parametrize("np_", [FAULT_RANKS])
def test_a_job_whose_ranks_all_finish_exits_0_when_one_rank_leaves_first(run_ranks, np_, start):
    # MPICH's forker interrupts the ranks still running when one exits
    # without MPI_Finalize: the engine's exit hook must finalize it.
    worker = os.path.join(os.path.dirname(__file__), "workers", "finished_job_worker.py")
    result = run_ranks(np_, worker, start, timeout=120, env={"KERAS_RING_FUSION_THRESHOLD": "0"})
    for rank in range(np_):
        assert f"rank {rank}: done" in result.stdout, result.stdout
    assert "signal" not in result.stdout, result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [FAULT_RANKS])
def test_a_stalled_tensor_is_reported_then_fails_on_the_waiting_ranks(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "stall_worker.py")
    env = {"KERAS_RING_STALL_CHECK_TIME": "1", "KERAS_RING_STALL_SHUTDOWN_TIME": "3"}
    result = run_ranks(np_, worker, timeout=120, env=env)
    waiting = "0" if np_ == 2 else "0, 2"
    assert (f"] keras-ring warning: stall: ranks [{waiting}] have been waiting 1 s for ranks [1] "
            "to submit tensor 'stalled'") in result.stdout, result.stdout
    for rank in [0] + list(range(2, np_)):
        assert f"rank {rank} error: keras-ring: stalled: ranks [{waiting}]" in result.stdout
    for rank in range(np_):
        assert f"rank {rank}: after ok" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("worker", ["killed_rank_worker.py", "shm_crash_worker.py"])
@pytest.mark.parametrize("np_", [FAULT_RANKS])
def test_a_killed_rank_ends_the_job_is_named_and_leaves_no_segments(run_ranks, np_, worker):
    # Killed while the others wait for it to agree, or in the middle of
    # shared-memory allreduces.
    worker = os.path.join(os.path.dirname(__file__), "workers", worker)
    result = run_ranks(np_, worker, timeout=120, check=False)
    assert result.returncode == 128 + 9, result.stdout
    assert "rank 1 died of signal 9 (Killed)" in result.stdout
    assert "without rank 1" not in result.stdout
    # Every other rank fails with its own error, naming rank 1, before the launcher stops it:
    # waiting for rank 1's submission (CheckLocalPeers) or in a shared-memory collective, or
    # told by rank 0, whose engine saw it first.
    own = re.findall(r"^keras_ring\.core\._errors\.WorkerLostError: keras-ring: "
                     r".*rank 1 \(pid \d+\) died", result.stdout, re.MULTILINE)
    assert len(own) == np_ - 1, result.stdout
    ranks = re.findall(r"rank \d+ pid (\d+) forker (\d+)", result.stdout)
    assert len(ranks) == np_, result.stdout
    # Ours are named kr-<pid of the host's first rank>x...; MPICH's after its forker.
    left = [
        name
        for name in os.listdir("/dev/shm")
        if any(name.startswith(f"kr-{pid}x") for pid, _ in ranks)
    ]
    left += [
        path
        for _, forker in ranks
        for path in forker_segment_paths(int(forker))
        if os.path.exists(path)
    ]
    assert not left, left


ENDING_WORKER = os.path.join(os.path.dirname(__file__), "workers", "ending_rank_worker.py")


# How rank 1 ends -> (its command's shell wrapper, what the launcher says of it in the MPI world
# and in the TCP world, the job's exit code). "{}" is python running the worker.
ENDINGS = {
    "os._exit(0)": ("exit", "", "exited with code 0 without MPI_Finalize; the launcher "
                    "stopped the other ranks.", "exited with code 0 without shutting keras-ring "
                    "down, the first rank to fail.", 1),
    # sh waits for its python: the launcher sees sh end, with 128 + SIGKILL.
    "killed-behind-sh": ("kill", "{}", "exited with code 137; the launcher stopped the other "
                         "ranks.", "exited with code 137, the first rank to fail.", 137),
    "killed-behind-sh-that-runs-on": (
        "kill", "{}; echo after", "exited with code 0 without MPI_Finalize; the launcher "
        "stopped the other ranks.", "exited with code 0 without shutting keras-ring down, the "
        "first rank to fail.", 1),
    # An exception: rank 1 shuts down at exit, then the others fail, naming it, maybe first.
    "exception": ("raise", "", "raised RuntimeError: rank 1 fails and exited with code 1, the "
                  "first rank to fail.", None, 1),
}


@pytest.mark.multirank
@pytest.mark.parametrize("transport", ["mpi", "tcp"])
@pytest.mark.parametrize("case", ENDINGS)
def test_the_rank_that_ends_a_job_is_named_with_its_exit_code(case, transport):
    how, shell, named_mpi, named_tcp, code = ENDINGS[case]
    named = named_mpi if transport == "mpi" else named_tcp or named_mpi
    python = shlex.join([sys.executable, ENDING_WORKER, how])
    rank = ["sh", "-c", shell.format(python)] if shell else shlex.split(python)
    command = [os.path.join(os.path.dirname(sys.executable), "keras-ring-run"),
               "-np", str(FAULT_RANKS), "--transport", transport, *rank]
    result = run_job(command, f"{FAULT_RANKS}-rank job {case}", timeout=120, check=False)
    assert result.returncode == code, result.stdout
    # On a loaded machine a survivor may still be exiting when the launcher's hold ends;
    # the launcher then says that it stops it, which changes nothing of the verdict.
    said = [line for line in re.findall(r"^keras-ring-run: .*", result.stdout, re.MULTILINE)
            if not re.fullmatch(r"keras-ring-run: rank \d \(pid \d+\) outlived the rank "
                                r"process it ran under: sending it SIGCONT and SIGTERM\.", line)]
    assert said == [f"keras-ring-run: rank 1 {named}"], result.stdout
    # Every other rank's own error names rank 1: its shutdown, its pid gone (shared memory),
    # or its connection closed (TCP), directly or as the reason another rank gave up.
    theirs = (r"rank 1 shut down" if how == "raise" else
              r"rank 1( \(pid \d+\) died|'s connection was lost)")
    own = re.findall(rf"^keras_ring\.core\._errors\.WorkerLostError: keras-ring: .*{theirs}",
                     result.stdout, re.MULTILINE)
    assert len(own) == FAULT_RANKS - 1, result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("np_", [FAULT_RANKS])
def test_every_rank_runs_with_rank_0s_settings(run_ranks, np_):
    worker = os.path.join(os.path.dirname(__file__), "workers", "settings_worker.py")
    result = run_ranks(np_, worker, timeout=120)
    for rank in range(np_):
        assert f"rank {rank}: settings ok" in result.stdout, result.stdout
    # The rank whose own settings differ says so.
    assert "differ from rank 0's; every rank uses rank 0's" in result.stdout, result.stdout
