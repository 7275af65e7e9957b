"""A worker of an elastic PyTorch job (`keras-ring-run --elastic`), as a Horovod user writes one.

A plain torch loop with `keras_ring.torch` imported as `hvd`:
`DistributedOptimizer`, `hvd.elastic.TorchState` (the model, the optimizer,
an `ElasticSampler` and attributes) and `hvd.elastic.run`. It trains a linear
model on synthetic data, STEPS batches per epoch, and writes the same events as
elastic_train_worker.py to `KR_TEST_LOG/<worker>.jsonl`, so that the test checks
both alike. KR_TEST_FAULT="ITERATION:START_RANK:WHAT" as there.
"""

import json
import os
import signal
import sys

import numpy as np
import torch

import keras_ring.torch as hvd
from keras_ring.core import _elastic_world

torch.set_num_threads(1)
EPOCHS = int(os.environ.get("KR_TEST_EPOCHS", "4"))
STEPS = int(os.environ.get("KR_TEST_STEPS", "8"))
BATCHES_PER_COMMIT = 2
BATCH = 8

hvd.init()
START_RANK = hvd.rank()
WORKER = os.environ["KERAS_RING_WORKER"]
LOG = open(os.path.join(os.environ["KR_TEST_LOG"], WORKER.replace(":", "_") + ".jsonl"), "a",
           encoding="utf-8")
fault = os.environ.get("KR_TEST_FAULT", "")
FAULT = fault.split(":") if fault else None


def log(event, **fields):
    fields.update(event=event, generation=_elastic_world.generation(), rank=hvd.rank(),
                  size=hvd.size())
    LOG.write(json.dumps(fields) + "\n")
    LOG.flush()


rng = np.random.default_rng(7)
features = torch.from_numpy(rng.normal(size=(1024, 4)).astype(np.float32))
targets = features @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.7
dataset = torch.utils.data.TensorDataset(features, targets)

torch.manual_seed(START_RANK)  # different weights on every rank: the first sync makes them one
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, iterations=0)

saved = state.save


def save():
    saved()
    log("commit", iterations=state.iterations, epoch=state.epoch, batch=state.batch)


state.save = save
state.register_reset_callbacks(
    [lambda: log("reset", iterations=state.iterations, epoch=state.epoch, batch=state.batch)])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for i, (x, y) in enumerate(loader):
            if state.batch == STEPS:
                break
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(i, BATCH)
            state.batch += 1
            state.iterations += 1
            log("step", epoch=state.epoch, batch=state.batch, iterations=state.iterations,
                loss=float(loss))
            if FAULT and _elastic_world.generation() == 0:
                at, start_rank, name = FAULT
                if state.iterations == int(at) and START_RANK == int(start_rank):
                    os.kill(os.getpid(), getattr(signal, "SIG" + name))
            if state.iterations % BATCHES_PER_COMMIT == 0:
                state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
log("end", iterations=state.iterations,
    weights=[p.detach().numpy().tolist() for p in model.parameters()])
print(f"worker {WORKER}: finished as rank {hvd.rank()} of {hvd.size()} on torch "
      f"(keras imported: {'keras' in sys.modules}, tensorflow imported: "
      f"{'tensorflow' in sys.modules})", flush=True)
