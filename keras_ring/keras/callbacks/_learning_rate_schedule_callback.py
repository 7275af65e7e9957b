"""LearningRateScheduleCallback: Horovod's epoch-based learning-rate schedule for Keras 3."""

import keras

from keras_ring.keras.callbacks._validation import check_integer, check_number


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between two epochs.

    From `start_epoch` (included) to `end_epoch` (excluded; `None`: to the end
    of training), the callback assigns the optimizer's learning rate at the
    start of a batch. With `staircase=True` it does so at the first batch of
    each epoch, with the epoch index; with `staircase=False` at every batch,
    with a fractional epoch `epoch + batch / steps_per_epoch`, for smooth
    schedules. A constant `multiplier` `m` means `m ** (epoch - start_epoch)`:
    exponential decay from `initial_lr` at `start_epoch`. These are Horovod's
    semantics.

    The optimizer must have a float learning rate (Keras keeps it in a
    variable, which the callback assigns). For an optimizer created with a
    `keras.optimizers.schedules.LearningRateSchedule`, write the schedule into
    that object instead (for warmup: `LearningRateWarmupSchedule`).

    Momentum correction (Goyal et al., "Accurate, Large Minibatch SGD",
    2017): `SGD` keeps a velocity that includes the learning rate
    (`velocity = momentum * velocity - learning_rate * g`), so after a change
    of learning rate the old velocity would be applied at the old scale. When
    the learning rate changes by a factor `r`, the callback multiplies the
    velocity by `r`. Horovod multiplies the momentum coefficient by `r` for
    one batch instead; for plain momentum the two give the same update, but
    Keras 3 reads `SGD.momentum` as a constant when it traces the train step,
    so only the velocity can be corrected. Other optimizers are left alone:
    Adam's moments do not include the learning rate, and `RMSprop` keeps its
    velocity private. A `LossScaleOptimizer` (or another wrapper with an
    `inner_optimizer`) is looked through.

    The callback runs on every rank and communicates with no other: every rank
    computes the same learning rate from the same epoch and batch.

    Args:
        initial_lr: The learning rate that `multiplier` scales (for
            data-parallel training usually the single-process rate times
            `keras_ring.size()`).
        multiplier: A number `m` (the learning rate is
            `initial_lr * m ** (epoch - start_epoch)`) or a function of the
            (possibly fractional) epoch index returning the factor.
        start_epoch: The first epoch to which the schedule applies.
        end_epoch: The epoch at which the schedule stops applying (excluded);
            `None` for no end. The learning rate then keeps its last value.
        staircase: `True` to set the learning rate once per epoch, `False` to
            set it at every batch with a fractional epoch.
        momentum_correction: Whether to rescale SGD's velocity when the
            learning rate changes.
        steps_per_epoch: The number of batches per epoch, needed when
            `staircase=False`; by default the number Keras reports to
            callbacks (known unless the data has an unknown length).

    Raises:
        ValueError: If an argument is invalid; at the start of training, if
            the optimizer's learning rate is a schedule, or if
            `steps_per_epoch` is needed and not known.

    Example:

    ```python
    lr = 0.1 * kr.size()
    callbacks = [
        # Warm up for 5 epochs, then divide by 10 at epochs 30 and 60.
        kr.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=5),
        kr.callbacks.LearningRateScheduleCallback(lr, lambda e: 0.1, start_epoch=30, end_epoch=60),
        kr.callbacks.LearningRateScheduleCallback(lr, lambda e: 0.01, start_epoch=60),
    ]
    # Or: multiply by 0.95 at each epoch from epoch 5 on.
    decay = kr.callbacks.LearningRateScheduleCallback(lr, 0.95, start_epoch=5)
    ```
    """

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
    ):
        super().__init__()
        check_number("initial_lr", initial_lr, positive=True)
        if not callable(multiplier):
            check_number("multiplier", multiplier)
        check_integer("start_epoch", start_epoch, 0)
        if end_epoch is not None:
            check_integer("end_epoch", end_epoch, start_epoch + 1)
        if steps_per_epoch is not None:
            check_integer("steps_per_epoch", steps_per_epoch, 1)
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._steps_per_epoch = steps_per_epoch  # resolved for the current `fit`
        self._epoch = 0

    def on_train_begin(self, logs=None):
        self._learning_rate_variable()
        self._steps_per_epoch = self.steps_per_epoch or self.params.get("steps")
        if not self.staircase and not self._steps_per_epoch:
            raise ValueError(
                f"{type(self).__name__} needs the number of steps per epoch, and Keras does "
                "not know it (the data has an unknown length). Pass steps_per_epoch to "
                f"{type(self).__name__}() (and to fit()). Received: steps_per_epoch=None"
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.start_epoch or (
            self.end_epoch is not None and self._epoch >= self.end_epoch
        ):
            return
        if not self.staircase:
            self._set_learning_rate(self._epoch + batch / self._steps_per_epoch)
        elif batch == 0:
            self._set_learning_rate(self._epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            # The key Keras's own learning-rate callbacks use.
            logs["learning_rate"] = float(self._learning_rate_variable().numpy())

    def _multiplier(self, epoch):
        if callable(self.multiplier):
            return self.multiplier(epoch)
        return self.multiplier ** (epoch - self.start_epoch)

    def _learning_rate_variable(self):
        learning_rate = self.model.optimizer.learning_rate
        if not isinstance(learning_rate, keras.Variable):
            # `optimizer.learning_rate` is the schedule's current value: name the schedule.
            schedule = self._inner_optimizer()._learning_rate
            raise ValueError(
                f"{type(self).__name__} assigns the optimizer's learning rate, but this "
                "optimizer computes it from a LearningRateSchedule (or a function), which cannot "
                "be assigned. Create the optimizer with a float learning rate, or put the "
                "schedule in the optimizer (for warmup: "
                "keras_ring.callbacks.LearningRateWarmupSchedule(initial_lr, warmup_steps, "
                "after=your_schedule)). "
                f"Received: optimizer.learning_rate={schedule!r}"
            )
        return learning_rate

    def _set_learning_rate(self, epoch):
        variable = self._learning_rate_variable()
        old = float(variable.numpy())
        new = self.initial_lr * self._multiplier(epoch)
        variable.assign(new)
        if self.momentum_correction and old > 0 and new != old:
            for velocity in self._sgd_velocities():
                velocity.assign(velocity * (new / old))

    def _inner_optimizer(self):
        """The optimizer inside any wrappers (`LossScaleOptimizer`), which holds the rate."""
        optimizer = self.model.optimizer
        while hasattr(optimizer, "inner_optimizer"):
            optimizer = optimizer.inner_optimizer
        return optimizer

    def _sgd_velocities(self):
        optimizer = self._inner_optimizer()
        # Before the first step Keras has not built the optimizer, and its
        # velocities (zero at first) do not exist yet.
        if isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum and optimizer.built:
            return list(optimizer.momentums)
        return []
