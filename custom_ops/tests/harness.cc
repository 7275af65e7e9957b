#include "harness.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace kr_test {
namespace {

struct TestCase {
  std::string name;
  std::function<void()> body;
};

// Function-local so that registration from other translation units' static
// initialisers finds it constructed.
std::vector<TestCase>& Registry() {
  static std::vector<TestCase> registry;
  return registry;
}

// Only failures are printed, and only the first few per case: one broken
// kernel would otherwise flood the log with a line per element.
constexpr int kMaxReportedFailures = 10;

std::mutex failures_mu;
int current_failures = 0;  // of the running case, guarded by failures_mu
const std::string* current_name = nullptr;

}  // namespace

void Register(const std::string& name, std::function<void()> body) {
  Registry().push_back({name, std::move(body)});
}

void RecordFailure(const char* file, int line, const std::string& message) {
  std::lock_guard<std::mutex> lock(failures_mu);
  if (++current_failures <= kMaxReportedFailures) {
    std::printf("FAIL %s\n  %s:%d: %s\n", current_name ? current_name->c_str() : "?", file, line,
                message.c_str());
    std::fflush(stdout);
  }
}

}  // namespace kr_test

int main(int argc, char** argv) {
  using kr_test::Registry;
  // Arguments: substrings; a case runs if its name contains any of them.
  // -v prints every case with its time, -l lists the cases. "-s K/N" runs
  // shard K of N: the K-th of every N selected cases, so that N processes
  // share the cases (their sizes interleaved) on N cores.
  bool verbose = false, list = false;
  int shard = 0, shards = 1;
  std::vector<std::string> filters;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) {
      verbose = true;
    } else if (std::strcmp(argv[i], "-l") == 0) {
      list = true;
    } else if (std::strcmp(argv[i], "-s") == 0) {
      const char* value = ++i < argc ? argv[i] : "nothing";
      if (std::sscanf(value, "%d/%d", &shard, &shards) != 2 || shards < 1 || shard < 0 ||
          shard >= shards) {
        std::fprintf(stderr, "-s takes K/N with 0 <= K < N, not %s\n", value);
        return 2;
      }
    } else {
      filters.emplace_back(argv[i]);
    }
  }

  int passed = 0, failed = 0, selected_count = 0;
  for (const kr_test::TestCase& test : Registry()) {
    bool selected = filters.empty();
    for (const std::string& f : filters) selected |= test.name.find(f) != std::string::npos;
    if (!selected || selected_count++ % shards != shard) continue;
    if (list) {
      std::printf("%s\n", test.name.c_str());
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(kr_test::failures_mu);
      kr_test::current_failures = 0;
      kr_test::current_name = &test.name;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      test.body();
    } catch (const std::exception& e) {
      KR_FAIL(std::string("uncaught exception: ") + e.what());
    } catch (...) {
      KR_FAIL("uncaught exception of unknown type");
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    int failures;
    {
      std::lock_guard<std::mutex> lock(kr_test::failures_mu);
      failures = kr_test::current_failures;
    }
    if (failures > kr_test::kMaxReportedFailures) {
      std::printf("  ... %d more failures in %s\n", failures - kr_test::kMaxReportedFailures,
                  test.name.c_str());
    }
    (failures == 0 ? passed : failed)++;
    if (verbose) {
      std::printf("%-4s %-60s %8.3f s\n", failures == 0 ? "ok" : "FAIL", test.name.c_str(),
                  seconds);
    }
    std::fflush(stdout);
  }
  if (list) return 0;
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
