"""Builds a framework adapter's library against the framework that is installed.

The adapters (TensorFlow's ops, JAX's XLA FFI handler) are compiled on first
use rather than at install time: TensorFlow has no stable C++ ABI, and the
XLA FFI headers come with the installed jaxlib. Builds are cached per
framework version and per hash of everything that goes into them, so an
upgrade of either package triggers a rebuild instead of a crash. This module
knows no framework: each adapter describes itself with an `Adapter`.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

# Where the engine library is installed (CMakeLists.txt), beside this module.
ENGINE_DIR = pathlib.Path(__file__).resolve().parent
_CORE_LIBRARY = "libkeras_ring_core.so"


@dataclasses.dataclass(frozen=True)
class Adapter:
    """What it takes to build one framework's adapter library.

    Attributes:
        framework: The framework's name for messages ("TensorFlow").
        version: The installed framework's version.
        key: The cache directory's prefix ("tf", "jax").
        source_dir: Where the adapter's sources were installed.
        library_name: The file name of the built library.
        compile_flags: The framework's flags for the compiler.
        link_flags: The framework's flags for the linker.
        seconds: About how long a build takes, for the message.
        advice: What to check when compiling fails.
    """

    framework: str
    version: str
    key: str
    source_dir: pathlib.Path
    library_name: str
    compile_flags: tuple
    link_flags: tuple
    seconds: int
    advice: str


def cache_dir():
    """Returns the root directory of the library cache.

    Returns:
        `$KERAS_RING_CACHE_DIR` if set, else `~/.cache/keras-ring`.
    """
    root = os.environ.get("KERAS_RING_CACHE_DIR")
    if root:
        return pathlib.Path(root).expanduser()
    return pathlib.Path.home() / ".cache" / "keras-ring"


def _compiler(adapter):
    command = shlex.split(os.environ.get("CXX") or "c++")
    path = shutil.which(command[0]) if command else None
    if path is None:
        raise RuntimeError(
            f"keras-ring: no C++ compiler found to build its {adapter.framework} adapter. "
            "Install one (e.g. `apt-get install g++`) or point $CXX at it. "
            f"Received: CXX={os.environ.get('CXX')!r}"
        )
    return [path] + command[1:]


def _sources(adapter):
    sources = sorted(
        p for p in adapter.source_dir.glob("*") if p.suffix in (".cc", ".h")
    ) if adapter.source_dir.is_dir() else []
    if not any(p.suffix == ".cc" for p in sources):
        raise RuntimeError(
            f"keras-ring: the {adapter.framework} adapter's sources are missing from "
            f"{adapter.source_dir}; the installation is incomplete. Reinstall keras-ring "
            "with `pip install --force-reinstall keras-ring`."
        )
    return sources


def library_path(adapter):
    """Returns where the adapter's library for the installed framework is cached.

    The directory name holds the framework's version and a hash of the
    sources, the framework's compile and link flags, the compiler and this
    package's location, so a change to any of them selects a new build.

    Returns:
        A `pathlib.Path`; the file may not exist yet.
    """
    digest = hashlib.sha256()
    for source in _sources(adapter):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in [
        *adapter.compile_flags, *adapter.link_flags, *_compiler(adapter), str(ENGINE_DIR)
    ]:
        digest.update(part.encode() + b"\0")
    key = f"{adapter.key}-{adapter.version}-{digest.hexdigest()[:16]}"
    return cache_dir() / key / adapter.library_name


@contextlib.contextmanager
def _exclusive_lock(path):
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _compile(adapter, target):
    core = ENGINE_DIR / _CORE_LIBRARY
    if not core.is_file():
        raise RuntimeError(
            f"keras-ring: the engine library {core} is missing; the "
            "installation is incomplete. Reinstall keras-ring with "
            "`pip install --force-reinstall keras-ring`."
        )
    fd, temp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    command = [
        *_compiler(adapter),
        "-O2",
        "-shared",
        "-fPIC",
        *adapter.compile_flags,
        f"-I{adapter.source_dir}",
        *(str(p) for p in _sources(adapter) if p.suffix == ".cc"),
        "-o",
        temp,
        f"-L{ENGINE_DIR}",
        f"-l:{_CORE_LIBRARY}",
        f"-Wl,-rpath,{ENGINE_DIR}",
        *adapter.link_flags,
    ]
    what = f"{adapter.framework} {adapter.version}"
    print(
        f"keras-ring: building its {adapter.framework} adapter for {what} "
        f"(one time, ~{adapter.seconds} s)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
            raise RuntimeError(
                f"keras-ring: compiling its {adapter.framework} adapter for {what} failed "
                f"(exit code {result.returncode}).\n"
                f"Command: {shlex.join(command)}\n"
                f"Compiler output (last lines):\n{tail}\n"
                f"{adapter.advice} Choose a compiler with $CXX, then run "
                f"`keras-ring-build` to retry. If {adapter.framework} was just upgraded, "
                "make sure keras-ring supports that version."
            )
        # mkstemp made the file private; a library is normally world-readable.
        os.chmod(temp, 0o755)
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def build(adapter):
    """Builds the adapter's library for the installed framework unless cached.

    Processes that start together (the ranks of a job) build it once: the
    first takes a file lock and builds, the others wait and reuse the result.

    Returns:
        The `pathlib.Path` of the built library.

    Raises:
        RuntimeError: If no compiler is found, the installation is
            incomplete, or compilation fails (with the compiler's output).
    """
    target = library_path(adapter)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / "build.lock"):
        # Another process may have built it while this one waited.
        if not target.is_file():
            _compile(adapter, target)
    return target


def stale_library_error(adapter, path, error):
    """The error for a cached library that does not load into the framework."""
    return RuntimeError(
        f"keras-ring: the library {path} does not load into {adapter.framework} "
        f"{adapter.version}: {error}\n"
        "Undefined symbols mean the cached build is stale or was built for a "
        f"{adapter.framework} with a different ABI. Delete {path.parent} (or all of "
        f"{cache_dir()}) and run `keras-ring-build` to rebuild."
    )
