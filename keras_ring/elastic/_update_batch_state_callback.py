"""UpdateBatchStateCallback: the state counts the epoch's batches; resumed, it runs the rest."""

import keras

from keras_ring.core import _log
from keras_ring.elastic import _validation


class _EndOfResumedEpoch:
    """`model.stop_training` while a resumed epoch ends early: true, so that Keras ends the
    epoch's loop, and told apart from the `True` of a callback that stops training."""

    def __bool__(self):
        return True

    def __repr__(self):
        return "<keras_ring.elastic: end of a resumed epoch>"


END_OF_RESUMED_EPOCH = _EndOfResumedEpoch()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of batches done in the current epoch.

    After each batch `state.batch` is the number of batches of the epoch
    done so far, and 0 at the end of the epoch, so a commit records where in
    the epoch training is. A `fit` that starts with `state.batch > 0` (the
    function was called again after a worker was lost mid-epoch) resumes
    that epoch: its first epoch runs only the `steps_per_epoch - state.batch`
    batches left, then validates and ends as any epoch does (`on_epoch_end`
    for every callback). The following epochs run every batch.

    Keras 3 ignores a change of `params["steps"]`, through which Horovod
    shortens the epoch, so the resumed epoch ends by setting
    `model.stop_training` to a marker after its last batch (Keras then leaves
    the epoch's loop), which is reset at the epoch's end unless a callback
    (`EarlyStopping`, `TerminateOnNaN`) set it to `True` meanwhile: those still
    stop training. Shortening needs Keras to know the steps per epoch: pass
    `steps_per_epoch` to `fit` (with `dataset.repeat()`), or data of known
    length. Without it the resumed epoch runs all its batches, and rank 0
    warns.

    The order of this callback, `UpdateEpochStateCallback` and
    `CommitStateCallback` in the callbacks list does not matter: the commit
    sees the batch and epoch of the step it commits.

    Args:
        state: A `keras_ring.elastic` state with a `batch` attribute.

    Raises:
        TypeError: If `state` is not a `keras_ring.elastic.State`.
        ValueError: If it has no `batch` attribute.

    Example:

    ```python
    state = kr.elastic.KerasState(model, epoch=0, batch=0)

    @kr.elastic.run
    def train(state):
        model.fit(dataset.repeat().skip(state.batch), steps_per_epoch=100,
                  epochs=10 - state.epoch,
                  callbacks=[kr.elastic.CommitStateCallback(state, batches_per_commit=10),
                             kr.elastic.UpdateBatchStateCallback(state),
                             kr.elastic.UpdateEpochStateCallback(state)])
    ```
    """

    def __init__(self, state):
        super().__init__()
        _validation.check_state(state, "batch")
        self.state = state
        self._resume_at = 0  # batches of the fit's first epoch done before this fit
        self._offset = 0  # batches of the current epoch done before this fit

    def on_train_begin(self, logs=None):
        self.state._follow(self)
        self._resume_at = int(self.state.batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._offset, self._resume_at = self._resume_at, 0
        if self._offset and not self.params.get("steps"):
            _log.warning(
                f"keras-ring: the epoch resumed at batch {self._offset} runs all its batches: "
                "Keras does not know the number of steps per epoch, so the batches left are "
                "unknown. Pass steps_per_epoch to fit().",
                once=True,
            )
            self._offset = 0
        self.state.batch = self._offset

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        steps = self.params.get("steps")
        if self._offset and steps and self.state.batch >= steps and not self.model.stop_training:
            self.model.stop_training = END_OF_RESUMED_EPOCH

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        if self.model.stop_training is END_OF_RESUMED_EPOCH:
            self.model.stop_training = False
