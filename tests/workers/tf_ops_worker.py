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
import zlib

import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
# Tracing in loops is deliberate here; TF's retracing warnings are noise.
tf.get_logger().setLevel("ERROR")

import keras_ring as kr  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64]
OPS = {"Average": kr.Average, "Sum": kr.Sum, "Min": kr.Min, "Max": kr.Max, "Product": kr.Product}
SIZES = [0, 1, 7, 1001]
BIG = 4 * 1024 * 1024 + 3  # ~16 MiB of 4-byte elements, not divisible by 2 or 3
BIG_DTYPES = (tf.float32, tf.int32)
# Exact in float32, the type of the scale attrs.
PRESCALE, POSTSCALE = 0.5, 2.5
TOLERANCE = {tf.float16: 1e-3, tf.bfloat16: 1e-2, tf.float32: 1e-6, tf.float64: 1e-12}
MODES = ("eager", "function")

RANK = SIZE = None
failures = []


def inputs(rank, shape, dtype, case, small):
    """Rank `rank`'s input for `case`, identical on every rank that asks.

    Integers span their whole range (to exercise wrap-around) unless `small`;
    floats and small integers are integer-valued and small, so sums, products
    and extrema are exact in every dtype, and scaled integers stay in range.
    """
    rng = np.random.default_rng([zlib.crc32(f"{case}/{dtype.name}".encode()), rank])
    np_dtype = dtype.as_numpy_dtype
    if dtype.is_integer and not small:
        return rng.integers(dtype.min, dtype.max, size=shape, dtype=np_dtype, endpoint=True)
    low = 0 if dtype.is_unsigned else (-3 if "Product" in case else -8)
    high = 3 if "Product" in case else 8
    return rng.integers(low, high, size=shape, endpoint=True).astype(np_dtype)


def saturate(values, dtype):
    """float64 -> integer dtype as the engine converts: truncated, saturated, NaN to 0."""
    info = np.iinfo(dtype.as_numpy_dtype)
    above = float(info.max) + 1.0  # a power of two, exact
    out = np.full(values.shape, info.min, dtype=dtype.as_numpy_dtype)
    inside = (values < above) & (values > float(info.min) - 1.0)
    out[inside] = np.trunc(values[inside]).astype(dtype.as_numpy_dtype)
    out[values >= above] = info.max
    out[np.isnan(values)] = 0
    return out


def scale(x, factor, dtype):
    """The engine's scaling: in float64 (float32 for half types)."""
    if factor == 1.0:
        return x
    if dtype.is_integer:
        return saturate(x.astype(np.float64) * factor, dtype)
    if dtype in (tf.float16, tf.bfloat16):
        return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)
    return (x.astype(np.float64) * factor).astype(x.dtype)


def reduce_reference(xs, dtype, op, prescale, postscale):
    xs = [scale(x, prescale, dtype) for x in xs]
    combine = {
        "Average": np.add,
        "Sum": np.add,
        "Min": np.minimum,
        "Max": np.maximum,
        "Product": np.multiply,
    }[op]
    if dtype.is_integer:
        result = functools.reduce(combine, xs)  # wraps around like the engine
    else:
        # Exact in float64 for these inputs, hence equal to any ring order.
        result = functools.reduce(combine, [x.astype(np.float64) for x in xs]).astype(xs[0].dtype)
    factor = postscale * (1.0 / len(xs)) if op == "Average" else postscale
    return scale(result, factor, dtype)


def check(what, actual, expected, dtype):
    actual = np.asarray(actual)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        ok = False
    elif dtype.is_integer:
        ok = np.array_equal(actual, expected)
    else:
        tol = TOLERANCE[dtype]
        ok = np.allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)
    if not ok:
        diff = (
            "shape/dtype"
            if actual.shape != expected.shape
            else np.flatnonzero(actual.astype(np.float64) != expected.astype(np.float64))[:5]
        )
        failures.append(
            f"rank {RANK}: {what}: got {actual.dtype}{actual.shape} {actual.ravel()[:6]}, "
            f"expected {expected.dtype}{expected.shape} {expected.ravel()[:6]} (differs at {diff})"
        )


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
    for dtype in DTYPES:
        sizes = SIZES + ([BIG // 4 // SIZE] if dtype == tf.float32 else [])
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
    for dtype in DTYPES:
        sizes = SIZES + ([BIG] if dtype in BIG_DTYPES else [])
        all_inputs = [[inputs(r, n, dtype, "broadcast", False) for r in range(SIZE)] for n in sizes]
        for root in range(SIZE):
            mine = [tf.constant(xs[RANK]) for xs in all_inputs]
            for mode in MODES:
                outputs = run_each(mode, functools.partial(kr.broadcast, root_rank=root), mine)
                for n, out, xs in zip(sizes, outputs, all_inputs):
                    check(f"broadcast root={root} {dtype.name} n={n} {mode}", out, xs[root], dtype)


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


def check_order():
    """Named collectives issued in opposite orders on even and odd ranks."""
    count = 6
    xs = [[inputs(r, 5, tf.float32, f"order/{k}", True) for r in range(SIZE)] for k in range(count)]
    functions = [
        tf.function(
            lambda x, k=k: (
                kr.allreduce(x, op=kr.Sum, name=f"order.reduce.{k}"),
                kr.allgather(x, name=f"order.gather.{k}"),
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
    for k in range(count):
        reduced, gathered, broadcast = results[k]
        check(f"order allreduce {k}", reduced, np.sum(xs[k], axis=0), tf.float32)
        check(f"order allgather {k}", gathered, np.concatenate(xs[k]), tf.float32)
        check(f"order broadcast {k}", broadcast, xs[k][k % SIZE], tf.float32)


def check_mismatch_errors():
    """Disagreeing ranks fail on every rank, naming the tensor; later ops still work."""
    cases = {
        "mismatch.shape": lambda: kr.allreduce(tf.zeros([RANK + 1]), name="mismatch.shape"),
        "mismatch.op": lambda: kr.allreduce(
            tf.zeros([2]), op=kr.Sum if RANK else kr.Max, name="mismatch.op"
        ),
        "mismatch.root": lambda: kr.broadcast(tf.zeros([2]), RANK, name="mismatch.root"),
    }
    for name, call in cases.items():
        try:
            call()
            failures.append(f"rank {RANK}: {name}: no error")
        except tf.errors.InvalidArgumentError as e:
            if f"ranks disagree on tensor '{name}'" not in e.message:
                failures.append(f"rank {RANK}: {name}: unexpected message: {e.message}")
    check(
        "allreduce after errors",
        kr.allreduce(tf.ones([3]), op=kr.Sum),
        np.full([3], SIZE, np.float32),
        tf.float32,
    )


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    start = time.time()
    try:
        for check_all in (
            check_allreduce,
            check_grouped_allreduce,
            check_allgather,
            check_broadcast,
            check_gradients,
            check_order,
            check_mismatch_errors,
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
