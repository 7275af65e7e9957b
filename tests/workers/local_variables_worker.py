"""Local layers and variables across ranks, for tests/test_local_variables.py.

Run with 2 or 3 ranks, under the test launcher or plainly:
`mpiexec -n 3 python tests/workers/local_variables_worker.py`.

A model has a local layer (its gradients are never reduced) and a shared one.
Every rank trains on its rows of the global batches, with keras-ring; then it
simulates the whole job in plain Keras, one model and one optimizer per rank
in this one process (the shared gradients averaged over the simulated ranks,
the local ones each rank's own divided by the number of ranks, as Horovod
does), and compares its weights with its simulated rank's. The local layer's
weights must differ across ranks, the shared ones must not.

Cases: `PartialDistributedOptimizer` with `model.fit` (and
`BroadcastGlobalVariablesCallback(local_variables=...)` from the last rank),
`register_local_var` with Adam and `scale_local_gradients=False`,
`backward_passes_per_step=2`, a lazily built model, and custom loops with
`PartialDistributedGradientTape` and `register_local_source` whose local
Embedding has a different shape on each rank (sparse local gradients).

Wrong values are collected and reported at the end (exit 1); an unexpected
exception exits at once, and the launcher then stops the other ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
import time
import traceback

import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import keras_ring as kr  # noqa: E402

STEPS = 4
BATCH = 4  # rows per rank per backward pass
SEED = 1234
# Both sides compute the same per-rank gradients; only the order of the
# average's additions differs (see keras_equivalence_worker.py).
RTOL, ATOL = 1e-5, 1e-6

RANK = SIZE = None
failures = []


def build_model(kind, seed):
    """A model whose layer "local" is local; every weight drawn from `seed`.

    Kind "embedding" has a local Embedding of 20 + rank rows (a different
    shape on each rank, as in model parallelism); kind "lazy" is "dense"
    without an Input, built in the first train step.
    """
    keras.utils.set_random_seed(seed)
    if kind == "embedding":
        return keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(20 + seed - SEED, 4, name="local"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1, name="shared"),
            ]
        )
    layers = [
        keras.layers.Dense(8, activation="tanh", name="local"),
        keras.layers.Dense(2, name="shared"),
    ]
    return keras.Sequential(layers if kind == "lazy" else [keras.Input((6,)), *layers])


def global_data(kind, passes=1):
    rows = STEPS * passes * SIZE * BATCH
    rng = np.random.default_rng(SEED)
    if kind == "embedding":
        x = rng.integers(0, 20, size=(rows, 5)).astype("int32")
        return x, rng.uniform(3.0, 4.0, size=(rows, 1)).astype("float32")
    return rng.normal(size=(rows, 6)).astype("float32"), rng.normal(size=(rows, 2)).astype(
        "float32"
    )


def rows_of(rank, batch):
    """Rank `rank`'s rows of global batch `batch`."""
    start = batch * SIZE * BATCH + rank * BATCH
    return slice(start, start + BATCH)


def rank_rows(array):
    return np.concatenate([array[rows_of(RANK, b)] for b in range(len(array) // (SIZE * BATCH))])


def local_layer(model):
    return model.get_layer("local")


def shared_weights(model):
    local = {id(v) for v in local_layer(model).weights}
    return [v for v in model.weights if id(v) not in local]


def simulate(kind, make_optimizer, init_seed, shared_from, passes=1, average=False, scale=True):
    """The job in plain Keras: one model per rank, built from `init_seed(rank)`.

    The shared weights of every simulated rank start as those of rank
    `shared_from`'s model (a broadcast); returns the models after STEPS updates.
    """
    models = [build_model(kind, init_seed(r)) for r in range(SIZE)]
    x, y = global_data(kind, passes)
    for model in models:
        model(x[:1])
    for model in models:
        for v, root in zip(shared_weights(model), shared_weights(models[shared_from])):
            v.assign(root)
    optimizers = [make_optimizer() for _ in models]
    loss_fn = keras.losses.MeanSquaredError()
    for step in range(STEPS):
        per_rank = []
        for r, model in enumerate(models):
            total = None
            for p in range(passes):
                rows = rows_of(r, step * passes + p)
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[rows], model(x[rows], training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
            per_rank.append(total)
        for r, model in enumerate(models):
            local_ids = {id(v) for v in local_layer(model).trainable_weights}
            grads = []
            for i, v in enumerate(model.trainable_variables):
                if id(v) in local_ids:
                    grad = per_rank[r][i]
                    n = SIZE if scale else 1
                    if isinstance(grad, tf.IndexedSlices):
                        grad = tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
                    else:
                        grad = grad / n
                else:
                    grad = tf.add_n([g[i] for g in per_rank]) / SIZE
                grads.append(grad / passes if average else grad)
            optimizers[r].apply(grads, model.trainable_variables)
    return models


def check_against(what, model, simulated):
    for got, expected in zip(model.weights, simulated[RANK].weights):
        got, expected = got.numpy(), expected.numpy()
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=RTOL, atol=ATOL):
            error = np.max(np.abs(got - expected)) if got.shape == expected.shape else "shape"
            failures.append(f"rank {RANK}: {what}: {got.shape} weight differs by {error}")
    shared = np.concatenate([v.numpy().ravel() for v in shared_weights(model)])
    every = kr.allgather(tf.constant(shared[None, :])).numpy()
    if not (every == every[0]).all():
        failures.append(f"rank {RANK}: {what}: the shared weights differ across ranks")
    local = np.concatenate([v.numpy().ravel()[:20] for v in local_layer(model).weights])
    every = kr.allgather(tf.constant(local[None, :])).numpy()
    if any((every[r] == every[0]).all() for r in range(1, SIZE)):
        failures.append(f"rank {RANK}: {what}: a rank's local weights equal rank 0's")


def check_partial_optimizer():
    # Every rank's own initial weights; the shared ones broadcast from the last rank.
    root = SIZE - 1
    model = build_model("dense", SEED + RANK)
    local = local_layer(model).weights
    model.compile(
        optimizer=kr.PartialDistributedOptimizer(
            keras.optimizers.SGD(0.1), local_layers=[local_layer(model)]
        ),
        loss="mse",
        jit_compile=False,
    )
    x, y = (rank_rows(a) for a in global_data("dense"))
    callback = kr.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    simulated = simulate("dense", lambda: keras.optimizers.SGD(0.1), lambda r: SEED + r, root)
    check_against("PartialDistributedOptimizer SGD fit", model, simulated)


def check_register_local_var():
    # Adam, unscaled local gradients; shared weights equal from the start.
    model = build_model("dense", SEED)
    optimizer = kr.DistributedOptimizer(keras.optimizers.Adam(0.01), scale_local_gradients=False)
    for variable in local_layer(model).trainable_weights:
        optimizer.register_local_var(variable)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x, y = (rank_rows(a) for a in global_data("dense"))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    simulated = simulate(
        "dense", lambda: keras.optimizers.Adam(0.01), lambda r: SEED, 0, scale=False
    )
    check_against("register_local_var Adam scale_local_gradients=False fit", model, simulated)


def check_backward_passes():
    optimizer = kr.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    model = build_model("dense", SEED)
    optimizer.register_local_var(local_layer(model).kernel)
    optimizer.register_local_var(local_layer(model).bias)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x, y = (rank_rows(a) for a in global_data("dense", passes=2))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    simulated = simulate(
        "dense", lambda: keras.optimizers.SGD(0.1), lambda r: SEED, 0, passes=2, average=True
    )
    check_against("backward_passes_per_step=2 averaged", model, simulated)
    if int(optimizer.iterations.numpy()) != 2 * STEPS:
        failures.append(f"rank {RANK}: iterations {optimizer.iterations.numpy()}, not batches")


def check_lazy():
    # The local layer exists before it is built; the broadcast (through the
    # optimizer, in the first step) gives every rank rank 0's initial weights.
    model = build_model("lazy", SEED + RANK)
    optimizer = kr.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=local_layer(model)
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x, y = (rank_rows(a) for a in global_data("dense"))
    callback = kr.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    simulated = simulate("lazy", lambda: keras.optimizers.SGD(0.1), lambda r: SEED, 0)
    check_against("lazily built PartialDistributedOptimizer", model, simulated)


def tape_loop(model, optimizer, wrap):
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = wrap(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    x, y = (rank_rows(a) for a in global_data("embedding"))
    for i in range(STEPS):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])


def embedding_model_with_shared_weights_of_rank_0():
    model = build_model("embedding", SEED + RANK)
    kr.broadcast_variables(shared_weights(model), root_rank=0)
    return model


def check_tapes():
    for name, make in (("SGD", lambda: keras.optimizers.SGD(0.1)),
                       ("Adam", lambda: keras.optimizers.Adam(0.01))):
        simulated = simulate("embedding", make, lambda r: SEED + r, 0)
        model = embedding_model_with_shared_weights_of_rank_0()
        tape_loop(
            model,
            make(),
            lambda tape: kr.PartialDistributedGradientTape(
                tape, local_layers=[local_layer(model)]
            ),
        )
        check_against(f"PartialDistributedGradientTape {name}, per-rank Embedding", model,
                      simulated)

        model = embedding_model_with_shared_weights_of_rank_0()

        def registered(tape):
            tape = kr.DistributedGradientTape(tape, sparse_as_dense=True)
            tape.register_local_source(local_layer(model).embeddings)
            return tape

        tape_loop(model, make(), registered)
        check_against(f"register_local_source {name} sparse_as_dense, per-rank Embedding",
                      model, simulated)


CHECKS = [
    check_partial_optimizer,
    check_register_local_var,
    check_backward_passes,
    check_lazy,
    check_tapes,
]


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    start = time.time()
    try:
        for check in CHECKS:
            check()
    except Exception:  # noqa: BLE001 -- any failure must stop all ranks
        traceback.print_exc()
        print(f"local_variables_worker: rank {RANK} failed with an exception", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        print(f"local_variables_worker: rank {RANK}: {len(failures)} failures", file=sys.stderr)
        sys.exit(1)
    if RANK == 0:
        print(f"local_variables_worker: passed on {SIZE} ranks in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
