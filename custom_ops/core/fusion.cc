#include "fusion.h"

#include <algorithm>
#include <numeric>

#include "reduce.h"

namespace keras_ring {

namespace {

bool Fusable(const Response& r) {
  return r.error.empty() && r.metas[0].collective == Collective::kAllreduce;
}

// A group's reduction fields are its first member's: fused with a
// different member's, the engine runs each stretch of alike tensors apart.
bool SameReduction(const Response& a, const Response& b) {
  return a.process_set == b.process_set && SameReduction(a.metas[0], b.metas[0]);
}

}  // namespace

std::vector<Response> Fuse(std::vector<Response> responses, size_t threshold) {
  std::vector<Response> out;
  std::vector<bool> taken(responses.size(), false);
  for (size_t i = 0; i < responses.size(); ++i) {
    if (taken[i]) continue;
    Response fused = std::move(responses[i]);
    if (Fusable(fused) && threshold > 0) {  // 0: no fusion, even of empty tensors
      for (size_t j = i + 1; j < responses.size(); ++j) {
        Response& next = responses[j];
        if (taken[j] || !Fusable(next) || !SameReduction(fused, next) ||
            fused.bytes + next.bytes > threshold) {
          continue;
        }
        fused.names.push_back(std::move(next.names[0]));
        fused.cache_ids.push_back(next.cache_ids[0]);
        fused.metas.push_back(std::move(next.metas[0]));
        fused.cached = fused.cached && next.cached;
        fused.send_metas = fused.send_metas || next.send_metas;
        fused.bytes += next.bytes;
        taken[j] = true;
      }
    }
    out.push_back(std::move(fused));
  }
  return out;
}


std::vector<size_t> PlanAllreduces(std::vector<Request>* requests, size_t threshold) {
  // Alike tensors together, in the order their kinds first appear and,
  // within a kind, in submission order; then cut where the next tensor would
  // take a collective past the threshold (a larger tensor alone; threshold 0:
  // each alone).
  if (requests->size() == 1) return {1};  // the common case, without allocating
  std::vector<const TensorMeta*> kinds;
  std::vector<size_t> kind(requests->size());
  for (size_t i = 0; i < requests->size(); ++i) {
    const TensorMeta& m = (*requests)[i].meta;
    size_t k = 0;
    while (k < kinds.size() && !SameReduction(*kinds[k], m)) ++k;
    if (k == kinds.size()) kinds.push_back(&m);
    kind[i] = k;
  }
  if (kinds.size() > 1) {
    std::vector<size_t> order(requests->size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return kind[a] < kind[b]; });
    std::vector<Request> sorted;
    sorted.reserve(order.size());
    for (size_t i : order) sorted.push_back(std::move((*requests)[i]));
    *requests = std::move(sorted);
    std::sort(kind.begin(), kind.end());  // the kinds in their new order
  }
  std::vector<size_t> ends;
  size_t bytes = 0;
  for (size_t i = 0; i < requests->size(); ++i) {
    const size_t more = Bytes((*requests)[i].meta);
    const bool fits =
        i > 0 && kind[i] == kind[i - 1] && threshold > 0 && bytes + more <= threshold;
    if (i > 0 && !fits) ends.push_back(i);
    bytes = fits ? bytes + more : more;
  }
  ends.push_back(requests->size());
  return ends;
}

char* FusionBuffer::Pack(const Request* begin, const Request* end) {
  const TensorMeta& m = begin->meta;
  const size_t esize = DataTypeSize(m.wire_dtype);
  size_t total = 0;
  for (const Request* req = begin; req != end; ++req) total += ElementCount(req->meta.shape);
  if (bytes_.size() < total * esize) bytes_.resize(total * esize);
  char* packed = bytes_.data();
  for (const Request* req = begin; req != end; ++req) {
    const size_t count = ElementCount(req->meta.shape);
    CopyElements(packed, m.wire_dtype, req->input, m.dtype, count);
    packed += count * esize;
  }
  return bytes_.data();
}

void FusionBuffer::Unpack(const Request* begin, const Request* end) const {
  const TensorMeta& m = begin->meta;
  const size_t esize = DataTypeSize(m.wire_dtype);
  const char* packed = bytes_.data();
  for (const Request* req = begin; req != end; ++req) {
    const size_t count = ElementCount(req->meta.shape);
    CopyElements(req->output, m.dtype, packed, m.wire_dtype, count);
    packed += count * esize;
  }
}

}  // namespace keras_ring
