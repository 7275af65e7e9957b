// The few socket operations the TCP world and the store client share: an
// owning descriptor, listening and connecting, and reads and writes bounded
// by a deadline. Every socket is non-blocking and close-on-exec; the bounded
// calls wait in poll(), so nothing here can block past its deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace keras_ring {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; closes it when destroyed.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { reset(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset();

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  int port = 0;
};

// "host:port", "[v6 address]:port". Throws EngineError naming `what` (the
// address's role, for the message) if it is malformed.
HostPort ParseHostPort(const std::string& address, const std::string& what);
std::string FormatHostPort(const std::string& host, int port);

// A listening socket on `host`, port 0 (the kernel picks one); *port gets it.
Socket Listen(const std::string& host, int* port);
// Connects to host:port, trying again while the connection is refused, until
// `deadline`. Throws EngineError naming the address.
Socket ConnectBefore(const std::string& host, int port, Clock::time_point deadline);
// Accepts one pending connection (the listener must be readable); an invalid
// Socket if none was pending after all. *peer gets its address.
Socket AcceptPending(int listener, std::string* peer);

// Low delay for small messages: the engine's control messages and the
// algorithms' small segments must not wait for Nagle's algorithm.
void SetNoDelay(int fd);

// Reads or writes exactly `bytes`, waiting at most until `deadline`. Throw
// EngineError saying what happened (timeout, end of stream, error) to `what`.
void ReadFully(int fd, void* buf, size_t bytes, Clock::time_point deadline,
               const std::string& what);
void WriteFully(int fd, const void* buf, size_t bytes, Clock::time_point deadline,
                const std::string& what);

// Milliseconds from now to `deadline`, rounded up, at least 0: for poll().
int MillisecondsUntil(Clock::time_point deadline);

// `bytes` random bytes from the kernel, for handshake nonces.
std::string RandomBytes(size_t bytes);

}  // namespace keras_ring
