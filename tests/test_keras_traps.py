"""What a new user of keras-ring runs into, under the launcher (workers/keras_traps_worker.py)."""

import os
import pathlib
import re
import sys

import pytest
from conftest import run_job

pytestmark = pytest.mark.multirank

WORKER = pathlib.Path(__file__).parent / "workers" / "keras_traps_worker.py"
SCENARIOS = ["uneven", "divergence", "evaluate_predict", "keras_backup"]
# 3 ranks: uneven shards of three lengths, and ranks other than the root that differ.
NP = 3


def outcomes(output, scenario, np):
    """Each rank's outcome line, by rank."""
    found = dict(re.findall(rf"^{scenario} rank (\d+): (.*)$", output, re.MULTILINE))
    assert sorted(found) == [str(r) for r in range(np)], output
    return [found[str(r)] for r in range(np)]


@pytest.fixture(scope="module")
def traps(tmp_path_factory):
    """The output of one 3-rank job that runs every scenario: the ranks start TensorFlow once."""
    out_dir = tmp_path_factory.mktemp("traps")
    command = [os.path.join(os.path.dirname(sys.executable), "keras-ring-run"), "-np", str(NP),
               "--", sys.executable, str(WORKER), str(out_dir), *SCENARIOS]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(out_dir)  # away from the source tree, as every test runs
        return run_job(command, f"{NP}-rank job {WORKER.name}", timeout=600).stdout


def test_ranks_with_uneven_data_train_together(traps):
    # Rank r has 17 - r batches, in a dataset of unknown length and in arrays.
    assert outcomes(traps, "uneven", NP) == ["ok"] * NP


def cases(output):
    """What rank 0 logged during each case of the divergence scenario, by case name."""
    logged, name = {}, None
    for line in output.splitlines():
        if match := re.fullmatch(r"case (\w+) (begin|end)", line):
            name = match[1] if match[2] == "begin" else None
            logged.setdefault(match[1], [])
        elif name and "keras-ring warning:" in line:
            logged[name].append(line.split("keras-ring warning: ", 1)[1])
    return logged


def test_ranks_that_silently_diverge_are_reported(traps):
    assert outcomes(traps, "divergence", NP) == ["ok"] * NP
    logged = cases(traps)
    diverged = {name: [w for w in warnings if w.startswith("The ranks have diverged")]
                for name, warnings in logged.items()}
    assert diverged["agreeing"] == [] and diverged["plateau_after_average"] == [], logged
    # ReduceLROnPlateau before MetricAverageCallback: rank 0's metric improves, the others' not.
    (plateau,) = diverged["plateau_before_average"]
    assert "at the end of training" in plateau, plateau
    assert "learning rates (rank 0: 0.05, rank 1: 0.025" in plateau, plateau
    assert "MetricAverageCallback() before ReduceLROnPlateau" in plateau
    # A plain optimizer: a warning when training starts, and the weights differ after epoch 1.
    assert logged["plain_optimizer"][0].startswith("The model's optimizer is not a "
                                                   "keras_ring.DistributedOptimizer")
    for name in ("plain_optimizer", "keras_load_model"):
        (weights,) = diverged[name]
        assert "after epoch 1: their trainable weights" in weights, weights
        assert "keras_ring.load_model(path), not keras.models.load_model" in weights, weights
        assert weights.endswith("(KERAS_RING_DIVERGENCE=error makes this an error.)"), weights
    # Ranks that start apart: an error on every rank (the worker checks it), or with
    # KERAS_RING_DIVERGENCE=warn one warning from rank 0, and no epoch-end warning after it.
    assert logged["no_broadcast"] == [] and logged["plateau_as_error"] == [], logged
    (started,) = logged["no_broadcast_warned"]
    assert started.startswith("The ranks would start training from different weights (ranks "
                              "that agree: [0]; [1]; [2])"), started


def test_evaluate_and_predict_over_shards_give_the_whole_datas_results(traps):
    assert outcomes(traps, "evaluate_predict", NP) == ["ok"] * NP


def test_keras_own_backup_in_one_directory_is_refused_naming_keras_rings(traps):
    assert outcomes(traps, "keras_backup", NP) == ["ok"] * NP
