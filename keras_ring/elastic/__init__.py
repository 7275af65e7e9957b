"""Elastic training (`horovod.tensorflow.keras.elastic`): training goes on as workers come and go.

In a job started with `keras-ring-run --elastic`, a worker that dies or
hangs makes a collective fail on every survivor with `WorkerLostError`;
`run` then goes back to the last committed state, re-forms the world with
the workers left (in the same processes: no new Python, no new
TensorFlow), gives every rank rank 0's state and calls the training
function again. Workers added later join at the next commit
(`HostsUpdatedInterrupt`), without going back.

```python
import keras_ring as kr

kr.init()
model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-3 * kr.size())),
              loss="sparse_categorical_crossentropy")
state = kr.elastic.KerasState(model, epoch=0, batch=0)
state.register_reset_callbacks(
    [lambda: model.optimizer.learning_rate.assign(1e-3 * kr.size())])

@kr.elastic.run
def train(state):
    # Sharded for this world, from where the epoch is.
    dataset = make_dataset().apply(kr.shard_dataset).batch(32).repeat().skip(state.batch)
    model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
              callbacks=[kr.elastic.CommitStateCallback(state, batches_per_commit=10),
                         kr.elastic.UpdateBatchStateCallback(state),
                         kr.elastic.UpdateEpochStateCallback(state)],
              verbose=kr.rank_zero_verbose(1))

train(state)
```
"""

import importlib

from keras_ring.core._errors import HostsUpdatedInterrupt, WorkerLostError
from keras_ring.elastic._object_state import ObjectState
from keras_ring.elastic._run import run
from keras_ring.elastic._state import State

# The states and callbacks of a framework import it: they load on first use,
# so that a PyTorch script (`keras_ring.torch.elastic`) imports neither Keras
# nor TensorFlow. Name -> the module that defines it.
_LAZY = {
    "CommitStateCallback": "keras_ring.elastic._commit_state_callback",
    "KerasState": "keras_ring.elastic._keras_state",
    "TensorFlowKerasState": "keras_ring.elastic._keras_state",
    "TensorFlowState": "keras_ring.elastic._tensorflow_state",
    "TorchState": "keras_ring.elastic._torch_state",
    "UpdateBatchStateCallback": "keras_ring.elastic._update_batch_state_callback",
    "UpdateEpochStateCallback": "keras_ring.elastic._update_epoch_state_callback",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


HorovodInternalError = WorkerLostError

__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "TorchState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "WorkerLostError",
    "run",
]
