// The job as the engine sees it (Gloo's Context, in our terms): who this
// process is, a control channel to the other ranks, and data transports among
// groups of them. The engine is built on one World and knows nothing else of
// how the ranks reach each other. Implementations: the MPI world
// (mpi/mpi_world.h), the in-process world whose ranks are threads
// (inprocess_world.h, for the engine's C++ tests) and the TCP world
// (tcp/tcp_world.h).
//
// Every blocking call is bounded by timeout() and throws EngineError naming
// the rank it waited for and what for; a peer that is known to be gone (its
// connection dropped) makes the calls that need it throw at once, naming it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace keras_ring {

class World {
 public:
  virtual ~World() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks that give the same name can map each other's shared memory.
  virtual std::string host() const = 0;
  // The bound on every wait of the world and its transports.
  virtual std::chrono::milliseconds timeout() const = 0;
  // Whether other threads of the process may use the library underneath at
  // the same time (MPI_THREAD_MULTIPLE: the user's mpi4py beside us).
  virtual bool threads_supported() const { return false; }

  // A data transport among `group` (world ranks, ascending, this rank among
  // them): its rank i is world rank group[i]. `id` must be the same on every
  // member and differ from that of every other transport in use that shares
  // two of its ranks. Local: no rank waits for another here. The transport
  // may not outlive the world.
  std::unique_ptr<Transport> Connect(const std::vector<int>& group, uint32_t id);

  // The control channel: small messages between world ranks, kept apart from
  // the data. Post queues `message` for rank `to` (not this one) and returns;
  // messages to one rank arrive in the order they were posted.
  virtual void Post(int to, std::shared_ptr<const std::vector<char>> message) = 0;
  // Takes one message that has arrived for this rank, if any.
  virtual bool Receive(int* from, std::vector<char>* message) = 0;
  // Waits until every posted message has been handed over.
  virtual void Flush() = 0;
  // Moves messages along while the caller waits on something the world does
  // not see (a shared-memory collective): MPI, for one, moves a message only
  // while its sender is in an MPI call.
  virtual void Progress() {}
  // Rank `rank` sends this rank no more control messages (its shutdown was
  // its last, or it sends none: the engine's ranks other than 0 hear from
  // rank 0 only): its connection closing from now on is no failure of the
  // control channel (a transfer that needs it still fails).
  virtual void Release(int rank) { (void)rank; }
  // This rank takes no further part (its engine failed, saying `why`):
  // peers waiting on it fail now, with `why` in their error, rather than at
  // the timeout (the TCP world says goodbye and closes its connections; the
  // MPI world sends a notice, and its launcher ends the job when the process
  // exits).
  virtual void Abort(const std::string& why) { (void)why; }
  // Liveness: Ask sends rank `peer` the question "are you alive?", which its
  // world answers in any of its waits and in Receive, even while its engine
  // waits for the user's next tensor; Answered says whether the answer has
  // come since (as Receive or a wait takes it in). A world without the
  // question (the in-process one) takes every rank for alive.
  virtual void Ask(int peer) { (void)peer; }
  virtual bool Answered(int peer) { return (void)peer, true; }

 protected:
  // Point-to-point among all ranks (rank() and size() those of the world),
  // with tags in [0, max_tag()]; Connect multiplexes the groups over it.
  virtual Transport& transport() = 0;
  virtual int max_tag() const = 0;
};

// How a network world's transfer waits on one peer, so that the rank blamed
// at a timeout is the one that is stuck, not one waiting for it: a rank whose
// peer waits in turn for a stopped rank would otherwise time out first and
// name the wrong one. The worlds answer a liveness question in every wait of
// theirs, and a rank that gives up tells the others (a notice that fails
// their waits at once, with its reason). So: wait up to the timeout; then
// ask the peer, for up to kAnswerWait; a peer that answers is alive and
// waits for another rank, whose neighbour will name it and tell this rank,
// so it gets one more timeout; a peer that does not answer is stuck.
//
// `wait_until(deadline)` makes progress until the transfer is done (true) or
// the deadline passes (false), and may throw (the transfer failed, a notice
// came); `ask` sends the question; `answered` says whether an answer came
// since.
enum class PeerWait { kDone, kSilent, kAnswering };
constexpr auto kAnswerWait = std::chrono::seconds(1);
PeerWait WaitOnPeer(std::chrono::milliseconds timeout,
                    const std::function<bool(std::chrono::steady_clock::time_point)>& wait_until,
                    const std::function<void()>& ask, const std::function<bool()>& answered);
// The end of a timed-out wait's message for what WaitOnPeer found of `peer`.
std::string PeerWaitVerdict(PeerWait found, int peer);

// Set-up collectives over a transport: small and blocking (bounded like any
// of its waits); every rank of the transport calls them in the same order.
// Each rank's `bytes` bytes at `mine` land in `all` at offset rank * bytes.
void AllgatherBytes(Transport& t, const void* mine, size_t bytes, void* all);
// Whether every rank passed true.
bool AllAgree(Transport& t, bool ok);

}  // namespace keras_ring
