"""kr.run: workers started from Python, results, exceptions, output and interruption."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import keras_ring as kr

pytestmark = pytest.mark.multirank


def rank_and_size(scale, offset=0):
    import keras_ring as kr

    kr.init()
    print(f"hello from {kr.rank()}", flush=True)
    return kr.rank() * scale + offset, kr.size()


def test_results_come_back_in_rank_order(capfd):
    assert kr.run(rank_and_size, args=(10,), kwargs={"offset": 1}, np=3) == [
        (1, 3), (11, 3), (21, 3)]
    out = capfd.readouterr().out
    for rank in range(3):
        assert f"[{rank}] hello from {rank}" in out


def test_a_closure_travels_by_value_and_env_reaches_the_workers():
    factor = 7

    def job():
        import os

        import numpy as np

        import keras_ring as kr

        kr.init()
        total = kr.allgather_object(factor * (kr.rank() + 1))
        return sum(total), os.environ["KR_RUN_TEST"], np.float32(1).dtype.name

    assert kr.run(job, np=2, env={"KR_RUN_TEST": "yes"}) == [(21, "yes", "float32")] * 2


def test_a_workers_exception_is_raised_with_its_rank_and_traceback():
    def fails_on_one():
        import keras_ring as kr

        kr.init()
        if kr.rank() == 1:
            raise KeyError("missing on rank one")
        kr.barrier()  # rank 0 waits: its error only follows rank 1's

    with pytest.raises(KeyError, match="missing on rank one") as info:
        kr.run(fails_on_one, np=2)
    assert "keras-ring: raised on rank 1 of 2" in info.value.__notes__
    assert "in fails_on_one" in str(info.value.__cause__)
    assert "KeyError: 'missing on rank one'" in str(info.value.__cause__)


def test_np_is_checked():
    with pytest.raises(ValueError, match="Received: np=0"):
        kr.run(print, np=0)


def test_horovods_arguments_in_its_order(capfd, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    # func, args, kwargs, num_proc: Horovod's positions.
    results = kr.run(
        rank_and_size, (10,), None, 2, hostfile=str(hostfile), verbose=True, use_mpi=True,
        disable_cache=True, executable=sys.executable,
    )
    assert results == [(0, 2), (10, 2)]
    assert f"-f {hostfile} -np 2" in capfd.readouterr().out  # the launcher's command


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"use_gloo": True, "use_mpi": True}, "use_gloo=True, use_mpi=True"),
        ({"num_proc": 0}, "num_proc=0"),
        ({"num_proc": 2, "np": 3}, "num_proc=2, np=3"),
        ({"hosts": "a:2", "hostfile": "hosts"}, "hosts='a:2', hostfile='hosts'"),
        ({"min_num_proc": 1}, "min_num_proc=1"),
        ({"host_discovery_script": "discover.sh"}, "host_discovery_script='discover.sh'"),
        ({"slots": 2}, "slots=2"),
        ({"start_timeout": 30}, "start_timeout=30"),
        ({"ssh_port": 22}, "ssh_port=22"),
        ({"output_filename": "logs"}, "output_filename='logs'"),
        ({"mpi_args": "-x A"}, "mpi_args='-x A'"),
        ({"network_interfaces": ["eth0"]}, "network_interfaces=['eth0']"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_what_it_cannot_honour_is_refused(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(f"Received: {shown}") + "$"):
        kr.run(print, **kwargs)


class _ScriptCaller:
    """kr.run in a plain Python process, interrupted with SIGINT (Ctrl-C)."""

    def __init__(self, tmp_path, code):
        script = tmp_path / "caller.py"
        script.write_text(code + CATCH_INTERRUPT)
        self.process = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True
        )

    def interrupt(self):
        self.process.send_signal(signal.SIGINT)

    def check_interrupted(self):
        out, _ = self.process.communicate(timeout=60)
        assert "caller interrupted" in out

    def close(self):
        if self.process.poll() is None:
            self.process.kill()


class _KernelCaller:
    """kr.run in a Jupyter kernel, interrupted as the notebook's stop button does."""

    def __init__(self, tmp_path, code):
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
        self.msg_id = self.client.execute(code + "run()")

    def interrupt(self):
        self.manager.interrupt_kernel()

    def check_interrupted(self):
        while True:
            reply = self.client.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == self.msg_id:
                break
        assert reply["content"]["status"] == "error", reply["content"]
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


CATCH_INTERRUPT = """
try:
    run()
except KeyboardInterrupt:
    print("caller interrupted", flush=True)
"""


@pytest.mark.parametrize("caller_type", [_ScriptCaller, _KernelCaller], ids=["script", "kernel"])
def test_interrupting_the_caller_stops_the_workers(tmp_path, caller_type):
    code = textwrap.dedent(f"""
        import os, time
        import keras_ring as kr

        def sleeper():
            open(os.path.join({str(tmp_path)!r}, f"pid.{{os.getpid()}}"), "w").close()
            time.sleep(300)

        def run():
            kr.run(sleeper, np=2)
    """)
    caller = caller_type(tmp_path, code)
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("pid.*"))) < 2:
            assert time.time() < deadline, "the workers did not start"
            time.sleep(0.2)
        caller.interrupt()
        caller.check_interrupted()
    finally:
        caller.close()
    for pid_file in tmp_path.glob("pid.*"):
        pid = int(pid_file.name.split(".")[1])
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"worker {pid} still runs after the caller was interrupted")
