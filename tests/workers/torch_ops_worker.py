"""Multi-rank checks of keras_ring.torch's collectives against NumPy references.

Run with 2 or 3 ranks under the launcher: `keras-ring-run -np 3 python
tests/workers/torch_ops_worker.py`. Each collective runs in every form a
Horovod script calls it: directly, through the torch operator (as autograd
and `torch.compile` reach it), started with `_async` and synchronized, and in
place where Horovod has an in-place form. Wrong values are collected and
reported at the end (exit 1); an unexpected exception exits at once.
"""

import sys
from unittest import mock

import numpy as np
import torch
from references import (
    BFLOAT16,
    BIG,
    MOVED_DTYPES,
    OP_NAMES,
    POSTSCALE,
    PRESCALE,
    REDUCED_DTYPES,
    SIZES,
    Checker,
    alltoall_reference,
    alltoall_splits,
    inputs,
    reduce_reference,
    scatter_reference,
)

import keras_ring.torch as hvd

torch.set_num_threads(1)  # up to 3 ranks share 2 cores
OPS = {name: getattr(hvd, name) for name in OP_NAMES}
BIG_DTYPES = (np.dtype("float32"),)

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
check = Checker(RANK)


def to_torch(array):
    array = np.ascontiguousarray(array)
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def to_numpy(tensor):
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def operator():
    """Calls made inside it go through the torch operator, as under torch.compile."""
    return mock.patch.object(torch.compiler, "is_compiling", lambda: True)


def forms(fn, fn_async=None, fn_in_place=None):
    """(form, fn(tensor) -> result) for each way a collective is called."""
    out = [("direct", fn)]

    def through_operator(t):
        with operator():
            return fn(t)

    out.append(("operator", through_operator))
    if fn_async is not None:
        out.append(("async", lambda t: hvd.synchronize(fn_async(t))))
    if fn_in_place is not None:
        def in_place(t):
            t = t.clone()
            result = fn_in_place(t)
            if result is not t:
                check.failures.append(f"rank {RANK}: an in-place form returned another tensor")
            return t

        out.append(("in-place", in_place))
    return out


def check_allreduce():
    for dtype in REDUCED_DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                pre, post = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                sizes = SIZES + ([BIG] if dtype in BIG_DTYPES and not scaled else [])
                case = f"allreduce/{op_name}/{scaled}"
                kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                for n in sizes:
                    xs = [inputs(r, n, dtype, case, scaled) for r in range(SIZE)]
                    expected = reduce_reference(xs, dtype, op_name, pre, post)
                    for form, fn in forms(lambda t: hvd.allreduce(t, **kw),
                                          lambda t: hvd.allreduce_async(t, **kw),
                                          lambda t: hvd.allreduce_(t, **kw)):
                        check(f"{case} {dtype.name} n={n} {form}",
                              to_numpy(fn(to_torch(xs[RANK]))), expected, dtype)


def check_grouped_allreduce():
    for op_name, op in OPS.items():
        case = f"grouped/{op_name}"
        shapes = [(SIZES[i % len(SIZES)], 2) for i in range(len(REDUCED_DTYPES))]
        every = [[inputs(r, s, d, case, False) for r in range(SIZE)]
                 for s, d in zip(shapes, REDUCED_DTYPES)]
        kw = dict(op=op, name=f"g.{op_name}")

        def in_place(ts):
            ts = [t.clone() for t in ts]
            hvd.grouped_allreduce_(ts, **kw)
            return ts

        for form, fn in forms(lambda ts: hvd.grouped_allreduce(ts, **kw),
                              lambda ts: hvd.grouped_allreduce_async(ts, **kw)) + [
                ("in-place", in_place)]:
            outputs = fn([to_torch(xs[RANK]) for xs in every])
            for dtype, xs, out in zip(REDUCED_DTYPES, every, outputs):
                check(f"{case} {dtype.name} {form}", to_numpy(out),
                      reduce_reference(xs, dtype, op_name, 1.0, 1.0), dtype)


def check_allgather():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        for n in SIZES + ([BIG // 4 // SIZE] if dtype in BIG_DTYPES else []):
            for pattern, rows in (("one-empty", [0 if r == 1 else n + r for r in range(SIZE)]),
                                  ("distinct", [n + r for r in range(SIZE)])):
                case = f"allgather/{n}/{pattern}"
                xs = [inputs(r, (rows[r], 4), dtype, case, False) for r in range(SIZE)]
                for form, fn in forms(hvd.allgather, hvd.allgather_async):
                    check(f"{case} {dtype.name} {form}", to_numpy(fn(to_torch(xs[RANK]))),
                          np.concatenate(xs), dtype)
    dtypes = REDUCED_DTYPES + MOVED_DTYPES
    every = [[inputs(r, ((i + r) % 3, 2), d, "grouped_ag", False) for r in range(SIZE)]
             for i, d in enumerate(dtypes)]
    for form, fn in forms(hvd.grouped_allgather, hvd.grouped_allgather_async):
        outputs = fn([to_torch(xs[RANK]) for xs in every])
        for dtype, xs, out in zip(dtypes, every, outputs):
            check(f"grouped_allgather {dtype.name} {form}", to_numpy(out), np.concatenate(xs),
                  dtype)


def check_broadcast():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        for n in SIZES + ([BIG] if dtype in BIG_DTYPES else []):
            xs = [inputs(r, n, dtype, "broadcast", False) for r in range(SIZE)]
            for root in range(SIZE):
                for form, fn in forms(lambda t: hvd.broadcast(t, root),
                                      lambda t: hvd.broadcast_async(t, root),
                                      lambda t: hvd.broadcast_(t, root)):
                    check(f"broadcast root={root} {dtype.name} n={n} {form}",
                          to_numpy(fn(to_torch(xs[RANK]))), xs[root], dtype)


def check_reducescatter():
    shapes = [(n, 3) for n in (0, 1, SIZE, 2 * SIZE + 1, 1001)] + [(2 * SIZE + 1, 2, 2)]
    for dtype in REDUCED_DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                pre, post = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                case = f"reducescatter/{op_name}/{scaled}"
                big = [(BIG // 4, 4)] if dtype in BIG_DTYPES and op_name == "Sum" else []
                kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                for shape in shapes + big:
                    xs = [inputs(r, shape, dtype, case, scaled) for r in range(SIZE)]
                    expected = scatter_reference(xs, dtype, op_name, pre, post, RANK)
                    for form, fn in forms(lambda t: hvd.reducescatter(t, **kw),
                                          lambda t: hvd.reducescatter_async(t, **kw)):
                        check(f"{case} {dtype.name} {shape} {form}",
                              to_numpy(fn(to_torch(xs[RANK]))), expected, dtype)
    every = [[inputs(r, ((i % 3) * SIZE + 1, 2), d, "grouped_rs", False) for r in range(SIZE)]
             for i, d in enumerate(REDUCED_DTYPES)]
    for form, fn in forms(lambda ts: hvd.grouped_reducescatter(ts, op=hvd.Sum),
                          lambda ts: hvd.grouped_reducescatter_async(ts, op=hvd.Sum)):
        outputs = fn([to_torch(xs[RANK]) for xs in every])
        for dtype, xs, out in zip(REDUCED_DTYPES, every, outputs):
            check(f"grouped_reducescatter {dtype.name} {form}", to_numpy(out),
                  scatter_reference(xs, dtype, "Sum", 1.0, 1.0, RANK), dtype)


def check_alltoall():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        for case in ("even", "uneven", "zeros", "one-sender", "none"):
            def rows(r):
                splits = alltoall_splits(r, SIZE, case)
                return 3 * SIZE if splits is None else sum(splits)

            xs = [inputs(r, (rows(r), 2), dtype, f"alltoall/{case}", False) for r in range(SIZE)]
            expected, received = alltoall_reference(xs, case, RANK)
            splits = alltoall_splits(RANK, SIZE, case)
            given = None if splits is None else torch.tensor(splits, dtype=torch.int32)
            for form, fn in forms(lambda t: hvd.alltoall(t, splits=given),
                                  lambda t: hvd.alltoall_async(t, splits=given)):
                result = fn(to_torch(xs[RANK]))
                what = f"alltoall/{case} {dtype.name} {form}"
                if given is None:
                    check(what, to_numpy(result), expected, dtype)
                    continue
                check(what, to_numpy(result[0]), expected, dtype)
                check(f"{what} received splits", to_numpy(result[1]), received, np.int32)


def gradient(fn, x, upstream):
    """d sum(fn(x) * upstream) / dx on this rank."""
    x = to_torch(x).requires_grad_()
    (fn(x) * to_torch(upstream)).sum().backward()
    return to_numpy(x.grad)


def check_gradients():
    f32 = np.dtype("float32")
    x = inputs(RANK, (4, 3), f32, "grad/x", True)
    ws = [inputs(r, (4, 3), f32, "grad/w", True) for r in range(SIZE)]
    w, total = ws[RANK], np.sum(ws, axis=0)
    check("grad allreduce Sum scaled",
          gradient(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0,
                                           postscale_factor=3.0), x, w), total * 6, f32)
    check("grad allreduce Average", gradient(hvd.allreduce, x, w), total / SIZE, f32)
    check("grad grouped_allreduce",
          gradient(lambda t: hvd.grouped_allreduce([t, t.double(), torch.arange(3)])[0], x, w),
          total / SIZE, f32)
    for root in range(SIZE):
        expected = total if RANK == root else np.zeros_like(total)
        check(f"grad broadcast root={root}", gradient(lambda t: hvd.broadcast(t, root), x, w),
              expected, f32)
    # allgather, uneven rows: a rank's gradient is the sum of every rank's for its rows.
    rows = [0 if r == 1 else r + 2 for r in range(SIZE)]
    offsets = np.cumsum([0] + rows)
    xg = inputs(RANK, (rows[RANK], 3), f32, "grad/xg", True)
    gws = [inputs(r, (sum(rows), 3), f32, "grad/gw", True) for r in range(SIZE)]
    own = np.sum(gws, axis=0)[offsets[RANK]:offsets[RANK + 1]]
    check("grad allgather", gradient(hvd.allgather, xg, gws[RANK]), own, f32)
    check("grad grouped_allgather",
          gradient(lambda t: hvd.grouped_allgather([t, t * 2])[1], xg, gws[RANK]), own * 2, f32)
    # reducescatter: the gathered output gradients, times the map's factor.
    rows = 2 * SIZE + 1
    xr = inputs(RANK, (rows, 3), f32, "grad/xr", True)
    bounds = np.cumsum([0] + [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)])
    ups = [inputs(r, (bounds[r + 1] - bounds[r], 3), f32, "grad/up", True) for r in range(SIZE)]
    check("grad reducescatter Average", gradient(hvd.reducescatter, xr, ups[RANK]),
          np.concatenate(ups) / SIZE, f32)
    # alltoall, uneven: each row's gradient goes back to the rank it came from.
    splits = alltoall_splits(RANK, SIZE, "uneven")
    xs = [inputs(r, (sum(alltoall_splits(r, SIZE, "uneven")), 3), f32, "grad/xs", True)
          for r in range(SIZE)]
    ups = [inputs(r, (sum(alltoall_splits(q, SIZE, "uneven")[r] for q in range(SIZE)), 3), f32,
                  "grad/ups", True) for r in range(SIZE)]
    expected = np.concatenate([
        ups[q][sum(alltoall_splits(p, SIZE, "uneven")[q] for p in range(RANK)):][
            :alltoall_splits(RANK, SIZE, "uneven")[q]]
        for q in range(SIZE)
    ])
    check("grad alltoall uneven",
          gradient(lambda t: hvd.alltoall(t, splits=splits)[0], xs[RANK], ups[RANK]),
          expected, f32)


def check_compiled():
    """A function compiled whole (fullgraph) with collectives inside runs them."""
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + RANK
    every = [np.arange(6, dtype=np.float32).reshape(3, 2) + r for r in range(SIZE)]

    @torch.compile(fullgraph=True)
    def step(t):
        total = hvd.allreduce(t * 2, op=hvd.Sum, name="compiled.sum")
        gathered = hvd.allgather(t, name="compiled.gather")
        return total + 1, gathered.sum(dim=0)

    total, column_sums = step(x)
    check("compiled allreduce", to_numpy(total), np.sum(every, axis=0) * 2 + 1, np.float32)
    check("compiled allgather", to_numpy(column_sums),
          np.concatenate(every).sum(axis=0), np.float32)


def check_compression():
    f32 = np.dtype("float32")
    xs = [inputs(r, 9, f32, "compression", True) for r in range(SIZE)]
    expected = reduce_reference(xs, f32, "Sum", 1.0, 1.0)
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            got = hvd.allreduce(to_torch(xs[RANK]).to(dtype), op=hvd.Sum, compression=compression)
            if got.dtype != dtype:
                check.failures.append(f"rank {RANK}: compression changed {dtype} to {got.dtype}")
            check(f"compression {compression.__name__} {dtype}", to_numpy(got.float()),
                  expected, f32)
    # Horovod's compressors called by a script itself, on torch tensors.
    for compression, wire in ((hvd.Compression.fp16, torch.float16),
                              (hvd.Compression.bf16, torch.bfloat16)):
        for dtype in (torch.float32, torch.float64, torch.int32):
            sent, ctx = compression.compress(torch.ones(3, dtype=dtype))
            back = compression.decompress(sent, ctx)
            if (sent.dtype, back.dtype) != ((wire if dtype.is_floating_point else dtype), dtype):
                check.failures.append(f"rank {RANK}: {compression.__name__}.compress of {dtype} "
                                      f"sent {sent.dtype}, gave back {back.dtype}")


def check_process_set():
    members = [0, SIZE - 1]
    subset = hvd.add_process_set(members)
    if subset.included():
        x = torch.arange(4, dtype=torch.float32) + RANK
        expected = sum(np.arange(4, dtype=np.float32) + r for r in members)
        check("process set allreduce", to_numpy(hvd.allreduce(x, op=hvd.Sum, process_set=subset)),
              expected, np.float32)
        h = hvd.allreduce_async(x, op=hvd.Sum, process_set=subset)
        check("process set allreduce_async", to_numpy(hvd.synchronize(h)), expected, np.float32)
        check("process set allgather",
              to_numpy(hvd.allgather(torch.full((1, 2), RANK, dtype=torch.int32),
                                     process_set=subset)),
              np.array([[r, r] for r in members], np.int32), np.int32)
        root = members[-1]
        check("process set broadcast",
              to_numpy(hvd.broadcast(torch.full((3,), RANK, dtype=torch.int32), root,
                                     process_set=subset)),
              np.full(3, root, np.int32), np.int32)
    hvd.remove_process_set(subset)


def check_handles_and_join():
    handles = [hvd.allreduce_async(torch.full((5,), float(i + RANK)), op=hvd.Sum, name=f"h{i}")
               for i in range(20)]
    for i, h in reversed(list(enumerate(handles))):  # synchronized in another order
        check(f"handle {i}", to_numpy(hvd.synchronize(h)),
              np.full(5, sum(i + r for r in range(SIZE)), np.float32), np.float32)
    # A name in flight given again: refused at the call, while the first goes on (rank 1
    # submits its part only after rank 0 has tried twice).
    if RANK != 1:
        first = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice")
        try:
            hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice")
        except ValueError as e:
            if "'twice'" not in str(e) or "in flight" not in str(e):
                check.failures.append(f"rank {RANK}: unclear error for a name in flight: {e}")
        else:
            check.failures.append(f"rank {RANK}: a name in flight given again was not refused")
    hvd.barrier()
    if RANK == 1:
        first = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice")
    check("the first of a name given twice", to_numpy(hvd.synchronize(first)),
          np.full(2, SIZE, np.float32), np.float32)
    try:
        hvd.synchronize(handles[0])
    except ValueError as e:
        if "not the handle" not in str(e):
            check.failures.append(f"rank {RANK}: unclear error for a used handle: {e}")
    else:
        check.failures.append(f"rank {RANK}: a handle synchronized twice did not fail")
    # Rank 0 has one batch more: its allreduce goes on with zeros from the joined ranks.
    if RANK == 0:
        check("allreduce with joined ranks",
              to_numpy(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after.join")),
              np.ones(3, np.float32), np.float32)
    last = hvd.join()
    if last != 0:
        check.failures.append(f"rank {RANK}: join() returned {last}, expected 0")
    hvd.barrier()
    objects = hvd.allgather_object({"rank": RANK})
    if objects != [{"rank": r} for r in range(SIZE)]:
        check.failures.append(f"rank {RANK}: allgather_object gave {objects}")


def check_errors():
    """Bad input fails on every rank, naming the tensor and what each rank sent."""
    try:
        hvd.allreduce(torch.ones(3 + RANK), name="mismatched")
    except RuntimeError as e:
        if "'mismatched'" not in str(e) or "rank 1" not in str(e):
            check.failures.append(f"rank {RANK}: unclear mismatch error: {e}")
    else:
        check.failures.append(f"rank {RANK}: a shape mismatch did not fail")
    try:
        hvd.synchronize(hvd.allreduce_async(torch.ones(2, dtype=torch.float64 if RANK else
                                                       torch.float32), name="dtypes"))
    except RuntimeError as e:
        if "'dtypes'" not in str(e):
            check.failures.append(f"rank {RANK}: unclear dtype mismatch error: {e}")
    else:
        check.failures.append(f"rank {RANK}: a dtype mismatch did not fail")
    for bad, words in (
            (lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), "does not support dtype bool"),
            (lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)), "complex64"),
            (lambda: hvd.allgather(torch.tensor(1.0)), "scalar"),
            (lambda: hvd.allreduce([1.0]), "takes a torch.Tensor"),
            (lambda: hvd.allreduce(torch.ones(2).to_sparse()), "dense"),
            (lambda: hvd.allreduce_(torch.ones(4, 2).t()), "contiguous"),
            (lambda: hvd.alltoall(torch.ones(4), splits=[1, 1, 1, 1, 1]), "splits"),
            (lambda: hvd.allreduce(torch.ones(2, requires_grad=True), op=hvd.Max).sum().backward(),
             "No gradient")):
        try:
            bad()
        except (TypeError, ValueError, LookupError) as e:
            if words not in str(e):
                check.failures.append(f"rank {RANK}: unclear error {e!r}, wanted {words!r}")
        else:
            check.failures.append(f"rank {RANK}: no error for {words!r}")


for section in (check_allreduce, check_grouped_allreduce, check_allgather, check_broadcast,
                check_reducescatter, check_alltoall, check_gradients, check_compiled,
                check_compression, check_process_set, check_handles_and_join, check_errors):
    section()

hvd.shutdown()
if check.failures:
    print("\n".join(check.failures[:40]), file=sys.stderr)
    print(f"rank {RANK}: {len(check.failures)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {RANK}: torch ops ok")
