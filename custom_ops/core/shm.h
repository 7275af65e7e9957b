// Collectives among the ranks of one host through shared memory.
//
// Every rank of a ShmGroup owns one POSIX shared-memory segment, mapped by
// all the others: a small header (progress counter, stop flag, pid) and two
// slots the size of a round. A collective moves through the buffers in
// rounds; in each round every rank copies its part of the data into its
// slot (all but its own block, when no conversion or prescale is needed),
// then each rank reduces its own block straight from every peer's slot
// (and from its input), then each rank copies the finished blocks out of
// their owners' slots. Where MPI's point-to-point path copies a message twice
// (into and out of its own shared buffers) before reducing it, here a peer's
// data is read once, where it lies. The two slots alternate between rounds, so a
// rank may fill round k+1 while its peers still read round k.
//
// Segments are unlinked from /dev/shm as soon as every rank has mapped
// them, so nothing is left behind however the job ends (and segments that a
// crash during setup left behind are removed by the next job on the host).
// Waits check the peers' stop flags and whether their processes still
// exist, so a rank that fails or dies makes the others throw EngineError
// instead of waiting forever.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.h"

namespace keras_ring {

// One input and its output within a collective over several tensors. The
// collective acts on their concatenation; input may equal output.
struct ShmSpan {
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;  // elements
};

struct ShmAllreduceOptions {
  std::vector<ShmSpan> spans;
  DataType dtype = DataType::kFloat32;  // of the spans' data
  // If set, the data is converted to this dtype on the way into the shared
  // buffers, reduced in it and converted back on the way out (compression:
  // float32 spans reduced as float16, say).
  std::optional<DataType> wire_dtype;
  ReduceOp op = ReduceOp::kSum;  // kAverage = kSum with postscale / size
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  // If set, runs on this rank's reduced block of every round before it is
  // post-scaled and handed to the peers (the hierarchical allreduce reduces
  // it across hosts here). Every rank's blocks are cut alike for the same
  // total count, round size and group size.
  std::function<void(void* block, size_t count)> combine;
  // Bytes (of the wire dtype) per round; 0 or more than a slot: a slot.
  // Every rank must pass the same.
  size_t round_bytes = 0;
};

class ShmGroup {
 public:
  // Collective over the group's ranks, which must all call it with the same
  // `key` (unique to this group on the host: every rank's segment is named
  // after it), `slot_bytes` and `world_ranks` (used to name ranks in errors).
  // `all_agree(ok)` must return whether every rank passed true, and act as a
  // barrier. `progress`, if given, is called now and then while a wait lasts:
  // the engine's world moves its messages there (MPI, say, moves a message
  // only while its sender is in an MPI call), so that a message this rank is
  // sending can reach a peer that needs it before it can join. A wait for a
  // peer that lasts `timeout` throws EngineError naming it. Returns null (on
  // every rank) if any rank could not create or map a segment; *why then
  // holds this rank's own reason, or is empty if the failure was another
  // rank's.
  static std::unique_ptr<ShmGroup> Create(int rank, const std::vector<int>& world_ranks,
                                          const std::string& key, size_t slot_bytes,
                                          const std::function<bool(bool)>& all_agree,
                                          std::string* why,
                                          std::function<void()> progress = nullptr,
                                          std::chrono::milliseconds timeout =
                                              std::chrono::seconds(300));
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }

  // Every rank calls it with the same dtype, op, factors and total count; the
  // spans may cut the data differently on each rank. Blocking.
  void Allreduce(const ShmAllreduceOptions& o);

  // Makes the peers' waits on this rank fail (this rank will not come back).
  void Stop();

  // Throws PeerLostError naming a peer whose process has ended without Stop()
  // (killed, crashed, or gone without shutting keras-ring down). Checks
  // nothing where this rank cannot see its peers' pids.
  void CheckPeers() const;

 private:
  struct Header;
  struct Peer {
    Header* header = nullptr;
    char* slots = nullptr;  // two slots of slot_bytes_
    size_t mapped_bytes = 0;
    void* base = nullptr;
  };
  ShmGroup() = default;
  char* Slot(int peer, uint64_t round) const;
  // Announces that this rank has reached `step`, then waits until every peer has.
  void Arrive(uint64_t step);
  void WaitFor(int peer, uint64_t step);

  int rank_ = 0;
  std::vector<int> world_ranks_;
  std::vector<Peer> peers_;  // peers_[rank_] is this rank's own segment
  size_t slot_bytes_ = 0;
  uint64_t step_ = 0;   // progress counter, the same on every rank between collectives
  bool check_pids_ = false;  // peers' pids are visible from here
  std::function<void()> progress_;
  std::chrono::milliseconds timeout_{};
};

}  // namespace keras_ring
