"""MetricAverageCallback: the metrics of all ranks' data, on every rank."""

import numbers

import numpy as np

from keras_ring.core import _basics, _host_collectives, _log
from keras_ring.core._reduce_ops import Average
from keras_ring.keras import _evaluate
from keras_ring.keras.callbacks import _sync


class MetricAverageCallback(_sync.SyncedCallback):
    """Makes every rank log the metrics of all ranks' data: exact for evaluation, averaged in fit.

    Each rank computes its metrics on its own shard of the data.

    **Validation** (`validation_data` in `fit`): when it ends, this callback
    sums the state of every compiled metric over the ranks (Keras's metrics
    keep sums and counts: `Mean`'s total and count, `Precision`'s true and
    false positives, `AUC`'s confusion counts per threshold) and the epoch's
    `val_*` entries hold the results computed from the sums: the values over
    the union of all ranks' validation data, for every Keras metric and any
    number of samples per rank (a metric of your own must keep additive
    state). With a `test_step` of your own that logs other values than the
    compiled metrics, the logged values are averaged instead.
    `model.evaluate` returns what Keras computed before any callback ran, so
    this callback cannot make it global (it warns if passed to `evaluate`):
    call `keras_ring.evaluate(model, ...)` instead.

    **Training**: the state of the epoch's training metrics is gone when the
    epoch ends (validation reuses the same metric objects), so at the end of
    each epoch this callback replaces every other
    numeric entry of `logs` (`loss`, `accuracy`, ...) with its mean over the
    ranks, so that every rank sees the same values. Entries are reduced in
    sorted order of their keys, and entries that are not numbers are left
    alone. That mean is the value over all the data only for metrics that are
    means of per-sample values (the loss, `accuracy`, `mae`, `mse`, ...), and
    only when every rank sees the same number of samples; not for ratios of
    sums (`Precision`, `Recall`, `AUC`, `F1Score`, `MeanIoU`) or non-linear
    functions of a mean (`RootMeanSquaredError`), which the `val_*` entries
    give exactly.

    Keras calls callbacks in the order of the `callbacks` list, all with the
    same `logs` dict: put this callback **before** every callback that reads
    the metrics (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`,
    `CSVLogger`, `TensorBoard`), or they see this rank's values. The `History`
    returned by `fit` and the progress bar that Keras adds come last, so they
    show the averages.

    Every rank must pass this callback. Like the other keras-ring callbacks
    that communicate, it also checks at each step that all ranks are in step
    (see `keras_ring.callbacks`).

    Args:
        device: Horovod's argument, kept for its scripts: the averages are
            computed in host memory under every Keras backend.

    Raises:
        RuntimeError: At the end of an epoch or of evaluating, on every rank,
            if the ranks logged different metrics (each rank's keys are named).

    Example:

    ```python
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        kr.callbacks.MetricAverageCallback(),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
    ]
    model.fit(x, y, validation_data=(x_val, y_val), callbacks=callbacks)
    # The loss and metrics of the union of every rank's shard of the test set:
    results = kr.evaluate(model, test_shard, return_dict=True)
    ```
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device
        self._in_fit = False
        self._validation = None  # this epoch's exact validation results

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._in_fit = True
        self._validation = None

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._in_fit = False

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if _basics.size() == 1 or logs is None:
            return
        validation, self._validation = self._validation, None
        self._average(_sync.EPOCH_END, logs)
        if validation:  # exact, where the average of the ranks' results may not be
            logs.update((f"val_{k}", v) for k, v in validation.items() if f"val_{k}" in logs)

    def on_test_begin(self, logs=None):
        super().on_test_begin(logs)
        if not self._in_fit and _basics.size() > 1 and _basics.rank() == 0:
            _log.warning(
                "MetricAverageCallback cannot change what model.evaluate() returns (Keras "
                "computes it before callbacks see it): it stays this rank's own. Call "
                "keras_ring.evaluate(model, ...) for the results of all ranks' data.",
                once=True,
            )

    def on_test_end(self, logs=None):
        # Validation inside `fit` ends here too, before the epoch's end.
        if _basics.size() == 1 or logs is None:
            return
        local = self.model.get_metrics_result()
        # Keras logs its metrics' results unless a test_step of the user's own logs others.
        exact = sorted(local) == _numeric_keys(logs)
        low, high = self.step_guard.exchange(_sync.TEST_END, _sync.METRICS, (exact,))
        if not (low[0] and high[0]):
            self._average(_sync.TEST_END, logs)
            return
        results = _evaluate.sum_metric_states(self.model)
        logs.update(results)  # for the callbacks after this one
        if self._in_fit:
            self._validation = results

    def _average(self, point, logs):
        keys = _numeric_keys(logs)
        self._check_same_keys(point, keys)
        if not keys:
            return
        values = np.array([logs[k] for k in keys], np.float64)
        averaged = _host_collectives.allreduce(values, Average, "keras_ring.metric_average")
        logs.update(zip(keys, averaged.tolist()))

    def _check_same_keys(self, point, keys):
        low, high = self.step_guard.exchange(
            point, _sync.METRICS, (len(keys), _sync.digest("\n".join(keys)))
        )
        if (low == high).all():
            return
        ranks = _sync.gather_text(", ".join(keys))
        guard = self.step_guard
        when = (f"at the end of epoch {guard.epoch + 1}" if point == _sync.EPOCH_END
                else "at the end of evaluating")
        raise RuntimeError(
            f"keras-ring: MetricAverageCallback: the ranks logged different metrics {when} "
            f"({_sync.per_rank(f'[{k}]' for k in ranks)}), so they cannot be "
            "averaged. Compile the same metrics on every rank, and pass validation data to fit() "
            "on every rank or on none."
        )


def _numeric_keys(logs):
    return sorted(
        k for k, v in logs.items() if isinstance(v, numbers.Number) and not isinstance(v, bool)
    )
