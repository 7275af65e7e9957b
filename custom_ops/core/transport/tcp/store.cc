#include "store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>

#include "../../common.h"
#include "hmac.h"

namespace keras_ring {

namespace {

constexpr size_t kNonceBytes = 32;
constexpr char kMagic[] = "KRS1";
// Beyond a Get's own wait, the time the server may take to answer it.
constexpr std::chrono::seconds kReplyMargin(10);

std::string TimeoutMessage(const std::string& key, std::chrono::milliseconds timeout,
                           const std::string& where) {
  return "keras-ring: waited " + std::to_string(timeout.count()) + " ms for key '" + key +
         "' in the rendezvous store" + where + " and no one set it";
}

void CheckKey(const std::string& key) {
  KR_CHECK(!key.empty() && key.size() <= kMaxStoreKeyBytes,
           "a store key of 1 to " + std::to_string(kMaxStoreKeyBytes) + " bytes, got " +
               std::to_string(key.size()));
}

std::string U16(size_t v) {
  return {static_cast<char>(v >> 8), static_cast<char>(v & 0xff)};
}

std::string U32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

void WriteFrame(int fd, const std::string& payload, Clock::time_point deadline,
                const std::string& what) {
  const std::string frame = U32(static_cast<uint32_t>(payload.size())) + payload;
  WriteFully(fd, frame.data(), frame.size(), deadline, what);
}

std::string ReadFrame(int fd, Clock::time_point deadline, const std::string& what) {
  unsigned char length[4];
  ReadFully(fd, length, sizeof(length), deadline, what);
  const uint32_t bytes = uint32_t{length[0]} << 24 | uint32_t{length[1]} << 16 |
                         uint32_t{length[2]} << 8 | uint32_t{length[3]};
  if (bytes > kMaxStoreFrameBytes) {
    throw EngineError("keras-ring: the rendezvous server sent a frame of " +
                      std::to_string(bytes) + " bytes in " + what + "; at most " +
                      std::to_string(kMaxStoreFrameBytes) + " are allowed");
  }
  std::string payload(bytes, '\0');
  ReadFully(fd, payload.data(), bytes, deadline, what);
  return payload;
}

std::string AsString(const Sha256Digest& d) {
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

void InMemoryStore::Set(const std::string& key, const std::vector<char>& value) {
  CheckKey(key);
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  set_.notify_all();
}

std::vector<char> InMemoryStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  CheckKey(key);
  std::unique_lock<std::mutex> lock(mu_);
  if (!set_.wait_for(lock, timeout, [&] { return values_.count(key) > 0; })) {
    throw EngineError(TimeoutMessage(key, timeout, ""));
  }
  return values_[key];
}

TcpStoreClient::TcpStoreClient(const std::string& address, const std::string& secret,
                               const std::string& role, std::chrono::milliseconds timeout)
    : address_(address), timeout_(timeout) {
  KR_CHECK(!role.empty() && role.size() <= 256,
           "a store client role of 1 to 256 bytes, got " + std::to_string(role.size()));
  const HostPort hp = ParseHostPort(address, "the rendezvous server's address");
  const Clock::time_point deadline = Clock::now() + timeout;
  socket_ = ConnectBefore(hp.host, hp.port, deadline);
  SetNoDelay(socket_.fd());
  const std::string what = "the handshake with the rendezvous server at " + address;
  const std::string hello = ReadFrame(socket_.fd(), deadline, what);
  if (hello.size() != 4 + kNonceBytes || hello.compare(0, 4, kMagic) != 0) {
    throw EngineError("keras-ring: " + address +
                      " answered with something other than a keras-ring rendezvous server");
  }
  const std::string nonce_s = hello.substr(4);
  const std::string nonce_c = RandomBytes(kNonceBytes);
  const Sha256Digest mac_c =
      HmacSha256(secret, "keras-ring store client" + nonce_s + nonce_c + role);
  WriteFrame(socket_.fd(), kMagic + nonce_c + AsString(mac_c) + role, deadline, what);
  const std::string proof = ReadFrame(
      socket_.fd(), deadline,
      what + " (if it closed the connection, it refused this job's secret)");
  Sha256Digest mac_s{};
  if (proof.size() == mac_s.size()) std::memcpy(mac_s.data(), proof.data(), mac_s.size());
  if (proof.size() != mac_s.size() ||
      !DigestsEqual(mac_s, HmacSha256(secret, "keras-ring store server" + nonce_s + nonce_c +
                                                  role))) {
    throw EngineError("keras-ring: the rendezvous server at " + address +
                      " does not hold the job's secret");
  }
}

std::string TcpStoreClient::Request(const std::string& request, Clock::time_point deadline,
                                    const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string context = what + " at the rendezvous server " + address_;
  WriteFrame(socket_.fd(), request, deadline, context);
  std::string reply = ReadFrame(socket_.fd(), deadline, context);
  if (!reply.empty() && reply[0] == '\x02') {
    throw EngineError("keras-ring: the rendezvous server at " + address_ + " refused " + what +
                      ": " + reply.substr(1));
  }
  if (reply.empty() || (reply[0] != '\x00' && reply[0] != '\x01')) {
    throw EngineError("keras-ring: the rendezvous server at " + address_ +
                      " answered " + what + " with a malformed reply");
  }
  return reply;
}

void TcpStoreClient::Set(const std::string& key, const std::vector<char>& value) {
  CheckKey(key);
  KR_CHECK(value.size() <= kMaxStoreValueBytes,
           "a store value of at most " + std::to_string(kMaxStoreValueBytes) + " bytes, got " +
               std::to_string(value.size()));
  Request("S" + U16(key.size()) + key + std::string(value.begin(), value.end()),
          Clock::now() + timeout_, "setting key '" + key + "'");
}

std::vector<char> TcpStoreClient::Get(const std::string& key, std::chrono::milliseconds timeout) {
  CheckKey(key);
  KR_CHECK(timeout.count() >= 0 && timeout.count() <= UINT32_MAX,
           "a store wait of 0 to 2^32-1 ms, got " + std::to_string(timeout.count()));
  const std::string reply =
      Request("G" + U32(static_cast<uint32_t>(timeout.count())) + U16(key.size()) + key,
              Clock::now() + timeout + kReplyMargin, "getting key '" + key + "'");
  if (reply[0] == '\x01') throw EngineError(TimeoutMessage(key, timeout, " at " + address_));
  return std::vector<char>(reply.begin() + 1, reply.end());
}

std::string TcpStoreClient::local_host() const {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  char text[INET6_ADDRSTRLEN] = {};
  if (getsockname(socket_.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) return "";
  if (address.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&address)->sin_addr, text, sizeof text);
  } else if (address.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr, text, sizeof text);
  }
  return text;
}

}  // namespace keras_ring
