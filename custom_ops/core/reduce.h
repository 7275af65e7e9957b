// Element-wise reduction and scaling kernels for every dtype. Half types
// (float16, bfloat16) are computed in float32 and rounded once per call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace keras_ring {

// dst[i] = dst[i] (op) src[i]. op must not be kAverage (callers reduce with
// kSum and post-scale). Integer Sum and Product wrap around as in NumPy.
void ReduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// buf[i] = buf[i] * factor, computed in double (float for half types) and
// converted back; integers truncate toward zero. factor == 1 is a no-op.
void ScaleBuffer(void* buf, size_t count, DataType dtype, double factor);

// IEEE binary16 and bfloat16 conversions, round to nearest even; NaN stays NaN.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t b);

}  // namespace keras_ring
