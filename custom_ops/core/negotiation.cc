#include "negotiation.h"

#include <algorithm>
#include <cstring>
#include <map>
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

size_t ElementCount(const std::vector<int64_t>& shape, size_t first) {
  size_t n = 1;
  for (size_t i = first; i < shape.size(); ++i) n *= static_cast<size_t>(shape[i]);
  return n;
}

size_t Bytes(const TensorMeta& m) {
  if (m.members) {
    size_t bytes = 0;
    for (const TensorMeta& member : *m.members) bytes += Bytes(member);
    return bytes;
  }
  return ElementCount(m.shape) * DataTypeSize(m.dtype);
}

bool SameReduction(const TensorMeta& a, const TensorMeta& b) {
  return a.dtype == b.dtype && a.wire_dtype == b.wire_dtype && a.op == b.op &&
         a.prescale_factor == b.prescale_factor && a.postscale_factor == b.postscale_factor;
}

std::string TensorMeta::Describe() const {
  std::ostringstream s;
  if (members) {
    s << "group of " << members->size() << " " << CollectiveName(collective) << "s";
    if (!members->empty()) {
      s << ": '" << members->front().name << "' " << members->front().Describe();
      if (members->size() > 1) s << ", ...";
    }
    return s.str();
  }
  s << CollectiveName(collective) << " of " << DataTypeName(dtype) << DimsToString(shape);
  if (collective == Collective::kAllreduce || collective == Collective::kReducescatter) {
    s << " op=" << ReduceOpName(op);
    if (prescale_factor != 1.0) s << " prescale=" << prescale_factor;
    if (postscale_factor != 1.0) s << " postscale=" << postscale_factor;
    if (wire_dtype != dtype) s << " sent as " << DataTypeName(wire_dtype);
  }
  if (collective == Collective::kBroadcast) s << " root=" << root_rank;
  if (collective == Collective::kAlltoall && !splits.empty()) s << " splits=" << DimsToString(splits);
  if (collective == Collective::kAddProcessSet) s << " ranks=" << DimsToString(splits);
  if (collective == Collective::kRemoveProcessSet) s << " id=" << DimsToString(splits);
  return s.str();
}

bool TensorMeta::operator==(const TensorMeta& o) const {
  return name == o.name && collective == o.collective && dtype == o.dtype && op == o.op &&
         prescale_factor == o.prescale_factor && postscale_factor == o.postscale_factor &&
         wire_dtype == o.wire_dtype && root_rank == o.root_rank && shape == o.shape &&
         splits == o.splits && error == o.error &&
         (members == o.members || (members && o.members && *members == *o.members));
}

namespace {

void PutMeta(Writer& w, const TensorMeta& m) {
  w.PutString(m.name);
  w.Put<int32_t>(static_cast<int32_t>(m.collective));
  w.Put<int32_t>(static_cast<int32_t>(m.dtype));
  w.Put<int32_t>(static_cast<int32_t>(m.op));
  w.Put(m.prescale_factor);
  w.Put(m.postscale_factor);
  w.Put<int32_t>(static_cast<int32_t>(m.wire_dtype));
  w.Put<int32_t>(m.root_rank);
  w.PutDims(m.shape);
  w.PutDims(m.splits);
  w.PutString(m.error);
  w.Put<int64_t>(m.members ? static_cast<int64_t>(m.members->size()) : -1);
  if (m.members) {
    for (const TensorMeta& member : *m.members) PutMeta(w, member);
  }
}

TensorMeta GetMeta(Reader& r) {
  TensorMeta m;
  m.name = r.GetString();
  m.collective = static_cast<Collective>(r.Get<int32_t>());
  m.dtype = static_cast<DataType>(r.Get<int32_t>());
  m.op = static_cast<ReduceOp>(r.Get<int32_t>());
  m.prescale_factor = r.Get<double>();
  m.postscale_factor = r.Get<double>();
  m.wire_dtype = static_cast<DataType>(r.Get<int32_t>());
  m.root_rank = r.Get<int32_t>();
  m.shape = r.GetDims();
  m.splits = r.GetDims();
  m.error = r.GetString();
  const int64_t members = r.Get<int64_t>();
  if (members >= 0) {
    auto list = std::make_shared<std::vector<TensorMeta>>();
    list->reserve(members);
    for (int64_t i = 0; i < members; ++i) list->push_back(GetMeta(r));
    m.members = std::move(list);
  }
  return m;
}

}  // namespace

std::vector<char> SerializeReadyList(const ReadyList& list) {
  Writer w;
  w.Put<int32_t>(list.process_set);
  w.Put<uint8_t>(list.shutdown);
  w.PutString(list.shutdown_reason);
  w.Put<uint64_t>(list.items.size());
  for (const auto& item : list.items) {
    w.Put(item.cache_id);
    if (item.cache_id < 0) PutMeta(w, item.meta);
  }
  return w.Take();
}

ReadyList DeserializeReadyList(const std::vector<char>& bytes) {
  Reader r(bytes);
  ReadyList list;
  list.process_set = r.Get<int32_t>();
  list.shutdown = r.Get<uint8_t>() != 0;
  list.shutdown_reason = r.GetString();
  list.items.resize(r.Get<uint64_t>());
  for (auto& item : list.items) {
    item.cache_id = r.Get<int32_t>();
    if (item.cache_id < 0) item.meta = GetMeta(r);
  }
  return list;
}

std::vector<char> SerializeResponses(const ResponseList& list) {
  Writer w;
  w.Put<int32_t>(list.shutdown_rank);
  w.PutString(list.shutdown_reason);
  w.Put<uint8_t>(list.params ? 1 + list.tuned : 0);
  if (list.params) {
    w.Put(list.params->fusion_threshold);
    w.Put(list.params->cycle_time_ms);
    w.Put(list.params->segment_bytes);
    w.Put(list.params->small_allreduce_bytes);
  }
  w.Put<uint64_t>(list.responses.size());
  for (const auto& resp : list.responses) {
    w.Put<int32_t>(resp.process_set);
    w.Put<uint8_t>(resp.cached);
    w.Put<uint64_t>(resp.cache_ids.size());
    for (size_t i = 0; i < resp.cache_ids.size(); ++i) {
      w.Put(resp.cache_ids[i]);
      if (!resp.cached) w.PutString(resp.names[i]);
    }
    w.PutString(resp.error);
    w.Put<int32_t>(resp.status);
    w.PutDims(resp.rows);
    w.Put<uint8_t>(resp.send_metas);
    if (resp.send_metas) {
      for (const auto& m : resp.metas) PutMeta(w, m);
    }
  }
  return w.Take();
}

ResponseList DeserializeResponses(const std::vector<char>& bytes) {
  Reader r(bytes);
  ResponseList list;
  list.shutdown_rank = r.Get<int32_t>();
  list.shutdown_reason = r.GetString();
  if (const uint8_t params = r.Get<uint8_t>()) {
    TunedParams p;
    p.fusion_threshold = r.Get<uint64_t>();
    p.cycle_time_ms = r.Get<double>();
    p.segment_bytes = r.Get<uint64_t>();
    p.small_allreduce_bytes = r.Get<uint64_t>();
    list.params = p;
    list.tuned = params == 2;
  }
  list.responses.resize(r.Get<uint64_t>());
  for (auto& resp : list.responses) {
    resp.process_set = r.Get<int32_t>();
    resp.cached = r.Get<uint8_t>() != 0;
    resp.cache_ids.resize(r.Get<uint64_t>());
    resp.names.resize(resp.cache_ids.size());
    for (size_t i = 0; i < resp.cache_ids.size(); ++i) {
      resp.cache_ids[i] = r.Get<int32_t>();
      if (!resp.cached) resp.names[i] = r.GetString();  // else: looked up by the rank
    }
    resp.error = r.GetString();
    resp.status = static_cast<kr_status>(r.Get<int32_t>());
    resp.rows = r.GetDims();
    resp.send_metas = r.Get<uint8_t>() != 0;
    if (resp.send_metas) {
      resp.metas.resize(resp.names.size());
      for (auto& m : resp.metas) m = GetMeta(r);
    }
  }
  return list;
}

void Coordinator::Add(int rank, TensorMeta meta, std::vector<Response>* out,
                      Clock::time_point now) {
  if (!waiting_by_id_.empty()) {
    if (meta.collective == Collective::kJoin) {
      // Joined ranks count as present: the table decides from now on.
      while (!waiting_by_id_.empty()) MoveToTable(waiting_by_id_.back());
    } else {
      auto it = cache_ids_.find(meta.name);
      if (it != cache_ids_.end() && by_id_[it->second].count > 0) MoveToTable(it->second);
    }
  }
  Record(rank, std::move(meta), false, out, now);
}

void Coordinator::AddCached(int rank, int32_t id, std::vector<Response>* out,
                            Clock::time_point now) {
  KR_CHECK(id >= 0 && size_t(id) < cache_.size(),
           "rank " + std::to_string(rank) + " sent unknown cache id " + std::to_string(id));
  const Cached& cached = cache_[id];
  const Collective c = cached.metas[0].collective;
  const bool fast = (c == Collective::kAllreduce || c == Collective::kBroadcast ||
                     c == Collective::kReducescatter) &&
                    (table_.empty() || !table_.count(cached.name)) && !AnyJoined();
  if (!fast) {
    Record(rank, cached.metas[rank], true, out, now);
    return;
  }
  ById& w = by_id_[id];
  if (w.count == 0) {
    w.present.assign(size_, false);
    w.first_seen = now;
    w.slot = waiting_by_id_.size();
    waiting_by_id_.push_back(id);
  }
  KR_CHECK(!w.present[rank], "rank " + std::to_string(rank) + " sent tensor '" + cached.name +
                                 "' twice before it completed");
  w.present[rank] = true;
  if (++w.count < size_) return;
  StopWaitingById(id);
  // What the table would decide for a name every rank sent by id.
  Response resp;
  resp.names = {cached.name};
  resp.metas = {cached.metas[0]};
  resp.cache_ids = {id};
  resp.cached = true;
  resp.bytes = Bytes(cached.metas[0]);
  out->push_back(std::move(resp));
}

void Coordinator::StopWaitingById(int32_t id) {
  ById& w = by_id_[id];
  w.count = 0;
  waiting_by_id_[w.slot] = waiting_by_id_.back();
  by_id_[waiting_by_id_[w.slot]].slot = w.slot;
  waiting_by_id_.pop_back();
}

void Coordinator::MoveToTable(int32_t id) {
  const ById& w = by_id_[id];
  Entry& e = table_[cache_[id].name];
  e.metas.resize(size_);
  e.present = w.present;
  e.count = e.by_id = w.count;
  e.first_seen = w.first_seen;
  for (int r = 0; r < size_; ++r) {
    if (w.present[r]) e.metas[r] = cache_[id].metas[r];
  }
  StopWaitingById(id);
}

void Coordinator::MoveToTableIfWaited(Clock::time_point now, Clock::duration after) {
  for (int32_t id : waiting_by_id_) {
    if (now - by_id_[id].first_seen < after) continue;
    while (!waiting_by_id_.empty()) MoveToTable(waiting_by_id_.back());
    return;
  }
}

bool Coordinator::JoinedTakePart(Collective c) {
  // Not join itself, nor adding or removing a process set: every rank must
  // call those.
  return c != Collective::kJoin && c != Collective::kAddProcessSet &&
         c != Collective::kRemoveProcessSet;
}

bool Coordinator::Complete(const Entry& e) const {
  const Collective c = e.first().collective;
  // Joined ranks count as present, except for join itself; a collective they
  // cannot take part in then fails (Disagreement) rather than waits forever.
  for (int r = 0; r < size_; ++r) {
    if (!e.present[r] && !(joined_[r] && c != Collective::kJoin)) return false;
  }
  return true;
}

void Coordinator::Record(int rank, TensorMeta meta, bool by_id, std::vector<Response>* out,
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
  const std::string name = meta.name;
  const bool join = meta.collective == Collective::kJoin;
  e.metas[rank] = std::move(meta);
  e.present[rank] = true;
  ++e.count;
  e.by_id += by_id;
  if (join) {
    joined_[rank] = true;
    last_joined_ = rank;
  }
  if (Complete(e)) Finish(name, out);
  if (!join) return;
  // Names that waited only for this rank can go now (in name order, so that
  // the decision does not depend on the hash table's).
  std::vector<std::string> ready;
  for (const auto& [other, entry] : table_) {
    if (Complete(entry)) ready.push_back(other);
  }
  std::sort(ready.begin(), ready.end());
  for (const std::string& other : ready) Finish(other, out);
}

void Coordinator::Finish(const std::string& name, std::vector<Response>* out) {
  Entry& e = table_[name];
  const TensorMeta& first = e.first();
  Response resp;
  resp.names = {name};
  resp.metas = {first};
  resp.cache_ids = {-1};
  resp.bytes = Bytes(first);
  const bool everyone = e.count == size_;
  resp.send_metas = !everyone;
  // Every rank sent it by id: the descriptions were agreed when cached.
  if (e.by_id != size_) {
    resp.error = InvalidOnSomeRank(name, e);
    if (!resp.error.empty()) {
      resp.status = KR_INVALID_ARGUMENT;
    } else if (!(resp.error = Disagreement(name, e)).empty()) {
      resp.status = KR_FAILED_PRECONDITION;
    }
  }
  if (!resp.error.empty()) {
    if (first.collective == Collective::kJoin) {  // the join failed: nobody is joined
      std::fill(joined_.begin(), joined_.end(), false);
    }
  } else if (first.collective == Collective::kJoin) {
    resp.rows = {last_joined_};
    std::fill(joined_.begin(), joined_.end(), false);
  } else {
    if (first.collective == Collective::kAllgather) {
      for (int r = 0; r < size_; ++r) resp.rows.push_back(e.present[r] ? e.metas[r].shape[0] : 0);
    }
    if (first.collective == Collective::kAlltoall) {
      for (const auto& m : e.metas) {
        for (int to = 0; to < size_; ++to) {
          // The engine checked the splits against the first dimension on submission.
          resp.rows.push_back(m.splits.empty() ? m.shape[0] / size_ : m.splits[to]);
        }
      }
    }
    // Cache what every rank submitted, on its second agreement, while there
    // is room; renew a changed entry in place.
    auto it = cache_ids_.find(name);
    const bool renew = it != cache_ids_.end();
    if (e.by_id == size_) {
      resp.cache_ids = {it->second};
      resp.cached = true;
    } else if (everyone && !renew && cache_.size() < cache_capacity_ &&
               seen_once_.insert(name).second) {
      // First agreement: remembered, not cached. The set is bounded: a job
      // that agrees ever new names forgets them in batches.
      if (seen_once_.size() > 4 * cache_capacity_) seen_once_ = {name};
    } else if (everyone && (renew || cache_.size() < cache_capacity_)) {
      seen_once_.erase(name);
      if (!renew) {
        it = cache_ids_.emplace(name, static_cast<int32_t>(cache_.size())).first;
        cache_.emplace_back();
        by_id_.emplace_back();
      }
      cache_[it->second] = {name, e.metas};
      resp.cache_ids = {it->second};
    }
  }
  out->push_back(std::move(resp));
  table_.erase(name);
}

std::string Coordinator::InvalidOnSomeRank(const std::string& name, const Entry& e) const {
  // Built only when there is something to say: this runs for every new name.
  std::string invalid;
  for (int r = 0; r < size_; ++r) {
    if (!e.present[r] || e.metas[r].error.empty()) continue;
    invalid += (invalid.empty() ? "keras-ring: " + label_ + "tensor '" + name + "' is invalid on "
                                : std::string("; ")) +
               "rank " + std::to_string(WorldRank(r)) + ": " + e.metas[r].error;
  }
  return invalid;
}

std::string Coordinator::Disagreement(const std::string& name, const Entry& e) const {
  int first_rank = std::find(e.present.begin(), e.present.end(), true) - e.present.begin();
  const TensorMeta& first = e.metas[first_rank];
  bool group = false;
  for (int r = 0; r < size_; ++r) group = group || (e.present[r] && e.metas[r].members);
  bool agree = true;
  if (group) {
    std::string why = GroupDisagreement(name, e);
    if (!why.empty()) return why;
  }
  for (int r = first_rank + 1; r < size_ && agree && !group; ++r) {  // groups: compared above
    if (!e.present[r]) continue;
    const TensorMeta& m = e.metas[r];
    agree = m.collective == first.collective && m.dtype == first.dtype;
    if (!agree) break;
    switch (first.collective) {
      case Collective::kAllreduce:
      case Collective::kReducescatter:
        agree = m.shape == first.shape && SameReduction(m, first);
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
      case Collective::kJoin:
        break;
      case Collective::kAddProcessSet:
      case Collective::kRemoveProcessSet:
        agree = m.splits == first.splits;
        break;
    }
  }
  if (!agree) {
    std::ostringstream s;
    s << "keras-ring: " << label_ << "ranks disagree on tensor '" << name << "':";
    for (int r = 0; r < size_; ++r) {
      s << (r ? ";" : "") << " rank " << WorldRank(r) << " sent "
        << (e.present[r] ? e.metas[r].Describe() : std::string("nothing (joined)"));
    }
    return s.str();
  }
  if (e.count == size_ || first.collective == Collective::kJoin) return "";
  // Joined ranks take part with zeros, which only sums and gathers absorb.
  std::string why;
  auto linear = [](ReduceOp o) { return o == ReduceOp::kSum || o == ReduceOp::kAverage; };
  const TensorMeta* culprit = &first;  // of a group: the first member that cannot run
  if (first.members) {
    for (const TensorMeta& m : *first.members) {
      culprit = &m;
      if (!linear(m.op)) break;
    }
  }
  if ((first.collective == Collective::kAllreduce ||
       first.collective == Collective::kReducescatter) && !linear(culprit->op)) {
    why = std::string("op=") + ReduceOpName(culprit->op) + " cannot take zeros from joined ranks";
  } else if (first.collective == Collective::kBroadcast && !e.present[first.root_rank]) {
    why = "its root rank has joined";
  } else if (first.collective == Collective::kAlltoall) {
    why = "alltoall does not support joined ranks";
  } else if (!JoinedTakePart(first.collective)) {
    why = "every rank must call it";
  }
  if (why.empty()) return "";
  std::ostringstream s;
  s << "keras-ring: " << label_ << "tensor '" << culprit->name << "'"
    << (culprit != &first ? " of group '" + name + "'" : "") << " (" << culprit->Describe()
    << ") cannot run while ranks [" << RankList(e.present, false) << "] have joined: " << why;
  return s.str();
}

std::string Coordinator::GroupDisagreement(const std::string& name, const Entry& e) const {
  const int first_rank = std::find(e.present.begin(), e.present.end(), true) - e.present.begin();
  // Member i of rank r's group; null past its end, or if r sent a lone tensor of this name.
  auto member = [&](int r, size_t i) -> const TensorMeta* {
    const auto& members = e.metas[r].members;
    return members && i < members->size() ? &(*members)[i] : nullptr;
  };
  auto agree = [](const TensorMeta* a, const TensorMeta* b) {
    return a && b && a->name == b->name && a->collective == b->collective && a->dtype == b->dtype &&
           a->shape == b->shape && SameReduction(*a, *b);
  };
  size_t most = 1;  // at least the first member: a lone tensor differs there
  for (int r = 0; r < size_; ++r) {
    if (e.present[r] && e.metas[r].members) most = std::max(most, e.metas[r].members->size());
  }
  for (size_t i = 0; i < most; ++i) {
    bool same = true;
    for (int r = 0; r < size_ && same; ++r) {
      same = !e.present[r] || agree(member(first_rank, i), member(r, i));
    }
    if (same) continue;
    std::ostringstream s;
    s << "keras-ring: " << label_ << "ranks disagree on tensor " << i << " of group '" << name
      << "':";
    for (int r = 0; r < size_; ++r) {
      s << (r ? ";" : "") << " rank " << WorldRank(r) << " sent ";
      const TensorMeta& m = e.metas[r];
      if (!e.present[r]) {
        s << "nothing (joined)";
      } else if (!m.members) {
        s << "a lone tensor, not a group (" << m.Describe() << ")";
      } else if (const TensorMeta* mine = member(r, i)) {
        s << "'" << mine->name << "', " << mine->Describe();
      } else {
        s << "a group of " << m.members->size() << " tensors";
      }
    }
    return s.str();
  }
  return "";
}

std::string Coordinator::RankList(const std::vector<bool>& which, bool value) const {
  std::ostringstream s;
  for (int r = 0; r < size_; ++r) {
    if (which[r] == value) s << (s.tellp() > 0 ? ", " : "") << WorldRank(r);
  }
  return s.str();
}

std::pair<std::string, std::string> Coordinator::StallRanks(const Entry& e) const {
  // Joined ranks are not waited for, where they take part unasked.
  std::vector<bool> counted = e.present;
  for (int r = 0; r < size_; ++r) {
    counted[r] = counted[r] || (joined_[r] && JoinedTakePart(e.first().collective));
  }
  return {RankList(e.present, true), RankList(counted, false)};
}

std::string Coordinator::Stall(const std::string& name, const Entry& e,
                               Clock::time_point now) const {
  auto seconds = std::chrono::duration_cast<std::chrono::seconds>(now - e.first_seen).count();
  const auto [waiting, missing] = StallRanks(e);
  std::ostringstream s;
  s << label_ << "ranks [" << waiting << "] have been waiting " << seconds << " s for ranks ["
    << missing << "] to submit tensor '" << name << "' (" << e.first().Describe() << ")";
  return s.str();
}

std::vector<std::string> Coordinator::StallReports(Clock::time_point now,
                                                   Clock::duration report_after) {
  // Waiting in a join is not a stall: the ranks with data are still working.
  MoveToTableIfWaited(now, report_after / 2);
  auto stalled = [&](const Entry& e, Clock::duration after) {
    return !e.reported && now - e.first_seen >= after &&
           e.first().collective != Collective::kJoin;
  };
  bool due = false;
  for (const auto& entry : table_) due = due || stalled(entry.second, report_after);
  if (!due) return {};
  // The tensors of one step arrive together: those already waiting half as
  // long go into the same report, grouped by who waits for whom, so that a
  // stalled step reads as one report instead of one line per tensor.
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> groups;
  for (auto& [name, e] : table_) {
    if (!stalled(e, report_after / 2)) continue;
    e.reported = true;
    groups[StallRanks(e)].push_back(name);
  }
  constexpr size_t kListed = 5;
  std::vector<std::string> reports;
  for (auto& [ranks, names] : groups) {
    std::sort(names.begin(), names.end());
    if (names.size() == 1) {
      reports.push_back(Stall(names[0], table_[names[0]], now));
      continue;
    }
    Clock::duration longest{};
    for (const auto& name : names) longest = std::max(longest, now - table_[name].first_seen);
    std::ostringstream s;
    s << label_ << "ranks [" << ranks.first << "] have been waiting up to "
      << std::chrono::duration_cast<std::chrono::seconds>(longest).count() << " s for ranks ["
      << ranks.second << "] to submit " << names.size() << " tensors: ";
    for (size_t i = 0; i < names.size() && i < kListed; ++i) {
      s << (i ? ", '" : "'") << names[i] << "' (" << table_[names[i]].first().Describe() << ")";
    }
    if (names.size() > kListed) s << " and " << names.size() - kListed << " more";
    reports.push_back(s.str());
  }
  return reports;
}

void Coordinator::FailStalled(Clock::time_point now, Clock::duration fail_after,
                              std::vector<Response>* out) {
  MoveToTableIfWaited(now, fail_after);
  std::vector<std::string> stalled;
  for (const auto& [name, e] : table_) {
    if (now - e.first_seen >= fail_after && e.first().collective != Collective::kJoin) {
      stalled.push_back(name);
    }
  }
  std::sort(stalled.begin(), stalled.end());
  for (const std::string& name : stalled) {
    Response resp;
    resp.names = {name};
    resp.cache_ids = {-1};
    resp.error = "keras-ring: stalled: " + Stall(name, table_[name], now) +
                 "; giving up after KERAS_RING_STALL_SHUTDOWN_TIME seconds. A rank that skips a "
                 "collective or runs a different number of steps (in model.fit: data of "
                 "unknown length that gives the ranks different numbers of batches) leaves "
                 "the others waiting.";
    resp.status = KR_ABORTED;
    // Only the requests the table holds fail: a missing rank may submit the
    // name (or have it on its way here) before the error reaches it, and
    // that request starts a new entry here, so it must stay pending there.
    const Entry& e = table_[name];
    for (int r = 0; r < size_; ++r) resp.rows.push_back(e.present[r] ? 1 : 0);
    out->push_back(std::move(resp));
    table_.erase(name);
  }
}

std::map<int, std::string> Coordinator::Overdue(Clock::time_point now, Clock::duration after) {
  MoveToTableIfWaited(now, after);
  std::map<int, std::pair<Clock::time_point, std::string>> oldest;  // by world rank
  for (const auto& [name, e] : table_) {
    if (now - e.first_seen < after || e.first().collective == Collective::kJoin) continue;
    for (int r = 0; r < size_; ++r) {
      if (e.present[r] || (joined_[r] && JoinedTakePart(e.first().collective))) continue;
      auto it = oldest.find(WorldRank(r));
      if (it == oldest.end() || e.first_seen < it->second.first) {
        oldest[WorldRank(r)] = {e.first_seen, Stall(name, e, now)};
      }
    }
  }
  std::map<int, std::string> out;
  for (auto& [rank, found] : oldest) out[rank] = std::move(found.second);
  return out;
}

void Coordinator::RequestShutdown(int rank, const std::string& reason) {
  shutdown_[rank] = true;
  if (first_shutdown_ < 0) {
    first_shutdown_ = rank;
    shutdown_reason_ = reason;
  }
}

std::vector<int> Coordinator::NotShutDown() const {
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r) {
    if (!shutdown_[r]) ranks.push_back(WorldRank(r));
  }
  return ranks;
}

}  // namespace keras_ring
