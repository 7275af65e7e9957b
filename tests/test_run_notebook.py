"""kr.run from a Jupyter kernel: a function defined in a notebook cell runs on two ranks."""

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.multirank

CELLS = [
    "import keras_ring as kr",
    "def scaled_rank(x):\n"
    "    import keras_ring as kr\n"
    "    kr.init()\n"
    "    print('working on rank', kr.rank(), flush=True)\n"
    "    return kr.rank() * x",
    "results = kr.run(scaled_rank, args=(3,), np=2)\n"
    "assert results == [0, 3], results\n"
    "print('results', results)",
]


def test_kr_run_from_a_notebook_kernel(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    streamed = "".join(output.get("text", "") for cell in notebook.cells
                       for output in cell.get("outputs", []))
    assert "results [0, 3]" in streamed
    for rank in range(2):
        assert f"[{rank}] working on rank {rank}" in streamed
