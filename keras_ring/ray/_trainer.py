"""`KerasRingTrainer`: a Ray Train data-parallel trainer whose workers form a keras-ring job.

Ray Train places the workers, hands them their dataset shards, collects what they report
and restarts the whole worker group after a failure, as `RunConfig(failure_config=...)`
says. keras-ring's backend joins the workers into one job on its TCP world: it serves the
job's rendezvous store from Ray Train's controller and gives each worker Ray Train's world
rank as its rank, so `kr.init()` inside the training function needs no launcher. Ray Train
numbers the workers of a node consecutively, so shared memory serves within a node and the
hierarchical path between nodes.
"""

import dataclasses
import secrets

import ray

try:
    from ray.train.backend import Backend, BackendConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
except ImportError as e:
    raise ImportError('KerasRingTrainer needs Ray Train: pip install "keras-ring[ray]"') from e

from keras_ring.core._rendezvous import RendezvousServer
from keras_ring.launcher._tcp_jobs import job_env
from keras_ring.ray._calls import _node_id, _set_env


@dataclasses.dataclass
class KerasRingConfig(BackendConfig):
    """How the workers of a `KerasRingTrainer` join one keras-ring job.

    Args:
        timeout_s: Seconds the workers have to say which node they run on and take their
            ranks.
        env: Environment variables set on every worker before the training function runs
            (keras-ring's settings, `KERAS_RING_FUSION_THRESHOLD` say).
    """

    timeout_s: float = 30
    env: dict = dataclasses.field(default_factory=dict)

    @property
    def backend_cls(self):
        return _KerasRingBackend

    def to_dict(self):
        return {"timeout_s": self.timeout_s, "env": dict(self.env)}


class _KerasRingBackend(Backend):
    """Serves each worker group's store while the group runs.

    Ray makes one instance per process (its Singleton metaclass), which keeps the stores.
    """

    _stores = {}  # id(worker group) -> its RendezvousServer

    def on_start(self, worker_group, backend_config):
        try:
            nodes = ray.get(worker_group.execute_async(_node_id),
                            timeout=backend_config.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"keras-ring: the {len(worker_group)} Ray Train workers did not all answer "
                f"within timeout_s={backend_config.timeout_s} s") from None
        secret = secrets.token_hex(32)
        host = ray.util.get_node_ip_address()
        server = RendezvousServer(secret.encode(), host=host)
        server.start()
        self._stores[id(worker_group)] = server
        env = job_env(dict(backend_config.env),
                      f"{host}:{server.address[1]}", secret)
        ray.get([worker_group.execute_single_async(rank, _set_env, {
            **env, "KERAS_RING_RANK": str(rank), "KERAS_RING_SIZE": str(len(nodes)),
            "KERAS_RING_HOSTNAME": node}) for rank, node in enumerate(nodes)],
            timeout=backend_config.timeout_s)

    def on_shutdown(self, worker_group, backend_config):
        server = self._stores.pop(id(worker_group), None)
        if server is not None:
            server.stop()


class KerasRingTrainer(DataParallelTrainer):
    """Ray Train's `DataParallelTrainer` for a Keras script on keras-ring, under any backend.

    The training function runs on each worker as under `keras-ring-run`: it calls
    `kr.init()` and trains with `kr.DistributedOptimizer` and keras-ring's callbacks;
    `ray.train.report(...)`, `ray.train.get_checkpoint()` and
    `ray.train.get_dataset_shard(...)` work as with Ray's own trainers. Ray Train's worker
    ranks are keras-ring's ranks.

    Args:
        train_loop_per_worker: The training function, of no argument or of one (the
            `train_loop_config`).
        train_loop_config: The argument passed to `train_loop_per_worker`.
        keras_ring_config: A `KerasRingConfig`; its defaults when None.
        scaling_config: Ray Train's `ScalingConfig`: `num_workers`, `resources_per_worker`.
            `use_gpu=True` is refused: keras-ring does not reduce GPU tensors yet.
        run_config: Ray Train's `RunConfig` (storage, checkpoints, failure handling).
        datasets: Ray Datasets by name, split across the workers.
        dataset_config: Ray Train's `DataConfig`.
        validation_config: Ray Train's `ValidationConfig`.
    """

    def __init__(self, train_loop_per_worker, *, train_loop_config=None,
                 keras_ring_config=None, scaling_config=None, run_config=None, datasets=None,
                 dataset_config=None, validation_config=None):
        if scaling_config is not None and scaling_config.use_gpu:
            raise ValueError("keras-ring: KerasRingTrainer does not support GPUs yet "
                             "(ScalingConfig(use_gpu=True)); train on CPU workers.")
        super().__init__(
            train_loop_per_worker=train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=keras_ring_config or KerasRingConfig(),
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            validation_config=validation_config,
        )
