"""Multi-rank checks of keras_ring.jax's collectives against NumPy references.

Run with 2 or 3 ranks under the launcher: `keras-ring-run -np 3 python
tests/workers/jax_ops_worker.py`. Each collective runs eagerly and inside
`jax.jit` (one jitted function for a list of cases, so that its custom calls
are in one program). Wrong values are collected and reported at the end
(exit 1); an unexpected exception exits at once.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
# Up to 3 ranks share 2 cores.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import functools  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 and int64 as themselves

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from references import (  # noqa: E402
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

import keras_ring.jax as krj  # noqa: E402

OPS = {name: getattr(krj, name) for name in OP_NAMES}
# Large arrays take the adapter's one path for every dtype; the engine's per-dtype paths at
# size are the TF worker's and the engine's tests.
BIG_DTYPES = (np.dtype("float32"),)
MODES = ("eager", "jit")

krj.init()
RANK, SIZE = krj.rank(), krj.size()
check = Checker(RANK)


def run_each(mode, fn, args):
    """fn over each arg: one call per arg eagerly, one jitted program for all."""
    if mode == "eager":
        return [fn(a) for a in args]
    return jax.jit(lambda xs: [fn(x) for x in xs])(list(args))


def check_allreduce():
    for dtype in REDUCED_DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                sizes = SIZES + ([BIG] if dtype in BIG_DTYPES and not scaled else [])
                case = f"allreduce/{op_name}/{scaled}"
                every = [[inputs(r, n, dtype, case, scaled) for r in range(SIZE)] for n in sizes]
                expected = [reduce_reference(xs, dtype, op_name, prescale, postscale)
                            for xs in every]
                mine = [jnp.asarray(xs[RANK]) for xs in every]
                allreduce = functools.partial(krj.allreduce, op=op, prescale_factor=prescale,
                                              postscale_factor=postscale)
                for mode in MODES:
                    for n, out, exp in zip(sizes, run_each(mode, allreduce, mine), expected):
                        check(f"{case} {dtype.name} n={n} {mode}", out, exp, dtype)


def check_grouped_allreduce():
    for op_name, op in OPS.items():
        for scaled in (False, True):
            prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
            case = f"grouped/{op_name}/{scaled}"
            shapes = [(SIZES[i % len(SIZES)], 2) for i in range(len(REDUCED_DTYPES))]
            every = [[inputs(r, s, d, case, scaled) for r in range(SIZE)]
                     for s, d in zip(shapes, REDUCED_DTYPES)]
            mine = [jnp.asarray(xs[RANK]) for xs in every]
            grouped = functools.partial(krj.grouped_allreduce, op=op, prescale_factor=prescale,
                                        postscale_factor=postscale, name=f"g.{op_name}.{scaled}")
            for mode in MODES:
                outputs = grouped(mine) if mode == "eager" else jax.jit(grouped)(mine)
                for dtype, xs, out in zip(REDUCED_DTYPES, every, outputs):
                    expected = reduce_reference(xs, dtype, op_name, prescale, postscale)
                    check(f"{case} {dtype.name} {mode}", out, expected, dtype)


def check_allgather():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        for n in SIZES + ([BIG // 4 // SIZE] if dtype in BIG_DTYPES else []):
            # Eagerly, rows differ per rank (rank 1 has none in one pattern);
            # inside jax.jit every rank gathers as many rows.
            for pattern, rows, modes in (
                ("one-empty", [0 if r == 1 else n + r for r in range(SIZE)], ("eager",)),
                ("distinct", [n + r for r in range(SIZE)], ("eager",)),
                ("equal", [n] * SIZE, MODES),
            ):
                case = f"allgather/{n}/{pattern}"
                xs = [inputs(r, (rows[r], 4), dtype, case, False) for r in range(SIZE)]
                for mode in modes:
                    fn = krj.allgather if mode == "eager" else jax.jit(krj.allgather)
                    check(f"{case} {dtype.name} {mode}", fn(jnp.asarray(xs[RANK])),
                          np.concatenate(xs), dtype)


def check_grouped_allgather():
    dtypes = REDUCED_DTYPES + MOVED_DTYPES
    shapes = [lambda n: (n, 2), lambda n: (n,), lambda n: (n, 1, 3)]
    for mode in MODES:
        def rows(i, r):
            if mode == "jit":
                return i % 3
            return 0 if (i % 2 and r == 1) else (i + r) % 3

        every = [[inputs(r, shapes[i % 3](rows(i, r)), d, "grouped_ag", False)
                  for r in range(SIZE)] for i, d in enumerate(dtypes)]
        mine = [jnp.asarray(xs[RANK]) for xs in every]
        gather = functools.partial(krj.grouped_allgather, name="grouped_ag")
        outputs = gather(mine) if mode == "eager" else jax.jit(gather)(mine)
        for dtype, xs, out in zip(dtypes, every, outputs):
            check(f"grouped_allgather {dtype.name} {mode}", out, np.concatenate(xs), dtype)


def check_broadcast():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        sizes = SIZES + ([BIG] if dtype in BIG_DTYPES else [])
        every = [[inputs(r, n, dtype, "broadcast", False) for r in range(SIZE)] for n in sizes]
        mine = [jnp.asarray(xs[RANK]) for xs in every]
        for root in range(SIZE):
            for mode in MODES:
                outputs = run_each(mode, functools.partial(krj.broadcast, root_rank=root), mine)
                for n, out, xs in zip(sizes, outputs, every):
                    check(f"broadcast root={root} {dtype.name} n={n} {mode}", out, xs[root],
                          dtype)


def check_reducescatter():
    rows = [0, 1, SIZE, 2 * SIZE + 1, 1001]
    for dtype in REDUCED_DTYPES:
        for op_name, op in OPS.items():
            for scaled in (False, True):
                prescale, postscale = (PRESCALE, POSTSCALE) if scaled else (1.0, 1.0)
                case = f"reducescatter/{op_name}/{scaled}"
                shapes = [(n, 3) for n in rows] + [(2 * SIZE + 1, 2, 2)]
                if dtype in BIG_DTYPES and op_name == "Sum" and not scaled:
                    shapes.append((BIG // 4, 4))
                every = [[inputs(r, s, dtype, case, scaled) for r in range(SIZE)]
                         for s in shapes]
                expected = [scatter_reference(xs, dtype, op_name, prescale, postscale, RANK)
                            for xs in every]
                mine = [jnp.asarray(xs[RANK]) for xs in every]
                scatter = functools.partial(krj.reducescatter, op=op, prescale_factor=prescale,
                                            postscale_factor=postscale)
                for mode in MODES:
                    for shape, out, exp in zip(shapes, run_each(mode, scatter, mine), expected):
                        check(f"{case} {dtype.name} {shape} {mode}", out, exp, dtype)
    # Grouped: one call over every dtype.
    first = [0, 1, SIZE, 2 * SIZE + 1, 7]
    shapes = [(first[i % len(first)], 2) for i in range(len(REDUCED_DTYPES))]
    every = [[inputs(r, s, d, "grouped_rs", False) for r in range(SIZE)]
             for s, d in zip(shapes, REDUCED_DTYPES)]
    mine = [jnp.asarray(xs[RANK]) for xs in every]
    grouped = functools.partial(krj.grouped_reducescatter, op=krj.Sum, name="grouped_rs")
    for mode in MODES:
        outputs = grouped(mine) if mode == "eager" else jax.jit(grouped)(mine)
        for dtype, xs, out in zip(REDUCED_DTYPES, every, outputs):
            check(f"grouped_reducescatter {dtype.name} {mode}", out,
                  scatter_reference(xs, dtype, "Sum", 1.0, 1.0, RANK), dtype)


def check_alltoall():
    for dtype in REDUCED_DTYPES + MOVED_DTYPES:
        for case in ("even", "uneven", "zeros", "one-sender", "none"):
            def rows(r):
                splits = alltoall_splits(r, SIZE, case)
                return 3 * SIZE if splits is None else sum(splits)

            inner = (2, 3) if dtype.kind == "f" else (2,)
            xs = [inputs(r, (rows(r), *inner), dtype, f"alltoall/{case}", False)
                  for r in range(SIZE)]
            expected, received = alltoall_reference(xs, case, RANK)
            x, splits = jnp.asarray(xs[RANK]), alltoall_splits(RANK, SIZE, case)
            what = f"alltoall/{case} {dtype.name}"
            if splits is None:
                for mode in MODES:
                    fn = krj.alltoall if mode == "eager" else jax.jit(krj.alltoall)
                    check(f"{what} {mode}", fn(x), expected, dtype)
                continue
            out, got = krj.alltoall(x, splits=splits)
            check(f"{what} eager", out, expected, dtype)
            check(f"{what} eager received_splits", got, received, np.int32)


def gradient(mode, fn, x, upstream):
    """d sum(fn(x) * upstream) / dx on this rank, eagerly or inside jax.jit."""
    grad = jax.grad(lambda v: jnp.sum(fn(v) * upstream))
    return grad(x) if mode == "eager" else jax.jit(grad)(x)


def check_gradients():
    f32 = np.dtype("float32")
    x = jnp.asarray(inputs(RANK, (4, 3), f32, "grad/x", True))
    ws = [inputs(r, (4, 3), f32, "grad/w", True) for r in range(SIZE)]
    w, total = jnp.asarray(ws[RANK]), np.sum(ws, axis=0)
    for mode in MODES:
        def scaled(t):
            return krj.allreduce(t, op=krj.Sum, prescale_factor=2.0, postscale_factor=3.0)

        check(f"grad allreduce Sum {mode}", gradient(mode, scaled, x, w), total * 6, f32)
        check(f"grad allreduce Average {mode}", gradient(mode, krj.allreduce, x, w),
              total / SIZE, f32)

        def grouped_first(t):
            return krj.grouped_allreduce([t, t.astype(jnp.float64), jnp.arange(3)])[0]

        check(f"grad grouped_allreduce {mode}", gradient(mode, grouped_first, x, w),
              total / SIZE, f32)
        # Only the root's input reaches the outputs: its gradient is every rank's.
        for root in range(SIZE):
            expected = total if RANK == root else np.zeros_like(total)
            check(f"grad broadcast root={root} {mode}",
                  gradient(mode, functools.partial(krj.broadcast, root_rank=root), x, w),
                  expected, f32)
        # allgather: a rank's gradient is the sum of every rank's for its rows.
        gws = [inputs(r, (4 * SIZE, 3), f32, "grad/gw", True) for r in range(SIZE)]
        summed = np.sum(gws, axis=0)[RANK * 4:(RANK + 1) * 4]
        check(f"grad allgather {mode}", gradient(mode, krj.allgather, x, jnp.asarray(gws[RANK])),
              summed, f32)
        # reducescatter: the gathered output gradients, times the map's factor.
        rows = 2 * SIZE + 1
        xr = jnp.asarray(inputs(RANK, (rows, 3), f32, "grad/xr", True))
        bounds = np.cumsum([0] + [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)])
        ups = [inputs(r, (bounds[r + 1] - bounds[r], 3), f32, "grad/up", True)
               for r in range(SIZE)]
        check(f"grad reducescatter Average {mode}",
              gradient(mode, krj.reducescatter, xr, jnp.asarray(ups[RANK])),
              np.concatenate(ups) / SIZE, f32)
        # alltoall (even): each row's gradient goes back to where the row came from.
        xa = jnp.asarray(inputs(RANK, (2 * SIZE, 3), f32, "grad/xa", True))
        ups = [inputs(r, (2 * SIZE, 3), f32, "grad/upa", True) for r in range(SIZE)]
        expected = np.concatenate([u[2 * RANK:2 * RANK + 2] for u in ups])
        check(f"grad alltoall {mode}", gradient(mode, krj.alltoall, xa, jnp.asarray(ups[RANK])),
              expected, f32)
    # Eagerly, with uneven rows and splits.
    rows = [0 if r == 1 else r + 2 for r in range(SIZE)]
    offsets = np.cumsum([0] + rows)
    xg = jnp.asarray(inputs(RANK, (rows[RANK], 3), f32, "grad/xg", True))
    gws = [inputs(r, (sum(rows), 3), f32, "grad/gwu", True) for r in range(SIZE)]
    check("grad allgather uneven", gradient("eager", krj.allgather, xg, jnp.asarray(gws[RANK])),
          np.sum(gws, axis=0)[offsets[RANK]:offsets[RANK + 1]], f32)
    splits = alltoall_splits(RANK, SIZE, "uneven")
    xs = [inputs(r, (sum(alltoall_splits(r, SIZE, "uneven")), 3), f32, "grad/xs", True)
          for r in range(SIZE)]
    ups = [inputs(r, (sum(alltoall_splits(q, SIZE, "uneven")[r] for q in range(SIZE)), 3), f32,
                  "grad/ups", True) for r in range(SIZE)]
    # Rank q's up rows from rank RANK sit after those from ranks before RANK.
    expected = np.concatenate([
        ups[q][sum(alltoall_splits(p, SIZE, "uneven")[q] for p in range(RANK)):][
            :alltoall_splits(RANK, SIZE, "uneven")[q]]
        for q in range(SIZE)
    ])
    got = gradient("eager", lambda t: krj.alltoall(t, splits=splits)[0], jnp.asarray(xs[RANK]),
                   jnp.asarray(ups[RANK]))
    check("grad alltoall uneven", got, expected, f32)


def check_pytrees():
    tree = {"w": jnp.full((3, 2), RANK, jnp.float32),
            "b": [jnp.arange(4, dtype=jnp.float32) * RANK, jnp.ones(2, jnp.int64)]}
    mean = (SIZE - 1) / 2
    for mode in MODES:
        reduce = krj.allreduce_gradients if mode == "eager" else jax.jit(krj.allreduce_gradients)
        out = reduce(tree)
        check(f"allreduce_gradients w {mode}", out["w"], np.full((3, 2), mean, np.float32),
              np.float32)
        check(f"allreduce_gradients b0 {mode}", out["b"][0],
              (np.arange(4.0) * mean).astype(np.float32), np.float32)
        check(f"allreduce_gradients b1 {mode}", out["b"][1], np.ones(2, np.int64), np.int64)
        out = krj.broadcast_parameters(tree, root_rank=SIZE - 1)
        check(f"broadcast_parameters {mode}", out["w"],
              np.full((3, 2), SIZE - 1, np.float32), np.float32)


def check_names_used_again():
    """A name used in two jitted functions and eagerly: each call matches across ranks."""
    x = jnp.arange(3, dtype=jnp.float32) + RANK
    total = sum(np.arange(3, dtype=np.float32) + r for r in range(SIZE))
    first = jax.jit(lambda v: krj.allreduce(v, op=krj.Sum, name="again"))
    second = jax.jit(lambda v: krj.allreduce(2 * v, op=krj.Sum, name="again"))
    for what, got, expected in (("first jit", first(x), total),
                                ("second jit", second(x), 2 * total),
                                ("eager", krj.allreduce(x, op=krj.Sum, name="again"), total),
                                ("first jit again", first(x), total)):
        check(f"name used again: {what}", got, expected, np.float32)


def check_process_set():
    """Collectives among a subset of the ranks: sizes, ranks and roots count within it."""
    members = [0, SIZE - 1]
    subset = krj.add_process_set(members)
    if subset.included():
        x = jnp.arange(4, dtype=jnp.float32) + RANK
        expected = sum(np.arange(4, dtype=np.float32) + r for r in members)
        for mode in MODES:
            reduce = functools.partial(krj.allreduce, op=krj.Sum, process_set=subset)
            got = reduce(x) if mode == "eager" else jax.jit(reduce)(x)
            check(f"process set allreduce {mode}", got, expected, np.float32)
        gathered = krj.allgather(jnp.full((1, 2), RANK, jnp.int32), process_set=subset)
        check("process set allgather", gathered,
              np.array([[r, r] for r in members], np.int32), np.int32)
        root = members[-1]
        check("process set broadcast",
              krj.broadcast(jnp.full(3, RANK, jnp.int32), root, process_set=subset),
              np.full(3, root, np.int32), np.int32)
    krj.remove_process_set(subset)


def check_errors():
    """Bad input fails on every rank, naming the tensor and what each rank sent."""
    try:
        krj.allreduce(jnp.ones(3 + RANK), name="mismatched")
    except ValueError as e:
        if "'mismatched'" not in str(e) or "rank 1" not in str(e):
            check.failures.append(f"rank {RANK}: unclear mismatch error: {e}")
    else:
        check.failures.append(f"rank {RANK}: a shape mismatch did not fail")
    # Inside jax.jit a gather of unequal rows cannot fit its traced shape.
    try:
        jax.block_until_ready(jax.jit(functools.partial(krj.allgather, name="unequal"))(
            jnp.ones((1 + RANK, 2))))
    except Exception as e:  # noqa: BLE001 (the check is of the words)
        if "'unequal'" not in str(e) or "traced" not in str(e):
            check.failures.append(f"rank {RANK}: unclear unequal-rows error: {e}")
    else:
        if RANK != (SIZE - 1) // 2 or SIZE == 2:
            check.failures.append(f"rank {RANK}: unequal rows inside jax.jit did not fail")
    for bad, words in ((lambda: krj.allreduce(jnp.ones(2, bool)), "does not support dtype bool"),
                       (lambda: krj.allreduce(jnp.ones(2, jnp.complex64)), "complex64"),
                       (lambda: krj.allgather(jnp.float32(1)), "scalar"),
                       (lambda: krj.grouped_allreduce(jnp.ones(2)), "list of arrays")):
        try:
            bad()
        except (TypeError, ValueError) as e:
            if words not in str(e):
                check.failures.append(f"rank {RANK}: unclear error {e!r}, wanted {words!r}")
        else:
            check.failures.append(f"rank {RANK}: no error for {words!r}")


for section in (check_allreduce, check_grouped_allreduce, check_allgather,
                check_grouped_allgather, check_broadcast, check_reducescatter, check_alltoall,
                check_gradients, check_pytrees, check_names_used_again, check_process_set,
                check_errors):
    section()

krj.shutdown()
if check.failures:
    print("\n".join(check.failures[:40]), file=sys.stderr)
    print(f"rank {RANK}: {len(check.failures)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {RANK}: jax ops ok")
