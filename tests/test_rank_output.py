"""Ranks' output reaches the user whole: UTF-8 text, long output and Keras's real progress bar.

MPICH's one-host forker closes a rank's pipe at its first byte of 0x80 or more
(see keras_ring/_rank_output.py). These tests run tests/workers/output_worker.py,
whose rank 0 trains with `verbose=kr.rank_zero_verbose(1)`, in every way a
user starts a job, with the output on pipes (as under `| tee`, CI or a notebook).
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


def test_keras_ring_run():
    check_output(*run([BIN / "keras-ring-run", "-np", "2", sys.executable, WORKER]))


def test_keras_ring_run_with_prefixes():
    out, err = run([BIN / "keras-ring-run", "-np", "2", "--prefix-output", sys.executable, WORKER])
    check_output(out, err, prefix=lambda rank: f"[{rank}] ")
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
