// Element-wise reduction, scaling and conversion kernels for every dtype that
// reductions take (IsReducibleDataType).
// Half types (float16, bfloat16) are computed in float32 and rounded once per
// call.
//
// The kernels come in levels, chosen at run time so that one build runs on any
// CPU: generic (plain C++, any CPU), avx2 (AVX2 and F16C) and avx512 (AVX-512
// F, BW, DQ and VL); the x86 levels exist in x86-64 builds made with GCC.
// Every level gives bit-identical results for every dtype, op and input, NaN
// included (reduce_test.cc checks every level against the generic one), so
// the level is a matter of speed only. One exception: scaling by a NaN factor
// gives NaN everywhere on every level, but where the buffer holds NaNs too,
// the sign and payload of the result may differ, because x86 returns the
// first NaN operand and each level's code may order x * factor either way.
//
// A call uses the level passed, by default the one in use: the best the CPU
// has, until UseKernelLevel (the engine calls it at init with the level that
// KERAS_RING_CPU_KERNELS names).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace keras_ring {

enum class KernelLevel : int { kGeneric, kAvx2, kAvx512 };

const char* KernelLevelName(KernelLevel level);  // "generic", "avx2", "avx512"
// The level named by text, with strtol's contract: *end points past the name,
// or at text when text names no level. Fits engine.cc's Setting<>.
KernelLevel ParseKernelLevel(const char* text, char** end);
bool CpuSupports(KernelLevel level);
KernelLevel BestKernelLevel();
KernelLevel KernelLevelInUse();
// Makes `level` the one in use, for the whole process. Throws EngineError,
// naming what the CPU can run, if it cannot run `level`.
void UseKernelLevel(KernelLevel level);

// dst[i] = dst[i] (op) src[i]. op must not be kAverage (callers reduce with
// kSum and post-scale). Integer Sum and Product wrap around as in NumPy.
// Min and Max propagate NaN, as numpy.minimum/maximum do.
void ReduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op,
                KernelLevel level = KernelLevelInUse());

// dst[i] = a[i] (op) b[i]: ReduceInto of b into a copy of a, in one pass.
void ReduceTo(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op,
              KernelLevel level = KernelLevelInUse());

// buf[i] = buf[i] * factor, computed in double (float for half types) and
// converted back; integers truncate toward zero. factor == 1 is a no-op.
void ScaleBuffer(void* buf, size_t count, DataType dtype, double factor,
                 KernelLevel level = KernelLevelInUse());

// dst[i] = src[i] converted, between float32 or float64 and float16 or
// bfloat16 (either way), exactly as the scalar conversions below. float64
// goes through float32: rounding twice, so a float64 within float32's
// rounding error of a tie between two halves may round the other way.
void ConvertBuffer(void* dst, DataType dst_dtype, const void* src, DataType src_dtype,
                   size_t count, KernelLevel level = KernelLevelInUse());

// Average is Sum followed by a post-scale of 1/size: returns the op to
// reduce with, and multiplies *postscale by 1/size for Average.
ReduceOp SumForAverage(ReduceOp op, int size, double* postscale);

// dst <- count elements of src: a copy if the dtypes are equal, else
// ConvertBuffer (compression on the way into and out of the engine).
void CopyElements(void* dst, DataType dst_dtype, const void* src, DataType src_dtype,
                  size_t count);

// IEEE binary16 and bfloat16 conversions, round to nearest even; NaN stays NaN.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t b);

}  // namespace keras_ring
