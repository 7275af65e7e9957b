// The shared-memory group: ranks as threads (or a forked process) of this
// machine, checked against the same serial reference as the ring.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>

#include "../core/algorithms.h"
#include "../core/shm.h"
#include "harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::EngineError;
using keras_ring::ShmAllreduceOptions;
using keras_ring::ShmGroup;
using keras_ring::ShmSpan;

// all_agree for threads: a barrier that ANDs what every thread passed.
class Agreement {
 public:
  explicit Agreement(int size) : size_(size) {}
  bool operator()(bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    all_ok_ = all_ok_ && ok;
    if (++arrived_ == size_) {
      result_ = all_ok_;
      all_ok_ = true;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    return result_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int size_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool all_ok_ = true, result_ = true;
};

std::string UniqueKey() {
  static int counter = 0;
  return std::to_string(getpid()) + "xtest" + std::to_string(counter++);
}

std::vector<int> WorldRanks(int p) {
  std::vector<int> ranks;
  for (int r = 0; r < p; ++r) ranks.push_back(10 + r);  // distinct from group ranks
  return ranks;
}

// Names in /dev/shm that start with kr-<key>.
std::vector<std::string> Leftovers(const std::string& key) {
  std::vector<std::string> found;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* e = readdir(dir)) {
      if (std::string(e->d_name).rfind("kr-" + key, 0) == 0) found.push_back(e->d_name);
    }
    closedir(dir);
  }
  return found;
}

// Runs body(group) on p threads sharing one freshly created group.
void RunShmRanks(int p, size_t slot_bytes, const std::function<void(ShmGroup&)>& body,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  Agreement agree(p);
  const std::string key = UniqueKey();
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::string why;
        std::unique_ptr<ShmGroup> g = ShmGroup::Create(
            r, WorldRanks(p), key, slot_bytes, [&](bool ok) { return agree(ok); }, &why,
            nullptr, timeout);
        if (!g) {
          KR_FAIL("rank " + std::to_string(r) + " could not create the group: " + why);
          return;
        }
        KR_EXPECT_EQ(g->size(), p);
        body(*g);
      } catch (const std::exception& e) {
        KR_FAIL("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  KR_EXPECT(Leftovers(key).empty());
}

// Cuts count elements into spans whose sizes depend on the rank (some empty).
template <typename S>
std::vector<ShmSpan> Spans(const std::vector<S>& in, std::vector<S>& out, int rank) {
  std::vector<ShmSpan> spans;
  size_t at = 0;
  for (int i = 0; at < in.size() || i == 0; ++i) {
    const size_t n = std::min(in.size() - at, size_t(Mix(rank, i) % 300));
    spans.push_back({in.data() + at, out.data() + at, n});
    at += n;
  }
  return spans;
}

enum class Layout { kInPlace, kSeparate, kSpans };

template <typename D>
void CheckShmAllreduce(int p, ReduceOp op, size_t count, double pre, double post,
                       size_t slot_bytes, Layout layout, size_t round_bytes = 0) {
  using S = typename D::Storage;
  std::vector<std::vector<S>> inputs(p), outputs(p);
  for (int r = 0; r < p; ++r) {
    inputs[r] = RankInput<D>(count, r, p, op);
    outputs[r].assign(count, S{});
  }
  const Expected<D> want = ReferenceAllreduce<D>(inputs, count, op, pre, post);
  const std::vector<std::vector<S>> original = inputs;

  RunShmRanks(p, slot_bytes, [&](ShmGroup& g) {
    const int r = g.rank();
    ShmAllreduceOptions o;
    if (layout == Layout::kInPlace) {
      o.spans = {{inputs[r].data(), inputs[r].data(), count}};
    } else if (layout == Layout::kSeparate) {
      o.spans = {{inputs[r].data(), outputs[r].data(), count}};
    } else {
      o.spans = Spans(inputs[r], outputs[r], r);
    }
    o.dtype = D::kType;
    o.op = op;
    o.prescale_factor = pre;
    o.postscale_factor = post;
    o.round_bytes = round_bytes;
    g.Allreduce(o);
  });

  const std::string context = "p=" + std::to_string(p) + " count=" + std::to_string(count) +
                              " pre=" + ToString(pre) + " post=" + ToString(post) +
                              " slot=" + std::to_string(slot_bytes) +
                              " round=" + std::to_string(round_bytes) +
                              " layout=" + std::to_string(static_cast<int>(layout)) + ": ";
  const auto& result = layout == Layout::kInPlace ? inputs : outputs;
  for (size_t i = 0; i < count; ++i) {
    if (!Matches<D>(result[0][i], want.values[i], want.tolerance[i])) {
      KR_FAIL(context + "rank 0 index " + std::to_string(i) + ": got " +
              ValueString<D>(result[0][i]) + ", want " + ValueString<D>(want.values[i]) +
              " +- " + ToString(want.tolerance[i]));
      break;
    }
  }
  for (int r = 0; r < p; ++r) {
    if (count > 0 && std::memcmp(result[r].data(), result[0].data(), count * sizeof(S)) != 0) {
      KR_FAIL(context + "rank " + std::to_string(r) + " differs from rank 0");
    }
    if (layout != Layout::kInPlace && count > 0 &&
        std::memcmp(inputs[r].data(), original[r].data(), count * sizeof(S)) != 0) {
      KR_FAIL(context + "rank " + std::to_string(r) + "'s input was changed");
    }
  }
}

KR_TEST_CASES(RegisterShmAllreduceTests) {
  ForEachDtype([](auto dtype) {
    using D = decltype(dtype);
    const std::string name = keras_ring::DataTypeName(D::kType);
    for (ReduceOp op : kAllOps) {
      for (int p = 1; p <= 4; ++p) {
        Register("shm_allreduce/" + name + "/" + keras_ring::ReduceOpName(op) + "/p" +
                     std::to_string(p),
                 [p, op] {
                   const auto [pre, post] = NontrivialScales<D>();
                   // 256-byte slots: many rounds, blocks of one cache line
                   // and empty blocks when a round is short.
                   for (size_t count : {0, 1, 7, 1001}) {
                     CheckShmAllreduce<D>(p, op, count, 1.0, 1.0, 256, Layout::kInPlace);
                     CheckShmAllreduce<D>(p, op, count, pre, post, 256, Layout::kSeparate);
                   }
                   CheckShmAllreduce<D>(p, op, 65537, pre, post, 4096, Layout::kSpans);
                   CheckShmAllreduce<D>(p, op, 65537, 1.0, 1.0, 1 << 20, Layout::kInPlace);
                   // Rounds smaller than a slot (not a multiple of a cache
                   // line), and a round asked larger than the slot.
                   CheckShmAllreduce<D>(p, op, 65537, pre, post, 1 << 20, Layout::kSpans, 300);
                   CheckShmAllreduce<D>(p, op, 5001, 1.0, 1.0, 4096, Layout::kSeparate, 1 << 20);
                 });
      }
    }
  });
  constexpr size_t kLarge = (size_t(1) << 22) + 3;
  for (int p : {2, 3}) {
    Register("shm_allreduce_large/float32/sum/p" + std::to_string(p), [p] {
      CheckShmAllreduce<Float32>(p, ReduceOp::kSum, kLarge, 1.0, 1.0, 1 << 20, Layout::kSpans);
    });
  }
}

// Hierarchical allreduce as the engine composes it: one group per pretended
// host, each rank's reduced block reduced across hosts by the ring among the
// ranks of the same local rank, Average as Sum scaled by 1 / (all ranks).
template <typename D>
void CheckHierarchical(int hosts, int local, ReduceOp op, size_t count, size_t slot_bytes) {
  using S = typename D::Storage;
  const int p = hosts * local;
  std::vector<std::vector<S>> buffers(p);
  for (int r = 0; r < p; ++r) buffers[r] = RankInput<D>(count, r, p, op);
  const Expected<D> want = ReferenceAllreduce<D>(buffers, count, op, 1.0, 1.0);
  std::vector<std::unique_ptr<Agreement>> agree;
  std::vector<std::string> keys;
  for (int h = 0; h < hosts; ++h) {
    agree.push_back(std::make_unique<Agreement>(local));
    keys.push_back(UniqueKey());
  }
  std::vector<keras_ring::InProcessWorld> cross;
  for (int l = 0; l < local; ++l) cross.emplace_back(hosts);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      const int h = r / local, l = r % local;
      try {
        auto g = ShmGroup::Create(l, WorldRanks(local), keys[h], slot_bytes,
                                  [&](bool ok) { return (*agree[h])(ok); }, nullptr);
        auto t = cross[l].Connect(h);
        ShmAllreduceOptions o;
        o.spans = {{buffers[r].data(), buffers[r].data(), count}};
        o.dtype = D::kType;
        o.op = op == ReduceOp::kAverage ? ReduceOp::kSum : op;
        o.postscale_factor = op == ReduceOp::kAverage ? 1.0 / p : 1.0;
        o.combine = [&](void* block, size_t n) {
          keras_ring::AllreduceOptions a;
          a.buffer = block;
          a.count = n;
          a.dtype = o.dtype;
          a.op = o.op;
          keras_ring::RingAllreduce(*t, a);
        };
        g->Allreduce(o);
      } catch (const std::exception& e) {
        KR_FAIL("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < count; ++i) {
      if (!Matches<D>(buffers[r][i], want.values[i], want.tolerance[i])) {
        KR_FAIL("hosts=" + std::to_string(hosts) + " local=" + std::to_string(local) +
                " count=" + std::to_string(count) + ": rank " + std::to_string(r) + " index " +
                std::to_string(i) + ": got " + ValueString<D>(buffers[r][i]) + ", want " +
                ValueString<D>(want.values[i]));
        break;
      }
    }
  }
}

KR_TEST_CASES(RegisterHierarchicalTests) {
  for (ReduceOp op : kAllOps) {
    Register(std::string("shm_hierarchical/float32/") + keras_ring::ReduceOpName(op), [op] {
      for (auto [hosts, local] : {std::pair{2, 2}, {3, 2}, {2, 3}}) {
        for (size_t count : {0, 1, 7, 1001, 70001}) {
          CheckHierarchical<Float32>(hosts, local, op, count, 4096);
        }
      }
    });
  }
  Register("shm_hierarchical/int64/sum", [] {
    CheckHierarchical<Int64>(2, 2, ReduceOp::kSum, 70001, 1024);
  });
}

// Compression: float32 data reduced as float16 or bfloat16 in the shared
// buffers. The result is what the narrow type's reduction of the rounded
// inputs gives, converted back exactly.
template <typename Narrow>
void CheckCompressedShmAllreduce(int p, ReduceOp op, size_t count) {
  std::vector<std::vector<float>> inputs(p), outputs(p, std::vector<float>(count));
  std::vector<std::vector<uint16_t>> narrow(p);
  for (int r = 0; r < p; ++r) {
    inputs[r] = RankInput<Float32>(count, r, p, op);
    for (float x : inputs[r]) narrow[r].push_back(Narrow::FromDouble(x));
  }
  const Expected<Narrow> want = ReferenceAllreduce<Narrow>(narrow, count, op, 1.0, 1.0);
  RunShmRanks(p, 4096, [&](ShmGroup& g) {
    ShmAllreduceOptions o;
    o.spans = Spans(inputs[g.rank()], outputs[g.rank()], g.rank());
    o.dtype = keras_ring::DataType::kFloat32;
    o.wire_dtype = Narrow::kType;
    o.op = op;
    g.Allreduce(o);
  });
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < count; ++i) {
      const uint16_t got = Narrow::FromDouble(outputs[r][i]);
      const bool exact = std::isnan(outputs[r][i]) || Narrow::ToDouble(got) == outputs[r][i];
      if (!exact || !Matches<Narrow>(got, want.values[i], want.tolerance[i])) {
        KR_FAIL("p=" + std::to_string(p) + " rank " + std::to_string(r) + " index " +
                std::to_string(i) + ": got " + ToString(outputs[r][i]) + ", want " +
                ValueString<Narrow>(want.values[i]));
        return;
      }
    }
  }
}

KR_TEST(ShmAllreduceCompressesFloat32ToHalfTypes) {
  for (int p : {1, 2, 3}) {
    for (ReduceOp op : kAllOps) {
      CheckCompressedShmAllreduce<Float16>(p, op, 5001);
      CheckCompressedShmAllreduce<BFloat16>(p, op, 5001);
    }
  }
}

KR_TEST(ShmGroupsRunManyCollectivesInARow) {
  RunShmRanks(3, 512, [](ShmGroup& g) {
    for (int i = 0; i < 200; ++i) {
      std::vector<int32_t> v(i % 37, g.rank() + i);
      ShmAllreduceOptions o;
      o.spans = {{v.data(), v.data(), v.size()}};
      o.dtype = keras_ring::DataType::kInt32;
      o.op = ReduceOp::kSum;
      g.Allreduce(o);
      for (int32_t x : v) KR_EXPECT_EQ(x, 3 * i + 3);
    }
  });
}

KR_TEST(ShmPeerThatStopsMakesTheOthersFailNamingIt) {
  RunShmRanks(3, 4096, [](ShmGroup& g) {
    std::vector<float> v(10000, 1.0f);
    ShmAllreduceOptions o;
    o.spans = {{v.data(), v.data(), v.size()}};
    if (g.rank() == 2) {
      g.Stop();
      return;
    }
    KR_EXPECT_THROW(g.Allreduce(o), EngineError, "rank 12 stopped");
  });
}

// A peer alive but stuck (never arriving, never stopping): the wait ends
// after the timeout, naming it.
KR_TEST(ShmPeerThatIsStuckMakesTheOthersFailAfterTheTimeout) {
  std::atomic<bool> failed{false};
  RunShmRanks(2, 4096, [&](ShmGroup& g) {
    std::vector<float> v(10000, 1.0f);
    ShmAllreduceOptions o;
    o.spans = {{v.data(), v.data(), v.size()}};
    if (g.rank() == 1) {
      // Stuck until the other has given up; then out of the group's way.
      while (!failed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return;
    }
    KR_EXPECT_THROW(g.Allreduce(o), EngineError, "waited 0.3 s (KERAS_RING_TIMEOUT) for rank 11");
    failed = true;
  }, std::chrono::milliseconds(300));
}

KR_TEST(ShmSetupFailureOnOneRankGivesNoGroupAnywhereAndLeavesNothing) {
  const int p = 3;
  Agreement agree(p);
  const std::string key = UniqueKey();
  // Rank 1's name is taken already.
  const std::string taken = "/kr-" + key + "-1";
  const int fd = shm_open(taken.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  KR_EXPECT(fd >= 0);
  close(fd);
  std::vector<std::string> why(p);
  std::vector<bool> created(p, true);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      created[r] = ShmGroup::Create(r, WorldRanks(p), key, 4096,
                                    [&](bool ok) { return agree(ok); }, &why[r]) != nullptr;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) KR_EXPECT(!created[r]);
  KR_EXPECT(why[1].find("shm_open(" + taken + ")") != std::string::npos);
  KR_EXPECT(why[0].empty() && why[2].empty());
  shm_unlink(taken.c_str());
  KR_EXPECT(Leftovers(key).empty());
}

KR_TEST(ShmSegmentsOfADeadJobAreRemoved) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);  // now a pid that is not running
  const std::string stale = std::to_string(child) + "xstale-0";
  const int fd = shm_open(("/kr-" + stale).c_str(), O_CREAT | O_RDWR, 0600);
  KR_EXPECT(fd >= 0);
  close(fd);
  RunShmRanks(2, 4096, [](ShmGroup&) {});  // rank 0 sweeps at setup
  KR_EXPECT(Leftovers(stale).empty());
}

// all_agree between two processes over a pair of pipes.
struct PipeAgreement {
  int to_peer, from_peer;
  bool operator()(bool ok) const {
    char mine = ok, theirs = 0;
    if (write(to_peer, &mine, 1) != 1 || read(from_peer, &theirs, 1) != 1) return false;
    return ok && theirs;
  }
};

KR_TEST(ShmPeerProcessThatDiesMakesTheOtherFail) {
  int a[2], b[2];
  KR_EXPECT(pipe(a) == 0 && pipe(b) == 0);
  const std::string key = UniqueKey();
  const pid_t child = fork();
  if (child == 0) {
    // Rank 1: joins the group, then exits without taking part.
    auto g = ShmGroup::Create(1, {10, 11}, key, 4096, PipeAgreement{b[1], a[0]}, nullptr);
    _exit(g ? 0 : 1);
  }
  auto g = ShmGroup::Create(0, {10, 11}, key, 4096, PipeAgreement{a[1], b[0]}, nullptr);
  KR_EXPECT(g != nullptr);
  if (g) {
    std::vector<double> v(5000, 1.0);
    ShmAllreduceOptions o;
    o.spans = {{v.data(), v.data(), v.size()}};
    o.dtype = keras_ring::DataType::kFloat64;
    // The child is a zombie until reaped: that counts as dead too.
    KR_EXPECT_THROW(g->Allreduce(o), EngineError, "rank 11 (pid " + std::to_string(child));
  }
  int status = 0;
  waitpid(child, &status, 0);
  KR_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {a[0], a[1], b[0], b[1]}) close(fd);
  KR_EXPECT(Leftovers(key).empty());
}

}  // namespace
}  // namespace kr_test
