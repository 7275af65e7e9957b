"""Jobs across real hosts: hosts made of network namespaces (tests/netns_hosts.py).

`keras-ring-run -H host0:2,host1:2 --remote-shell tests/netns_rsh.sh` runs in the
first host's namespace and starts Hydra's `mpiexec` there; Hydra starts a proxy
on every host through the remote shell, and the ranks' MPI traffic between hosts
is TCP over the hosts' veths and bridge. With `--transport tcp` keras-ring-run
starts the ranks through the remote shell itself and serves their rendezvous
store on host0's address; the TCP world's sockets take the same way. Needs root
and `ip netns` (skipped otherwise). See docs/launching.md, "How multi-host jobs are tested".
"""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_job
from netns_hosts import IFACE, NetnsHosts, kill_namespace_processes, remove_stale

WORKERS = Path(__file__).parent / "workers"
# engine_worker.py's largest allreduce (float32): every byte of it crosses between the hosts.
BIG_BYTES = 4 * (4 * 1024 * 1024 + 3)
# How long the hosts get to be left by the job's processes after the launcher has exited.
DRAIN_SECONDS = 10


def run_across(hosts, slots, script, *args, timeout=300, env=None, check=True, transport=None):
    """Runs `script` as ranks on `slots[i]` ranks of host i, launched from host 0.

    `transport="tcp"`: over the TCP world, its store on host 0's interface.

    Fails the test, as `run_ranks` does, on a non-zero exit code or past `timeout`;
    and if a process is left in a host once the job has ended, or a file in a
    host's /dev/shm. Whatever happens, nothing of the job is left behind.
    """
    spec = ",".join(f"{host}:{n}" for host, n in zip(hosts.hosts, slots))
    command = [
        *hosts.exec_prefix(0),
        os.path.join(os.path.dirname(sys.executable), "keras-ring-run"),
        "-np", str(sum(slots)), "-H", spec,
        *(["--transport", "tcp", "--network-interface", IFACE] if transport == "tcp" else []),
        "--",
        sys.executable, str(script), *map(str, args),
    ]
    try:
        result = run_job(command, f"job {script.name} on {spec}", timeout=timeout,
                         env={**hosts.env(), **(env or {})}, check=check)
    except BaseException:
        _clear_hosts(hosts)
        raise
    deadline = time.monotonic() + DRAIN_SECONDS
    while hosts.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: _command_line(pid) for pid in hosts.pids()}
    shm = _clear_hosts(hosts)
    assert not left, f"processes left in the hosts after the job: {left}"
    assert not shm, f"shared-memory files left in the hosts' /dev/shm: {shm}"
    return result


def _clear_hosts(hosts):
    """Kills what runs in the hosts, empties their /dev/shm; returns the files it removed."""
    kill_namespace_processes(hosts.namespaces)
    shm = hosts.shm_left()
    for path in shm:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return shm


def _command_line(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _where(output):
    """{rank: the `where` line of netns_worker.py}."""
    return {int(rank): json.loads(line)
            for rank, line in re.findall(r"^rank (\d+): where (\{.*\})$", output, re.M)}


@pytest.mark.timeout(60)
def test_the_hosts_reach_each_other_and_only_each_other(netns_hosts):
    # A listener on host0's address, and connections to it from host1 and from the root
    # namespace (this test's), which has no interface on 10.77.0.0/24.
    address = netns_hosts.addresses[0]
    server = subprocess.Popen(
        [*netns_hosts.exec_prefix(0), sys.executable, "-c",
         "import socket, sys\n"
         f"s = socket.create_server(('{address}', 5599)); s.settimeout(15)\n"
         "print('listening', flush=True)\n"
         "c, peer = s.accept(); print('accepted', peer[0], c.recv(16).decode(), flush=True)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "listening\n"
        # The root namespace's route to the hosts is its default route, away from the bridge;
        # on some machines a gateway accepts any connection, so only the listener can tell.
        try:
            with socket.create_connection((address, 5599), timeout=3) as c:
                c.sendall(b"root")
        except OSError:
            pass  # no route: as it should be
        subprocess.run(
            [*netns_hosts.exec_prefix(1), sys.executable, "-c",
             f"import socket; socket.create_connection(('{address}', 5599), timeout=5)"
             ".sendall(b'host1')"], check=True, timeout=30)
        out, _ = server.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    assert out == f"accepted {netns_hosts.addresses[1]} host1\n"
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "10.77.0." not in addresses


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grouping, transport", [("hostname", "mpi"), ("system", "mpi"),
                                                 ("system", "tcp")])
def test_engine_collectives_across_hosts(netns_hosts, grouping, transport, tmp_path):
    # Every collective against NumPy (engine_worker.py) on 2 hosts x 2 ranks: the hierarchical
    # allreduce (shared memory within a host, MPI across) over TCP between the namespaces.
    # "hostname": the engine groups ranks by KERAS_RING_HOSTNAME, as the remote shell sets it;
    # "system": by each host's own name (gethostname: the remote shell gives each namespace its
    # own), as on a real cluster.
    # The user's environment reaches every rank, and no value of it is on the remote shell's
    # command line (which every user of either host sees in `ps`), the job's secret included.
    canary = f"canary-{os.getpid()}-{time.time_ns()}"
    remote_shell_log = tmp_path / "remote_shell_argv"
    remote_shell = tmp_path / "logging_rsh.sh"
    remote_shell.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {remote_shell_log}\n'
                            f'exec {netns_hosts.env()["KERAS_RING_REMOTE_SHELL"]} "$@"\n')
    remote_shell.chmod(0o755)
    env = {"KR_TEST_EXPECTED_SIZE": "4", "KR_TEST_PATH": "hierarchical", "KR_TEST_LOCAL_SIZE": "2",
           "KR_NETNS_SET_HOSTNAME": "1" if grouping == "hostname" else "0",
           "KR_TEST_CANARY": canary, "KERAS_RING_REMOTE_SHELL": str(remote_shell)}
    before = netns_hosts.port_bytes()
    result = run_across(netns_hosts, [2, 2], WORKERS / "netns_worker.py", env=env, timeout=240,
                        transport=transport)
    moved = [after - b for after, b in zip(netns_hosts.port_bytes(), before)]
    command_lines = remote_shell_log.read_text()
    assert "host1" in command_lines
    assert canary not in command_lines and "KERAS_RING_SECRET" not in command_lines, command_lines
    for rank in range(4):
        assert f"rank {rank}: test_restart ok" in result.stdout
    where = _where(result.stdout)
    assert sorted(where) == [0, 1, 2, 3], result.stdout
    for rank, seen in where.items():
        host = rank // 2
        # Each rank ran in its host's network namespace, under its host's name.
        assert seen["netns"] == netns_hosts.netns_inode(host)
        assert seen["hostname"] == netns_hosts.hosts[host]
        expected_name = netns_hosts.hosts[host] if grouping == "hostname" else None
        assert seen["KERAS_RING_HOSTNAME"] == expected_name
        assert seen["canary"] == canary
        assert (seen["local_rank"], seen["local_size"]) == (rank % 2, 2)
        assert (seen["cross_rank"], seen["cross_size"]) == (host, 2)
        # The allreduces took the hierarchical path (test_transport checked it too).
        stats = seen["stats"]
        assert stats["hierarchical_collectives"] > 0, stats
        assert stats["hierarchical_collectives"] == stats["shm_collectives"], stats
    # The data crossed between the hosts through their bridge ports: each host sent and received
    # at least every allreduce's bytes (the largest alone is 16 MiB).
    assert moved[0] > 2 * BIG_BYTES and moved[1] > 2 * BIG_BYTES, moved
    assert moved[2] < 64 * 1024, moved  # the third host took no part


@pytest.mark.multirank
@pytest.mark.timeout(300)
# On the default world: the TCP world across these hosts is test_engine_collectives_across_hosts's.
@pytest.mark.parametrize("transport", ["mpi"])
def test_keras_equivalence_across_hosts(netns_hosts, transport):
    # The decisive Keras test (tests/test_keras_equivalence.py) with its ranks on 2 hosts.
    before = netns_hosts.port_bytes()
    run_across(netns_hosts, [1, 1], WORKERS / "keras_equivalence_worker.py", "core",
               timeout=240, transport=transport)
    moved = [after - b for after, b in zip(netns_hosts.port_bytes(), before)]
    assert moved[0] > 100_000 and moved[1] > 100_000, moved


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_job_stopped_at_its_timeout_leaves_nothing_in_the_hosts(netns_hosts):
    script = Path(os.getcwd()) / "hang.py"
    script.write_text("import time\nimport keras_ring as kr\nkr.init()\n"
                      "print('rank', kr.rank(), 'up', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception, match="ran past 20 s"):
        run_across(netns_hosts, [2, 1], script, timeout=20)
    assert not netns_hosts.pids()
    assert not netns_hosts.shm_left()


@pytest.mark.timeout(60)
def test_stale_hosts_of_a_run_that_died_are_removed(netns_hosts):
    # Named for an owner that no longer runs: this pid, started at another time (the pid reused).
    pid, start = netns_hosts.owner.split(".")
    stale = NetnsHosts(1, owner=f"{pid}.{int(start) + 1}")
    stale.create()
    try:
        assert Path("/run/netns", stale.namespaces[0]).exists() and stale.shm[0].is_dir()
        remove_stale()
        assert not Path("/run/netns", stale.namespaces[0]).exists()
        assert not Path("/run/netns", stale.switch).exists()
        assert not stale.shm_root.exists()
        # A live owner's hosts stay.
        assert all(Path("/run/netns", n).exists() for n in netns_hosts.namespaces)
        assert netns_hosts.shm_root.is_dir()
    finally:
        stale.destroy()
