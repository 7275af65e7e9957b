"""Multi-rank checks of keras_ring.elastic's states, for tests/test_elastic_multirank.py.

Run with 2 or 3 ranks, under the test launcher or plainly:
`keras-ring-run -np 3 python tests/workers/elastic_state_worker.py SCENARIO...`.

No driver runs here: the job is not elastic. The host update the driver
would announce is stood in for by replacing `_elastic_world.hosts_updated`,
and `kr.elastic.run`'s re-init starts the engine again on the same world.
Failed checks are collected and reported at the end (exit 1); an unexpected
exception exits at once, and the launcher then stops the other ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
import time
import traceback

import keras
import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras_ring as kr  # noqa: E402
from keras_ring.core import _elastic_world  # noqa: E402

BATCH = 4
RANK = SIZE = None
failures = []


def check(condition, message):
    if not condition:
        failures.append(f"rank {RANK}: {message}")


def every_rank(value):
    """Every rank's picklable `value`, in rank order."""
    return kr.allgather_object(value)


def model_and_optimizer(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def values(model):
    return [keras.ops.convert_to_numpy(v).tolist()
            for v in model.weights + model.optimizer.variables]


def train(model, steps, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(steps * BATCH, 3)), rng.normal(size=(steps * BATCH, 1))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


def scenario_sync():
    """Every rank gets rank 0's committed weights, slots, iterations and attributes; the last
    rank, a newcomer that never trained, has its optimizer built by the state."""
    model = model_and_optimizer(seed=RANK)
    newcomer = RANK == SIZE - 1
    if not newcomer:
        train(model, steps=RANK + 1, seed=RANK)
    state = kr.elastic.KerasState(model, epoch=RANK, batch=10 * RANK, seen=[RANK])
    check(model.optimizer.built, "the state should build the optimizer")
    state.commit()  # every rank its own
    state.epoch, state.batch = 100 + RANK, 7  # not committed: sync takes rank 0's committed ones
    before = every_rank(values(model))
    check(before[0] != before[-1], "ranks should differ before the sync")
    state.sync()
    after = every_rank((values(model), state.epoch, state.batch, state.seen))
    for rank, (weights, epoch, batch, seen) in enumerate(after):
        check(weights == before[0], f"rank {rank}'s variables after sync are not rank 0's")
        check((epoch, batch, seen) == (0, 0, [0]),
              f"rank {rank}'s attributes after sync: {(epoch, batch, seen)}")
    check(int(model.optimizer.iterations.numpy()) == 1, "iterations should be rank 0's (1)")
    # What sync gave is the committed state now.
    train(model, steps=2, seed=50 + RANK)
    state.epoch = 9
    state.restore()
    check(values(model) == before[0] and state.epoch == 0, "restore after sync: not rank 0's")


def scenario_object_state():
    """ObjectState.sync gives every rank rank 0's saved values."""
    state = kr.elastic.ObjectState(epoch=RANK, history={"loss": [float(RANK)]})
    state.epoch = -1
    state.sync()
    got = every_rank((state.epoch, state.history))
    check(all(g == (0, {"loss": [0.0]}) for g in got), f"ObjectState after sync: {got}")


def scenario_tensorflow_state():
    """TensorFlowState.sync gives every rank rank 0's committed variables, of each dtype, and
    attributes; ranks whose variables differ get an error on every rank."""
    w = tf.Variable(np.full((2, 3), RANK, np.float32))
    steps = tf.Variable(10 * RANK, dtype=tf.int64)
    state = kr.elastic.TensorFlowState([w, steps], step=RANK)
    w.assign_add(tf.ones_like(w))  # not committed: sync takes rank 0's variables as they are
    state.sync()
    got = every_rank((w.numpy().tolist(), int(steps.numpy()), state.step))
    check(all(g == ([[1.0] * 3] * 2, 0, 0) for g in got), f"TensorFlowState after sync: {got}")
    w.assign(tf.zeros_like(w) - 5)
    state.restore()  # to what sync saved
    check(w.numpy().tolist() == [[1.0] * 3] * 2, f"restore after sync: {w.numpy()}")
    extra = [tf.Variable(0.0)] if RANK == 1 else []
    try:
        kr.elastic.TensorFlowState([w, *extra]).sync()
    except ValueError as e:
        check("TensorFlowState.sync: the ranks' variables differ" in str(e)
              and "rank 1: 2" in str(e), str(e))
    else:
        check(False, "sync of different variables did not raise")


def scenario_different_models():
    """Ranks whose models differ get an error on every rank, not a hang."""
    model = model_and_optimizer(seed=0)
    if RANK == 1:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    state = kr.elastic.KerasState(model)
    try:
        state.sync()
    except ValueError as e:
        check("models or optimizers differ" in str(e) and "rank 1: 8" in str(e), str(e))
    else:
        check(False, "sync of different models did not raise")


def announce_at(commit):
    """Stands in for the driver: rank 0 sees a host update at its `commit`-th check (from 1)."""
    asked = []

    def hosts_updated():
        check(RANK == 0, "only rank 0 should ask the driver")
        asked.append(1)
        return len(asked) == commit

    _elastic_world.hosts_updated = hosts_updated


def scenario_host_update():
    """Every rank raises HostsUpdatedInterrupt at the commit where rank 0 sees the update."""
    announce_at(3)
    state = kr.elastic.ObjectState(batch=0)
    raised_at = None
    for batch in range(1, 6):
        state.batch = batch
        try:
            state.commit()
        except kr.elastic.HostsUpdatedInterrupt:
            raised_at = batch
            break
    got = every_rank(raised_at)
    check(got == [3] * SIZE, f"HostsUpdatedInterrupt at commits {got}, not 3 on every rank")
    state.restore()
    check(state.batch == 3, "the interrupted commit should have saved")


def scenario_run_reset():
    """run() re-inits the engine on a host update, syncs, resets, calls again: in step."""
    announce_at(2)
    model = model_and_optimizer(seed=RANK)
    state = kr.elastic.KerasState(model, calls=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(kr.size())])

    @kr.elastic.run
    def fit(state):
        state.calls += 1
        callbacks = [kr.elastic.CommitStateCallback(state, batches_per_commit=2)]
        rng = np.random.default_rng(RANK)
        x, y = rng.normal(size=(4 * BATCH, 3)), rng.normal(size=(4 * BATCH, 1))
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        return state.calls

    calls = fit(state)
    check(calls == 2 and resets == [SIZE], f"calls {calls}, resets {resets}")
    # Interrupted at the first call's last commit (its epoch's end), not restored.
    check(int(model.optimizer.iterations.numpy()) == 8,
          f"iterations {int(model.optimizer.iterations.numpy())}")
    check(kr.size() == SIZE and kr.rank() == RANK, "the world should be the same")
    # The optimizer does not reduce gradients: the ranks share the start of each call only.
    first_layer = every_rank(values(model)[0])
    check(first_layer[0] != first_layer[-1], "ranks should have trained on their own data")


class BatchCount(keras.callbacks.Callback):
    """Counts the batches of each epoch."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches[-1] += 1


def scenario_resumed_epoch():
    """A resumed epoch ends early on every rank alike, with keras-ring's step guard and a
    DistributedOptimizer: no rank out of step, the same weights everywhere."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    state = kr.elastic.KerasState(model, epoch=1, batch=3)
    state.sync()
    rng = np.random.default_rng(RANK)
    x, y = rng.normal(size=(5 * BATCH, 3)), rng.normal(size=(5 * BATCH, 1))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().skip(state.batch)
    count = BatchCount()
    model.fit(data, steps_per_epoch=5, epochs=3 - state.epoch, verbose=0,
              validation_data=(x[:BATCH], y[:BATCH]),
              callbacks=[count, kr.callbacks.MetricAverageCallback(),
                         kr.elastic.UpdateBatchStateCallback(state),
                         kr.elastic.CommitStateCallback(state, batches_per_commit=2),
                         kr.elastic.UpdateEpochStateCallback(state)])
    check(count.batches == [2, 5], f"batches per epoch {count.batches}")
    check((state.epoch, state.batch) == (3, 0), f"state {(state.epoch, state.batch)}")
    got = every_rank(values(model))
    check(got == [got[0]] * SIZE, "the ranks' weights differ")


SCENARIOS = {
    "sync": scenario_sync,
    "object_state": scenario_object_state,
    "tensorflow_state": scenario_tensorflow_state,
    "different_models": scenario_different_models,
    "host_update": scenario_host_update,
    "run_reset": scenario_run_reset,
    "resumed_epoch": scenario_resumed_epoch,
}


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    for name in sys.argv[1:]:
        start = time.monotonic()
        try:
            SCENARIOS[name]()
        except Exception:
            traceback.print_exc()
            print(f"rank {RANK}: scenario {name} raised", flush=True)
            os._exit(1)
        if RANK == 0:
            print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)
    for failure in failures:
        print(failure, flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
