// The coordinator's table, its agreement checks, fusion and the wire format,
// without MPI.
#include <string>
#include <vector>

#include "../core/fusion.h"
#include "../core/negotiation.h"
#include "harness.h"

namespace kr_test {
namespace {

using namespace keras_ring;

TensorMeta Allreduce(const std::string& name, std::vector<int64_t> shape,
                     DataType dtype = DataType::kFloat32, ReduceOp op = ReduceOp::kSum) {
  TensorMeta m;
  m.name = name;
  m.collective = Collective::kAllreduce;
  m.dtype = dtype;
  m.wire_dtype = dtype;
  m.op = op;
  m.shape = std::move(shape);
  return m;
}

// Every rank submits `metas` (rank r's list in its own order); returns the
// decisions in the order the coordinator made them.
std::vector<Response> Agree(int size, const std::vector<std::vector<TensorMeta>>& by_rank) {
  Coordinator c(size);
  std::vector<Response> out;
  for (int r = 0; r < size; ++r) {
    for (const TensorMeta& m : by_rank[r]) c.Add(r, m, &out);
  }
  return out;
}

KR_TEST(NameIsDecidedWhenTheLastRankArrives) {
  Coordinator c(3);
  std::vector<Response> out;
  c.Add(0, Allreduce("a", {4}), &out);
  c.Add(2, Allreduce("a", {4}), &out);
  KR_EXPECT_EQ(out.size(), 0u);
  c.Add(1, Allreduce("a", {4}), &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT_EQ(out[0].names.size(), 1u);
  KR_EXPECT_EQ(out[0].names[0], std::string("a"));
  KR_EXPECT(out[0].error.empty());
  KR_EXPECT_EQ(out[0].bytes, 16u);
}

KR_TEST(DifferentSubmissionOrdersGiveOneOrder) {
  auto out = Agree(2, {{Allreduce("a", {1}), Allreduce("b", {1})},
                       {Allreduce("b", {1}), Allreduce("a", {1})}});
  KR_EXPECT_EQ(out.size(), 2u);
  KR_EXPECT_EQ(out[0].names[0], std::string("b"));  // completed first, on rank 1's "b"
  KR_EXPECT_EQ(out[1].names[0], std::string("a"));
}

KR_TEST(DisagreementNamesTheTensorAndEveryRanksView) {
  auto out = Agree(2, {{Allreduce("w", {4})}, {Allreduce("w", {5}, DataType::kFloat64)}});
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT_EQ(out[0].status, KR_FAILED_PRECONDITION);
  const std::string& e = out[0].error;
  KR_EXPECT(e.find("'w'") != std::string::npos);
  KR_EXPECT(e.find("rank 0 sent allreduce of float32[4]") != std::string::npos);
  KR_EXPECT(e.find("rank 1 sent allreduce of float64[5]") != std::string::npos);
  out = Agree(2, {{Allreduce("o", {4})}, {Allreduce("o", {4}, DataType::kFloat32,
                                                    ReduceOp::kMax)}});
  KR_EXPECT(out[0].error.find("op=max") != std::string::npos);
  // Compression is part of the request: one rank compressing alone is an error.
  TensorMeta compressed = Allreduce("c", {4});
  compressed.wire_dtype = DataType::kFloat16;
  out = Agree(2, {{Allreduce("c", {4})}, {compressed}});
  KR_EXPECT(out[0].error.find("rank 1 sent allreduce of float32[4] op=sum sent as float16") !=
            std::string::npos);
}

KR_TEST(FusionKeepsCompressedAndUncompressedApart) {
  TensorMeta compressed = Allreduce("b", {10});
  compressed.wire_dtype = DataType::kBFloat16;
  auto fused = Fuse(Agree(1, {{Allreduce("a", {10}), compressed, Allreduce("c", {10})}}), 1000);
  KR_EXPECT_EQ(fused.size(), 2u);
  KR_EXPECT(fused[0].names == std::vector<std::string>({"a", "c"}));
  KR_EXPECT(fused[1].names == std::vector<std::string>({"b"}));
}

KR_TEST(AllgatherMayDifferInTheFirstDimensionOnly) {
  TensorMeta a = Allreduce("g", {2, 3});
  a.collective = Collective::kAllgather;
  TensorMeta b = a;
  b.shape = {5, 3};
  auto out = Agree(2, {{a}, {b}});
  KR_EXPECT(out[0].error.empty());
  KR_EXPECT(out[0].rows == std::vector<int64_t>({2, 5}));
  b.shape = {5, 4};
  out = Agree(2, {{a}, {b}});
  KR_EXPECT(!out[0].error.empty());
}

KR_TEST(FusionGroupsAgreeingAllreducesUpToTheThreshold) {
  std::vector<Response> decided = Agree(1, {{
      Allreduce("a", {10}),                                   // 40 bytes
      Allreduce("b", {10}, DataType::kFloat64),               // other dtype
      Allreduce("c", {10}),                                   // fuses with a
      Allreduce("d", {10}, DataType::kFloat32, ReduceOp::kMax),  // other op
      Allreduce("e", {20}),                                   // 80 bytes: over 120 with a+c
      Allreduce("f", {5}),                                    // fits with a+c
  }});
  auto fused = Fuse(decided, 120);
  KR_EXPECT_EQ(fused.size(), 4u);
  KR_EXPECT(fused[0].names == std::vector<std::string>({"a", "c", "f"}));
  KR_EXPECT_EQ(fused[0].bytes, 100u);
  KR_EXPECT(fused[1].names == std::vector<std::string>({"b"}));
  KR_EXPECT(fused[2].names == std::vector<std::string>({"d"}));
  KR_EXPECT(fused[3].names == std::vector<std::string>({"e"}));
  // Threshold 0: every tensor alone.
  KR_EXPECT_EQ(Fuse(decided, 0).size(), decided.size());
}

KR_TEST(FusionLeavesErrorsAndOtherCollectivesAlone) {
  TensorMeta g = Allreduce("g", {2});
  g.collective = Collective::kAllgather;
  auto decided = Agree(2, {{Allreduce("a", {1}), g, Allreduce("bad", {1}), Allreduce("c", {1})},
                           {Allreduce("a", {1}), g, Allreduce("bad", {2}), Allreduce("c", {1})}});
  auto fused = Fuse(decided, 1 << 20);
  KR_EXPECT_EQ(fused.size(), 3u);
  KR_EXPECT(fused[0].names == std::vector<std::string>({"a", "c"}));
  KR_EXPECT(fused[1].names == std::vector<std::string>({"g"}));
  KR_EXPECT(fused[2].names == std::vector<std::string>({"bad"}));
  KR_EXPECT(!fused[2].error.empty());
}

KR_TEST(StallsAreReportedOnceThenFailedNamingTheMissingRanks) {
  using std::chrono::seconds;
  const auto t0 = Coordinator::Clock::now();
  Coordinator c(3);
  std::vector<Response> out;
  c.Add(0, Allreduce("late", {4}), &out, t0);
  c.Add(2, Allreduce("late", {4}), &out, t0 + seconds(1));
  KR_EXPECT(c.StallReports(t0 + seconds(59), seconds(60)).empty());
  auto reports = c.StallReports(t0 + seconds(61), seconds(60));
  KR_EXPECT_EQ(reports.size(), 1u);
  KR_EXPECT(reports[0].find("ranks [0, 2] have been waiting 61 s for ranks [1] to submit "
                            "tensor 'late' (allreduce of float32[4]") != std::string::npos);
  KR_EXPECT(c.StallReports(t0 + seconds(120), seconds(60)).empty());  // once
  c.FailStalled(t0 + seconds(100), seconds(200), &out);
  KR_EXPECT(out.empty());
  c.FailStalled(t0 + seconds(200), seconds(200), &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT_EQ(out[0].status, KR_ABORTED);
  KR_EXPECT(out[0].error.find("waiting 200 s for ranks [1]") != std::string::npos);
  // It fails the requests of ranks 0 and 2 only: one that rank 1 makes now is a new one.
  KR_EXPECT(out[0].rows == std::vector<int64_t>({1, 0, 1}));
  KR_EXPECT(!c.HasWaiting());
  out.clear();
  c.Add(1, Allreduce("late", {4}), &out, t0 + seconds(201));
  KR_EXPECT(out.empty() && c.HasWaiting());
  c.Add(0, Allreduce("late", {4}), &out, t0 + seconds(202));
  c.Add(2, Allreduce("late", {4}), &out, t0 + seconds(202));
  KR_EXPECT(out.size() == 1u && out[0].error.empty());
}

KR_TEST(WireFormatRoundTrips) {
  std::vector<TensorMeta> metas = {Allreduce("x", {2, 3}, DataType::kBFloat16, ReduceOp::kProduct),
                                   Allreduce("", {}), Allreduce("a2a", {4, 2})};
  metas[0].prescale_factor = 0.5;
  metas[1].wire_dtype = DataType::kFloat16;
  metas[2].collective = Collective::kAlltoall;
  metas[2].dtype = metas[2].wire_dtype = DataType::kBool;
  metas[2].splits = {3, 0, 1};
  metas[1].collective = Collective::kBroadcast;
  metas[1].root_rank = 2;
  ReadyList ready;
  for (const TensorMeta& m : metas) ready.items.push_back({-1, m});
  ready.items.insert(ready.items.begin() + 1, {4, {}});  // order is kept
  ready.shutdown = true;
  ready.shutdown_reason = "why";
  ready.process_set = 3;
  ReadyList back_list = DeserializeReadyList(SerializeReadyList(ready));
  KR_EXPECT(back_list.shutdown);
  KR_EXPECT_EQ(back_list.shutdown_reason, std::string("why"));
  KR_EXPECT_EQ(back_list.process_set, 3);
  KR_EXPECT_EQ(back_list.items.size(), 4u);
  KR_EXPECT_EQ(back_list.items[1].cache_id, 4);
  std::vector<TensorMeta> back;
  for (const auto& item : back_list.items) {
    if (item.cache_id < 0) back.push_back(item.meta);
  }
  KR_EXPECT_EQ(back.size(), 3u);
  KR_EXPECT(back[1] == metas[1]);  // wire_dtype included
  KR_EXPECT(back[2] == metas[2]);
  KR_EXPECT_EQ(back[0].Describe(), metas[0].Describe());
  KR_EXPECT_EQ(back[1].Describe(), metas[1].Describe());
  KR_EXPECT_EQ(back[2].Describe(), std::string("alltoall of bool[4,2] splits=[3,0,1]"));

  ResponseList list;
  list.shutdown_rank = 1;
  list.responses.resize(3);
  list.responses[0].names = {"a", "b"};
  list.responses[0].cache_ids = {-1, 3};
  list.responses[1].names = {"g"};
  list.responses[1].cache_ids = {-1};
  list.responses[1].metas = {metas[2]};
  list.responses[1].send_metas = true;
  list.responses[2].names = {"c", "d"};
  list.responses[2].cache_ids = {7, 2};
  list.responses[2].cached = true;
  list.responses[2].process_set = 2;
  list.responses[1].error = "bad";
  list.responses[1].status = KR_ABORTED;
  list.responses[1].rows = {1, 0, 7};
  ResponseList got = DeserializeResponses(SerializeResponses(list));
  KR_EXPECT_EQ(got.shutdown_rank, 1);
  KR_EXPECT(got.responses[0].names == list.responses[0].names);
  KR_EXPECT_EQ(got.responses[1].error, std::string("bad"));
  KR_EXPECT_EQ(got.responses[1].status, KR_ABORTED);
  KR_EXPECT(got.responses[1].rows == list.responses[1].rows);
  KR_EXPECT(got.responses[0].cache_ids == list.responses[0].cache_ids);
  KR_EXPECT(got.responses[1].metas.size() == 1 && got.responses[1].metas[0] == metas[2]);
  // Cached responses carry ids only: the ranks look the names up.
  KR_EXPECT(got.responses[2].cached);
  KR_EXPECT_EQ(got.responses[2].process_set, 2);
  KR_EXPECT(got.responses[2].cache_ids == list.responses[2].cache_ids);
  KR_EXPECT(got.responses[2].names == std::vector<std::string>({"", ""}));
  KR_EXPECT(!got.params && !got.tuned);
  // Settings from the autotuner travel with the list.
  list.params = TunedParams{32 << 20, 2.5, 256 << 10, 16 << 10};
  list.tuned = true;
  got = DeserializeResponses(SerializeResponses(list));
  KR_EXPECT(got.params && *got.params == *list.params);
  KR_EXPECT(got.tuned);
  std::vector<char> truncated = SerializeResponses(list);
  truncated.resize(truncated.size() - 3);
  KR_EXPECT_THROW(DeserializeResponses(truncated), EngineError, "truncated");
}

// Both ranks of a two-rank coordinator submit `m` in full.
void BothAdd(Coordinator& c, const TensorMeta& m, std::vector<Response>* out) {
  c.Add(0, m, out);
  c.Add(1, m, out);
}

KR_TEST(NamesAgreedTwiceAreCachedAndThenSentByIdAlone) {
  Coordinator c(2, 2);
  std::vector<Response> out;
  for (const char* name : {"a", "b", "c", "a", "b", "c"}) BothAdd(c, Allreduce(name, {4}), &out);
  KR_EXPECT_EQ(out.size(), 6u);
  for (int i = 0; i < 3; ++i) KR_EXPECT(out[i].cache_ids == std::vector<int32_t>({-1}));
  KR_EXPECT(out[3].cache_ids == std::vector<int32_t>({0}) && !out[3].cached);
  KR_EXPECT(out[4].cache_ids == std::vector<int32_t>({1}));
  KR_EXPECT(out[5].cache_ids == std::vector<int32_t>({-1}));  // capacity 2: full
  out.clear();
  c.AddCached(1, 1, &out);
  c.AddCached(0, 1, &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT(out[0].cached && out[0].error.empty());
  KR_EXPECT_EQ(out[0].names[0], std::string("b"));
  KR_EXPECT_EQ(out[0].bytes, 16u);
  // One rank's request changed: the full comparison runs and finds it.
  out.clear();
  c.AddCached(0, 0, &out);
  c.Add(1, Allreduce("a", {5}), &out);
  KR_EXPECT(!out[0].cached);
  KR_EXPECT(out[0].error.find("rank 0 sent allreduce of float32[4] op=sum; rank 1 sent allreduce "
                              "of float32[5]") != std::string::npos);
  // Every rank changed it the same way: the entry is renewed under its id.
  out.clear();
  BothAdd(c, Allreduce("a", {5}), &out);
  KR_EXPECT(out[0].error.empty() && !out[0].cached);
  KR_EXPECT(out[0].cache_ids == std::vector<int32_t>({0}));
  out.clear();
  c.AddCached(0, 0, &out);
  c.AddCached(1, 0, &out);
  KR_EXPECT(out[0].cached && out[0].bytes == 20u);
  KR_EXPECT_THROW(c.AddCached(0, 9, &out), EngineError, "unknown cache id 9");
  // Capacity 0: nothing is cached.
  Coordinator none(2, 0);
  out.clear();
  for (int i = 0; i < 3; ++i) BothAdd(none, Allreduce("x", {1}), &out);
  for (const Response& r : out) KR_EXPECT(r.cache_ids == std::vector<int32_t>({-1}));
}

KR_TEST(FusedResponsesKeepEachNamesCacheId) {
  Coordinator c(1);
  std::vector<Response> out;
  for (int i = 0; i < 2; ++i) {
    c.Add(0, Allreduce("a", {1}), &out);
    c.Add(0, Allreduce("b", {1}), &out);
  }
  auto first = Fuse({out[2], out[3]}, 1 << 20);
  KR_EXPECT(first.size() == 1 && first[0].cache_ids == std::vector<int32_t>({0, 1}));
  KR_EXPECT(!first[0].cached);
  out.clear();
  c.AddCached(0, 1, &out);
  c.AddCached(0, 0, &out);
  auto second = Fuse(out, 1 << 20);
  KR_EXPECT(second[0].cached && second[0].cache_ids == std::vector<int32_t>({1, 0}));
  out.clear();
  c.AddCached(0, 0, &out);
  c.Add(0, Allreduce("z", {1}), &out);
  auto mixed = Fuse(out, 1 << 20);
  KR_EXPECT(!mixed[0].cached && mixed[0].names == std::vector<std::string>({"a", "z"}));
  KR_EXPECT(mixed[0].cache_ids == std::vector<int32_t>({0, -1}));
}

TensorMeta Join() {
  TensorMeta m;
  m.name = "join";
  m.collective = Collective::kJoin;
  m.dtype = DataType::kInt32;
  return m;
}

// Caches "a" (id 0) and "b" (id 1) on a three-rank coordinator.
Coordinator ThreeRanksWithTwoCachedNames() {
  Coordinator c(3);
  std::vector<Response> out;
  for (int i = 0; i < 2; ++i) {
    for (int r = 0; r < 3; ++r) c.Add(r, Allreduce("a", {4}), &out);
    for (int r = 0; r < 3; ++r) c.Add(r, Allreduce("b", {2}), &out);
  }
  return c;
}

// Names sent by id wait outside the table (the fast path); a full
// description, a join or a stall hands them to the table with what the ranks
// sent so far, so its checks still apply.
KR_TEST(NamesWaitingByIdMoveToTheTableWhenTheyNeedItsChecks) {
  using std::chrono::seconds;
  const auto t0 = Coordinator::Clock::now();
  std::vector<Response> out;
  {  // every rank by id: the same decision as the table's
    Coordinator c = ThreeRanksWithTwoCachedNames();
    c.AddCached(2, 1, &out, t0);
    c.AddCached(0, 1, &out, t0);
    KR_EXPECT(out.empty() && c.HasWaiting());
    KR_EXPECT_THROW(c.AddCached(0, 1, &out, t0), EngineError, "sent tensor 'b' twice");
    c.AddCached(1, 1, &out, t0);
    KR_EXPECT_EQ(out.size(), 1u);
    KR_EXPECT(out[0].cached && out[0].error.empty() && !out[0].send_metas);
    KR_EXPECT(out[0].names == std::vector<std::string>({"b"}) && out[0].bytes == 8u);
    KR_EXPECT(out[0].cache_ids == std::vector<int32_t>({1}) && out[0].metas[0] == Allreduce("b", {2}));
    KR_EXPECT(!c.HasWaiting());
  }
  {  // one rank's request changed after two sent theirs by id: named on all
    out.clear();
    Coordinator c = ThreeRanksWithTwoCachedNames();
    c.AddCached(0, 0, &out, t0);
    c.AddCached(1, 0, &out, t0);
    c.Add(2, Allreduce("a", {5}), &out, t0);
    KR_EXPECT_EQ(out.size(), 1u);
    KR_EXPECT(out[0].error.find("rank 0 sent allreduce of float32[4] op=sum; rank 1 sent "
                                "allreduce of float32[4] op=sum; rank 2 sent allreduce of "
                                "float32[5]") != std::string::npos);
    // The full description first, then ids: the table again.
    out.clear();
    c.Add(0, Allreduce("a", {4}), &out, t0);
    c.AddCached(1, 0, &out, t0);
    c.AddCached(2, 0, &out, t0);
    KR_EXPECT(out.size() == 1u && out[0].error.empty() && !out[0].cached);
  }
  {  // a join: the waiting name goes once only the joined rank is missing
    out.clear();
    Coordinator c = ThreeRanksWithTwoCachedNames();
    c.AddCached(0, 0, &out, t0);
    c.AddCached(1, 0, &out, t0);
    c.Add(2, Join(), &out, t0);
    KR_EXPECT_EQ(out.size(), 1u);
    KR_EXPECT(out[0].names == std::vector<std::string>({"a"}) && out[0].send_metas);
    KR_EXPECT(out[0].error.empty());
    // While rank 2 is joined, ids take the table's path too.
    out.clear();
    c.AddCached(0, 1, &out, t0);
    c.AddCached(1, 1, &out, t0);
    KR_EXPECT(out.size() == 1u && out[0].send_metas && out[0].error.empty());
  }
  {  // stalls are reported, and fail, like those of names in the table
    out.clear();
    Coordinator c = ThreeRanksWithTwoCachedNames();
    c.AddCached(0, 0, &out, t0);
    c.AddCached(2, 0, &out, t0);
    c.AddCached(0, 1, &out, t0 + seconds(25));
    KR_EXPECT(c.StallReports(t0 + seconds(59), seconds(60)).empty());
    auto reports = c.StallReports(t0 + seconds(61), seconds(60));
    KR_EXPECT_EQ(reports.size(), 2u);
    KR_EXPECT(reports[0].find("ranks [0] have been waiting 36 s for ranks [1, 2] to submit "
                              "tensor 'b'") == 0);
    KR_EXPECT(reports[1].find("ranks [0, 2] have been waiting 61 s for ranks [1] to submit "
                              "tensor 'a' (allreduce of float32[4]") == 0);
    c.AddCached(1, 1, &out, t0 + seconds(62));  // moved: the table completes it
    c.AddCached(2, 1, &out, t0 + seconds(62));
    c.FailStalled(t0 + seconds(200), seconds(100), &out);
    KR_EXPECT_EQ(out.size(), 2u);
    KR_EXPECT(out[0].names[0] == "b" && out[0].error.empty());
    KR_EXPECT(out[1].names[0] == "a" && out[1].status == KR_ABORTED);
    KR_EXPECT(out[1].rows == std::vector<int64_t>({1, 0, 1}));  // sent by id by ranks 0 and 2
    KR_EXPECT(!c.HasWaiting());
    // Only stall checks that are due move names.
    out.clear();
    c.AddCached(0, 0, &out, t0 + seconds(300));
    c.FailStalled(t0 + seconds(350), seconds(100), &out);
    c.AddCached(1, 0, &out, t0 + seconds(350));
    c.AddCached(2, 0, &out, t0 + seconds(350));
    KR_EXPECT(out.size() == 1u && out[0].cached);
  }
}

KR_TEST(JoinedRanksCountAsPresentUntilEveryRankHasJoined) {
  Coordinator c(3);
  std::vector<Response> out;
  c.Add(0, Allreduce("w", {4}), &out);
  c.Add(1, Join(), &out);  // rank 1 is out of data
  KR_EXPECT(out.empty());
  c.Add(2, Allreduce("w", {4}), &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT(out[0].error.empty() && out[0].send_metas);
  KR_EXPECT(out[0].metas[0] == Allreduce("w", {4}));
  KR_EXPECT(out[0].cache_ids == std::vector<int32_t>({-1}));  // not every rank took part
  // A name waiting only for the rank that joins goes when it joins.
  out.clear();
  TensorMeta g = Allreduce("g", {3, 2});
  g.collective = Collective::kAllgather;
  c.Add(0, g, &out);
  c.Add(2, Join(), &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT(out[0].rows == std::vector<int64_t>({3, 0, 0}));
  out.clear();
  c.Add(0, Allreduce("m", {4}, DataType::kFloat32, ReduceOp::kMax), &out);
  KR_EXPECT_EQ(out[0].status, KR_FAILED_PRECONDITION);
  KR_EXPECT(out[0].error.find("tensor 'm' (allreduce of float32[4] op=max) cannot run while "
                              "ranks [1, 2] have joined: op=max cannot take zeros") !=
            std::string::npos);
  out.clear();
  c.Add(0, Join(), &out);
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT(out[0].error.empty());
  KR_EXPECT(out[0].rows == std::vector<int64_t>({0}));  // the last rank to join
  // Nobody is joined any more.
  out.clear();
  c.Add(0, Allreduce("after", {1}), &out);
  KR_EXPECT(out.empty());
}

KR_TEST(StalledTensorsOfOneStepMakeOneReport) {
  using std::chrono::seconds;
  const auto t0 = Coordinator::Clock::now();
  Coordinator c(3);
  std::vector<Response> out;
  for (const char* name : {"g7", "g1", "g2", "g3", "g4", "g5", "g6"}) {
    c.Add(0, Allreduce(name, {2}), &out, t0);
    c.Add(2, Allreduce(name, {2}), &out, t0);
  }
  c.Add(0, Allreduce("late", {2}), &out, t0 + seconds(25));  // half the check time by 61 s
  c.Add(0, Allreduce("later", {2}), &out, t0 + seconds(35));
  auto reports = c.StallReports(t0 + seconds(61), seconds(60));
  KR_EXPECT_EQ(reports.size(), 2u);
  KR_EXPECT(reports[1].find("ranks [0, 2] have been waiting up to 61 s for ranks [1] to submit 7 "
                            "tensors: 'g1' (allreduce of float32[2]") == 0);
  KR_EXPECT(reports[1].find("'g5' (allreduce of float32[2] op=sum) and 2 more") !=
            std::string::npos);
  KR_EXPECT(reports[0].find("ranks [0] have been waiting 36 s for ranks [1, 2] to submit tensor "
                            "'late'") == 0);
  reports = c.StallReports(t0 + seconds(95), seconds(60));
  KR_EXPECT_EQ(reports.size(), 1u);
  KR_EXPECT(reports[0].find("'later'") != std::string::npos);
}

KR_TEST(AProcessSetsCoordinatorNamesWorldRanks) {
  using std::chrono::seconds;
  const auto t0 = Coordinator::Clock::now();
  Coordinator c(2);
  c.SetWorldRanks({1, 3}, "in process set 4, ");
  std::vector<Response> out;
  c.Add(1, Allreduce("x", {2}), &out, t0);
  auto reports = c.StallReports(t0 + seconds(61), seconds(60));
  KR_EXPECT_EQ(reports.size(), 1u);
  KR_EXPECT(reports[0].find("in process set 4, ranks [3] have been waiting 61 s for ranks [1]") ==
            0);
  c.Add(0, Allreduce("x", {3}), &out, t0);
  KR_EXPECT(out[0].error.find("in process set 4, ranks disagree on tensor 'x': rank 1 sent "
                              "allreduce of float32[3] op=sum; rank 3 sent") != std::string::npos);
}

KR_TEST(FusionKeepsProcessSetsApart) {
  auto decided = Agree(1, {{Allreduce("a", {1}), Allreduce("b", {1})}});
  decided[1].process_set = 1;
  KR_EXPECT_EQ(Fuse(decided, 1 << 20).size(), 2u);
}

KR_TEST(JoinedRanksDoNotStandInForProcessSetChangesAndAreNoStall) {
  using std::chrono::seconds;
  const auto t0 = Coordinator::Clock::now();
  Coordinator c(2);
  std::vector<Response> out;
  c.Add(1, Join(), &out, t0);
  TensorMeta add = Allreduce("keras_ring.add_process_set.0", {});
  add.collective = Collective::kAddProcessSet;
  add.splits = {0, 1};
  c.Add(0, add, &out, t0);
  // Rank 1 must call it itself, and cannot while joined: an error, not a wait.
  KR_EXPECT_EQ(out.size(), 1u);
  KR_EXPECT(out[0].error.find("cannot run while ranks [1] have joined: every rank must call it") !=
            std::string::npos);
  // Waiting in a join is not a stall.
  KR_EXPECT(c.StallReports(t0 + seconds(61), seconds(60)).empty());
  out.clear();
  c.FailStalled(t0 + seconds(61), seconds(60), &out);
  KR_EXPECT(out.empty());
}

KR_TEST(ARanksOwnObjectionFailsTheNameOnEveryRank) {
  TensorMeta bad = Allreduce("a2a", {4});
  bad.collective = Collective::kAlltoall;
  TensorMeta good = bad;
  bad.error = "alltoall splits must add up to the first dimension";
  // The objection is the error, an invalid argument, though rank 1's shape differs too.
  bad.shape = {5};
  auto out = Agree(3, {{good}, {bad}, {good}});
  KR_EXPECT_EQ(out[0].status, KR_INVALID_ARGUMENT);
  KR_EXPECT_EQ(out[0].error, std::string("keras-ring: tensor 'a2a' is invalid on rank 1: alltoall "
                                         "splits must add up to the first dimension"));
}

// A group of the given members, as the engine describes one.
TensorMeta Group(const std::string& name, std::vector<TensorMeta> members) {
  TensorMeta g = members[0];
  g.name = name;
  g.shape.clear();
  g.members = std::make_shared<std::vector<TensorMeta>>(std::move(members));
  return g;
}

KR_TEST(AGroupIsAgreedAndCachedAsOneName) {
  const TensorMeta g = Group("g", {Allreduce("g.0", {3}), Allreduce("g.1", {2, 2}, DataType::kInt64),
                                   Allreduce("g.2", {0}, DataType::kFloat32, ReduceOp::kMax)});
  Coordinator c(2);
  std::vector<Response> out;
  BothAdd(c, g, &out);
  BothAdd(c, g, &out);
  KR_EXPECT_EQ(out.size(), 2u);
  KR_EXPECT(out[1].error.empty());
  KR_EXPECT(out[1].names == std::vector<std::string>({"g"}));
  KR_EXPECT_EQ(out[1].bytes, 3u * 4 + 4u * 8);  // the members' bytes
  KR_EXPECT(out[1].cache_ids == std::vector<int32_t>({0}));
  out.clear();
  c.AddCached(0, 0, &out);
  c.AddCached(1, 0, &out);
  KR_EXPECT(out.size() == 1 && out[0].cached && out[0].bytes == 44u);
  KR_EXPECT(out[0].metas[0] == g);  // what a joined rank would need to stand in
  KR_EXPECT_EQ(g.Describe(), std::string("group of 3 allreduces: 'g.0' allreduce of float32[3] "
                                         "op=sum, ..."));
}

KR_TEST(RanksThatDisagreeOnAGroupHearWhichTensorDiffers) {
  const std::vector<TensorMeta> members = {Allreduce("g.0", {3}), Allreduce("g.1", {5}),
                                           Allreduce("g.2", {7})};
  auto changed = members;
  changed[1].shape = {6};
  auto out = Agree(3, {{Group("g", members)}, {Group("g", changed)}, {Group("g", members)}});
  KR_EXPECT_EQ(out[0].status, KR_FAILED_PRECONDITION);
  KR_EXPECT_EQ(out[0].error,
               std::string("keras-ring: ranks disagree on tensor 1 of group 'g': rank 0 sent "
                           "'g.1', allreduce of float32[5] op=sum; rank 1 sent 'g.1', allreduce "
                           "of float32[6] op=sum; rank 2 sent 'g.1', allreduce of float32[5] "
                           "op=sum"));
  // A member missing on one rank (refused there, say); a member named differently.
  auto fewer = members;
  fewer.pop_back();
  out = Agree(2, {{Group("g", members)}, {Group("g", fewer)}});
  KR_EXPECT(out[0].error.find("tensor 2 of group 'g': rank 0 sent 'g.2', allreduce of float32[7] "
                              "op=sum; rank 1 sent a group of 2 tensors") != std::string::npos);
  auto renamed = members;
  renamed[0].name = "other";
  out = Agree(2, {{Group("g", members)}, {Group("g", renamed)}});
  KR_EXPECT(out[0].error.find("rank 1 sent 'other'") != std::string::npos);
  // A lone tensor of the group's name.
  out = Agree(2, {{Group("g", members)}, {Allreduce("g", {3})}});
  KR_EXPECT(out[0].error.find("rank 1 sent a lone tensor, not a group (allreduce of float32[3]") !=
            std::string::npos);
  // The same members in a different order are a different group.
  auto swapped = members;
  std::swap(swapped[0], swapped[2]);
  out = Agree(2, {{Group("g", members)}, {Group("g", swapped)}});
  KR_EXPECT(out[0].error.find("tensor 0 of group 'g'") != std::string::npos);
}

KR_TEST(JoinedRanksStandInForAGroupOfSumsOnly) {
  const TensorMeta sums = Group("s", {Allreduce("s.0", {3}), Allreduce("s.1", {1})});
  const TensorMeta mixed =
      Group("m", {Allreduce("m.0", {3}), Allreduce("m.1", {1}, DataType::kFloat32, ReduceOp::kMin)});
  Coordinator c(2);
  std::vector<Response> out;
  TensorMeta join;
  join.name = "join";
  join.collective = Collective::kJoin;
  join.dtype = DataType::kInt32;
  c.Add(1, join, &out);
  c.Add(0, sums, &out);
  c.Add(0, mixed, &out);
  KR_EXPECT_EQ(out.size(), 2u);
  KR_EXPECT(out[0].error.empty() && out[0].send_metas && out[0].metas[0] == sums);
  KR_EXPECT(out[1].error.find("tensor 'm.1' of group 'm' (allreduce of float32[1] op=min) cannot "
                              "run while ranks [1] have joined: op=min cannot take zeros from "
                              "joined ranks") != std::string::npos);
}

KR_TEST(AGroupTravelsWithItsMembers) {
  const TensorMeta g = Group("g", {Allreduce("g.0", {3}), Allreduce("g.1", {2}, DataType::kInt8)});
  ReadyList ready;
  ready.items.push_back({-1, g});
  ready.items.push_back({-1, Allreduce("lone", {1})});
  ReadyList back = DeserializeReadyList(SerializeReadyList(ready));
  KR_EXPECT(back.items[0].meta == g && back.items[0].meta.members->size() == 2u);
  KR_EXPECT(back.items[1].meta == ready.items[1].meta && !back.items[1].meta.members);
  ResponseList list;
  list.responses.resize(1);
  list.responses[0].names = {"g"};
  list.responses[0].cache_ids = {-1};
  list.responses[0].metas = {g};
  list.responses[0].send_metas = true;
  ResponseList got = DeserializeResponses(SerializeResponses(list));
  KR_EXPECT(got.responses[0].metas[0] == g);
}

KR_TEST(FusionCountsAGroupsMembers) {
  const TensorMeta g = Group("g", {Allreduce("g.0", {4}), Allreduce("g.1", {4})});  // 32 bytes
  auto out = Agree(1, {{Allreduce("a", {4}), g, Allreduce("b", {4})}});
  auto fused = Fuse(out, 48);
  KR_EXPECT_EQ(fused.size(), 2u);
  KR_EXPECT(fused[0].names == std::vector<std::string>({"a", "g"}));
  KR_EXPECT_EQ(fused[0].bytes, 48u);
}

}  // namespace
}  // namespace kr_test
