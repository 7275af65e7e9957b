"""Single-process behaviour of init, shutdown and the topology queries."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import keras_ring as kr
from keras_ring.core import _environment

QUERIES = ["size", "rank", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "mpi_threads_supported", "mpi_enabled"]


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    "query", QUERIES + ["barrier", "broadcast_object, 1", "allgather_object, 1"]
)
def test_queries_before_init_raise_clear_error(query):
    function, _, args = query.partition(", ")
    result = run_python(f"import keras_ring as kr\nkr.{function}({args})")
    assert result.returncode != 0
    assert "keras_ring.init()" in result.stderr, result.stderr


def test_no_launcher_is_a_job_of_size_one():
    result = run_python(
        "import keras_ring as kr\n"
        "kr.init()\n"
        "print(kr.rank(), kr.size(), kr.local_rank(), kr.local_size(), kr.cross_rank(),"
        " kr.cross_size(), kr.is_homogeneous(), kr.mpi_enabled())\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "0", "1", "0", "1", "True", "True"]


def test_init_twice_then_shutdown_and_init_again():
    result = run_python(
        "import numpy as np, keras_ring as kr\n"
        "from keras_ring.core import _engine\n"
        "kr.init(); kr.init()\n"
        "kr.shutdown(); assert not kr.is_initialized()\n"
        "kr.init(); assert kr.is_initialized()\n"
        "print(_engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), 'x').wait())\n"
    )
    assert result.returncode == 0, result.stderr
    assert "[1. 1. 1.]" in result.stdout


def test_build_flags():
    assert kr.mpi_built() is True
    assert kr.nccl_built() is False
    assert kr.cuda_built() is False


@pytest.mark.parametrize("argument", ["fusion_threshold", "cycle_time", "stall_check_time",
                                      "stall_shutdown_time"])
@pytest.mark.parametrize("value", [-1, "10", True])
def test_init_rejects_bad_settings(argument, value):
    with pytest.raises(ValueError, match=f"Received: {argument}="):
        kr.init(**{argument: value})


def test_init_settings_reach_the_engine_and_leave_the_environment_alone():
    result = run_python(
        "import os, numpy as np, keras_ring as kr\n"
        "from keras_ring.core import _engine\n"
        "kr.init(fusion_threshold=1 << 20, cycle_time=0.5, stall_check_time=30)\n"
        "print(_engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), 'x').wait())\n"
        "p = _engine.parameters()\n"
        "print(p['cycle_time_ms'], 'KERAS_RING_CYCLE_TIME' in os.environ)\n"
        "kr.shutdown()\n"
        "kr.init()\n"  # the next init() reads the environment again
        "print(_engine.parameters()['cycle_time_ms'])\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-3:] == ["0.5", "False", "0.0"]


def test_a_bad_setting_in_the_environment_is_named():
    result = subprocess.run(
        [sys.executable, "-c", "import keras_ring as kr; kr.init()"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "KERAS_RING_CYCLE_TIME": "soon"},
    )
    assert result.returncode != 0
    assert "KERAS_RING_CYCLE_TIME must be a number of milliseconds" in result.stderr


def test_a_misspelled_variable_is_warned_of_naming_the_closest_setting():
    result = subprocess.run(
        [sys.executable, "-c", "import keras_ring as kr; kr.init(); kr.init(); print('ran')"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "KERAS_RING_FUSION_TRESHOLD": "0", "KERAS_RING_NONSENSE": "1"},
    )
    assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
    (warning,) = [line for line in result.stderr.splitlines() if "does not read" in line]
    assert warning.endswith(
        "keras-ring warning: keras-ring does not read KERAS_RING_FUSION_TRESHOLD (did you mean "
        "KERAS_RING_FUSION_THRESHOLD?), KERAS_RING_NONSENSE: they have no effect. The settings "
        "are listed in docs/settings.md."), warning


def test_every_variable_keras_ring_reads_is_known_and_every_setting_documented():
    root = pathlib.Path(__file__).parent.parent
    sources = [*(root / "keras_ring").rglob("*.py"), *(root / "custom_ops").rglob("*.cc"),
               *(root / "custom_ops").rglob("*.h"), root / "CMakeLists.txt",
               *(root / "cmake").rglob("*")]
    read = set()
    for path in sources:
        if path.is_file() and path.name != "_environment.py":
            read |= set(re.findall(r"\bKERAS_RING_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    read -= {"KERAS_RING_C_API_H"}  # the C header's include guard
    assert read == _environment.KNOWN, (sorted(read - _environment.KNOWN),
                                        sorted(_environment.KNOWN - read))
    docs = "".join(path.read_text() for path in (root / "docs").glob("*.md"))
    assert not [name for name in _environment.USER_SETTINGS if f"`{name}" not in docs]


def test_init_rejects_unsupported_arguments():
    with pytest.raises(ValueError, match="Received: comm="):
        kr.init(comm=object())


def test_engine_refuses_requests_before_init():
    result = run_python(
        "import numpy as np\n"
        "from keras_ring.core import _engine\n"
        "_engine.submit(_engine.ALLREDUCE, np.ones(3, np.float32), 'x').wait()\n"
    )
    assert result.returncode != 0
    assert "not initialised" in result.stderr


def test_importing_the_source_tree_says_so():
    # `python -c` in the clone's root imports the unbuilt keras_ring there.
    root = pathlib.Path(__file__).resolve().parents[1]
    if (root / "keras_ring" / "core" / "_build_info.json").exists():
        pytest.skip(f"{root} holds a built keras_ring")
    result = subprocess.run(
        [sys.executable, "-c", "import keras_ring as kr; kr.init()"],
        capture_output=True, text=True, timeout=120, cwd=root,
    )
    assert result.returncode != 0
    assert "ImportError: keras-ring: keras_ring was imported from its source tree" in (
        result.stderr
    ), result.stderr
    assert "run Python from another directory" in result.stderr
    assert "`pip install .`" in result.stderr
