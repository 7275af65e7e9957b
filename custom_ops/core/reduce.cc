#include "reduce.h"

#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace keras_ring {
namespace {

template <typename To, typename From>
inline To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs equal sizes");
  To to;
  std::memcpy(&to, &v, sizeof to);
  return to;
}

// The conversions are branch-free so that the loops calling them vectorise.
// They rely on the default round-to-nearest-even FPU mode, and stay exact
// under flush-to-zero (TF's threads set it): their float intermediates are
// never subnormal, and float subnormal inputs round to a half zero anyway.

// Picks a or b with a bit mask. A ternary would let GCC sink the float
// operation computing one operand into a branch, which it then refuses to
// if-convert (floating point may trap), and the loop stays scalar.
inline uint32_t Select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

inline uint16_t FloatToHalfBits(float f) {
  const uint32_t x = BitCast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // Normal half: rebias the exponent (127 -> 15) and round away the 13 low
  // mantissa bits to nearest even; a carry out of the mantissa bumps the
  // exponent, up to infinity for |f| >= 65520.
  const uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal half (|f| < 2^-14): adding 0.5f makes the FPU round |f| to a
  // multiple of 2^-24 (the half subnormal unit), left in the low bits.
  const uint32_t subnormal = BitCast<uint32_t>(BitCast<float>(a) + 0.5f) - 0x3f000000u;
  // NaN stays NaN (quiet); infinity and |f| >= 65536 give infinity.
  const uint32_t special = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
  const uint32_t h = Select(a >= 0x47800000u, special, Select(a < 0x38800000u, subnormal, normal));
  return static_cast<uint16_t>(h | sign);
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t shifted = (uint32_t{h} & 0x7fffu) << 13;  // exponent and mantissa in float position
  const uint32_t exponent = shifted & 0x0f800000u;
  const uint32_t normal = shifted + (112u << 23);    // rebias 15 -> 127
  const uint32_t inf_nan = shifted + (224u << 23);   // exponent 31 -> 255, payload kept
  // Subnormal: m * 2^-24 = (2^-14 * (1 + m/1024)) - 2^-14, normalised by the FPU.
  const uint32_t subnormal = BitCast<uint32_t>(BitCast<float>(shifted + (113u << 23)) -
                                               BitCast<float>(113u << 23));
  const uint32_t f =
      Select(exponent == 0x0f800000u, inf_nan, Select(exponent == 0, subnormal, normal));
  return BitCast<float>(f | ((uint32_t{h} & 0x8000u) << 16));
}

inline uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t x = BitCast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  // Rounding a NaN could carry its payload away and leave infinity: keep the
  // sign and top payload bits and force the quiet bit instead.
  const uint32_t quiet_nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float BFloat16BitsToFloat(uint16_t b) { return BitCast<float>(uint32_t{b} << 16); }

// Out-of-range results of integer scaling saturate and NaN gives 0: a plain
// static_cast would be undefined behaviour there.
template <typename T>
inline T SaturatingCast(double v) {
  constexpr double kLow = static_cast<double>(std::numeric_limits<T>::min());  // exact
  constexpr double kAboveHigh =
      static_cast<double>(uint64_t{1} << std::numeric_limits<T>::digits);  // max + 1, exact
  return v >= kAboveHigh ? std::numeric_limits<T>::max()
         : v > kLow - 1.0 ? static_cast<T>(v)
         : v != v         ? T{0}
                          : std::numeric_limits<T>::min();
}

// A codec says how a dtype is stored, what Load widens it to for reducing
// (only the half types change: to float32) and in which type it is scaled.
template <typename T>
struct NativeCodec {
  using Storage = T;
  using Scale = double;
  static T Load(T v) { return v; }
  static T Store(T v) { return v; }
  static T FromScaled(double v) {
    if constexpr (std::is_integral_v<T>) {
      return SaturatingCast<T>(v);
    } else {
      return static_cast<T>(v);
    }
  }
};

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
struct HalfCodec {
  using Storage = uint16_t;
  using Scale = float;
  static float Load(uint16_t v) { return ToFloat(v); }
  static uint16_t Store(float v) { return FromFloat(v); }
  static uint16_t FromScaled(float v) { return FromFloat(v); }
};

using Float16Codec = HalfCodec<HalfBitsToFloat, FloatToHalfBits>;
using BFloat16Codec = HalfCodec<BFloat16BitsToFloat, FloatToBFloat16Bits>;

template <typename F>
void VisitDataType(DataType dtype, F&& f) {
  switch (dtype) {
    case DataType::kFloat16: return f(Float16Codec{});
    case DataType::kBFloat16: return f(BFloat16Codec{});
    case DataType::kFloat32: return f(NativeCodec<float>{});
    case DataType::kFloat64: return f(NativeCodec<double>{});
    case DataType::kInt8: return f(NativeCodec<int8_t>{});
    case DataType::kUInt8: return f(NativeCodec<uint8_t>{});
    case DataType::kInt32: return f(NativeCodec<int32_t>{});
    case DataType::kInt64: return f(NativeCodec<int64_t>{});
  }
  throw EngineError("keras-ring internal: invalid dtype " +
                    std::to_string(static_cast<int>(dtype)));
}

// Integer Sum and Product run in an unsigned type at least as wide as int:
// they wrap modulo 2^bits like NumPy, with neither signed overflow nor the
// promotion of small types to (signed) int.
template <typename T>
using WrapType = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned,
                                    std::make_unsigned_t<T>>;

template <typename T>
inline bool IsNaN(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return v != v;
  } else {
    return false;
  }
}

struct SumOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(WrapType<T>(a) + WrapType<T>(b));
    } else {
      return a + b;
    }
  }
};

struct ProductOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(WrapType<T>(a) * WrapType<T>(b));
    } else {
      return a * b;
    }
  }
};

// Min and Max propagate NaN (as numpy.minimum/maximum do), so that a NaN on
// any rank shows in the result whatever the reduction order.
struct MinOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a < b || IsNaN(a)) ? a : b;
  }
};

struct MaxOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a > b || IsNaN(a)) ? a : b;
  }
};

template <typename F>
void VisitReduceOp(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum: return f(SumOp{});
    case ReduceOp::kProduct: return f(ProductOp{});
    case ReduceOp::kMin: return f(MinOp{});
    case ReduceOp::kMax: return f(MaxOp{});
    case ReduceOp::kAverage:
      throw EngineError(
          "keras-ring internal: ReduceInto got op average; reduce with sum "
          "and post-scale by 1/size");
  }
  throw EngineError("keras-ring internal: invalid reduce op " +
                    std::to_string(static_cast<int>(op)));
}

// Runs body(i) for i in [0, count) as fixed-size blocks plus a tail. At -O2,
// GCC 12 only vectorises a loop whose trip count is a known multiple of the
// vector width ("very cheap" cost model), which the inner loop is.
template <typename Body>
inline void ForEachIndex(size_t count, Body&& body) {
  constexpr size_t kBlock = 64;
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) body(i + j);
  }
  for (; i < count; ++i) body(i);
}

// Callers never pass overlapping buffers (the ring reduces from a separate
// receive buffer), which lets the compiler vectorise without alias checks.
// noinline: inlined into the dispatch lambdas, GCC 12 loses the __restrict
// and most loops stay scalar (3x slower for float32, 8x for int8).
template <typename Codec, typename Op>
__attribute__((noinline)) void ReduceLoop(typename Codec::Storage* __restrict dst,
                                          const typename Codec::Storage* __restrict src,
                                          size_t count) {
  ForEachIndex(count, [=](size_t i) {
    dst[i] = Codec::Store(Op::Apply(Codec::Load(dst[i]), Codec::Load(src[i])));
  });
}

template <typename Codec>  // noinline: as ReduceLoop
__attribute__((noinline)) void ScaleLoop(typename Codec::Storage* __restrict buf, size_t count,
                                         typename Codec::Scale factor) {
  using Scale = typename Codec::Scale;
  ForEachIndex(count, [=](size_t i) {
    buf[i] = Codec::FromScaled(static_cast<Scale>(Codec::Load(buf[i])) * factor);
  });
}

}  // namespace

void ReduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  VisitDataType(dtype, [&](auto codec) {
    using Codec = decltype(codec);
    using Storage = typename Codec::Storage;
    VisitReduceOp(op, [&](auto reduce_op) {
      ReduceLoop<Codec, decltype(reduce_op)>(static_cast<Storage*>(dst),
                                             static_cast<const Storage*>(src), count);
    });
  });
}

void ScaleBuffer(void* buf, size_t count, DataType dtype, double factor) {
  if (factor == 1.0) return;
  VisitDataType(dtype, [&](auto codec) {
    using Codec = decltype(codec);
    ScaleLoop<Codec>(static_cast<typename Codec::Storage*>(buf), count,
                     static_cast<typename Codec::Scale>(factor));
  });
}

uint16_t FloatToHalf(float f) { return FloatToHalfBits(f); }
float HalfToFloat(uint16_t h) { return HalfBitsToFloat(h); }
uint16_t FloatToBFloat16(float f) { return FloatToBFloat16Bits(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16BitsToFloat(b); }

}  // namespace keras_ring
