// A minimal test harness: named test cases registered at static
// initialisation, checks that record a failure and keep going, and a main()
// that runs the cases (optionally filtered by substring) and ends with the
// line "N passed, M failed".
//
//   KR_TEST(ParsesEmptyInput) { KR_EXPECT_EQ(Parse("").size(), 0u); }
//
//   // Parameterised cases: a function that registers several at start-up.
//   KR_TEST_CASES(RegisterSizes) {
//     for (int n : {1, 2, 3}) kr_test::Register("sizes/" + std::to_string(n), [n] { ... });
//   }
#pragma once

#include <functional>
#include <sstream>
#include <string>
#include <type_traits>

namespace kr_test {

void Register(const std::string& name, std::function<void()> body);

// Records a failure of the running test case. Thread-safe, so rank threads
// may report too.
void RecordFailure(const char* file, int line, const std::string& message);

// Runs a registration function during static initialisation.
struct StaticRegistration {
  explicit StaticRegistration(void (*registrar)()) { registrar(); }
};

template <typename T>
std::string ToString(const T& v) {
  std::ostringstream s;
  if constexpr (sizeof(T) == 1 && std::is_integral_v<T>) {
    s << static_cast<int>(v);  // int8/uint8 as numbers, not characters
  } else {
    s.precision(17);
    s << v;
  }
  return s.str();
}

}  // namespace kr_test

#define KR_TEST_CASES(registrar)                                                      \
  static void registrar();                                                            \
  static const ::kr_test::StaticRegistration registrar##_registration(&registrar); \
  static void registrar()

#define KR_TEST(name)                                                             \
  static void name();                                                             \
  static const ::kr_test::StaticRegistration name##_registration(                 \
      [] { ::kr_test::Register(#name, &name); });                                 \
  static void name()

#define KR_FAIL(message) ::kr_test::RecordFailure(__FILE__, __LINE__, (message))

#define KR_EXPECT(cond)                             \
  do {                                              \
    if (!(cond)) KR_FAIL("expected " #cond);        \
  } while (0)

#define KR_EXPECT_EQ(a, b)                                                                 \
  do {                                                                                     \
    const auto& kr_a_ = (a);                                                               \
    const auto& kr_b_ = (b);                                                               \
    if (!(kr_a_ == kr_b_)) {                                                               \
      KR_FAIL("expected " #a " == " #b ", got " + ::kr_test::ToString(kr_a_) + " vs " +    \
              ::kr_test::ToString(kr_b_));                                                 \
    }                                                                                      \
  } while (0)

// Expects `statement` to throw `exception_type` whose what() contains `part`.
#define KR_EXPECT_THROW(statement, exception_type, part)                                  \
  do {                                                                                    \
    try {                                                                                 \
      statement;                                                                          \
      KR_FAIL("expected " #statement " to throw " #exception_type);                       \
    } catch (const exception_type& kr_e_) {                                               \
      if (std::string(kr_e_.what()).find(part) == std::string::npos) {                    \
        KR_FAIL("expected the error of " #statement " to mention \"" + std::string(part) + \
                "\", got: " + kr_e_.what());                                              \
      }                                                                                   \
    }                                                                                     \
  } while (0)
