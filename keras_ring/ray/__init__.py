"""keras-ring on Ray (`horovod.ray`): `RayExecutor` runs a training function on Ray actors.

Horovod's `ElasticRayExecutor` and a Ray Train trainer are not here yet (docs/ray.md).
"""

from keras_ring.ray._executor import RayExecutor

__all__ = ["RayExecutor"]
