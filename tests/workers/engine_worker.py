"""Multi-rank checks of the engine through its NumPy binding (no TensorFlow).

Run under the launcher with 2 or 3 ranks; exits non-zero on the first
mismatch. Every collective x dtype x reduce op is compared with a NumPy
reference computed from all ranks' inputs, which every rank can regenerate
because the inputs are seeded by rank.
"""

import functools
import os
import random
import sys
import threading
import time

import numpy as np

import keras_ring as kr
from keras_ring.core import _engine

try:
    from ml_dtypes import bfloat16
except ImportError:  # ml_dtypes comes with TensorFlow
    bfloat16 = None

OPS = {name: getattr(kr, name) for name in ("Average", "Sum", "Min", "Max", "Product")}
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]
if bfloat16 is not None:
    DTYPES.insert(1, bfloat16)
# Moved unchanged by allgather, broadcast and alltoall; not reduced.
MOVED_DTYPES = [np.int16, np.uint16, np.bool_]
SIZES = [0, 1, 7, 1001]
BIG = 4 * 1024 * 1024 + 3  # ~16 MiB of float32, not divisible by 2 or 3


def data(rank, n, dtype, op, seed):
    """Integer-valued inputs, so that Sum/Min/Max/Product are exact in every dtype."""
    return _data(rank, n, dtype, op == "Product", seed).copy()


@functools.lru_cache(maxsize=32)
def _data(rank, n, dtype, for_product, seed):
    # Every rank makes every rank's inputs for its reference, for each op: made once.
    rng = np.random.default_rng([seed, rank, n])
    if dtype is np.bool_:
        return rng.integers(0, 1, size=n, endpoint=True).astype(np.bool_)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, endpoint=True).astype(dtype)
    lo, hi = (-4, 4) if for_product else (-8, 8)
    return rng.integers(lo, hi, size=n, endpoint=True).astype(np.float64).astype(dtype)


def reference(inputs, dtype, op, pre, post):
    size = len(inputs)
    is_int = np.issubdtype(np.dtype(dtype), np.integer)

    def scale(x, f):
        if f == 1.0:
            return x
        if is_int:
            return np.trunc(x.astype(np.float64) * f).astype(dtype)
        return (x.astype(np.float64) * f).astype(dtype)

    xs = [scale(x, pre) for x in inputs]
    if op in ("Sum", "Average"):
        # Integer sums wrap: accumulate in int64 and cast back, as NumPy would.
        acc = np.sum([x.astype(np.int64 if is_int else np.float64) for x in xs], axis=0)
        out = acc.astype(dtype)
        if op == "Average":
            post = post / size
    elif op == "Product":
        acc = xs[0].astype(np.int64 if is_int else np.float64)
        for x in xs[1:]:
            acc = acc * x.astype(acc.dtype)
        out = acc.astype(dtype)
    else:
        out = (np.minimum if op == "Min" else np.maximum).reduce(np.stack(xs))
    return scale(out, post)


def check(name, got, want, exact):
    got, want = np.asarray(got), np.asarray(want)
    if exact and got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want):
        return  # equal as they are: no float64 copies of large arrays
    got64 = got.astype(np.float64)
    want64 = np.asarray(want).astype(np.float64)
    if got64.shape != want64.shape:
        fail(f"{name}: shape {got64.shape} != expected {want64.shape}")
    if exact:
        ok = np.array_equal(got64, want64)
    else:
        ok = np.allclose(got64, want64, rtol=2e-2, atol=1e-2)
    if not ok:
        bad = np.flatnonzero(~np.isclose(got64, want64, rtol=2e-2, atol=1e-2) if not exact
                             else got64 != want64)
        i = bad[0]
        fail(f"{name}: {bad.size} elements differ; first at {i}: got {got64.flat[i]}, "
             f"expected {want64.flat[i]}")


def fail(message):
    print(f"rank {kr.rank()}: FAIL {message}", flush=True)
    sys.exit(1)


def submit(collective, array, name, **kw):
    return _engine.submit(collective, array, name, **kw)


def test_allreduce(rank, size):
    for dtype in DTYPES:
        is_int = np.issubdtype(np.dtype(dtype), np.integer)
        for op in OPS:
            for pre, post in [(1.0, 1.0), (0.5, 2.0)]:
                if is_int and op in ("Sum", "Product", "Average") and pre != 1.0:
                    continue  # scaled wrapped integers are out of range: undefined
                sizes = SIZES + ([BIG] if dtype in (np.float32, np.int32) and pre == 1.0 else [])
                for n in sizes:
                    name = f"ar.{np.dtype(dtype).name}.{op}.{pre}.{n}"
                    x = data(rank, n, dtype, op, 1)
                    got = submit(_engine.ALLREDUCE, x, name, op=OPS[op],
                                 prescale_factor=pre, postscale_factor=post).wait()
                    want = reference([data(r, n, dtype, op, 1) for r in range(size)],
                                     dtype, op, pre, post)
                    # Average divides by size: exact for ints (truncation) only.
                    exact = is_int or (op != "Average" and post * pre in (1.0,))
                    check(name, got, want, exact)
    # Multi-dimensional shapes keep their shape.
    x = np.full((3, 5, 2), rank + 1, np.float32)
    got = submit(_engine.ALLREDUCE, x, "ar.shape", op=OPS["Sum"]).wait()
    check("ar.shape", got, np.full((3, 5, 2), size * (size + 1) / 2), exact=True)


def test_allgather(rank, size):
    for dtype in DTYPES + MOVED_DTYPES:
        for rows_of in (lambda r: 3, lambda r: r + 1, lambda r: 0 if r == 1 else 2 * r + 1):
            rows = [rows_of(r) for r in range(size)]
            parts = [data(r, rows[r] * 4, dtype, "Sum", 2).reshape(rows[r], 4)
                     for r in range(size)]
            name = f"ag.{np.dtype(dtype).name}.{rows}"
            got = submit(_engine.ALLGATHER, parts[rank], name).wait()
            check(name, got, np.concatenate(parts), exact=True)
    for dtype in (np.float32, np.int16):
        big = data(rank, BIG + rank, dtype, "Sum", 3)
        got = submit(_engine.ALLGATHER, big, "ag.big").wait()
        want = np.concatenate([data(r, BIG + r, dtype, "Sum", 3) for r in range(size)])
        check(f"ag.big {np.dtype(dtype).name}", got, want, exact=True)


def split_rows(rows, size):
    """Horovod's reducescatter split: the first rows % size ranks get one row more."""
    counts = [rows // size + (r < rows % size) for r in range(size)]
    return np.cumsum([0] + counts)


def test_reducescatter(rank, size):
    for dtype in DTYPES:
        is_int = np.issubdtype(np.dtype(dtype), np.integer)
        for op in OPS:
            for pre, post in [(1.0, 1.0), (0.5, 2.0)]:
                if is_int and op in ("Sum", "Product", "Average") and pre != 1.0:
                    continue
                for rows in (0, 1, size, 2 * size + 1, 1001):
                    name = f"rs.{np.dtype(dtype).name}.{op}.{pre}.{rows}"
                    shape = (rows, 3)
                    inputs = [data(r, rows * 3, dtype, op, 5).reshape(shape) for r in range(size)]
                    got = submit(_engine.REDUCESCATTER, inputs[rank], name, op=OPS[op],
                                 prescale_factor=pre, postscale_factor=post).wait()
                    bounds = split_rows(rows, size)
                    want = reference(inputs, dtype, op, pre, post)[bounds[rank]:bounds[rank + 1]]
                    exact = is_int or (op != "Average" and post * pre in (1.0,))
                    check(name, got, want, exact)
    big = data(rank, BIG, np.float32, "Sum", 6)
    got = submit(_engine.REDUCESCATTER, big, "rs.big", op=OPS["Sum"]).wait()
    bounds = split_rows(BIG, size)
    want = reference([data(r, BIG, np.float32, "Sum", 6) for r in range(size)], np.float32,
                     "Sum", 1.0, 1.0)
    check("rs.big", got, want[bounds[rank]:bounds[rank + 1]], exact=True)


def test_alltoall(rank, size):
    def splits_of(r, case):
        return {"even": [2] * size, "uneven": [(r + 2 * j) % 4 for j in range(size)],
                "zeros": [0] * size, "none": None}[case]

    for dtype in DTYPES + MOVED_DTYPES:
        for case in ("even", "uneven", "zeros", "none"):
            def rows_of(r):
                s = splits_of(r, case)
                return 3 * size if s is None else sum(s)

            inputs = [data(r, rows_of(r) * 2, dtype, "Sum", 7).reshape(rows_of(r), 2)
                      for r in range(size)]
            name = f"a2a.{np.dtype(dtype).name}.{case}"
            splits = splits_of(rank, case)
            handle = submit(_engine.ALLTOALL, inputs[rank], name,
                            splits=[] if splits is None else splits)
            got = handle.wait()
            parts, received = [], []
            for r in range(size):
                s = splits_of(r, case) or [3] * size
                start = sum(s[:rank])
                parts.append(inputs[r][start:start + s[rank]])
                received.append(s[rank])
            check(name, got, np.concatenate(parts), exact=True)
            if handle.received_splits() != received:
                fail(f"{name}: received splits {handle.received_splits()} != {received}")
    # Large blocks to every rank.
    rows = (1 << 20) + 1
    x = data(rank, rows * size, np.float32, "Sum", 8)
    got = submit(_engine.ALLTOALL, x, "a2a.big", splits=[rows] * size).wait()
    want = np.concatenate([data(r, rows * size, np.float32, "Sum", 8)[rank * rows:(rank + 1) * rows]
                           for r in range(size)])
    check("a2a.big", got, want, exact=True)


def test_broadcast(rank, size):
    for dtype in DTYPES + MOVED_DTYPES:
        for root in range(size):
            for n in SIZES + ([BIG] if dtype in (np.float32, np.bool_) else []):
                name = f"bc.{np.dtype(dtype).name}.{root}.{n}"
                got = submit(_engine.BROADCAST, data(rank, n, dtype, "Sum", 4), name,
                             root_rank=root).wait()
                check(name, got, data(root, n, dtype, "Sum", 4), exact=True)


def test_out_of_order(rank, size):
    """Each rank submits 200 names in its own random order before waiting on any."""
    names = [f"ooo.{i}" for i in range(200)]
    order = list(range(len(names)))
    random.Random(rank).shuffle(order)
    handles = {}
    for i in order:
        x = np.full(1 + (i * 37) % 3000, float(rank + i), np.float32)
        handles[i] = submit(_engine.ALLREDUCE, x, names[i], op=OPS["Sum"])
    for i in range(len(names)):
        want = sum(float(r + i) for r in range(size))
        check(names[i], handles[i].wait(), np.full(1 + (i * 37) % 3000, want), exact=True)


def test_fusion(rank, size):
    """Many small tensors of mixed dtypes, ops and sizes in flight at once, as fusion sees them."""
    cases = []
    for i in range(300):
        dtype = DTYPES[i % len(DTYPES)]
        op = ["Sum", "Average", "Max"][i % 3]
        cases.append((f"fuse.{i}", dtype, op, [0, 1, 7, 1001, 5000][i % 5]))
    handles = [submit(_engine.ALLREDUCE, data(rank, n, dtype, op, i), name, op=OPS[op])
               for i, (name, dtype, op, n) in enumerate(cases)]
    for i, ((name, dtype, op, n), handle) in enumerate(zip(cases, handles)):
        want = reference([data(r, n, dtype, op, i) for r in range(size)], dtype, op, 1.0, 1.0)
        is_int = np.issubdtype(np.dtype(dtype), np.integer)
        check(name, handle.wait(), want, exact=is_int or op != "Average")
    stats = _engine.stats()
    if stats["tensors"] < len(cases):
        fail(f"engine counted {stats['tensors']} tensors after {len(cases)} requests")


def test_compression(rank, size):
    """float32/float64 reduced as float16 or bfloat16 inside the engine, alone and fused."""
    narrow = {_engine.COMPRESSION_FP16: np.float16}
    if bfloat16 is not None:
        narrow[_engine.COMPRESSION_BF16] = bfloat16

    def fractions(r, n):  # values that the wire types round
        return np.random.default_rng([9, r, n]).uniform(-2, 2, n)

    for code, wire in narrow.items():
        for dtype in (np.float32, np.float64):
            # Several tensors in flight at once, as fusion sees them.
            xs = [fractions(rank, n).astype(dtype) for n in (0, 1, 7, 1001, 70001)]
            handles = [submit(_engine.ALLREDUCE, x, f"cmp.{code}.{dtype.__name__}.{i}",
                              op=OPS["Average"], compression=code) for i, x in enumerate(xs)]
            for i, (x, handle) in enumerate(zip(xs, handles)):
                got = handle.wait()
                name = f"cmp.{code}.{dtype.__name__}.{i}"
                if got.dtype != dtype or got.shape != x.shape:
                    fail(f"{name}: got {got.dtype}{got.shape}")
                # Converted back from the wire type: exactly representable in it.
                if not np.array_equal(got.astype(wire).astype(dtype), got):
                    fail(f"{name}: the result is not a {np.dtype(wire).name} value")
                want = np.mean([fractions(r, len(x)) for r in range(size)], axis=0)
                tol = 2e-3 if wire is np.float16 else 2e-2
                if not np.allclose(got, want, rtol=tol, atol=tol):
                    fail(f"{name}: {np.max(np.abs(got - want))} from the exact mean")
    # Integers are never compressed; reducescatter compresses too.
    ints = np.arange(10, dtype=np.int32) * (rank + 1)
    got = submit(_engine.ALLREDUCE, ints, "cmp.int", op=OPS["Sum"],
                 compression=_engine.COMPRESSION_FP16).wait()
    check("cmp.int", got, np.arange(10) * size * (size + 1) // 2, exact=True)
    x = np.full((2 * size, 3), 0.1 * (rank + 1), np.float32)
    got = submit(_engine.REDUCESCATTER, x, "cmp.rs", op=OPS["Sum"],
                 compression=_engine.COMPRESSION_FP16).wait()
    want = np.float16(0.1 * size * (size + 1) / 2)
    if got.shape != (2, 3) or not np.allclose(got, want, rtol=2e-3):
        fail(f"cmp.rs: got {got}, want {want}")


def test_transport(rank, size):
    """The allreduces so far took the path the job's settings call for (KR_TEST_PATH)."""
    local = os.environ.get("KR_TEST_LOCAL_SIZE")
    if local and kr.local_size() != int(local):
        fail(f"local_size {kr.local_size()} on a pretended host of {local} ranks")
    expected = os.environ.get("KR_TEST_PATH")
    if not expected:
        return
    stats = _engine.stats()
    shm, hierarchical = stats["shm_collectives"], stats["hierarchical_collectives"]
    got = "hierarchical" if hierarchical else "shm" if shm else "network"
    if got != expected or (hierarchical and hierarchical != shm):
        fail(f"expected the {expected} path, the engine counted {shm} shared-memory "
             f"allreduces, {hierarchical} of them hierarchical")


def test_objects(rank, size):
    for root in range(size):
        obj = {"root": rank, "payload": list(range(rank * 1000))} if rank == root else None
        got = kr.broadcast_object(obj, root_rank=root)
        if got != {"root": root, "payload": list(range(root * 1000))}:
            fail(f"broadcast_object from {root}: {str(got)[:80]}")
    got = kr.allgather_object(("rank", rank, "x" * (rank * 5000)))
    if got != [("rank", r, "x" * (r * 5000)) for r in range(size)]:
        fail(f"allgather_object: {str(got)[:80]}")
    # Every rank leaves a mark, then meets the others: after the barrier all marks are there.
    with open(f"barrier.{rank}", "w") as f:
        f.write("here")
    kr.barrier()
    missing = [r for r in range(size) if not os.path.exists(f"barrier.{r}")]
    if missing:
        fail(f"barrier returned before ranks {missing} reached it")
    kr.barrier()  # nobody removes its mark before everyone has looked
    os.remove(f"barrier.{rank}")


def expect_error(handle, exc_type, *fragments):
    """Fails unless waiting for `handle` (or calling it, if it is a function) raises exc_type
    with every fragment in its message."""
    try:
        handle() if callable(handle) else handle.wait()
    except exc_type as e:
        text = str(e).lower()
        for frag in fragments:
            if frag.lower() not in text:
                fail(f"error message lacks {frag!r}: {text}")
        return
    fail(f"expected {exc_type.__name__} containing {fragments}")


def test_mismatch(rank, size):
    x = np.zeros(4 + (rank == 1), np.float32)
    expect_error(submit(_engine.ALLREDUCE, x, "mm.shape", op=OPS["Sum"]), ValueError,
                 "mm.shape", "rank 0", "float32[4]", "float32[5]")
    x = np.zeros(4, np.float32 if rank == 0 else np.float64)
    expect_error(submit(_engine.ALLREDUCE, x, "mm.dtype", op=OPS["Sum"]), ValueError,
                 "mm.dtype", "float64")
    x = np.zeros(4, np.float32)
    expect_error(submit(_engine.ALLREDUCE, x, "mm.op", op=OPS["Sum" if rank else "Max"]),
                 ValueError, "mm.op", "Max", "Sum")
    expect_error(submit(_engine.BROADCAST, x, "mm.root", root_rank=rank % 2), ValueError,
                 "mm.root", "root=0", "root=1")
    x = np.zeros((2, 3 + (rank == 1)), np.float32)
    expect_error(submit(_engine.ALLGATHER, x, "mm.gather"), ValueError, "mm.gather")
    x = np.zeros((size, 3 + (rank == 1)), np.float32)
    expect_error(submit(_engine.ALLTOALL, x, "mm.alltoall"), ValueError, "mm.alltoall",
                 f"float32[{size},3]", f"float32[{size},4]")
    x = np.zeros((size + (rank == 1), 2), np.float32)
    expect_error(submit(_engine.REDUCESCATTER, x, "mm.reducescatter", op=OPS["Sum"]), ValueError,
                 "mm.reducescatter", f"float32[{size},2]", f"float32[{size + 1},2]")
    # Splits that fit on every rank but one: every rank gets the error, naming that rank.
    x = np.zeros((size, 2), np.float32)
    splits = [1] * size if rank != 1 else [2] * size
    expect_error(submit(_engine.ALLTOALL, x, "one.bad.split", splits=splits), ValueError,
                 "'one.bad.split' is invalid on rank 1: alltoall splits must add up")
    expect_error(submit(_engine.BROADCAST, x, "one.bad.root", root_rank=size if rank == 1 else 0),
                 ValueError, f"'one.bad.root' is invalid on rank 1: root_rank {size} is outside")
    # Splits wrong on every rank: each rank's reason.
    x = np.zeros((5, 2), np.float32)
    expect_error(submit(_engine.ALLTOALL, x, "bad.splits", splits=[5] + [1] * (size - 1)),
                 ValueError, "bad.splits", "add up to", "first dimension is 5")
    expect_error(submit(_engine.ALLTOALL, x, "bad.splits", splits=[5]), ValueError,
                 "bad.splits", f"one split per rank ({size})")
    expect_error(submit(_engine.ALLTOALL, x, "bad.splits"), ValueError, "bad.splits",
                 "divisible", "Pass splits")
    # Reductions refuse the dtypes that are only moved, on the rank that submits them.
    for dtype in MOVED_DTYPES:
        name = np.dtype(dtype).name
        for collective in ("ALLREDUCE", "REDUCESCATTER"):
            expect_error(submit(getattr(_engine, collective), np.zeros((2, 2), dtype), "moved",
                                op=OPS["Sum"]), ValueError, "'moved'",
                         f"{collective.lower()} does not take {name}: reductions take float16",
                         f"allgather, broadcast and alltoall take {name} too")
    # The engine still works after errors.
    got = submit(_engine.ALLREDUCE, np.ones(3, np.float32), "after", op=OPS["Sum"]).wait()
    check("after", got, np.full(3, size), exact=True)


def test_duplicate_name(rank, size):
    """Rank 1 submits "dup" twice; the others submit it only after rank 1 has seen its
    error (ordered by the "dup.sync" allreduce), so the first "dup" is surely in flight."""
    ones = np.ones(3, np.float32)
    if rank == 1:
        a = submit(_engine.ALLREDUCE, ones, "dup", op=OPS["Sum"])
        expect_error(submit(_engine.ALLREDUCE, ones, "dup", op=OPS["Sum"]), ValueError,
                     "dup", "in flight")
    submit(_engine.ALLREDUCE, ones, "dup.sync", op=OPS["Sum"]).wait()
    if rank != 1:
        a = submit(_engine.ALLREDUCE, ones, "dup", op=OPS["Sum"])
    check("dup", a.wait(), np.full(3, size), exact=True)


def test_cache(rank, size):
    """The same names step after step: announced by id after the first step, and still right
    when a shape changes on every rank, or (an error) on one."""
    capacity = int(os.environ.get("KERAS_RING_CACHE_CAPACITY", "1024"))
    before = _engine.stats()["cached_tensors"]
    names = [f"cache.{i}" for i in range(30)]
    steps = 12
    for step in range(steps):
        order = list(range(len(names)))
        random.Random(step * 10 + rank).shuffle(order)
        n_of = {i: 5 + i + (7 if step >= 8 and i == 3 else 0) for i in order}
        handles = {i: submit(_engine.ALLREDUCE, np.full(n_of[i], rank + step, np.int64), names[i],
                             op=OPS["Sum"]) for i in order}
        for i, h in handles.items():
            want = np.full(n_of[i], sum(r + step for r in range(size)))
            check(f"{names[i]} step {step}", h.wait(), want, exact=True)
    hits = _engine.stats()["cached_tensors"] - before
    # A name is cached on its second agreement (step 1); cache.3 changes at step 8 and is renewed.
    expected = 0 if capacity == 0 else (steps - 2) * len(names) - 1
    if hits != expected:
        fail(f"{hits} requests announced by cache id, expected {expected}")
    # One rank changes a cached name: the full comparison runs and names both views.
    x = np.zeros(5 + (rank == 1), np.int64)
    expect_error(submit(_engine.ALLREDUCE, x, names[0], op=OPS["Sum"]), ValueError,
                 names[0], "int64[5]", "int64[6]")
    got = submit(_engine.ALLREDUCE, np.ones(5, np.int64), names[0], op=OPS["Sum"]).wait()
    check("after change", got, np.full(5, size), exact=True)


def test_join(rank, size):
    """Rank r has 2r + 2 batches; a joined rank adds zeros to the others' sums and no rows to
    their allgathers; join returns the last rank to join."""
    steps = 2 * rank + 2
    for step in range(steps):
        total = submit(_engine.ALLREDUCE, np.ones(3, np.float32), "join.sum", op=OPS["Sum"]).wait()
        active = sum(1 for r in range(size) if step < 2 * r + 2)
        check(f"join.sum step {step}", total, np.full(3, active), exact=True)
        mean = submit(_engine.ALLREDUCE, np.full(2, 6.0, np.float32), "join.avg",
                      op=OPS["Average"]).wait()
        check(f"join.avg step {step}", mean, np.full(2, 6.0 * active / size), exact=True)
        group = _engine.run(_engine.ALLREDUCE, [np.ones(3, np.float32), np.full(2, 2, np.int64)],
                            ["join.g.0", "join.g.1"], op=OPS["Sum"], group="join.g")
        check(f"join.g.0 step {step}", group[0], np.full(3, active), exact=True)
        check(f"join.g.1 step {step}", group[1], np.full(2, 2 * active), exact=True)
        rows = submit(_engine.ALLGATHER, np.full((2, 2), rank, np.int32), "join.rows").wait()
        want = np.concatenate([np.full((2, 2), r, np.int32) for r in range(size)
                               if step < 2 * r + 2])
        check(f"join.rows step {step}", rows, want, exact=True)
        if step == steps - 1 and rank == size - 1 and size > 1:
            # Everybody else has joined by now: Max cannot take their zeros.
            expect_error(submit(_engine.ALLREDUCE, np.ones(1, np.float32), "join.max",
                                op=OPS["Max"]), ValueError, "join.max", "have joined", "max")
    last = kr.join()
    if last != size - 1:
        fail(f"join returned {last}, expected {size - 1}")
    # Joining is over: collectives need every rank again.
    got = submit(_engine.ALLREDUCE, np.ones(1, np.float32), "after.join", op=OPS["Sum"]).wait()
    check("after.join", got, np.full(1, size), exact=True)


def test_run(rank, size):
    """run(): many arrays at once, waited for by this thread running the engine (kr_drive)."""
    # Every dtype and size, each with its own op, in one call.
    cases = [(f"run.{i}", DTYPES[i % len(DTYPES)], ["Sum", "Max", "Min"][i % 3],
              (SIZES + [BIG // 64])[i % 5]) for i in range(40)]
    for op_name in ("Sum", "Max", "Min"):
        picked = [c for c in cases if c[2] == op_name]
        inputs = [data(rank, n, dtype, op_name, i) for i, (_, dtype, _, n) in enumerate(picked)]
        got = _engine.run(_engine.ALLREDUCE, inputs, [c[0] for c in picked], op=OPS[op_name])
        for i, ((name, dtype, op, n), out) in enumerate(zip(picked, got)):
            want = reference([data(r, n, dtype, op, i) for r in range(size)], dtype, op, 1.0, 1.0)
            check(name, out, want, exact=True)
    # Other collectives.
    got = _engine.run(_engine.ALLGATHER, [np.full((rank + 1, 2), rank, np.int32)], ["run.ag"])[0]
    check("run.ag", got, np.concatenate([np.full((r + 1, 2), r) for r in range(size)]), exact=True)
    got = _engine.run(_engine.BROADCAST, [np.full(5, rank, np.float64)], ["run.bc"], root_rank=1)
    check("run.bc", got[0], np.full(5, 1.0), exact=True)
    # Handles submitted earlier and not yet waited for complete while run() drives.
    early = [submit(_engine.ALLREDUCE, np.full(3, rank + i, np.float32), f"run.early.{i}",
                    op=OPS["Sum"]) for i in range(5)]
    got = _engine.run(_engine.ALLREDUCE, [np.ones(9, np.float32)], ["run.late"], op=OPS["Sum"])
    check("run.late", got[0], np.full(9, size), exact=True)
    for i, h in enumerate(early):
        check(f"run.early.{i}", h.wait(), np.full(3, sum(r + i for r in range(size))), exact=True)
    # A slow rank: the others' drive gives up spinning and the background thread finishes.
    if rank == 0:
        time.sleep(0.3)
    got = _engine.run(_engine.ALLREDUCE, [np.ones(4, np.float32)], ["run.slow"], op=OPS["Sum"])
    check("run.slow", got[0], np.full(4, size), exact=True)
    # A refused request raises after the call; the rest of the call still completes.
    x = np.zeros(4 + (rank == 1), np.float32)
    try:
        _engine.run(_engine.ALLREDUCE, [np.ones(2, np.float32), x], ["run.ok", "run.bad"],
                    op=OPS["Sum"])
        fail("run() with mismatched shapes did not raise")
    except ValueError as e:
        if "run.bad" not in str(e):
            fail(f"run() error does not name the tensor: {e}")
    try:
        _engine.run(_engine.ALLREDUCE, [np.ones(2, np.float32)], ["a", "b"])
        fail("run() with a name too many did not raise")
    except ValueError as e:
        if "one name per array" not in str(e):
            fail(f"run() with a name too many: unexpected error {e}")
    for names, why in (("ab", "a str for names"), ([b"a", b"b"], "bytes names")):
        try:
            _engine.run(_engine.ALLREDUCE, [np.ones(2, np.float32)] * 2, names)
            fail(f"run() with {why} did not raise")
        except TypeError as e:
            if "Received: names" not in str(e):
                fail(f"run() with {why}: unexpected error {e}")
    if _engine.run(_engine.ALLREDUCE, [], []) != []:
        fail("run() of nothing did not return []")
    # The outputs of one call share one allocation: each is still its own array.
    got = _engine.run(_engine.ALLREDUCE, [np.ones(3, np.float16), np.ones(5, np.int64)],
                      ["run.own.0", "run.own.1"], op=OPS["Sum"])
    got[0][:] = -1
    check("run.own.1", got[1], np.full(5, size), exact=True)
    del got[0]
    check("run.own.1", got[0], np.full(5, size), exact=True)


def test_prepared_run(rank, size):
    """_PreparedRun (the fusion benchmark's engine-only timing): the same requests run again."""
    xs = [np.full(n, rank + 1, dtype) for n, dtype in ((5, np.float32), (0, np.float32),
                                                        (1001, np.float64), (7, np.int32))]
    names = [f"prep.{i}" for i in range(len(xs))]
    gather = _engine._PreparedRun(_engine.ALLGATHER, [np.ones((1, 2), np.float32)], ["prep.ag"])
    expect_error(gather.results, RuntimeError, "once its run() has returned")
    gather.run()
    check("prep.ag", gather.results()[0], np.ones((size, 2)), exact=True)
    for group in ("", "prep"):
        prepared = _engine._PreparedRun(_engine.ALLREDUCE, xs, names, op=OPS["Sum"], group=group)
        for step in range(3):
            for x in xs:
                x[:] = rank + step  # C-contiguous inputs are read as they are at each run
            prepared.run()
            for name, x, out in zip(names, xs, prepared.results()):
                check(f"{name} step {step}", out, np.full(x.shape, sum(r + step for r in
                                                                       range(size))), exact=True)
    bad = _engine._PreparedRun(_engine.ALLREDUCE, [np.ones(2 + rank, np.float32)], ["prep.bad"])
    for _ in range(2):  # and again: a failed run leaves the requests ready to run
        expect_error(bad.run, ValueError, "prep.bad")


def test_groups(rank, size):
    """run(..., group=...): allreduces agreed as one unit. Every dtype, op and size, scale
    factors and compression in one group, step after step (the group is then cached); groups
    that differ between ranks fail on every rank, naming the tensor; no hang."""
    cases = [(f"grp.{i}", DTYPES[i % len(DTYPES)], ["Sum", "Max", "Min", "Product"][i % 4],
              (SIZES + [BIG // 8])[i % 5]) for i in range(24)]
    before = _engine.stats()
    steps = 4
    for step in range(steps):
        inputs = [data(rank, n, dtype, op, i + step) for i, (_, dtype, op, n) in enumerate(cases)]
        # A group for each op, the dtypes mixed within it.
        for op_name in ("Sum", "Max", "Min", "Product"):
            picked = [i for i, c in enumerate(cases) if c[2] == op_name]
            got = _engine.run(_engine.ALLREDUCE, [inputs[i] for i in picked],
                              [cases[i][0] for i in picked], op=OPS[op_name],
                              group=f"grp.{op_name}")
            for i, out in zip(picked, got):
                name, dtype, op, n = cases[i]
                want = reference([data(r, n, dtype, op, i + step) for r in range(size)],
                                 dtype, op, 1.0, 1.0)
                check(f"{name} step {step}", out, want, exact=True)
    stats = _engine.stats()
    hits = stats["cached_tensors"] - before["cached_tensors"]
    capacity = int(os.environ.get("KERAS_RING_CACHE_CAPACITY", "1024"))
    # Cached on the second agreement; from the third step on, every member goes by id.
    if hits != (0 if capacity == 0 else (steps - 2) * len(cases)):
        fail(f"{hits} group members announced by cache id over {steps} steps")
    if stats["tensors"] - before["tensors"] != steps * len(cases):
        fail(f"engine counted {stats['tensors'] - before['tensors']} tensors")
    # Scale factors and compression, in a group of two dtypes.
    xs = [np.full(1001, 0.25 * (rank + 1), np.float32), np.full(7, rank + 1.0, np.float64)]
    got = _engine.run(_engine.ALLREDUCE, xs, ["grp.scaled.0", "grp.scaled.1"], op=OPS["Average"],
                      prescale_factor=2.0, postscale_factor=0.5, group="grp.scaled",
                      compression=_engine.COMPRESSION_FP16)
    mean = sum(r + 1 for r in range(size)) / size
    check("grp.scaled.0", got[0], np.full(1001, 0.25 * mean), exact=False)
    check("grp.scaled.1", got[1], np.full(7, mean), exact=False)
    if got[0].dtype != np.float32 or got[1].dtype != np.float64:
        fail(f"a compressed group changed dtypes: {got[0].dtype}, {got[1].dtype}")

    def expect_run_error(arrays, names, group, *fragments):
        try:
            _engine.run(_engine.ALLREDUCE, arrays, names, op=OPS["Sum"], group=group)
        except ValueError as e:
            for frag in fragments:
                if frag.lower() not in str(e).lower():
                    fail(f"group {group!r}: error lacks {frag!r}: {e}")
            return
        fail(f"group {group!r}: no error")

    ones = [np.ones(3, np.float32) for _ in range(4)]
    names = [f"grp.m.{i}" for i in range(4)]
    # A member's shape differs on rank 1 (after the group was cached).
    for _ in range(3):
        _engine.run(_engine.ALLREDUCE, ones, names, op=OPS["Sum"], group="grp.m")
    odd = ones[:2] + [np.ones(3 + (rank == 1), np.float32)] + ones[3:]
    expect_run_error(odd, names, "grp.m", "tensor 2 of group 'grp.m'", "rank 0 sent 'grp.m.2'",
                     "float32[3]", "rank 1 sent 'grp.m.2'", "float32[4]")
    # Rank 1 has a member fewer, or a member its engine refuses (it has no name), so its
    # group lacks it: every rank fails, naming it.
    mine = [(ones, names), (ones[:3], names[:3]), (ones, names[:3] + [""])]
    for arrays, member_names in mine[1:] if rank == 1 else mine[:1] * 2:
        expect_run_error(arrays, member_names, "grp.m", "tensor 3 of group 'grp.m'",
                         "rank 0 sent 'grp.m.3'", "rank 1 sent a group of 3 tensors")
    # Every member refused on rank 1 (an unknown compression), or a member name twice there:
    # the group still reaches the coordinator, as rank 1's objection.
    if rank == 1:
        try:
            _engine.run(_engine.ALLREDUCE, ones, names, op=OPS["Sum"], group="grp.m",
                        compression=7)
            fail("a group of refused tensors did not raise")
        except ValueError as e:
            if "unknown compression 7" not in str(e):
                fail(f"a group of refused tensors: unexpected error {e}")
    else:
        expect_run_error(ones, names, "grp.m", "'grp.m' is invalid on rank 1",
                         "every tensor of the group was refused")
    if rank == 1:
        expect_run_error(ones, names[:3] + names[:1], "grp.twice", "invalid group 'grp.twice'",
                         "it names two tensors 'grp.m.0'")
    else:
        expect_run_error(ones, names, "grp.twice", "'grp.twice' is invalid on rank 1",
                         "names two tensors 'grp.m.0'")
    # Alike tensors fuse however the group interleaves them: two collectives here (float32,
    # int64), or one per tensor without fusion.
    mixed = [np.ones(1000, np.float32), np.ones(10, np.int64), np.ones(5, np.float32)]
    before = _engine.stats()["collectives"]
    got = _engine.run(_engine.ALLREDUCE, mixed, ["grp.x.0", "grp.x.1", "grp.x.2"],
                      op=OPS["Sum"], group="grp.x")
    for i, (x, out) in enumerate(zip(mixed, got)):
        check(f"grp.x.{i}", out, x * size, exact=True)
        if out.dtype != x.dtype:
            fail(f"grp.x.{i}: dtype {out.dtype}, expected {x.dtype}")
    fusing = _engine.parameters()["fusion_threshold"] > 0
    if _engine.stats()["collectives"] - before != (2 if fusing else 3):
        fail(f"group of float32, int64, float32 ran as "
             f"{_engine.stats()['collectives'] - before} collectives")
    # Only allreduces form groups.
    try:
        _engine.run(_engine.BROADCAST, ones, names, group="grp.bc")
        fail("a group of broadcasts did not raise")
    except ValueError as e:
        if "a group holds allreduces" not in str(e):
            fail(f"a group of broadcasts: unexpected error {e}")
    # The group works again, and a one-tensor "group" is a lone tensor.
    got = _engine.run(_engine.ALLREDUCE, ones, names, op=OPS["Sum"], group="grp.m")
    for name, out in zip(names, got):
        check(name, out, np.full(3, size), exact=True)
    got = _engine.run(_engine.ALLREDUCE, ones[:1], ["grp.one"], op=OPS["Sum"], group="grp.one")
    check("grp.one", got[0], np.full(3, size), exact=True)


def test_threads(rank, size):
    """Several Python threads wait (and so drive the engine) at once. Each thread runs its
    collectives one after another in the same order on every rank (it waits for each before
    submitting the next); the threads interleave differently on each rank."""
    results, errors = {}, []

    def worker(t):
        try:
            order = list(range(30))
            random.Random(t).shuffle(order)
            for i in order:
                name = f"thr.{t}.{i}"
                x = np.full(1 + i * 11, float(rank + t + i), np.float32)
                if i % 2:
                    results[name] = _engine.run(_engine.ALLREDUCE, [x], [name], op=OPS["Sum"])[0]
                else:
                    results[name] = submit(_engine.ALLREDUCE, x, name, op=OPS["Sum"]).wait()
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        if th.is_alive():
            fail("a waiting thread did not finish")
    if errors:
        fail(f"a thread failed: {errors[0]}")
    for t in range(3):
        for i in range(30):
            want = np.full(1 + i * 11, sum(float(r + t + i) for r in range(size)))
            check(f"thr.{t}.{i}", results[f"thr.{t}.{i}"], want, exact=True)


def test_late_rank_after_stall(rank, size):
    """Rank 1 submits "late" only after the others' request of that name has failed by the
    stall shutdown, as they submit it again: rank 1's request is a new one, which must pair
    with their retry, though the stall's error reaches rank 1 after it was made. (It used to
    fail there with that error while the coordinator kept it waiting, so the name's next
    requests paired with the wrong ones: "scheduled tensor 'late', which this rank has not
    submitted", or, run with different buffers, "Message truncated".)"""
    saved = {k: os.environ.get(k)
             for k in ("KERAS_RING_STALL_CHECK_TIME", "KERAS_RING_STALL_SHUTDOWN_TIME")}
    kr.shutdown()
    kr.init(stall_check_time=0, stall_shutdown_time=1)
    try:
        # A moment shared by the ranks (one host's clock): the retry and the late request go
        # then, a second after the stall shutdown time has passed.
        start = submit(_engine.ALLREDUCE, np.array([time.time()]), "late.clock",
                       op=OPS["Max"]).wait()[0]
        then = start + 2.0
        x = np.full(8, rank + 1, np.float32)
        h = None
        if rank != 1:
            try:
                submit(_engine.ALLREDUCE, x, "late", op=OPS["Sum"]).wait()
                # Rank 1's request came first (a very busy machine): nothing to test.
                print(f"rank {rank}: test_late_rank_after_stall: rank 1 was not late", flush=True)
            except RuntimeError as e:
                if "stalled" not in str(e) or "'late'" not in str(e):
                    fail(f"late: unexpected error {e}")
                time.sleep(max(0.0, then - time.time()))
                h = submit(_engine.ALLREDUCE, x, "late", op=OPS["Sum"])
        else:
            time.sleep(max(0.0, then - time.time()))
            h = submit(_engine.ALLREDUCE, x, "late", op=OPS["Sum"])
        if h is not None:
            try:
                got = h.wait()
            except RuntimeError as e:
                fail(f"late: a request made after the stall failed: {e}")
            check("late", got, np.full(8, size * (size + 1) / 2), exact=True)
        # The name's next requests pair with each other (544 bytes where the stalled had 32).
        y = np.full(136, rank + 1, np.float32)
        got = submit(_engine.ALLREDUCE, y, "late", op=OPS["Sum"]).wait()
        check("late again", got, np.full(136, size * (size + 1) / 2), exact=True)
    finally:
        kr.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        kr.init()


def test_restart(rank, size):
    # A request no other rank submits is pending when shutdown() is called: it fails, naming
    # this rank's shutdown or the rank whose shutdown came first.
    orphan = submit(_engine.ALLREDUCE, np.ones(2, np.float32), f"orphan.{rank}", op=OPS["Sum"])
    kr.shutdown()
    try:
        orphan.wait()
        fail("a request pending at shutdown() completed")
    except RuntimeError as e:
        reasons = ("shutdown() was called while this operation was pending",
                   "shut down (shutdown() or its process exiting)")
        if not any(reason in str(e) for reason in reasons):
            fail(f"pending at shutdown: unexpected error {e}")
        if f"'orphan.{rank}'" not in str(e):
            fail(f"pending at shutdown: the error does not name the tensor: {e}")
    if kr.is_initialized():
        fail("still initialised after shutdown()")
    expect_error(submit(_engine.ALLREDUCE, np.ones(2, np.float32), "x", op=1), RuntimeError,
                 "not initialised")
    kr.init()
    got = submit(_engine.ALLREDUCE, np.ones(2, np.float32), "restart", op=OPS["Sum"]).wait()
    check("restart", got, np.full(2, size), exact=True)


def main():
    kr.init()
    rank, size = kr.rank(), kr.size()
    expected = int(os.environ.get("KR_TEST_EXPECTED_SIZE", size))
    if size != expected:
        fail(f"size {size}, expected {expected}")
    for test in (test_allreduce, test_allgather, test_reducescatter, test_alltoall,
                 test_broadcast, test_out_of_order, test_fusion, test_compression, test_transport,
                 test_objects, test_mismatch, test_duplicate_name, test_cache, test_join,
                 test_run, test_prepared_run, test_groups, test_threads,
                 test_late_rank_after_stall, test_restart):
        test(rank, size)
        print(f"rank {rank}: {test.__name__} ok", flush=True)


if __name__ == "__main__":
    main()
