"""The docs site builds with Sphinx, warnings as errors, from the installed package's docstrings;
the tutorial notebooks are rendered as stored (tests/test_tutorials.py executes them)."""

import glob
import importlib.util
import inspect
import os
import subprocess
import sys
import types

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
TUTORIALS = glob.glob(os.path.join(DOCS, "tutorials", "*.ipynb"))


def test_docs_build_without_warnings(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            DOCS,
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    pages = [
        "index",
        "getting-started",
        "concepts",
        "launching",
        "elastic",
        "migrating-from-mwms",
        "api",
        "keras",
        "design",
        "backends",
    ]
    pages += [f"tutorials/{os.path.basename(path)[: -len('.ipynb')]}" for path in TUTORIALS]
    for page in pages:
        assert (tmp_path / "html" / f"{page}.html").exists(), page
    assert (tmp_path / "html" / "_images" / "ring_allreduce.svg").exists()
    api = (tmp_path / "html" / "api.html").read_text()
    for name in (
        "keras_ring.allreduce",
        "keras_ring.run",
        "keras_ring.DistributedOptimizer",
        "keras_ring.ProcessSet",
        "BroadcastGlobalVariablesCallback",
        "keras_ring.elastic.KerasState",
        "keras_ring.jax.allreduce",
        "keras_ring.shard_arrays",
    ):
        assert name in api, name


def test_ring_diagram_is_the_scripts_output():
    # The concepts page's diagram is drawn by a script that runs the ring's schedule.
    spec = importlib.util.spec_from_file_location(
        "ring_allreduce", os.path.join(DOCS, "_static", "ring_allreduce.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with open(os.path.join(DOCS, "_static", "ring_allreduce.svg")) as f:
        assert f.read() == script.svg()
    final_state = list(script.schedule())[-1][1]
    assert all(block == set(range(script.P)) for row in final_state for block in row)


def test_every_public_symbol_has_a_docstring_with_an_example():
    # Keras style: an "Example:" section with a ```python fence. The reduce ops
    # are plain integers, described in docs/api.md.
    import keras_ring
    import keras_ring.callbacks
    import keras_ring.jax

    symbols = [(f"keras_ring.{name}", getattr(keras_ring, name)) for name in keras_ring.__all__]
    symbols += [(f"keras_ring.jax.{name}", getattr(keras_ring.jax, name))
                for name in keras_ring.jax.__all__]
    symbols += [
        (f"keras_ring.callbacks.{name}", getattr(keras_ring.callbacks, name))
        for name in keras_ring.callbacks.__all__
    ]
    missing = [
        name
        for name, symbol in symbols
        if not isinstance(symbol, (int, types.ModuleType))
        and not ("Example:" in (doc := inspect.getdoc(symbol) or "") and "```python" in doc)
    ]
    assert not missing
