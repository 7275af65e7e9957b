"""The README's and getting-started's four-line snippet, exactly as written, under the launcher.

Each snippet is cut from its page and run after a prelude that stands for the
user's own script: the imports, a model built lazily (`keras.Sequential`
without `keras.Input`, the most common pattern) and a dataset `ds`. Both launch
commands of the pages run it: `keras-ring-run -np 2 python train.py` and
`mpiexec -n 2 python train.py` (the README's), and the README's runs under
`KERAS_BACKEND=jax` and `KERAS_BACKEND=torch` too, unchanged. Rank 0 draws Keras's
real progress bar. The PyTorch scripts of the Horovod PyTorch page and of the
elastic page run after a prelude of their own.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import RANK_THREAD_ENV

pytestmark = pytest.mark.multirank

ROOT = pathlib.Path(__file__).parent.parent
BIN = pathlib.Path(sys.executable).parent
PRELUDE = """\
import keras
import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int64") + 2 * (x[:, 4:].sum(axis=1) > 0)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
model = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(4, activation="softmax")])
"""
EPILOGUE = """
weights = np.concatenate([w.ravel() for w in model.get_weights()])
same = kr.allgather_object(weights)
assert all((w == same[0]).all() for w in same), "the ranks' weights differ"
print(f"snippet finished on rank {kr.rank()} of {kr.size()}", flush=True)
"""


def snippet(page, after):
    """The first ```python block of `page` after the line that contains `after`."""
    text = (ROOT / page).read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(after):], re.DOTALL)[1]


SNIPPETS = {
    "README": snippet("README.md", "four additions"),
    "getting-started": snippet("docs/getting-started.md", "## The four lines"),
}


@pytest.mark.parametrize(("page", "launch", "backend"), [
    ("README", "keras-ring-run", "tensorflow"), ("README", "mpiexec", "tensorflow"),
    ("getting-started", "keras-ring-run", "tensorflow"), ("README", "keras-ring-run", "jax"),
    ("README", "keras-ring-run", "torch")])
def test_snippet_trains_as_written(tmp_path, page, launch, backend):
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + SNIPPETS[page] + EPILOGUE)
    command = {"keras-ring-run": [BIN / "keras-ring-run", "-np", "2"],
               "mpiexec": [BIN / "mpiexec", "-n", "2"]}[launch]
    result = subprocess.run([*command, sys.executable, script], stdin=subprocess.DEVNULL,
                            capture_output=True, timeout=400, cwd=tmp_path,
                            env={**os.environ, **RANK_THREAD_ENV, "KERAS_BACKEND": backend})
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    for rank in range(2):
        assert f"snippet finished on rank {rank} of 2" in out
    assert "Epoch 10/10" in out and "━━━━━━━━━━━━━━━━━━━━" in out, out[-3000:]
    assert "Epoch 1/10" not in err  # only rank 0 prints progress, on stdout


def test_the_jax_script_of_getting_started_trains_as_written(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("docs/getting-started.md", "## On JAX") + EPILOGUE)
    result = subprocess.run([BIN / "keras-ring-run", "-np", "2", sys.executable, script],
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=400,
                            cwd=tmp_path, env={**os.environ, **RANK_THREAD_ENV})
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    for rank in range(2):
        assert f"snippet finished on rank {rank} of 2" in out
    assert "Epoch 3/3" in out and "━━━━━━━━━━━━━━━━━━━━" in out, out[-3000:]


TORCH_PRELUDE = """\
import numpy as np
import torch

torch.set_num_threads(1)
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.normal(size=(256, 20)).astype("float32"))
dataset = torch.utils.data.TensorDataset(x, (x[:, :10].sum(dim=1) > 0).long())
epochs = 2
"""
TORCH_EPILOGUE = """
weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
same = hvd.allgather_object(weights)
assert all((w == same[0]).all() for w in same), "the ranks' weights differ"
print(f"snippet finished on rank {hvd.rank()} of {hvd.size()}", flush=True)
"""


@pytest.mark.parametrize(("page", "after", "prelude"), [
    ("docs/migrating-from-horovod-pytorch.md", "## A training script", ""),
    ("docs/elastic.md", "## A PyTorch loop",
     "model = torch.nn.Linear(20, 1)\n"
     "dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))\n")],
    ids=["horovod-pytorch", "elastic-pytorch"])
def test_the_pytorch_scripts_of_the_docs_train_as_written(tmp_path, page, after, prelude):
    script = tmp_path / "train.py"
    script.write_text(TORCH_PRELUDE + prelude + snippet(page, after) + TORCH_EPILOGUE)
    result = subprocess.run([BIN / "keras-ring-run", "-np", "2", sys.executable, script],
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=400,
                            cwd=tmp_path, env={**os.environ, **RANK_THREAD_ENV})
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    for rank in range(2):
        assert f"snippet finished on rank {rank} of 2" in out
