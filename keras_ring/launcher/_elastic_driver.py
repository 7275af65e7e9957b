"""Elastic jobs: `keras-ring-run --elastic` keeps training while workers come and go.

The driver serves the job's rendezvous store and decides every world itself
(docs/decisions/0003-elastic-protocol.md): workers write `elastic/ready/<worker>`
when they need a world and wait for `elastic/assign/<worker>/<k>`; the driver
writes `elastic/hosts_updated/<g>` when the world should re-form at its next
commit. The decisions (who forms the next world, which host is blacklisted,
what a deadline does) are `Policy`'s, a class fed with events and the clock;
`run_elastic_job` is the thin part that starts processes, polls them, the
store and the discovery script, and carries out what `Policy` decides, in one
loop that wakes at least every `_TICK_SECONDS`.

Rules, as implemented:

- Workers start on free slots (discovered, or the fixed pool of `-np`/`-H`/
  `--hostfile`) of hosts that are not blacklisted, while fewer than `--max-np`
  workers are active.
- With no member of a world alive (at the start, or once all have ended)
  the next world forms once every started worker has asked, or
  `KERAS_RING_TIMEOUT` after the driver began to need a world without those
  that have not (they join later). The first world needs `-np` workers,
  later ones `--min-np`.
- While a world trains, the next forms once every member still alive has
  asked; a member that has not asked `KERAS_RING_TIMEOUT` after the first
  member did is dropped (SIGCONT, SIGKILL) as a failure of its host. Members
  are ranked survivors first, in their old rank order, then newcomers in the
  order they started.
- A newcomer ready while the world trains, or a member whose slot left the
  discovery output, makes the driver write `elastic/hosts_updated/<g>`. A
  worker whose slot left gets `{"removed": why}` once it asks (a member: once
  every member has asked); a member that does not ask in time is killed, which
  is not counted as a failure.
- A worker that exits non-zero, dies, cannot be started or is dropped is
  lost: its host is blacklisted, for the rest of the job, or with
  `--blacklist-cooldown-range LO HI` for clamp(LO * 2**n + U(0, 1) * LO, LO, HI)
  seconds, n counting the host's earlier blacklistings (Horovod's rule).
- Too few workers for a world: the driver waits for capacity up to
  `--elastic-timeout` (at once where none can come: no discovery script, and
  every free slot's host blacklisted for good), then fails the job. A world
  past `--reset-limit` re-formations fails it too. Failing: every waiting
  worker gets `{"failed": why}`, a line names the lost workers, the workers
  get `REPORT_SECONDS` to exit, then SIGCONT and SIGTERM, then SIGKILL after
  `GRACE_SECONDS`; the exit code is 1.
- A member that exits 0 starts the end: no world forms after it, a member
  that asks gets `{"failed": why}`; the job ends when every member of the
  world has exited, with 0 if all exited 0. Workers outside the world are
  told `{"removed": ...}` and stopped.
- SIGINT, SIGTERM or SIGHUP to the driver: every worker gets SIGCONT and
  SIGTERM at once and SIGKILL after `GRACE_SECONDS`; a second signal kills
  them; the exit code is 128 + the signal.
"""

import dataclasses
import glob
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from keras_ring.core._rendezvous import RendezvousServer
from keras_ring.launcher import _base
from keras_ring.launcher._tcp_jobs import (
    GRACE_SECONDS,
    REPORT_SECONDS,
    OutputRelay,
    describe_exit,
    given_hosts,
    handling_signals,
    is_this_host,
    job_env,
    parse_hosts,
    signal_process,
    start_process,
    store_host,
)

# The loop's longest sleep: how late it notices a process's exit or relays output.
_TICK_SECONDS = 0.1
# The discovery script runs this long after its previous run ended, and may take this long.
_DISCOVERY_INTERVAL_SECONDS = 1
_DISCOVERY_TIMEOUT_SECONDS = 30
# The engine's KERAS_RING_TIMEOUT when it is not set (custom_ops/core/options.cc).
DEFAULT_TIMEOUT_SECONDS = 300
# How much longer than the driver can take to answer a worker waits for its world.
_WORKER_WAIT_MARGIN_SECONDS = 10
FAILED = 1

READY_PREFIX = "elastic/ready/"


def assign_key(worker, request):
    """The key of the driver's answer to a worker's request."""
    return f"elastic/assign/{worker}/{request}"


def hosts_updated_key(generation):
    """The key that tells generation `generation` to re-form at its next commit."""
    return f"elastic/hosts_updated/{generation}"


@dataclasses.dataclass
class Worker:
    """One worker process, as `Policy` sees it.

    Args:
        host: Its host, as discovered or given.
        slot: Its slot on that host (0 up).
        n: How many workers the job started before it.
        started_at: When it was started (the clock `Policy` is given).
    """

    host: str
    slot: int
    n: int
    started_at: float
    rank: int | None = None  # in the current generation
    request: int | None = None  # the request asked and not answered yet
    asked_at: float | None = None
    answered: int = -1  # the last request answered
    leaving: str | None = None  # why its slot was removed
    dropped: bool = False  # killed for not asking in time
    code: int | None = None  # its exit code, once it has ended

    @property
    def name(self):
        """`host:slot:n`, unique in the job (KERAS_RING_WORKER)."""
        return f"{self.host}:{self.slot}:{self.n}"

    @property
    def place(self):
        """`host:slot`."""
        return f"{self.host}:{self.slot}"

    @property
    def alive(self):
        return self.code is None

    @property
    def active(self):
        """Alive and neither dropped nor leaving: it may be in the next world."""
        return self.code is None and not self.dropped and self.leaving is None


@dataclasses.dataclass(frozen=True)
class Start:
    """Start a process for `worker`; report `Policy.start_failed` if it cannot."""

    worker: Worker


@dataclasses.dataclass(frozen=True)
class Answer:
    """Write `value` (a dict, as JSON) at `assign_key(worker.name, request)`."""

    worker: Worker
    request: int
    value: dict


@dataclasses.dataclass(frozen=True)
class HostsUpdated:
    """Write `{"why": why}` at `hosts_updated_key(generation)`."""

    generation: int
    why: str


@dataclasses.dataclass(frozen=True)
class Signal:
    """Send `signals`, in order, to `worker`'s process and its children."""

    worker: Worker
    signals: tuple


@dataclasses.dataclass(frozen=True)
class Say:
    """Print `text` on stderr, after `keras-ring-run: `."""

    text: str


class Policy:
    """The decisions of an elastic job, from events and the clock (module docstring: the rules).

    Feed it with `hosts`, `asked`, `exited`, `start_failed` and `interrupt`,
    then call `step` for what to do; the calls take the time `now` (seconds of
    a monotonic clock). Nothing here starts or signals a process.

    Args:
        np: Workers the first world needs.
        min_np: Workers a later world needs.
        max_np: The most workers active at once, or None for no bound.
        timeout: KERAS_RING_TIMEOUT: seconds a member may take to ask once
            another has.
        elastic_timeout: Seconds to wait for capacity with too few workers.
        reset_limit: The most re-formations (worlds after the first), or None.
        cooldown: (lo, hi) seconds of a blacklisting, or None: for good.
        discovery: Whether a discovery script may add hosts later.
        rng: The `random.Random` of the cooldowns.
        names: What the messages call `np`, `min_np`, `elastic_timeout` and
            `reset_limit`: `keras-ring-run`'s options unless given.
    """

    def __init__(self, *, np, min_np, max_np, timeout, elastic_timeout, reset_limit=None,
                 cooldown=None, discovery=False, rng=None, names=None):
        self.np = np
        self.min_np = min_np
        self.max_np = max_np
        self.timeout = timeout
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.cooldown = cooldown
        self.discovery = discovery
        self.rng = rng or random.Random()
        self.names = {"np": "-np", "min_np": "--min-np", "elastic_timeout": "--elastic-timeout",
                      "reset_limit": "--reset-limit", **(names or {})}
        self.workers = []  # in start order
        self._by_name = {}
        self.generation = -1
        self.lost = []  # (worker, how it ended), in order
        self.exit_code = None  # once the job is ending
        self.message = None  # why it is ending, once it is, unless it finished well
        self._available = {}  # host -> slots, in discovery order
        self._blacklisted_until = {}  # host -> time
        self._blacklistings = {}  # host -> how many times
        self._actions = []
        self._round_since = None  # with no member alive: when the driver began to need a world
        self._short_since = None  # when too few workers for a world began
        self._updated = False  # whether hosts_updated was written for this generation
        self._finishing = None  # the member whose exit 0 started the end
        self._stops = []  # (when, signals) for the workers left, once ending
        self._ending_answer = None  # what a worker that asks once the job is ending is told

    # Events.

    def hosts(self, hosts):
        """The slots there are now: [(host, slots)], e.g. the discovery script's output."""
        available = {}
        for host, slots in hosts:
            available[host] = available.get(host, 0) + slots
        if available != self._available:
            listed = ", ".join(f"{h}:{s}" for h, s in available.items()) or "none"
            self._say(f"hosts: {listed}")
        self._available = available
        for w in self.workers:
            if w.alive and w.leaving is None and w.slot >= available.get(w.host, 0):
                w.leaving = (f"host {w.host} left the discovery output" if w.host not in available
                             else f"host {w.host} has {available[w.host]} slots now")
                self._say(f"worker {w.place} leaves the job: {w.leaving}")

    def asked(self, name, request, now):
        """Worker `name` wrote request `request` (its `elastic/ready` key); repeats are ignored.

        Returns:
            Whether `name` is a worker of this job.
        """
        w = self.worker(name)
        if w is None:
            return False
        if w.alive and request > w.answered and request != w.request:
            w.request, w.asked_at = request, now
        return True

    def exited(self, name, code, now, how=None):
        """Worker `name`'s process ended with return code `code` (-N: signal N).

        `how` says how it ended, where the code alone does not (a Ray actor's death, say).
        """
        w = self.worker(name)
        w.code = code
        if self.exit_code is not None or w.dropped:
            return
        if code == 0:
            if w.rank is not None and self._finishing is None:
                self._finishing = w
            return
        how = how or describe_exit(code)
        if w.leaving is not None:
            self._say(f"worker {w.place} {how} while leaving the job")
            return
        self._lose(w, how, now)

    def start_failed(self, name, why, now):
        """Worker `name` could not be started (`why`)."""
        w = self.worker(name)
        w.code = FAILED
        self._lose(w, why, now)

    def interrupt(self, signum, now):
        """The driver got signal `signum`: stop every worker (a second time: kill them)."""
        if self.exit_code is not None:
            self._stops = [(now, (signal.SIGKILL,))]
            return
        name = signal.Signals(signum).name
        self._end(128 + signum, f"keras-ring-run got {name}", f"got {name}: stopping every worker.",
                  [(now, (signal.SIGCONT, signal.SIGTERM)),
                   (now + GRACE_SECONDS, (signal.SIGKILL,))])

    # Decisions.

    @property
    def done(self):
        """Whether the job has ended: it is ending (`exit_code` set) and no worker is alive."""
        return self.exit_code is not None and not any(w.alive for w in self.workers)

    def step(self, now):
        """Decides what to do now.

        Returns:
            A list of `Start`, `Answer`, `HostsUpdated`, `Signal` and `Say`, in
            the order to carry them out.
        """
        if self.exit_code is None:
            self._decide(now)
        if self.exit_code is not None:
            self._answer_while_ending()
            while self._stops and now >= self._stops[0][0]:
                for w in self.workers:
                    if w.alive:
                        self._actions.append(Signal(w, self._stops[0][1]))
                self._stops.pop(0)
        actions, self._actions = self._actions, []
        return actions

    def _decide(self, now):
        members = [w for w in self.workers if w.rank is not None]
        if self._finishing is not None:
            self._finish(members, now)
            return
        self._start_workers(now)
        for w in self.workers:
            if w.alive and w.leaving is not None and w.rank is None and w.request is not None:
                self._answer(w, {"removed": w.leaving})
        alive = [w for w in members if w.alive and not w.dropped]
        if alive:
            asked = [w for w in alive if w.request is not None]
            if not asked:
                self._maybe_hosts_updated()
                return
            first = min(asked, key=lambda w: w.asked_at)
            for w in alive:
                if w.request is None and now >= first.asked_at + self.timeout:
                    self._drop(w, first, now)
            if any(w.request is None and not w.dropped for w in alive):
                return
            for w in alive:
                if w.leaving is not None and not w.dropped:
                    self._answer(w, {"removed": w.leaving})
                    w.rank = None
            survivors = sorted((w for w in alive if w.active), key=lambda w: w.rank)
        else:
            if self._round_since is None:
                self._round_since = now
            waiting = [w for w in self.workers if w.active and w.request is None]
            if waiting and now < self._round_since + self.timeout:
                return
            survivors = []
        newcomers = [w for w in self.workers
                     if w.active and w.rank is None and w.request is not None]
        ready = survivors + newcomers
        needed = self.np if self.generation < 0 else self.min_np
        if len(ready) < needed:
            self._short_of(ready, needed, now)
            return
        if self.reset_limit is not None and self.generation + 1 > self.reset_limit:
            self._fail(f"the world has re-formed {self.generation} times, the most "
                       f"{self.names['reset_limit']} {self.reset_limit} allows", now)
            return
        self._form(ready)

    def _form(self, ready):
        self.generation += 1
        for w in self.workers:
            w.rank = None
        for rank, w in enumerate(ready):
            w.rank = rank
            self._answer(w, {"generation": self.generation, "rank": rank, "size": len(ready)})
        places = ", ".join(f"{w.place}={w.rank}" for w in ready)
        self._say(f"generation {self.generation}: {len(ready)} workers ({places})")
        self._round_since = None
        self._short_since = None
        self._updated = False

    def _short_of(self, ready, needed, now):
        """Too few workers for a world: wait for more, up to the elastic timeout."""
        if self._short_since is None:
            self._short_since = now
            self._say(f"{len(ready)} workers ready, {needed} needed for a world: waiting up "
                      f"to {self.elastic_timeout:g} s ({self.names['elastic_timeout']}) for more")
        waiting = ", ".join(w.place for w in ready) or "none"
        what = self.names["np" if self.generation < 0 else "min_np"]
        if not self._may_grow():
            self._fail(f"{len(ready)} workers are ready, fewer than {what} {needed}, and no "
                       f"more can start (every free slot's host is blacklisted); waiting: "
                       f"{waiting}", now)
        elif now >= self._short_since + self.elastic_timeout:
            self._fail(f"fewer than {what} {needed} workers for {self.elastic_timeout:g} s "
                       f"({self.names['elastic_timeout']}); waiting: {waiting}", now)

    def _may_grow(self):
        if self.discovery or any(w.active and w.request is None for w in self.workers):
            return True
        held = {(w.host, w.slot) for w in self.workers if w.active}
        return any(self._blacklisted_until.get(host, -math.inf) < math.inf
                   and any((host, slot) not in held for slot in range(slots))
                   for host, slots in self._available.items())

    def _maybe_hosts_updated(self):
        if self._updated:
            return
        why = None
        if any(w.active and w.rank is None and w.request is not None for w in self.workers):
            why = "workers were added"
        elif any(w.alive and w.rank is not None and w.leaving is not None for w in self.workers):
            why = "hosts were removed"
        if why is not None:
            self._actions.append(HostsUpdated(self.generation, why))
            self._updated = True

    def _start_workers(self, now):
        active = sum(w.active for w in self.workers)
        held = {(w.host, w.slot) for w in self.workers if w.alive}
        for host, slots in self._available.items():
            if self._blacklisted_until.get(host, -math.inf) > now:
                continue
            for slot in range(slots):
                if self.max_np is not None and active >= self.max_np:
                    return
                if (host, slot) in held:
                    continue
                w = Worker(host, slot, len(self.workers), now)
                self.workers.append(w)
                self._by_name[w.name] = w
                self._actions.append(Start(w))
                active += 1

    def _drop(self, w, first, now):
        w.dropped = True
        why = (f"did not ask for a new world within {self.timeout:g} s (KERAS_RING_TIMEOUT) "
               f"of {first.place}")
        self._actions.append(Signal(w, (signal.SIGCONT, signal.SIGKILL)))
        if w.leaving is not None:
            self._say(f"worker {w.place} {why}: killing it (it was leaving)")
            return
        self._lose(w, f"{why}; killed", now)

    def _lose(self, w, how, now):
        role = (f"rank {w.rank} of generation {self.generation}" if w.rank is not None
                else "not in a world")
        self.lost.append((w, how))
        self._say(f"lost worker {w.place} ({role}): {how}")
        host = w.host
        if self._blacklisted_until.get(host, -math.inf) > now:
            return
        n = self._blacklistings.get(host, 0)
        self._blacklistings[host] = n + 1
        if self.cooldown is None:
            self._blacklisted_until[host] = math.inf
            self._say(f"host {host} is blacklisted: no worker starts on it again")
            return
        lo, hi = self.cooldown
        seconds = max(lo, min(hi, lo * 2 ** n + self.rng.uniform(0, 1) * lo))
        self._blacklisted_until[host] = now + seconds
        self._say(f"host {host} is blacklisted for {seconds:.1f} s")

    def _finish(self, members, now):
        for w in members:
            if w.alive and w.request is not None:
                self._answer(w, {"failed": f"worker {self._finishing.place} has finished "
                                           "training (it exited 0): no new world forms"})
        if any(w.alive for w in members):
            return
        failed = [w for w in members if w.code != 0]
        if failed:
            self._fail(f"worker {self._finishing.place} finished, but not every worker of "
                       f"generation {self.generation} did", now)
            return
        self._end(0, "the job has finished", None,
                  [(now + REPORT_SECONDS, (signal.SIGCONT, signal.SIGTERM)),
                   (now + REPORT_SECONDS + GRACE_SECONDS, (signal.SIGKILL,))])

    def _fail(self, why, now):
        lost = ", ".join(f"{w.place} ({how})" for w, how in self.lost) or "none"
        self._end(FAILED, why, f"the elastic job failed: {why}. Lost workers: {lost}.",
                  [(now + REPORT_SECONDS, (signal.SIGCONT, signal.SIGTERM)),
                   (now + REPORT_SECONDS + GRACE_SECONDS, (signal.SIGKILL,))])

    def _end(self, code, why, message, stops):
        self.exit_code = code
        self._ending_answer = {"removed": why} if code == 0 else {"failed": why}
        self._stops = stops
        self.message = message
        if message:
            self._say(message)

    def _answer_while_ending(self):
        for w in self.workers:
            if w.alive and w.request is not None:
                self._answer(w, self._ending_answer)

    def _answer(self, w, value):
        self._actions.append(Answer(w, w.request, value))
        w.answered, w.request = w.request, None

    def worker(self, name):
        """The `Worker` called `name`, or None."""
        return self._by_name.get(name)

    def _say(self, text):
        self._actions.append(Say(text))


def read_timeout(env):
    """KERAS_RING_TIMEOUT of the job's environment, as the engine reads it (seconds)."""
    text = env.get("KERAS_RING_TIMEOUT", "")
    if not text:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise _base.LaunchError(f"KERAS_RING_TIMEOUT must be a number of seconds more than "
                                    f"0. Received: KERAS_RING_TIMEOUT={text}")
    return value


class _Discovery:
    """Runs the host discovery script: once at the start, then in the background.

    Args:
        script: The command (run by /bin/sh), which prints `host:slots` lines
            (or bare `host` lines with `slots`).
        slots: The slots of a bare `host` line, or None.
    """

    def __init__(self, script, slots):
        self.script = script
        self.slots = slots
        self._process = None
        self._output = None
        self._started_at = None
        self._next_at = 0.0
        self._failing = False

    def first(self):
        """The hosts of the first run, waited for.

        Raises:
            LaunchError: If it fails: exits non-zero, prints a bad line, or
                takes longer than `_DISCOVERY_TIMEOUT_SECONDS`.
        """
        self._start(time.monotonic())
        try:
            self._process.wait(timeout=_DISCOVERY_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        hosts, why = self._collect()
        if why is not None:
            raise _base.LaunchError(why)
        return hosts

    def poll(self, now):
        """Starts a run when one is due; returns the hosts of a run that ended well, else None.

        A run that fails is told on stderr (the first of a row of failures) and ignored.
        """
        if self._process is None:
            if now >= self._next_at:
                self._start(now)
            return None
        if self._process.poll() is None and now < self._started_at + _DISCOVERY_TIMEOUT_SECONDS:
            return None
        hosts, why = self._collect()
        self._next_at = now + _DISCOVERY_INTERVAL_SECONDS
        if why is not None:
            if not self._failing:
                print(f"keras-ring-run: {why}; keeping the hosts it printed last.",
                      file=sys.stderr, flush=True)
            self._failing = True
            return None
        self._failing = False
        return hosts

    def stop(self):
        """Ends a run in progress."""
        if self._process is not None:
            self._collect()

    def _start(self, now):
        self._output = tempfile.TemporaryFile()
        try:
            self._process = subprocess.Popen(["/bin/sh", "-c", self.script],
                                             stdin=subprocess.DEVNULL, stdout=self._output,
                                             start_new_session=True)
        except OSError as e:
            self._output.close()
            raise _base.LaunchError(f"cannot run /bin/sh for the host discovery script: "
                                        f"{e.strerror}") from None
        self._started_at = now

    def _collect(self):
        """Ends the run (killed if it still runs); returns (hosts, None) or (None, why)."""
        process, self._process = self._process, None
        code = process.poll()
        if code is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
        self._output.seek(0)
        text = self._output.read().decode(errors="replace")
        self._output.close()
        what = f"the host discovery script {self.script!r}"
        if code is None:
            return None, f"{what} took longer than {_DISCOVERY_TIMEOUT_SECONDS} s"
        if code != 0:
            return None, f"{what} {describe_exit(code)}"
        try:
            return parse_hosts(text.splitlines(), f"the output of {what}", self.slots), None
        except _base.LaunchError as e:
            return None, str(e)


def fixed_pool(options):
    """The slots of an elastic job without a discovery script: [(host, slots)].

    -H or --hostfile, else this host with `--max-np` (else `-np`) slots.

    Raises:
        LaunchError: If the hosts have fewer slots than -np.
    """
    hosts = given_hosts(options) or [("localhost", options.max_np or options.np)]
    total = sum(slots for _, slots in hosts)
    if total < options.np:
        raise _base.LaunchError(
            f"the hosts have {total} slots for -np {options.np}; give more slots "
            "(host:slots) or a smaller -np.")
    return hosts


def worker_env(env, store, secret, timeout, elastic_timeout):
    """`env` with what every worker of an elastic job needs but its name (KERAS_RING_WORKER):
    the store, the secret, and how long to wait for a world (longer than the driver can take
    to answer, so that its answer, which says why, comes first)."""
    env = {**job_env(env, store, secret), "KERAS_RING_ELASTIC": "1",
           "KERAS_RING_ELASTIC_TIMEOUT": str(
               timeout + elastic_timeout + _WORKER_WAIT_MARGIN_SECONDS)}
    for name in ("KERAS_RING_RANK", "KERAS_RING_SIZE"):
        env.pop(name, None)
    return env


def run_elastic_job(options, env):
    """Runs an elastic job until it has finished or failed, with every worker ended.

    Args:
        options: The namespace from `_main.parse_args()` with `elastic` set.
        env: The environment of the workers (before the job's own variables).

    Returns:
        0 once every worker of the last world has exited 0; 1 if the job
        failed (the reason on stderr); 128 + N after signal N.

    Raises:
        LaunchError: If the settings are wrong, the first discovery fails or
            the store cannot listen.
    """
    timeout = read_timeout(env)
    discovery = None
    if options.host_discovery_script is not None:
        discovery = _Discovery(options.host_discovery_script, options.slots)
        hosts = discovery.first()
    else:
        hosts = fixed_pool(options)
    bind, advertised = store_host(options, [h for h, _ in hosts if not is_this_host(h)])
    policy = Policy(np=options.np, min_np=options.min_np, max_np=options.max_np,
                    timeout=timeout, elastic_timeout=options.elastic_timeout,
                    reset_limit=options.reset_limit, cooldown=options.blacklist_cooldown_range,
                    discovery=discovery is not None)
    secret = secrets.token_hex(32)
    with RendezvousServer(secret.encode(), host=bind) as server:
        store = f"{advertised}:{server.address[1]}"
        job = _Job(options, worker_env(env, store, secret, timeout, options.elastic_timeout),
                   server, policy, discovery, loopback=bind == "127.0.0.1")
        with handling_signals(job.interrupt):
            try:
                return job.run(hosts)
            finally:
                job.leave_nothing()


class DriverLoop:
    """The loop that feeds `Policy` with what happens and carries out what it decides.

    It reads the workers' requests from the store and writes the answers;
    a subclass starts, watches and signals the workers themselves: processes
    here (`_Job`), Ray actors in `keras_ring.ray`.

    Args:
        server: The job's `RendezvousServer`.
        policy: The job's `Policy`.
        name: What the loop's lines on stderr begin with.
    """

    def __init__(self, server, policy, name):
        self.server = server
        self.policy = policy
        self.name = name
        self.signals = []  # received, not yet given to the policy
        self.warned = set()

    def interrupt(self, signum, frame):
        self.signals.append(signum)

    def run(self, hosts):
        """Runs the job on `hosts` ([(host, slots)]) until it is done; returns its exit code."""
        policy = self.policy
        policy.hosts(self._reachable(hosts))
        seen = -1
        while True:
            now = time.monotonic()
            while self.signals:
                policy.interrupt(self.signals.pop(0), now)
            self._poll_workers(now)
            changes = self.server.changes
            if changes != seen:
                seen = changes
                self._read_requests(now)
            if policy.exit_code is None:
                found = self._poll_hosts(now)
                if found is not None:
                    policy.hosts(self._reachable(found))
            for action in policy.step(now):
                self._carry_out(action, now)
            if policy.done:
                return policy.exit_code
            self.server.wait_for_change(seen, _TICK_SECONDS)

    def _poll_workers(self, now):
        """Tells the policy of the workers that have ended (`Policy.exited`)."""
        raise NotImplementedError

    def _poll_hosts(self, now):
        """The hosts there are now, when they may have changed; else None."""
        return None

    def _reachable(self, hosts):
        """The hosts whose workers can reach the store."""
        return hosts

    def _start(self, w, now):
        """Starts `w`, or reports `Policy.start_failed`."""
        raise NotImplementedError

    def _signal(self, w, signals):
        """Carries out `Signal(w, signals)`."""
        raise NotImplementedError

    def say(self, text):
        print(f"{self.name}: {text}", file=sys.stderr, flush=True)

    def _read_requests(self, now):
        for key in self.server.keys(READY_PREFIX):
            name = key[len(READY_PREFIX):]
            value = self.server.get(key)
            try:
                request = json.loads(value)["request"]
                if not isinstance(request, int) or request < 0:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                request = None
            known = request is not None and self.policy.asked(name, request, now)
            if not known and (key, value) not in self.warned:
                self.warned.add((key, value))
                expected = ("a JSON object with a request count" if request is None
                            else "a worker of this job")
                self.say(f"ignoring {key}: expected {expected}. Received: {value[:200]!r}")

    def _carry_out(self, action, now):
        if isinstance(action, Start):
            self._start(action.worker, now)
        elif isinstance(action, Answer):
            self.server.set(assign_key(action.worker.name, action.request),
                            json.dumps(action.value).encode())
        elif isinstance(action, HostsUpdated):
            self.server.set(hosts_updated_key(action.generation),
                            json.dumps({"why": action.why}).encode())
        elif isinstance(action, Signal):
            self._signal(action.worker, action.signals)
        else:
            self.say(action.text)


class _Job(DriverLoop):
    """The worker processes of `keras-ring-run --elastic`."""

    def __init__(self, options, env, server, policy, discovery, loopback):
        super().__init__(server, policy, "keras-ring-run")
        self.options = options
        self.env = env
        self.discovery = discovery
        self.loopback = loopback
        self.relay = OutputRelay()
        self.started = {}  # worker name -> _tcp_jobs.Started
        self.local_pids = []

    def _poll_workers(self, now):
        self.relay.pump(0)
        for name, started in self.started.items():
            if self.policy.worker(name).alive:
                code = started.process.poll()
                if code is not None:
                    self.policy.exited(name, code, now)

    def _poll_hosts(self, now):
        return None if self.discovery is None else self.discovery.poll(now)

    def _reachable(self, hosts):
        """The hosts the workers can reach the store from: with a loopback store, this one's."""
        if not self.loopback:
            return hosts
        kept = []
        for host, slots in hosts:
            if is_this_host(host):
                kept.append((host, slots))
            elif host not in self.warned:
                self.warned.add(host)
                self.say(f"leaving out host {host}: the job's store listens on loopback only, "
                         "as every host was this one at the start; give --network-interface "
                         "to reach other hosts.")
        return kept

    def _start(self, w, now):
        local = is_this_host(w.host)
        env = {**self.env, "KERAS_RING_WORKER": w.name}
        prefix = f"[{w.place}] " if self.options.prefix_output else ""
        try:
            started = start_process(f"worker {w.place}", None if local else w.host, env,
                                    self.options, prefix, not self.options.all_output and w.n > 0)
        except _base.LaunchError as e:
            self.policy.start_failed(w.name, str(e), now)
            return
        self.started[w.name] = started
        self.relay.add(started.streams)
        if local:
            self.local_pids.append(started.process.pid)

    def _signal(self, w, signals):
        for signum in signals:
            signal_process(self.started[w.name], signum)

    def leave_nothing(self):
        """Kills what is left (after an error), relays the last output, removes shm segments."""
        if self.discovery is not None:
            self.discovery.stop()
        for started in self.started.values():
            if started.process.poll() is None:
                signal_process(started, signal.SIGCONT)
                signal_process(started, signal.SIGKILL)
                started.process.wait()
        self.relay.drain()
        remove_shm_segments(self.local_pids)


def remove_shm_segments(pids):
    """Removes the shared-memory segments left by those of `pids` (processes of this host)
    that have ended.

    The engine names a segment after the pid of the process that made the set
    it serves (custom_ops/core/shm.cc); one killed between making and removing
    it leaves it behind.
    """
    for pid in pids:
        if is_alive(pid):
            continue
        for path in glob.glob(f"/dev/shm/kr-{pid}x*"):
            try:
                os.unlink(path)
            except OSError:
                pass


def is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process has the pid now
    return True
