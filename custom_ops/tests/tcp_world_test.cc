// TcpWorld with threads as ranks over loopback, meeting through an
// InMemoryStore: the algorithms against serial references, groups, ordering,
// and the failures a job meets (mismatched sizes, a silent peer, a peer that
// goes, a connection without the secret).
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "../core/algorithms.h"
#include "../core/transport/tcp/handshake.h"
#include "../core/transport/tcp/socket.h"
#include "../core/transport/tcp/store.h"
#include "../core/transport/tcp/tcp_world.h"
#include "harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::AllgatherOptions;
using keras_ring::AllreduceOptions;
using keras_ring::AlltoallOptions;
using keras_ring::BroadcastOptions;
using keras_ring::Clock;
using keras_ring::EngineError;
using keras_ring::InMemoryStore;
using keras_ring::PeerLostError;
using keras_ring::TcpWorld;
using keras_ring::TcpWorldOptions;
using keras_ring::Transport;
using std::chrono::milliseconds;

const char kSecret[] = "the job's secret";

TcpWorldOptions Options(int rank, int size, InMemoryStore* store, milliseconds timeout) {
  TcpWorldOptions o;
  o.rank = rank;
  o.size = size;
  o.host = "localhost";
  o.store = store;
  o.secret = kSecret;
  o.timeout = timeout;
  return o;
}

std::vector<int> AllRanks(int size) {
  std::vector<int> all(size);
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// Lets threads go on only once all have arrived.
class Latch {
 public:
  explicit Latch(int count) : count_(count) {}
  void ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--count_ == 0) all_.notify_all();
    all_.wait(lock, [&] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable all_;
  int count_;
};

// Runs body on `size` threads, each with its rank's TcpWorld. The worlds are
// destroyed only once every body has returned, so that no rank's exit looks
// like a lost connection to another. An exception is a failure naming the rank.
void RunTcpRanks(int size, const std::function<void(TcpWorld&)>& body,
                 milliseconds timeout = milliseconds(10000)) {
  InMemoryStore store;
  Latch done(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<TcpWorld> world;
      try {
        world = std::make_unique<TcpWorld>(Options(r, size, &store, timeout));
        body(*world);
      } catch (const std::exception& e) {
        KR_FAIL("rank " + std::to_string(r) + " threw: " + e.what());
      }
      done.ArriveAndWait();
    });
  }
  for (std::thread& t : threads) t.join();
}

// Runs body with the transport of the whole world.
void RunTcpTransports(int size, const std::function<void(Transport&)>& body,
                      milliseconds timeout = milliseconds(10000)) {
  RunTcpRanks(
      size,
      [&](TcpWorld& world) {
        std::unique_ptr<Transport> t = world.Connect(AllRanks(size), 0);
        body(*t);
      },
      timeout);
}

std::vector<char> Pattern(size_t bytes, uint64_t a, uint64_t b = 0) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>(Mix(a, b, i / 8) >> (8 * (i % 8)));
  return v;
}

template <typename D>
void CheckTcpAllreduce(int p, size_t count, size_t segment_bytes) {
  using S = typename D::Storage;
  std::vector<std::vector<S>> buffers(p);
  for (int r = 0; r < p; ++r) buffers[r] = RankInput<D>(count, r, p, ReduceOp::kSum);
  const Expected<D> want = ReferenceAllreduce<D>(buffers, count, ReduceOp::kSum, 1.0, 1.0);
  RunTcpTransports(p, [&](Transport& t) {
    AllreduceOptions o;
    o.buffer = buffers[t.rank()].data();
    o.count = count;
    o.dtype = D::kType;
    o.op = ReduceOp::kSum;
    o.segment_bytes = segment_bytes;
    keras_ring::RingAllreduce(t, o);
  });
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < count; ++i) {
      if (!Matches<D>(buffers[r][i], want.values[i], want.tolerance[i])) {
        KR_FAIL("p=" + std::to_string(p) + " count=" + std::to_string(count) + " rank " +
                std::to_string(r) + " index " + std::to_string(i) + ": got " +
                ValueString<D>(buffers[r][i]) + ", want " + ValueString<D>(want.values[i]));
        break;
      }
    }
  }
}

void CheckTcpAllgather(int p) {
  std::vector<size_t> block_bytes(p);
  for (int r = 0; r < p; ++r) block_bytes[r] = r == 1 ? 0 : 100003 * (r + 1);
  const size_t total = std::accumulate(block_bytes.begin(), block_bytes.end(), size_t{0});
  std::vector<char> want;
  for (int r = 0; r < p; ++r) {
    const std::vector<char> block = Pattern(block_bytes[r], r);
    want.insert(want.end(), block.begin(), block.end());
  }
  std::vector<std::vector<char>> outputs(p, std::vector<char>(total));
  RunTcpTransports(p, [&](Transport& t) {
    const std::vector<char> mine = Pattern(block_bytes[t.rank()], t.rank());
    AllgatherOptions o;
    o.input = mine.data();
    o.output = outputs[t.rank()].data();
    o.block_bytes = block_bytes;
    o.segment_bytes = 65536;
    keras_ring::RingAllgather(t, o);
  });
  for (int r = 0; r < p; ++r) {
    if (outputs[r] != want) KR_FAIL("allgather: rank " + std::to_string(r) + " differs");
  }
}

void CheckTcpBroadcast(int p) {
  const size_t bytes = 300001;
  const std::vector<char> want = Pattern(bytes, 42);
  std::vector<std::vector<char>> buffers(p, std::vector<char>(bytes));
  buffers[p - 1] = want;
  RunTcpTransports(p, [&](Transport& t) {
    BroadcastOptions o;
    o.buffer = buffers[t.rank()].data();
    o.bytes = bytes;
    o.root = p - 1;
    o.segment_bytes = 65536;
    keras_ring::Broadcast(t, o);
  });
  for (int r = 0; r < p; ++r) {
    if (buffers[r] != want) KR_FAIL("broadcast: rank " + std::to_string(r) + " differs");
  }
}

void CheckTcpAlltoall(int p) {
  // Rank i sends SendBytes(i, j) to rank j, filled with Pattern(.., i, j).
  auto send_bytes = [](int i, int j) { return size_t(1000) * (i + 1) + 70001 * j; };
  std::vector<std::vector<char>> outputs(p);
  RunTcpTransports(p, [&](Transport& t) {
    const int me = t.rank();
    AlltoallOptions o;
    std::vector<char> input;
    for (int j = 0; j < p; ++j) {
      const std::vector<char> block = Pattern(send_bytes(me, j), me, j);
      input.insert(input.end(), block.begin(), block.end());
      o.send_bytes.push_back(send_bytes(me, j));
      o.recv_bytes.push_back(send_bytes(j, me));
    }
    outputs[me].resize(std::accumulate(o.recv_bytes.begin(), o.recv_bytes.end(), size_t{0}));
    o.input = input.data();
    o.output = outputs[me].data();
    o.segment_bytes = 65536;
    keras_ring::Alltoall(t, o);
  });
  for (int r = 0; r < p; ++r) {
    std::vector<char> want;
    for (int i = 0; i < p; ++i) {
      const std::vector<char> block = Pattern(send_bytes(i, r), i, r);
      want.insert(want.end(), block.begin(), block.end());
    }
    if (outputs[r] != want) KR_FAIL("alltoall: rank " + std::to_string(r) + " differs");
  }
}

KR_TEST_CASES(RegisterTcpAlgorithmTests) {
  for (int p : {2, 3}) {
    const std::string suffix = "/p" + std::to_string(p);
    Register("tcp_world/allreduce" + suffix, [p] {
      for (size_t count : {0, 1, 1001, 65537}) {
        CheckTcpAllreduce<Float32>(p, count, 4100);
        CheckTcpAllreduce<Int32>(p, count, 4100);
      }
      CheckTcpAllreduce<Float32>(p, (size_t(1) << 22) + 3, size_t(1) << 20);
    });
    Register("tcp_world/allgather" + suffix, [p] { CheckTcpAllgather(p); });
    Register("tcp_world/broadcast" + suffix, [p] { CheckTcpBroadcast(p); });
    Register("tcp_world/alltoall" + suffix, [p] { CheckTcpAlltoall(p); });
  }
}

KR_TEST(TcpWorldOfOneRank) {
  RunTcpTransports(1, [](Transport& t) {
    std::vector<int32_t> v = {1, 2, 3};
    AllreduceOptions o;
    o.buffer = v.data();
    o.count = v.size();
    o.dtype = keras_ring::DataType::kInt32;
    keras_ring::RingAllreduce(t, o);
    KR_EXPECT(v == std::vector<int32_t>({1, 2, 3}));
  });
}

KR_TEST(TcpWorldChecksItsOptions) {
  InMemoryStore store;
  TcpWorldOptions o = Options(0, 2, &store, milliseconds(1000));
  o.secret = "";
  KR_EXPECT_THROW(TcpWorld{o}, EngineError, "the job's secret, got an empty one");
  o = Options(0, 2, nullptr, milliseconds(1000));
  KR_EXPECT_THROW(TcpWorld{o}, EngineError, "a store to find the other ranks through");
  o = Options(0, 2, &store, milliseconds(1000));
  o.listen_host = "0.0.0.0";
  KR_EXPECT_THROW(TcpWorld{o}, EngineError, "that the other ranks can reach");
  o = Options(2, 2, &store, milliseconds(1000));
  KR_EXPECT_THROW(TcpWorld{o}, EngineError, "got rank 2 of 2");
}

// A rank that never comes: the bootstrap fails within the timeout, naming it.
KR_TEST(TcpWorldBootstrapTimesOutNamingTheMissingRank) {
  InMemoryStore store, empty;
  const auto start = Clock::now();
  KR_EXPECT_THROW(TcpWorld(Options(0, 2, &store, milliseconds(300))), PeerLostError,
                  "rank 0 waited 300 ms for rank 1 to connect to it");
  KR_EXPECT_THROW(TcpWorld(Options(2, 3, &empty, milliseconds(300))), PeerLostError,
                  "rank 2 could not connect to rank 0 within 300 ms");
  KR_EXPECT(Clock::now() - start < milliseconds(3000));
}

// Groups share the world's connections, each with its own tags.
KR_TEST(TcpWorldConnectGroups) {
  RunTcpRanks(3, [](TcpWorld& world) {
    const int me = world.rank();
    auto sum_over = [&](const std::vector<int>& group, uint32_t id) {
      std::unique_ptr<Transport> t = world.Connect(group, id);
      int64_t v = int64_t{1} << (8 * me);
      AllreduceOptions o;
      o.buffer = &v;
      o.count = 1;
      o.dtype = keras_ring::DataType::kInt64;
      keras_ring::RingAllreduce(*t, o);
      return v;
    };
    KR_EXPECT_EQ(sum_over({0, 1, 2}, 0), int64_t{0x010101});
    if (me != 1) KR_EXPECT_EQ(sum_over({0, 2}, 1), int64_t{0x010001});
    if (me != 0) KR_EXPECT_EQ(sum_over({1, 2}, 2), int64_t{0x010100});
    std::unique_ptr<Transport> all = world.Connect({0, 1, 2}, 7);
    KR_EXPECT(keras_ring::AllAgree(*all, true));
    KR_EXPECT(!keras_ring::AllAgree(*all, me != 2));
  });
}

// Receives of one tag taken in order while the other tag's frames pile up
// unexpected, some of them arriving as their receive is posted.
KR_TEST(TcpWorldKeepsOrderPerTag) {
  constexpr int kMessages = 40;
  auto bytes_of = [](int tag, int i) { return size_t(i * 37397 + tag * 1001) % 300007; };
  RunTcpTransports(2, [&](Transport& t) {
    if (t.rank() == 0) {
      std::vector<std::vector<char>> data;
      std::vector<keras_ring::PendingPtr> sends;
      for (int i = 0; i < kMessages; ++i) {
        for (int tag : {2, 3}) {
          data.push_back(Pattern(bytes_of(tag, i), tag, i));
          sends.push_back(t.Isend(data.back().data(), data.back().size(), 1, tag));
        }
      }
      for (auto& s : sends) s->Wait();
      return;
    }
    for (int tag : {3, 2}) {
      std::vector<std::vector<char>> got(kMessages);
      std::vector<keras_ring::PendingPtr> receives;
      for (int i = 0; i < kMessages; ++i) {
        got[i].resize(bytes_of(tag, i));
        receives.push_back(t.Irecv(got[i].data(), got[i].size(), 0, tag));
      }
      for (int i = 0; i < kMessages; ++i) {
        receives[i]->Wait();
        if (got[i] != Pattern(bytes_of(tag, i), tag, i)) {
          KR_FAIL("tag " + std::to_string(tag) + " message " + std::to_string(i) + " differs");
        }
      }
    }
  });
}

KR_TEST(TcpWorldByteCountMismatch) {
  RunTcpTransports(2, [](Transport& t) {
    if (t.rank() == 0) {
      const std::vector<char> sixteen(16, 'x');
      const int32_t after = 1234;
      t.Send(sixteen.data(), sixteen.size(), 1, 1);
      t.Send(&after, sizeof(after), 1, 2);
      return;
    }
    std::vector<char> eight(8);
    // A bug of the job, which no new world would mend: not a lost peer.
    try {
      t.Recv(eight.data(), eight.size(), 0, 1);
      KR_FAIL("expected a receive of 8 bytes to fail against a send of 16");
    } catch (const PeerLostError& e) {
      KR_FAIL(std::string("a byte count mismatch was reported as a lost peer: ") + e.what());
    } catch (const EngineError& e) {
      KR_EXPECT(std::string(e.what()).find("posted a receive of 8 bytes from rank 0 (tag 1) "
                                           "but the matching send has 16 bytes") !=
                std::string::npos);
    }
    int32_t after = 0;
    t.Recv(&after, sizeof(after), 0, 2);
    KR_EXPECT_EQ(after, 1234);
  });
}

KR_TEST(TcpWorldReceiveTimesOutNamingThePeer) {
  RunTcpRanks(
      2,
      [](TcpWorld& world) {
        if (world.rank() == 0) return;
        std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
        int32_t v;
        const auto start = Clock::now();
        // The group's tag 2 is the world's tag 2 for group id 0.
        KR_EXPECT_THROW(t->Recv(&v, sizeof(v), 0, 2), PeerLostError,
                        "rank 1 waited 300 ms for a message of 4 bytes from rank 0 (tag 2) that "
                        "never came");
        const auto waited = Clock::now() - start;
        KR_EXPECT(waited >= milliseconds(300) && waited < milliseconds(2000));
      },
      milliseconds(300));
}

KR_TEST(TcpWorldSendTimesOutNamingThePeer) {
  RunTcpRanks(
      2,
      [](TcpWorld& world) {
        if (world.rank() == 1) return;  // never reads: the socket buffers fill
        std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
        const std::vector<char> big(size_t(64) << 20);
        const auto start = Clock::now();
        KR_EXPECT_THROW(t->Send(big.data(), big.size(), 1, 3), EngineError,
                        "rank 0 waited 300 ms for rank 1 to take a message of 67108864 bytes "
                        "(tag 3)");
        KR_EXPECT(Clock::now() - start < milliseconds(2000));
      },
      milliseconds(300));
}

// A rank whose world goes while another waits for it: every wait involving
// it fails at once, naming it, well before the timeout.
KR_TEST(TcpWorldPeerLostMidWait) {
  InMemoryStore store;
  const milliseconds timeout(20000);
  std::thread rank0([&] {
    try {
      TcpWorld world(Options(0, 2, &store, timeout));
      std::this_thread::sleep_for(milliseconds(200));
    } catch (const std::exception& e) {
      KR_FAIL(std::string("rank 0 threw: ") + e.what());
    }
  });
  try {
    TcpWorld world(Options(1, 2, &store, timeout));
    std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
    const std::vector<char> big(size_t(64) << 20);
    keras_ring::PendingPtr send = t->Isend(big.data(), big.size(), 0, 1);
    int32_t v;
    const auto start = Clock::now();
    KR_EXPECT_THROW(t->Recv(&v, sizeof(v), 0, 2), PeerLostError, "rank 0's connection was lost");
    KR_EXPECT(Clock::now() - start < milliseconds(5000));
    KR_EXPECT_THROW(send->Wait(), PeerLostError, "rank 0's connection was lost");
    KR_EXPECT_THROW(t->Send(&v, sizeof(v), 0, 2), PeerLostError, "rank 0's connection was lost");
    int from;
    std::vector<char> message;
    KR_EXPECT_THROW(world.Receive(&from, &message), PeerLostError, "rank 0's connection was lost");
    KR_EXPECT_THROW(world.Post(0, std::make_shared<std::vector<char>>(3)), PeerLostError,
                    "rank 0's connection was lost");
  } catch (const std::exception& e) {
    KR_FAIL(std::string("rank 1 threw: ") + e.what());
  }
  rank0.join();
}

// A rank whose engine failed says goodbye: the peer waiting on it fails at
// once, with the reason.
KR_TEST(TcpWorldPeerThatSaysGoodbyeIsLostWithItsReason) {
  InMemoryStore store;
  const milliseconds timeout(20000);
  std::thread rank0([&] {
    try {
      TcpWorld world(Options(0, 2, &store, timeout));
      std::this_thread::sleep_for(milliseconds(100));
      world.Abort("keras-ring: its engine failed (test)");
      std::this_thread::sleep_for(milliseconds(300));  // the sockets outlive the goodbye
    } catch (const std::exception& e) {
      KR_FAIL(std::string("rank 0 threw: ") + e.what());
    }
  });
  try {
    TcpWorld world(Options(1, 2, &store, timeout));
    std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
    int32_t v;
    const auto start = Clock::now();
    KR_EXPECT_THROW(t->Recv(&v, sizeof(v), 0, 2), PeerLostError,
                    "rank 0's connection was lost (it left the job: keras-ring: its engine "
                    "failed (test))");
    KR_EXPECT(Clock::now() - start < milliseconds(5000));
  } catch (const std::exception& e) {
    KR_FAIL(std::string("rank 1 threw: ") + e.what());
  }
  rank0.join();
}

// The policy of every network world's waits, alone: a peer that answers gets
// one more timeout; one that does not is blamed after the answer wait.
KR_TEST(WaitOnPeerBlamesOnlyAPeerThatDoesNotAnswer) {
  using keras_ring::PeerWait;
  using keras_ring::WaitOnPeer;
  const milliseconds timeout(200);
  auto sleep_until = [](Clock::time_point t) {
    std::this_thread::sleep_until(t);
    return false;
  };
  int asked = 0;
  auto start = Clock::now();
  KR_EXPECT(WaitOnPeer(timeout, sleep_until, [&] { ++asked; }, [] { return false; }) ==
            PeerWait::kSilent);
  KR_EXPECT_EQ(asked, 1);
  KR_EXPECT(Clock::now() - start >= 2 * timeout);  // the answer wait is at most the timeout

  start = Clock::now();
  KR_EXPECT(WaitOnPeer(timeout, sleep_until, [] {}, [] { return true; }) ==
            PeerWait::kAnswering);
  KR_EXPECT(Clock::now() - start >= 2 * timeout);

  // Done while the answer is awaited, or in the extra timeout.
  const auto done_at = Clock::now() + timeout + timeout / 4;
  auto done_later = [&](Clock::time_point t) {
    if (t >= done_at) {
      std::this_thread::sleep_until(done_at);
      return true;
    }
    std::this_thread::sleep_until(t);
    return false;
  };
  KR_EXPECT(WaitOnPeer(timeout, done_later, [] {}, [] { return false; }) == PeerWait::kDone);
  KR_EXPECT(WaitOnPeer(timeout, [](Clock::time_point) { return true; }, [&] { ++asked; },
                       [] { return false; }) == PeerWait::kDone);
  KR_EXPECT_EQ(asked, 1);
}

// A chain of waits: rank 0 waits for rank 1, which waits for rank 2, which is
// stuck (its world never runs). Rank 1 blames rank 2 and leaves; rank 0, whose
// peer answered, is told so instead of blaming rank 1.
KR_TEST(TcpWorldBlamesTheStuckRankNotTheOneWaitingForIt) {
  const milliseconds timeout(2000);
  std::atomic<int> failed{0};
  RunTcpRanks(
      3,
      [&](TcpWorld& world) {
        const int me = world.rank();
        std::unique_ptr<Transport> t = world.Connect({0, 1, 2}, 0);
        if (me == 2) {
          const auto bound = Clock::now() + 3 * timeout;
          while (failed < 2 && Clock::now() < bound) std::this_thread::sleep_for(milliseconds(10));
          return;
        }
        int32_t v;
        try {
          t->Recv(&v, sizeof(v), me + 1, 1);
          KR_FAIL("rank " + std::to_string(me) + " received what was never sent");
        } catch (const EngineError& e) {
          const std::string what = e.what();
          KR_EXPECT(what.find("rank 2 is stuck or stopped (it does not answer)") !=
                    std::string::npos);
          if (me == 1) world.Abort(what);
          if (me == 0) KR_EXPECT(what.find("rank 1's connection was lost") != std::string::npos);
        }
        ++failed;
      },
      timeout);
}

// Control messages both ways, in order per sender, while data is in flight
// on the same connections.
KR_TEST(TcpWorldControlMessages) {
  constexpr int kPerPeer = 20;
  auto message_of = [](int from, int to, int k) {
    return Pattern(k == 3 ? 0 : size_t(k) * 5003, from, to * 1000 + k);
  };
  RunTcpRanks(3, [&](TcpWorld& world) {
    const int me = world.rank(), p = world.size();
    std::unique_ptr<Transport> t = world.Connect(AllRanks(p), 0);
    const std::vector<char> out = Pattern(size_t(4) << 20, me);
    std::vector<char> in(out.size());
    keras_ring::PendingPtr send = t->Isend(out.data(), out.size(), (me + 1) % p, 0);
    for (int k = 0; k < kPerPeer; ++k) {
      for (int j = 0; j < p; ++j) {
        if (j != me) world.Post(j, std::make_shared<std::vector<char>>(message_of(me, j, k)));
      }
    }
    world.Flush();
    std::vector<int> next(p, 0);
    int received = 0;
    const auto deadline = Clock::now() + milliseconds(10000);
    while (received < kPerPeer * (p - 1) && Clock::now() < deadline) {
      int from;
      std::vector<char> message;
      if (!world.Receive(&from, &message)) {
        world.Progress();
        std::this_thread::sleep_for(milliseconds(1));
        continue;
      }
      KR_EXPECT(from != me && from >= 0 && from < p);
      if (message != message_of(from, me, next[from])) {
        KR_FAIL("rank " + std::to_string(me) + ": control message " + std::to_string(next[from]) +
                " from rank " + std::to_string(from) + " differs");
      }
      ++next[from];
      ++received;
    }
    KR_EXPECT_EQ(received, kPerPeer * (p - 1));
    t->Recv(in.data(), in.size(), (me + p - 1) % p, 0);
    send->Wait();
    KR_EXPECT(in == Pattern(in.size(), (me + p - 1) % p));
  });
}

// One thread moves data while another posts and takes control messages on
// the same world: the world's state is shared under its lock.
KR_TEST(TcpWorldUsedFromTwoThreads) {
  constexpr int kRounds = 30, kMessages = 100;
  RunTcpRanks(2, [&](TcpWorld& world) {
    const int me = world.rank(), peer = 1 - me;
    std::thread control([&] {
      for (int k = 0; k < kMessages; ++k) {
        world.Post(peer, std::make_shared<std::vector<char>>(Pattern(k * 31, me, k)));
      }
      int next = 0;
      const auto deadline = Clock::now() + milliseconds(10000);
      while (next < kMessages && Clock::now() < deadline) {
        int from;
        std::vector<char> message;
        if (!world.Receive(&from, &message)) {
          std::this_thread::sleep_for(milliseconds(1));
          continue;
        }
        if (message != Pattern(next * 31, peer, next)) KR_FAIL("control message differs");
        ++next;
      }
      KR_EXPECT_EQ(next, kMessages);
      world.Flush();
    });
    std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
    for (int i = 0; i < kRounds; ++i) {
      const std::vector<char> out = Pattern(size_t(256) << 10, me, i);
      std::vector<char> in(out.size());
      keras_ring::PendingPtr send = t->Isend(out.data(), out.size(), peer, 0);
      t->Recv(in.data(), in.size(), peer, 0);
      send->Wait();
      if (in != Pattern(in.size(), peer, i)) KR_FAIL("data differs in round " + std::to_string(i));
    }
    control.join();
  });
}

// True if the other end closes or resets `fd` within a few seconds, whatever
// it sent first.
bool ClosedByPeer(int fd) {
  const auto deadline = Clock::now() + milliseconds(5000);
  char buf[256];
  while (Clock::now() < deadline) {
    try {
      keras_ring::ReadFully(fd, buf, 1, deadline, "anything");
    } catch (const EngineError& e) {
      return std::string(e.what()).find("timed out") == std::string::npos;
    }
  }
  return false;
}

// Connections without the secret, or with garbage, are refused while the
// world waits for its real peer, which then connects and works; one that
// says nothing does not hold the real peer up.
KR_TEST(TcpWorldRefusesConnectionsWithoutTheSecret) {
  InMemoryStore store;
  const milliseconds timeout(20000);
  std::thread rank0([&] {
    try {
      TcpWorld world(Options(0, 2, &store, timeout));
      std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
      int32_t v = 0;
      t->Recv(&v, sizeof(v), 1, 0);
      KR_EXPECT_EQ(v, 77);
      t->Send(&v, sizeof(v), 1, 0);
    } catch (const std::exception& e) {
      KR_FAIL(std::string("rank 0 threw: ") + e.what());
    }
  });
  const std::vector<char> value = store.Get("tcp_world/0", timeout);
  const keras_ring::HostPort address =
      keras_ring::ParseHostPort(std::string(value.begin(), value.end()), "rank 0's address");
  const auto deadline = Clock::now() + milliseconds(5000);
  keras_ring::Socket silent = keras_ring::ConnectBefore(address.host, address.port, deadline);
  {
    keras_ring::Socket s = keras_ring::ConnectBefore(address.host, address.port, deadline);
    KR_EXPECT_THROW(
        keras_ring::ConnectHandshake(s.fd(), "not the secret", 1, 0, 2, deadline), EngineError,
        "did it refuse ours?");
  }
  {
    keras_ring::Socket s = keras_ring::ConnectBefore(address.host, address.port, deadline);
    const std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(80, '\x7f');
    send(s.fd(), garbage.data(), garbage.size(), MSG_NOSIGNAL);
    KR_EXPECT(ClosedByPeer(s.fd()));
  }
  try {
    const auto start = Clock::now();
    TcpWorld world(Options(1, 2, &store, timeout));
    KR_EXPECT(Clock::now() - start < milliseconds(5000));
    // Rank 0 dropped the silent connection once its mesh was complete.
    KR_EXPECT(ClosedByPeer(silent.fd()));
    std::unique_ptr<Transport> t = world.Connect({0, 1}, 0);
    int32_t v = 77;
    t->Send(&v, sizeof(v), 0, 0);
    v = 0;
    t->Recv(&v, sizeof(v), 0, 0);
    KR_EXPECT_EQ(v, 77);
  } catch (const std::exception& e) {
    KR_FAIL(std::string("rank 1 threw: ") + e.what());
  }
  rank0.join();
}

}  // namespace
}  // namespace kr_test
