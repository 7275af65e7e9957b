// Test-side references, written independently of the code under test:
// narrow-float conversions via ldexp/nearbyint, scalar reduce and scale
// semantics, deterministic inputs, and ranks run as threads.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/common.h"
#include "../core/transport/inprocess_transport.h"
#include "../core/transport/transport.h"

namespace kr_test {

using keras_ring::DataType;
using keras_ring::ReduceOp;

// Narrow IEEE-style floats (float16: 10 mantissa and 5 exponent bits;
// bfloat16: 7 and 8), decoded and rounded (to nearest even) the slow way.
double RefNarrowToDouble(uint16_t bits, int mantissa_bits, int exponent_bits);
uint16_t RefDoubleToNarrow(double v, int mantissa_bits, int exponent_bits);

// What a test needs to know of a dtype: its storage and its values as double.
template <typename S, DataType D, int kMantissaBits = 0, int kExponentBits = 0>
struct Dtype {
  using Storage = S;
  static constexpr DataType kType = D;
  static constexpr bool kNarrowFloat = kMantissaBits > 0;
  static constexpr bool kInteger = std::is_integral_v<S> && !kNarrowFloat;

  static double ToDouble(S v) {
    if constexpr (kNarrowFloat) {
      // Tabulated: the references decode millions of values.
      static const std::vector<double> table = [] {
        std::vector<double> t(1 << 16);
        for (size_t bits = 0; bits < t.size(); ++bits) {
          t[bits] = RefNarrowToDouble(static_cast<uint16_t>(bits), kMantissaBits, kExponentBits);
        }
        return t;
      }();
      return table[v];
    } else {
      return static_cast<double>(v);
    }
  }
  // Rounds to nearest; integers must be in range.
  static S FromDouble(double v) {
    if constexpr (kNarrowFloat) {
      return RefDoubleToNarrow(v, kMantissaBits, kExponentBits);
    } else {
      return static_cast<S>(v);
    }
  }
  // Relative rounding unit (distance from 1 to the next value).
  static double Epsilon() {
    if constexpr (kNarrowFloat) {
      return std::ldexp(1.0, -kMantissaBits);
    } else {
      return std::numeric_limits<S>::epsilon();
    }
  }
  static double DenormMin() {
    if constexpr (kNarrowFloat) {
      return std::ldexp(1.0, 2 - (1 << (kExponentBits - 1)) - kMantissaBits);
    } else {
      return std::numeric_limits<S>::denorm_min();
    }
  }
};

using Float16 = Dtype<uint16_t, DataType::kFloat16, 10, 5>;
using BFloat16 = Dtype<uint16_t, DataType::kBFloat16, 7, 8>;
using Float32 = Dtype<float, DataType::kFloat32>;
using Float64 = Dtype<double, DataType::kFloat64>;
using Int8 = Dtype<int8_t, DataType::kInt8>;
using UInt8 = Dtype<uint8_t, DataType::kUInt8>;
using Int32 = Dtype<int32_t, DataType::kInt32>;
using Int64 = Dtype<int64_t, DataType::kInt64>;

template <typename F>
void ForEachDtype(F&& f) {
  f(Float16{});
  f(BFloat16{});
  f(Float32{});
  f(Float64{});
  f(Int8{});
  f(UInt8{});
  f(Int32{});
  f(Int64{});
}

constexpr ReduceOp kAllOps[] = {ReduceOp::kAverage, ReduceOp::kSum, ReduceOp::kMin,
                                ReduceOp::kMax, ReduceOp::kProduct};

// ScaleBuffer's documented semantics for one element: half types in float32,
// the others in double; integers truncate toward zero and saturate, NaN -> 0.
template <typename D>
typename D::Storage RefScale(typename D::Storage x, double factor) {
  using S = typename D::Storage;
  if (factor == 1.0) return x;
  if constexpr (D::kNarrowFloat) {
    return D::FromDouble(static_cast<float>(D::ToDouble(x)) * static_cast<float>(factor));
  } else if constexpr (D::kInteger) {
    const double v = std::trunc(static_cast<double>(x) * factor);
    if (std::isnan(v)) return 0;
    if (v <= static_cast<double>(std::numeric_limits<S>::min())) {
      return std::numeric_limits<S>::min();
    }
    if (v >= std::ldexp(1.0, std::numeric_limits<S>::digits)) return std::numeric_limits<S>::max();
    return static_cast<S>(v);
  } else if constexpr (std::is_same_v<S, float>) {
    return x * static_cast<float>(factor);
  } else {
    return static_cast<S>(static_cast<double>(x) * factor);
  }
}

// Min/Max that propagate NaN, like numpy.minimum/maximum.
template <typename T>
T RefMinMax(T a, T b, ReduceOp op) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
  }
  return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
}

// Integer Sum/Product modulo 2^bits, as NumPy does: accumulated modulo 2^64,
// which reduces to the same value modulo 2^bits.
template <typename S>
uint64_t RefWrap(uint64_t acc, S v, ReduceOp op) {
  const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(v));
  return op == ReduceOp::kProduct ? acc * u : acc + u;
}

// ReduceInto's documented semantics for one element pair (op != Average).
template <typename D>
typename D::Storage RefReduce(typename D::Storage a, typename D::Storage b, ReduceOp op) {
  using S = typename D::Storage;
  if constexpr (D::kInteger) {
    if (op == ReduceOp::kMin || op == ReduceOp::kMax) return RefMinMax(a, b, op);
    const uint64_t start = op == ReduceOp::kProduct ? 1 : 0;
    return static_cast<S>(RefWrap(RefWrap(start, a, op), b, op));
  } else {
    // float32 arithmetic for float32 and the half types.
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const C x = static_cast<C>(D::ToDouble(a));
    const C y = static_cast<C>(D::ToDouble(b));
    C r;
    switch (op) {
      case ReduceOp::kSum: r = x + y; break;
      case ReduceOp::kProduct: r = x * y; break;
      default: r = RefMinMax(x, y, op); break;
    }
    return D::FromDouble(r);
  }
}

// Equal values, both NaN, or (floats) within tol.
template <typename D>
bool Matches(typename D::Storage got, typename D::Storage want, double tol = 0) {
  if constexpr (D::kInteger) {
    return got == want;
  } else {
    const double g = D::ToDouble(got), w = D::ToDouble(want);
    if (std::isnan(w) || std::isnan(g)) return std::isnan(w) && std::isnan(g);
    if (std::isinf(w)) return g == w;
    return std::fabs(g - w) <= tol;
  }
}

template <typename D>
std::string ValueString(typename D::Storage v) {
  if constexpr (D::kInteger) {
    return std::to_string(static_cast<int64_t>(v));
  } else {
    return std::to_string(D::ToDouble(v));
  }
}

// Deterministic hash of a few integers (SplitMix64 finaliser).
uint64_t Mix(uint64_t a, uint64_t b = 0, uint64_t c = 0);
// Uniform in [0, 1) from a hash.
double Unit(uint64_t hash);

// Rank `rank`'s distinct input. Floats stay in ranges where the reduction of
// five ranks neither overflows nor underflows, and carry NaN and infinities
// at fixed places; integers take every bit pattern, so Sum and Product wrap.
template <typename D>
std::vector<typename D::Storage> RankInput(size_t count, int rank, int size, ReduceOp op) {
  using S = typename D::Storage;
  std::vector<S> v(count);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t h = Mix(rank, i, static_cast<uint64_t>(op));
    if constexpr (D::kInteger) {
      v[i] = static_cast<S>(h);
    } else if (op == ReduceOp::kProduct) {
      const double magnitude = 0.5 + 1.5 * Unit(h);
      v[i] = D::FromDouble((h & 1) ? -magnitude : magnitude);
    } else {
      v[i] = D::FromDouble(Unit(h) * 8.0 - 4.0);
    }
  }
  if constexpr (!D::kInteger) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    if (rank == 0 && count > 5) {
      v[3] = D::FromDouble(nan);
      v[5] = D::FromDouble(inf);
    }
    if (rank == size - 1 && count > 6) {
      v[4] = D::FromDouble(nan);
      v[6] = D::FromDouble(-inf);
    }
  }
  return v;
}

template <typename D>
struct Expected {
  std::vector<typename D::Storage> values;
  std::vector<double> tolerance;  // absolute, per element
};

// The serial reference. Integer results and Min/Max are exact, since their
// arithmetic does not depend on the order. Float Sum and Product are
// computed in double and allowed the rounding of p + 1 operations in the
// dtype (p - 1 reductions, the post-scale and the reference's own rounding);
// the prescaled inputs are rounded exactly as the kernels round them.
template <typename D>
Expected<D> ReferenceAllreduce(const std::vector<std::vector<typename D::Storage>>& inputs,
                               size_t count, ReduceOp op, double pre, double post) {
  using S = typename D::Storage;
  const int p = static_cast<int>(inputs.size());
  if (op == ReduceOp::kAverage) {
    op = ReduceOp::kSum;
    post *= 1.0 / p;
  }
  const bool min_max = op == ReduceOp::kMin || op == ReduceOp::kMax;
  Expected<D> e{std::vector<S>(count), std::vector<double>(count, 0.0)};
  for (size_t i = 0; i < count; ++i) {
    if constexpr (D::kInteger) {
      uint64_t acc = op == ReduceOp::kProduct ? 1 : 0;
      S m = RefScale<D>(inputs[0][i], pre);
      for (int r = 0; r < p; ++r) {
        const S v = RefScale<D>(inputs[r][i], pre);
        acc = RefWrap(acc, v, op);
        m = RefMinMax(m, v, op);
      }
      e.values[i] = RefScale<D>(min_max ? m : static_cast<S>(acc), post);
    } else if (min_max) {
      double m = D::ToDouble(RefScale<D>(inputs[0][i], pre));
      for (int r = 1; r < p; ++r) m = RefMinMax(m, D::ToDouble(RefScale<D>(inputs[r][i], pre)), op);
      e.values[i] = RefScale<D>(D::FromDouble(m), post);
    } else {
      double acc = op == ReduceOp::kProduct ? 1.0 : 0.0;
      double magnitude = 0.0;
      for (int r = 0; r < p; ++r) {
        const double v = D::ToDouble(RefScale<D>(inputs[r][i], pre));
        acc = op == ReduceOp::kProduct ? acc * v : acc + v;
        magnitude += std::fabs(v);
      }
      const double result = acc * post;
      e.values[i] = D::FromDouble(result);
      const double scale = op == ReduceOp::kProduct ? std::fabs(result) : magnitude * std::fabs(post);
      e.tolerance[i] = (p + 1) * D::Epsilon() * scale + p * D::DenormMin();
    }
  }
  return e;
}

// Scales that change every result: negative (swaps Min and Max), and for
// integers odd products that truncate.
template <typename D>
std::pair<double, double> NontrivialScales() {
  return D::kInteger ? std::make_pair(-3.0, 0.5) : std::make_pair(-0.5, 3.0);
}

// Runs body on `size` threads, each with the transport of one rank of a fresh
// in-process world. An exception on a rank is recorded as a failure naming
// the rank. If stats is given, it receives the world's traffic counters.
void RunRanks(int size, const std::function<void(keras_ring::Transport&)>& body,
              keras_ring::InProcessStats* stats = nullptr,
              std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace kr_test
