"""LearningRateWarmupSchedule: gradual warmup as a Keras learning-rate schedule."""

import keras
from keras import ops

from keras_ring.core import _basics
from keras_ring.keras.callbacks._validation import check_integer, check_number


@keras.saving.register_keras_serializable(package="keras_ring")
class LearningRateWarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Raises the learning rate from `initial_lr / size` to `initial_lr`, then hands over.

    The schedule form of `LearningRateWarmupCallback`, for optimizers created
    with a schedule (whose learning rate a callback cannot assign) and for
    users who prefer the schedule to live in the optimizer, where it is saved
    with the model. At optimizer step `t` (counted from 0):

    ```
    t < warmup_steps:  lr = initial_lr / size * ((t + 1) * (size - 1) / warmup_steps + 1)
    otherwise:         lr = initial_lr, or after(t - warmup_steps)
    ```

    With `warmup_steps = warmup_epochs * steps_per_epoch` this gives, step for
    step, the values of `LearningRateWarmupCallback(initial_lr, warmup_epochs)`.
    The schedule `after` starts from its own step 0 when the warmup ends, so
    it should start at `initial_lr`.

    Saving: the class is registered with Keras as
    `"keras_ring>LearningRateWarmupSchedule"`; a model whose optimizer uses it
    loads with `keras.models.load_model` once `keras_ring.callbacks` has been
    imported.

    Args:
        initial_lr: The learning rate at the end of the warmup (usually the
            single-process rate times `keras_ring.size()`).
        warmup_steps: The number of optimizer steps the warmup lasts.
        after: The `LearningRateSchedule` to follow the warmup; `None` keeps
            `initial_lr`.
        size: The number of ranks the warmup starts from (`initial_lr / size`);
            `None` (the default) reads `keras_ring.size()` when the schedule is
            called (in a compiled train step: when it is traced), or uses 1 if
            keras-ring is not initialised (a model loaded
            in a single process then trains at `initial_lr`).
        name: The name of the schedule.

    Raises:
        ValueError: If an argument is invalid.

    Example:

    ```python
    kr.init()
    schedule = kr.callbacks.LearningRateWarmupSchedule(
        initial_lr=0.01 * kr.size(),
        warmup_steps=3 * steps_per_epoch,
        after=keras.optimizers.schedules.CosineDecay(0.01 * kr.size(), decay_steps=10_000),
    )
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    ```
    """

    def __init__(
        self, initial_lr, warmup_steps, after=None, size=None, name="LearningRateWarmupSchedule"
    ):
        super().__init__()
        check_number("initial_lr", initial_lr, positive=True)
        check_integer("warmup_steps", warmup_steps, 1)
        if after is not None and not isinstance(
            after, keras.optimizers.schedules.LearningRateSchedule
        ):
            raise ValueError(
                "`after` must be a keras.optimizers.schedules.LearningRateSchedule or None. "
                f"Received: after={after!r}"
            )
        if size is not None:
            check_integer("size", size, 1)
        self.initial_lr = float(initial_lr)
        self.warmup_steps = warmup_steps
        self.after = after
        self.size = size
        self.name = name

    def __call__(self, step):
        size = self.size
        if size is None:
            size = _basics.size() if _basics.is_initialized() else 1
        step = ops.cast(step, "float32")
        warmup = self.initial_lr / size * ((step + 1) * (size - 1) / self.warmup_steps + 1)
        if self.after is None:
            later = ops.full_like(warmup, self.initial_lr)
        else:
            # Clipped so that `after` never sees the negative steps of the
            # branch `where` discards.
            later = ops.cast(self.after(ops.maximum(step - self.warmup_steps, 0)), "float32")
        return ops.where(step < self.warmup_steps, warmup, later)

    def get_config(self):
        return {
            "initial_lr": self.initial_lr,
            "warmup_steps": self.warmup_steps,
            "after": None
            if self.after is None
            else keras.optimizers.schedules.serialize(self.after),
            "size": self.size,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config["after"] is not None:
            config["after"] = keras.optimizers.schedules.deserialize(config["after"])
        return cls(**config)
