"""`RayExecutor`: Horovod's `horovod.ray.RayExecutor` on keras-ring's TCP world.

The workers are Ray actors in a placement group; this process serves the
job's rendezvous store (`_rendezvous.RendezvousServer`, with a secret made
for the job), so no MPI launcher and no ssh are involved. Ranks on one Ray
node get consecutive ranks and share the node's id as their host name, so
shared memory serves within a node and the hierarchical path between nodes.
"""

import dataclasses
import functools
import secrets
import sys

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from keras_ring.core._rendezvous import RendezvousServer
from keras_ring.launcher._run import raise_first_failure
from keras_ring.launcher._tcp_jobs import job_env
from keras_ring.ray._calls import _load, _no_callbacks, _pack, _set_env, cause_of
from keras_ring.ray._elastic import ElasticRayExecutor


@dataclasses.dataclass
class Settings:
    """What `RayExecutor.create_settings` returns."""

    timeout_s: float = 30
    placement_group_timeout_s: float = 100


class _Worker:
    """One rank: a Ray actor that runs the functions it is given. Ray prefixes the lines it
    prints with its repr, `(rank 1 pid=4242, ip=10.0.0.2)`."""

    executable = None

    def __init__(self, rank):
        self.rank = rank

    def __repr__(self):
        return f"rank {self.rank}"

    def set_env(self, env):
        _set_env(env)

    def start_executable(self, payload, path):
        cls, args, kwargs = _load(payload, path)
        self.executable = cls(*args, **kwargs)

    def execute(self, payload, path, executable):
        fn, args, kwargs = _load(payload, path)
        try:
            return fn(self.executable) if executable else fn(*args, **kwargs)
        except BaseException:
            _leave_job()
            raise


def _leave_job():
    """What a rank's process does as it ends: shuts its engine down, so that the others'
    collectives fail at once, naming it, rather than wait for it until KERAS_RING_TIMEOUT."""
    basics = sys.modules.get("keras_ring.core._basics")
    if basics is not None and basics.is_initialized():
        from keras_ring.core import _lifecycle

        _lifecycle.shutdown()


class RayExecutor:
    """Runs a function on `num_workers` Ray actors that form one keras-ring job.

    Horovod's `horovod.ray.RayExecutor`. Each worker's function calls
    `kr.init()` itself, as a script would.

    Args:
        settings: From `RayExecutor.create_settings(...)`.
        num_workers: The number of ranks, packed onto as few nodes as fit.
        num_hosts: Instead of `num_workers`: this many nodes, one bundle
            each (Ray's STRICT_SPREAD), ...
        num_workers_per_host: ... with this many ranks on each.
        cpus_per_worker: CPUs each actor reserves.
        use_gpu: Refused while keras-ring runs on CPUs only.
        gpus_per_worker: Refused with `use_gpu`.
        use_current_placement_group: Accepted; the executor makes a
            placement group of its own in every case.
        min_workers: Instead of `num_workers` or `num_hosts`, Horovod 0.28's
            elastic form: `run` runs an elastic job of `min_workers` to
            `max_workers` workers on the cluster's nodes, as
            `ElasticRayExecutor` does (with `reset_limit`, `cooldown_range`,
            `elastic_timeout` and `override_discovery` as its settings), one
            worker per `cpus_per_worker` CPUs of a node; `run_remote`,
            `execute` and `execute_single` are refused there.

    Example:

    ```python
    import ray
    from keras_ring.ray import RayExecutor

    def train():
        import keras_ring as kr
        kr.init()
        return kr.rank()

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    executor.run(train)  # [0, 1]
    executor.shutdown()
    ```
    """

    def __init__(self, settings, num_workers=None, num_hosts=None, num_workers_per_host=1,
                 cpus_per_worker=1, use_gpu=False, gpus_per_worker=None,
                 use_current_placement_group=True, min_workers=None, max_workers=None,
                 reset_limit=None, cooldown_range=None, elastic_timeout=600,
                 override_discovery=True):
        if use_gpu or gpus_per_worker:
            raise ValueError("keras-ring on Ray runs on CPUs only for now. Received: "
                             f"use_gpu={use_gpu!r}, gpus_per_worker={gpus_per_worker!r}")
        self.settings = settings
        self._elastic = self._elastic_args = None
        self._workers = self._group = self._server = None
        if max_workers is not None and not (min_workers and min_workers > 0):
            raise ValueError("`max_workers` needs a positive `min_workers` (the elastic form). "
                             f"Received: min_workers={min_workers!r}")
        if min_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise ValueError("Pass `min_workers` (elastic) or `num_workers`/`num_hosts`, not "
                                 f"both. Received: min_workers={min_workers!r}, "
                                 f"num_workers={num_workers!r}, num_hosts={num_hosts!r}")
            self._elastic_args = dict(
                settings=ElasticRayExecutor.create_settings(
                    min_num_proc=min_workers, max_num_proc=max_workers, reset_limit=reset_limit,
                    elastic_timeout=elastic_timeout, timeout_s=settings.timeout_s,
                    cooldown_range=cooldown_range),
                cpus_per_slot=cpus_per_worker, override_discovery=override_discovery)
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("Pass `num_workers`, or `num_hosts` with `num_workers_per_host`. "
                             f"Received: num_workers={num_workers!r}, num_hosts={num_hosts!r}")
        self._num_workers = num_workers
        self._num_hosts = num_hosts
        self._per_host = num_workers_per_host or 1
        self._cpus = cpus_per_worker

    @classmethod
    def create_settings(cls, timeout_s=30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s=100, nics=None, verbose=None):
        """Horovod's settings. `timeout_s` bounds the workers' start; `placement_group_timeout_s`
        Ray's placement. The ssh arguments and `nics` have no use (the driver serves the store,
        and each rank listens on the address it reaches the store from); `verbose` is taken as
        Horovod's docs pass it."""
        return Settings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s)

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None,
              extra_env_vars=None):
        """Places the workers, starts them and gives each its rank and the job's store.

        In the elastic form, only `extra_env_vars` may be given: the workers start with
        each `run`."""
        if self._elastic_args is not None:
            if executable_cls is not None:
                raise NotImplementedError("keras-ring: the elastic RayExecutor (min_workers) "
                                          "runs functions, not an executable_cls")
            self._elastic = ElasticRayExecutor(**self._elastic_args, env_vars=extra_env_vars)
            return self._elastic.start()
        if self._workers is not None:
            raise RuntimeError("This RayExecutor has started already; shutdown() first.")
        if self._num_workers is not None:
            bundles = [{"CPU": self._cpus}] * self._num_workers
            strategy, per_bundle = "PACK", 1
        else:
            bundles = [{"CPU": self._cpus * self._per_host}] * self._num_hosts
            strategy, per_bundle = "STRICT_SPREAD", self._per_host
        self._group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self._group.ready()],
                            timeout=self.settings.placement_group_timeout_s)
        if not ready:
            self.shutdown()
            raise TimeoutError(
                f"keras-ring: Ray could not place {len(bundles)} bundles of {bundles[0]} "
                f"({strategy}) within {self.settings.placement_group_timeout_s} s; the cluster "
                f"has {ray.available_resources()} free.")
        # Ranks of one node are consecutive, nodes in the order of their first bundle: known
        # from the placement, so each actor is made with its rank (its output's prefix).
        nodes = ray.util.placement_group_table(self._group)["bundles_to_node_id"]
        order = {}
        for b in range(len(bundles)):
            order.setdefault(nodes[b], len(order))
        slots = [b for b in sorted(range(len(bundles)), key=lambda b: order[nodes[b]])
                 for _ in range(per_bundle)]
        actor = ray.remote(_Worker)
        self._workers = [
            actor.options(num_cpus=self._cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=b)).remote(rank)
            for rank, b in enumerate(slots)]
        try:
            self._connect(extra_env_vars, [nodes[b] for b in slots])
            if executable_cls is not None:
                payload, path = _pack((executable_cls, executable_args or [],
                                       executable_kwargs or {}))
                ray.get([w.start_executable.remote(payload, path) for w in self._workers])
        except BaseException:
            self.shutdown()  # no actor, group or store is left behind
            raise

    def _connect(self, extra_env_vars, nodes):
        """Gives each started actor its rank, its node's id as its host name and the job's
        store."""
        secret = secrets.token_hex(32)
        host = ray.util.get_node_ip_address()
        self._server = RendezvousServer(secret.encode(), host=host)
        self._server.start()
        store = f"{host}:{self._server.address[1]}"
        try:
            ray.get([w.set_env.remote({
                **job_env(dict(extra_env_vars or {}), store, secret),
                "KERAS_RING_RANK": rank, "KERAS_RING_SIZE": len(nodes),
                "KERAS_RING_HOSTNAME": node})
                for rank, (node, w) in enumerate(zip(nodes, self._workers))],
                timeout=self.settings.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"keras-ring: the {len(self._workers)} Ray actors did not all start within "
                f"timeout_s={self.settings.timeout_s} s") from None

    def run(self, fn, args=None, kwargs=None, callbacks=None):
        """`fn(*args, **kwargs)` on every worker; their results in rank order.

        `callbacks`, Horovod's receivers of what rank 0 logs, are refused. In the elastic
        form, the results are those of the last world's workers."""
        _no_callbacks(callbacks)
        if self._elastic_args is not None:
            if self._elastic is None:
                raise RuntimeError("This RayExecutor is not started: call start() first.")
            return self._elastic.run(functools.partial(fn, *(args or ()), **(kwargs or {})))
        return self._collect(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn, args=None, kwargs=None):
        """As `run`, without waiting: one Ray object ref per worker, in rank order."""
        return self._submit(self._started(), (fn, tuple(args or ()), dict(kwargs or {})), False)

    def execute(self, fn, callbacks=None):
        """`fn(executable)` on every worker, where `executable` is its instance of `start`'s
        `executable_cls` (None without one); the results in rank order."""
        _no_callbacks(callbacks)
        return self._collect(self._submit(self._started(), (fn, (), {}), True))

    def execute_single(self, fn):
        """`fn(executable)` on rank 0 only; its result."""
        return self._collect(self._submit(self._started()[:1], (fn, (), {}), True))[0]

    def shutdown(self):
        """Stops the workers and frees their placement group and the store."""
        if self._elastic is not None:
            self._elastic.shutdown()
            self._elastic = None
            return
        for w in self._workers or []:
            ray.kill(w)
        self._workers = None
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _started(self):
        if self._elastic_args is not None:
            raise NotImplementedError("keras-ring: the elastic RayExecutor (min_workers) has "
                                      "only run(): its workers live for one run, as Horovod's")
        if self._workers is None:
            raise RuntimeError("This RayExecutor is not started: call start() first "
                               "(and not after shutdown()).")
        return self._workers

    def _submit(self, workers, call, executable):
        payload, path = _pack(call)
        return [w.execute.remote(payload, path, executable) for w in workers]

    def _collect(self, refs):
        outcomes = [_outcome(ref) for ref in refs]
        # A worker whose actor died caused the others' errors (their collectives, or kr.init(),
        # waiting for it): named first.
        for rank, outcome in enumerate(outcomes):
            if outcome[0] == "died":
                raise RuntimeError(f"keras-ring: the Ray actor of rank {rank} (of {len(outcomes)}) "
                                   f"died before its function returned: {outcome[1]}")
        return raise_first_failure(outcomes)


def _outcome(ref):
    """A worker's result, from its Ray object ref, as the tuple `raise_first_failure` takes, or
    ("died", why) if its actor died."""
    try:
        return ("ok", ray.get(ref))
    except ray.exceptions.RayActorError as e:
        return ("died", str(e))
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else None
        return ("error", cause, cause_of(e), str(e))
