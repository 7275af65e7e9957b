// A World over TCP sockets: one connection per pair of ranks, opened at
// construction through a rendezvous Store and authenticated with the job's
// secret in both directions (handshake.h).
//
//   InMemoryStore store;  // or a TcpStoreClient to the launcher's server
//   TcpWorldOptions o;
//   o.rank = r; o.size = n; o.host = "node1"; o.store = &store; o.secret = secret;
//   TcpWorld world(o);  // in every rank; returns once the mesh is up
//   std::unique_ptr<Transport> t = world.Connect(all_ranks, 0);
//
// Frames on a connection, after the handshake, each a 16-byte header and its
// payload (integers in network byte order):
//
//   kind[1] (0 data, 1 control, 2 goodbye)  reserved[3] = 0  tag[4]  bytes[8]  payload[bytes]
//
// A goodbye's payload says why its sender leaves the job (its engine failed);
// the receiver then takes the connection for lost, with that reason.
//
// Data and control messages share the connection (one socket per pair keeps
// the mesh at n-1 descriptors a rank); a control message is queued ahead of
// data that has not started, so negotiation does not wait behind a large
// transfer. The receiver reads every frame as soon as it arrives: a frame
// whose receive is posted lands straight in the receive's buffer, any other
// is buffered until its receive is posted, so a sender never waits for the
// receiver to post and no pair can deadlock on order.
//
// Progress is made by whoever waits: Wait(), Flush(), Receive() and
// Progress() poll the sockets and move bytes. No background thread: the
// kernel's socket buffers already overlap the wire with the caller's
// reductions, and a polling thread would take a core from them (on a 2-core
// machine, half of it). The world and its transports may be used from
// several threads; one mutex guards their state.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "../world.h"
#include "store.h"

namespace keras_ring {

struct TcpWorldOptions {
  int rank = 0;
  int size = 1;
  std::string host;  // what host() says: ranks with the same name share memory
  Store* store = nullptr;
  std::string secret;  // the job's: every connection proves it holds it
  std::chrono::milliseconds timeout{60000};
  // The address this rank listens on (a port is picked), published in the
  // store: it must be one the other ranks can reach, not a wildcard.
  std::string listen_host = "127.0.0.1";
  // Keys in the store are <store_prefix>/<rank>: a job that opens several
  // worlds in turn gives each its own prefix.
  std::string store_prefix = "tcp_world";
};

class TcpWorld : public World {
 public:
  // Connects the mesh; throws EngineError naming the ranks it waited for if
  // that takes longer than the timeout.
  explicit TcpWorld(const TcpWorldOptions& options);
  ~TcpWorld() override;

  int rank() const override;
  int size() const override;
  std::string host() const override;
  std::chrono::milliseconds timeout() const override;

  void Post(int to, std::shared_ptr<const std::vector<char>> message) override;
  bool Receive(int* from, std::vector<char>* message) override;
  void Flush() override;
  void Progress() override;
  // Says goodbye (`why`) to every peer, briefly waiting for it to leave, and
  // closes the connections: each peer's waits on this rank fail with `why`.
  void Abort(const std::string& why) override;
  void Release(int rank) override;
  void Ask(int peer) override;
  bool Answered(int peer) override;

  // Defined in tcp_world.cc, beside the transport and pendings that share it.
  struct State;

 protected:
  Transport& transport() override;
  int max_tag() const override;

 private:
  std::unique_ptr<State> state_;
  std::unique_ptr<Transport> transport_;
};

}  // namespace keras_ring
