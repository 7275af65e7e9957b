"""BestModelCheckpoint: the best model so far, saved by rank 0 only."""

import keras

from keras_ring.core import _basics


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model whenever the monitored metric improves, on rank 0 only.

    A `keras.callbacks.ModelCheckpoint` with `save_best_only=True`, as in
    Horovod, whose saving hooks do nothing on ranks other than 0, so that one
    process writes each file. Put a `MetricAverageCallback` before it to judge
    "best" on the metric averaged over the ranks rather than on rank 0's own
    value.

    Args:
        filepath: Where to save: a path ending in `.keras` (or `.weights.h5`
            with `save_weights_only=True`); may contain format fields such as
            `{epoch:02d}` or `{val_loss:.3f}`, as for `ModelCheckpoint`.
        monitor: The metric that decides what is best.
        verbose: If 1, print a line when saving.
        save_weights_only: Save only the weights (`model.save_weights`).
        mode: `"min"`, `"max"` or `"auto"` (from the metric's name).
        save_freq: `"epoch"` or a number of batches.
        initial_value_threshold: Save only once the metric is better than
            this value.

    Raises:
        ValueError: If an argument is invalid (as `ModelCheckpoint` checks it).

    Example:

    ```python
    callbacks = [
        kr.callbacks.MetricAverageCallback(),
        kr.callbacks.BestModelCheckpoint("best.keras", monitor="val_loss"),
    ]
    ```
    """

    def __init__(
        self,
        filepath,
        monitor="val_loss",
        verbose=0,
        save_weights_only=False,
        mode="auto",
        save_freq="epoch",
        initial_value_threshold=None,
    ):
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
            initial_value_threshold=initial_value_threshold,
        )

    # The hooks of ModelCheckpoint that save.
    def on_train_batch_end(self, batch, logs=None):
        if _basics.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if _basics.rank() == 0:
            super().on_epoch_end(epoch, logs)
