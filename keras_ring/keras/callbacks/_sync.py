"""Keeps the ranks in step during `fit`: the exchanges keras-ring's callbacks communicate through.

A rank that stopped training on its own leaves its peers waiting in their
next collective, which may be a gradient allreduce inside the train step: a
hang, not an error. So every collective a keras-ring callback makes during
`fit` is preceded, at the same point of training, by an *exchange*: one small
allgather under one fixed name that carries where each rank is (the point in
`fit`, epoch, step) and which callback asks. Exchanges are eager and run one
at a time, so the n-th exchange of every rank pairs with the n-th of the
others: ranks that are out of step meet in an exchange (never in a gradient
allreduce) and all of them raise the same error, naming where each rank is.

Ranks may run different numbers of steps in an epoch (uneven shards, data of
unknown length). A rank whose steps have ended joins (`keras_ring.join`) at
the end of its train loop, the first of fit's validation (`on_test_begin`)
and `on_epoch_end`: the others' remaining steps run with zeros from it in
their gradient allreduces, and their exchanges, being allgathers, go on
without its row. Once every rank has joined, the ranks that ran the most
steps broadcast the model's and the optimizer's state to the others, who
missed the last updates.

`SyncedCallback` is the base of the callbacks that communicate. Its hooks run
the step guard: an exchange at train begin (which also compares the epochs,
and refuses Keras's own `BackupAndRestore` given one directory on every rank
of a host),
at each batch begin (before the train step's own collectives), at the end of
each epoch's train loop, at each epoch end and at train end (counting the
ended steps at each batch end needs none). The callbacks of one `fit` share
one guard, so the guard exchanges once per point however many keras-ring
callbacks are in the list.
"""

import sys
import zlib

import keras
import numpy as np

from keras_ring.core import _basics, _host_collectives, _log, _objects
from keras_ring.keras import _divergence, _optimizer

# Points in `fit`.
TRAIN_BEGIN, BATCH_BEGIN, BATCH_END, EPOCH_END, TRAIN_END, TEST_END, LOOP_END = range(1, 8)
# Who exchanges: names each rank's position when ranks disagree.
GUARD, VARIABLES, METRICS, STOP, BACKUP = range(5)
_KINDS = {
    GUARD: "keras-ring's step guard",
    VARIABLES: "BroadcastGlobalVariablesCallback",
    METRICS: "MetricAverageCallback",
    STOP: "AgreedStoppingCallback",
    BACKUP: "BackupAndRestore",
}
# A row of an exchange: the rank, then its position (point, epoch, step,
# kind: must agree on every rank), then the values compared.
_RANK, _POSITION, _VALUES = 1, 4, 4
_NAME = "keras_ring.callbacks.sync"

NOT_DISTRIBUTED_WARNING = (
    "The model's optimizer is not a keras_ring.DistributedOptimizer, so each rank applies its "
    "own gradients and the ranks' weights drift apart. Compile with "
    "optimizer=keras_ring.DistributedOptimizer(...); load a saved model with "
    "keras_ring.load_model(path), not keras.models.load_model, which gives back the plain "
    "optimizer. (A train_step of your own that reduces gradients with "
    "keras_ring.DistributedGradientTape needs neither.)"
)
STEPS_ADVICE = (
    "A rank whose data runs out in the middle of a call of the train function cannot join "
    "the others' remaining steps, so with steps_per_execution > 1 every rank must run the "
    "same number of steps in each epoch: shard with keras_ring.shard_dataset(dataset, "
    "drop_remainder=True) before batching, or pass steps_per_epoch to fit() no larger than the "
    "smallest rank's number of batches (with dataset.repeat()), or compile with "
    "steps_per_execution=1, with which ranks that run different numbers of steps train together."
)
UNKNOWN_STEPS_WARNING = (
    "Keras does not know the number of steps per epoch (the data has an unknown length), so "
    "keras-ring cannot check before training that all ranks run the same number, which "
    "steps_per_execution={per_call} needs: a rank whose data runs out first leaves the others "
    "waiting in their gradient allreduce, and the job fails after "
    "KERAS_RING_STALL_SHUTDOWN_TIME seconds (default 600). " + STEPS_ADVICE
)
STOP_ADVICE = (
    "If a callback stopped training on some ranks only (EarlyStopping, TerminateOnNaN), put "
    "keras_ring.callbacks.AgreedStoppingCallback() after it in the callbacks list."
)


def exchange(point, epoch, step, kind, values=()):
    """Checks that all ranks are at the same point; reduces `values` over the ranks.

    Collective: every rank that has not joined must call it at the same point
    of `fit`; joined ranks take no part.

    Args:
        point: Where in `fit` this rank is (`TRAIN_BEGIN`, ...).
        epoch: The epoch index (or -1 before the first epoch).
        step: The step within the epoch (see `_StepGuard.exchange`).
        kind: Who exchanges (`GUARD`, `VARIABLES`, `METRICS`, `STOP`).
        values: Up to four integers to compare across the ranks.

    Returns:
        `(low, high)`: the minimum and maximum of each of `values` over the
        ranks, as NumPy int64 arrays, the same on every rank.

    Raises:
        RuntimeError: On every rank, if the ranks are not at the same point,
            naming where each rank is.
    """
    values = exchange_rows(point, epoch, step, kind, values)[:, 1:]
    return values.min(axis=0), values.max(axis=0)


def exchange_rows(point, epoch, step, kind, values=()):
    """`exchange()`, returning one row `(rank, values...)` per rank that took part."""
    mine = np.zeros(_RANK + _POSITION + _VALUES, np.int64)
    mine[: _RANK + _POSITION] = (_basics.rank(), point, epoch, step, kind)
    mine[_RANK + _POSITION : _RANK + _POSITION + len(values)] = values
    rows = mine[None] if _basics.size() == 1 else _host_collectives.allgather(mine[None], _NAME)
    position = rows[:, _RANK : _RANK + _POSITION]
    if (position != position[0]).any():
        raise RuntimeError(_out_of_step_message(rows))
    return np.delete(rows, np.s_[_RANK : _RANK + _POSITION], axis=1)


def gather(values):
    """Returns every rank's integer `values`, one row per rank. Collective."""
    row = np.asarray(values, np.int64).reshape(1, -1)
    return _host_collectives.allgather(row, f"{_NAME}.gather")


def gather_text(text):
    """Returns every rank's `text`, a list indexed by rank. Collective."""
    data = np.frombuffer(text.encode(), np.uint8)
    lengths = gather([data.size])[:, 0]
    joined = _host_collectives.allgather(data, f"{_NAME}.text").tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [joined[a:b].decode() for a, b in zip(offsets[:-1], offsets[1:])]


def digest(text):
    """A checksum of `text` that is the same on every rank."""
    return zlib.crc32(text.encode())


def per_rank(values):
    """'rank 0: a, rank 1: b' for a message."""
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _where(point, epoch, step):
    epoch += 1  # as Keras's progress bar and messages count epochs
    return {
        TRAIN_BEGIN: "is starting training",
        BATCH_BEGIN: f"is starting step {step + 1} of epoch {epoch}",
        BATCH_END: f"is ending step {step} of epoch {epoch}",
        EPOCH_END: f"has ended epoch {epoch} after {step} steps",
        TRAIN_END: "has ended training",
        TEST_END: "has ended evaluating" if epoch < 1 else f"has ended validating epoch {epoch}",
        LOOP_END: f"has ended the steps of epoch {epoch}",
    }[point]


def _out_of_step_message(rows):
    position = rows[:, _RANK : _RANK + _POSITION]
    where_differs = (position[:, :3] != position[0, :3]).any()
    kinds_differ = (position[:, 3] != position[0, 3]).any()
    states = []
    for rank, (point, epoch, step, kind) in zip(rows[:, 0].tolist(), position.tolist()):
        who = f" (in {_KINDS[kind]})" if kinds_differ else ""
        states.append(f"rank {rank} {_where(point, epoch, step)}{who}")
    advice = (
        STOP_ADVICE
        if where_differs
        else "Pass the same keras-ring callbacks, in the same order, on every rank."
    )
    return f"keras-ring: the ranks are out of step: {'; '.join(states)}. {advice}"


def _learning_rate(model):
    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def _weights_digest(model):
    # Local variables (register_local_var, PartialDistributedOptimizer) differ by design.
    local = _optimizer.local_variable_ids(model.optimizer)
    return _divergence.weights_digest(v for v in model.trainable_weights if id(v) not in local)


def _rate_digest(model):
    return zlib.crc32(np.float64(_learning_rate(model)).tobytes())


def _divergence_message(point, epoch, differ, digests, rates, distributed):
    """The warning for ranks whose trainable weights or learning rates differ."""
    when = "at the end of training" if point == TRAIN_END else f"after epoch {epoch + 1}"
    parts, causes = [], []
    if "rate" in differ:
        parts.append(f"learning rates ({per_rank(rates)})")
        causes.append(
            "a callback changed the learning rate from each rank's own metrics: put "
            "keras_ring.callbacks.MetricAverageCallback() before ReduceLROnPlateau (and every "
            "callback that reads the metrics), so that every rank decides from the same averages."
        )
    if "weights" in differ:
        agree = _divergence.agreeing_ranks(range(len(digests)), digests[:, 0].tolist())
        parts.append(f"trainable weights (ranks that agree: {agree})")
        if not distributed.any():
            causes.append(NOT_DISTRIBUTED_WARNING)
        elif "rate" not in differ:
            causes.append(
                "the ranks started from different weights (pass "
                "keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)), a callback changed "
                "weights on some ranks only, or the weights were updated outside the distributed "
                "optimizer."
            )
    return (f"The ranks have diverged {when}: their {' and '.join(parts)} differ, although "
            "data-parallel ranks hold the same. Likely cause: " + " Or: ".join(causes))


class _StepGuard:
    """The guard of one `fit`: exchanges once at each point, whichever callback gets there first."""

    def __init__(self):
        self._last_point = None
        self._reported = set()  # kinds of divergence reported in this `fit`
        self.epoch = -1
        self.steps = 0  # begun in the current epoch
        self.completed = 0  # ended in the current epoch
        self._in_loop = False  # in an epoch's train loop

    def exchange(self, point, kind, values=()):
        """`exchange()` at `point` of the current epoch and step."""
        return exchange(point, self.epoch, self._step(point), kind, values)

    def _step(self, point):
        # A step that finds no data is begun but never ended, so where the
        # ranks' step counts may differ, the ended steps are compared.
        return self.steps if point in (BATCH_BEGIN, BATCH_END) else self.completed

    def _first_at(self, point):
        # Every rank runs the same callbacks in the same order, so every rank
        # makes the same choice here.
        if point == self._last_point:
            return False
        self._last_point = point
        return True

    def train_begin(self, params, model, callbacks):
        if not self._first_at((TRAIN_BEGIN,)):
            return
        epochs = int(params.get("epochs") or 0)
        backup_dir = _keras_backup_dir(callbacks)
        distributed = _optimizer.is_distributed(model.optimizer)
        # Several steps per call of the train function: a rank whose data runs
        # out within a call ends it early, before a callback could join.
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        planned = params.get("steps") if per_call > 1 else 0
        planned = -1 if planned is None else int(planned)
        # Ranks that share a host and a directory collide; one rank per host may be given a
        # directory of its host's own (the same path names another directory on each host).
        shared = backup_dir is not None and _basics.local_size() > 1
        backup = digest(backup_dir) + 1 if shared else 0
        low, high = self.exchange(TRAIN_BEGIN, GUARD, (epochs, distributed, planned, backup))
        if low[3] > 0 and low[3] == high[3]:
            raise ValueError(
                "keras-ring: keras.callbacks.BackupAndRestore writes its backup from every rank "
                f"into one directory ({backup_dir!r}), where the ranks' writes collide at the "
                "first epoch end (FileExistsError, or h5py's lock error). Use "
                f"keras_ring.callbacks.BackupAndRestore({backup_dir!r}) instead: the same "
                "arguments; rank 0 writes the backup, and every rank restores it."
            )
        if low[0] != high[0]:
            counts = per_rank(gather([epochs])[:, 0])
            raise RuntimeError(
                f"keras-ring: the ranks would train for different numbers of epochs ({counts}). "
                "Pass the same `epochs` (and `initial_epoch`) to fit() on every rank."
            )
        if low[2] >= 0 and low[2] != high[2]:
            counts = per_rank(gather([planned])[:, 0])
            raise RuntimeError(
                "keras-ring: the ranks would run different numbers of steps per epoch "
                f"({counts}) with steps_per_execution={per_call}. {STEPS_ADVICE}"
            )
        if low[2] < 0 and _basics.size() > 1 and _basics.rank() == 0:
            _log.warning(UNKNOWN_STEPS_WARNING.format(per_call=per_call), once=True)
        if low[1] != high[1]:
            which = per_rank("yes" if d else "no" for d in gather([distributed])[:, 0])
            raise RuntimeError(
                "keras-ring: the model's optimizer is a keras_ring.DistributedOptimizer on some "
                f"ranks only ({which}): those wait for the others in every step. "
                "Compile the same model with the same optimizer on every rank."
            )
        # A train_step of the user's own may reduce its gradients itself.
        own_step = type(model).train_step is not keras.Model.train_step
        if not high[1] and not own_step and _basics.size() > 1 and _basics.rank() == 0:
            _log.warning(NOT_DISTRIBUTED_WARNING, once=True)

    def epoch_begin(self, epoch):
        if epoch != self.epoch:
            self.epoch = epoch
            self.steps = self.completed = 0
            self._in_loop = True

    def batch_begin(self, batch):
        if self._first_at((BATCH_BEGIN, self.epoch, batch)):
            self.exchange(BATCH_BEGIN, GUARD)
            self.steps += 1

    def batch_end(self):
        self.completed = self.steps

    def test_begin(self, model):
        """Ends the train loop when `fit` goes on to validate (a no-op in `evaluate`)."""
        self._end_loop(model)

    def _end_loop(self, model):
        """Joins, then gives every rank the state of the ranks that ran the most steps.

        Called where this rank's train loop has ended, once per epoch: ranks
        whose data ran out first take part in the others' remaining steps with
        zeros until every rank is here.
        """
        if not self._in_loop:
            return
        self._in_loop = False
        # A rank that stopped training (EarlyStopping, TerminateOnNaN) does not
        # join: ranks that go on meet it, out of step, in their next exchange.
        if _basics.size() == 1 or model.stop_training:
            return
        _objects.join()
        rows = exchange_rows(LOOP_END, self.epoch, 0, GUARD, (self.completed,))
        ranks, completed = rows[:, 0], rows[:, 1]
        self.completed = int(completed.max())
        if completed.min() == self.completed:
            return
        root = int(ranks[completed == self.completed].min())
        if _basics.rank() == 0:
            _log.info(
                f"Epoch {self.epoch + 1}: the ranks ran different numbers of steps "
                f"({per_rank(completed[np.argsort(ranks)].tolist())}); every rank takes the "
                f"model and optimizer state of rank {root}, which ran them all.",
                once=True,
            )
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_weights)
        _host_collectives.broadcast_variables(list(model.weights) + list(optimizer.variables), root,
                                             f"{_NAME}.uneven_steps")

    def epoch_end(self, epoch, model):
        self._end_loop(model)
        if self._first_at((EPOCH_END, epoch)):
            self._check_agreement(EPOCH_END, model)

    def train_end(self, model):
        if self._first_at((TRAIN_END,)):
            self._check_agreement(TRAIN_END, model)

    def _check_agreement(self, point, model):
        """Exchanges at `point`, and warns if the ranks' weights or learning rates differ.

        Data-parallel ranks hold the same trainable weights and learning rate
        bit for bit; each is compared through a checksum (one read of the
        weights per epoch, no extra collective unless they differ). Each kind
        of difference is reported once per `fit`, on rank 0, with its likely
        cause.
        """
        weights, rate = _weights_digest(model), _rate_digest(model)
        low, high = self.exchange(point, GUARD, (weights, rate))
        differ = [kind for kind, i in (("weights", 0), ("rate", 1)) if low[i] != high[i]]
        differ = [kind for kind in differ if kind not in self._reported]
        if not differ:
            return
        self._reported.update(differ)
        digests = gather([weights, rate])
        rates = gather_text(f"{_learning_rate(model):.7g}")
        distributed = gather([_optimizer.is_distributed(model.optimizer)])[:, 0]
        message = _divergence_message(point, self.epoch, differ, digests, rates, distributed)
        if _divergence.mode() == "error":
            raise RuntimeError(f"keras-ring: {message}")
        if _basics.rank() == 0:
            _log.warning(f"{message} ({_divergence.VARIABLE}=error makes this an error.)")


def _keras_backup_dir(callbacks):
    """The directory of Keras's own BackupAndRestore among `callbacks`, or None.

    Keras's class itself: a subclass may write on one rank only.
    """
    for callback in callbacks:
        if type(callback) is keras.callbacks.BackupAndRestore:
            return str(callback.backup_dir)
    return None


def _sibling_callbacks():
    """The callbacks of the `keras.callbacks.CallbackList` running the current hook, or [].

    No hook hands a callback the others of its `fit`, which builds the list
    itself: the list is the `self` of the frame that called the hook, a few
    frames up (through subclasses' hooks that call their parent's).
    """
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return list(owner.callbacks)
        frame = frame.f_back
    return []


# The guard of the current `fit`, keyed by the `params` dict that Keras's
# CallbackList hands to each of its callbacks (one dict per `fit`).
_current = (None, None)


def _guard_for(params):
    global _current
    if _current[0] is not params:
        _current = (params, _StepGuard())
    return _current[1]


class SyncedCallback(keras.callbacks.Callback):
    """Base of the keras-ring callbacks that communicate: runs the step guard.

    Subclasses call the parent's hook first, so that the guard has checked
    that the ranks are in step before their own collectives.
    """

    @property
    def step_guard(self):
        """The step guard of the current `fit`."""
        return _guard_for(self.params)

    def on_train_begin(self, logs=None):
        self.step_guard.train_begin(self.params, self.model, _sibling_callbacks())

    def on_epoch_begin(self, epoch, logs=None):
        self.step_guard.epoch_begin(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.step_guard.batch_begin(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.step_guard.batch_end()

    def on_test_begin(self, logs=None):
        self.step_guard.test_begin(self.model)

    def on_epoch_end(self, epoch, logs=None):
        self.step_guard.epoch_end(epoch, self.model)

    def on_train_end(self, logs=None):
        self.step_guard.train_end(self.model)
