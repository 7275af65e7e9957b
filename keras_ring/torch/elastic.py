"""Elastic training for PyTorch (`horovod.torch.elastic`): training goes on as workers come and go.

The elastic layer (`keras_ring.elastic`) at Horovod's PyTorch path: `run`
wraps the training function, `TorchState` keeps the model, the optimizer,
an `ElasticSampler` and attributes, and a lost worker sends every survivor
back to the last commit on a re-formed world (`keras-ring-run --elastic`).
It imports neither Keras nor TensorFlow.

```python
import keras_ring.torch as hvd

hvd.init()
sampler = hvd.elastic.ElasticSampler(dataset)
loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            state.sampler.record_batch(i, 32)
            if i % 10 == 0:
                state.commit()
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()

train(state)
```
"""

from keras_ring.core._errors import HostsUpdatedInterrupt, WorkerLostError
from keras_ring.elastic._object_state import ObjectState
from keras_ring.elastic._run import run
from keras_ring.elastic._state import State
from keras_ring.elastic._torch_state import TorchState
from keras_ring.torch._elastic_sampler import ElasticSampler

HorovodInternalError = WorkerLostError

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "WorkerLostError", "run"]
