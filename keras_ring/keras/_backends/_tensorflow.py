"""The Keras layer's needs under `KERAS_BACKEND=tensorflow` (see `keras_ring.keras._backends`).

Keras's TensorFlow trainer traces the train step with `tf.function`; the
reductions are keras-ring's TF ops, named in name scopes that TF makes
unique per use inside a function.
"""

import contextlib

import keras
import tensorflow as tf

from keras_ring.core._reduce_ops import Sum
from keras_ring.tensorflow import _ops


def check_no_strategy(api):
    """Raises if a `tf.distribute` strategy is active.

    Args:
        api: The public name of the caller, for the message.

    Raises:
        ValueError: If a strategy other than the default one is active.
    """
    if tf.distribute.has_strategy():
        strategy = type(tf.distribute.get_strategy()).__name__
        raise ValueError(
            f"keras_ring.{api} cannot run under a tf.distribute strategy ({strategy} is "
            "active): keras-ring replaces tf.distribute for data-parallel training. Create and "
            "compile the model outside `strategy.scope()`, without a strategy, and start one "
            "process per device with `keras-ring-run -np N python train.py`."
        )


def check_not_xla(api):
    # The collectives are AsyncOpKernels with no XLA lowering: caught here,
    # while tracing, instead of as "No registered ... OpKernel for XLA" at
    # the first step. `get_enclosing_xla_context` is TF's exported hook for
    # libraries that must behave differently under XLA.
    if tf.__internal__.get_enclosing_xla_context() is not None:
        raise ValueError(
            f"keras_ring.{api} cannot reduce gradients in a function compiled with XLA: "
            "keras-ring's collectives have no XLA kernel yet. Compile the model with "
            "`model.compile(..., jit_compile=False)` (the default, jit_compile='auto', turns "
            "XLA on when a GPU is present), and decorate a custom training step with "
            "`tf.function(jit_compile=False)`."
        )


def check_step(api):
    """Refuses a step under a `tf.distribute` strategy or inside an XLA compilation."""
    check_no_strategy(api)
    check_not_xla(api)


@contextlib.contextmanager
def group_names(scope):
    with tf.name_scope(scope):
        yield lambda key: _ops._tensor_name(key, ignore_name_scope=False)


def grouped_allreduce(tensors, op, compression, prescale_factor, postscale_factor, name,
                      process_set, device_dense, device_sparse):
    return _ops._grouped_allreduce(tensors, op, compression, prescale_factor, postscale_factor,
                                   name, process_set, device_dense, device_sparse)


def sum_over_ranks(tensors, name):
    del name  # named by its place in the traced step, in TF's name scopes
    return _ops.grouped_allreduce(tensors, op=Sum)


def densify(grad):
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def divide(grad, n):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n


def static_bytes(tensor):
    """Bytes of a tensor's values as far as the graph knows (rows of IndexedSlices unknown: 0)."""
    values = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
    elements = values.shape.num_elements()
    return (elements or 0) * values.dtype.size


def _initialized(variables):
    """Whether the variables (Keras's, or TensorFlow's) hold their values. Eager only."""
    tf_variables = (v.value if isinstance(v, keras.Variable) else v for v in variables)
    return all(bool(v.is_initialized()) for v in tf_variables)


def when_ready(variables, fn):
    """Calls `fn()` eagerly once `variables` hold their values; returns whether it did.

    Keras builds the optimizer of a model built lazily while `tf.function`
    traces the first train step, after the forward pass has made the
    model's variables. Those, and the optimizer's own, hold their initial
    values only once TF has run their initializers, after that trace; TF
    then traces the step again and runs it. So `fn` runs in the second
    trace: after the variables have their values and before the step
    computes anything.
    """
    with tf.init_scope():
        if not _initialized(variables):
            return False
        fn()
        return True


def at_first_update(variables, ready, fn, iterations):
    """Calls `fn(values)` eagerly with the variables' values, once `ready` hold theirs.

    In a traced step it runs while TF traces the update (as `when_ready`).
    Returns whether it did.
    """
    del iterations  # TF runs `fn` before the step computes anything
    return when_ready(ready, lambda: fn([keras.ops.convert_to_numpy(v) for v in variables]))


def pass_accumulator(passes, average):
    return PassAccumulator(passes, average)


class PassAccumulator:
    """Sums gradients over `passes` backward passes, for `backward_passes_per_step`.

    Its TensorFlow variables are kept from Keras's tracking on purpose: they
    are not optimizer state (they are zero after every update), so they stay
    out of `optimizer.variables`, saved models and the variable count that
    checkpoints and state broadcasts rely on.
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self._count = None
        self._sums = {}

    def build(self, optimizer, variables):
        del optimizer, variables  # the sums are made at the first pass, per gradient's dtype

    def saved_out(self):
        """The optimizer variables that saving leaves out: none, the sums are untracked."""
        return []

    def stateless_apply(self, *args):
        del args
        raise NotImplementedError(
            "keras-ring: with backward_passes_per_step > 1 under TensorFlow, the optimizer "
            "updates through apply() (model.fit's path); stateless_apply() is Keras's JAX path."
        )

    def _variable(self, shape, dtype):
        # Lifted out of any function being traced, like Keras's own slots.
        with tf.init_scope():
            return tf.Variable(tf.zeros(shape, dtype), trainable=False)

    def add(self, grads, variables):
        """Adds this pass's gradients to the sums; returns the sum variables (or `None`)."""
        if self._count is None:
            self._count = self._variable([], tf.int64)
        sums = []
        for g, v in zip(grads, variables):
            if g is None:
                sums.append(None)
                continue
            if id(v) not in self._sums:
                # Holds `v` too, so that its id cannot be reused.
                self._sums[id(v)] = (v, self._variable(v.shape, g.dtype))
            total = self._sums[id(v)][1]
            if isinstance(g, tf.IndexedSlices):
                # Adds the rows in place: converting the slices to a dense
                # tensor needs a dense shape that is unknown while tracing.
                total.scatter_add(g)
            else:
                total.assign_add(g)
            sums.append(total)
        return sums

    def branch(self, apply_fn, accumulate_fn):
        """Runs `apply_fn` at the last pass, else `accumulate_fn`.

        Every rank runs the same number of passes, so all take the same
        branch: the collective inside runs on all ranks or on none.
        """
        tf.cond(tf.equal(self._count, self.passes - 1), apply_fn, accumulate_fn)

    def totals(self, sums):
        """Reads the sums (divided by `passes` if averaging) and zeroes them."""
        totals = []
        for total in sums:
            if total is None:
                totals.append(None)
                continue
            value = total.read_value()
            totals.append(value / self.passes if self.average else value)
            total.assign(tf.zeros_like(total))
        self._count.assign(0)
        return totals

    def next_pass(self):
        self._count.assign_add(1)


