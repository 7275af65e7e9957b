"""Randomised-order stress of the engine through its NumPy binding (no TensorFlow).

Run under the launcher with 2 or 3 ranks; exits non-zero on the first mismatch.

At the start every rank adds two process sets, P = [0, size-1] and
Q = [1 .. size-1] (for 2 ranks: [0, 1], the same members as the global set
under another id, and the singleton [1]). Every step then has, for the global
set, a set of 50-90 named tensors: stable names present in every step, names
present in some steps only, and names used in one step only; and for each
process set 12-25 more, several with the same names as the global set's. What
a name does in a step (collective: allreduce, allgather, broadcast,
reducescatter or alltoall; dtype, reduce op, scale factors, root, shape) is
derived from its set, the name, a version and the seed only, so every rank
agrees on it; stable names keep their spec across steps except for occasional
shape changes (and rarer changes of collective, dtype, op or scale factors),
which every rank makes at the same step. Inputs (and alltoall splits, and
allgather first dimensions) are seeded by (set, name, step, rank), so every
rank regenerates every rank's contribution and checks its results against a
NumPy reference.

Every rank submits all of a step's tensors, global and of the sets it is in,
before waiting on any, in its own random order, then waits on them in
another random order. About half of the allreduces (picked by name) run as
groups instead: one blocking `run(..., group=...)` call per set and (op,
scale factors), their members changing as the specs do, all at a random
point of the rank's submissions.

Two join phases follow. In the first, the global set runs JOIN_STEPS more
steps, but each rank runs out of data at its own step (one rank, the last,
runs them all) and then calls join(): a joined rank takes part with zeros in
Sum/Average allreduces and reducescatters and with no rows in allgathers,
broadcasts from a rank that has not joined still run, and every other
collective in flight while a rank has joined fails with an error that names
why; join returns the last rank. The second does the same within P, with P's
names.

At the end each rank prints the engine's counters, which the test solves for
each set's share (a rank runs the collectives of every set it is in) and
compares with the fusion setting, and how they moved in each join phase (one
set's collectives only: the same on all its members).

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
from engine_worker import DTYPES, OPS, bfloat16, fail, reference, split_rows

import keras_ring as kr
from keras_ring.core import _engine

SEED = int(os.environ.get("KR_STRESS_SEED", "0"))
STEPS = int(os.environ.get("KR_STRESS_STEPS", "60"))

STABLE = [f"w.{i}" for i in range(52)]       # every step
SOMETIMES = [f"opt.{i}" for i in range(30)]  # each step with probability SOMETIMES_P
SOMETIMES_P = 0.35
MAX_ONE_OFF = 10                              # "s<step>.<i>": one step only
# Process sets: fewer names, partly the global set's.
SET_STABLE = [f"w.{i}" for i in range(8)] + [f"p.{i}" for i in range(4)]
SET_SOMETIMES = [f"opt.{i}" for i in range(8)]
SET_MAX_ONE_OFF = 4
RESHAPE_P = 0.05  # per stable name and step: a new shape
RESPEC_P = 0.015  # per stable name and step: a new collective/dtype/op/scales/root
JOIN_STEPS = 6      # global join phase
SET_JOIN_STEPS = 4  # join phase within P

COLLECTIVES = {"allreduce": 0.55, "allgather": 0.12, "broadcast": 0.12, "reducescatter": 0.12,
               "alltoall": 0.09}
REDUCING = ("allreduce", "reducescatter")
NEEDS_ROWS = ("allgather", "reducescatter", "alltoall")  # rank 1 or more
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


class Group:
    """The global set (sid 0) or a process set; `members` are world ranks, `me` this rank's
    rank within the set (-1 outside)."""

    def __init__(self, sid, members, process_set_id, rank):
        self.sid, self.members, self.id = sid, list(members), process_set_id
        self.size = len(self.members)
        self.me = self.members.index(rank) if rank in self.members else -1

    def __repr__(self):
        return "global set" if self.sid == 0 else f"process set {self.id} {self.members}"


class Spec:
    def __init__(self, group, name, collective, dtype, op, scales, root, shape):
        self.group, self.name, self.collective, self.dtype = group, name, collective, dtype
        self.op = op
        self.pre, self.post = scales
        self.root, self.shape = root, shape

    def __repr__(self):
        what = {"allreduce": f"op={self.op} pre={self.pre} post={self.post}",
                "reducescatter": f"op={self.op} pre={self.pre} post={self.post}",
                "broadcast": f"root={self.root}", "allgather": "", "alltoall": ""}[self.collective]
        return (f"{self.collective} {np.dtype(self.dtype).name}{list(self.shape)} {what} in the "
                f"{self.group} (seed {SEED})")


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


def make_spec(group, name, params_version, shape_version):
    p = rng_for("params", group.sid, name, params_version)
    if p.random() < 0.3:  # gradient-like: unscaled float32 Sum/Average, so that fusion has peers
        shape = make_shape(rng_for("shape", group.sid, name, shape_version), 4)
        return Spec(group, name, "allreduce", np.float32, ["Sum", "Average"][p.integers(2)],
                    (1.0, 1.0), 0, shape)
    collective = str(p.choice(list(COLLECTIVES), p=list(COLLECTIVES.values())))
    dtype = DTYPES[p.integers(len(DTYPES))]
    op = list(OPS)[p.integers(len(OPS))]
    u = p.random()
    if u < 0.55:
        scales = (1.0, 1.0)
    elif u < 0.8 or is_int(dtype):
        scales = EXACT_SCALES[p.integers(len(EXACT_SCALES))]
    else:
        scales = INEXACT_SCALES[p.integers(len(INEXACT_SCALES))]
    root = int(p.integers(group.size))
    shape = make_shape(rng_for("shape", group.sid, name, shape_version), np.dtype(dtype).itemsize)
    if collective in NEEDS_ROWS and shape == ():
        shape = (1,)
    return Spec(group, name, collective, dtype, str(op), scales, root, shape)


def gather_rows(spec, step, rank):
    """Allgather: this rank's first dimension in this step (0 now and then)."""
    g = rng_for("rows", spec.group.sid, spec.name, step, rank)
    if g.random() < 0.15:
        return 0
    base = spec.shape[0]
    return int(g.integers(0, base + 2 + (base if base < 1000 else 0)))


def alltoall_splits(spec, step, rank):
    """Alltoall: the rows this rank sends to each member in this step, or None for an even
    split (no splits passed)."""
    g = rng_for("splits", spec.group.sid, spec.name, step, rank)
    n = spec.group.size
    if g.random() < 0.25:
        return None
    per = spec.shape[0] // n
    return [0 if g.random() < 0.15 else int(g.integers(0, 2 * per + 2)) for _ in range(n)]


def even_rows(spec):
    """Alltoall without splits: a first dimension divisible by the set's size."""
    n = spec.group.size
    return n * (spec.shape[0] // n or spec.shape[0])


def rank_shape(spec, step, rank):
    if spec.collective == "allgather":
        return (gather_rows(spec, step, rank), *spec.shape[1:])
    if spec.collective == "alltoall":
        splits = alltoall_splits(spec, step, rank)
        return (even_rows(spec) if splits is None else sum(splits), *spec.shape[1:])
    return spec.shape


def make_input(spec, step, rank):
    """Integer-valued data (random floats for the collectives that only move bytes)."""
    shape = rank_shape(spec, step, rank)
    n = math.prod(shape)
    g = rng_for("data", spec.group.sid, spec.name, step, rank)
    dtype = np.dtype(spec.dtype)
    if is_int(dtype):
        if spec.collective in REDUCING and (spec.pre, spec.post) != (1.0, 1.0):
            # Scaled integers must stay in range: saturation is not NumPy's behaviour.
            lo, hi = (-3, 3) if spec.op == "Product" else (-8, 8)
            lo = max(lo, 0) if np.iinfo(dtype).min == 0 else lo
        else:
            lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        x = g.integers(lo, hi, size=n, endpoint=True, dtype=np.int64).astype(dtype)
    elif spec.collective not in REDUCING:
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


def join_error(spec, active):
    """What the error names when some members have joined (`active`: by rank within the set,
    False once joined) and `spec` cannot take their part; None when it runs."""
    if all(active):
        return None
    if spec.collective in REDUCING and spec.op not in ("Sum", "Average"):
        return "cannot take zeros from joined ranks"
    if spec.collective == "broadcast" and not active[spec.root]:
        return "its root rank has joined"
    if spec.collective == "alltoall":
        return "alltoall does not support joined ranks"
    return None


def expected(spec, step, active):
    """(result, exact, magnitude for the tolerance, alltoall's received splits) on this rank;
    joined members take part with zeros, or no rows."""
    group = spec.group
    me = group.me
    inputs = [make_input(spec, step, w) if active[r] else None
              for r, w in enumerate(group.members)]
    if spec.collective == "allgather":
        return np.concatenate([x for x in inputs if x is not None]), True, None, None
    if spec.collective == "broadcast":
        return inputs[spec.root], True, None, None
    if spec.collective == "alltoall":
        parts, received = [], []
        for r, x in enumerate(inputs):
            splits = (alltoall_splits(spec, step, group.members[r])
                      or [x.shape[0] // group.size] * group.size)
            start = sum(splits[:me])
            parts.append(x[start:start + splits[me]])
            received.append(splits[me])
        return np.concatenate(parts), True, None, received
    inputs = [np.zeros(spec.shape, spec.dtype) if x is None else x for x in inputs]
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
    if spec.collective == "reducescatter":
        bounds = split_rows(spec.shape[0], group.size)
        want = want[bounds[me]:bounds[me + 1]]
        if magnitude is not None:
            magnitude = magnitude[bounds[me]:bounds[me + 1]]
    return want, exact, magnitude, None


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


def submit(spec, array, step, rank):
    kw = {"process_set": spec.group.id}
    if spec.collective in REDUCING:
        kind = _engine.ALLREDUCE if spec.collective == "allreduce" else _engine.REDUCESCATTER
        return _engine.submit(kind, array, spec.name, op=OPS[spec.op],
                              prescale_factor=spec.pre, postscale_factor=spec.post, **kw)
    if spec.collective == "allgather":
        return _engine.submit(_engine.ALLGATHER, array, spec.name, **kw)
    if spec.collective == "alltoall":
        return _engine.submit(_engine.ALLTOALL, array, spec.name,
                              splits=alltoall_splits(spec, step, rank) or [], **kw)
    return _engine.submit(_engine.BROADCAST, array, spec.name, root_rank=spec.root, **kw)


def size_class(shape):
    n = math.prod(shape)
    if shape == ():
        return "scalar"
    return ("0" if n == 0 else "1" if n == 1 else "<300" if n < 300 else "<30k" if n < 30000
            else ">=30k")


def step_names(group, step):
    stable, sometimes, max_one_off = ((STABLE, SOMETIMES, MAX_ONE_OFF) if group.sid == 0 else
                                      (SET_STABLE, SET_SOMETIMES, SET_MAX_ONE_OFF))
    count = int(rng_for("one-off", group.sid, step).integers(max_one_off))
    one_off = [f"s{step}.{i}" for i in range(count)]  # the same names in every set
    present = [n for n in sometimes
               if rng_for("present", group.sid, n, step).random() < SOMETIMES_P]
    return stable + present + one_off


class Plan:
    """Every group's specs step by step, computed alike on every rank, member or not."""

    def __init__(self, groups):
        self.versions = {(g.sid, name): [0, 0] for g in groups
                         for name in (STABLE if g.sid == 0 else SET_STABLE)}  # [params, shape]
        self.coverage = collections.Counter()

    def specs(self, group, step):
        stable = STABLE if group.sid == 0 else SET_STABLE
        if step > 0:
            for name in stable:
                u = rng_for("change", group.sid, name, step).random()
                if u < RESPEC_P:
                    self.versions[group.sid, name][0] += 1
                    self.coverage["respec"] += 1
                elif u < RESPEC_P + RESHAPE_P:
                    self.versions[group.sid, name][1] += 1
                    self.coverage["reshape"] += 1
        specs = []
        for name in step_names(group, step):
            if name in stable:
                spec = make_spec(group, name, *self.versions[group.sid, name])
            elif name.startswith("opt."):
                spec = make_spec(group, name, 0, step)  # new shape at every appearance
            else:
                spec = make_spec(group, name, step, step)
            specs.append(spec)
            c = self.coverage
            where = "" if group.sid == 0 else "set "
            c[where + spec.collective] += 1
            c[np.dtype(spec.dtype).name] += 1
            c["size " + size_class(spec.shape)] += 1
            if spec.collective in REDUCING:
                c[spec.op] += 1
                c["scaled" if (spec.pre, spec.post) != (1.0, 1.0) else "unscaled"] += 1
        return specs


GROUPED = collections.Counter()  # {True: tensors run in groups of 2 or more, False: alone}


def step_groups(by_key):
    """The allreduces that run as groups (run(..., group=...)): about half of them, picked by
    name, one group per set and (op, scale factors), members in spec order: the same on every
    rank. Returns {(sid, group name): [keys]}, sorted, the order every rank runs them in."""
    groups = collections.defaultdict(list)
    for key, spec in by_key.items():
        if spec.collective == "allreduce" and zlib.crc32(spec.name.encode()) % 2:
            groups[spec.group.sid, f"grp.{spec.op}.{spec.pre}.{spec.post}"].append(key)
    return dict(sorted(groups.items()))


def run_group(step, by_key, keys, group_name, active, rank):
    """Runs the group's allreduces in one blocking call and checks the results: all of them,
    or the error that names the first member a joined rank cannot stand in for."""
    specs = [by_key[k] for k in keys]
    GROUPED[len(specs) > 1] += len(specs)
    first = specs[0]
    where = f"step {step} group '{group_name}' of {[s.name for s in specs]} ({first!r})"
    culprit = next((s for s in specs if join_error(s, active[first.group.sid])), None)
    try:
        outs = _engine.run(_engine.ALLREDUCE, [make_input(s, step, rank) for s in specs],
                           [s.name for s in specs], op=OPS[first.op], prescale_factor=first.pre,
                           postscale_factor=first.post, process_set=first.group.id,
                           group=group_name)
    except ValueError as e:
        why = culprit and join_error(culprit, active[first.group.sid])
        if culprit is None or f"'{culprit.name}'" not in str(e) or why not in str(e):
            fail(f"{where}: ValueError: {e}")
        return
    if culprit is not None:
        fail(f"{where}: ran, but should have failed naming '{culprit.name}'")
    for spec, got in zip(specs, outs):
        want, exact, magnitude, _ = expected(spec, step, active[spec.group.sid])
        compare(spec, step, got, want, exact, magnitude)


def run_step(step, specs, active, rank):
    """Submits `specs` in a random order, waits on them in another and checks each result
    (or, where a member has joined, the error); the grouped allreduces run in blocking calls
    (one per group, in the same order on every rank) at a random point of the submissions.
    Returns the number submitted."""
    local = random.Random(f"{SEED}/{rank}/{step}")
    by_key = {(spec.group.sid, spec.name): spec for spec in specs}
    groups = step_groups(by_key)
    grouped = {key for keys in groups.values() for key in keys}
    order = [key for key in by_key if key not in grouped]
    local.shuffle(order)
    groups_at = local.randint(0, len(order))
    handles, arrays = {}, {}
    for i, key in enumerate(order + [None]):
        if i == groups_at:
            for (_, group_name), keys in groups.items():
                run_group(step, by_key, keys, group_name, active, rank)
        if key is None:
            break
        spec = by_key[key]
        x = make_input(spec, step, rank)
        arrays[key] = x
        handles[key] = submit(spec, odd_layout(x) if x.ndim and local.random() < 0.05 else x,
                              step, rank)
        if local.random() < 0.1:  # poll an earlier handle; must never block
            handles[local.choice(list(handles))].done()

    local.shuffle(order)
    for key in order:
        spec = by_key[key]
        where = f"step {step} tensor '{spec.name}' ({spec!r})"
        why = join_error(spec, active[spec.group.sid])
        try:
            got = handles[key].wait()
        except ValueError as e:
            if why is None or f"'{spec.name}'" not in str(e) or why not in str(e):
                fail(f"{where}: ValueError: {e}" + (f" (expected one naming: {why})" if why
                                                      else ""))
            got = None
        except Exception as e:  # any other error fails the run, reported in full
            fail(f"{where}: {type(e).__name__}: {e}")
        if not handles[key].done():
            fail(f"{where}: done() is False after wait() returned")
        if got is not None:
            if why is not None:
                fail(f"{where}: ran, but should have failed: {why}")
            want, exact, magnitude, received = expected(spec, step, active[spec.group.sid])
            compare(spec, step, got, want, exact, magnitude)
            if received is not None and handles[key].received_splits() != received:
                fail(f"{where}: received splits {handles[key].received_splits()}, "
                     f"expected {received}")
        if not np.array_equal(arrays[key], make_input(spec, step, rank)):
            fail(f"{where}: the engine changed its input")
    return len(by_key)


def ends_of_data(group, first, steps):
    """Join phase: the step at which each member (by rank within the set) runs out of data,
    and the member that runs all `steps` steps, so joins last."""
    g = rng_for("ends", group.sid)
    last = int(g.integers(group.size))
    ends = [first + (steps if r == last else int(g.integers(steps))) for r in range(group.size)]
    return ends, last


def main():
    kr.init()
    # init() agrees the Keras backend with one collective of its own: count from here.
    at_start = _engine.stats()
    rank, size = kr.rank(), kr.size()
    expected_size = int(os.environ.get("KR_TEST_EXPECTED_SIZE", size))
    if size != expected_size:
        fail(f"size {size}, expected {expected_size}")
    if rank == 0:
        print(f"stress: seed {SEED}, {STEPS} steps, {size} ranks", flush=True)
    start = time.monotonic()
    # Tensors each set runs (the same on every member): the engine's counters sum them.
    set_tensors = collections.Counter()
    p_set = kr.add_process_set([0, size - 1])
    q_set = kr.add_process_set(list(range(1, size)))
    set_tensors[0] += 2  # adding a set is a collective of the global set
    groups = [Group(0, range(size), 0, rank), Group(1, p_set.ranks, p_set.process_set_id, rank),
              Group(2, q_set.ranks, q_set.process_set_id, rank)]
    plan = Plan(groups)
    everyone = {g.sid: [True] * g.size for g in groups}
    submitted = 0
    fused_before = 0
    for step in range(STEPS):
        mine = []
        for group in groups:
            specs = plan.specs(group, step)
            set_tensors[group.sid] += len(specs)
            if group.me >= 0:
                mine += specs
        submitted += run_step(step, mine, everyone, rank)
        if step % 10 == 9 or step == STEPS - 1:
            fused = _engine.stats()["fused_tensors"]
            print(f"rank {rank}: step {step} ok ({len(mine)} tensors, "
                  f"{fused - fused_before} fused since last report)", flush=True)
            fused_before = fused

    # Join phases: the global set's, then P's. Members run out of data at different steps.
    # Only the one set runs collectives in each, so its members' counters must move alike.
    first = STEPS
    phases = {}
    before = _engine.stats()
    for group, steps in ((groups[0], JOIN_STEPS), (groups[1], SET_JOIN_STEPS)):
        ends, last = ends_of_data(group, first, steps)
        phase_tensors = set_tensors[group.sid]
        for step in range(first, first + steps):
            active = {group.sid: [end > step for end in ends]}
            specs = plan.specs(group, step)
            # A group fails as a whole if a joined rank cannot stand in for one member.
            failed_groups = set()
            for (_, group_name), keys in step_groups({(s.group.sid, s.name): s
                                                     for s in specs}).items():
                if any(join_error(s, active[group.sid]) for s in specs if
                       (s.group.sid, s.name) in keys):
                    failed_groups.update(keys)
            for spec in specs:
                why = join_error(spec, active[group.sid])
                fails = why is not None or (spec.group.sid, spec.name) in failed_groups
                set_tensors[group.sid] += not fails  # joined members run it too, with zeros
                if not all(active[group.sid]):
                    plan.coverage[f"joined: {spec.collective} {'error' if fails else 'ok'}"] += 1
            if group.me >= 0 and active[group.sid][group.me]:
                submitted += run_step(step, specs, active, rank)
        first += steps
        if group.me >= 0:
            got = kr.join(process_set=p_set if group.sid else None)
            if got != group.members[last]:  # a rank of the job
                fail(f"join in the {group} returned {got}, expected {group.members[last]} "
                     f"(data ends by rank: {ends})")
            print(f"rank {rank}: join in the {group} ok (ran out of data at step "
                  f"{ends[group.me]}, last {last})", flush=True)
        set_tensors[group.sid] += 1  # the join itself
        if group.me >= 0:
            after = _engine.stats()
            phases[f"join in set {group.sid}"] = {
                "stats": {key: after[key] - before[key] for key in after},
                "tensors": set_tensors[group.sid] - phase_tensors}
            before = after

    stats = {key: value - at_start[key] for key, value in _engine.stats().items()}
    want_tensors = sum(set_tensors[g.sid] for g in groups if g.me >= 0)
    if stats["tensors"] != want_tensors:
        fail(f"engine counted {stats['tensors']} tensors, expected {want_tensors} "
             f"({submitted} were submitted here)")
    sets = {g.sid: {"members": g.members, "tensors": set_tensors[g.sid]}
            for g in groups if g.me >= 0}
    report = {**stats, "submitted": submitted, "expected_tensors": want_tensors, "sets": sets,
              "phases": phases, "grouped_tensors": GROUPED[True]}
    # Into a file as well when asked: the launcher forwards each rank's output on its own, so
    # one rank's long line can arrive cut by another's.
    if os.environ.get("KR_STRESS_REPORTS"):
        with open(os.path.join(os.environ["KR_STRESS_REPORTS"], f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    print(f"rank {rank}: stats {json.dumps(report, sort_keys=True)}", flush=True)
    if rank == 0:
        print(f"stress coverage: {json.dumps(dict(sorted(plan.coverage.items())))}", flush=True)
    # A rank's exit ends the job's engine: P's join phase must be over everywhere first.
    kr.barrier()
    print(f"rank {rank}: stress ok, {submitted} tensors in {STEPS} + {JOIN_STEPS} + "
          f"{SET_JOIN_STEPS} steps, {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
