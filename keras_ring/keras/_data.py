"""Data helpers: each rank's shard of a dataset, its results gathered back, output on rank 0.

Every shard holds the elements `rank, rank + size(), ...` (Horovod's
`dataset.shard(size, rank)`), whatever the data's kind: a `tf.data.Dataset`
(`shard_dataset`, which needs TensorFlow), NumPy arrays (`shard_arrays`) or
a `keras.utils.PyDataset` (`shard_py_dataset`, by batch). `unshard` puts
every rank's results back in the data's order.
"""

import keras
import numpy as np

from keras_ring.core import _basics, _host_collectives


def _shard_range(count, drop_remainder):
    """This rank's indices of `count` elements."""
    size, rank = _basics.size(), _basics.rank()
    end = count - count % size if drop_remainder else count
    return range(rank, end, size)


def shard_arrays(*arrays, drop_remainder=False):
    """Returns this rank's rows of NumPy arrays: rows `rank, rank + size(), ...`.

    The rows `shard_dataset` would give this rank of a dataset of the same
    rows, so `unshard` puts results of them back in order. Works under every
    Keras backend; pass the shards to `model.fit` as usual.

    Args:
        *arrays: Arrays (or anything `np.asarray` takes) with the same first
            dimension, such as `x` and `y`.
        drop_remainder: If `True`, the last `rows % size()` rows are left
            out, so that every rank gets the same number.

    Returns:
        This rank's rows of the array, or a tuple of them for several.

    Raises:
        ValueError: If the arrays' first dimensions differ.

    Example:

    ```python
    kr.init()
    x_train, y_train = kr.shard_arrays(x_train, y_train)
    model.fit(x_train, y_train, batch_size=32)
    ```
    """
    _basics._require_initialized("shard_arrays()")
    arrays = [np.asarray(a) for a in arrays]
    rows = {a.shape[0] if a.ndim else None for a in arrays}
    if len(rows) != 1 or None in rows:
        raise ValueError(
            "shard_arrays() takes arrays of the same first dimension (one row per sample). "
            f"Received shapes: {[a.shape for a in arrays]}"
        )
    index = _shard_range(rows.pop(), drop_remainder)
    shards = tuple(a[index.start:index.stop:index.step] for a in arrays)
    return shards[0] if len(shards) == 1 else shards


class _ShardedPyDataset(keras.utils.PyDataset):
    """Batches `rank, rank + size(), ...` of a `keras.utils.PyDataset`."""

    def __init__(self, dataset, drop_remainder):
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset = dataset
        self._batches = _shard_range(len(dataset), drop_remainder)

    def __len__(self):
        return len(self._batches)

    def __getitem__(self, index):
        return self.dataset[self._batches[index]]

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


def shard_py_dataset(dataset, drop_remainder=False):
    """Returns this rank's batches of a `keras.utils.PyDataset`: `rank, rank + size(), ...`.

    Under every Keras backend. Each rank then runs `len(dataset) // size()`
    or one more steps per epoch (the same number with `drop_remainder`).

    Args:
        dataset: A `keras.utils.PyDataset` of finite length (`__len__`).
        drop_remainder: If `True`, the last `len(dataset) % size()` batches
            are left out, so that every rank runs the same number of steps.

    Returns:
        A `keras.utils.PyDataset` of this rank's batches, with the
        original's workers and epoch hooks.

    Raises:
        TypeError: If `dataset` is not a `keras.utils.PyDataset`.

    Example:

    ```python
    kr.init()
    model.fit(kr.shard_py_dataset(MyBatches(x, y, batch_size=32)), epochs=5)
    ```
    """
    _basics._require_initialized("shard_py_dataset()")
    if not isinstance(dataset, keras.utils.PyDataset):
        raise TypeError(
            f"`dataset` must be a keras.utils.PyDataset. Received: dataset={dataset!r}"
        )
    return _ShardedPyDataset(dataset, drop_remainder)


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
    try:
        import tensorflow as tf
    except ImportError:
        raise ImportError(
            "keras_ring.shard_dataset shards a tf.data.Dataset and needs TensorFlow, which is "
            "not installed. Without TensorFlow, shard NumPy arrays with kr.shard_arrays(x, y) "
            "or a keras.utils.PyDataset with kr.shard_py_dataset(dataset)."
        ) from None
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
    flat = [np.asarray(keras.ops.convert_to_numpy(r)) for r in keras.tree.flatten(results)]
    rows = {a.shape[0] if a.ndim else -1 for a in flat}
    if len(rows) != 1 or -1 in rows:
        raise ValueError(
            "unshard() takes one row per element of this rank's shard: arrays with the same "
            f"first dimension. Received shapes: {[a.shape for a in flat]}"
        )
    size = _basics.size()
    counts = _host_collectives.allgather(np.array([rows.pop()], np.int64), f"{name}.counts")
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
        together = _host_collectives.allgather(array, f"{name}.{i}")
        back = np.empty_like(together)
        back[order] = together
        gathered.append(back)
    return keras.tree.pack_sequence_as(results, gathered)


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
