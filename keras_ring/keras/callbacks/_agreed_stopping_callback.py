"""AgreedStoppingCallback: when one rank stops training, every rank stops at the same step."""

from keras_ring.keras.callbacks import _sync


class AgreedStoppingCallback(_sync.SyncedCallback):
    """Stops training on every rank, at the same step, when any rank stops it.

    Keras callbacks that stop training (`EarlyStopping`, `TerminateOnNaN`, or
    a callback of your own) decide on one rank's values and set
    `model.stop_training` on that rank only: that rank would leave the
    training loop while the others wait for it. At the end of every step and
    of every epoch this callback reduces the flag over the ranks (one small
    allreduce): if any rank has set it, every rank sets it, and all ranks stop
    after the same step.

    Keras calls callbacks in the order of the `callbacks` list and checks the
    flag right after the last one: put this callback **after** every callback
    that may stop training. `EarlyStopping` placed after a
    `MetricAverageCallback` sees the same averaged values on every rank and so
    decides alike everywhere; `TerminateOnNaN` looks at each rank's own batch
    loss, so it needs this callback.

    Every rank must pass this callback. Like the other keras-ring callbacks
    that communicate, it also checks at each step that all ranks are in step
    (see `keras_ring.callbacks`).

    Example:

    ```python
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        kr.callbacks.MetricAverageCallback(),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
        keras.callbacks.TerminateOnNaN(),
        kr.callbacks.AgreedStoppingCallback(),
    ]
    model.fit(x, y, validation_data=(x_val, y_val), callbacks=callbacks)
    ```
    """

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self._agree(_sync.BATCH_END)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._agree(_sync.EPOCH_END)

    def _agree(self, point):
        # Only `True` asks to stop: `kr.elastic` ends a resumed epoch early, on every rank
        # alike, with a marker of its own, which must survive this callback.
        stop = int(self.model.stop_training is True)
        _, high = self.step_guard.exchange(point, _sync.STOP, (stop,))
        if high[0]:
            self.model.stop_training = True
