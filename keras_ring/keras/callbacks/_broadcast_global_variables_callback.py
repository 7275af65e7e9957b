"""BroadcastGlobalVariablesCallback: one starting state for every rank."""

import sys

import keras

from keras_ring.core import _basics, _host_collectives
from keras_ring.keras import _optimizer
from keras_ring.keras.callbacks import _sync
from keras_ring.keras.callbacks._validation import check_integer


class BroadcastGlobalVariablesCallback(_sync.SyncedCallback):
    """Copies the model's and the optimizer's state from `root_rank` to every rank.

    Every rank receives the root's model weights (trainable and not, such as
    batch-normalisation statistics) and optimizer variables (iteration count,
    learning rate, slots) before the first step computes anything, so the
    first update starts from one state on every rank, whether the model was
    initialised at random or restored from a checkpoint on the root only:

    - A model that is built (it has an `Input`, or it was called or built
      before `fit`) is broadcast at the start of training (`on_train_begin`),
      after its optimizer has been built if Keras had not built it yet.
    - A model built lazily (`keras.Sequential` without `keras.Input`, a
      subclassed model never called) gets its variables only in the first
      train step, while Keras traces it. A `DistributedOptimizer` then
      broadcasts them as Keras builds it, in that trace, after the forward
      pass has made the model's variables and before the step runs, so even
      the first step's gradients are computed from the root's weights.
    - A lazily built model whose optimizer is not distributed is broadcast at
      the end of the first step, as Horovod does for every model: each rank's
      first step ran from its own initial weights.

    Random-number states (the seeds of `Dropout` and similar layers) are not
    broadcast: each rank keeps its own randomness. Nor are `local_variables`
    (and those given to `register_local_var`): model variables that each
    rank keeps, such as those of the local layers of a
    `PartialDistributedOptimizer`. The optimizer's variables are all
    broadcast, as Horovod does.

    It broadcasts at the start of every `fit` it is passed to, so weights
    loaded on the root between two `fit` calls reach every rank too.

    Every rank must pass this callback. Like the other keras-ring callbacks
    that communicate, it also checks at each step that all ranks are in step
    (see `keras_ring.callbacks`).

    Args:
        root_rank: The rank whose state every rank receives.
        device: Horovod's argument, kept for its scripts: the broadcast
            runs in host memory under every Keras backend.
        local_variables: A model variable (`keras.Variable` or
            `tf.Variable`) or a list of them, not broadcast: each rank keeps
            its own. They may differ between ranks in shape too.

    Raises:
        ValueError: If `root_rank` is not a non-negative integer or
            `local_variables` holds anything but variables; at the start
            of training, if it is not a rank of the job, if the ranks' models
            or optimizers differ (each rank's variables are named), or if a
            `LossScaleOptimizer` wraps the distributed optimizer (as `compile`
            does for a model built with `dtype="mixed_float16"` when the global
            policy is not mixed): one rank could then skip a step alone.

    Example:

    ```python
    kr.init()
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    model.fit(x, y, callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        check_integer("root_rank", root_rank, 0)
        self.root_rank = int(root_rank)
        self.device = device
        self._fit = None
        self._pending = False  # a lazily built model not yet broadcast in this `fit`
        # By id (Keras 3 variables are not hashable by value), kept alive so
        # that their ids are not reused.
        self._local_variables = {}
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        if not isinstance(local_variables, (list, tuple)) or not all(
            _is_variable(v) for v in local_variables
        ):
            raise ValueError(
                "`local_variables` must be a variable (keras.Variable or tf.Variable) or a list "
                f"of them. Received: local_variables={local_variables!r}"
            )
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var):
        """Leaves `var` out of the broadcast: each rank keeps its own value.

        Args:
            var: A variable of the model.
        """
        self._local_variables[id(var)] = var

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # A model whose own dtype policy is mixed_float16 gets its loss scale
        # wrapped around ours by compile(): refuse it here rather than hang.
        _optimizer.check_loss_scale_outside(self.model.optimizer)
        self._fit = self.params  # one dict per `fit`: a call left from an earlier one is stale
        self._pending = False
        if _basics.size() == 1:
            return
        if self.model.built:
            self._broadcast(_sync.TRAIN_BEGIN)
            return
        self._pending = True
        fit = self._fit

        def in_first_step():
            if self._pending and self._fit is fit:
                self._pending = False
                self._broadcast(_sync.BATCH_BEGIN)

        _optimizer.call_after_build(self.model.optimizer, in_first_step)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self._pending:  # the optimizer is not distributed: Horovod's order
            self._pending = False
            self._broadcast(_sync.BATCH_END)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._fit = None
        self._pending = False

    def _broadcast(self, point):
        variables = self._variables()
        self._check_same_variables(point, variables)
        _host_collectives.broadcast_variables(variables, self.root_rank,
                                              "keras_ring.broadcast_global_variables")

    def _variables(self):
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_weights)
        model = [v for v in self.model.weights if id(v) not in self._local_variables]
        return model + list(optimizer.variables)

    def _check_same_variables(self, point, variables):
        """Raises on every rank unless all ranks have variables of the same shapes and dtypes."""
        shapes = [f"{tuple(v.shape)} {v.dtype}" for v in variables]
        low, high = self.step_guard.exchange(
            point, _sync.VARIABLES, (len(variables), _sync.digest("\n".join(shapes)))
        )
        if (low == high).all():
            return
        described = [f"{v.path} {shape}" for v, shape in zip(variables, shapes)]
        ranks = [text.splitlines() for text in _sync.gather_text("\n".join(described))]
        counts = _sync.per_rank(len(r) for r in ranks)
        first = next(
            i
            for i in range(max(len(r) for r in ranks))
            if len({r[i].split(" ", 1)[1] if i < len(r) else None for r in ranks}) > 1
        )
        at_first = _sync.per_rank(r[first] if first < len(r) else "(none)" for r in ranks)
        raise ValueError(
            "keras-ring: BroadcastGlobalVariablesCallback: the ranks' models or optimizers "
            f"differ, so their state cannot be broadcast. Variables per rank: {counts}. "
            f"The first difference is variable {first}: {at_first}. Build the same model and "
            "the same optimizer on every rank."
        )


def _is_variable(value):
    tf = sys.modules.get("tensorflow")
    return isinstance(value, keras.Variable) or (tf is not None and isinstance(value, tf.Variable))
