"""Runs the engine's C++ tests (threads as ranks, no MPI).

The C++ suite checks the reduction kernels and the ring algorithms against
serial references, and runs the whole engine on the in-process world; it is
built with CMake (tests/cpp_builds.py, in the background while the rest of the
session runs) so that one pytest command runs every test. It is built once,
under AddressSanitizer and UndefinedBehaviorSanitizer, which run the same cases
as a plain build and more checks; the plain build runs only where the compiler
cannot build with those sanitizers. The engine's cases (the threads that share
its state) run under ThreadSanitizer too.
"""

import subprocess


def run(program, *cases):
    result = subprocess.run([program, *cases], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " 0 failed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
    return result


def test_core_algorithms(cpp_builds):
    result = run(cpp_builds.wait(cpp_builds.main))
    assert "runtime error" not in result.stderr, result.stderr[-4000:]


def test_core_engine_under_thread_sanitizer(cpp_builds):
    result = run(cpp_builds.wait("tsan"), "engine/")
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
