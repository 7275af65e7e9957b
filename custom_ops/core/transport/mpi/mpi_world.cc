#include "mpi_world.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../common.h"

namespace keras_ring {

namespace {

using Clock = std::chrono::steady_clock;

// Whether NewMpiWorld started MPI (then FinalizeMpi ends it).
bool we_initialized_mpi = false;
// Whether a rank failed to answer this one within the timeout, or this rank's
// engine failed: MPI_Finalize would then wait (in the launcher's barrier) for
// a rank that may never come, so FinalizeMpi leaves it out and the launcher
// takes the exit for a failure and ends the job.
std::atomic<bool> world_failed{false};

void CheckMpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw EngineError(std::string("keras-ring: ") + what + " failed: " + std::string(text, len));
}

std::string SecondsText(std::chrono::milliseconds d) { return FormatSeconds(d.count() / 1e3); }

// Waits for `request` like MPI_Wait, calling `while_waiting` now and then,
// until `deadline`; returns false if the deadline passed first.
bool WaitUntil(MPI_Request* request, MPI_Status* status, Clock::time_point deadline,
               const std::function<void()>& while_waiting, const char* what) {
  // MPI_Test calls between two calls of while_waiting and of the clock
  // (about as costly as one MPI_Test when there is nothing to do).
  constexpr unsigned kTestsPerCheck = 64;
  for (unsigned tests = 1;; ++tests) {
    int done = 0;
    CheckMpi(MPI_Test(request, &done, status), what);
    if (done) return true;
    if (tests % kTestsPerCheck == 0) {
      if (while_waiting) while_waiting();
      if (Clock::now() > deadline) return false;
    }
    std::this_thread::yield();
  }
}

// A transfer given up on (its wait timed out, or it was dropped on an error
// path): MPI must not go on touching a buffer that is about to be freed.
void Abandon(MPI_Request* request) {
  if (*request == MPI_REQUEST_NULL) return;
  MPI_Cancel(request);
  int done = 0;
  MPI_Test(request, &done, MPI_STATUS_IGNORE);
  if (!done) MPI_Request_free(request);
}

class MpiWorld;

class MpiPending : public Pending {
 public:
  MpiPending(MPI_Request request, size_t bytes, bool is_recv, int peer, int tag,
             MpiWorld* world)
      : request_(request), bytes_(bytes), is_recv_(is_recv), peer_(peer), tag_(tag),
        world_(world) {}
  ~MpiPending() override { Abandon(&request_); }
  void Wait() override;

 private:
  MPI_Request request_;
  size_t bytes_;
  bool is_recv_;
  int peer_, tag_;
  MpiWorld* world_;  // outlives its transfers
};

// Point-to-point over the world's data communicator.
class MpiTransport : public Transport {
 public:
  MpiTransport(MPI_Comm comm, int rank, int size, MpiWorld* world)
      : comm_(comm), rank_(rank), size_(size), world_(world) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override {
    KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
    MPI_Request req;
    CheckMpi(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req),
             "MPI_Isend");
    return std::make_unique<MpiPending>(req, bytes, false, peer, tag, world_);
  }
  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override {
    KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
    MPI_Request req;
    CheckMpi(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req),
             "MPI_Irecv");
    return std::make_unique<MpiPending>(req, bytes, true, peer, tag, world_);
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
  MpiWorld* world_;
};

class MpiWorld : public World {
 public:
  MpiWorld(std::chrono::milliseconds timeout, bool threads_supported)
      : timeout_(timeout), threads_supported_(threads_supported) {
    try {
      control_ = Duplicate("control");
      data_ = Duplicate("data");
    } catch (...) {
      FreeComms();
      throw;
    }
    MPI_Comm_rank(control_, &rank_);
    MPI_Comm_size(control_, &size_);
    int* tag_ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(data_, MPI_TAG_UB, &tag_ub, &found);
    max_tag_ = found && tag_ub ? *tag_ub : 32767;  // the least the standard allows
    // Waiting for data, the world receives its control messages: MPICH keeps
    // an unreceived small message in the sender's share of its shared-memory
    // queues, so a rank that let them pile up while it waited (for a rank
    // busy in another process set's collectives, say) could leave a peer
    // without room to send the very data that rank waits for.
    drain_ = [this] { Drain(); };
    answered_.assign(size_, false);
    transport_ = std::make_unique<MpiTransport>(data_, rank_, size_, this);
    char name[256] = {};
    gethostname(name, sizeof name - 1);
    host_ = name;
  }

  ~MpiWorld() override {
    for (auto& send : sends_) {
      Abandon(&send.first);
      // MPI may still read the bytes if the cancel came too late: they are
      // left allocated (an engine that failed; rare and small).
      if (send.first != MPI_REQUEST_NULL) new std::shared_ptr<const std::vector<char>>(send.second);
    }
    FreeComms();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string host() const override { return host_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  bool threads_supported() const override { return threads_supported_; }

  void Post(int to, std::shared_ptr<const std::vector<char>> message) override {
    Send(to, kTag, std::move(message));
    Reap();
  }

  bool Receive(int* from, std::vector<char>* message) override {
    if (inbox_.empty()) Drain();
    Reap();
    if (inbox_.empty()) return false;
    *from = inbox_.front().first;
    *message = std::move(inbox_.front().second);
    inbox_.pop_front();
    return true;
  }

  void Flush() override {
    const auto deadline = Clock::now() + timeout_;
    // By index: draining may answer a question, which adds a send.
    for (size_t i = 0; i < sends_.size(); ++i) {
      if (!WaitUntil(&sends_[i].first, MPI_STATUS_IGNORE, deadline, drain_, "MPI_Test (control)")) {
        world_failed = true;
        throw PeerLostError("keras-ring: rank " + std::to_string(rank_) + " waited " +
                            SecondsText(timeout_) +
                            " s (KERAS_RING_TIMEOUT) for its control messages to leave; a rank "
                          "it sends to is stuck or stopped");
      }
    }
    sends_.clear();
  }

  void Progress() override { Drain(); }
  // Every other rank is told why, in a notice that fails its waits; the
  // launcher ends the job once this process exits without MPI_Finalize.
  void Abort(const std::string& why) override {
    world_failed = true;
    auto notice = std::make_shared<const std::vector<char>>(
        why.begin(), why.begin() + std::min<size_t>(why.size(), kMaxNoticeBytes));
    try {
      const size_t first = sends_.size();
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) Send(r, kNoticeTag, notice);
      }
      // Briefly: a rank that does not take it is stuck, and hears of it when the job ends.
      const auto deadline = Clock::now() + std::min<Clock::duration>(kNoticeWait, timeout_);
      for (size_t i = first; i < sends_.size(); ++i) {
        if (!WaitUntil(&sends_[i].first, MPI_STATUS_IGNORE, deadline, nullptr,
                       "MPI_Test (notice)")) {
          return;
        }
      }
    } catch (const EngineError&) {
      // MPI itself failed (a peer's death, say): the launcher ends the job.
    }
  }

  const std::function<void()>& drain() const { return drain_; }
  void Ask(int peer) override {
    answered_[peer] = false;
    Send(peer, kAskTag, std::make_shared<const std::vector<char>>());
  }
  bool Answered(int peer) override { return answered_[peer]; }

 protected:
  Transport& transport() override { return *transport_; }
  int max_tag() const override { return max_tag_; }

 private:
  // Tags on the control communicator: control messages, a failed rank's
  // notice (its reason), and the liveness question and its answer.
  static constexpr int kTag = 1;
  static constexpr int kNoticeTag = 2;
  static constexpr int kAskTag = 3;
  static constexpr int kAnswerTag = 4;
  static constexpr size_t kMaxNoticeBytes = 4096;
  static constexpr auto kNoticeWait = std::chrono::seconds(2);

  void Send(int to, int tag, std::shared_ptr<const std::vector<char>> message) {
    MPI_Request req;
    CheckMpi(MPI_Isend(message->data(), static_cast<int>(message->size()), MPI_BYTE, to, tag,
                       control_, &req),
             "MPI_Isend (control)");
    sends_.emplace_back(req, std::move(message));
  }

  MPI_Comm Duplicate(const char* what) {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Request req;
    CheckMpi(MPI_Comm_idup(MPI_COMM_WORLD, &comm, &req), "MPI_Comm_idup");
    if (!WaitUntil(&req, MPI_STATUS_IGNORE, Clock::now() + timeout_, nullptr,
                   "MPI_Test (MPI_Comm_idup)")) {
      world_failed = true;
      // Left to MPI: freeing a communicator still being made is erroneous.
      throw EngineError(std::string("keras-ring: init() waited ") + SecondsText(timeout_) +
                        " s (KERAS_RING_TIMEOUT) for every rank of the MPI job to start the " +
                        what + " communicator; some rank has not called init()");
    }
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    return comm;
  }

  void FreeComms() {
    if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
    if (data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
  }

  // Receives every control message that has arrived into the inbox, answers
  // questions, and throws a notice's reason.
  void Drain() {
    for (;;) {
      int flag = 0;
      MPI_Status status;
      CheckMpi(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, control_, &flag, &status),
               "MPI_Iprobe (control)");
      if (!flag) return;
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      std::vector<char> bytes(count);
      const int from = status.MPI_SOURCE;
      CheckMpi(MPI_Recv(bytes.data(), count, MPI_BYTE, from, status.MPI_TAG, control_,
                        MPI_STATUS_IGNORE),
               "MPI_Recv (control)");
      switch (status.MPI_TAG) {
        case kAskTag:
          Send(from, kAnswerTag, std::make_shared<const std::vector<char>>());
          break;
        case kAnswerTag:
          answered_[from] = true;
          break;
        case kNoticeTag:
          world_failed = true;
          throw PeerLostError("keras-ring: rank " + std::to_string(from) +
                              " gave up and left the job: " +
                              std::string(bytes.begin(), bytes.end()));
        default:
          inbox_.emplace_back(from, std::move(bytes));
      }
    }
  }

  // Forgets the control sends that have completed.
  void Reap() {
    while (!sends_.empty()) {
      int flag = 0;
      CheckMpi(MPI_Test(&sends_.front().first, &flag, MPI_STATUS_IGNORE), "MPI_Test (control)");
      if (!flag) return;
      sends_.pop_front();
    }
  }

  const std::chrono::milliseconds timeout_;
  const bool threads_supported_;
  MPI_Comm control_ = MPI_COMM_NULL;
  MPI_Comm data_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, max_tag_ = 32767;
  std::string host_;
  std::function<void()> drain_;
  std::unique_ptr<MpiTransport> transport_;
  std::deque<std::pair<int, std::vector<char>>> inbox_;
  std::vector<bool> answered_;  // by each rank asked, since it was asked
  // Control messages in flight with the bytes they send from.
  std::deque<std::pair<MPI_Request, std::shared_ptr<const std::vector<char>>>> sends_;
};

void MpiPending::Wait() {
  MPI_Status status;
  // MPI fails a transfer from a rank that died in its middle: the message names that rank.
  const std::string what = std::string(is_recv_ ? "MPI_Test (receive from rank " :
                                                  "MPI_Test (send to rank ") +
                           std::to_string(peer_) + ")";
  const PeerWait found = WaitOnPeer(
      world_->timeout(),
      [&](Clock::time_point deadline) {
        return WaitUntil(&request_, &status, deadline, world_->drain(), what.c_str());
      },
      [&] { world_->Ask(peer_); }, [&] { return world_->Answered(peer_); });
  if (found != PeerWait::kDone) {
    Abandon(&request_);
    world_failed = true;
    throw PeerLostError("keras-ring: rank " + std::to_string(world_->rank()) + " waited " +
                        SecondsText(world_->timeout()) + " s (KERAS_RING_TIMEOUT) for rank " +
                        std::to_string(peer_) + (is_recv_ ? " to send it " : " to receive ") +
                        std::to_string(bytes_) + " bytes (tag " + std::to_string(tag_) +
                        ") in the middle of a collective: " + PeerWaitVerdict(found, peer_));
  }
  if (!is_recv_) return;
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  KR_CHECK(static_cast<size_t>(count) == bytes_,
           "received " + std::to_string(count) + " bytes, expected " + std::to_string(bytes_));
}

}  // namespace

std::unique_ptr<World> NewMpiWorld(std::chrono::milliseconds timeout) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    throw EngineError("keras-ring: MPI has already been finalized in this process; init() "
                      "cannot start it again.");
  }
  int inited = 0, provided = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    CheckMpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    we_initialized_mpi = true;
  } else {
    MPI_Query_thread(&provided);
  }
  // Only the thread running the engine's loop (one at a time) calls MPI, so
  // SERIALIZED is enough; MULTIPLE lets the user's mpi4py run beside us.
  if (provided < MPI_THREAD_SERIALIZED) {
    throw EngineError("keras-ring: MPI was initialised with thread level " +
                      std::to_string(provided) +
                      "; keras-ring needs at least MPI_THREAD_SERIALIZED. Initialise MPI with "
                      "MPI_Init_thread(MPI_THREAD_MULTIPLE) or let keras-ring do it.");
  }
  return std::make_unique<MpiWorld>(timeout, provided == MPI_THREAD_MULTIPLE);
}

void FinalizeMpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (we_initialized_mpi && !finalized && !world_failed) MPI_Finalize();
}

std::string MpiLibraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  return std::string(text, len);
}

}  // namespace keras_ring
