"""The docs site builds with Sphinx, warnings as errors, from the installed package's docstrings."""

import os
import subprocess
import sys

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


def test_docs_build_without_warnings(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS,
         str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for page in ("index", "getting-started", "api", "keras", "design"):
        assert (tmp_path / "html" / f"{page}.html").exists()
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("keras_ring.allreduce", "keras_ring.run", "keras_ring.DistributedOptimizer",
                 "keras_ring.ProcessSet", "BroadcastGlobalVariablesCallback"):
        assert name in api, name
