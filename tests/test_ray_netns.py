"""keras_ring.ray on a Ray cluster of two hosts: network namespaces (tests/netns_hosts.py).

`ray start --head` runs in host0 (2 CPUs) and `ray start --address` in host1
(1 CPU), each through the hosts' remote shell (tests/netns_rsh.sh: the
host's own network, host name and /dev/shm), so the two raylets reach each
other only over the hosts' bridge. The drivers run in host0
(tests/workers/ray_netns_driver.py). A cluster of nodes that listen beyond
localhost asks for a token from every process that joins it: the test makes
one (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN).

The nodes share this machine's file system, so each has a Ray folder of its own
(`--temp-dir`, in a temporary folder of the test's), as separate machines would:
in a shared one, each node's log monitor relays every node's worker logs, each
line twice, under both nodes' addresses. `ray stop` would stop every Ray
process of the machine: the cluster ends with its namespaces' processes killed
instead.
"""

import json
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import RANK_THREAD_ENV
from elastic_checks import (
    EPOCHS,
    STEPS,
    check_training_went_on,
    losses_continue,
    read_logs,
    resets_of,
)
from netns_hosts import RSH, NetnsHosts

pytest.importorskip("ray")
if NetnsHosts.unavailable():
    pytest.skip(NetnsHosts.unavailable(), allow_module_level=True)

DRIVER = pathlib.Path(__file__).parent / "workers" / "ray_netns_driver.py"
HEAD = "10.77.0.1:6379"
RESULT = "driver's result: "  # the driver's line (ray_netns_driver.RESULT)


@pytest.fixture(scope="module")
def cluster():
    hosts = NetnsHosts(2).create()
    # Short: Ray's socket paths in its session folder must fit AF_UNIX's 107 bytes.
    root = pathlib.Path(tempfile.mkdtemp(prefix="kr-ray-"))
    env = {**os.environ, **hosts.env(), **RANK_THREAD_ENV,
           "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_ADDRESS": HEAD,
           "KERAS_BACKEND": "torch",
           # Ray's driver merges lines that differ only in numbers (the ranks' own): each apart.
           "RAY_DEDUP_LOGS": "0"}

    def shell(host, command, timeout=300, **extra):
        """`command` in `host`'s shell, in `root`; the CompletedProcess, its output merged."""
        return subprocess.run([str(RSH), f"host{host}", f"cd {root} && {command}"],
                              env={**env, **extra}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)

    try:
        for host, command in (
                (0, f"ray start --head --node-ip-address {hosts.addresses[0]} --port 6379 "
                    f"--num-cpus 2 --include-dashboard false --temp-dir {root / 'ray'}"),
                (1, f"ray start --address {HEAD} --node-ip-address {hosts.addresses[1]} "
                    f"--num-cpus 1 --temp-dir {root / 'ray1'}")):
            started = shell(host, command, timeout=120)
            assert started.returncode == 0, started.stdout[-5000:]
        yield hosts, root, shell
    finally:
        hosts.destroy()
        shutil.rmtree(root, ignore_errors=True)


def drive(cluster, scenario, **env):
    """The driver's scenario in host0: its JSON line, and its whole output."""
    _, _, shell = cluster
    result = shell(0, f"python {DRIVER} {scenario}", **env)
    assert result.returncode == 0, result.stdout[-8000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):]), result.stdout


def test_the_executors_ranks_span_both_hosts_and_end_with_identical_weights(cluster):
    outcome, output = drive(cluster, "executor")
    # Packed onto the two hosts, two workers on one: the ranks of a host are consecutive, with
    # local ranks in the same order. The host names are the namespaces' own: each rank ran on
    # the node Ray said.
    ranks = outcome["ranks"]
    assert [r[:2] for r in ranks] == [[0, 3], [1, 3], [2, 3]]
    by_host = {}
    for rank, _, local_rank, local_size, host in ranks:
        by_host.setdefault(host, []).append((rank, local_rank, local_size))
    assert sorted(by_host) == ["host0", "host1"], ranks
    assert sorted(len(on) for on in by_host.values()) == [1, 2], ranks
    for on in by_host.values():
        assert [r for r, _, _ in on] == list(range(on[0][0], on[0][0] + len(on))), ranks
        assert [(lr, ls) for _, lr, ls in on] == [(i, len(on)) for i in range(len(on))], ranks
    # One on each host (in the order Ray spreads them), each the only rank of its host.
    assert sorted((r[4], r[1:4]) for r in outcome["hosts"]) == [("host0", [2, 0, 1]),
                                                                ("host1", [2, 0, 1])]
    assert sorted(r[0] for r in outcome["hosts"]) == [0, 1]
    # Ray prefixes each worker's lines with its rank, and the address of a node not the
    # driver's: the first job's lines, each rank's own, with lines of both hosts among them
    # (Ray relays lines on its own time: one may come late, after the driver's end).
    lines = re.findall(r"\((\w+ \d+) pid=\d+(, ip=[\d.]+)?\)\S* rank (\d+) of 3 on (host\d)\n",
                       output)
    assert {host for *_, host in lines} == {"host0", "host1"}, output[-6000:]
    for prefix, ip, rank, host in lines:
        assert (prefix, ip) == (f"rank {rank}", ", ip=10.77.0.2" if host == "host1" else ""), \
            output[-6000:]
    assert outcome["starts_differ"] == [True, True]
    assert outcome["ends_identical"] == [True, True]


@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_the_trainer_runs_a_worker_on_each_host_under_jax(cluster, tmp_path):
    metrics, _ = drive(cluster, "trainer", KR_TEST_LOG=str(tmp_path))
    assert metrics["epoch"] == 1 and metrics["identical"], metrics
    assert [(r["rank"], r["size"], tuple(r["local"])) for r in metrics["ranks"]] == [
        (0, 2, (0, 1)), (1, 2, (0, 1))]
    assert sorted(r["host"] for r in metrics["ranks"]) == ["host0", "host1"]
    assert sum(r["rows"] for r in metrics["ranks"]) == 32


def test_elastic_a_worker_killed_mid_fit_leaves_the_others_training_across_hosts(
        cluster, tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    outcome, output = drive(cluster, "elastic", KR_TEST_LOG=str(log_dir),
                            KR_TEST_EPOCHS=str(EPOCHS), KR_TEST_STEPS=str(STEPS),
                            KR_TEST_FAULT="11:1:KILL", KERAS_RING_TIMEOUT="30")
    assert "names" in outcome, outcome
    logs = read_logs(log_dir)
    check_training_went_on(subprocess.CompletedProcess("driver", 0, output), logs, survivors=2)
    resets = resets_of(logs)
    assert len(resets) == 2 and all(r["size"] == 2 for r in resets), resets
    assert all(r["iterations"] == 10 for r in resets), resets  # the last commit before step 11
    losses_continue(logs)
    assert re.search(r"lost worker \S+ \(rank 1 of generation 0\): its Ray actor \(pid \d+\) "
                     r"died", output), output[-6000:]
    # Workers are named after their node's address: the first world had three on both
    # hosts, and whichever the second rank was, the survivors are one on each.
    first = re.search(r"generation 0: 3 workers \((.*)\)", output)
    assert first and {"10.77.0.1", "10.77.0.2"} == set(re.findall(r"10\.77\.0\.\d", first[1]))
    assert sorted(name.split("-")[0] for name in outcome["names"]) == ["10.77.0.1", "10.77.0.2"]
    # Ray prefixes a worker's lines with its place, and the address of a node not the
    # driver's: Keras's progress output, from the first epoch on (Ray relays lines on its own
    # time, and the last ones of a job that ends the driver's script may come after its end).
    for name in outcome["names"]:
        place = name.rsplit(":", 1)[0]
        ip = ", ip=10.77.0.2" if place.startswith("10.77.0.2-") else ""
        assert re.search(rf"\({place} pid=\d+{ip}\)\S* Epoch 1/{EPOCHS}\n", output), \
            output[-6000:]
    hosts, _, _ = cluster
    assert [p for p in hosts.shm_left() if os.path.basename(p).startswith("kr-")] == []
