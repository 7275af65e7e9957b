"""The decisive test for keras_ring.torch's training API, and its rules, across ranks.

Run with 2 or 3 ranks: `keras-ring-run -np 3 python tests/workers/torch_train_worker.py`.
N ranks at batch b with `DistributedOptimizer` must reach the weights that one
plain torch optimizer reaches at batch N*b. Every rank computes that
reference itself, on the global batch, so the comparison needs no second job.
The ranks start from different weights, which `broadcast_parameters` makes
equal. Wrong values are collected and reported at the end (exit 1).
"""

import copy
import sys
import warnings

import torch

import keras_ring.torch as hvd

torch.set_num_threads(1)  # up to 3 ranks share 2 cores
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BATCH, STEPS = 4, 5
failures = []


def fail(message):
    failures.append(f"rank {RANK}: {message}")


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


class Embedded(torch.nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 5, sparse=sparse)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.embedding(x).mean(1))


def data(model_kind, step, rank):
    """This rank's batch of a step (the global batch is the ranks' batches in rank order)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if model_kind is Embedded:
        x = torch.randint(0, 20, (BATCH, 4), generator=g)
    else:
        x = torch.randn(BATCH, 6, generator=g)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def global_batch(model_kind, step):
    parts = [data(model_kind, step, r) for r in range(SIZE)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def close(what, actual, expected, tol=1e-5):
    for (name, a), b in zip(actual.state_dict().items(), expected.state_dict().values()):
        if not torch.allclose(a, b, rtol=tol, atol=tol):
            fail(f"{what}: {name} differs from one optimizer at the global batch by "
                 f"{(a - b).abs().max().item():.3g}")
            return


def equivalence(what, model_kind=Dense, make=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                passes=1, scale=1.0, tol=1e-5, **options):
    """N ranks at batch b with DistributedOptimizer against one optimizer at batch N*b."""
    torch.manual_seed(RANK)  # each rank starts from its own weights
    model = model_kind(**options.pop("model_args", {}))
    optimizer = make(model.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = copy.deepcopy(model)
    reference_optimizer = make(reference.parameters())
    if callable(options.get("groups")):
        options["groups"] = options["groups"](model)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        for micro in range(passes):
            x, y = data(model_kind, passes * step + micro, RANK)
            loss_fn(model, x, y).backward()
            gx, gy = global_batch(model_kind, passes * step + micro)
            (scale * loss_fn(reference, gx, gy)).backward()
        optimizer.step()
        reference_optimizer.step()
    close(what, model, reference, tol)
    return model, optimizer


def check_equivalence():
    equivalence("dense, SGD with momentum")
    equivalence("dense, Adam", make=lambda p: torch.optim.Adam(p, lr=0.01))
    equivalence("embedding, Adam", Embedded, make=lambda p: torch.optim.Adam(p, lr=0.01))
    equivalence("sparse embedding, SGD (rows gathered)", Embedded,
                make=lambda p: torch.optim.SGD(p, lr=0.1), model_args={"sparse": True})
    equivalence("sparse embedding, SGD, sparse_as_dense", Embedded,
                make=lambda p: torch.optim.SGD(p, lr=0.1), model_args={"sparse": True},
                sparse_as_dense=True)
    equivalence("backward_passes_per_step=2", passes=2)
    equivalence("op=Sum", op=hvd.Sum, scale=float(SIZE))
    equivalence("gradient_predivide_factor=2", gradient_predivide_factor=2.0)
    equivalence("groups=2", groups=2, make=lambda p: torch.optim.Adam(p, lr=0.01))
    equivalence("groups as lists", groups=lambda m: [[m.hidden.weight, m.out.bias]])
    equivalence("fp16 compression", compression=hvd.Compression.fp16, tol=2e-3)
    equivalence("bf16 compression", compression=hvd.Compression.bf16, tol=2e-2)


def check_synchronize_and_clipping():
    """synchronize() gives the reduced gradients before the step; clipping sees them."""
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, *data(Dense, step, RANK)).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with optimizer.skip_synchronize():
                optimizer.step()
        reference_optimizer.zero_grad()
        loss_fn(reference, *global_batch(Dense, step)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        reference_optimizer.step()
    close("synchronize, clip, skip_synchronize", model, reference)

    optimizer.zero_grad()
    loss_fn(model, *data(Dense, 9, RANK)).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    if not any("skip_synchronize" in str(w.message) for w in caught):
        fail("step() after synchronize() without skip_synchronize() did not warn")


def check_unused_parameter():
    """A parameter one rank's forward pass leaves out is reduced as zeros there, not hung."""

    class Branchy(Dense):
        def forward(self, x, use_out):
            h = torch.tanh(self.hidden(x))
            return self.out(h) if use_out else h[:, :3]

    torch.manual_seed(0)
    model = Branchy()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    before = model.out.weight.detach().clone()
    x, y = data(Dense, 0, RANK)
    torch.nn.functional.cross_entropy(model(x, use_out=RANK == 0), y).backward()
    optimizer.step()
    moved = not torch.equal(before, model.out.weight.detach())
    if not moved:
        fail("the parameter only rank 0 used did not move")
    everyone = hvd.allgather_object(model.out.weight.detach().numpy().tolist())
    if any(w != everyone[0] for w in everyone):
        fail("the weights differ between ranks after an unused parameter's step")


def check_rules():
    """Horovod's rules for DistributedOptimizer, each a clear error."""
    model = Dense()
    params = list(model.named_parameters())
    for kwargs, words in (
            ({"named_parameters": [p for _, p in params]}, "(name, parameter) tuples"),
            ({"named_parameters": [("same", p) for _, p in params]}, "Found twice: same"),
            ({"named_parameters": params[:2]}, "leaves out 2 of the optimizer's 4"),
            ({"backward_passes_per_step": 0}, "positive integer"),
            ({"groups": -1}, "groups must be"),
            ({"groups": [[params[0][1], params[0][1]]]}, "twice in groups"),
            ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "needs op=Average"),
            ({"op": hvd.Adasum}, "Adasum")):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        except (ValueError, NotImplementedError) as e:
            if words not in str(e):
                fail(f"unclear error for {kwargs}: {e}")
        else:
            fail(f"no error for {kwargs}")

    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x, y = data(Dense, 0, RANK)
    loss_fn(model, x, y).backward()
    if len(optimizer._kr_pending) != 4:  # each hook started its gradient's allreduce
        fail(f"{len(optimizer._kr_pending)} of 4 allreduces started during the backward pass")
    for bad, words in ((optimizer.zero_grad, "before optimizer.step()"),
                       (lambda: loss_fn(model, x, y).backward(), "more than "
                        "backward_passes_per_step=1 times")):
        try:
            bad()
        except (AssertionError, RuntimeError) as e:
            if words not in str(e):
                fail(f"unclear error {e!r}, wanted {words!r}")
        else:
            fail(f"no error for {words!r}")
    optimizer.step()  # the allreduces the first backward started finish on every rank
    try:
        hvd.DistributedOptimizer(optimizer)
    except ValueError as e:
        if "already a DistributedOptimizer" not in str(e):
            fail(f"unclear error for wrapping twice: {e}")
    else:
        fail("wrapping a DistributedOptimizer again did not fail")


def check_state_and_scheduler():
    """broadcast_optimizer_state gives every rank the root's state; the class, hooks and a
    scheduler made after wrapping behave as on the plain optimizer."""
    torch.manual_seed(RANK)
    model = Dense()
    plain = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1))
    for step in range(RANK + 1):  # a different state on every rank
        plain.zero_grad()
        loss_fn(model, *data(Dense, step, RANK)).backward()
        plain.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    states = hvd.allgather_object({k: (v.tolist() if torch.is_tensor(v) else v)
                                   for k, v in plain.state_dict()["state"][0].items()})
    if any(s != states[0] for s in states) or plain.param_groups[0]["lr"] != 0.01:
        fail("broadcast_optimizer_state left the ranks' Adam states or learning rates different")
    optimizer = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    if not isinstance(optimizer, torch.optim.Adam) or type(optimizer).__name__ != "Adam":
        fail(f"the wrapped optimizer is a {type(optimizer).__mro__}, not an Adam")
    if int(optimizer.state_dict()["state"][0]["step"]) != 1:
        fail("wrapping lost the optimizer's state")
    steps = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(2):
            optimizer.zero_grad()
            loss_fn(model, *data(Dense, step, RANK)).backward()
            optimizer.step()
            scheduler.step()
    if steps != [1, 1] or abs(optimizer.param_groups[0]["lr"] - 0.0025) > 1e-12:
        fail(f"step hooks ran {len(steps)} times; lr {optimizer.param_groups[0]['lr']}")
    weights = hvd.allgather_object([p.detach().tolist() for p in model.parameters()])
    if any(w != weights[0] for w in weights):
        fail("weights differ between ranks after broadcast and two distributed steps")


def check_sync_batch_norm():
    """N ranks' SyncBatchNorm at batches of different sizes against BatchNorm at their union."""
    for shape, momentum in (((3, 4), 0.1), ((2, 4, 5), None), ((2, 4, 3, 3), 0.3)):
        rows = [shape[0] + r for r in range(SIZE)]  # uneven batches
        g = torch.Generator().manual_seed(7)
        # float64, so that the two ways of summing agree to 1e-10.
        every = [torch.randn(n, *shape[1:], generator=g, dtype=torch.float64) * 3 + 10
                 for n in rows]
        weight, bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
        sync = hvd.SyncBatchNorm(4, momentum=momentum).double()
        plain = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d,
                 4: torch.nn.BatchNorm2d}[len(shape)](4, momentum=momentum).double()
        for layer in (sync, plain):
            with torch.no_grad():
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
        mine = every[RANK].clone().requires_grad_()
        union = torch.cat(every).requires_grad_()
        scale = torch.arange(union[:1].numel(), dtype=torch.float64).view(union[:1].shape)
        for _ in range(2):
            out = sync(mine)
            (out * scale).sum().backward()
            expected = plain(union)
            (expected * scale).sum().backward()
        start = sum(rows[:RANK])
        what = f"SyncBatchNorm{tuple(shape)}"
        # Each rank's weight and bias gradients are its samples' share: they sum to BatchNorm's.
        pairs = ((out, expected[start:start + rows[RANK]], "output"),
                 (mine.grad, union.grad[start:start + rows[RANK]], "input gradient"),
                 (hvd.allreduce(sync.weight.grad, op=hvd.Sum), plain.weight.grad,
                  "weight gradient"),
                 (hvd.allreduce(sync.bias.grad, op=hvd.Sum), plain.bias.grad, "bias gradient"),
                 (sync.running_mean, plain.running_mean, "running mean"),
                 (sync.running_var, plain.running_var, "running variance"))
        for actual, wanted, label in pairs:
            if (actual - wanted).abs().max() > 1e-10 * max(1.0, wanted.abs().max().item()):
                fail(f"{what}: {label} differs by {(actual - wanted).abs().max().item():.3g} "
                     f"(of {wanted.abs().max().item():.3g})")
        sync.eval()
        plain.eval()
        if not torch.allclose(sync(every[RANK]), plain(every[RANK]), rtol=1e-10, atol=1e-10):
            fail(f"{what}: evaluation differs")


for section in (check_equivalence, check_synchronize_and_clipping, check_unused_parameter,
                check_rules, check_state_and_scheduler, check_sync_batch_norm):
    section()

hvd.shutdown()
if failures:
    print("\n".join(failures[:40]), file=sys.stderr)
    print(f"rank {RANK}: {len(failures)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {RANK}: torch training ok")
