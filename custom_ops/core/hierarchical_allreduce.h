// The allreduce of ranks that share memory, on one host or on several: the
// ranks of each host reduce in shared-memory rounds (ShmGroup), and when they
// span hosts, each rank's reduced block of every round is first reduced
// across hosts with the ranks of the same local rank, over the network.
#pragma once

#include "algorithms.h"
#include "shm.h"
#include "transport/transport.h"

namespace keras_ring {

struct HierarchicalAllreduceOptions {
  // The spans, dtypes, op, scale factors and round size (combine is set here).
  ShmAllreduceOptions host;
  // Across hosts: the pipelining granularity, and the block size up to which
  // recursive doubling is used instead of the ring (see AllreduceOptions).
  size_t cross_segment_bytes = AllreduceOptions().segment_bytes;
  size_t cross_small_bytes = 0;
};

// Every rank of `host` calls it with the same options except the spans'
// buffers; `cross` links this rank with the ranks of its local rank on the
// other hosts (null: one host), each host holding the same number of ranks.
// Blocking.
void HierarchicalAllreduce(ShmGroup& host, Transport* cross, HierarchicalAllreduceOptions o);

}  // namespace keras_ring
