// Transport over MPI point-to-point on a communicator the engine owns (a
// duplicate of the job's communicator, so our tags never meet the user's).
#pragma once

#include <mpi.h>

#include <functional>

#include "transport.h"

namespace keras_ring {

class MpiTransport : public Transport {
 public:
  // `while_waiting` is called now and then while a Wait() lasts (the engine
  // receives its control messages there: see Engine::DrainControl).
  MpiTransport(MPI_Comm comm, std::function<void()> while_waiting);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) override;
  PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) override;

 private:
  MPI_Comm comm_;
  std::function<void()> while_waiting_;
  int rank_ = 0;
  int size_ = 1;
};

// Throws EngineError naming the MPI call and MPI's own error text.
void CheckMpi(int rc, const char* what);

}  // namespace keras_ring
