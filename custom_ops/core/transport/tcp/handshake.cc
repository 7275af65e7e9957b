#include "handshake.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "../../common.h"
#include "hmac.h"

namespace keras_ring {

namespace {

constexpr char kMagic[4] = {'K', 'R', 'P', '1'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kHelloBytes = sizeof(kMagic) + kNonceBytes;
constexpr size_t kConnectBytes = sizeof(kMagic) + kNonceBytes + 12 + 32;

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (24 - 8 * i));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(p[i]);
  return v;
}

// The MAC of one side over everything both sides have said.
Sha256Digest PeerMac(const std::string& secret, const char* label, const std::string& nonce_a,
                     const std::string& nonce_c, const char* ranks) {
  return HmacSha256(secret, std::string(label) + nonce_a + nonce_c + std::string(ranks, 12));
}

std::string AsString(const Sha256Digest& d) {
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

Sha256Digest AsDigest(const char* p) {
  Sha256Digest d;
  std::memcpy(d.data(), p, d.size());
  return d;
}

}  // namespace

void ConnectHandshake(int fd, const std::string& secret, int from, int to, int size,
                      Clock::time_point deadline) {
  char hello[kHelloBytes];
  ReadFully(fd, hello, sizeof(hello), deadline, "the handshake of rank " + std::to_string(to));
  if (std::memcmp(hello, kMagic, sizeof(kMagic)) != 0) {
    throw EngineError("keras-ring: rank " + std::to_string(to) +
                      "'s address answered with something other than a keras-ring handshake");
  }
  const std::string nonce_a(hello + sizeof(kMagic), kNonceBytes);
  const std::string nonce_c = RandomBytes(kNonceBytes);
  char ranks[12];
  PutU32(ranks, static_cast<uint32_t>(from));
  PutU32(ranks + 4, static_cast<uint32_t>(to));
  PutU32(ranks + 8, static_cast<uint32_t>(size));
  const std::string message = std::string(kMagic, sizeof(kMagic)) + nonce_c +
                              std::string(ranks, sizeof(ranks)) +
                              AsString(PeerMac(secret, "keras-ring peer connect", nonce_a,
                                               nonce_c, ranks));
  WriteFully(fd, message.data(), message.size(), deadline,
             "the handshake to rank " + std::to_string(to));
  char proof[32];
  ReadFully(fd, proof, sizeof(proof), deadline,
            "rank " + std::to_string(to) + "'s proof of the job's secret (did it refuse ours?)");
  if (!DigestsEqual(AsDigest(proof),
                    PeerMac(secret, "keras-ring peer accept", nonce_a, nonce_c, ranks))) {
    throw EngineError("keras-ring: the process at rank " + std::to_string(to) +
                      "'s address does not hold the job's secret");
  }
}

AcceptingHandshake::AcceptingHandshake(int fd, const std::string& secret, int me, int size)
    : fd_(fd), secret_(secret), me_(me), size_(size), nonce_a_(RandomBytes(kNonceBytes)) {
  static_assert(kAnswerBytes == kConnectBytes, "the connector's message");
  const std::string hello = std::string(kMagic, sizeof(kMagic)) + nonce_a_;
  WriteFully(fd_, hello.data(), hello.size(), Clock::now(), "the handshake");
}

int AcceptingHandshake::Feed() {
  while (got_ < kAnswerBytes) {
    const ssize_t n = recv(fd_, answer_ + got_, kAnswerBytes - got_, 0);
    if (n > 0) {
      got_ += static_cast<size_t>(n);
    } else if (n == 0) {
      throw EngineError("keras-ring: it closed the connection during the handshake (" +
                        std::to_string(got_) + " of " + std::to_string(kAnswerBytes) +
                        " bytes came)");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return -1;
    } else if (errno != EINTR) {
      throw EngineError(std::string("keras-ring: reading its handshake failed: ") +
                        std::strerror(errno));
    }
  }
  if (std::memcmp(answer_, kMagic, sizeof(kMagic)) != 0) {
    throw EngineError("keras-ring: it did not open with a keras-ring handshake");
  }
  const std::string nonce_c(answer_ + sizeof(kMagic), kNonceBytes);
  const char* ranks = answer_ + sizeof(kMagic) + kNonceBytes;
  if (!DigestsEqual(AsDigest(ranks + 12),
                    PeerMac(secret_, "keras-ring peer connect", nonce_a_, nonce_c, ranks))) {
    throw EngineError("keras-ring: it does not hold the job's secret");
  }
  const uint32_t from = GetU32(ranks), to = GetU32(ranks + 4), world = GetU32(ranks + 8);
  if (to != static_cast<uint32_t>(me_) || world != static_cast<uint32_t>(size_) ||
      from <= to || from >= world) {
    throw EngineError("keras-ring: it says it is rank " + std::to_string(from) + " of " +
                      std::to_string(world) + " connecting to rank " + std::to_string(to) +
                      "; this is rank " + std::to_string(me_) + " of " + std::to_string(size_) +
                      ", which only higher ranks connect to");
  }
  const std::string proof =
      AsString(PeerMac(secret_, "keras-ring peer accept", nonce_a_, nonce_c, ranks));
  // Only the 36-byte hello went before it: the send buffer has room.
  WriteFully(fd_, proof.data(), proof.size(), Clock::now(), "the handshake's proof");
  return static_cast<int>(from);
}

}  // namespace keras_ring
