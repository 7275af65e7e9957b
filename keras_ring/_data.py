"""Data helpers: each rank's shard of a dataset, and output on rank 0 only."""

import tensorflow as tf

from keras_ring import _basics


def shard_dataset(dataset, drop_remainder=False):
    """Returns this rank's shard of a `tf.data.Dataset`: every `size()`-th element.

    Rank `r` keeps elements `r`, `r + size()`, `r + 2 * size()`, ...
    (`dataset.shard(size(), rank())`). Shard before shuffling, batching and
    augmenting, so that each rank reads only its own elements; shard a dataset
    of file names before reading the files, so that each rank opens only its
    own.

    Every rank must run the same number of steps per epoch. With `n` elements
    and `size()` ranks, the first `n % size()` ranks get one element more, which
    after batching can mean one batch more; `drop_remainder=True` first drops
    the last `n % size()` elements, so that every rank gets `n // size()`.

    Args:
        dataset: A `tf.data.Dataset`.
        drop_remainder: Whether to give every rank the same number of elements
            by dropping the last `n % size()`. Needs a dataset whose length
            TensorFlow knows (or an infinite one, which needs nothing dropped).

    Returns:
        This rank's `tf.data.Dataset`.

    Raises:
        TypeError: If `dataset` is not a `tf.data.Dataset`.
        ValueError: If `drop_remainder=True` and the dataset's length is
            unknown, or keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    dataset = tf.data.Dataset.range(10)
    dataset = kr.shard_dataset(dataset, drop_remainder=True)  # 3 ranks: 3 elements each
    dataset = dataset.shuffle(10).batch(2, drop_remainder=True)
    # Or within a pipeline:
    dataset = tf.data.Dataset.range(10).apply(kr.shard_dataset).batch(2)
    ```
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset. Received: dataset={dataset!r}")
    size, rank = _basics.size(), _basics.rank()
    if drop_remainder:
        count = int(dataset.cardinality())
        if count == tf.data.UNKNOWN_CARDINALITY:
            raise ValueError(
                "shard_dataset(drop_remainder=True) needs the length of the dataset, and "
                "TensorFlow cannot tell it (after filter(), for example). Declare it with "
                "dataset.apply(tf.data.experimental.assert_cardinality(n)), or shard without "
                "drop_remainder and pass steps_per_epoch to fit(). "
                f"Received: dataset={dataset!r}"
            )
        if count != tf.data.INFINITE_CARDINALITY:
            dataset = dataset.take(count - count % size)
    return dataset.shard(size, rank)


def rank_zero_verbose(verbose=1):
    """Returns `verbose` on rank 0 and 0 on the other ranks.

    For the `verbose` argument of `fit`, `evaluate` and `predict`, so that
    only rank 0 prints a progress bar (one line per epoch with
    `verbose=2`), instead of one per rank.

    Args:
        verbose: The verbosity for rank 0: `"auto"`, 0, 1 or 2.

    Returns:
        `verbose` on rank 0, 0 elsewhere.

    Raises:
        ValueError: If keras-ring is not initialised.

    Example:

    ```python
    kr.init()
    model.fit(x, y, epochs=5, verbose=kr.rank_zero_verbose(1))
    ```
    """
    return verbose if _basics.rank() == 0 else 0
