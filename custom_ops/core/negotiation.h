// Agreement on what to run and in what order. Every rank tells the
// coordinator (rank 0) which named tensors it has ready; once a name is ready
// on every rank the coordinator checks that the ranks agree on it and appends
// a Response. All ranks then run responses in the coordinator's order, so the
// collectives line up even when frameworks issue ops in different orders.
//
// Agreed names enter a response cache (ids every rank knows): later a rank
// whose request matches its cached one sends the id instead of the
// description, and a name that every rank sent by id is scheduled without
// comparing descriptions again; the response then carries only ids.
//
// A rank that has joined (kr join: it has run out of data) counts as present
// for every name; it takes part with zeros shaped by the description the
// response carries, until every rank has joined.
//
// This file holds the transport-free parts (metadata, wire format, the
// coordinator's table) so that they can be tested without MPI.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "autotune.h"
#include "common.h"

namespace keras_ring {

// What a rank says about one tensor it has ready.
struct TensorMeta {
  std::string name;
  Collective collective = Collective::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  // Allreduce and reducescatter: the dtype the data travels and is reduced
  // in (float16 or bfloat16 for a float32 or float64 tensor: compression),
  // else the tensor's own.
  DataType wire_dtype = DataType::kFloat32;
  int root_rank = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall: rows for each rank; empty = even split
                                // (process set changes: see Collective)
  // This rank's own objection to its request (alltoall splits that do not fit
  // the tensor, a root outside the set): sent like any description, so that
  // every rank fails the name with it instead of waiting for this rank.
  std::string error;
  // A group: allreduces that every rank submits together (a grouped op),
  // agreed, cached and scheduled as this one name. Their descriptions, in
  // submission order; the reduction fields above are the first member's and
  // `shape` is empty. Shared because the coordinator copies a cached
  // group's description into every response it makes of it.
  std::shared_ptr<const std::vector<TensorMeta>> members;

  std::string Describe() const;  // "float32[2,3] Sum" and the like, for errors
  bool operator==(const TensorMeta& o) const;
};

// What the two allreduces (or reducescatters) need to agree on across ranks.
bool SameReduction(const TensorMeta& a, const TensorMeta& b);
// The elements of a tensor of `shape`, or of one of its rows (first = 1).
size_t ElementCount(const std::vector<int64_t>& shape, size_t first = 0);
// The bytes a tensor, or a group's members, hold: what fusion counts.
size_t Bytes(const TensorMeta& m);

// The coordinator's decision about one tensor, or several fused into one
// collective (allreduces of the same dtype, op and scale factors).
struct Response {
  int32_t process_set = 0;
  std::vector<std::string> names;
  // Parallel to names: the name's response-cache id, or -1. When `cached`,
  // every rank submitted every name by id and the response travels as ids
  // alone (ranks look the names up); otherwise each name with an id is a new
  // or renewed cache entry, which every rank records with its own request.
  std::vector<int32_t> cache_ids;
  bool cached = false;
  std::string error;                 // empty when the ranks agree
  // KR_INVALID_ARGUMENT (a request invalid on some rank), KR_FAILED_PRECONDITION
  // (ranks disagree, or joined ranks cannot take part), KR_ABORTED (stall).
  kr_status status = KR_OK;
  // allgather: each rank's first dimension; alltoall: rows[i * size + j] is
  // the number of rows rank i sends to rank j; a stalled name's error:
  // rows[r] is 1 if rank r had submitted it (its request fails), 0 if not
  // (a request of that name it makes, or has made, since is a new one,
  // which the coordinator waits on afresh and must not fail).
  std::vector<int64_t> rows;

  // Parallel to names: the first submitting rank's view. Sent only when
  // `send_metas` (some rank has joined and needs it to take part).
  std::vector<TensorMeta> metas;
  bool send_metas = false;
  size_t bytes = 0;                  // coordinator only: what fusion counts
};

struct ResponseList {
  std::vector<Response> responses;
  // A rank shut down (shutdown() or process exit): the job's engine stops and
  // what is still pending fails on every rank. -1: no shutdown.
  int shutdown_rank = -1;
  std::string shutdown_reason;  // why, if its engine failed
  // Settings every rank adopts before running these responses (autotuning);
  // `tuned`: they are final.
  std::optional<TunedParams> params;
  bool tuned = false;
};

// What one rank tells the coordinator in one message.
struct ReadyList {
  int32_t process_set = 0;
  // In submission order (a join must not overtake what was submitted before
  // it): a full description, or the cache id of an unchanged request.
  struct Item {
    int32_t cache_id = -1;  // -1: `meta` holds the description
    TensorMeta meta;
  };
  std::vector<Item> items;
  bool shutdown = false;
  std::string shutdown_reason;  // empty: shutdown() or the process exiting
};

// Byte serialisation between processes of one job (all ranks run the same
// build, so native layout is fine).
std::vector<char> SerializeReadyList(const ReadyList& list);
ReadyList DeserializeReadyList(const std::vector<char>& bytes);
std::vector<char> SerializeResponses(const ResponseList& list);
ResponseList DeserializeResponses(const std::vector<char>& bytes);

class Coordinator {
 public:
  using Clock = std::chrono::steady_clock;

  // Up to cache_capacity names get cache ids (0 turns the cache off); ids
  // are never reassigned, so an id in flight can never mean another name. A
  // name is cached when it is agreed for the second time, so that one-off
  // names (barriers, objects, evaluation) do not fill the cache before the
  // names that repeat every step.
  explicit Coordinator(int size, size_t cache_capacity = 1024)
      : size_(size), cache_capacity_(cache_capacity), shutdown_(size, false),
        joined_(size, false) {}

  // Records that `rank` has `meta` ready; appends a Response to `out` when the
  // last rank arrives (joined ranks count as arrived). A kJoin request marks
  // the rank joined, which may complete names that only it was missing.
  void Add(int rank, TensorMeta meta, std::vector<Response>* out,
           Clock::time_point now = Clock::now());
  // Names ranks in messages as these (world) ranks; default: 0..size-1.
  void SetWorldRanks(std::vector<int> ranks, std::string label) {
    world_ranks_ = std::move(ranks);
    label_ = std::move(label);
  }
  // The same for a name `rank` sent by cache id.
  void AddCached(int rank, int32_t id, std::vector<Response>* out,
                 Clock::time_point now = Clock::now());
  bool HasWaiting() const { return !table_.empty() || !waiting_by_id_.empty(); }

  // Stall handling. Once a name has waited `report_after`, the names that
  // have waited at least half that long, each reported once: one report per
  // group of names that the same ranks wait for and the same ranks miss. Names waiting longer than
  // `fail_after` (if positive): an error Response each, naming the missing
  // ranks, and the name leaves the table.
  std::vector<std::string> StallReports(Clock::time_point now, Clock::duration report_after);
  void FailStalled(Clock::time_point now, Clock::duration fail_after, std::vector<Response>* out);
  // The (world) ranks that names waiting at least `after` miss (joins aside:
  // waiting in one is no stall), each with the stall of the longest-waiting
  // such name ("ranks [0, 2] have been waiting 61 s for ranks [1] to submit
  // tensor 'x' (...)"): the engine asks them whether they are alive.
  std::map<int, std::string> Overdue(Clock::time_point now, Clock::duration after);
  void RequestShutdown(int rank, const std::string& reason = "");
  const std::string& ShutdownReason() const { return shutdown_reason_; }
  int FirstShutdownRank() const { return first_shutdown_; }
  // The (world) ranks whose shutdown has not arrived.
  std::vector<int> NotShutDown() const;

 private:
  struct Entry {
    std::vector<TensorMeta> metas;  // by rank; `present` says which are set
    std::vector<bool> present;
    int count = 0;
    int by_id = 0;                  // how many ranks sent it by cache id
    Clock::time_point first_seen;
    bool reported = false;
    // The first submitting rank's view.
    const TensorMeta& first() const {
      return metas[std::find(present.begin(), present.end(), true) - present.begin()];
    }
  };
  struct Cached {
    std::string name;
    std::vector<TensorMeta> metas;  // each rank's request when it was agreed
  };
  // The fast path: a cached allreduce, broadcast or reducescatter that every
  // rank has so far sent by id waits here, counted by id, with no
  // description copied and nothing allocated (the table costs about 0.7 us
  // per name and round, measured). A full description of the name, a join or
  // a due stall check moves it into the table, whose checks then apply.
  struct ById {
    std::vector<bool> present;  // by rank
    int count = 0;              // 0: not waiting
    size_t slot = 0;            // its place in waiting_by_id_
    Clock::time_point first_seen;
  };
  void MoveToTable(int32_t id);
  // Moves every name waiting by id into the table if one has waited `after`.
  void MoveToTableIfWaited(Clock::time_point now, Clock::duration after);
  void StopWaitingById(int32_t id);
  bool AnyJoined() const { return std::find(joined_.begin(), joined_.end(), true) != joined_.end(); }
  void Record(int rank, TensorMeta meta, bool by_id, std::vector<Response>* out,
              Clock::time_point now);
  bool Complete(const Entry& e) const;
  // Joined ranks take part in these, unasked, with zeros.
  static bool JoinedTakePart(Collective c);
  // Appends the decision on a complete entry and removes it.
  void Finish(const std::string& name, std::vector<Response>* out);
  // The waiting ranks and the missing ones, as lists ("0, 2" and "1").
  std::pair<std::string, std::string> StallRanks(const Entry& e) const;
  // "ranks [0, 2] have been waiting 61 s for ranks [1] to submit tensor 'x' (...)".
  std::string Stall(const std::string& name, const Entry& e, Clock::time_point now) const;
  // Empty unless some rank's request is invalid by itself (TensorMeta::error),
  // else each such rank's error: a KR_INVALID_ARGUMENT.
  std::string InvalidOnSomeRank(const std::string& name, const Entry& e) const;
  // Empty when the present ranks agree and joined ranks can take part, else
  // the error: a KR_FAILED_PRECONDITION.
  std::string Disagreement(const std::string& name, const Entry& e) const;
  // The same for a group: the ranks' members, one by one.
  std::string GroupDisagreement(const std::string& name, const Entry& e) const;

  int WorldRank(int r) const { return world_ranks_.empty() ? r : world_ranks_[r]; }
  std::string RankList(const std::vector<bool>& which, bool value) const;

  int size_;
  size_t cache_capacity_;
  std::vector<int> world_ranks_;
  std::string label_;  // "in process set 1, " or empty
  std::unordered_map<std::string, Entry> table_;
  std::vector<Cached> cache_;  // by id
  std::vector<ById> by_id_;    // by id
  std::vector<int32_t> waiting_by_id_;
  std::unordered_map<std::string, int32_t> cache_ids_;
  std::unordered_set<std::string> seen_once_;  // agreed once, not cached
  std::vector<bool> shutdown_;
  int first_shutdown_ = -1;
  std::string shutdown_reason_;
  std::vector<bool> joined_;
  int last_joined_ = -1;
};

}  // namespace keras_ring
