// The kernels of reduce_kernels.inc compiled for wider x86 instruction sets:
// once for AVX2 and F16C, once for AVX-512 (F, BW, DQ, VL). reduce.cc calls
// them only on CPUs that have those.
#include "reduce_kernels.h"

#if KR_X86_KERNELS
#include <immintrin.h>

#include <cstring>
#include <limits>
#include <type_traits>

// The target pragmas come after the includes, so that only our kernels are
// compiled for the wider instruction sets.
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define KR_KERNELS_F16C 1
namespace keras_ring {
namespace avx2 {
namespace {
#include "reduce_kernels.inc"
}  // namespace
}  // namespace avx2
constexpr KernelTable kAvx2Kernels = avx2::MakeKernelTable();
}  // namespace keras_ring
#pragma GCC pop_options

// 512-bit vectors: GCC's generic tuning would otherwise stop at 256 bits.
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#undef KR_KERNELS_F16C
#define KR_KERNELS_AVX512 1
namespace keras_ring {
namespace avx512 {
namespace {
#include "reduce_kernels.inc"
}  // namespace
}  // namespace avx512
constexpr KernelTable kAvx512Kernels = avx512::MakeKernelTable();
}  // namespace keras_ring
#pragma GCC pop_options

#endif
