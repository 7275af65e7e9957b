"""Keras callbacks for data-parallel training with keras-ring, as in `horovod.tensorflow.keras`.

Keras calls callbacks in the order of the `callbacks` list, all with the same
`logs` dict, and checks `model.stop_training` after the last. A typical list:

```python
callbacks = [
    # The same starting state on every rank, before the first step.
    kr.callbacks.BroadcastGlobalVariablesCallback(0),
    # Before anything that reads the metrics.
    kr.callbacks.MetricAverageCallback(),
    kr.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * kr.size(), warmup_epochs=3),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
    keras.callbacks.TerminateOnNaN(),
    # After everything that may stop training.
    kr.callbacks.AgreedStoppingCallback(),
    # Files written once, by rank 0.
    kr.callbacks.BestModelCheckpoint("best.keras", monitor="val_loss"),
    kr.callbacks.rank_zero_only(keras.callbacks.CSVLogger("training.csv")),
    # Resumes after an interruption; one backup_dir for all ranks.
    kr.callbacks.BackupAndRestore("backup"),
]
model.fit(x, y, validation_data=(x_val, y_val), callbacks=callbacks,
          verbose=kr.rank_zero_verbose(1))
```

**Ranks in step.** A rank that stops on its own (EarlyStopping on one rank)
leaves the others waiting for it in their next collective. The callbacks
that communicate (`BroadcastGlobalVariablesCallback`, `MetricAverageCallback`,
`AgreedStoppingCallback`, `BackupAndRestore`) therefore check that all ranks
are at the same point, with one small allgather at the start of training, at
the start of each step (before the step's own collectives), at the end of
each epoch and at the end of training. Together they check each point once:
one small collective per step. When the ranks are not in step, every rank
raises a `RuntimeError` that says where each rank is and what to change,
instead of waiting forever.

**Uneven data.** Ranks may run different numbers of steps in an epoch
(shards of different sizes, data of unknown length such as
`Dataset.from_generator` or `filter`): a rank whose data runs out joins
(`keras_ring.join`) at the end of its epoch's steps, and the others' remaining
steps average their gradients with zeros from it, as `Average` over all ranks
(Horovod's `join`). Before validating or ending the epoch, every rank takes
the model's and optimizer's state from the lowest rank that ran the most
steps, so the ranks hold the same weights again. With `steps_per_execution`
above 1 a rank whose data runs out inside a call of the train function
cannot join: the ranks must then run the same number of steps, which is
checked at train begin when Keras knows them.

These callbacks must be passed on every rank, in the same order. With one
rank they do nothing.
"""

from keras_ring.keras.callbacks._agreed_stopping_callback import AgreedStoppingCallback
from keras_ring.keras.callbacks._backup_and_restore import BackupAndRestore
from keras_ring.keras.callbacks._best_model_checkpoint import BestModelCheckpoint
from keras_ring.keras.callbacks._broadcast_global_variables_callback import (
    BroadcastGlobalVariablesCallback,
)
from keras_ring.keras.callbacks._learning_rate_schedule_callback import LearningRateScheduleCallback
from keras_ring.keras.callbacks._learning_rate_warmup_callback import LearningRateWarmupCallback
from keras_ring.keras.callbacks._learning_rate_warmup_schedule import LearningRateWarmupSchedule
from keras_ring.keras.callbacks._metric_average_callback import MetricAverageCallback
from keras_ring.keras.callbacks._rank_zero_only import rank_zero_only

__all__ = [
    "AgreedStoppingCallback",
    "BackupAndRestore",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "LearningRateWarmupSchedule",
    "MetricAverageCallback",
    "rank_zero_only",
]
