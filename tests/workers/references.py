"""NumPy references for the collectives, shared by every framework's op worker.

No framework is imported: dtypes are NumPy's (`ml_dtypes.bfloat16` for
bfloat16). Every rank regenerates every rank's inputs (seeded by rank and
case), so each computes the expected results itself.
"""

import functools
import zlib

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
REDUCED_DTYPES = [np.dtype(d) for d in
                  ("float16", BFLOAT16, "float32", "float64", "int8", "uint8", "int32", "int64")]
# Moved unchanged by allgather, broadcast and alltoall; not reduced.
MOVED_DTYPES = [np.dtype(d) for d in ("int16", "uint16", "bool")]
FLOATING = REDUCED_DTYPES[:4]
OP_NAMES = ("Average", "Sum", "Min", "Max", "Product")
SIZES = [0, 1, 7, 1001]
BIG = 4 * 1024 * 1024 + 3  # ~16 MiB of 4-byte elements, not divisible by 2 or 3
# Exact in float32, the type of the scale attrs.
PRESCALE, POSTSCALE = 0.5, 2.5
TOLERANCE = {np.dtype("float16"): 1e-3, BFLOAT16: 1e-2, np.dtype("float32"): 1e-6,
             np.dtype("float64"): 1e-12}


def is_integer(dtype):
    return np.dtype(dtype).kind in "iu"


def inputs(rank, shape, dtype, case, small):
    """Rank `rank`'s input for `case`, identical on every rank that asks.

    Integers span their whole range (to exercise wrap-around) unless `small`;
    floats and small integers are integer-valued and small, so sums, products
    and extrema are exact in every dtype, and scaled integers stay in range.
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([zlib.crc32(f"{case}/{dtype.name}".encode()), rank])
    if dtype == np.bool_:
        return rng.integers(0, 1, size=shape, endpoint=True).astype(bool)
    if is_integer(dtype) and not small:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    low = 0 if dtype.kind == "u" else (-3 if "Product" in case else -8)
    high = 3 if "Product" in case else 8
    return rng.integers(low, high, size=shape, endpoint=True).astype(dtype)


def saturate(values, dtype):
    """float64 -> integer dtype as the engine converts: truncated, saturated, NaN to 0."""
    info = np.iinfo(dtype)
    above = float(info.max) + 1.0  # a power of two, exact
    out = np.full(values.shape, info.min, dtype=dtype)
    inside = (values < above) & (values > float(info.min) - 1.0)
    out[inside] = np.trunc(values[inside]).astype(dtype)
    out[values >= above] = info.max
    out[np.isnan(values)] = 0
    return out


def scale(x, factor, dtype):
    """The engine's scaling: by the factor in float32 for float32 and half types, else float64."""
    dtype = np.dtype(dtype)
    if factor == 1.0:
        return x
    if is_integer(dtype):
        return saturate(x.astype(np.float64) * factor, dtype)
    if dtype.itemsize <= 4:
        return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)
    return (x.astype(np.float64) * factor).astype(x.dtype)


def reduce_reference(xs, dtype, op, prescale, postscale):
    xs = [scale(x, prescale, dtype) for x in xs]
    combine = {"Average": np.add, "Sum": np.add, "Min": np.minimum, "Max": np.maximum,
               "Product": np.multiply}[op]
    if is_integer(dtype):
        result = functools.reduce(combine, xs)  # wraps around like the engine
    else:
        # Exact in float64 for these inputs, hence equal to any ring order.
        result = functools.reduce(combine, [x.astype(np.float64) for x in xs]).astype(xs[0].dtype)
    factor = postscale * (1.0 / len(xs)) if op == "Average" else postscale
    return scale(result, factor, dtype)


def split_bounds(rows, size):
    """Reducescatter's split of `rows` rows: the first rows % size ranks get one row more."""
    return np.cumsum([0] + [rows // size + (r < rows % size) for r in range(size)])


def scatter_reference(xs, dtype, op, prescale, postscale, rank):
    """Rank `rank`'s rows of the reduction of xs."""
    bounds = split_bounds(xs[0].shape[0], len(xs))
    return reduce_reference(xs, dtype, op, prescale, postscale)[bounds[rank]: bounds[rank + 1]]


def alltoall_splits(rank, size, case):
    """Rank `rank`'s splits in `case`: rows for each rank (None: an even split of 3 each)."""
    return {
        "even": [2] * size,
        "uneven": [(rank + 2 * j) % 4 for j in range(size)],
        "zeros": [0] * size,
        "one-sender": [5 if rank == 1 else 0 for _ in range(size)],
        "none": None,
    }[case]


def alltoall_reference(xs, case, rank):
    """What `rank` receives from ranks sending xs, and how many rows from each."""
    parts, received = [], []
    for r, x in enumerate(xs):
        splits = alltoall_splits(r, len(xs), case) or [3] * len(xs)
        start = sum(splits[:rank])
        parts.append(x[start: start + splits[rank]])
        received.append(splits[rank])
    return np.concatenate(parts), np.array(received, np.int32)


class Checker:
    """Collects wrong values, to report them all at the end."""

    def __init__(self, rank):
        self.rank = rank
        self.failures = []

    def __call__(self, what, actual, expected, dtype):
        dtype = np.dtype(dtype)
        actual = np.asarray(actual)
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            ok = False
        elif dtype not in FLOATING:
            ok = np.array_equal(actual, expected)
        else:
            tol = TOLERANCE[dtype]
            ok = np.allclose(actual.astype(np.float64), expected.astype(np.float64),
                             rtol=tol, atol=tol)
        if not ok:
            diff = (
                "shape/dtype" if actual.shape != expected.shape or actual.dtype != expected.dtype
                else np.flatnonzero(actual.astype(np.float64) != expected.astype(np.float64))[:5]
            )
            self.failures.append(
                f"rank {self.rank}: {what}: got {actual.dtype}{actual.shape} "
                f"{actual.ravel()[:6]}, expected {expected.dtype}{expected.shape} "
                f"{expected.ravel()[:6]} (differs at {diff})"
            )
