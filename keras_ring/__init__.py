"""keras-ring: distributed data-parallel training for Keras 3 on TensorFlow.

The API mirrors `horovod.tensorflow.keras`: `init()`, `rank()`, `size()`,
collectives on tensors (`allreduce`, `grouped_allreduce`, `allgather`,
`broadcast`) and the reduce ops `Average`, `Sum`, `Min`, `Max`, `Product`.
"""

from keras_ring._basics import (
    cross_rank,
    cross_size,
    cuda_built,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    shutdown,
    size,
)
from keras_ring._reduce_ops import Average, Max, Min, Product, Sum

__version__ = "0.1.0.dev0"

# The collectives need TensorFlow; importing it takes seconds, so it happens on
# first use (`kr.allreduce`), and the launcher and `kr.init()` stay fast.
_TF_NAMES = frozenset(["allreduce", "grouped_allreduce", "allgather", "broadcast"])


def __getattr__(name):
    if name in _TF_NAMES:
        from keras_ring import _ops

        return getattr(_ops, name)
    raise AttributeError(f"module 'keras_ring' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_TF_NAMES))
