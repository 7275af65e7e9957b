"""The MPI that keras-ring was built against, as CMake recorded it in `_build_info.json`."""

import json
import os
import sysconfig
from pathlib import Path

REBUILD_HINT = (
    "rebuild keras-ring against the MPI you launch with: "
    "`KERAS_RING_MPICXX=/path/to/its/mpicxx pip install --force-reinstall --no-cache-dir "
    "keras-ring`"
)

_BUILD_INFO_PATH = Path(__file__).with_name("_build_info.json")
# A source tree that was never built has no build info: it uses the PyPI mpich.
_DEFAULT_BUILD_INFO = {
    "mpi_source": "pypi-mpich",
    "mpicxx": None,
    "mpi_vendor": "MPICH",
    "mpi_library_version": "",
    "mpiexec": None,
}


def read_build_info():
    """Returns the MPI facts recorded when keras-ring was built.

    Returns:
        A dict with `mpi_source` (`"pypi-mpich"` or `"system"`), `mpicxx`,
        `mpi_vendor` (`"MPICH"`, `"Open MPI"`, `"Intel MPI"` or `"unknown"`),
        `mpi_library_version` and `mpiexec` (the system launcher's path, or
        `None` for the PyPI `mpich`). Without a build info file (a source tree
        that was never built) the PyPI `mpich` is assumed.
    """
    try:
        text = _BUILD_INFO_PATH.read_text()
    except FileNotFoundError:
        return dict(_DEFAULT_BUILD_INFO)
    return {**_DEFAULT_BUILD_INFO, **json.loads(text)}


def default_mpiexec(build_info):
    """Returns the path of the `mpiexec` that matches the build.

    Args:
        build_info: The dict from `read_build_info()`.

    Returns:
        For the PyPI `mpich`, its `mpiexec` in this environment's scripts
        folder (or the user scripts folder, after `pip install --user`);
        otherwise the launcher recorded at build time.
    """
    if build_info["mpi_source"] != "pypi-mpich":
        return build_info["mpiexec"]
    candidates = [
        os.path.join(sysconfig.get_path("scripts", scheme), "mpiexec")
        for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user")
    ]
    return next((path for path in candidates if os.access(path, os.X_OK)), candidates[0])
