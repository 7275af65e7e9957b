// Collectives run with threads as ranks over InProcessWorld, checked against
// serial references computed here.
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "../core/algorithms.h"
#include "harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::AllgatherOptions;
using keras_ring::AllreduceOptions;
using keras_ring::AlltoallOptions;
using keras_ring::BroadcastOptions;
using keras_ring::EngineError;
using keras_ring::InProcessStats;
using keras_ring::InProcessWorld;
using keras_ring::ReduceScatterOptions;
using keras_ring::Transport;

std::string Describe(int p, size_t count, double pre, double post, size_t segment) {
  return "p=" + std::to_string(p) + " count=" + std::to_string(count) + " pre=" + ToString(pre) +
         " post=" + ToString(post) + " segment=" + std::to_string(segment) + ": ";
}

using AllreduceFn = void (*)(Transport&, const AllreduceOptions&);

template <typename D>
void CheckAllreduce(int p, ReduceOp op, size_t count, double pre, double post,
                    size_t segment_bytes, AllreduceFn allreduce = keras_ring::RingAllreduce) {
  using S = typename D::Storage;
  std::vector<std::vector<S>> buffers(p);
  for (int r = 0; r < p; ++r) buffers[r] = RankInput<D>(count, r, p, op);
  const Expected<D> want = ReferenceAllreduce<D>(buffers, count, op, pre, post);

  RunRanks(p, [&](Transport& t) {
    AllreduceOptions o;
    o.buffer = buffers[t.rank()].data();
    o.count = count;
    o.dtype = D::kType;
    o.op = op;
    o.prescale_factor = pre;
    o.postscale_factor = post;
    o.segment_bytes = segment_bytes;
    o.tag = 7;
    allreduce(t, o);
  });

  const std::string context = Describe(p, count, pre, post, segment_bytes);
  for (size_t i = 0; i < count; ++i) {
    if (!Matches<D>(buffers[0][i], want.values[i], want.tolerance[i])) {
      KR_FAIL(context + "rank 0 index " + std::to_string(i) + ": got " +
              ValueString<D>(buffers[0][i]) + ", want " + ValueString<D>(want.values[i]) +
              " +- " + ToString(want.tolerance[i]));
      break;
    }
  }
  // Every rank ends with the owner's copy of each chunk: identical bits.
  for (int r = 1; r < p; ++r) {
    if (count > 0 && std::memcmp(buffers[r].data(), buffers[0].data(), count * sizeof(S)) != 0) {
      KR_FAIL(context + "rank " + std::to_string(r) + " differs from rank 0");
    }
  }
}

KR_TEST_CASES(RegisterAllreduceTests) {
  ForEachDtype([](auto dtype) {
    using D = decltype(dtype);
    const std::string name = keras_ring::DataTypeName(D::kType);
    for (ReduceOp op : kAllOps) {
      for (int p = 1; p <= 5; ++p) {
        Register("allreduce/" + name + "/" + keras_ring::ReduceOpName(op) + "/p" +
                     std::to_string(p),
                 [p, op] {
                   const auto [pre, post] = NontrivialScales<D>();
                   // Segment sizes that are not whole elements of every
                   // dtype; 21 bytes splits even the small chunks.
                   for (size_t count : {0, 1, 7, 1001}) {
                     CheckAllreduce<D>(p, op, count, 1.0, 1.0, 21);
                     CheckAllreduce<D>(p, op, count, pre, post, 21);
                   }
                   CheckAllreduce<D>(p, op, 65537, pre, post, 4100);
                 });
      }
    }
    // About 4M elements in 4 KiB segments: every op for three ranks, and
    // every world size for float32 sum. Scaling is covered above.
    constexpr size_t kLarge = (size_t(1) << 22) + 3;
    for (ReduceOp op : kAllOps) {
      Register("allreduce_large/" + name + "/" + keras_ring::ReduceOpName(op) + "/p3",
               [op] { CheckAllreduce<D>(3, op, kLarge, 1.0, 1.0, 4096); });
    }
    if constexpr (std::is_same_v<D, Float32>) {
      for (int p : {1, 2, 4, 5}) {
        Register("allreduce_large/float32/sum/p" + std::to_string(p),
                 [p] { CheckAllreduce<D>(p, ReduceOp::kSum, kLarge, 1.0, 1.0, 4096); });
      }
    }
  });
}

KR_TEST_CASES(RegisterRecursiveDoublingTests) {
  ForEachDtype([](auto dtype) {
    using D = decltype(dtype);
    const std::string name = keras_ring::DataTypeName(D::kType);
    for (ReduceOp op : kAllOps) {
      for (int p = 1; p <= 6; ++p) {
        Register("recursive_doubling/" + name + "/" + keras_ring::ReduceOpName(op) + "/p" +
                     std::to_string(p),
                 [p, op] {
                   const auto [pre, post] = NontrivialScales<D>();
                   for (size_t count : {0, 1, 7, 1001}) {
                     CheckAllreduce<D>(p, op, count, 1.0, 1.0, 21,
                                       keras_ring::RecursiveDoublingAllreduce);
                     CheckAllreduce<D>(p, op, count, pre, post, 21,
                                       keras_ring::RecursiveDoublingAllreduce);
                   }
                   CheckAllreduce<D>(p, op, 65537, pre, post, 4100,
                                     keras_ring::RecursiveDoublingAllreduce);
                 });
      }
    }
  });
}

// Allreduce() takes recursive doubling up to small_bytes: one exchange of
// the whole buffer for two ranks, where the ring sends two halves.
KR_TEST(AllreducePicksTheAlgorithmBySize) {
  for (size_t small : {size_t(0), size_t(400), size_t(399)}) {
    InProcessStats stats;
    RunRanks(
        2,
        [&](Transport& t) {
          std::vector<float> v(100, 1.0f);
          AllreduceOptions o;
          o.buffer = v.data();
          o.count = v.size();
          o.small_bytes = small;
          keras_ring::Allreduce(t, o);
          for (float x : v) KR_EXPECT_EQ(x, 2.0f);
        },
        &stats);
    KR_EXPECT_EQ(stats.messages, small >= 400 ? 2u : 4u);
  }
}

// Ring traffic: each rank sends 2(p-1)/p of the buffer, in messages no
// larger than the segment rounded down to whole elements.
KR_TEST(AllreduceSendsTwoPMinusOneOverPOfTheBufferInSegments) {
  struct Case {
    int p;
    size_t count, segment_bytes, want_max_message;
  };
  for (const Case& c : {Case{4, 10007, 4096, 4096}, Case{3, 10000, 4097, 4096},
                        Case{5, 13, 3, 8}, Case{2, 1, 1 << 20, 8}}) {
    std::vector<std::vector<double>> buffers(c.p, std::vector<double>(c.count, 1.0));
    InProcessStats stats;
    RunRanks(
        c.p,
        [&](Transport& t) {
          AllreduceOptions o;
          o.buffer = buffers[t.rank()].data();
          o.count = c.count;
          o.dtype = DataType::kFloat64;
          o.segment_bytes = c.segment_bytes;
          keras_ring::RingAllreduce(t, o);
        },
        &stats);
    KR_EXPECT_EQ(stats.bytes, 2 * (c.p - 1) * c.count * sizeof(double));
    KR_EXPECT_EQ(stats.max_message_bytes, c.want_max_message);
    KR_EXPECT(buffers[c.p - 1][c.count - 1] == c.p);
  }
}

// Each rank's block must equal the same block of the whole allreduce.
template <typename D>
void CheckReduceScatter(ReduceOp op, const std::vector<size_t>& counts, double pre, double post,
                        size_t segment_bytes) {
  using S = typename D::Storage;
  const int p = static_cast<int>(counts.size());
  std::vector<size_t> offsets(p + 1, 0);
  for (int r = 0; r < p; ++r) offsets[r + 1] = offsets[r] + counts[r];
  std::vector<std::vector<S>> buffers(p);
  for (int r = 0; r < p; ++r) buffers[r] = RankInput<D>(offsets[p], r, p, op);
  const Expected<D> want = ReferenceAllreduce<D>(buffers, offsets[p], op, pre, post);
  InProcessStats stats;
  RunRanks(
      p,
      [&](Transport& t) {
        ReduceScatterOptions o;
        o.buffer = buffers[t.rank()].data();
        o.counts = counts;
        o.dtype = D::kType;
        o.op = op;
        o.prescale_factor = pre;
        o.postscale_factor = post;
        o.segment_bytes = segment_bytes;
        o.tag = 5;
        keras_ring::RingReduceScatter(t, o);
      },
      &stats);
  std::string context = "counts";
  for (size_t c : counts) context += " " + std::to_string(c);
  context += " " + Describe(p, offsets[p], pre, post, segment_bytes);
  for (int r = 0; r < p; ++r) {
    for (size_t i = offsets[r]; i < offsets[r + 1]; ++i) {
      if (!Matches<D>(buffers[r][i], want.values[i], want.tolerance[i])) {
        KR_FAIL(context + "rank " + std::to_string(r) + " index " + std::to_string(i) + ": got " +
                ValueString<D>(buffers[r][i]) + ", want " + ValueString<D>(want.values[i]));
        return;
      }
    }
  }
  // Each rank sends every block but one once: (p-1)/p of the buffer.
  KR_EXPECT_EQ(stats.bytes, (p - 1) * offsets[p] * sizeof(S));
}

KR_TEST_CASES(RegisterReduceScatterTests) {
  ForEachDtype([](auto dtype) {
    using D = decltype(dtype);
    const std::string name = keras_ring::DataTypeName(D::kType);
    for (ReduceOp op : kAllOps) {
      for (int p = 1; p <= 5; ++p) {
        Register("reducescatter/" + name + "/" + keras_ring::ReduceOpName(op) + "/p" +
                     std::to_string(p),
                 [p, op] {
                   const auto [pre, post] = NontrivialScales<D>();
                   std::vector<size_t> even(p, 333), uneven(p), zeros(p, 0), one(p, 0);
                   for (int r = 0; r < p; ++r) uneven[r] = (r * 37 + 5) % 23 * 7 + (r % 2);
                   one[p - 1] = 1;
                   for (const auto& counts : {even, uneven, zeros, one}) {
                     CheckReduceScatter<D>(op, counts, 1.0, 1.0, 21);
                     CheckReduceScatter<D>(op, counts, pre, post, 21);
                   }
                 });
      }
    }
  });
}

void CheckAlltoall(const std::vector<std::vector<size_t>>& bytes, size_t segment_bytes) {
  // bytes[i][j]: what rank i sends to rank j.
  const int p = static_cast<int>(bytes.size());
  auto value = [](int from, int to, size_t i) { return static_cast<char>(Mix(from, to, i)); };
  std::vector<std::vector<char>> inputs(p), outputs(p), want(p);
  std::vector<std::vector<size_t>> recv(p, std::vector<size_t>(p));
  for (int i = 0; i < p; ++i) {
    for (int j = 0; j < p; ++j) {
      recv[j][i] = bytes[i][j];
      for (size_t k = 0; k < bytes[i][j]; ++k) inputs[i].push_back(value(i, j, k));
    }
  }
  for (int j = 0; j < p; ++j) {
    for (int i = 0; i < p; ++i) {
      for (size_t k = 0; k < bytes[i][j]; ++k) want[j].push_back(value(i, j, k));
    }
    outputs[j].assign(want[j].size(), '\xEE');
  }
  InProcessStats stats;
  RunRanks(
      p,
      [&](Transport& t) {
        const int r = t.rank();
        AlltoallOptions o;
        o.input = inputs[r].data();
        o.send_bytes = bytes[r];
        o.output = outputs[r].data();
        o.recv_bytes = recv[r];
        o.segment_bytes = segment_bytes;
        o.tag = 9;
        keras_ring::Alltoall(t, o);
      },
      &stats);
  size_t moved = 0;
  for (int i = 0; i < p; ++i) {
    for (int j = 0; j < p; ++j) moved += i == j ? 0 : bytes[i][j];
  }
  for (int r = 0; r < p; ++r) {
    if (outputs[r] != want[r]) {
      KR_FAIL("alltoall p=" + std::to_string(p) + ": rank " + std::to_string(r) +
              " got wrong data");
    }
  }
  KR_EXPECT_EQ(stats.bytes, moved);
  KR_EXPECT(stats.max_message_bytes <= segment_bytes);
}

KR_TEST_CASES(RegisterAlltoallTests) {
  for (int p = 1; p <= 5; ++p) {
    Register("alltoall/p" + std::to_string(p), [p] {
      std::vector<std::vector<size_t>> even(p, std::vector<size_t>(p, 100)), uneven(p), zeros(
          p, std::vector<size_t>(p, 0)), big(p, std::vector<size_t>(p, 3));
      for (int i = 0; i < p; ++i) {
        for (int j = 0; j < p; ++j) uneven[i].push_back((i * 7 + j * 13) % 5 == 0 ? 0 : i + 3 * j);
      }
      big[0][p - 1] = (size_t(1) << 20) + 3;
      CheckAlltoall(even, 64);
      CheckAlltoall(uneven, 5);
      CheckAlltoall(zeros, 64);
      CheckAlltoall(big, 4096);
    });
  }
}

void CheckAllgather(const std::vector<size_t>& block_bytes, size_t segment_bytes, bool in_place) {
  const int p = static_cast<int>(block_bytes.size());
  std::vector<size_t> offsets(p + 1, 0);
  for (int r = 0; r < p; ++r) offsets[r + 1] = offsets[r] + block_bytes[r];
  std::vector<char> want(offsets[p]);
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < block_bytes[r]; ++i) want[offsets[r] + i] = static_cast<char>(Mix(r, i));
  }
  std::vector<std::vector<char>> inputs(p), outputs(p, std::vector<char>(offsets[p], '\xEE'));
  for (int r = 0; r < p; ++r) {
    inputs[r].assign(want.begin() + offsets[r], want.begin() + offsets[r + 1]);
    if (in_place) std::copy(inputs[r].begin(), inputs[r].end(), outputs[r].begin() + offsets[r]);
  }
  InProcessStats stats;
  RunRanks(
      p,
      [&](Transport& t) {
        const int r = t.rank();
        AllgatherOptions o;
        o.input = in_place ? outputs[r].data() + offsets[r] : inputs[r].data();
        o.output = outputs[r].data();
        o.block_bytes = block_bytes;
        o.segment_bytes = segment_bytes;
        o.tag = 3;
        keras_ring::RingAllgather(t, o);
      },
      &stats);
  std::string context = "blocks";
  for (size_t b : block_bytes) context += " " + std::to_string(b);
  context += ", segment " + std::to_string(segment_bytes) + (in_place ? ", in place: " : ": ");
  for (int r = 0; r < p; ++r) {
    if (outputs[r] != want) KR_FAIL(context + "rank " + std::to_string(r) + " got wrong data");
  }
  KR_EXPECT_EQ(stats.bytes, (p - 1) * offsets[p]);
  KR_EXPECT(stats.max_message_bytes <= segment_bytes);
}

KR_TEST_CASES(RegisterAllgatherTests) {
  for (int p = 1; p <= 5; ++p) {
    Register("allgather/p" + std::to_string(p), [p] {
      std::vector<size_t> uniform(p, 1001), uneven(p), with_zeros(p), all_zero(p, 0), one_big(p, 5);
      for (int r = 0; r < p; ++r) {
        uneven[r] = (r * 37 + 5) % 23 * 7 + 1;
        with_zeros[r] = r % 2 == 0 ? 0 : 13 * r;
      }
      one_big[p / 2] = (size_t(1) << 20) + 3;
      for (bool in_place : {false, true}) {
        CheckAllgather(uniform, 100, in_place);
        CheckAllgather(uneven, 7, in_place);
        CheckAllgather(with_zeros, 5, in_place);
        CheckAllgather(all_zero, 4096, in_place);
        CheckAllgather(one_big, 4096, in_place);
      }
    });
  }
}

void CheckBroadcast(int p, int root, size_t bytes, size_t segment_bytes) {
  std::vector<char> want(bytes);
  for (size_t i = 0; i < bytes; ++i) want[i] = static_cast<char>(Mix(root, i));
  std::vector<std::vector<char>> buffers(p, std::vector<char>(bytes, '\xEE'));
  buffers[root] = want;
  InProcessStats stats;
  RunRanks(
      p,
      [&](Transport& t) {
        BroadcastOptions o;
        o.buffer = buffers[t.rank()].data();
        o.bytes = bytes;
        o.root = root;
        o.segment_bytes = segment_bytes;
        o.tag = 11;
        keras_ring::Broadcast(t, o);
      },
      &stats);
  for (int r = 0; r < p; ++r) {
    if (buffers[r] != want) {
      KR_FAIL("p=" + std::to_string(p) + " root=" + std::to_string(root) + " bytes=" +
              std::to_string(bytes) + ": rank " + std::to_string(r) + " got wrong data");
    }
  }
  // Every rank but the root receives the buffer exactly once.
  KR_EXPECT_EQ(stats.bytes, (p - 1) * bytes);
  KR_EXPECT(stats.max_message_bytes <= segment_bytes);
}

KR_TEST_CASES(RegisterBroadcastTests) {
  // Up to 8 ranks: tree shapes with every depth up to 3.
  for (int p = 1; p <= 8; ++p) {
    Register("broadcast/p" + std::to_string(p), [p] {
      for (int root = 0; root < p; ++root) {
        CheckBroadcast(p, root, 0, 100);
        CheckBroadcast(p, root, 1, 100);
        CheckBroadcast(p, root, 1001, 100);
        CheckBroadcast(p, root, (size_t(1) << 20) + 3, 4096);
      }
    });
  }
}

KR_TEST(AlgorithmsRejectInvalidOptions) {
  InProcessWorld world(2);
  auto t = world.Connect(0);
  float x[4] = {};

  AllreduceOptions a;
  a.count = 3;
  KR_EXPECT_THROW(keras_ring::RingAllreduce(*t, a), EngineError, "3 elements has a null buffer");
  a.buffer = x;
  a.dtype = DataType::kInt16;
  KR_EXPECT_THROW(keras_ring::RingAllreduce(*t, a), EngineError,
                  "dtype 8 is not one that reductions take");
  a.dtype = DataType::kFloat32;
  a.op = static_cast<ReduceOp>(2);
  KR_EXPECT_THROW(keras_ring::RingAllreduce(*t, a), EngineError, "op 2 is not a kr_reduce_op");
  a.op = ReduceOp::kSum;
  a.segment_bytes = 0;
  KR_EXPECT_THROW(keras_ring::RingAllreduce(*t, a), EngineError, "segment_bytes");

  AllgatherOptions g;
  g.block_bytes = {4};
  KR_EXPECT_THROW(keras_ring::RingAllgather(*t, g), EngineError, "expected 2, got 1");
  g.block_bytes = {0, 4};
  KR_EXPECT_THROW(keras_ring::RingAllgather(*t, g), EngineError, "4 bytes has a null output");
  g.output = x;
  g.block_bytes = {4, 4};
  KR_EXPECT_THROW(keras_ring::RingAllgather(*t, g), EngineError, "4 bytes has a null input");

  ReduceScatterOptions rs;
  rs.counts = {1};
  KR_EXPECT_THROW(keras_ring::RingReduceScatter(*t, rs), EngineError, "expected 2, got 1");
  rs.counts = {1, 2};
  KR_EXPECT_THROW(keras_ring::RingReduceScatter(*t, rs), EngineError,
                  "3 elements has a null buffer");

  AlltoallOptions aa;
  aa.send_bytes = {1, 1};
  aa.recv_bytes = {1};
  KR_EXPECT_THROW(keras_ring::Alltoall(*t, aa), EngineError, "expected 2, got 2 and 1");
  aa.recv_bytes = {2, 1};
  aa.input = x;
  aa.output = x;
  KR_EXPECT_THROW(keras_ring::Alltoall(*t, aa), EngineError, "sends 1 bytes to itself");

  BroadcastOptions b;
  b.buffer = x;
  b.bytes = sizeof x;
  b.root = 2;
  KR_EXPECT_THROW(keras_ring::Broadcast(*t, b), EngineError, "root 2 is not a rank");
  b.root = -1;
  KR_EXPECT_THROW(keras_ring::Broadcast(*t, b), EngineError, "root -1 is not a rank");
  b.root = 0;
  b.buffer = nullptr;
  KR_EXPECT_THROW(keras_ring::Broadcast(*t, b), EngineError, "16 bytes has a null buffer");
}

// A rank that never joins makes the others fail within the timeout, not hang.
KR_TEST(MissingRankEndsInAnErrorNotAHang) {
  InProcessWorld world(3, std::chrono::milliseconds(100));
  std::vector<float> buffers[2] = {std::vector<float>(100, 1.0f), std::vector<float>(100, 2.0f)};
  std::string errors[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      AllreduceOptions o;
      o.buffer = buffers[r].data();
      o.count = buffers[r].size();
      try {
        keras_ring::RingAllreduce(*world.Connect(r), o);
      } catch (const EngineError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) KR_EXPECT(e.find("waited 100 ms") != std::string::npos);
}

}  // namespace
}  // namespace kr_test
