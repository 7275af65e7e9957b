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


def run(fn, args=(), kwargs=None, np=2, hosts=None, env=None):
    """Runs `fn(*args, **kwargs)` on `np` ranks and returns their results in rank order.

    Each worker is a fresh Python process started through `keras-ring-run`;
    `fn` calls `kr.init()` itself, as a script would. Worker output is streamed
    to this process's stdout, each line prefixed with `[rank]`. An exception
    in a worker is raised here, with the rank in its notes and the worker's
    traceback as its cause. Interrupting the caller (Ctrl-C, or the notebook's
    interrupt button) stops the workers.

    Args:
        fn: The function to run; defined anywhere, a notebook cell included.
        args: Positional arguments for `fn` (pickled).
        kwargs: Keyword arguments for `fn` (pickled).
        np: The number of ranks.
        hosts: Hosts and slots as for `keras-ring-run -H`, e.g.
            `"node1:2,node2:2"`; by default this host only.
        env: Extra environment variables for the workers.

    Returns:
        A list with `fn`'s return value on each rank, in rank order.

    Raises:
        ValueError: If `np` is not a positive integer.
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
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"`np` must be a positive integer. Received: np={np!r}")
    with tempfile.TemporaryDirectory(prefix="keras-ring-run-") as directory:
        with open(os.path.join(directory, "payload.pkl"), "wb") as f:
            cloudpickle.dump((fn, tuple(args), dict(kwargs or {})), f)
        command = [sys.executable, "-m", "keras_ring", "-np", str(np)]
        if hosts:
            command += ["-H", hosts]
        command += ["--", sys.executable, "-m", "keras_ring._run_worker", directory]
        # The workers import what this process can: a function defined in a
        # module next to a script or a test travels by reference.
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        job_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        returncode, tail = _stream(command, job_env)
        return _results(directory, np, returncode, tail)


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
    results, failures = [], []
    for rank in range(np):
        path = os.path.join(directory, f"result.{rank}.pkl")
        if not os.path.exists(path):
            raise RuntimeError(
                f"keras-ring: rank {rank} ended without a result (job exit code {returncode}). "
                f"Last output:\n{tail}"
            )
        with open(path, "rb") as f:
            outcome = pickle.load(f)
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
    exception.add_note(f"keras-ring: raised on rank {rank} of {np}")
    raise exception from _RemoteTraceback(f"\n\nTraceback on rank {rank}:\n{traceback_text}")
