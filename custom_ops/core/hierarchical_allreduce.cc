#include "hierarchical_allreduce.h"

#include "reduce.h"

namespace keras_ring {

void HierarchicalAllreduce(ShmGroup& host, Transport* cross, HierarchicalAllreduceOptions o) {
  ShmAllreduceOptions& local = o.host;
  if (cross) {
    // Averaging divides once, by every rank of every host, after the sums.
    local.op = SumForAverage(local.op, host.size() * cross->size(), &local.postscale_factor);
    local.combine = [&](void* block, size_t count) {
      AllreduceOptions across;
      across.buffer = block;
      across.count = count;
      across.dtype = local.wire_dtype.value_or(local.dtype);
      across.op = local.op;
      across.segment_bytes = o.cross_segment_bytes;
      across.small_bytes = o.cross_small_bytes;
      Allreduce(*cross, across);
    };
  }
  host.Allreduce(local);
}

}  // namespace keras_ring
