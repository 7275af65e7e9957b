"""SyncBatchNormalization: batch normalisation with statistics over every rank's batch."""

import inspect

import keras
from keras import ops

from keras_ring.core import _basics
from keras_ring.keras import _backends

_BatchNormalization = keras.layers.BatchNormalization


def _has_moments_hook():
    # Keras 3 BatchNormalization.call gets the training statistics from the
    # private method `_moments(inputs, mask)` (there is no public hook). It is
    # the smallest place to synchronise: everything around it (renorm, the
    # moving statistics, the float32 upcast, the normalisation) stays Keras's.
    hook = getattr(_BatchNormalization, "_moments", None)
    if not callable(hook):
        return False
    try:
        parameters = list(inspect.signature(hook).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[:3] == ["self", "inputs", "mask"]


def _local_moments(inputs, mask, axes):
    """This rank's per-channel count, mean and sum of squared deviations from it.

    As Keras's `_moments` reads them: the mask (one dimension less than the
    inputs) is broadcast over the last axis; masked-out values count for
    nothing. A batch of no rows gives count 0, mean 0 and sum 0.
    """
    if mask is None:
        weights = ops.ones_like(inputs)
    else:
        weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs))
        weights = ops.cast(ops.cast(weights, "bool"), inputs.dtype)
    count = ops.sum(weights, axis=axes)
    mean = ops.divide_no_nan(ops.sum(inputs * weights, axis=axes), count)
    # As tf.nn.moments: the mean's gradient through the deviations is 0.
    deviations = (inputs - ops.stop_gradient(_keep_dims(mean, inputs, axes))) * weights
    squares = ops.sum(ops.square(deviations), axis=axes)
    return count, mean, squares


def _keep_dims(channels, inputs, axes):
    """A per-channel vector shaped to broadcast against `inputs`."""
    rank = len(inputs.shape)
    shape = [1] * rank
    (channel_axis,) = sorted(set(range(rank)) - set(axes))
    shape[channel_axis] = -1
    return ops.reshape(channels, shape)


@keras.saving.register_keras_serializable(package="keras_ring")
class SyncBatchNormalization(_BatchNormalization):
    """Batch normalisation whose training statistics cover every rank's batch.

    `keras.layers.BatchNormalization` normalises, in training, by the mean
    and variance of its own batch; in data-parallel training that is one
    rank's `b` rows. This layer (Horovod's `hvd.SyncBatchNormalization`)
    computes them over the union of all ranks' batches, so that `N` ranks at
    batch `b` normalise, update the moving statistics and backpropagate
    exactly as one process at batch `N * b`. Ranks may hold different
    numbers of rows (the last, partial batch, or none): each rank's count
    and mean, then its squared deviations from the global mean, are summed
    over the ranks in two grouped allreduces per layer and step (Chan's
    parallel formula, as accurate as one pass over all the rows). Gradients flow back through
    the collective to every rank's inputs.

    Everything else is `BatchNormalization`'s: the arguments, the variables,
    inference (the moving statistics, no communication), masks, `renorm`,
    and mixed precision (float16 or bfloat16 inputs give float32
    statistics). With one rank, or before `keras_ring.init()`, the layer is
    exactly `BatchNormalization`.

    Every rank must call the layer in training the same number of times,
    in the same order (as every rank runs the same train steps); the
    collectives are matched by name: under TensorFlow their graph node's,
    which follows the layer's name, under JAX the order of tracing.

    `synchronized` is `BatchNormalization`'s switch for a `tf.distribute`
    strategy, which keras-ring replaces: this layer always synchronises
    over the ranks, so `synchronized=True` is refused rather than meaning
    a second, different synchronisation.

    The class is registered with Keras as
    `"keras_ring>SyncBatchNormalization"`: a saved model loads with
    `keras_ring.load_model`, or with `keras.models.load_model` once the class
    has been looked up in the process (any mention of
    `kr.SyncBatchNormalization`, or `import keras_ring` after `import keras`).
    For a process without keras-ring, save the copy that
    `SyncBatchNormalization.to_batch_normalization(model)` makes.

    Args:
        **kwargs: As for `keras.layers.BatchNormalization` (`axis`,
            `momentum`, `epsilon`, `center`, `scale`, the initializers,
            regularizers and constraints, `renorm`, `name`, `dtype`, ...).

    Raises:
        ValueError: If `synchronized=True`.
        RuntimeError: If this Keras's `BatchNormalization` has not the hook
            the layer relies on (its private `_moments(inputs, mask)`).

    Example:

    ```python
    kr.init()
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3),
        kr.SyncBatchNormalization(),  # statistics of all ranks' batches
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    ```
    """

    def __init__(self, *args, synchronized=False, **kwargs):
        if not _has_moments_hook():
            raise RuntimeError(
                "keras_ring.SyncBatchNormalization overrides the private method "
                "BatchNormalization._moments(inputs, mask) of Keras 3, which this Keras "
                f"({keras.__version__}) does not have. Use a Keras 3 release that has it, "
                "or keras.layers.BatchNormalization."
            )
        if synchronized:
            raise ValueError(
                "keras_ring.SyncBatchNormalization always computes its statistics over "
                "every keras-ring rank; `synchronized=True` is Keras's synchronisation "
                "within a tf.distribute strategy, which keras-ring replaces. Leave it out. "
                f"Received: synchronized={synchronized!r}"
            )
        super().__init__(*args, synchronized=False, **kwargs)
        self._moments_traced = False

    def call(self, inputs, training=None, mask=None):
        self._moments_traced = False
        outputs = super().call(inputs, training=training, mask=mask)
        if training and self.trainable and _synchronizing() and not self._moments_traced:
            # A Keras whose call no longer reads the statistics from
            # `_moments` would otherwise normalise by local ones, silently.
            raise RuntimeError(
                "keras_ring.SyncBatchNormalization: this Keras "
                f"({keras.__version__}) computed the batch statistics without calling "
                "BatchNormalization._moments, the hook this layer overrides; they would "
                "not be synchronised. Use keras.layers.BatchNormalization or another "
                "Keras release."
            )
        return outputs

    @staticmethod
    def to_batch_normalization(model):
        """A copy of `model` whose `SyncBatchNormalization` layers are Keras's `BatchNormalization`.

        For inference where keras-ring is not installed: a `.keras` file of
        the copy loads with plain Keras, whose loader knows no class it has
        not seen registered (a file of `model` itself names this layer, so it
        loads only where keras-ring is importable). The copy computes exactly
        what `model` does in inference (the same moving statistics and
        weights); in training it would normalise by each process's own batch.
        It is not compiled.

        Args:
            model: A built `keras.Sequential` or functional `keras.Model`
                (`keras.models.clone_model` copies those, nested models
                included; a subclassed model makes its layers in its own
                code: make them `BatchNormalization` there).

        Returns:
            The copy, holding a copy of `model`'s weights.

        Raises:
            ValueError: If `model` is not built, or cannot be cloned.

        Example:

        ```python
        if kr.rank() == 0:
            kr.SyncBatchNormalization.to_batch_normalization(model).save("serve.keras")
        ```
        """
        if not model.built:
            raise ValueError(
                "SyncBatchNormalization.to_batch_normalization needs a built model (one with a "
                "keras.Input, or called or fitted once): it copies the weights. "
                f"Received: an unbuilt model {model.name!r}"
            )

        def clone(layer):
            if isinstance(layer, SyncBatchNormalization):
                return _BatchNormalization.from_config(layer.get_config())
            return layer.__class__.from_config(layer.get_config())

        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
        copy.set_weights(model.get_weights())
        return copy

    def _moments(self, inputs, mask):
        # Overrides a private method of Keras's BatchNormalization (see
        # _has_moments_hook). `inputs` are already float32 (or float64).
        self._moments_traced = True
        if not _synchronizing():
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        count, mean, squares = _local_moments(inputs, mask, axes)
        # Sums over the ranks, to which a rank that joined adds zeros, and
        # whose shapes do not depend on how many ranks take part (a
        # compiled step's cannot): first the counts and weighted means of
        # each channel, then, from the global mean, the squared deviations.
        sum_over_ranks = _backends.current().sum_over_ranks
        total, weighted = sum_over_ranks([count, count * mean], f"{self.path}/moments")
        global_mean = ops.divide_no_nan(weighted, total)
        # Chan et al.: the squared deviations from the global mean are each
        # rank's own plus its count times its mean's squared distance to it.
        (squares,) = sum_over_ranks([squares + count * ops.square(mean - global_mean)],
                                    f"{self.path}/squares")
        if mask is None:
            return global_mean, ops.divide_no_nan(squares, total)
        # Keras divides masked sums by the weights plus its epsilon.
        divisor = total + keras.config.epsilon()
        return global_mean * (total / divisor), squares / divisor


def _synchronizing():
    return _basics.is_initialized() and _basics.size() > 1
