// Reduce and scale kernels against the scalar references of test_util.h, the
// half conversions against known bit patterns and a slow reference, and every
// kernel level the CPU has against the generic one, bit for bit.
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "../core/reduce.h"
#include "harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::BFloat16ToFloat;
using keras_ring::ConvertBuffer;
using keras_ring::CpuSupports;
using keras_ring::EngineError;
using keras_ring::FloatToBFloat16;
using keras_ring::FloatToHalf;
using keras_ring::HalfToFloat;
using keras_ring::KernelLevel;
using keras_ring::KernelLevelName;
using keras_ring::ReduceInto;
using keras_ring::ReduceTo;
using keras_ring::ScaleBuffer;

float FloatFromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t BitsOfFloat(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// The kernels' inputs: random values of every magnitude the dtype holds
// (integers: every bit pattern, so Sum and Product wrap), plus the float
// specials at fixed places.
template <typename D>
std::vector<typename D::Storage> KernelInput(size_t count, uint64_t seed) {
  using S = typename D::Storage;
  std::vector<S> v(count);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t h = Mix(seed, i);
    if constexpr (D::kInteger) {
      v[i] = static_cast<S>(h);
    } else {
      const double magnitude = std::ldexp(1.0 + Unit(h), static_cast<int>(h % 20) - 10);
      v[i] = D::FromDouble((h >> 8) & 1 ? -magnitude : magnitude);
    }
  }
  if constexpr (!D::kInteger) {
    const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                               std::numeric_limits<double>::infinity(),
                               -std::numeric_limits<double>::infinity(), 0.0, -0.0,
                               D::DenormMin()};
    for (size_t k = 0; k < std::size(specials); ++k) {
      if (count > 20 + k) v[(seed % 5) * 3 + k] = D::FromDouble(specials[k]);
    }
  }
  return v;
}

template <typename D>
void CheckReduce(ReduceOp op, size_t count) {
  using S = typename D::Storage;
  const std::vector<S> a = KernelInput<D>(count, 1);
  const std::vector<S> b = KernelInput<D>(count, 2);
  std::vector<S> got = a;
  ReduceInto(got.data(), b.data(), count, D::kType, op);
  for (size_t i = 0; i < count; ++i) {
    const S want = RefReduce<D>(a[i], b[i], op);
    if (!Matches<D>(got[i], want)) {
      KR_FAIL("count " + std::to_string(count) + " index " + std::to_string(i) + ": " +
              ValueString<D>(a[i]) + " (op) " + ValueString<D>(b[i]) + " gave " +
              ValueString<D>(got[i]) + ", want " + ValueString<D>(want));
      return;
    }
  }
}

template <typename D>
void CheckScale(double factor, size_t count) {
  using S = typename D::Storage;
  const std::vector<S> input = KernelInput<D>(count, 3);
  std::vector<S> got = input;
  ScaleBuffer(got.data(), count, D::kType, factor);
  for (size_t i = 0; i < count; ++i) {
    const S want = RefScale<D>(input[i], factor);
    if (!Matches<D>(got[i], want)) {
      KR_FAIL("factor " + ToString(factor) + " index " + std::to_string(i) + ": " +
              ValueString<D>(input[i]) + " gave " + ValueString<D>(got[i]) + ", want " +
              ValueString<D>(want));
      return;
    }
  }
}

KR_TEST_CASES(RegisterKernelTests) {
  ForEachDtype([](auto dtype) {
    using D = decltype(dtype);
    const std::string name = keras_ring::DataTypeName(D::kType);
    for (ReduceOp op : kAllOps) {
      if (op == ReduceOp::kAverage) continue;
      Register("reduce/" + name + "/" + keras_ring::ReduceOpName(op), [op] {
        // Sizes around the kernels' 64-element blocks, and a large odd one.
        for (size_t count : {0, 1, 63, 64, 65, 129, 100003}) CheckReduce<D>(op, count);
      });
    }
    Register("scale/" + name, [] {
      for (double factor : {1.0, 0.5, -3.0, 1e-3, 1e30, -1e300}) CheckScale<D>(factor, 1003);
    });
  });
}

// Wraparound and NaN cases spelled out, independent of the reference.
template <typename T>
T Reduced(T a, T b, DataType dtype, ReduceOp op) {
  ReduceInto(&a, &b, 1, dtype, op);
  return a;
}

KR_TEST(IntegerSumAndProductWrapLikeNumpy) {
  KR_EXPECT_EQ(Reduced<int8_t>(127, 1, DataType::kInt8, ReduceOp::kSum), int8_t{-128});
  KR_EXPECT_EQ(Reduced<int8_t>(-128, -1, DataType::kInt8, ReduceOp::kProduct), int8_t{-128});
  KR_EXPECT_EQ(Reduced<uint8_t>(255, 1, DataType::kUInt8, ReduceOp::kSum), uint8_t{0});
  KR_EXPECT_EQ(Reduced<uint8_t>(16, 16, DataType::kUInt8, ReduceOp::kProduct), uint8_t{0});
  KR_EXPECT_EQ(Reduced<uint8_t>(255, 255, DataType::kUInt8, ReduceOp::kProduct), uint8_t{1});
  const int32_t i32max = std::numeric_limits<int32_t>::max();
  const int64_t i64max = std::numeric_limits<int64_t>::max();
  const int64_t i64min = std::numeric_limits<int64_t>::min();
  KR_EXPECT_EQ(Reduced<int32_t>(i32max, 1, DataType::kInt32, ReduceOp::kSum),
               std::numeric_limits<int32_t>::min());
  KR_EXPECT_EQ(Reduced<int32_t>(65536, 65536, DataType::kInt32, ReduceOp::kProduct), 0);
  KR_EXPECT_EQ(Reduced<int64_t>(i64min, -1, DataType::kInt64, ReduceOp::kSum), i64max);
  KR_EXPECT_EQ(Reduced<int64_t>(i64max, 2, DataType::kInt64, ReduceOp::kProduct), int64_t{-2});
  KR_EXPECT_EQ(Reduced<int64_t>(i64min, -1, DataType::kInt64, ReduceOp::kProduct), i64min);
  KR_EXPECT_EQ(Reduced<int64_t>(i64min, i64max, DataType::kInt64, ReduceOp::kMin), i64min);
  KR_EXPECT_EQ(Reduced<uint8_t>(200, 7, DataType::kUInt8, ReduceOp::kMax), uint8_t{200});
}

KR_TEST(FloatMinMaxPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kSum, ReduceOp::kProduct}) {
    KR_EXPECT(std::isnan(Reduced<float>(nan, 1.0f, DataType::kFloat32, op)));
    KR_EXPECT(std::isnan(Reduced<float>(1.0f, nan, DataType::kFloat32, op)));
    KR_EXPECT(std::isnan(Reduced<double>(2.0, nan, DataType::kFloat64, op)));
    KR_EXPECT(std::isnan(HalfToFloat(
        Reduced<uint16_t>(FloatToHalf(1.0f), FloatToHalf(nan), DataType::kFloat16, op))));
    KR_EXPECT(std::isnan(BFloat16ToFloat(
        Reduced<uint16_t>(FloatToBFloat16(nan), 0x3F80, DataType::kBFloat16, op))));
  }
  KR_EXPECT(std::isnan(Reduced<float>(inf, -inf, DataType::kFloat32, ReduceOp::kSum)));
  KR_EXPECT_EQ(Reduced<float>(-inf, 5.0f, DataType::kFloat32, ReduceOp::kMin), -inf);
  KR_EXPECT_EQ(Reduced<double>(-inf, 5.0, DataType::kFloat64, ReduceOp::kMax), 5.0);
}

KR_TEST(HalfArithmeticRoundsOnceToNearestEven) {
  auto half_sum = [](uint16_t a, uint16_t b) {
    return Reduced<uint16_t>(a, b, DataType::kFloat16, ReduceOp::kSum);
  };
  KR_EXPECT_EQ(half_sum(0x7BFF, 0x4C00), uint16_t{0x7C00});  // 65504 + 16: tie, to inf
  KR_EXPECT_EQ(half_sum(0x7BFF, 0x4BFF), uint16_t{0x7BFF});  // 65504 + 15.99: below the tie
  KR_EXPECT_EQ(half_sum(0x3C00, 0x1000), uint16_t{0x3C00});  // 1 + 2^-11: tie, to even 1
  KR_EXPECT_EQ(half_sum(0x3C01, 0x1000), uint16_t{0x3C02});  // tie, to even 1 + 2^-9
  KR_EXPECT_EQ(half_sum(0x0001, 0x0001), uint16_t{0x0002});  // subnormals add exactly
  KR_EXPECT_EQ(half_sum(0x03FF, 0x0001), uint16_t{0x0400});  // into the normals
  // bfloat16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7, rounded to even.
  KR_EXPECT_EQ(Reduced<uint16_t>(0x3F80, 0x3B80, DataType::kBFloat16, ReduceOp::kSum),
               uint16_t{0x3F80});
}

KR_TEST(ScaleTruncatesTowardZeroAndSaturates) {
  auto scaled = [](auto v, DataType dtype, double factor) {
    ScaleBuffer(&v, 1, dtype, factor);
    return v;
  };
  KR_EXPECT_EQ(scaled(int32_t{7}, DataType::kInt32, 0.5), 3);
  KR_EXPECT_EQ(scaled(int32_t{-7}, DataType::kInt32, 0.5), -3);
  KR_EXPECT_EQ(scaled(int8_t{100}, DataType::kInt8, 2.0), int8_t{127});
  KR_EXPECT_EQ(scaled(int8_t{-100}, DataType::kInt8, 2.0), int8_t{-128});
  KR_EXPECT_EQ(scaled(uint8_t{200}, DataType::kUInt8, -1.0), uint8_t{0});
  KR_EXPECT_EQ(scaled(uint8_t{200}, DataType::kUInt8, 2.0), uint8_t{255});
  KR_EXPECT_EQ(scaled(int8_t{5}, DataType::kInt8, std::nan("")), int8_t{0});
  KR_EXPECT_EQ(scaled(std::numeric_limits<int64_t>::max(), DataType::kInt64, 1.5),
               std::numeric_limits<int64_t>::max());
  KR_EXPECT_EQ(scaled(int64_t{-3}, DataType::kInt64, 1e300), std::numeric_limits<int64_t>::min());
  KR_EXPECT_EQ(scaled(uint16_t{0x3C00}, DataType::kFloat16, 0.5), uint16_t{0x3800});
  KR_EXPECT_EQ(scaled(uint16_t{0x3F80}, DataType::kBFloat16, -2.0), uint16_t{0xC000});
  KR_EXPECT_EQ(scaled(3.0f, DataType::kFloat32, 1e300), std::numeric_limits<float>::infinity());
}

KR_TEST(KernelsRejectAverageAndInvalidEnums) {
  float a = 1, b = 2;
  KR_EXPECT_THROW(ReduceInto(&a, &b, 1, DataType::kFloat32, ReduceOp::kAverage), EngineError,
                  "average");
  KR_EXPECT_THROW(ReduceInto(&a, &b, 1, DataType::kFloat32, static_cast<ReduceOp>(2)),
                  EngineError, "invalid reduce op 2");
  KR_EXPECT_THROW(ReduceInto(&a, &b, 1, static_cast<DataType>(12), ReduceOp::kSum), EngineError,
                  "no kernels for dtype 12");
  // Dtypes that only move: no kernels, an error instead of a read past the table.
  for (DataType d : {DataType::kInt16, DataType::kUInt16, DataType::kBool}) {
    KR_EXPECT_THROW(ReduceInto(&a, &b, 1, d, ReduceOp::kSum), EngineError,
                    "no kernels for dtype " + std::to_string(static_cast<int>(d)));
    KR_EXPECT_THROW(ReduceTo(&a, &a, &b, 1, d, ReduceOp::kMax), EngineError,
                    DataTypeName(d));
    KR_EXPECT_THROW(ScaleBuffer(&a, 1, d, 2.0), EngineError, DataTypeName(d));
  }
  KR_EXPECT_THROW(ReduceTo(&a, &a, &b, 1, DataType::kFloat32, ReduceOp::kAverage), EngineError,
                  "average");
  KR_EXPECT_THROW(ScaleBuffer(&a, 1, static_cast<DataType>(-1), 2.0), EngineError,
                  "no kernels for dtype -1");
}

KR_TEST(HalfKnownBitPatterns) {
  KR_EXPECT_EQ(FloatToHalf(1.0f), uint16_t{0x3C00});
  KR_EXPECT_EQ(FloatToHalf(-2.0f), uint16_t{0xC000});
  KR_EXPECT_EQ(FloatToHalf(0.0f), uint16_t{0x0000});
  KR_EXPECT_EQ(FloatToHalf(-0.0f), uint16_t{0x8000});
  KR_EXPECT_EQ(FloatToHalf(65504.0f), uint16_t{0x7BFF});
  KR_EXPECT_EQ(FloatToHalf(65519.99f), uint16_t{0x7BFF});
  KR_EXPECT_EQ(FloatToHalf(65520.0f), uint16_t{0x7C00});  // tie rounds to even: infinity
  KR_EXPECT_EQ(FloatToHalf(1e10f), uint16_t{0x7C00});
  KR_EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), uint16_t{0xFC00});
  KR_EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), uint16_t{0x0400});  // smallest normal
  KR_EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), uint16_t{0x0001});  // smallest subnormal
  KR_EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), uint16_t{0x0000});  // tie to even: 0
  KR_EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), uint16_t{0x0001});
  KR_EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), uint16_t{0x0002});  // tie to even: 2
  KR_EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -30)), uint16_t{0x8000});
  KR_EXPECT_EQ(FloatToHalf(1e-45f), uint16_t{0x0000});  // a float subnormal
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  KR_EXPECT((nan & 0x7C00) == 0x7C00 && (nan & 0x03FF) != 0);
  KR_EXPECT(std::isnan(HalfToFloat(FloatToHalf(FloatFromBits(0x7F800001)))));  // signalling

  KR_EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  KR_EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  KR_EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  KR_EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  KR_EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  KR_EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  KR_EXPECT_EQ(BitsOfFloat(HalfToFloat(0x8000)), 0x80000000u);
  KR_EXPECT(std::isnan(HalfToFloat(0x7C01)));
  KR_EXPECT(std::isnan(HalfToFloat(0xFE00)));
}

KR_TEST(BFloat16KnownBitPatterns) {
  KR_EXPECT_EQ(FloatToBFloat16(1.0f), uint16_t{0x3F80});
  KR_EXPECT_EQ(FloatToBFloat16(-2.0f), uint16_t{0xC000});
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x3F808000)), uint16_t{0x3F80});  // tie, to even
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x3F818000)), uint16_t{0x3F82});  // tie, to even
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x3F808001)), uint16_t{0x3F81});
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x3F807FFF)), uint16_t{0x3F80});
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x7F7FFFFF)), uint16_t{0x7F80});  // max float: inf
  KR_EXPECT_EQ(FloatToBFloat16(FloatFromBits(0x00018000)), uint16_t{0x0002});  // subnormal tie
  KR_EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), uint16_t{0xFF80});
  // A NaN whose payload lies only in the dropped bits must not become infinity.
  KR_EXPECT(std::isnan(BFloat16ToFloat(FloatToBFloat16(FloatFromBits(0x7F800001)))));
  KR_EXPECT(std::isnan(BFloat16ToFloat(FloatToBFloat16(FloatFromBits(0xFFFFFFFF)))));
  KR_EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  KR_EXPECT_EQ(BFloat16ToFloat(0x0001), std::ldexp(1.0f, -133));
}

// Every 16-bit pattern decodes like the reference and survives a round trip;
// every tie between neighbours rounds to even; and a sweep of float bit
// patterns rounds like the reference.
template <typename D>
void CheckNarrowConversions(float (*to_float)(uint16_t), uint16_t (*from_float)(float)) {
  int failures = 0;
  auto expect_rounds = [&](float f) {
    const uint16_t got = from_float(f);
    const uint16_t want = D::FromDouble(f);
    if (!Matches<D>(got, want) && ++failures <= 5) {
      KR_FAIL("float with bits " + ToString(BitsOfFloat(f)) + " -> " + ToString(got) + ", want " +
              ToString(want));
    }
  };
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const double ref = D::ToDouble(h);
    const float f = to_float(h);
    if (std::isnan(ref)) {
      KR_EXPECT(std::isnan(f) && std::isnan(to_float(from_float(f))));
      continue;
    }
    if (static_cast<double>(f) != ref || from_float(f) != h) {
      if (++failures <= 5) KR_FAIL("pattern " + ToString(bits) + " decodes to " + ToString(f));
    }
    // The float halfway to the next pattern of larger magnitude, and its neighbours.
    const uint16_t next = static_cast<uint16_t>(h + 1);
    if ((h & 0x7FFF) != 0x7FFF && !std::isnan(D::ToDouble(next))) {
      const double mid = (ref + D::ToDouble(next)) / 2;
      if (std::isfinite(mid)) {
        const float fm = static_cast<float>(mid);
        expect_rounds(fm);
        expect_rounds(std::nextafter(fm, 0.0f));
        expect_rounds(std::nextafter(fm, fm * 2));
      }
    }
  }
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 1021) {
    expect_rounds(FloatFromBits(static_cast<uint32_t>(bits)));
  }
}

KR_TEST(HalfConversionsMatchReference) {
  CheckNarrowConversions<Float16>(HalfToFloat, FloatToHalf);
}

KR_TEST(BFloat16ConversionsMatchReference) {
  CheckNarrowConversions<BFloat16>(BFloat16ToFloat, FloatToBFloat16);
}

// Every kernel level against the generic one.

constexpr KernelLevel kWiderLevels[] = {KernelLevel::kAvx2, KernelLevel::kAvx512};

// Element counts around the vector widths, the 64-element loop blocks and the
// 256-element half blocks, and larger odd ones.
constexpr size_t kLevelCounts[] = {0, 1, 7, 15, 16, 17, 63, 64, 65, 257, 1000, 4097};

template <typename S>
S FromBits(uint64_t bits) {
  S v;
  std::memcpy(&v, &bits, sizeof v);  // the low bytes, on this little-endian target
  return v;
}

// The special values of a dtype, as bit patterns: for floats, NaNs of either
// sign (quiet, signalling, with payloads), infinities, signed zeros,
// subnormals, the largest finite values and (float16) the values around its
// overflow to infinity; for integers, the extremes, 0 and -1.
template <typename D>
std::vector<uint64_t> SpecialBits() {
  using S = typename D::Storage;
  if constexpr (D::kInteger) {
    return {static_cast<uint64_t>(std::numeric_limits<S>::min()),
            static_cast<uint64_t>(std::numeric_limits<S>::max()), 0, ~uint64_t{0}, 1};
  } else if constexpr (sizeof(S) == 2) {
    std::vector<uint64_t> bits = {0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x7FFF, 0x7C00, 0xFC00,
                                  0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x0400};
    if (D::kType == DataType::kBFloat16) {
      bits = {0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x7FFF, 0x7F80, 0xFF80,
              0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x0080};
    }
    return bits;
  } else if constexpr (sizeof(S) == 4) {
    return {0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00005, 0x7FFFFFFF, 0x7F800000,
            0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF,
            0x477FE000, 0x477FF000, 0xC77FEFFF, 0x33000000, 0x3F808000};
  } else {
    return {0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF4000000000005,
            0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000000, 0x8000000000000000,
            0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF, 0x40EFFC0000000000,
            0x3FF0000010000000};
  }
}

// count + 1 values with one to spare, so that callers can start at element 1
// (unaligned): the ordinary inputs of KernelInput, with one value in eight
// replaced by a random bit pattern and one in eight by a special value, so
// that the two inputs of a reduction are sometimes special together.
template <typename D>
std::vector<typename D::Storage> LevelInput(size_t count, uint64_t seed) {
  using S = typename D::Storage;
  std::vector<S> v = KernelInput<D>(count + 1, seed);
  const std::vector<uint64_t> specials = SpecialBits<D>();
  for (size_t i = 0; i < v.size(); ++i) {
    const uint64_t h = Mix(seed, i, 7);
    if (h % 8 == 0) v[i] = FromBits<S>(Mix(h));
    if (h % 8 == 1) v[i] = FromBits<S>(specials[(h >> 8) % specials.size()]);
  }
  return v;
}

template <typename S>
bool SameBits(const std::vector<S>& got, const std::vector<S>& want, const std::string& what) {
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(S)) == 0) return true;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(S)) != 0) {
      uint64_t g = 0, w = 0;
      std::memcpy(&g, &got[i], sizeof(S));
      std::memcpy(&w, &want[i], sizeof(S));
      KR_FAIL(what + ": element " + std::to_string(i) + " has bits " + ToString(g) +
              ", the generic kernels give " + ToString(w));
      break;
    }
  }
  return false;
}

template <typename D>
void CheckLevelReduceAndScale(KernelLevel level, const std::string& mode) {
  using S = typename D::Storage;
  for (size_t count : kLevelCounts) {
    const std::vector<S> a = LevelInput<D>(count, count * 2 + 1);
    const std::vector<S> b = LevelInput<D>(count, count * 2 + 2);
    const std::string where = std::string(keras_ring::DataTypeName(D::kType)) + ", " +
                              std::to_string(count) + " elements, " + mode;
    for (ReduceOp op : kAllOps) {
      if (op == ReduceOp::kAverage) continue;
      std::vector<S> got = a, want = a;
      ReduceInto(got.data() + 1, b.data() + 1, count, D::kType, op, level);
      ReduceInto(want.data() + 1, b.data() + 1, count, D::kType, op, KernelLevel::kGeneric);
      if (!SameBits(got, want, std::string(keras_ring::ReduceOpName(op)) + ", " + where)) return;
      // Into a third buffer: the same bits as reducing into a copy of a.
      std::vector<S> to(a.size());
      to[0] = a[0];
      ReduceTo(to.data() + 1, a.data() + 1, b.data() + 1, count, D::kType, op, level);
      if (!SameBits(to, want, std::string("ReduceTo ") + keras_ring::ReduceOpName(op) + ", " +
                                  where)) {
        return;
      }
    }
    for (double factor : {0.5, -3.0, 1e-3, 1e30}) {
      std::vector<S> got = a, want = a;
      ScaleBuffer(got.data() + 1, count, D::kType, factor, level);
      ScaleBuffer(want.data() + 1, count, D::kType, factor, KernelLevel::kGeneric);
      if (!SameBits(got, want, "scale by " + ToString(factor) + ", " + where)) return;
    }
    // By NaN: NaN everywhere (integers: 0), but which NaN bits is left open
    // (reduce.h says why).
    std::vector<S> got = a;
    ScaleBuffer(got.data() + 1, count, D::kType, std::nan(""), level);
    for (size_t i = 1; i <= count; ++i) {
      if (!Matches<D>(got[i], D::FromDouble(D::kInteger ? 0.0 : std::nan("")))) {
        KR_FAIL("scale by nan, " + where + ": element " + std::to_string(i) + " gave " +
                ValueString<D>(got[i]));
        return;
      }
    }
  }
}

template <typename From, typename To>
void CheckLevelConvert(KernelLevel level, const std::string& mode) {
  using S = typename From::Storage;
  using T = typename To::Storage;
  for (size_t count : kLevelCounts) {
    const std::vector<S> in = LevelInput<From>(count, count + 5);
    std::vector<T> got(count + 1), want(count + 1);
    ConvertBuffer(got.data() + 1, To::kType, in.data() + 1, From::kType, count, level);
    ConvertBuffer(want.data() + 1, To::kType, in.data() + 1, From::kType, count,
                  KernelLevel::kGeneric);
    if (!SameBits(got, want,
                  std::string(keras_ring::DataTypeName(From::kType)) + " to " +
                      keras_ring::DataTypeName(To::kType) + ", " + std::to_string(count) +
                      " elements, " + mode)) {
      return;
    }
  }
}

void CheckLevel(KernelLevel level, const std::string& mode) {
  ForEachDtype([&](auto dtype) { CheckLevelReduceAndScale<decltype(dtype)>(level, mode); });
  CheckLevelConvert<Float32, Float16>(level, mode);
  CheckLevelConvert<Float16, Float32>(level, mode);
  CheckLevelConvert<Float32, BFloat16>(level, mode);
  CheckLevelConvert<BFloat16, Float32>(level, mode);
  CheckLevelConvert<Float64, Float16>(level, mode);
  CheckLevelConvert<Float16, Float64>(level, mode);
  CheckLevelConvert<Float64, BFloat16>(level, mode);
  CheckLevelConvert<BFloat16, Float64>(level, mode);
}

// Sets flush-to-zero and denormals-are-zero, as TF's threads do, for its
// lifetime (x86 only: elsewhere the FPU's mode is left alone).
class FlushDenormals {
 public:
#if defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

bool Skipped(KernelLevel level) {
  if (CpuSupports(level)) return false;
  std::printf("note: this CPU cannot run the %s kernels; their tests are skipped\n",
              KernelLevelName(level));
  return true;
}

KR_TEST_CASES(RegisterLevelTests) {
  for (KernelLevel level : kWiderLevels) {
    const std::string name = std::string("level/") + KernelLevelName(level);
    Register(name + "/matches_generic", [level] {
      if (!Skipped(level)) CheckLevel(level, "default FPU mode");
    });
    Register(name + "/matches_generic_flushing_denormals", [level] {
      if (Skipped(level)) return;
      FlushDenormals flush;
      CheckLevel(level, "flush-to-zero and denormals-are-zero");
    });
  }
}

// ConvertBuffer at every level against the scalar conversions: every 16-bit
// pattern widened, and a sweep of float32 bit patterns (and some float64
// ones) narrowed.
KR_TEST(ConvertBufferMatchesScalarConversions) {
  std::vector<uint16_t> halves(1 << 16);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<float> floats;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 1021) {
    floats.push_back(FloatFromBits(static_cast<uint32_t>(bits)));
  }
  std::vector<double> doubles(floats.begin(), floats.end());
  for (double& d : doubles) d = std::nextafter(d, 0.0);  // between two floats, mostly
  for (KernelLevel level : {KernelLevel::kGeneric, KernelLevel::kAvx2, KernelLevel::kAvx512}) {
    if (Skipped(level)) continue;
    const std::string at = std::string(" at level ") + KernelLevelName(level);
    struct Pair {
      DataType dtype;
      uint16_t (*narrow)(float);
      float (*widen)(uint16_t);
    };
    for (const Pair& p : {Pair{DataType::kFloat16, FloatToHalf, HalfToFloat},
                          Pair{DataType::kBFloat16, FloatToBFloat16, BFloat16ToFloat}}) {
      const std::string name = keras_ring::DataTypeName(p.dtype) + at;
      std::vector<float> wide(halves.size()), want_wide(halves.size());
      ConvertBuffer(wide.data(), DataType::kFloat32, halves.data(), p.dtype, halves.size(), level);
      for (size_t i = 0; i < halves.size(); ++i) want_wide[i] = p.widen(halves[i]);
      SameBits(wide, want_wide, "widening " + name);
      std::vector<uint16_t> narrow(floats.size()), want_narrow(floats.size());
      ConvertBuffer(narrow.data(), p.dtype, floats.data(), DataType::kFloat32, floats.size(),
                    level);
      for (size_t i = 0; i < floats.size(); ++i) want_narrow[i] = p.narrow(floats[i]);
      SameBits(narrow, want_narrow, "narrowing float32 to " + name);
      ConvertBuffer(narrow.data(), p.dtype, doubles.data(), DataType::kFloat64, doubles.size(),
                    level);
      for (size_t i = 0; i < doubles.size(); ++i) {
        want_narrow[i] = p.narrow(static_cast<float>(doubles[i]));
      }
      SameBits(narrow, want_narrow, "narrowing float64 to " + name);
    }
  }
}

KR_TEST(KernelLevelsParseAndRefuseWhatTheCpuLacks) {
  for (KernelLevel level : {KernelLevel::kGeneric, KernelLevel::kAvx2, KernelLevel::kAvx512}) {
    char* end = nullptr;
    const char* name = KernelLevelName(level);
    KR_EXPECT(keras_ring::ParseKernelLevel(name, &end) == level && *end == '\0');
    if (!CpuSupports(level)) {
      KR_EXPECT_THROW(keras_ring::UseKernelLevel(level), EngineError,
                      std::string("cannot use the ") + name + " kernels here");
      float x = 1;
      KR_EXPECT_THROW(ReduceInto(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum, level),
                      EngineError, "this machine can run generic");
    }
  }
  char* end = nullptr;
  const char* text = "avx";
  keras_ring::ParseKernelLevel(text, &end);
  KR_EXPECT(end == text);
  KR_EXPECT(CpuSupports(KernelLevel::kGeneric));
  KR_EXPECT(CpuSupports(keras_ring::BestKernelLevel()));
  KR_EXPECT(keras_ring::KernelLevelInUse() == keras_ring::BestKernelLevel());
  const KernelLevel best = keras_ring::BestKernelLevel();
  keras_ring::UseKernelLevel(KernelLevel::kGeneric);
  KR_EXPECT(keras_ring::KernelLevelInUse() == KernelLevel::kGeneric);
  keras_ring::UseKernelLevel(best);
}

KR_TEST(ConvertBufferRefusesOtherPairs) {
  float f = 1;
  int32_t i = 1;
  uint16_t h = 0;
  KR_EXPECT_THROW(ConvertBuffer(&h, DataType::kFloat16, &i, DataType::kInt32, 1), EngineError,
                  "int32 to float16");
  KR_EXPECT_THROW(ConvertBuffer(&f, DataType::kFloat32, &f, DataType::kFloat32, 1), EngineError,
                  "float32 to float32");
  KR_EXPECT_THROW(ConvertBuffer(&h, DataType::kBFloat16, &h, DataType::kFloat16, 1), EngineError,
                  "between float32 or float64 and float16 or bfloat16");
  KR_EXPECT_THROW(ConvertBuffer(&h, static_cast<DataType>(12), &f, DataType::kFloat32, 1),
                  EngineError, "no kernels for dtype 12");
}

}  // namespace
}  // namespace kr_test
