// InMemoryStore: the rendezvous store the TCP world's tests run on.
#include <chrono>
#include <thread>

#include "../core/common.h"
#include "../core/transport/tcp/store.h"
#include "harness.h"

namespace kr_test {
namespace {

using keras_ring::EngineError;
using keras_ring::InMemoryStore;
using std::chrono::milliseconds;

std::vector<char> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

KR_TEST(InMemoryStoreSetThenGet) {
  InMemoryStore store;
  store.Set("a", Bytes("one"));
  KR_EXPECT(store.Get("a", milliseconds(0)) == Bytes("one"));
  store.Set("a", Bytes("two"));
  KR_EXPECT(store.Get("a", milliseconds(0)) == Bytes("two"));
}

KR_TEST(InMemoryStoreGetWaitsForSet) {
  InMemoryStore store;
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(50));
    store.Set("later", Bytes("v"));
  });
  KR_EXPECT(store.Get("later", milliseconds(5000)) == Bytes("v"));
  setter.join();
}

KR_TEST(InMemoryStoreGetTimesOutNamingTheKey) {
  InMemoryStore store;
  const auto start = std::chrono::steady_clock::now();
  KR_EXPECT_THROW(store.Get("never", milliseconds(100)), EngineError,
                  "waited 100 ms for key 'never'");
  KR_EXPECT(std::chrono::steady_clock::now() - start >= milliseconds(100));
}

}  // namespace
}  // namespace kr_test
