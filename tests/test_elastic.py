"""Elastic training end to end: `keras-ring-run --elastic` with Keras workers and real faults.

Each test runs tests/workers/elastic_train_worker.py (a user's script: model.fit
with kr.elastic's state, callbacks and run) under the real driver, injects a
fault (SIGKILL, SIGSTOP, a kill inside the recovery, hosts leaving and coming
back), and checks from the workers' logs that training went on where the last
commit left it: every optimizer step applied exactly once, identical weights
on the survivors, a loss that continues instead of restarting. Every job has
a hard timeout, and none may leave a process or a shared-memory segment.
"""

import glob
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import RANK_THREAD_ENV
from elastic_checks import (
    EPOCHS,
    STEPS,
    check_training_went_on,
    events_of,
    losses_continue,
    read_logs,
    resets_of,
    shm_segments,
)
from netns_hosts import IFACE

WORKERS = pathlib.Path(__file__).parent / "workers"
ROOT = pathlib.Path(__file__).parent.parent
JOB_TIMEOUT = 420


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _processes_with(marker):
    """Pids of live processes whose environment holds `marker`."""
    pids = [int(path.split("/")[2]) for path in glob.glob("/proc/[0-9]*/environ")]
    return [p for p in pids if p != os.getpid() and marker.encode() in _environ(p)]


def run_elastic(tmp_path, launcher_args, env=None, timeout=JOB_TIMEOUT, prefix=(),
                worker="elastic_train_worker.py"):
    """Runs a training worker under `keras-ring-run --elastic`; returns (result, logs).

    logs: {worker: [events]}. `prefix` goes before the command (`ip netns exec HOST`).
    """
    log_dir = tmp_path / "logs"
    log_dir.mkdir(parents=True)
    full_env = {**os.environ, **RANK_THREAD_ENV, "KR_TEST_LOG": str(log_dir),
                "KR_TEST_EPOCHS": str(EPOCHS), "KR_TEST_STEPS": str(STEPS),
                "KERAS_RING_TIMEOUT": "8", **(env or {})}
    before = shm_segments()
    command = [*prefix, "keras-ring-run", "--elastic", *launcher_args, sys.executable,
               str(WORKERS / worker)]
    process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        for pid in _processes_with(str(log_dir)):
            os.kill(pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"the elastic job did not end within {timeout} s:\n{out[-6000:]}")
    deadline = time.monotonic() + 10
    while _processes_with(str(log_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(str(log_dir))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}\n{out[-6000:]}"
    assert shm_segments() - before == set(), out[-6000:]
    return subprocess.CompletedProcess(command, process.returncode, out), read_logs(log_dir)


def _hosts(request, where, count=3):
    """(launcher args, environment, command prefix, each slot's host) for one host, or `count`
    hosts made of network namespaces (tests/netns_hosts.py) with one slot each."""
    if where == "one-host":
        return [], {}, (), ["localhost"] * count
    netns_hosts = request.getfixturevalue("netns_hosts")
    spec = ",".join(f"{h}:1" for h in netns_hosts.hosts[:count])
    return (["-H", spec, "--network-interface", IFACE], netns_hosts.env(),
            netns_hosts.exec_prefix(0), netns_hosts.hosts)


@pytest.mark.multirank
@pytest.mark.parametrize(("start_rank", "fault", "backend"),
                         [(1, "KILL", "tensorflow"), (0, "KILL", "tensorflow"),
                          (2, "RAISE", "tensorflow"), (1, "KILL", "jax"),
                          (1, "KILL", "torch")],
                         ids=["rank1", "rank0", "rank2-raises", "rank1-jax", "rank1-torch"])
def test_a_lost_worker_leaves_the_others_training_from_the_last_commit(tmp_path, start_rank,
                                                                        fault, backend):
    result, logs = run_elastic(tmp_path, ["-np", "3", "--min-np", "2"],
                               env={"KR_TEST_FAULT": f"11:{start_rank}:{fault}",
                                    "KERAS_BACKEND": backend})
    check_training_went_on(result, logs, survivors=2)
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["size"] == 2 for r in resets), resets
    # The last commit before the kill at step 11 was step 10 (a commit every 2 steps).
    assert all(r["iterations"] == 10 for r in resets), resets
    losses_continue(logs)
    assert "lost" in result.stdout
    assert f"on {backend}" in result.stdout


@pytest.mark.multirank
def test_a_torch_loop_with_keras_ring_torch_elastic_goes_on_from_the_last_commit(tmp_path):
    # Horovod's PyTorch elastic API (workers/elastic_torch_worker.py), rank 1 killed.
    result, logs = run_elastic(tmp_path, ["-np", "3", "--min-np", "2"],
                               env={"KR_TEST_FAULT": "11:1:KILL"},
                               worker="elastic_torch_worker.py")
    check_training_went_on(result, logs, survivors=2)
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["size"] == 2 for r in resets), resets
    assert all(r["iterations"] == 10 for r in resets), resets
    losses_continue(logs)
    assert result.stdout.count("on torch (keras imported: False, tensorflow imported: False)") == 2


@pytest.mark.multirank
def test_a_stopped_worker_is_dropped_after_the_timeout(tmp_path):
    result, logs = run_elastic(tmp_path, ["-np", "3", "--min-np", "2"],
                               env={"KR_TEST_FAULT": "11:2:STOP", "KERAS_RING_TIMEOUT": "5"})
    check_training_went_on(result, logs, survivors=2)
    assert all(r["size"] == 2 for r in resets_of(logs))


@pytest.mark.multirank
@pytest.mark.parametrize(("start_rank", "fault"), [(0, "KILL"), (1, "STOP")],
                         ids=["rank0-killed", "rank1-stopped"])
def test_across_namespace_hosts_a_lost_worker_leaves_the_others_training(
        tmp_path, netns_hosts, start_rank, fault):
    # One worker on each of three hosts made of network namespaces (tests/netns_hosts.py).
    spec = ",".join(f"{h}:1" for h in netns_hosts.hosts)
    result, logs = run_elastic(
        tmp_path, ["-np", "3", "--min-np", "2", "-H", spec, "--network-interface", IFACE],
        env={**netns_hosts.env(), "KR_TEST_FAULT": f"11:{start_rank}:{fault}",
             "KERAS_RING_TIMEOUT": "5"},
        prefix=netns_hosts.exec_prefix(0))
    check_training_went_on(result, logs, survivors=2)
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["iterations"] == 10 for r in resets), resets
    lost = netns_hosts.hosts[start_rank]
    assert f"lost worker {lost}:0 (rank {start_rank} of generation 0)" in result.stdout
    assert not netns_hosts.pids()
    assert not netns_hosts.shm_left()


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["one-host", "namespace-hosts"])
def test_a_worker_killed_during_the_recovery_is_dropped_too(tmp_path, request, where):
    args, env, prefix, _ = _hosts(request, where)
    result, logs = run_elastic(tmp_path, ["-np", "3", "--min-np", "1", *args], prefix=prefix,
                               env={**env, "KR_TEST_FAULT": "11:2:KILL",
                                    "KR_TEST_FAULT_IN_RESET": "1"})
    check_training_went_on(result, logs, survivors=1)
    assert resets_of(logs)[-1]["size"] == 1


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["one-host", "namespace-hosts"])
def test_below_min_np_the_job_ends_with_an_error_naming_the_lost_workers(tmp_path, request,
                                                                         where):
    args, env, prefix, hosts = _hosts(request, where, count=2)  # no slot for a new worker
    start = time.monotonic()
    result, logs = run_elastic(
        tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "5", *args], prefix=prefix,
        env={**env, "KR_TEST_FAULT": "5:1:KILL"}, timeout=300)
    assert result.returncode != 0, result.stdout[-6000:]
    lost = f"{hosts[1]}:{1 if where == 'one-host' else 0}"
    assert "min-np" in result.stdout and lost in result.stdout, result.stdout[-6000:]
    assert time.monotonic() - start < 240


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_job_lost_whole_resumes_from_its_backup_and_its_recoveries_from_the_commits(
        tmp_path, backend):
    backup = tmp_path / "backup"
    # Below --min-np at step 19 (epoch 2): the job ends; rank 0's backup holds epoch 2's start.
    first, first_logs = run_elastic(
        tmp_path / "first", ["-np", "2", "--min-np", "2", "--elastic-timeout", "5"],
        env={"KR_TEST_FAULT": "19:1:KILL", "KR_TEST_BACKUP_DIR": str(backup),
             "KERAS_BACKEND": backend}, timeout=300)
    assert first.returncode != 0 and "min-np" in first.stdout, first.stdout[-6000:]
    assert json.loads((backup / "training_metadata.json").read_text())["epoch"] == 2
    # Run again: every worker starts from the backup; a kill at step 27 costs one step.
    result, logs = run_elastic(tmp_path / "second", ["-np", "3", "--min-np", "2"],
                               env={"KR_TEST_FAULT": "27:1:KILL",
                                    "KR_TEST_BACKUP_DIR": str(backup),
                                    "KERAS_BACKEND": backend})
    check_training_went_on(result, logs, survivors=2)
    for worker, events in logs.items():
        restored = events[0]  # the backup, taken as the state's first commit
        assert (restored["event"], restored["iterations"], restored["epoch"]) == (
            "commit", 2 * STEPS, 2), (worker, events[:2])
        assert events_of(events, "step")[0]["iterations"] == 2 * STEPS + 1, worker
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["iterations"] == 26 for r in resets), resets
    first_loss = events_of(first_logs[min(first_logs)], "step")[0]["loss"]
    resumed_loss = events_of(logs[min(logs)], "step")[0]["loss"]
    assert resumed_loss < first_loss / 4, (first_loss, resumed_loss)
    assert not backup.exists()  # rank 0 deleted it when the training completed


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["one-host", "namespace-hosts"])
def test_a_host_removed_then_added_back_shrinks_then_grows_the_job(tmp_path, request, where):
    if where == "one-host":  # two names of this host: localhost and 127.0.0.1
        all_hosts, gone, extra, prefix = "localhost:2\n127.0.0.1:1\n", "127.0.0.1", {}, ()
        stay = ["localhost_0_0", "localhost_1_1"]
    else:
        netns_hosts = request.getfixturevalue("netns_hosts")
        all_hosts = "".join(f"{h}:1\n" for h in netns_hosts.hosts)
        gone, extra = netns_hosts.hosts[2], {**netns_hosts.env(), "KERAS_RING_TIMEOUT": "20"}
        prefix = netns_hosts.exec_prefix(0)
        stay = ["host0_0_0", "host1_0_1"]
    hosts = tmp_path / "hosts"
    hosts.write_text(all_hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    phases = [[all_hosts.replace(f"{gone}:1\n", ""), 2], [all_hosts, 3]]
    args = ["-np", "3", "--min-np", "2", "--host-discovery-script", str(script)]
    if where != "one-host":
        args += ["--network-interface", IFACE]
    result, logs = run_elastic(
        tmp_path, args, prefix=prefix,
        env={"KR_TEST_HOSTS_FILE": str(hosts), "KR_TEST_HOSTS_PHASES": json.dumps(phases),
             "KR_TEST_HOSTS_FROM": "6", "KR_TEST_EPOCHS": "8", **extra})
    assert result.returncode == 0, result.stdout[-8000:]
    assert [r["size"] for r in resets_of(logs) if r["rank"] == 0] == [2, 3], result.stdout[-8000:]
    ended = {w: events_of(ev, "end")[0] for w, ev in logs.items() if events_of(ev, "end")}
    # The removed worker left (exit 0); a new one took its host's slot.
    newcomer = f"{gone}_0_3"
    assert sorted(ended) == sorted([newcomer, *stay]), sorted(logs)
    assert all(e["iterations"] == 8 * STEPS for e in ended.values()), ended
    assert all(e["weights"] == ended[stay[0]]["weights"] for e in ended.values())
    assert "leaves the job" in result.stdout
    # The newcomer started from the committed state, not from scratch.
    first = events_of(logs[newcomer], "step")[0]
    assert first["iterations"] > 8 and first["size"] == 3, first
    assert first["loss"] < events_of(logs[stay[0]], "step")[0]["loss"] / 4, first


@pytest.mark.multirank
def test_the_worked_example_of_the_docs_survives_a_kill_as_written(tmp_path):
    text = (ROOT / "docs" / "elastic.md").read_text()
    (tmp_path / "train.py").write_text(
        re.search(r"## A worked example.*?```python\n(.*?)```", text, re.DOTALL)[1])
    marker = f"KR_TEST_MARKER={tmp_path}"
    env = {**os.environ, **RANK_THREAD_ENV, "KR_TEST_MARKER": str(tmp_path),
           "KERAS_RING_TIMEOUT": "20"}
    before = shm_segments()
    process = subprocess.Popen(
        ["keras-ring-run", "--elastic", "-np", "3", "--min-np", "2", sys.executable, "train.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("Epoch 3/") for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            time.sleep(0.1)
        victim = [pid for pid in _processes_with(marker)
                  if b"KERAS_RING_WORKER=localhost:1:" in _environ(pid)]
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        reader.join(timeout=10)
        process.stdout.close()
    out = "".join(lines)
    assert process.returncode == 0, out[-6000:]
    assert "lost worker localhost:1 (rank 1 of generation 0): died of signal 9" in out, out[-6000:]
    assert "generation 1: 2 workers" in out, out[-6000:]
    found = re.search(r"trained \d+ steps, 2 workers at the end, accuracy ([\d.]+)", out)
    assert found and float(found[1]) > 0.9, out[-6000:]
    assert not _processes_with(marker)
    assert shm_segments() - before == set()
