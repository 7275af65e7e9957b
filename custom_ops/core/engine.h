// The engine of one rank: a request queue and a loop, run by a background
// thread or by a caller that waits (Drive), that negotiates with the other
// ranks, runs the agreed collectives over the World's transports and
// completes requests through their callbacks. It knows the job only through
// its World (MPI, in-process or TCP).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "autotune.h"
#include "c_api.h"
#include "common.h"
#include "engine_trace.h"
#include "executor.h"
#include "negotiation.h"
#include "options.h"
#include "process_set.h"
#include "request.h"
#include "timeline.h"
#include "transport/world.h"

namespace keras_ring {

class Engine {
 public:
  // Starts the engine on `world`: a collective of every rank (bounded by the
  // world's timeout), which agrees on the host topology and on rank 0's
  // settings, sets up shared memory and starts the background thread.
  // Throws EngineError saying why it could not.
  Engine(EngineOptions options, std::unique_ptr<World> world);
  // Shuts down (see Shutdown) if that has not been done.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Stops the engine of every rank: pending requests, here and on the other
  // ranks, complete with KR_ABORTED. Returns once the loop has ended; later
  // calls return at once. Refused from the engine's own thread (a callback).
  kr_status Shutdown(std::string* error);
  // Until Shutdown, or the loop stopping by itself (another rank shut down,
  // or the engine failed).
  bool initialized() const;
  kr_topology topology() const { return topology_; }
  kr_stats stats() const {
    return {stats_.collectives.load(),     stats_.tensors.load(),
            stats_.fused_tensors.load(),   stats_.cached_tensors.load(),
            stats_.shm_collectives.load(), stats_.hierarchical_collectives.load()};
  }
  kr_parameters parameters() const;
  // Validates and queues the requests; each refused one is completed through
  // its done callback, and the first refusal's status returned. Without
  // `wake`, the caller must Drive() next: the background thread is not told.
  // With a `group` name (non-empty), the requests form one group (see
  // kr_enqueue_and_drive).
  kr_status Enqueue(const kr_request* requests, int n, bool wake = true,
                    const char* group = nullptr);
  // Runs the engine's loop on the calling thread until finished(ctx) returns
  // true, the loop stops, or nothing has happened for a while (then the
  // background thread carries on and the caller should block as usual). A
  // caller about to wait for its request saves the two thread wake-ups of
  // handing the work to the background thread and back (see kr_drive).
  void Drive(int (*finished)(void* ctx), void* ctx);
  // Agreed with every rank like a collective of the whole job; blocking.
  kr_status AddProcessSet(std::vector<int> ranks, int32_t* id, std::string* error);
  kr_status RemoveProcessSet(int32_t id, std::string* error);
  // The set's world ranks; false if there is no such set.
  bool ProcessSetRanks(int32_t id, std::vector<int>* ranks) const;
  // Records this rank's timeline into `path` (see timeline.h) until
  // StopTimeline or shutdown.
  kr_status StartTimeline(const std::string& path, bool mark_cycles, std::string* error);
  void StopTimeline() { timeline_.Stop(); }

 private:
  // The constructor's collective part; throws EngineError.
  void Start();
  // Validates one request into *out; on refusal calls done itself and
  // returns the status.
  kr_status Prepare(const kr_request& request, Request* out);
  // Queues an internal request of the whole job and waits for it.
  kr_status RunControl(Request req, std::string* error);
  // The background thread: runs passes of the loop while no caller drives it.
  void Loop();
  // One pass of the loop under pass_mu_; false once the loop is over (the
  // other ranks have then been told, and further requests are refused).
  // *progress: whether the pass did anything.
  bool Step(bool* progress);
  // The rank whose shutdown ends the loop (this one's, or another's), or -1.
  int Pass(bool* progress);
  // Takes a request from the queue into its set's pending table and the ready
  // list; false if it was refused (and completed).
  bool Admit(Request& req, std::unordered_map<int32_t, ReadyList>* ready);
  void SendReadyList(ReadyList list);
  bool ReceiveReadyLists();  // rank 0: records the ready lists received
  void AddToCoordinator(int world_rank, ReadyList list);
  bool ReceiveOnCoordinator(ResponseList* out);
  bool ReceiveResponses(ResponseList* out);
  // Runs a response list (Executor), with the settings it carries; fails
  // what is pending if it says a rank shut down.
  void Execute(ResponseList& list);
  void CreateProcessSet(const std::vector<int>& ranks, int32_t* id);
  // What SetUpSharedMemory may do, from the settings.
  SharedMemoryOptions SharedMemory() const;
  void DestroyProcessSet(int32_t id);
  bool InFlight() const;
  // Other ranks, after each pass (`heard`: it received rank 0's responses):
  // while waiting for rank 0, pings it and fails once it has been silent for
  // longer than the timeout allows.
  void CheckCoordinator(bool heard);
  // Rank 0, after each pass: asks the ranks that tensors have waited the
  // timeout for whether they are alive, and fails, naming one, if it does
  // not answer within kAnswerWait (stopped, or hung with its engine); one
  // that answers is left to the stall rules and asked again a timeout later.
  void CheckOverdueRanks(std::chrono::steady_clock::time_point now);
  // Every rank, once a kPeerCheckTick: fails, naming it, if a shared-memory
  // peer's process has ended without shutting down (ShmGroup::CheckPeers).
  void CheckLocalPeers();
  // Rank 0 has coordinating to do that its own requests do not show.
  bool CoordinatorBusy() const;
  bool OutsideASet() const;  // rank 0 coordinates a set it is not in
  void SendResponses(const ResponseList& list);
  // Rank 0, after running a list: feeds the autotuner.
  void Tune(const ResponseList& list);
  // Every rank, before running a list that carries new settings.
  void Apply(const TunedParams& params, bool tuned);
  // After an engine failure: tells the other ranks this one has stopped.
  void Abandon(const std::string& reason);
  void FailAll(kr_status status, const std::string& message);
  // The loop has ended: refuse what is queued and whatever comes later.
  void StopAccepting(kr_status status, const std::string& message);
  // Rank 0, shutting down: waits (bounded) until every rank has sent its
  // shutdown message, so that none is left behind.
  void AwaitShutdowns();

  const EngineOptions options_;
  const std::unique_ptr<World> world_;
  // Each rank's host name, by world rank.
  std::vector<std::string> hosts_;
  // Serialises Shutdown: two callers (a user thread and process exit) must
  // not both join the thread.
  std::mutex lifecycle_mu_;

  // Shared between framework threads and the thread running the loop.
  mutable std::mutex mu_;
  std::condition_variable cv_;  // the background thread waits on it
  std::deque<Request> queue_;
  bool shutdown_requested_ = false;
  bool running_ = false;
  bool loop_over_ = false;  // written under mu_ and pass_mu_
  int drivers_ = 0;         // callers in Drive()
  bool resume_ = false;     // the last driver left work in flight
  // How the last pass left the loop, for the background thread's choice of
  // how long to sleep.
  struct {
    bool in_flight = false;
    bool outside_a_set = false;
    bool shutdown_sent = false;
    int idle_passes = 0;
  } pace_;
  // How the loop ended (a shutdown, or the engine failing), which refusals
  // report until shutdown() or init(); an empty `why`: it has not.
  struct {
    kr_status status = KR_OK;
    std::string why;
  } stopped_;
  // Copies of each set's world ranks, for framework threads.
  std::unordered_map<int32_t, std::vector<int>> set_ranks_;
  uint64_t control_calls_ = 0;  // names internal requests alike on every rank

  // Whoever holds pass_mu_ runs the loop's passes: the background thread, or
  // a caller in Drive(). It owns what follows while it does.
  std::mutex pass_mu_;
  std::thread thread_;
  std::unordered_map<int32_t, ProcessSet> sets_;
  int32_t next_set_id_ = 1;
  bool shutdown_sent_ = false;
  bool coordinating_ = false;                      // world rank 0
  // Other ranks: whether the last pass waited for rank 0, since when nothing
  // came from it, and when it was last pinged (CheckCoordinator).
  bool waiting_on_coordinator_ = false;
  std::chrono::steady_clock::time_point quiet_since_, pinged_;
  // Rank 0 (CheckOverdueRanks): the ranks asked whether they are alive, and
  // when; when those that answered are asked again.
  std::map<int, std::chrono::steady_clock::time_point> asked_, next_ask_;
  std::chrono::steady_clock::time_point overdue_checked_;
  std::chrono::steady_clock::time_point peers_checked_;  // CheckLocalPeers
  std::vector<Response> decided_;                  // rank 0: agreed, not yet sent
  std::chrono::steady_clock::time_point decided_since_;  // when decided_ became non-empty
  // The settings the autotuner may change; written under mu_ (read by
  // parameters()), read without it by the thread running the loop.
  TunedParams params_;
  std::unique_ptr<Autotuner> autotuner_;  // rank 0, while KERAS_RING_AUTOTUNE tunes
  bool autotune_ = false;
  bool autotune_done_ = false;
  bool params_changed_ = false;  // rank 0: to send with the next response list
  Timeline timeline_;
  EngineTrace trace_{timeline_};
  Stats stats_;
  Observers observers_{{&trace_, &stats_}};
  Executor executor_;

  kr_topology topology_{};
};

}  // namespace keras_ring
