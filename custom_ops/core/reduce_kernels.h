// The table of kernels that each instruction-set level provides; reduce.cc
// picks a table at run time and calls through it. Internal to reduce*.cc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

// The x86 levels are built with GCC's target pragmas, one source file each;
// other compilers and other CPUs get the generic kernels only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KR_X86_KERNELS 1
#else
#define KR_X86_KERNELS 0
#endif

namespace keras_ring {

struct KernelTable {
  using ReduceFn = void (*)(void* dst, const void* src, size_t count);
  using ReduceToFn = void (*)(void* dst, const void* a, const void* b, size_t count);
  using ScaleFn = void (*)(void* buf, size_t count, double factor);
  using ToFloatFn = void (*)(float* dst, const uint16_t* src, size_t count);
  using FromFloatFn = void (*)(uint16_t* dst, const float* src, size_t count);

  // Indexed by the DataType and ReduceOp values; null for kAverage and for
  // values that name no op.
  ReduceFn reduce[kReducibleDataTypes][6];
  ReduceToFn reduce_to[kReducibleDataTypes][6];  // the same, into a third buffer
  ScaleFn scale[kReducibleDataTypes];
  ToFloatFn half_to_float, bfloat16_to_float;
  FromFloatFn float_to_half, float_to_bfloat16;
};

extern const KernelTable kGenericKernels;  // reduce.cc: plain C++, vectorised for the baseline ISA
#if KR_X86_KERNELS
extern const KernelTable kAvx2Kernels;    // reduce_avx2.cc: AVX2 and F16C
extern const KernelTable kAvx512Kernels;  // reduce_avx512.cc: AVX-512 F, BW, DQ, VL and F16C
#endif

}  // namespace keras_ring
