"""Allreduce time: keras-ring (TF op and engine binding) against mpi4py on the same MPI.

    keras-ring-run -np 2 python benchmarks/allreduce_vs_mpi4py.py [--sizes-mib 1 4 16] [--iters 20]
        [--transport mpi tcp] [--store-host ADDRESS]

With `--transport mpi tcp` keras-ring runs once on each world in the same job
(`shutdown()` and `init()` between them): on the MPI world, and on the TCP
world, whose rendezvous store rank 0 serves itself on `--store-host`
(loopback by default; across hosts, an address of rank 0's host that the
others reach), while mpi4py's baseline stays on the job's MPI.

Every method reduces the same float32 buffer, one method after the other,
each call started together on every rank (a barrier). Rank 0 prints a table (median
time, algbw = bytes / time, busbw = algbw * 2(p-1)/p as nccl-tests define
them, and each method's time relative to mpi4py and to the memory-bandwidth
floor), and writes JSON and a PNG plot to benchmarks/results/.

The floor is every rank copying its buffer once, all at the same time
(`np.copyto`): no allreduce on one host can move less memory than that, so
each method's time is also printed as a multiple of it.
"""

import argparse
import os
import secrets

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin otherwise

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _report import save_plot, write_results
from _timing import median_seconds  # noqa: E402
from mpi4py import MPI  # noqa: E402  (initialises MPI before keras-ring, which then shares it)

import keras_ring as kr  # noqa: E402
from keras_ring.core import _engine  # noqa: E402
from keras_ring.core._rendezvous import RendezvousServer  # noqa: E402

TCP_WORLD_VARIABLES = ("KERAS_RING_TRANSPORT", "KERAS_RING_RANK", "KERAS_RING_SIZE",
                       "KERAS_RING_RENDEZVOUS", "KERAS_RING_SECRET")


def start_tcp_world(comm, store_host, servers):
    """Restarts keras-ring on the TCP world, rank 0 serving the store (kept in `servers`)."""
    kr.shutdown()
    secret = address = None
    if comm.rank == 0:
        secret = secrets.token_hex(32)
        server = RendezvousServer(secret.encode(), host=store_host)
        server.start()
        servers.append(server)
        address = f"{store_host}:{server.address[1]}"
    secret, address = comm.bcast((secret, address), root=0)
    os.environ.update(KERAS_RING_TRANSPORT="tcp", KERAS_RING_RANK=str(comm.rank),
                      KERAS_RING_SIZE=str(comm.size), KERAS_RING_RENDEZVOUS=address,
                      KERAS_RING_SECRET=secret)
    kr.init()


def start_mpi_world():
    """Restarts keras-ring on the job's MPI world (after the TCP world)."""
    kr.shutdown()
    for name in TCP_WORLD_VARIABLES:
        os.environ.pop(name, None)
    kr.init()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--transport", nargs="+", choices=("mpi", "tcp"), default=["mpi"])
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if len(set(args.transport)) != len(args.transport):
        parser.error("--transport: each world once")

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    kr.init()
    comm = MPI.COMM_WORLD
    rank, size = kr.rank(), kr.size()
    if MPI.Get_library_version() != kr._basics.mpi_library_version():
        raise SystemExit("mpi4py and keras-ring loaded different MPI libraries; "
                         "the comparison would be meaningless")

    rows = []
    servers = []
    for transport in args.transport:
        if transport == "tcp":
            start_tcp_world(comm, args.store_host, servers)
        elif transport != args.transport[0]:
            start_mpi_world()
        # Named by world only when both run, so that one-world tables read as before.
        world = f" ({transport})" if len(args.transport) > 1 else ""
        baselines = transport == args.transport[0]
        for mib in args.sizes_mib:
            n = int(mib * 2**20) // 4
            host = np.full(n, float(rank + 1), np.float32)
            out = np.empty_like(host)
            tensor = tf.constant(host)

            def tf_op():
                kr.allreduce(tensor, op=kr.Sum, name="bench")  # eager ops return when done

            def binding():  # the caller's thread runs the engine while it waits
                _engine.run(_engine.ALLREDUCE, [host], ["bench"], op=kr.Sum)

            def mpi4py():
                comm.Allreduce(host, out, op=MPI.SUM)

            def floor():
                np.copyto(out, host)

            methods = {f"keras-ring TF op{world}": tf_op, f"keras-ring engine{world}": binding}
            if baselines:
                methods.update({"mpi4py Allreduce": mpi4py, "memcpy floor": floor})
            for fn in methods.values():  # warm up: first-use costs are not what we measure
                fn()
            for name, fn in methods.items():
                seconds = median_seconds(fn, args.iters, comm)
                algbw = n * 4 / seconds / 1e9
                rows.append({"method": name, "bytes": n * 4, "ranks": size, "seconds": seconds,
                             "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (size - 1) / size})
    kr.shutdown()
    for server in servers:
        server.stop()
    if rank != 0:
        return
    base = {r["bytes"]: r["seconds"] for r in rows if r["method"] == "mpi4py Allreduce"}
    floor = {r["bytes"]: r["seconds"] for r in rows if r["method"] == "memcpy floor"}
    print(f"\nallreduce float32, {size} ranks, median of {args.iters}, KERAS_RING_SHM="
          f"{os.environ.get('KERAS_RING_SHM', '1')}; MPI: "
          f"{MPI.Get_library_version().splitlines()[0]}")
    print(f"{'method':<26}{'MiB':>8}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"
          f"{'x mpi4py':>10}{'x floor':>9}")
    for r in rows:
        r["time_vs_mpi4py"] = r["seconds"] / base[r["bytes"]]
        r["time_vs_floor"] = r["seconds"] / floor[r["bytes"]]
        print(f"{r['method']:<26}{r['bytes'] / 2**20:>8.1f}{r['seconds'] * 1e3:>10.2f}"
              f"{r['algbw_GBps']:>12.2f}{r['busbw_GBps']:>12.2f}{r['time_vs_mpi4py']:>10.2f}"
              f"{r['time_vs_floor']:>9.2f}")
    name = f"allreduce_vs_mpi4py_{size}ranks" + "".join(
        f"_{t}" for t in args.transport if args.transport != ["mpi"])
    fig, ax = write_results(args.out, name, {"ranks": size, "iters": args.iters, "rows": rows},
                            figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "memcpy floor"):
        pts = [r for r in rows if r["method"] == method]
        ax.plot([r["bytes"] / 2**20 for r in pts], [r["busbw_GBps"] for r in pts], "o-",
                label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"allreduce float32, {size} ranks")
    ax.legend()
    save_plot(fig, args.out, name)


if __name__ == "__main__":
    main()
