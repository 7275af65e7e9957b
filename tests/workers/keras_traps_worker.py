"""What a new user of keras-ring runs into, for tests/test_keras_traps.py.

`keras-ring-run -np 3 python tests/workers/keras_traps_worker.py OUT_DIR SCENARIO...`.
The scenarios run one after another in one job, each with its own folder in
OUT_DIR: each does what a user would, and prints one line per rank,
`<scenario> rank <r>: ok` or `<scenario> rank <r>: FAILED: <why>`, that the
test reads.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys

import keras
import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras_ring as kr  # noqa: E402

SEED = 7


def compile_distributed(model, lr=0.05):
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    return model


def data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


def small_model(seed=None):
    keras.utils.set_random_seed(SEED + kr.rank() if seed is None else seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


# Uneven data: rank r has 17 - r batches of 8 rows, its own.
UNEVEN_EPOCHS, UNEVEN_BATCH, UNEVEN_LR = 2, 8, 0.02


def uneven_batches(rank):
    x, y = data((17 - rank) * UNEVEN_BATCH, seed=rank)
    return [(x[i : i + UNEVEN_BATCH], y[i : i + UNEVEN_BATCH])
            for i in range(0, len(x), UNEVEN_BATCH)]


def uneven_reference(optimizer):
    """The weights `fit` must reach: each step averages the gradients of the ranks that
    still have a batch, with zeros from the others (Average over all ranks), as `join` does."""
    model = small_model(seed=SEED)  # rank 0's weights, which the callback broadcasts
    shards = [uneven_batches(r) for r in range(kr.size())]
    loss = keras.losses.MeanSquaredError()
    for _ in range(UNEVEN_EPOCHS):
        for step in range(len(shards[0])):
            total = [tf.zeros_like(w) for w in model.trainable_weights]
            for shard in shards:
                if step < len(shard):
                    with tf.GradientTape() as tape:
                        value = loss(shard[step][1], model(shard[step][0]))
                    grads = tape.gradient(value, model.trainable_weights)
                    total = [t + g for t, g in zip(total, grads)]
            optimizer.apply_gradients(
                [(t / kr.size(), w) for t, w in zip(total, model.trainable_weights)])
    return [w.numpy() for w in model.trainable_weights]


def uneven(out_dir):
    """Ranks with different numbers of batches train together: the ones whose data runs out
    join until the others' steps are done, then every rank holds the same weights and
    optimizer state.

    Data of unknown length (a generator) with validation, and arrays of known but
    different lengths without: the ranks join at validation's start and at the epoch's end.
    """
    shard = uneven_batches(kr.rank())
    x = np.concatenate([b[0] for b in shard])
    y = np.concatenate([b[1] for b in shard])

    def rows():
        yield from zip(x, y)

    spec = (tf.TensorSpec((3,), tf.float32), tf.TensorSpec((1,), tf.float32))
    generated = tf.data.Dataset.from_generator(rows, output_signature=spec).batch(UNEVEN_BATCH)
    # Keras counts an extra iteration for the step that finds a dataset of unknown length
    # exhausted (with one rank too), which Adam's bias correction would see: SGD there.
    cases = (
        ("unknown length", lambda: keras.optimizers.SGD(UNEVEN_LR, momentum=0.9), (generated,),
         {"validation_data": (x[:16], y[:16])}),
        ("known lengths", lambda: keras.optimizers.Adam(UNEVEN_LR), (x, y),
         {"batch_size": UNEVEN_BATCH, "shuffle": False}),
    )
    problems = []
    for name, make_optimizer, fit_data, extra in cases:
        model = small_model()
        model.compile(optimizer=kr.DistributedOptimizer(make_optimizer()), loss="mse")
        history = model.fit(*fit_data, epochs=UNEVEN_EPOCHS, verbose=0, **extra,
                            callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                                       kr.callbacks.MetricAverageCallback()])
        state = [v.numpy() for v in model.trainable_weights + model.optimizer.variables]
        gathered = kr.allgather_object(state)
        if any(not all(np.array_equal(a, b) for a, b in zip(gathered[0], other))
               for other in gathered):
            problems.append(f"{name}: the ranks' weights or optimizer states differ")
        got = state[: len(model.trainable_weights)]
        expected = uneven_reference(make_optimizer())
        error = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
        if error > 1e-5:
            problems.append(f"{name}: weights {error:.3g} from the reference")
        if name == "known lengths" and model.optimizer.iterations.numpy() != UNEVEN_EPOCHS * 17:
            problems.append(f"{name}: {int(model.optimizer.iterations.numpy())} updates")
        if "validation_data" in extra and "val_loss" not in history.history:
            problems.append(f"{name}: no val_loss")
    return f"FAILED: {'; '.join(problems)}" if problems else "ok"


class RankMetric(keras.callbacks.Callback):
    """Logs a metric that improves on rank 0 and stays flat on the others: a rank's own view."""

    def on_epoch_end(self, epoch, logs=None):
        logs["rank_metric"] = 1.0 / (epoch + 1) if kr.rank() == 0 else 1.0


def plateau():
    return keras.callbacks.ReduceLROnPlateau(monitor="rank_metric", mode="min", factor=0.5,
                                             patience=0, min_delta=0.0, verbose=0)


def divergence(out_dir):
    """Ranks that silently diverge are reported; ranks that agree are not.

    Each case prints `case <name> begin` and `case <name> end` around its fit,
    so that the test finds which warnings each case logged (rank 0 logs them).
    """
    x, y = data(64, seed=kr.rank())  # each rank's own shard
    broadcast = kr.callbacks.BroadcastGlobalVariablesCallback
    average = kr.callbacks.MetricAverageCallback
    saved = os.path.join(out_dir, "saved.keras")
    if kr.rank() == 0:
        compile_distributed(small_model()).save(saved)
    kr.barrier()
    cases = {
        "agreeing": (lambda: compile_distributed(small_model()), [broadcast(0), average()]),
        "plateau_after_average": (lambda: compile_distributed(small_model()),
                                  [broadcast(0), RankMetric(), average(), plateau()]),
        "plateau_before_average": (lambda: compile_distributed(small_model()),
                                   [broadcast(0), RankMetric(), plateau(), average()]),
        "plain_optimizer": (keras_model_compiled_plain, [broadcast(0), average()]),
        "keras_load_model": (lambda: keras.models.load_model(saved), [broadcast(0), average()]),
    }
    rates = {}
    for name, (make, callbacks) in cases.items():
        print(f"case {name} begin", flush=True)
        model = make()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
        rates[name] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        kr.barrier()
        print(f"case {name} end", flush=True)
    # The plateau fired on the flat ranks only when they read their own metric.
    lr, halved = float(np.float32(0.05)), float(np.float32(0.025))
    if rates["plateau_before_average"] != (lr if kr.rank() == 0 else halved) or (
        rates["plateau_after_average"] != lr
    ):
        return f"FAILED: learning rates {rates}"
    problems = divergence_as_error(x, y, broadcast, average)
    return f"FAILED: {'; '.join(problems)}" if problems else "ok"


def lazy_model():
    keras.utils.set_random_seed(SEED + kr.rank())
    return keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def divergence_as_error(x, y, broadcast, average):
    """Ranks that start apart stop at the first update; KERAS_RING_DIVERGENCE changes which
    differences are errors. Returns what went wrong on this rank."""
    problems = []
    start = "the ranks would start training from different weights (ranks that agree: "
    cases = {
        # (make, callbacks, KERAS_RING_DIVERGENCE, the error's text, or None)
        "no_broadcast": (lambda: compile_distributed(small_model()), [], "",
                         f"keras-ring: {start}[0]; [1]; [2])"),
        "no_broadcast_lazy": (lambda: compile_distributed(lazy_model()), [average()], "",
                              f"keras-ring: {start}[0]; [1]; [2])"),
        "no_broadcast_warned": (lambda: compile_distributed(small_model()), [], "warn", None),
        "plateau_as_error": (lambda: compile_distributed(small_model()),
                             [broadcast(0), RankMetric(), plateau(), average()], "error",
                             "keras-ring: The ranks have diverged at the end of training: their "
                             "learning rates (rank 0: 0.05, rank 1: 0.025"),
    }
    for name, (make, callbacks, setting, error) in cases.items():
        print(f"case {name} begin", flush=True)
        os.environ["KERAS_RING_DIVERGENCE"] = setting
        model = make()
        before = [np.array(w) for w in model.get_weights()]
        try:
            model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
            raised = None
        except RuntimeError as e:
            raised = str(e)
        finally:
            del os.environ["KERAS_RING_DIVERGENCE"]
        if error is None and raised is not None:
            problems.append(f"{name}: raised {raised}")
        elif error is not None and (raised is None or error not in raised):
            problems.append(f"{name}: wanted an error with {error!r}, got {raised!r}")
        if name == "no_broadcast" and not all(
                np.array_equal(a, b) for a, b in zip(before, model.get_weights())):
            problems.append(f"{name}: the weights changed before the error")
        if error is not None and "BroadcastGlobalVariablesCallback(0)" not in (
                raised or "") and name != "plateau_as_error":
            problems.append(f"{name}: the error does not name the callback: {raised}")
        kr.barrier()
        print(f"case {name} end", flush=True)
    return problems


def keras_model_compiled_plain():
    model = small_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def evaluate_predict(out_dir):
    """Evaluation and prediction over every rank's shard give the whole data's results.

    10 rows of test data shard unevenly (4, 3, 3 rows on 3 ranks).
    `kr.evaluate`, and `fit`'s validation with MetricAverageCallback, must
    give the metrics of all 10 rows, ratios of sums (Precision, AUC)
    included; `unshard` must give every row's prediction in the data's order. The references are
    computed on each rank with plain Keras on all 10 rows.
    """
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1, activation="sigmoid")])
    metrics = ["accuracy", keras.metrics.Precision(name="precision"),
               keras.metrics.AUC(name="auc"), keras.metrics.RootMeanSquaredError(name="rmse")]
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="binary_crossentropy", metrics=metrics)
    x, _ = data(10, seed=1)
    y = (x[:, 0] > 0).astype("float32")[:, None]
    test = tf.data.Dataset.from_tensor_slices((x, y))
    shard = test.apply(kr.shard_dataset).batch(2)
    train_x, train_y = data(8 * kr.size(), seed=2)
    train_y = (train_y > 0).astype("float32")
    history = model.fit(train_x[kr.rank()::kr.size()], train_y[kr.rank()::kr.size()],
                        batch_size=4, epochs=2, verbose=0, validation_data=shard,
                        callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0),
                                   kr.callbacks.MetricAverageCallback()])
    reference = model.evaluate(test.batch(2), verbose=0, return_dict=True)
    problems = []
    for key, expected in reference.items():
        got = history.history[f"val_{key}"][-1]
        if not np.isclose(got, expected, rtol=1e-5, atol=1e-6):
            problems.append(f"fit's val_{key} {got} != {expected}")
    results = kr.evaluate(model, shard, verbose=0, return_dict=True)
    for key, expected in reference.items():
        if not np.isclose(results[key], expected, rtol=1e-5, atol=1e-6):
            problems.append(f"kr.evaluate's {key} {results[key]} != {expected}")
    as_list = kr.evaluate(model, shard, verbose=0)
    expected = model.evaluate(test.batch(2), verbose=0)
    if not np.allclose(as_list, expected, rtol=1e-5, atol=1e-6):
        problems.append(f"kr.evaluate's list {as_list} != {expected}")
    # MetricAverageCallback in evaluate: callbacks after it see all ranks' results.
    seen = {}
    keep = keras.callbacks.LambdaCallback(on_test_end=lambda logs: seen.update(logs))
    model.evaluate(shard, verbose=0, callbacks=[kr.callbacks.MetricAverageCallback(), keep])
    if not np.isclose(seen.get("auc", -1), reference["auc"], rtol=1e-5, atol=1e-6):
        problems.append(f"after MetricAverageCallback in evaluate: {seen}")
    predictions = kr.unshard(model.predict(test.apply(kr.shard_dataset).batch(3), verbose=0))
    if not np.allclose(predictions, model.predict(x, verbose=0), rtol=1e-6, atol=1e-7):
        problems.append(f"unshard gave {predictions.ravel()}")
    try:
        kr.unshard(np.zeros((2 if kr.rank() == 0 else 5, 1)))
        problems.append("unshard took rows that no shard_dataset shard gives")
    except ValueError as e:
        if "rank 0: 2, rank 1: 5" not in str(e):
            problems.append(f"unshard's error: {e}")
    return f"FAILED: {'; '.join(problems)}" if problems else "ok"


def keras_backup(out_dir):
    """Keras's own BackupAndRestore with one directory on every rank is refused at train begin,
    naming keras-ring's; with a directory per rank it trains, as keras-ring's does with one."""
    x, y = data(32, seed=kr.rank())
    shared = os.path.join(out_dir, "shared")
    problems = []
    cases = {
        "keras_shared": (keras.callbacks.BackupAndRestore(shared), True),
        "keras_per_rank": (keras.callbacks.BackupAndRestore(
            os.path.join(out_dir, f"rank{kr.rank()}")), False),
        "keras_ring_shared": (kr.callbacks.BackupAndRestore(shared), False),
    }
    for name, (backup, refused) in cases.items():
        model = compile_distributed(small_model())
        try:
            model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                      callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0), backup])
            error = None
        except ValueError as e:
            error = str(e)
        wanted = f"Use keras_ring.callbacks.BackupAndRestore({shared!r}) instead"
        if refused and (error is None or wanted not in error):
            problems.append(f"{name}: wanted the refusal, got {error!r}")
        elif not refused and error is not None:
            problems.append(f"{name}: raised {error}")
        kr.barrier()
    return f"FAILED: {'; '.join(problems)}" if problems else "ok"


SCENARIOS = {"uneven": uneven, "divergence": divergence,
             "evaluate_predict": evaluate_predict, "keras_backup": keras_backup}


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    kr.init()
    for scenario in scenarios:
        folder = os.path.join(out_dir, scenario)
        os.makedirs(folder, exist_ok=True)
        outcome = SCENARIOS[scenario](folder)
        print(f"{scenario} rank {kr.rank()}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
