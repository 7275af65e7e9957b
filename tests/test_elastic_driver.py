"""The elastic driver (keras_ring/launcher/_elastic_driver.py): its decisions, fed with events
and a clock (no process), its options, and whole jobs of fake workers
(tests/workers/elastic_fake_worker.py: the store protocol, no TensorFlow, no engine) that finish,
lose a worker, hang, grow and shrink.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from netns_hosts import IFACE

from keras_ring.launcher import _base, _elastic_driver, _main
from keras_ring.launcher._elastic_driver import Answer, HostsUpdated, Policy, Say, Signal, Start
from keras_ring.launcher._tcp_jobs import GRACE_SECONDS, REPORT_SECONDS

pytestmark = pytest.mark.timeout(180)

# Decisions.


class Sim:
    """A `Policy` on a clock the test moves, with the actions of every step kept."""

    def __init__(self, hosts=(("h", 3),), **settings):
        settings = {"np": 3, "min_np": 2, "max_np": 3, "timeout": 10, "elastic_timeout": 60,
                    **settings}
        self.policy = Policy(**settings)
        self.now = 0.0
        self.requests = {}  # worker name -> its next request
        self.policy.hosts(list(hosts))

    def step(self, at=None):
        if at is not None:
            self.now = at
        return self.policy.step(self.now)

    def ask(self, *names):
        for name in names:
            request = self.requests.get(name, 0)
            self.requests[name] = request + 1
            assert self.policy.asked(name, request, self.now)

    def exit(self, name, code):
        self.policy.exited(name, code, self.now)

    def world(self, names):
        """Every member asks (survivors first); returns the answers of the next step."""
        self.ask(*names)
        return answers(self.step())


def started(actions):
    return [a.worker.name for a in actions if isinstance(a, Start)]


def answers(actions):
    return {a.worker.name: a.value for a in actions if isinstance(a, Answer)}


def said(actions):
    return [a.text for a in actions if isinstance(a, Say)]


def signals(actions):
    return {a.worker.name: a.signals for a in actions if isinstance(a, Signal)}


def ranks(got):
    return {name: value["rank"] for name, value in got.items() if "rank" in value}


def test_the_first_world_waits_for_every_started_worker_and_ranks_them_in_start_order():
    sim = Sim()
    assert started(sim.step()) == ["h:0:0", "h:1:1", "h:2:2"]
    sim.ask("h:2:2", "h:0:0")
    assert answers(sim.step(at=1)) == {}
    sim.ask("h:1:1")
    actions = sim.step(at=2)
    assert answers(actions) == {f"h:{r}:{r}": {"generation": 0, "rank": r, "size": 3}
                                for r in range(3)}
    assert "generation 0: 3 workers (h:0=0, h:1=1, h:2=2)" in said(actions)
    assert started(sim.step(at=3)) == []  # every slot is taken


def test_survivors_keep_their_order_and_newcomers_follow_in_start_order():
    sim = Sim(hosts=[("a", 2), ("b", 2)], np=2, max_np=None, discovery=True)
    assert started(sim.step()) == ["a:0:0", "a:1:1", "b:0:2", "b:1:3"]
    assert ranks(sim.world(["a:0:0", "a:1:1", "b:0:2", "b:1:3"])) == {
        "a:0:0": 0, "a:1:1": 1, "b:0:2": 2, "b:1:3": 3}
    sim.exit("a:0:0", -9)
    # The first to ask is not rank 0: the old ranks decide.
    got = sim.world(["b:1:3", "a:1:1", "b:0:2"])
    assert got == {"a:1:1": {"generation": 1, "rank": 0, "size": 3},
                   "b:0:2": {"generation": 1, "rank": 1, "size": 3},
                   "b:1:3": {"generation": 1, "rank": 2, "size": 3}}
    sim.policy.hosts([("a", 2), ("b", 2), ("c", 2)])
    actions = sim.step()
    assert started(actions) == ["c:0:4", "c:1:5"]  # a is blacklisted
    sim.ask("c:1:5", "c:0:4")
    actions = sim.step()
    assert [a for a in actions if isinstance(a, HostsUpdated)] == [
        HostsUpdated(1, "workers were added")]
    assert answers(actions) == {}
    assert ranks(sim.world(["b:0:2", "a:1:1", "b:1:3"])) == {
        "a:1:1": 0, "b:0:2": 1, "b:1:3": 2, "c:0:4": 3, "c:1:5": 4}


def test_no_more_than_max_np_workers_start():
    sim = Sim(hosts=[("h", 5)], np=2, max_np=3)
    assert started(sim.step()) == ["h:0:0", "h:1:1", "h:2:2"]
    got = sim.world(["h:0:0", "h:1:1", "h:2:2"])
    assert {v["size"] for v in got.values()} == {3}


def test_too_few_workers_for_longer_than_the_elastic_timeout_fail_the_job():
    sim = Sim(min_np=3, discovery=True)
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.exit("h:1:1", -9)
    sim.ask("h:0:0", "h:2:2")
    actions = sim.step(at=10)
    assert answers(actions) == {}
    assert "2 workers ready, 3 needed for a world: waiting up to 60 s (--elastic-timeout) " \
           "for more" in said(actions)
    assert answers(sim.step(at=69.9)) == {}
    actions = sim.step(at=70)
    failed = answers(actions)
    assert set(failed) == {"h:0:0", "h:2:2"}
    assert all("fewer than --min-np 3 workers for 60 s" in v["failed"] for v in failed.values())
    assert ("the elastic job failed: fewer than --min-np 3 workers for 60 s (--elastic-timeout); "
            "waiting: h:0, h:2. Lost workers: h:1 (died of signal 9 (Killed)).") in said(actions)
    assert sim.policy.exit_code == 1 and not sim.policy.done
    # They get REPORT_SECONDS to exit, then SIGCONT and SIGTERM, then SIGKILL.
    assert signals(actions) == {}
    assert signals(sim.step(at=70 + REPORT_SECONDS)) == {
        n: (signal.SIGCONT, signal.SIGTERM) for n in ("h:0:0", "h:2:2")}
    sim.exit("h:0:0", 3)
    assert signals(sim.step(at=70 + REPORT_SECONDS + GRACE_SECONDS)) == {
        "h:2:2": (signal.SIGKILL,)}
    sim.exit("h:2:2", -9)
    assert sim.policy.done and sim.policy.exit_code == 1
    assert [w.place for w, _ in sim.policy.lost] == ["h:1"]  # the job's own kills are not lost


def test_capacity_that_comes_in_time_forms_the_world():
    sim = Sim(hosts=[("a", 2)], np=2, min_np=2, max_np=None, discovery=True)
    sim.step()
    sim.world(["a:0:0", "a:1:1"])
    sim.exit("a:1:1", 1)
    sim.ask("a:0:0")
    sim.step(at=1)
    sim.policy.hosts([("a", 2), ("b", 1)])
    assert started(sim.step(at=30)) == ["b:0:2"]
    got = sim.world(["b:0:2"])
    assert ranks(got) == {"a:0:0": 0, "b:0:2": 1}


def test_without_discovery_a_job_that_cannot_grow_fails_at_once():
    sim = Sim(np=2, min_np=2, max_np=2, hosts=[("h", 2)])
    sim.step()
    sim.world(["h:0:0", "h:1:1"])
    sim.exit("h:0:0", 2)
    sim.ask("h:1:1")
    actions = sim.step(at=1)
    assert answers(actions) == {"h:1:1": {"failed": (
        "1 workers are ready, fewer than --min-np 2, and no more can start (every free slot's "
        "host is blacklisted); waiting: h:1")}}
    assert "Lost workers: h:0 (exited with code 2)." in said(actions)[-1]


class HalfRandom:
    def uniform(self, a, b):
        return (a + b) / 2


def test_a_failed_host_gets_new_workers_after_a_growing_cooldown():
    sim = Sim(hosts=[("h", 2)], np=2, min_np=1, max_np=2, cooldown=(10, 30), rng=HalfRandom())
    sim.step()
    sim.world(["h:0:0", "h:1:1"])
    sim.exit("h:1:1", -9)
    actions = sim.step(at=1)
    assert "host h is blacklisted for 15.0 s" in said(actions)  # 10 * 2**0 + 0.5 * 10
    assert ranks(sim.world(["h:0:0"])) == {"h:0:0": 0}
    assert started(sim.step(at=14.9)) == []
    assert started(sim.step(at=15)) == ["h:1:2"]
    sim.ask("h:1:2")
    assert [a.generation for a in sim.step() if isinstance(a, HostsUpdated)] == [1]
    assert ranks(sim.world(["h:0:0"])) == {"h:0:0": 0, "h:1:2": 1}
    sim.exit("h:1:2", 1)
    assert "host h is blacklisted for 25.0 s" in said(sim.step(at=20))  # 10 * 2 + 5
    sim.world(["h:0:0"])
    assert started(sim.step(at=39.9)) == []
    assert started(sim.step(at=40)) == ["h:1:3"]
    sim.exit("h:1:3", 1)
    assert "host h is blacklisted for 30.0 s" in said(sim.step(at=46))  # 10 * 4 + 5, at most 30


def test_without_a_cooldown_a_failed_host_gets_no_new_worker_but_its_others_train_on():
    sim = Sim(hosts=[("a", 2), ("b", 1)], np=2, min_np=1, max_np=3)
    sim.step()
    sim.world(["a:0:0", "a:1:1", "b:0:2"])
    sim.exit("a:0:0", -9)
    actions = sim.step(at=1)
    assert "host a is blacklisted: no worker starts on it again" in said(actions)
    assert "lost worker a:0 (rank 0 of generation 0): died of signal 9 (Killed)" in said(actions)
    assert ranks(sim.world(["a:1:1", "b:0:2"])) == {"a:1:1": 0, "b:0:2": 1}
    assert started(sim.step(at=1000)) == []


def test_past_the_reset_limit_the_job_fails():
    sim = Sim(hosts=[("h", 3)], np=3, min_np=1, reset_limit=1)
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.exit("h:0:0", -9)
    assert ranks(sim.world(["h:1:1", "h:2:2"])) == {"h:1:1": 0, "h:2:2": 1}
    sim.exit("h:1:1", -9)
    actions = sim.step()
    sim.ask("h:2:2")
    actions = sim.step()
    assert answers(actions) == {"h:2:2": {
        "failed": "the world has re-formed 1 times, the most --reset-limit 1 allows"}}
    assert sim.policy.exit_code == 1


def test_a_member_that_does_not_ask_in_time_is_dropped_as_a_failure():
    sim = Sim()
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.now = 100
    sim.ask("h:2:2")
    sim.now = 105
    sim.ask("h:0:0")
    # The deadline counts from the first member's request, not from each one's.
    assert signals(sim.step(at=109.9)) == {}
    actions = sim.step(at=110)
    assert signals(actions) == {"h:1:1": (signal.SIGCONT, signal.SIGKILL)}
    assert ("lost worker h:1 (rank 1 of generation 0): did not ask for a new world within 10 s "
            "(KERAS_RING_TIMEOUT) of h:2; killed") in said(actions)
    assert ranks(answers(actions)) == {"h:0:0": 0, "h:2:2": 1}
    sim.exit("h:1:1", -9)  # the kill: counted once
    assert len(sim.policy.lost) == 1


def test_a_worker_lost_during_the_recovery_is_left_out_of_it_and_of_the_next():
    sim = Sim(np=3, min_np=1)
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.exit("h:0:0", -9)
    sim.ask("h:1:1")
    assert answers(sim.step(at=1)) == {}  # h:2 has not asked yet
    sim.exit("h:2:2", -9)  # killed before it did
    assert answers(sim.step(at=2)) == {"h:1:1": {"generation": 1, "rank": 0, "size": 1}}
    # Killed after its answer, before it joined: the others ask again, and form without it.
    sim = Sim(np=3, min_np=1)
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.exit("h:0:0", -9)
    assert ranks(sim.world(["h:1:1", "h:2:2"])) == {"h:1:1": 0, "h:2:2": 1}
    sim.exit("h:1:1", -9)
    assert sim.world(["h:2:2"]) == {"h:2:2": {"generation": 2, "rank": 0, "size": 1}}
    assert [w.place for w, _ in sim.policy.lost] == ["h:0", "h:1"]


def test_a_newcomer_that_never_asks_delays_the_first_world_by_the_timeout_only():
    sim = Sim(np=2, min_np=2)
    sim.step()
    sim.ask("h:0:0", "h:1:1")
    assert answers(sim.step(at=9.9)) == {}
    got = answers(sim.step(at=10))
    assert ranks(got) == {"h:0:0": 0, "h:1:1": 1}
    assert signals(sim.step()) == {}  # not dropped: it joins later
    sim.ask("h:2:2")
    assert [a for a in sim.step() if isinstance(a, HostsUpdated)]


def test_a_removed_host_leaves_at_the_next_world_and_is_not_a_failure():
    sim = Sim(hosts=[("a", 1), ("b", 2)], np=3, min_np=1, max_np=None, discovery=True)
    sim.step()
    sim.world(["a:0:0", "b:0:1", "b:1:2"])
    sim.policy.hosts([("a", 1), ("b", 1)])
    actions = sim.step(at=5)
    assert "worker b:1 leaves the job: host b has 1 slots now" in said(actions)
    assert [a for a in actions if isinstance(a, HostsUpdated)] == [
        HostsUpdated(0, "hosts were removed")]
    got = sim.world(["a:0:0", "b:0:1", "b:1:2"])
    assert got["b:1:2"] == {"removed": "host b has 1 slots now"}
    assert ranks(got) == {"a:0:0": 0, "b:0:1": 1}
    sim.exit("b:1:2", 0)
    # A host that leaves the output: its member does not ask, and is killed, not counted.
    sim.policy.hosts([("a", 1)])
    sim.step(at=20)
    sim.ask("a:0:0")
    actions = sim.step(at=30)
    assert signals(actions) == {"b:0:1": (signal.SIGCONT, signal.SIGKILL)}
    assert ranks(answers(actions)) == {"a:0:0": 0}
    assert sim.policy.lost == []
    sim.exit("b:0:1", -9)
    sim.policy.hosts([("a", 1), ("b", 2)])
    assert started(sim.step(at=40)) == ["b:0:3", "b:1:4"]  # b was never blacklisted


def test_a_worker_that_exits_0_ends_the_job_once_every_member_has():
    sim = Sim()
    sim.step()
    sim.world(["h:0:0", "h:1:1", "h:2:2"])
    sim.exit("h:0:0", 0)
    sim.step(at=1)
    assert sim.policy.exit_code is None  # the others still train (horovod#3852)
    sim.exit("h:2:2", 0)
    sim.step(at=2)
    sim.exit("h:1:1", 0)
    sim.step(at=3)
    assert sim.policy.done and sim.policy.exit_code == 0


def test_once_a_member_has_exited_0_no_world_forms():
    sim = Sim(hosts=[("h", 4)], np=3, min_np=1, max_np=4)
    sim.step()
    sim.ask("h:0:0", "h:1:1", "h:2:2")
    assert len(answers(sim.step(at=10))) == 3  # without h:3, which joins later
    sim.ask("h:3:3")
    sim.step()
    sim.exit("h:0:0", 0)
    sim.exit("h:1:1", -9)  # not blacklisting anything worth it: the job is finishing
    actions = sim.world(["h:2:2"])
    assert actions == {"h:2:2": {"failed": "worker h:0 has finished training (it exited 0): "
                                           "no new world forms"}}
    sim.exit("h:2:2", 3)
    actions = sim.step(at=5)
    assert answers(actions) == {"h:3:3": {"failed": "worker h:0 finished, but not every worker "
                                                    "of generation 0 did"}}
    assert sim.policy.exit_code == 1
    sim.step(at=5 + REPORT_SECONDS)
    sim.exit("h:3:3", -15)
    assert sim.policy.done


def test_newcomers_are_told_they_are_removed_when_the_job_has_finished():
    sim = Sim(hosts=[("h", 3)], np=2, min_np=1, max_np=3)
    sim.step()
    sim.ask("h:0:0", "h:1:1")
    assert len(answers(sim.step(at=10))) == 2
    sim.ask("h:2:2")
    sim.exit("h:0:0", 0)
    sim.exit("h:1:1", 0)
    actions = sim.step()
    assert answers(actions) == {"h:2:2": {"removed": "the job has finished"}}
    assert sim.policy.exit_code == 0


def test_a_signal_stops_every_worker_at_once_and_kills_them_after_the_grace():
    sim = Sim()
    sim.step()
    sim.ask("h:0:0")
    sim.policy.interrupt(signal.SIGTERM, 1)
    actions = sim.step(at=1)
    assert answers(actions) == {"h:0:0": {"failed": "keras-ring-run got SIGTERM"}}
    assert set(signals(actions).values()) == {(signal.SIGCONT, signal.SIGTERM)}
    assert set(signals(sim.step(at=1 + GRACE_SECONDS)).values()) == {(signal.SIGKILL,)}
    assert sim.policy.exit_code == 128 + signal.SIGTERM
    sim.policy.interrupt(signal.SIGINT, 2)  # a second signal: kill now
    assert set(signals(sim.step(at=2)).values()) == {(signal.SIGKILL,)}


def test_a_worker_that_cannot_start_is_lost_and_its_host_blacklisted():
    sim = Sim(hosts=[("a", 1), ("b", 2)], np=2, min_np=2, max_np=2)
    assert started(sim.step()) == ["a:0:0", "b:0:1"]
    sim.policy.start_failed("a:0:0", "cannot start worker a:0 (ssh): No such file", 0)
    actions = sim.step()
    assert "lost worker a:0 (not in a world): cannot start worker a:0 (ssh): No such file" in \
        said(actions)
    assert started(actions) == ["b:1:2"]
    assert ranks(sim.world(["b:0:1", "b:1:2"])) == {"b:0:1": 0, "b:1:2": 1}


def test_repeated_and_unknown_requests():
    sim = Sim()
    sim.step()
    assert not sim.policy.asked("x:0:9", 0, 0)
    sim.ask("h:0:0", "h:1:1", "h:2:2")
    assert sim.policy.asked("h:0:0", 0, 0)  # the same request again
    got = answers(sim.step())
    assert answers(sim.step()) == {}
    assert sim.policy.asked("h:0:0", 0, 0)  # answered already: ignored
    assert answers(sim.step()) == {} and len(got) == 3


# Options.


def parse(*argv, environ=None):
    return _main.parse_args([*argv, "python", "train.py"], environ=environ or {})


def test_horovods_spellings():
    o = parse("-np", "4", "--min-num-proc", "2", "--max-num-proc", "6",
              "--host-discovery-script", "./hosts.sh", "--slots-per-host", "2",
              "--reset-limit", "3", "--blacklist-cooldown-range", "10", "100",
              "--elastic-timeout", "30")
    assert o.elastic and o.transport == "tcp"
    assert (o.np, o.min_np, o.max_np, o.slots) == (4, 2, 6, 2)
    assert (o.reset_limit, o.blacklist_cooldown_range, o.elastic_timeout) == (3, (10, 100), 30)
    assert parse("--min-np", "2", "--max-np", "4").np == 2
    assert parse("-np", "2", "--host-discovery-script", "x").elastic


def test_elastic_defaults():
    o = parse("--elastic", "-np", "3")
    assert (o.np, o.min_np, o.max_np, o.elastic_timeout) == (3, 3, 3, 600)
    assert o.reset_limit is None and o.blacklist_cooldown_range is None
    assert parse("-np", "2", "--host-discovery-script", "x").max_np is None
    assert parse("--elastic", "-np", "1", environ={
        "HOROVOD_ELASTIC_TIMEOUT": "7"}).elastic_timeout == 7
    assert parse("--elastic", "-np", "1", environ={
        "KERAS_RING_ELASTIC_TIMEOUT": "5", "HOROVOD_ELASTIC_TIMEOUT": "7"}).elastic_timeout == 5
    assert not parse("-np", "2").elastic


@pytest.mark.parametrize("argv, message", [
    (["--elastic", "-np", "2", "--transport", "mpi"], "Received: --transport mpi"),
    (["--elastic"], "an elastic job needs -np or --min-np"),
    (["-np", "2", "--min-np", "3"], "--min-np must be at most -np. Received: --min-np=3, -np=2"),
    (["-np", "2", "--min-np", "0"], "--min-np must be at least 1. Received: --min-np=0"),
    (["--elastic", "-np", "3", "--max-np", "2"], "Received: --max-np=2, -np=3"),
    (["-np", "2", "--max-np", "4"], "--max-np is for elastic jobs: add --elastic"),
    (["-np", "2", "--host-discovery-script", "x", "-H", "a:2"], "not both"),
    (["--elastic", "-np", "2", "--slots", "2"], "--slots is the slots of hosts the discovery"),
    (["--elastic", "-np", "2", "--reset-limit", "-1"], "Received: --reset-limit=-1"),
    (["--elastic", "-np", "2", "--blacklist-cooldown-range", "5", "1"],
     "Received: --blacklist-cooldown-range 5 1"),
    (["--elastic", "-np", "2", "--elastic-timeout", "0"], "Received: --elastic-timeout=0"),
])
def test_bad_elastic_options_are_explained_with_exit_code_2(capfd, argv, message):
    assert _main.main([*argv, "ls"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("keras-ring-run: ") and message in err, err


def test_bad_elastic_timeout_variable_is_explained():
    with pytest.raises(_base.LaunchError, match=r"Received: KERAS_RING_ELASTIC_TIMEOUT "
                       r"\(or HOROVOD_ELASTIC_TIMEOUT\)=soon"):
        parse("--elastic", "-np", "2", environ={"KERAS_RING_ELASTIC_TIMEOUT": "soon"})


def test_bad_engine_timeout_is_explained():
    assert _elastic_driver.read_timeout({}) == 300
    assert _elastic_driver.read_timeout({"KERAS_RING_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(_base.LaunchError, match="Received: KERAS_RING_TIMEOUT=0"):
        _elastic_driver.read_timeout({"KERAS_RING_TIMEOUT": "0"})


def test_fixed_pool():
    assert _elastic_driver.fixed_pool(parse("--elastic", "-np", "2")) == [("localhost", 2)]
    assert _elastic_driver.fixed_pool(parse("--elastic", "-np", "2", "--max-np", "3")) == [
        ("localhost", 3)]
    assert _elastic_driver.fixed_pool(parse("--elastic", "-np", "2", "-H", "a:1,b:2")) == [
        ("a", 1), ("b", 2)]
    with pytest.raises(_base.LaunchError, match="the hosts have 2 slots for -np 3"):
        _elastic_driver.fixed_pool(parse("--elastic", "-np", "3", "-H", "a:2"))


# Jobs of fake workers.

FAKE_WORKER = os.path.join(os.path.dirname(__file__), "workers", "elastic_fake_worker.py")
RUN = os.path.join(os.path.dirname(sys.executable), "keras-ring-run")
JOB_LIMIT_SECONDS = 90
# What --prefix-output puts before a worker's lines.
PREFIX = r"(?:\[[^]]+\] )?"
WAIT_SECONDS = 60


class Job:
    """`keras-ring-run --elastic ... python elastic_fake_worker.py` in its own session (after
    `prefix`, e.g. `ip netns exec NAMESPACE`), its output (stdout and stderr) read on a thread."""

    def __init__(self, tmp_path, *argv, env=None, prefix=()):
        self.finish = tmp_path / "finish"
        environ = {**os.environ, "FAKE_FINISH": str(self.finish), **(env or {})}
        self.process = subprocess.Popen(
            [*prefix, RUN, *argv, "--", sys.executable, FAKE_WORKER], env=environ,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.lines = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line.decode(errors="replace").rstrip("\n"))
                self.changed.notify_all()

    @property
    def output(self):
        with self.changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern, count=1):
        """The match of the `count`th line that matches `pattern`; fails after WAIT_SECONDS."""
        deadline = time.monotonic() + WAIT_SECONDS
        with self.changed:
            while True:
                found = [m for m in map(re.compile(pattern).search, self.lines) if m]
                if len(found) >= count:
                    return found[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self.reader.is_alive()):
                    pytest.fail(f"no line matched {pattern!r}:\n{self.output_unlocked()}")
                self.changed.wait(min(left, 1))

    def output_unlocked(self):
        return "\n".join(self.lines)

    def pid(self, place):
        """The pid of the last worker started on `place` (host:slot), once it has said it."""
        pattern = rf"^{PREFIX}worker {re.escape(place)}:\d+ pid (\d+)$"
        self.wait_for(pattern)
        return int(re.findall(pattern, self.output, re.MULTILINE)[-1])

    def kill(self):
        """Kills the driver and what is left of the job; returns the pids that were left."""
        left = leftovers(self.process.pid)
        for pid in left:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.reader.join(timeout=10)
        self.process.stdout.close()
        return left

    def finishes(self):
        """Lets the workers finish; checks that the job ends with 0; returns its output."""
        self.finish.write_text("")
        code, output, _ = self.end()
        assert code == 0, output
        return output

    def end(self):
        """Waits for the job's end; returns (exit code, output, seconds it took to end)."""
        started = time.monotonic()
        try:
            self.process.wait(timeout=JOB_LIMIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - started
        timed_out = self.process.returncode is None
        left = self.kill()
        if timed_out:
            pytest.fail(f"the job ran past {JOB_LIMIT_SECONDS} s:\n{self.output}")
        assert not left, f"left running: {sorted(left)}\n{self.output}"
        pids = [int(p) for p in re.findall(rf"^{PREFIX}worker \S+ pid (\d+)$", self.output,
                                           re.MULTILINE)]
        segments = [p for pid in pids for p in os.listdir("/dev/shm")
                    if p.startswith(f"kr-{pid}x")]
        assert not segments, segments
        return self.process.returncode, self.output, took


def leftovers(driver_pid):
    """The job's processes still there: the driver's session, and every worker's (each has its
    own session, led by the worker, whose pid the worker prints)."""
    found = set()
    result = subprocess.run(["pgrep", "-f", FAKE_WORKER], capture_output=True, text=True,
                            check=False)
    found.update(int(pid) for pid in result.stdout.split())
    result = subprocess.run(["pgrep", "-s", str(driver_pid)], capture_output=True, text=True,
                            check=False)
    found.update(int(pid) for pid in result.stdout.split())
    found.discard(os.getpid())
    return found


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(*argv, env=None, prefix=()):
        jobs.append(Job(tmp_path, *argv, env=env, prefix=prefix))
        return jobs[-1]

    yield start
    for j in jobs:
        if not j.process.stdout.closed:  # a test that failed before the job's end
            j.kill()


# How long a member may take to ask once another has: long enough for a busy 2-core machine
# not to drop a worker that is only slow; short where a stopped worker is to be dropped.
STEADY = {"KERAS_RING_TIMEOUT": "30"}
FAST = {"KERAS_RING_TIMEOUT": "3"}


def test_every_worker_finishes(job):
    # Variables a worker must not inherit: each world's rank and size come from the store.
    j = job("--elastic", "-np", "3",
            env={**STEADY, "KERAS_RING_RANK": "7", "KERAS_RING_SIZE": "9"})
    j.wait_for(r"keras-ring-run: generation 0: 3 workers "
               r"\(localhost:0=0, localhost:1=1, localhost:2=2\)")
    j.wait_for(r"worker localhost:2:2 generation 0 rank 2 size 3 step 0")
    output = j.finishes()
    assert len(re.findall(r"^worker localhost:\d:\d finished at step", output, re.MULTILINE)) == 3
    envs = re.findall(r"^worker localhost:\d:\d env (.*)$", output, re.MULTILINE)
    # The worker waits longer than the driver may take to answer: 600 + 30 + 10 s.
    assert [json.loads(e) for e in envs] == [{
        "KERAS_RING_ELASTIC": "1", "KERAS_RING_ELASTIC_TIMEOUT": "640.0",
        "KERAS_RING_RANK": None, "KERAS_RING_SIZE": None, "KERAS_RING_TRANSPORT": "tcp"}] * 3


def test_a_killed_worker_leaves_a_world_of_the_others_which_finish(job):
    j = job("--elastic", "-np", "3", "--min-np", "2", "--prefix-output", env={
        **STEADY, "FAKE_SHM": "1"})
    j.wait_for(r"generation 0: 3 workers")
    j.wait_for(r"\[localhost:0\] worker localhost:0:0 generation 0 rank 0 size 3")
    os.kill(j.pid("localhost:1"), signal.SIGKILL)
    j.wait_for(r"keras-ring-run: lost worker localhost:1 \(rank 1 of generation 0\): died of "
               r"signal 9")
    j.wait_for(r"keras-ring-run: generation 1: 2 workers \(localhost:0=0, localhost:2=1\)")
    j.wait_for(r"worker localhost:2:2 generation 1 rank 1 size 2")
    output = j.finishes()  # and the killed worker's /dev/shm file is gone
    assert "keras-ring-run: host localhost is blacklisted" in output


def test_a_stopped_worker_is_dropped_after_the_timeout(job):
    j = job("--elastic", "-np", "3", "--min-np", "2", env=FAST)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 3")
    os.kill(j.pid("localhost:1"), signal.SIGSTOP)
    j.wait_for(r"lost worker localhost:1 \(rank 1 of generation 0\): did not ask for a new "
               r"world within 3 s \(KERAS_RING_TIMEOUT\) of localhost:[02]; killed")
    j.wait_for(r"generation 1: 2 workers \(localhost:0=0, localhost:2=1\)")
    j.finishes()


def _hosts_script(tmp_path, text):
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    return hosts, f"cat {hosts}"


def test_a_job_whose_hosts_all_leave_fails_after_the_elastic_timeout(job, tmp_path):
    hosts, script = _hosts_script(tmp_path, "localhost:2\n")
    j = job("-np", "2", "--min-np", "2", "--host-discovery-script", script,
            "--elastic-timeout", "2", env=STEADY)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 2")
    hosts.write_text("")  # no capacity comes back
    code, output, _ = j.end()
    assert code == 1, output
    for name in ("localhost:0:0", "localhost:1:1"):
        assert f"worker {name} removed: host localhost left the discovery output" in output
    assert ("keras-ring-run: the elastic job failed: fewer than --min-np 2 workers for 2 s "
            "(--elastic-timeout); waiting: none. Lost workers: none.") in output


def test_below_min_np_after_a_kill_the_job_fails_within_the_elastic_timeout(job, tmp_path):
    _, script = _hosts_script(tmp_path, "localhost:2\n")
    j = job("-np", "2", "--min-np", "2", "--host-discovery-script", script,
            "--elastic-timeout", "3", env=STEADY)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 2")
    killed = time.monotonic()
    os.kill(j.pid("localhost:1"), signal.SIGKILL)
    code, output, _ = j.end()
    took = time.monotonic() - killed
    assert code == 1, output
    assert ("keras-ring-run: the elastic job failed: fewer than --min-np 2 workers for 3 s "
            "(--elastic-timeout); waiting: localhost:0. Lost workers: localhost:1 (died of "
            "signal 9 (Killed)).") in output
    assert "worker localhost:0:0 failed: fewer than --min-np 2 workers" in output
    # The survivor asks at once (its peer died), the driver waits 3 s, the survivor exits.
    assert took < 3 + REPORT_SECONDS + 20, output


def test_a_discovery_script_whose_output_changes_grows_and_shrinks_the_job(job, tmp_path):
    hosts, script = _hosts_script(tmp_path, "localhost:2\n")
    j = job("-np", "2", "--min-np", "1", "--host-discovery-script", script, env=STEADY)
    j.wait_for(r"generation 0: 2 workers \(localhost:0=0, localhost:1=1\)")
    hosts.write_text("# a comment\nlocalhost:3\n")
    j.wait_for(r"generation 1: 3 workers \(localhost:0=0, localhost:1=1, localhost:2=2\)")
    j.wait_for(r"worker localhost:2:2 generation 1 rank 2 size 3")
    hosts.write_text("localhost slots=1\n")
    j.wait_for(r"generation 2: 1 workers \(localhost:0=0\)")
    for name in ("localhost:1:1", "localhost:2:2"):
        j.wait_for(rf"worker {name} removed: host localhost has 1 slots now")
    assert "lost worker" not in j.finishes()


def test_the_reset_limit_ends_the_job(job):
    j = job("--elastic", "-np", "3", "--min-np", "1", "--reset-limit", "0", env=STEADY)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 3")
    os.kill(j.pid("localhost:1"), signal.SIGKILL)
    code, output, _ = j.end()
    assert code == 1, output
    assert ("the elastic job failed: the world has re-formed 0 times, the most --reset-limit 0 "
            "allows. Lost workers: localhost:1 (died of signal 9 (Killed)).") in output


def test_a_fixed_pool_grows_back_after_the_cooldown(job):
    j = job("--elastic", "-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "1",
            env=STEADY)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 2")
    os.kill(j.pid("localhost:1"), signal.SIGKILL)
    j.wait_for(r"host localhost is blacklisted for 1.0 s")
    j.wait_for(r"generation \d: 2 workers \(localhost:0=0, localhost:1=1\)", 2)
    j.wait_for(r"worker localhost:1:2 generation \d rank 1 size 2")
    j.finishes()


def test_a_signal_to_the_driver_ends_every_worker(job):
    j = job("--elastic", "-np", "2", env=STEADY)
    j.wait_for(r"worker localhost:1:1 generation 0 rank 1 size 2")
    os.kill(j.pid("localhost:0"), signal.SIGSTOP)  # a stopped one too
    os.kill(j.process.pid, signal.SIGTERM)
    code, output, _ = j.end()
    assert code == 128 + signal.SIGTERM, output
    assert "keras-ring-run: got SIGTERM: stopping every worker." in output


def test_a_bad_discovery_script_is_fatal_on_its_first_run(capfd):
    assert _main.main(["-np", "1", "--host-discovery-script", "echo localhost", "ls"]) == 2
    assert ("expected `host:slots` or `host slots=N` (a bare `host` needs --slots). Received: "
            "'localhost'") in capfd.readouterr().err
    assert _main.main(["-np", "1", "--host-discovery-script", "exit 3", "ls"]) == 2
    assert "the host discovery script 'exit 3' exited with code 3" in capfd.readouterr().err


def test_workers_on_other_hosts_through_the_remote_shell(job, netns_hosts):
    # Hosts of network namespaces (tests/netns_hosts.py; skipped without root).
    spec = ",".join(f"{h}:1" for h in netns_hosts.hosts)
    j = job("--elastic", "-np", "3", "--min-np", "2", "-H", spec, "--network-interface", IFACE,
            env={**netns_hosts.env(), **STEADY}, prefix=netns_hosts.exec_prefix(0))
    j.wait_for(r"generation 0: 3 workers \(host0:0=0, host1:0=1, host2:0=2\)")
    j.wait_for(r"worker host1:0:1 generation 0 rank 1 size 3")
    os.kill(j.pid("host1:0"), signal.SIGKILL)  # the hosts share the machine's pids
    j.wait_for(r"lost worker host1:0 \(rank 1 of generation 0\): died of signal 9")
    j.wait_for(r"generation 1: 2 workers \(host0:0=0, host2:0=1\)")
    j.wait_for(r"worker host2:0:2 generation 1 rank 1 size 2")
    j.finishes()
    assert not netns_hosts.pids()
    assert not netns_hosts.shm_left()
