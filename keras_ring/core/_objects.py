"""Collectives on picklable Python objects, a barrier and join, over the engine's NumPy binding.

They need no TensorFlow. Names match across ranks by call order: every rank
(of the process set) must call them in the same order (as with any
collective), or pass `name`.
"""

import collections
import io
import itertools
import pickle

import numpy as np

from keras_ring.core import _basics
from keras_ring.core._process_sets import describe, process_set_id, root_index, world_rank

# One counter per process set: only its members call its collectives.
_counters = collections.defaultdict(itertools.count)


def _name(kind, name, process_set):
    # Python calls on one rank run one at a time, so a per-process counter gives
    # every rank the same sequence of names.
    if name is None:
        name = next(_counters[process_set_id(process_set)])
    return f"{kind}.{name}"


def _run(collective, array, name, process_set=None, **kwargs):
    engine = _basics._engine()
    return engine.submit(getattr(engine, collective), array, name,
                         process_set=process_set_id(process_set), **kwargs).wait()


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Sends a picklable object from `root_rank` to every rank.

    Args:
        obj: The object; only the root's matters.
        root_rank: The rank whose object every rank receives.
        name: Matches the call across ranks; by default the call order does.
        process_set: Run among this `ProcessSet`'s members only (`root_rank`
            is a rank of the job and one of them, as in Horovod); default:
            every rank.

    Returns:
        The root's object (unpickled on each rank; the root gets its own back).

    Example:

    ```python
    # Rank 0 decides; every rank receives its choice.
    config = {"lr": 0.1, "seed": 1234} if kr.rank() == 0 else None
    config = kr.broadcast_object(config, root_rank=0)
    ```
    """
    _basics._require_initialized("broadcast_object()")
    base = _name("broadcast_object", name, process_set)
    root_rank = root_index(process_set, root_rank)
    is_root = describe(process_set)[2] == root_rank
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if is_root else None
    length = np.array([payload.size if payload is not None else 0], np.int64)
    length = _run("BROADCAST", length, base + ".length", process_set, root_rank=root_rank)
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    payload = _run("BROADCAST", payload, base + ".bytes", process_set, root_rank=root_rank)
    return pickle.load(io.BytesIO(payload.tobytes()))


def allgather_object(obj, name=None, process_set=None):
    """Gathers a picklable object from every rank, in rank order.

    Args:
        obj: This rank's object.
        name: Matches the call across ranks; by default the call order does.
        process_set: Gather among this `ProcessSet`'s members only; default:
            every rank.

    Returns:
        A list with one object per rank (of the set), in rank order.

    Example:

    ```python
    hosts = kr.allgather_object(socket.gethostname())
    if kr.rank() == 0:
        print(f"ranks per host: {collections.Counter(hosts)}")
    ```
    """
    _basics._require_initialized("allgather_object()")
    base = _name("allgather_object", name, process_set)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = _run("ALLGATHER", np.array([payload.size], np.int64), base + ".lengths",
                   process_set)
    gathered = _run("ALLGATHER", payload, base + ".bytes", process_set)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[offsets[r]:offsets[r + 1]].tobytes())
            for r in range(len(lengths))]


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None):
    """Horovod's factory of object broadcasts: a function `f(obj)` that is `broadcast_object`.

    Args:
        root_rank: The rank whose object every rank receives.
        session: Accepted for Horovod's TF1 scripts; there is no session here.
        name: Matches the broadcasts across ranks; by default the call order does.
        process_set: Broadcast among this `ProcessSet`'s ranks only.

    Returns:
        A function of one picklable object that returns the root's object.

    Example:

    ```python
    kr.init()
    bcast = kr.broadcast_object_fn(root_rank=0)
    config = bcast({"lr": 0.1} if kr.rank() == 0 else None)  # rank 0's dict everywhere
    ```
    """
    del session  # TF1 only

    def broadcast(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return broadcast


def join(process_set=None):
    """Says that this rank has run out of data; returns once every rank has.

    Until then, the allreduces, reducescatters and allgathers that the other
    ranks run go ahead without this rank submitting them: it takes part with
    zeros (no rows for allgather), so a sum counts only the ranks with data,
    and `Average` still divides by the number of all ranks, as in Horovod.
    Collectives that cannot take zeros (Min, Max, Product, a broadcast from a
    joined rank, alltoall) fail with an error naming the joined ranks.

    A rank that joined early did not apply the updates the others made after
    it joined: its weights are behind theirs. The rank that joined last took
    every update, so broadcast the training state from the rank `join()`
    returns before using the model on every rank (evaluating, saving,
    training on), as in the example.

    Args:
        process_set: Join within this `ProcessSet` (its collectives only);
            default: every rank.

    Returns:
        The rank that joined last, a rank of the job (as in Horovod).

    Example:

    ```python
    for x, y in my_shard:  # shards of different lengths
        train_step(x, y)   # its gradient allreduce: with zeros from ranks that joined
    last = kr.join()       # waits while the other ranks still step
    # Ranks that joined early missed the last updates: take the last rank's state.
    kr.broadcast_variables(model.variables + optimizer.variables, root_rank=last)
    ```
    """
    _basics._require_initialized("join()")
    last = int(_run("JOIN", np.zeros((), np.int32), "keras_ring.join", process_set))
    return world_rank(process_set, last)


def barrier(name=None, process_set=None):
    """Returns once every rank has called `barrier()`.

    A collective completes only when every rank has submitted it, so an empty
    allreduce is a barrier, and costs one agreement round.

    Args:
        name: Matches the call across ranks; by default the call order does.
        process_set: Wait for this `ProcessSet`'s members only; default:
            every rank.

    Example:

    ```python
    if kr.rank() == 0:
        download_dataset()  # rank 0 fetches, the others wait for it
    kr.barrier()
    ```
    """
    _basics._require_initialized("barrier()")
    _run("ALLREDUCE", np.empty(0, np.float32), _name("barrier", name, process_set), process_set)
