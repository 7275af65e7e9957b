"""The Keras layer's needs under `KERAS_BACKEND=jax` (see `keras_ring.keras._backends`).

Keras's JAX trainer runs the optimizer's `apply` inside `jax.jit`, through
`stateless_apply`: gradients are traced arrays and the variables stand for
the step's arrays. Reductions are `keras_ring.jax`'s custom calls.
"""

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from keras_ring import jax as _krj

# Reductions traced in this process: the same sequence on every rank that
# traces the same steps.
_uses = itertools.count()


def check_step(api):
    del api  # nothing refuses a JAX step


@contextlib.contextmanager
def group_names(scope):
    prefix = f"{scope}.{next(_uses)}"
    yield lambda key: f"{prefix}/{key}"


def grouped_allreduce(tensors, op, compression, prescale_factor, postscale_factor, name,
                      process_set, device_dense, device_sparse):
    del device_dense, device_sparse  # one device: the CPU
    return _krj.grouped_allreduce(tensors, op=op, compression=compression,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set)


def sum_over_ranks(tensors, name):
    del name  # named by its place in the traced step
    return _krj.grouped_allreduce(tensors, op=_krj.Sum)


def densify(grad):
    return grad


def divide(grad, n):
    return grad / n


def static_bytes(tensor):
    return int(np.prod(tensor.shape)) * np.dtype(tensor.dtype).itemsize


def when_ready(variables, fn):
    # JAX variables hold their values from the start.
    del variables
    fn()
    return True


def at_first_update(variables, ready, fn, iterations):
    """Calls `fn(values)` with the variables' values as the first update runs.

    The step is traced with abstract arrays (Keras's trainer even empties the
    variables while it runs), so the values reach `fn` through a host
    callback that only the update with `iterations == 0` takes.
    """
    del ready  # JAX variables hold their values from the start

    def on_host(*arrays):
        fn([np.asarray(a) for a in arrays])

    jax.lax.cond(iterations.value == 0,
                 lambda values: jax.debug.callback(on_host, *values),
                 lambda values: None,
                 [v.value for v in variables])
    return True


def pass_accumulator(passes, average):
    return PassAccumulator(passes, average)


class PassAccumulator:
    """Sums gradients over `passes` backward passes, for `backward_passes_per_step`.

    Keras's JAX trainer threads the optimizer's variables through its jitted
    step as arrays, so the sums and the pass count are optimizer variables:
    the trainer carries them from step to step. They are zero after every
    update and stay out of saved models (`saved_out`), as the TF backend's
    untracked sums do.
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self._count = None
        self._sums = {}  # id of a trainable variable -> its sum

    def build(self, optimizer, variables):
        """Adds the count and a sum per trainable variable to `optimizer`'s variables."""
        self._count = optimizer.add_variable((), dtype="int32", name="keras_ring_passes")
        for v in variables:
            self._sums[id(v)] = optimizer.add_variable_from_reference(v, "keras_ring_pass_sum")

    def saved_out(self):
        """The optimizer variables that saving leaves out."""
        return [self._count, *self._sums.values()]

    def stateless_apply(self, optimizer, optimizer_variables, grads, trainable_variables,
                        variables, reduce, apply):
        """One pass of Keras's JAX step: accumulates, and updates at the last pass.

        `reduce(grads)` runs under a `lax.cond` that only the last pass
        takes, so the collectives run once per update, on every rank alike
        (every rank runs the same passes). The update itself is computed at
        every pass and kept at the last, as Keras's own JAX gradient
        accumulation does. `iterations` counts passes, as Horovod's does.

        Args:
            optimizer: The distributed optimizer.
            optimizer_variables: The values of `optimizer.variables`.
            grads: This pass's gradients, of `variables`.
            trainable_variables: The values of `variables`.
            variables: The trainable variables the optimizer was built with.
            reduce: Reduces a list of gradients across ranks.
            apply: `apply(optimizer_variables, grads)`: the optimizer's own
                `stateless_apply` of reduced gradients.

        Returns:
            The new values of the trainable and optimizer variables.
        """
        position = {id(v): i for i, v in enumerate(optimizer.variables)}
        values = list(optimizer_variables)
        count = values[position[id(self._count)]]
        last = count == self.passes - 1
        sums = [values[position[id(self._sums[id(v)])]] + g
                for v, g in zip(variables, grads)]
        totals = [s / self.passes for s in sums] if self.average else sums
        grads = jax.lax.cond(last, reduce, list, totals)
        for v, total in zip(variables, sums):
            values[position[id(self._sums[id(v)])]] = jnp.where(last, jnp.zeros_like(total), total)
        values[position[id(self._count)]] = jnp.where(last, 0, count + 1).astype(count.dtype)
        updated = apply(values, grads)
        iterations = position[id(optimizer.iterations)]
        values[iterations] = values[iterations] + 1
        kept = (list(trainable_variables), values)
        return jax.tree.map(lambda new, old: jnp.where(last, new, old), updated, kept)

    # Outside a traced step (`optimizer.apply` called eagerly), as the TF backend's:

    def add(self, grads, variables):
        """Adds this pass's gradients to the sums; returns the sum variables."""
        sums = []
        for g, v in zip(grads, variables):
            total = self._sums[id(v)]
            total.assign(total + g)
            sums.append(total)
        return sums

    def branch(self, apply_fn, accumulate_fn):
        """Runs `apply_fn` at the last pass, else `accumulate_fn` (eagerly only)."""
        try:
            last = int(self._count.value) == self.passes - 1
        except jax.errors.ConcretizationTypeError:
            raise NotImplementedError(
                "keras-ring: with backward_passes_per_step > 1 under JAX, an optimizer.apply() "
                "inside jax.jit cannot choose between accumulating and updating; update through "
                "stateless_apply() as Keras's trainer does (model.fit), or call apply() eagerly."
            ) from None
        (apply_fn if last else accumulate_fn)()

    def totals(self, sums):
        """Reads the sums (divided by `passes` if averaging) and zeroes them."""
        totals = []
        for total in sums:
            value = total.value
            totals.append(value / self.passes if self.average else value)
            total.assign(jnp.zeros_like(value))
        self._count.assign(0)
        return totals

    def next_pass(self):
        self._count.assign(self._count.value + 1)
