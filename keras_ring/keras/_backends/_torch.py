"""The Keras layer's needs under `KERAS_BACKEND=torch` (see `keras_ring.keras._backends`).

Keras's torch trainer runs the train step eagerly: `loss.backward()`, then
the optimizer's `apply` on the gradients, torch tensors. The reductions are
`keras_ring.torch`'s operators, which run at once, so each group's name is
the same at every step (the engine's cache of agreed names keeps serving
it) and nothing waits for a trace.
"""

import contextlib

import keras
import torch

from keras_ring import torch as _krt


def check_step(api):
    del api  # nothing refuses an eager torch step


@contextlib.contextmanager
def group_names(scope):
    yield lambda key: f"{scope}/{key}"


def grouped_allreduce(tensors, op, compression, prescale_factor, postscale_factor, name,
                      process_set, device_dense, device_sparse):
    del device_dense, device_sparse  # one device: the CPU
    return _krt.grouped_allreduce(tensors, op=op, compression=compression,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set, api="DistributedOptimizer")


def sum_over_ranks(tensors, name):
    # Named, not numbered: ranks that run different numbers of steps (one
    # joined, with uneven data) keep agreeing on the names of the next ones.
    return _krt.grouped_allreduce(tensors, op=_krt.Sum, name=name)


def densify(grad):
    return grad


def divide(grad, n):
    return grad / n


def static_bytes(tensor):
    return tensor.numel() * tensor.element_size()


def when_ready(variables, fn):
    # Torch variables hold their values from the start, and the step is eager.
    del variables
    fn()
    return True


def at_first_update(variables, ready, fn, iterations):
    del ready, iterations  # eager: the first update is the one that calls this
    fn([keras.ops.convert_to_numpy(v) for v in variables])
    return True


def pass_accumulator(passes, average):
    return PassAccumulator(passes, average)


class PassAccumulator:
    """Sums gradients over `passes` backward passes, for `backward_passes_per_step`.

    The step is eager, so the sums are plain torch tensors and the pass
    count a Python integer: not optimizer state (they are zero after every
    update), so they stay out of `optimizer.variables` and saved models, as
    the TF backend's untracked sums do.
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self._count = 0
        self._sums = {}  # id of a variable -> (the variable, its sum)

    def build(self, optimizer, variables):
        del optimizer, variables  # the sums are made at the first pass, per gradient's dtype

    def saved_out(self):
        """The optimizer variables that saving leaves out: none, the sums are untracked."""
        return []

    def stateless_apply(self, *args):
        del args
        raise NotImplementedError(
            "keras-ring: with backward_passes_per_step > 1 under torch, the optimizer updates "
            "through apply() (model.fit's path); stateless_apply() is Keras's JAX path."
        )

    def add(self, grads, variables):
        """Adds this pass's gradients to the sums; returns the sums (or `None`)."""
        sums = []
        for g, v in zip(grads, variables):
            if g is None:
                sums.append(None)
                continue
            # Holds `v` too, so that its id cannot be reused.
            _, total = self._sums.setdefault(id(v), (v, torch.zeros_like(g)))
            total.add_(g)
            sums.append(total)
        return sums

    def branch(self, apply_fn, accumulate_fn):
        """Runs `apply_fn` at the last pass, else `accumulate_fn`.

        Every rank runs the same number of passes, so all take the same
        branch: the collective inside runs on all ranks or on none.
        """
        (apply_fn if self._count == self.passes - 1 else accumulate_fn)()

    def totals(self, sums):
        """The sums (divided by `passes` if averaging), read before they are zeroed."""
        totals = []
        for total in sums:
            if total is None:
                totals.append(None)
                continue
            totals.append(total / self.passes if self.average else total.clone())
            total.zero_()
        self._count = 0
        return totals

    def next_pass(self):
        self._count += 1

