"""Where this process sits in the job, and the engine binding it asks.

Everything here goes through the engine's NumPy binding (`keras_ring.core._engine`),
loaded on first use: `import keras_ring` imports neither TensorFlow nor MPI,
so the launcher starts fast and can explain a missing MPI itself. `init()` and
`shutdown()` (`_lifecycle`) set and clear the topology kept here.
"""

import importlib
import os

from keras_ring.core import _build_info

# The engine's topology (rank, size, local and cross ranks) between init() and shutdown().
_topology = None


def _engine():
    """Returns the engine binding, explaining a missing MPI library or an unbuilt source tree."""
    try:
        return importlib.import_module("keras_ring.core._engine")
    except ImportError as e:
        package = os.path.dirname(__file__)
        if e.name == "keras_ring.core._engine" and not os.path.exists(
            os.path.join(package, "_build_info.json")
        ):
            # `python -c` in the clone's root imports the clone, not the installed copy.
            raise ImportError(
                f"keras-ring: keras_ring was imported from its source tree ({package}), not "
                "from the installed keras-ring; the source tree has no compiled engine "
                "(keras_ring.core._engine). Python puts the working directory (or the script's) "
                "first on sys.path: run Python from another directory, after installing "
                "keras-ring if it is not installed yet (`pip install .` in this tree)."
            ) from None
        if "libmpi" not in str(e):
            raise
        raise RuntimeError(
            f"keras-ring: the engine cannot load its MPI library ({e}). keras-ring was built "
            f"against {_describe_mpi(_build_info.read_build_info())}; reinstall that MPI (for the "
            "default build: `pip install mpich` in this environment) or rebuild keras-ring "
            "against the MPI you have (see docs/system-mpi.md)."
        ) from None


def _describe_mpi(info):
    if info.get("mpi_source") == "pypi-mpich":
        return "the PyPI mpich package"
    return f"{info.get('mpi_vendor', 'an MPI')} ({info.get('mpicxx')})"


def is_initialized():
    """Returns True between `init()` and `shutdown()`.

    Example:

    ```python
    if not kr.is_initialized():
        kr.init()
    ```
    """
    return _topology is not None


def _require_initialized(what):
    if _topology is None:
        raise ValueError(
            f"keras-ring: {what} needs keras_ring.init() to have been called first "
            "(and not shut down since)."
        )
    return _topology


def rank():
    """Returns this process's rank in the job, 0 to `size() - 1`.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    if kr.rank() == 0:
        model.save("model.keras")  # one file, written by one rank
    ```
    """
    return _require_initialized("rank()")["rank"]


def size():
    """Returns the number of processes in the job.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    optimizer = keras.optimizers.Adam(1e-3 * kr.size())  # the global batch grows with size
    ```
    """
    return _require_initialized("size()")["size"]


def local_rank():
    """Returns this process's rank among the processes on its host.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    # One GPU per process on a host with several:
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[kr.local_rank()], "GPU")
    ```
    """
    return _require_initialized("local_rank()")["local_rank"]


def local_size():
    """Returns the number of processes on this process's host.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    # Share the host's cores between its processes.
    tf.config.threading.set_intra_op_parallelism_threads(
        max(1, os.cpu_count() // kr.local_size()))
    ```
    """
    return _require_initialized("local_size()")["local_size"]


def cross_rank():
    """Returns the index of this process's host among hosts (ranks of equal `local_rank`).

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    print(f"host {kr.cross_rank()} of {kr.cross_size()}, local rank {kr.local_rank()}")
    ```
    """
    return _require_initialized("cross_rank()")["cross_rank"]


def cross_size():
    """Returns the number of hosts that have a process with this `local_rank`.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    hosts = kr.cross_size()  # on a homogeneous job: kr.size() // kr.local_size()
    ```
    """
    return _require_initialized("cross_size()")["cross_size"]


def is_homogeneous():
    """Returns True if every host runs the same number of processes.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    if not kr.is_homogeneous():
        print("hosts run different numbers of ranks")
    ```
    """
    return _require_initialized("is_homogeneous()")["is_homogeneous"]


def mpi_threads_supported():
    """Returns True if MPI runs with MPI_THREAD_MULTIPLE.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    print(kr.mpi_threads_supported())
    ```
    """
    return _require_initialized("mpi_threads_supported()")["mpi_threads_supported"]


def mpi_built():
    """Returns True: keras-ring is always built with MPI.

    Example:

    ```python
    assert kr.mpi_built()
    ```
    """
    return True


def mpi_enabled():
    """Returns True if MPI carries this job (always, once initialised).

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    assert kr.mpi_enabled()
    ```
    """
    return _require_initialized("mpi_enabled()") is not None


def nccl_built():
    """Returns False: GPU collectives through NCCL are not built yet.

    Example:

    ```python
    device = "GPU" if kr.nccl_built() else "CPU"
    ```
    """
    return False


def cuda_built():
    """Returns False: CUDA kernels are not built yet.

    Example:

    ```python
    print(kr.cuda_built())  # False
    ```
    """
    return False


def _never_built(name, what):
    """A Horovod build check for something keras-ring does not have: it returns False."""

    def check():
        return False

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"""Returns False: {what}

    Horovod's name, so that scripts and tests that check it run unchanged.

    Example:

    ```python
    assert not kr.{name}()
    ```
    """
    return check


gloo_built = _never_built("gloo_built", "keras-ring has no Gloo; MPI starts and carries jobs.")
gloo_enabled = _never_built("gloo_enabled", "no job runs on Gloo (see `gloo_built`).")
ccl_built = _never_built("ccl_built", "keras-ring is not built with Intel's oneCCL.")
ddl_built = _never_built("ddl_built", "keras-ring is not built with IBM's DDL.")
rocm_built = _never_built("rocm_built", "keras-ring is not built for AMD GPUs (ROCm).")


def mpi_library_version():
    """Returns the MPI library's own version string."""
    return _engine().mpi_library_version()
