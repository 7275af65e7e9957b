"""The timeline (Chrome trace JSON per rank, merge, plot) and the log's level."""

import json
import os
import subprocess
import sys

import pytest

from keras_ring import timeline

WORKER = os.path.join(os.path.dirname(__file__), "workers", "timeline_worker.py")
# Holds the three "fused.*" allreduces back until all are agreed.
FUSING = {"KERAS_RING_CYCLE_TIME": "50"}


def read(path):
    with open(path) as f:
        return f.read()


def rows_and_spans(path):
    events = timeline.load(path)
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    by_tensor = {}
    for s in timeline.spans(events):
        by_tensor.setdefault(names.get(s["tid"]), []).append(s)
    return by_tensor


def packed(np_, shm="1"):
    """Whether small fused allreduces go through the MPI fusion buffer: without
    shared memory, or with more ranks than cores (the engine's rule)."""
    return shm == "0" or np_ > len(os.sched_getaffinity(0))


def check_sequence(path, rank, step="", packs=False):
    # Fused tensors show PACK and UNPACK only over MPI (`packs`): shared memory
    # copies them in and out within COMMUNICATE, with no fusion buffer.
    by_tensor = rows_and_spans(path)
    groups = set()
    for tensor in ("fused.a", "fused.b", "fused.c", "single", "gather", "bcast"):
        found = by_tensor[tensor + step]
        kinds = [s["name"] for s in found]
        collective = {"gather": "ALLGATHER", "bcast": "BROADCAST"}.get(tensor, "ALLREDUCE")
        assert kinds.count("NEGOTIATE") == 1 and kinds.count(collective) == 1, (tensor, kinds)
        assert {"QUEUE", "COMMUNICATE", "DONE"} <= set(kinds), (tensor, kinds)
        top = {s["name"]: s for s in found if s["depth"] == 0}
        assert top["NEGOTIATE"]["end"] <= top[collective]["start"]
        for s in found:
            if s["depth"] > 0:  # phases lie inside the collective's span (to a double's ulp)
                assert top[collective]["start"] - 0.05 <= s["start"] <= s["end"]
                assert s["end"] <= top[collective]["end"] + 0.05
        fused = tensor.startswith("fused")
        assert top[collective]["args"]["tensors"] == (3 if fused else 1), (tensor, top)
        assert ({"PACK", "UNPACK"} <= set(kinds)) == (fused and packs), (tensor, kinds)
        if fused:
            groups.add(top[collective]["args"]["group"])
    assert len(groups) == 1, groups  # one collective for the three
    # A group's members have a row each; its two float32 tensors ran as one collective, the
    # int64 one as another.
    ran = {}
    for tensor in ("grp.a", "grp.b", "grp.c"):
        found = by_tensor[tensor + step]
        kinds = [s["name"] for s in found]
        assert kinds.count("NEGOTIATE") == 1 and kinds.count("ALLREDUCE") == 1, (tensor, kinds)
        assert {"QUEUE", "COMMUNICATE", "DONE"} <= set(kinds), (tensor, kinds)
        args = next(s for s in found if s["name"] == "ALLREDUCE")["args"]
        ran[tensor] = (args["group"], args["tensors"])
    assert ran["grp.a"] == ran["grp.c"] and ran["grp.a"][1] == 2, ran
    assert ran["grp.b"][1] == 1 and ran["grp.b"][0] != ran["grp.a"][0], ran
    assert {s["pid"] for spans in by_tensor.values() for s in spans} == {rank}
    return groups.pop()


@pytest.mark.multirank
@pytest.mark.parametrize("np_, shm", [(2, "1"), (3, "1"), (2, "0")], ids=["2", "3", "2-mpi"])
def test_timeline_from_the_environment(run_ranks, tmp_path, np_, shm):
    path = str(tmp_path / "trace.json")
    env = {
        "KERAS_RING_TIMELINE": path,
        "KERAS_RING_LOG_LEVEL": "info",
        "KERAS_RING_SHM": shm,
        **FUSING,
    }
    result = run_ranks(np_, WORKER, "env", path, timeout=300, env=env)
    groups = set()
    for rank in range(np_):
        file = timeline.rank_file(path, rank)
        assert f"rank {rank} " in result.stdout and f"recording the timeline into {file}" in (
            result.stdout
        ), result.stdout
        json.loads(read(file))  # closed at shutdown: strict JSON
        groups.add(check_sequence(file, rank, packs=packed(np_, shm)))
    assert len(groups) == 1, groups  # every rank numbers the fused collective alike
    merged = timeline.merge(path)
    assert merged == path
    events = json.loads(read(path))
    assert {e["pid"] for e in events} == set(range(np_))
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {n.split(" (")[0] for n in names} == {f"rank {r}" for r in range(np_)}
    pytest.importorskip("matplotlib")
    image = tmp_path / "trace.png"
    subprocess.run(
        [sys.executable, "-m", "keras_ring.timeline", "plot", path, str(image)],
        check=True,
        timeout=120,
    )
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multirank
def test_timeline_started_and_stopped_at_run_time(run_ranks, tmp_path):
    path = str(tmp_path / "runtime.json")
    result = run_ranks(2, WORKER, "runtime", path, timeout=300, env=FUSING)
    assert result.stdout.count("second start refused: keras-ring: a timeline is already") == 2
    for rank in (0, 1):
        file = timeline.rank_file(path, rank)
        json.loads(read(file))
        check_sequence(file, rank, packs=packed(2))
        tensors = rows_and_spans(file)
        assert "before.start" not in tensors and "after.stop" not in tensors


@pytest.mark.multirank
def test_timeline_is_readable_after_a_rank_is_killed(run_ranks, tmp_path):
    path = str(tmp_path / "killed.json")
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1", **FUSING}
    result = run_ranks(2, WORKER, "killed", path, timeout=300, env=env, check=False)
    assert result.returncode == 128 + 9, result.stdout
    for rank in (0, 1):
        file = timeline.rank_file(path, rank)
        text = read(file)
        if not text.rstrip().endswith("]"):
            # Cut short: the format's rule (add the closing bracket) makes it JSON.
            json.loads(text + "]")
        check_sequence(file, rank, packs=packed(2))
        assert any(e.get("name") == "CYCLE" for e in timeline.load(file))
    assert len(rows_and_spans(timeline.merge(path))) >= 6


def test_load_reads_a_file_cut_in_the_middle_of_an_event(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n{"name":"a","ph":"B","pid":0,"tid":1,"ts":1},\n{"name":"b","ph":"X","pi')
    events = timeline.load(str(path))
    assert [e["name"] for e in events] == ["a"]
    spans = timeline.spans(events)  # the open span lasts to the end of the trace
    assert [(s["name"], s["start"], s["end"]) for s in spans] == [("a", 1, 1)]
    path.write_text('{"traceEvents": [{"name":"x","ph":"X","pid":0,"tid":1,"ts":1,"dur":2}]}')
    assert timeline.spans(timeline.load(str(path)))[0]["end"] == 3


def test_rank_files_and_merge_errors(tmp_path):
    assert timeline.rank_file("/a/trace.json", 3) == "/a/trace.rank3.json"
    assert timeline.rank_file("/a/trace", 0) == "/a/trace.rank0.json"
    with pytest.raises(FileNotFoundError, match="no timeline files"):
        timeline.merge(str(tmp_path / "none.json"))


NOT_INITIALISED = """
import keras_ring as kr
kr.stop_timeline()  # nothing recording: nothing to do
try:
    kr.start_timeline("never.json")
except ValueError as e:
    print(e)
"""


def test_start_timeline_needs_init(tmp_path):
    # A fresh process: this one may have initialised keras-ring in another test.
    result = subprocess.run(
        [sys.executable, "-c", NOT_INITIALISED], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "start_timeline() needs keras_ring.init()" in result.stdout, result.stdout
    assert not os.path.exists(tmp_path / "never.rank0.json")


LOGGING = """
import keras_ring as kr
from keras_ring.core import _log
kr.init()
_log.log(_log.DEBUG, "a debug message")
for _ in range(3):
    _log.warning("a warning said once", once=True)
kr.shutdown()
"""


@pytest.mark.parametrize("level", ["debug", "WARNING", "bogus"])
def test_log_level_filters_messages(level):
    env = {**os.environ, "KERAS_RING_LOG_LEVEL": level}
    result = subprocess.run(
        [sys.executable, "-c", LOGGING], capture_output=True, text=True, env=env, timeout=120
    )
    if level == "bogus":
        assert result.returncode != 0
        assert (
            "KERAS_RING_LOG_LEVEL must be one of trace, debug, info, warning, error. "
            "Received: KERAS_RING_LOG_LEVEL=bogus"
        ) in result.stderr
        return
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    debug = [line for line in lines if "keras-ring debug: a debug message" in line]
    assert len(debug) == (1 if level == "debug" else 0), result.stderr
    assert ("keras-ring info: engine started" in result.stderr) == (level == "debug")
    warned = [line for line in lines if "keras-ring warning: a warning said once" in line]
    assert len(warned) == 1, result.stderr
    assert warned[0].startswith("[20") and " UTC rank 0 " in warned[0], warned[0]


@pytest.mark.multirank
def test_timeline_records_a_stalled_tensor_failing(run_ranks, tmp_path):
    # Rank 1 never submits "stalled": the error reaches it with no request of its own.
    worker = os.path.join(os.path.dirname(__file__), "workers", "stall_worker.py")
    path = str(tmp_path / "stall.json")
    env = {
        "KERAS_RING_TIMELINE": path,
        "KERAS_RING_STALL_CHECK_TIME": "1",
        "KERAS_RING_STALL_SHUTDOWN_TIME": "3",
    }
    run_ranks(2, worker, timeout=120, env=env)
    stalled = rows_and_spans(timeline.rank_file(path, 0))["stalled"]
    failed = [s for s in stalled if s["name"] == "ALLREDUCE"]
    assert len(failed) == 1 and "giving up" in failed[0]["args"]["error"], stalled
    assert "stalled" not in rows_and_spans(timeline.rank_file(path, 1))
    assert "after" in rows_and_spans(timeline.rank_file(path, 1))
