"""CommitStateCallback: commits the state every few batches and at each epoch's end."""

import keras

from keras_ring.elastic import _validation
from keras_ring.elastic._update_batch_state_callback import END_OF_RESUMED_EPOCH
from keras_ring.keras.callbacks._validation import check_integer


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every `batches_per_commit` batches and at the end of every epoch.

    A worker lost during training sends every survivor back to the last
    commit, so a commit every few batches bounds the work lost; each commit
    copies the state into host memory and costs one small broadcast (the
    check for host updates). The last batch of an epoch is committed at the
    epoch's end instead, after validation and with the epoch counted: a
    worker lost during validation then sends training back to that last
    batch, never to an epoch with no batch left to run.

    Before committing it brings the state's batch and epoch up to date
    (`UpdateBatchStateCallback`, `UpdateEpochStateCallback`), wherever they
    stand in the callbacks list (horovod#2652, #2844).

    Args:
        state: The `keras_ring.elastic` state to commit.
        batches_per_commit: Commit after this many batches.

    Raises:
        TypeError: If `state` is not a `keras_ring.elastic.State`.
        ValueError: If `batches_per_commit` is not a positive integer.
        HostsUpdatedInterrupt: At a commit, on every rank, when the world
            should re-form (`keras_ring.elastic.run` handles it).

    Example:

    ```python
    callbacks = [kr.elastic.CommitStateCallback(state, batches_per_commit=10),
                 kr.elastic.UpdateBatchStateCallback(state),
                 kr.elastic.UpdateEpochStateCallback(state)]
    ```
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        _validation.check_state(state)
        check_integer("batches_per_commit", batches_per_commit, 1)
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._uncommitted = 0  # batches since the last commit
        self._last_batch = -1  # Keras's index of the last batch ended in this epoch

    def on_train_begin(self, logs=None):
        self._uncommitted = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1 one call ends several batches.
        self._uncommitted += batch - self._last_batch
        self._last_batch = batch
        for callback in self.state._progress_callbacks_of(self.params):
            callback.on_train_batch_end(batch, logs)
        steps = self.params.get("steps")
        epoch_ends = self.model.stop_training is END_OF_RESUMED_EPOCH or (
            steps and batch + 1 >= steps)
        if self._uncommitted >= self.batches_per_commit and not epoch_ends:
            self._commit()

    def on_epoch_end(self, epoch, logs=None):
        for callback in self.state._progress_callbacks_of(self.params):
            callback.on_epoch_end(epoch, logs)
        self._commit()

    def _commit(self):
        self._uncommitted = 0
        self.state.commit()
