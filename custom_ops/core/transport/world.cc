#include "world.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "../algorithms.h"
#include "../common.h"

namespace keras_ring {

PeerWait WaitOnPeer(std::chrono::milliseconds timeout,
                    const std::function<bool(std::chrono::steady_clock::time_point)>& wait_until,
                    const std::function<void()>& ask, const std::function<bool()>& answered) {
  using Clock = std::chrono::steady_clock;
  if (wait_until(Clock::now() + timeout)) return PeerWait::kDone;
  ask();
  const auto asked = Clock::now() + std::min<Clock::duration>(kAnswerWait, timeout);
  // In slices, to see the answer come.
  constexpr auto kSlice = std::chrono::milliseconds(10);
  while (!answered()) {
    if (Clock::now() >= asked) return PeerWait::kSilent;
    if (wait_until(std::min(asked, Clock::now() + kSlice))) return PeerWait::kDone;
  }
  return wait_until(Clock::now() + timeout) ? PeerWait::kDone : PeerWait::kAnswering;
}

std::string PeerWaitVerdict(PeerWait found, int peer) {
  const std::string r = "rank " + std::to_string(peer);
  if (found == PeerWait::kSilent) return r + " is stuck or stopped (it does not answer)";
  return r + " is alive (it answers) but has not gone on for another KERAS_RING_TIMEOUT, and no "
         "rank reported a failure: it waits for another rank, or the ranks do not run the same "
         "collectives";
}

namespace {

// Tags a group's transport may use; the algorithms use 0, the set-up
// collectives kSetupTag.
constexpr int kTagsPerGroup = 4;
constexpr int kSetupTag = 1;

// A group's view of the world's transport: ranks renumbered within the
// group, tags moved into the group's own range.
class GroupTransport : public Transport {
 public:
  GroupTransport(Transport& world, std::vector<int> group, int rank, int first_tag)
      : world_(world), group_(std::move(group)), rank_(rank), first_tag_(first_tag) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_.size()); }
  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override {
    return world_.Isend(buf, bytes, WorldRank(peer), Tag(tag));
  }
  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override {
    return world_.Irecv(buf, bytes, WorldRank(peer), Tag(tag));
  }

 private:
  int WorldRank(int peer) const {
    KR_CHECK(peer >= 0 && peer < size(), "peer " + std::to_string(peer) + " of a group of " +
                                             std::to_string(size()));
    return group_[peer];
  }
  int Tag(int tag) const {
    KR_CHECK(tag >= 0 && tag < kTagsPerGroup, "tag " + std::to_string(tag));
    return first_tag_ + tag;
  }

  Transport& world_;
  const std::vector<int> group_;
  const int rank_;
  const int first_tag_;
};

}  // namespace

std::unique_ptr<Transport> World::Connect(const std::vector<int>& group, uint32_t id) {
  int mine = -1;
  for (size_t i = 0; i < group.size(); ++i) {
    KR_CHECK(group[i] >= 0 && group[i] < size() && (i == 0 || group[i - 1] < group[i]),
             "a group lists world ranks in ascending order");
    if (group[i] == rank()) mine = static_cast<int>(i);
  }
  KR_CHECK(mine >= 0, "rank " + std::to_string(rank()) + " connects to a group it is not in");
  const uint64_t first_tag = uint64_t{id} * kTagsPerGroup;
  if (first_tag + kTagsPerGroup - 1 > static_cast<uint64_t>(max_tag())) {
    throw EngineError("keras-ring: too many process sets for this transport (set ids past " +
                      std::to_string(max_tag() / kTagsPerGroup) +
                      " do not fit its message tags); remove sets that are no longer used "
                      "and add fewer");
  }
  return std::make_unique<GroupTransport>(transport(), group, mine, static_cast<int>(first_tag));
}

void AllgatherBytes(Transport& t, const void* mine, size_t bytes, void* all) {
  AllgatherOptions o;
  o.input = mine;
  o.output = all;
  o.block_bytes.assign(t.size(), bytes);
  o.tag = kSetupTag;
  RingAllgather(t, o);
}

bool AllAgree(Transport& t, bool ok) {
  const char mine = ok ? 1 : 0;
  std::string all(t.size(), '\0');
  AllgatherBytes(t, &mine, 1, all.data());
  return all.find('\0') == std::string::npos;
}

}  // namespace keras_ring
