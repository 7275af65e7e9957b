"""keras_ring.callbacks and the data helpers in one process (a job of size 1, no launcher).

What depends on the job's size or this process's rank is tested by patching
`keras_ring.core._basics.size` / `rank`, which the library reads when it runs;
tests/workers/callbacks_worker.py checks the communicating callbacks across
real ranks.
"""

import gc
import json
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from workers.interrupt_callback import Interrupt

import keras_ring as kr
from keras_ring.core import _basics

STEPS = 5  # per epoch
BATCH = 4
SIZE = 4  # the job size the learning-rate tests pretend


@pytest.fixture(autouse=True, scope="module")
def initialized():
    kr.init()


@pytest.fixture
def size(monkeypatch):
    monkeypatch.setattr(_basics, "size", lambda: SIZE)


def set_rank(monkeypatch, rank):
    monkeypatch.setattr(_basics, "rank", lambda: rank)


def linear_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def data(batches=STEPS):
    rng = np.random.default_rng(0)
    return rng.normal(size=(batches * BATCH, 3)), rng.normal(size=(batches * BATCH, 1))


class LearningRates(keras.callbacks.Callback):
    """Records the learning rate each step runs with."""

    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_begin(self, batch, logs=None):
        self.values.append(float(self.model.optimizer.learning_rate.numpy()))


def fit_recording(model, callbacks, epochs, **kwargs):
    rates = LearningRates()
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, rates],
        **kwargs,
    )
    return np.array(rates.values), history


def horovod_warmup(initial_lr, warmup_epochs, epochs, size=SIZE):
    """The learning rate of each step under horovod's LearningRateWarmupCallback."""
    rates = []
    lr = None
    for epoch in range(epochs):
        for batch in range(STEPS):
            if epoch < warmup_epochs:
                fractional = epoch + batch / STEPS + 1 / STEPS
                lr = initial_lr / size * (fractional * (size - 1) / warmup_epochs + 1)
            rates.append(lr)
    return np.array(rates)


# Learning-rate warmup and schedules.


def test_warmup_sets_horovods_learning_rate_at_every_step(size):
    model = linear_model(keras.optimizers.SGD(0.1))
    warmup = kr.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    rates, history = fit_recording(model, [warmup], epochs=3)
    expected = horovod_warmup(0.4, warmup_epochs=2, epochs=3)
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    assert rates[0] == pytest.approx(0.4 / SIZE * (1 + (SIZE - 1) / (2 * STEPS)))
    assert rates[2 * STEPS - 1] == pytest.approx(0.4)
    # Logged at each epoch's end: the rate of its last step.
    np.testing.assert_allclose(history.history["learning_rate"], expected[STEPS - 1 :: STEPS])


def test_warmup_with_one_rank_keeps_initial_lr():
    model = linear_model(keras.optimizers.SGD(0.1))
    warmup = kr.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    rates, _ = fit_recording(model, [warmup], epochs=2)
    np.testing.assert_allclose(rates, 0.4, rtol=1e-6)


def test_warmup_prints_on_rank_zero_when_done(size, capsys):
    warmup = kr.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=1, verbose=1)
    fit_recording(linear_model(keras.optimizers.SGD(0.1)), [warmup], epochs=2)
    assert "Epoch 1: finished gradual learning rate warmup to 0.4." in capsys.readouterr().out


def test_warmup_schedule_matches_the_callback_step_for_step(size):
    warmup_epochs, epochs = 2, 3
    rates, _ = fit_recording(
        linear_model(keras.optimizers.SGD(0.1)),
        [kr.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs)],
        epochs=epochs,
    )
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, warmup_steps=warmup_epochs * STEPS)
    from_schedule = [float(schedule(step)) for step in range(epochs * STEPS)]
    np.testing.assert_allclose(from_schedule, rates, rtol=1e-6)


def test_warmup_schedule_trains_in_the_optimizer(size):
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, warmup_steps=2 * STEPS)
    model = linear_model(keras.optimizers.SGD(schedule))
    rates, _ = fit_recording(model, [], epochs=3)
    np.testing.assert_allclose(rates, horovod_warmup(0.4, 2, 3), rtol=1e-6)


def test_warmup_schedule_hands_over_to_after():
    after = keras.optimizers.schedules.ExponentialDecay(0.4, decay_steps=10, decay_rate=0.5)
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, warmup_steps=10, after=after, size=2)
    assert float(schedule(0)) == pytest.approx(0.2 * (1 + 1 / 10))
    assert float(schedule(9)) == pytest.approx(0.4)
    for step in (10, 15, 30):
        assert float(schedule(step)) == pytest.approx(float(after(step - 10)))


def test_warmup_schedule_reads_the_job_size_when_called(size):
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, warmup_steps=10)
    assert float(schedule(0)) == pytest.approx(0.4 / SIZE * (1 + (SIZE - 1) / 10))


def test_warmup_schedule_config_round_trip():
    after = keras.optimizers.schedules.CosineDecay(0.4, decay_steps=100)
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, 10, after=after, size=3, name="w")
    serialized = keras.optimizers.schedules.serialize(schedule)
    assert serialized["registered_name"] == "keras_ring>LearningRateWarmupSchedule"
    restored = keras.optimizers.schedules.deserialize(serialized)
    assert isinstance(restored, kr.callbacks.LearningRateWarmupSchedule)
    assert isinstance(restored.after, keras.optimizers.schedules.CosineDecay)
    assert restored.get_config() == schedule.get_config()
    for step in (0, 5, 10, 50):
        assert float(restored(step)) == pytest.approx(float(schedule(step)))


def test_warmup_schedule_survives_model_save_and_load(tmp_path):
    schedule = kr.callbacks.LearningRateWarmupSchedule(0.4, 10, size=2)
    model = linear_model(keras.optimizers.SGD(schedule, momentum=0.5))
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    config = loaded.optimizer.get_config()["learning_rate"]
    restored = keras.optimizers.schedules.deserialize(config)
    assert isinstance(restored, kr.callbacks.LearningRateWarmupSchedule)
    assert restored.get_config() == schedule.get_config()
    assert float(loaded.optimizer.learning_rate) == pytest.approx(float(schedule(STEPS)))


def test_schedule_callback_staircase_with_constant_multiplier():
    callbacks = [kr.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1, end_epoch=3)]
    rates, history = fit_recording(linear_model(keras.optimizers.SGD(0.1)), callbacks, epochs=4)
    # Epoch 0 keeps the optimizer's rate; epoch 3 keeps epoch 2's.
    expected = np.repeat([0.1, 0.4, 0.4 * 0.5, 0.4 * 0.5], STEPS)
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"], expected[::STEPS], rtol=1e-6)


def test_schedule_callback_smooth_with_function_multiplier():
    def multiplier(epoch):
        return 1.0 / (1.0 + epoch)

    callback = kr.callbacks.LearningRateScheduleCallback(0.4, multiplier, staircase=False)
    rates, _ = fit_recording(linear_model(keras.optimizers.SGD(0.1)), [callback], epochs=2)
    expected = [0.4 * multiplier(e + b / STEPS) for e in range(2) for b in range(STEPS)]
    np.testing.assert_allclose(rates, expected, rtol=1e-6)


def sgd_with_momentum_correction(initial_lr, warmup_epochs, epochs, momentum, corrected):
    """Horovod's rule in NumPy (float64): the momentum scaled by new/old lr for one step."""
    x, y = data()
    w = keras.ops.convert_to_numpy(linear_model(keras.optimizers.SGD()).weights[0]).astype(float)
    velocity = np.zeros_like(w)
    old = initial_lr  # the optimizer's rate before the first change
    for step, lr in enumerate(horovod_warmup(initial_lr, warmup_epochs, epochs)):
        xb = x[(step % STEPS) * BATCH : (step % STEPS + 1) * BATCH]
        yb = y[(step % STEPS) * BATCH : (step % STEPS + 1) * BATCH]
        gradient = 2 / BATCH * xb.T @ (xb @ w - yb)
        m = momentum * lr / old if corrected else momentum
        velocity = m * velocity - lr * gradient
        w = w + velocity
        old = lr
    return w


@pytest.mark.parametrize("corrected", [True, False])
def test_momentum_correction_matches_horovod(size, corrected):
    optimizer = keras.optimizers.SGD(0.4, momentum=0.9)
    model = linear_model(optimizer)
    warmup = kr.callbacks.LearningRateWarmupCallback(0.4, 2, momentum_correction=corrected)
    fit_recording(model, [warmup], epochs=3)
    actual = keras.ops.convert_to_numpy(model.weights[0])
    expected = sgd_with_momentum_correction(0.4, 2, 3, 0.9, corrected)
    other = sgd_with_momentum_correction(0.4, 2, 3, 0.9, not corrected)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    # The test can tell the two apart.
    assert not np.allclose(actual, other, rtol=1e-3)
    # Keras's momentum coefficient itself is never changed.
    assert optimizer.momentum == 0.9


def test_momentum_correction_looks_through_loss_scale_optimizer(size):
    inner = keras.optimizers.SGD(0.4, momentum=0.9)
    model = linear_model(keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0))
    warmup = kr.callbacks.LearningRateWarmupCallback(0.4, 2)
    fit_recording(model, [warmup], epochs=3)
    expected = sgd_with_momentum_correction(0.4, 2, 3, 0.9, corrected=True)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(model.weights[0]), expected, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "callback",
    [
        lambda: kr.callbacks.LearningRateWarmupCallback(0.4, 2),
        lambda: kr.callbacks.LearningRateScheduleCallback(0.4, 0.5),
    ],
    ids=["warmup", "schedule"],
)
def test_learning_rate_callbacks_refuse_a_schedule_optimizer(callback):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    with pytest.raises(ValueError, match="LearningRateWarmupSchedule") as error:
        fit_recording(linear_model(keras.optimizers.SGD(schedule)), [callback()], epochs=1)
    # The schedule the user passed, not its current value (a tensor).
    assert str(error.value).endswith(f"Received: optimizer.learning_rate={schedule!r}")
    with pytest.raises(ValueError, match="ExponentialDecay object"):
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(schedule))
        fit_recording(linear_model(optimizer), [callback()], epochs=1)


def test_warmup_needs_steps_per_epoch_for_data_of_unknown_length():
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(BATCH)
    warmup = kr.callbacks.LearningRateWarmupCallback(0.4, 2)
    with pytest.raises(ValueError, match="Pass steps_per_epoch"):
        linear_model(keras.optimizers.SGD(0.1)).fit(
            dataset, shuffle=False, verbose=0, callbacks=[warmup]
        )


@pytest.mark.parametrize(
    "make, received",
    [
        (lambda: kr.callbacks.LearningRateWarmupCallback(0), "initial_lr=0"),
        (lambda: kr.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0), "warmup_epochs=0"),
        (lambda: kr.callbacks.LearningRateScheduleCallback(0.1, "x"), "multiplier='x'"),
        (lambda: kr.callbacks.LearningRateScheduleCallback(0.1, 2, 3, 3), "end_epoch=3"),
        (lambda: kr.callbacks.LearningRateScheduleCallback(0.1, 2, steps_per_epoch=0), "=0"),
        (lambda: kr.callbacks.LearningRateWarmupSchedule(0.1, 0), "warmup_steps=0"),
        (lambda: kr.callbacks.LearningRateWarmupSchedule(0.1, 5, after=0.1), "after=0.1"),
        (lambda: kr.callbacks.LearningRateWarmupSchedule(0.1, 5, size=0), "size=0"),
        (lambda: kr.callbacks.BroadcastGlobalVariablesCallback(-1), "root_rank=-1"),
        (lambda: kr.callbacks.BroadcastGlobalVariablesCallback(True), "root_rank=True"),
    ],
)
def test_arguments_are_checked(make, received):
    with pytest.raises(ValueError, match=f"Received: .*{received}"):
        make()


# The callbacks that communicate, with one rank.


def test_communicating_callbacks_change_nothing_with_one_rank():
    def fit(callbacks):
        model = linear_model(keras.optimizers.Adam(0.1))
        x, y = data()
        history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=callbacks)
        return history.history, keras.ops.convert_to_numpy(model.weights[0])

    plain_history, plain_weights = fit([])
    history, weights = fit(
        [
            kr.callbacks.BroadcastGlobalVariablesCallback(0),
            kr.callbacks.MetricAverageCallback(),
            kr.callbacks.AgreedStoppingCallback(),
        ]
    )
    assert history == plain_history
    np.testing.assert_array_equal(weights, plain_weights)


def test_agreed_stopping_keeps_a_local_stop_with_one_rank():
    x, y = data()
    y[BATCH : 2 * BATCH] = np.nan
    history = linear_model(keras.optimizers.SGD(0.1)).fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN(), kr.callbacks.AgreedStoppingCallback()],
    )
    assert len(history.history["loss"]) == 1
    free_stopped_fit()


# Rank 0 only.


def file_callbacks(tmp_path):
    return [
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "checkpoint.keras")),
        kr.callbacks.BestModelCheckpoint(str(tmp_path / "best.keras"), monitor="loss"),
    ]


def fit_with(callbacks):
    x, y = data()
    linear_model(keras.optimizers.SGD(0.1)).fit(
        x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks
    )


def test_rank_zero_only_keeps_callbacks_on_rank_zero(tmp_path, monkeypatch):
    set_rank(monkeypatch, 0)
    csv, checkpoint, best = file_callbacks(tmp_path)
    assert kr.callbacks.rank_zero_only(csv) is csv
    fit_with([kr.callbacks.rank_zero_only(csv), kr.callbacks.rank_zero_only(checkpoint), best])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.keras",
        "checkpoint.keras",
        "log.csv",
    ]


def test_nothing_is_written_on_other_ranks(tmp_path, monkeypatch):
    set_rank(monkeypatch, 1)
    csv, checkpoint, best = file_callbacks(tmp_path)
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tensorboard"))
    wrapped = [kr.callbacks.rank_zero_only(c) for c in (csv, checkpoint, tensorboard)]
    assert all(type(c) is keras.callbacks.Callback for c in wrapped)
    fit_with([*wrapped, best])
    assert list(tmp_path.iterdir()) == []


def test_rank_zero_only_tensorboard_writes_event_files(tmp_path, monkeypatch):
    # TensorBoard needs the tensorboard package, which TF 2.21 no longer pulls in.
    set_rank(monkeypatch, 0)
    fit_with([kr.callbacks.rank_zero_only(keras.callbacks.TensorBoard(log_dir=str(tmp_path)))])
    assert list(tmp_path.glob("train/events.out.tfevents.*"))


def test_best_model_checkpoint_saves_only_improvements(tmp_path, monkeypatch):
    set_rank(monkeypatch, 0)
    best = kr.callbacks.BestModelCheckpoint(
        str(tmp_path / "best_{epoch}.keras"), monitor="loss", mode="max"
    )
    assert isinstance(best, keras.callbacks.ModelCheckpoint) and best.save_best_only
    fit_with([best])  # the loss falls: only epoch 1 is a "best" in max mode
    assert [p.name for p in tmp_path.iterdir()] == ["best_1.keras"]


def test_rank_zero_only_refuses_what_must_run_everywhere():
    with pytest.raises(ValueError, match="every rank must run it"):
        kr.callbacks.rank_zero_only(kr.callbacks.MetricAverageCallback())
    with pytest.raises(TypeError, match="Received: callback='log.csv'"):
        kr.callbacks.rank_zero_only("log.csv")


# BackupAndRestore with one rank: Keras's callback.

BACKUP_EPOCHS = 4


def backup_model(seed=0, lazy=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers if lazy else [keras.Input((3,)), *layers])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def backup_fit(model, callbacks, epochs=BACKUP_EPOCHS):
    """The epochs run, or None if a callback interrupted training."""
    x, y = data()
    try:
        history = model.fit(
            x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
        )
    except RuntimeError as e:
        assert str(e) == "interrupted"
    else:
        return len(history.history.get("loss", []))
    free_stopped_fit()
    return None


def free_stopped_fit():
    """Frees what a fit stopped within an epoch leaves in a reference cycle, while it is young.

    Keras's epoch iterator is such a cycle. Freed late, by a collection in a
    later test, a tf.data iterator waits out its autotuner's sleep, which grows
    with the iterator's age (see tests/workers/callbacks_worker.py).
    """
    gc.collect()


def backup_state(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables]


def interrupted_and_resumed(make_callback, backup_dir, interrupt, lazy=False):
    """Interrupts a fit, then fits a fresh model (a restarted job) with a fresh callback.

    Returns the resumed model's state, the epochs it ran, and the backup found
    after the interruption: its file names and its training metadata.
    """
    ran = backup_fit(backup_model(0, lazy), [make_callback(backup_dir), interrupt])
    assert ran is None
    files = sorted(p.name for p in backup_dir.iterdir())
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    model = backup_model(1, lazy)
    epochs = backup_fit(model, [make_callback(backup_dir)])
    assert not backup_dir.exists()  # delete_checkpoint=True
    return backup_state(model), epochs, files, metadata


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "arguments, interrupt, epochs",
    [
        ({}, (1, None), BACKUP_EPOCHS - 2),
        ({"double_checkpoint": True}, (2, None), BACKUP_EPOCHS - 3),
        # Saved at epoch 1, batch 0: Keras runs epoch 1 again, from those weights.
        ({"save_freq": 3}, (1, 2), BACKUP_EPOCHS - 1),
    ],
)
def test_backup_and_restore_resumes_as_keras_does(tmp_path, arguments, interrupt, epochs):
    results = {}
    for name, cls in (
        ("keras", keras.callbacks.BackupAndRestore),
        ("kr", kr.callbacks.BackupAndRestore),
    ):
        results[name] = interrupted_and_resumed(
            lambda d: cls(d, **arguments), tmp_path / name, Interrupt(*interrupt)
        )
    (keras_state, keras_epochs, keras_files, keras_metadata) = results["keras"]
    (state, ran, files, metadata) = results["kr"]
    assert ran == keras_epochs == epochs
    assert files == keras_files
    assert metadata.pop("build_config") == {"input_shape": [None, 3]}
    assert metadata == keras_metadata
    assert_same_state(state, keras_state)
    if "save_freq" not in arguments:  # resumed at an epoch's start: as if never interrupted
        model = backup_model(0)
        backup_fit(model, [])
        assert_same_state(state, backup_state(model))


def test_backup_and_restore_keeps_the_backup_if_asked(tmp_path):
    callback = kr.callbacks.BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)
    assert backup_fit(backup_model(), [callback]) == BACKUP_EPOCHS
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == BACKUP_EPOCHS
    # The next fit resumes after the last epoch: nothing is left to run.
    assert backup_fit(backup_model(), [callback]) == 0


def test_backup_and_restore_resumes_only_the_fit_that_restored_even_if_interrupted(tmp_path):
    backup_dir = tmp_path / "backup"
    assert backup_fit(backup_model(), [kr.callbacks.BackupAndRestore(backup_dir),
                                       Interrupt(1)]) is None
    model = backup_model(1)
    # Resumed at epoch 2, then interrupted in it.
    assert backup_fit(model, [kr.callbacks.BackupAndRestore(backup_dir), Interrupt(2, 0)]) is None
    # A fit without the callback, or with a new one elsewhere, starts at its own epoch 0.
    assert backup_fit(model, [], epochs=2) == 2
    assert backup_fit(model, [kr.callbacks.BackupAndRestore(tmp_path / "other")], epochs=2) == 2


def test_backup_and_restore_falls_back_to_the_previous_backup(tmp_path):
    backup_dir = tmp_path / "backup"
    make = lambda: kr.callbacks.BackupAndRestore(backup_dir, double_checkpoint=True)  # noqa: E731
    assert backup_fit(backup_model(), [make(), Interrupt(2)]) is None
    (backup_dir / "latest.weights.h5").write_bytes(b"corrupted")
    model = backup_model(1)
    assert backup_fit(model, [make()]) == BACKUP_EPOCHS - 2  # from the end of epoch 1
    reference = backup_model()
    backup_fit(reference, [])
    assert_same_state(backup_state(model), backup_state(reference))


def test_backup_and_restore_raises_for_a_corrupted_backup(tmp_path):
    backup_dir = tmp_path / "backup"
    assert (
        backup_fit(backup_model(), [kr.callbacks.BackupAndRestore(backup_dir), Interrupt(0)])
        is None
    )
    (backup_dir / "latest.weights.h5").write_bytes(b"corrupted")
    with pytest.raises(OSError):
        backup_fit(backup_model(), [kr.callbacks.BackupAndRestore(backup_dir)])


def test_backup_and_restore_resumes_a_lazily_built_model(tmp_path):
    # Keras's own callback refuses a model that is not built when fit starts.
    with pytest.raises(ValueError, match="must be built before you call `fit\\(\\)`"):
        backup_fit(backup_model(lazy=True), [keras.callbacks.BackupAndRestore(tmp_path / "k")])
    state, epochs, _, metadata = interrupted_and_resumed(
        kr.callbacks.BackupAndRestore, tmp_path / "backup", Interrupt(1), lazy=True
    )
    assert "build_config" in metadata
    assert epochs == BACKUP_EPOCHS - 2
    reference = backup_model(0, lazy=True)
    backup_fit(reference, [])
    assert_same_state(state, backup_state(reference))


def test_backup_and_restore_refuses_a_lazy_model_without_a_build_config(tmp_path):
    backup_dir = tmp_path / "backup"
    assert (
        backup_fit(backup_model(), [kr.callbacks.BackupAndRestore(backup_dir), Interrupt(0)])
        is None
    )
    path = backup_dir / "training_metadata.json"
    path.write_text(json.dumps({"epoch": 1, "batch": 0}))  # as Keras's callback writes it
    with pytest.raises(ValueError, match="must be built before you call `fit\\(\\)`"):
        backup_fit(backup_model(lazy=True), [kr.callbacks.BackupAndRestore(backup_dir)])


def test_backup_and_restore_resumes_only_the_fit_that_restored(tmp_path):
    model = backup_model()
    callback = kr.callbacks.BackupAndRestore(tmp_path / "backup")
    assert backup_fit(model, [callback, Interrupt(1)]) is None
    assert backup_fit(model, [callback]) == BACKUP_EPOCHS - 2
    assert backup_fit(model, []) == BACKUP_EPOCHS
    # Resumed, interrupted again, and the backup removed: the next fit starts afresh.
    assert backup_fit(model, [callback, Interrupt(1)]) is None
    assert backup_fit(model, [callback, Interrupt(2)]) is None
    shutil.rmtree(tmp_path / "backup")
    assert backup_fit(model, [callback]) == BACKUP_EPOCHS


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"backup_dir": ""}, "Empty `backup_dir` argument passed"),
        ({"backup_dir": "b", "save_freq": "batch"}, "Invalid value for argument `save_freq`"),
        ({"backup_dir": "b", "save_freq": 0.15}, "Invalid value for argument `save_freq`"),
    ],
)
def test_backup_and_restore_checks_arguments_as_keras_does(arguments, message):
    for cls in (keras.callbacks.BackupAndRestore, kr.callbacks.BackupAndRestore):
        with pytest.raises(ValueError, match=message):
            cls(**arguments)


# Data helpers.


def elements(dataset):
    return [int(x) for x in dataset.as_numpy_iterator()]


@pytest.mark.parametrize(
    "rank, drop_remainder, expected",
    [
        (0, False, [0, 3, 6, 9]),
        (1, False, [1, 4, 7]),
        (0, True, [0, 3, 6]),
        (2, True, [2, 5, 8]),
    ],
)
def test_shard_dataset(monkeypatch, rank, drop_remainder, expected):
    monkeypatch.setattr(_basics, "size", lambda: 3)
    set_rank(monkeypatch, rank)
    dataset = tf.data.Dataset.range(10)
    assert elements(kr.shard_dataset(dataset, drop_remainder=drop_remainder)) == expected


def test_shard_dataset_drop_remainder_needs_a_known_length(monkeypatch):
    monkeypatch.setattr(_basics, "size", lambda: 3)
    set_rank(monkeypatch, 1)
    infinite = kr.shard_dataset(tf.data.Dataset.range(10).repeat(), drop_remainder=True)
    assert elements(infinite.take(4)) == [1, 4, 7, 0]
    unknown = tf.data.Dataset.range(10).filter(lambda x: x < 5)
    with pytest.raises(ValueError, match="assert_cardinality"):
        kr.shard_dataset(unknown, drop_remainder=True)
    with pytest.raises(TypeError, match="Received: dataset=\\[1, 2\\]"):
        kr.shard_dataset([1, 2])


@pytest.mark.parametrize("rank, expected", [(0, 2), (1, 0), (2, 0)])
def test_rank_zero_verbose(monkeypatch, rank, expected):
    set_rank(monkeypatch, rank)
    assert kr.rank_zero_verbose(2) == expected
