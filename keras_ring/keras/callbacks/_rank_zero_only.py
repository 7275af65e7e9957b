"""rank_zero_only: keep a callback on rank 0, drop it elsewhere."""

import keras

from keras_ring.core import _basics
from keras_ring.keras.callbacks import _sync


def rank_zero_only(callback):
    """Returns `callback` on rank 0 and a callback that does nothing on the other ranks.

    For callbacks whose effects should happen once per job rather than once
    per rank: `keras.callbacks.ModelCheckpoint`, `CSVLogger`, `TensorBoard`, or your
    own that write files or print. Not for callbacks that change training,
    such as `BackupAndRestore`: every rank must resume alike. On the other
    ranks the returned `keras.callbacks.Callback()` has no effect, so the
    callback's `set_model` and hooks (where Keras's callbacks create their
    files and directories) never run there. Creating a Keras callback writes
    nothing, so it is safe to create it on every rank.

    Callbacks that read metrics see rank 0's values unless a
    `MetricAverageCallback` comes before them in the list.

    Args:
        callback: A `keras.callbacks.Callback`.

    Returns:
        `callback` on rank 0; elsewhere a new `keras.callbacks.Callback()`.

    Raises:
        TypeError: If `callback` is not a `keras.callbacks.Callback`.
        ValueError: If `callback` is a keras-ring callback that communicates
            (it must run on every rank), or keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    callbacks = [
        kr.callbacks.BroadcastGlobalVariablesCallback(0),
        kr.callbacks.MetricAverageCallback(),
        kr.callbacks.rank_zero_only(keras.callbacks.CSVLogger("training.csv")),
        kr.callbacks.rank_zero_only(keras.callbacks.TensorBoard("logs")),
    ]
    ```
    """
    if not isinstance(callback, keras.callbacks.Callback):
        raise TypeError(
            f"`callback` must be a keras.callbacks.Callback. Received: callback={callback!r}"
        )
    if isinstance(callback, _sync.SyncedCallback):
        raise ValueError(
            f"{type(callback).__name__} communicates with the other ranks, so every rank must "
            f"run it; pass it without rank_zero_only(). Received: callback={callback!r}"
        )
    return callback if _basics.rank() == 0 else keras.callbacks.Callback()
