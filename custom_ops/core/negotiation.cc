#include "negotiation.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace keras_ring {

namespace {

class Writer {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "plain values only");
    const char* p = reinterpret_cast<const char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void PutDims(const std::vector<int64_t>& dims) {
    Put<uint64_t>(dims.size());
    for (int64_t d : dims) Put(d);
  }
  std::vector<char> Take() { return std::move(bytes_); }

 private:
  std::vector<char> bytes_;
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& bytes) : bytes_(bytes) {}
  template <typename T>
  T Get() {
    KR_CHECK(pos_ + sizeof(T) <= bytes_.size(), "truncated control message");
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string GetString() {
    uint64_t n = Get<uint64_t>();
    KR_CHECK(pos_ + n <= bytes_.size(), "truncated control message");
    std::string s(bytes_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  std::vector<int64_t> GetDims() {
    std::vector<int64_t> dims(Get<uint64_t>());
    for (auto& d : dims) d = Get<int64_t>();
    return dims;
  }

 private:
  const std::vector<char>& bytes_;
  size_t pos_ = 0;
};

std::string DimsToString(const std::vector<int64_t>& dims) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
  s << "]";
  return s.str();
}

}  // namespace

std::string TensorMeta::Describe() const {
  std::ostringstream s;
  s << CollectiveName(collective) << " of " << DataTypeName(dtype) << DimsToString(shape);
  if (collective == Collective::kAllreduce || collective == Collective::kReducescatter) {
    s << " op=" << ReduceOpName(op);
    if (prescale_factor != 1.0) s << " prescale=" << prescale_factor;
    if (postscale_factor != 1.0) s << " postscale=" << postscale_factor;
  }
  if (collective == Collective::kBroadcast) s << " root=" << root_rank;
  if (collective == Collective::kAlltoall && !splits.empty()) s << " splits=" << DimsToString(splits);
  return s.str();
}

std::vector<char> SerializeMetas(const std::vector<TensorMeta>& metas, bool shutdown) {
  Writer w;
  w.Put<uint8_t>(shutdown);
  w.Put<uint64_t>(metas.size());
  for (const auto& m : metas) {
    w.PutString(m.name);
    w.Put<int32_t>(static_cast<int32_t>(m.collective));
    w.Put<int32_t>(static_cast<int32_t>(m.dtype));
    w.Put<int32_t>(static_cast<int32_t>(m.op));
    w.Put(m.prescale_factor);
    w.Put(m.postscale_factor);
    w.Put<int32_t>(m.root_rank);
    w.PutDims(m.shape);
    w.PutDims(m.splits);
  }
  return w.Take();
}

void DeserializeMetas(const std::vector<char>& bytes, std::vector<TensorMeta>* metas,
                      bool* shutdown) {
  Reader r(bytes);
  *shutdown = r.Get<uint8_t>() != 0;
  metas->resize(r.Get<uint64_t>());
  for (auto& m : *metas) {
    m.name = r.GetString();
    m.collective = static_cast<Collective>(r.Get<int32_t>());
    m.dtype = static_cast<DataType>(r.Get<int32_t>());
    m.op = static_cast<ReduceOp>(r.Get<int32_t>());
    m.prescale_factor = r.Get<double>();
    m.postscale_factor = r.Get<double>();
    m.root_rank = r.Get<int32_t>();
    m.shape = r.GetDims();
    m.splits = r.GetDims();
  }
}

std::vector<char> SerializeResponses(const ResponseList& list) {
  Writer w;
  w.Put<int32_t>(list.shutdown_rank);
  w.Put<uint64_t>(list.responses.size());
  for (const auto& resp : list.responses) {
    w.Put<uint64_t>(resp.names.size());
    for (const auto& name : resp.names) w.PutString(name);
    w.PutString(resp.error);
    w.Put<int32_t>(resp.status);
    w.PutDims(resp.rows);
  }
  return w.Take();
}

ResponseList DeserializeResponses(const std::vector<char>& bytes) {
  Reader r(bytes);
  ResponseList list;
  list.shutdown_rank = r.Get<int32_t>();
  list.responses.resize(r.Get<uint64_t>());
  for (auto& resp : list.responses) {
    resp.names.resize(r.Get<uint64_t>());
    for (auto& name : resp.names) name = r.GetString();
    resp.error = r.GetString();
    resp.status = static_cast<kr_status>(r.Get<int32_t>());
    resp.rows = r.GetDims();
  }
  return list;
}

void Coordinator::Add(int rank, TensorMeta meta, std::vector<Response>* out,
                      Clock::time_point now) {
  Entry& e = table_[meta.name];
  if (e.metas.empty()) {
    e.metas.resize(size_);
    e.present.assign(size_, false);
    e.first_seen = now;
  }
  // A rank's engine refuses a name it already has in flight, so a repeat here
  // means the ranks' engines disagree: fail the name rather than guess.
  KR_CHECK(!e.present[rank], "rank " + std::to_string(rank) + " sent tensor '" + meta.name +
                                 "' twice before it completed");
  std::string name = meta.name;
  e.metas[rank] = std::move(meta);
  e.present[rank] = true;
  if (++e.count < size_) return;
  out->push_back(Decide(name, e));
  table_.erase(name);
}

Response Coordinator::Decide(const std::string& name, const Entry& entry) const {
  Response resp;
  resp.names = {name};
  const TensorMeta& first = entry.metas[0];
  resp.meta = first;
  size_t count = 1;
  for (int64_t d : first.shape) count *= static_cast<size_t>(d);
  resp.bytes = count * DataTypeSize(first.dtype);
  bool agree = true;
  for (int r = 1; r < size_ && agree; ++r) {
    const TensorMeta& m = entry.metas[r];
    agree = m.collective == first.collective && m.dtype == first.dtype;
    if (!agree) break;
    switch (first.collective) {
      case Collective::kAllreduce:
      case Collective::kReducescatter:
        agree = m.shape == first.shape && m.op == first.op &&
                m.prescale_factor == first.prescale_factor &&
                m.postscale_factor == first.postscale_factor;
        break;
      case Collective::kBroadcast:
        agree = m.shape == first.shape && m.root_rank == first.root_rank;
        break;
      case Collective::kAllgather:
      case Collective::kAlltoall:
        // Only the first dimension may differ between ranks.
        agree = m.shape.size() == first.shape.size() &&
                std::equal(m.shape.begin() + (m.shape.empty() ? 0 : 1), m.shape.end(),
                           first.shape.begin() + (first.shape.empty() ? 0 : 1));
        break;
    }
  }
  if (!agree) {
    std::ostringstream s;
    s << "keras-ring: ranks disagree on tensor '" << name << "':";
    for (int r = 0; r < size_; ++r) s << (r ? ";" : "") << " rank " << r << " sent "
                                      << entry.metas[r].Describe();
    resp.error = s.str();
    resp.status = KR_INVALID_ARGUMENT;
    return resp;
  }
  if (first.collective == Collective::kAllgather) {
    for (const auto& m : entry.metas) resp.rows.push_back(m.shape.empty() ? 0 : m.shape[0]);
  }
  if (first.collective == Collective::kAlltoall) {
    for (const auto& m : entry.metas) {
      for (int to = 0; to < size_; ++to) {
        // The engine checked the splits against the first dimension on submission.
        resp.rows.push_back(m.splits.empty() ? m.shape[0] / size_ : m.splits[to]);
      }
    }
  }
  return resp;
}

namespace {

bool Fusable(const Response& r) {
  return r.error.empty() && r.meta.collective == Collective::kAllreduce;
}

bool SameReduction(const TensorMeta& a, const TensorMeta& b) {
  return a.dtype == b.dtype && a.op == b.op && a.prescale_factor == b.prescale_factor &&
         a.postscale_factor == b.postscale_factor;
}

}  // namespace

std::vector<Response> Fuse(std::vector<Response> responses, size_t threshold) {
  std::vector<Response> out;
  std::vector<bool> taken(responses.size(), false);
  for (size_t i = 0; i < responses.size(); ++i) {
    if (taken[i]) continue;
    Response fused = std::move(responses[i]);
    if (Fusable(fused)) {
      for (size_t j = i + 1; j < responses.size(); ++j) {
        const Response& next = responses[j];
        if (taken[j] || !Fusable(next) || !SameReduction(fused.meta, next.meta) ||
            fused.bytes + next.bytes > threshold) {
          continue;
        }
        fused.names.push_back(next.names[0]);
        fused.bytes += next.bytes;
        taken[j] = true;
      }
    }
    out.push_back(std::move(fused));
  }
  return out;
}

std::string Coordinator::Stall(const std::string& name, const Entry& e,
                               Clock::time_point now) const {
  std::ostringstream waiting, missing;
  for (int r = 0; r < size_; ++r) {
    std::ostringstream& s = e.present[r] ? waiting : missing;
    s << (s.tellp() > 0 ? ", " : "") << r;
  }
  const TensorMeta& m = e.metas[std::find(e.present.begin(), e.present.end(), true) -
                                e.present.begin()];
  auto seconds = std::chrono::duration_cast<std::chrono::seconds>(now - e.first_seen).count();
  std::ostringstream s;
  s << "ranks [" << waiting.str() << "] have been waiting " << seconds << " s for ranks ["
    << missing.str() << "] to submit tensor '" << name << "' (" << m.Describe() << ")";
  return s.str();
}

std::vector<std::string> Coordinator::StallReports(Clock::time_point now,
                                                   Clock::duration report_after) {
  std::vector<std::string> reports;
  for (auto& [name, e] : table_) {
    if (e.reported || now - e.first_seen < report_after) continue;
    e.reported = true;
    reports.push_back(Stall(name, e, now));
  }
  std::sort(reports.begin(), reports.end());
  return reports;
}

void Coordinator::FailStalled(Clock::time_point now, Clock::duration fail_after,
                              std::vector<Response>* out) {
  std::vector<std::string> stalled;
  for (const auto& [name, e] : table_) {
    if (now - e.first_seen >= fail_after) stalled.push_back(name);
  }
  std::sort(stalled.begin(), stalled.end());
  for (const std::string& name : stalled) {
    Response resp;
    resp.names = {name};
    resp.error = "keras-ring: stalled: " + Stall(name, table_[name], now) +
                 "; giving up (KERAS_RING_STALL_SHUTDOWN_TIME). A rank that skips a collective "
                 "or runs a different number of steps leaves the others waiting.";
    resp.status = KR_ABORTED;
    out->push_back(std::move(resp));
    table_.erase(name);
  }
}

void Coordinator::RequestShutdown(int rank) {
  shutdown_[rank] = true;
  if (first_shutdown_ < 0) first_shutdown_ = rank;
}

bool Coordinator::AllRequestedShutdown() const {
  for (bool s : shutdown_) {
    if (!s) return false;
  }
  return true;
}

}  // namespace keras_ring
