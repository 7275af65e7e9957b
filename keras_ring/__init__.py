"""keras-ring: distributed data-parallel training for Keras 3 on TensorFlow and JAX.

The API mirrors `horovod.tensorflow.keras`: `init()`, `rank()`, `size()`,
collectives on tensors (`allreduce`, `grouped_allreduce`, `allgather`,
`grouped_allgather`, `broadcast`, `reducescatter`, `grouped_reducescatter`,
`alltoall`) and the reduce ops `Average`, `Sum`, `Min`, `Max`, `Product`
(`Adasum` is named, and refused where used), and for Keras
`DistributedOptimizer`, `DistributedGradientTape`, their `Partial*` forms
with local layers, and `SyncBatchNormalization`. The collectives here take
TensorFlow tensors; `keras_ring.jax` has them on `jax.Array`s. The Keras
layer runs under either Keras backend.
"""

import importlib
import sys

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
from keras_ring.core._lifecycle import init, shutdown
from keras_ring.core._objects import (
    allgather_object,
    barrier,
    broadcast_object,
    broadcast_object_fn,
    join,
)
from keras_ring.core._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from keras_ring.core._reduce_ops import Adasum, Average, Max, Min, Product, Sum
from keras_ring.core._timeline import start_timeline, stop_timeline

__version__ = "0.1.0.dev0"

# Everything below needs Keras (the collectives and the tape TensorFlow);
# importing them takes seconds, so it happens on first use (`kr.allreduce`),
# and the launcher and `kr.init()` stay fast. Name -> the module that defines it.
_LAZY = {
    "allreduce": "keras_ring.tensorflow._ops",
    "grouped_allreduce": "keras_ring.tensorflow._ops",
    "allgather": "keras_ring.tensorflow._ops",
    "grouped_allgather": "keras_ring.tensorflow._ops",
    "broadcast": "keras_ring.tensorflow._ops",
    "reducescatter": "keras_ring.tensorflow._ops",
    "grouped_reducescatter": "keras_ring.tensorflow._ops",
    "alltoall": "keras_ring.tensorflow._ops",
    "broadcast_variables": "keras_ring.tensorflow._ops",
    "broadcast_": "keras_ring.tensorflow._ops",
    "broadcast_global_variables": "keras_ring.tensorflow._ops",
    "size_op": "keras_ring.tensorflow._ops",
    "local_size_op": "keras_ring.tensorflow._ops",
    "rank_op": "keras_ring.tensorflow._ops",
    "local_rank_op": "keras_ring.tensorflow._ops",
    "process_set_included_op": "keras_ring.tensorflow._ops",
    "Compression": "keras_ring.core._compression",
    "DistributedOptimizer": "keras_ring.keras._optimizer",
    "PartialDistributedOptimizer": "keras_ring.keras._optimizer",
    "load_model": "keras_ring.keras._optimizer",
    "DistributedGradientTape": "keras_ring.keras._gradient_tape",
    "PartialDistributedGradientTape": "keras_ring.keras._gradient_tape",
    "SyncBatchNormalization": "keras_ring.keras._sync_batch_norm",
    "shard_dataset": "keras_ring.keras._data",
    "shard_arrays": "keras_ring.keras._data",
    "shard_py_dataset": "keras_ring.keras._data",
    "rank_zero_verbose": "keras_ring.keras._data",
    "unshard": "keras_ring.keras._data",
    "evaluate": "keras_ring.keras._evaluate",
    "run": "keras_ring.launcher._run",
}

# What to use instead of a name that needs TensorFlow, where it is not installed.
_TF_ALTERNATIVES = {
    "keras_ring.tensorflow._ops": "on JAX, keras_ring.jax has the same collectives on "
    "jax.Arrays",
    "keras_ring.keras._gradient_tape": "with Keras on any backend, kr.DistributedOptimizer "
    "reduces the gradients in model.fit; in a jax.jit step of your own, "
    "keras_ring.jax.allreduce_gradients",
}

# Sub-packages that import Keras, loaded on first use too.
_SUBPACKAGES = ("callbacks", "elastic")

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum",
    "cross_rank", "cross_size", "cuda_built", "init", "is_homogeneous", "is_initialized",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "shutdown", "size", "callbacks", "elastic", "broadcast_object",
    "allgather_object", "barrier", "join", "broadcast_object_fn", "gloo_built", "gloo_enabled",
    "ccl_built", "ddl_built", "rocm_built", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "start_timeline", "stop_timeline", *_LAZY,
]


# With Keras already loaded, registering keras-ring's layers costs nothing, and
# keras.models.load_model then finds them in saved models.
if "keras" in sys.modules:
    importlib.import_module("keras_ring.keras._sync_batch_norm")


def __getattr__(name):
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name != "tensorflow" or _LAZY[name] not in _TF_ALTERNATIVES:
                raise
            raise ModuleNotFoundError(
                f"keras_ring.{name} works on TensorFlow tensors and needs TensorFlow, which is "
                'not installed (pip install "keras-ring[tensorflow]"); '
                f"{_TF_ALTERNATIVES[_LAZY[name]]}.", name="tensorflow") from None
        return getattr(module, name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"keras_ring.{name}")
    raise AttributeError(f"module 'keras_ring' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_SUBPACKAGES))
