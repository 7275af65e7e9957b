"""Randomised-order stress of the engine through its NumPy binding (no TensorFlow).

Run under the launcher with 2 or 3 ranks; exits non-zero on the first mismatch.

Every step has a set of 50-90 named tensors: stable names present in every
step, names present in some steps only, and names used in one step only. What
a name does in a step (collective, dtype, reduce op, scale factors, root,
shape) is derived from the name, a version and the seed only, so every rank
agrees on it; stable names keep their spec across steps except for occasional
shape changes (and rarer changes of collective, dtype, op or scale factors),
which every rank makes at the same step. Inputs are seeded by (name, step,
rank), so every rank regenerates every rank's contribution and checks its
results against a NumPy reference.

Every rank submits all of a step's tensors before waiting on any, in its own
random order, then waits on them in another random order. At the end each
rank prints the engine's counters, which the test compares across ranks and
with the fusion setting.

Environment: KR_STRESS_SEED (default 0), KR_STRESS_STEPS (default 60),
KR_TEST_EXPECTED_SIZE (the job size the test started).
"""

import collections
import json
import math
import os
import random
import time
import zlib

import numpy as np
from engine_worker import DTYPES, OPS, bfloat16, fail, reference

import keras_ring as kr
from keras_ring import _engine

SEED = int(os.environ.get("KR_STRESS_SEED", "0"))
STEPS = int(os.environ.get("KR_STRESS_STEPS", "60"))

STABLE = [f"w.{i}" for i in range(52)]       # every step
SOMETIMES = [f"opt.{i}" for i in range(30)]  # each step with probability SOMETIMES_P
SOMETIMES_P = 0.35
MAX_ONE_OFF = 10                              # "s<step>.<i>": one step only
RESHAPE_P = 0.05  # per stable name and step: a new shape
RESPEC_P = 0.015  # per stable name and step: a new collective/dtype/op/scales/root

# Powers of two keep integer-valued float data exact; the others need a tolerance.
EXACT_SCALES = [(0.5, 2.0), (2.0, 0.5), (0.25, 1.0), (1.0, 4.0)]
INEXACT_SCALES = [(0.1, 1.0), (1.0, 1.0 / 3.0), (3.0, 0.7)]
# Bound on the error of an inexact result, relative to the magnitude of its inputs: a few
# units of rounding (half types are rounded at every ring step).
TOLERANCE = {np.dtype(np.float16): 8 * 2.0**-11, np.dtype(np.float32): 16 * 2.0**-24,
             np.dtype(np.float64): 16 * 2.0**-53}
if bfloat16 is not None:
    TOLERANCE[np.dtype(bfloat16)] = 8 * 2.0**-8


def rng_for(*parts):
    """A generator that depends on the seed and `parts` only: the same on every rank."""
    return np.random.default_rng([SEED, *(zlib.crc32(str(p).encode()) for p in parts)])


def is_int(dtype):
    return np.issubdtype(np.dtype(dtype), np.integer)


class Spec:
    def __init__(self, name, collective, dtype, op, scales, root, shape):
        self.name, self.collective, self.dtype, self.op = name, collective, dtype, op
        self.pre, self.post = scales
        self.root, self.shape = root, shape

    def __repr__(self):
        what = {"allreduce": f"op={self.op} pre={self.pre} post={self.post}",
                "broadcast": f"root={self.root}", "allgather": ""}[self.collective]
        return (f"{self.collective} {np.dtype(self.dtype).name}{list(self.shape)} {what}"
                f" (seed {SEED})")


def make_shape(g, itemsize):
    """Sizes 0, 1, odd, not divisible by the rank count, a few up to ~1 MB; 0 to 3 dims."""
    kind = g.choice(["empty", "scalar", "one", "small", "medium", "large"],
                    p=[0.05, 0.05, 0.07, 0.50, 0.30, 0.03])
    if kind == "empty":
        return [(0,), (0, 3), (4, 0), (2, 0, 5)][g.integers(4)]
    if kind == "scalar":
        return ()
    if kind == "one":
        return [(1,), (1, 1)][g.integers(2)]
    if kind == "small":
        n = int(g.integers(2, 300))
    elif kind == "medium":
        n = int(g.integers(300, 30000))
    else:
        n = int(g.integers(200_000, 1_100_000)) // itemsize | 1
    ndim = g.choice([1, 2, 3], p=[0.6, 0.3, 0.1])
    if ndim == 1 or n < 4:
        return (n,)
    a = int(g.integers(2, 8))
    if ndim == 2:
        return (a, max(1, n // a))
    b = int(g.integers(2, 5))
    return (a, b, max(1, n // (a * b)))


def make_spec(name, size, params_version, shape_version):
    p = rng_for("params", name, params_version)
    if p.random() < 0.3:  # gradient-like: unscaled float32 Sum/Average, so that fusion has peers
        shape = make_shape(rng_for("shape", name, shape_version), 4)
        return Spec(name, "allreduce", np.float32, ["Sum", "Average"][p.integers(2)], (1.0, 1.0),
                    0, shape)
    collective = p.choice(["allreduce", "allgather", "broadcast"], p=[0.7, 0.15, 0.15])
    dtype = DTYPES[p.integers(len(DTYPES))]
    op = list(OPS)[p.integers(len(OPS))]
    u = p.random()
    if u < 0.55:
        scales = (1.0, 1.0)
    elif u < 0.8 or is_int(dtype):
        scales = EXACT_SCALES[p.integers(len(EXACT_SCALES))]
    else:
        scales = INEXACT_SCALES[p.integers(len(INEXACT_SCALES))]
    root = int(p.integers(size))
    shape = make_shape(rng_for("shape", name, shape_version), np.dtype(dtype).itemsize)
    if collective == "allgather" and shape == ():
        shape = (1,)
    return Spec(name, str(collective), dtype, str(op), scales, root, shape)


def gather_rows(spec, step, rank):
    """Allgather: this rank's first dimension in this step (0 now and then)."""
    g = rng_for("rows", spec.name, step, rank)
    if g.random() < 0.15:
        return 0
    base = spec.shape[0]
    return int(g.integers(0, base + 2 + (base if base < 1000 else 0)))


def rank_shape(spec, step, rank):
    if spec.collective == "allgather":
        return (gather_rows(spec, step, rank), *spec.shape[1:])
    return spec.shape


def make_input(spec, step, rank):
    """Integer-valued data (random floats for the collectives that only move bytes)."""
    shape = rank_shape(spec, step, rank)
    n = math.prod(shape)
    g = rng_for("data", spec.name, step, rank)
    dtype = np.dtype(spec.dtype)
    if is_int(dtype):
        if spec.collective == "allreduce" and (spec.pre, spec.post) != (1.0, 1.0):
            # Scaled integers must stay in range: saturation is not NumPy's behaviour.
            lo, hi = (-3, 3) if spec.op == "Product" else (-8, 8)
            lo = max(lo, 0) if np.iinfo(dtype).min == 0 else lo
        else:
            lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        x = g.integers(lo, hi, size=n, endpoint=True, dtype=np.int64).astype(dtype)
    elif spec.collective != "allreduce":
        x = (g.standard_normal(n) * 100).astype(dtype)
    else:
        lo, hi = (-4, 4) if spec.op == "Product" else (-8, 8)
        x = g.integers(lo, hi, size=n, endpoint=True).astype(np.float64).astype(dtype)
    return x.reshape(shape)


def odd_layout(x):
    """The same values in a non-C-contiguous array (the binding must copy it)."""
    if x.ndim >= 2:
        return np.asfortranarray(x)
    wide = np.zeros((2 * x.size,) + x.shape[1:], x.dtype)
    wide[::2] = x
    return wide[::2]


def expected(spec, step, size):
    inputs = [make_input(spec, step, r) for r in range(size)]
    if spec.collective == "allgather":
        return np.concatenate(inputs), True, None
    if spec.collective == "broadcast":
        return inputs[spec.root], True, None
    exact = is_int(spec.dtype) or (spec.op != "Average" and (spec.pre, spec.post) not in
                                   INEXACT_SCALES)
    want = reference(inputs, spec.dtype, spec.op, spec.pre, spec.post)
    magnitude = None
    if not exact:
        mags = [np.abs(x.astype(np.float64)) * abs(spec.pre) for x in inputs]
        if spec.op in ("Sum", "Average"):
            magnitude = np.sum(mags, axis=0)
        elif spec.op == "Product":
            magnitude = np.prod(mags, axis=0)
        else:
            magnitude = np.max(mags, axis=0)
        magnitude = magnitude * abs(spec.post)
    return want, exact, magnitude


def compare(spec, step, got, want, exact, magnitude):
    where = f"step {step} tensor '{spec.name}' ({spec!r})"
    got = np.asarray(got)
    want = np.asarray(want)
    if got.dtype != np.dtype(spec.dtype):
        fail(f"{where}: result dtype {got.dtype}")
    if got.shape != want.shape:
        fail(f"{where}: result shape {got.shape}, expected {want.shape}")
    wide = np.int64 if is_int(spec.dtype) else np.float64
    got_w, want_w = got.astype(wide).ravel(), want.astype(wide).ravel()
    if exact:
        bad = np.flatnonzero(got_w != want_w)
    else:
        bound = TOLERANCE[np.dtype(spec.dtype)] * np.asarray(magnitude).ravel()
        bad = np.flatnonzero(~(np.abs(got_w - want_w) <= bound))
    if bad.size:
        i = bad[0]
        fail(f"{where}: {bad.size} of {got_w.size} elements differ; first at {i}: "
             f"got {got_w[i]}, expected {want_w[i]}")


def submit(spec, array):
    if spec.collective == "allreduce":
        return _engine.submit(_engine.ALLREDUCE, array, spec.name, op=OPS[spec.op],
                              prescale_factor=spec.pre, postscale_factor=spec.post)
    if spec.collective == "allgather":
        return _engine.submit(_engine.ALLGATHER, array, spec.name)
    return _engine.submit(_engine.BROADCAST, array, spec.name, root_rank=spec.root)


def size_class(shape):
    n = math.prod(shape)
    if shape == ():
        return "scalar"
    return ("0" if n == 0 else "1" if n == 1 else "<300" if n < 300 else "<30k" if n < 30000
            else ">=30k")


def step_names(step):
    one_off = [f"s{step}.{i}" for i in range(int(rng_for("one-off", step).integers(MAX_ONE_OFF)))]
    sometimes = [n for n in SOMETIMES if rng_for("present", n, step).random() < SOMETIMES_P]
    return STABLE + sometimes + one_off


def main():
    kr.init()
    rank, size = kr.rank(), kr.size()
    expected_size = int(os.environ.get("KR_TEST_EXPECTED_SIZE", size))
    if size != expected_size:
        fail(f"size {size}, expected {expected_size}")
    if rank == 0:
        print(f"stress: seed {SEED}, {STEPS} steps, {size} ranks", flush=True)
    versions = {name: [0, 0] for name in STABLE}  # [params, shape]
    coverage = collections.Counter()
    submitted = 0
    fused_before = 0
    start = time.monotonic()
    for step in range(STEPS):
        if step > 0:
            for name in STABLE:
                u = rng_for("change", name, step).random()
                if u < RESPEC_P:
                    versions[name][0] += 1
                    coverage["respec"] += 1
                elif u < RESPEC_P + RESHAPE_P:
                    versions[name][1] += 1
                    coverage["reshape"] += 1
        specs = {}
        for name in step_names(step):
            if name in versions:
                specs[name] = make_spec(name, size, *versions[name])
            elif name.startswith("opt."):
                specs[name] = make_spec(name, size, 0, step)  # new shape at every appearance
            else:
                specs[name] = make_spec(name, size, step, step)

        for spec in specs.values():
            coverage[spec.collective] += 1
            coverage[np.dtype(spec.dtype).name] += 1
            coverage["size " + size_class(spec.shape)] += 1
            if spec.collective == "allreduce":
                coverage[spec.op] += 1
                coverage["scaled" if (spec.pre, spec.post) != (1.0, 1.0) else "unscaled"] += 1

        local = random.Random(f"{SEED}/{rank}/{step}")
        order = list(specs)
        local.shuffle(order)
        handles, arrays = {}, {}
        for name in order:
            x = make_input(specs[name], step, rank)
            arrays[name] = x
            handles[name] = submit(specs[name], odd_layout(x) if x.ndim and local.random() < 0.05
                                   else x)
            if local.random() < 0.1:  # poll an earlier handle; must never block
                handles[local.choice(list(handles))].done()
        submitted += len(order)

        local.shuffle(order)
        for name in order:
            spec = specs[name]
            try:
                got = handles[name].wait()
            except Exception as e:  # any error fails the run, reported in full
                fail(f"step {step} tensor '{name}' ({spec!r}): {type(e).__name__}: {e}")
            if not handles[name].done():
                fail(f"step {step} tensor '{name}': done() is False after wait() returned")
            want, exact, magnitude = expected(spec, step, size)
            compare(spec, step, got, want, exact, magnitude)
            if not np.array_equal(arrays[name], make_input(spec, step, rank)):
                fail(f"step {step} tensor '{name}' ({spec!r}): the engine changed its input")
        if step % 10 == 9 or step == STEPS - 1:
            fused = _engine.stats()["fused_tensors"]
            print(f"rank {rank}: step {step} ok ({len(order)} tensors, "
                  f"{fused - fused_before} fused since last report)", flush=True)
            fused_before = fused

    stats = _engine.stats()
    if stats["tensors"] != submitted:
        fail(f"engine counted {stats['tensors']} tensors, {submitted} were submitted")
    report = {**stats, "submitted": submitted}
    print(f"rank {rank}: stats {json.dumps(report, sort_keys=True)}", flush=True)
    if rank == 0:
        print(f"stress coverage: {json.dumps(dict(sorted(coverage.items())))}", flush=True)
    print(f"rank {rank}: stress ok, {submitted} tensors in {STEPS} steps, "
          f"{time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
