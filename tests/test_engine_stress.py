"""Randomised-order stress of the engine through its NumPy binding (no TensorFlow).

Every rank submits each step's 50-90 named global collectives and 12-25 more
in each of two process sets it may be in (allreduces, allgathers, broadcasts,
reducescatters and alltoalls; mixed dtypes, reduce ops, scale factors, sizes,
occasional shape changes; the same names in several sets) in its own random
order before waiting on any, and checks every result against NumPy; then the
ranks run out of data at different steps and join, in the global set and in
a process set: see workers/stress_worker.py. A hang fails the test at the
run's timeout. KR_STRESS_SEED and KR_STRESS_STEPS in the environment override
the seed and step count of every case.
"""

import collections
import json
import os

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "stress_worker.py")
# A run takes 2-6 s here (2 cores, 3 ranks); the timeout only has to catch a hang.
TIMEOUT = 240
SETTING_NAMES = ["KERAS_RING_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD",
                 "KERAS_RING_CYCLE_TIME", "HOROVOD_CYCLE_TIME"]


# The defaults at 2 and 3 ranks; the other settings at 3, where the process sets overlap most.
@pytest.mark.multirank
@pytest.mark.parametrize(
    "np_, case, settings, fuses",
    [
        (2, 0, {}, True),
        (3, 0, {}, True),
        (3, 1, {"KERAS_RING_FUSION_THRESHOLD": "0"}, False),
        (3, 2, {"KERAS_RING_FUSION_THRESHOLD": "4096"}, True),  # small: many fused groups
        (3, 3, {"KERAS_RING_CYCLE_TIME": "1"}, True),
        # MPICH's shared-memory queues with 4 cells per sender instead of 64: a rank that
        # leaves control messages unreceived while it waits starves its peers' sends at
        # once (the engine drains them: Engine::DrainControl). Other MPIs ignore it.
        (3, 4, {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": "4"}, True),
    ],
    ids=["2-default", "3-default", "3-no-fusion", "3-threshold-4k", "3-cycle-1ms",
         "3-few-mpi-cells"],
)
def test_randomised_order_stress(run_ranks, monkeypatch, tmp_path, np_, case, settings, fuses):
    for name in SETTING_NAMES:  # "default" means the engine's defaults
        monkeypatch.delenv(name, raising=False)
    # A different fixed seed per case covers more specs, reproducibly.
    seed = os.environ.get("KR_STRESS_SEED", str(10 * np_ + case))
    env = {"KR_TEST_EXPECTED_SIZE": str(np_), "KR_STRESS_SEED": seed,
           "KR_STRESS_REPORTS": str(tmp_path), **settings}
    result = run_ranks(np_, WORKER, timeout=TIMEOUT, env=env)

    # From files: a rank's long line on stdout can arrive cut by another rank's.
    reports = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text())
               for rank in range(np_) if (tmp_path / f"rank{rank}.json").exists()}
    assert sorted(reports) == list(range(np_)), result.stdout
    for rank in range(np_):
        assert f"rank {rank}: stress ok" in result.stdout, result.stdout
    per_set = solve_per_set(reports, np_)
    for members, (want, stats) in per_set.items():
        where = (members, want, stats, reports)
        assert stats["tensors"] == want, where
        assert 1 <= stats["collectives"] <= stats["tensors"], where
        assert 0 <= stats["fused_tensors"] <= stats["tensors"], where
        if not fuses:
            assert stats["fused_tensors"] == 0, where
            assert stats["collectives"] == stats["tensors"], where
    # In the join phases only one set runs collectives (joined members with zeros), so its
    # members' counters move alike, whatever the other sets they are in.
    phases = collections.defaultdict(dict)
    for rank, r in reports.items():
        for label, phase in r["phases"].items():
            phases[label][rank] = phase
    assert len(phases) == 2, reports
    for label, by_rank in phases.items():
        first = next(iter(by_rank.values()))
        for phase in by_rank.values():
            assert {**phase["stats"], "cached_tensors": 0} == {**first["stats"],
                                                               "cached_tensors": 0}, by_rank
            assert phase["stats"]["tensors"] == phase["tensors"], (label, by_rank)
            if not fuses:
                assert phase["stats"]["fused_tensors"] == 0, (label, by_rank)
    for r in reports.values():
        assert r["tensors"] == r["expected_tensors"], reports
        assert r["grouped_tensors"] > r["submitted"] // 10, reports  # run(..., group=...)
        if fuses:
            assert r["fused_tensors"] > 0, reports
            assert r["collectives"] < r["tensors"], reports
        # Stable names are announced by response-cache id after their second step.
        assert r["cached_tensors"] > r["tensors"] // 4, reports


def solve_per_set(reports, np_):
    """Each set's share of the counters, solved from every rank's: a rank runs the collectives
    of every set it is in, so its counters are the sum of those sets' (sets with the same
    members are one unknown). Every member of a set runs the coordinator's list of collectives,
    fused groups included, so the sums must fit exactly: with one set, every rank's counters
    agree. (Cache hits are per rank: an allgather whose first dimension changed on one rank
    only is announced in full there and by id elsewhere.)

    Returns {members: (tensors the sets with those members ran, {counter: share})}.
    """
    sets = {}
    for rank, report in reports.items():
        for sid, s in report["sets"].items():
            assert sets.setdefault(sid, s) == s, (rank, sid, reports)  # members agree
            assert rank in s["members"], (rank, sid, reports)
    tensors = collections.Counter()
    for s in sets.values():
        tensors[tuple(s["members"])] += s["tensors"]
    columns = list(tensors)
    m = np.array([[rank in c for c in columns] for rank in range(np_)], float)
    assert np.linalg.matrix_rank(m) == len(columns), columns  # each set's share is determined
    shares = {}
    for key in ("collectives", "tensors", "fused_tensors"):
        y = np.array([reports[rank][key] for rank in range(np_)], float)
        x = np.linalg.lstsq(m, y, rcond=None)[0]
        assert np.allclose(m @ x, y) and np.allclose(x, np.round(x)), (key, columns, reports)
        shares[key] = [int(v) for v in np.round(x)]
    return {c: (tensors[c], {key: shares[key][i] for key in shares})
            for i, c in enumerate(columns)}
