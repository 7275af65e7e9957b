#include "mpi_transport.h"

#include <climits>
#include <string>
#include <thread>
#include <utility>

#include "../common.h"

namespace keras_ring {

void CheckMpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw EngineError(std::string("keras-ring: ") + what + " failed: " + std::string(text, len));
}

namespace {

// MPI_Test calls between two calls of the transport's while_waiting (about
// as costly as one MPI_Test when there is nothing to do).
constexpr unsigned kTestsPerCall = 64;

class MpiPending : public Pending {
 public:
  MpiPending(MPI_Request request, size_t expected_bytes, bool is_recv,
             const std::function<void()>& while_waiting)
      : request_(request), expected_bytes_(expected_bytes), is_recv_(is_recv),
        while_waiting_(while_waiting) {}
  ~MpiPending() override {
    // Never leave MPI writing into a buffer that is about to be freed.
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  void Wait() override {
    MPI_Status status;
    // MPI_Wait's own loop, with the transport's call now and then.
    for (unsigned tests = 1;; ++tests) {
      int done = 0;
      CheckMpi(MPI_Test(&request_, &done, &status),
               is_recv_ ? "MPI_Test (receive)" : "MPI_Test (send)");
      if (done) break;
      if (tests % kTestsPerCall == 0) while_waiting_();
      std::this_thread::yield();
    }
    if (!is_recv_) return;
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    KR_CHECK(static_cast<size_t>(count) == expected_bytes_,
             "received " + std::to_string(count) + " bytes, expected " +
                 std::to_string(expected_bytes_));
  }

 private:
  MPI_Request request_;
  size_t expected_bytes_;
  bool is_recv_;
  const std::function<void()>& while_waiting_;  // the transport's, which outlives this
};

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm, std::function<void()> while_waiting)
    : comm_(comm), while_waiting_(std::move(while_waiting)) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

PendingPtr MpiTransport::Isend(const void* buf, size_t bytes, int peer, int tag) {
  KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
  MPI_Request req;
  CheckMpi(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req), "MPI_Isend");
  return std::make_unique<MpiPending>(req, bytes, false, while_waiting_);
}

PendingPtr MpiTransport::Irecv(void* buf, size_t bytes, int peer, int tag) {
  KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
  MPI_Request req;
  CheckMpi(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req), "MPI_Irecv");
  return std::make_unique<MpiPending>(req, bytes, true, while_waiting_);
}

}  // namespace keras_ring
