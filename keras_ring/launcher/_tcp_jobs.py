"""Jobs of the TCP world: `keras-ring-run --transport tcp` starts the ranks itself.

No MPI launcher is involved. This process serves the job's rendezvous store
(`_rendezvous.RendezvousServer`), authenticated with a secret made for the
job, starts every rank with its rank, size, the store's address and the
secret in its environment (ranks on other hosts through the remote shell,
their environment and the secret on the shell's stdin, never on a command
line), relays their
output, and ends the job when one rank fails: the others have `REPORT_SECONDS`
to fail by themselves, naming it, then get SIGCONT and SIGTERM (a stopped
rank must wake to die), then SIGKILL after `GRACE_SECONDS`. A one-host
job's store and ranks listen on loopback only.
"""

import contextlib
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

from keras_ring.core import _end_report
from keras_ring.core._rendezvous import RendezvousServer
from keras_ring.launcher import _base

# Once a rank has failed: how long the others have to fail by themselves (their engines
# notice its connection drop at once, and say so), then how long after SIGTERM before SIGKILL.
REPORT_SECONDS = 2
GRACE_SECONDS = 10
# Variables that describe this shell, not the job: not sent to other hosts.
_LOCAL_ONLY_ENV = frozenset(["_", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "HOME", "TERM",
                             "DISPLAY", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK"])
SECRET_VARIABLE = "KERAS_RING_SECRET"


def placement(options):
    """The host of each rank, in rank order: None for this host.

    Hosts fill in the order given, each up to its slots (`-H a:2,b:2`, or a
    host file with `host`, `host:slots` or `host slots=N` lines).
    """
    hosts = given_hosts(options)
    if not hosts:
        return [None] * options.np
    slots = []
    for host, count in hosts:
        slots += [None if is_this_host(host) else host] * count
    if len(slots) < options.np:
        raise _base.LaunchError(
            f"the hosts have {len(slots)} slots for {options.np} ranks; give more slots "
            "(host:slots) or fewer ranks.")
    return slots[:options.np]


def given_hosts(options):
    """[(host, slots)] from -H or --hostfile, or None if neither was given."""
    if options.hostfile is not None:
        return read_hostfile(options.hostfile)
    return options.hosts


def read_hostfile(path):
    """[(host, slots)] from a host file; raises LaunchError naming a bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise _base.LaunchError(f"cannot read the host file {path}: {e.strerror}") from None
    return parse_hosts(lines, path)


def parse_hosts(lines, source, default_slots=1):
    """[(host, slots)] from `host`, `host:slots` or `host slots=N` lines.

    Args:
        lines: The lines; `#` starts a comment, blank lines are skipped.
        source: What the lines come from, for errors (a file name).
        default_slots: The slots of a bare `host`; None makes it an error.

    Returns:
        The hosts in the order given, each with its slots (at least 1).

    Raises:
        LaunchError: naming the first bad line (`source:number`).
    """
    expected = ("`host`, `host:slots` or `host slots=N`" if default_slots is not None
                else "`host:slots` or `host slots=N` (a bare `host` needs --slots)")
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, _, slots = words[0].partition(":")
        for word in words[1:]:
            if word.startswith("slots="):
                slots = word[len("slots="):]
        if not host or (slots and not (slots.isdigit() and int(slots) > 0)) or (
                not slots and default_slots is None):
            raise _base.LaunchError(
                f"{source}:{number}: expected {expected}. Received: {line!r}")
        hosts.append((host, int(slots) if slots else default_slots))
    return hosts


def is_this_host(host):
    """Whether `host` names this host."""
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
            raise _base.LaunchError(
                f"--network-interface {interface}: no IPv4 address ({e.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def store_host(options, remote_hosts):
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
        raise _base.LaunchError(
            f"cannot tell which address of this host {remote_hosts[0]} reaches (it does not "
            "resolve); name the interface with --network-interface") from None
    return address, address


def job_env(env, store, secret):
    """`env` with what every process of a TCP job needs: the transport, the store, the secret."""
    return {**env, "KERAS_RING_TRANSPORT": "tcp", "KERAS_RING_RENDEZVOUS": store,
            SECRET_VARIABLE: secret}


def _rank_env(env, rank, size, store, secret):
    return {**job_env(env, store, secret), "KERAS_RING_RANK": str(rank),
            "KERAS_RING_SIZE": str(size), _end_report.VARIABLE: "store"}


# What the remote shell runs on another host: a POSIX shell, in the login shell's place (so that
# the rank's exit status and signals reach the launcher as its own), that reads its script from
# stdin (`_remote_script`). A command line is visible to every user of a host: it holds no value.
REMOTE_COMMAND = "exec sh -s"


def _remote_script(env, command):
    """The script, sent on the remote shell's stdin, that runs `command` on another host in
    this directory with `env` (the secret included), less what describes this shell only."""
    exports = "".join(f"export {name}={shlex.quote(value)}\n"
                      for name, value in sorted(env.items())
                      if name not in _LOCAL_ONLY_ENV and name.isidentifier())
    return f"cd {shlex.quote(os.getcwd())} || exit\n{exports}exec {shlex.join(command)}\n"


class Started:
    """A process the launcher started, with the pipes its output comes through.

    Args:
        name: What messages call it ("rank 3").
        process: Its `subprocess.Popen`.
        streams: The `_base.RankStream`s of its pipes (none where it
            writes to our stdout and stderr itself).
    """

    def __init__(self, name, process, streams):
        self.name = name
        self.process = process
        self.streams = streams


def start_process(name, host, env, options, prefix, quiet):
    """Starts `options.command` here or on another host, in a session of its own.

    Args:
        name: What an error calls it ("rank 3").
        host: The host, or None for this one; another host's process is
            started through `options.remote_shell` (ssh by default), with
            its environment (with the secret) on its stdin.
        env: Its environment (with `SECRET_VARIABLE`).
        options: The namespace from `_main.parse_args()`.
        prefix: What goes before each of its output lines, or "" (then its
            stdout is its own: ours).
        quiet: Whether TensorFlow's start-up lines are left out of its stderr.

    Returns:
        A `Started`.

    Raises:
        LaunchError: If the process cannot be started.
    """
    streams = []
    pipes = {}
    for stream_name, dest in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        quiet_here = quiet and dest is sys.stderr
        if prefix or quiet_here:
            read_end, write_end = os.pipe()
            pipes[stream_name] = write_end
            streams.append(_base.RankStream(read_end, dest, prefix, quiet_here))
    if host is None:
        argv, stdin = options.command, subprocess.DEVNULL
    else:
        argv, stdin = [options.remote_shell or "ssh", host, REMOTE_COMMAND], subprocess.PIPE
    try:
        # A session of its own: the job's end reaches the process's own children too.
        process = subprocess.Popen(argv, env=env, stdin=stdin, start_new_session=True,
                                   stdout=pipes.get("stdout"), stderr=pipes.get("stderr"))
    except OSError as e:
        for s in streams:
            os.close(s.fd)
        raise _base.LaunchError(f"cannot start {name} ({argv[0]}): {e.strerror}") from None
    finally:
        for fd in pipes.values():
            os.close(fd)
    if host is not None:
        process.stdin.write(_remote_script(env, options.command).encode())
        process.stdin.close()
    return Started(name, process, streams)


def signal_process(started, signum):
    """Sends `signum` to a started process's session (its children too), if it is still there."""
    try:
        os.killpg(started.process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(code):
    """How a process ended, from its return code: "exited with code 1", "died of signal 9 (...)"."""
    if code < 0:
        return f"died of signal {-code} ({signal.strsignal(-code)})"
    return f"exited with code {code}"


class OutputRelay:
    """Copies started processes' output pipes to ours, line by line (`_base.RankStream`)."""

    def __init__(self):
        self._selector = selectors.DefaultSelector()

    def add(self, streams):
        """Relays these `RankStream`s from now on."""
        for stream in streams:
            self._selector.register(stream.fd, selectors.EVENT_READ, stream)

    def pump(self, timeout):
        """Copies what the pipes have, waiting at most `timeout` seconds for some.

        A pipe that has ended (or whose reader, ours, has gone) is closed.
        """
        for key, _ in self._selector.select(timeout=timeout):
            chunk = os.read(key.fd, 65536)
            if chunk and key.data.feed(chunk):
                continue
            self._end(key)

    def drain(self):
        """Copies what is left, then closes every pipe.

        Pipes a process's own child keeps open are read for `_base.DRAIN_SECONDS`.
        """
        deadline = time.monotonic() + _base.DRAIN_SECONDS
        while self._selector.get_map() and time.monotonic() < deadline:
            self.pump(_base.PARTIAL_LINE_SECONDS)
        for key in list(self._selector.get_map().values()):
            self._end(key)
        self._selector.close()

    def _end(self, key):
        key.data.flush()
        self._selector.unregister(key.fd)
        os.close(key.fd)


@contextlib.contextmanager
def handling_signals(handler):
    """Calls `handler(signum, frame)` on SIGINT, SIGTERM and SIGHUP while in the block."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM,
                                                        signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_tcp_job(options, env):
    """Runs the job over the TCP world until every rank has ended.

    Returns:
        0, or the exit code of the rank whose failure ended the job (128 + N
        for a signal N), which `keras-ring-run` names on stderr
        (`_first_failure`); 128 + N when the user stopped it with signal N.
    """
    hosts = placement(options)
    remote = [h for h in hosts if h is not None]
    bind, advertised = store_host(options, remote)
    secret = secrets.token_hex(32)
    quiet = not options.all_output
    with RendezvousServer(secret.encode(), host=bind) as server:
        store = f"{advertised}:{server.address[1]}"
        ranks = []
        signalled = []

        def forward(signum, frame):
            signalled.append(signum)
            for r in ranks:
                signal_process(r, signal.SIGTERM)

        with handling_signals(forward):
            try:
                for rank, host in enumerate(hosts):
                    rank_env = _rank_env(env, rank, options.np, store, secret)
                    prefix = f"[{rank}] " if options.prefix_output else ""
                    ranks.append(start_process(f"rank {rank}", host, rank_env, options, prefix,
                                               quiet and rank > 0))
                exits = _supervise(ranks)
            except BaseException:
                for r in ranks:
                    signal_process(r, signal.SIGKILL)
                raise
        if signalled:
            return 128 + signalled[0]
        first = _first_failure(exits, server)
    if first is None:
        return 0
    rank, code, why = first
    print(f"keras-ring-run: rank {rank} {why}", file=sys.stderr, flush=True)
    return code or 1  # a rank's exit with code 0 mid-job fails the job


def _supervise(ranks):
    """Relays the ranks' output until every rank has ended; stops the others once one fails.

    Returns:
        `(rank, returncode, stopped)` for each rank, in the order they were
        seen to end: its `Popen.returncode` (-N for a signal N), and whether
        the launcher had begun to stop the ranks then.
    """
    relay = OutputRelay()
    for r in ranks:
        relay.add(r.streams)
    running = dict(enumerate(ranks))
    exits = []
    stops = []  # (when, signals) still to send to the ranks left
    stopping = False
    while running:
        relay.pump(_base.PARTIAL_LINE_SECONDS)
        for rank, r in list(running.items()):
            code = r.process.poll()
            if code is None:
                continue
            del running[rank]
            exits.append((rank, code, stopping))
            if code != 0 and not stops and not stopping:
                now = time.monotonic()
                stops = [(now + REPORT_SECONDS, (signal.SIGCONT, signal.SIGTERM)),
                         (now + REPORT_SECONDS + GRACE_SECONDS, (signal.SIGKILL,))]
        while stops and time.monotonic() > stops[0][0]:
            stopping = True
            for other in running.values():
                for signum in stops[0][1]:
                    signal_process(other, signum)
            stops.pop(0)
    relay.drain()
    return exits


def _first_failure(exits, server):
    """The rank whose failure ended a TCP job, its exit code and what to say of it; or None.

    A job fails when a rank exits with a code other than 0 or reports that it
    raised. A rank that started keras-ring and ended without reaching the
    end of its exit or `shutdown()` (`os._exit`, a signal, a crash) ended
    abruptly, and the others failed for it: the first such rank seen to end,
    before the launcher stopped any, is the one. Otherwise the first rank to
    fail by what the ranks reported (`_end_report.first_to_fail`), and for
    commands that report nothing the first rank seen to fail. The ranks
    report through the store (`keras_ring/core/_end_report.py`).

    Args:
        exits: What `_supervise` returned.
        server: The job's `RendezvousServer`.
    """
    reported = {}
    for key in server.keys("end/"):
        _, rank, kind = key.split("/")
        reported.setdefault(kind, {})[int(rank)] = server.get(key).decode("utf-8", "replace")
    started, ended = reported.get("started", {}), reported.get("ended", {})
    endings = [_end_report.RankEnding.parse(rank, value)
               for rank, value in reported.get("ending", {}).items()]
    # A job fails when a rank does, or raised (a shell around it may exit 0 all the same).
    if all(code == 0 for _, code, _ in exits) and not any(e.error for e in endings):
        return None
    for rank, code, stopped in exits:
        if rank in started and ended.get(rank) != started[rank] and not stopped:
            unfinished = " without shutting keras-ring down" if code == 0 else ""
            return (rank, _shell_code(code),
                    f"{describe_exit(code)}{unfinished}, the first rank to fail.")
    first = _end_report.first_to_fail(endings, {rank: _shell_code(code) for rank, code, _ in exits})
    if first is not None:
        return first
    rank, code, _ = next(exit for exit in exits if exit[1] != 0)
    return rank, _shell_code(code), f"{describe_exit(code)}, the first rank to fail."


def _shell_code(returncode):
    """A `Popen.returncode` as a shell gives it: 128 + N for a signal N."""
    return 128 - returncode if returncode < 0 else returncode
