"""keras_ring.torch: Horovod's PyTorch collectives across ranks; torch alone, without TensorFlow."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

WORKERS = pathlib.Path(__file__).parent / "workers"


# At 3 ranks only, for the reason tests/test_tf_ops_multirank.py gives.
@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_torch_ops(run_ranks, np):
    run_ranks(np, WORKERS / "torch_ops_worker.py", timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("np", [3])
def test_torch_training_matches_one_optimizer_at_the_global_batch(run_ranks, np):
    # DistributedOptimizer (every option), broadcast_parameters and _optimizer_state,
    # synchronize()'s rules, SyncBatchNorm: see the worker's checks.
    run_ranks(np, WORKERS / "torch_train_worker.py", timeout=600)


def test_torch_alone_never_imports_tensorflow_or_jax():
    # Both are installed here; a PyTorch job must load neither (nor pay their start-up).
    result = subprocess.run(
        [sys.executable, "-c",
         "import sys\n"
         "import torch\n"
         "import keras_ring.torch as hvd\n"
         "hvd.init()\n"
         "x = hvd.allreduce(torch.ones(3), op=hvd.Sum)\n"
         "g = hvd.allgather(torch.ones(2, 1))\n"
         "print(float(x.sum()), tuple(g.shape),\n"
         "      'tensorflow' in sys.modules, 'jax' in sys.modules)\n"],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3.0", "(2,", "1)", "False", "False"]


def test_gpu_tensors_are_refused_with_the_way_out():
    import torch

    import keras_ring.torch as hvd

    hvd.init()
    with pytest.raises(ValueError, match="CPU tensors only.*meta.*tensor.cpu"):
        hvd.allreduce(torch.ones(2, device="meta"))


@pytest.mark.multirank
@pytest.mark.parametrize("tensorflow", ["hidden", "installed"])
def test_keras_on_torch_never_imports_tensorflow(run_ranks, tensorflow):
    # The Keras layer whole (optimizer, callbacks, SyncBatchNormalization, uneven shards,
    # kr.evaluate, KerasState) under KERAS_BACKEND=torch: as where TensorFlow is not
    # installed, and where it is.
    args = ["hide"] if tensorflow == "hidden" else []
    result = run_ranks(2, WORKERS / "keras_torch_no_tf_worker.py", *args,
                       env={"KERAS_BACKEND": "torch"})
    for rank in range(2):
        assert f"rank {rank}: same weights True" in result.stdout, result.stdout
    assert result.stdout.count("tensorflow imported: False") == 2, result.stdout
