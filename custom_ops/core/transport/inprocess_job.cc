#include "inprocess_job.h"

#include <climits>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "../common.h"

namespace keras_ring {

// Control messages, one queue per rank, and the faults of each rank.
struct InProcessJob::Mailboxes {
  explicit Mailboxes(int size) : queues(size), faults(size) {}
  enum Fault { kNone, kFail, kFreeze };
  struct RankFault {
    Fault fault = kNone;
    std::string why;
  };
  std::mutex mu;
  std::vector<std::deque<std::pair<int, std::vector<char>>>> queues;  // guarded by mu
  std::vector<RankFault> faults;                                      // guarded by mu

  RankFault FaultOf(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    return faults[rank];
  }
};

namespace {

// A stopped rank's transfer: not done for three timeouts, so that the ranks
// waiting on it give up first, as they would on a stopped process, however
// late their waits began; then it fails, and the rank's thread can end.
class FrozenPending : public Pending {
 public:
  explicit FrozenPending(std::chrono::milliseconds timeout) : timeout_(timeout) {}
  void Wait() override {
    std::this_thread::sleep_for(3 * timeout_);
    throw EngineError("keras-ring: this rank was frozen (test fault)");
  }

 private:
  std::chrono::milliseconds timeout_;
};

}  // namespace

// A rank's endpoint with its faults applied.
class InProcessJob::FaultyTransport : public Transport {
 public:
  FaultyTransport(int rank, std::unique_ptr<Transport> inner, std::chrono::milliseconds timeout,
                  std::shared_ptr<Mailboxes> mailboxes)
      : rank_(rank), inner_(std::move(inner)), timeout_(timeout),
        mailboxes_(std::move(mailboxes)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override {
    if (PendingPtr frozen = Check()) return frozen;
    return inner_->Isend(buf, bytes, peer, tag);
  }
  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override {
    if (PendingPtr frozen = Check()) return frozen;
    return inner_->Irecv(buf, bytes, peer, tag);
  }

 private:
  PendingPtr Check() {
    const Mailboxes::RankFault f = mailboxes_->FaultOf(rank_);
    if (f.fault == Mailboxes::kFail) throw EngineError(f.why);
    if (f.fault == Mailboxes::kFreeze) return std::make_unique<FrozenPending>(timeout_);
    return nullptr;
  }

  const int rank_;
  std::unique_ptr<Transport> inner_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Mailboxes> mailboxes_;
};

class InProcessJob::RankWorld : public World {
 public:
  RankWorld(int rank, std::unique_ptr<Transport> transport, std::string host,
            std::chrono::milliseconds timeout, std::shared_ptr<Mailboxes> mailboxes,
            InProcessWorld transports)
      : rank_(rank), transport_(std::move(transport)), host_(std::move(host)),
        timeout_(timeout), mailboxes_(std::move(mailboxes)), transports_(std::move(transports)) {}

  int rank() const override { return rank_; }
  int size() const override { return transport_->size(); }
  std::string host() const override { return host_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void Post(int to, std::shared_ptr<const std::vector<char>> message) override {
    KR_CHECK(to >= 0 && to < size() && to != rank_, "control message to rank " +
                                                        std::to_string(to));
    std::lock_guard<std::mutex> lock(mailboxes_->mu);
    mailboxes_->queues[to].emplace_back(rank_, *message);
  }
  bool Receive(int* from, std::vector<char>* message) override {
    std::lock_guard<std::mutex> lock(mailboxes_->mu);
    auto& queue = mailboxes_->queues[rank_];
    if (queue.empty()) return false;
    *from = queue.front().first;
    *message = std::move(queue.front().second);
    queue.pop_front();
    return true;
  }
  void Flush() override {}  // delivered when posted
  void Abort(const std::string& why) override { transports_.Disconnect(rank_, why); }

 protected:
  Transport& transport() override { return *transport_; }
  int max_tag() const override { return INT_MAX; }

 private:
  const int rank_;
  std::unique_ptr<Transport> transport_;
  const std::string host_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Mailboxes> mailboxes_;
  InProcessWorld transports_;  // shares the job's mailboxes
};

InProcessJob::InProcessJob(int size, std::chrono::milliseconds timeout,
                           std::vector<std::string> hosts)
    : transports_(size, timeout), hosts_(std::move(hosts)), timeout_(timeout),
      mailboxes_(std::make_shared<Mailboxes>(size)) {
  KR_CHECK(hosts_.empty() || static_cast<int>(hosts_.size()) == size,
           "one host name per rank, or none");
}

std::unique_ptr<World> InProcessJob::Join(int rank) {
  auto transport = std::make_unique<FaultyTransport>(rank, transports_.Connect(rank), timeout_,
                                                     mailboxes_);
  return std::make_unique<RankWorld>(rank, std::move(transport),
                                     hosts_.empty() ? "localhost" : hosts_[rank], timeout_,
                                     mailboxes_, transports_);
}

void InProcessJob::Fail(int rank, const std::string& why) {
  std::lock_guard<std::mutex> lock(mailboxes_->mu);
  mailboxes_->faults.at(rank) = {Mailboxes::kFail, why};
}

void InProcessJob::Freeze(int rank) {
  std::lock_guard<std::mutex> lock(mailboxes_->mu);
  mailboxes_->faults.at(rank) = {Mailboxes::kFreeze, ""};
}

}  // namespace keras_ring
