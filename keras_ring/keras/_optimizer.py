"""`DistributedOptimizer`: any Keras optimizer, with its gradients reduced across ranks.

The optimizer's class is replaced by a subclass that puts
`_DistributedOptimizerMixin` in front of it (one subclass per optimizer
class, made once). `apply` reduces the gradients, then hands them to the
class's own `apply`, so Keras's loss-scale check, clipping, accumulation,
weight decay and update all see the global gradients. The subclass adds no
config keys and no Keras variables, and presents the original class to
Keras's serialisation: a saved model names its optimizer as the unwrapped
one would, and loads without keras-ring.
"""

import functools
import importlib
import numbers

import keras

from keras_ring.core._compression import Compression
from keras_ring.core._reduce_ops import Average
from keras_ring.keras import _backends, _divergence
from keras_ring.keras._gradient_reducer import GradientReducer, local_layer_list


class _Distribution:
    """What keras-ring keeps on a distributed optimizer (untracked by Keras)."""

    def __init__(self, reducer, accumulator):
        self.reducer = reducer
        self.accumulator = accumulator
        # The variables the optimizer was built with, for `apply(grads)`.
        self.variables = None
        # Functions to call once, eagerly, when the optimizer and the variables
        # it was built with are ready (see `_call_after_build`).
        self.after_build = []
        # Whether the ranks' weights were found the same before the first update.
        self.start_checked = False
        # Set while `stateless_apply` hands gradients it reduced to Keras's.
        self.reduced = False


class _DistributedOptimizerMixin:
    """Reduces gradients across ranks in `apply`, before the optimizer's own class sees them."""

    def register_local_var(self, var):
        """Keeps the gradient of `var` on this rank: it is applied without being reduced.

        The gradient is this rank's own, divided by the number of ranks
        unless the optimizer was made with `scale_local_gradients=False`
        (as Horovod). For model-parallel parts of a model, whose variables
        differ between ranks. Register variables before the first training
        step: a traced step keeps what it saw. `keras_ring.load_model` and
        saved models do not keep registrations: register again after
        loading.

        Args:
            var: A variable that the optimizer updates.
        """
        self._keras_ring.reducer.register_local_source(var)

    def build(self, variables):
        super().build(variables)
        state = self._keras_ring
        state.variables = list(variables)
        if state.accumulator is not None:
            state.accumulator.build(self, state.variables)
        self._call_after_build()

    def save_own_variables(self, store):
        """Saves the optimizer's variables as the plain optimizer has them: no pass sums."""
        for i, variable in enumerate(self._saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        saved = self._saved_variables()
        if len(store.keys()) != len(saved):
            return super().load_own_variables(store)  # Keras explains the mismatch
        for i, variable in enumerate(saved):
            variable.assign(store[str(i)])

    def _saved_variables(self):
        accumulator = self._keras_ring.accumulator
        left_out = {id(v) for v in accumulator.saved_out()} if accumulator else set()
        return [v for v in self.variables if id(v) not in left_out]

    def _call_after_build(self):
        """Runs the `after_build` calls, eagerly, once the variables hold their values.

        When that is depends on the backend (`_backends`' `when_ready`):
        under TF, a model built lazily gets its optimizer built while the
        first train step is traced, and its variables' values only after.
        """
        state = self._keras_ring
        if not state.after_build or not self.built:
            return

        def call_them():
            calls, state.after_build = state.after_build, []
            for call in calls:
                call()

        _backends.current().when_ready(state.variables + list(self.variables), call_them)

    def _check_same_start(self, variables):
        """Checks, once, that the ranks update the same weights (`_divergence.check_same_start`).

        In a traced step it runs eagerly while the step is traced, as
        `_call_after_build` does, once the variables hold their values and
        after the broadcast `BroadcastGlobalVariablesCallback` left to the
        optimizer's build (a model built lazily): then the update it checks
        is the first, or, where the optimizer is built by its first update
        outside a traced step, the second.
        """
        state = self._keras_ring
        process_set = state.reducer.process_set
        # A broadcast still to come (`call_after_build`) comes first.
        if (state.start_checked or state.after_build or variables is None
                or not process_set.included()):
            return
        local = state.reducer.local_ids()
        mine = [v for v in variables if id(v) not in local]
        ready = list(variables) + list(self.variables)
        if _backends.current().at_first_update(
                mine, ready, lambda values: _divergence.check_same_start(values, process_set),
                self.iterations):
            state.start_checked = True

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Keras's JAX trainer updates through here: the gradients are reduced first.

        Keras's own `stateless_apply` may look at the gradients before any
        `apply` (a `LossScaleOptimizer`'s checks that they are finite): they
        must be the reduced ones, so that every rank skips the same steps.
        The reduction (and the checks before it) reads the variables as the
        step's values, in a `keras.StatelessScope` of them. With
        `backward_passes_per_step` the accumulator decides when to reduce.
        """
        state = self._keras_ring
        values = list(zip(state.variables or (), trainable_variables))
        values += list(zip(self.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=values):
            self._call_after_build()
            self._check_same_start(state.variables)
        parent_stateless_apply = super().stateless_apply

        def reduce(grads):
            with keras.StatelessScope(state_mapping=values):
                return state.reducer.reduce(list(grads), state.variables)

        def apply_reduced(optimizer_variables, grads):
            state.reduced = True
            try:
                return parent_stateless_apply(optimizer_variables, grads, trainable_variables)
            finally:
                state.reduced = False

        if state.accumulator is None:
            return apply_reduced(optimizer_variables, reduce(grads))
        return state.accumulator.stateless_apply(
            self, optimizer_variables, list(grads), trainable_variables, state.variables,
            reduce, apply_reduced)

    def apply(self, grads, trainable_variables=None):
        state = self._keras_ring
        if state.reduced:
            return super().apply(grads, trainable_variables)
        self._call_after_build()
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = state.variables if trainable_variables is None else trainable_variables
        self._check_same_start(variables)
        if state.accumulator is None:
            return super().apply(state.reducer.reduce(grads, variables), trainable_variables)
        if variables is None:
            raise ValueError(
                "With backward_passes_per_step > 1, keras_ring.DistributedOptimizer needs the "
                "variables of the gradients: call apply(grads, trainable_variables) or "
                "apply_gradients(zip(grads, variables))."
            )
        if not self.built:
            # Before the branch below, which must not create variables.
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        sums = state.accumulator.add(grads, variables)
        parent_apply = super().apply

        def reduce_and_apply():
            totals = state.accumulator.totals(sums)
            parent_apply(state.reducer.reduce(totals, variables), trainable_variables)

        def accumulate_only():
            state.accumulator.next_pass()
            # `iterations` counts batches, as Horovod's does: the update
            # counts the last one.
            self.iterations.assign_add(1)

        state.accumulator.branch(reduce_and_apply, accumulate_only)


@functools.cache
def _distributed_class(base):
    """The subclass of `base` that distributed optimizers of class `base` get."""
    return type(
        f"Distributed{base.__name__}",
        (_DistributedOptimizerMixin, base),
        {
            "__module__": __name__,
            # Keras serialises objects under `obj.__class__`'s public or
            # registered name (keras.optimizers.Adam, "my_package>MyOptimizer"):
            # presenting the base class saves the optimizer exactly as the
            # unwrapped one. `type()` still gives this subclass, so method
            # lookup and isinstance are unaffected.
            "__class__": property(lambda self: base),
        },
    )


def is_distributed(optimizer):
    """Whether `optimizer` reduces its gradients across ranks (made by `DistributedOptimizer`)."""
    return isinstance(optimizer, _DistributedOptimizerMixin)


def local_variable_ids(optimizer):
    """The ids of the variables whose gradients `optimizer` leaves on each rank (none unless
    it is distributed: see `register_local_var` and `PartialDistributedOptimizer`)."""
    return optimizer._keras_ring.reducer.local_ids() if is_distributed(optimizer) else set()


def call_after_build(optimizer, fn):
    """Has a distributed optimizer call `fn()` eagerly once it is built, before it applies anything.

    Nothing happens if `optimizer` is not distributed or is built already.
    In a traced train step `fn` runs while TF traces the step, which every
    rank does at the same point.
    """
    if is_distributed(optimizer) and not optimizer.built:
        optimizer._keras_ring.after_build.append(fn)


def _check_optimizer(optimizer):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "keras_ring.DistributedOptimizer wraps a keras.optimizers.Optimizer. "
            f"Received: optimizer={optimizer!r}"
        )
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError(
            f"The optimizer is already distributed. Received: optimizer={optimizer.name!r}"
        )
    check_loss_scale_outside(optimizer)


def check_loss_scale_outside(optimizer):
    """Raises if a LossScaleOptimizer wraps a distributed optimizer (the order that hangs)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
        optimizer.inner_optimizer, _DistributedOptimizerMixin
    ):
        raise ValueError(
            "The LossScaleOptimizer wraps a distributed optimizer: the loss scale would then "
            "skip non-finite steps on one rank only, and the other ranks would wait for it "
            "forever. Wrap the other way round: "
            "keras_ring.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)). "
            f"Received: optimizer={optimizer.name!r}"
        )


def _distribute(optimizer, distribution):
    # Past Keras's and TF's attribute tracking, which have nothing to track here.
    object.__setattr__(optimizer, "__class__", _distributed_class(type(optimizer)))
    optimizer._keras_ring = distribution
    return optimizer


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    groups=None,
    num_groups=0,
    process_set=None,
    scale_local_gradients=True,
):
    """Makes a Keras optimizer average its gradients across all ranks before applying them.

    Works with any `keras.optimizers.Optimizer`: built-in ones, your
    subclasses, and `keras.optimizers.LossScaleOptimizer`. Gradients are
    reduced in `apply()` (which `model.fit` and `apply_gradients` call),
    before the optimizer clips, unscales, accumulates or applies them, in
    buckets of about `KERAS_RING_BUCKET_BYTES` (4 MiB) issued from the last
    layer backwards, so that communication overlaps the backward pass. The optimizer is changed in
    place, keeps its state, and gains no config keys and no variables: a
    model compiled with it saves and loads like one compiled with the plain
    optimizer (see `keras_ring.load_model` to load it distributed again).

    Mixed precision: the loss scale must judge the reduced gradients, or one
    rank would skip a step while the others wait for it. So pass a
    `LossScaleOptimizer` to wrap it from outside; and if the global dtype
    policy is `"mixed_float16"` when you call this, an optimizer that is not
    one is first wrapped in a `LossScaleOptimizer` (as `model.compile` would
    do, which then leaves it as is). If only the model's own policy is
    `"mixed_float16"` (`dtype=` of the model), pass
    `DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer))`
    yourself: `compile` would otherwise put its loss scale outside (and
    `BroadcastGlobalVariablesCallback` refuses to start training then). In a
    custom training loop, scale the loss with `optimizer.scale_loss(loss)`,
    as with any `LossScaleOptimizer`.

    Local accumulation: `backward_passes_per_step` sums gradients locally
    and reduces once per update. Keras's own `gradient_accumulation_steps`
    works too (not with `backward_passes_per_step`), but accumulates after
    the reduction, so it reduces every batch.

    Local variables: the gradients of variables registered with
    `optimizer.register_local_var(var)` (or of the layers passed to
    `PartialDistributedOptimizer`) are applied without being reduced.

    Args:
        optimizer: The `keras.optimizers.Optimizer` to distribute.
        name: Name scope for the collectives. Defaults to `"Distributed"`
            followed by the optimizer's class name.
        device_dense: Device on which to reduce dense gradients.
        device_sparse: Device on which to gather sparse gradients.
        compression: `keras_ring.Compression.none` (default), `.fp16` or
            `.bf16`: the type dense floating-point gradients travel as.
        sparse_as_dense: If `True`, sparse gradients (`tf.IndexedSlices`,
            e.g. from `Embedding`) are made dense and reduced; otherwise the
            rows of all ranks are gathered, which is cheaper when each rank
            touches few rows.
        gradient_predivide_factor: With `op=Average`, gradients are divided
            by this factor before the sum and by `size / factor` after it.
        op: `keras_ring.Average` (default) or `keras_ring.Sum`.
        backward_passes_per_step: Number of backward passes (batches) whose
            gradients are summed locally before one reduction and update.
            `optimizer.iterations` counts batches, as Horovod's does, so
            learning-rate schedules and optimizers that read it (Adam's bias
            correction) see batches.
        average_aggregated_gradients: With `backward_passes_per_step > 1`,
            divide the local sum by `backward_passes_per_step`.
        groups: `None` (buckets of about `KERAS_RING_BUCKET_BYTES`, or one
            collective per dtype if that is 0), a positive integer (that
            many collectives over consecutive gradients) or a list of lists
            of variables (the gradients of each list share a collective;
            other gradients get one each).
        num_groups: Same as an integer `groups` (Horovod's older name).
        process_set: The `keras_ring.ProcessSet` whose ranks average the
            gradients (default `None`: all ranks). Only its members may use
            the optimizer.
        scale_local_gradients: Whether the gradients of local variables
            (see `register_local_var`) are divided by the number of ranks
            (default `True`, as Horovod).

    Returns:
        The distributed optimizer: `optimizer` itself, or the
        `LossScaleOptimizer` around it under a `"mixed_float16"` policy.

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer.
        ValueError: If an argument is invalid, the optimizer is already
            distributed (or inside a `LossScaleOptimizer` that is), or a
            `tf.distribute` strategy is active. Later, when a training step
            is traced with XLA (`jit_compile=True`).

    Example:

    ```python
    kr.init()
    optimizer = kr.DistributedOptimizer(keras.optimizers.Adam(0.001 * kr.size()))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """
    _check_optimizer(optimizer)
    backend = _backends.current()
    backend.check_step("DistributedOptimizer")
    if (
        not isinstance(backward_passes_per_step, numbers.Integral)
        or isinstance(backward_passes_per_step, bool)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            "`backward_passes_per_step` must be a positive integer. "
            f"Received: backward_passes_per_step={backward_passes_per_step!r}"
        )
    if not isinstance(average_aggregated_gradients, bool):
        raise ValueError(
            "`average_aggregated_gradients` must be True or False. "
            f"Received: average_aggregated_gradients={average_aggregated_gradients!r}"
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if backward_passes_per_step > 1 and inner.gradient_accumulation_steps:
        raise ValueError(
            "Accumulate with keras_ring's `backward_passes_per_step` or with Keras's "
            "`gradient_accumulation_steps`, not both. Received: backward_passes_per_step="
            f"{backward_passes_per_step}, gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}"
        )
    reducer = GradientReducer(
        name=f"Distributed{type(optimizer).__name__}" if name is None else name,
        api="DistributedOptimizer",
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
    )
    accumulator = None
    if backward_passes_per_step > 1:
        accumulator = backend.pass_accumulator(int(backward_passes_per_step),
                                               average_aggregated_gradients)
    if keras.config.dtype_policy().name == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
    return _distribute(optimizer, _Distribution(reducer, accumulator))


def PartialDistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    groups=None,
    process_set=None,
    local_layers=None,
    scale_local_gradients=True,
):
    """A `DistributedOptimizer` that applies the gradients of `local_layers` unreduced.

    The gradients of the local layers' trainable weights stay on each rank,
    divided by the number of ranks unless `scale_local_gradients=False` (as
    Horovod); all others are reduced as by `DistributedOptimizer`. Use it for
    layers whose weights differ between ranks by design (model-parallel
    parts, per-rank heads); give `BroadcastGlobalVariablesCallback` their
    variables as `local_variables` to keep each rank's initial values. The
    layers' weights are read at each step, so layers not yet built count
    too. Other arguments are those of `DistributedOptimizer`.

    Args:
        optimizer: The `keras.optimizers.Optimizer` to distribute.
        name: As for `DistributedOptimizer`.
        device_dense: As for `DistributedOptimizer`.
        device_sparse: As for `DistributedOptimizer`.
        compression: As for `DistributedOptimizer`.
        sparse_as_dense: As for `DistributedOptimizer`.
        gradient_predivide_factor: As for `DistributedOptimizer`.
        op: As for `DistributedOptimizer`.
        backward_passes_per_step: As for `DistributedOptimizer`.
        average_aggregated_gradients: As for `DistributedOptimizer`.
        groups: As for `DistributedOptimizer`.
        process_set: As for `DistributedOptimizer`.
        local_layers: A `keras.layers.Layer` or a list of them (default
            `None`: none, the optimizer is a plain distributed one).
        scale_local_gradients: Whether local gradients are divided by the
            number of ranks.

    Returns:
        The distributed optimizer, as `DistributedOptimizer` returns it.

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer.
        ValueError: If an argument is invalid, `local_layers` included, or
            as `DistributedOptimizer` raises.

    Example:

    ```python
    kr.init()
    head = keras.layers.Dense(10)  # each rank trains its own
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64), head])
    optimizer = kr.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=[head])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    ```
    """
    layers = local_layer_list(local_layers)  # checked before the optimizer is changed
    distributed = DistributedOptimizer(
        optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    distributed._keras_ring.reducer.register_local_layers(layers)
    return distributed


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Loads a saved Keras model and makes its optimizer distributed.

    The model loads as with `keras.models.load_model`, optimizer state
    included; its optimizer is then distributed as by
    `DistributedOptimizer(optimizer, compression=compression)`.

    Args:
        filepath: Path of the `.keras` file.
        custom_optimizers: Optimizer classes the model may use that Keras
            cannot find by itself. Each is offered under its class name and
            under its registered name (`package>Name`, for a class registered
            with `keras.saving.register_keras_serializable`), the name Keras
            saved it under.
        custom_objects: Other custom objects, as for
            `keras.models.load_model`.
        compression: The compression of the distributed optimizer.

    Returns:
        The model, compiled with a distributed optimizer if it was saved
        compiled.

    Raises:
        ValueError: If `compression` is invalid or a `tf.distribute`
            strategy is active.

    Example:

    ```python
    kr.init()
    model = kr.load_model("model.keras")  # saved by rank 0 after epoch 3
    model.fit(x, y, epochs=10, initial_epoch=3)
    ```
    """
    _backends.current().check_step("load_model")
    # Registers keras-ring's own layers with Keras, which a saved model may name.
    importlib.import_module("keras_ring.keras._sync_batch_norm")
    # Keras saves a registered class under its registered name, `package>Name`.
    objects = {}
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
        objects[keras.saving.get_registered_name(cls)] = cls
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = model.optimizer
    if optimizer is not None:
        # The model's own compile already put a loss-scale wrapper where its
        # dtype policy needs one: distribute the outermost optimizer as is.
        _check_optimizer(optimizer)
        reducer = GradientReducer(
            name=f"Distributed{type(optimizer).__name__}",
            api="load_model",
            compression=compression,
        )
        _distribute(optimizer, _Distribution(reducer, accumulator=None))
    return model
