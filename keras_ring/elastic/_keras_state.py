"""KerasState: a Keras model's and optimizer's variables, kept across an elastic job's resets."""

import keras

from keras_ring.elastic._variables_state import VariablesState


class KerasState(VariablesState):
    """A Keras model's weights and its optimizer's variables, plus attributes such as the epoch.

    `save()` (and `commit()`) copies every model weight (trainable and not,
    such as batch-normalisation statistics) and every optimizer variable
    (`iterations`, the learning rate when it is a variable, the slots) into
    host memory as NumPy arrays, with the attributes; `restore()` assigns the
    copy back; `sync()` gives every rank rank 0's variables in one broadcast
    per dtype, then its saved attributes, and saves.

    An optimizer that is not built yet is built here
    (`optimizer.build(model.trainable_variables)`, as `fit` would), so that
    every rank, a newcomer that has not trained yet included, holds the same
    variables (horovod#2652: a newcomer's unbuilt optimizer hung the sync).
    The model must be built: give it a `keras.Input`, or call or build it,
    before making the state.

    Args:
        model: A built `keras.Model`.
        optimizer: Its optimizer; by default the one it was compiled with.
        **kwargs: Attributes, as for `ObjectState` (`epoch=0, batch=0` for
            `UpdateEpochStateCallback` and `UpdateBatchStateCallback`).

    Raises:
        TypeError: If `model` is not a Keras model or `optimizer` not a Keras
            optimizer.
        ValueError: If the model is not built, or has no optimizer and none
            is given; from `sync()`, on every rank, if the ranks' models or
            optimizers differ.

    Example:

    ```python
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    state = kr.elastic.KerasState(model, epoch=0, batch=0)
    ```
    """

    _DIFFER = ("models or optimizers", "Build the same model and optimizer")

    def __init__(self, model, optimizer=None, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None)
            if optimizer is None:
                raise ValueError(
                    "The model has no optimizer: compile it first, or pass `optimizer`. "
                    f"Received: model={model!r}, optimizer=None"
                )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`optimizer` must be a keras.optimizers.Optimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        if not model.built:
            raise ValueError(
                "The model must be built before its state is made, so that every rank (a "
                "newcomer too) holds the same variables: give it a keras.Input, or call it or "
                f"build() it first. Received: model={model!r} (not built)"
            )
        self.model = model
        self.optimizer = optimizer
        super().__init__(**kwargs)

    def on_reset(self):
        """Has the model trace its steps again for the new world, then calls the reset callbacks.

        Its train, test and predict functions are made again, since a step
        traced for the old world keeps what it read of it: traced in a job of
        size 1, a `DistributedOptimizer`'s step leaves the gradient allreduce
        out. `keras_ring.elastic.run` calls this after each reset, once the
        state is synced. A `tf.function` of your own that uses keras-ring
        needs the same: make it again in a reset callback.

        Example:

        ```python
        state.on_reset()  # the next fit traces its step for kr.size() ranks
        ```
        """
        if self.model.compiled:
            self.model.make_train_function(force=True)
            self.model.make_test_function(force=True)
            self.model.make_predict_function(force=True)
        super().on_reset()

    def _variables(self):
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        return list(self.model.weights) + list(self.optimizer.variables)


TensorFlowKerasState = KerasState
