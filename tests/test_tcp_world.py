"""Jobs over the TCP world (`keras-ring-run --transport tcp`): no MPI launcher, no MPI.

The engine's collective tests and a failure test run here as they run over
MPI; and the job's rendezvous store and its ranks refuse connections that do
not hold the job's secret, while the job goes on. The layers above the engine
(the TF ops, Keras) do not know the world they run on: they run over MPI, and
over TCP in tests/test_multihost.py, where the world is the subject.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest
from conftest import RANK_THREAD_ENV

WORKERS = pathlib.Path(__file__).parent / "workers"


# The ring over TCP at 2 and 3 ranks, whose schedules differ; shared memory, whose data path is
# the same on either world (test_engine_multirank.py runs it at 2 and 3 over MPI), at 3.
@pytest.mark.multirank
@pytest.mark.parametrize(
    "np_, settings",
    [(2, {"KERAS_RING_SHM": "0", "KR_TEST_PATH": "network"}),
     (3, {"KERAS_RING_SHM": "0", "KR_TEST_PATH": "network"}),
     (3, {"KR_TEST_PATH": "shm"})],
    ids=["2-tcp-ring", "3-tcp-ring", "3-shm"],
)
def test_engine_collectives_over_tcp(run_ranks, np_, settings):
    env = {"KR_TEST_EXPECTED_SIZE": str(np_), **settings}
    result = run_ranks(np_, WORKERS / "engine_worker.py", timeout=600, env=env, transport="tcp")
    for rank in range(np_):
        assert f"rank {rank}: test_restart ok" in result.stdout


@pytest.mark.multirank
def test_hierarchical_allreduce_over_tcp_across_pretended_hosts(run_ranks):
    env = {"KR_TEST_EXPECTED_SIZE": "4", "KR_TEST_PATH": "hierarchical"}
    result = run_ranks(4, WORKERS / "fake_hosts.py", "2,2", WORKERS / "engine_worker.py",
                       timeout=600, env=env, transport="tcp")
    for rank in range(4):
        assert f"rank {rank}: test_restart ok" in result.stdout


@pytest.mark.multirank
def test_a_rank_that_exits_fails_the_others_over_tcp(run_ranks):
    result = run_ranks(3, WORKERS / "early_exit_worker.py", timeout=120, check=False,
                       transport="tcp")
    # Rank 1 exits (3), the others fail naming it and exit (4), maybe first: rank 1 is named.
    assert result.returncode == 3, result.stdout
    assert "keras-ring-run: rank 1 exited with code 3, the first rank to fail." in result.stdout
    for rank in (0, 2):
        assert f"rank {rank} error: keras-ring: rank 1 shut down" in result.stdout, result.stdout


def _listening_ports(pid):
    """The TCP ports process `pid` listens on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return sorted({int(m[1]) for m in re.finditer(rf"\S+:(\d+)\s.*pid={pid},", out)})


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _intrude(port):
    """Connects without the secret twice, garbage then a wrong handshake; True if both refused."""
    refused = 0
    # Longer than any greeting either side expects, so that it is read whole and judged at once.
    for payload in (b"\x00\x00\x00\x05hello, is this the job?" * 20, b"KRS1" + b"x" * 500):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            try:
                s.sendall(payload)
                s.settimeout(30)
                while s.recv(4096):  # whatever the greeting, then the close
                    pass
                refused += 1
            except (ConnectionResetError, BrokenPipeError):
                refused += 1
    return refused == 2


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_connections_without_the_secret_are_refused_while_the_job_goes_on(tmp_path):
    if subprocess.run(["ss", "-V"], capture_output=True).returncode != 0:
        pytest.skip("needs ss (iproute2) to find the job's ports")
    go = tmp_path / "go"
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")
    job = subprocess.Popen(
        [launcher, "--transport", "tcp", "-np", "2", "--prefix-output", sys.executable,
         str(WORKERS / "intruder_worker.py")],
        env={**os.environ, **RANK_THREAD_ENV, "KR_TEST_GO": str(go)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # The store (keras-ring-run's) and rank 0 (waiting for rank 1) listen on loopback.
        deadline = time.monotonic() + 60
        store_ports = rank0_ports = []
        while time.monotonic() < deadline and not (store_ports and rank0_ports):
            time.sleep(0.1)
            store_ports = _listening_ports(job.pid)
            ranks = _children(job.pid)
            rank0_ports = _listening_ports(ranks[0]) if ranks else []
        assert store_ports and rank0_ports, "the job's ports did not appear"
        assert _intrude(store_ports[0]), "the store served a client without the secret"
        assert _intrude(rank0_ports[0]), "rank 0 kept a connection without the secret"
        go.write_text("go")
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output
    assert "[0] rank 0: allreduce ok after the intruders" in output
    assert "[1] rank 1: allreduce ok after the intruders" in output
    # Rank 0 logs each refusal; the store the first one, then counts the rest on one line.
    assert output.count("rank 0 refused a connection from 127.0.0.1") == 2, output
    assert output.count("rendezvous: refused a connection from 127.0.0.1") == 1, output
    assert "rendezvous: refused 1 more connection in the last" in output, output


def _sum_of_ranks():
    import numpy as np

    import keras_ring as kr
    from keras_ring.core import _engine

    kr.init()
    got = _engine.submit(_engine.ALLREDUCE, np.full(3, kr.rank(), np.float32), "s").wait()
    return os.environ["KERAS_RING_TRANSPORT"], float(got[0])


@pytest.mark.multirank
def test_kr_run_starts_a_tcp_job():
    import keras_ring as kr

    assert kr.run(_sum_of_ranks, np=3, env={"KERAS_RING_TRANSPORT": "tcp"}) == [("tcp", 3.0)] * 3
    assert kr.run(_sum_of_ranks, np=2, use_gloo=True) == [("tcp", 1.0)] * 2  # Horovod's spelling
