"""Shared test setup: markers and the `run_ranks` fixture that starts multi-rank jobs."""

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile

import pytest

# Each rank gets a small share of the machine: CI runners have 2 cores.
RANK_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "2",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
OUTPUT_TAIL_LINES = 80
# After a timeout, how long the launcher gets to stop its ranks before SIGKILL.
STOP_GRACE_SECONDS = 10


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multirank: starts a job of several ranks under keras-ring-run"
    )
    import keras_ring

    package = os.path.dirname(keras_ring.__file__)
    if not os.path.exists(os.path.join(package, "core", "_build_info.json")):
        raise pytest.UsageError(
            f"the tests imported keras_ring from {package}, which is not an installed build. "
            "Install it (pip install '.[test]') and run `pytest` rather than `python -m pytest`, "
            "which puts the source tree first on sys.path."
        )


_CPP_BUILDS = pytest.StashKey()


def pytest_collection_modifyitems(config, items):
    # The C++ suite runs last; its builds start now and run while the other tests do, on the
    # cores those leave idle (tests/cpp_builds.py).
    cpp = [item for item in items if item.path.name == "test_core_cpp.py"]
    if cpp:
        from cpp_builds import CppBuilds

        items[:] = [item for item in items if item not in cpp] + cpp
        config.stash[_CPP_BUILDS] = CppBuilds(tempfile.mkdtemp(prefix="kr-cpp-")).start()


def pytest_unconfigure(config):
    builds = config.stash.get(_CPP_BUILDS, None)
    if builds is not None:
        builds.stop()


@pytest.fixture(scope="session")
def cpp_builds(request):
    """The C++ suite's builds (tests/cpp_builds.py), started when the tests were collected."""
    return request.config.stash[_CPP_BUILDS]


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    # `python -c` and `python script` put the working directory first on
    # sys.path: run from elsewhere so that subprocesses import the installed
    # keras_ring, never the unbuilt source tree.
    monkeypatch.chdir(tmp_path)


def _tail(text):
    return "\n".join(text.splitlines()[-OUTPUT_TAIL_LINES:])


@pytest.fixture
def run_ranks():
    """Runs a script as `np` ranks under `keras-ring-run`, as a user would.

    Called as `run_ranks(np, script_path, *args, timeout=300, env=None, check=True,
    transport=None)`; `env` adds to (or overrides) this process's environment
    and the per-rank thread settings; `transport` ("mpi" or "tcp") is passed
    as `--transport` when given. The test fails, showing the end of the output, when the
    job exits with a non-zero code (unless `check` is False) or runs past
    `timeout` seconds (then the launcher's whole process group is stopped).

    Returns:
        A `subprocess.CompletedProcess` whose `stdout` holds stdout and stderr.
    """

    def run(np, script_path, *args, timeout=300, env=None, check=True, transport=None):
        command = [
            os.path.join(os.path.dirname(sys.executable), "keras-ring-run"),
            "-np",
            str(np),
            *(["--transport", transport] if transport else []),
            "--",
            sys.executable,
            str(script_path),
            *map(str, args),
        ]
        label = f"{np}-rank job {script_path}" + (f" over {transport}" if transport else "")
        return run_job(command, label, timeout=timeout, env=env, check=check)

    return run


def run_job(command, label, timeout=300, env=None, check=True):
    """Runs a job's command as `run_ranks` does (its own session, output to a file).

    Args:
        command: The argv, e.g. a `keras-ring-run` command line.
        label: What the job is, for failure messages ("2-rank job worker.py").
        timeout: Seconds before the job is stopped and the test fails.
        env: Added to (or overriding) this process's environment and the
            per-rank thread settings.
        check: Whether a non-zero exit code fails the test.

    Returns:
        A `subprocess.CompletedProcess` whose `stdout` holds stdout and stderr.
    """
    job_env = {**os.environ, **RANK_THREAD_ENV, **(env or {})}
    # A file, not a pipe: ranks that outlive a killed launcher cannot block the read.
    with tempfile.TemporaryFile() as output:
        job = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=job_env,
            start_new_session=True,
        )
        try:
            job.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_process_group(job)
        output.seek(0)
        text = output.read().decode(errors="replace")
    if timed_out:
        pytest.fail(f"{label} ran past {timeout} s and was stopped. Output tail:\n{_tail(text)}")
    if check and job.returncode != 0:
        pytest.fail(f"{label} exited with {job.returncode}. Output tail:\n{_tail(text)}")
    return subprocess.CompletedProcess(command, job.returncode, text, None)


@pytest.fixture(scope="module")
def netns_hosts():
    """Three hosts made of network namespaces (tests/netns_hosts.py), removed afterwards.

    Skips the test where they cannot be made (not root, no `ip netns`, no veth
    or bridge support).
    """
    from netns_hosts import NetnsHosts

    reason = NetnsHosts.unavailable()
    if reason:
        pytest.skip(reason)
    hosts = NetnsHosts(3)
    try:
        hosts.create()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make network-namespace hosts: `{shlex.join(e.cmd)}`: "
                    f"{(e.stderr or '').strip()}")
    try:
        yield hosts
    finally:
        hosts.destroy()


def _stop_process_group(job):
    """SIGTERM (the launcher passes it on to the ranks), then SIGKILL, to the job's group."""
    try:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=STOP_GRACE_SECONDS)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()
