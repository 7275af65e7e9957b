"""MetricAverageCallback: epoch-end metrics averaged over the ranks."""

import numbers

import numpy as np
import tensorflow as tf

from keras_ring import _basics, _ops
from keras_ring.callbacks import _sync


class MetricAverageCallback(_sync.SyncedCallback):
    """Averages the epoch-end metrics (`logs`) over the ranks, in place.

    Each rank computes its metrics on its own shard of the data. At the end of
    each epoch this callback replaces every numeric entry of `logs` (`loss`,
    `val_accuracy`, ...) with its mean over the ranks, so that every rank sees
    the same values. Entries are reduced in sorted order of their keys, and
    entries that are not numbers are left alone.

    The mean over the ranks is the value over all the data only for metrics
    that are means of per-sample values (the loss, `accuracy`, `mae`, `mse`,
    ...), and only when every rank sees the same number of samples. It is not
    for metrics that are ratios of sums over the data (`Precision`, `Recall`,
    `AUC`, `F1Score`, `MeanIoU`) or non-linear functions of a mean
    (`RootMeanSquaredError`): the mean of the ranks' ratios or roots is not
    the ratio or root over all the data, and differs from it the more, the
    more the shards differ. For exact values of those, evaluate the whole
    validation set on one rank (for example `model.evaluate` on rank 0, with
    `kr.broadcast_object` if every rank needs the result), or sum the counts
    the metric keeps (`Precision`'s `true_positives` and `false_positives`
    variables, ...) over the ranks with `kr.allreduce(..., op=kr.Sum)` and
    compute the metric from the sums.

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
        device: The device on which to reduce; by default TensorFlow's choice.

    Raises:
        RuntimeError: At the end of an epoch, on every rank, if the ranks
            logged different metrics (each rank's keys are named).

    Example:

    ```python
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        kr.callbacks.MetricAverageCallback(),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
    ]
    model.fit(x, y, validation_data=(x_val, y_val), callbacks=callbacks)
    ```
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if _basics.size() == 1 or logs is None:
            return
        keys = sorted(
            k for k, v in logs.items() if isinstance(v, numbers.Number) and not isinstance(v, bool)
        )
        self._check_same_keys(epoch, keys)
        if not keys:
            return
        values = np.array([logs[k] for k in keys], np.float64)
        with tf.device(self.device):
            averaged = _ops.allreduce(values, name="keras_ring.metric_average").numpy()
        logs.update(zip(keys, averaged.tolist()))

    def _check_same_keys(self, epoch, keys):
        low, high = self.step_guard.exchange(
            _sync.EPOCH_END, _sync.METRICS, (len(keys), _sync.digest("\n".join(keys)))
        )
        if (low == high).all():
            return
        ranks = _sync.gather_text(", ".join(keys))
        raise RuntimeError(
            f"keras-ring: MetricAverageCallback: the ranks logged different metrics at the end "
            f"of epoch {epoch + 1} ({_sync.per_rank(f'[{k}]' for k in ranks)}), so they cannot be "
            "averaged. Compile the same metrics on every rank, and pass validation data to fit() "
            "on every rank or on none."
        )
