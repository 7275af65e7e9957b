#include "inprocess_transport.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../common.h"

namespace keras_ring {

struct InProcessWorld::State {
  State(int world_size, std::chrono::milliseconds wait_timeout)
      : size(world_size), timeout(wait_timeout), arrived(world_size), gone(world_size),
        why_gone(world_size) {}

  // A send not yet received. Like MPI's rendezvous protocol, the data is read
  // from the sender's buffer only when the receiver waits for it, and the
  // send completes then: an algorithm that writes to a buffer while its send
  // is pending gets corrupted results in tests, as it would with MPI.
  struct Message {
    const char* data = nullptr;
    size_t bytes = 0;
    bool* received = nullptr;  // owned by the send's Pending
  };
  // Messages from src to dst with one tag. Sends and receives are numbered in
  // the order they are posted and matched by number, which keeps the
  // transport's ordering guarantee even when receives are waited out of order.
  struct Channel {
    uint64_t sends_posted = 0;
    uint64_t receives_posted = 0;
    std::map<uint64_t, Message> messages;  // by send number
  };
  using ChannelKey = std::tuple<int, int, int>;  // (src, dst, tag)

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::vector<std::condition_variable> arrived;  // per rank: a message came or was taken
  std::map<ChannelKey, Channel> channels;        // guarded by mu
  InProcessStats stats;                          // guarded by mu
  std::vector<bool> gone;                        // by rank, guarded by mu
  std::vector<std::string> why_gone;             // by rank, guarded by mu

  std::string Lost(int rank) const {
    return "keras-ring: rank " + std::to_string(rank) + " left the job (" + why_gone[rank] + ")";
  }

  void CheckTransfer(size_t bytes, int peer) const {
    KR_CHECK(peer >= 0 && peer < size, "peer " + std::to_string(peer) +
                                           " is not a rank of an in-process world of size " +
                                           std::to_string(size));
    KR_CHECK(bytes <= Transport::kMaxMessageBytes,
             "a message of " + std::to_string(bytes) + " bytes exceeds kMaxMessageBytes");
  }
};

class InProcessWorld::SendPending : public Pending {
 public:
  SendPending(std::shared_ptr<State> state, size_t bytes, int src, int dst, int tag)
      : state_(std::move(state)), bytes_(bytes), src_(src), dst_(dst), tag_(tag) {}

  // A send dropped without Wait() must not leave a pointer to its flag
  // behind: its message is withdrawn (error paths only).
  ~SendPending() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (received_) return;
    auto& messages = state_->channels[{src_, dst_, tag_}].messages;
    for (auto it = messages.begin(); it != messages.end(); ++it) {
      if (it->second.received == &received_) {
        messages.erase(it);
        break;
      }
    }
  }

  void Wait() override {
    std::unique_lock<std::mutex> lock(state_->mu);
    const bool done = state_->arrived[src_].wait_for(
        lock, state_->timeout, [&] { return received_ || state_->gone[dst_]; });
    if (!received_ && state_->gone[dst_]) throw PeerLostError(state_->Lost(dst_));
    if (!done) {
      throw PeerLostError("keras-ring: rank " + std::to_string(src_) + " waited " +
                          std::to_string(state_->timeout.count()) + " ms for rank " +
                          std::to_string(dst_) + " to receive a message of " +
                          std::to_string(bytes_) + " bytes (tag " + std::to_string(tag_) + ")");
    }
  }

  bool* received() { return &received_; }

 private:
  std::shared_ptr<State> state_;
  size_t bytes_;
  int src_, dst_, tag_;
  bool received_ = false;  // guarded by state_->mu
};

class InProcessWorld::ReceivePending : public Pending {
 public:
  ReceivePending(std::shared_ptr<State> state, void* buf, size_t bytes, int src, int dst,
                 int tag, uint64_t number)
      : state_(std::move(state)), buf_(buf), bytes_(bytes), src_(src), dst_(dst), tag_(tag),
        number_(number) {}

  // A receive dropped without Wait() leaves its message in the mailbox; that
  // only happens on an error path, where the world is discarded anyway.
  void Wait() override {
    if (done_) return;
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      State::Channel& channel = state_->channels[{src_, dst_, tag_}];
      const bool arrived = state_->arrived[dst_].wait_for(lock, state_->timeout, [&] {
        return channel.messages.count(number_) > 0 || state_->gone[src_];
      });
      if (!channel.messages.count(number_) && state_->gone[src_]) {
        throw PeerLostError(state_->Lost(src_));
      }
      if (!arrived) {
        throw PeerLostError("keras-ring: rank " + std::to_string(dst_) + " waited " +
                            std::to_string(state_->timeout.count()) +
                            " ms for a message of " + std::to_string(bytes_) +
                            " bytes from rank " + std::to_string(src_) + " (tag " +
                            std::to_string(tag_) + ") that never came");
      }
      auto it = channel.messages.find(number_);
      const State::Message m = it->second;
      KR_CHECK(m.bytes == bytes_, "rank " + std::to_string(dst_) + " posted a receive of " +
                                      std::to_string(bytes_) + " bytes from rank " +
                                      std::to_string(src_) + " (tag " + std::to_string(tag_) +
                                      ") but the matching send has " + std::to_string(m.bytes) +
                                      " bytes");
      // Copied under the lock: the sender's Wait() cannot return meanwhile.
      if (bytes_ > 0) std::memcpy(buf_, m.data, bytes_);
      *m.received = true;
      channel.messages.erase(it);
    }
    state_->arrived[src_].notify_all();
    done_ = true;
  }

 private:
  std::shared_ptr<State> state_;
  void* buf_;
  size_t bytes_;
  int src_, dst_, tag_;
  uint64_t number_;
  bool done_ = false;
};

class InProcessWorld::Endpoint : public Transport {
 public:
  Endpoint(std::shared_ptr<State> state, int rank) : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }

  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override {
    state_->CheckTransfer(bytes, peer);
    auto pending = std::make_unique<SendPending>(state_, bytes, rank_, peer, tag);
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      State::Channel& channel = state_->channels[{rank_, peer, tag}];
      channel.messages.emplace(channel.sends_posted++,
                               State::Message{static_cast<const char*>(buf), bytes,
                                              pending->received()});
      InProcessStats& stats = state_->stats;
      ++stats.messages;
      stats.bytes += bytes;
      stats.max_message_bytes = std::max(stats.max_message_bytes, bytes);
    }
    state_->arrived[peer].notify_all();
    return pending;
  }

  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override {
    state_->CheckTransfer(bytes, peer);
    uint64_t number;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      number = state_->channels[{peer, rank_, tag}].receives_posted++;
    }
    return std::make_unique<ReceivePending>(state_, buf, bytes, peer, rank_, tag, number);
  }

 private:
  std::shared_ptr<State> state_;
  int rank_;
};

InProcessWorld::InProcessWorld(int size, std::chrono::milliseconds timeout) {
  KR_CHECK(size >= 1, "in-process world size must be at least 1, got " + std::to_string(size));
  state_ = std::make_shared<State>(size, timeout);
}

int InProcessWorld::size() const { return state_->size; }

std::unique_ptr<Transport> InProcessWorld::Connect(int rank) {
  KR_CHECK(rank >= 0 && rank < state_->size,
           "rank " + std::to_string(rank) + " is not in an in-process world of size " +
               std::to_string(state_->size));
  return std::make_unique<Endpoint>(state_, rank);
}

void InProcessWorld::Disconnect(int rank, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->gone.at(rank) = true;
    state_->why_gone.at(rank) = why;
  }
  for (auto& cv : state_->arrived) cv.notify_all();
}

InProcessStats InProcessWorld::stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

}  // namespace keras_ring
