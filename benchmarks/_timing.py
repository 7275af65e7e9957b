"""Timing shared by the benchmarks that run under the launcher."""

import time

import numpy as np
from mpi4py import MPI


def median_seconds(fn, iters, comm=MPI.COMM_WORLD):
    """Median seconds of `iters` calls, each started together on every rank.

    A collective finishes when its slowest rank does, so the result is the
    largest of the ranks' medians, the same on every rank.
    """
    times = []
    for _ in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return comm.allreduce(float(np.median(times)), op=MPI.MAX)
