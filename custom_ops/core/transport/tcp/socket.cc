#include "socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "../../common.h"

namespace keras_ring {

namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// getaddrinfo for a numeric or named host; the caller frees the list.
addrinfo* Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    throw EngineError("keras-ring: cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  return list;
}

Socket NewSocket(int family) {
  const int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw EngineError("keras-ring: socket() failed: " + ErrnoText(errno));
  return Socket(fd);
}

// Waits for `events` on fd until the deadline; false on timeout.
bool PollUntil(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, MillisecondsUntil(deadline));
    if (rc > 0) return true;
    if (rc == 0) {
      if (Clock::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) throw EngineError("keras-ring: poll() failed: " + ErrnoText(errno));
  }
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

HostPort ParseHostPort(const std::string& address, const std::string& what) {
  HostPort hp;
  size_t colon;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    colon = close == std::string::npos ? std::string::npos : close + 1;
    if (colon != std::string::npos && (colon >= address.size() || address[colon] != ':')) {
      colon = std::string::npos;
    }
    if (colon != std::string::npos) hp.host = address.substr(1, close - 1);
  } else {
    colon = address.rfind(':');
    if (colon != std::string::npos) hp.host = address.substr(0, colon);
  }
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  const bool digits = !port.empty() && port.size() <= 5 &&
                      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (hp.host.empty() || !digits || std::stoi(port) > 65535) {
    throw EngineError("keras-ring: " + what + " must be host:port or [ipv6]:port, got '" +
                      address + "'");
  }
  hp.port = std::stoi(port);
  return hp;
}

std::string FormatHostPort(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Socket Listen(const std::string& host, int* port) {
  addrinfo* list = Resolve(host, 0, true);
  std::string error;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    Socket s = NewSocket(a->ai_family);
    if (bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || listen(s.fd(), SOMAXCONN) != 0) {
      error = ErrnoText(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
    *port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                        : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    freeaddrinfo(list);
    return s;
  }
  freeaddrinfo(list);
  throw EngineError("keras-ring: cannot listen on " + host + ": " + error);
}

Socket ConnectBefore(const std::string& host, int port, Clock::time_point deadline) {
  const std::string address = FormatHostPort(host, port);
  std::string error = "timed out";
  while (Clock::now() < deadline) {
    addrinfo* list = Resolve(host, port, false);
    for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
      Socket s = NewSocket(a->ai_family);
      int err = 0;
      if (connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          if (!PollUntil(s.fd(), POLLOUT, deadline)) {
            err = ETIMEDOUT;
          } else {
            socklen_t len = sizeof(err);
            getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
          }
        }
      }
      if (err == 0) {
        freeaddrinfo(list);
        return s;
      }
      error = ErrnoText(err);
    }
    freeaddrinfo(list);
    // The listener may not be up yet (a stale or early address): try again
    // shortly rather than fail the job.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw EngineError("keras-ring: cannot connect to " + address + ": " + error);
}

Socket AcceptPending(int listener, std::string* peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&addr), &len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
      return Socket();
    }
    throw EngineError("keras-ring: accept() failed: " + ErrnoText(errno));
  }
  char host[NI_MAXHOST] = "?", service[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), service,
              sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV);
  *peer = FormatHostPort(host, std::atoi(service));
  return Socket(fd);
}

void SetNoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void ReadFully(int fd, void* buf, size_t bytes, Clock::time_point deadline,
               const std::string& what) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = recv(fd, p + done, bytes - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      throw EngineError("keras-ring: the connection closed while reading " + what + " (" +
                        std::to_string(done) + " of " + std::to_string(bytes) + " bytes came)");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!PollUntil(fd, POLLIN, deadline)) {
        throw EngineError("keras-ring: timed out reading " + what + " (" + std::to_string(done) +
                          " of " + std::to_string(bytes) + " bytes came)");
      }
    } else if (errno != EINTR) {
      throw EngineError("keras-ring: reading " + what + " failed: " + ErrnoText(errno));
    }
  }
}

void WriteFully(int fd, const void* buf, size_t bytes, Clock::time_point deadline,
                const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = send(fd, p + done, bytes - done, MSG_NOSIGNAL);
    if (n >= 0) {
      done += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!PollUntil(fd, POLLOUT, deadline)) {
        throw EngineError("keras-ring: timed out writing " + what);
      }
    } else if (errno != EINTR) {
      throw EngineError("keras-ring: writing " + what + " failed: " + ErrnoText(errno));
    }
  }
}

int MillisecondsUntil(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

std::string RandomBytes(size_t bytes) {
  std::string out(bytes, '\0');
  // /dev/urandom rather than getrandom(): the engine is also built against
  // glibc versions older than 2.25.
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw EngineError("keras-ring: cannot open /dev/urandom: " + ErrnoText(errno));
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = read(fd, &out[done], bytes - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0 || errno != EINTR) {
      const int err = n == 0 ? EIO : errno;
      close(fd);
      throw EngineError("keras-ring: reading /dev/urandom failed: " + ErrnoText(err));
    }
  }
  close(fd);
  return out;
}

}  // namespace keras_ring
