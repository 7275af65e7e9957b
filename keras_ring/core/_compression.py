"""Gradient compression for the reductions, with Horovod's `Compressor` interface.

Backend-free: the engine itself converts float32 and float64 tensors for
`fp16` and `bf16` as it copies them (every framework's adapter passes it the
compressor's `wire_dtype`); the methods below run where the engine cannot
(tensors of other dtypes), or where a script calls them itself, as Horovod's
allow. They cast in the tensor's own framework, which is never imported here.
"""

import sys

import numpy as np


def _framework(tensor):
    """'torch' or 'tensorflow' if `tensor` is one of theirs (imported already), else None."""
    for name, kinds in (("torch", ("Tensor",)), ("tensorflow", ("Tensor", "Variable"))):
        module = sys.modules.get(name)
        if module is not None and isinstance(tensor, tuple(getattr(module, k) for k in kinds)):
            return module
    return None


def _is_floating(dtype):
    for attribute in ("is_floating_point", "is_floating"):  # torch's, TensorFlow's
        if hasattr(dtype, attribute):
            return bool(getattr(dtype, attribute))
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _cast(tensor, dtype):
    """`tensor` as `dtype` (a name, or its framework's dtype), in its own framework."""
    framework = _framework(tensor)
    if framework is None:
        return tensor.astype(dtype)  # NumPy and JAX arrays
    if framework.__name__ == "torch":
        return tensor.to(getattr(framework, dtype) if isinstance(dtype, str) else dtype)
    return framework.cast(tensor, dtype)


class Compressor:
    """Converts a tensor before a collective and back after it.

    A compressor is used as a class, through its two static methods; both
    run in the graph of the training step.
    """

    @staticmethod
    def compress(tensor):
        """Returns the tensor to send and a context that `decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the received tensor converted back using `ctx`."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    """Sends floating-point tensors as `wire_dtype`; other tensors as they are."""

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if _is_floating(tensor.dtype):
            return _cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if _is_floating(ctx):
            return _cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 (11 significant bits, range ±65504)."""

    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (8 significant bits, float32's range)."""

    wire_dtype = "bfloat16"


# The built-in compressors whose casts the engine does itself for float32 and
# float64 tensors, by their kr_compression code (c_api.h).
ENGINE_CODES = {FP16Compressor: 1, BF16Compressor: 2}


class Compression:
    """The compressors that gradient reductions accept, as in Horovod.

    Compression halves the bytes sent for float32 gradients at the cost of
    precision: `fp16` keeps about 3 significant decimal digits but overflows
    above 65504 (a `gradient_predivide_factor` helps keep sums in range);
    `bf16` keeps about 2 digits and float32's range. Integer tensors are
    never converted.

    Attributes:
        none: No compression.
        fp16: Floating-point tensors travel as float16.
        bf16: Floating-point tensors travel as bfloat16 (Horovod has no such
            option).

    Example:

    ```python
    optimizer = kr.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression=kr.Compression.fp16)
    total = kr.allreduce(tensor, op=kr.Sum, compression=kr.Compression.bf16)
    ```
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
