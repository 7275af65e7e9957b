"""Process sets under the launcher (2 or 3 ranks), through the engine's NumPy binding.

Exits non-zero on the first mismatch; prints "rank R: <test> ok" after each test.
"""

import random
import sys

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine


def fail(message):
    print(f"rank {kr.rank()}: FAIL {message}", flush=True)
    sys.exit(1)


def check(name, got, want):
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        fail(f"{name}: got {np.asarray(got).tolist()}, expected {np.asarray(want).tolist()}")


def expect_error(call, exc_type, *fragments):
    try:
        call()
    except exc_type as e:
        for fragment in fragments:
            if fragment not in str(e):
                fail(f"error lacks {fragment!r}: {e}")
        return
    fail(f"expected {exc_type.__name__} with {fragments}")


def submit(collective, array, name, process_set, **kw):
    return _engine.submit(collective, array, name,
                          process_set=process_set.process_set_id, **kw)


def test_collectives_within_a_set(rank, size):
    # The last two ranks, so that world rank 0 (the coordinator) is outside when size is 3.
    pair = kr.add_process_set(kr.ProcessSet([size - 2, size - 1]))
    if pair.ranks != [size - 2, size - 1] or pair.size() != 2:
        fail(f"set {pair}")
    if not pair.included():
        if pair.rank() != -1:
            fail(f"rank() of a non-member: {pair.rank()}")
        expect_error(lambda: submit(_engine.ALLREDUCE, np.ones(2), "x", pair).wait(),
                     ValueError, f"rank {rank} is not in process set {pair.process_set_id}")
    else:
        me = pair.rank()
        x = np.full(3, rank + 1, np.int64)
        check("allreduce", submit(_engine.ALLREDUCE, x, "ar", pair, op=kr.Sum).wait(),
              np.full(3, 2 * size - 1))
        got = submit(_engine.BROADCAST, x, "bc", pair, root_rank=1).wait()
        check("broadcast from set rank 1", got, np.full(3, size))
        got = submit(_engine.ALLGATHER, np.full((me + 1, 2), rank, np.int32), "ag", pair).wait()
        check("allgather", got, [[size - 2] * 2, [size - 1] * 2, [size - 1] * 2])
        rows = np.arange(5 * 2, dtype=np.float32).reshape(5, 2) * (rank + 1)
        got = submit(_engine.REDUCESCATTER, rows, "rs", pair, op=kr.Sum).wait()
        total = np.arange(10, dtype=np.float32).reshape(5, 2) * (2 * size - 1)
        check("reducescatter", got, total[:3] if me == 0 else total[3:])
        h = submit(_engine.ALLTOALL, np.full((3, 1), rank, np.int64), "a2a", pair,
                   splits=[1, 2] if me == 0 else [2, 1])
        a, b = pair.ranks
        check("alltoall", h.wait(), [[a], [b], [b]] if me == 0 else [[a], [a], [b]])
        if h.received_splits() != ([1, 2] if me == 0 else [2, 1]):
            fail(f"received splits {h.received_splits()}")
        expect_error(lambda: submit(_engine.BROADCAST, x, "bad.root", pair, root_rank=2).wait(),
                     ValueError, "root_rank 2 is outside [0, 2)")
        objs = kr.allgather_object({"r": rank}, process_set=pair)
        if objs != [{"r": size - 2}, {"r": size - 1}]:
            fail(f"allgather_object {objs}")
        if kr.broadcast_object(rank, root_rank=size - 1, process_set=pair) != size - 1:
            fail("broadcast_object within the set")
        kr.barrier(process_set=pair)
    # The global set still works, and its object names were not disturbed by the set's.
    if kr.broadcast_object(f"from {rank}", root_rank=0) != "from 0":
        fail("global broadcast_object after set collectives")
    return pair


def test_interleaved_sets_do_not_deadlock(rank, size, pair):
    """Global and set collectives in flight together, submitted in a random order per rank,
    with the same names in both sets."""
    handles = []
    jobs = [("g", i) for i in range(40)] + ([("s", i) for i in range(40)] if pair.included()
                                             else [])
    random.Random(rank).shuffle(jobs)
    for kind, i in jobs:
        process_set = kr.global_process_set if kind == "g" else pair
        x = np.full(1000 + i, rank + i, np.int64)
        handles.append((kind, i, submit(_engine.ALLREDUCE, x, f"same.{i}", process_set,
                                        op=kr.Sum)))
    for kind, i, h in handles:
        members = range(size) if kind == "g" else pair.ranks
        check(f"{kind} {i}", h.wait(), np.full(1000 + i, sum(r + i for r in members)))


def test_join_within_a_set(rank, size, pair):
    if not pair.included():
        return
    steps = 1 + pair.rank()
    for step in range(steps):
        got = submit(_engine.ALLREDUCE, np.ones(2, np.float32), "js", pair, op=kr.Sum).wait()
        check(f"join step {step}", got, np.full(2, 2 if step < 1 else 1))
    last = kr.join(process_set=pair)
    if last != pair.ranks[1]:  # a rank of the job, as in Horovod
        fail(f"join in the set returned {last}")


def test_add_and_remove(rank, size, pair):
    # Ranks that disagree on the members all get an error naming each rank's list.
    expect_error(lambda: kr.add_process_set([0, rank] if rank else [0]), ValueError,
                 "ranks disagree", "rank 0 sent add_process_set", "ranks=[0]; rank 1 sent")
    expect_error(lambda: kr.add_process_set([0, size]), ValueError, f"[0, {size})")
    expect_error(lambda: kr.ProcessSet([1, 1]), ValueError, "must not repeat")
    solo = kr.add_process_set([0])
    solo_id = solo.process_set_id
    if rank == 0:
        check("solo", submit(_engine.ALLREDUCE, np.ones(1), "solo", solo, op=kr.Sum).wait(), [1])
    if not kr.remove_process_set(solo) or kr.remove_process_set(solo):
        fail("remove_process_set should return True once, then False")
    expect_error(lambda: kr.barrier(process_set=solo), ValueError, "add_process_set")
    expect_error(lambda: kr.remove_process_set(kr.global_process_set), ValueError, "global")
    # A set whose id was set by hand (Horovod's test does this) is refused before any collective.
    fake = kr.ProcessSet([0])
    fake.process_set_id = pair.process_set_id
    expect_error(lambda: kr.barrier(process_set=fake), ValueError, "did not return")
    # Ids are never reused, and the remaining set still works.
    again = kr.add_process_set([0])
    if again.process_set_id <= solo_id:
        fail(f"id {again.process_set_id} reused")
    kr.remove_process_set(again)
    if pair.included():
        kr.barrier(process_set=pair)


def test_init_with_process_sets(rank, size, pair):
    kr.barrier()  # shutdown is job-wide: the set's members must be done first
    kr.shutdown()
    if pair.process_set_id is not None:
        fail("a set survived shutdown()")
    edges = kr.ProcessSet([0, size - 1])
    kr.init(process_sets=[edges])
    if edges.process_set_id != 1:
        fail(f"first set after init has id {edges.process_set_id}")
    if edges.included():
        got = submit(_engine.ALLREDUCE, np.ones(1), "edges", edges, op=kr.Sum).wait()
        check("edges", got, [2])
    kr.barrier()  # a rank's exit ends the job's engine, sets included


def main():
    kr.init()
    rank, size = kr.rank(), kr.size()
    pair = test_collectives_within_a_set(rank, size)
    print(f"rank {rank}: test_collectives_within_a_set ok", flush=True)
    for test in (test_interleaved_sets_do_not_deadlock, test_join_within_a_set,
                 test_add_and_remove, test_init_with_process_sets):
        test(rank, size, pair)
        print(f"rank {rank}: {test.__name__} ok", flush=True)


if __name__ == "__main__":
    main()
