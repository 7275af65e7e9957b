"""What a new user of keras-ring runs into, under the launcher (workers/keras_traps_worker.py)."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.multirank

WORKER = pathlib.Path(__file__).parent / "workers" / "keras_traps_worker.py"


def outcomes(output, scenario, np):
    """Each rank's outcome line, by rank."""
    found = dict(re.findall(rf"^{scenario} rank (\d+): (.*)$", output, re.MULTILINE))
    assert sorted(found) == [str(r) for r in range(np)], output
    return [found[str(r)] for r in range(np)]


@pytest.mark.parametrize("np", [3])
def test_ranks_with_uneven_data_train_together(run_ranks, tmp_path, np):
    # Rank r has 17 - r batches, in a dataset of unknown length and in arrays.
    result = run_ranks(np, WORKER, "uneven", tmp_path, timeout=300)
    assert outcomes(result.stdout, "uneven", np) == ["ok"] * np


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


@pytest.mark.parametrize("np", [3])
def test_ranks_that_silently_diverge_are_reported(run_ranks, tmp_path, np):
    result = run_ranks(np, WORKER, "divergence", tmp_path, timeout=300)
    assert outcomes(result.stdout, "divergence", np) == ["ok"] * np
    logged = cases(result.stdout)
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


@pytest.mark.parametrize("np", [3])
def test_evaluate_and_predict_over_shards_give_the_whole_datas_results(run_ranks, tmp_path, np):
    result = run_ranks(np, WORKER, "evaluate_predict", tmp_path, timeout=300)
    assert outcomes(result.stdout, "evaluate_predict", np) == ["ok"] * np
