"""The arguments that every framework's collectives take, checked the same way.

Backend-free: the TensorFlow ops and `keras_ring.jax` both read `op`,
`average`, `compression` and the scale factors through `reduce_args`.
"""

import numbers
import warnings

from keras_ring.core import _compression
from keras_ring.core._reduce_ops import NAMES as _REDUCE_OP_NAMES
from keras_ring.core._reduce_ops import Average, Sum, refuse_adasum


def _reduce_op(op, average):
    if average is not None:
        if op is not None:
            raise ValueError(
                "Pass either `op` or the deprecated `average`, not both. "
                f"Received: op={op!r}, average={average!r}"
            )
        warnings.warn(
            "The `average` argument is deprecated; pass op=keras_ring.Average "
            "or op=keras_ring.Sum instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        return Average if average else Sum
    if op is None:
        return Average
    refuse_adasum(op)
    if isinstance(op, bool) or not isinstance(op, numbers.Integral) or op not in _REDUCE_OP_NAMES:
        raise ValueError(
            f"`op` must be one of keras_ring.Average, Sum, Min, Max or Product. Received: op={op!r}"
        )
    return int(op)


def _scale_factor(arg, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{arg}` must be a number. Received: {arg}={value!r}") from None


def _compressor(compression):
    if compression is None:
        return _compression.Compression.none
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError(
            "`compression` must be a keras_ring.Compression member (none, fp16, bf16) or a "
            f"Compressor. Received: compression={compression!r}"
        )
    return compression


def reduce_args(op, average, compression, prescale_factor, postscale_factor):
    """Returns `(op, compressor, prescale_factor, postscale_factor)`, checked.

    Raises:
        ValueError: For an unknown op, both `op` and `average`, a compression
            that is not a `Compressor`, or a scale factor that is no number.
    """
    return (
        _reduce_op(op, average),
        _compressor(compression),
        _scale_factor("prescale_factor", prescale_factor),
        _scale_factor("postscale_factor", postscale_factor),
    )
