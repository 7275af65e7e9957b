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
#include "transport/world.h"

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

// The transports of process set `set` take the world's group ids 3 set (its
// members), 3 set + 1 (its members on one host) and 3 set + 2 (its members of
// one local rank, across hosts): never two alike among sets alive together.
inline uint32_t GroupId(int32_t set, int kind) { return 3 * static_cast<uint32_t>(set) + kind; }

// Where `rank` stands in `ranks` (ascending); -1 if it is not there.
int IndexOf(const std::vector<int>& ranks, int rank);

// How `ranks` (ascending) lie on their hosts, seen from `rank`, one of them;
// `hosts` holds every world rank's host name.
struct HostLayout {
  HostLayout(const std::vector<int>& ranks, const std::vector<std::string>& hosts, int rank);

  std::vector<int> local;  // the ranks on this rank's host
  int local_rank = 0;      // this rank's place among them
  std::vector<int> cross;  // the ranks of this local rank, one per host
  int min_local = 0, max_local = 0;  // the fewest and most ranks a host holds
};

// What SetUpSharedMemory may do, from the engine's settings.
struct SharedMemoryOptions {
  bool enabled = true;
  bool hierarchical = true;  // a set across hosts: shared memory within each
  uint64_t slot_bytes = 0;   // this rank's wish; 0: the engine's choice
  // The largest round that KERAS_RING_SEGMENT_BYTES or the autotuner may
  // ask for: slots are made at least this large.
  uint64_t largest_round = 0;
};

// Collective over the members of `set` (this rank one of them, its transport
// connected): maps the shared memory of the members on each host, if they
// are all on one host or (hierarchical) every host has the same number of
// them, and links this member with those of its local rank on the other
// hosts. Leaves set.shm null where shared memory cannot be used.
void SetUpSharedMemory(ProcessSet& set, int32_t id, World& world,
                       const std::vector<std::string>& hosts, const SharedMemoryOptions& o);

}  // namespace keras_ring
