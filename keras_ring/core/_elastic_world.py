"""A worker's side of an elastic job: asking the driver for each world.

Under `keras-ring-run --elastic` (`KERAS_RING_ELASTIC=1`), `kr.init()` does
not read its rank and size from the environment: it asks the driver through
the job's rendezvous store and waits, bounded, for the answer
(docs/decisions/0003-elastic-protocol.md has the keys). The answer is a
world to join, or the news that this worker was removed (it exits with code
0) or that the job is ending (an error).
"""

import contextlib
import json
import os
import sys
import threading

from keras_ring.core._rendezvous import RendezvousClient

_DEFAULT_ELASTIC_TIMEOUT = 600.0

_lock = threading.Lock()
_client = None
_requests = 0  # the worker's requests so far
_generation = -1  # the world it is in (-1: none yet)
_reason = ""  # what ended its last world, for the driver's log
_running = []  # the states of the functions `kr.elastic.run` wrapped, being called, innermost last


def is_elastic():
    """True in a worker of an elastic job (started by `keras-ring-run --elastic`)."""
    return os.environ.get("KERAS_RING_ELASTIC") == "1"


def generation():
    """The generation of the world this worker is in; -1 before the first."""
    return _generation


@contextlib.contextmanager
def running(state):
    """Makes `state` the running state while a function `kr.elastic.run` wrapped is called."""
    _running.append(state)
    try:
        yield
    finally:
        _running.pop()


def running_state():
    """The state of the innermost call of a function `kr.elastic.run` wrapped, or None outside one.

    `keras_ring.callbacks.BackupAndRestore` asks it, so that in an elastic
    job it reads its backup into the state once, and numbers its epochs as
    the state counts them.
    """
    return _running[-1] if _running else None


def set_reason(why):
    """Records what ended this worker's world; its next request tells the driver."""
    global _reason
    _reason = str(why)


def _elastic_timeout():
    text = os.environ.get("KERAS_RING_ELASTIC_TIMEOUT", "")
    try:
        value = float(text) if text else _DEFAULT_ELASTIC_TIMEOUT
    except ValueError:
        value = -1
    if not value > 0:
        raise ValueError("keras-ring: KERAS_RING_ELASTIC_TIMEOUT must be a number of seconds "
                         f"(more than 0). Received: KERAS_RING_ELASTIC_TIMEOUT={text}")
    return value


def _worker():
    worker = os.environ.get("KERAS_RING_WORKER", "")
    if not worker:
        raise RuntimeError("keras-ring: KERAS_RING_ELASTIC=1, but KERAS_RING_WORKER is not set: "
                           "an elastic job's workers are started by `keras-ring-run --elastic`, "
                           "which names each of them")
    return worker


def _store(fresh=False):
    """The connection to the job's store, opened once (again if `fresh`)."""
    global _client
    if _client is not None and fresh:
        _client.close()
        _client = None
    if _client is None:
        address = os.environ.get("KERAS_RING_RENDEZVOUS", "")
        secret = os.environ.get("KERAS_RING_SECRET", "")
        if not address or not secret:
            raise RuntimeError("keras-ring: KERAS_RING_ELASTIC=1, but KERAS_RING_RENDEZVOUS or "
                               "KERAS_RING_SECRET is not set: an elastic job's workers are "
                               "started by `keras-ring-run --elastic`")
        timeout = float(os.environ.get("KERAS_RING_TIMEOUT") or 300)
        _client = RendezvousClient(address, secret.encode(), f"worker {_worker()}", timeout)
    return _client


def _call(method, *args):
    """A store request; once more on a new connection if the first one broke
    (the server closes connections idle for ten minutes)."""
    try:
        return getattr(_store(), method)(*args)
    except ConnectionError:
        return getattr(_store(fresh=True), method)(*args)


def request_world():
    """Asks the driver for this worker's next world and waits for the answer.

    Returns:
        The engine settings of the world to join: `rank`, `size` and
        `world_name`.

    Raises:
        SystemExit: (code 0) if the driver removed this worker from the job.
        RuntimeError: if the job is ending, or no answer came within
            `KERAS_RING_ELASTIC_TIMEOUT` seconds.
    """
    global _requests, _generation, _reason
    with _lock:
        worker = _worker()
        timeout = _elastic_timeout()
        request = _requests
        _call("set", f"elastic/ready/{worker}", json.dumps(
            {"request": request, "generation": _generation, "why": _reason}).encode())
        _requests += 1
        _reason = ""
        reply = _call("get", f"elastic/assign/{worker}/{request}", timeout)
        if reply is None:
            raise RuntimeError(
                f"keras-ring: worker {worker} waited {timeout:g} s "
                "(KERAS_RING_ELASTIC_TIMEOUT) for the elastic driver to give it a world; the "
                "driver is gone or stuck")
        answer = json.loads(reply)
        if "removed" in answer:
            print(f"keras-ring: worker {worker} leaves the job: {answer['removed']}",
                  file=sys.stderr, flush=True)
            raise SystemExit(0)
        if "failed" in answer:
            raise RuntimeError(f"keras-ring: the elastic job is ending: {answer['failed']}")
        _generation = int(answer["generation"])
        return {"rank": int(answer["rank"]), "size": int(answer["size"]),
                "world_name": f"world.{_generation}"}


def hosts_updated():
    """True if the driver asked the current world to re-form (workers can join or must leave).

    Rank 0 reads it at every commit (a store read with no wait); outside an
    elastic job it is always False.
    """
    if not is_elastic() or _generation < 0:
        return False
    with _lock:
        return _call("get", f"elastic/hosts_updated/{_generation}", 0) is not None
