#include "test_util.h"

#include <exception>
#include <thread>

#include "harness.h"

namespace kr_test {

double RefNarrowToDouble(uint16_t bits, int mantissa_bits, int exponent_bits) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int max_exponent = (1 << exponent_bits) - 1;
  const bool negative = (bits >> (mantissa_bits + exponent_bits)) & 1;
  const int exponent = (bits >> mantissa_bits) & max_exponent;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  double magnitude;
  if (exponent == max_exponent) {
    magnitude = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                              : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, 1 - bias - mantissa_bits);
  } else {
    magnitude = std::ldexp(mantissa + (1 << mantissa_bits), exponent - bias - mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

uint16_t RefDoubleToNarrow(double v, int mantissa_bits, int exponent_bits) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int max_exponent = (1 << exponent_bits) - 1;
  const int sign = std::signbit(v) ? 1 << (mantissa_bits + exponent_bits) : 0;
  const int infinity = sign | (max_exponent << mantissa_bits);
  if (std::isnan(v)) return static_cast<uint16_t>(infinity | (1 << (mantissa_bits - 1)));
  const double a = std::fabs(v);
  if (std::isinf(a)) return static_cast<uint16_t>(infinity);
  // Binade of the result: that of a, but not below the smallest normal's,
  // where the subnormals share its spacing.
  const int min_exponent = 1 - bias;
  int e = a == 0 ? min_exponent : std::max(std::ilogb(a), min_exponent);
  // Significand in units of the binade's last place; nearbyint rounds to
  // nearest even in the default rounding mode.
  double q = std::nearbyint(std::ldexp(a, mantissa_bits - e));
  if (q == std::ldexp(1.0, mantissa_bits + 1)) {  // rounded up into the next binade
    q /= 2;
    ++e;
  }
  if (e > bias) return static_cast<uint16_t>(infinity);
  const int implicit_bit = 1 << mantissa_bits;
  const int mantissa = static_cast<int>(q);
  if (mantissa < implicit_bit) return static_cast<uint16_t>(sign | mantissa);  // subnormal or 0
  return static_cast<uint16_t>(sign | ((e + bias) << mantissa_bits) | (mantissa - implicit_bit));
}

uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b * 0xbf58476d1ce4e5b9ull + c * 0x94d049bb133111ebull +
               0x2545f4914f6cdd1dull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Unit(uint64_t hash) { return static_cast<double>(hash >> 11) * 0x1.0p-53; }

void RunRanks(int size, const std::function<void(keras_ring::Transport&)>& body,
              keras_ring::InProcessStats* stats, std::chrono::milliseconds timeout) {
  keras_ring::InProcessWorld world(size, timeout);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&world, &body, r] {
      try {
        std::unique_ptr<keras_ring::Transport> transport = world.Connect(r);
        body(*transport);
      } catch (const std::exception& e) {
        KR_FAIL("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (stats) *stats = world.stats();
}

}  // namespace kr_test
