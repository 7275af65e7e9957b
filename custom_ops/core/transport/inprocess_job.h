// A job whose ranks are threads of one process, for the engine's C++ tests:
// every rank's World shares the job's mailboxes.
//
//   InProcessJob job(3);
//   // in thread r:
//   Engine engine(options, job.Join(r));
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "inprocess_transport.h"
#include "world.h"

namespace keras_ring {

class InProcessJob {
 public:
  // `hosts[r]` names rank r's host (all one host if empty); every wait gives
  // up after `timeout`.
  explicit InProcessJob(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60),
                        std::vector<std::string> hosts = {});

  // Rank `rank`'s world. It may outlive the InProcessJob object.
  std::unique_ptr<World> Join(int rank);

  InProcessStats stats() const { return transports_.stats(); }

  // Faults for tests, from the next transfer of `rank` on: each throws
  // EngineError(why), as if its transport had failed (Fail); or sends
  // nothing and waits three timeouts, as if its process had stopped
  // (Freeze).
  void Fail(int rank, const std::string& why);
  void Freeze(int rank);

 private:
  struct Mailboxes;
  class RankWorld;
  class FaultyTransport;
  InProcessWorld transports_;
  std::vector<std::string> hosts_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Mailboxes> mailboxes_;
};

}  // namespace keras_ring
