"""The soak's short form: memory, threads, fds and shared memory stay flat (benchmarks/soak.py).

The benchmark's full run (10,000 cached and 10,000 uniquely named allreduces,
2,000 fit steps) has its figures in docs/performance.md; this runs it with
3,000, 3,000 and 600, as a user runs it, and reads the JSON it writes.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank

SOAK = pathlib.Path(__file__).parent.parent / "benchmarks" / "soak.py"
# Growth of the resident memory a phase may show from a tenth of the way in to its
# end: the allocator's noise, not a leak (a kernel kept per name grew 32 MiB in 900 names).
RSS_SLACK_MIB = 8.0


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    command = [sys.executable, str(SOAK), "--cached", "3000", "--unique", "3000",
               "--steps", "600", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"wrote {out / 'soak'}.json and {out / 'soak'}.png" in result.stdout, result.stdout
    return json.loads((out / "soak.json").read_text())["rows"]


def test_the_soak_runs_every_phase_on_every_rank(rows):
    assert sorted((r["config"], r["phase"]) for r in rows) == sorted(
        [(f"keras-ring rank {rank}", phase) for rank in (0, 1)
         for phase in ("cached", "unique", "fit")] + [("plain Keras", "fit")])


@pytest.mark.parametrize("phase", ["cached", "unique", "fit"])
def test_threads_fds_and_shared_memory_stay_flat(rows, phase):
    for row in rows:
        if row["phase"] == phase:
            for what in ("threads", "fds", "shm_files"):
                start, end = row[what]
                assert start == end, (row["config"], phase, what, row["series"])


@pytest.mark.parametrize("phase", ["cached", "unique", "fit"])
def test_resident_memory_stays_flat(rows, phase):
    plain = next(r for r in rows if r["config"] == "plain Keras")
    tensorflow_growth = max(0.0, plain["rss_mib"][1] - plain["rss_mib"][0]) if phase == "fit" else 0
    for row in rows:
        if row["phase"] == phase and row["config"] != "plain Keras":
            start, end = row["rss_mib"]
            assert end - start <= tensorflow_growth + RSS_SLACK_MIB, (
                row["config"], phase, [round(s[1], 1) for s in row["series"]])
