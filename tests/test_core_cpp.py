"""Builds and runs the engine's C++ tests (threads as ranks, no MPI).

The C++ suite checks the reduction kernels and the ring algorithms against
serial references, and runs the whole engine on the in-process world; it is
built here with CMake so that one pytest command runs every test. It is
built once, under AddressSanitizer and UndefinedBehaviorSanitizer, which run
the same cases as a plain build and more checks; the plain build runs only
where the compiler cannot build with those sanitizers. The engine's cases
(the threads that share its state) run under ThreadSanitizer too.
"""

import os
import shutil
import subprocess
import tempfile

import pytest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "custom_ops", "tests")


def build_and_run(build_dir, *cmake_args, cases=()):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is needed to build the C++ tests (pip install cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", SOURCE, "-B", str(build_dir), *generator, *cmake_args],
                   check=True, capture_output=True, text=True)
    subprocess.run([cmake, "--build", str(build_dir), "-j", "2"], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([os.path.join(build_dir, "kr_core_tests"), *cases],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " 0 failed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
    return result


def can_link(*flags):
    """Whether the C++ compiler CMake would pick builds and links a program with `flags`."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory() as scratch:
        source = os.path.join(scratch, "probe.cc")
        with open(source, "w") as f:
            f.write("int main() { return 0; }\n")
        built = subprocess.run([compiler, *flags, source, "-o", os.path.join(scratch, "probe")],
                               capture_output=True)
    return built.returncode == 0


def test_core_algorithms(tmp_path):
    if not can_link("-fsanitize=address,undefined"):
        build_and_run(tmp_path / "release")
        return
    result = build_and_run(tmp_path / "asan", "-DKR_SANITIZE=ON")
    assert "runtime error" not in result.stderr, result.stderr[-4000:]


def test_core_engine_under_thread_sanitizer(tmp_path):
    result = build_and_run(tmp_path / "tsan", "-DKR_SANITIZE=thread", cases=["engine/"])
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
