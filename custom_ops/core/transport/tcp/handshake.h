// The handshake that opens every connection between two ranks of a TCP
// world: each side proves it holds the job's secret without sending it
// (HMAC-SHA256 over both sides' fresh nonces), so neither a process of
// another job nor a stray client can join the mesh. Fixed-size messages,
// integers in network byte order:
//
//   acceptor -> connector  "KRP1" nonce_a[32]                              36 bytes
//   connector -> acceptor  "KRP1" nonce_c[32] from[4] to[4] size[4] mac_c  80 bytes
//   acceptor -> connector  mac_a                                           32 bytes
//
//   mac_c = HMAC(secret, "keras-ring peer connect" nonce_a nonce_c from to size)
//   mac_a = HMAC(secret, "keras-ring peer accept"  nonce_a nonce_c from to size)
//
// The distinct labels keep one side from replaying the other's MAC; the
// acceptor's nonce keeps a connector from replaying an old handshake, and
// the connector's keeps an impostor acceptor from doing the same.
#pragma once

#include <string>

#include "socket.h"

namespace keras_ring {

// Rank `from` connected to rank `to` of a world of `size`. Throws
// EngineError if the acceptor does not answer in time or cannot prove it
// holds `secret`.
void ConnectHandshake(int fd, const std::string& secret, int from, int to, int size,
                      Clock::time_point deadline);

// Rank `me`'s side of a connection it accepted, taken a step at a time so
// that one listener can authenticate several connections at once and a
// client that connects and says nothing holds up no other.
class AcceptingHandshake {
 public:
  // Sends the hello on `fd`, a fresh non-blocking socket (whose empty buffer
  // takes it at once).
  AcceptingHandshake(int fd, const std::string& secret, int me, int size);

  // Reads what has arrived, without waiting. Returns -1 while the answer is
  // incomplete; once it is in, checks it, sends the proof and returns the
  // connecting rank, which has proved it holds `secret` and is a rank above
  // `me` of a world of `size`. Throws EngineError saying why otherwise (the
  // caller refuses the connection).
  int Feed();

 private:
  static constexpr size_t kAnswerBytes = 80;

  int fd_;
  const std::string secret_;
  int me_;
  int size_;
  std::string nonce_a_;
  char answer_[kAnswerBytes];
  size_t got_ = 0;
};

}  // namespace keras_ring
