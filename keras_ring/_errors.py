"""The errors of elastic training (temporary: the lead's version replaces this file)."""

import sys


class WorkerLostError(RuntimeError):
    """A collective failed because a peer died or stopped answering."""


class HostsUpdatedInterrupt(RuntimeError):
    """The driver asked the world to re-form; raised at a commit on every rank."""


def worker_lost(exc):
    """Returns a `WorkerLostError` if `exc` is a keras-ring op's lost-peer error, else None."""
    tf = sys.modules.get("tensorflow")
    if (tf is not None and isinstance(exc, tf.errors.UnavailableError)
            and str(exc.message).startswith("keras-ring:")):
        return WorkerLostError(exc.message)
    return None
