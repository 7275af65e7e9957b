"""Builds and loads the TensorFlow op library against the imported TensorFlow.

TensorFlow has no stable C++ ABI: a library built for one TensorFlow fails
with undefined symbols under another, so the ops are built on first use
(`keras_ring.core._op_build`) with TensorFlow's own compile and link flags.
"""

import pathlib
import threading

import tensorflow as tf

from keras_ring.core import _op_build

_loaded = None
_load_lock = threading.Lock()


def adapter():
    """Describes the TensorFlow op library for `keras_ring.core._op_build`."""
    return _op_build.Adapter(
        framework="TensorFlow",
        version=tf.__version__,
        key="tf",
        source_dir=pathlib.Path(__file__).resolve().parent / "_src",
        library_name="libkeras_ring_tf_ops.so",
        # TF's headers trigger hundreds of deprecation warnings; they would bury real errors.
        compile_flags=("-Wno-deprecated-declarations", *tf.sysconfig.get_compile_flags()),
        link_flags=tuple(tf.sysconfig.get_link_flags()),
        seconds=15,
        advice="TensorFlow needs a C++17 compiler compatible with the one it was built with "
        "(g++ 9 or newer works).",
    )


def library_path():
    """Returns where the op library for the imported TensorFlow is cached."""
    return _op_build.library_path(adapter())


def build():
    """Builds the op library for the imported TensorFlow unless cached; returns its path."""
    return _op_build.build(adapter())


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
                raise _op_build.stale_library_error(adapter(), path, e.message) from e
    return _loaded
