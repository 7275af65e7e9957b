"""The pid of the MPICH forker this rank runs under, which MPICH names its segments after."""

import os


def forker_pid():
    """The nearest ancestor that is `mpiexec.gforker` (a rank starts under `_rank_output.py`,
    maybe behind `sh -c`), else the parent."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "mpiexec.gforker":
                return pid
    return os.getppid()
