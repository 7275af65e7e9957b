// A process set: a subset of the job's ranks with its own transports,
// coordinator table, pending requests and response cache.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "negotiation.h"
#include "request.h"
#include "shm.h"
#include "transport/transport.h"

namespace keras_ring {

// One process set as this process sees it. Set 0 is the whole job.
struct ProcessSet {
  std::vector<int> ranks;        // world ranks, ascending
  int rank = -1;                 // this process's rank within the set; -1: not a member
  std::unique_ptr<Transport> transport;  // among the members
  // Allreduce through shared memory among the members on this host; if the
  // set spans hosts (hierarchical), `cross` links this member with those of
  // the same local rank on the other hosts.
  std::unique_ptr<ShmGroup> shm;
  size_t shm_round_bytes = 0;  // the round size the engine chose (the slot may be larger)
  // A host has more of the set's ranks than cores: small allreduces go over
  // the network instead (the same on every member).
  bool shm_oversubscribed = false;
  std::unique_ptr<Transport> cross;
  // World rank 0 coordinates every set, member or not.
  std::unique_ptr<Coordinator> coordinator;
  // Members only: requests sent to the coordinator and not yet completed.
  std::unordered_map<std::string, Request> pending;
  bool joined = false;  // a join request of this rank is pending
  // The response cache as this rank knows it: name -> id, and by id the
  // request this rank made when the coordinator cached the name.
  std::unordered_map<std::string, int32_t> cache_ids;
  std::vector<TensorMeta> cached;
  uint64_t collectives_run = 0;  // the same count on every member: names fused groups

  int size() const { return static_cast<int>(ranks.size()); }
};

}  // namespace keras_ring
