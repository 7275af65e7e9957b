"""keras_ring.callbacks across 3 ranks under each Keras backend (workers/callbacks_worker.py)."""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).parent / "workers" / "callbacks_worker.py"
SCENARIOS = [
    "broadcast",
    "metric_average",
    "agreed_stopping",
    "rank_zero_files",
    "guard",
    "backup_and_restore",
]


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
@pytest.mark.parametrize("np", [3])
def test_callbacks(run_ranks, tmp_path, np, backend):
    out_dir = tmp_path / "files"
    out_dir.mkdir()
    result = run_ranks(np, WORKER, out_dir, *SCENARIOS, timeout=300,
                       env={"KERAS_BACKEND": backend})
    for scenario in SCENARIOS:
        assert f"{scenario}: " in result.stdout, result.stdout
    # Files are written by rank 0 only; BackupAndRestore's backups are deleted at the end.
    written = sorted(p.name for p in out_dir.iterdir())
    assert written == ["best_rank0.keras", "checkpoint_rank0.keras", "log_rank0.csv"]
