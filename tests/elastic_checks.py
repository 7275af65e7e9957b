"""What every elastic recovery must show in the training worker's logs
(tests/workers/elastic_train_worker.py), under `keras-ring-run --elastic` or on Ray."""

import glob
import json

# The worker's epochs and steps per epoch (KR_TEST_EPOCHS, KR_TEST_STEPS).
EPOCHS, STEPS = 4, 8


def shm_segments():
    return set(glob.glob("/dev/shm/kr-*"))


def read_logs(log_dir):
    """{worker: [events]} from the workers' logs in `log_dir`."""
    logs = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            logs[path.stem] = [json.loads(line) for line in f]
    return logs


def events_of(events, kind):
    return [e for e in events if e["event"] == kind]


def check_training_went_on(result, logs, survivors):
    """The checks every recovery must pass; `survivors` the number of workers that finish."""
    assert result.returncode == 0, result.stdout[-8000:]
    ended = {w: events_of(ev, "end")[0] for w, ev in logs.items() if events_of(ev, "end")}
    assert len(ended) == survivors, (sorted(ended), result.stdout[-8000:])
    # Every optimizer step applied exactly once: the restored iterations are the committed
    # ones, and a resumed epoch runs only the batches its commit had not done.
    for worker, end in ended.items():
        assert end["iterations"] == EPOCHS * STEPS, (worker, end["iterations"])
    weights = [end["weights"] for end in ended.values()]
    assert all(w == weights[0] for w in weights), "the survivors' weights differ"
    for worker, events in logs.items():
        for i, reset in enumerate(events):
            if reset["event"] != "reset":
                continue
            commits = events_of(events[:i], "commit")
            steps_after = events_of(events[i:], "step")
            if commits and steps_after:
                # Back at the last commit, and on from it.
                assert reset["iterations"] == commits[-1]["iterations"], (worker, reset)
                assert steps_after[0]["iterations"] == reset["iterations"] + 1, (worker, reset)


def resets_of(logs):
    return [e for ev in logs.values() for e in ev if e["event"] == "reset"]


def losses_continue(logs):
    """The first loss after each reset is far below the first loss of the job."""
    first = min((e for ev in logs.values() for e in ev if e["event"] == "step"),
                key=lambda e: e["iterations"])["loss"]
    for events in logs.values():
        for i, e in enumerate(events):
            if e["event"] == "reset" and e["iterations"] > 4:
                after = next(x for x in events[i:] if x["event"] == "step")
                assert after["loss"] < first / 4, (first, after)
