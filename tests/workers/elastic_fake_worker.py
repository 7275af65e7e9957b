"""A fake elastic worker: it speaks the store protocol of docs/decisions/0003-elastic-protocol.md
and trains nothing (no TensorFlow, no engine), so that the driver's tests are fast.

It asks for a world, then runs steps until rank 0 sees the file in $FAKE_FINISH. A step is a
barrier through the store: each member sets `fake/<g>/<step>/<rank>` and reads every other's;
rank 0's value is what it broadcasts: "go", "update" (it read `elastic/hosts_updated/<g>`: every
member asks again, as at a commit) or "finish" (every member exits 0). A member that waits for a
peer whose process has died, or for longer than KERAS_RING_TIMEOUT, asks for a new world, as
the engine's WorkerLostError would make it. A new world starts at the step its rank 0 was at.

Lines it prints (stdout): `worker W pid P`, `worker W env {...}` (the protocol's variables,
as JSON), `worker W generation G rank R size N step S`,
`worker W finished at step S`, `worker W removed: why`, `worker W failed: why`.
With FAKE_SHM=1 it leaves a file in /dev/shm named as the engine names its segments.
"""

import json
import os
import sys
import time

from keras_ring.core._rendezvous import RendezvousClient

STEP_SECONDS = 0.05
POLL_SECONDS = 0.2
# The variables of the elastic protocol, which it prints.
ENV = ("KERAS_RING_TRANSPORT", "KERAS_RING_ELASTIC", "KERAS_RING_ELASTIC_TIMEOUT",
       "KERAS_RING_RANK", "KERAS_RING_SIZE")

worker = os.environ["KERAS_RING_WORKER"]
timeout = float(os.environ.get("KERAS_RING_TIMEOUT") or 300)
wait = float(os.environ["KERAS_RING_ELASTIC_TIMEOUT"])
finish_file = os.environ["FAKE_FINISH"]
store = RendezvousClient(os.environ["KERAS_RING_RENDEZVOUS"],
                         os.environ["KERAS_RING_SECRET"].encode(), f"worker {worker}", 30)


def say(text):
    # One write per line: the workers share our stdout, unbuffered (PYTHONUNBUFFERED).
    sys.stdout.write(f"worker {worker} {text}\n")
    sys.stdout.flush()


def process_state(pid):
    """The state letter of process `pid`, or "X" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "X"
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


class Lost(Exception):
    """A peer died or did not answer: the world is gone."""


def gather(g, key, rank, size, value, pids):
    """Sets fake/<g>/<key>/<rank> and returns every member's value, in rank order."""
    store.set(f"fake/{g}/{key}/{rank}", value)
    values = []
    for peer in range(size):
        started = time.monotonic()
        while True:
            got = store.get(f"fake/{g}/{key}/{peer}", POLL_SECONDS)
            if got is not None:
                values.append(got)
                break
            if pids and process_state(pids[peer]) in "ZX":
                raise Lost(f"rank {peer} died")
            if time.monotonic() - started > timeout:
                raise Lost(f"rank {peer} did not answer within {timeout:g} s")
    return values


def main():
    say(f"pid {os.getpid()}")
    say("env " + json.dumps({name: os.environ.get(name) for name in ENV}, sort_keys=True))
    if os.environ.get("FAKE_SHM") == "1":
        open(f"/dev/shm/kr-{os.getpid()}x{os.urandom(8).hex()}-0", "w").close()
    request, generation, why, step = 0, -1, "", 0
    while True:
        store.set(f"elastic/ready/{worker}",
                  json.dumps({"request": request, "generation": generation, "why": why}).encode())
        reply = store.get(f"elastic/assign/{worker}/{request}", wait)
        request += 1
        if reply is None:
            say("failed: no answer from the driver")
            return 4
        answer = json.loads(reply)
        if "removed" in answer:
            say(f"removed: {answer['removed']}")
            return 0
        if "failed" in answer:
            say(f"failed: {answer['failed']}")
            return 3
        generation, rank, size = answer["generation"], answer["rank"], answer["size"]
        try:
            pids = [int(p) for p in gather(generation, "pid", rank, size,
                                           str(os.getpid()).encode(), None)]
            step = int(gather(generation, "start", rank, size, str(step).encode(), pids)[0])
            say(f"generation {generation} rank {rank} size {size} step {step}")
            while True:
                word = b"go"
                if rank == 0:
                    if os.path.exists(finish_file):
                        word = b"finish"
                    elif store.get(f"elastic/hosts_updated/{generation}", 0) is not None:
                        word = b"update"
                word = gather(generation, step, rank, size, word, pids)[0]
                step += 1
                if word == b"finish":
                    say(f"finished at step {step}")
                    return 0
                if word == b"update":
                    why = "hosts updated"
                    break
                time.sleep(STEP_SECONDS)
        except Lost as e:
            why = str(e)


if __name__ == "__main__":
    sys.exit(main())
