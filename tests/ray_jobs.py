"""The functions the Ray tests run on Ray's workers, shared by tests/test_ray.py (a local
cluster) and tests/workers/ray_netns_driver.py (a cluster of network-namespace hosts).

Ray's workers cannot import this module: callers send it by value
(`ray.cloudpickle.register_pickle_by_value(ray_jobs)`), as Ray sends a script's own functions.
"""

import os
import pathlib
import runpy
import socket
import tempfile
import time

import numpy as np

ELASTIC_WORKER = pathlib.Path(__file__).parent / "workers" / "elastic_train_worker.py"


def _keras(backend):
    """Keras under `backend`, with one intra-op thread, in a worker that has not imported it."""
    os.environ["KERAS_BACKEND"] = backend
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    elif backend == "torch":
        import torch

        torch.set_num_threads(1)
    import keras

    assert keras.backend.backend() == backend, (keras.backend.backend(), backend)
    return keras


def ranks():
    """keras-ring's rank, size, local rank and local size in this worker, and its host name,
    also printed."""
    import keras_ring as kr

    kr.init()
    print(f"rank {kr.rank()} of {kr.size()} on {socket.gethostname()}", flush=True)
    return kr.rank(), kr.size(), kr.local_rank(), kr.local_size(), socket.gethostname()


def _model(keras, seed):
    import keras_ring as kr

    keras.utils.set_random_seed(seed + kr.rank())  # each rank starts from its own weights
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(seed, backend="torch"):
    """Two epochs of `model.fit` on this rank's data, from this rank's own starting weights;
    returns (the starting weights, the final ones)."""
    keras = _keras(backend)
    import keras_ring as kr

    kr.init()
    x = np.random.default_rng(kr.rank()).normal(size=(64, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    model = _model(keras, seed)
    start = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
    return start, model.get_weights()


def trainer_loop(config):
    """Ray Train's loop: this worker's shard of the Ray Dataset, an epoch at a time, each
    reported with a checkpoint. Its config: seed, epochs, backend, starts (a file each worker
    writes its rank and first epoch to), die_at (in the first group, rank 1's process dies
    before this epoch; None: never)."""
    keras = _keras(config["backend"])
    import ray.train

    import keras_ring as kr

    kr.init()
    context = ray.train.get_context()
    where = {"rank": kr.rank(), "size": kr.size(), "local": (kr.local_rank(), kr.local_size()),
             "ray": (context.get_world_rank(), context.get_world_size(),
                     context.get_local_rank(), context.get_local_world_size()),
             "host": socket.gethostname()}
    shard = ray.train.get_dataset_shard("train")
    rows = list(shard.iter_batches(batch_size=None, batch_format="numpy"))
    x = np.concatenate([r["x"] for r in rows]).astype("float32")
    y = np.concatenate([r["y"] for r in rows]).astype("int32")
    model = _model(keras, config["seed"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            model.load_weights(os.path.join(directory, "model.weights.h5"))
            start = int(pathlib.Path(directory, "epoch").read_text()) + 1
    with open(config["starts"], "a") as f:
        f.write(f"{kr.rank()} {start}\n")
    for epoch in range(start, config["epochs"]):
        if start == 0 and epoch == config["die_at"] and kr.rank() == 1:
            # Once Ray Train's controller, which polls every 2 s, has taken the reports: a
            # poll that finds a worker dead drops those it brings.
            time.sleep(5)
            os._exit(1)  # its process dies, as one SIGKILLed
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                            callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(0)])
        flat = np.concatenate([w.ravel() for w in model.get_weights()])
        everyone = kr.allgather_object({**where, "rows": len(x), "weights": flat})
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if kr.rank() == 0:
                model.save_weights(os.path.join(directory, "model.weights.h5"))
                pathlib.Path(directory, "epoch").write_text(str(epoch))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(
                {"epoch": epoch, "loss": history.history["loss"][-1],
                 "ranks": [{k: v for k, v in e.items() if k != "weights"} for e in everyone],
                 "identical": all(np.array_equal(e["weights"], flat) for e in everyone)},
                checkpoint=checkpoint)


def elastic_env():
    """What the elastic script's workers take from the driver's environment: the test's
    settings (KR_TEST_*), keras-ring's and Keras's, and the thread counts."""
    return {k: v for k, v in os.environ.items() if k.startswith(("KR_TEST", "KERAS"))
            or k in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")}


def train_script():
    """tests/workers/elastic_train_worker.py, the elastic jobs' script, as the function;
    returns this worker's name."""
    runpy.run_path(str(ELASTIC_WORKER), run_name="__main__")
    return os.environ["KERAS_RING_WORKER"]
