"""The decisive test: N ranks at batch b train exactly as 1 rank at batch N*b.

Run with 2 or 3 ranks, under the test launcher or plainly, naming the suites
to run in one job: `mpiexec -n 3 python tests/workers/keras_equivalence_worker.py core lazy`.
It runs under the Keras backend that KERAS_BACKEND names (tensorflow, jax or torch).

Every rank builds the same model from the same seed and generates the same
global data; rank r trains on rows [r*b, (r+1)*b) of each global batch of
N*b rows. After STEPS steps rank 0 compares its weights with a single-rank
reference that it computes itself with plain Keras on the whole batches, and
every rank's weights must equal rank 0's bit for bit: so every rank matches
the reference, which is computed once per job rather than on every rank.

Suites:
    core: a dense model, one with an Embedding (under TF sparse gradients,
        and sparse_as_dense) and one with SyncBatchNormalization (against
        BatchNormalization at N*b), with SGD with momentum and Adam,
        through `model.fit` with `DistributedOptimizer` and through a custom
        loop (TF: `DistributedGradientTape`; JAX: a `jax.jit` step with
        `keras_ring.jax`; torch: `loss.backward()` and the distributed
        optimizer's `apply`), on ranks that start from different weights.
    options: backward_passes_per_step, compression, op=Sum,
        gradient_predivide_factor, groups, steps_per_execution, and
        mixed_float16 with one rank's gradients non-finite for a step.
    lazy: models built lazily (a Sequential without an Input, a subclassed
        model), initialised differently on each rank, with
        BroadcastGlobalVariablesCallback.

Wrong values are collected and reported at the end (exit 1); an unexpected
exception exits at once, and the launcher then stops the other ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
import time
import traceback

import numpy as np

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    import tensorflow as tf

    # Up to 3 ranks share 2 cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.get_logger().setLevel("ERROR")
elif BACKEND == "jax":
    import jax

    import keras_ring.jax as krj
else:
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import keras_ring as kr  # noqa: E402

STEPS = 5
BATCH = 4  # rows per rank per backward pass
SEED = 1234
# float32: both sides sum the same per-example gradients, in a different
# order (per-rank means, then their mean), so they differ by rounding, about
# 1e-7 relative per step. A real error (a rank's rows lost, a 1/N factor
# missing or doubled) moves weights by 1e-3 or more.
RTOL, ATOL = 1e-5, 1e-6
# Compressed gradients keep 11 (float16) or 8 (bfloat16) significant bits:
# relative errors of 5e-4 and 4e-3 per gradient, times lr, over STEPS steps.
FP16_TOL = 1e-3
BF16_TOL = 5e-3
# mixed_float16 computes activations and their gradients in float16 on
# batches of b rows on one side and N*b rows on the other.
MIXED_TOL = 1e-2
# Inputs that overflow float16, making one rank's gradients non-finite.
POISON_STEP, POISON_VALUE = 2, 1e5

RANK = SIZE = None
failures = []
# Keras's defaults: XLA under JAX; TF's collectives have no XLA kernel.
JIT = BACKEND == "jax"


class TwoDense(keras.Model):
    """A subclassed model: its variables exist only once it is called."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def build_model(kind, seed=SEED):
    """The same initial weights on every rank and in every run, for the same seed.

    Kinds "lazy" (a Sequential without an Input) and "subclassed" compute as
    "dense" but are built lazily, in the first train step.
    """
    keras.utils.set_random_seed(seed)
    if kind == "lazy":
        return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    if kind == "subclassed":
        return TwoDense()
    if kind == "dense":
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(2),
            ]
        )
    if kind in ("batchnorm", "syncbn"):
        # The reference normalises its whole batch; the ranks synchronise theirs.
        norm = kr.SyncBatchNormalization if kind == "syncbn" else keras.layers.BatchNormalization
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), norm(),
                                 keras.layers.Activation("tanh"), keras.layers.Dense(2)])
    # Few rows, so that ranks (and a batch) look up the same rows: their
    # sparse gradients then carry duplicate indices.
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )


def global_data(kind, passes=1):
    """The data of the whole job: STEPS * passes global batches of SIZE * BATCH rows."""
    rows = STEPS * passes * SIZE * BATCH
    rng = np.random.default_rng(SEED)
    if kind != "embedding":
        x = rng.normal(size=(rows, 6)).astype("float32")
        y = rng.normal(size=(rows, 2)).astype("float32")
    else:
        x = rng.integers(0, 20, size=(rows, 5)).astype("int32")
        # Targets far above every prediction: all examples push an embedding
        # row the same way, so no gradient entry nearly cancels to zero,
        # where Adam (which divides by |g|) would amplify rounding.
        y = rng.uniform(3.0, 4.0, size=(rows, 1)).astype("float32")
    return x, y


def rank_rows(array):
    """This rank's rows: [RANK*b, (RANK+1)*b) of each global batch of SIZE*b rows."""
    batches = array.reshape(-1, SIZE * BATCH, *array.shape[1:])
    return batches[:, RANK * BATCH : (RANK + 1) * BATCH].reshape(-1, *array.shape[1:])


def skip_passes(optimizer, passes):
    """Advances the step count by the passes that only accumulate.

    With backward_passes_per_step, `iterations` counts batches (as Horovod's),
    and Adam's bias correction reads it.
    """
    optimizer.iterations.assign_add(passes - 1)


def reference_fit(kind, optimizer, passes=1, data=None):
    """Plain Keras on one rank: `model.fit` at batch SIZE * BATCH * passes; on rank 0 only.

    Every rank builds the model, so that Keras's generated names, which name
    SyncBatchNormalization's collectives under TF, stay the same on every rank.
    """
    model = build_model(kind)
    if RANK != 0:
        return None
    model.compile(optimizer=optimizer, loss="mse", jit_compile=JIT)
    x, y = global_data(kind, passes) if data is None else data
    if passes > 1 and BACKEND == "jax":
        # Keras's JAX trainer holds the optimizer's variables while fit runs:
        # one train_on_batch per update lets the step count move between them.
        optimizer.build(model.trainable_variables)
        batch = SIZE * BATCH * passes
        for step in range(STEPS):
            skip_passes(optimizer, passes)
            model.train_on_batch(x[step * batch : (step + 1) * batch],
                                 y[step * batch : (step + 1) * batch])
        return model
    passed = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: skip_passes(optimizer, passes)
    )
    model.fit(x, y, batch_size=SIZE * BATCH * passes, shuffle=False, verbose=0,
              callbacks=[passed] if passes > 1 else [])
    return model


def reference_dense_gradients(kind, optimizer, passes=1):
    """Plain Keras on one rank, as `reference_fit`, with sparse gradients made dense.

    Keras's Adam squares each row of a tf.IndexedSlices before summing
    duplicate indices, so dense and sparse gradients give different Adam
    updates. Gradients are dense with sparse_as_dense, and once summed
    over backward passes: there the reference must make them dense too.
    On rank 0 only; built on every rank, as `reference_fit`'s.
    """
    model = build_model(kind)
    if RANK != 0:
        return None
    x, y = global_data(kind, passes)
    loss_fn = keras.losses.MeanSquaredError()
    batch = SIZE * BATCH * passes
    for step in range(STEPS):
        rows = slice(step * batch, (step + 1) * batch)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows], model(x[rows], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        skip_passes(optimizer, passes)
        optimizer.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return model


def distributed_fit(kind, optimizer, passes=1, data=None, seed=SEED, callbacks=(),
                    steps_per_execution=1, **options):
    """`model.fit` on this rank's rows with a DistributedOptimizer, at batch BATCH."""
    model = build_model(kind, seed)
    optimizer = kr.DistributedOptimizer(optimizer, backward_passes_per_step=passes, **options)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=JIT,
                  steps_per_execution=steps_per_execution)
    x, y = global_data(kind, passes) if data is None else data
    model.fit(rank_rows(x), rank_rows(y), batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def distributed_jax_loop(kind, optimizer, seed=SEED):
    """A `jax.jit` step of this rank's rows at batch BATCH: `keras_ring.jax` reduces the grads.

    The ranks start from different weights (`seed + RANK`); the step begins
    with rank 0's, given by `broadcast_parameters`.
    """
    model = build_model(kind, seed + RANK)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    state = krj.broadcast_parameters(
        ([v.value for v in model.trainable_variables],
         [v.value for v in model.non_trainable_variables],
         [v.value for v in optimizer.variables]), root_rank=0)

    @jax.jit
    def step(state, x, y):
        trainable, non_trainable, optimizer_variables = state

        def loss(trainable):
            predictions, updated = model.stateless_call(trainable, non_trainable, x,
                                                        training=True)
            return loss_fn(y, predictions), updated

        grads, non_trainable = jax.grad(loss, has_aux=True)(trainable)
        grads = krj.allreduce_gradients(grads)
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads,
                                                                   trainable)
        return trainable, non_trainable, optimizer_variables

    x, y = (rank_rows(a) for a in global_data(kind))
    for i in range(STEPS):
        state = step(state, x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    for variable, value in zip(model.trainable_variables, state[0]):
        variable.assign(value)
    return model


def distributed_torch_loop(kind, optimizer):
    """Keras's custom loop under torch, on this rank's rows at batch BATCH.

    `loss.backward()` and the distributed optimizer's `apply`, as in Keras's
    guide to writing a training loop in torch.
    """
    model = build_model(kind)
    optimizer = kr.DistributedOptimizer(optimizer)
    loss_fn = keras.losses.MeanSquaredError()
    x, y = (rank_rows(a) for a in global_data(kind))
    for i in range(STEPS):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        loss = loss_fn(torch.from_numpy(y[rows]), model(torch.from_numpy(x[rows]), training=True))
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_variables)
    return model


def distributed_tape(kind, optimizer, groups_of=None, **options):
    """A custom loop on this rank's rows with a DistributedGradientTape, at batch BATCH."""
    model = build_model(kind)
    if groups_of is not None:
        options["groups"] = groups_of(model)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = kr.DistributedGradientTape(tape, **options)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    x, y = (rank_rows(a) for a in global_data(kind))
    for i in range(STEPS):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
    return model


def check_weights(what, model, reference, rtol=RTOL, atol=ATOL):
    """Rank 0's weights against the reference (rank 0's), every rank's against rank 0's."""
    if RANK == 0:
        for k, (got, expected) in enumerate(zip(model.get_weights(), reference.get_weights())):
            if not np.allclose(got, expected, rtol=rtol, atol=atol):
                error = np.max(np.abs(got - expected))
                failures.append(
                    f"rank {RANK}: {what}: weight {k} differs from the single-rank reference "
                    f"by up to {error:.3g} (rtol={rtol}, atol={atol})"
                )
    check_same_on_all_ranks(what, model)


def check_same_on_all_ranks(what, model):
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = kr.allgather_object(flat)
    if not all(np.array_equal(g, gathered[0]) for g in gathered):
        failures.append(f"rank {RANK}: {what}: ranks hold different weights")


def sgd(lr=0.1):
    return keras.optimizers.SGD(lr, momentum=0.9)


def adam():
    return keras.optimizers.Adam(0.01)


def check_core():
    broadcast = [kr.callbacks.BroadcastGlobalVariablesCallback(0)]
    for kind in ("dense", "embedding"):
        for name, make in (("SGD", sgd), ("Adam", adam)):
            reference = reference_fit(kind, make())
            check_weights(f"{kind} {name} fit", distributed_fit(kind, make()), reference)
            different = distributed_fit(kind, make(), seed=SEED + RANK, callbacks=broadcast)
            check_weights(f"{kind} {name} fit from different weights", different, reference)
            if BACKEND == "jax":
                check_weights(f"{kind} {name} jax.jit loop", distributed_jax_loop(kind, make()),
                              reference)
            elif BACKEND == "torch":
                check_weights(f"{kind} {name} torch loop", distributed_torch_loop(kind, make()),
                              reference)
            else:
                check_weights(f"{kind} {name} tape", distributed_tape(kind, make()), reference)
    # Batch statistics over every rank's rows: SyncBatchNormalization against one rank's
    # BatchNormalization at N*b, moving statistics included.
    check_weights("SyncBatchNormalization SGD fit", distributed_fit("syncbn", sgd()),
                  reference_fit("batchnorm", sgd()))
    if BACKEND != "tensorflow":
        return  # JAX's and torch's gradients are dense: sparse_as_dense changes nothing
    for name, make in (("SGD", sgd), ("Adam", adam)):
        reference = reference_dense_gradients("embedding", make())
        for run, distributed in (("fit", distributed_fit), ("tape", distributed_tape)):
            check_weights(
                f"embedding {name} sparse_as_dense {run}",
                distributed("embedding", make(), sparse_as_dense=True),
                reference,
            )


def check_options():
    reference = reference_fit("dense", sgd())
    if BACKEND != "torch":  # Keras's torch trainer runs one step at a time
        check_weights("dense SGD steps_per_execution=2",
                      distributed_fit("dense", sgd(), steps_per_execution=2), reference)
    check_passes()
    check_weights(
        "dense SGD op=Sum", distributed_fit("dense", sgd(0.1 / SIZE), op=kr.Sum), reference
    )
    check_weights(
        "dense SGD gradient_predivide_factor",
        distributed_fit("dense", sgd(), gradient_predivide_factor=float(SIZE)),
        reference,
    )
    check_weights(
        "dense SGD num_groups=3", distributed_fit("dense", sgd(), num_groups=3), reference
    )
    if BACKEND == "tensorflow":
        check_weights(
            "dense SGD groups=[kernels] tape",
            distributed_tape("dense", sgd(), groups_of=lambda m: [m.trainable_variables[::2]]),
            reference,
        )
    fp16 = distributed_fit("dense", sgd(), compression=kr.Compression.fp16)
    check_weights("dense SGD fp16", fp16, reference, rtol=FP16_TOL, atol=FP16_TOL)
    bf16 = distributed_fit("dense", sgd(), compression=kr.Compression.bf16)
    check_weights("dense SGD bf16", bf16, reference, rtol=BF16_TOL, atol=BF16_TOL)
    if RANK == 0 and all(np.array_equal(a, b)
                         for a, b in zip(bf16.get_weights(), reference.get_weights())):
        failures.append(f"rank {RANK}: bf16: weights equal float32's exactly; not compressed?")

    check_mixed_precision("Adam, LossScaleOptimizer added", adam)
    check_mixed_precision(
        "SGD in an explicit LossScaleOptimizer",
        lambda: keras.optimizers.LossScaleOptimizer(sgd()),
    )


def check_passes():
    # Two passes per update, averaged: one update per 2*N*b rows. Summed
    # (Horovod's default), the gradient doubles: SGD at twice the rate.
    for kind, reference in (
        ("dense", reference_fit("dense", adam(), passes=2)),
        # TF's Embedding gradients are sparse, summed over the passes as dense ones.
        ("embedding", reference_dense_gradients("embedding", adam(), passes=2)
         if BACKEND == "tensorflow" else reference_fit("embedding", adam(), passes=2)),
    ):
        check_weights(
            f"{kind} Adam backward_passes_per_step=2 averaged",
            distributed_fit(kind, adam(), passes=2, average_aggregated_gradients=True),
            reference,
        )
    check_weights(
        "dense SGD backward_passes_per_step=2 summed",
        distributed_fit("dense", sgd(), passes=2),
        reference_fit("dense", sgd(0.2), passes=2),
    )


def check_mixed_precision(what, make):
    """Rank 1's inputs overflow float16 at one step: every rank must skip that step."""
    x, y = global_data("dense")
    start = POISON_STEP * SIZE * BATCH + BATCH  # rank 1's rows of that global batch
    x[start : start + BATCH] = POISON_VALUE
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = reference_fit("dense", make(), data=(x, y))
        model = distributed_fit("dense", make(), data=(x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    what = f"mixed_float16 {what}"
    if not (
        isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        and type(optimizer).__name__.startswith("Distributed")
        and not type(optimizer.inner_optimizer).__name__.startswith("Distributed")
    ):
        failures.append(f"rank {RANK}: {what}: the loss scale is not inside: {type(optimizer)}")
    sides = [("distributed", optimizer)] + ([("reference", reference.optimizer)] if RANK == 0
                                            else [])
    for side, opt in sides:
        updates, scale = int(opt.iterations.numpy()), float(opt.dynamic_scale.numpy())
        if updates != STEPS - 1 or scale != 2.0**15 / 2:
            failures.append(
                f"rank {RANK}: {what} ({side}): {updates} updates and loss scale {scale}; "
                f"expected {STEPS - 1} (one step skipped) and {2.0**15 / 2}"
            )
    check_weights(what, model, reference, rtol=MIXED_TOL, atol=MIXED_TOL)


def check_lazy():
    """Models built in the first train step, initialised differently on each rank.

    BroadcastGlobalVariablesCallback must give every rank rank 0's initial
    weights before the first step computes anything: then the job trains as
    one rank would from rank 0's weights.
    """
    for kind in ("lazy", "subclassed"):
        for name, make in (("SGD", sgd), ("Adam", adam)):
            model = distributed_fit(kind, make(), seed=SEED + RANK,
                                    callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
            check_weights(f"{kind} {name} fit", model, reference_fit(kind, make()))


SUITES = {"core": check_core, "options": check_options, "lazy": check_lazy}


def main():
    global RANK, SIZE
    suites = sys.argv[1:]
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    try:
        for suite in suites:
            start = time.time()
            SUITES[suite]()
            if RANK == 0 and not failures:
                print(f"keras_equivalence_worker: {suite} passed on {SIZE} ranks "
                      f"in {time.time() - start:.1f} s", flush=True)
    except Exception:  # noqa: BLE001 -- any failure must stop all ranks
        traceback.print_exc()
        print(f"keras_equivalence_worker: rank {RANK} failed with an exception", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        print(f"keras_equivalence_worker: rank {RANK}: {len(failures)} failures", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
