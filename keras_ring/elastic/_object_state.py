"""ObjectState: picklable Python values kept across the resets of an elastic job."""

import copy

from keras_ring.core import _objects
from keras_ring.elastic._state import State


class ObjectState(State):
    """Python values that every rank keeps, commits and gets back after a reset.

    Each keyword argument becomes an attribute of the state. `save()` (and
    `commit()`) keeps a copy of their values, `restore()` puts that copy
    back, and `sync()` gives every rank rank 0's saved values (one
    `keras_ring.broadcast_object`). The copy is a deep copy: a list changed
    in place after a commit does not change what was committed.

    Args:
        **kwargs: The attributes and their initial values: picklable objects
            (numbers, strings, lists, dicts, NumPy arrays). The initial
            values are the first saved ones.

    Raises:
        ValueError: If a name starts with an underscore or is one of the
            state's methods.

    Example:

    ```python
    state = kr.elastic.ObjectState(epoch=0, losses=[])

    @kr.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 10):
            state.losses.append(train_one_epoch())
            state.commit()

    train(state)
    ```
    """

    def __init__(self, **kwargs):
        super().__init__()
        for name in kwargs:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(
                    "The state's attributes may not start with an underscore or be named after "
                    f"a method of {type(self).__name__}. Received: {name}={kwargs[name]!r}"
                )
        self._saved_attributes = copy.deepcopy(kwargs)
        self._put_back_attributes()

    def save(self):
        """Keeps a copy of the attributes' values.

        Example:

        ```python
        state.epoch = 2
        state.save()
        ```
        """
        self._saved_attributes = {
            name: copy.deepcopy(getattr(self, name)) for name in self._saved_attributes
        }

    def restore(self):
        """Gives the attributes the values of the last save or commit.

        Example:

        ```python
        state.epoch = 5
        state.restore()  # state.epoch is back to its committed value
        ```
        """
        self._put_back_attributes()

    def sync(self):
        """Gives every rank rank 0's saved values, as attributes and as the saved copy.

        Collective.

        Example:

        ```python
        state.sync()  # a newcomer now has rank 0's epoch
        ```
        """
        self._saved_attributes = _objects.broadcast_object(
            self._saved_attributes, 0, name="keras_ring.elastic.sync.attributes"
        )
        self._put_back_attributes()

    def _put_back_attributes(self):
        for name, value in self._saved_attributes.items():
            setattr(self, name, copy.deepcopy(value))
