"""Data helpers: each rank's shard of a dataset, its results gathered back, output on rank 0."""

import keras
import numpy as np
import tensorflow as tf

from keras_ring import _basics, _ops


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


def unshard(results, name="keras_ring.unshard"):
    """Gathers every rank's results for its `shard_dataset` shard, in the dataset's order.

    After `shard_dataset`, rank `r` holds elements `r`, `r + size()`, ... of
    the dataset, so gathering the ranks' results one rank after the other
    (`allgather`) would put them in another order than the dataset's. This
    puts every row back where its element was: row `i` of the result belongs
    to element `i` of the dataset before sharding. Collective: every rank
    calls it, and every rank gets the whole result.

    Args:
        results: This rank's rows, one per element of its shard, in the
            shard's order: an array or tensor (for example what
            `model.predict` returns for the shard, unshuffled), or a nested
            structure of them (a multi-output model's list or dict).
        name: The prefix of the collectives' names.

    Returns:
        NumPy arrays of every rank's rows in the dataset's order, in the
        structure of `results`.

    Raises:
        ValueError: On every rank, if the ranks' row counts are not those of
            `shard_dataset`'s shards (rank `r` of `n` elements holds
            `len(range(r, n, size()))`): each rank's count is named.

    Example:

    ```python
    kr.init()
    test = tf.data.Dataset.from_tensor_slices(x_test)  # 10 rows; 3 ranks: 4, 3 and 3
    predictions = model.predict(test.apply(kr.shard_dataset).batch(32))
    predictions = kr.unshard(predictions)  # all 10 rows, as model.predict(x_test) orders them
    ```
    """
    _basics._require_initialized("unshard()")
    flat = [np.asarray(keras.ops.convert_to_numpy(r)) for r in tf.nest.flatten(results)]
    rows = {a.shape[0] if a.ndim else -1 for a in flat}
    if len(rows) != 1 or -1 in rows:
        raise ValueError(
            "unshard() takes one row per element of this rank's shard: arrays with the same "
            f"first dimension. Received shapes: {[a.shape for a in flat]}"
        )
    size = _basics.size()
    counts = _ops.allgather(np.array([rows.pop()], np.int64), name=f"{name}.counts").numpy()
    total = int(counts.sum())
    if counts.tolist() != [len(range(r, total, size)) for r in range(size)]:
        raise ValueError(
            "unshard() puts back rows of shard_dataset's shards, where rank r of n elements "
            f"holds len(range(r, n, size())) rows; the ranks hold "
            f"{', '.join(f'rank {r}: {c}' for r, c in enumerate(counts.tolist()))} of {total}. "
            "Pass every row of this rank's shard, unshuffled and not repeated."
        )
    # Rank r's row j is element r + j * size of the dataset.
    order = np.concatenate([np.arange(r, total, size) for r in range(size)])
    gathered = []
    for i, array in enumerate(flat):
        together = _ops.allgather(array, name=f"{name}.{i}").numpy()
        back = np.empty_like(together)
        back[order] = together
        gathered.append(back)
    return tf.nest.pack_sequence_as(results, gathered)


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
