"""init() and shutdown(): start the engine in this process, and stop it.

`init()` checks the launcher's environment against the MPI keras-ring was
built with, joins the elastic world when there is one, starts the engine,
agrees the Keras backend across ranks, then starts the timeline and the process
sets the job asks for. The topology it gets is kept in `_basics`.
"""

import json
import os
import sys
import threading

from keras_ring.core import (
    _basics,
    _build_info,
    _elastic_world,
    _end_report,
    _environment,
    _log,
    _mpi_env,
    _process_sets,
    _timeline,
)

_lock = threading.Lock()
# The settings the last init() was given: an elastic re-init uses them again.
given_settings = {}


def _line_buffer_output():
    # Ranks share the launcher's output: write whole lines, so that lines of
    # different ranks never mix (PYTHONUNBUFFERED would write in pieces).
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and not stream.isatty():
            stream.reconfigure(line_buffering=True, write_through=False)


# init()'s arguments: the engine's name for each (kr_init_options).
_SETTINGS = {
    "fusion_threshold": "fusion_threshold",
    "cycle_time": "cycle_time_ms",
    "stall_check_time": "stall_check_seconds",
    "stall_shutdown_time": "stall_shutdown_seconds",
    "cache_capacity": "cache_capacity",
}


def init(comm=None, process_sets=None, fusion_threshold=None, cycle_time=None,
         stall_check_time=None, stall_shutdown_time=None, cache_capacity=None):
    """Starts keras-ring in this process: MPI (unless already started) and the engine.

    A script started without a launcher is a job of size 1. Calling `init()`
    again while initialised does nothing; after `shutdown()` it starts again.
    In a worker of an elastic job (`keras-ring-run --elastic`), `init()` asks
    the job's driver for the world to join, its rank and its size, and waits
    for the answer up to `KERAS_RING_ELASTIC_TIMEOUT` seconds; a worker the
    driver removes exits here with code 0.
    Each setting left `None` comes from its environment variable
    (`KERAS_RING_FUSION_THRESHOLD`, ...; Horovod's `HOROVOD_*` names are read
    too); a value given here holds for this `init()` only and leaves the
    environment (and child processes) alone. Every rank should use the same
    settings.

    Args:
        comm: Reserved for an mpi4py communicator or a list of world ranks,
            as in Horovod. Only `None` (the whole job) is supported so far.
        process_sets: `ProcessSet` objects (or lists of world ranks) to add right
            away, as `add_process_set` would; more can be added later.
        fusion_threshold: Bytes up to which allreduces that are ready together
            are fused into one collective (default 64 MiB; 0: no fusion).
        cycle_time: Milliseconds an agreed tensor may wait for others to fuse
            with (default 0: none).
        stall_check_time: Seconds after which rank 0 reports a tensor that
            some ranks wait for and others have not submitted (default 60;
            0: never).
        stall_shutdown_time: Seconds after which such a tensor fails on the
            ranks that wait for it (default 600; 0: never).
        cache_capacity: How many tensor names the response cache holds
            (default 1024; 0: no cache). A cached name is announced to the
            coordinator by a small id and scheduled without comparing its
            description again; names beyond the capacity take the full path.

    `KERAS_RING_TIMELINE=path` (or `HOROVOD_TIMELINE`) starts recording the
    timeline here (see `start_timeline`); `KERAS_RING_LOG_LEVEL` sets what the
    log shows; `KERAS_RING_AUTOTUNE=1` (or `HOROVOD_AUTOTUNE`) tunes the
    fusion threshold, cycle time, segment size and algorithm crossover during
    the first steps of training, the same on every rank.

    Raises:
        ValueError: if `comm` is given, or a process set is invalid.
        keras_ring.elastic.WorkerLostError: if a rank of the new world was
            lost while it was being set up (elastic jobs start it again).
        RuntimeError: if the job was started by a different MPI than the one
            keras-ring was built against, or MPI cannot start.

    Example:

    ```python
    import keras_ring as kr

    kr.init()  # under `keras-ring-run -np 2`: rank 0 or 1, size 2
    print(f"rank {kr.rank()} of {kr.size()}")
    ```
    """
    global given_settings
    if comm is not None:
        raise ValueError(
            "keras-ring: init(comm=...) is not supported yet; keras-ring uses the whole "
            f"MPI job. Received: comm={comm!r}"
        )
    given = dict(fusion_threshold=fusion_threshold, cycle_time=cycle_time,
                 stall_check_time=stall_check_time,
                 stall_shutdown_time=stall_shutdown_time, cache_capacity=cache_capacity)
    # Checked on a second call too, which changes nothing: a bad value is an error either way.
    settings = {}
    for argument, value in given.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"keras-ring: `{argument}` must be a non-negative number. "
                             f"Received: {argument}={value!r}")
        counts = ("fusion_threshold", "cache_capacity")
        settings[_SETTINGS[argument]] = int(value) if argument in counts else float(value)
    with _lock:
        if _basics._topology is not None:
            return
        given_settings = {k: v for k, v in given.items() if v is not None}
        info = _build_info.read_build_info()
        _mpi_env.check_launcher_environment(info)
        engine = _basics._engine()
        if _elastic_world.is_elastic():
            # The driver gives each world's rank and size (it may remove this worker instead).
            settings.update(_elastic_world.request_world())
        _end_report.before_engine_start()
        engine.init(settings)
        topology = engine.topology()
        _end_report.after_engine_start(topology["rank"])
        expected = _mpi_env.expected_world_size()
        if expected is not None and expected != topology["size"]:
            engine.shutdown()
            raise RuntimeError(
                f"keras-ring: the launcher started {expected} processes but MPI reports a job "
                f"of size {topology['size']}: the processes did not join one job, so each "
                f"would run as rank 0 of its own. keras-ring was built against "
                f"{_basics._describe_mpi(info)}; start the job with keras-ring-run or with that "
                "MPI's own mpiexec."
            )
        _check_same_keras_backend(engine, topology["size"])
        _basics._topology = topology
        if topology["size"] > 1:
            _line_buffer_output()
        misspelled = _environment.unknown_variables_message(os.environ)
        if misspelled and topology["rank"] == 0:
            _log.warning(misspelled, once=True)
    _timeline.start_from_environment()
    if process_sets is not None:
        for process_set in process_sets:
            _process_sets.add_process_set(process_set)


def _keras_backend_name():
    """The Keras backend this process uses or will use, without importing Keras."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    # Keras's own choice: its config file, else TensorFlow.
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json"), encoding="utf-8") as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


# The Keras backend agreed at init(), which the Keras layer holds Keras to.
keras_backend_at_init = None


def _check_same_keras_backend(engine, size):
    """Raises on every rank unless every rank runs the same Keras backend.

    A job whose ranks trained on different backends would name its
    collectives differently and wait for each other until the timeout.
    """
    import numpy as np

    global keras_backend_at_init
    name = keras_backend_at_init = _keras_backend_name()
    if size == 1:
        return
    mine = np.frombuffer(name.encode()[:31].ljust(32, b"\0"), np.uint8)
    every = engine.run(engine.ALLGATHER, [mine], ["keras_ring.init.keras_backend"])[0]
    names = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every.reshape(-1, 32)]
    if len(set(names)) == 1:
        return
    engine.shutdown()
    ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
    raise RuntimeError(
        f"keras-ring: the ranks run different Keras backends ({ranks}); a job trains on one. "
        "Give every rank the same KERAS_BACKEND (keras-ring-run passes its environment to "
        "every rank) and the same Keras configuration."
    )


def shutdown():
    """Stops the engine. Collective: returns once every rank has called it.

    Operations still pending fail with an error. `init()` may be called again.
    Calling it is optional: the engine shuts down when the process exits.

    Example:

    ```python
    kr.init()
    model.fit(dataset, epochs=5)
    kr.shutdown()
    ```
    """
    with _lock:
        if "keras_ring.core._engine" in sys.modules:
            _basics._engine().shutdown()
            _end_report.shut_down()
        _basics._topology = None
        _process_sets._forget_all()
