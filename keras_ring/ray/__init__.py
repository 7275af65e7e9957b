"""keras-ring on Ray (`horovod.ray`): `RayExecutor` runs a training function on Ray actors;
`ElasticRayExecutor` runs an elastic job on the cluster's nodes.

A Ray Train trainer is not here yet (docs/ray.md).
"""

from keras_ring.ray._elastic import ElasticRayExecutor
from keras_ring.ray._executor import RayExecutor

__all__ = ["ElasticRayExecutor", "RayExecutor"]
