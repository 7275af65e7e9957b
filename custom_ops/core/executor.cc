#include "executor.h"

#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include "algorithms.h"
#include "hierarchical_allreduce.h"
#include "reduce.h"

namespace keras_ring {

namespace {

// What a joined rank runs in place of a request it never made: zeros in,
// whatever comes back is dropped.
struct StandIn {
  std::vector<char> input, output;
  size_t element_bytes = 1;

  static void* Allocate(void* ctx, int ndim, const int64_t* shape) {
    auto* self = static_cast<StandIn*>(ctx);
    self->output.resize(ElementCount(std::vector<int64_t>(shape, shape + ndim)) *
                        self->element_bytes);
    return self->output.data();
  }
  static void Done(void*, kr_status, const char*) {}

  // A request of `meta`'s description that this stand-in serves.
  static Request For(const TensorMeta& meta, std::vector<std::unique_ptr<StandIn>>* keep) {
    auto s = std::make_unique<StandIn>();
    Request req;
    req.meta = meta;
    if (req.meta.collective == Collective::kAllgather) req.meta.shape[0] = 0;
    s->element_bytes = DataTypeSize(req.meta.dtype);
    s->input.assign(ElementCount(req.meta.shape) * s->element_bytes, 0);
    s->output.resize(s->input.size());
    req.input = s->input.data();
    req.output = s->output.data();
    req.allocate_output = &StandIn::Allocate;
    req.done = &StandIn::Done;
    req.ctx = s.get();
    keep->push_back(std::move(s));
    return req;
  }
};

}  // namespace

void Executor::Execute(ResponseList& list, std::unordered_map<int32_t, ProcessSet>& sets) {
  received_ = observers_.Now();
  for (Response& resp : list.responses) {
    auto found = sets.find(resp.process_set);
    // A list may mix sets: run those this rank is in (a removed set has
    // failed its requests already).
    if (found == sets.end() || found->second.rank < 0) continue;
    ProcessSet& set = found->second;
    std::vector<Request> requests;
    std::vector<std::unique_ptr<StandIn>> stand_ins;
    try {
      for (size_t i = 0; i < resp.names.size(); ++i) {
        const int32_t id = resp.cache_ids[i];
        if (resp.cached) {
          KR_CHECK(id >= 0 && size_t(id) < set.cached.size(),
                   "unknown cache id " + std::to_string(id));
          resp.names[i] = set.cached[id].name;
        }
        const std::string& name = resp.names[i];
        auto it = set.pending.find(name);
        if (it == set.pending.end() && !resp.error.empty()) continue;  // stalled elsewhere
        // Stalled without this rank: the request of this name it has here
        // reached the coordinator after the decision (or is still on its
        // way), which waits on it as a new one; failing it here would leave
        // the coordinator pairing it with another rank's next request of
        // the name, run with this rank's next buffer.
        if (!resp.error.empty() && !resp.rows.empty() &&
            (size_t(set.rank) >= resp.rows.size() || !resp.rows[set.rank])) {
          continue;
        }
        if (it == set.pending.end() && set.joined && resp.send_metas) {
          const TensorMeta& meta = resp.metas[i];
          if (!meta.members) {
            requests.push_back(StandIn::For(meta, &stand_ins));
            continue;
          }
          for (const TensorMeta& m : *meta.members) requests.push_back(StandIn::For(m, &stand_ins));
          continue;
        }
        KR_CHECK(it != set.pending.end(), "the coordinator scheduled tensor '" + name +
                                              "', which this rank has not submitted");
        Request& req = it->second;
        // A new cache entry: remember this rank's request under the id.
        if (id >= 0 && !resp.cached) {
          if (set.cached.size() <= size_t(id)) set.cached.resize(id + 1);
          req.DescribeMembers();
          set.cached[id] = req.meta;
          set.cache_ids[name] = id;
        }
        if (req.group) {
          for (Request& m : req.members) requests.push_back(std::move(m));
        } else {
          requests.push_back(std::move(req));
        }
        set.pending.erase(it);
      }
    } catch (const std::exception& e) {
      // Requests taken out of `pending` must still complete.
      for (const Request& req : requests) req.Complete(StatusOf(e), e.what());
      throw;
    }
    Run(set, requests, resp);
  }
}

void Executor::Run(ProcessSet& set, std::vector<Request>& requests, const Response& resp) {
  const auto started = observers_.Now();
  // Where each collective's requests end: allreduces (a group's members,
  // fused tensors) may take several.
  std::vector<size_t> ends = {requests.size()};
  if (resp.error.empty() && !requests.empty() &&
      requests[0].meta.collective == Collective::kAllreduce) {
    ends = PlanAllreduces(&requests, params_.fusion_threshold);
  }
  // A stalled tensor's error reaches ranks that never submitted it: no requests.
  if (!requests.empty()) observers_.Running(set, requests, ends, resp, received_, started);
  set.collectives_run += ends.size();
  if (!resp.error.empty()) {
    for (const Request& req : requests) {
      if (req.meta.collective == Collective::kJoin) set.joined = false;
      Complete(req, resp.status, resp.error);
    }
    return;
  }
  if (requests.empty()) return;  // a group of this rank's whose every member was refused
  bool ok = true;
  try {
    switch (requests[0].meta.collective) {
      case Collective::kAllreduce:
        for (size_t k = 0, begin = 0; k < ends.size(); begin = ends[k++]) {
          RunAllreduce(set, requests.data() + begin, requests.data() + ends[k]);
        }
        break;
      case Collective::kBroadcast:
        RunBroadcast(set, requests[0]);
        break;
      case Collective::kAllgather:
        ok = RunAllgather(set, requests[0], resp);
        break;
      case Collective::kReducescatter:
        ok = RunReducescatter(set, requests[0]);
        break;
      case Collective::kAlltoall:
        ok = RunAlltoall(set, requests[0], resp);
        break;
      case Collective::kJoin: {
        // The last rank to join, as a rank of the set.
        const int32_t last = static_cast<int32_t>(resp.rows[0]);
        std::memcpy(requests[0].output, &last, sizeof last);
        set.joined = false;
        break;
      }
      case Collective::kAddProcessSet: {
        const TensorMeta& m = requests[0].meta;
        add_set_(std::vector<int>(m.splits.begin(), m.splits.end()),
                 static_cast<int32_t*>(requests[0].output));
        break;
      }
      case Collective::kRemoveProcessSet:
        remove_set_(static_cast<int32_t>(requests[0].meta.splits[0]));
        break;
    }
  } catch (const std::exception& e) {
    for (const Request& req : requests) {
      Complete(req, StatusOf(e), std::string(e.what()) + " (tensor '" + req.meta.name + "')");
    }
    throw;
  }
  // Allreduces report their own collectives.
  if (requests[0].meta.collective != Collective::kAllreduce) {
    observers_.Ran(requests.data(), requests.data() + 1, Observer::Path::kNetwork,
                   {{"COMMUNICATE", started, observers_.Now()}});
  }
  if (!ok) return;
  for (const Request& req : requests) Complete(req, KR_OK, "");
}

void Executor::Complete(const Request& req, kr_status status, const std::string& message) {
  const auto start = observers_.Now();
  req.Complete(status, message);
  observers_.Completed(req, start, observers_.Now());
}

void Executor::RunAllreduce(ProcessSet& set, const Request* begin, const Request* end) {
  const TensorMeta& m = begin->meta;
  const size_t n = end - begin;
  size_t total = 0;  // elements of all the requests
  for (const Request* req = begin; req != end; ++req) total += ElementCount(req->meta.shape);
  // With more ranks than cores, a shared-memory allreduce waits for ranks
  // that are not running; recursive doubling over the network is faster for small ones
  // (measured: 3 ranks on 2 cores, 4 KiB: 0.07 ms against 0.62 ms).
  const bool small =
      set.shm_oversubscribed && total * DataTypeSize(m.wire_dtype) <= params_.small_allreduce_bytes;
  if (set.shm && !small) {
    // Inputs are copied straight into shared memory and results straight
    // out of it: no packing, fused or not.
    const auto started = observers_.Now();
    HierarchicalAllreduceOptions o;
    ShmAllreduceOptions& host = o.host;
    host.spans.reserve(n);
    for (const Request* req = begin; req != end; ++req) {
      host.spans.push_back({req->input, req->output, ElementCount(req->meta.shape)});
    }
    host.dtype = m.dtype;
    if (m.wire_dtype != m.dtype) host.wire_dtype = m.wire_dtype;
    host.op = m.op;
    host.prescale_factor = m.prescale_factor;
    host.postscale_factor = m.postscale_factor;
    host.round_bytes = params_.segment_bytes ? params_.segment_bytes : set.shm_round_bytes;
    if (params_.segment_bytes) o.cross_segment_bytes = params_.segment_bytes;
    o.cross_small_bytes = params_.small_allreduce_bytes;
    HierarchicalAllreduce(*set.shm, set.cross.get(), std::move(o));
    const auto path = set.cross ? Observer::Path::kHierarchical : Observer::Path::kSharedMemory;
    observers_.Ran(begin, end, path, {{"COMMUNICATE", started, observers_.Now()}});
    return;
  }
  AllreduceOptions o;
  o.dtype = m.wire_dtype;
  o.op = m.op;
  o.prescale_factor = m.prescale_factor;
  o.postscale_factor = m.postscale_factor;
  o.small_bytes = params_.small_allreduce_bytes;
  if (params_.segment_bytes) o.segment_bytes = params_.segment_bytes;
  if (n == 1 && m.wire_dtype == m.dtype) {
    const Request& req = *begin;
    const auto started = observers_.Now();
    o.count = total;
    if (o.count && req.output != req.input) {
      std::memcpy(req.output, req.input, o.count * DataTypeSize(m.dtype));
    }
    o.buffer = req.output;
    Allreduce(*set.transport, o);
    observers_.Ran(begin, end, Observer::Path::kNetwork,
                   {{"COMMUNICATE", started, observers_.Now()}});
    return;
  }
  // Fused or compressed: pack every input into one buffer (converting to
  // the wire dtype), reduce once, unpack. Packing is a copy either way:
  // unfused, each input is copied to its output first.
  const auto packing = observers_.Now();
  o.count = total;
  o.buffer = fusion_buffer_.Pack(begin, end);
  const auto packed_at = observers_.Now();
  Allreduce(*set.transport, o);
  const auto reduced = observers_.Now();
  fusion_buffer_.Unpack(begin, end);
  observers_.Ran(begin, end, Observer::Path::kNetwork,
                 {{"PACK", packing, packed_at},
                  {"COMMUNICATE", packed_at, reduced},
                  {"UNPACK", reduced, observers_.Now()}});
}

void Executor::RunBroadcast(ProcessSet& set, const Request& req) {
  const TensorMeta& m = req.meta;
  const size_t bytes = ElementCount(m.shape) * DataTypeSize(m.dtype);
  if (bytes && set.rank == m.root_rank && req.output != req.input) {
    std::memcpy(req.output, req.input, bytes);
  }
  BroadcastOptions o;
  o.buffer = req.output;
  o.bytes = bytes;
  o.root = m.root_rank;
  Broadcast(*set.transport, o);
}

void* Executor::AllocateOutput(const Request& req, const std::vector<int64_t>& shape,
                             std::vector<char>* scratch, bool* failed) {
  const size_t bytes = ElementCount(shape) * DataTypeSize(req.meta.dtype);
  void* out = req.allocate_output(req.ctx, static_cast<int>(shape.size()), shape.data());
  // NULL is a failure only when there are bytes to hold (an empty tensor may
  // have no buffer). Without an output this rank must still take part, or the
  // others hang.
  *failed = !out && bytes > 0;
  if (!*failed) return out;
  scratch->resize(bytes);
  Complete(req, KR_INTERNAL, std::string("keras-ring: could not allocate the output of ") +
                                 CollectiveName(req.meta.collective) + " for tensor '" +
                                 req.meta.name + "'");
  return scratch->data();
}

bool Executor::RunAllgather(ProcessSet& set, const Request& req, const Response& resp) {
  const TensorMeta& m = req.meta;
  const size_t row_bytes = ElementCount(m.shape, 1) * DataTypeSize(m.dtype);
  std::vector<int64_t> out_shape = m.shape;
  out_shape[0] = std::accumulate(resp.rows.begin(), resp.rows.end(), int64_t{0});
  AllgatherOptions o;
  for (int64_t d : resp.rows) o.block_bytes.push_back(static_cast<size_t>(d) * row_bytes);
  o.input = req.input;
  std::vector<char> scratch;
  bool failed;
  o.output = AllocateOutput(req, out_shape, &scratch, &failed);
  if (params_.segment_bytes) o.segment_bytes = params_.segment_bytes;
  RingAllgather(*set.transport, o);
  return !failed;
}

bool Executor::RunReducescatter(ProcessSet& set, const Request& req) {
  const TensorMeta& m = req.meta;
  const int p = set.size();
  const size_t row_elements = ElementCount(m.shape, 1);
  const size_t esize = DataTypeSize(m.wire_dtype);
  const int r = set.rank;
  auto rows = [&](int rank) { return m.shape[0] / p + (rank < m.shape[0] % p); };
  ReduceScatterOptions o;
  for (int i = 0; i < p; ++i) o.counts.push_back(rows(i) * row_elements);
  // The algorithm works in place over the whole input: use the fusion buffer.
  char* buffer = fusion_buffer_.Pack(&req, &req + 1);
  o.buffer = buffer;
  o.dtype = m.wire_dtype;
  o.op = m.op;
  o.prescale_factor = m.prescale_factor;
  o.postscale_factor = m.postscale_factor;
  if (params_.segment_bytes) o.segment_bytes = params_.segment_bytes;
  RingReduceScatter(*set.transport, o);
  std::vector<int64_t> out_shape = m.shape;
  out_shape[0] = rows(r);
  std::vector<char> scratch;
  bool failed;
  void* out = AllocateOutput(req, out_shape, &scratch, &failed);
  const size_t before = std::accumulate(o.counts.begin(), o.counts.begin() + r, size_t{0});
  CopyElements(out, m.dtype, buffer + before * esize, m.wire_dtype, o.counts[r]);
  return !failed;
}

bool Executor::RunAlltoall(ProcessSet& set, const Request& req, const Response& resp) {
  const TensorMeta& m = req.meta;
  const int p = set.size();
  const int r = set.rank;
  const size_t row_bytes = ElementCount(m.shape, 1) * DataTypeSize(m.dtype);
  AlltoallOptions o;
  std::vector<int64_t> out_shape = m.shape;
  out_shape[0] = 0;
  for (int i = 0; i < p; ++i) {
    const int64_t sent = resp.rows[size_t(r) * p + i], received = resp.rows[size_t(i) * p + r];
    o.send_bytes.push_back(static_cast<size_t>(sent) * row_bytes);
    o.recv_bytes.push_back(static_cast<size_t>(received) * row_bytes);
    out_shape[0] += received;
    if (req.received_splits) req.received_splits[i] = received;
  }
  o.input = req.input;
  std::vector<char> scratch;
  bool failed;
  o.output = AllocateOutput(req, out_shape, &scratch, &failed);
  Alltoall(*set.transport, o);
  return !failed;
}

}  // namespace keras_ring
