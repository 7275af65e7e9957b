#include "process_set.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "algorithms.h"
#include "log.h"

namespace keras_ring {

namespace {

// Bytes of one shared-memory round (each rank maps two per member), when
// KERAS_RING_SHM_SLOT_BYTES is 0 (auto). Measured (docs/performance.md):
// with a core per rank, small rounds that stay in the caches win; with more
// ranks than cores each round's two waits cost context switches, so fewer,
// larger rounds win.
constexpr size_t kShmSlotBytes = size_t(256) << 10;
constexpr size_t kShmSlotBytesOversubscribed = size_t(4) << 20;

// CPUs this process may run on.
int UsableCpus() {
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) != 0) return 1;
  return CPU_COUNT(&cpus);
}

// Of `ranks` (ascending), those on the host of `hosts[rank]`.
std::vector<int> SameHost(const std::vector<int>& ranks, const std::vector<std::string>& hosts,
                          int rank) {
  std::vector<int> local;
  for (int r : ranks) {
    if (hosts[r] == hosts[rank]) local.push_back(r);
  }
  return local;
}

}  // namespace

int IndexOf(const std::vector<int>& ranks, int rank) {
  const auto pos = std::lower_bound(ranks.begin(), ranks.end(), rank);
  return pos != ranks.end() && *pos == rank ? static_cast<int>(pos - ranks.begin()) : -1;
}

HostLayout::HostLayout(const std::vector<int>& ranks, const std::vector<std::string>& hosts,
                       int rank)
    : local(SameHost(ranks, hosts, rank)),
      local_rank(IndexOf(local, rank)),
      min_local(static_cast<int>(ranks.size())) {
  for (int r : ranks) {
    const std::vector<int> theirs = SameHost(ranks, hosts, r);
    min_local = std::min(min_local, static_cast<int>(theirs.size()));
    max_local = std::max(max_local, static_cast<int>(theirs.size()));
    if (IndexOf(theirs, r) == local_rank) cross.push_back(r);
  }
}

void SetUpSharedMemory(ProcessSet& set, int32_t id, World& world,
                       const std::vector<std::string>& hosts, const SharedMemoryOptions& o) {
  if (!o.enabled || set.size() < 2) return;
  // The members on each host, from the host names agreed at start.
  const HostLayout layout(set.ranks, hosts, world.rank());
  const std::vector<int>& local = layout.local;
  const int local_rank = layout.local_rank;
  const int local_size = static_cast<int>(local.size());
  // Across hosts: hierarchical when every host holds the same number (> 1)
  // of members, so that the blocks of each local rank line up across hosts.
  const bool spans_hosts = local_size != set.size();
  if (spans_hosts &&
      !(o.hierarchical && layout.min_local == layout.max_local && layout.min_local > 1)) {
    return;
  }
  // The slot size must agree across hosts too (the hierarchical blocks line
  // up), and a host with more members than cores makes every member take
  // small allreduces over the network: agreed over the whole set.
  struct Wish {
    uint64_t slot_bytes;
    uint8_t oversubscribed;
  } wish{o.slot_bytes, local_size > UsableCpus()};
  std::vector<Wish> wishes(set.size());
  AllgatherBytes(*set.transport, &wish, sizeof wish, wishes.data());
  uint64_t slot_bytes = 0;
  for (const Wish& w : wishes) {
    set.shm_oversubscribed = set.shm_oversubscribed || w.oversubscribed;
    slot_bytes = std::max(slot_bytes, w.slot_bytes);
  }
  if (slot_bytes == 0) {
    slot_bytes = set.shm_oversubscribed ? kShmSlotBytesOversubscribed : kShmSlotBytes;
  }
  // Rounds are a slot unless KERAS_RING_SEGMENT_BYTES or the autotuner
  // asks for smaller ones; the slots are made large enough for what they
  // may ask.
  set.shm_round_bytes = slot_bytes;
  slot_bytes = std::max<uint64_t>(slot_bytes, o.largest_round);
  // Unique on the host: the first local member's pid (which lets a later job
  // spot the segments of a crashed one) and a random number.
  char key[64] = {};
  if (local_rank == 0) {
    const unsigned long long nonce =
        (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
    std::snprintf(key, sizeof key, "%dx%016llx-%d", static_cast<int>(getpid()), nonce, id);
  }
  {
    std::unique_ptr<Transport> host = world.Connect(local, GroupId(id, 1));
    BroadcastOptions bcast;
    bcast.buffer = key;
    bcast.bytes = sizeof key;
    Broadcast(*host, bcast);
  }
  // Agreed over the whole set: all hosts use shared memory, or none.
  auto all_agree = [&](bool ok) { return AllAgree(*set.transport, ok); };
  std::string why;
  // Waiting in shared memory, the world moves its messages along (see
  // World::Progress), so that control messages this rank has sent reach
  // the ranks that need them before they can join.
  set.shm = ShmGroup::Create(local_rank, local, key, slot_bytes, all_agree, &why,
                             [&world] { world.Progress(); }, world.timeout());
  if (!set.shm && !why.empty()) {
    Log(LogLevel::kWarning, "cannot use shared memory (" + why + "); process set " +
                                std::to_string(id) + " allreduces over the network instead");
  }
  if (set.shm && spans_hosts) set.cross = world.Connect(layout.cross, GroupId(id, 2));
}

}  // namespace keras_ring
