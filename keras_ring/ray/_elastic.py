"""`ElasticRayExecutor`: Horovod's `horovod.ray.ElasticRayExecutor` on keras-ring's elastic driver.

The decisions are those of `keras-ring-run --elastic` (`_elastic_driver.Policy`,
the rules in that module's docstring); only the hosts and the workers differ:

- The hosts are Ray's live nodes, read again every second, each with one
  slot per `cpus_per_slot` CPUs it has. A node that joins the cluster adds
  workers, up to `max_num_proc`; one that leaves takes its workers with it.
- Each worker is a Ray actor pinned to its node, which runs the function
  once. Its result is an exit with code 0 (its engine shuts down and the
  actor is killed, as a process would end); an exception, a failure (the
  actor is killed at once, so that the others' engines notice); the actor's
  death, a lost worker; an actor Ray has not started within `timeout_s`, a
  worker that could not start. Signals to a worker are `ray.kill`.
- Each `run` serves a rendezvous store of its own in this process, as
  `RayExecutor` does, so that a second run meets none of the first's keys.
"""

import dataclasses
import os
import secrets
import signal
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from keras_ring.core._rendezvous import RendezvousServer
from keras_ring.launcher._elastic_driver import (
    FAILED,
    DriverLoop,
    Policy,
    is_alive,
    read_timeout,
    remove_shm_segments,
    worker_env,
)
from keras_ring.ray._calls import _load, _no_callbacks, _node_id, _pack, cause_of

# How often the cluster's nodes are read.
_NODES_INTERVAL_SECONDS = 1


@dataclasses.dataclass
class ElasticSettings:
    """What `ElasticRayExecutor.create_settings` returns."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    cooldown_range: tuple | None = None


class _ElasticWorker:
    """One worker: a Ray actor that runs the job's function once. Ray prefixes the lines it
    prints with its repr, the worker's place (host:slot), as `keras-ring-run --elastic
    --prefix-output` does, which stays while its rank changes:
    `(10.0.0.2-0c47d9ac:1 pid=4242, ip=10.0.0.2)`."""

    def __init__(self, place):
        self.place = place

    def __repr__(self):
        return self.place

    def pid(self):
        return os.getpid(), _node_id()

    def run(self, env, payload, path):
        os.environ.update(env)
        fn, args, kwargs = _load(payload, path)
        try:
            result = ("ok", fn(*args, **kwargs))
        except SystemExit as e:  # kr.init() of a worker the driver removed: code 0
            result = ("exit", e.code if isinstance(e.code, int) else int(e.code is not None))
        if "keras_ring.core._engine" in sys.modules:
            # What the end of a worker's process does (then the driver kills the actor).
            from keras_ring.core._lifecycle import shutdown

            shutdown()
        return result


class ElasticRayExecutor:
    """Runs an elastic keras-ring job on the nodes of a Ray cluster.

    Horovod's `horovod.ray.ElasticRayExecutor`: the function runs on one
    worker per slot of every node, and the job goes on while workers and
    nodes come and go. It calls `kr.init()` and trains under
    `kr.elastic.run`, as a script under `keras-ring-run --elastic` does
    (docs/elastic.md).

    Args:
        settings: From `ElasticRayExecutor.create_settings(...)`.
        use_gpu: Refused while keras-ring runs on CPUs only.
        cpus_per_slot: CPUs each worker reserves; a node has one slot per
            `cpus_per_slot` of its CPUs.
        gpus_per_slot: Refused with `use_gpu`.
        env_vars: Environment variables of every worker.
        override_discovery: Accepted; the hosts are always Ray's nodes.

    Example:

    ```python
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=2))
    executor.start()
    results = executor.run(train)  # those of the last world's workers, in rank order
    ```
    """

    def __init__(self, settings, use_gpu=False, cpus_per_slot=1, gpus_per_slot=None,
                 env_vars=None, override_discovery=True):
        if use_gpu or gpus_per_slot:
            raise ValueError("keras-ring on Ray runs on CPUs only for now. Received: "
                             f"use_gpu={use_gpu!r}, gpus_per_slot={gpus_per_slot!r}")
        self.settings = settings
        self._cpus = cpus_per_slot
        self._env = {k: str(v) for k, v in (env_vars or {}).items()}
        self._started = False

    @staticmethod
    def create_settings(min_num_proc=1, max_num_proc=None, reset_limit=None,
                        elastic_timeout=600, timeout_s=30, ssh_identity_file=None, nics=None,
                        min_np=None, max_np=None, cooldown_range=None, verbose=None):
        """Horovod's elastic settings.

        Args:
            min_num_proc: Workers the job needs to train (the first world
                included); `min_np` is its older name.
            max_num_proc: The most workers at once, or None for one per slot;
                `max_np` is its older name.
            reset_limit: The most times the world may re-form, or None.
            elastic_timeout: Seconds to wait for `min_num_proc` workers.
            timeout_s: Seconds a worker's actor may take to start on its node;
                one that Ray has not started by then (its node is full, say)
                is killed and counted as a worker that could not start.
            cooldown_range: (lo, hi) seconds a node whose worker failed is left
                out for (Horovod's rule, as `--blacklist-cooldown-range`), or
                None: for the rest of the job.

        The ssh arguments and `nics` have no use (the driver serves the store);
        `verbose` is accepted as Horovod's docs pass it.
        """
        return ElasticSettings(
            min_num_proc=min_np if min_np is not None else min_num_proc,
            max_num_proc=max_np if max_np is not None else max_num_proc,
            reset_limit=reset_limit, elastic_timeout=elastic_timeout, timeout_s=timeout_s,
            cooldown_range=cooldown_range)

    def start(self):
        """Makes the executor ready to `run`. Each run serves a store of its own, on this
        node's address, with a secret of its own."""
        self._started = True

    def run(self, worker_fn, callbacks=None):
        """Runs `worker_fn()` as an elastic job until it finishes or fails.

        `callbacks`, Horovod's receivers of what rank 0 logs, are refused.

        Returns:
            The results of the last world's workers, in rank order.

        Raises:
            RuntimeError: If the job failed (too few workers for
                `elastic_timeout`, past `reset_limit`, or a member of the last
                world did not finish); the message names the lost workers.
        """
        _no_callbacks(callbacks)
        if not self._started:
            raise RuntimeError("This ElasticRayExecutor is not started: call start() first "
                               "(and not after shutdown()).")
        s = self.settings
        env = {**os.environ, **self._env}
        timeout = read_timeout(env)
        policy = Policy(np=s.min_num_proc, min_np=s.min_num_proc, max_np=s.max_num_proc,
                        timeout=timeout, elastic_timeout=s.elastic_timeout,
                        reset_limit=s.reset_limit, cooldown=s.cooldown_range, discovery=True,
                        names={"np": "min_num_proc", "min_np": "min_num_proc",
                               "elastic_timeout": "elastic_timeout",
                               "reset_limit": "reset_limit"})
        secret = secrets.token_hex(32)
        # The workers wait as long as the driver does, wherever their node is.
        env = {**self._env, "KERAS_RING_TIMEOUT": f"{timeout:g}"}
        with RendezvousServer(secret.encode(), host=ray.util.get_node_ip_address()) as server:
            store = f"{server.address[0]}:{server.address[1]}"
            job = _RayJob(server, policy, self._cpus, s.timeout_s, _pack((worker_fn, (), {})),
                          worker_env(env, store, secret, timeout, s.elastic_timeout))
            try:
                job.run(job.hosts())
            finally:
                job.leave_nothing()
        if policy.exit_code != 0:
            raise RuntimeError(f"keras-ring: {policy.message}")
        members = sorted((w for w in policy.workers if w.rank is not None),
                         key=lambda w: w.rank)
        return [job.results.get(w.name) for w in members]

    def shutdown(self):
        """Ends the executor: `run` is refused until `start` again."""
        self._started = False


class _RayJob(DriverLoop):
    """An elastic job's workers as Ray actors, one per `Policy` worker, on their nodes."""

    def __init__(self, server, policy, cpus, start_timeout, packed, env):
        super().__init__(server, policy, "keras-ring")
        self.cpus = cpus
        self.start_timeout = start_timeout
        self.packed = packed
        self.env = env
        self.nodes = {}  # host name -> Ray node id
        self.actors = {}  # worker name -> (actor, ref of its run, ref of its pid)
        self.unstarted = {}  # worker name -> when its actor was asked for, until it runs
        self.results = {}  # worker name -> what its function returned
        self.next_read = 0.0

    def hosts(self):
        """[(host, slots)] of Ray's live nodes; a host is named by its address and node id."""
        hosts = []
        for node in ray.nodes():
            if node["Alive"]:
                host = f"{node['NodeManagerAddress']}-{node['NodeID'][:8]}"
                self.nodes[host] = node["NodeID"]
                hosts.append((host, int(node["Resources"].get("CPU", 0) // self.cpus)))
        return hosts

    def _poll_hosts(self, now):
        if now < self.next_read:
            return None
        self.next_read = now + _NODES_INTERVAL_SECONDS
        return self.hosts()

    def _start(self, w, now):
        actor = ray.remote(_ElasticWorker).options(
            num_cpus=self.cpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.nodes[w.host], soft=False))
        actor = actor.remote(w.place)
        env = {**self.env, "KERAS_RING_WORKER": w.name, "KERAS_RING_HOSTNAME": self.nodes[w.host]}
        pid = actor.pid.remote()  # first: an actor runs its calls in order
        self.actors[w.name] = (actor, actor.run.remote(env, *self.packed), pid)
        self.unstarted[w.name] = now

    def _poll_workers(self, now):
        self._check_started(now)
        running = {run: name for name, (_, run, _) in self.actors.items()
                   if self.policy.worker(name).alive}
        if not running:
            return
        ended, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
        for run in ended:
            name = running[run]
            code, how = self._ending(name, run)
            self.policy.exited(name, code, now, how)

    def _check_started(self, now):
        """Counts an actor Ray has not started within the start timeout as a failed start."""
        for name, since in list(self.unstarted.items()):
            actor, _, pid = self.actors[name]
            if ray.wait([pid], timeout=0)[0]:
                del self.unstarted[name]
            elif now >= since + self.start_timeout and self.policy.worker(name).alive:
                del self.unstarted[name]
                ray.kill(actor)
                self.policy.start_failed(
                    name, f"Ray did not start its actor within timeout_s={self.start_timeout:g} "
                          f"s ({self.cpus} CPUs on node {self.nodes[self.policy.worker(name).host]}"
                          " asked for)", now)

    def _ending(self, name, run):
        """(exit code, how it ended or None) of the worker whose run has ended."""
        try:
            kind, value = ray.get(run)
        except ray.exceptions.RayTaskError as e:
            ray.kill(self.actors[name][0])  # its connections close: the others notice at once
            self.say(f"worker {self.policy.worker(name).place} raised:\n{e}")
            return FAILED, f"raised {cause_of(e)}"
        except ray.exceptions.RayActorError as e:
            return FAILED, f"its Ray actor{self._pid_of(name)} died: {_first_line(e)}"
        except ray.exceptions.RayError as e:  # out of memory, runtime environment, ...
            return FAILED, f"its Ray actor{self._pid_of(name)} failed: {_first_line(e)}"
        ray.kill(self.actors[name][0])  # done, its engine shut down: as a process would end
        if kind == "exit":
            return value, None
        self.results[name] = value
        return 0, None

    def _pid_of(self, name):
        """" (pid N)" of the worker's actor where it is known, else ""."""
        pid = self.actors[name][2]
        if ray.wait([pid], timeout=0)[0]:
            try:
                return f" (pid {ray.get(pid)[0]})"
            except ray.exceptions.RayError:
                pass
        return ""

    def _signal(self, w, signals):
        if signal.SIGTERM in signals or signal.SIGKILL in signals:
            ray.kill(self.actors[w.name][0])

    def leave_nothing(self):
        """Kills every actor and removes the shared-memory segments of those on this node."""
        here = _node_id()
        pids = []
        for actor, _, pid in self.actors.values():
            ready, _ = ray.wait([pid], timeout=0)
            ray.kill(actor)
            if ready:
                try:
                    pid, node = ray.get(pid)
                except ray.exceptions.RayError:
                    continue
                if node == here:
                    pids.append(pid)
        deadline = time.monotonic() + 5
        while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        remove_shm_segments(pids)


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
