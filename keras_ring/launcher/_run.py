"""`kr.run`: start N workers from Python (a script or a notebook) and collect their results.

The function and its arguments travel to the workers pickled by value
(cloudpickle), so functions defined in a notebook or a `__main__` script work;
the workers are started by `keras-ring-run`, exactly as a job from the shell.
"""

import os
import pickle
import signal
import subprocess
import sys
import tempfile

import cloudpickle

# Errors that only say another rank went first; the caller wants the first cause.
_CONSEQUENCES = ("shut down (shutdown() or its process exiting)", "stopped, its engine failed")
_STOP_GRACE_SECONDS = 10


class _RemoteTraceback(Exception):
    """The worker's traceback, attached as the `__cause__` of the re-raised exception."""

    def __str__(self):
        return self.args[0]


# Horovod's `run` arguments that keras-ring cannot honour, and why; refused
# when given (not None) rather than ignored.
_REFUSED = {
    "min_num_proc": "elastic training is not offered",
    "max_num_proc": "elastic training is not offered",
    "min_np": "elastic training is not offered",
    "max_np": "elastic training is not offered",
    "reset_limit": "elastic training is not offered",
    "cooldown_range": "elastic training is not offered",
    "host_discovery_script": "elastic training is not offered",
    "slots": "give each host's slots in `hosts`, as 'host:slots'",
    "start_timeout": "the MPI launcher starts the ranks, without a start timeout",
    "ssh_port": "the MPI launcher reaches other hosts as configured for it (see docs/launching.md)",
    "ssh_identity_file": (
        "the MPI launcher reaches other hosts as configured for it (see docs/launching.md)"
    ),
    "output_filename": "workers' output comes to this process, prefixed with its rank",
    "mpi_args": "keras-ring-run passes no arguments to the MPI launcher",
    "network_interface": "the MPI library chooses the network interfaces",
    "network_interfaces": "the MPI library chooses the network interfaces",
}
DEFAULT_NUM_PROC = 2


def run(
    func,
    args=(),
    kwargs=None,
    num_proc=None,
    min_num_proc=None,
    max_num_proc=None,
    slots=None,
    reset_limit=None,
    cooldown_range=None,
    hosts=None,
    hostfile=None,
    host_discovery_script=None,
    start_timeout=None,
    ssh_port=None,
    ssh_identity_file=None,
    disable_cache=None,
    output_filename=None,
    verbose=None,
    use_gloo=None,
    use_mpi=None,
    mpi_args=None,
    network_interface=None,
    network_interfaces=None,
    executable=None,
    np=None,
    min_np=None,
    max_np=None,
    env=None,
):
    """Runs `func(*args, **kwargs)` on `num_proc` ranks and returns their results in rank order.

    Horovod's `horovod.run`, arguments in its order. Each worker is a fresh
    Python process started through `keras-ring-run`; `func` calls `kr.init()`
    itself, as a script would. Worker output is streamed to this process's
    stdout, each line prefixed with `[rank]`. An exception in a worker is
    raised here, with the rank in its notes and the worker's traceback as its
    cause. Interrupting the caller (Ctrl-C, or the notebook's interrupt
    button) stops the workers.

    Horovod's arguments for what keras-ring does not have (elastic training,
    Gloo, SSH and network options, `slots`, `start_timeout`,
    `output_filename`, `mpi_args`) raise `ValueError` when given.

    Args:
        func: The function to run; defined anywhere, a notebook cell included.
        args: Positional arguments for `func` (pickled).
        kwargs: Keyword arguments for `func` (pickled).
        num_proc: The number of ranks (default 2; Horovod's default is 1).
        min_num_proc: Refused (elastic training).
        max_num_proc: Refused (elastic training).
        slots: Refused: give the slots in `hosts`.
        reset_limit: Refused (elastic training).
        cooldown_range: Refused (elastic training).
        hosts: Hosts and slots as for `keras-ring-run -H`, e.g.
            `"node1:2,node2:2"`; by default this host only.
        hostfile: A host file, as for `keras-ring-run --hostfile`.
        host_discovery_script: Refused (elastic training).
        start_timeout: Refused.
        ssh_port: Refused.
        ssh_identity_file: Refused.
        disable_cache: Accepted: keras-ring caches no launch checks.
        output_filename: Refused.
        verbose: If true, the launcher prints its command first.
        use_gloo: True: the job runs without MPI, on the TCP world
            (`keras-ring-run --transport tcp`), as Horovod's Gloo jobs do.
        use_mpi: True: over MPI (the default); not with `use_gloo=True`.
        mpi_args: Refused.
        network_interface: Refused.
        network_interfaces: Refused.
        executable: The Python of the workers (default `sys.executable`).
        np: Same as `num_proc`.
        min_np: Refused (elastic training).
        max_np: Refused (elastic training).
        env: Extra environment variables for the workers (keras-ring's own
            argument).

    Returns:
        A list with `func`'s return value on each rank, in rank order.

    Raises:
        ValueError: If `num_proc` is not a positive integer, `np` and
            `num_proc` differ, `hosts` and `hostfile` are both given, or an
            argument keras-ring cannot honour is given.
        Exception: The exception a worker raised (of the first rank that
            failed of its own accord, not because another stopped).
        RuntimeError: If a worker ended without a result (killed, or the
            job could not start); the message holds its output's tail.

    Example:

    ```python
    def train(lr):
        import keras_ring as kr

        kr.init()
        return kr.rank(), lr * kr.size()

    kr.run(train, args=(0.1,), np=2)  # [(0, 0.2), (1, 0.2)]
    ```
    """
    given = locals()
    for name, reason in _REFUSED.items():
        if given[name] is not None:
            raise ValueError(
                f"keras_ring.run does not take `{name}`: {reason}. "
                f"Received: {name}={given[name]!r}"
            )
    if use_gloo and use_mpi:
        raise ValueError(
            "Pass `use_gloo=True` (a job without MPI, on keras-ring's TCP world) or "
            f"`use_mpi=True`, not both. Received: use_gloo={use_gloo!r}, use_mpi={use_mpi!r}"
        )
    if num_proc is not None and np is not None and num_proc != np:
        raise ValueError(
            "Pass `num_proc` or `np` (the same), not two numbers. "
            f"Received: num_proc={num_proc!r}, np={np!r}"
        )
    name, count = ("np", np) if np is not None else ("num_proc", num_proc)
    count = DEFAULT_NUM_PROC if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={count!r}")
    if hosts is not None and hostfile is not None:
        raise ValueError(
            f"Pass `hosts` or `hostfile`, not both. Received: hosts={hosts!r}, "
            f"hostfile={hostfile!r}"
        )
    python = executable or sys.executable
    with tempfile.TemporaryDirectory(prefix="keras-ring-run-") as directory:
        with open(os.path.join(directory, "payload.pkl"), "wb") as f:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), f)
        command = [sys.executable, "-m", "keras_ring", "-np", str(count)]
        if hosts:
            command += ["-H", hosts]
        if hostfile:
            command += ["--hostfile", os.fspath(hostfile)]
        if verbose:
            command.append("--verbose")
        command += ["--", python, "-m", "keras_ring.launcher._run_worker", directory]
        # The workers import what this process can: a function defined in a
        # module next to a script or a test travels by reference.
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        job_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        if use_gloo:
            job_env["KERAS_RING_TRANSPORT"] = "tcp"
        returncode, tail = _stream(command, job_env)
        return _results(directory, count, returncode, tail)


def _stream(command, env):
    """Runs the job, copying its output to sys.stdout; returns its exit code and last lines."""
    tail = []
    # A session of its own: the terminal's Ctrl-C reaches only this process,
    # which then stops the job in order.
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as job:
        try:
            for line in iter(job.stdout.readline, b""):
                text = line.decode(errors="replace")
                sys.stdout.write(text)
                sys.stdout.flush()
                tail = (tail + [text])[-20:]
            return job.wait(), "".join(tail)
        except BaseException:
            _stop(job)
            raise


def _stop(job):
    # keras-ring-run passes SIGTERM on to the ranks; kill what is left after a grace.
    try:
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    except ProcessLookupError:
        pass


def _results(directory, np, returncode, tail):
    outcomes = []
    for rank in range(np):
        path = os.path.join(directory, f"result.{rank}.pkl")
        if not os.path.exists(path):
            raise RuntimeError(
                f"keras-ring: rank {rank} ended without a result (job exit code {returncode}). "
                f"Last output:\n{tail}"
            )
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return raise_first_failure(outcomes)


def raise_first_failure(outcomes):
    """The results of the ranks' outcomes (`_run_worker._outcome`'s tuples, in rank order), or the
    exception of the first rank that failed of its own accord, raised with its rank in a
    note and its traceback as the cause."""
    results, failures = [], []
    for rank, outcome in enumerate(outcomes):
        if outcome[0] == "ok":
            results.append(outcome[1])
        else:
            failures.append((rank, *outcome[1:]))
    if not failures:
        return results
    first = next((f for f in failures if not any(c in f[2] for c in _CONSEQUENCES)), failures[0])
    rank, exception, text, traceback_text = first
    if exception is None:  # it could not be pickled
        exception = RuntimeError(text)
    exception.add_note(f"keras-ring: raised on rank {rank} of {len(outcomes)}")
    raise exception from _RemoteTraceback(f"\n\nTraceback on rank {rank}:\n{traceback_text}")
