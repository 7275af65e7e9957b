#include "algorithms.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "reduce.h"

namespace keras_ring {
namespace {

// Bytes per message: segment_bytes rounded down to whole elements, at least
// one element, and never above what a transport accepts in one call.
size_t SegmentBytes(size_t segment_bytes, size_t element_bytes) {
  KR_CHECK(segment_bytes > 0, "segment_bytes must be positive");
  const size_t limit = std::min(segment_bytes, Transport::kMaxMessageBytes);
  return std::max<size_t>(1, limit / element_bytes) * element_bytes;
}

int Mod(int x, int p) { return ((x % p) + p) % p; }

// One ring step: sends send_bytes from `send` to the right neighbour while
// receiving recv_bytes into `recv` from the left one, both cut into messages
// of at most `segment` bytes. Every receive is posted before any send, so a
// transport whose large sends wait for the matching receive cannot deadlock
// around the ring. on_segment(offset, bytes) runs as each received segment
// lands, in order, overlapping its work with the rest of the transfer. A
// zero-byte side posts nothing; its peer knows the size too and does the same.
template <typename OnSegment>
void RingStep(Transport& t, int right, const char* send, size_t send_bytes, int left, char* recv,
              size_t recv_bytes, size_t segment, int tag, OnSegment&& on_segment) {
  std::vector<PendingPtr> receives;
  for (size_t off = 0; off < recv_bytes; off += segment) {
    receives.push_back(t.Irecv(recv + off, std::min(segment, recv_bytes - off), left, tag));
  }
  std::vector<PendingPtr> sends;
  for (size_t off = 0; off < send_bytes; off += segment) {
    sends.push_back(t.Isend(send + off, std::min(segment, send_bytes - off), right, tag));
  }
  for (size_t i = 0; i < receives.size(); ++i) {
    receives[i]->Wait();
    const size_t off = i * segment;
    on_segment(off, std::min(segment, recv_bytes - off));
  }
  for (PendingPtr& s : sends) s->Wait();
}

}  // namespace

// Ring allreduce (reduce-scatter, then allgather), in place.
//
// The count elements are cut into p chunks c0..c(p-1) whose sizes differ by
// at most one element (some may be empty). Rank r sends to r+1 and receives
// from r-1 (mod p). For p = 3, "cK->" sends chunk K to the right, "cK+="
// receives chunk K from the left and reduces it into the local one, "cK="
// receives it in place:
//
//   reduce-scatter  step 0       step 1       then owns
//     rank 0        c0->, c2+=   c2->, c1+=   c1
//     rank 1        c1->, c0+=   c0->, c2+=   c2
//     rank 2        c2->, c1+=   c1->, c0+=   c0
//   allgather       step 0       step 1
//     rank 0        c1->, c0=    c0->, c2=
//     rank 1        c2->, c1=    c1->, c0=
//     rank 2        c0->, c2=    c2->, c1=
//
// At step s rank r sends chunk (r-s) and reduces chunk (r-s-1) received from
// the left; after p-1 steps chunk (r+1) holds the reduction of every rank's
// input. The owner post-scales only that chunk (1/p of the scaling work).
// The allgather then circulates the finished chunks: at step s rank r sends
// chunk (r+1-s) and receives chunk (r-s) straight into the buffer. Each rank
// sends 2(p-1)/p of the buffer in all.
//
// A chunk travels in segments of at most segment_bytes: all receives of a
// step are posted at once and each segment is reduced as soon as it lands,
// while the following segments are still in flight.
void RingAllreduce(Transport& t, const AllreduceOptions& o) {
  KR_CHECK(IsValidDataType(static_cast<int>(o.dtype)),
           "allreduce dtype " + std::to_string(static_cast<int>(o.dtype)) + " is not a kr_dtype");
  KR_CHECK(IsValidReduceOp(static_cast<int>(o.op)),
           "allreduce op " + std::to_string(static_cast<int>(o.op)) + " is not a kr_reduce_op");
  KR_CHECK(o.buffer != nullptr || o.count == 0,
           "allreduce of " + std::to_string(o.count) + " elements has a null buffer");
  const int p = t.size();
  const int r = t.rank();
  const size_t element_bytes = DataTypeSize(o.dtype);
  const size_t segment = SegmentBytes(o.segment_bytes, element_bytes);

  ReduceOp op = o.op;
  double postscale = o.postscale_factor;
  if (op == ReduceOp::kAverage) {
    op = ReduceOp::kSum;
    postscale *= 1.0 / p;
  }
  if (o.count == 0) return;

  char* buf = static_cast<char*>(o.buffer);
  ScaleBuffer(buf, o.count, o.dtype, o.prescale_factor);
  if (p == 1) {
    ScaleBuffer(buf, o.count, o.dtype, postscale);
    return;
  }

  const size_t base = o.count / p;
  const size_t extra = o.count % p;  // the first `extra` chunks get one more element
  auto chunk_bytes = [&](int c) { return (base + (size_t(c) < extra ? 1 : 0)) * element_bytes; };
  auto chunk = [&](int c) { return buf + (c * base + std::min<size_t>(c, extra)) * element_bytes; };
  const int right = Mod(r + 1, p);
  const int left = Mod(r - 1, p);

  std::vector<char> incoming(chunk_bytes(0));  // chunk 0 is a largest chunk
  for (int s = 0; s < p - 1; ++s) {
    const int send_c = Mod(r - s, p);
    const int recv_c = Mod(r - s - 1, p);
    char* target = chunk(recv_c);
    RingStep(t, right, chunk(send_c), chunk_bytes(send_c), left, incoming.data(),
             chunk_bytes(recv_c), segment, o.tag, [&](size_t off, size_t bytes) {
               ReduceInto(target + off, incoming.data() + off, bytes / element_bytes, o.dtype, op);
             });
  }

  const int owned = Mod(r + 1, p);
  ScaleBuffer(chunk(owned), chunk_bytes(owned) / element_bytes, o.dtype, postscale);

  for (int s = 0; s < p - 1; ++s) {
    const int send_c = Mod(r + 1 - s, p);
    const int recv_c = Mod(r - s, p);
    RingStep(t, right, chunk(send_c), chunk_bytes(send_c), left, chunk(recv_c),
             chunk_bytes(recv_c), segment, o.tag, [](size_t, size_t) {});
  }
}

// Ring allgather of variable-sized blocks. Each rank first copies its own
// block into place; at step s (of p-1) rank r sends block (r-s) to r+1 and
// receives block (r-s-1) from r-1 directly into the output, so every block
// travels once around the ring, segmented like the allreduce.
void RingAllgather(Transport& t, const AllgatherOptions& o) {
  const int p = t.size();
  const int r = t.rank();
  KR_CHECK(o.block_bytes.size() == size_t(p),
           "allgather needs one block size per rank: expected " + std::to_string(p) + ", got " +
               std::to_string(o.block_bytes.size()));
  std::vector<size_t> offsets(p + 1, 0);
  for (int i = 0; i < p; ++i) offsets[i + 1] = offsets[i] + o.block_bytes[i];
  KR_CHECK(o.output != nullptr || offsets[p] == 0,
           "allgather of " + std::to_string(offsets[p]) + " bytes has a null output");
  KR_CHECK(o.input != nullptr || o.block_bytes[r] == 0,
           "allgather block of " + std::to_string(o.block_bytes[r]) + " bytes has a null input");
  const size_t segment = SegmentBytes(o.segment_bytes, 1);

  char* out = static_cast<char*>(o.output);
  // memmove: the input may already sit at its place in the output.
  if (o.block_bytes[r] > 0) std::memmove(out + offsets[r], o.input, o.block_bytes[r]);

  const int right = Mod(r + 1, p);
  const int left = Mod(r - 1, p);
  for (int s = 0; s < p - 1; ++s) {
    const int send_b = Mod(r - s, p);
    const int recv_b = Mod(r - s - 1, p);
    RingStep(t, right, out + offsets[send_b], o.block_bytes[send_b], left, out + offsets[recv_b],
             o.block_bytes[recv_b], segment, o.tag, [](size_t, size_t) {});
  }
}

// Binomial-tree broadcast. With virtual ranks v = (r - root) mod p, the
// root is v = 0; v receives from v minus its lowest set bit, then sends to
// v + 2^k for every 2^k below that bit (v + 2^k < p), largest first so that
// the deepest subtree starts earliest. Example, p = 6:
//
//   0 -> 4, 0 -> 2, 0 -> 1;  4 -> 5;  2 -> 3
//
// The data moves in segments: an inner node forwards each segment to its
// children as soon as it arrives, so a large buffer is pipelined down the
// tree instead of being stored and forwarded whole at each level.
void Broadcast(Transport& t, const BroadcastOptions& o) {
  const int p = t.size();
  const int r = t.rank();
  KR_CHECK(o.root >= 0 && o.root < p,
           "broadcast root " + std::to_string(o.root) + " is not a rank of a world of size " +
               std::to_string(p));
  KR_CHECK(o.buffer != nullptr || o.bytes == 0,
           "broadcast of " + std::to_string(o.bytes) + " bytes has a null buffer");
  const size_t segment = SegmentBytes(o.segment_bytes, 1);
  if (p == 1 || o.bytes == 0) return;

  const int v = Mod(r - o.root, p);
  auto real_rank = [&](int virtual_rank) { return (virtual_rank + o.root) % p; };
  int mask = 1;
  int parent = -1;
  for (; mask < p; mask <<= 1) {
    if (v & mask) {
      parent = real_rank(v - mask);
      break;
    }
  }
  std::vector<int> children;
  for (int m = mask >> 1; m > 0; m >>= 1) {
    if (v + m < p) children.push_back(real_rank(v + m));
  }

  char* buf = static_cast<char*>(o.buffer);
  std::vector<PendingPtr> receives;
  if (parent >= 0) {
    for (size_t off = 0; off < o.bytes; off += segment) {
      receives.push_back(t.Irecv(buf + off, std::min(segment, o.bytes - off), parent, o.tag));
    }
  }
  std::vector<PendingPtr> sends;
  for (size_t i = 0, off = 0; off < o.bytes; ++i, off += segment) {
    if (parent >= 0) receives[i]->Wait();
    for (int child : children) {
      sends.push_back(t.Isend(buf + off, std::min(segment, o.bytes - off), child, o.tag));
    }
  }
  for (PendingPtr& s : sends) s->Wait();
}

}  // namespace keras_ring
