"""keras_ring.torch against what a PyTorch user picks instead: torch.distributed's gloo, in one job.

    keras-ring-run -np 2 python benchmarks/torch_vs_gloo.py [--sizes-kib 4 1024 16384 65536]
        [--iters 30] [--steps 30] [--rounds 3]

Every rank joins a gloo process group beside keras-ring (TCP on loopback,
rendezvous at a port rank 0 picks). Allreduce: each size is summed in place
by `keras_ring.torch.allreduce_` and by `torch.distributed.all_reduce`, one
after the other, each call started together on every rank (an mpi4py
barrier): medians, and keras-ring's as a ratio to gloo's. Training: one
MLP, the same data, `--steps` steps of `loss.backward(); step()` with
`keras_ring.torch.DistributedOptimizer` and with `DistributedDataParallel`
on gloo, alternated `--rounds` times; samples per second over all ranks
(the best round of each, the least disturbed on a shared machine). One
intra-op thread per rank. Rank 0 prints the tables and writes JSON and a PNG
plot to benchmarks/results/.
"""

import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
from _report import save_plot, write_results
from _timing import median_seconds
from mpi4py import MPI  # initialises MPI before keras-ring, which then shares it

import keras_ring.torch as hvd

ALLREDUCES = ("keras_ring.torch allreduce_", "gloo all_reduce")
TRAINERS = ("keras_ring.torch DistributedOptimizer", "DDP on gloo")


def join_gloo():
    """A gloo process group of the same ranks, through a port rank 0 found free."""
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def allreduce_rows(sizes_kib, iters, comm):
    rows = []
    for kib in sizes_kib:
        values = torch.from_numpy(np.random.default_rng(hvd.rank()).random(kib * 256, np.float32))
        mine, theirs = values.clone(), values.clone()
        calls = {
            ALLREDUCES[0]: lambda: hvd.allreduce_(mine, op=hvd.Sum, name="bench.torch"),
            ALLREDUCES[1]: lambda: dist.all_reduce(theirs),
        }
        times = {}
        for method, call in calls.items():
            call()  # connections and buffers outside the timing
            times[method] = median_seconds(call, iters, comm)
        rows.append({"kib": kib, **times})
    return rows


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def samples_per_second(trainer, steps, batch, comm):
    """Trains the MLP for `steps` steps with `trainer`; returns all ranks' samples per second."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if trainer == TRAINERS[0]:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        forward = model
    else:
        forward = torch.nn.parallel.DistributedDataParallel(model)
    rng = np.random.default_rng(hvd.rank())
    x = torch.from_numpy(rng.normal(size=(batch, 784)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, batch))

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()  # warm-up
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return steps * batch * hvd.size() / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 1024, 16384, 65536])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    join_gloo()
    comm = MPI.COMM_WORLD
    rows = allreduce_rows(args.sizes_kib, args.iters, comm)
    rounds = {t: [] for t in TRAINERS}
    for _ in range(args.rounds):
        for trainer in TRAINERS:
            rounds[trainer].append(samples_per_second(trainer, args.steps, args.batch, comm))
    dist.destroy_process_group()
    hvd.shutdown()
    if comm.rank != 0:
        return
    print(f"allreduce (sum, in place), {comm.size} ranks, median of {args.iters} (us)")
    print(f"{'size':>10} " + " ".join(f"{m:>28}" for m in ALLREDUCES) + f" {'keras-ring/gloo':>16}")
    for row in rows:
        print(f"{row['kib']:>7} KiB " + " ".join(f"{row[m] * 1e6:>28.1f}" for m in ALLREDUCES)
              + f" {row[ALLREDUCES[0]] / row[ALLREDUCES[1]]:>16.2f}")
    best = {t: max(r) for t, r in rounds.items()}
    params = sum(p.numel() for p in mlp().parameters())
    print(f"\nMLP ({params / 1e6:.2f}M parameters), batch {args.batch} per rank, {args.steps} "
          f"steps, best of {args.rounds} alternated rounds (samples/s, all ranks)")
    for trainer in TRAINERS:
        print(f"{trainer:>38} {best[trainer]:>10.0f}  rounds: "
              + ", ".join(f"{r:.0f}" for r in rounds[trainer]))
    print(f"{'keras-ring / DDP':>38} {best[TRAINERS[0]] / best[TRAINERS[1]]:>10.2f}")
    payload = {"ranks": comm.size, "iters": args.iters, "allreduce": rows,
               "mlp": {"parameters": params, "batch": args.batch, "steps": args.steps,
                       "rounds": rounds}}
    fig, (left, right) = write_results(args.out, "torch_vs_gloo", payload, figsize=(10, 4),
                                       ncols=2)
    sizes = [row["kib"] for row in rows]
    for method in ALLREDUCES:
        left.plot(sizes, [row[method] * 1e6 for row in rows], marker="o", label=method)
    left.set(xscale="log", yscale="log", xlabel="KiB per rank", ylabel="median time (us)",
             title=f"allreduce, {comm.size} ranks")
    left.legend()
    right.bar(range(len(TRAINERS)), [best[t] for t in TRAINERS])
    right.set_xticks(range(len(TRAINERS)), ["keras-ring", "DDP (gloo)"])
    right.set(ylabel="samples/s (best round)", title=f"MLP training, {comm.size} ranks")
    save_plot(fig, args.out, "torch_vs_gloo")


if __name__ == "__main__":
    main()
