"""UpdateEpochStateCallback: the state counts the epochs done."""

import keras

from keras_ring.elastic import _validation


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs done.

    At the end of each epoch `state.epoch` becomes the number of epochs
    completed, counting those of earlier calls of the function that
    `keras_ring.elastic.run` wraps: the first epoch of a `fit` is taken to be
    epoch `state.epoch`. Both ways of resuming therefore count right:

    - `fit(epochs=EPOCHS - state.epoch)`, as in Horovod's examples (Keras
      numbers the epochs from 0 in each call);
    - `fit(initial_epoch=state.epoch, epochs=EPOCHS)` (Keras numbers them
      from `state.epoch`, and its progress bar shows the job's epoch).

    The order of this callback, `UpdateBatchStateCallback` and
    `CommitStateCallback` in the callbacks list does not matter.

    Args:
        state: A `keras_ring.elastic` state with an `epoch` attribute.

    Raises:
        TypeError: If `state` is not a `keras_ring.elastic.State`.
        ValueError: If it has no `epoch` attribute.

    Example:

    ```python
    state = kr.elastic.KerasState(model, epoch=0, batch=0)

    @kr.elastic.run
    def train(state):
        model.fit(dataset, initial_epoch=state.epoch, epochs=10,
                  callbacks=[kr.elastic.CommitStateCallback(state),
                             kr.elastic.UpdateEpochStateCallback(state)])
    ```
    """

    def __init__(self, state):
        super().__init__()
        _validation.check_state(state, "epoch")
        self.state = state
        self._start = 0  # state.epoch when the fit's first epoch began
        self._first_epoch = None  # Keras's index of the fit's first epoch

    def on_train_begin(self, logs=None):
        self.state._follow(self)
        self._first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            # Read here, after every callback's on_train_begin: a
            # BackupAndRestore that resumes the job sets state.epoch there.
            self._start = int(self.state.epoch)
            self._first_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._start + epoch - self._first_epoch + 1
