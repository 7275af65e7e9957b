"""Which launcher started this process, read from the environment before MPI starts.

Each launcher leaves its own variables in the ranks' environment:

- MPICH's Hydra `mpiexec`: `PMI_RANK`, `PMI_SIZE`, `PMI_FD`, `PMI_HOSTNAME`,
  `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`, `HYDI_CONTROL_FD`. MPICH's forker
  (`mpiexec.gforker`): `PMI_RANK`, `PMI_SIZE`, `PMI_FD`, `MPI_APPNUM`. Intel MPI's
  launcher is derived from Hydra and sets the same `PMI_*` variables.
- Open MPI's `mpirun`: `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`,
  `OMPI_COMM_WORLD_LOCAL_RANK`, ... and, from its PMIx server, `PMIX_RANK` and
  `PMIX_NAMESPACE`.
- Slurm's `srun`: `SLURM_STEP_ID`, `SLURM_STEP_NUM_TASKS`, `SLURM_PROCID`, plus
  `PMI_*` with `--mpi=pmi2` or `PMIX_*` with `--mpi=pmix`. `SLURM_NTASKS` alone
  is also set in a batch script, outside any MPI launch.

An MPI library started by another MPI's launcher does not find its job and
runs as a job of size 1: N copies of rank 0.
"""

import os

from keras_ring.core import _build_info

# How to start a job under Slurm for each build.
_SRUN_BY_VENDOR = {
    "MPICH": "srun --mpi=pmi2",
    "Intel MPI": "srun --mpi=pmi2",
    "Open MPI": "srun --mpi=pmix",
}


def check_launcher_environment(build_info, environ=None):
    """Checks that this process was not started by another MPI's launcher.

    Call it before starting MPI: afterwards the damage (a job of size 1 in
    every process) is done.

    Args:
        build_info: The dict from `keras_ring.core._build_info.read_build_info()`.
        environ: The environment to inspect; `os.environ` by default.

    Raises:
        RuntimeError: if the environment shows a launcher whose processes the
            MPI keras-ring was built against cannot join.

    Example:

    >>> check_launcher_environment({"mpi_vendor": "MPICH", "mpi_source": "pypi-mpich",
    ...                             "mpicxx": None, "mpiexec": None}, environ={})
    """
    environ = os.environ if environ is None else environ
    built = build_info["mpi_vendor"]
    launched_by = None
    if built in ("MPICH", "Intel MPI"):
        if "OMPI_COMM_WORLD_SIZE" in environ:
            launched_by = "Open MPI's mpirun (OMPI_COMM_WORLD_SIZE is set)"
        elif (
            "PMIX_RANK" in environ
            and "PMI_RANK" not in environ
            and build_info["mpi_source"] == "pypi-mpich"
        ):
            # The PyPI mpich speaks PMI-1 and PMI-2 only; MPI_Init rejects PMIx.
            launched_by = "a PMIx launcher such as `srun --mpi=pmix` (PMIX_RANK is set)"
    elif built == "Open MPI":
        if "HYDI_CONTROL_FD" in environ:
            launched_by = "MPICH's or Intel MPI's Hydra mpiexec (HYDI_CONTROL_FD is set)"
        elif (
            "PMI_RANK" in environ
            and "OMPI_COMM_WORLD_SIZE" not in environ
            and "PMIX_RANK" not in environ
            and "SLURM_STEP_ID" not in environ
        ):
            launched_by = "an MPICH-family mpiexec (PMI_RANK is set)"
    if launched_by is None:
        return
    raise RuntimeError(
        f"keras-ring: this process was started by {launched_by}, but keras-ring was built "
        f"against {built} (mpicxx: {build_info['mpicxx'] or 'from the PyPI mpich package'}). "
        "Its MPI_Init cannot join a job started by another MPI, so every process would run "
        "alone as rank 0 of a job of size 1. Start the job with `keras-ring-run -np N ...` "
        f"or {built}'s own launcher ({_build_info.default_mpiexec(build_info)}), under Slurm "
        f"with `{_SRUN_BY_VENDOR[built]}`; or {_build_info.REBUILD_HINT}."
    )


def expected_world_size(environ=None):
    """Returns the number of processes the launcher says it started.

    Compare it with MPI's world size after MPI starts: a mismatch means the
    processes did not join one job.

    Args:
        environ: The environment to inspect; `os.environ` by default.

    Returns:
        The size from `PMI_SIZE` (MPICH, Intel MPI, srun with PMI-2) or
        `OMPI_COMM_WORLD_SIZE` (Open MPI), else `SLURM_STEP_NUM_TASKS` when
        `srun` started this process through PMI or PMIx, else `None` (no
        launcher, or one that does not say).

    Example:

    >>> expected_world_size({"PMI_RANK": "0", "PMI_SIZE": "4"})
    4
    """
    environ = os.environ if environ is None else environ
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if name in environ:
            return _positive_int(environ[name])
    if any(name in environ for name in ("PMI_RANK", "PMI_FD", "PMIX_RANK")):
        return _positive_int(environ.get("SLURM_STEP_NUM_TASKS"))
    return None


def _positive_int(text):
    try:
        value = int(text)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None
