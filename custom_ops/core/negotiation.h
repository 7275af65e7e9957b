// Agreement on what to run and in what order. Every rank tells the
// coordinator (rank 0) which named tensors it has ready; once a name is ready
// on every rank the coordinator checks that the ranks agree on it and appends
// a Response. All ranks then run responses in the coordinator's order, so the
// collectives line up even when frameworks issue ops in different orders.
//
// This file holds the transport-free parts (metadata, wire format, the
// coordinator's table) so that they can be tested without MPI.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

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
  int root_rank = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall: rows for each rank; empty = even split

  std::string Describe() const;  // "float32[2,3] Sum" and the like, for errors
};

// The coordinator's decision about one tensor, or several fused into one
// collective (allreduces of the same dtype, op and scale factors).
struct Response {
  std::vector<std::string> names;
  std::string error;                 // empty when the ranks agree
  kr_status status = KR_OK;          // KR_INVALID_ARGUMENT (disagreement), KR_ABORTED (stall)
  // allgather: each rank's first dimension; alltoall: rows[i * size + j] is
  // the number of rows rank i sends to rank j.
  std::vector<int64_t> rows;

  // Known to the coordinator only (not sent): what fusion compares.
  TensorMeta meta;                   // rank 0's view
  size_t bytes = 0;
};

// Packs consecutive-or-later allreduce responses that agree on dtype, op and
// scale factors into fused responses of at most `threshold` bytes (a tensor
// larger than the threshold goes alone). Order of first appearance is kept;
// other responses pass through unchanged. Every rank runs the result in the
// same order, so the choice needs no further agreement.
std::vector<Response> Fuse(std::vector<Response> responses, size_t threshold);

struct ResponseList {
  std::vector<Response> responses;
  // A rank shut down (shutdown() or process exit): the job's engine stops and
  // what is still pending fails on every rank. -1: no shutdown.
  int shutdown_rank = -1;
};

// Little-endian-agnostic byte serialisation between processes of one job
// (all ranks run the same build, so native layout is fine).
std::vector<char> SerializeMetas(const std::vector<TensorMeta>& metas, bool shutdown);
void DeserializeMetas(const std::vector<char>& bytes, std::vector<TensorMeta>* metas,
                      bool* shutdown);
std::vector<char> SerializeResponses(const ResponseList& list);
ResponseList DeserializeResponses(const std::vector<char>& bytes);

class Coordinator {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Coordinator(int size) : size_(size), shutdown_(size, false) {}

  // Records that `rank` has `meta` ready; appends a Response to `out` when the
  // last rank arrives.
  void Add(int rank, TensorMeta meta, std::vector<Response>* out,
           Clock::time_point now = Clock::now());
  bool HasWaiting() const { return !table_.empty(); }

  // Stall handling. Names some ranks have submitted for longer than
  // `report_after`: one report line each, once. Names waiting longer than
  // `fail_after` (if positive): an error Response each, naming the missing
  // ranks, and the name leaves the table.
  std::vector<std::string> StallReports(Clock::time_point now, Clock::duration report_after);
  void FailStalled(Clock::time_point now, Clock::duration fail_after, std::vector<Response>* out);
  void RequestShutdown(int rank);
  int FirstShutdownRank() const { return first_shutdown_; }
  bool AllRequestedShutdown() const;

 private:
  struct Entry {
    std::vector<TensorMeta> metas;  // by rank; `present` says which are set
    std::vector<bool> present;
    int count = 0;
    Clock::time_point first_seen;
    bool reported = false;
  };
  // "ranks [0, 2] have been waiting 61 s for ranks [1] to submit tensor 'x' (...)".
  std::string Stall(const std::string& name, const Entry& e, Clock::time_point now) const;
  Response Decide(const std::string& name, const Entry& entry) const;

  int size_;
  std::unordered_map<std::string, Entry> table_;
  std::vector<bool> shutdown_;
  int first_shutdown_ = -1;
};

}  // namespace keras_ring
