"""The builds of the engine's C++ suite (custom_ops/tests), made in the background.

Compiling the suite under the sanitizers takes about two minutes of both cores here. The builds
start when the session's tests have been collected and run at idle priority (SCHED_IDLE: only on
cores no test wants; most of the suite waits on its jobs' ranks), one after the other; the C++
tests, which the session runs last, wait for them and run the programs at normal priority.

`CppBuilds(root).start()` builds under AddressSanitizer with UBSan, which run the same cases as
a plain build with more checks (the plain build only where the compiler cannot link those), then
under ThreadSanitizer; `wait(name)` returns the path of a build's program, or fails the test with
the output of the step that failed.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading

import pytest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "custom_ops", "tests")
PROGRAM = "kr_core_tests"


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


def _idle_priority():
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


class CppBuilds:
    def __init__(self, root):
        self.root = root
        sanitized = can_link("-fsanitize=address,undefined")
        self.builds = {"asan" if sanitized else "release": ["-DKR_SANITIZE=ON"] if sanitized
                       else [], "tsan": ["-DKR_SANITIZE=thread"]}
        self.main = next(iter(self.builds))
        self._done = {name: threading.Event() for name in self.builds}
        self._errors = {}
        self._process = None
        self._stopping = False
        self._thread = threading.Thread(target=self._build_all, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _build_all(self):
        cmake = shutil.which("cmake")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        for name, args in self.builds.items():
            build_dir = os.path.join(self.root, name)
            if cmake is None:
                self._errors[name] = "cmake is needed to build the C++ tests (pip install cmake)"
            steps = [[cmake, "-S", SOURCE, "-B", build_dir, *generator, *args],
                     [cmake, "--build", build_dir, "-j", "2"]] if cmake else []
            for step in steps:
                if self._stopping:
                    break
                self._process = subprocess.Popen(
                    step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    preexec_fn=_idle_priority, start_new_session=True)
                output, _ = self._process.communicate()
                if self._process.returncode != 0:
                    self._errors[name] = f"`{' '.join(step)}` failed:\n{output[-6000:]}"
                    break
            self._done[name].set()

    def wait(self, name, timeout=1200):
        """The path of build `name`'s program, once built; fails the test if it was not."""
        if not self._done[name].wait(timeout):
            pytest.fail(f"the C++ {name} build took longer than {timeout} s")
        if name in self._errors:
            pytest.fail(self._errors[name])
        return os.path.join(self.root, name, PROGRAM)

    def stop(self):
        self._stopping = True
        process = self._process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        self._thread.join()
        shutil.rmtree(self.root, ignore_errors=True)
