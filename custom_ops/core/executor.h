// Runs the coordinator's response lists on every rank, in their order: finds
// each response's requests (by name or cache id; zeros in place of those a
// joined rank never made), cuts allreduces into collectives (PlanAllreduces),
// takes each collective's path (shared memory within a host, hierarchical
// across hosts, or the network) and completes the requests.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include "autotune.h"
#include "fusion.h"
#include "negotiation.h"
#include "observer.h"
#include "process_set.h"
#include "request.h"

namespace keras_ring {

class Executor {
 public:
  // The engine adds and removes process sets where the agreed order has them.
  using AddSet = std::function<void(const std::vector<int>& ranks, int32_t* id)>;
  using RemoveSet = std::function<void(int32_t id)>;
  // `params` are read at each collective (the autotuner changes them).
  Executor(const TunedParams& params, Observers& observers, AddSet add_set, RemoveSet remove_set)
      : params_(params), observers_(observers), add_set_(std::move(add_set)),
        remove_set_(std::move(remove_set)) {}

  // Runs the responses of the sets this rank is in. Throws EngineError (the
  // requests concerned are then completed with it).
  void Execute(ResponseList& list, std::unordered_map<int32_t, ProcessSet>& sets);
  // Frees the fusion buffer.
  void Release() { fusion_buffer_.Release(); }

 private:
  // Runs one agreed collective (several requests when fused).
  void Run(ProcessSet& set, std::vector<Request>& requests, const Response& resp);
  // Runs requests [begin, end), alike in dtype, op and scale factors, as one allreduce.
  void RunAllreduce(ProcessSet& set, const Request* begin, const Request* end);
  void RunBroadcast(ProcessSet& set, const Request& req);
  // These three allocate their output through the request; each returns false
  // if that failed (the request is then already completed with the error).
  bool RunAllgather(ProcessSet& set, const Request& req, const Response& resp);
  bool RunReducescatter(ProcessSet& set, const Request& req);
  bool RunAlltoall(ProcessSet& set, const Request& req, const Response& resp);
  // Asks for the output; on failure returns a scratch buffer so that this rank
  // still takes part in the collective, and sets *failed.
  void* AllocateOutput(const Request& req, const std::vector<int64_t>& shape,
                       std::vector<char>* scratch, bool* failed);
  // Completes the request, telling the observers.
  void Complete(const Request& req, kr_status status, const std::string& message);

  const TunedParams& params_;
  Observers& observers_;
  const AddSet add_set_;
  const RemoveSet remove_set_;
  FusionBuffer fusion_buffer_;
  Observer::Clock::time_point received_;  // when the response list being run arrived
};

}  // namespace keras_ring
