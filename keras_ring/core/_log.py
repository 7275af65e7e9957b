"""keras-ring's log for the Python layer: the engine's own, so one level and one format.

`KERAS_RING_LOG_LEVEL` (trace, debug, info, warning, error; `HOROVOD_LOG_LEVEL`
too) filters the messages; each is one line on stderr prefixed with the time,
the rank and the host.
"""

from keras_ring.core import _basics

TRACE, DEBUG, INFO, WARNING, ERROR = range(5)


def log(level, message, once=False):
    """Writes `message` at `level`; with `once`, at most once per process."""
    _basics._engine().log(level, message, once)


def info(message, once=False):
    log(INFO, message, once)


def warning(message, once=False):
    log(WARNING, message, once)
