"""`kr.evaluate`: a model's loss and metrics over the union of every rank's shard."""

import zlib

import keras
import numpy as np

from keras_ring.core import _basics, _host_collectives
from keras_ring.core._reduce_ops import Max, Sum


def evaluate(model, *args, return_dict=False, **kwargs):
    """`model.evaluate` over every rank's shard together: the results of all ranks' data.

    Each rank evaluates its own shard with `model.evaluate(*args, **kwargs)`;
    then the state of every compiled metric (the loss tracker's total and
    count, `Precision`'s true and false positives, `AUC`'s confusion counts,
    ...) is summed over the ranks and the results are computed from the sums.
    So every rank gets the loss and metrics of the whole test set, exactly,
    whatever the number of samples per rank: ratios of sums (`Precision`,
    `AUC`) and functions of a mean (`RootMeanSquaredError`) included, where
    averaging per-rank results would be off. A metric of your own must keep
    additive state (sums, counts) for its result to be right.

    Collective: every rank calls it (with its own data; the ranks may have
    different numbers of batches). With one rank it is `model.evaluate`.

    Args:
        model: A compiled Keras model.
        *args: Passed to `model.evaluate` (`x`, `y`, `batch_size`, ...).
        return_dict: As for `model.evaluate`: a dict of results, or a list
            (a scalar for a single result).
        **kwargs: Passed to `model.evaluate` (`verbose`, `steps`,
            `callbacks`, ...).

    Returns:
        The results, as `model.evaluate` returns them, of all ranks' data.

    Raises:
        ValueError: On every rank, if the ranks' models have different metric
            states (different metrics compiled).

    Example:

    ```python
    kr.init()
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test))
    results = kr.evaluate(model, test.apply(kr.shard_dataset).batch(64), return_dict=True,
                          verbose=kr.rank_zero_verbose(1))
    # Without tf.data (any Keras backend): this rank's rows of NumPy arrays.
    results = kr.evaluate(model, kr.shard_arrays(x_test), kr.shard_arrays(y_test),
                          return_dict=True)
    ```
    """
    local = model.evaluate(*args, return_dict=True, **kwargs)
    if _basics.size() == 1:
        results = local
    else:
        results = sum_metric_states(model)
    if return_dict:
        return results
    values = list(results.values())
    return values[0] if len(values) == 1 else values


def sum_metric_states(model, name="keras_ring.metric_states"):
    """Sums the state of `model`'s metrics over the ranks, in place; returns their results.

    Collective. Every rank's model must have the same metrics.

    Returns:
        `model.get_metrics_result()` after the sums, as Python floats.

    Raises:
        ValueError: On every rank, if the ranks' metric states differ in
            number, shapes or dtypes.
    """
    variables = [v for metric in model.metrics for v in metric.variables]
    described = "\n".join(f"{tuple(v.shape)} {v.dtype}" for v in variables)
    digest = zlib.crc32(described.encode())
    # Max of (d, -d) is the largest and the smallest digest: equal when every rank's is.
    high, low = _host_collectives.allreduce(np.array([digest, -digest], np.int64), Max,
                                            f"{name}.described")
    if high != -low:
        raise ValueError(
            "keras-ring: the ranks' models have different metrics, so their states cannot be "
            "summed. Compile the same metrics on every rank."
        )
    values = [np.ravel(keras.ops.convert_to_numpy(v)).astype(np.float64) for v in variables]
    sums = _host_collectives.allreduce(np.concatenate([np.zeros(0), *values]), Sum, name)
    offsets = np.cumsum([0] + [v.size for v in values])
    for variable, start, end in zip(variables, offsets[:-1], offsets[1:]):
        total = sums[start:end].reshape(variable.shape)
        variable.assign(total.astype(keras.backend.standardize_dtype(variable.dtype)))
    return {k: float(keras.ops.convert_to_numpy(v)) for k, v in model.get_metrics_result().items()}
