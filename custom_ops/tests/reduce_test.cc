// Reduce and scale kernels against the scalar references of test_util.h, and
// the half conversions against known bit patterns and a slow reference.
#include <cstring>
#include <limits>
#include <vector>

#include "../core/reduce.h"
#include "harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::BFloat16ToFloat;
using keras_ring::EngineError;
using keras_ring::FloatToBFloat16;
using keras_ring::FloatToHalf;
using keras_ring::HalfToFloat;
using keras_ring::ReduceInto;
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
  KR_EXPECT_THROW(ReduceInto(&a, &b, 1, static_cast<DataType>(9), ReduceOp::kSum), EngineError,
                  "invalid dtype 9");
  KR_EXPECT_THROW(ScaleBuffer(&a, 1, static_cast<DataType>(-1), 2.0), EngineError,
                  "invalid dtype -1");
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

}  // namespace
}  // namespace kr_test
