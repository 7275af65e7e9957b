"""keras-ring on Ray (`horovod.ray`): `RayExecutor` runs a training function on Ray actors;
`ElasticRayExecutor` runs an elastic job on the cluster's nodes; `KerasRingTrainer` is a
Ray Train trainer whose workers form one keras-ring job.
"""

from keras_ring.ray._elastic import ElasticRayExecutor
from keras_ring.ray._executor import RayExecutor

__all__ = ["ElasticRayExecutor", "KerasRingConfig", "KerasRingTrainer", "RayExecutor"]


def __getattr__(name):
    # Ray Train imports Ray Data and pyarrow (2 s here): only for those who use the trainer,
    # not in every RayExecutor worker.
    if name in ("KerasRingConfig", "KerasRingTrainer"):
        from keras_ring.ray import _trainer

        return getattr(_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
