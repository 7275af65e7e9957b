"""keras-ring on Ray (`horovod.ray`): `RayExecutor` runs a training function on Ray actors.

Work in progress (issue 29): the static executor on one Ray cluster.
"""

from keras_ring.ray._executor import RayExecutor

__all__ = ["RayExecutor"]
