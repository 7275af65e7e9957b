"""Tells `keras-ring-run` how this rank ends, so that it can name the rank that failed first.

When a rank raises, its engine shuts down at exit and every other rank then
fails too, naming it; all of them exit with code 1, in any order, so exit
statuses alone cannot say which failed first. So in a job `keras-ring-run`
started, a rank reports from `atexit`, before the engine shuts down: that it
is ending, when (`time.time()`), and the exception that ends it, if one does.
In a TCP job it also reports each start of the engine and, after each
shutdown (by `shutdown()`, or at exit), that it got that far: a rank whose
last start has no such report (`os._exit`, a signal, a crash) ended
abruptly; under MPICH's forker the start script sees that
instead.

`keras-ring-run` names where to report in `KERAS_RING_END_REPORT`: `fd:N`
(a pipe to it, which `_rank_output.py` hands down), or `store` (the job's
rendezvous store, `KERAS_RING_RENDEZVOUS` with `KERAS_RING_SECRET`). Without
it, nothing is reported. `RankEnding` and `first_to_fail` are how
`keras-ring-run` reads the reports back.
"""

import atexit
import dataclasses
import os
import sys
import time

VARIABLE = "KERAS_RING_END_REPORT"
# At most this much of the exception's first line is reported (a pipe write under
# PIPE_BUF is atomic, so lines of ranks writing at once never mix).
_TEXT_CHARS = 300
# How long a report to the store may take, at exit.
_STORE_TIMEOUT_SECONDS = 5.0

_target = None  # ("fd", fd) or ("store", address, secret), once read
_rank = None  # this rank, once the engine has started
_starts = 0  # the engine's starts in this process (init() again after shutdown())
_ending_since = None  # when shutdown() ran with an exception on its way out
_registered = set()  # the reports registered with atexit


def before_engine_start():
    """Registers the report of a normal exit; call before the engine first registers its own.

    `atexit` runs its functions last registered first, so this one runs after
    the engine's shutdown and MPI_Finalize: a rank whose exit never gets this
    far (`os._exit`, a signal, a crash) ended abruptly.
    """
    if _read_target() and _target[0] == "store":
        _register(_report_ended)


def after_engine_start(rank):
    """Registers the report of this rank's end, before the engine shuts down at exit."""
    global _rank, _starts
    _rank = rank
    _starts += 1
    if _read_target():
        if _target[0] == "store":
            _report("started", str(_starts))
        _register(_report_ending)


def _register(report):
    if report not in _registered:
        atexit.register(report)
        _registered.add(report)


def _read_target():
    global _target
    if _target is None:
        spec = os.environ.pop(VARIABLE, "")
        if spec.startswith("fd:"):
            fd = int(spec[3:])
            os.set_inheritable(fd, False)  # not a rank's own child's
            _target = ("fd", fd)
        elif spec == "store":
            _target = ("store", os.environ["KERAS_RING_RENDEZVOUS"],
                       os.environ["KERAS_RING_SECRET"].encode())
        else:
            _target = ()
    return bool(_target)


def _report_ending():
    # Python keeps the exception that ended the script in sys.last_value (SystemExit excepted).
    error = getattr(sys, "last_value", None)
    when = time.time() if _ending_since is None else _ending_since
    text = "" if error is None else f"{type(error).__name__}: {error}".split("\n", 1)[0]
    if len(text) > _TEXT_CHARS:
        text = text[: _TEXT_CHARS - 3] + "..."
    _report("ending", f"{when:.6f} {text}".rstrip())


def _report_ended():
    if _rank is not None:
        _report("ended", str(_starts))


def shut_down():
    """Notes `shutdown()`: in a TCP job, that the engine shut down (the rank may end any way).

    A `shutdown()` in a `finally:` around training, with an exception on its
    way out, is where this rank's end began (the others fail from here on):
    the report at exit gives that time, with the exception the script ended
    with, if it did.
    """
    global _ending_since
    if _ending_since is None and sys.exc_info()[1] is not None:
        _ending_since = time.time()
    if _read_target() and _target[0] == "store":
        _report_ended()


def _report(kind, value):
    rank = _rank
    if _target[0] == "fd":
        try:
            os.write(_target[1], f"{rank} {kind} {value}\n".encode("utf-8", "replace"))
        except OSError:
            pass  # keras-ring-run has gone: no one to tell
        return
    from keras_ring.core._rendezvous import RendezvousClient

    try:
        with RendezvousClient(_target[1], _target[2], f"rank {rank} at exit",
                              timeout=_STORE_TIMEOUT_SECONDS) as store:
            store.set(f"end/{rank}/{kind}", value.encode("utf-8", "replace"))
    except ConnectionError:
        pass


@dataclasses.dataclass(frozen=True)
class RankEnding:
    """What a rank reported as its exit began (`_report_ending`): when, and the exception.

    Attributes:
        rank: The rank.
        when: Its `time.time()` then.
        error: The exception's type and first line ("ValueError: bad"), or "".
    """

    rank: int
    when: float
    error: str

    @classmethod
    def parse(cls, rank, value):
        when, _, error = value.partition(" ")
        return cls(rank, float(when), error)


def first_to_fail(endings, codes):
    """The rank whose exit started a failed job's end, its code and what to say of it; or None.

    A rank that raises shuts its engine down at exit, and only then do the
    others fail, naming it, and exit: of the ranks that raised or exited with
    a code other than 0 (a shell around a rank may hide its code), the one
    whose exit began first (as each reported) failed first.

    Args:
        endings: The `RankEnding`s reported.
        codes: The exit code of each rank that ended, by rank.
    """
    failing = [ending for ending in endings if codes.get(ending.rank, 0) != 0 or ending.error]
    if not failing:
        return None
    first = min(failing, key=lambda ending: ending.when)
    code = codes.get(first.rank, 1)  # 1 where the rank's own end was never reported
    raised = f"raised {first.error} and " if first.error else ""
    return first.rank, code, f"{raised}exited with code {code}, the first rank to fail."
