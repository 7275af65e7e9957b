"""Data-parallel ranks hold the same weights: the checks that they do, and `KERAS_RING_DIVERGENCE`.

Ranks that start from different weights, or whose weights drift apart, train
a model each without a word: the loss still falls on every rank. Two checks
compare a checksum of the ranks' trainable weights (their bits, so it costs
one read of them and no collective but a row of integers):

- at a `DistributedOptimizer`'s first update (`check_same_start`), which
  needs no callback: different weights there are an error, since a
  broadcast before the first step is the only right start;
- at each epoch end of a `fit` with a keras-ring callback
  (`callbacks/_sync.py`), with the learning rates: a warning by default,
  since ranks on hosts of different CPUs may round differently.

`KERAS_RING_DIVERGENCE=error` makes both errors, `=warn` both warnings.
"""

import os
import zlib

import keras
import numpy as np

from keras_ring.core import _basics, _elastic_world, _host_collectives, _log

VARIABLE = "KERAS_RING_DIVERGENCE"
_MODES = ("warn", "error")
_START_NAME = "keras_ring.optimizer.first_update"


def mode():
    """`KERAS_RING_DIVERGENCE`: "warn", "error", or "" (the default: an error at the start only).

    Raises:
        ValueError: If the variable holds anything else, on every rank at the
            first update.
    """
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value and value not in _MODES:
        raise ValueError(f"keras-ring: {VARIABLE} must be warn or error. "
                         f"Received: {VARIABLE}={os.environ[VARIABLE]}")
    return value


def weights_digest(values):
    """A checksum of the values (variables or arrays), bit for bit, in their order."""
    digest = 0
    for value in values:
        digest = zlib.crc32(np.ascontiguousarray(keras.ops.convert_to_numpy(value)), digest)
    return digest


def agreeing_ranks(ranks, digests):
    """'[0, 2]; [1]': the ranks grouped by the digest they hold, for a message."""
    groups = {}
    for rank, digest in zip(ranks, digests):
        groups.setdefault(digest, []).append(rank)
    return "; ".join(str(group) for group in groups.values())


def _own_loop():
    """How a training loop of the user's own gives every rank the root's weights."""
    if keras.backend.backend() == "jax":
        return ("give the values your jax.jit step starts from to "
                "keras_ring.jax.broadcast_parameters(values, root_rank=0)")
    return ("call keras_ring.broadcast_variables(model.variables, root_rank=0) once the model "
            "is built (it has variables)")


def check_same_start(values, process_set):
    """Raises, on every rank, if the ranks' weights differ before their first update.

    Collective over `process_set`: every member calls it at its
    `DistributedOptimizer`'s first update (eagerly, in a traced step while
    TF traces it). Skipped in an elastic job, whose state's `sync()` gives
    every rank the same weights and whose new workers' first update is not
    the others'.

    Args:
        values: The values (NumPy arrays) of the variables the optimizer
            updates, without the local ones (which differ by design).
        process_set: The `ProcessSet` whose ranks average the gradients.

    Raises:
        RuntimeError: If the weights differ, naming the ranks that agree
            (a warning on the set's first rank instead under
            `KERAS_RING_DIVERGENCE=warn`).
    """
    setting = mode()  # read first, so that a wrong value is an error on every rank
    if _elastic_world.is_elastic() or process_set.size() == 1:
        return
    values = list(values)
    row = np.array([[_basics.rank(), len(values), weights_digest(values)]], np.int64)
    rows = _host_collectives.allgather(row, _START_NAME, process_set)
    ranks, counts, digests = rows.T.tolist()
    if len(set(digests)) == 1:
        return
    sizes = "" if len(set(counts)) == 1 else (
        " Their models differ too: trainable variables "
        + ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts)) + ".")
    message = (
        "the ranks would start training from different weights (ranks that agree: "
        f"{agreeing_ranks(ranks, digests)}), so each would train a model of its own: "
        f"DistributedOptimizer averages the gradients, not the weights.{sizes} Give every rank "
        "the root's weights before the first step: pass "
        f"keras_ring.callbacks.BroadcastGlobalVariablesCallback(0) to fit(), or {_own_loop()}, "
        "before a training loop of your own. Variables that differ "
        "between ranks by design must be registered with optimizer.register_local_var(variable)."
    )
    if setting != "warn":
        raise RuntimeError(f"keras-ring: {message} ({VARIABLE}=warn makes this a warning.)")
    if _basics.rank() == ranks[0]:
        _log.warning(message[0].upper() + message[1:], once=True)
