"""keras-ring for PyTorch: Horovod's `horovod.torch` API on keras-ring's engine.

A Horovod script changes one line, `import horovod.torch as hvd` to
`import keras_ring.torch as hvd`:

```python
import keras_ring.torch as hvd
hvd.init()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
for x, y in loader:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()   # each gradient's allreduce starts as it is ready
    optimizer.step()
```

The collectives take CPU tensors (the engine does not reach GPUs yet). A Keras
model under `KERAS_BACKEND=torch` needs only `keras_ring` itself.
"""

import importlib

from keras_ring.core._basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from keras_ring.core._compression import Compression
from keras_ring.core._errors import WorkerLostError as HorovodInternalError
from keras_ring.core._lifecycle import init, shutdown
from keras_ring.core._objects import allgather_object, broadcast_object
from keras_ring.core._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from keras_ring.core._reduce_ops import Adasum, Average, Max, Min, Product, Sum
from keras_ring.core._timeline import start_timeline, stop_timeline
from keras_ring.torch._functions import broadcast_optimizer_state, broadcast_parameters
from keras_ring.torch._ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from keras_ring.torch._optimizer import DistributedOptimizer
from keras_ring.torch._sync_batch_norm import SyncBatchNorm


def __getattr__(name):
    # `hvd.elastic` as in Horovod, loaded on first use: the elastic layer sits
    # above this one (keras_ring/torch/elastic.py, a face at Horovod's path).
    if name == "elastic":
        return importlib.import_module("keras_ring.torch.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
