// InMemoryStore, the rendezvous store the TCP world's tests run on, and
// TcpStoreClient against the launcher's real server (keras_ring/core/_rendezvous.py,
// run by python3 as a script), so that both ends of the protocol meet.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "../core/common.h"
#include "../core/transport/tcp/store.h"
#include "../core/transport/tcp/tcp_world.h"
#include "harness.h"

namespace kr_test {
namespace {

using keras_ring::EngineError;
using keras_ring::InMemoryStore;
using keras_ring::TcpStoreClient;
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

// Found from this file's path, which CMake gives as an absolute one.
std::string ServerScript() {
  const std::string source = __FILE__;
  return source.substr(0, source.rfind('/')) + "/../../keras_ring/core/_rendezvous.py";
}

// The server of keras_ring/core/_rendezvous.py in a child process, for one test.
class RendezvousServerProcess {
 public:
  explicit RendezvousServerProcess(const std::string& secret_hex) {
    const std::string script = ServerScript();
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) throw EngineError("pipe() failed");
    setenv("KERAS_RING_SECRET", secret_hex.c_str(), 1);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      execlp("python3", "python3", "-I", script.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    stdin_ = to_child[1];
    // Its first line is its address; a closed pipe means it failed to start.
    char c;
    while (read(from_child[0], &c, 1) == 1 && c != '\n') address_ += c;
    close(from_child[0]);
  }
  ~RendezvousServerProcess() {
    close(stdin_);  // the server stops when its stdin closes
    int status;
    waitpid(pid_, &status, 0);
  }
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  std::string address_;
};

const char kSecretHex[] = "6b657261732072696e67";  // kSecret
const std::string kSecret = "keras ring";

KR_TEST(TcpStoreClientAgainstRendezvousServer) {
  RendezvousServerProcess server(kSecretHex);
  if (server.address().empty()) {
    KR_FAIL("python3 " + ServerScript() + " did not start");
    return;
  }
  TcpStoreClient client(server.address(), kSecret, "rank 0", milliseconds(10000));
  client.Set("a", Bytes("one"));
  KR_EXPECT(client.Get("a", milliseconds(0)) == Bytes("one"));
  client.Set("empty", {});
  KR_EXPECT(client.Get("empty", milliseconds(0)).empty());
  std::thread setter([&] {
    TcpStoreClient other(server.address(), kSecret, "rank 1", milliseconds(10000));
    std::this_thread::sleep_for(milliseconds(50));
    other.Set("later", Bytes("v"));
  });
  KR_EXPECT(client.Get("later", milliseconds(10000)) == Bytes("v"));
  setter.join();
  KR_EXPECT_THROW(client.Get("never", milliseconds(200)), EngineError,
                  "waited 200 ms for key 'never' in the rendezvous store at " + server.address());
  KR_EXPECT_THROW(TcpStoreClient(server.address(), "another job's", "rank 2", milliseconds(10000)),
                  EngineError, "refused this job's secret");
  // The client still works after the server refused another.
  KR_EXPECT(client.Get("a", milliseconds(0)) == Bytes("one"));
}

// A TCP world whose ranks meet through the real server.
KR_TEST(TcpWorldThroughRendezvousServer) {
  RendezvousServerProcess server(kSecretHex);
  if (server.address().empty()) {
    KR_FAIL("python3 " + ServerScript() + " did not start");
    return;
  }
  auto rank = [&](int r) {
    try {
      TcpStoreClient store(server.address(), kSecret, "rank " + std::to_string(r),
                           milliseconds(10000));
      keras_ring::TcpWorldOptions o;
      o.rank = r;
      o.size = 2;
      o.store = &store;
      o.secret = kSecret;
      o.timeout = milliseconds(10000);
      keras_ring::TcpWorld world(o);
      std::unique_ptr<keras_ring::Transport> t = world.Connect({0, 1}, 0);
      int32_t mine = 10 + r, theirs = 0;
      keras_ring::PendingPtr send = t->Isend(&mine, sizeof(mine), 1 - r, 0);
      t->Recv(&theirs, sizeof(theirs), 1 - r, 0);
      send->Wait();
      KR_EXPECT_EQ(theirs, 11 - r);
      keras_ring::AllAgree(*t, true);  // neither world goes before the other is done
    } catch (const std::exception& e) {
      KR_FAIL("rank " + std::to_string(r) + " threw: " + e.what());
    }
  };
  std::thread rank1(rank, 1);
  rank(0);
  rank1.join();
}

}  // namespace
}  // namespace kr_test
