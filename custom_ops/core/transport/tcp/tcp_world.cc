#include "tcp_world.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "../../common.h"
#include "../../log.h"
#include "handshake.h"
#include "socket.h"

namespace keras_ring {

namespace {

constexpr size_t kHeaderBytes = 16;
constexpr uint8_t kDataFrame = 0;
constexpr uint8_t kControlFrame = 1;
// The sender's engine failed and it leaves the job: the payload says why.
constexpr uint8_t kGoodbyeFrame = 2;
// Whether the peer is alive (World's WaitOnPeer), and its answer: no payload.
constexpr uint8_t kAskFrame = 3;
constexpr uint8_t kAnswerFrame = 4;
// How long Abort waits for its goodbyes to leave, at most.
constexpr auto kGoodbyeWait = std::chrono::seconds(2);
// Socket reads land here when no large payload is being read: many small
// frames then cost one recv() between them.
constexpr size_t kStagingBytes = size_t(64) << 10;
// A payload with at least this much left is read straight into its
// destination, with no copy.
constexpr size_t kDirectReadBytes = size_t(16) << 10;
// The most one pass moves on one connection in one direction before the
// others get their turn: a ring rank must keep its send to the next rank
// flowing while it drains the previous one. Copying 1 MiB takes less time
// than a 4 MiB send buffer takes to drain even at 100 Gb/s.
constexpr size_t kPassBytes = size_t(1) << 20;
constexpr int kMaxIov = 64;
// A thread waiting in poll() wakes at least this often, so that work another
// thread queued meanwhile (which this poll does not watch) waits no longer.
constexpr int kPollSliceMs = 20;
// How often Progress() polls the sockets, at most.
constexpr auto kProgressEvery = std::chrono::milliseconds(1);
// How long an accepted connection may take to authenticate, and how many may
// be authenticating at once.
constexpr auto kAcceptHandshakeTimeout = std::chrono::seconds(10);
constexpr size_t kMaxAccepting = 64;

void EncodeHeader(char* out, uint8_t kind, uint32_t tag, uint64_t bytes) {
  out[0] = static_cast<char>(kind);
  out[1] = out[2] = out[3] = 0;
  for (int i = 0; i < 4; ++i) out[4 + i] = static_cast<char>(tag >> (24 - 8 * i));
  for (int i = 0; i < 8; ++i) out[8 + i] = static_cast<char>(bytes >> (56 - 8 * i));
}

std::string Reason(const EngineError& e) {
  const std::string what = e.what();
  const std::string prefix = "keras-ring: ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}

std::string R(int rank) { return "rank " + std::to_string(rank); }

std::string MessageOf(size_t bytes, int tag) {
  return "a message of " + std::to_string(bytes) + " bytes (tag " + std::to_string(tag) + ")";
}

struct SendOp {
  int peer = 0;
  int tag = 0;
  bool control = false;
  char header[kHeaderBytes];
  const char* data = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // of header and payload
  std::shared_ptr<const std::vector<char>> message;  // a control message, kept alive
  std::unique_ptr<char[]> copy;  // the payload, once its Pending was dropped mid-write
  bool done = false;
  std::string error;  // set if it failed: Wait() throws it
  bool lost = false;  // the error is the peer's loss
};

struct RecvOp {
  char* buf = nullptr;
  size_t bytes = 0;
  int peer = 0;
  int tag = 0;
  bool done = false;
  bool dropped = false;  // its Pending is gone: the matching frame is discarded
  std::string error;
  bool lost = false;
};

// Throws an operation's error: a PeerLostError when the peer was lost.
template <typename Op>
[[noreturn]] void ThrowError(const Op& op) {
  if (op.lost) throw PeerLostError(op.error);
  throw EngineError(op.error);
}

// A data frame that arrived before its receive was posted.
struct Unexpected {
  explicit Unexpected(size_t n) : data(new char[n]), bytes(n) {}
  std::unique_ptr<char[]> data;
  size_t bytes;
  bool complete = false;
};

// Per (peer, tag). Invariant: `unexpected` is empty whenever `posted` is not.
struct TagQueue {
  std::deque<std::shared_ptr<RecvOp>> posted;
  std::deque<std::shared_ptr<Unexpected>> unexpected;
};

// The frame being read from a peer.
struct Incoming {
  char header[kHeaderBytes];
  size_t header_got = 0;
  bool in_payload = false;
  uint8_t kind = 0;
  int tag = 0;
  size_t bytes = 0;
  size_t got = 0;
  char* dest = nullptr;  // where the payload goes; null: discarded
  std::shared_ptr<RecvOp> recv;
  std::shared_ptr<Unexpected> unexpected;
  std::shared_ptr<std::vector<char>> control;
};

struct Peer {
  Socket socket;
  bool lost = false;
  std::string lost_reason;
  bool control_lost = false;  // control messages to it were lost with it
  bool released = false;      // it has said its last (World::Release): its loss is no failure
  bool answered = false;      // it answered since it was last asked
  // Control messages come first, at most behind a data frame already begun.
  std::deque<std::shared_ptr<SendOp>> out;
  size_t control_queued = 0;
  Incoming in;
  std::unordered_map<int, TagQueue> tags;
};

}  // namespace

struct TcpWorld::State {
  State(const TcpWorldOptions& o)
      : rank(o.rank), size(o.size), host(o.host), timeout(o.timeout), peers(o.size),
        staging(kStagingBytes), discard(kStagingBytes) {}

  const int rank;
  const int size;
  const std::string host;
  const std::chrono::milliseconds timeout;

  std::mutex mu;  // guards everything below
  std::vector<Peer> peers;
  std::deque<std::pair<int, std::vector<char>>> inbox;
  std::vector<char> staging;
  std::vector<char> discard;
  Clock::time_point progressed;  // Progress()'s last poll

  std::string Lost(int peer, const std::string& doing) const {
    return "keras-ring: " + R(peer) + "'s connection was lost (" + peers[peer].lost_reason +
           "); " + R(rank) + " was " + doing;
  }
  template <typename Op>
  static void SetLost(Op& op, const std::string& error) {
    op.error = error;
    op.lost = true;
  }
  std::string Mismatch(size_t posted, int peer, int tag, size_t sent) const {
    return "keras-ring: " + R(rank) + " posted a receive of " + std::to_string(posted) +
           " bytes from " + R(peer) + " (tag " + std::to_string(tag) +
           ") but the matching send has " + std::to_string(sent) + " bytes";
  }
  static std::string Sending(const SendOp& op) {
    return op.control ? "sending a control message of " + std::to_string(op.bytes) + " bytes to it"
                      : "sending " + MessageOf(op.bytes, op.tag) + " to it";
  }
  static std::string Receiving(const RecvOp& op) {
    return "receiving " + MessageOf(op.bytes, op.tag) + " from it";
  }

  void CheckTransfer(const void* buf, size_t bytes, int peer, int tag) const {
    KR_CHECK(peer >= 0 && peer < size && peer != rank,
             "a peer among the other ranks of a TCP world of " + std::to_string(size) + ", " +
                 R(rank) + " got " + std::to_string(peer));
    KR_CHECK(bytes <= Transport::kMaxMessageBytes,
             "a message of at most kMaxMessageBytes, got " + std::to_string(bytes) + " bytes");
    KR_CHECK(tag >= 0, "a tag of at least 0, got " + std::to_string(tag));
    KR_CHECK(buf != nullptr || bytes == 0, "a buffer for a message of " + std::to_string(bytes) +
                                               " bytes, got null");
  }

  // Marks `peer` lost: everything pending with it fails, naming it.
  void MarkLost(int peer, const std::string& reason) {
    Peer& p = peers[peer];
    if (p.lost) return;
    p.lost = true;
    p.lost_reason = reason;
    p.control_lost = p.control_queued > 0;
    for (const auto& op : p.out) SetLost(*op, Lost(peer, Sending(*op)));
    p.out.clear();
    p.control_queued = 0;
    for (auto& [tag, q] : p.tags) {
      for (const auto& op : q.posted) SetLost(*op, Lost(peer, Receiving(*op)));
      q.posted.clear();
      if (!q.unexpected.empty() && !q.unexpected.back()->complete) q.unexpected.pop_back();
    }
    if (p.in.recv) SetLost(*p.in.recv, Lost(peer, Receiving(*p.in.recv)));
    p.in = Incoming();
    // The descriptor stays open until the world goes: another thread may be
    // polling it, and a closed number could be reused meanwhile.
    shutdown(p.socket.fd(), SHUT_RDWR);
  }

  void StartFrame(int peer) {
    Peer& p = peers[peer];
    Incoming& in = p.in;
    const auto* h = reinterpret_cast<const unsigned char*>(in.header);
    uint32_t tag = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < 4; ++i) tag = tag << 8 | h[4 + i];
    for (int i = 0; i < 8; ++i) bytes = bytes << 8 | h[8 + i];
    if (h[0] > kAnswerFrame || h[1] != 0 || h[2] != 0 || h[3] != 0 || tag > INT_MAX ||
        bytes > Transport::kMaxMessageBytes) {
      MarkLost(peer, "it sent a malformed frame header");
      return;
    }
    in.in_payload = true;
    in.kind = h[0];
    in.tag = static_cast<int>(tag);
    in.bytes = static_cast<size_t>(bytes);
    in.got = 0;
    in.dest = nullptr;
    if (in.kind != kDataFrame) {
      in.control = std::make_shared<std::vector<char>>(in.bytes);
      in.dest = in.control->data();
      return;
    }
    TagQueue& q = p.tags[in.tag];
    if (q.posted.empty()) {
      in.unexpected = std::make_shared<Unexpected>(in.bytes);
      in.dest = in.unexpected->data.get();
      q.unexpected.push_back(in.unexpected);
      return;
    }
    std::shared_ptr<RecvOp> op = std::move(q.posted.front());
    q.posted.pop_front();
    if (op->dropped) return;
    if (op->bytes != in.bytes) {
      op->error = Mismatch(op->bytes, peer, in.tag, in.bytes);
      return;
    }
    in.dest = op->buf;
    in.recv = std::move(op);
  }

  void FinishFrame(int peer) {
    Incoming& in = peers[peer].in;
    if (in.kind == kGoodbyeFrame) {
      const std::string why(in.control->begin(), in.control->end());
      MarkLost(peer, "it left the job: " + why);
      return;
    }
    const uint8_t kind = in.kind;
    if (kind == kControlFrame) inbox.emplace_back(peer, std::move(*in.control));
    if (in.recv) in.recv->done = true;
    if (in.unexpected) in.unexpected->complete = true;
    in.in_payload = false;
    in.control.reset();
    in.recv.reset();
    in.unexpected.reset();
    if (kind == kAskFrame) SendEmpty(peer, kAnswerFrame);
    if (kind == kAnswerFrame) peers[peer].answered = true;
  }

  // Asks `peer` whether it is alive; its world answers in any of its waits.
  void Ask(int peer) {
    peers[peer].answered = false;
    SendEmpty(peer, kAskFrame);
  }

  void SendEmpty(int peer, uint8_t kind) {
    auto op = std::make_shared<SendOp>();
    op->peer = peer;
    op->control = true;
    EncodeHeader(op->header, kind, 0, 0);
    Queue(peer, op);
  }

  // Parses bytes read into the staging buffer.
  void Consume(int peer, const char* data, size_t n) {
    Peer& p = peers[peer];
    Incoming& in = p.in;
    while (n > 0 && !p.lost) {
      if (!in.in_payload) {
        const size_t take = std::min(n, kHeaderBytes - in.header_got);
        std::memcpy(in.header + in.header_got, data, take);
        in.header_got += take;
        data += take;
        n -= take;
        if (in.header_got < kHeaderBytes) continue;
        in.header_got = 0;
        StartFrame(peer);
        if (!p.lost && in.bytes == 0) FinishFrame(peer);
        continue;
      }
      const size_t take = std::min(n, in.bytes - in.got);
      if (in.dest) std::memcpy(in.dest + in.got, data, take);
      in.got += take;
      data += take;
      n -= take;
      if (in.got == in.bytes) FinishFrame(peer);
    }
  }

  // Reads what has arrived from `peer`, without blocking.
  void ReadFrom(int peer) {
    Peer& p = peers[peer];
    size_t budget = kPassBytes;
    while (!p.lost && budget > 0) {
      Incoming& in = p.in;
      const bool direct = in.in_payload && in.bytes - in.got >= kDirectReadBytes;
      ssize_t n;
      if (direct) {
        size_t want = std::min(in.bytes - in.got, budget);
        char* to = in.dest ? in.dest + in.got : discard.data();
        if (!in.dest) want = std::min(want, discard.size());
        n = recv(p.socket.fd(), to, want, 0);
        if (n > 0) {
          in.got += static_cast<size_t>(n);
          if (in.got == in.bytes) FinishFrame(peer);
        }
      } else {
        n = recv(p.socket.fd(), staging.data(), staging.size(), 0);
        if (n > 0) Consume(peer, staging.data(), static_cast<size_t>(n));
      }
      if (n > 0) {
        budget -= std::min(budget, static_cast<size_t>(n));
      } else if (n == 0) {
        MarkLost(peer, "it closed the connection: the process exited or destroyed its world");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return;
      } else if (errno != EINTR) {
        MarkLost(peer, std::strerror(errno));
      }
    }
  }

  // Writes queued frames to `peer`, without blocking.
  void WriteTo(int peer) {
    Peer& p = peers[peer];
    size_t budget = kPassBytes;
    while (!p.lost && !p.out.empty() && budget > 0) {
      iovec iov[kMaxIov];
      int count = 0;
      size_t total = 0;
      for (auto it = p.out.begin(); it != p.out.end() && count + 2 <= kMaxIov && total < budget;
           ++it) {
        SendOp& op = **it;
        if (op.sent < kHeaderBytes) {
          iov[count++] = {op.header + op.sent, kHeaderBytes - op.sent};
          total += kHeaderBytes - op.sent;
        }
        const size_t payload_sent = op.sent > kHeaderBytes ? op.sent - kHeaderBytes : 0;
        if (op.bytes > payload_sent) {
          iov[count++] = {const_cast<char*>(op.data) + payload_sent, op.bytes - payload_sent};
          total += op.bytes - payload_sent;
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = count;
      const ssize_t n = sendmsg(p.socket.fd(), &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno != EINTR) MarkLost(peer, std::strerror(errno));
        continue;
      }
      budget -= std::min(budget, static_cast<size_t>(n));
      size_t left = static_cast<size_t>(n);
      while (!p.out.empty()) {
        SendOp& op = *p.out.front();
        const size_t take = std::min(left, kHeaderBytes + op.bytes - op.sent);
        op.sent += take;
        left -= take;
        if (op.sent < kHeaderBytes + op.bytes) break;
        op.done = true;
        if (op.control) --p.control_queued;
        p.out.pop_front();
      }
    }
  }

  // Waits up to timeout_ms for any socket to be ready, then services those
  // that are. Unlocks while it waits.
  void PollOnce(std::unique_lock<std::mutex>& lock, int timeout_ms) {
    // Per thread, kept: a waiting rank polls thousands of times a second.
    thread_local std::vector<pollfd> fds;
    thread_local std::vector<int> who;
    fds.clear();
    who.clear();
    for (int r = 0; r < size; ++r) {
      const Peer& p = peers[r];
      if (r == rank || p.lost) continue;
      fds.push_back({p.socket.fd(), static_cast<short>(POLLIN | (p.out.empty() ? 0 : POLLOUT)), 0});
      who.push_back(r);
    }
    lock.unlock();
    int ready = 0;
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    } else {
      ready = poll(fds.data(), fds.size(), timeout_ms);
    }
    lock.lock();
    if (ready <= 0) return;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents & POLLOUT) WriteTo(who[i]);
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ReadFrom(who[i]);
    }
  }

  // Makes progress until done() (which may throw the operation's error):
  // true, or false once `deadline` has passed.
  template <typename Done>
  bool ProgressUntil(std::unique_lock<std::mutex>& lock, Done done, Clock::time_point deadline) {
    while (!done()) {
      if (Clock::now() >= deadline) return false;
      PollOnce(lock, std::min(kPollSliceMs, MillisecondsUntil(deadline)));
    }
    return true;
  }

  // The same up to the world's timeout, then throws what timed_out() says.
  template <typename Done, typename TimedOut>
  void WaitUntil(std::unique_lock<std::mutex>& lock, Done done, TimedOut timed_out) {
    if (!ProgressUntil(lock, done, Clock::now() + timeout)) throw PeerLostError(timed_out());
  }

  // A transfer's wait on `peer` (WaitOnPeer): timed_out() and the verdict on
  // the peer make the error.
  template <typename Done, typename TimedOut>
  void WaitOn(int peer, std::unique_lock<std::mutex>& lock, Done done, TimedOut timed_out) {
    const PeerWait found = WaitOnPeer(
        timeout, [&](Clock::time_point deadline) { return ProgressUntil(lock, done, deadline); },
        [&] { Ask(peer); }, [&] { return peers[peer].answered; });
    if (found != PeerWait::kDone) {
      throw PeerLostError(timed_out() + ": " + PeerWaitVerdict(found, peer));
    }
  }

  void Queue(int peer, const std::shared_ptr<SendOp>& op) {
    Peer& p = peers[peer];
    if (p.lost) {
      SetLost(*op, Lost(peer, Sending(*op)));
      return;
    }
    if (op->control) {
      const bool data_begun = !p.out.empty() && !p.out.front()->control && p.out.front()->sent > 0;
      p.out.insert(p.out.begin() + static_cast<long>(p.control_queued + (data_begun ? 1 : 0)),
                   op);
      ++p.control_queued;
    } else {
      p.out.push_back(op);
    }
    // Handed to the kernel at once where its buffer has room: the transfer
    // then overlaps whatever the caller does before it waits.
    WriteTo(peer);
  }

  std::shared_ptr<SendOp> Isend(const void* buf, size_t bytes, int peer, int tag) {
    CheckTransfer(buf, bytes, peer, tag);
    auto op = std::make_shared<SendOp>();
    op->peer = peer;
    op->tag = tag;
    op->data = static_cast<const char*>(buf);
    op->bytes = bytes;
    EncodeHeader(op->header, kDataFrame, static_cast<uint32_t>(tag), bytes);
    std::lock_guard<std::mutex> lock(mu);
    Queue(peer, op);
    return op;
  }

  std::shared_ptr<RecvOp> Irecv(void* buf, size_t bytes, int peer, int tag) {
    CheckTransfer(buf, bytes, peer, tag);
    auto op = std::make_shared<RecvOp>();
    op->buf = static_cast<char*>(buf);
    op->bytes = bytes;
    op->peer = peer;
    op->tag = tag;
    std::lock_guard<std::mutex> lock(mu);
    Peer& p = peers[peer];
    TagQueue& q = p.tags[tag];
    if (q.unexpected.empty()) {
      if (p.lost) {
        SetLost(*op, Lost(peer, Receiving(*op)));
      } else {
        q.posted.push_back(op);
      }
      return op;
    }
    std::shared_ptr<Unexpected> u = std::move(q.unexpected.front());
    q.unexpected.pop_front();
    Incoming& in = p.in;
    const bool arriving = in.unexpected == u;
    if (arriving) {
      // The rest of the frame goes straight to the receive's buffer.
      in.unexpected.reset();
      in.dest = nullptr;
    }
    if (u->bytes != bytes) {
      op->error = Mismatch(bytes, peer, tag, u->bytes);
      return op;
    }
    if (bytes > 0) std::memcpy(op->buf, u->data.get(), arriving ? in.got : bytes);
    if (arriving) {
      in.dest = op->buf;
      in.recv = op;
    } else {
      op->done = true;
    }
    return op;
  }

  void WaitSend(SendOp& op) {
    std::unique_lock<std::mutex> lock(mu);
    WaitOn(
        op.peer, lock,
        [&] {
          if (!op.error.empty()) ThrowError(op);
          return op.done;
        },
        [&] {
          const size_t handed = op.sent > kHeaderBytes ? op.sent - kHeaderBytes : 0;
          return "keras-ring: " + R(rank) + " waited " + std::to_string(timeout.count()) +
                 " ms for " + R(op.peer) + " to take " + MessageOf(op.bytes, op.tag) + " (" +
                 std::to_string(handed) + " bytes of it were handed over)";
        });
  }

  void WaitRecv(RecvOp& op) {
    std::unique_lock<std::mutex> lock(mu);
    WaitOn(
        op.peer, lock,
        [&] {
          if (!op.error.empty()) ThrowError(op);
          return op.done;
        },
        [&] {
          const Incoming& in = peers[op.peer].in;
          const size_t got = in.recv.get() == &op ? in.got : 0;
          return "keras-ring: " + R(rank) + " waited " + std::to_string(timeout.count()) +
                 " ms for a message of " + std::to_string(op.bytes) + " bytes from " +
                 R(op.peer) + " (tag " + std::to_string(op.tag) + ") that never came (" +
                 std::to_string(got) + " bytes of it arrived)";
        });
  }

  // A Pending dropped before its transfer finished (error paths): the
  // transfer must stop using the caller's buffer.
  void DropSend(const std::shared_ptr<SendOp>& op) {
    std::lock_guard<std::mutex> lock(mu);
    if (op->done || !op->error.empty()) return;
    auto& out = peers[op->peer].out;
    if (op->sent == 0) {
      out.erase(std::find(out.begin(), out.end(), op));
      return;
    }
    // Begun: the peer expects the rest of the frame, so it is sent from a copy.
    op->copy.reset(new char[op->bytes]);
    std::memcpy(op->copy.get(), op->data, op->bytes);
    op->data = op->copy.get();
  }

  void DropRecv(const std::shared_ptr<RecvOp>& op) {
    std::lock_guard<std::mutex> lock(mu);
    if (op->done || !op->error.empty()) return;
    op->dropped = true;
    Incoming& in = peers[op->peer].in;
    if (in.recv == op) {
      in.recv.reset();
      in.dest = nullptr;
    }
  }
};

namespace {

class SendPending : public Pending {
 public:
  SendPending(TcpWorld::State* s, std::shared_ptr<SendOp> op) : s_(s), op_(std::move(op)) {}
  ~SendPending() override { s_->DropSend(op_); }
  void Wait() override { s_->WaitSend(*op_); }

 private:
  TcpWorld::State* s_;
  std::shared_ptr<SendOp> op_;
};

class RecvPending : public Pending {
 public:
  RecvPending(TcpWorld::State* s, std::shared_ptr<RecvOp> op) : s_(s), op_(std::move(op)) {}
  ~RecvPending() override { s_->DropRecv(op_); }
  void Wait() override { s_->WaitRecv(*op_); }

 private:
  TcpWorld::State* s_;
  std::shared_ptr<RecvOp> op_;
};

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(TcpWorld::State* s) : s_(s) {}
  int rank() const override { return s_->rank; }
  int size() const override { return s_->size; }
  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override {
    return std::make_unique<SendPending>(s_, s_->Isend(buf, bytes, peer, tag));
  }
  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override {
    return std::make_unique<RecvPending>(s_, s_->Irecv(buf, bytes, peer, tag));
  }

 private:
  TcpWorld::State* s_;
};

std::string StoreKey(const TcpWorldOptions& o, int rank) {
  return o.store_prefix + "/" + std::to_string(rank);
}

}  // namespace

TcpWorld::TcpWorld(const TcpWorldOptions& o) {
  KR_CHECK(o.size >= 1 && o.rank >= 0 && o.rank < o.size,
           "a rank in [0, size) and size >= 1, got rank " + std::to_string(o.rank) + " of " +
               std::to_string(o.size));
  KR_CHECK(o.store != nullptr, "a store to find the other ranks through, got null");
  KR_CHECK(!o.secret.empty(), "the job's secret, got an empty one");
  KR_CHECK(!o.listen_host.empty() && o.listen_host != "0.0.0.0" && o.listen_host != "::",
           "an address to listen on that the other ranks can reach (it is published as this "
           "rank's), got '" + o.listen_host + "'");
  KR_CHECK(o.timeout.count() > 0,
           "a positive timeout, got " + std::to_string(o.timeout.count()) + " ms");
  state_ = std::make_unique<State>(o);
  transport_ = std::make_unique<TcpTransport>(state_.get());
  if (o.size == 1) return;

  const Clock::time_point deadline = Clock::now() + o.timeout;
  const std::string me = R(o.rank);
  int port = 0;
  Socket listener = Listen(o.listen_host, &port);
  const std::string address = FormatHostPort(o.listen_host, port);
  o.store->Set(StoreKey(o, o.rank), std::vector<char>(address.begin(), address.end()));

  // Each rank connects to the ranks below it and accepts the ranks above:
  // rank 0 accepts first, so no rank waits on one that waits on it.
  for (int j = 0; j < o.rank; ++j) {
    std::string theirs;
    try {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      const std::vector<char> value =
          o.store->Get(StoreKey(o, j), std::max(left, std::chrono::milliseconds(0)));
      theirs.assign(value.begin(), value.end());
      const HostPort hp = ParseHostPort(theirs, R(j) + "'s address in the store");
      Socket s = ConnectBefore(hp.host, hp.port, deadline);
      ConnectHandshake(s.fd(), o.secret, o.rank, j, o.size, deadline);
      state_->peers[j].socket = std::move(s);
    } catch (const EngineError& e) {
      throw PeerLostError("keras-ring: " + me + " could not connect to " + R(j) +
                          (theirs.empty() ? "" : " at " + theirs) + " within " +
                          std::to_string(o.timeout.count()) + " ms: " + Reason(e));
    }
  }
  // Connections are authenticated side by side, so that a client that
  // connects and says nothing holds up no real peer.
  struct Accepting {
    Socket socket;
    std::string address;
    std::unique_ptr<AcceptingHandshake> handshake;
    Clock::time_point deadline;
  };
  std::vector<Accepting> accepting;
  auto refuse = [&](const std::string& address, const std::string& why) {
    KR_LOG(kWarning, me + " refused a connection from " + address + ": " + why);
  };
  int waiting = o.size - 1 - o.rank;
  while (waiting > 0) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int j = o.rank + 1; j < o.size; ++j) {
        if (!state_->peers[j].socket.valid()) missing += (missing.empty() ? "" : ", ") + R(j);
      }
      throw PeerLostError("keras-ring: " + me + " waited " + std::to_string(o.timeout.count()) +
                          " ms for " + missing + " to connect to it at " + address);
    }
    Clock::time_point wake = deadline;
    for (auto it = accepting.begin(); it != accepting.end();) {
      if (now >= it->deadline) {
        refuse(it->address, "it did not finish the handshake within " +
                                std::to_string(kAcceptHandshakeTimeout.count()) + " s");
        it = accepting.erase(it);
      } else {
        wake = std::min(wake, it->deadline);
        ++it;
      }
    }
    std::vector<pollfd> fds{{listener.fd(), POLLIN, 0}};
    for (const Accepting& a : accepting) fds.push_back({a.socket.fd(), POLLIN, 0});
    if (poll(fds.data(), fds.size(), MillisecondsUntil(wake)) <= 0) continue;
    // Back to front, so that erasing one leaves the others' indices valid.
    for (size_t i = fds.size() - 1; i >= 1; --i) {
      if (fds[i].revents == 0) continue;
      Accepting& a = accepting[i - 1];
      try {
        const int from = a.handshake->Feed();
        if (from < 0) continue;
        if (state_->peers[from].socket.valid()) {
          throw EngineError("keras-ring: " + R(from) + " is connected already");
        }
        state_->peers[from].socket = std::move(a.socket);
        --waiting;
      } catch (const EngineError& e) {
        refuse(a.address, Reason(e));
      }
      accepting.erase(accepting.begin() + static_cast<long>(i - 1));
    }
    if (fds[0].revents == 0) continue;
    if (accepting.size() >= kMaxAccepting) {
      // Full of strangers: the oldest makes room, so a real peer still gets in.
      refuse(accepting.front().address, "too many connections were authenticating at once");
      accepting.erase(accepting.begin());
    }
    Accepting a;
    a.socket = AcceptPending(listener.fd(), &a.address);
    if (!a.socket.valid()) continue;
    try {
      a.handshake = std::make_unique<AcceptingHandshake>(a.socket.fd(), o.secret, o.rank, o.size);
      a.deadline = std::min(deadline, Clock::now() + kAcceptHandshakeTimeout);
      accepting.push_back(std::move(a));
    } catch (const EngineError& e) {
      refuse(a.address, Reason(e));
    }
  }
  for (const Accepting& a : accepting) {
    refuse(a.address, "the mesh was complete before it finished the handshake");
  }
  // Socket buffer sizes are left to Linux's autotuning, which grows them to
  // tcp_wmem/tcp_rmem's maximum (4-6 MiB) as the link needs: setting
  // SO_SNDBUF/SO_RCVBUF would turn it off and cap them at wmem_max/rmem_max,
  // 208 KiB by default.
  for (const Peer& p : state_->peers) {
    if (p.socket.valid()) SetNoDelay(p.socket.fd());
  }
}

TcpWorld::~TcpWorld() = default;

int TcpWorld::rank() const { return state_->rank; }
int TcpWorld::size() const { return state_->size; }
std::string TcpWorld::host() const { return state_->host; }
std::chrono::milliseconds TcpWorld::timeout() const { return state_->timeout; }
Transport& TcpWorld::transport() { return *transport_; }
int TcpWorld::max_tag() const { return INT_MAX; }

void TcpWorld::Post(int to, std::shared_ptr<const std::vector<char>> message) {
  State& s = *state_;
  KR_CHECK(message != nullptr, "a control message, got null");
  s.CheckTransfer(message->data(), message->size(), to, 0);
  auto op = std::make_shared<SendOp>();
  op->peer = to;
  op->control = true;
  op->data = message->data();
  op->bytes = message->size();
  op->message = std::move(message);
  EncodeHeader(op->header, kControlFrame, 0, op->bytes);
  std::lock_guard<std::mutex> lock(s.mu);
  s.Queue(to, op);
  if (!op->error.empty()) ThrowError(*op);
}

bool TcpWorld::Receive(int* from, std::vector<char>* message) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.inbox.empty()) s.PollOnce(lock, 0);
  if (!s.inbox.empty()) {
    *from = s.inbox.front().first;
    *message = std::move(s.inbox.front().second);
    s.inbox.pop_front();
    return true;
  }
  for (int r = 0; r < s.size; ++r) {
    if (s.peers[r].lost && !s.peers[r].released) {
      throw PeerLostError(s.Lost(r, "receiving control messages"));
    }
  }
  return false;
}

void TcpWorld::Flush() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  int waiting_for = -1;
  s.WaitUntil(
      lock,
      [&] {
        for (int r = 0; r < s.size; ++r) {
          if (s.peers[r].control_lost && !s.peers[r].released) {
            throw PeerLostError(s.Lost(r, "flushing control messages"));
          }
          if (s.peers[r].control_queued > 0) {
            waiting_for = r;
            return false;
          }
        }
        return true;
      },
      [&] {
        return "keras-ring: " + R(s.rank) + " waited " + std::to_string(s.timeout.count()) +
               " ms for " + R(waiting_for) + " to take " +
               std::to_string(s.peers[waiting_for].control_queued) +
               " control messages; it is not reading";
      });
}

void TcpWorld::Abort(const std::string& why) {
  State& s = *state_;
  auto reason = std::make_shared<const std::vector<char>>(
      why.begin(), why.begin() + std::min<size_t>(why.size(), 4096));
  std::unique_lock<std::mutex> lock(s.mu);
  std::vector<std::shared_ptr<SendOp>> goodbyes;
  for (int r = 0; r < s.size; ++r) {
    if (r == s.rank || s.peers[r].lost) continue;
    auto op = std::make_shared<SendOp>();
    op->peer = r;
    op->control = true;
    op->data = reason->data();
    op->bytes = reason->size();
    op->message = reason;
    EncodeHeader(op->header, kGoodbyeFrame, 0, op->bytes);
    s.Queue(r, op);
    goodbyes.push_back(op);
  }
  // Briefly: a peer that does not read hears of it when the sockets close.
  const auto deadline = Clock::now() + std::min<Clock::duration>(kGoodbyeWait, s.timeout);
  auto all_gone = [&] {
    for (const auto& op : goodbyes) {
      if (!op->done && op->error.empty()) return false;
    }
    return true;
  };
  while (!all_gone() && Clock::now() < deadline) {
    s.PollOnce(lock, std::min(kPollSliceMs, MillisecondsUntil(deadline)));
  }
  for (int r = 0; r < s.size; ++r) {
    if (r != s.rank) s.MarkLost(r, "this rank left the job");
  }
}

void TcpWorld::Release(int rank) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->peers.at(rank).released = true;
}

void TcpWorld::Ask(int peer) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->Ask(peer);
}

bool TcpWorld::Answered(int peer) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->peers.at(peer).answered;
}

void TcpWorld::Progress() {
  // Called in every few hundred spins of a shared-memory wait, where the
  // kernel moves the bytes anyway: only answers and queued control messages
  // need this, and a poll() system call in every call would slow the wait.
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const auto now = Clock::now();
  if (now - s.progressed < kProgressEvery) return;
  s.progressed = now;
  s.PollOnce(lock, 0);
}

}  // namespace keras_ring
