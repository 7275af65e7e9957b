"""Builds and loads the TensorFlow op library against the imported TensorFlow.

The TF adapter is compiled on first use rather than at install time, because
TensorFlow has no stable C++ ABI: a library built for one TensorFlow fails
with undefined symbols under another. Builds are cached per TensorFlow
version and per hash of everything that goes into them, so an upgrade of
either package triggers a rebuild instead of a crash.
"""

import contextlib
import fcntl
import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

import tensorflow as tf

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_SOURCE_DIR = _PACKAGE_DIR / "_tf_src"
_CORE_LIBRARY = "libkeras_ring_core.so"
_LIBRARY_NAME = "libkeras_ring_tf_ops.so"
_TYPICAL_BUILD_SECONDS = 15

_loaded = None
_load_lock = threading.Lock()


def cache_dir():
    """Returns the root directory of the op library cache.

    Returns:
        `$KERAS_RING_CACHE_DIR` if set, else `~/.cache/keras-ring`.
    """
    root = os.environ.get("KERAS_RING_CACHE_DIR")
    if root:
        return pathlib.Path(root).expanduser()
    return pathlib.Path.home() / ".cache" / "keras-ring"


def _compiler():
    command = shlex.split(os.environ.get("CXX") or "c++")
    path = shutil.which(command[0]) if command else None
    if path is None:
        raise RuntimeError(
            "keras-ring: no C++ compiler found to build its TensorFlow ops. "
            "Install one (e.g. `apt-get install g++`) or point $CXX at it. "
            f"Received: CXX={os.environ.get('CXX')!r}"
        )
    return [path] + command[1:]


def _sources():
    if not (_SOURCE_DIR / "kernels.cc").is_file():
        raise RuntimeError(
            f"keras-ring: the TensorFlow op sources are missing from "
            f"{_SOURCE_DIR}; the installation is incomplete. Reinstall "
            "keras-ring with `pip install --force-reinstall keras-ring`."
        )
    return sorted(p for p in _SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h"))


def library_path():
    """Returns where the op library for the imported TensorFlow is cached.

    The directory name holds the TensorFlow version and a hash of the
    sources, TensorFlow's compile and link flags, the compiler and this
    package's location, so a change to any of them selects a new build.

    Returns:
        A `pathlib.Path`; the file may not exist yet.
    """
    digest = hashlib.sha256()
    for source in _sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in [
        *tf.sysconfig.get_compile_flags(),
        *tf.sysconfig.get_link_flags(),
        *_compiler(),
        str(_PACKAGE_DIR),
    ]:
        digest.update(part.encode() + b"\0")
    key = f"tf-{tf.__version__}-{digest.hexdigest()[:16]}"
    return cache_dir() / key / _LIBRARY_NAME


@contextlib.contextmanager
def _exclusive_lock(path):
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _compile(target):
    core = _PACKAGE_DIR / _CORE_LIBRARY
    if not core.is_file():
        raise RuntimeError(
            f"keras-ring: the engine library {core} is missing; the "
            "installation is incomplete. Reinstall keras-ring with "
            "`pip install --force-reinstall keras-ring`."
        )
    compiler = _compiler()
    fd, temp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    command = [
        *compiler,
        "-O2",
        "-shared",
        "-fPIC",
        # TF's headers trigger hundreds of these; they would bury real errors.
        "-Wno-deprecated-declarations",
        *tf.sysconfig.get_compile_flags(),
        f"-I{_SOURCE_DIR}",
        *(str(p) for p in _sources() if p.suffix == ".cc"),
        "-o",
        temp,
        f"-L{_PACKAGE_DIR}",
        f"-l:{_CORE_LIBRARY}",
        f"-Wl,-rpath,{_PACKAGE_DIR}",
        *tf.sysconfig.get_link_flags(),
    ]
    print(
        f"keras-ring: building the TensorFlow ops for TensorFlow "
        f"{tf.__version__} (one time, ~{_TYPICAL_BUILD_SECONDS} s)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
            raise RuntimeError(
                f"keras-ring: compiling its TensorFlow ops for TensorFlow "
                f"{tf.__version__} failed (exit code {result.returncode}).\n"
                f"Command: {shlex.join(command)}\n"
                f"Compiler output (last lines):\n{tail}\n"
                "TensorFlow needs a C++17 compiler compatible with the one "
                "it was built with (g++ 9 or newer works); choose one with "
                "$CXX, then run `keras-ring-build` to retry. If TensorFlow "
                "was just upgraded, make sure keras-ring supports that version."
            )
        # mkstemp made the file private; a library is normally world-readable.
        os.chmod(temp, 0o755)
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def build():
    """Builds the op library for the imported TensorFlow unless cached.

    Processes that start together (the ranks of a job) build it once: the
    first takes a file lock and builds, the others wait and reuse the result.

    Returns:
        The `pathlib.Path` of the built library.

    Raises:
        RuntimeError: If no compiler is found, the installation is
            incomplete, or compilation fails (with the compiler's output).
    """
    target = library_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / "build.lock"):
        # Another process may have built it while this one waited.
        if not target.is_file():
            _compile(target)
    return target


def load():
    """Loads the op library, building it first if needed.

    Returns:
        The module returned by `tf.load_op_library`, the same one on every
        call within a process.

    Raises:
        RuntimeError: If the library cannot be built, or is built but does
            not load into this TensorFlow.
    """
    global _loaded
    with _load_lock:
        if _loaded is None:
            path = build()
            try:
                _loaded = tf.load_op_library(str(path))
            except tf.errors.NotFoundError as e:
                raise RuntimeError(
                    f"keras-ring: the op library {path} does not load into "
                    f"TensorFlow {tf.__version__}: {e.message}\n"
                    "Undefined symbols mean the cached build is stale or was "
                    "built for a TensorFlow with a different ABI. Delete "
                    f"{path.parent} (or all of {cache_dir()}) and run "
                    "`keras-ring-build` to rebuild."
                ) from e
    return _loaded


def main():
    """Entry point of `keras-ring-build`: builds and loads the op library."""
    load()
    print(f"keras-ring: TensorFlow {tf.__version__} ops at {library_path()}")
