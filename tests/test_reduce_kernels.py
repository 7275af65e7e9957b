"""The reduction kernels of every level this CPU has, through the binding, against NumPy.

The C++ tests (custom_ops/tests/reduce_test.cc) check every level against the
generic one bit for bit; these check the generic and wider ones against an
independent reference, and the KERAS_RING_CPU_KERNELS setting.
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import keras_ring as kr
from keras_ring.core import _engine

LEVELS = ["generic", "avx2", "avx512"]
DTYPES = [
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
]
OPS = {kr.Sum: np.add, kr.Min: np.minimum, kr.Max: np.maximum, kr.Product: np.multiply}
COUNTS = [0, 1, 7, 17, 64, 1000, 4097]


def level_or_skip(level):
    if not _engine._cpu_supports_kernels(level):
        pytest.skip(f"this CPU cannot run the {level} kernels")
    return level


def inputs(dtype, count, seed):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        a[: min(count, 3)] = [info.min, info.max, -1 if info.min else 0][: min(count, 3)]
        return a
    a = (rng.standard_normal(count) * 2.0 ** rng.integers(-10, 10, count)).astype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32).astype(dtype)
    picks = rng.integers(0, 8, count) == 0  # one in eight: special
    a[picks] = rng.choice(specials, picks.sum())
    return a


def is_half(dtype):
    return np.dtype(dtype).itemsize == 2 and not np.issubdtype(dtype, np.integer)


def reference(dtype, op, a, b):
    with np.errstate(all="ignore"):  # inf - inf, overflow: NaN and inf are what we compare
        if is_half(dtype):
            # Half types: computed in float32, rounded once.
            return OPS[op](a.astype(np.float32), b.astype(np.float32)).astype(dtype)
        return OPS[op](a, b)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_into_matches_numpy(level, dtype):
    level_or_skip(level)
    for count in COUNTS:
        a, b = inputs(dtype, count, 1), inputs(dtype, count, 2)
        for op in OPS:
            got = a.copy()
            _engine._reduce_into(got, b, op, level)
            want = reference(dtype, op, a, b)
            if is_half(dtype):  # compared as float32: NumPy sees bfloat16 NaNs as unequal
                got, want = got.astype(np.float32), want.astype(np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"op {op}, {count} elements")


def test_reduce_into_rejects_bad_arguments():
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="Received: kernels=sse9"):
        _engine._reduce_into(a, a.copy(), kr.Sum, "sse9")
    with pytest.raises(ValueError, match="op sum, min, max or product"):
        _engine._reduce_into(a, a.copy(), kr.Average)
    with pytest.raises(ValueError, match="dtype and size"):
        _engine._reduce_into(a, np.ones(4, np.float64), kr.Sum)
    with pytest.raises(ValueError, match="writeable"):
        _engine._reduce_into(a[::2], a[::2].copy(), kr.Sum)


def kernels_after_init(setting):
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import keras_ring as kr\nfrom keras_ring.core import _engine\n"
            "kr.init()\nprint(_engine._cpu_kernels())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KERAS_RING_CPU_KERNELS": setting},
    )


def test_the_setting_chooses_the_kernels():
    best = [level for level in LEVELS if _engine._cpu_supports_kernels(level)][-1]
    assert _engine._cpu_kernels() == best  # before init, and without the setting
    for setting, want in [("", best), ("generic", "generic")]:
        result = kernels_after_init(setting)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [want]


def test_an_unknown_setting_is_named():
    result = kernels_after_init("fast")
    assert result.returncode != 0
    assert (
        "KERAS_RING_CPU_KERNELS must be generic, avx2 or avx512. "
        "Received: KERAS_RING_CPU_KERNELS=fast"
    ) in result.stderr


def test_kernels_the_cpu_lacks_are_refused_at_init():
    lacking = [level for level in LEVELS if not _engine._cpu_supports_kernels(level)]
    if not lacking:
        pytest.skip("this CPU runs every level")
    result = kernels_after_init(lacking[-1])
    assert result.returncode != 0
    assert f"cannot use the {lacking[-1]} kernels here" in result.stderr
