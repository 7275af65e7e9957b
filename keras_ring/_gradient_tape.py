"""`DistributedGradientTape`: a `tf.GradientTape` whose gradients are reduced across ranks."""

import tensorflow as tf

from keras_ring._compression import Compression
from keras_ring._gradient_reducer import GradientReducer, check_no_strategy
from keras_ring._reduce_ops import Average


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
    ):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(
                "keras_ring.DistributedGradientTape wraps a tf.GradientTape. "
                f"Received: gradtape={gradtape!r}"
            )
        check_no_strategy("DistributedGradientTape")
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
        )

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

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name):
        # Only called for names this class lacks: the rest of the tape's API.
        return getattr(self._tape, name)
