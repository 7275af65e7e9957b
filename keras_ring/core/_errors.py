"""The errors of elastic training, raised by the engine and by `kr.elastic`.

They live here, not in `keras_ring.elastic`, because the engine's binding
raises `WorkerLostError` itself, without importing TensorFlow or Keras.
"""

import re
import sys


class WorkerLostError(RuntimeError):
    """A collective failed because another worker died, hung or left the job.

    This worker is well. Under `keras-ring-run --elastic`, `kr.elastic.run`
    catches it, restores the last committed state and goes on in a new world
    with the workers that are left; elsewhere it ends the job. The message
    names the lost rank and what this rank was doing. Horovod calls it
    `HorovodInternalError` (an alias in `kr.elastic`).
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank at the same commit when workers can join or must leave.

    `kr.elastic.run` catches it and re-forms the world without restoring
    the state: nothing was lost.

    Args:
        skip_sync: Horovod's argument, kept for its scripts: keras-ring syncs
            the state after every re-formed world whatever it says, so that
            old and new workers run the same collectives (horovod#3494).
    """

    def __init__(self, skip_sync=False):
        super().__init__("keras-ring: workers are joining or leaving; the world re-forms at "
                         "this commit")
        self.skip_sync = skip_sync


def worker_lost(error):
    """Returns `error` as a `WorkerLostError` if it reports a lost worker, else None.

    JAX custom calls of keras-ring report one as a `JaxRuntimeError` whose
    message starts with "UNAVAILABLE: keras-ring:". TensorFlow ops of
    keras-ring report a lost worker as
    `tf.errors.UnavailableError` with the engine's message, which starts
    with "keras-ring:" (TensorFlow adds its own words around it, and inside a
    `tf.function` raises an `InternalError` saying the op returned
    `UnavailableError`); the engine's binding raises `WorkerLostError` itself.

    Args:
        error: An exception.

    Returns:
        A `WorkerLostError` with the engine's message alone, or None.
    """
    if isinstance(error, WorkerLostError):
        return error
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(error, jax.errors.JaxRuntimeError):
        found = re.match(r"UNAVAILABLE: (keras-ring:.*)", str(error), re.DOTALL)
        if not found:
            return None
        lost = WorkerLostError(found[1].strip())
        lost.__cause__ = error
        return lost
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(error, tf.errors.OpError):
        return None
    message = getattr(error, "message", "")
    # Inside a tf.function (model.fit's steps) TensorFlow raises an InternalError that says
    # what the op returned.
    if isinstance(error, tf.errors.UnavailableError) or (
            isinstance(error, tf.errors.InternalError) and
            "originally returned UnavailableError" in message):
        # TensorFlow wraps the engine's message: "{{function_node ...}} keras-ring: ... [Op:...]".
        found = re.search(r"keras-ring:.*?(?=\s*\[Op:|\s*\[\[|\s*\Z)", message, re.DOTALL)
        if found:
            lost = WorkerLostError(found[0])
            lost.__cause__ = error
            return lost
    return None
