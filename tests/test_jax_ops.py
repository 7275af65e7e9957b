"""keras_ring.jax: its collectives across ranks, its build, what it refuses; Keras on JAX alone."""

import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "jax_ops_worker.py"


# At 3 ranks only, for the reason tests/test_tf_ops_multirank.py gives.
@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_jax_ops(run_ranks, np):
    run_ranks(np, WORKER, timeout=600)


def _python(code, env=None):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "KERAS_BACKEND": "jax", **(env or {})},
    )


def test_jax_alone_never_imports_tensorflow():
    # TensorFlow is installed here; a JAX job must not load it (nor pay its start-up).
    result = _python(
        "import sys\n"
        "import jax, jax.numpy as jnp\n"
        "import keras_ring as kr, keras_ring.jax as krj\n"
        "krj.init()\n"
        "x = jax.jit(lambda v: krj.allreduce(v, op=krj.Sum))(jnp.ones(3))\n"
        "g = krj.allgather(jnp.ones((2, 1)))\n"
        "print(float(x.sum()), g.shape, 'tensorflow' in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3.0", "(2,", "1)", "False"]


def test_arrays_over_several_devices_are_refused():
    result = _python(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "import keras_ring.jax as krj\n"
        "krj.init()\n"
        "mesh = jax.sharding.Mesh(np.array(jax.devices()), ('d',))\n"
        "x = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.P('d')))\n"
        "krj.allreduce(x)\n",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )
    assert result.returncode != 0
    assert "one process per device" in result.stderr and "2 devices" in result.stderr


def test_keras_ring_build_builds_the_jax_adapter(tmp_path):
    env = {**os.environ, "KERAS_RING_CACHE_DIR": str(tmp_path)}
    build = os.path.join(os.path.dirname(sys.executable), "keras-ring-build")
    result = subprocess.run([build], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "JAX adapter at" in result.stdout and "TensorFlow adapter at" in result.stdout
    assert list(tmp_path.glob("jax-*/libkeras_ring_jax.so"))
    assert list(tmp_path.glob("tf-*/libkeras_ring_tf_ops.so"))


def test_a_jax_runtime_error_of_a_lost_worker_is_recognised():
    import jax

    from keras_ring.core import _errors

    lost = _errors.worker_lost(jax.errors.JaxRuntimeError(
        "UNAVAILABLE: keras-ring: rank 1 died during allreduce of 'x'"))
    assert isinstance(lost, _errors.WorkerLostError)
    assert str(lost) == "keras-ring: rank 1 died during allreduce of 'x'"
    assert _errors.worker_lost(jax.errors.JaxRuntimeError("INTERNAL: something else")) is None


FIT_WORKER = pathlib.Path(__file__).parent / "workers" / "jax_fit_worker.py"


@pytest.mark.multirank
def test_a_keras_job_on_jax_never_imports_tensorflow(run_ranks):
    result = run_ranks(2, FIT_WORKER, timeout=300)
    for rank in range(2):
        assert f"jax_fit_worker: rank {rank} finished" in result.stdout, result.stdout[-3000:]
    assert "tensorflow imported: False" in result.stdout


MIXED = """\
import os
import sys
if os.environ.get("PMI_RANK", os.environ.get("KERAS_RING_RANK")) == "1":
    os.environ["KERAS_BACKEND"] = "jax"
import keras_ring as kr
try:
    kr.init()
except RuntimeError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(3)
print("not refused", flush=True)
"""


@pytest.mark.multirank
def test_ranks_on_different_backends_are_refused_at_init(run_ranks, tmp_path):
    script = tmp_path / "mixed.py"
    script.write_text(MIXED)
    result = run_ranks(2, script, timeout=120, check=False,
                       env={"KERAS_BACKEND": "tensorflow"})
    assert result.returncode != 0
    assert "not refused" not in result.stdout
    assert result.stdout.count("refused: keras-ring: the ranks run different Keras backends "
                               "(rank 0: tensorflow, rank 1: jax)") == 2, result.stdout


def test_a_backend_changed_after_init_is_refused():
    result = subprocess.run(
        [sys.executable, "-c",
         "import os\n"
         "import keras_ring as kr\n"
         "kr.init()\n"
         "os.environ['KERAS_BACKEND'] = 'jax'\n"
         "import keras\n"
         "kr.DistributedOptimizer(keras.optimizers.SGD())\n"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"},
    )
    assert result.returncode != 0
    assert ("Keras runs on jax, but its backend was tensorflow when keras_ring.init() agreed it"
            in result.stderr), result.stderr[-2000:]


def test_a_tensorflow_helper_without_tensorflow_names_the_alternative():
    result = _python(
        "import sys\n"
        "class NoTensorFlow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tensorflow':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTensorFlow())\n"
        "import keras_ring as kr\n"
        "for name in ('allreduce', 'DistributedGradientTape', 'shard_dataset'):\n"
        "    try:\n"
        "        f = getattr(kr, name)\n"
        "        f(None)\n"
        "    except ImportError as e:\n"
        "        print(name, '->', e)\n"
    )
    assert "allreduce -> keras_ring.allreduce works on TensorFlow tensors" in result.stdout, (
        result.stdout + result.stderr)
    assert "keras_ring.jax has the same collectives" in result.stdout
    assert "keras_ring.jax.allreduce_gradients" in result.stdout
    assert "kr.shard_arrays(x, y)" in result.stdout
