"""`DistributedGradientTape`: a `tf.GradientTape` whose gradients are reduced across ranks.

`PartialDistributedGradientTape` makes one whose local layers' gradients are not.
"""

import tensorflow as tf

from keras_ring.core._compression import Compression
from keras_ring.core._reduce_ops import Average
from keras_ring.keras._backends import _tensorflow as _tf_backend
from keras_ring.keras._gradient_reducer import GradientReducer, local_layer_list


class DistributedGradientTape:
    """Wraps a `tf.GradientTape` so that `gradient()` returns gradients averaged over all ranks.

    For custom training loops: the gradients come back reduced, and a plain
    Keras optimizer applies them. Everything but `gradient()` is the wrapped
    tape's own (`watch`, `stop_recording`, `jacobian`, ...); the wrapper can
    also be used as the context manager in place of the tape.

    Args:
        gradtape: The `tf.GradientTape` to wrap.
        device_dense: Device on which to reduce dense gradients.
        device_sparse: Device on which to gather sparse gradients.
        compression: `keras_ring.Compression.none` (default), `.fp16` or
            `.bf16`: the type dense floating-point gradients travel as.
        sparse_as_dense: If `True`, sparse gradients (`tf.IndexedSlices`)
            are made dense and reduced; otherwise their rows are gathered.
        op: `keras_ring.Average` (default) or `keras_ring.Sum`.
        gradient_predivide_factor: With `op=Average`, gradients are divided
            by this factor before the sum and by `size / factor` after it.
        num_groups: Number of collectives over consecutive gradients; 0
            (default) means buckets of about `KERAS_RING_BUCKET_BYTES`.
        groups: Same as an integer `num_groups`, or a list of lists of
            sources whose gradients share a collective (other gradients
            get one each).
        process_set: The `keras_ring.ProcessSet` whose ranks average the
            gradients (default `None`: all ranks). Only its members may use
            the tape.
        scale_local_gradients: Whether the gradients of local sources (see
            `register_local_source`) are divided by the number of ranks
            (default `True`, as Horovod).

    Raises:
        TypeError: If `gradtape` is not a `tf.GradientTape`.
        ValueError: If an argument is invalid or a `tf.distribute` strategy
            is active.

    Example:

    ```python
    kr.init()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = kr.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss
    ```
    """

    def __init__(
        self,
        gradtape,
        device_dense="",
        device_sparse="",
        compression=Compression.none,
        sparse_as_dense=False,
        op=Average,
        gradient_predivide_factor=1.0,
        num_groups=0,
        groups=None,
        process_set=None,
        scale_local_gradients=True,
    ):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(
                "keras_ring.DistributedGradientTape wraps a tf.GradientTape. "
                f"Received: gradtape={gradtape!r}"
            )
        _tf_backend.check_no_strategy("DistributedGradientTape")
        self._tape = gradtape
        self._reducer = GradientReducer(
            name="DistributedGradientTape",
            api="DistributedGradientTape",
            device_dense=device_dense,
            device_sparse=device_sparse,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            groups=groups,
            num_groups=num_groups,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
            # A tf.GradientTape's gradients are TensorFlow's under any Keras backend.
            backend=_tf_backend,
        )

    def register_local_source(self, source):
        """Keeps the gradient of `source` on this rank: `gradient()` does not reduce it.

        The gradient is this rank's own, divided by the number of ranks
        unless the tape was made with `scale_local_gradients=False`. For
        model-parallel parts of a model, whose variables differ between ranks.
        Register sources before the first `gradient()` call of a
        `tf.function` trace: the trace keeps what it saw.

        Args:
            source: A variable (or watched tensor) passed in `sources`.
        """
        self._reducer.register_local_source(source)

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        """Computes the gradients of `target` and reduces them across ranks.

        Args:
            target: The tensor (or structure of tensors) to differentiate.
            sources: The variables or tensors (a structure of them) to
                differentiate with respect to; the same on every rank.
            output_gradients: As for `tf.GradientTape.gradient`.
            unconnected_gradients: As for `tf.GradientTape.gradient`.

        Returns:
            The reduced gradients, in the structure of `sources`.

        Raises:
            ValueError: Inside an XLA-compiled function or under a
                `tf.distribute` strategy.
        """
        grads = self._tape.gradient(
            target,
            sources,
            output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients,
        )
        reduced = self._reducer.reduce(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """Computes the gradients as `gradient()` does, split into local and reduced ones.

        Args:
            target: The tensor (or structure of tensors) to differentiate.
            sources: The variables or tensors (a structure of them) to
                differentiate with respect to.
            output_gradients: As for `tf.GradientTape.gradient`.

        Returns:
            Two lists of `(source, gradient)` pairs, in the order of the
            flattened `sources`: those of local sources, then the others.
        """
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local, shared = [], []
        for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if self._reducer.is_local(source) else shared).append((source, grad))
        return local, shared

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name):
        # Only called for names this class lacks: the rest of the tape's API.
        return getattr(self._tape, name)


def PartialDistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=None,
    local_layers=None,
    scale_local_gradients=True,
):
    """A `DistributedGradientTape` whose `local_layers` keep their gradients on each rank.

    The gradients of the local layers' trainable weights are not reduced:
    each rank gets its own, divided by the number of ranks unless
    `scale_local_gradients=False` (as Horovod). Use it for layers whose
    weights differ between ranks by design (model-parallel parts, per-rank
    heads). The layers' weights are read when gradients are computed, so
    layers not yet built count too. Other arguments are those of
    `DistributedGradientTape`.

    Args:
        gradtape: The `tf.GradientTape` to wrap.
        device_dense: As for `DistributedGradientTape`.
        device_sparse: As for `DistributedGradientTape`.
        compression: As for `DistributedGradientTape`.
        sparse_as_dense: As for `DistributedGradientTape`.
        op: As for `DistributedGradientTape`.
        gradient_predivide_factor: As for `DistributedGradientTape`.
        num_groups: As for `DistributedGradientTape`.
        groups: As for `DistributedGradientTape`.
        process_set: As for `DistributedGradientTape`.
        local_layers: A `keras.layers.Layer` or a list of them (default
            `None`: none, the tape is a plain `DistributedGradientTape`).
        scale_local_gradients: Whether local gradients are divided by the
            number of ranks.

    Returns:
        The `DistributedGradientTape`.

    Raises:
        TypeError: If `gradtape` is not a `tf.GradientTape`.
        ValueError: If an argument is invalid, `local_layers` included.

    Example:

    ```python
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = kr.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    ```
    """
    layers = local_layer_list(local_layers)
    tape = DistributedGradientTape(
        gradtape,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    tape._reducer.register_local_layers(layers)
    return tape
