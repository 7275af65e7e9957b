// The generic kernels, and the choice of kernel level at run time.
#include "reduce.h"

#include <atomic>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>

#include "reduce_kernels.h"

namespace keras_ring {
namespace {
#include "reduce_kernels.inc"
}  // namespace

constexpr KernelTable kGenericKernels = MakeKernelTable();

namespace {

constexpr KernelLevel kAllLevels[] = {KernelLevel::kGeneric, KernelLevel::kAvx2,
                                      KernelLevel::kAvx512};

struct LevelInfo {
  const char* name;
  const char* needs;  // on an x86-64 CPU
};

constexpr LevelInfo kLevelInfo[] = {  // indexed by KernelLevel
    {"generic", "nothing"},
    {"avx2", "AVX2 and F16C"},
    {"avx512", "AVX-512 F, BW, DQ and VL, and F16C"},
};

const LevelInfo& Info(KernelLevel level) {
  static constexpr LevelInfo kUnknown = {"?", "?"};
  const int i = static_cast<int>(level);
  return i >= 0 && i < static_cast<int>(std::size(kLevelInfo)) ? kLevelInfo[i] : kUnknown;
}

const KernelTable& KernelsFor(KernelLevel level) {
  if (!CpuSupports(level)) {
    std::string supported;
    for (KernelLevel l : kAllLevels) {
      if (CpuSupports(l)) supported += std::string(supported.empty() ? "" : ", ") + Info(l).name;
    }
    throw EngineError(std::string("keras-ring: cannot use the ") + Info(level).name +
                      " kernels here: they need an x86-64 CPU with " + Info(level).needs +
                      ", and a build made with GCC; this machine can run " + supported +
                      ". Set KERAS_RING_CPU_KERNELS to one of those, or unset it for the best "
                      "available.");
  }
  switch (level) {
#if KR_X86_KERNELS
    case KernelLevel::kAvx2: return kAvx2Kernels;
    case KernelLevel::kAvx512: return kAvx512Kernels;
#endif
    default: return kGenericKernels;
  }
}

std::atomic<KernelLevel>& LevelInUse() {
  static std::atomic<KernelLevel> level{BestKernelLevel()};
  return level;
}

bool IsHalf(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

std::string InvalidDtype(DataType dtype) {
  return "keras-ring internal: no kernels for dtype " +
         std::to_string(static_cast<int>(dtype)) + " (" + DataTypeName(dtype) + ")";
}

}  // namespace

const char* KernelLevelName(KernelLevel level) { return Info(level).name; }

KernelLevel ParseKernelLevel(const char* text, char** end) {
  for (KernelLevel level : kAllLevels) {
    if (std::strcmp(text, KernelLevelName(level)) == 0) {
      *end = const_cast<char*>(text) + std::strlen(text);
      return level;
    }
  }
  *end = const_cast<char*>(text);
  return KernelLevel::kGeneric;
}

bool CpuSupports(KernelLevel level) {
#if KR_X86_KERNELS
  // Asked on every call through the level in use: looked up once.
  static const bool avx2 = [] {
    __builtin_cpu_init();  // needed where this runs before the constructors that would call it
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vl");
  switch (level) {
    case KernelLevel::kGeneric: return true;
    case KernelLevel::kAvx2: return avx2;
    case KernelLevel::kAvx512: return avx512;
  }
  return false;
#else
  return level == KernelLevel::kGeneric;
#endif
}

KernelLevel BestKernelLevel() {
  KernelLevel best = KernelLevel::kGeneric;
  for (KernelLevel level : kAllLevels) {
    if (CpuSupports(level)) best = level;
  }
  return best;
}

KernelLevel KernelLevelInUse() { return LevelInUse().load(std::memory_order_relaxed); }

void UseKernelLevel(KernelLevel level) {
  KernelsFor(level);  // throws if the CPU cannot run it
  LevelInUse().store(level, std::memory_order_relaxed);
}

namespace {

void CheckReduction(DataType dtype, ReduceOp op) {
  if (!IsReducibleDataType(static_cast<int>(dtype))) throw EngineError(InvalidDtype(dtype));
  if (op == ReduceOp::kAverage) {
    throw EngineError(
        "keras-ring internal: ReduceInto got op average; reduce with sum and post-scale by "
        "1/size");
  }
  if (!IsValidReduceOp(static_cast<int>(op))) {
    throw EngineError("keras-ring internal: invalid reduce op " +
                      std::to_string(static_cast<int>(op)));
  }
}

}  // namespace

void ReduceTo(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op,
              KernelLevel level) {
  CheckReduction(dtype, op);
  KernelsFor(level).reduce_to[static_cast<int>(dtype)][static_cast<int>(op)](dst, a, b, count);
}

void ReduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op,
                KernelLevel level) {
  CheckReduction(dtype, op);
  KernelsFor(level).reduce[static_cast<int>(dtype)][static_cast<int>(op)](dst, src, count);
}

void ScaleBuffer(void* buf, size_t count, DataType dtype, double factor, KernelLevel level) {
  if (!IsReducibleDataType(static_cast<int>(dtype))) throw EngineError(InvalidDtype(dtype));
  if (factor == 1.0) return;
  KernelsFor(level).scale[static_cast<int>(dtype)](buf, count, factor);
}

void ConvertBuffer(void* dst, DataType dst_dtype, const void* src, DataType src_dtype,
                   size_t count, KernelLevel level) {
  const KernelTable& kernels = KernelsFor(level);
  const bool wide_src = src_dtype == DataType::kFloat32 || src_dtype == DataType::kFloat64;
  const bool wide_dst = dst_dtype == DataType::kFloat32 || dst_dtype == DataType::kFloat64;
  if (!(IsHalf(dst_dtype) && wide_src) && !(wide_dst && IsHalf(src_dtype))) {
    for (DataType dtype : {dst_dtype, src_dtype}) {
      if (!IsValidDataType(static_cast<int>(dtype))) throw EngineError(InvalidDtype(dtype));
    }
    throw EngineError(std::string("keras-ring internal: ConvertBuffer converts between float32 "
                                  "or float64 and float16 or bfloat16; asked for ") +
                      DataTypeName(src_dtype) + " to " + DataTypeName(dst_dtype));
  }
  if (IsHalf(dst_dtype)) {
    const auto narrow = dst_dtype == DataType::kFloat16 ? kernels.float_to_half
                                                        : kernels.float_to_bfloat16;
    auto* out = static_cast<uint16_t*>(dst);
    if (src_dtype == DataType::kFloat32) return narrow(out, static_cast<const float*>(src), count);
    const auto* in = static_cast<const double*>(src);
    float block[kHalfBlock];
    for (size_t i = 0; i < count; i += kHalfBlock) {
      const size_t n = count - i < kHalfBlock ? count - i : kHalfBlock;
      ForEachIndex(n, [&](size_t j) { block[j] = static_cast<float>(in[i + j]); });
      narrow(out + i, block, n);
    }
    return;
  }
  const auto widen = src_dtype == DataType::kFloat16 ? kernels.half_to_float
                                                     : kernels.bfloat16_to_float;
  const auto* in = static_cast<const uint16_t*>(src);
  if (dst_dtype == DataType::kFloat32) return widen(static_cast<float*>(dst), in, count);
  auto* out = static_cast<double*>(dst);
  float block[kHalfBlock];
  for (size_t i = 0; i < count; i += kHalfBlock) {
    const size_t n = count - i < kHalfBlock ? count - i : kHalfBlock;
    widen(block, in + i, n);
    ForEachIndex(n, [&](size_t j) { out[i + j] = block[j]; });
  }
}

uint16_t FloatToHalf(float f) { return FloatToHalfBits(f); }
float HalfToFloat(uint16_t h) { return HalfBitsToFloat(h); }
uint16_t FloatToBFloat16(float f) { return FloatToBFloat16Bits(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16BitsToFloat(b); }

ReduceOp SumForAverage(ReduceOp op, int size, double* postscale) {
  if (op != ReduceOp::kAverage) return op;
  *postscale *= 1.0 / size;
  return ReduceOp::kSum;
}

void CopyElements(void* dst, DataType dst_dtype, const void* src, DataType src_dtype,
                  size_t count) {
  if (dst_dtype != src_dtype) {
    ConvertBuffer(dst, dst_dtype, src, src_dtype, count);
  } else if (count > 0) {
    std::memcpy(dst, src, count * DataTypeSize(dst_dtype));
  }
}

}  // namespace keras_ring
