"""keras-ring-run (keras_ring/launcher/_main.py) and its checks in keras_ring/core/_mpi_env.py."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from keras_ring.core import _build_info, _end_report, _mpi_env
from keras_ring.launcher import _base, _main

WORKERS = os.path.join(os.path.dirname(__file__), "workers")

COMMAND = ["python", "train.py"]
HYDRA = _main.Launcher("/mpi/bin/mpiexec", "MPICH")
MPICH_WITH_FORKER = _main.Launcher("/mpi/bin/mpiexec", "MPICH", "/mpi/bin/mpiexec.gforker")
OPEN_MPI = _main.Launcher("/ompi/bin/mpirun", "Open MPI")
INTEL = _main.Launcher("/impi/bin/mpiexec", "Intel MPI")
VERSION_TEXT = {
    "MPICH": "HYDRA build details:\n    Version: 4.2.0",
    "Open MPI": "mpirun (Open MPI) 5.0.3",
    "Intel MPI": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619",
}


def options(*argv, environ=None):
    return _main.parse_args([*argv, *COMMAND], environ=environ or {})


def write_build_info(monkeypatch, tmp_path, **info):
    path = tmp_path / "_build_info.json"
    path.write_text(json.dumps({**_build_info._DEFAULT_BUILD_INFO, **info}))
    monkeypatch.setattr(_build_info, "_BUILD_INFO_PATH", path)


def write_fake_launcher(path, version_text, stderr_text="", exit_code=3):
    """A shell script that answers `--version`, else records its argv and env."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = --version ]; then printf '%s\\n' '{version_text}'; exit 0; fi\n"
        f"printf '%s\\n' \"$@\" > '{path}.argv'\n"
        f"env > '{path}.env'\n"
        f"printf '%s' '{stderr_text}' >&2\n"
        f"exit {exit_code}\n"
    )
    path.chmod(0o755)
    return path


def run_main(capfd, *argv):
    code = _main.main(list(argv))
    return code, capfd.readouterr().err


# Arguments.


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required: -np"),
        (["-np", "x", "ls"], "invalid int value: 'x'"),
        (["-np", "0", "ls"], "Received: -np=0"),
        (["-np", "2"], "no command to run"),
        (["-np", "2", "-H", "a:0", "ls"], "Received: -H=a:0"),
        (["-np", "2", "-H", "a", "--hostfile", "hosts", "ls"], "not both"),
    ],
)
def test_bad_arguments_are_explained_with_exit_code_2(capfd, argv, message):
    code, err = run_main(capfd, *argv)
    assert code == 2
    assert err.startswith("keras-ring-run: ")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, variables",
    [
        (["--fusion-threshold-mb", "64"], {"KERAS_RING_FUSION_THRESHOLD": str(64 << 20)}),
        (["--fusion-threshold-mb", "0.5"], {"KERAS_RING_FUSION_THRESHOLD": str(1 << 19)}),
        (["--cycle-time-ms", "3.5"], {"KERAS_RING_CYCLE_TIME": "3.5"}),
        (["--cache-capacity", "0"], {"KERAS_RING_CACHE_CAPACITY": "0"}),
        (["--hierarchical-allreduce"], {"KERAS_RING_HIERARCHICAL_ALLREDUCE": "1"}),
        (["--no-hierarchical-allreduce"], {"KERAS_RING_HIERARCHICAL_ALLREDUCE": "0"}),
        (["--autotune", "--autotune-log-file", "tune.csv", "--autotune-warmup-samples", "2",
          "--autotune-steps-per-sample", "5"],
         {"KERAS_RING_AUTOTUNE": "1", "KERAS_RING_AUTOTUNE_LOG": "tune.csv",
          "KERAS_RING_AUTOTUNE_WARMUP_SAMPLES": "2", "KERAS_RING_AUTOTUNE_STEPS_PER_SAMPLE": "5"}),
        (["--timeline-filename", "t.json", "--timeline-mark-cycles"],
         {"KERAS_RING_TIMELINE": "t.json", "KERAS_RING_TIMELINE_MARK_CYCLES": "1"}),
        (["--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "90"],
         {"KERAS_RING_STALL_CHECK_TIME": "30.0", "KERAS_RING_STALL_SHUTDOWN_TIME": "90.0"}),
        (["--no-stall-check"],
         {"KERAS_RING_STALL_CHECK_TIME": "0", "KERAS_RING_STALL_SHUTDOWN_TIME": "0"}),
        (["--log-level", "DEBUG", "--log-hide-timestamp"],
         {"KERAS_RING_LOG_LEVEL": "debug", "KERAS_RING_LOG_HIDE_TIME": "1"}),
        ([], {}),
    ],
)
def test_horovodrun_settings_become_engine_variables(argv, variables):
    parsed = options("-np", "2", *argv)
    assert parsed.settings == variables
    # Over the same variables inherited from the shell.
    env = _main.launcher_env(HYDRA, parsed, {name: "inherited" for name in variables})
    assert {name: env[name] for name in variables} == variables


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fusion-threshold-mb", "-1"], "--fusion-threshold-mb must be a number of 0 or more. "
                                          "Received: --fusion-threshold-mb=-1"),
        (["--cycle-time-ms", "fast"], "Received: --cycle-time-ms=fast"),
        (["--cache-capacity", "1.5"], "--cache-capacity must be a whole number"),
        (["--log-level", "loud"], "--log-level must be one of trace, debug"),
        (["--timeline-filename", ""], "--timeline-filename needs a file name"),
        (["--no-stall-check", "--stall-check-shutdown-time-seconds", "9"], "contradicts it"),
        (["--hierarchical-allreduce", "--no-hierarchical-allreduce"], "not allowed with"),
    ],
)
def test_bad_settings_are_explained_with_exit_code_2(capfd, argv, message):
    code, err = run_main(capfd, "-np", "2", *argv, "ls")
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_command_may_follow_a_double_dash():
    parsed = _main.parse_args(["-np", "2", "--", "python", "-H", "x.py"])
    assert parsed.command == ["python", "-H", "x.py"]
    assert parsed.hosts is None


# Command construction.


def test_one_host_mpich_job_runs_under_the_forker():
    # Each rank starts through _rank_output.py, which hands it our output; the
    # prefixes are ours too (the forker's -l would copy the output itself).
    shim = [sys.executable, "-I", "-S", str(_main._RANK_OUTPUT_SCRIPT)]
    for argv in (["-np", "2"], ["-np", "2", "--prefix-output"]):
        assert _main.launcher_command(MPICH_WITH_FORKER, options(*argv), {}) == [
            "/mpi/bin/mpiexec.gforker", "-n", "2", *shim, *COMMAND,
        ]


def test_one_host_hydra_job_stays_on_loopback():
    assert _main.launcher_command(HYDRA, options("-np", "2", "--prefix-output"), {}) == [
        "/mpi/bin/mpiexec",
        "-hosts",
        "localhost",
        "-iface",
        "lo",
        "-prepend-rank",
        "-np",
        "2",
        *COMMAND,
    ]


START_UP_NOTICE = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)


class _Destination:
    def __init__(self):
        self.buffer = io.BytesIO()


def test_prefixed_rank_output_keeps_lines_whole_and_prefixes_redrawn_lines():
    dest = _Destination()
    stream = _base.RankStream(-1, dest, "[3] ", quiet=False)
    assert stream.feed(b"a\nb")  # "b" waits for the rest of its line
    assert dest.buffer.getvalue() == b"[3] a\n"
    stream.feed(b"c\r\n")  # one line ending, not a redraw
    stream.feed(b"\r1/2 \xe2\x94")  # a redraw, cut inside a UTF-8 character
    stream.feed(b"\x81\r2/2 \xe2\x94\x81\n")
    stream.feed(b"prompt: ")
    stream.flush()  # the pipe went quiet: the unfinished line is written
    stream.feed(b"yes\n")
    assert dest.buffer.getvalue().decode() == (
        "[3] a\n[3] bc\r\n[3] \r[3] 1/2 ━\r[3] 2/2 ━\n[3] prompt: yes\n"
    )


def test_quiet_rank_output_leaves_out_only_whole_start_up_lines():
    dest = _Destination()
    stream = _base.RankStream(-1, dest, "", quiet=True)
    notice = START_UP_NOTICE
    stream.feed(notice + b"\nI0000 00:00:1796176450.224693    5878 cudart_stub.cc:31] Could not")
    stream.feed(b" find cuda drivers on your machine, GPU will not be used.\r\n")
    stream.feed(b"[1] " + notice + b"\n")  # as kr.run's workers write it
    error = b"E0000 00:00:1796176510.612931    5878 cuda_platform.cc:52] failed call to cuInit\n"
    stream.feed(error)
    stream.feed(notice[:20])
    stream.flush()  # cut by the pipe going quiet: shown
    stream.feed(notice[20:] + b"\nrank 1: " + notice + b"\n" + notice + b" and more\n")
    assert dest.buffer.getvalue() == (
        error + notice + b"\nrank 1: " + notice + b"\n" + notice + b" and more\n"
    )


def test_rank_output_writes_each_line_at_once():
    class Writes:
        class buffer:  # noqa: N801 -- stands for sys.stderr.buffer
            written = []
            write = written.append

            def flush():
                pass

    stream = _base.RankStream(-1, Writes, "", quiet=True)
    stream.feed(b"a\n" + START_UP_NOTICE + b"\nb\r2/2\n")
    assert Writes.buffer.written == [b"a\n", b"b\r", b"2/2\n"]


def test_prefixed_rank_output_tells_when_its_reader_has_gone():
    class Closed:
        class buffer:  # noqa: N801 -- stands for sys.stdout.buffer
            def write(data):
                raise BrokenPipeError

    assert not _base.RankStream(-1, Closed, "[0] ", quiet=False).feed(b"line\n")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", socket.gethostname()])
def test_local_hosts_make_a_one_host_job(host):
    argv = _main.launcher_command(MPICH_WITH_FORKER, options("-np", "2", "-H", f"{host}:2"), {})
    assert argv[0] == "/mpi/bin/mpiexec.gforker"


@pytest.mark.parametrize("launcher", [HYDRA, MPICH_WITH_FORKER, INTEL])
def test_multi_host_hydra_job(launcher):
    assert _main.launcher_command(
        launcher, options("-np", "3", "-H", "a:2,b", "--prefix-output"), {}
    ) == [launcher.path, "-hosts", "a:2,b:1", "-prepend-rank", "-np", "3", *COMMAND]
    assert _main.launcher_command(launcher, options("-np", "4", "--hostfile", "hosts"), {}) == [
        launcher.path,
        "-f",
        "hosts",
        "-np",
        "4",
        *COMMAND,
    ]


@pytest.mark.parametrize("launcher", [HYDRA, MPICH_WITH_FORKER])
def test_remote_shell_of_a_multi_host_hydra_job(launcher, tmp_path):
    rsh = write_fake_launcher(tmp_path / "rsh", "")
    expected = [launcher.path, "-hosts", "a:2,b:2", "-launcher", "ssh", "-launcher-exec", str(rsh),
                "-np", "4", *COMMAND]
    parsed = options("-np", "4", "-H", "a:2,b:2", "--remote-shell", str(rsh))
    assert _main.launcher_command(launcher, parsed, {}) == expected
    # From the environment, found on the job's PATH; the option wins over the variable.
    parsed = options("-np", "4", "-H", "a:2,b:2", environ={"KERAS_RING_REMOTE_SHELL": "rsh"})
    assert parsed.remote_shell == "rsh"
    assert _main.launcher_command(launcher, parsed, {"PATH": str(tmp_path)}) == [
        *expected[:6], "rsh", *expected[7:]]
    parsed = options("-np", "4", "-H", "a:2,b:2", "--remote-shell", "sh",
                     environ={"KERAS_RING_REMOTE_SHELL": "rsh"})
    assert parsed.remote_shell == "sh"
    argv = _main.launcher_command(launcher, options(
        "-np", "4", "--hostfile", "hosts", "--remote-shell", str(rsh), "--prefix-output"), {})
    assert argv == [launcher.path, "-f", "hosts", "-launcher", "ssh", "-launcher-exec", str(rsh),
                    "-prepend-rank", "-np", "4", *COMMAND]


def test_remote_shell_without_one_is_the_launchers_default_and_unused_on_one_host(tmp_path):
    for environ in ({}, {"KERAS_RING_REMOTE_SHELL": ""}):
        parsed = options("-np", "2", "-H", "a,b", environ=environ)
        assert parsed.remote_shell is None
        assert "-launcher" not in _main.launcher_command(HYDRA, parsed, {})
    # A one-host job starts no remote shell: the forker, or Hydra on loopback.
    parsed = options("-np", "2", "--remote-shell", "/no/such/rsh")
    assert _main.launcher_command(MPICH_WITH_FORKER, parsed, {})[0] == MPICH_WITH_FORKER.forker
    assert "-launcher" not in _main.launcher_command(HYDRA, parsed, {})


def test_remote_shell_of_other_mpis(tmp_path):
    rsh = str(write_fake_launcher(tmp_path / "rsh", ""))
    argv = _main.launcher_command(
        INTEL, options("-np", "2", "-H", "a,b", "--remote-shell", rsh), {})
    assert argv[3:7] == ["-bootstrap", "ssh", "-bootstrap-exec", rsh]
    # Open MPI splits its agent at spaces: a command with arguments is fine.
    argv = _main.launcher_command(
        OPEN_MPI, options("-np", "2", "-H", "a,b", "--remote-shell", "ssh -p 2222"), {})
    assert argv == ["/ompi/bin/mpirun", "-np", "2", "-H", "a:1,b:1",
                    "--mca", "plm_rsh_agent", "ssh -p 2222", *COMMAND]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--remote-shell", " "], "--remote-shell needs a command"),
        (["--remote-shell", "ssh -p 2222"], "runs the remote shell as one program"),
        (["--remote-shell", "/no/such/rsh"], "cannot find the remote shell '/no/such/rsh'"),
    ],
)
def test_bad_remote_shell_is_explained_with_exit_code_2(monkeypatch, tmp_path, capfd, argv,
                                                       message):
    write_build_info(monkeypatch, tmp_path, mpi_source="system", mpi_vendor="MPICH",
                     mpiexec=str(write_fake_launcher(tmp_path / "bin" / "mpiexec",
                                                     VERSION_TEXT["MPICH"])))
    code, err = run_main(capfd, "-np", "2", "-H", "a,b", *argv, "ls")
    assert code == 2
    assert err.startswith("keras-ring-run: ")
    assert message in err
    assert "Traceback" not in err


def test_one_host_open_mpi_job():
    assert _main.launcher_command(OPEN_MPI, options("-np", "2", "--prefix-output"), {}) == [
        "/ompi/bin/mpirun",
        "-np",
        "2",
        "--tag-output",
        *COMMAND,
    ]


def test_multi_host_open_mpi_job_exports_the_environment():
    env = {"PYTHONUNBUFFERED": "1", "MY_SETTING": "x", "PWD": "/here", "BASH_FUNC_f%%": "() {}"}
    assert _main.launcher_command(OPEN_MPI, options("-np", "4", "-H", "a:2,b:2"), env) == [
        "/ompi/bin/mpirun",
        "-np",
        "4",
        "-H",
        "a:2,b:2",
        "-x",
        "MY_SETTING",
        "-x",
        "PYTHONUNBUFFERED",
        *COMMAND,
    ]
    argv = _main.launcher_command(OPEN_MPI, options("-np", "4", "--hostfile", "hosts"), env)
    assert argv[3:5] == ["--hostfile", "hosts"]


# Environment.


def test_one_host_job_environment():
    env = _main.launcher_env(HYDRA, options("-np", "2"), {"UCX_NET_DEVICES": "mlx5_0:1"})
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["FI_TCP_IFACE"] == env["FI_SOCKETS_IFACE"] == "lo"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"


def test_multi_host_job_environment_is_not_restricted_to_loopback():
    env = _main.launcher_env(HYDRA, options("-np", "2", "-H", "a,b"), {"KEEP": "1"})
    assert env == {"KEEP": "1", "PYTHONUNBUFFERED": "1"}


def test_open_mpi_keeps_the_users_exclude_list():
    environ = {"OMPI_MCA_btl_tcp_if_exclude": "docker0"}
    env = _main.launcher_env(OPEN_MPI, options("-np", "2"), environ)
    assert "OMPI_MCA_btl_tcp_if_include" not in env
    assert env["OMPI_MCA_oob_tcp_if_include"] == env["UCX_NET_DEVICES"] == "lo"


# Finding the launcher.


def test_missing_build_info_means_pypi_mpich(monkeypatch, tmp_path):
    monkeypatch.setattr(_build_info, "_BUILD_INFO_PATH", tmp_path / "absent.json")
    assert _build_info.read_build_info()["mpi_source"] == "pypi-mpich"


def test_missing_pypi_mpich_launcher_is_explained(monkeypatch, tmp_path, capfd):
    write_build_info(monkeypatch, tmp_path, mpi_source="pypi-mpich")
    monkeypatch.setattr(_build_info.sysconfig, "get_path", lambda name, scheme=None: str(tmp_path))
    code, err = run_main(capfd, "-np", "2", "ls")
    assert code == 2
    assert f"{tmp_path}/mpiexec" in err
    assert "-m pip install mpich" in err
    assert "Traceback" not in err


def test_missing_system_launcher_is_explained(monkeypatch, tmp_path, capfd):
    gone = str(tmp_path / "gone" / "mpiexec")
    write_build_info(monkeypatch, tmp_path, mpi_source="system", mpiexec=gone, mpicxx="/x/mpicxx")
    code, err = run_main(capfd, "-np", "2", "ls")
    assert code == 2
    assert gone in err and "/x/mpicxx" in err and "KERAS_RING_MPICXX" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "built, found", [("MPICH", "Open MPI"), ("Open MPI", "MPICH"), ("MPICH", "Intel MPI")]
)
def test_launcher_of_another_mpi_is_refused(monkeypatch, tmp_path, capfd, built, found):
    mpiexec = write_fake_launcher(tmp_path / "bin" / "mpiexec", VERSION_TEXT[found])
    write_build_info(
        monkeypatch, tmp_path, mpi_source="system", mpi_vendor=built, mpiexec=str(mpiexec)
    )
    code, err = run_main(capfd, "-np", "2", "ls")
    assert code == 2
    assert f"launcher of {found}, but keras-ring was built against {built}" in err
    assert "Traceback" not in err
    assert not os.path.exists(f"{mpiexec}.argv")


def test_launcher_with_unknown_version_text_is_trusted(tmp_path):
    mpiexec = write_fake_launcher(tmp_path / "mpiexec", "a wrapper script")
    info = {
        **_build_info._DEFAULT_BUILD_INFO,
        "mpi_source": "system",
        "mpi_vendor": "Open MPI",
        "mpiexec": str(mpiexec),
    }
    assert _main.locate_launcher(info) == _main.Launcher(str(mpiexec), "Open MPI")


def test_job_runs_with_its_environment_and_exit_code(monkeypatch, tmp_path, capfd):
    mpiexec = write_fake_launcher(tmp_path / "bin" / "mpiexec", VERSION_TEXT["MPICH"])
    write_build_info(monkeypatch, tmp_path, mpi_source="system", mpiexec=str(mpiexec))
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    code, err = run_main(capfd, "-np", "2", "--verbose", *COMMAND)
    assert code == 3
    expected = ["-hosts", "localhost", "-iface", "lo", "-np", "2", *COMMAND]
    assert mpiexec.with_suffix(".argv").read_text().split("\n")[:-1] == expected
    job_env = mpiexec.with_suffix(".env").read_text().splitlines()
    assert "PYTHONUNBUFFERED=1" in job_env and "UCX_NET_DEVICES=lo" in job_env
    assert f"{mpiexec} -hosts localhost -iface lo -np 2 python train.py" in err


def _end(rank, ended, status=0, stopped=None):
    return _main._RankEnd(rank, status, ended, stopped)


KILLED = signal.SIGKILL  # a wait status: killed by SIGKILL
QUIT = signal.SIGQUIT
EXIT_1 = 1 << 8


@pytest.mark.parametrize("ends, named, code", [
    # Killed: the forker stops the others (SIGINT, then SIGQUIT).
    ([_end(0, 5.0, QUIT, stopped=3.0), _end(1, 2.9, KILLED)],
     "rank 1 died of signal 9 (Killed); the launcher stopped the other ranks.", 137),
    # os._exit(0), or a shell that ran on after its python was killed: a clean exit mid-job.
    ([_end(0, 4.0, EXIT_1, stopped=3.0), _end(1, 2.9)],
     "rank 1 exited with code 0 without MPI_Finalize; the launcher stopped the other ranks.", 1),
    # A rank that finished earlier, with MPI_Finalize, is not the one.
    ([_end(0, 1.0), _end(1, 6.0, QUIT, stopped=5.1), _end(2, 5.0, 137 << 8)],
     "rank 2 exited with code 137; the launcher stopped the other ranks.", 137),
    # An exception: the rank finalizes and the others fail on their own, maybe first.
    ([_end(0, 3.0, EXIT_1), _end(1, 3.5, EXIT_1)], None, 0),
    ([_end(0, 3.0), _end(1, 3.1)], None, 0),
    # The forker stopped every rank: the user asked it to.
    ([_end(0, 3.0, QUIT, stopped=2.0), _end(1, 3.1, QUIT, stopped=2.0)], None, 0),
])
def test_the_rank_that_ended_a_forker_job_is_found(ends, named, code):
    first = _main._first_failure(ends)
    if named is None:
        assert first is None
    else:
        rank, exit_code, why = first
        assert f"rank {rank} {why}" == named
        assert (exit_code or 1) == code


def _ending(rank, when, error=""):
    return _end_report.RankEnding(rank, when, error)


@pytest.mark.parametrize("endings, codes, named", [
    # Rank 1 raised; its engine's shutdown then failed the others, who raised in turn.
    ([_ending(0, 5.2, "RuntimeError: keras-ring: rank 1 shut down"),
      _ending(1, 5.0, "ValueError: bad batch")], {0: 1, 1: 1},
     "rank 1 raised ValueError: bad batch and exited with code 1, the first rank to fail."),
    # sys.exit(3) mid-job: no exception, a code of its own.
    ([_ending(0, 5.2, "RuntimeError: keras-ring: rank 1 shut down"), _ending(1, 5.0)],
     {0: 1, 1: 3}, "rank 1 exited with code 3, the first rank to fail."),
    # Every rank shut down together; rank 0 failed afterwards: the others exited 0.
    ([_ending(0, 5.1), _ending(1, 5.0)], {0: 2, 1: 0},
     "rank 0 exited with code 2, the first rank to fail."),
    ([_ending(0, 5.1), _ending(1, 5.0)], {0: 0, 1: 0}, None),
    # Rank 1's start script never reported its end (it was killed): its code counts as 1.
    ([_ending(0, 5.2, "RuntimeError: keras-ring: rank 1 shut down"),
      _ending(1, 5.0, "ValueError: bad batch")], {0: 1},
     "rank 1 raised ValueError: bad batch and exited with code 1, the first rank to fail."),
])
def test_the_rank_that_failed_first_is_found_from_the_ends_the_ranks_reported(
        endings, codes, named):
    first = _end_report.first_to_fail(endings, codes)
    assert (first and f"rank {first[0]} {first[2]}") == named


def test_forker_job_removes_its_segments_and_no_others(monkeypatch, tmp_path, capfd):
    # The fake forker leaves what a killed rank would: MPICH's segments named
    # after the forker's pid. It also makes one named after this live process,
    # which no job can own, standing for another job's.
    bin_dir = tmp_path / "bin"
    mpiexec = write_fake_launcher(bin_dir / "mpiexec", VERSION_TEXT["MPICH"])
    forker = bin_dir / "mpiexec.gforker"
    forker.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "from keras_ring.launcher import _main\n"
        "paths = _main.forker_segment_paths(os.getpid())\n"
        "paths.append(_main.forker_segment_paths(os.getppid())[0])\n"
        "for path in paths:\n"
        "    open(path, 'x').close()\n"
        f"open({str(tmp_path / 'forker.pid')!r}, 'w').write(str(os.getpid()))\n"
    )
    forker.chmod(0o755)
    write_build_info(monkeypatch, tmp_path, mpi_source="system", mpiexec=str(mpiexec))
    others = _main.forker_segment_paths(os.getpid())[0]
    try:
        code, err = run_main(capfd, "-np", "2", *COMMAND)
        assert code == 0, err
        forker_pid = int((tmp_path / "forker.pid").read_text())
        left = [p for p in _main.forker_segment_paths(forker_pid) if os.path.exists(p)]
        assert not left, left
        assert os.path.exists(others)
    finally:
        os.unlink(others)


# The environment a rank was started with (keras_ring/core/_mpi_env.py).

HYDRA_ENV = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9", "HYDI_CONTROL_FD": "7"}
FORKER_ENV = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "8"}
OPEN_MPI_ENV = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "0",
    "PMIX_RANK": "0",
    "PMIX_NAMESPACE": "prterun-x-1@1",
}
SRUN_PMI2_ENV = {"PMI_RANK": "0", "PMI_FD": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
SRUN_PMIX_ENV = {
    "PMIX_RANK": "0",
    "PMIX_NAMESPACE": "slurm.pmix.1.0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "8",
}


def build_info(vendor, source="system"):
    return {
        **_build_info._DEFAULT_BUILD_INFO,
        "mpi_source": source,
        "mpi_vendor": vendor,
        "mpicxx": "/usr/bin/mpicxx",
        "mpiexec": "/usr/bin/mpiexec",
    }


@pytest.mark.parametrize(
    "info, environ, message",
    [
        (build_info("MPICH"), OPEN_MPI_ENV, "started by Open MPI's mpirun"),
        (build_info("Intel MPI"), OPEN_MPI_ENV, "started by Open MPI's mpirun"),
        (build_info("Open MPI"), HYDRA_ENV, "Hydra mpiexec"),
        (build_info("Open MPI"), FORKER_ENV, "MPICH-family mpiexec"),
        (build_info("MPICH", "pypi-mpich"), SRUN_PMIX_ENV, "srun --mpi=pmi2"),
    ],
)
def test_launcher_of_another_mpi_is_detected_in_a_rank(info, environ, message):
    with pytest.raises(RuntimeError, match=re.escape(message)) as error:
        _mpi_env.check_launcher_environment(info, environ)
    assert f"built against {info['mpi_vendor']}" in str(error.value)
    assert "keras-ring-run" in str(error.value)


@pytest.mark.parametrize(
    "info, environ",
    [
        (build_info("MPICH"), {}),
        (build_info("MPICH"), HYDRA_ENV),
        (build_info("MPICH"), FORKER_ENV),
        (build_info("MPICH"), SRUN_PMI2_ENV),
        (build_info("MPICH"), SRUN_PMIX_ENV),
        (build_info("Intel MPI"), HYDRA_ENV),
        (build_info("Open MPI"), OPEN_MPI_ENV),
        (build_info("Open MPI"), SRUN_PMI2_ENV),
        (build_info("Open MPI"), SRUN_PMIX_ENV),
        (build_info("unknown"), OPEN_MPI_ENV),
    ],
)
def test_matching_launcher_passes_the_check(info, environ):
    _mpi_env.check_launcher_environment(info, environ)


@pytest.mark.parametrize(
    "environ, size",
    [
        ({}, None),
        (HYDRA_ENV, 2),
        (OPEN_MPI_ENV, 2),
        (SRUN_PMI2_ENV, 4),
        (SRUN_PMIX_ENV, 8),
        ({"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"}, None),
        ({"PMI_SIZE": "two"}, None),
    ],
)
def test_expected_world_size(environ, size):
    assert _mpi_env.expected_world_size(environ) == size


# Real jobs under the MPI of the build.


def launch(*argv):
    """Starts `keras-ring-run *argv` with its stdout and stderr on one pipe."""
    return subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "keras-ring-run"), *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.multirank
def test_every_rank_runs_and_its_lines_are_tagged():
    script = (
        "import os\n"
        "rank = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))\n"
        "os.write(1, f'rank {rank}\\n'.encode())"  # one write: ranks' lines cannot interleave
    )
    with launch("-np", "2", "--prefix-output", "--verbose", sys.executable, "-c", script) as job:
        output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output
    assert output.startswith("keras-ring-run: ")
    for rank in range(2):
        (line,) = [line for line in output.splitlines() if line.endswith(f"rank {rank}")]
        assert re.match(rf"(\[{rank}\] |{rank}>|\[\d+,{rank}\]<stdout>:)", line), line


@pytest.mark.multirank
def test_settings_reach_every_ranks_engine():
    script = (
        "import json, os, keras_ring as kr\n"
        "from keras_ring.core import _engine\n"
        "kr.init()\n"
        "os.write(1, ('params ' + json.dumps(_engine.parameters()) + '\\n').encode())\n"
        "kr.shutdown()"
    )
    with launch("-np", "2", "--fusion-threshold-mb", "1.5", "--cycle-time-ms", "2.5",
                sys.executable, "-c", script) as job:
        output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output
    params = [json.loads(line.split("params ", 1)[1]) for line in output.splitlines()
              if "params " in line]
    assert len(params) == 2, output
    for p in params:
        assert p["fusion_threshold"] == 3 << 19 and p["cycle_time_ms"] == 2.5, output


RANK_1_SCRIPT = (
    "import os, signal, sys\n"
    "if os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')) == '1': {}"
)


@pytest.mark.multirank
def test_exit_code_of_a_failing_rank_is_the_jobs():
    with launch("-np", "2", sys.executable, "-c", RANK_1_SCRIPT.format("sys.exit(3)")) as job:
        output, _ = job.communicate(timeout=120)
    assert job.returncode == 3, output


@pytest.mark.multirank
def test_rank_killed_by_a_signal_fails_the_job():
    statement = "os.kill(os.getpid(), signal.SIGKILL)"
    with launch("-np", "2", sys.executable, "-c", RANK_1_SCRIPT.format(statement)) as job:
        output, _ = job.communicate(timeout=120)
    assert job.returncode != 0, output


def is_running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_launcher_stops_every_rank(signum):
    script = "import os, time; os.write(1, f'ready {os.getpid()}\\n'.encode()); time.sleep(120)"
    with launch("-np", "2", sys.executable, "-c", script) as job:
        pids = []
        while len(pids) < 2 and (line := job.stdout.readline()):
            if line.startswith("ready "):
                pids.append(int(line.split()[1]))
        job.send_signal(signum)
        output, _ = job.communicate(timeout=60)
    assert len(pids) == 2, output
    assert job.returncode != 0, output
    assert not [pid for pid in pids if is_running(pid)], output


LISTENERS_SCRIPT = r'''
"""Fails if this rank, or a launcher process above it, listens off loopback."""
import ipaddress
import os
import sys

from mpi4py import MPI


def ancestors_up_to_the_launcher():
    pid, pids = os.getpid(), []
    while pid > 1:
        pids.append(pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"keras-ring-run" in f.read():
                return pids
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return pids


def socket_inodes(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def address(hex_address):
    host = hex_address.split(":")[0]
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    return getattr(ip, "ipv4_mapped", None) or ip


MPI.COMM_WORLD.Barrier()  # every rank has opened its endpoints
ours = set().union(*(socket_inodes(pid) for pid in ancestors_up_to_the_launcher()))
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        rows = [line.split() for line in f.readlines()[1:]]
    listening += [address(row[1]) for row in rows if row[3] == "0A" and row[9] in ours]
print(f"rank {MPI.COMM_WORLD.rank} listens on {sorted(map(str, listening))}", flush=True)
MPI.COMM_WORLD.Barrier()
sys.exit(0 if all(ip.is_loopback for ip in listening) else 1)
'''


@pytest.mark.multirank
def test_one_host_job_listens_on_loopback_only(run_ranks, tmp_path):
    pytest.importorskip("mpi4py")
    if _build_info.read_build_info()["mpi_source"] != "pypi-mpich":
        pytest.skip(
            "a system MPICH without mpiexec.gforker runs Hydra, which listens on all interfaces"
        )
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS_SCRIPT)
    result = run_ranks(2, script, timeout=120)
    assert result.stdout.count(" listens on ") == 2, result.stdout


@pytest.mark.multirank
def test_ranks_see_the_launcher_they_were_built_for(run_ranks, tmp_path):
    script = tmp_path / "launcher_env.py"
    script.write_text(
        "from keras_ring.core import _build_info, _mpi_env\n"
        "_mpi_env.check_launcher_environment(_build_info.read_build_info())\n"
        "print(f'expected size {_mpi_env.expected_world_size()}')\n"
    )
    result = run_ranks(2, script, timeout=120)
    assert result.stdout.count("expected size 2") == 2, result.stdout


@pytest.mark.multirank
def test_ranks_use_the_mpich_segment_named_after_the_forker(run_ranks, tmp_path):
    # keras-ring-run removes a dead job's segment under that name before the
    # ranks start, and the job's own after it ends: the name must be MPICH's.
    if _build_info.read_build_info()["mpi_source"] != "pypi-mpich":
        pytest.skip("one-host jobs of a system MPICH without mpiexec.gforker run under Hydra")
    script = tmp_path / "segments.py"
    script.write_text(
        "import sys\n"
        "import keras_ring as kr\n"
        "kr.init()\n"
        "with open('/proc/self/maps') as f:\n"
        "    names = {line.split()[5] for line in f if '/mpich_shm_' in line}\n"
        f"sys.path.insert(0, {str(WORKERS)!r})\n"
        "from forker_pid import forker_pid\n"
        "print(f'forker {forker_pid()} segments {sorted(names)}', flush=True)\n"
    )
    result = run_ranks(2, script, timeout=120)
    found = re.findall(r"forker (\d+) segments \[\'(\S+)\'\]", result.stdout)
    assert len(found) == 2, result.stdout
    for forker_pid, name in found:
        assert name == _main.forker_segment_paths(int(forker_pid))[0]
        assert not os.path.exists(name)
