"""LearningRateWarmupCallback: Horovod's gradual learning-rate warmup for Keras 3."""

from keras_ring.core import _basics
from keras_ring.keras.callbacks._learning_rate_schedule_callback import LearningRateScheduleCallback
from keras_ring.keras.callbacks._validation import check_integer


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate gradually from `initial_lr / size` to `initial_lr`.

    Training with `size` ranks multiplies the batch size, and the learning
    rate with it; starting at the full rate can diverge. Over the first
    `warmup_epochs` epochs this callback raises the learning rate linearly, at
    every batch, from `initial_lr / size` to `initial_lr` (Goyal et al.,
    "Accurate, Large Minibatch SGD", 2017). With `e` the epoch, `b` the batch
    index and `s` the steps per epoch, as in Horovod:

    ```
    epoch = e + (b + 1) / s
    lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)
    ```

    so the last batch of the warmup runs at `initial_lr` exactly; after the
    warmup the callback leaves the learning rate alone. With one rank the rate
    is `initial_lr` throughout. The same values per step are available as a
    schedule object, `LearningRateWarmupSchedule`, for optimizers created with
    a `LearningRateSchedule` (this callback cannot assign those).

    Momentum correction and the requirements on the optimizer are those of
    `LearningRateScheduleCallback`.

    Args:
        initial_lr: The learning rate at the end of the warmup (usually the
            single-process rate times `keras_ring.size()`).
        warmup_epochs: The number of epochs the warmup lasts.
        momentum_correction: Whether to rescale SGD's velocity when the
            learning rate changes.
        steps_per_epoch: The number of batches per epoch; by default the
            number Keras reports to callbacks.
        verbose: If 1, rank 0 prints a line when the warmup ends.

    Raises:
        ValueError: If an argument is invalid; at the start of training, if
            the optimizer's learning rate is a schedule, or if the steps per
            epoch are not known.

    Example:

    ```python
    kr.init()
    optimizer = kr.DistributedOptimizer(keras.optimizers.SGD(0.01 * kr.size(), momentum=0.9))
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        kr.callbacks.LearningRateWarmupCallback(0.01 * kr.size(), warmup_epochs=3, verbose=1),
    ]
    ```
    """

    def __init__(
        self,
        initial_lr,
        warmup_epochs=5,
        momentum_correction=True,
        steps_per_epoch=None,
        verbose=0,
    ):
        check_integer("warmup_epochs", warmup_epochs, 1)
        super().__init__(
            initial_lr,
            self._warmup_multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _warmup_multiplier(self, epoch):
        # Shifted by one step, so that each epoch ends on a round value and
        # the warmup on `initial_lr`.
        epoch += 1 / self._steps_per_epoch
        size = _basics.size()
        return (epoch * (size - 1) / self.warmup_epochs + 1) / size

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _basics.rank() == 0:
            learning_rate = float(self._learning_rate_variable().numpy())
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {learning_rate:g}."
            )
