"""Runs the engine's C++ tests (threads as ranks, no MPI).

The C++ suite checks the reduction kernels and the ring algorithms against
serial references, and runs the whole engine on the in-process world; it is
built with CMake (tests/cpp_builds.py, in the background while the rest of the
session runs) so that one pytest command runs every test. It is built once,
under AddressSanitizer and UndefinedBehaviorSanitizer, which run the same cases
as a plain build and more checks; the plain build runs only where the compiler
cannot build with those sanitizers. The engine's cases (the threads that share
its state) run under ThreadSanitizer too. The cases are shared among one
process per core (the program's `-s K/N`): the suite runs them last, alone.
"""

import contextlib
import os
import re
import subprocess
import tempfile


def run(program, *cases):
    """Runs the program's `cases` (all when none) in one process per core; returns each
    process's stderr, having checked that each passed all its cases."""
    shards = len(os.sched_getaffinity(0))
    results = []
    with contextlib.ExitStack() as files:
        jobs = []
        for shard in range(shards):
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe")
            jobs.append((subprocess.Popen([program, "-s", f"{shard}/{shards}", *cases],
                                          stdout=out, stderr=err, text=True), out, err))
        try:
            for process, out, err in jobs:
                process.wait(timeout=600)
                out.seek(0), err.seek(0)
                stdout, stderr = out.read(), err.read()
                assert process.returncode == 0, stdout[-4000:] + stderr[-4000:]
                counts = re.fullmatch(r"(\d+) passed, 0 failed", stdout.splitlines()[-1])
                assert counts, stdout[-2000:]
                results.append((int(counts[1]), stderr))
        finally:
            for process, _, _ in jobs:
                process.kill()
                process.wait()
    assert sum(passed for passed, _ in results) > 0, "no case ran"
    return [stderr for _, stderr in results]


def test_core_algorithms(cpp_builds):
    for stderr in run(cpp_builds.wait(cpp_builds.main)):
        assert "runtime error" not in stderr, stderr[-4000:]


def test_core_engine_under_thread_sanitizer(cpp_builds):
    for stderr in run(cpp_builds.wait("tsan"), "engine/"):
        assert "ThreadSanitizer" not in stderr, stderr[-4000:]
