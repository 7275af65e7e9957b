"""Collectives on NumPy arrays and Keras variables, over the engine's NumPy binding.

The Keras layer's eager exchanges (callbacks, checks, elastic state) use
these: they need no framework and work under every Keras backend. A
variable is read with `keras.ops.convert_to_numpy` and written with
`assign`, which every backend offers.
"""

import keras
import numpy as np

from keras_ring.core import _basics
from keras_ring.core._process_sets import process_set_id, root_index


def _engine():
    return _basics._engine()


def allgather(array, name, process_set=None):
    """Concatenates every rank's array along its first dimension, in rank order."""
    engine = _engine()
    return engine.run(engine.ALLGATHER, [np.ascontiguousarray(array)], [name],
                      process_set=process_set_id(process_set))[0]


def allreduce(array, op, name, process_set=None):
    """Reduces an array over the ranks with `op` (a `keras_ring` reduce op)."""
    engine = _engine()
    return engine.run(engine.ALLREDUCE, [np.ascontiguousarray(array)], [name], op=int(op),
                      process_set=process_set_id(process_set))[0]


def broadcast_values(values, root_rank, name, process_set=None):
    """Every rank receives `root_rank`'s arrays: one broadcast per dtype, end to end.

    Args:
        values: NumPy arrays of the same shapes and dtypes on every rank.
        root_rank: A rank of the job (and of `process_set`).
        name: Names the broadcasts (`<name>.<dtype>`).

    Returns:
        The root's arrays, in order.
    """
    by_dtype = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype.name, []).append(i)
    if not by_dtype:
        return []
    engine = _engine()
    received = engine.run(
        engine.BROADCAST,
        [np.concatenate([values[i].ravel() for i in indices]) for indices in by_dtype.values()],
        [f"{name}.{dtype}" for dtype in by_dtype],
        root_rank=root_index(process_set, root_rank),
        process_set=process_set_id(process_set),
    )
    results = [None] * len(values)
    for indices, buffer in zip(by_dtype.values(), received):
        offset = 0
        for i in indices:
            results[i] = buffer[offset:offset + values[i].size].reshape(values[i].shape)
            offset += values[i].size
    return results


def broadcast_variables(variables, root_rank, name, process_set=None):
    """Assigns every rank's variables the values of `root_rank`'s.

    Args:
        variables: Keras variables (or any with `assign`) of the same shapes
            and dtypes on every rank, in the same order.
    """
    variables = list(variables)
    values = [keras.ops.convert_to_numpy(v) for v in variables]
    for variable, value in zip(variables, broadcast_values(values, root_rank, name,
                                                           process_set)):
        variable.assign(value)
