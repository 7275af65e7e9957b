// The small interface every collective algorithm is written against.
// Implementations: MPI point-to-point (mpi_transport.h) and an in-process
// transport whose ranks are threads (inprocess_transport.h), used by the C++
// tests. Shared memory, TCP and NCCL come later behind the same interface.
#pragma once

#include <cstddef>
#include <memory>

namespace keras_ring {

// A started send or receive. Wait() blocks until the buffer may be reused (send)
// or holds the data (receive); it throws EngineError if the transfer failed.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void Wait() = 0;
};
using PendingPtr = std::unique_ptr<Pending>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Non-blocking point-to-point transfers. Messages between the same pair of
  // ranks with the same tag arrive in the order they were sent. A receive's
  // byte count must equal the matching send's. The buffer must stay valid
  // until Wait() returns. Every call is at most kMaxMessageBytes.
  virtual PendingPtr Isend(const void* buf, size_t bytes, int peer, int tag) = 0;
  virtual PendingPtr Irecv(void* buf, size_t bytes, int peer, int tag) = 0;

  static constexpr size_t kMaxMessageBytes = size_t(1) << 30;

  void Send(const void* buf, size_t bytes, int peer, int tag) {
    Isend(buf, bytes, peer, tag)->Wait();
  }
  void Recv(void* buf, size_t bytes, int peer, int tag) {
    Irecv(buf, bytes, peer, tag)->Wait();
  }
};

}  // namespace keras_ring
