"""Multi-rank checks of keras_ring.callbacks, for tests/test_callbacks_multirank.py.

Run with 2 or 3 ranks, under the test launcher or plainly:
`mpiexec -n 3 python tests/workers/callbacks_worker.py OUT_DIR SCENARIO...`.

Each scenario trains a small model with plain Keras optimizers (no gradient
reduction: the callbacks are what is tested) and checks its results against
every rank's values, gathered with keras-ring's collectives. Failed checks are
collected and reported at the end (exit 1); an unexpected exception exits at
once, and the launcher then stops the other ranks.
"""

import contextlib
import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import shutil
import sys
import tempfile
import time
import traceback

import keras
import numpy as np

# Under the Keras backend KERAS_BACKEND names.
BACKEND = keras.backend.backend()
if BACKEND == "tensorflow":
    import tensorflow as tf

    # Up to 3 ranks share 2 cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
elif BACKEND == "torch":
    import torch

    torch.set_num_threads(1)

from interrupt_callback import Interrupt  # noqa: E402

import keras_ring as kr  # noqa: E402

BATCH = 8
# The guard must answer in about the time of a few exchanges, not a timeout.
GUARD_SECONDS = 20
RANK = SIZE = None
failures = []


def check(condition, message):
    if not condition:
        failures.append(f"rank {RANK}: {message}")


def gathered(values, tag):
    """Every rank's float vector `values`, one row per rank."""
    # Objects, not a framework's tensors: the same under every backend.
    del tag
    return np.stack(kr.allgather_object(np.asarray(values, np.float64).ravel()))


def state(variables):
    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in variables]).astype(
        np.float64
    )


def small_model(optimizer=None, model_class=keras.Sequential, steps_per_execution=1):
    model = model_class(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse",
                  steps_per_execution=steps_per_execution)
    return model


def data(batches, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batches * BATCH, 3)), rng.normal(size=(batches * BATCH, 1))


class EpochMetric(keras.callbacks.Callback):
    """Logs a metric of this rank's own, `rank_metric = rank`, and records the logs."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        logs["rank_metric"] = float(RANK)
        self.logs.append(dict(logs))


class Recorder(keras.callbacks.Callback):
    """Records the epoch-end logs and the (epoch, batch) of every ended batch."""

    def __init__(self):
        super().__init__()
        self.logs = []
        self.batches = []
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


if BACKEND == "tensorflow":
    class CollectiveStepModel(keras.Sequential):
        """Communicates in every train step, as a DistributedOptimizer does."""

        def train_step(self, data):
            kr.allreduce(tf.constant(1.0), name="worker.train_step")
            return super().train_step(data)
elif BACKEND == "torch":
    import keras_ring.torch as krt

    class CollectiveStepModel(keras.Sequential):
        """Communicates in every train step, as a DistributedOptimizer does."""

        def train_step(self, data):
            krt.allreduce(torch.tensor(1.0), name="worker.train_step")
            return super().train_step(data)
else:

    import keras_ring.jax as krj

    class CollectiveStepModel(keras.Sequential):
        """Communicates in every train step, as a DistributedOptimizer does."""

        def train_step(self, state, data):
            krj.allreduce(np.float32(1.0), name="worker.train_step")
            return super().train_step(state, data)


def scenario_broadcast(out_dir):
    """From root size-1: equal model and optimizer state before the first update, and after it."""
    root = SIZE - 1
    keras.utils.set_random_seed(100 + RANK)
    optimizer = keras.optimizers.Adam(0.01)
    model = small_model(optimizer)
    initial = gathered(state(model.weights), "broadcast.initial")
    check(not np.array_equal(initial[0], initial[1]), "ranks should start from different weights")
    if RANK == root:
        # State that only the root has: slots, step count.
        optimizer.build(model.trainable_weights)
        rng = np.random.default_rng(7)
        for variable in optimizer.variables:
            if variable is optimizer.iterations:
                variable.assign(7)
            elif variable is not optimizer.learning_rate:
                variable.assign(rng.uniform(0.1, 1.0, variable.shape))
        root_state = state(model.weights + optimizer.variables)
    else:
        check(not optimizer.built, "the optimizer should not be built before fit")

    class CaptureBeforeFirstStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.state = state(self.model.weights + self.model.optimizer.variables)

    capture = CaptureBeforeFirstStep()
    x, y = data(1, seed=0)  # the same batch on every rank
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(root), capture],
    )
    before = gathered(capture.state, "broadcast.before")
    check((before == before[root]).all(), "state before the first update differs between ranks")
    if RANK == root:
        check(np.array_equal(capture.state, root_state), "the root's state changed")
    after = gathered(state(model.weights + optimizer.variables), "broadcast.after")
    # Equal up to rounding: Eigen's vectorised reductions round by memory
    # alignment, which differs between processes.
    check(
        np.allclose(after, after[root], rtol=1e-5, atol=1e-7),
        "state after one identical step differs between ranks",
    )
    check(int(optimizer.iterations.numpy()) == 8, "the root's step count was not broadcast")


def scenario_metric_average(out_dir):
    """Averaged epoch-end logs on every rank; EarlyStopping after the averaging sees the mean."""
    model = small_model()
    x, y = data(4, seed=RANK)
    own = EpochMetric()
    seen = Recorder()
    # rank_metric = rank: below the baseline on rank 0 only, while the mean
    # ((size - 1) / 2 >= 0.5) never beats it, so all ranks stop after epoch 2.
    stopping = keras.callbacks.EarlyStopping(
        monitor="rank_metric", mode="min", baseline=0.5, patience=1
    )
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=5,
        verbose=0,
        callbacks=[own, kr.callbacks.MetricAverageCallback(), seen, stopping],
    )
    check(len(seen.logs) == 2, f"EarlyStopping should stop after 2 epochs, ran {len(seen.logs)}")
    for epoch, (mine, averaged) in enumerate(zip(own.logs, seen.logs)):
        losses = gathered([mine["loss"]], f"metrics.loss.{epoch}")[:, 0]
        check(
            np.isclose(averaged["loss"], losses.mean(), rtol=1e-12),
            f"epoch {epoch}: averaged loss {averaged['loss']}, expected {losses.mean()}",
        )
        check(
            averaged["rank_metric"] == (SIZE - 1) / 2,
            f"epoch {epoch}: rank_metric {averaged['rank_metric']}",
        )
    check(history.history["loss"] == [e["loss"] for e in seen.logs], "History is not averaged")


def scenario_agreed_stopping(out_dir):
    """TerminateOnNaN on the last rank, then EarlyStopping on the last rank: all stop alike."""
    nan_batch = 2
    x, y = data(6, seed=RANK)
    if RANK == SIZE - 1:
        y[nan_batch * BATCH : (nan_batch + 1) * BATCH] = np.nan
    seen = Recorder()
    small_model().fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN(), kr.callbacks.AgreedStoppingCallback(), seen],
    )
    expected = [(0, b) for b in range(nan_batch + 1)]
    check(seen.batches == expected, f"TerminateOnNaN: ran batches {seen.batches}, not {expected}")

    seen = Recorder()
    # Only the last rank's own rank_metric misses the baseline.
    stopping = keras.callbacks.EarlyStopping(
        monitor="rank_metric", mode="min", baseline=SIZE - 1.5, patience=1
    )
    x, y = data(2, seed=RANK)
    small_model().fit(
        x,
        y,
        batch_size=BATCH,
        epochs=5,
        verbose=0,
        callbacks=[EpochMetric(), stopping, kr.callbacks.AgreedStoppingCallback(), seen],
    )
    check(len(seen.logs) == 2, f"EarlyStopping on one rank: ran {len(seen.logs)} epochs, not 2")


def scenario_rank_zero_files(out_dir):
    """Checkpoints and CSV logs are written by rank 0 only (the test lists them)."""
    x, y = data(2, seed=RANK)
    path = os.path.join(out_dir, f"{{}}_rank{RANK}")
    seen = Recorder()
    history = small_model().fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[
            kr.callbacks.MetricAverageCallback(),
            kr.callbacks.BestModelCheckpoint(path.format("best") + ".keras", monitor="loss"),
            kr.callbacks.rank_zero_only(keras.callbacks.CSVLogger(path.format("log") + ".csv")),
            kr.callbacks.rank_zero_only(
                keras.callbacks.ModelCheckpoint(path.format("checkpoint") + ".keras")
            ),
            seen,
        ],
    )
    if RANK == 0:
        rows = np.genfromtxt(path.format("log") + ".csv", delimiter=",", names=True)
        check(
            np.allclose(rows["loss"], history.history["loss"]),
            "the CSV log should hold the averaged loss",
        )


@contextlib.contextmanager
def logged():
    """Collects what keras-ring logs (on file descriptor 2) meanwhile, as lines."""
    lines = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            lines += log.read().splitlines()


def expect_error(tag, fit, *fragments):
    """Runs `fit`, which must raise a RuntimeError containing `fragments` within GUARD_SECONDS."""
    start = time.monotonic()
    try:
        fit()
    except RuntimeError as e:
        message = str(e)
        missing = [f for f in fragments if f not in message]
        check(not missing, f"{tag}: the message lacks {missing}: {message}")
        if RANK == 0:
            print(f"{tag}: {message}")
    else:
        check(False, f"{tag}: fit() did not raise")
    elapsed = time.monotonic() - start
    check(elapsed < GUARD_SECONDS, f"{tag}: took {elapsed:.1f} s")


def scenario_guard(out_dir):
    """Ranks out of step raise an actionable error on every rank instead of waiting."""
    # Several steps per call of the train function: ranks with different numbers of
    # batches cannot join each other's remaining steps, caught at the start of training.
    # Keras's torch trainer runs one step per call.
    if BACKEND != "torch":
        x, y = data(4 + RANK, seed=RANK)
        expect_error(
            "known steps",
            lambda: small_model(steps_per_execution=2).fit(
                x,
                y,
                batch_size=BATCH,
                verbose=0,
                callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)],
            ),
            "different numbers of steps per epoch",
            *[f"rank {r}: {4 + r}" for r in range(SIZE)],
            "steps_per_execution=2",
            "shard_dataset",
        )
    if BACKEND == "tensorflow":
        # Of unknown length (tf.data's filter): rank 0 warns that it cannot check (here the
        # lengths agree).
        x, y = data(4, seed=RANK)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(BATCH)
        with logged() as lines:
            small_model(steps_per_execution=2).fit(
                dataset, verbose=0, callbacks=[kr.callbacks.MetricAverageCallback()]
            )
        unknown_warnings = [line for line in lines if "unknown length" in line]
        check(len(unknown_warnings) == (RANK == 0),
              f"unknown-length warnings: {unknown_warnings}")

    # A rank that stops alone, although every train step communicates: caught
    # at the start of the next step, before the train step's collective.
    x, y = data(6, seed=RANK)
    if RANK == SIZE - 1:
        y[BATCH : 2 * BATCH] = np.nan
    expect_error(
        "stopped alone",
        lambda: small_model(model_class=CollectiveStepModel).fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.TerminateOnNaN(), kr.callbacks.MetricAverageCallback()],
        ),
        "out of step",
        f"rank {SIZE - 1} has ended epoch 1 after 2 steps",
        "rank 0 is starting step 3 of epoch 1",
        "AgreedStoppingCallback",
    )

    # Different metrics: named per rank.
    class ExtraMetric(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if RANK == 0:
                logs["extra"] = 1.0

    x, y = data(2, seed=RANK)
    expect_error(
        "different metrics",
        lambda: small_model().fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[ExtraMetric(), kr.callbacks.MetricAverageCallback()],
        ),
        "logged different metrics",
        "rank 0: [extra, loss]",
        "rank 1: [loss]",
    )


# BackupAndRestore: E epochs of STEPS batches per rank, interrupted on every
# rank and resumed. Gradients are averaged (DistributedOptimizer) and the model
# has no per-rank state (no batch normalisation), so every rank holds the same
# state throughout and the resumed runs must end where the uninterrupted run does.
BACKUP_EPOCHS, BACKUP_STEPS = 4, 4
BACKUP_FILES = ["latest.weights.h5", "training_metadata.json"]


def backup_model(seed, lazy=False):
    """A fresh model and optimizer, as a restarted job builds them: initialised per rank."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers if lazy else [keras.Input((3,)), *layers])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    return model


def backup_fit(model, callbacks, interrupt=None):
    """Fits on this rank's data; returns the number of epochs run, or None when interrupted."""
    x, y = data(BACKUP_STEPS, seed=RANK)
    seen = Recorder()
    extra = [interrupt] if interrupt else []
    try:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=BACKUP_EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[*callbacks, seen, *extra],
        )
    except RuntimeError as e:
        if str(e) != "interrupted":
            raise
    else:
        return len(seen.logs)
    gc.collect()  # see main()
    return None


def backup_state(model):
    return state(model.weights + model.optimizer.variables)


def check_same_on_every_rank(values, tag):
    rows = gathered(values, tag)
    # Equal up to float rounding (bitwise in the runs here).
    check(np.allclose(rows, rows[0], rtol=1e-6, atol=1e-7), f"{tag}: ranks differ")


def scenario_backup_and_restore(out_dir):
    """kr.callbacks.BackupAndRestore with one backup_dir for every rank: written by rank 0 only,
    restored on every rank through collectives, resumed where the uninterrupted run goes."""
    interrupted_at = 1  # the interrupted runs end with epoch 2 of 4
    model = backup_model(100 + RANK)
    backup_fit(model, [kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = backup_state(model)
    check_same_on_every_rank(reference, "backup.reference")

    def check_resumed(tag, model, epochs_run, expected=reference, epochs=None):
        epochs = BACKUP_EPOCHS - interrupted_at - 1 if epochs is None else epochs
        check(epochs_run == epochs, f"{tag}: resumed for {epochs_run} epochs, not {epochs}")
        final = backup_state(model)
        # Equal up to float rounding (the same ops on the same values).
        check(np.allclose(final, expected, rtol=1e-6, atol=1e-7), f"{tag}: not the reference")
        check_same_on_every_rank(final, f"{tag}.final")

    def check_backup(tag, backup_dir, epoch):
        """After an interruption: the backup of rank 0, in backup_dir (seen from every rank)."""
        kr.barrier()
        files = sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else None
        check(files == BACKUP_FILES, f"{tag}: backup files {files}")
        if files:
            with open(os.path.join(backup_dir, "training_metadata.json")) as f:
                recorded = json.load(f)["epoch"]
            check(recorded == epoch, f"{tag}: the backup records epoch {recorded}, not {epoch}")

    def check_deleted(tag, backup_dir):
        kr.barrier()
        check(not os.path.exists(backup_dir), f"{tag}: {backup_dir} was not deleted")

    orders = {
        "broadcast first": lambda d: [
            kr.callbacks.BroadcastGlobalVariablesCallback(0),
            kr.callbacks.BackupAndRestore(d),
        ],
        "backup first": lambda d: [
            kr.callbacks.BackupAndRestore(d),
            kr.callbacks.BroadcastGlobalVariablesCallback(0),
        ],
    }
    # A restarted job: fresh models initialised per rank, fresh callbacks, one
    # shared directory; the model built (Input) or lazily. The broadcast of
    # the root's fresh weights comes first (in a lazily built model, from the
    # DistributedOptimizer as it is built), so a restore on rank 0 alone would
    # leave the other ranks with those fresh weights.
    cases = [("broadcast first", False), ("broadcast first", True)]
    for order, lazy in cases:
        tag = f"backup.{order}{' lazy' if lazy else ''}"
        backup_dir = os.path.join(out_dir, "backup_shared")
        callbacks = orders[order]
        ran = backup_fit(
            backup_model(100 + RANK, lazy), callbacks(backup_dir), Interrupt(interrupted_at)
        )
        check(ran is None, f"{tag}: the first fit was not interrupted")
        check_backup(tag, backup_dir, interrupted_at + 1)
        resumed = backup_model(200 + RANK, lazy)
        check_resumed(tag, resumed, backup_fit(resumed, callbacks(backup_dir)))
        check_deleted(tag, backup_dir)

    # One directory per rank, the other order: only rank 0's directory is
    # written, and the other ranks, whose directories never exist, still
    # resume from rank 0's state.
    tag = "backup.per-rank dirs, backup first"
    own_dir = os.path.join(out_dir, f"backup_rank{RANK}")
    ran = backup_fit(
        backup_model(100 + RANK), orders["backup first"](own_dir), Interrupt(interrupted_at)
    )
    check(ran is None, f"{tag}: the first fit was not interrupted")
    kr.barrier()
    written = sorted(p for p in os.listdir(out_dir) if p.startswith("backup"))
    check(written == ["backup_rank0"], f"{tag}: directories written: {written}")
    resumed = backup_model(200 + RANK)
    check_resumed(tag, resumed, backup_fit(resumed, orders["backup first"](own_dir)))
    check_deleted(tag, os.path.join(out_dir, "backup_rank0"))

    # The same model and the same callback fit again, as in Keras's tests.
    tag = "backup.same callback"
    backup_dir = os.path.join(out_dir, "backup_shared")
    model = backup_model(100 + RANK)
    callbacks = orders["broadcast first"](backup_dir)
    check(
        backup_fit(model, callbacks, Interrupt(interrupted_at)) is None, f"{tag}: not interrupted"
    )
    check_resumed(tag, model, backup_fit(model, callbacks))
    check_deleted(tag, backup_dir)

    # save_freq in batches, interrupted within an epoch: resumed as Keras's own
    # callback resumes with one directory per rank (at the start of the epoch
    # of the last backup, from the weights of that backup).
    save_freq = 3
    interrupt = Interrupt(interrupted_at, batch=2)  # the last backup: epoch 1, batch 1
    keras_dir = tempfile.mkdtemp(prefix=f"keras_backup_rank{RANK}_")
    broadcast = kr.callbacks.BroadcastGlobalVariablesCallback(0)
    keras_backup = keras.callbacks.BackupAndRestore(keras_dir, save_freq=save_freq)
    check(
        backup_fit(backup_model(100 + RANK), [broadcast, keras_backup], interrupt) is None,
        "backup.keras: not interrupted",
    )
    keras_model = backup_model(200 + RANK)
    keras_backup = keras.callbacks.BackupAndRestore(keras_dir, save_freq=save_freq)
    keras_epochs = backup_fit(keras_model, [broadcast, keras_backup])
    check(keras_epochs == BACKUP_EPOCHS - interrupted_at, f"backup.keras: {keras_epochs} epochs")

    tag = "backup.save_freq"
    backup_dir = os.path.join(out_dir, "backup_shared")
    ours = kr.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)
    check(
        backup_fit(backup_model(100 + RANK), [broadcast, ours], interrupt) is None,
        f"{tag}: not interrupted",
    )
    check_backup(tag, backup_dir, interrupted_at)
    resumed = backup_model(200 + RANK)
    ours = kr.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)
    check_resumed(
        tag,
        resumed,
        backup_fit(resumed, [ours]),
        expected=backup_state(keras_model),
        epochs=keras_epochs,
    )
    check_deleted(tag, backup_dir)

    # A rank without the callback: an error on every rank, naming it, not a hang.
    callbacks = [kr.callbacks.BroadcastGlobalVariablesCallback(0)]
    if RANK == 0:
        callbacks.insert(0, kr.callbacks.BackupAndRestore(backup_dir))
    expect_error(
        "backup on rank 0 only",
        lambda: backup_fit(backup_model(100 + RANK), callbacks),
        "out of step",
        "rank 0 is starting training (in BackupAndRestore)",
        "rank 1 is starting training (in BroadcastGlobalVariablesCallback)",
    )

    # A backup that rank 0 cannot read: rank 0's error on rank 0, named on the others.
    kr.barrier()
    if RANK == 0:
        os.makedirs(backup_dir)
        with open(os.path.join(backup_dir, "latest.weights.h5"), "wb") as f:
            f.write(b"corrupted")
    kr.barrier()
    try:
        backup_fit(backup_model(100 + RANK), [kr.callbacks.BackupAndRestore(backup_dir)])
    except (OSError, RuntimeError) as e:
        expected = OSError if RANK == 0 else RuntimeError
        check(isinstance(e, expected), f"backup.corrupted: {type(e).__name__}: {e}")
        if RANK:
            check("rank 0 could not restore the backup" in str(e), f"backup.corrupted: {e}")
    else:
        check(False, "backup.corrupted: fit() did not raise")
    kr.barrier()
    if RANK == 0:
        shutil.rmtree(backup_dir)


SCENARIOS = {
    "broadcast": scenario_broadcast,
    "metric_average": scenario_metric_average,
    "agreed_stopping": scenario_agreed_stopping,
    "rank_zero_files": scenario_rank_zero_files,
    "guard": scenario_guard,
    "backup_and_restore": scenario_backup_and_restore,
}


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    out_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        start = time.monotonic()
        try:
            SCENARIOS[name](out_dir)
        except Exception:
            traceback.print_exc()
            print(f"rank {RANK}: scenario {name} raised", flush=True)
            os._exit(1)
        # A fit stopped within an epoch leaves Keras's epoch iterator in a
        # reference cycle. Freed late, a tf.data iterator waits out its
        # autotuner's sleep, which grows with the iterator's age: a rank
        # stalled up to a minute in a later collection or at exit.
        gc.collect()
        if RANK == 0:
            print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)
    for failure in failures:
        print(failure, flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
