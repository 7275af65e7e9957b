"""Recording the timeline: each rank's engine writes its own file as it works.

`keras_ring.timeline` reads the files (merge, plot); `init()` starts a
recording when the environment asks for one.
"""

import os
import sys

from keras_ring.core import _basics

_ENVIRONMENT = ("KERAS_RING_TIMELINE", "HOROVOD_TIMELINE")
_MARK_CYCLES_ENVIRONMENT = ("KERAS_RING_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES")


def start_timeline(file_path, mark_cycles=False):
    """Starts recording this rank's timeline; every rank that calls it records its own.

    The events go to `rank_file(file_path, rank())` as they happen (buffered,
    written every 100 ms by a thread of their own): per tensor, waiting for
    the other ranks and agreement (`NEGOTIATE`), then the collective's span
    (`ALLREDUCE`, ...) with its phases `QUEUE`, `PACK`, `COMMUNICATE`,
    `UNPACK` and `DONE`. `stop_timeline()` or `shutdown()` ends the file;
    `python -m keras_ring.timeline merge file_path` joins the ranks' files.

    Args:
        file_path: Where the timeline goes, before the rank is added
            (`trace.json` gives `trace.rank0.json` on rank 0).
        mark_cycles: Also mark every engine cycle that submitted or ran
            something (`CYCLE` marks).

    Raises:
        ValueError: if keras-ring is not initialised, a timeline is already
            being recorded, or the file cannot be created.

    Example:

    ```python
    kr.init()
    kr.start_timeline("/tmp/trace.json")
    model.fit(x, y, epochs=1)
    kr.stop_timeline()
    ```
    """
    rank = _basics._require_initialized("start_timeline()")["rank"]
    path = rank_file(os.fspath(file_path), rank)
    try:
        _basics._engine().start_timeline(path, bool(mark_cycles))
    except RuntimeError as e:  # not initialised: the engine stopped by itself
        raise ValueError(str(e)) from None


def stop_timeline():
    """Stops recording the timeline and closes its file (does nothing if none is recording).

    Example:

    ```python
    kr.start_timeline("/tmp/trace.json")
    train_a_few_steps()
    kr.stop_timeline()
    ```
    """
    if "keras_ring.core._engine" in sys.modules:
        _basics._engine().stop_timeline()


def start_from_environment():
    """Called by `init()`: starts the timeline that the environment asks for."""
    path = next((os.environ[v] for v in _ENVIRONMENT if os.environ.get(v)), None)
    if path:
        mark = next((os.environ[v] for v in _MARK_CYCLES_ENVIRONMENT if os.environ.get(v)), "0")
        start_timeline(path, mark_cycles=mark.strip().lower() not in ("0", "false", ""))


def file_stem(path):
    """`path` without its `.json`."""
    return path[: -len(".json")] if path.endswith(".json") else path


def rank_file(path, rank):
    """The file rank `rank` records into for `path`: `trace.json` -> `trace.rank0.json`."""
    return f"{file_stem(path)}.rank{rank}.json"
