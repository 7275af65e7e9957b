// Collective algorithms, written only against Transport. Each takes an
// options struct and documents its schedule next to its code in
// algorithms.cc. All are blocking and must be entered by every rank of the
// transport in the same order with the same options (except buffers).
#pragma once

#include <cstddef>
#include <vector>

#include "common.h"
#include "transport/transport.h"

namespace keras_ring {

struct AllreduceOptions {
  void* buffer = nullptr;      // in place: this rank's input on entry, result on return
  size_t count = 0;            // elements
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kAverage = kSum with postscale / size
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  size_t segment_bytes = size_t(1) << 20;  // pipelining granularity
  int tag = 0;
  // Allreduce() uses recursive doubling up to this many bytes, the ring above.
  size_t small_bytes = 0;
};

// Ring allreduce: reduce-scatter then allgather, p-1 steps each, segmented so
// that receiving the next segment overlaps reducing the current one. Each
// rank sends 2(p-1)/p of the buffer: bandwidth-optimal, 2(p-1) latencies.
void RingAllreduce(Transport& t, const AllreduceOptions& o);

// Recursive doubling: log2(p) exchanges of the whole buffer (two more when p
// is not a power of two): latency-optimal, for small buffers.
void RecursiveDoublingAllreduce(Transport& t, const AllreduceOptions& o);

// Picks one of the two by the buffer's size and o.small_bytes.
void Allreduce(Transport& t, const AllreduceOptions& o);

struct ReduceScatterOptions {
  void* buffer = nullptr;       // this rank's whole input; clobbered except its own block
  std::vector<size_t> counts;   // elements of each rank's block, in rank order; may be 0
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kAverage = kSum with postscale / size
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  size_t segment_bytes = size_t(1) << 20;
  int tag = 0;
};

// Ring reduce-scatter, in place: on return this rank's block of `buffer`
// (after the blocks of lower ranks) holds the reduction of that block over
// every rank, post-scaled. p-1 steps, segmented like the allreduce.
void RingReduceScatter(Transport& t, const ReduceScatterOptions& o);

struct AllgatherOptions {
  const void* input = nullptr;     // this rank's block, block_bytes[rank] bytes
  void* output = nullptr;          // sum(block_bytes) bytes, blocks in rank order
  std::vector<size_t> block_bytes;  // one entry per rank; may differ and be 0
  size_t segment_bytes = size_t(1) << 20;
  int tag = 0;
};

// Ring allgather of variable-sized blocks.
void RingAllgather(Transport& t, const AllgatherOptions& o);

struct BroadcastOptions {
  void* buffer = nullptr;  // root: the data; others: receives it
  size_t bytes = 0;
  int root = 0;
  size_t segment_bytes = size_t(1) << 20;
  int tag = 0;
};

// Binomial-tree broadcast from any root.
void Broadcast(Transport& t, const BroadcastOptions& o);

struct AlltoallOptions {
  const void* input = nullptr;     // blocks for ranks 0..p-1, send_bytes[j] bytes each
  std::vector<size_t> send_bytes;  // one entry per rank; may be 0
  void* output = nullptr;          // blocks from ranks 0..p-1, recv_bytes[i] bytes each
  std::vector<size_t> recv_bytes;  // must equal what rank i sends to this rank
  size_t segment_bytes = size_t(1) << 20;
  int tag = 0;
};

// Pairwise exchange: in step s (of p-1) rank r sends its block for r+s and
// receives the block of r-s, so every rank sends and receives once per step.
void Alltoall(Transport& t, const AlltoallOptions& o);

}  // namespace keras_ring
