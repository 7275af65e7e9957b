"""keras_ring.elastic in one process (a job of size 1, no launcher, no driver).

The states' save, restore and sync, the run() loop (its re-init replaced by
a recorder: no driver re-forms a world here), and the callbacks with Keras's
real `fit`. tests/workers/elastic_state_worker.py checks sync and the host
update check across real ranks.
"""

import inspect
import itertools
import json
import os
import subprocess
import sys
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring.core import _basics, _elastic_world, _lifecycle, _objects
from keras_ring.elastic import _run

STEPS = 5  # per epoch
BATCH = 4


@pytest.fixture(autouse=True, scope="module")
def initialized():
    kr.init()


def dense_model(optimizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.05), loss="mse")
    return model


def data(batches=STEPS):
    rng = np.random.default_rng(0)
    return rng.normal(size=(batches * BATCH, 3)), rng.normal(size=(batches * BATCH, 1))


def dataset(skip_batches=0):
    """The training data as repeated batches, starting `skip_batches` into an epoch."""
    return tf.data.Dataset.from_tensor_slices(data()).batch(BATCH).repeat().skip(skip_batches)


def values(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# ObjectState


def test_object_state_saves_restores_and_commits_copies():
    state = kr.elastic.ObjectState(epoch=0, losses=[1.0])
    assert (state.epoch, state.losses) == (0, [1.0])
    state.epoch, state.losses = 2, state.losses + [0.5]
    state.losses.append(0.25)
    state.commit()
    state.losses.append(0.125)  # in place, after the commit
    state.epoch = 7
    state.restore()
    assert (state.epoch, state.losses) == (2, [1.0, 0.5, 0.25])
    state.losses.append(9.0)  # restore gives a copy: the committed list stays
    state.restore()
    assert state.losses == [1.0, 0.5, 0.25]


def test_object_state_initial_values_are_the_first_commit():
    state = kr.elastic.ObjectState(batch=0)
    state.batch = 3
    state.restore()
    assert state.batch == 0


def test_object_state_sync_keeps_the_saved_values():
    state = kr.elastic.ObjectState(epoch=1)
    state.epoch = 5  # not saved: sync gives rank 0's saved values
    state.sync()
    assert state.epoch == 1


@pytest.mark.parametrize("name", ["_hidden", "commit", "sync", "restore"])
def test_object_state_refuses_names_it_cannot_hold(name):
    with pytest.raises(ValueError, match=f"Received: {name}=1"):
        kr.elastic.ObjectState(**{name: 1})


def test_reset_callbacks_run_in_order_and_are_checked():
    state = kr.elastic.ObjectState()
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.register_reset_callbacks((lambda: calls.append(2),))
    state.on_reset()
    assert calls == [1, 2]
    with pytest.raises(TypeError, match="Received: callbacks="):
        state.register_reset_callbacks(lambda: None)
    with pytest.raises(TypeError, match="Received: callbacks="):
        state.register_reset_callbacks([1])


def test_commit_raises_when_rank_zero_sees_a_host_update(monkeypatch):
    state = kr.elastic.ObjectState(epoch=0)
    monkeypatch.setattr(_elastic_world, "hosts_updated", lambda: True)
    state.epoch = 1
    with pytest.raises(kr.elastic.HostsUpdatedInterrupt, match="re-form"):
        state.commit()
    state.epoch = 2
    state.restore()
    assert state.epoch == 1  # saved before the check raised
    monkeypatch.setattr(_elastic_world, "hosts_updated", lambda: False)
    state.commit()


# KerasState


def test_keras_state_commits_weights_slots_iterations_and_attributes():
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=0)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    state.epoch, state.batch = 1, 3
    state.commit()
    committed = values(model)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    model.fit(x, y, batch_size=BATCH, verbose=0)  # moves weights, BN statistics, slots
    state.epoch, state.batch = 2, 4
    assert not any(np.array_equal(a, b) for a, b in zip(committed[:2], values(model)[:2]))
    state.restore()
    assert_same(values(model), committed)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    assert (state.epoch, state.batch) == (1, 3)


def test_keras_state_builds_an_unbuilt_optimizer():
    model = dense_model(keras.optimizers.Adam(0.05))
    assert not model.optimizer.built
    state = kr.elastic.KerasState(model)
    assert model.optimizer.built
    before = values(model)
    assert len(before) == len(model.weights) + 2 + 2 * len(model.trainable_weights)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    state.restore()  # the slots too: they existed at the first save
    assert_same(values(model), before)


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05)),
    lambda: kr.DistributedOptimizer(keras.optimizers.AdamW(0.05)),
], ids=["SGD", "LossScaleOptimizer", "DistributedOptimizer"])
def test_keras_state_restores_each_kind_of_optimizer(optimizer):
    model = dense_model(optimizer())
    state = kr.elastic.KerasState(model)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    state.sync()
    state.commit()
    committed = values(model)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    state.restore()
    assert_same(values(model), committed)


def test_keras_state_sync_keeps_the_values_and_saves_them():
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=3)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    trained = values(model)
    state.sync()
    assert_same(values(model), trained)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    state.restore()  # to what sync saved
    assert_same(values(model), trained)
    assert state.epoch == 3


def test_keras_state_reset_traces_the_steps_again():
    model = dense_model()
    state = kr.elastic.KerasState(model)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(model.train_function)])
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    traced = model.train_function
    state.on_reset()
    assert calls and calls[0] is not traced  # the callbacks see the new one
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


def test_keras_state_takes_an_optimizer_and_the_horovod_name():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    state = kr.elastic.TensorFlowKerasState(model, optimizer, epoch=0)
    assert isinstance(state, kr.elastic.KerasState)
    assert state.optimizer is optimizer and optimizer.built


def test_keras_state_checks_its_arguments():
    with pytest.raises(TypeError, match="Received: model="):
        kr.elastic.KerasState("model")
    with pytest.raises(ValueError, match="no optimizer"):
        kr.elastic.KerasState(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    with pytest.raises(TypeError, match="Received: optimizer="):
        kr.elastic.KerasState(dense_model(), optimizer="adam")
    lazy = keras.Sequential([keras.layers.Dense(1)])
    lazy.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="must be built"):
        kr.elastic.KerasState(lazy)


# TensorFlowState


def test_tensorflow_state_commits_restores_and_syncs_its_variables():
    w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    count = tf.Variable(3, dtype=tf.int64)
    state = kr.elastic.TensorFlowState([w, count], step=0)
    w.assign_add(tf.ones_like(w))
    state.step = 1
    state.commit()
    w.assign(tf.zeros_like(w))
    count.assign(9)
    state.step = 2
    state.restore()
    np.testing.assert_array_equal(w.numpy(), np.arange(6).reshape(2, 3) + 1)
    assert (int(count.numpy()), state.step) == (3, 1)
    state.sync()  # a job of one rank: its own values, saved
    w.assign(tf.zeros_like(w))
    state.restore()
    np.testing.assert_array_equal(w.numpy(), np.arange(6).reshape(2, 3) + 1)


def test_tensorflow_state_checks_its_arguments():
    with pytest.raises(TypeError, match="Received: variables=None"):
        kr.elastic.TensorFlowState()
    with pytest.raises(TypeError, match="Received: 3 among the variables"):
        kr.elastic.TensorFlowState([tf.Variable(1.0), 3])
    with pytest.raises(ValueError, match="sessions are not supported"):
        kr.elastic.TensorFlowState([tf.Variable(1.0)], session=object())


# run()


class RecordingState(kr.elastic.ObjectState):
    """An ObjectState that records its restores and syncs in `calls`."""

    def __init__(self, calls):
        super().__init__(epoch=0)
        self.calls = calls

    def restore(self):
        self.calls.append("restore")
        super().restore()

    def sync(self):
        self.calls.append("sync")
        super().sync()


@pytest.fixture
def calls(monkeypatch):
    """What run() does, in order; its re-init is recorded, not done."""
    calls = []
    monkeypatch.setattr(_run, "_reinit", lambda: calls.append("reinit"))
    monkeypatch.setenv("KERAS_RING_ELASTIC", "1")
    return calls


def lost_peer():
    return tf.errors.UnavailableError(None, None, "keras-ring: rank 2 is lost")


def failing(calls, errors):
    """A training function that raises each of `errors` in turn, then returns its arguments."""
    errors = list(errors)

    def train(state, *args, **kwargs):
        calls.append("func")
        if errors:
            raise errors.pop(0)
        return args, kwargs

    return train


def with_reset_callback(calls):
    state = RecordingState(calls)
    state.register_reset_callbacks([lambda: calls.append("reset callback")])
    return state


def test_run_syncs_then_calls_once_without_errors(calls):
    train = kr.elastic.run(failing(calls, []))
    assert train(with_reset_callback(calls), 1, key=2) == ((1,), {"key": 2})
    assert calls == ["sync", "func"]


def test_run_resets_a_newcomer_after_its_first_sync(calls, monkeypatch):
    monkeypatch.setattr(_elastic_world, "generation", lambda: 3)  # joined a running job
    train = kr.elastic.run(failing(calls, [kr.elastic.WorkerLostError("lost")]))
    train(with_reset_callback(calls))
    assert calls == ["sync", "reset callback", "func", "restore", "reinit", "sync",
                     "reset callback", "func"]


@pytest.mark.parametrize("error", [kr.elastic.WorkerLostError("lost"), lost_peer()],
                         ids=["WorkerLostError", "keras-ring UnavailableError"])
def test_run_restores_reinits_syncs_then_resets_after_a_lost_worker(calls, error):
    train = kr.elastic.run(failing(calls, [error]))
    assert train(with_reset_callback(calls)) == ((), {})
    assert calls == ["sync", "func", "restore", "reinit", "sync", "reset callback", "func"]


@pytest.mark.parametrize("make_error", [lambda: kr.elastic.WorkerLostError("lost"), lost_peer],
                         ids=["WorkerLostError", "keras-ring UnavailableError"])
def test_run_keeps_nothing_of_the_lost_call_into_the_next_world(calls, make_error):
    # The error's traceback holds the failed call's frames: in a fit, its
    # tf.data iterator with its threads, which must not outlive their world.
    class Data:
        pass

    seen = []

    def train(state):
        if not seen:
            data = Data()
            seen.append(weakref.ref(data))
            raise make_error()
        return seen[0]() is None

    assert kr.elastic.run(train)(with_reset_callback(calls))


def test_run_reinits_without_restoring_after_a_host_update(calls):
    train = kr.elastic.run(failing(calls, [kr.elastic.HostsUpdatedInterrupt()]))
    train(with_reset_callback(calls))
    assert calls == ["sync", "func", "reinit", "sync", "reset callback", "func"]


def test_run_recovers_from_a_worker_lost_during_the_recovery(calls):
    state = with_reset_callback(calls)
    syncs = iter([None, kr.elastic.WorkerLostError("lost in sync"), None])

    def sync():
        calls.append("sync")
        error = next(syncs)
        if error:
            raise error

    state.sync = sync
    kr.elastic.run(failing(calls, [kr.elastic.WorkerLostError("lost")]))(state)
    assert calls == ["sync", "func", "restore", "reinit", "sync", "restore", "reinit", "sync",
                     "reset callback", "func"]


@pytest.mark.parametrize("error", [
    ValueError("not ours"),
    tf.errors.UnknownError(None, None, "some op failed"),
    tf.errors.UnavailableError(None, None, "a file system is unavailable"),
    KeyboardInterrupt(),
], ids=["ValueError", "UnknownError", "UnavailableError of another op", "KeyboardInterrupt"])
def test_run_lets_other_errors_through(calls, error):
    train = kr.elastic.run(failing(calls, [error]))
    with pytest.raises(type(error)) as raised:
        train(with_reset_callback(calls))
    assert raised.value is error
    assert calls == ["sync", "func"]


def test_run_outside_an_elastic_job_says_the_world_cannot_re_form(calls, monkeypatch):
    monkeypatch.delenv("KERAS_RING_ELASTIC")
    error = lost_peer()
    train = kr.elastic.run(failing(calls, [error]))
    with pytest.raises(kr.elastic.WorkerLostError, match="keras-ring-run --elastic") as raised:
        train(with_reset_callback(calls))
    assert raised.value.__cause__ is error
    assert "rank 2 is lost" in str(raised.value)
    assert calls == ["sync", "func"]


def test_run_checks_its_arguments(calls):
    with pytest.raises(TypeError, match="Received: func=1"):
        kr.elastic.run(1)

    @kr.elastic.run
    def train(state):
        """Trains."""

    assert train.__name__ == "train" and train.__doc__ == "Trains."
    with pytest.raises(TypeError, match="Received: state="):
        train("state")


def test_reinit_starts_the_engine_again_and_names_by_call_order_from_zero():
    kr.barrier()  # named by call order
    _run._reinit()  # outside an elastic job: the same world of size 1
    assert kr.is_initialized() and kr.size() == 1
    assert _objects._name("barrier", None, None) == "barrier.0"
    kr.barrier()


def test_reinit_keeps_the_settings_the_script_gave_init():
    kr.shutdown()
    kr.init(cycle_time=2, cache_capacity=16)
    try:
        _run._reinit()
        assert _lifecycle.given_settings == {"cycle_time": 2, "cache_capacity": 16}
        assert _basics._engine().parameters()["cycle_time_ms"] == 2
    finally:
        kr.shutdown()
        kr.init()
    assert _lifecycle.given_settings == {}


def test_horovod_names():
    assert kr.elastic.HorovodInternalError is kr.elastic.WorkerLostError
    assert issubclass(kr.elastic.WorkerLostError, RuntimeError)
    assert issubclass(kr.elastic.HostsUpdatedInterrupt, RuntimeError)


# Callbacks with Keras's fit


class Steps(keras.callbacks.Callback):
    """Counts the batches each epoch runs, and records the epochs that ended (with their logs)."""

    def __init__(self):
        super().__init__()
        self.batches, self.ended = {}, []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches[epoch] = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches[max(self.batches)] += 1

    def on_epoch_end(self, epoch, logs=None):
        self.ended.append((epoch, sorted(logs)))


class CommitRecorder:
    """Records (epoch, batch, iterations) as each commit saves them."""

    def __init__(self, state):
        self.commits = []
        save = state.save

        def recording_save():
            save()
            self.commits.append((state.epoch, state.batch,
                                 int(state.optimizer.iterations.numpy())))

        state.save = recording_save


def elastic_callbacks(state, order, batches_per_commit):
    made = {
        "commit": kr.elastic.CommitStateCallback(state, batches_per_commit=batches_per_commit),
        "batch": kr.elastic.UpdateBatchStateCallback(state),
        "epoch": kr.elastic.UpdateEpochStateCallback(state),
    }
    return [made[name] for name in order]


@pytest.mark.parametrize("order", list(itertools.permutations(["commit", "batch", "epoch"])),
                         ids="-".join)
def test_commits_see_the_batch_and_epoch_in_any_order(order):
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=0)
    recorder = CommitRecorder(state)
    model.fit(dataset(), shuffle=False, steps_per_epoch=STEPS, epochs=2, verbose=0,
              callbacks=elastic_callbacks(state, order, batches_per_commit=2))
    # Every 2 batches; the epoch's last batch is committed at its end, counted.
    assert recorder.commits == [(0, 2, 2), (0, 4, 4), (1, 0, 5), (1, 2, 7), (1, 4, 9),
                                (2, 0, 10)]
    assert (state.epoch, state.batch) == (2, 0)


@pytest.mark.parametrize("order", list(itertools.permutations(["commit", "batch", "epoch"])),
                         ids="-".join)
def test_a_resumed_epoch_runs_only_its_batches_left(order, capsys):
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=1, batch=3)
    recorder = CommitRecorder(state)
    steps = Steps()
    x_val, y_val = data(2)
    model.fit(dataset(skip_batches=state.batch), shuffle=False, steps_per_epoch=STEPS,
              epochs=3 - state.epoch, validation_data=(x_val, y_val), verbose=1,
              callbacks=[steps, *elastic_callbacks(state, order, batches_per_commit=1)])
    assert steps.batches == {0: STEPS - 3, 1: STEPS}
    assert [epoch for epoch, _ in steps.ended] == [0, 1]
    assert all("val_loss" in logs for _, logs in steps.ended)  # validated after each
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS - 3
    assert recorder.commits == [(1, 4, 1), (2, 0, 2), (2, 1, 3), (2, 2, 4), (2, 3, 5), (2, 4, 6),
                                (3, 0, 7)]
    output = capsys.readouterr().out
    assert "Epoch 1/2" in output and "Epoch 2/2" in output and "val_loss" in output


def test_only_the_first_epoch_of_a_fit_resumes():
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=0)
    steps = Steps()
    model.fit(dataset(), shuffle=False, steps_per_epoch=STEPS, epochs=2, verbose=0,
              callbacks=[steps, kr.elastic.UpdateBatchStateCallback(state)])
    assert steps.batches == {0: STEPS, 1: STEPS}


def test_a_resumed_epoch_with_steps_per_execution():
    model = dense_model()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", steps_per_execution=2)
    state = kr.elastic.KerasState(model, epoch=0, batch=2)
    recorder = CommitRecorder(state)
    model.fit(dataset(skip_batches=2), shuffle=False, steps_per_epoch=6, epochs=2, verbose=0,
              callbacks=elastic_callbacks(state, ["batch", "epoch", "commit"], 2))
    assert int(model.optimizer.iterations.numpy()) == 4 + 6
    assert recorder.commits == [(0, 4, 2), (1, 0, 4), (1, 2, 6), (1, 4, 8), (2, 0, 10)]


def test_a_resumed_epoch_of_unknown_length_runs_every_batch():
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=3)
    steps = Steps()
    unknown = tf.data.Dataset.from_tensor_slices(data()).filter(lambda x, y: True).batch(BATCH)
    with pytest.warns(UserWarning, match="ran out of data"):  # Keras's, at each epoch's end
        model.fit(unknown, shuffle=False, epochs=2, verbose=0,
                  callbacks=[steps, kr.elastic.UpdateBatchStateCallback(state)])
    assert steps.batches == {0: STEPS, 1: STEPS}
    assert state.batch == 0


class StopAt(keras.callbacks.Callback):
    """Stops training at the end of Keras's epoch `epoch`, or of its batch `batch`."""

    def __init__(self, epoch, batch=None):
        super().__init__()
        self.at, self.batch, self.epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.at, self.batch):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.batch is None and epoch == self.at:
            self.model.stop_training = True


@pytest.mark.parametrize("first", [True, False], ids=["stopper first", "stopper last"])
@pytest.mark.parametrize("stopper, batches", [
    # Keras's EarlyStopping never stops in a fit's first epoch; asked for an
    # improvement no loss can make, it stops at the end of the second.
    (lambda: keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=1),
     {0: STEPS - 3, 1: STEPS}),
    (lambda: StopAt(0), {0: STEPS - 3}),
    (lambda: StopAt(0, STEPS - 3 - 1), {0: STEPS - 3}),
    (lambda: StopAt(1, 1), {0: STEPS - 3, 1: 2}),
], ids=["EarlyStopping", "at the resumed epoch's end", "at its last batch", "in the next"])
def test_callbacks_that_stop_training_still_stop_it(stopper, batches, first):
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=3)
    steps = Steps()
    elastic = elastic_callbacks(state, ["commit", "batch", "epoch"], 1)
    callbacks = [stopper(), *elastic] if first else [*elastic, stopper()]
    model.fit(dataset(3), shuffle=False, steps_per_epoch=STEPS, epochs=4, verbose=0,
              callbacks=[steps, *callbacks])
    assert steps.batches == batches
    assert [epoch for epoch, _ in steps.ended] == list(batches)


def test_agreed_stopping_lets_a_resumed_epoch_end():
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=0, batch=3)
    steps = Steps()
    model.fit(dataset(3), shuffle=False, steps_per_epoch=STEPS, epochs=2, verbose=0,
              callbacks=[steps, *elastic_callbacks(state, ["commit", "batch", "epoch"], 1),
                         kr.callbacks.AgreedStoppingCallback()])
    assert steps.batches == {0: STEPS - 3, 1: STEPS}


@pytest.mark.parametrize("style", ["epochs left", "initial_epoch"])
def test_both_ways_of_resuming_count_the_epochs(style):
    epochs = 4
    model = dense_model()
    state = kr.elastic.KerasState(model, epoch=2, batch=0)
    recorder = CommitRecorder(state)
    if style == "epochs left":
        span = dict(epochs=epochs - state.epoch)
    else:
        span = dict(initial_epoch=state.epoch, epochs=epochs)
    model.fit(dataset(), shuffle=False, steps_per_epoch=STEPS, verbose=0, **span,
              callbacks=elastic_callbacks(state, ["epoch", "commit"], STEPS))
    assert [epoch for epoch, _, _ in recorder.commits] == [3, 4]
    assert state.epoch == epochs


def test_callbacks_check_their_arguments():
    with pytest.raises(TypeError, match="Received: state="):
        kr.elastic.CommitStateCallback({"epoch": 0})
    with pytest.raises(ValueError, match="Received: batches_per_commit=0"):
        kr.elastic.CommitStateCallback(kr.elastic.ObjectState(), batches_per_commit=0)
    with pytest.raises(ValueError, match="no `batch` attribute"):
        kr.elastic.UpdateBatchStateCallback(kr.elastic.ObjectState(epoch=0))
    with pytest.raises(ValueError, match="no `epoch` attribute"):
        kr.elastic.UpdateEpochStateCallback(kr.elastic.ObjectState(batch=0))


# run() with fit: a worker lost mid-epoch


class LoseWorker(keras.callbacks.Callback):
    """Raises a lost-peer error once, at the end of the job's epoch `epoch`, batch `batch`."""

    def __init__(self, state, epoch, batch):
        super().__init__()
        self.state, self.at, self.fired = state, (epoch, batch), False

    def on_train_batch_end(self, batch, logs=None):
        if not self.fired and (self.state.epoch, self.state.batch) == self.at:
            self.fired = True
            raise lost_peer()


def test_a_lost_worker_costs_the_steps_since_the_commit_and_no_more(calls):
    epochs = 3

    def train_job(lose):
        model = dense_model(keras.optimizers.SGD(0.05, momentum=0.5))
        state = kr.elastic.KerasState(model, epoch=0, batch=0)
        losing = LoseWorker(state, epoch=1, batch=4)

        @kr.elastic.run
        def train(state):
            # Rebuilt at each call, starting where the state says.
            model.fit(dataset(skip_batches=state.batch), shuffle=False, steps_per_epoch=STEPS,
                                epochs=epochs - state.epoch, verbose=0,
                                callbacks=[*elastic_callbacks(state, ["commit", "batch", "epoch"],
                                                              batches_per_commit=3),
                                           *([losing] if lose else [])])

        train(state)
        return model, state

    model, state = train_job(lose=True)
    # Lost after batch 4 of epoch 1; committed at batch 3: the step after it is run again.
    assert calls.count("reinit") == 1
    assert int(model.optimizer.iterations.numpy()) == epochs * STEPS
    assert (state.epoch, state.batch) == (epochs, 0)
    reference, _ = train_job(lose=False)
    for a, b in zip(values(model), values(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# run() with BackupAndRestore: the backup on disk outlives the job, the commits a worker


class JobDies(keras.callbacks.Callback):
    """Ends the job (every worker) at the job's epoch `epoch`, batch `batch`."""

    def __init__(self, state, epoch, batch):
        super().__init__()
        self.state, self.at = state, (epoch, batch)

    def on_train_batch_end(self, batch, logs=None):
        if (self.state.epoch, self.state.batch) == self.at:
            raise RuntimeError("every worker of the job died")


@pytest.mark.parametrize("style", ["epochs left", "initial_epoch"])
@pytest.mark.parametrize("place", ["first", "last"])
def test_a_job_run_again_resumes_from_the_backup_and_its_resets_from_the_commits(
        calls, tmp_path, style, place):
    epochs, backup_dir = 5, tmp_path / "backup"

    def train_job(seed, *faults):
        model = dense_model(keras.optimizers.SGD(0.05, momentum=0.5), seed=seed)
        state = kr.elastic.KerasState(model, epoch=0, batch=0)
        recorder = CommitRecorder(state)
        made = [fault(state) for fault in faults]

        @kr.elastic.run
        def train(state):
            if style == "epochs left":
                span = dict(epochs=epochs - state.epoch)
            else:
                span = dict(initial_epoch=state.epoch, epochs=epochs)
            backup = kr.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
            elastic = elastic_callbacks(state, ["commit", "batch", "epoch"], 3)
            listed = [backup, *elastic] if place == "first" else [*elastic, backup]
            model.fit(dataset(skip_batches=state.batch), shuffle=False, steps_per_epoch=STEPS,
                      verbose=0, **span, callbacks=[*listed, *made])

        train(state)
        return model, state, recorder.commits

    with pytest.raises(RuntimeError, match="every worker"):
        train_job(0, lambda state: JobDies(state, epoch=2, batch=2))
    assert json.loads((backup_dir / "training_metadata.json").read_text())["epoch"] == 2
    # Run again from other weights: the backup gives the weights and the epoch, and a
    # worker lost in epoch 3 sends the job back to its commit at batch 3, not to the backup.
    model, state, commits = train_job(1, lambda state: LoseWorker(state, epoch=3, batch=4))
    assert commits[0] == (2, 0, 2 * STEPS)  # the backup, taken as the first commit
    assert calls.count("reinit") == 1
    assert (3, 3, 3 * STEPS + 3) in commits
    assert int(model.optimizer.iterations.numpy()) == epochs * STEPS
    assert (state.epoch, state.batch) == (epochs, 0)
    # The backup counts the job's epochs, also in a fit that started after the reset.
    assert json.loads((backup_dir / "training_metadata.json").read_text())["epoch"] == epochs
    reference = dense_model(keras.optimizers.SGD(0.05, momentum=0.5))
    reference.fit(dataset(), shuffle=False, steps_per_epoch=STEPS, epochs=epochs, verbose=0)
    for a, b in zip(values(model), values(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_job_without_a_backup_never_reads_the_one_it_writes(calls, tmp_path):
    epochs, backup_dir = 3, tmp_path / "backup"
    model = dense_model(keras.optimizers.SGD(0.05, momentum=0.5))
    state = kr.elastic.KerasState(model, epoch=0, batch=0)
    recorder = CommitRecorder(state)
    losing = LoseWorker(state, epoch=1, batch=4)

    @kr.elastic.run
    def train(state):
        model.fit(dataset(skip_batches=state.batch), shuffle=False, steps_per_epoch=STEPS,
                  epochs=epochs - state.epoch, verbose=0,
                  callbacks=[kr.callbacks.BackupAndRestore(backup_dir),
                             *elastic_callbacks(state, ["commit", "batch", "epoch"], 3), losing])

    train(state)
    # Back to the commit at batch 3 of epoch 1, not to the backup of epoch 1's start.
    assert recorder.commits[0] == (0, 3, 3)
    assert calls.count("reinit") == 1
    assert int(model.optimizer.iterations.numpy()) == epochs * STEPS
    assert not backup_dir.exists()  # deleted by the fit that completed


# Data and the package


def test_shard_dataset_reads_the_world_when_called(monkeypatch):
    elements = tf.data.Dataset.range(12)
    for rank, size in [(1, 3), (0, 2), (1, 2)]:  # as after two resets
        monkeypatch.setattr(_basics, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(_basics, "size", lambda size=size: size)
        assert list(kr.shard_dataset(elements).as_numpy_iterator()) == list(range(rank, 12, size))


def test_importing_keras_ring_does_not_import_keras():
    code = ("import sys, keras_ring as kr; assert 'elastic' in dir(kr) and 'elastic' in kr.__all__;"
            "assert 'keras' not in sys.modules and 'tensorflow' not in sys.modules;"
            "assert kr.elastic.run and 'keras' not in sys.modules;"
            "assert kr.elastic.KerasState and 'keras' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def test_every_public_elastic_symbol_has_a_docstring_with_an_example():
    # The errors are described in docs/api.md.
    symbols = [getattr(kr.elastic, name) for name in kr.elastic.__all__]
    missing = [symbol for symbol in symbols
               if not (isinstance(symbol, type) and issubclass(symbol, Exception))
               and not ("Example:" in (doc := inspect.getdoc(symbol) or "") and "```python" in doc)]
    assert not missing
