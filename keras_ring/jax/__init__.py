"""keras-ring for JAX: the engine's collectives on `jax.Array`s, eagerly and inside `jax.jit`.

A script that writes its own JAX training loop uses this module; a Keras
model under `KERAS_BACKEND=jax` needs only `keras_ring` itself. Each
collective is one XLA FFI custom call into the engine, built on first use
against the installed jaxlib. The topology, process sets, objects and reduce
ops are keras-ring's own, re-exported here so that one import serves:

```python
import keras_ring.jax as krj
krj.init()
grads = krj.allreduce_gradients(grads)          # inside jax.jit: one grouped call
params = krj.broadcast_parameters(params, root_rank=0)
```
"""

from keras_ring.core._basics import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from keras_ring.core._compression import Compression
from keras_ring.core._lifecycle import init, shutdown
from keras_ring.core._objects import allgather_object, barrier, broadcast_object, join
from keras_ring.core._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from keras_ring.core._reduce_ops import Average, Max, Min, Product, Sum
from keras_ring.jax._ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from keras_ring.jax._pytrees import allreduce_gradients, broadcast_parameters

__all__ = [
    "Average", "Compression", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
    "allgather", "allgather_object", "allreduce", "allreduce_gradients", "alltoall", "barrier",
    "broadcast", "broadcast_object", "broadcast_parameters", "cross_rank", "cross_size",
    "global_process_set", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
    "init", "is_initialized", "join", "local_rank", "local_size", "rank", "reducescatter",
    "remove_process_set", "shutdown", "size",
]
