"""The Keras layer's needs under `KERAS_BACKEND=jax` (see `keras_ring.keras._backends`).

Keras's JAX trainer runs the optimizer's `apply` inside `jax.jit`, through
`stateless_apply`: gradients are traced arrays and the variables stand for
the step's arrays. Reductions are `keras_ring.jax`'s custom calls.
"""

import contextlib
import itertools

import jax
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


def sum_over_ranks(tensors):
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
    raise NotImplementedError(
        "keras-ring: backward_passes_per_step > 1 is not available under KERAS_BACKEND=jax "
        "yet; use Keras's own gradient_accumulation_steps on the wrapped optimizer (the "
        "gradients are then reduced at every pass), or the TensorFlow backend. "
        f"Received: backward_passes_per_step={passes}"
    )


