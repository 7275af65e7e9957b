"""Ranks' output reaches the user whole: UTF-8 text, long output and Keras's real progress bar.

MPICH's one-host forker closes a rank's pipe at its first byte of 0x80 or more
(see keras_ring/launcher/_rank_output.py). These tests run tests/workers/output_worker.py,
whose rank 0 trains with `verbose=kr.rank_zero_verbose(1)`, in every way a
user starts a job, with the output on pipes (as under `| tee`, CI or a notebook).
Under keras-ring-run, TensorFlow's start-up lines come from rank 0 only, and
every other line of every rank is kept.
"""

import os
import pathlib
import subprocess
import sys

import nbformat
import pytest
from conftest import RANK_THREAD_ENV
from nbclient import NotebookClient

pytestmark = pytest.mark.multirank

WORKERS = pathlib.Path(__file__).parent / "workers"
WORKER = WORKERS / "output_worker.py"
sys.path.insert(0, str(WORKERS))
from output_worker import LINES  # noqa: E402

BIN = pathlib.Path(sys.executable).parent
PROGRESS_BAR = "━━━━━━━━━━━━━━━━━━━━"  # Keras's bar at the end of an epoch
# The first of TensorFlow's start-up lines, which keras-ring-run leaves out of ranks other than 0.
ABSL_NOTICE = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
               "STDERR")


def run(command, **kwargs):
    result = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, timeout=300,
        env={**os.environ, **RANK_THREAD_ENV, "PYTHONPATH": str(WORKERS)}, **kwargs,
    )
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, f"exit code {result.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


def check_output(out, err, prefix=lambda rank: ""):
    """Both ranks' lines are all there, whole, and rank 0 drew its progress bar."""
    assert PROGRESS_BAR in out and "accuracy:" in out, out[-3000:]
    for rank in range(2):
        p = prefix(rank)
        out_lines = [line for line in out.split("\n") if line.startswith(f"{p}rank {rank} line")]
        err_lines = [line for line in err.split("\n") if line.startswith(f"{p}rank {rank} err")]
        assert out_lines == [f"{p}rank {rank} line {i}: é ━ ✓ 日本語" for i in range(LINES)]
        assert err_lines == [f"{p}rank {rank} err {i}: é ━" for i in range(LINES)]
        assert f"{p}done {rank} ✓" in out.split("\n")


def check_start_up_lines(err, prefix):
    """TensorFlow's start-up notice comes from rank 0 and not from rank 1."""
    lines = err.split("\n")
    assert f"{prefix(0)}{ABSL_NOTICE}" in lines, err[-3000:]
    assert f"{prefix(1)}{ABSL_NOTICE}" not in lines, err[-3000:]


def test_keras_ring_run():
    check_output(*run([BIN / "keras-ring-run", "-np", "2", sys.executable, WORKER]))


def test_keras_ring_run_with_prefixes():
    out, err = run([BIN / "keras-ring-run", "-np", "2", "--prefix-output", sys.executable, WORKER])
    check_output(out, err, prefix=lambda rank: f"[{rank}] ")
    check_start_up_lines(err, prefix=lambda rank: f"[{rank}] ")
    # Keras redraws its bar after carriage returns: each drawing keeps the prefix.
    drawings = [d for line in out.split("\n") for d in line.split("\r") if "/step" in d]
    assert drawings and all(d.startswith("[0] ") for d in drawings), drawings


def test_plain_mpiexec():
    check_output(*run([BIN / "mpiexec", "-n", "2", sys.executable, WORKER]))


def test_kr_run_from_a_script():
    script = "import keras_ring as kr, output_worker\nprint(kr.run(output_worker.train, np=2))"
    out, _ = run([sys.executable, "-c", script])
    # kr.run streams stdout and stderr together, each line prefixed with its rank.
    check_output(out, out, prefix=lambda rank: f"[{rank}] ")
    check_start_up_lines(out, prefix=lambda rank: f"[{rank}] ")
    assert out.splitlines()[-1] == "[0, 1]"


def test_kr_run_from_a_notebook(tmp_path):
    cells = [f"import sys\nsys.path.insert(0, {str(WORKERS)!r})",
             "import keras_ring as kr, output_worker\nprint(kr.run(output_worker.train, np=2))"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    streamed = "".join(output.get("text", "") for output in notebook.cells[1].outputs)
    check_output(streamed, streamed, prefix=lambda rank: f"[{rank}] ")
    assert streamed.splitlines()[-1] == "[0, 1]"


# TensorFlow's start-up lines as TF 2.21 prints them (the CUDA ones as its GPU builds do), with
# the rank as the thread id; then lines of the same kind that are not start-up chatter.
START_UP_LINES = [
    ABSL_NOTICE,
    "I0000 00:00:1796176450.224363    {rank} port.cc:153] oneDNN custom operations are on. You may "
    "see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1796176450.224693    {rank} cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "I0000 00:00:1796176450.425215    {rank} cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other "
    "operations, rebuild TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1751448150.986970   {rank} cuda_dnn.cc:8579] Unable to register cuDNN factory: "
    "Attempting to register factory for plugin cuDNN when one has already been registered",
    "2025-02-09 09:37:32.334667: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:607] "
    "Unable to register cuFFT factory: Attempting to register factory for plugin cuFFT when one "
    "has already been registered",
    "W0000 00:00:1751448151.003754   {rank} computation_placer.cc:177] computation placer already "
    "registered. Please check linkage and avoid linking the same target more than once.",
    "2025-02-09 09:37:33.337631: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] TF-TRT "
    "Warning: Could not find TensorRT",
]
KEPT_LINES = [
    "E0000 00:00:1796176510.612931    {rank} cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "/tmp/train.py:7: UserWarning: rank {rank} warns: é ━",
    "I0000 00:00:1796176450.224693    {rank} cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used. And more.",
    "ValueError: rank {rank} failed",
]
START_UP_SCRIPT = (
    "import os\n"
    "rank = os.environ['PMI_RANK']\n"
    f"for line in {START_UP_LINES + KEPT_LINES!r}:\n"
    "    os.write(2, (line.format(rank=rank) + '\\n').encode())\n"
    # One write, as a keras-ring rank's line-buffered print makes (PYTHONUNBUFFERED, which the
    # launcher sets, would write print's pieces one by one, and two ranks' pieces may mix).
    "os.write(1, f'rank {rank} done\\n'.encode())"
)


@pytest.mark.parametrize("flags", [[], ["--prefix-output"], ["--all-output"]])
def test_tensorflow_start_up_lines_are_left_out_of_ranks_other_than_0(flags):
    out, err = run([BIN / "keras-ring-run", "-np", "2", *flags, sys.executable, "-c",
                    START_UP_SCRIPT])
    prefix = (lambda rank: f"[{rank}] ") if flags == ["--prefix-output"] else (lambda rank: "")
    shown_ranks = [0, 1] if flags == ["--all-output"] else [0]
    lines = err.split("\n")
    for line in START_UP_LINES:
        expected = sorted(prefix(rank) + line.format(rank=rank) for rank in shown_ranks)
        # A line without the rank in it is shown once per shown rank.
        assert sorted(x for x in lines if x in {prefix(r) + line.format(rank=r) for r in (0, 1)}
                      ) == expected, err
    for line in KEPT_LINES:
        for rank in (0, 1):
            assert lines.count(prefix(rank) + line.format(rank=rank)) == 1, err
    assert sorted(out.split("\n")) == ["", f"{prefix(0)}rank 0 done", f"{prefix(1)}rank 1 done"]
