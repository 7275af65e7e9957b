"""A worker's side of an elastic job (keras_ring/core/_elastic_world.py), the test its driver.

The driver's side is tested in test_elastic_driver.py; here the test writes
the driver's answers into a real rendezvous store itself, so that what a
worker does with each answer is checked alone: the world it joins, a removal,
the end of the job, no answer, and a new world in the same process once a
peer was SIGKILLed.
"""

import json
import os
import pathlib
import secrets
import subprocess
import sys
import time

import pytest
from conftest import RANK_THREAD_ENV

from keras_ring.core._rendezvous import RendezvousClient, RendezvousServer

WORKERS = pathlib.Path(__file__).parent / "workers"


@pytest.fixture
def store():
    """(server address, secret, a client of the test's own)."""
    secret = secrets.token_hex(16)
    with RendezvousServer(secret.encode()) as server:
        address = "%s:%d" % server.address
        with RendezvousClient(address, secret.encode(), "test driver", timeout=10) as client:
            yield address, secret, client


def _worker_env(address, secret, worker, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KERAS_RING_", "PMI_", "HYDRA_"))}
    return {**env, **RANK_THREAD_ENV, "KERAS_RING_TRANSPORT": "tcp",
            "KERAS_RING_RENDEZVOUS": address, "KERAS_RING_SECRET": secret,
            "KERAS_RING_ELASTIC": "1", "KERAS_RING_WORKER": worker,
            "KERAS_RING_TIMEOUT": "20", **extra}


def _ready(client, worker, timeout=60):
    reply = client.get(f"elastic/ready/{worker}", timeout)
    assert reply is not None, f"worker {worker} never asked for a world"
    return json.loads(reply)


def _answer(client, worker, request, **answer):
    client.set(f"elastic/assign/{worker}/{request}", json.dumps(answer).encode())


def _run_init(address, secret, worker, timeout="30"):
    code = ("import keras_ring as kr; kr.init(); "
            "print('rank', kr.rank(), 'of', kr.size(), flush=True)")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=_worker_env(address, secret, worker,
                                   KERAS_RING_ELASTIC_TIMEOUT=timeout))


def test_the_client_sets_gets_and_waits_bounded(store):
    address, secret, client = store
    client.set("a", b"1")
    assert client.get("a", 0) == b"1"
    start = time.monotonic()
    assert client.get("never", 0.3) is None
    assert 0.25 < time.monotonic() - start < 5
    with RendezvousClient(address, secret.encode(), "another") as other:
        assert other.get("a", 0) == b"1"


def test_the_client_refuses_a_server_without_the_secret(store):
    address, _, _ = store
    with pytest.raises(ConnectionError, match="secret"):
        RendezvousClient(address, b"not the secret", "intruder", timeout=5)


def _init_answered(store, worker, **answer):
    """Runs kr.init() in a worker whose first request gets `answer`: (exit code, output)."""
    address, secret, client = store
    process = _run_init(address, secret, worker)
    try:
        asked = _ready(client, worker)
        assert asked == {"request": 0, "generation": -1, "why": ""}
        _answer(client, worker, 0, **answer)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    return process.returncode, out


def test_a_worker_joins_the_world_the_driver_gives_it(store):
    code, out = _init_answered(store, "localhost:0:0", generation=0, rank=0, size=1)
    assert code == 0, out
    assert "rank 0 of 1" in out


def test_a_removed_worker_exits_with_code_0_saying_why(store):
    code, out = _init_answered(store, "localhost:1:5", removed="its host left the discovery output")
    assert code == 0, out
    assert "leaves the job: its host left the discovery output" in out
    assert "rank" not in out.replace("keras-ring", "")


def test_a_worker_of_a_failing_job_raises_the_drivers_reason(store):
    code, out = _init_answered(store, "localhost:0:0", failed="1 worker left of --min-np 2")
    assert code != 0
    assert "the elastic job is ending: 1 worker left of --min-np 2" in out


def test_a_worker_without_an_answer_fails_after_the_elastic_timeout(store):
    address, secret, client = store
    process = _run_init(address, secret, "localhost:0:0", timeout="1")
    try:
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    assert "waited 1 s (KERAS_RING_ELASTIC_TIMEOUT) for the elastic driver" in out


@pytest.mark.multirank
@pytest.mark.parametrize(("killed", "tf"), [(2, "0"), (0, "0"), (1, "1")],
                         ids=["rank2", "rank0", "rank1-tf-op"])
def test_survivors_of_a_killed_worker_go_on_in_a_new_world_in_the_same_process(store, killed,
                                                                                 tf):
    address, secret, client = store
    workers = [f"localhost:{slot}:{slot}" for slot in range(3)]
    processes = [subprocess.Popen(
        [sys.executable, str(WORKERS / "elastic_world_worker.py")], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=_worker_env(address, secret, w, KR_TEST_KILL_SELF=str(killed), KR_TEST_TF=tf))
        for w in workers]
    try:
        for rank, w in enumerate(workers):
            _ready(client, w)
            _answer(client, w, 0, generation=0, rank=rank, size=3)
        survivors = [w for rank, w in enumerate(workers) if rank != killed]
        for w in survivors:
            asked = _ready(client, w)  # the key now holds the second request
            deadline = time.monotonic() + 60
            while asked["request"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
                asked = _ready(client, w)
            assert asked["request"] == 1 and asked["generation"] == 0, asked
            assert asked["why"].startswith("keras-ring:"), asked
        for rank, w in enumerate(survivors):
            _answer(client, w, 1, generation=1, rank=rank, size=2)
        outs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for rank, (p, out) in enumerate(zip(processes, outs)):
        if rank == killed:
            assert p.returncode == -9, out
            continue
        assert p.returncode == 0, out
        assert f"first rank {rank} lost a worker: keras-ring:" in out, out
        new_rank = 0 if rank == min(r for r in range(3) if r != killed) else 1
        assert f"first rank {rank}: now rank {new_rank} of 2, total 1" in out, out
