// A Transport whose ranks are threads of one process, for the C++ tests:
// fast, deterministic and usable under sanitizers.
//
//   InProcessWorld world(4);
//   // in thread r:
//   std::unique_ptr<Transport> t = world.Connect(r);
//   RingAllreduce(*t, options);
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "transport.h"

namespace keras_ring {

// Traffic counters over all ranks, so tests can check how an algorithm
// split its transfers.
struct InProcessStats {
  size_t messages = 0;
  size_t bytes = 0;
  size_t max_message_bytes = 0;
};

class InProcessWorld {
 public:
  // A receive that waits longer than `timeout` throws EngineError, so a
  // broken algorithm fails its test instead of hanging it.
  explicit InProcessWorld(int size,
                          std::chrono::milliseconds timeout = std::chrono::seconds(60));

  int size() const;

  // The endpoint of `rank`. Endpoints share the world's mailboxes and keep
  // them alive, so they may outlive the InProcessWorld object.
  std::unique_ptr<Transport> Connect(int rank);

  InProcessStats stats() const;

  // As if `rank` had said goodbye (`why`) and closed its connections: every
  // wait for it, now or later, throws EngineError naming it and saying why.
  void Disconnect(int rank, const std::string& why);

 private:
  struct State;
  class Endpoint;
  class ReceivePending;
  class SendPending;
  std::shared_ptr<State> state_;
};

}  // namespace keras_ring
