"""Builds the XLA FFI handler against the installed jaxlib and registers it with JAX.

The handler's headers (`xla/ffi/api`) ship with jaxlib, and the FFI's C
structures are versioned by it, so the library is built on first use
(`keras_ring.core._op_build`), like the TensorFlow ops, once per jaxlib version.
"""

import ctypes
import pathlib
import threading

import jax
import jaxlib

from keras_ring.core import _op_build

# The name under which the handler is registered with XLA.
TARGET = "keras_ring_collective"

_registered = None  # the loaded library's path
_lock = threading.Lock()


def adapter():
    """Describes the JAX adapter's library for `keras_ring.core._op_build`."""
    return _op_build.Adapter(
        framework="JAX",
        version=jaxlib.__version__,
        key="jax",
        source_dir=pathlib.Path(__file__).resolve().parent / "_src",
        library_name="libkeras_ring_jax.so",
        # -isystem: the FFI headers' own warnings are jaxlib's, not ours.
        compile_flags=("-std=c++17", "-isystem", jax.ffi.include_dir()),
        link_flags=(),
        seconds=5,
        advice="The XLA FFI headers need a C++17 compiler (g++ 9 or newer works).",
    )


def library_path():
    """Returns where the handler's library for the installed jaxlib is cached."""
    return _op_build.library_path(adapter())


def load():
    """Builds the library if needed and registers its handler with JAX (once).

    Returns:
        The library's path.

    Raises:
        RuntimeError: If the library cannot be built or does not load.
    """
    global _registered
    if _registered:  # every collective asks: no lock, no hashing of the sources
        return _registered
    with _lock:
        if not _registered:
            path = _op_build.build(adapter())
            try:
                library = ctypes.CDLL(str(path))
                handler = library.KerasRingJaxCollective
            except (OSError, AttributeError) as e:
                raise _op_build.stale_library_error(adapter(), path, e) from e
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
            _registered = path
    return _registered
