"""Jobs of the TCP world: `keras-ring-run --transport tcp` starts the ranks itself.

No MPI launcher is involved. This process serves the job's rendezvous store
(`_rendezvous.RendezvousServer`), authenticated with a secret made for the
job, starts every rank with its rank, size, the store's address and the
secret in its environment (ranks on other hosts through the remote shell,
the secret on the shell's stdin, never on a command line), relays their
output, and ends the job when one rank fails: the others have `_REPORT_SECONDS`
to fail by themselves, naming it, then get SIGCONT and SIGTERM (a stopped
rank must wake to die), then SIGKILL after `_GRACE_SECONDS`. A one-host
job's store and ranks listen on loopback only.
"""

import fcntl
import os
import secrets
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time

from keras_ring import _launcher
from keras_ring._rendezvous import RendezvousServer

# Once a rank has failed: how long the others have to fail by themselves (their engines
# notice its connection drop at once, and say so), then how long after SIGTERM before SIGKILL.
_REPORT_SECONDS = 2
_GRACE_SECONDS = 10
# Variables that describe this shell, not the job: not sent to other hosts.
_LOCAL_ONLY_ENV = frozenset(["_", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "HOME", "TERM",
                             "DISPLAY", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK"])
SECRET_VARIABLE = "KERAS_RING_SECRET"


def placement(options):
    """The host of each rank, in rank order: None for this host.

    Hosts fill in the order given, each up to its slots (`-H a:2,b:2`, or a
    host file with `host`, `host:slots` or `host slots=N` lines).
    """
    hosts = options.hosts
    if options.hostfile is not None:
        hosts = read_hostfile(options.hostfile)
    if not hosts:
        return [None] * options.np
    slots = []
    for host, count in hosts:
        slots += [None if _is_this_host(host) else host] * count
    if len(slots) < options.np:
        raise _launcher.LaunchError(
            f"the hosts have {len(slots)} slots for {options.np} ranks; give more slots "
            "(host:slots) or fewer ranks.")
    return slots[:options.np]


def read_hostfile(path):
    """[(host, slots)] from a host file; raises LaunchError naming a bad line."""
    hosts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise _launcher.LaunchError(f"cannot read the host file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, _, slots = words[0].partition(":")
        for word in words[1:]:
            if word.startswith("slots="):
                slots = word[len("slots="):]
        if not host or (slots and not (slots.isdigit() and int(slots) > 0)):
            raise _launcher.LaunchError(
                f"{path}:{number}: expected `host`, `host:slots` or `host slots=N`. "
                f"Received: {line!r}")
        hosts.append((host, int(slots or 1)))
    return hosts


def _is_this_host(host):
    name = socket.gethostname()
    return host in {"localhost", "127.0.0.1", name, name.split(".")[0]}


def interface_address(interface):
    """The IPv4 address of a network interface; raises LaunchError if it has none."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr,
                                 struct.pack("256s", interface.encode()[:15]))
        except OSError as e:
            raise _launcher.LaunchError(
                f"--network-interface {interface}: no IPv4 address ({e.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def _store_host(options, remote_hosts):
    """Where the store listens and where the ranks reach it: (bind, advertised)."""
    if not remote_hosts:
        return "127.0.0.1", "127.0.0.1"
    if options.network_interface:
        address = interface_address(options.network_interface)
        return address, address
    # The address this host reaches the first remote host from.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((remote_hosts[0], 9))
            address = s.getsockname()[0]
    except OSError:
        raise _launcher.LaunchError(
            f"cannot tell which address of this host {remote_hosts[0]} reaches (it does not "
            "resolve); name the interface with --network-interface") from None
    return address, address


def _rank_env(env, rank, size, store, secret):
    return {**env, "KERAS_RING_TRANSPORT": "tcp", "KERAS_RING_RANK": str(rank),
            "KERAS_RING_SIZE": str(size), "KERAS_RING_RENDEZVOUS": store,
            SECRET_VARIABLE: secret}


def _remote_command(env, command):
    """The shell command line that runs `command` on another host, in this directory.

    The secret comes on stdin: a command line is visible to every user of that host.
    """
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())
                       if name not in _LOCAL_ONLY_ENV and name != SECRET_VARIABLE
                       and name.isidentifier())
    return (f"cd {shlex.quote(os.getcwd())} && IFS= read -r {SECRET_VARIABLE} && "
            f"export {SECRET_VARIABLE} && exec env {exports} {shlex.join(command)}")


class _Rank:
    def __init__(self, rank, process, streams):
        self.rank = rank
        self.process = process
        self.streams = streams


def _start_rank(rank, host, env, options, quiet):
    streams = []
    pipes = {}
    for name, dest in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        quiet_here = quiet and rank > 0 and dest is sys.stderr
        if options.prefix_output or quiet_here:
            read_end, write_end = os.pipe()
            pipes[name] = write_end
            streams.append(_launcher._RankStream(
                read_end, dest, f"[{rank}] " if options.prefix_output else "", quiet_here))
    if host is None:
        argv, stdin = options.command, subprocess.DEVNULL
    else:
        argv, stdin = [options.remote_shell or "ssh", host,
                       _remote_command(env, options.command)], subprocess.PIPE
    try:
        # A session of its own: the job's end reaches the rank's own children too.
        process = subprocess.Popen(argv, env=env, stdin=stdin, start_new_session=True,
                                   stdout=pipes.get("stdout"), stderr=pipes.get("stderr"))
    except OSError as e:
        for s in streams:
            os.close(s.fd)
        raise _launcher.LaunchError(f"cannot start rank {rank} ({argv[0]}): {e.strerror}") from None
    finally:
        for fd in pipes.values():
            os.close(fd)
    if host is not None:
        process.stdin.write(env[SECRET_VARIABLE].encode() + b"\n")
        process.stdin.close()
    return _Rank(rank, process, streams)


def _signal_rank(rank, signum):
    try:
        os.killpg(rank.process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code):
    if code < 0:
        return f"died of signal {-code} ({signal.strsignal(-code)})"
    return f"exited with code {code}"


def run_tcp_job(options, env):
    """Runs the job over the TCP world until every rank has ended.

    Returns:
        0, or the exit code of the first rank that failed (128 + N for a
        signal N), whose failure `keras-ring-run` names on stderr.
    """
    hosts = placement(options)
    remote = [h for h in hosts if h is not None]
    bind, advertised = _store_host(options, remote)
    secret = secrets.token_hex(32)
    quiet = not options.all_output
    with RendezvousServer(secret.encode(), host=bind) as server:
        store = f"{advertised}:{server.address[1]}"
        ranks = []
        ending = [None]  # (rank, code) of the first failure, or ("signal", n)

        def forward(signum, frame):
            if ending[0] is None:
                ending[0] = ("signal", signum)
            for r in ranks:
                _signal_rank(r, signal.SIGTERM)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM,
                                                            signal.SIGHUP)}
        try:
            for rank, host in enumerate(hosts):
                rank_env = _rank_env(env, rank, options.np, store, secret)
                ranks.append(_start_rank(rank, host, rank_env, options, quiet))
            return _supervise(ranks, ending)
        except BaseException:
            for r in ranks:
                _signal_rank(r, signal.SIGKILL)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _supervise(ranks, ending):
    selector = selectors.DefaultSelector()
    for r in ranks:
        for stream in r.streams:
            selector.register(stream.fd, selectors.EVENT_READ, stream)

    def relay(close_all=False):
        for key, _ in selector.select(timeout=_launcher._PARTIAL_LINE_SECONDS):
            chunk = os.read(key.fd, 65536)
            if chunk and key.data.feed(chunk):
                continue
            key.data.flush()
            selector.unregister(key.fd)
            os.close(key.fd)
        if close_all:
            for key in list(selector.get_map().values()):
                key.data.flush()
                selector.unregister(key.fd)
                os.close(key.fd)

    running = {r.rank: r for r in ranks}
    stops = []  # (when, signals) still to send to the ranks left
    while running:
        relay()
        for r in list(running.values()):
            code = r.process.poll()
            if code is None:
                continue
            del running[r.rank]
            if code != 0 and ending[0] is None:
                ending[0] = (r.rank, code)
                print(f"keras-ring-run: rank {r.rank} {_describe_exit(code)}; stopping the "
                      "other ranks.", file=sys.stderr, flush=True)
                now = time.monotonic()
                stops = [(now + _REPORT_SECONDS, (signal.SIGCONT, signal.SIGTERM)),
                         (now + _REPORT_SECONDS + _GRACE_SECONDS, (signal.SIGKILL,))]
        while stops and time.monotonic() > stops[0][0]:
            for other in running.values():
                for signum in stops[0][1]:
                    _signal_rank(other, signum)
            stops.pop(0)
    # Pipes a rank's own child keeps open: read for a moment, then let go.
    deadline = time.monotonic() + _launcher._DRAIN_SECONDS
    while selector.get_map() and time.monotonic() < deadline:
        relay()
    relay(close_all=True)
    selector.close()
    if ending[0] is None:
        return 0
    who, code = ending[0]
    if who == "signal":
        return 128 + code
    return 128 - code if code < 0 else code
