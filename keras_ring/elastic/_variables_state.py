"""VariablesState: variables copied to host memory at each commit (KerasState, TensorFlowState)."""

import zlib

import keras
import numpy as np

from keras_ring.core import _host_collectives, _objects
from keras_ring.elastic._object_state import ObjectState


class VariablesState(ObjectState):
    """Variables and attributes that every rank commits and gets back after a reset.

    `save()` (and `commit()`) copies the variables into host memory as NumPy
    arrays, with the attributes; `restore()` assigns the copy back; `sync()`
    gives every rank rank 0's variables in one broadcast per dtype, then its
    saved attributes, and saves. Subclasses say which variables
    (`_variables()`) and how to name them in an error (`_DIFFER`).
    """

    # What differs between the ranks when their variables do not match, and what to do.
    _DIFFER = ("variables", "Make the same variables on every rank")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._saved_variables = self._read_variables()

    def save(self):
        """Copies the variables into host memory, and saves the attributes.

        Example:

        ```python
        state.save()  # commit() without the check for host updates
        ```
        """
        self._saved_variables = self._read_variables()
        super().save()

    def restore(self):
        """Assigns the variables and attributes their values of the last save or commit.

        Example:

        ```python
        state.restore()  # the variables of the last commit
        ```
        """
        for variable, value in zip(self._variables(), self._saved_variables):
            variable.assign(value)
        super().restore()

    def sync(self):
        """Gives every rank rank 0's variables and saved attributes, then saves. Collective.

        Rank 0's variables as they are, which in `keras_ring.elastic.run` is
        its last commit: run syncs after a restore, after the commit that
        raised `HostsUpdatedInterrupt`, or before training starts.

        Raises:
            ValueError: On every rank, if the ranks' variables differ (their
                count, shapes or dtypes).

        Example:

        ```python
        state.sync()  # a newcomer now has rank 0's variables
        ```
        """
        variables = self._variables()
        values = self._read_variables()
        self._check_same_variables(values)
        received = _host_collectives.broadcast_values(values, 0, "keras_ring.elastic.sync")
        for variable, value in zip(variables, received):
            variable.assign(value)
        super().sync()
        self._saved_variables = self._read_variables()

    def _variables(self):
        raise NotImplementedError

    def _read_variables(self):
        # convert_to_numpy copies: the saved arrays do not follow the variables.
        return [keras.ops.convert_to_numpy(v) for v in self._variables()]

    def _check_same_variables(self, values):
        """Raises on every rank unless every rank has variables of the same shapes and dtypes."""
        layout = "\n".join(f"{value.shape} {value.dtype.name}" for value in values)
        mine = np.array([[len(values), zlib.crc32(layout.encode())]], np.int64)
        every = _objects._run("ALLGATHER", mine, "keras_ring.elastic.sync.layout")
        if (every == every[0]).all():
            return
        counts = ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(every[:, 0]))
        what, advice = self._DIFFER
        raise ValueError(
            f"keras-ring: {type(self).__name__}.sync: the ranks' {what} differ, so rank 0's "
            f"state cannot be given to every rank (variables per rank: {counts}; their shapes "
            f"or dtypes differ where the counts agree). {advice} on every rank, a newcomer "
            "included, before calling the function kr.elastic.run wraps."
        )
