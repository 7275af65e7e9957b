#include <chrono>
#include <thread>
#include <vector>

#include "../core/common.h"
#include "../core/transport/inprocess_transport.h"
#include "harness.h"

namespace kr_test {
namespace {

using keras_ring::EngineError;
using keras_ring::InProcessWorld;
using keras_ring::PendingPtr;
using keras_ring::Transport;

KR_TEST(ReceivesMatchSendsInPostingOrderPerTag) {
  InProcessWorld world(2);
  auto a = world.Connect(0);
  auto b = world.Connect(1);
  int one = 1, two = 2, seven = 7;
  PendingPtr sends[] = {a->Isend(&one, sizeof one, 1, 0), a->Isend(&seven, sizeof seven, 1, 5),
                        a->Isend(&two, sizeof two, 1, 0)};
  int x = 0, y = 0, z = 0;
  PendingPtr first = b->Irecv(&x, sizeof x, 0, 0);
  PendingPtr second = b->Irecv(&y, sizeof y, 0, 0);
  PendingPtr other_tag = b->Irecv(&z, sizeof z, 0, 5);
  second->Wait();  // waited out of order: still the second message of tag 0
  other_tag->Wait();
  first->Wait();
  first->Wait();  // a second Wait is a no-op
  for (PendingPtr& send : sends) send->Wait();
  KR_EXPECT_EQ(x, 1);
  KR_EXPECT_EQ(y, 2);
  KR_EXPECT_EQ(z, 7);
  KR_EXPECT_EQ(world.stats().messages, 3u);
  KR_EXPECT_EQ(world.stats().bytes, 3 * sizeof(int));
}

KR_TEST(ReceiveWaitsForALaterSendFromAnotherThread) {
  InProcessWorld world(2);
  std::vector<char> got(100);
  std::thread sender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<char> data(100, 'x');
    world.Connect(1)->Send(data.data(), data.size(), 0, 3);
  });
  world.Connect(0)->Recv(got.data(), got.size(), 1, 3);
  sender.join();
  KR_EXPECT(got == std::vector<char>(100, 'x'));
}

KR_TEST(ByteCountMismatchNamesBothCounts) {
  InProcessWorld world(2);
  std::vector<char> buf(100);
  PendingPtr send = world.Connect(0)->Isend(buf.data(), 50, 1, 0);
  KR_EXPECT_THROW(world.Connect(1)->Recv(buf.data(), 100, 0, 0), EngineError,
                  "receive of 100 bytes from rank 0 (tag 0) but the matching send has 50 bytes");
}

// Like MPI's rendezvous protocol: the data is read from the sender's buffer
// when the receive is waited for, so writing to it before the send completes
// shows up as corrupted data (the mistake the algorithms must not make).
KR_TEST(SendsReadTheirBufferWhenReceivedAndCompleteThen) {
  InProcessWorld world(2, std::chrono::milliseconds(50));
  auto a = world.Connect(0);
  auto b = world.Connect(1);
  int value = 1, got = 0;
  PendingPtr send = a->Isend(&value, sizeof value, 1, 0);
  value = 2;  // too early
  b->Recv(&got, sizeof got, 0, 0);
  send->Wait();
  KR_EXPECT_EQ(got, 2);
  PendingPtr unreceived = a->Isend(&value, sizeof value, 1, 0);
  KR_EXPECT_THROW(unreceived->Wait(), EngineError,
                  "rank 0 waited 50 ms for rank 1 to receive a message of 4 bytes (tag 0)");
}

KR_TEST(ReceiveTimesOutInsteadOfHanging) {
  InProcessWorld world(2, std::chrono::milliseconds(50));
  int x;
  const auto start = std::chrono::steady_clock::now();
  KR_EXPECT_THROW(world.Connect(1)->Recv(&x, sizeof x, 0, 9), EngineError,
                  "rank 1 waited 50 ms for a message of 4 bytes from rank 0 (tag 9)");
  KR_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

KR_TEST(RejectsBadRanksAndOversizedMessages) {
  KR_EXPECT_THROW(InProcessWorld(0), EngineError, "at least 1");
  InProcessWorld world(3);
  KR_EXPECT_THROW(world.Connect(3), EngineError, "rank 3 is not in");
  auto t = world.Connect(0);
  KR_EXPECT_EQ(t->rank(), 0);
  KR_EXPECT_EQ(t->size(), 3);
  int x = 0;
  KR_EXPECT_THROW(t->Isend(&x, sizeof x, -1, 0), EngineError, "peer -1");
  KR_EXPECT_THROW(t->Irecv(&x, sizeof x, 3, 0), EngineError, "peer 3");
  KR_EXPECT_THROW(t->Isend(&x, Transport::kMaxMessageBytes + 1, 1, 0), EngineError,
                  "exceeds kMaxMessageBytes");
}

KR_TEST(SelfSendAndZeroBytes) {
  InProcessWorld world(1);
  auto t = world.Connect(0);
  double in = 2.5, out = 0;
  PendingPtr r = t->Irecv(&out, sizeof out, 0, 1);
  PendingPtr s = t->Isend(&in, sizeof in, 0, 1);
  r->Wait();
  s->Wait();
  KR_EXPECT_EQ(out, 2.5);
  PendingPtr empty = t->Isend(nullptr, 0, 0, 2);
  t->Recv(nullptr, 0, 0, 2);
  empty->Wait();
}

}  // namespace
}  // namespace kr_test
