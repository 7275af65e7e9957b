"""Files of checkpoints and backups, local or remote, under every Keras backend.

Local paths use the standard library; a path with a scheme (`gs://...`) goes
through `tf.io.gfile` and needs TensorFlow, as in Keras's own callbacks.
"""

import os
import shutil


def _remote(path):
    if "://" not in str(path):
        return None
    try:
        import tensorflow as tf
    except ImportError:
        raise ValueError(
            f"keras-ring: {path} is a remote path, which needs TensorFlow's file systems; "
            "install TensorFlow or use a local path"
        ) from None
    return tf.io.gfile


def exists(path):
    gfile = _remote(path)
    return gfile.exists(path) if gfile else os.path.exists(path)


def read_text(path):
    gfile = _remote(path)
    if gfile:
        with gfile.GFile(path, "r") as f:
            return f.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_text(path, text):
    gfile = _remote(path)
    if gfile:
        with gfile.GFile(path, "w") as f:
            f.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def copy(source, target):
    """Copies `source` over `target`."""
    gfile = _remote(source) or _remote(target)
    if gfile:
        gfile.copy(source, target, overwrite=True)
    else:
        shutil.copyfile(source, target)


def remove(path):
    gfile = _remote(path)
    if gfile:
        gfile.remove(path)
    else:
        os.remove(path)


def rmtree(path):
    gfile = _remote(path)
    if gfile:
        gfile.rmtree(path)
    else:
        shutil.rmtree(path)


def makedirs(path):
    gfile = _remote(path)
    if gfile:
        gfile.makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)
