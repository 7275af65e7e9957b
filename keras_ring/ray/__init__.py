"""keras-ring on Ray (`horovod.ray`): `RayExecutor` runs a training function on Ray actors;
`ElasticRayExecutor` runs an elastic job on the cluster's nodes; `KerasRingTrainer` is a
Ray Train trainer whose workers form one keras-ring job.
"""

try:
    import ray  # noqa: F401
except ImportError as e:
    raise ImportError('keras_ring.ray needs Ray: pip install "keras-ring[ray]"') from e

from keras_ring.ray._elastic import ElasticRayExecutor  # noqa: E402
from keras_ring.ray._executor import RayExecutor  # noqa: E402

__all__ = ["ElasticRayExecutor", "KerasRingConfig", "KerasRingTrainer", "RayExecutor"]


def __getattr__(name):
    # Ray Train imports Ray Data and pyarrow (2 s here): only for those who use the trainer,
    # not in every RayExecutor worker.
    if name in ("KerasRingConfig", "KerasRingTrainer"):
        from keras_ring.ray import _trainer

        return getattr(_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
