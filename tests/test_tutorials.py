"""The tutorial notebooks run top to bottom in a Jupyter kernel, as a reader would run them."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

TUTORIALS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "tutorials",
                                          "*.ipynb")))


@pytest.mark.multirank
@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_runs_top_to_bottom(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    # Any error in a cell raises CellExecutionError, with the cell and its traceback.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()


def test_there_are_tutorials():
    assert TUTORIALS
