// A key-value store through which the ranks of a TCP world find each other
// (Gloo's rendezvous store, in our terms): each rank sets its listening
// address under its own key and gets the others'. Get waits for the key,
// bounded by its timeout. Implementations: InMemoryStore (threads as ranks,
// for the tests) and TcpStoreClient, which talks to the launcher's
// RendezvousServer (keras_ring/core/_rendezvous.py).
//
// Wire protocol of TcpStoreClient <-> RendezvousServer. Every message is a
// frame: a 4-byte big-endian payload length, then the payload; a frame is at
// most kMaxStoreFrameBytes and the server drops a connection that announces
// a longer one. A connection first authenticates with the job's secret:
//
//   server -> client  "KRS1" nonce_s[32]
//   client -> server  "KRS1" nonce_c[32] mac_c[32] role      (role: 1-256 bytes, e.g. "rank 3")
//   server -> client  mac_s[32]
//
//   mac_c = HMAC-SHA256(secret, "keras-ring store client" nonce_s nonce_c role)
//   mac_s = HMAC-SHA256(secret, "keras-ring store server" nonce_s nonce_c role)
//
// The server serves nothing before mac_c checks out, and closes the
// connection, without a reply, when it does not; the client trusts nothing
// the server says before mac_s checks out. Then requests, one reply each:
//
//   "S" key_len[2] key value             -> "\x00"
//   "G" timeout_ms[4] key_len[2] key     -> "\x00" value, or "\x01" if the key
//                                           was not set within timeout_ms
//   any request the server cannot serve  -> "\x02" message (UTF-8)
//
// Keys are 1 to kMaxStoreKeyBytes bytes; a later Set of a key replaces its
// value.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "socket.h"

namespace keras_ring {

constexpr size_t kMaxStoreKeyBytes = 512;
constexpr size_t kMaxStoreValueBytes = size_t(1) << 20;
constexpr size_t kMaxStoreFrameBytes = kMaxStoreValueBytes + kMaxStoreKeyBytes + 16;

class Store {
 public:
  virtual ~Store() = default;
  virtual void Set(const std::string& key, const std::vector<char>& value) = 0;
  // Waits until `key` is set; throws EngineError naming the key if it is not
  // within `timeout`.
  virtual std::vector<char> Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

class InMemoryStore : public Store {
 public:
  void Set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> Get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable set_;
  std::map<std::string, std::vector<char>> values_;  // guarded by mu_
};

class TcpStoreClient : public Store {
 public:
  // Connects to the server at `address` (host:port) and authenticates as
  // `role` with `secret`, within `timeout`; every later request waits at most
  // `timeout` for the server (plus a Get's own wait). Throws EngineError
  // naming the address if it cannot.
  TcpStoreClient(const std::string& address, const std::string& secret, const std::string& role,
                 std::chrono::milliseconds timeout);

  void Set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> Get(const std::string& key, std::chrono::milliseconds timeout) override;

  // This end's address on the connection: one the server's host reaches this
  // host by (loopback when the server is on loopback).
  std::string local_host() const;

 private:
  // Sends one request and returns the reply's payload.
  std::string Request(const std::string& request, Clock::time_point deadline,
                      const std::string& what);

  const std::string address_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // one request at a time on the connection
  Socket socket_;
};

}  // namespace keras_ring
