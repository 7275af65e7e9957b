"""Odd and bad input, each ending as documented: the right result or a clear error.

`keras-ring-run -np 2 python tests/workers/bad_input_worker.py CASE...`; each
case prints `rank <r>: <case> ok` or `rank <r>: <case> FAILED: <why>` for
tests/test_bad_input.py. Every rank makes every rank's input, so it checks the
result against NumPy itself.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
import threading

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras_ring as kr  # noqa: E402
from keras_ring.core import _engine  # noqa: E402

SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.0], np.float32)
REFERENCE = {"Sum": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def special_values(rank, n):
    """`n` float32 values, a third of them NaN or infinite, seeded by rank."""
    rng = np.random.default_rng([7, rank, n])
    return rng.choice(SPECIALS, n).astype(np.float32)


def nan_and_inf():
    """NaN and infinities reduce as NumPy's ufuncs do, on both data paths' sizes."""
    problems = []
    for n in (1, 7, 100_003):  # one element, odd, and past one shared-memory round
        inputs = [special_values(r, n) for r in range(kr.size())]
        for name, ufunc in REFERENCE.items():
            with np.errstate(all="ignore"):
                want = ufunc.reduce(np.stack(inputs), axis=0)
            got = kr.allreduce(inputs[kr.rank()], op=getattr(kr, name),
                               name=f"special.{name}.{n}").numpy()
            if not np.array_equal(got, want, equal_nan=True):
                bad = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))))
                problems.append(f"{name} of {n}: at {bad[:5]} got {got[bad[:5]]}, "
                                f"wanted {want[bad[:5]]}")
        with np.errstate(all="ignore"):
            mean = (np.sum(np.stack(inputs), axis=0) / kr.size()).astype(np.float32)
        got = kr.allreduce(inputs[kr.rank()], op=kr.Average, name=f"special.Average.{n}").numpy()
        if not np.array_equal(got, mean, equal_nan=True):
            problems.append(f"Average of {n} differs from NumPy's")
    return problems


def empty_and_scalar():
    """Empty tensors and 0-d tensors give the right result; a 0-d allgather is refused."""
    problems = []
    for shape in ([0], [3, 0], [0, 5]):
        x = tf.zeros(shape)
        for what, got, want in (
            ("allreduce", kr.allreduce(x, name=f"empty.ar.{shape}"), shape),
            ("broadcast", kr.broadcast(x, 0, name=f"empty.bc.{shape}"), shape),
            ("allgather", kr.allgather(x, name=f"empty.ag.{shape}"),
             [shape[0] * kr.size(), *shape[1:]]),
        ):
            if list(got.shape) != want:
                problems.append(f"{what} of shape {shape} gave shape {got.shape}")
    scalar = kr.allreduce(tf.constant(float(kr.rank() + 1)), op=kr.Sum, name="scalar.ar")
    if scalar.shape != () or float(scalar) != sum(range(1, kr.size() + 1)):
        problems.append(f"0-d allreduce gave {scalar!r}")
    root = kr.broadcast(tf.constant(kr.rank() + 10), 1, name="scalar.bc")
    if int(root) != 11:
        problems.append(f"0-d broadcast gave {root!r}")
    try:
        kr.allgather(tf.constant(1.0), name="scalar.ag")
        problems.append("a 0-d allgather ran")
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        if "rank" not in str(e):
            problems.append(f"0-d allgather's error: {e}")
    return problems


def strings():
    """A string tensor is refused before anything is sent, naming the dtypes taken."""
    problems = []
    for call in (lambda: kr.allreduce(tf.constant(["a", "b"])),
                 lambda: kr.allgather(tf.constant(["a"])),
                 lambda: kr.broadcast(tf.constant(["a"]), 0)):
        try:
            call()
            problems.append("a string tensor was accepted")
        except TypeError as e:
            if "string" not in str(e) or "float32" not in str(e):
                problems.append(f"string tensor's error: {e}")
    return problems


def over_2_gib():
    """A tensor of more than 2**31 bytes and elements reduces right, past the int32 range."""
    n, chunk = 2**31 + 5, 2**28  # checked a chunk at a time: each rank holds 4 GiB at once
    x = tf.fill([n], tf.constant(kr.rank() + 1, tf.int8))
    got = kr.allreduce(x, op=kr.Sum, name="big.int8")
    del x
    want = sum(range(1, kr.size() + 1))
    if got.shape != (n,):
        return [f"allreduce of {n} int8 gave shape {got.shape}"]
    for start in range(0, n, chunk):
        part = got[start : start + chunk].numpy()
        if not (part == want).all():
            wrong = np.flatnonzero(part != want)[:5]
            return [f"allreduce of {n} int8 gave {part[wrong]} at {start + wrong}"]
    return []


def shutdown_with_a_pending_op():
    """shutdown() while another thread waits for a collective fails it, with no hang."""
    outcome = {}
    thread = None
    if kr.rank() == 0:
        # Enqueued here, so pending before shutdown(); rank 1 never submits the name.
        handle = _engine.submit(_engine.ALLREDUCE, np.ones(4, np.float32),
                                "pending.until.shutdown", op=kr.Sum)

        def waiter():
            try:
                handle.wait()
                outcome["error"] = None
            except Exception as e:  # noqa: BLE001 - what it raised is the result
                outcome["error"] = e

        thread = threading.Thread(target=waiter)
        thread.start()
    kr.shutdown()
    problems = []
    if thread is not None:
        thread.join(timeout=60)
        error = outcome.get("error", "no end")
        if thread.is_alive():
            problems.append("the pending allreduce still waits after shutdown()")
        # Its own shutdown() or rank 1's, whichever the engine saw first; naming the tensor.
        elif error is None or "'pending.until.shutdown'" not in str(error) or not (
                "shutdown()" in str(error) or "shut down" in str(error)):
            problems.append(f"the pending allreduce ended with {error!r}")
    kr.init()  # the job goes on: init() may be called again
    total = kr.allreduce(np.float32(1.0), op=kr.Sum, name="after.shutdown")
    if float(total) != kr.size():
        problems.append(f"allreduce after init() again gave {total}")
    return problems


CASES = {"nan_and_inf": nan_and_inf, "empty_and_scalar": empty_and_scalar,
         "strings": strings, "over_2_gib": over_2_gib,
         "shutdown_with_a_pending_op": shutdown_with_a_pending_op}


def main():
    kr.init()
    for case in sys.argv[1:]:
        problems = CASES[case]()
        outcome = "ok" if not problems else "FAILED: " + "; ".join(problems)
        print(f"rank {kr.rank()}: {case} {outcome}", flush=True)
        kr.barrier()


if __name__ == "__main__":
    main()
