"""Multi-rank checks of the TensorFlow collectives against NumPy references.

Run with 2 or 3 ranks, under the test launcher or plainly:
`mpiexec -n 3 python tests/workers/tf_ops_worker.py`.

Every rank regenerates every rank's inputs (seeded by rank and case), so each
computes the expected results itself. Wrong values are collected and reported
at the end (exit 1); an unexpected exception exits at once, and the launcher
then stops the other ranks, which would otherwise wait for this one.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import functools
import sys
import threading
import time
import traceback

import numpy as np
import references
import tensorflow as tf
from references import BIG, POSTSCALE, PRESCALE, SIZES

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
# Tracing in loops is deliberate here; TF's retracing warnings are noise.
tf.get_logger().setLevel("ERROR")

import keras_ring as kr  # noqa: E402
from keras_ring.tensorflow import _ops  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64]
# Moved unchanged by allgather, broadcast and alltoall; not reduced.
MOVED_DTYPES = [tf.int16, tf.uint16, tf.bool]
OPS = {"Average": kr.Average, "Sum": kr.Sum, "Min": kr.Min, "Max": kr.Max, "Product": kr.Product}
BIG_DTYPES = (tf.float32, tf.int32)
BIG_MOVED_DTYPES = (tf.float32, tf.int16, tf.bool)  # the collectives that move bytes
MODES = ("eager", "function")

RANK = SIZE = None
failures = []
checker = references.Checker(None)
checker.failures = failures  # one list for the checks here and those of the references


def _numpy(dtype):
    return np.dtype(dtype.as_numpy_dtype)


# The NumPy references (tests/workers/references.py) on TensorFlow's dtypes.
def inputs(rank, shape, dtype, case, small):
    return references.inputs(rank, shape, _numpy(dtype), case, small)


def reduce_reference(xs, dtype, op, prescale, postscale):
    return references.reduce_reference(xs, _numpy(dtype), op, prescale, postscale)


def check(what, actual, expected, dtype):
    checker(what, actual, expected, _numpy(dtype))


def run(mode, fn, *args):
    """Calls fn eagerly, or as a tf.function (so all its collectives run concurrently)."""
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


def run_each(mode, fn, args):
    """fn over each arg: one call per arg eagerly, one call for all in a tf.function."""
    if mode == "eager":
        return [fn(a) for a in args]
    return tf.function(lambda *xs: [fn(x) for x in xs])(*args)


def check_allreduce():
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                # Big tensors are slow to reference: a subset suffices.
                sizes = SIZES + ([BIG] if dtype in BIG_DTYPES and not scaled else [])
                case = f"allreduce/{op_name}/{scaled}"
                all_inputs = [
                    [inputs(r, n, dtype, case, scaled) for r in range(SIZE)] for n in sizes
                ]
                expected = [
                    reduce_reference(xs, dtype, op_name, prescale, postscale) for xs in all_inputs
                ]
                mine = [tf.constant(xs[RANK]) for xs in all_inputs]
                allreduce = functools.partial(
                    kr.allreduce, op=op, prescale_factor=prescale, postscale_factor=postscale
                )
                for mode in MODES:
                    outputs = run_each(mode, allreduce, mine)
                    for n, out, exp in zip(sizes, outputs, expected):
                        check(f"{case} {dtype.name} n={n} {mode}", out, exp, dtype)


def check_grouped_allreduce():
    for op_name, op in OPS.items():
        for scaled in (False, True):
            prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
            case = f"grouped/{op_name}/{scaled}"
            shapes = [(SIZES[i % len(SIZES)], 2) for i in range(len(DTYPES))]
            all_inputs = [
                [inputs(r, s, d, case, scaled) for r in range(SIZE)] for s, d in zip(shapes, DTYPES)
            ]
            mine = [tf.constant(xs[RANK]) for xs in all_inputs]
            grouped_allreduce = functools.partial(
                kr.grouped_allreduce,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                name=f"grouped.{op_name}.{scaled}",
            )
            for mode in MODES:
                outputs = run(mode, grouped_allreduce, mine)
                for dtype, xs, out in zip(DTYPES, all_inputs, outputs):
                    expected = reduce_reference(xs, dtype, op_name, prescale, postscale)
                    check(f"{case} {dtype.name} {mode}", out, expected, dtype)


def check_allgather():
    for dtype in DTYPES + MOVED_DTYPES:
        sizes = SIZES + ([BIG // 4 // SIZE] if dtype in BIG_MOVED_DTYPES else [])
        for n in sizes:
            # Rows differ per rank; rank 1 has none in the first pattern.
            for pattern, rows in (
                ("one-empty", [0 if r == 1 else n + r for r in range(SIZE)]),
                ("distinct", [n + r for r in range(SIZE)]),
            ):
                case = f"allgather/{n}/{pattern}"
                xs = [inputs(r, (rows[r], 4), dtype, case, False) for r in range(SIZE)]
                expected = np.concatenate(xs, axis=0)
                for mode in MODES:
                    out = run(mode, kr.allgather, tf.constant(xs[RANK]))
                    check(f"{case} {dtype.name} {mode}", out, expected, dtype)


def check_broadcast():
    for dtype in DTYPES + MOVED_DTYPES:
        sizes = SIZES + ([BIG] if dtype in BIG_DTYPES + BIG_MOVED_DTYPES else [])
        all_inputs = [[inputs(r, n, dtype, "broadcast", False) for r in range(SIZE)] for n in sizes]
        for root in range(SIZE):
            mine = [tf.constant(xs[RANK]) for xs in all_inputs]
            for mode in MODES:
                outputs = run_each(mode, functools.partial(kr.broadcast, root_rank=root), mine)
                for n, out, xs in zip(sizes, outputs, all_inputs):
                    check(f"broadcast root={root} {dtype.name} n={n} {mode}", out, xs[root], dtype)


def split_bounds(rows):
    return references.split_bounds(rows, SIZE)


def scatter_reference(xs, dtype, op, prescale, postscale):
    return references.scatter_reference(xs, _numpy(dtype), op, prescale, postscale, RANK)


def check_reducescatter():
    # Rows: none, fewer than the ranks, one each, and two uneven splits.
    rows = [0, 1, SIZE, 2 * SIZE + 1, 1001]
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                case = f"reducescatter/{op_name}/{scaled}"
                shapes = [(n, 3) for n in rows] + [(2 * SIZE + 1, 2, 2)]
                if dtype in BIG_DTYPES and op_name == "Sum" and not scaled:
                    shapes.append((BIG // 4, 4))
                all_inputs = [
                    [inputs(r, s, dtype, case, scaled) for r in range(SIZE)] for s in shapes
                ]
                expected = [
                    scatter_reference(xs, dtype, op_name, prescale, postscale) for xs in all_inputs
                ]
                mine = [tf.constant(xs[RANK]) for xs in all_inputs]
                reducescatter = functools.partial(
                    kr.reducescatter, op=op, prescale_factor=prescale, postscale_factor=postscale
                )
                for mode in MODES:
                    outputs = run_each(mode, reducescatter, mine)
                    for shape, out, exp in zip(shapes, outputs, expected):
                        check(f"{case} {dtype.name} {shape} {mode}", out, exp, dtype)


def check_grouped_reducescatter():
    for op_name, op in OPS.items():
        for scaled in (False, True):
            prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
            case = f"grouped_rs/{op_name}/{scaled}"
            first = [0, 1, SIZE, 2 * SIZE + 1, 7]
            shapes = [(first[i % len(first)], 2) for i in range(len(DTYPES))]
            all_inputs = [
                [inputs(r, s, d, case, scaled) for r in range(SIZE)] for s, d in zip(shapes, DTYPES)
            ]
            mine = [tf.constant(xs[RANK]) for xs in all_inputs]
            grouped = functools.partial(
                kr.grouped_reducescatter,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                name=f"grouped_rs.{op_name}.{scaled}",
            )
            for mode in MODES:
                outputs = run(mode, grouped, mine)
                for dtype, xs, out in zip(DTYPES, all_inputs, outputs):
                    expected = scatter_reference(xs, dtype, op_name, prescale, postscale)
                    check(f"{case} {dtype.name} {mode}", out, expected, dtype)


def check_grouped_allgather():
    # Tensor i has (i + r) % 3 rows on rank r, or none on rank 1 for odd i.
    def rows(i, r):
        return 0 if (i % 2 and r == 1) else (i + r) % 3

    shapes = [lambda n: (n, 2), lambda n: (n,), lambda n: (n, 1, 3)]
    all_inputs = [
        [
            inputs(r, shapes[i % 3](rows(i, r)), dtype, "grouped_ag", False)
            for r in range(SIZE)
        ]
        for i, dtype in enumerate(DTYPES + MOVED_DTYPES)
    ]
    mine = [tf.constant(xs[RANK]) for xs in all_inputs]
    for mode in MODES:
        outputs = run(mode, functools.partial(kr.grouped_allgather, name="grouped_ag"), mine)
        for dtype, xs, out in zip(DTYPES + MOVED_DTYPES, all_inputs, outputs):
            check(f"grouped_allgather {dtype.name} {mode}", out, np.concatenate(xs), dtype)


def alltoall_splits(rank, case):
    return references.alltoall_splits(rank, SIZE, case)


def alltoall_reference(xs, case):
    return references.alltoall_reference(xs, case, RANK)


def check_alltoall():
    library = _ops._library()
    for dtype in DTYPES + MOVED_DTYPES:
        for case in ("even", "uneven", "zeros", "one-sender", "none"):
            def rows(r):
                splits = alltoall_splits(r, case)
                return 3 * SIZE if splits is None else sum(splits)

            inner = (2, 3) if dtype.is_floating else (2,)
            xs = [
                inputs(r, (rows(r), *inner), dtype, f"alltoall/{case}", False) for r in range(SIZE)
            ]
            expected, received = alltoall_reference(xs, case)
            x, splits = tf.constant(xs[RANK]), alltoall_splits(RANK, case)
            what = f"alltoall/{case} {dtype.name}"
            if splits is None:
                for mode in MODES:
                    check(f"{what} {mode}", run(mode, kr.alltoall, x), expected, dtype)
                # The op reports received splits for an even split too.
                out, got = library.keras_ring_alltoall(x, tf.zeros([0], tf.int32), "")
                check(f"{what} op", out, expected, dtype)
                check(f"{what} op received_splits", got, received, tf.int32)
                continue
            # Eagerly with a list; in a graph with splits known only when it runs.
            out, got = kr.alltoall(x, splits=splits)
            check(f"{what} eager", out, expected, dtype)
            check(f"{what} eager received_splits", got, received, tf.int32)
            fn = tf.function(lambda t, s: kr.alltoall(t, splits=s))
            out, got = fn(x, tf.constant(splits, tf.int64))
            check(f"{what} function", out, expected, dtype)
            check(f"{what} function received_splits", got, received, tf.int32)
    # Large blocks to every rank.
    n = BIG // 4 // SIZE
    for dtype in BIG_MOVED_DTYPES:
        xs = [inputs(r, (n * SIZE, 4), dtype, "alltoall/big", False) for r in range(SIZE)]
        expected = np.concatenate([x[RANK * n : (RANK + 1) * n] for x in xs])
        out, got = kr.alltoall(tf.constant(xs[RANK]), splits=[n] * SIZE)
        check(f"alltoall big {dtype.name}", out, expected, dtype)
        check("alltoall big received_splits", got, np.full([SIZE], n, np.int32), tf.int32)


def gradient(mode, fn, x, upstream):
    """d sum(fn(x) * upstream) / dx on this rank, eagerly or in a tf.function."""

    def compute(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x, output_gradients=upstream)

    return run(mode, compute, x)


def grouped_first(t):
    """The first output of a grouped Average of t in two dtypes."""
    return kr.grouped_allreduce([t, tf.cast(t, tf.float64)], op=kr.Average)[0]


def check_gradients():
    x = tf.constant(inputs(RANK, (4, 3), tf.float32, "grad/x", True))
    ws = [inputs(r, (4, 3), tf.float32, "grad/w", True) for r in range(SIZE)]
    w, total = tf.constant(ws[RANK]), np.sum(ws, axis=0)
    rows = [0 if r == 1 else r + 2 for r in range(SIZE)]
    offsets = np.cumsum([0] + rows)
    gx = inputs(RANK, (rows[RANK], 3), tf.float32, "grad/gx", True)
    gw = [inputs(r, (sum(rows), 3), tf.float32, "grad/gw", True) for r in range(SIZE)]
    gathered_grad = np.sum(gw, axis=0)[offsets[RANK] : offsets[RANK + 1]]
    for mode in MODES:
        def scaled(t):
            return kr.allreduce(t, op=kr.Sum, prescale_factor=2.0, postscale_factor=3.0)

        check(f"grad allreduce Sum {mode}", gradient(mode, scaled, x, w), total * 6, tf.float32)
        check(
            f"grad allreduce Average {mode}",
            gradient(mode, kr.allreduce, x, w),
            total / SIZE,
            tf.float32,
        )
        check(
            f"grad grouped_allreduce {mode}",
            gradient(mode, grouped_first, x, w),
            total / SIZE,
            tf.float32,
        )
        check(
            f"grad allgather {mode}",
            gradient(mode, kr.allgather, tf.constant(gx), tf.constant(gw[RANK])),
            gathered_grad,
            tf.float32,
        )
        for root in range(SIZE):
            expected = total if RANK == root else np.zeros_like(total)
            check(
                f"grad broadcast root={root} {mode}",
                gradient(mode, functools.partial(kr.broadcast, root_rank=root), x, w),
                expected,
                tf.float32,
            )


def check_new_gradients():
    """Gradients of reducescatter, grouped_allgather and alltoall from their definitions.

    Each rank's loss is sum(output * w) with its own w; the gradient on a rank
    is that of the sum of all ranks' losses with respect to its input.
    """
    d = 2 * SIZE + 1
    bounds = split_bounds(d)
    x = tf.constant(inputs(RANK, (d, 3), tf.float32, "grad/rs/x", True))
    ws = [
        inputs(r, (bounds[r + 1] - bounds[r], 3), tf.float32, "grad/rs/w", True)
        for r in range(SIZE)
    ]
    w, gathered = tf.constant(ws[RANK]), np.concatenate(ws)
    # Grouped allgather: rank r has rows[r] rows, rank 1 none.
    rows = [0 if r == 1 else r + 2 for r in range(SIZE)]
    offsets = np.cumsum([0] + rows)
    gx = inputs(RANK, (rows[RANK], 3), tf.float32, "grad/gx", True)
    gw = [inputs(r, (sum(rows), 3), tf.float32, "grad/gw", True) for r in range(SIZE)]
    gathered_grad = np.sum(gw, axis=0)[offsets[RANK] : offsets[RANK + 1]]
    # Alltoall: the gradient rows come back from where this rank's rows went.
    case = "uneven"
    ax = [inputs(r, (sum(alltoall_splits(r, case)), 2), tf.float32, "grad/ax", True)
          for r in range(SIZE)]
    received = [sum(alltoall_splits(i, case)[j] for i in range(SIZE)) for j in range(SIZE)]
    aw = [inputs(r, (received[r], 2), tf.float32, "grad/aw", True) for r in range(SIZE)]
    expected_a2a = []
    for j, mine in enumerate(alltoall_splits(RANK, case)):
        start = sum(alltoall_splits(i, case)[j] for i in range(RANK))
        expected_a2a.append(aw[j][start : start + mine])
    expected_a2a = np.concatenate(expected_a2a)
    ex = inputs(RANK, (3 * SIZE, 2), tf.float32, "grad/ex", True)
    ew = [inputs(r, (3 * SIZE, 2), tf.float32, "grad/ew", True) for r in range(SIZE)]
    expected_even = np.concatenate([ew[j][3 * RANK : 3 * RANK + 3] for j in range(SIZE)])

    def scaled(t):
        return kr.reducescatter(t, op=kr.Sum, prescale_factor=2.0, postscale_factor=3.0)

    def grouped_second(t):
        return kr.grouped_reducescatter(
            [tf.cast(t, tf.float64), t], op=kr.Average, postscale_factor=0.5
        )[1]

    def grouped_sum(t):
        return kr.grouped_reducescatter([t, t * 2.0], op=kr.Sum)[0]

    for mode in MODES:
        check(f"grad reducescatter Sum {mode}", gradient(mode, scaled, x, w), gathered * 6,
              tf.float32)
        check(f"grad reducescatter Average {mode}", gradient(mode, kr.reducescatter, x, w),
              gathered / SIZE, tf.float32)
        check(f"grad grouped_reducescatter {mode}", gradient(mode, grouped_second, x, w),
              gathered * 0.5 / SIZE, tf.float32)
        # Grouped and alone alike: the gradient of the sum of every rank's loss (Horovod's
        # is size() times larger for Sum).
        check(f"grad grouped_reducescatter Sum {mode}", gradient(mode, grouped_sum, x, w),
              gathered, tf.float32)
        check(f"grad reducescatter Sum unscaled {mode}",
              gradient(mode, functools.partial(kr.reducescatter, op=kr.Sum), x, w), gathered,
              tf.float32)
        for i in range(2):
            check(
                f"grad grouped_allgather output {i} {mode}",
                gradient(
                    mode,
                    lambda t, i=i: kr.grouped_allgather([t, t * 1.0])[i],
                    tf.constant(gx),
                    tf.constant(gw[RANK]),
                ),
                gathered_grad,
                tf.float32,
            )
        splits = alltoall_splits(RANK, case)
        check(
            f"grad alltoall {mode}",
            gradient(mode, lambda t: kr.alltoall(t, splits=splits)[0], tf.constant(ax[RANK]),
                     tf.constant(aw[RANK])),
            expected_a2a,
            tf.float32,
        )
        check(
            f"grad alltoall without splits {mode}",
            gradient(mode, kr.alltoall, tf.constant(ex), tf.constant(ew[RANK])),
            expected_even,
            tf.float32,
        )


def check_order():
    """Named collectives issued in opposite orders on even and odd ranks."""
    count = 6
    xs = [[inputs(r, 5, tf.float32, f"order/{k}", True) for r in range(SIZE)] for k in range(count)]
    splits = [5 // SIZE + (j < 5 % SIZE) for j in range(SIZE)]
    functions = [
        tf.function(
            lambda x, k=k: (
                kr.allreduce(x, op=kr.Sum, name=f"order.reduce.{k}"),
                kr.allgather(x, name=f"order.gather.{k}"),
                kr.reducescatter(x, op=kr.Sum, name=f"order.scatter.{k}"),
                kr.alltoall(x, splits=splits, name=f"order.alltoall.{k}")[0],
            )
        ).get_concrete_function(tf.TensorSpec([5], tf.float32))
        for k in range(count)
    ]
    results, errors = {}, []

    def issue(k):
        try:
            x = tf.constant(xs[k][RANK])
            results[k] = (
                *functions[k](x),
                kr.broadcast(x, root_rank=k % SIZE, name=f"order.eager.{k}"),
            )
        except Exception:  # noqa: BLE001 -- reported by the main thread
            errors.append(traceback.format_exc())

    order = range(count) if RANK % 2 == 0 else reversed(range(count))
    threads = []
    for k in order:
        threads.append(threading.Thread(target=issue, args=(k,)))
        threads[-1].start()
        time.sleep(0.05)  # let this thread enqueue before the next starts
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("in an ordering thread:\n" + "\n".join(errors))
    bounds = np.cumsum([0] + splits)
    for k in range(count):
        reduced, gathered, scattered, exchanged, broadcast = results[k]
        check(f"order allreduce {k}", reduced, np.sum(xs[k], axis=0), tf.float32)
        check(f"order allgather {k}", gathered, np.concatenate(xs[k]), tf.float32)
        check(f"order reducescatter {k}", scattered,
              np.sum(xs[k], axis=0)[bounds[RANK] : bounds[RANK + 1]], tf.float32)
        check(f"order alltoall {k}", exchanged,
              np.concatenate([x[bounds[RANK] : bounds[RANK + 1]] for x in xs[k]]), tf.float32)
        check(f"order broadcast {k}", broadcast, xs[k][k % SIZE], tf.float32)


def check_mismatch_errors():
    """Disagreeing ranks fail on every rank with FailedPreconditionError (Horovod's class),
    naming the tensor; later ops still work."""
    cases = {
        "mismatch.shape": lambda: kr.allreduce(tf.zeros([RANK + 1]), name="mismatch.shape"),
        "mismatch.dtype": lambda: kr.allreduce(
            tf.zeros([2], tf.float32 if RANK else tf.float64), name="mismatch.dtype"
        ),
        "mismatch.op": lambda: kr.allreduce(
            tf.zeros([2]), op=kr.Sum if RANK else kr.Max, name="mismatch.op"
        ),
        "mismatch.root": lambda: kr.broadcast(tf.zeros([2]), RANK, name="mismatch.root"),
        "mismatch.reducescatter": lambda: kr.reducescatter(
            tf.zeros([SIZE + (RANK == 1), 2]), name="mismatch.reducescatter"
        ),
        "mismatch.reducescatter.op": lambda: kr.reducescatter(
            tf.zeros([SIZE]), op=kr.Sum if RANK else kr.Min, name="mismatch.reducescatter.op"
        ),
        # Tensor 1 of the group disagrees; tensor 0 completes (the op reports the error).
        "mismatch.grouped_rs.1": lambda: kr.grouped_reducescatter(
            [tf.zeros([2]), tf.zeros([2, 1 + (RANK == 1)])], name="mismatch.grouped_rs"
        ),
        "mismatch.grouped_ag.1": lambda: kr.grouped_allgather(
            [tf.zeros([RANK]), tf.zeros([1], tf.float32 if RANK else tf.float64)],
            name="mismatch.grouped_ag",
        ),
        "mismatch.alltoall": lambda: kr.alltoall(
            tf.zeros([SIZE, 2 + (RANK == 1)]), name="mismatch.alltoall"
        ),
        "mismatch.moved": lambda: kr.allgather(
            tf.zeros([1], tf.int16 if RANK else tf.uint16), name="mismatch.moved"
        ),
        "mismatch.alltoall.fn": lambda: tf.function(
            lambda: kr.alltoall(tf.zeros([SIZE, 1], tf.int32 if RANK else tf.int64),
                                splits=[1] * SIZE, name="mismatch.alltoall.fn")
        )(),
    }
    for name, call in cases.items():
        try:
            call()
            failures.append(f"rank {RANK}: {name}: no error")
        except tf.errors.FailedPreconditionError as e:
            if f"ranks disagree on tensor '{name}'" not in e.message:
                failures.append(f"rank {RANK}: {name}: unexpected message: {e.message}")
    # A grouped allreduce is agreed as one unit: its tensor 1 disagrees, the whole op fails on
    # every rank, naming that tensor and each rank's view of it.
    for mode in MODES:
        group = f"mismatch.grouped_ar.{mode}"
        try:
            run(mode, functools.partial(kr.grouped_allreduce, name=group),
                [tf.zeros([2]), tf.zeros([3 + (RANK == 1)]), tf.zeros([4])])
            failures.append(f"rank {RANK}: {group}: no error")
        except tf.errors.FailedPreconditionError as e:
            want = (f"ranks disagree on tensor 1 of group '{group}': rank 0 sent '{group}.1', "
                    f"allreduce of float32[3]")
            if want not in e.message or "rank 1 sent" not in e.message or "[4]" not in e.message:
                failures.append(f"rank {RANK}: {group}: unexpected message: {e.message}")
    check_bad_splits()
    check(
        "allreduce after errors",
        kr.allreduce(tf.ones([3]), op=kr.Sum),
        np.full([3], SIZE, np.float32),
        tf.float32,
    )


def check_bad_splits():
    """Splits that cannot split the tensor fail on the rank that passes them, naming them.

    Every rank passes bad splits here: a rank that refuses its request alone
    would leave the others waiting for it.
    """
    x = tf.ones([5, 2])
    eager_cases = {
        f"one entry per rank ({SIZE})": [5],
        "no negative entries": [6, -1] + [0] * (SIZE - 2),
        "add up to the first dimension of `tensor`, 5": [1] * SIZE,
    }
    for match, splits in eager_cases.items():
        try:
            kr.alltoall(x, splits=splits, name="bad.splits")
            failures.append(f"rank {RANK}: splits {splits}: no error")
        except ValueError as e:
            if match not in str(e) or f"Received: splits={splits}" not in str(e):
                failures.append(f"rank {RANK}: splits {splits}: unexpected message: {e}")
    # Known only when the graph runs: the engine refuses, naming the tensor.
    fn = tf.function(
        lambda t, s: kr.alltoall(t, splits=s, name="bad.splits.fn"),
        input_signature=[tf.TensorSpec([5, 2]), tf.TensorSpec([None], tf.int32)],
    )
    graph_cases = {
        "splits must add up to the first dimension": [1] * SIZE,
        f"one split per rank ({SIZE})": [5] + [0] * SIZE,
        "splits must not be negative": [6, -1] + [0] * (SIZE - 2),
    }
    for match, splits in graph_cases.items():
        try:
            fn(x, tf.constant(splits))
            failures.append(f"rank {RANK}: graph splits {splits}: no error")
        except tf.errors.InvalidArgumentError as e:
            if "'bad.splits.fn'" not in e.message or match not in e.message:
                failures.append(f"rank {RANK}: graph splits {splits}: unexpected: {e.message}")
    # An even split needs a first dimension divisible by the number of ranks.
    try:
        kr.alltoall(tf.ones([SIZE + 1]), name="bad.even")
        failures.append(f"rank {RANK}: uneven first dimension without splits: no error")
    except ValueError as e:
        if f"divisible by the number of ranks ({SIZE})" not in str(e):
            failures.append(f"rank {RANK}: uneven without splits: unexpected message: {e}")
    even = tf.function(
        lambda t: kr.alltoall(t, name="bad.even.fn"), input_signature=[tf.TensorSpec([None])]
    )
    try:
        even(tf.ones([SIZE + 1]))
        failures.append(f"rank {RANK}: uneven first dimension without splits: no error")
    except tf.errors.InvalidArgumentError as e:
        if "'bad.even.fn'" not in e.message or "divisible" not in e.message:
            failures.append(f"rank {RANK}: uneven without splits: unexpected: {e.message}")


def check_process_sets():
    """The last two ranks as a set: every op, eager and in a tf.function, with gradients."""
    pair = kr.add_process_set([SIZE - 2, SIZE - 1])
    x = tf.constant(inputs(RANK, (5, 2), tf.float32, "ps/x", True))
    xs = {r: inputs(r, (5, 2), tf.float32, "ps/x", True) for r in range(SIZE)}
    for mode in MODES:
        if not pair.included():
            continue
        me, members = pair.rank(), pair.ranks
        got = run(mode, lambda t: kr.allreduce(t, op=kr.Sum, process_set=pair), x)
        check(f"{mode} set allreduce", got, xs[members[0]] + xs[members[1]], tf.float32)
        got = run(mode, lambda t: kr.allgather(t, process_set=pair), x)
        check(f"{mode} set allgather", got, np.concatenate([xs[r] for r in members]), tf.float32)
        got = run(mode, lambda t: kr.broadcast(t, members[1], process_set=pair), x)
        check(f"{mode} set broadcast", got, xs[members[1]], tf.float32)
        got = run(mode, lambda t: kr.reducescatter(t, op=kr.Sum, process_set=pair), x)
        total = xs[members[0]] + xs[members[1]]
        check(f"{mode} set reducescatter", got, total[:3] if me == 0 else total[3:], tf.float32)
        out, received = run(mode, lambda t: kr.alltoall(t, splits=[2, 3], process_set=pair), x)
        want = np.concatenate([xs[r][:2] if me == 0 else xs[r][2:] for r in members])
        check(f"{mode} set alltoall", out, want, tf.float32)
        check(f"{mode} set alltoall splits", received,
              np.array([2, 2] if me == 0 else [3, 3], np.int32), tf.int32)
        # Gradients run in the op's set: d sum(allreduce(x) * w) / dx = sum of the set's w.
        ws = {r: inputs(r, (5, 2), tf.float32, "ps/w", True) for r in members}
        grad = gradient(mode, lambda t: kr.allreduce(t, op=kr.Sum, process_set=pair), x,
                        tf.constant(ws[RANK]))
        check(f"{mode} set allreduce gradient", grad, ws[members[0]] + ws[members[1]],
              tf.float32)
        grad = gradient(mode, lambda t: kr.allgather(t, process_set=pair), x,
                        tf.constant(np.concatenate([ws[r] for r in members])))
        check(f"{mode} set allgather gradient", grad, 2 * ws[RANK], tf.float32)
    if pair.included():
        # Gradient reduction in the set: averaged over its two members only.
        members = pair.ranks
        v = tf.Variable(np.zeros((5, 2), np.float32))
        with tf.GradientTape() as plain:
            loss = tf.reduce_sum(v * x)
        tape = kr.DistributedGradientTape(plain, process_set=pair)
        (grad,) = tape.gradient(loss, [v])
        check("tape in a set", grad, (xs[members[0]] + xs[members[1]]) / 2, tf.float32)
        import keras

        opt = kr.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=pair)
        opt.apply([x], [v])
        check("optimizer in a set", v, -(xs[members[0]] + xs[members[1]]) / 2, tf.float32)
    # Compression: fp16 on the wire, float32 back; values that fp16 holds exactly.
    y = tf.constant(np.full(4, RANK + 0.5, np.float32))
    for compression in (kr.Compression.fp16, kr.Compression.bf16):
        got = kr.allreduce(y, op=kr.Sum, compression=compression)
        check(f"allreduce {compression.__name__}", got,
              np.full(4, sum(r + 0.5 for r in range(SIZE)), np.float32), tf.float32)
    kr.barrier()
    kr.remove_process_set(pair)


def check_horovod_names():
    """Horovod's topology ops, in-place broadcasts and object broadcast factory."""
    pair = kr.add_process_set([SIZE - 2, SIZE - 1])
    topology = tf.function(lambda: [kr.size_op(), kr.rank_op(), kr.local_size_op(),
                                    kr.local_rank_op(), kr.size_op(pair.process_set_id),
                                    kr.process_set_included_op(pair.process_set_id),
                                    kr.process_set_included_op()])
    got = [int(t) for t in topology()]
    check("topology ops", np.array(got), np.array(
        [SIZE, RANK, kr.local_size(), kr.local_rank(), 2, int(pair.included()), 1]), tf.int32)
    v = tf.Variable(np.full(3, RANK, np.float32))
    (value,) = kr.broadcast_([v], root_rank=SIZE - 1)
    check("broadcast_", v, np.full(3, SIZE - 1, np.float32), tf.float32)
    check("broadcast_ value", value, np.full(3, SIZE - 1, np.float32), tf.float32)
    # A tape on a rank outside its process set gives that rank's own gradient (Horovod's test).
    x = tf.constant(float(RANK))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    (grad,) = kr.DistributedGradientTape(tape, process_set=pair).gradient(y, [x])
    want = np.mean([2.0 * r for r in pair.ranks]) if pair.included() else 2.0 * RANK
    check("tape with a process set", grad, np.float32(want), tf.float32)
    # In a TF1-style graph (Horovod's tests): broadcast_'s values are read after its
    # assignments, and broadcast_variables returns the op that assigns.
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        a, b = (tf.Variable(np.full(3, RANK, np.float32)) for _ in range(2))
        session.run(tf.compat.v1.global_variables_initializer())
        (value,) = kr.broadcast_([a], root_rank=SIZE - 1, name="graph.broadcast_")
        check("broadcast_ in a graph", session.run(value), np.full(3, SIZE - 1, np.float32),
              tf.float32)
        session.run(kr.broadcast_variables([b], root_rank=SIZE - 1, name="graph.variables"))
        check("broadcast_variables in a graph", session.run(b),
              np.full(3, SIZE - 1, np.float32), tf.float32)
        # The broadcast's gradient: on the other ranks zeros that still run the allreduce, or
        # the root waits for them (TensorFlow folds a zeros_like of known shape to a constant).
        x = tf.constant(np.full(3, RANK + 1, np.float32))
        ws = [np.arange(3, dtype=np.float32) * (r + 1) for r in range(SIZE)]
        cases = [("broadcast gradient in a graph", SIZE - 1, kr.global_process_set, range(SIZE))]
        if pair.included():
            cases.append(("broadcast gradient in a graph, in a set", SIZE - 2, pair, pair.ranks))
        for what, root, process_set, members in cases:
            y = kr.broadcast(x, root_rank=root, name=what.replace(" ", "_").replace(",", ""),
                             process_set=process_set)
            (grad,) = tf.gradients(tf.reduce_sum(y * ws[RANK]), [x])
            expected = sum(ws[r] for r in members) if RANK == root else np.zeros(3, np.float32)
            check(what, session.run(grad), expected, tf.float32)
    if pair.included():
        w = tf.Variable(np.full(2, RANK, np.float32))
        kr.broadcast_variables([w], root_rank=SIZE - 1, process_set=pair, inplace=True)
        check("broadcast_variables in a set", w, np.full(2, SIZE - 1, np.float32), tf.float32)
        # root_rank is a rank of the job, as in Horovod (not an index within the set).
        got = kr.broadcast(tf.constant(RANK), root_rank=SIZE - 2, process_set=pair)
        check("broadcast in a set from its first member", got, np.int32(SIZE - 2), tf.int32)
        if SIZE > 2:
            try:
                kr.broadcast(tf.constant(RANK), root_rank=0, process_set=pair)
                failures.append(f"rank {RANK}: a root outside the set: no error")
            except ValueError as e:
                if f"one of the set's {pair.ranks}" not in str(e):
                    failures.append(f"rank {RANK}: a root outside the set: {e}")
    bcast = kr.broadcast_object_fn(root_rank=1, name="hvd.bcast_fn")
    for step in range(2):
        got = bcast({"step": step, "from": RANK})
        if got != {"step": step, "from": 1}:
            failures.append(f"rank {RANK}: broadcast_object_fn step {step}: {got}")
    kr.barrier()
    kr.remove_process_set(pair)


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    checker.rank = RANK
    start = time.time()
    try:
        for check_all in (
            check_allreduce,
            check_grouped_allreduce,
            check_allgather,
            check_broadcast,
            check_reducescatter,
            check_grouped_reducescatter,
            check_grouped_allgather,
            check_alltoall,
            check_gradients,
            check_new_gradients,
            check_order,
            check_mismatch_errors,
            check_process_sets,
            check_horovod_names,
        ):
            check_all()
            if RANK == 0:
                print(
                    f"tf_ops_worker: {check_all.__name__} done at {time.time() - start:.1f} s",
                    flush=True,
                )
    except Exception:  # noqa: BLE001 -- any failure must stop all ranks
        traceback.print_exc()
        print(f"tf_ops_worker: rank {RANK} failed with an exception", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    if failures:
        print("\n".join(failures[:50]), file=sys.stderr)
        print(f"tf_ops_worker: rank {RANK}: {len(failures)} mismatches", file=sys.stderr)
        sys.exit(1)
    if RANK == 0:
        print(f"tf_ops_worker: all checks passed on {SIZE} ranks in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
