"""Hosts made of Linux network namespaces, for real multi-host jobs on one machine.

`NetnsHosts(n)` makes n "hosts", each a network namespace with its own
loopback and one interface, `krnet0`, at 10.77.0.<i+1>/24. The interfaces are
veth pairs whose other ends sit on a bridge in one more namespace, the switch:
the root namespace holds none of them, so the hosts reach each other and
nothing else, and nothing outside reaches them (the root namespace's route to
10.77.0.0/24, if any, is its default route, away from the bridge).

Jobs start inside the first host (`ip netns exec`), where `keras-ring-run`
runs Hydra's `mpiexec`. Hydra reaches every host, the first included, through
the remote shell `tests/netns_rsh.sh` (`--remote-shell`), which runs its proxy
in that host's namespace with its own host name and /dev/shm. Host names
(`host0`, `host1`, ...) resolve nowhere, so Hydra takes none of them for its
own host and starts every proxy through the remote shell; no name lookup is
needed, as Hydra hands the remote shell the name and its proxies connect back
to the address of `HYDRA_IFACE`.

Names are unique per owner (`krnet-<pid>.<start time>-...`), so parallel runs
do not collide; the namespaces and /dev/shm folders of owners that no longer
run (a crashed run) are removed when the next set is made. `destroy()` kills
whatever still runs in the namespaces, deletes them (which deletes their veths)
and removes the hosts' /dev/shm folders.

Needs root, `ip` with `netns`, veth and bridge support, `unshare` and `mount`;
`NetnsHosts.unavailable()` says why not, for a skip.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

PREFIX = "krnet-"
SUBNET = "10.77.0"
IFACE = "krnet0"
RSH = Path(__file__).with_name("netns_rsh.sh")
_NETNS_DIR = Path("/run/netns")
_SHM_DIR = Path("/dev/shm")
_OWNER = re.compile(rf"{PREFIX}(\d+)\.(\d+)-")


def _start_time(pid):
    """The start time of process `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _ip(*args, namespace=None):
    command = ["ip", *args]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=30).stdout


class NetnsHosts:
    """`count` network-namespace hosts on one bridge.

    Args:
        count: How many hosts.
        owner: "PID.START_TIME" of the process the hosts belong to; this one by
            default (tests give another to make stale hosts).

    Attributes:
        hosts: The host names, `host0`, `host1`, ...: give them to `-H`.
        namespaces: The network namespace of each host.
        addresses: Each host's address, 10.77.0.1, 10.77.0.2, ...
        switch: The namespace of the bridge.
        shm: Each host's /dev/shm, a folder of the machine's /dev/shm.
    """

    def __init__(self, count, owner=None):
        # Its pid and start time: a later pid of the same number is another owner.
        self.owner = owner or f"{os.getpid()}.{_start_time(os.getpid())}"
        self.hosts = [f"host{i}" for i in range(count)]
        self.namespaces = [f"{PREFIX}{self.owner}-h{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.switch = f"{PREFIX}{self.owner}-sw"
        self.shm_root = _SHM_DIR / f"{PREFIX}{self.owner}"
        self.shm = [self.shm_root / host for host in self.hosts]

    @staticmethod
    def unavailable():
        """Why network-namespace hosts cannot be made here, or None when they can."""
        if os.geteuid() != 0:
            return "network-namespace hosts need root"
        for tool in ("ip", "unshare", "mount", "hostname"):
            if shutil.which(tool) is None:
                return f"network-namespace hosts need `{tool}`, which is not on the PATH"
        try:
            _ip("netns", "list")
        except (OSError, subprocess.SubprocessError) as e:
            return f"`ip netns` is not available: {getattr(e, 'stderr', '') or e}"
        return None

    def create(self):
        """Makes the namespaces, the bridge and the veths (after removing stale ones)."""
        remove_stale()
        try:
            self.shm_root.mkdir(mode=0o755)
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
            _ip("link", "set", "br0", "up", namespace=self.switch)
            for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
                self.shm[i].mkdir(mode=0o1777)
                self.shm[i].chmod(0o1777)  # as /dev/shm
                _ip("netns", "add", namespace)
                _ip("link", "set", "lo", "up", namespace=namespace)
                port = f"port{i}"
                _ip("link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", namespace,
                    namespace=self.switch)
                _ip("link", "set", port, "master", "br0", namespace=self.switch)
                _ip("link", "set", port, "up", namespace=self.switch)
                _ip("addr", "add", f"{address}/24", "dev", IFACE, namespace=namespace)
                _ip("link", "set", IFACE, "up", namespace=namespace)
            # What the remote shell does: a host name and a /dev/shm of the host's own.
            subprocess.run([*self.exec_prefix(0), "unshare", "--uts", "/bin/sh", "-c",
                            'hostname "$1" && mount --bind "$2" /dev/shm', "probe",
                            self.hosts[0], str(self.shm[0])],
                           check=True, capture_output=True, text=True, timeout=30)
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self):
        """Stops what still runs in the hosts, deletes the namespaces and the hosts' /dev/shm."""
        _destroy([*self.namespaces, self.switch], [self.shm_root])

    def env(self):
        """The environment a job across these hosts needs, besides the test's own."""
        return {
            "KR_NETNS_HOSTS": " ".join(f"{h}={n}" for h, n in zip(self.hosts, self.namespaces)),
            "KR_NETNS_SHM": str(self.shm_root),
            "KERAS_RING_REMOTE_SHELL": str(RSH),
            # Hydra's control connections: mpiexec tells its proxies the address of this
            # interface (by default its host name, which here is the machine's).
            "HYDRA_IFACE": IFACE,
            # The MPI traffic over the hosts' interfaces. UCX (the PyPI mpich's default netmod)
            # sees that the namespaces are one machine and would move the data through its
            # shared-memory and cross-memory-attach transports: TCP only, as between hosts.
            "UCX_NET_DEVICES": IFACE,
            "UCX_TLS": "self,tcp",
            "FI_TCP_IFACE": IFACE,
            "FI_SOCKETS_IFACE": IFACE,
        }

    def exec_prefix(self, host=0):
        """The command prefix that runs a command in a host's namespace (the machine's /dev/shm)."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def port_bytes(self):
        """Bytes received plus sent by each host's bridge port so far."""
        files = [f"/sys/class/net/port{i}/statistics/{way}_bytes"
                 for i in range(len(self.hosts)) for way in ("rx", "tx")]
        # `ip netns exec` mounts the namespace's own /sys.
        counts = subprocess.run(["ip", "netns", "exec", self.switch, "cat", *files], check=True,
                                capture_output=True, text=True, timeout=30).stdout.split()
        return [int(counts[2 * i]) + int(counts[2 * i + 1]) for i in range(len(self.hosts))]

    def pids(self):
        """The processes that run in any of the hosts' namespaces."""
        return _namespace_pids([*self.namespaces, self.switch])

    def shm_left(self):
        """What the jobs left in the hosts' /dev/shm, as paths."""
        return sorted(str(p) for d in self.shm if d.exists() for p in d.iterdir())

    def netns_inode(self, host):
        """The inode that identifies a host's network namespace (/proc/PID/ns/net's)."""
        return os.stat(_NETNS_DIR / self.namespaces[host]).st_ino


def _namespace_pids(namespaces):
    pids = set()
    for namespace in namespaces:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            pids.update(int(p) for p in _ip("netns", "pids", namespace).split())
    return pids


def kill_namespace_processes(namespaces, grace=5.0):
    """SIGTERM, then after `grace` seconds SIGKILL, to every process in `namespaces`."""
    pids = _namespace_pids(namespaces)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _namespace_pids(namespaces)
        if not pids:
            return


def _destroy(namespaces, shm_dirs):
    present = [n for n in namespaces if (_NETNS_DIR / n).exists()]
    kill_namespace_processes(present)
    for namespace in present:
        # Deleting a namespace deletes the veth ends in it, and with them their peers.
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _ip("netns", "delete", namespace)
    for directory in shm_dirs:
        shutil.rmtree(directory, ignore_errors=True)


def remove_stale():
    """Removes the namespaces and /dev/shm folders of owners that no longer run."""
    names = [p.name for p in _NETNS_DIR.iterdir()] if _NETNS_DIR.is_dir() else []
    shm = [p.name for p in _SHM_DIR.iterdir() if p.name.startswith(PREFIX)]

    def stale(name):
        match = _OWNER.match(name + "-")
        return match and _start_time(int(match[1])) != int(match[2])

    _destroy([n for n in names if stale(n)], [_SHM_DIR / n for n in shm if stale(n)])
