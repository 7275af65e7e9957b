"""BackupAndRestore: Keras's backup for fault tolerance, written by rank 0, restored everywhere."""

import json
import os

from keras_ring.core import _basics, _elastic_world, _host_collectives, _objects
from keras_ring.keras import _files
from keras_ring.keras.callbacks import _sync

_NAME = "keras_ring.callbacks.backup_and_restore"
# Files go through keras_ring.keras._files: local paths without TensorFlow, remote
# ones through tf.io.gfile, as Keras's private keras.src.utils.file_utils does.


def _unbuilt_message(model):
    # Keras's own message for a model that is not built when fit() starts.
    return (
        "To use the BackupAndRestore callback, "
        "you model must be built before you call `fit()`. "
        f"Model {model} is unbuilt. You can build it "
        "beforehand by calling it on a batch of data."
    )


class BackupAndRestore(_sync.SyncedCallback):
    """Keras's `BackupAndRestore` for data-parallel training: one backup, written by rank 0.

    Backs up the training state (model weights, optimizer variables, and the
    epoch reached) in `backup_dir` during `fit`, and restores it at the start
    of the next `fit` after an interruption, as
    `keras.callbacks.BackupAndRestore` does: the same arguments, the same
    files (`latest.weights.h5`, `training_metadata.json`, and their `.bkp`
    copies with `double_checkpoint=True`), the same moments, and the backup
    deleted at the end of a `fit` that completes. Keras's own callback, given
    one `backup_dir` on every rank, has every rank write the same file (h5py
    then fails to lock it); this one differs only in who touches the disk:

    - Only rank 0 writes the backup, and deletes it at the end.
    - At the start of training rank 0 reads the backup if there is one, and
      every rank receives the restored weights and optimizer variables and
      the epoch to resume from through keras-ring's collectives: no other
      rank needs to see rank 0's disk, and every rank resumes at the same
      epoch, from the same state.

    As with Keras's callback, `fit` resumes at the beginning of the epoch the
    backup records. With `save_freq` a number of batches, the backup written
    during an epoch holds the weights of that moment, and `fit` runs that
    epoch again from its first batch (Keras records the batch but does not
    resume within an epoch).

    In an elastic job (inside the function `keras_ring.elastic.run` wraps)
    it works with the state, so that a job that lost every worker resumes
    when run again: the job's first `fit` restores the backup, and what it
    restored becomes the state's first commit (`state.epoch` included);
    after a reset the commit in memory, which is newer, is what training
    goes on from, and the backup is not read again. The backup records the
    job's epoch as the state counts it, also in a `fit` that started after
    a reset (and numbers its epochs from 0).

    With one rank it behaves as Keras's callback, with these differences:

    - A model built lazily (a `keras.Sequential` without `keras.Input`, a
      subclassed model never called) has no variables when `fit` starts, and
      Keras's callback refuses it with a `ValueError`. This one records the
      model's build config (`model.get_build_config()`) in the training
      metadata and, when it finds a backup for a model that is not built,
      builds the model from it (`model.build_from_config`) before restoring.
      Without a backup it leaves the model to be built by the first step.
    - A backup written during an epoch records that epoch even when the
      callback was created for the resumed `fit` (Keras's records epoch 0
      until the first epoch of that `fit` ends).
    - The epoch to resume from applies to the `fit` that restored it only
      (Keras's remains on the model for the `fit` calls after it).

    Random-number states (the seeds of `Dropout` and similar layers) are not
    in the backup, as with Keras's callback; each rank keeps its own.
    Non-trainable state that differs between ranks (each rank's own
    batch-normalisation statistics) is restored from rank 0's backup on
    every rank.

    Every rank must pass this callback, in the same place of the list (only
    rank 0 reads and writes files, but every rank takes part in the restore).
    Its place relative to `BroadcastGlobalVariablesCallback` does not matter,
    because it broadcasts what it restores itself: after the broadcast, whose
    fresh weights of the root it then replaces on every rank, or before it,
    which then broadcasts the restored state again. Like the other keras-ring
    callbacks that communicate, it checks at each step that all ranks are in
    step (see `keras_ring.callbacks`). Use a `DistributedOptimizer`, so that
    the ranks' states stay equal and rank 0's backup holds every rank's state.

    Args:
        backup_dir: The directory where rank 0 keeps the backup; reserved for
            it (no other callback or training run may write there). Other
            ranks never read it, so it may be a directory on rank 0's host.
        save_freq: `"epoch"` to back up at the end of each epoch, or an
            integer: back up every `save_freq` batches.
        double_checkpoint: Keep the previous backup as well; if the latest
            cannot be read (a corrupted file), restore the previous one.
        delete_checkpoint: Delete `backup_dir` at the end of a `fit` that
            completes.

    Raises:
        ValueError: If `backup_dir` is empty or `save_freq` is neither
            `"epoch"` nor an integer (as Keras checks them); at the start of
            training, on every rank, if the model is not built and the backup
            does not record how to build it, or if the ranks' models or
            optimizers differ. What rank 0 raises when it reads the backup
            (`OSError` for a corrupted file that has no previous copy) is
            raised on rank 0, and as a `RuntimeError` naming it on the others.

    Example:

    ```python
    kr.init()
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        # The same directory on every rank; rank 0 alone writes it.
        kr.callbacks.BackupAndRestore("/shared/run42/backup"),
    ]
    # After an interruption, run the same script again: fit resumes at the
    # epoch the backup records, on every rank.
    model.fit(x, y, epochs=100, callbacks=callbacks)
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
    ):
        super().__init__()
        # Keras's checks, paths and counters (keras/src/callbacks/backup_and_restore.py).
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self._batches_seen_since_last_saving = 0
        self._last_batch_seen = 0
        self._current_epoch = 0
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        self.backup_dir = backup_dir
        self._weights_path = os.path.join(backup_dir, "latest.weights.h5")
        self._training_metadata_path = os.path.join(backup_dir, "training_metadata.json")
        self._prev_weights_path = f"{self._weights_path}.bkp"
        self._prev_training_metadata_path = f"{self._training_metadata_path}.bkp"
        if save_freq != "epoch" and not isinstance(save_freq, int):
            raise ValueError(
                "Invalid value for argument `save_freq`. "
                f"Received: save_freq={save_freq}. "
                "Expected either 'epoch' or an integer value."
            )
        self._resumed = False  # this fit's first epoch came from the backup
        self._epoch_offset = None  # the job's epoch minus Keras's, from the fit's first epoch

    # Restoring.

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self._resumed:  # left by an interrupted fit that this callback resumed
            self.model._initial_epoch = None
            self._resumed = False
        self._epoch_offset = None
        root = _basics.rank() == 0
        # In an elastic job the backup is read once, into the state: after a
        # reset the state's commit in memory is the newer (rank 0 decides).
        state = _elastic_world.running_state()
        read = state is not None and state._backup_read
        model = self.model
        if not model.built:
            # Every rank builds the model the same way, and the optimizer too:
            # a DistributedOptimizer may communicate once built.
            plan = ("none",) if read else self._build_plan() if root else None
            plan = self._share("build", plan)
            if plan[0] == "none":
                if state is not None:
                    state._backup_read = True
                return  # nothing to restore: the first step builds the model
            if plan[0] == "error":
                raise ValueError(plan[1])
            model.build_from_config(plan[1])
            if not model.built:
                raise ValueError(_unbuilt_message(model))
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        error = outcome = None
        if root and read:
            outcome = ("read before",)
        elif root:
            try:
                outcome = ("restored", *self._restore())
            except Exception as e:  # every rank raises, rank 0 its own exception
                error = e
                outcome = ("error", f"{type(e).__name__}: {e}")
        outcome = self._share("outcome", outcome)
        if error is not None:
            raise error
        if outcome[0] == "error":
            raise RuntimeError(
                f"keras-ring: BackupAndRestore: rank 0 could not restore the backup in "
                f"{os.fspath(self.backup_dir)!r}: {outcome[1]}"
            )
        if outcome[0] == "read before":
            if state is not None:
                state._backup_read = True
            return
        _, loaded, epoch = outcome
        if loaded and _basics.size() > 1:
            self._broadcast_state()
        if state is not None:
            self._into_state(state, loaded, epoch)
        if epoch is not None:
            # Keras's callback makes fit() start at the backup's epoch through
            # this private attribute, which fit() reads after on_train_begin;
            # Keras has no public way for a callback to do it.
            model._initial_epoch = epoch
            self._resumed = True

    @staticmethod
    def _into_state(state, loaded, epoch):
        """Makes what was restored an elastic state's commit: a reset comes back to it."""
        if epoch is not None and hasattr(state, "epoch"):
            state.epoch = epoch
        state._backup_read = True
        if loaded or epoch is not None:
            state.save()

    def _share(self, what, value):
        """Rank 0's `value`, on every rank (after checking that all ranks are here)."""
        if _basics.size() == 1:
            return value
        phase = ("build", "outcome").index(what)
        low, high = self.step_guard.exchange(_sync.TRAIN_BEGIN, _sync.BACKUP, (phase,))
        if low[0] != high[0]:
            built = _sync.per_rank(["no" if p == 0 else "yes" for p in _sync.gather([phase])[:, 0]])
            raise ValueError(
                "keras-ring: BackupAndRestore: the model is built on some ranks only when "
                f"training starts (built: {built}). Build the same model on every rank."
            )
        return _objects.broadcast_object(value, 0, name=f"{_NAME}.{what}")

    def _build_plan(self):
        """On rank 0, for a model that is not built: how to build it for the backup, if any."""
        backup = (
            self._weights_path,
            self._training_metadata_path,
            self._prev_weights_path,
            self._prev_training_metadata_path,
        )
        if not any(_files.exists(path) for path in backup):
            return ("none",)
        for path in (self._training_metadata_path, self._prev_training_metadata_path):
            try:
                config = json.loads(_files.read_text(path)).get("build_config")
            except (OSError, ValueError, AttributeError):
                continue
            if config:
                return ("build", config)
        return ("error", _unbuilt_message(self.model))

    def _restore(self):
        """Keras's restore on rank 0: returns (weights loaded, epoch or None)."""
        try:
            return self._load_model()
        except OSError:
            # Weights may be corrupted. Trying to load previous one.
            if not _files.exists(self._prev_weights_path):
                raise
            _files.copy(self._prev_weights_path, self._weights_path)
            if _files.exists(self._prev_training_metadata_path):
                _files.copy(self._prev_training_metadata_path, self._training_metadata_path)
            elif _files.exists(self._training_metadata_path):
                _files.remove(self._training_metadata_path)
            return self._load_model()

    def _load_model(self):
        loaded = False
        if _files.exists(self._weights_path):
            optimizer = self.model.optimizer
            if optimizer is not None and not optimizer.built:
                # Make sure optimizer weights exist before loading.
                optimizer.build(self.model.trainable_variables)
            self.model.load_weights(self._weights_path)
            loaded = True
        epoch = None
        if _files.exists(self._training_metadata_path):
            epoch = json.loads(_files.read_text(self._training_metadata_path))["epoch"]
        return loaded, epoch

    def _broadcast_state(self):
        """Gives every rank rank 0's restored model weights and optimizer variables."""
        optimizer = self.model.optimizer
        variables = list(self.model.weights)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        # What model.save_weights() saves: the model's weights, the optimizer's variables.
        shapes = "\n".join(f"{tuple(v.shape)} {v.dtype}" for v in variables)
        low, high = self.step_guard.exchange(
            _sync.TRAIN_BEGIN, _sync.BACKUP, (len(variables), _sync.digest(shapes))
        )
        if (low != high).any():
            counts = _sync.per_rank(_sync.gather([len(variables)])[:, 0])
            raise ValueError(
                "keras-ring: BackupAndRestore: the ranks' models or optimizers differ, so rank "
                f"0's restored state cannot be given to every rank (variables per rank: "
                f"{counts}). Build the same model and the same optimizer on every rank."
            )
        _host_collectives.broadcast_variables(variables, 0, _NAME)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._resumed:
            self.model._initial_epoch = None  # see on_train_begin
            self._resumed = False
        if _basics.rank() == 0 and self.delete_checkpoint and _files.exists(self.backup_dir):
            _files.rmtree(self.backup_dir)

    # Backing up: Keras's schedule on every rank, the files on rank 0.

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if self._resumed:
            # fit() has read it: a later fit, after this one ends or is
            # interrupted (an elastic job's reset), starts where it is told.
            self.model._initial_epoch = None
            self._resumed = False
        if self._epoch_offset is None:
            # In an elastic job the backup records the job's epoch, which the
            # state counts (a fit after a reset numbers its epochs from 0).
            state = _elastic_world.running_state()
            counted = state is not None and hasattr(state, "epoch")
            self._epoch_offset = int(state.epoch) - epoch if counted else 0
        self._current_epoch = epoch + self._epoch_offset

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._current_epoch = epoch + 1 + self._epoch_offset
        self._last_batch_seen = 0
        if self.save_freq == "epoch":
            self._save_model()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self._should_save_on_batch(batch):
            self._save_model()

    def _should_save_on_batch(self, batch):
        """Keras's batch-level schedule (which supports steps_per_execution)."""
        if self.save_freq == "epoch":
            return False
        if batch <= self._last_batch_seen:  # New epoch.
            add_batches = batch + 1  # batches are zero-indexed.
        else:
            add_batches = batch - self._last_batch_seen
        self._batches_seen_since_last_saving += add_batches
        self._last_batch_seen = batch
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._batches_seen_since_last_saving = 0
            return True
        return False

    def _save_model(self):
        if _basics.rank() != 0:
            return
        if not _files.exists(self.backup_dir):
            _files.makedirs(self.backup_dir)
        if self.double_checkpoint and _files.exists(self._weights_path):
            _files.copy(self._weights_path, self._prev_weights_path)
        if self.double_checkpoint and _files.exists(self._training_metadata_path):
            _files.copy(self._training_metadata_path, self._prev_training_metadata_path)
        self.model.save_weights(filepath=self._weights_path, overwrite=True)
        training_metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen}
        build_config = self._build_config()
        if build_config is not None:
            training_metadata["build_config"] = build_config
        _files.write_text(self._training_metadata_path, json.dumps(training_metadata))

    def _build_config(self):
        """The model's build config as JSON data, or None (a lazily built model needs it)."""
        try:
            config = self.model.get_build_config()
            json.dumps(config)
        except (TypeError, ValueError):
            return None
        return config
