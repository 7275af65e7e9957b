"""What the Keras layer needs from each Keras backend, and nothing more.

The Keras layer (`DistributedOptimizer`, the callbacks, `kr.elastic`'s Keras
state) is written once, against `keras.ops` and the host collectives
(`keras_ring.core._host_collectives`). Inside a compiled train step it needs a
few things that differ per framework; each backend's module here provides
them, as Keras's own `keras/src/backend/<name>/` modules do for Keras:

- `check_step(api)`: refuses a step that cannot reduce gradients (TF: a
  `tf.distribute` strategy, XLA).
- `group_names(scope)`: a context manager giving a function from a group's
  key to a collective name, unique to this use and the same on every rank.
- `grouped_allreduce(tensors, op, compression, prescale_factor,
  postscale_factor, name, process_set, device_dense, device_sparse)`: one
  grouped allreduce inside the step.
- `sum_over_ranks(tensors, name)`: a grouped sum inside the step
  (`SyncBatchNormalization`'s statistics). `name` is the same at every
  step; a backend that traces the step may name the sum by its place in
  the trace instead.
- `densify(grad)`, `divide(grad, n)`, `static_bytes(tensor)`: gradients that
  may be sparse (TF's `IndexedSlices`).
- `when_ready(variables, fn)`: calls `fn()` eagerly once the variables hold
  their values, from inside a step being traced; returns whether it did.
- `at_first_update(variables, ready, fn, iterations)`: calls `fn` with the
  variables' values as NumPy arrays at the first update, from inside a step
  being traced; returns whether it will.
- `pass_accumulator(passes, average)`: the sums of `backward_passes_per_step`
  (`build`, `saved_out`, and `add`, `branch`, `totals`, `next_pass` for
  `apply`; JAX's `stateless_apply` for its trainer), and the branch between
  accumulating and applying.

Which module serves is `keras.backend.backend()`'s choice. `kr.init()`
agrees the backend between the ranks; one that differs from it later is
refused.
"""

import importlib

import keras

from keras_ring.core import _lifecycle

_MODULES = {
    "tensorflow": "keras_ring.keras._backends._tensorflow",
    "jax": "keras_ring.keras._backends._jax",
    "torch": "keras_ring.keras._backends._torch",
}


def current():
    """The module of the Keras backend in use.

    Raises:
        NotImplementedError: For a Keras backend keras-ring does not support.
        RuntimeError: If the Keras backend is not the one `kr.init()` agreed.
    """
    name = keras.backend.backend()
    agreed = _lifecycle.keras_backend_at_init
    if agreed is not None and agreed != name:
        raise RuntimeError(
            f"keras-ring: Keras runs on {name}, but its backend was {agreed} when "
            "keras_ring.init() agreed it with the other ranks: KERAS_BACKEND changed after "
            "kr.init(). Set it before kr.init() (and before importing Keras)."
        )
    if name not in _MODULES:
        raise NotImplementedError(
            f"keras-ring does not support the Keras backend {name!r} yet; it supports "
            f"{' and '.join(_MODULES)}. Received: KERAS_BACKEND={name}"
        )
    return importlib.import_module(_MODULES[name])
