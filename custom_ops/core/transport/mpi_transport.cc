#include "mpi_transport.h"

#include <climits>
#include <string>

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

class MpiPending : public Pending {
 public:
  MpiPending(MPI_Request request, size_t expected_bytes, bool is_recv)
      : request_(request), expected_bytes_(expected_bytes), is_recv_(is_recv) {}
  ~MpiPending() override {
    // Never leave MPI writing into a buffer that is about to be freed.
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  void Wait() override {
    MPI_Status status;
    CheckMpi(MPI_Wait(&request_, &status), is_recv_ ? "MPI_Wait (receive)" : "MPI_Wait (send)");
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
};

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

PendingPtr MpiTransport::Isend(const void* buf, size_t bytes, int peer, int tag) {
  KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
  MPI_Request req;
  CheckMpi(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req), "MPI_Isend");
  return std::make_unique<MpiPending>(req, bytes, false);
}

PendingPtr MpiTransport::Irecv(void* buf, size_t bytes, int peer, int tag) {
  KR_CHECK(bytes <= kMaxMessageBytes, "message of " + std::to_string(bytes) + " bytes");
  MPI_Request req;
  CheckMpi(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &req), "MPI_Irecv");
  return std::make_unique<MpiPending>(req, bytes, true);
}

}  // namespace keras_ring
