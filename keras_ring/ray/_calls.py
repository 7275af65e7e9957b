"""What the Ray executors' drivers and actors share: the functions they send, pickled by value,
and what a worker's error says."""

import os
import pickle
import sys

import cloudpickle
import ray


def _load(payload, path):
    # What travels may live in a module beside the driver's script (a test's, say): the
    # driver's import path is added after the worker's own, then the payload unpickled.
    sys.path += [p for p in path if p not in sys.path and os.path.isdir(p)]
    return pickle.loads(payload)


def _pack(call):
    """`call` pickled by value, and the driver's import path, for `_load` on a worker."""
    return ray.put(cloudpickle.dumps(call)), [p for p in sys.path if p]


def _node_id():
    """The Ray node this process runs on: a worker's host name in the job."""
    return ray.get_runtime_context().get_node_id()


def _set_env(env):
    os.environ.update({k: str(v) for k, v in env.items()})


def _no_callbacks(callbacks):
    if callbacks:
        raise NotImplementedError("keras-ring: RayExecutor and ElasticRayExecutor take no "
                                  "callbacks (Horovod's receivers of the values rank 0 logs); "
                                  "return values from the function instead")


def cause_of(error):
    """What a worker raised, from Ray's `RayTaskError`: "ValueError: ..."."""
    cause = error.cause if isinstance(error.cause, BaseException) else None
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
