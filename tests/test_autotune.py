"""Autotuning under the launcher: results stay exact while the settings change,
the search ends, and every rank ends with the same settings."""

import csv
import json
import os

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "autotune_worker.py")


def finals(out_dir, np_):
    ranks = []
    for rank in range(np_):
        with open(out_dir / f"final.{rank}.json") as f:
            ranks.append(json.load(f))
    return ranks


@pytest.mark.parametrize("np_", [3])
def test_autotune_converges_and_agrees_across_ranks(run_ranks, tmp_path, np_):
    log = tmp_path / "autotune.csv"
    env = {
        "KERAS_RING_AUTOTUNE": "1",
        "KERAS_RING_AUTOTUNE_LOG": str(log),
        "KERAS_RING_AUTOTUNE_WARMUP_SAMPLES": "2",
        "KERAS_RING_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        # A poor start: no fusion.
        "KERAS_RING_FUSION_THRESHOLD": "0",
        "KERAS_RING_LOG_LEVEL": "info",
    }
    # 3 samples per trial, at most 6 + 5 + 4 + 4 trials, a sample about two steps.
    result = run_ranks(np_, WORKER, "200", str(tmp_path), env=env, timeout=300)
    ranks = finals(tmp_path, np_)
    assert all(r["params"]["autotune"] == "tuned" for r in ranks), ranks
    assert len({json.dumps(r["params"], sort_keys=True) for r in ranks}) == 1, ranks
    assert ranks[0]["settings_seen"] > 5, ranks  # the settings really moved during the run
    assert result.stdout.count("autotune chose fusion threshold") == np_, result.stdout[-3000:]

    with open(log) as f:
        rows = list(csv.DictReader(f))
    phases = [r["phase"] for r in rows]
    assert phases[:2] == ["warmup", "warmup"] and phases[-1] == "chosen", phases
    trials = phases.count("trial")
    assert trials % 3 == 0, phases
    tuned = {r["setting"] for r in rows if r["phase"] == "trial"}
    assert {"fusion_threshold", "segment_bytes"} <= tuned, tuned
    # The cycle time is tried unless the fusion threshold was tuned to 0 (no fusion).
    fused = next(int(r["fusion_threshold_bytes"]) for r in rows if r["setting"] == "segment_bytes")
    assert ("cycle_time_ms" in tuned) == (fused != 0), (fused, tuned)
    # The crossover matters only where small allreduces may go over MPI.
    oversubscribed = np_ > len(os.sched_getaffinity(0))
    assert ("small_allreduce_bytes" in tuned) == oversubscribed, tuned
    chosen = rows[-1]
    params = ranks[0]["params"]
    assert int(chosen["fusion_threshold_bytes"]) == params["fusion_threshold"]
    assert float(chosen["cycle_time_ms"]) == params["cycle_time_ms"]
    assert int(chosen["segment_bytes"]) == params["segment_bytes"]
    assert int(chosen["small_allreduce_bytes"]) == params["small_allreduce_bytes"]
    assert all(float(r["bytes_per_second"]) > 0 for r in rows)


def test_autotune_log_that_cannot_be_written_fails_init(run_ranks, tmp_path):
    env = {"KERAS_RING_AUTOTUNE": "1", "KERAS_RING_AUTOTUNE_LOG": str(tmp_path / "no" / "x.csv")}
    result = run_ranks(2, WORKER, "1", str(tmp_path), env=env, check=False, timeout=120)
    assert result.returncode != 0
    assert "autotune: cannot write the log" in result.stdout, result.stdout[-3000:]
