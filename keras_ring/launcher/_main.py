"""`keras-ring-run`: starts a job under the MPI launcher keras-ring was built with.

```
keras-ring-run -np 4 python train.py
keras-ring-run -np 8 -H node1:4,node2:4 --prefix-output python train.py
```

The launcher comes from the build info (`_build_info.json`): the `mpiexec` of
the PyPI `mpich` package in this environment, or the system MPI's launcher
recorded at build time. In a one-host job the MPI library's sockets listen on
loopback only (see `launcher_env()`). Hydra's `mpiexec` binds its control port
to all interfaces whatever its options say, so when MPICH's forker
(`mpiexec.gforker`, shipped by the PyPI `mpich`) sits beside it, a one-host job
runs under the forker, which reaches the ranks through socket pairs and listens
nowhere.

This module imports neither TensorFlow nor the engine, so it starts fast.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import os
import re
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from keras_ring.core import _build_info, _end_report
from keras_ring.launcher import _base, _elastic_driver, _rank_output, _tcp_jobs

USAGE_ERROR = 2
# One-host jobs: the MPI library's own network endpoints (UCX and libfabric
# netmods for MPICH and Intel MPI; TCP BTL and OOB for Open MPI) listen on
# loopback only. Values the user already set are kept.
_MPICH_LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo"}
_OPEN_MPI_LOOPBACK_ENV = {
    "UCX_NET_DEVICES": "lo",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "PRTE_MCA_oob_tcp_if_include": "lo",
}
# The remote shell that starts ranks on other hosts: --remote-shell, else this variable, else the
# MPI launcher's own choice (ssh, or a resource manager's launcher inside an allocation).
REMOTE_SHELL_VARIABLE = "KERAS_RING_REMOTE_SHELL"
# Elastic jobs: how long the driver waits for enough workers, unless --elastic-timeout says.
ELASTIC_TIMEOUT_VARIABLES = ("KERAS_RING_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT")
DEFAULT_ELASTIC_TIMEOUT_SECONDS = 600
# Variables Open MPI must not copy to other hosts (`-x`): they describe this shell.
_LOCAL_ONLY_ENV = frozenset(["_", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "HOME"])
# Signals passed on to the launcher. Hydra and the forker stop their ranks on
# SIGINT and SIGTERM but die of SIGHUP and leave them running: send SIGTERM.
_FORWARDED_SIGNALS = {
    signal.SIGINT: signal.SIGINT,
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGHUP: signal.SIGTERM,
}
# MPICH (5.0 here) names a job's shared-memory segments after an FNV-1a hash of
# its PMI kvsname, which the forker makes from its own pid: "kvs_<pid>_0". A rank
# killed before MPI_Finalize leaves them in /dev/shm, and once pids wrap a later
# forker with that pid makes its ranks all attach to the stale segment as if a
# peer had created it (shm_open with O_EXCL decides who initialises it): MPI_Init
# then fails on the dead job's queues ("Invalid GenQ flag", "Message truncated").
_FORKER_SEGMENT_FORMATS = ("/dev/shm/mpich_shm_{:x}_0", "/dev/shm/mpich_vci_{:x}_0")
# A rank stopped by SIGSTOP (alive but stuck) cannot act on the MPI launcher's signals, which stay
# pending, so the launcher waits for it forever. Once another rank of the job has ended, a rank
# process (or a process under it, as under `sh -c`) stopped this long is sent SIGCONT and SIGTERM,
# and SIGKILL this long after that if it is still there.
_STOPPED_RANK_SECONDS = 2
_STOPPED_RANK_KILL_SECONDS = 3
_WATCH_INTERVAL_SECONDS = 0.5
# A rank's own children (its python under `sh -c "python train.py"`) are orphaned when the MPI
# launcher kills the rank, which it knows, and ran on until their own timeout: keras-ring-run
# adopts them (a child subreaper) and, once the launcher has exited, ends them the same way.
_PR_SET_CHILD_SUBREAPER = 36
# The MPI launchers' per-host processes whose children are the ranks.
_RANK_PARENTS = frozenset(["hydra_pmi_proxy", "prted", "orted"])
# Under the forker each rank starts through this script, which hands it our output.
_RANK_OUTPUT_SCRIPT = Path(_rank_output.__file__)
@dataclasses.dataclass(frozen=True)
class _Setting:
    """A horovodrun-style option that sets one engine variable in every rank's environment."""

    flag: str
    variable: str
    kind: str  # "mb" (MiB to bytes), "ms", "seconds", "count", "path", "on" or "level"
    help: str

    @property
    def dest(self):
        return self.flag[2:].replace("-", "_")


_SETTINGS = (
    _Setting("--fusion-threshold-mb", "KERAS_RING_FUSION_THRESHOLD", "mb",
             "fusion buffer size in MiB (0: no fusion)"),
    _Setting("--cycle-time-ms", "KERAS_RING_CYCLE_TIME", "ms",
             "how long agreed tensors wait for others to fuse with, in ms"),
    _Setting("--cache-capacity", "KERAS_RING_CACHE_CAPACITY", "count",
             "tensor names the response cache holds (0: no cache)"),
    _Setting("--autotune", "KERAS_RING_AUTOTUNE", "on", "tune the settings while training"),
    _Setting("--autotune-log-file", "KERAS_RING_AUTOTUNE_LOG", "path",
             "CSV file of the autotuner's trials"),
    _Setting("--autotune-warmup-samples", "KERAS_RING_AUTOTUNE_WARMUP_SAMPLES", "count",
             "samples the autotuner discards first"),
    _Setting("--autotune-steps-per-sample", "KERAS_RING_AUTOTUNE_STEPS_PER_SAMPLE", "count",
             "steps per autotuner sample"),
    _Setting("--timeline-filename", "KERAS_RING_TIMELINE", "path",
             "record every rank's timeline (trace.json: trace.rank0.json, ...)"),
    _Setting("--timeline-mark-cycles", "KERAS_RING_TIMELINE_MARK_CYCLES", "on",
             "mark the engine's cycles in the timeline"),
    _Setting("--stall-check-warning-time-seconds", "KERAS_RING_STALL_CHECK_TIME", "seconds",
             "warn about tensors some ranks wait for this long"),
    _Setting("--stall-check-shutdown-time-seconds", "KERAS_RING_STALL_SHUTDOWN_TIME", "seconds",
             "fail tensors some ranks wait for this long (0: never)"),
    _Setting("--log-level", "KERAS_RING_LOG_LEVEL", "level",
             "trace, debug, info, warning, error or fatal"),
    _Setting("--log-hide-timestamp", "KERAS_RING_LOG_HIDE_TIME", "on",
             "leave the time out of log lines"),
)
_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """The MPI launcher a job starts with.

    Args:
        path: The `mpiexec` (or `mpirun`) of the MPI keras-ring was built with.
        vendor: `"MPICH"`, `"Open MPI"`, `"Intel MPI"` or `"unknown"`.
        forker: MPICH's `mpiexec.gforker` beside `path`, or `None`.
    """

    path: str
    vendor: str
    forker: str = None


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise _base.LaunchError(f"{message}\n{self.format_usage()}")


def locate_launcher(build_info):
    """Finds the launcher of the build and checks that it is that MPI's.

    Args:
        build_info: The dict from `_build_info.read_build_info()`.

    Returns:
        A `Launcher`.

    Raises:
        LaunchError: if the launcher is missing, cannot run, or belongs to
            another MPI than the one keras-ring was built against.
    """
    path = _build_info.default_mpiexec(build_info)
    built = build_info["mpi_vendor"]
    if not path or not os.access(path, os.X_OK):
        if build_info["mpi_source"] == "pypi-mpich":
            raise _base.LaunchError(
                f"cannot find the MPI launcher {path}. keras-ring was built against the MPICH "
                "of the PyPI `mpich` package, whose `mpiexec` belongs in the same environment "
                f"as keras-ring; install it again with `{sys.executable} -m pip install mpich`, "
                f"or {_build_info.REBUILD_HINT}."
            )
        raise _base.LaunchError(
            f"cannot find the MPI launcher {path!r} of the {built} that keras-ring was built "
            f"against (mpicxx: {build_info['mpicxx']}). If that MPI was removed or moved, "
            f"reinstall it, or {_build_info.REBUILD_HINT}."
        )
    vendor = launcher_vendor(path)
    if "unknown" not in (built, vendor) and vendor != built:
        raise _base.LaunchError(
            f"{path} is the launcher of {vendor}, but keras-ring was built against {built} "
            f"(mpicxx: {build_info['mpicxx'] or 'from the PyPI mpich package'}). Processes "
            "started by another MPI's launcher do not join one job: each would run alone as "
            f"rank 0. Restore {built}'s launcher at {path}, or {_build_info.REBUILD_HINT}."
        )
    vendor = built if vendor == "unknown" else vendor
    forker = os.path.join(os.path.dirname(path), "mpiexec.gforker")
    has_forker = vendor == "MPICH" and os.access(forker, os.X_OK)
    return Launcher(path, vendor, forker if has_forker else None)


def launcher_vendor(path):
    """Tells which MPI a launcher belongs to from its `--version` output.

    Args:
        path: The launcher to ask.

    Returns:
        `"MPICH"` (Hydra), `"Open MPI"`, `"Intel MPI"` or `"unknown"`.

    Raises:
        LaunchError: if the launcher cannot run or does not answer in 30 s.
    """
    try:
        result = subprocess.run(
            [path, "--version"],
            check=False,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=30,
        )
    except OSError as e:
        raise _base.LaunchError(f"cannot run the MPI launcher {path}: {e.strerror}.") from None
    except subprocess.TimeoutExpired:
        raise _base.LaunchError(
            f"the MPI launcher {path} did not answer `--version` within 30 s."
        ) from None
    text = result.stdout + result.stderr
    if "Intel(R) MPI" in text:
        return "Intel MPI"
    if "Open MPI" in text:
        return "Open MPI"
    if "HYDRA" in text or "MPICH" in text:
        return "MPICH"
    return "unknown"


def parse_args(argv, environ=None):
    """Parses the `keras-ring-run` command line.

    Args:
        argv: The arguments after the program name.
        environ: The environment `KERAS_RING_REMOTE_SHELL` is read from when
            `--remote-shell` is not given; `os.environ` by default.

    Returns:
        An `argparse.Namespace` with `np`, `hosts` (a list of `(host, slots)`
        or `None`), `hostfile`, `remote_shell` (a command, or `None` for the
        MPI launcher's default), `transport` (`"mpi"` or `"tcp"`),
        `network_interface`, `prefix_output`, `all_output`, `verbose`,
        `settings`, `command`, and the elastic job's: `elastic` (whether it
        is one; then `transport` is `"tcp"`), `min_np`, `max_np` (`None`: no
        bound), `host_discovery_script`, `slots`, `reset_limit`,
        `blacklist_cooldown_range` (`(min, max)` seconds or `None`) and
        `elastic_timeout` (seconds).

    Raises:
        LaunchError: on a missing or invalid argument.
    """
    parser = _ArgumentParser(
        prog="keras-ring-run",
        description="Runs COMMAND as NP ranks of one keras-ring job, under the MPI launcher "
        "keras-ring was built with.",
        allow_abbrev=False,
    )
    parser.add_argument("-np", type=int,
                        help="number of ranks (elastic: the first world's; default --min-np)")
    parser.add_argument(
        "-H", dest="hosts", metavar="HOST:SLOTS,...", help="hosts and their slots, e.g. a:4,b:4"
    )
    parser.add_argument(
        "--hostfile", metavar="FILE", help="host file, in the syntax of the MPI's own launcher"
    )
    parser.add_argument(
        "--remote-shell", metavar="CMD",
        help=f"the command that starts ranks on other hosts, called as `CMD HOST COMMAND...` as "
        f"ssh is (default: ${REMOTE_SHELL_VARIABLE}, else the MPI launcher's own: ssh)"
    )
    parser.add_argument(
        "--transport", choices=("mpi", "tcp"),
        help="how the ranks reach each other: mpi (the default: started by the MPI launcher) "
        "or tcp (started by keras-ring-run itself, no MPI; default: $KERAS_RING_TRANSPORT)"
    )
    parser.add_argument(
        "--network-interface", metavar="IFACE",
        help="with --transport tcp across hosts: the interface of this host the ranks reach "
        "the job's rendezvous store on (default: the one that routes to the first host)"
    )
    parser.add_argument(
        "--prefix-output", action="store_true",
        help="prefix every output line with its rank (an elastic job's worker: its host:slot)"
    )
    parser.add_argument(
        "--all-output", action="store_true",
        help="keep every rank's TensorFlow start-up lines (on one host, by default only rank 0's)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the launcher command before running it"
    )
    tuning = parser.add_argument_group(
        "settings", "as horovodrun's; each sets a KERAS_RING_* variable in every rank's "
        "environment (docs/launching.md)")
    for setting in _SETTINGS:
        if setting.kind == "on":
            tuning.add_argument(setting.flag, dest=setting.dest, action="store_true",
                                help=setting.help)
        else:
            tuning.add_argument(setting.flag, dest=setting.dest, metavar=setting.kind.upper(),
                                help=setting.help)
    hierarchy = tuning.add_mutually_exclusive_group()
    hierarchy.add_argument("--hierarchical-allreduce", dest="hierarchical_allreduce",
                           action="store_true", default=None,
                           help="across hosts: reduce within each host first (the default)")
    hierarchy.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce",
                           action="store_false", help="across hosts: one flat allreduce")
    tuning.add_argument("--no-stall-check", action="store_true",
                        help="no stall warnings (nor the shutdown after a stall)")
    _add_elastic_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command of every rank")
    options = parser.parse_args(argv)
    if options.command[:1] == ["--"]:
        options.command = options.command[1:]
    environ = os.environ if environ is None else environ
    _check_elastic(options, parser, environ)
    if options.np is None:
        parser.error("the following arguments are required: -np")
    if options.np < 1:
        parser.error(f"-np must be at least 1. Received: -np={options.np}")
    if not options.command:
        parser.error("no command to run, e.g. `keras-ring-run -np 2 python train.py`.")
    if options.hosts is not None and options.hostfile is not None:
        parser.error("give -H or --hostfile, not both.")
    if options.hosts is not None:
        options.hosts = _parse_hosts(options.hosts, parser)
    if options.transport is None:
        options.transport = environ.get("KERAS_RING_TRANSPORT") or "mpi"
        if options.transport not in ("mpi", "tcp"):
            parser.error(f"KERAS_RING_TRANSPORT must be mpi or tcp. "
                         f"Received: KERAS_RING_TRANSPORT={options.transport}")
    if options.remote_shell is None:
        options.remote_shell = environ.get(REMOTE_SHELL_VARIABLE) or None
    elif not options.remote_shell.strip():
        parser.error("--remote-shell needs a command, e.g. --remote-shell ssh.")
    options.settings = _settings(options, parser)
    return options


def _add_elastic_arguments(parser):
    elastic = parser.add_argument_group(
        "elastic", "as horovodrun's: workers may come and go, the job goes on "
        "(docs/launching.md; implies --transport tcp)")
    elastic.add_argument("--elastic", action="store_true",
                         help="an elastic job (also turned on by --min-np or "
                         "--host-discovery-script)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                         help="the fewest workers training goes on with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                         help="the most workers (default: -np, or every discovered slot)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="a command that prints the hosts there are now, a `host:slots` "
                         "line each (or `host`, with --slots); run every second")
    elastic.add_argument("--slots", "--slots-per-host", dest="slots", type=int, metavar="N",
                         help="the slots of a host the discovery script prints without them")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="the most times the world may re-form; one more fails the job")
    elastic.add_argument("--blacklist-cooldown-range", nargs=2, type=float,
                         metavar=("MIN", "MAX"),
                         help="a host whose worker failed gets no new worker for MIN to MAX "
                         "seconds, longer each time (default: for the rest of the job)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="SECONDS",
                         help="how long to wait for enough workers before failing the job "
                         f"(default: ${ELASTIC_TIMEOUT_VARIABLES[0]}, "
                         f"${ELASTIC_TIMEOUT_VARIABLES[1]}, else "
                         f"{DEFAULT_ELASTIC_TIMEOUT_SECONDS:g})")


def _check_elastic(options, parser, environ):
    """Checks the elastic options and fills in their defaults (`options.elastic` tells)."""
    options.elastic = bool(options.elastic or options.min_np is not None
                           or options.host_discovery_script is not None)
    if not options.elastic:
        for flag in ("max_np", "slots", "reset_limit", "blacklist_cooldown_range",
                     "elastic_timeout"):
            if getattr(options, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} is for elastic jobs: add --elastic.")
        return
    if options.transport == "mpi":
        parser.error("an elastic job runs over the TCP world (keras-ring-run starts and "
                     "replaces its workers itself). Received: --transport mpi; leave it out.")
    options.transport = "tcp"
    if options.np is None:
        options.np = options.min_np
    if options.np is None:
        parser.error("an elastic job needs -np or --min-np.")
    if options.min_np is None:
        options.min_np = options.np
    for flag in ("np", "min_np", "max_np", "slots"):
        value = getattr(options, flag)
        if value is not None and value < 1:
            name = "-np" if flag == "np" else f"--{flag.replace('_', '-')}"
            parser.error(f"{name} must be at least 1. Received: {name}={value}")
    discovery = options.host_discovery_script is not None
    if options.max_np is None and not discovery:
        options.max_np = options.np
    if options.min_np > options.np:
        parser.error(f"--min-np must be at most -np. Received: --min-np={options.min_np}, "
                     f"-np={options.np}")
    if options.max_np is not None and options.max_np < options.np:
        parser.error(f"--max-np must be at least -np. Received: --max-np={options.max_np}, "
                     f"-np={options.np}")
    if discovery and (options.hosts is not None or options.hostfile is not None):
        parser.error("give --host-discovery-script or -H/--hostfile, not both.")
    if discovery and not options.host_discovery_script.strip():
        parser.error("--host-discovery-script needs a command.")
    if options.slots is not None and not discovery:
        parser.error("--slots is the slots of hosts the discovery script prints without "
                     "them; give -H host:slots without --host-discovery-script.")
    if options.reset_limit is not None and options.reset_limit < 0:
        parser.error(f"--reset-limit must be 0 or more. Received: "
                     f"--reset-limit={options.reset_limit}")
    cooldown = options.blacklist_cooldown_range
    if cooldown is not None:
        if not 0 < cooldown[0] <= cooldown[1] < float("inf"):
            parser.error(f"--blacklist-cooldown-range takes MIN MAX with 0 < MIN <= MAX. "
                         f"Received: --blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}")
        options.blacklist_cooldown_range = tuple(cooldown)
    if options.elastic_timeout is None:
        text = next((environ[v] for v in ELASTIC_TIMEOUT_VARIABLES if environ.get(v)), None)
        try:
            options.elastic_timeout = (DEFAULT_ELASTIC_TIMEOUT_SECONDS if text is None
                                       else float(text))
        except ValueError:
            options.elastic_timeout = float("nan")
        where = f"{ELASTIC_TIMEOUT_VARIABLES[0]} (or {ELASTIC_TIMEOUT_VARIABLES[1]})={text}"
    else:
        where = f"--elastic-timeout={options.elastic_timeout:g}"
    if not 0 < options.elastic_timeout < float("inf"):
        parser.error(f"the elastic timeout must be a number of seconds more than 0. "
                     f"Received: {where}")


def _settings(options, parser):
    """The engine variables the options set, checked: {name: value}."""
    settings = {}
    for setting in _SETTINGS:
        value = getattr(options, setting.dest)
        if value is None or value is False:
            continue
        if setting.kind == "on":
            settings[setting.variable] = "1"
            continue
        if setting.kind == "path":
            if not value:
                parser.error(f"{setting.flag} needs a file name.")
            settings[setting.variable] = value
            continue
        if setting.kind == "level":
            if value.lower() not in _LOG_LEVELS:
                parser.error(f"{setting.flag} must be one of {', '.join(_LOG_LEVELS)}. "
                             f"Received: {setting.flag}={value}")
            settings[setting.variable] = value.lower()
            continue
        try:
            number = int(value) if setting.kind == "count" else float(value)
        except ValueError:
            number = None
        if number is None or not 0 <= number < float("inf"):  # NaN fails too
            what = "a whole number" if setting.kind == "count" else "a number"
            parser.error(f"{setting.flag} must be {what} of 0 or more. "
                         f"Received: {setting.flag}={value}")
        if setting.kind == "mb":
            number = int(number * 1024 * 1024)
        settings[setting.variable] = str(number)
    if options.hierarchical_allreduce is not None:
        settings["KERAS_RING_HIERARCHICAL_ALLREDUCE"] = str(int(options.hierarchical_allreduce))
    if options.no_stall_check:
        given = [s.flag for s in _SETTINGS
                 if s.kind == "seconds" and getattr(options, s.dest) is not None]
        if given:
            parser.error(f"--no-stall-check turns the stall check off; {given[0]} contradicts it.")
        settings["KERAS_RING_STALL_CHECK_TIME"] = "0"
        settings["KERAS_RING_STALL_SHUTDOWN_TIME"] = "0"
    return settings


def _parse_hosts(spec, parser):
    hosts = []
    for item in spec.split(","):
        host, _, slots = item.partition(":")
        if not host or (slots and not (slots.isdigit() and int(slots) > 0)):
            parser.error(
                f"-H takes host:slots pairs separated by commas, e.g. node1:4,node2:4. "
                f"Received: -H={spec}"
            )
        hosts.append((host, int(slots or 1)))
    return hosts


def is_local_job(options):
    """Returns whether a job runs on this host only (no host file, only local -H hosts)."""
    if options.hostfile is not None:
        return False
    hostname = socket.gethostname()
    local_names = {"localhost", "127.0.0.1", hostname, hostname.split(".")[0]}
    return all(host in local_names for host, _ in options.hosts or [])


def launcher_command(launcher, options, env):
    """Returns the command line that starts the job.

    Args:
        launcher: A `Launcher`.
        options: The namespace from `parse_args()`.
        env: The environment of the job (Open MPI copies it to other hosts
            with `-x NAME`).

    Returns:
        The launcher's argv, ending with `options.command`.

    Raises:
        LaunchError: if a remote shell is given for a job on other hosts and
            the launcher cannot run it (Hydra's takes one program, no
            arguments; it must be on the `PATH` of `env`).
    """
    np = str(options.np)
    local = is_local_job(options)
    hosts = ",".join(f"{host}:{slots}" for host, slots in options.hosts or [])
    if launcher.vendor == "Open MPI":
        argv = [launcher.path, "-np", np]
        if options.prefix_output:
            argv.append("--tag-output")
        if options.hostfile is not None:
            argv += ["--hostfile", options.hostfile]
        elif not local:
            argv += ["-H", hosts]
        if options.remote_shell and not local:
            # Open MPI splits the agent at spaces itself: "ssh -p 2222" works.
            argv += ["--mca", "plm_rsh_agent", options.remote_shell]
        if not local:
            for name in sorted(env):
                if name not in _LOCAL_ONLY_ENV and re.fullmatch(r"[A-Za-z_]\w*", name):
                    argv += ["-x", name]
        return argv + options.command
    if local and launcher.forker:
        # Each rank's output bypasses the forker (see _rank_output.py); run_job prefixes it.
        shim = [sys.executable, "-I", "-S", str(_RANK_OUTPUT_SCRIPT)]
        return [launcher.forker, "-n", np, *shim, *options.command]
    argv = [launcher.path]
    if options.hostfile is not None:
        argv += ["-f", options.hostfile]
    elif local:
        argv += ["-hosts", "localhost", "-iface", "lo"]
    else:
        argv += ["-hosts", hosts]
    if options.remote_shell and not local:
        # Hydra runs the ssh launcher's program as `CMD -x HOST PROXY ARGS...` (-x: no X
        # forwarding), just as ssh; Intel MPI's Hydra spells the options -bootstrap(-exec).
        spelling = ("-bootstrap", "-bootstrap-exec") if launcher.vendor == "Intel MPI" else (
            "-launcher", "-launcher-exec")
        argv += [spelling[0], "ssh", spelling[1], _hydra_remote_shell(options.remote_shell, env)]
    if options.prefix_output:
        argv.append("-prepend-rank")
    return argv + ["-np", np] + options.command


def _hydra_remote_shell(command, env):
    """The remote shell as Hydra's `-launcher-exec` takes it: one program, found on the PATH."""
    if len(command.split()) != 1:
        raise _base.LaunchError(
            f"the MPI launcher (Hydra) runs the remote shell as one program, without arguments. "
            f"Received: --remote-shell={command!r}. Put the command in a script (e.g. "
            f"`exec ssh -p 2222 \"$@\"`) and give its path, or set ssh's options in "
            f"~/.ssh/config."
        )
    if shutil.which(command, path=env.get("PATH", os.defpath)) is None:
        raise _base.LaunchError(
            f"cannot find the remote shell {command!r} (--remote-shell, or "
            f"{REMOTE_SHELL_VARIABLE}): give the path of an executable, or a program on the PATH."
        )
    return command


def launcher_env(launcher, options, environ):
    """Returns the environment of the job.

    Args:
        launcher: A `Launcher`.
        options: The namespace from `parse_args()`.
        environ: The environment to pass through, usually `os.environ`.

    Returns:
        `environ` with `PYTHONUNBUFFERED=1`, the engine variables the options
        set (over the same variables in `environ`) and, for a one-host job,
        the settings that keep the MPI library's sockets on loopback.
    """
    env = dict(environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(options.settings)
    if is_local_job(options):
        loopback = _OPEN_MPI_LOOPBACK_ENV if launcher.vendor == "Open MPI" else _MPICH_LOOPBACK_ENV
        for name, value in loopback.items():
            # Open MPI refuses an include list next to the user's exclude list.
            if name.replace("_include", "_exclude") not in env:
                env.setdefault(name, value)
    return env


def run_job(argv, env, forker=False, prefix_output=False, quiet=False, np=1):
    """Runs the launcher until the job ends, passing on SIGINT, SIGTERM and SIGHUP.

    Args:
        argv: The launcher command line.
        env: The environment of the job.
        forker: Whether the launcher is MPICH's forker. Its stderr is then
            relayed to find ranks killed by a signal; its MPICH segments are
            removed before the job starts and after it ends; and the ranks'
            output reaches this process's stdout and stderr without passing
            through the forker (`argv` starts them through `_rank_output.py`).
        prefix_output: Under the forker: whether each line a rank writes is
            prefixed with `[rank] `.
        quiet: Under the forker: whether ranks other than 0 leave TensorFlow's
            start-up lines out of their stderr.
        np: Under the forker: the number of ranks.

    Returns:
        The job's exit code: the launcher's, or 128 + N when the launcher,
        or (under the forker) a rank, died of signal N.
    """
    # The forker's segment names follow from its pid: clear a dead job's
    # leftovers under them in the child, before any rank can exist.
    clear_names = (lambda: remove_forker_segments(os.getpid())) if forker else None
    outputs = _RankOutputs(np, prefix_output, quiet) if forker else None
    if outputs:
        env = {**env, **outputs.env}
    try:
        child = subprocess.Popen(
            argv, env=env, stderr=subprocess.PIPE if forker else None,
            preexec_fn=clear_names, pass_fds=outputs.handed_down if outputs else (),
        )
    finally:
        if outputs:
            outputs.close_handed_down()
    watch = _StoppedRankWatch(child.pid) if os.path.isdir("/proc/self") else None
    if watch:
        _set_child_subreaper(True)
    with child:
        if watch:
            watch.start()

        signalled = []

        def forward(signum, frame):
            signalled.append(signum)
            if outputs:
                outputs.stop()
            # Ctrl-C reaches the whole foreground process group, the launcher too; a
            # second SIGINT would make Hydra abort at once instead of stopping the ranks.
            if signum != signal.SIGINT or not _in_terminal_foreground():
                child.send_signal(_FORWARDED_SIGNALS[signum])

        previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED_SIGNALS}
        try:
            reports = _EndReports(None)
            if forker:
                reports = _relay_forker_output(child.stderr, outputs)
                # Removed before the forker is reaped, while no other process can
                # take its pid: what a killed rank left, never another job's.
                os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
                remove_forker_segments(child.pid)
            returncode = child.wait()
        finally:
            if outputs:
                outputs.stop()
            if watch:
                watch.stop()
                _set_child_subreaper(False)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    # Stopped from outside, the job ended for that reason, not for a rank's.
    ends = reports.ends
    codes = {end.rank: end.exit_code for end in ends}
    first = None if signalled else (_first_failure(ends)
                                    or _end_report.first_to_fail(reports.endings, codes))
    # A stopped rank the watch ended did not end the job: the line it printed says why it died.
    if first is not None and watch and first[0] in watch.ended:
        first = None
        returncode = returncode or 128 + signal.SIGTERM
    if returncode < 0:
        returncode = 128 - returncode
    if first is None:
        # The forker returns 0 when ranks die of a signal (one the user sent, say).
        failed = sorted((end.ended, end.exit_code) for end in ends if end.status != 0)
        return returncode or (failed[0][1] if failed else 0)
    rank, code, why = first
    print(f"keras-ring-run: rank {rank} {why}", file=sys.stderr, flush=True)
    # The failing rank's code, whatever the forker returns (0 when ranks die of a signal, and
    # otherwise the highest code of all ranks).
    return code or 1


@dataclasses.dataclass(frozen=True)
class _RankEnd:
    """How one rank of a forker job ended, as `_rank_output.py` reports it.

    Attributes:
        rank: The rank.
        status: Its wait status.
        ended: When it ended (`time.monotonic()`).
        stopped: When the forker first sent it a signal, or None.
    """

    rank: int
    status: int
    ended: float
    stopped: float | None

    @classmethod
    def parse(cls, line):
        rank, status, ended, stopped = line.split()
        return cls(int(rank), int(status), float(ended),
                   None if stopped == b"-" else float(stopped))

    @property
    def exit_code(self):
        """The code a shell gives it: 128 + N if signal N ended it."""
        if os.WIFSIGNALED(self.status):
            return 128 + os.WTERMSIG(self.status)
        return os.waitstatus_to_exitcode(self.status)

    def describe(self):
        if os.WIFSIGNALED(self.status):
            signum = os.WTERMSIG(self.status)
            return f"died of signal {signum} ({signal.strsignal(signum)})"
        return f"exited with code {self.exit_code}"


def _first_failure(ends):
    """The rank that ended a forker job abruptly, its code and what to say of it; or None.

    Once a rank ends without MPI_Finalize (a signal, `os._exit`, a crash), the
    forker stops the others: the rank that ended last before the first of
    them was signalled started it, whatever its status (exit code 0 too).
    A rank that fails after MPI_Finalize (an exception, which shuts the engine
    down at exit) stops no one: `_end_report.first_to_fail` finds it.

    Args:
        ends: Every rank's `_RankEnd` (those of ranks never started are missing).
    """
    stops = [end.stopped for end in ends if end.stopped is not None]
    before = [end for end in ends if stops and end.ended <= min(stops)]
    if not before:
        return None
    end = max(before, key=lambda end: end.ended)
    unfinalized = " without MPI_Finalize" if end.status == 0 else ""
    return (end.rank, end.exit_code,
            f"{end.describe()}{unfinalized}; the launcher stopped the other ranks.")


class _EndReports:
    """The pipe `_rank_output.py` and the ranks report their ends on, read like a rank's pipe.

    Attributes:
        ends: Each rank's `_RankEnd`, as its start script reported it.
        endings: The `_end_report.RankEnding`s the ranks reported.
    """

    def __init__(self, fd):
        self.fd = fd
        self.ends = []
        self.endings = []
        self.partial = b""

    def feed(self, chunk):
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            rank, kind, value = line.decode("utf-8", "replace").split(" ", 2)
            if kind == "ending":
                self.endings.append(_end_report.RankEnding.parse(int(rank), value))
            else:
                self.ends.append(_RankEnd.parse(line))
        return True

    def flush(self):
        return True


class _StoppedRankWatch:
    """Ends the job's stopped ranks once another rank has ended (see `_STOPPED_RANK_SECONDS`).

    A thread that reads the launcher's process tree in /proc every
    `_WATCH_INTERVAL_SECONDS`; it sees the ranks of this host only.

    Args:
        launcher_pid: The MPI launcher's pid (the forker, `mpiexec` or `mpirun`).
    """

    def __init__(self, launcher_pid):
        self._launcher_pid = launcher_pid
        self._done = threading.Event()
        self.ended = set()  # the stopped ranks (numbers, where known) it sent SIGTERM
        self._ranks = {}  # pid: rank, of the processes it has looked at
        self._thread = threading.Thread(target=self._run, name="stopped-rank-watch", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._done.set()
        self._thread.join()

    def _run(self):
        seen = set()  # rank processes seen alive
        rank_ended = False
        stopped_since = {}
        terminated = {}  # pid: when SIGTERM was sent
        while True:
            last = self._done.wait(_WATCH_INTERVAL_SECONDS)
            processes = _processes()
            ranks, below = _rank_processes(self._launcher_pid, processes)
            # Adopted: what the job left when a rank above it ended (see _PR_SET_CHILD_SUBREAPER).
            adopted, _ = _rank_processes(os.getpid(), processes, skip=self._launcher_pid)
            launcher_ended = processes.get(self._launcher_pid, (0, "Z"))[1] in "ZX"
            rank_ended = rank_ended or launcher_ended or bool(seen - ranks)
            seen |= ranks
            now = time.monotonic()
            stopped = {pid for pid in below | adopted if processes[pid][1] == "T"}
            stopped_since = {pid: stopped_since.get(pid, now) for pid in stopped}
            # Adopted from a rank that has ended (its sh, say, killed by the launcher), or once the
            # launcher has; what a live rank left running (a daemon) may go on until then.
            live_ranks = {self._rank_of(pid) for pid in ranks}
            ending = {pid for pid in adopted if launcher_ended or last
                      or self._rank_of(pid) not in live_ranks | {None}}
            for pid in sorted(stopped_since.keys() | ending):
                since = stopped_since.get(pid)
                if pid in terminated or not (rank_ended or pid in ending) or (
                        pid not in ending and now - since < _STOPPED_RANK_SECONDS):
                    continue
                rank = self._rank_of(pid)
                if rank is not None and pid not in ending:
                    self.ended.add(rank)
                who = f"pid {pid}" if rank is None else f"rank {rank} (pid {pid})"
                why = ("outlived the rank process it ran under" if pid in ending
                       else "is stopped (SIGSTOP) and another rank has ended")
                print(f"keras-ring-run: {who} {why}: sending it SIGCONT and SIGTERM.",
                      file=sys.stderr, flush=True)
                _signal_quietly(pid, signal.SIGCONT)
                _signal_quietly(pid, signal.SIGTERM)
                terminated[pid] = now
            for pid, when in terminated.items():
                if pid in below | adopted and now - when >= _STOPPED_RANK_KILL_SECONDS:
                    _signal_quietly(pid, signal.SIGKILL)
            for pid, (parent, state) in processes.items():
                if parent == os.getpid() and state == "Z" and pid != self._launcher_pid:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
            if last:
                if not adopted:
                    return
                time.sleep(0.1)  # until what was adopted has ended (SIGKILL at the latest)

    def _rank_of(self, pid):
        if pid not in self._ranks:
            self._ranks[pid] = _rank_of(pid)
        return self._ranks[pid]


def _processes():
    """{pid: (parent pid, state letter)} of every process in /proc."""
    processes = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        processes[int(entry.name)] = (int(fields[1]), fields[0].decode())
    return processes


def _rank_processes(launcher_pid, processes, skip=None):
    """The live rank processes under the launcher, and every live process at or below them.

    The ranks are the launcher's children (but `skip`), or those of its per-host proxies.
    """
    children = {}
    for pid, (parent, state) in processes.items():
        if state not in "ZX":
            children.setdefault(parent, []).append(pid)
    ranks = set()
    for pid in children.get(launcher_pid, []):
        if pid == skip:
            continue
        if _command_name(pid) in _RANK_PARENTS:
            ranks.update(children.get(pid, []))
        else:
            ranks.add(pid)
    below, todo = set(), list(ranks)
    while todo:
        pid = todo.pop()
        below.add(pid)
        todo += children.get(pid, [])
    return ranks, below


def _command_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _rank_of(pid):
    """The rank the MPI launcher gave process `pid` (PMI_RANK in its environment), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0"))
    except OSError:
        return None
    rank = environ.get(b"PMI_RANK") or environ.get(b"OMPI_COMM_WORLD_RANK") or b""
    return int(rank) if rank.isdigit() else None


def _set_child_subreaper(on):
    """Makes this process adopt its descendants' orphans (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def _signal_quietly(pid, signum):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


class _RankOutputs:
    """The file descriptors a forker job's ranks write their stdout and stderr to.

    A rank writes to a copy of this process's stdout or stderr, unless
    `_relay_forker_output` has to change what it writes: then to a pipe of its
    own, copied by a `_base.RankStream`. With prefixes that is every rank's stdout
    and stderr; quiet, the stderr of ranks other than 0. Each rank's end is
    reported on the pipe `ends` reads; `stop` says that the user stopped the job
    (see `_rank_output.py`).
    """

    def __init__(self, np, prefix, quiet):
        self.streams = []
        self.ends, end_fd = os.pipe()
        stop_fd, self._stop = os.pipe()
        self.handed_down = [end_fd, stop_fd]
        copies = {}
        pairs = []
        for rank in range(np):
            pair = []
            for dest in (sys.stdout, sys.stderr):
                quiet_here = quiet and rank > 0 and dest is sys.stderr
                if prefix or quiet_here:
                    read_end, fd = os.pipe()
                    self.handed_down.append(fd)
                    self.streams.append(
                        _base.RankStream(read_end, dest, f"[{rank}] " if prefix else "", quiet_here)
                    )
                else:
                    if dest not in copies:
                        copies[dest] = os.dup(dest.fileno())
                        self.handed_down.append(copies[dest])
                    fd = copies[dest]
                pair.append(f"{fd}")
            pairs.append(",".join(pair))
        # One pair serves every rank when all ranks share it.
        self.env = {
            _rank_output.VARIABLE: " ".join(pairs if len(set(pairs)) > 1 else pairs[:1]),
            _rank_output.END_VARIABLE: f"{end_fd}",
            _rank_output.STOP_VARIABLE: f"{stop_fd}",
        }

    def stop(self):
        """Tells the ranks that the user asked the job to stop: closes the pipe they watch."""
        if self._stop is not None:
            os.close(self._stop)
            self._stop = None

    def close_handed_down(self):
        """Closes this process's copies of the ranks' ends, so that a rank's pipe ends with it."""
        for fd in self.handed_down:
            os.close(fd)


def _relay_forker_output(forker_stderr, outputs):
    """Copies the forker's stderr to ours, and each prefixed rank's output to ours.

    Returns once the forker has exited and every rank's pipe has ended, or
    `_base.DRAIN_SECONDS` after the forker's exit if a pipe stays open (kept by a
    rank's own child process).

    Returns:
        The `_EndReports` of the ranks that `_rank_output.py` started.
    """
    reports = _EndReports(outputs.ends)
    selector = selectors.DefaultSelector()
    selector.register(forker_stderr.fileno(), selectors.EVENT_READ, None)
    for stream in [reports, *outputs.streams]:
        selector.register(stream.fd, selectors.EVENT_READ, stream)

    def end(stream):
        # Our reader gone (`keras-ring-run ... | head`): the rank's next write fails,
        # as it would have written to the closed pipe itself.
        selector.unregister(stream.fd)
        os.close(stream.fd)

    forker_exited = None
    while selector.get_map():
        if forker_exited is not None and time.monotonic() - forker_exited > _base.DRAIN_SECONDS:
            break
        events = selector.select(timeout=_base.PARTIAL_LINE_SECONDS)
        if not events:
            for key in list(selector.get_map().values()):
                if key.data is not None and not key.data.flush():
                    end(key.data)
            continue
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            stream = key.data
            if stream is None:  # the forker's own messages
                if not chunk:
                    selector.unregister(key.fd)
                    forker_exited = time.monotonic()
                    continue
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            elif not chunk:
                stream.flush()
                end(stream)
            elif not stream.feed(chunk):
                end(stream)
    for key in list(selector.get_map().values()):
        if key.data is not None:
            key.data.flush()
            end(key.data)
    selector.close()
    return reports


def forker_segment_paths(pid):
    """Returns the paths of the shared-memory segments of an MPICH forker's job.

    Args:
        pid: The process id of the `mpiexec.gforker` that runs the job.

    Returns:
        The `/dev/shm` paths MPICH's ranks use on this host (the general segment,
        and the one for several virtual communication interfaces).

    Example:

    >>> forker_segment_paths(1234)
    ['/dev/shm/mpich_shm_935ed4cd_0', '/dev/shm/mpich_vci_935ed4cd_0']
    """
    world_id = 2166136261  # MPICH's world id: FNV-1a (32 bits) of the kvsname.
    for byte in f"kvs_{pid}_0".encode():
        world_id = ((world_id ^ byte) * 16777619) & 0xFFFFFFFF
    return [name.format(world_id) for name in _FORKER_SEGMENT_FORMATS]


def remove_forker_segments(pid):
    """Removes the shared-memory segments of the forker job of `pid`, if there are any.

    Call it only while `pid` is a forker this process started, or this very
    process: then no running job can own these names. Ranks that have mapped
    a segment keep it until they exit.

    Args:
        pid: The process id of the `mpiexec.gforker` of the job.
    """
    for path in forker_segment_paths(pid):
        # Missing: the job ended normally. Another user's: not ours to remove.
        with contextlib.suppress(OSError):
            os.unlink(path)


def _in_terminal_foreground():
    try:
        with open("/dev/tty", "rb") as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp()
    except OSError:
        return False


def main(argv=None):
    """Runs `keras-ring-run`.

    Args:
        argv: The arguments after the program name; `sys.argv[1:]` by default.

    Returns:
        The job's exit code, or 2 when the command line or the MPI
        installation is wrong (explained on stderr).

    Example:

    ```
    keras-ring-run -np 2 --prefix-output python -c "import os; print(os.environ['PMI_RANK'])"
    ```
    """
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        if options.elastic:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **options.settings}
            return _elastic_driver.run_elastic_job(options, env)
        if options.transport == "tcp":
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **options.settings}
            return _tcp_jobs.run_tcp_job(options, env)
        launcher = locate_launcher(_build_info.read_build_info())
        env = launcher_env(launcher, options, os.environ)
        argv = launcher_command(launcher, options, env)
    except _base.LaunchError as e:
        print(f"keras-ring-run: {e}", file=sys.stderr)
        return USAGE_ERROR
    if options.verbose:
        changed = [
            f"{name}={value}" for name, value in env.items() if os.environ.get(name) != value
        ]
        print(f"keras-ring-run: {shlex.join(changed + argv)}", file=sys.stderr, flush=True)
    return run_job(argv, env, forker=argv[0] == launcher.forker,
                   prefix_output=options.prefix_output, quiet=not options.all_output,
                   np=options.np)
