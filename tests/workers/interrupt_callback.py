"""A callback that interrupts training, for the BackupAndRestore tests (single and multi-rank)."""

import keras


class Interrupt(keras.callbacks.Callback):
    """Raises at the end of `epoch`, or of batch `batch` in it, as Keras's tests do."""

    def __init__(self, epoch, batch=None):
        super().__init__()
        self.at, self.batch, self.epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.at, self.batch):
            raise RuntimeError("interrupted")

    def on_epoch_end(self, epoch, logs=None):
        if self.batch is None and epoch == self.at:
            raise RuntimeError("interrupted")
