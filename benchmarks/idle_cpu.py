"""CPU used by an initialised, idle engine: keras-ring against a Horovod-style 1 ms control loop.

    keras-ring-run -np 2 python benchmarks/idle_cpu.py [--seconds 10]

Each rank initialises keras-ring, lets it sit idle for `--seconds`, and
measures its own process CPU time; as a baseline from the same run it then
spins a 1 ms cycle of one small MPI_Allreduce (what an engine that negotiates
every cycle costs: Horovod's background loop). Rank 0 prints the table
(percent of one core) and writes JSON and a PNG plot to benchmarks/results/.
"""

import argparse
import os
import time

import numpy as np
from _report import save_plot, write_results
from mpi4py import MPI

import keras_ring as kr


def cpu_percent(fn, seconds):
    wall, cpu = time.perf_counter(), time.process_time()
    fn(seconds)
    return 100.0 * (time.process_time() - cpu) / (time.perf_counter() - wall)


def idle(seconds):
    time.sleep(seconds)


def control_loop(seconds):
    flag, out = np.zeros(1, np.int64), np.zeros(1, np.int64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        MPI.COMM_WORLD.Allreduce(flag, out)
        time.sleep(0.001)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    kr.init()
    comm = MPI.COMM_WORLD
    rows = []
    for method, fn in [("keras-ring engine, idle", idle),
                       ("1 ms control allreduce loop", control_loop)]:
        comm.Barrier()
        per_rank = comm.gather(cpu_percent(fn, args.seconds))
        if kr.rank() == 0:
            rows.append({"method": method, "cpu_percent_per_rank": per_rank,
                         "cpu_percent_max": max(per_rank)})
    if kr.rank() != 0:
        return
    print(f"\nCPU of one core used over {args.seconds:.0f} s, {kr.size()} ranks")
    print(f"{'method':<32}{'max %':>10}  per rank")
    for r in rows:
        print(f"{r['method']:<32}{r['cpu_percent_max']:>10.3f}  "
              + ", ".join(f"{p:.3f}" for p in r["cpu_percent_per_rank"]))
    name = f"idle_cpu_{kr.size()}ranks"
    fig, ax = write_results(args.out, name,
                            {"ranks": kr.size(), "seconds": args.seconds, "rows": rows},
                            figsize=(6, 2.8))
    ax.barh([r["method"] for r in rows], [r["cpu_percent_max"] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("% of one core (busiest rank, log scale)")
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
