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

namespace {

void CheckReduction(DataType dtype, ReduceOp op, const void* buffer, size_t count,
                    const char* what) {
  KR_CHECK(IsReducibleDataType(static_cast<int>(dtype)),
           std::string(what) + " dtype " + std::to_string(static_cast<int>(dtype)) +
               " is not one that reductions take");
  KR_CHECK(IsValidReduceOp(static_cast<int>(op)),
           std::string(what) + " op " + std::to_string(static_cast<int>(op)) +
               " is not a kr_reduce_op");
  KR_CHECK(buffer != nullptr || count == 0,
           std::string(what) + " of " + std::to_string(count) + " elements has a null buffer");
}

}  // namespace

// Ring reduce-scatter, in place.
//
// The buffer is cut into p blocks b0..b(p-1) (block c is rank c's result; its
// size is counts[c], possibly 0). Rank r sends to r+1 and receives from r-1
// (mod p). For p = 3, "bK->" sends block K to the right and "bK+=" receives
// block K from the left and reduces it into the local one:
//
//                 step 0       step 1       then owns
//     rank 0      b2->, b1+=   b1->, b0+=   b0
//     rank 1      b0->, b2+=   b2->, b1+=   b1
//     rank 2      b1->, b0+=   b0->, b2+=   b2
//
// At step s rank r sends block (r-1-s) and reduces block (r-2-s) received
// from the left; the last step completes block r, which holds the reduction
// of every rank's input, and only the owner post-scales it (1/p of the
// scaling work). Each rank sends (p-1)/p of the buffer.
//
// A block travels in segments of at most segment_bytes: all receives of a
// step are posted at once and each segment is reduced as soon as it lands,
// while the following segments are still in flight.
void RingReduceScatter(Transport& t, const ReduceScatterOptions& o) {
  const int p = t.size();
  const int r = t.rank();
  KR_CHECK(o.counts.size() == size_t(p),
           "reduce-scatter needs one block size per rank: expected " + std::to_string(p) +
               ", got " + std::to_string(o.counts.size()));
  std::vector<size_t> offsets(p + 1, 0);
  for (int i = 0; i < p; ++i) offsets[i + 1] = offsets[i] + o.counts[i];
  CheckReduction(o.dtype, o.op, o.buffer, offsets[p], "reduce-scatter");
  const size_t element_bytes = DataTypeSize(o.dtype);
  const size_t segment = SegmentBytes(o.segment_bytes, element_bytes);

  double postscale = o.postscale_factor;
  const ReduceOp op = SumForAverage(o.op, p, &postscale);
  if (offsets[p] == 0) return;

  char* buf = static_cast<char*>(o.buffer);
  auto block = [&](int c) { return buf + offsets[c] * element_bytes; };
  auto block_bytes = [&](int c) { return o.counts[c] * element_bytes; };
  ScaleBuffer(buf, offsets[p], o.dtype, o.prescale_factor);

  const int right = Mod(r + 1, p);
  const int left = Mod(r - 1, p);
  std::vector<char> incoming(*std::max_element(o.counts.begin(), o.counts.end()) * element_bytes);
  for (int s = 0; s < p - 1; ++s) {
    const int send_c = Mod(r - 1 - s, p);
    const int recv_c = Mod(r - 2 - s, p);
    char* target = block(recv_c);
    RingStep(t, right, block(send_c), block_bytes(send_c), left, incoming.data(),
             block_bytes(recv_c), segment, o.tag, [&](size_t off, size_t bytes) {
               ReduceInto(target + off, incoming.data() + off, bytes / element_bytes, o.dtype, op);
             });
  }
  ScaleBuffer(block(r), o.counts[r], o.dtype, postscale);
}

// Ring allreduce: a ring reduce-scatter into p blocks whose sizes differ by at
// most one element, then a ring allgather of the finished blocks in place.
// Each rank sends 2(p-1)/p of the buffer in all.
void RingAllreduce(Transport& t, const AllreduceOptions& o) {
  CheckReduction(o.dtype, o.op, o.buffer, o.count, "allreduce");
  const int p = t.size();
  const size_t element_bytes = DataTypeSize(o.dtype);
  ReduceScatterOptions rs;
  rs.buffer = o.buffer;
  for (int c = 0; c < p; ++c) rs.counts.push_back(o.count / p + (size_t(c) < o.count % p));
  rs.dtype = o.dtype;
  rs.op = o.op;
  rs.prescale_factor = o.prescale_factor;
  rs.postscale_factor = o.postscale_factor;
  rs.segment_bytes = o.segment_bytes;
  rs.tag = o.tag;
  RingReduceScatter(t, rs);
  if (p == 1 || o.count == 0) return;

  AllgatherOptions ag;
  ag.output = o.buffer;
  size_t before = 0;
  for (int c = 0; c < p; ++c) {
    ag.block_bytes.push_back(rs.counts[c] * element_bytes);
    if (c < t.rank()) before += ag.block_bytes.back();
  }
  ag.input = static_cast<char*>(o.buffer) + before;  // already in place
  ag.segment_bytes = SegmentBytes(o.segment_bytes, element_bytes);  // whole elements
  ag.tag = o.tag;
  RingAllgather(t, ag);
}

// Recursive doubling. With q the largest power of two <= p and e = p - q,
// the first 2e ranks pair up first: each even one sends its buffer to the
// odd one above it and sits out. The q remaining ranks, renumbered 0..q-1,
// then exchange whole buffers with the rank whose new number differs in bit
// k, for k = 0, 1, ...: after step k every rank holds the reduction over a
// group of 2^(k+1). Finally each odd rank of the first 2e sends the result
// back to its even partner. Both partners of an exchange compute a (op) b
// with the same two operands, and the ops are commutative, so every rank
// ends with the same bits. For p = 6 (q = 4, e = 2):
//
//   fold:    0 -> 1, 2 -> 3            (new numbers: 1->0, 3->1, 4->2, 5->3)
//   step 0:  1 <-> 3, 4 <-> 5
//   step 1:  1 <-> 4, 3 <-> 5
//   unfold:  1 -> 0, 3 -> 2
void RecursiveDoublingAllreduce(Transport& t, const AllreduceOptions& o) {
  CheckReduction(o.dtype, o.op, o.buffer, o.count, "allreduce");
  const int p = t.size();
  const int r = t.rank();
  const size_t element_bytes = DataTypeSize(o.dtype);
  const size_t bytes = o.count * element_bytes;
  const size_t segment = SegmentBytes(o.segment_bytes, element_bytes);
  double postscale = o.postscale_factor;
  const ReduceOp op = SumForAverage(o.op, p, &postscale);
  if (o.count == 0) return;
  char* buf = static_cast<char*>(o.buffer);
  ScaleBuffer(buf, o.count, o.dtype, o.prescale_factor);
  std::vector<char> incoming(p > 1 ? bytes : 0);
  auto reduce = [&] { ReduceInto(buf, incoming.data(), o.count, o.dtype, op); };
  auto no_op = [](size_t, size_t) {};

  int q = 1;
  while (q * 2 <= p) q *= 2;
  const int extra = p - q;
  int me = r - extra;  // this rank's number among the q, or -1
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      RingStep(t, r + 1, buf, bytes, r + 1, nullptr, 0, segment, o.tag, no_op);
      me = -1;
    } else {
      RingStep(t, r - 1, nullptr, 0, r - 1, incoming.data(), bytes, segment, o.tag, no_op);
      reduce();
      me = r / 2;
    }
  }
  if (me >= 0) {
    for (int mask = 1; mask < q; mask <<= 1) {
      const int partner_me = me ^ mask;
      const int partner = partner_me < extra ? partner_me * 2 + 1 : partner_me + extra;
      // Reduced only once the send is complete: it reads `buf`.
      RingStep(t, partner, buf, bytes, partner, incoming.data(), bytes, segment, o.tag, no_op);
      reduce();
    }
  }
  if (r < 2 * extra) {
    if (r % 2 == 1) {
      RingStep(t, r - 1, buf, bytes, r - 1, nullptr, 0, segment, o.tag, no_op);
    } else {
      RingStep(t, r + 1, nullptr, 0, r + 1, buf, bytes, segment, o.tag, no_op);
    }
  }
  ScaleBuffer(buf, o.count, o.dtype, postscale);
}

void Allreduce(Transport& t, const AllreduceOptions& o) {
  if (o.count * DataTypeSize(o.dtype) <= o.small_bytes) {
    RecursiveDoublingAllreduce(t, o);
  } else {
    RingAllreduce(t, o);
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
  // The input may already sit at its place in the output.
  if (o.block_bytes[r] > 0 && o.input != out + offsets[r]) {
    std::memmove(out + offsets[r], o.input, o.block_bytes[r]);
  }

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

// Pairwise exchange. Step s pairs rank r with r+s (to send) and r-s (to
// receive); both sides know each block's size, so a zero-byte block posts
// nothing. Receives are posted before sends, as in RingStep.
void Alltoall(Transport& t, const AlltoallOptions& o) {
  const int p = t.size();
  const int r = t.rank();
  KR_CHECK(o.send_bytes.size() == size_t(p) && o.recv_bytes.size() == size_t(p),
           "alltoall needs one block size per rank: expected " + std::to_string(p) + ", got " +
               std::to_string(o.send_bytes.size()) + " and " + std::to_string(o.recv_bytes.size()));
  std::vector<size_t> send_off(p + 1, 0), recv_off(p + 1, 0);
  for (int i = 0; i < p; ++i) {
    send_off[i + 1] = send_off[i] + o.send_bytes[i];
    recv_off[i + 1] = recv_off[i] + o.recv_bytes[i];
  }
  KR_CHECK(o.input != nullptr || send_off[p] == 0,
           "alltoall of " + std::to_string(send_off[p]) + " bytes has a null input");
  KR_CHECK(o.output != nullptr || recv_off[p] == 0,
           "alltoall of " + std::to_string(recv_off[p]) + " bytes has a null output");
  KR_CHECK(o.send_bytes[r] == o.recv_bytes[r],
           "alltoall sends " + std::to_string(o.send_bytes[r]) + " bytes to itself but expects " +
               std::to_string(o.recv_bytes[r]));
  const size_t segment = SegmentBytes(o.segment_bytes, 1);
  const char* in = static_cast<const char*>(o.input);
  char* out = static_cast<char*>(o.output);
  if (o.send_bytes[r] > 0) std::memcpy(out + recv_off[r], in + send_off[r], o.send_bytes[r]);
  for (int s = 1; s < p; ++s) {
    const int to = Mod(r + s, p);
    const int from = Mod(r - s, p);
    std::vector<PendingPtr> transfers;
    for (size_t off = 0; off < o.recv_bytes[from]; off += segment) {
      transfers.push_back(t.Irecv(out + recv_off[from] + off,
                                  std::min(segment, o.recv_bytes[from] - off), from, o.tag));
    }
    for (size_t off = 0; off < o.send_bytes[to]; off += segment) {
      transfers.push_back(t.Isend(in + send_off[to] + off,
                                  std::min(segment, o.send_bytes[to] - off), to, o.tag));
    }
    for (PendingPtr& x : transfers) x->Wait();
  }
}

}  // namespace keras_ring
