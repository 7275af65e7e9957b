"""run: calls a training function again on a re-formed world, from the last commit."""

import functools

from keras_ring.core import _basics, _elastic_world, _errors, _lifecycle, _log, _objects
from keras_ring.elastic import _validation


def run(func):
    """Makes `func(state, *args, **kwargs)` survive lost workers and re-formed worlds.

    The returned function syncs `state` from rank 0 (so that every rank,
    newcomers included, starts from one state), then calls `func`. When a
    collective fails because a peer died or stopped answering
    (`WorkerLostError`), it restores the last commit, re-forms the world
    (keras-ring's engine starts again in this process on the driver's new
    world: `keras_ring.rank()` and `keras_ring.size()` change), syncs the
    state from the new rank 0, runs the state's reset callbacks and calls
    `func` again. A `HostsUpdatedInterrupt`, which a commit raises on every
    rank when workers were added or hosts removed, does the same without
    restoring: the state was just committed.

    Every reset syncs, on survivors and newcomers alike, so they run the same
    collectives (horovod#3494's deadlock came from ranks that skipped it).
    The reset callbacks run after the sync, so they see, and may change, the
    state training goes on from; Horovod runs them before, and its sync then
    overwrites what they set (horovod#2844). A newcomer, whose first world
    is a re-formed one, runs them after its first sync, so that it sets what
    the survivors set.

    Any other error propagates unchanged. Outside an elastic job (one not
    started with `keras-ring-run --elastic`) a lost worker cannot be
    replaced: the `WorkerLostError` propagates, saying so.

    Data: build the dataset inside `func`, so that each call shards it for
    the world it runs on (`keras_ring.shard_dataset` reads the rank and size
    when it is called), and start it where the state says the epoch is
    (`skip(state.batch)` batches, as in the example): the resumed epoch then
    runs the batches it had left, provided each call yields the batches in
    the same order (a shuffle that differs between calls skips others).
    After a resize the batches left are counted in the new
    world's batches, so the resumed epoch covers the data only roughly once;
    the epochs after it cover it as they would without a reset.

    Args:
        func: The training function; its first argument is the state.

    Returns:
        The wrapped function, which returns what `func` returns.

    Raises:
        TypeError: If `func` is not callable; from the wrapped function, if
            its first argument is not a `keras_ring.elastic.State`.
        WorkerLostError: From the wrapped function, outside an elastic job,
            when a peer is lost.

    Example:

    ```python
    state = kr.elastic.KerasState(model, epoch=0, batch=0)

    @kr.elastic.run
    def train(state):
        # Built here: after a reset, each rank shards for the new world.
        dataset = (tf.data.Dataset.from_tensor_slices((x, y)).apply(kr.shard_dataset)
                   .batch(32, drop_remainder=True).repeat().skip(state.batch))
        model.fit(dataset, steps_per_epoch=len(x) // (32 * kr.size()),
                  epochs=EPOCHS - state.epoch,
                  callbacks=[kr.elastic.CommitStateCallback(state, batches_per_commit=10),
                             kr.elastic.UpdateBatchStateCallback(state),
                             kr.elastic.UpdateEpochStateCallback(state)])

    train(state)
    ```
    """
    if not callable(func):
        raise TypeError(f"`func` must be callable. Received: func={func!r}")

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        _validation.check_state(state)
        # A newcomer's first world is a re-formed one: it runs the reset
        # callbacks after its first sync, as the survivors do after theirs.
        joined = _elastic_world.generation() > 0
        with _elastic_world.running(state):
            return _call(state, joined, func, args, kwargs)

    return wrapper


def _call(state, joined, func, args, kwargs):
    """Calls `func` until it returns, re-forming the world after each lost worker."""
    reset = False
    while True:
        try:
            if reset:
                _reinit()
            state.sync()
            if reset or joined:
                state.on_reset()
            return func(state, *args, **kwargs)
        except _errors.HostsUpdatedInterrupt as interrupt:
            if _basics.rank() == 0:
                _log.info(f"{interrupt}.")
            _elastic_world.set_reason(interrupt)
        except Exception as error:
            lost = _errors.worker_lost(error)
            if lost is None:
                raise
            if not _elastic_world.is_elastic():
                raise _errors.WorkerLostError(
                    f"{lost} This job cannot go on without the lost worker: it was not "
                    "started with `keras-ring-run --elastic`, so no driver re-forms its "
                    "world."
                ) from error
            _log.warning(f"{lost} Going back to the last commit and re-forming the world.")
            _elastic_world.set_reason(lost)
            # Its traceback holds the interrupted call's frames (its fit, the
            # fit's tf.data iterator and threads), not to be kept alive
            # through the next world.
            del lost
            state.restore()
        reset = True


def _reinit():
    """Starts the engine again, on the world the driver forms next."""
    _lifecycle.shutdown()
    # Collectives named by call order count from 0 again, as in a newcomer's
    # new process, so that survivors' and newcomers' names agree.
    _objects._counters.clear()
    # The settings the script gave init() hold for every world (process sets,
    # given by ranks of the old world, do not).
    _lifecycle.init(**_lifecycle.given_settings)
