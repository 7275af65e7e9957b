"""A worker of an elastic Keras job (`keras-ring-run --elastic`), as a user writes one.

It trains a linear model with SGD on synthetic data through `model.fit`, with
Horovod's elastic API (`KerasState`, `run`, the three callbacks), and writes
what the test checks to `KR_TEST_LOG/<worker>.jsonl`, one JSON object per line, each with its
`time` (seconds since the epoch) too:

    {"event": "step", "generation", "rank", "size", "epoch", "batch", "iterations", "loss"}
    {"event": "commit", "generation", "iterations", "epoch", "batch"}
    {"event": "reset", "generation", "rank", "size", "iterations", "epoch", "batch"}
    {"event": "end", "generation", "rank", "size", "iterations", "weights": [...]}

Hosts: with `KR_TEST_HOSTS_FILE` (what the test's discovery script prints)
and `KR_TEST_HOSTS_PHASES` ([["the file's text", size], ...]), rank 0 writes
the first phase's text once `optimizer.iterations` reaches
`KR_TEST_HOSTS_FROM`, and each next one once the world has the size the
previous phase asks for; meanwhile each of its steps lasts `KR_TEST_HOSTS_STEP_SECONDS` (0.5) more
(bounded), so that the driver and a newcomer have time to act.

Backup: with `KR_TEST_BACKUP_DIR`, the fit also has
`kr.callbacks.BackupAndRestore` there (a backup at each epoch's end).

Faults, by the rank a worker had in its first world ("start rank"):
    KR_TEST_FAULT="ITERATION:START_RANK:WHAT": that worker sends itself the
        signal WHAT (KILL, STOP), or raises an error (RAISE) that ends its
        script, once `optimizer.iterations` reaches ITERATION, in its first
        world only.
    KR_TEST_FAULT_IN_RESET="START_RANK": that worker SIGKILLs itself in its
        first reset callback (inside the recovery).
"""

import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

# Under the Keras backend KERAS_BACKEND names; the data is tf.data's under TensorFlow.
BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

import keras  # noqa: E402

import keras_ring as kr  # noqa: E402
from keras_ring.core import _elastic_world  # noqa: E402

EPOCHS = int(os.environ.get("KR_TEST_EPOCHS", "4"))
STEPS = int(os.environ.get("KR_TEST_STEPS", "8"))
BATCHES_PER_COMMIT = int(os.environ.get("KR_TEST_BATCHES_PER_COMMIT", "2"))
BATCH = 8
SLOW = float(os.environ.get("KR_TEST_STEP_SECONDS", "0"))  # per batch, so a test can act
HOSTS_FILE = os.environ.get("KR_TEST_HOSTS_FILE")
HOSTS_PHASES = json.loads(os.environ.get("KR_TEST_HOSTS_PHASES", "[]"))
HOSTS_FROM = int(os.environ.get("KR_TEST_HOSTS_FROM", "0"))
HOSTS_WAIT_SECONDS = 180
HOSTS_STEP_SECONDS = float(os.environ.get("KR_TEST_HOSTS_STEP_SECONDS", "0.5"))
BACKUP_DIR = os.environ.get("KR_TEST_BACKUP_DIR")

kr.init()
START_RANK = kr.rank()
WORKER = os.environ["KERAS_RING_WORKER"]
LOG = open(os.path.join(os.environ["KR_TEST_LOG"], WORKER.replace(":", "_") + ".jsonl"), "a",
           encoding="utf-8")


def log(event, **fields):
    fields.update(event=event, generation=_elastic_world.generation(), rank=kr.rank(),
                  size=kr.size(), time=time.time())
    LOG.write(json.dumps(fields) + "\n")
    LOG.flush()


rng = np.random.default_rng(7)
features = rng.normal(size=(1024, 4)).astype(np.float32)
targets = (features @ np.array([[1.5], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(
    np.float32)


def make_dataset():
    """Each rank's shard of the data, for the world it is in now: `fit`'s data arguments."""
    if BACKEND != "tensorflow":
        return dict(zip(("x", "y"), kr.shard_arrays(features, targets)), batch_size=BATCH)
    data = tf.data.Dataset.from_tensor_slices((features, targets))
    return {"x": kr.shard_dataset(data).repeat().batch(BATCH)}


keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
              loss="mse")
state = kr.elastic.KerasState(model, batch=0, epoch=0)

saved = state.save


def save():
    saved()
    log("commit", iterations=int(model.optimizer.iterations.numpy()), epoch=state.epoch,
        batch=state.batch)


state.save = save

resets = []


def on_reset():
    resets.append(1)
    if os.environ.get("KR_TEST_FAULT_IN_RESET") == str(START_RANK) and len(resets) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    log("reset", iterations=int(model.optimizer.iterations.numpy()), epoch=state.epoch,
        batch=state.batch)


state.register_reset_callbacks([on_reset])


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        fault = os.environ.get("KR_TEST_FAULT", "")
        self.fault = fault.split(":") if fault else None

    def on_train_batch_end(self, batch, logs=None):
        iterations = int(self.model.optimizer.iterations.numpy())
        log("step", epoch=state.epoch, batch=batch, iterations=iterations,
            loss=float(logs["loss"]))
        if self.fault and _elastic_world.generation() == 0:
            at, start_rank, name = self.fault
            if iterations == int(at) and START_RANK == int(start_rank):
                if name == "RAISE":
                    raise RuntimeError("the test's fault: an error in the training script")
                os.kill(os.getpid(), getattr(signal, "SIG" + name))
        if SLOW:
            time.sleep(SLOW)
        if kr.rank() == 0 and HOSTS_PHASES and iterations >= HOSTS_FROM:
            self.change_hosts()

    def change_hosts(self):
        """The next phase's hosts once the world has the size the last one asked for."""
        global hosts_phase, hosts_waited
        if hosts_phase < 0 or HOSTS_PHASES[hosts_phase][1] == kr.size():
            if hosts_phase + 1 == len(HOSTS_PHASES):
                return
            hosts_phase += 1
            with open(HOSTS_FILE + ".new", "w", encoding="utf-8") as f:
                f.write(HOSTS_PHASES[hosts_phase][0])
            os.replace(HOSTS_FILE + ".new", HOSTS_FILE)
        if hosts_waited < HOSTS_WAIT_SECONDS:
            time.sleep(HOSTS_STEP_SECONDS)
            hosts_waited += HOSTS_STEP_SECONDS


hosts_phase, hosts_waited = -1, 0.0


@kr.elastic.run
def train(state):
    model.fit(**make_dataset(), steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, verbose=1,
              callbacks=[kr.elastic.CommitStateCallback(state, BATCHES_PER_COMMIT),
                         kr.elastic.UpdateBatchStateCallback(state),
                         kr.elastic.UpdateEpochStateCallback(state), Record(),
                         *([kr.callbacks.BackupAndRestore(BACKUP_DIR)] if BACKUP_DIR else [])])


train(state)
log("end", iterations=int(model.optimizer.iterations.numpy()),
    weights=[w.tolist() for w in model.get_weights()])
print(f"worker {WORKER}: finished as rank {kr.rank()} of {kr.size()} on {keras.backend.backend()}",
      flush=True)
