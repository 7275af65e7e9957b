"""State: what an elastic job keeps of its training when its world re-forms."""

import numpy as np

from keras_ring.core import _basics, _elastic_world, _errors, _objects


class State:
    """The base of the states that `keras_ring.elastic.run` keeps across resets.

    A state has a committed copy, kept in memory on every rank: `commit()`
    (`save()`, then `check_host_updates()`) takes it, `restore()` puts it
    back after a worker was lost, and `sync()` gives every rank rank 0's
    state, for a world that has just re-formed (newcomers included).
    Subclasses implement `save`, `restore` and `sync`; `ObjectState` and
    `KerasState` are the ones to use.

    Reset callbacks (`register_reset_callbacks`) run after every reset,
    once the state has been synced: what depends on the world's size (a
    learning rate scaled by `keras_ring.size()`) is set from the new world.

    Example:

    ```python
    state = kr.elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: print(f"now {kr.size()} ranks")])
    state.epoch = 3
    state.commit()   # saved; raises HostsUpdatedInterrupt if the world should re-form
    state.epoch = 4
    state.restore()  # state.epoch == 3
    ```
    """

    def __init__(self):
        self._reset_callbacks = []
        # The UpdateBatchStateCallback and UpdateEpochStateCallback of the
        # `fit` now running: CommitStateCallback brings them up to date before
        # it commits, whatever their order in the callbacks list.
        self._progress_callbacks = []
        # Whether keras_ring.callbacks.BackupAndRestore has read its backup on
        # disk into this state: it does once per job, so that a reset goes back
        # to the commit in memory, not to the older backup.
        self._backup_read = False

    def register_reset_callbacks(self, callbacks):
        """Adds functions to call, without arguments, after each reset of the world.

        They run after the state has been synced from the new rank 0, so they
        see the state every rank trains from, and they may change it (a
        learning rate for the new `keras_ring.size()`). Horovod runs them
        before the sync, which then overwrites what they set.

        Args:
            callbacks: A list of callables.

        Raises:
            TypeError: If `callbacks` is not a list or tuple of callables.

        Example:

        ```python
        def on_reset():
            model.optimizer.learning_rate.assign(1e-3 * kr.size())

        state.register_reset_callbacks([on_reset])
        ```
        """
        if not isinstance(callbacks, (list, tuple)) or not all(callable(c) for c in callbacks):
            raise TypeError(
                f"`callbacks` must be a list of callables. Received: callbacks={callbacks!r}"
            )
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Calls the reset callbacks, in the order they were registered.

        `keras_ring.elastic.run` calls it after each reset, once the state is
        synced.

        Example:

        ```python
        state.register_reset_callbacks([lambda: print("reset")])
        state.on_reset()  # prints "reset"
        ```
        """
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state, then checks whether the world should re-form.

        Collective: every rank commits at the same point of training (the
        commit check is a broadcast from rank 0). A worker lost later makes
        every survivor go back to this commit.

        Raises:
            HostsUpdatedInterrupt: On every rank at once, if the driver has
                asked the world to re-form (workers were added or hosts
                removed); `keras_ring.elastic.run` then re-forms it without
                restoring.

        Example:

        ```python
        for batch, (x, y) in enumerate(dataset):
            train_step(x, y)
            state.batch = batch + 1
            if state.batch % 10 == 0:
                state.commit()
        ```
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises `HostsUpdatedInterrupt` on every rank if the driver asked the world to re-form.

        Rank 0 asks (a read of the rendezvous store, with no wait) and
        broadcasts its answer, so that every rank raises at the same commit.
        Outside an elastic job the answer is always no. Collective.

        Raises:
            HostsUpdatedInterrupt: If the world should re-form.

        Example:

        ```python
        state.save()
        state.check_host_updates()  # what commit() does
        ```
        """
        updated = np.array([_basics.rank() == 0 and _elastic_world.hosts_updated()], np.int32)
        updated = _objects._run("BROADCAST", updated, "keras_ring.elastic.hosts_updated",
                                root_rank=0)
        if updated[0]:
            raise _errors.HostsUpdatedInterrupt()

    def save(self):
        """Keeps a copy of the state in memory (subclasses define what it holds).

        Example:

        ```python
        state.save()  # commit() without the check for host updates
        ```
        """
        raise NotImplementedError(f"{type(self).__name__} must define save().")

    def restore(self):
        """Puts back the copy the last `save()` (or `commit()`) took.

        Example:

        ```python
        state.restore()  # back to the last commit
        ```
        """
        raise NotImplementedError(f"{type(self).__name__} must define restore().")

    def sync(self):
        """Gives every rank rank 0's state. Collective.

        Example:

        ```python
        state.sync()  # what keras_ring.elastic.run does after each reset
        ```
        """
        raise NotImplementedError(f"{type(self).__name__} must define sync().")

    def _follow(self, callback):
        """Registers a progress callback of the `fit` that is starting; forgets earlier fits'."""
        self._progress_callbacks = [
            c for c in self._progress_callbacks if c.params is callback.params and c is not callback
        ] + [callback]

    def _progress_callbacks_of(self, params):
        """The progress callbacks of the `fit` whose callbacks share `params`."""
        return [c for c in self._progress_callbacks if c.params is params]
