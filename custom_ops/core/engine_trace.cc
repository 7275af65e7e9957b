#include "engine_trace.h"

#include <memory>
#include <string>

namespace keras_ring {

void EngineTrace::Negotiating(const Request& req, bool) {
  if (!timeline_.on()) return;
  const bool since_submission = req.submitted != Clock::time_point();
  const auto begin = since_submission ? req.submitted : Clock::now();
  // A group's members have a row each, as they would alone.
  if (!req.group) timeline_.Row(req.process_set, req.meta.name).Begin("NEGOTIATE", begin);
  for (const Request& member : req.members) {
    timeline_.Row(req.process_set, member.meta.name).Begin("NEGOTIATE", begin);
  }
}

void EngineTrace::Cycle(size_t submitted, size_t responses) {
  if (!timeline_.mark_cycles()) return;
  timeline_.Mark("CYCLE", Clock::now(),
                 std::make_shared<const std::string>("\"submitted\":" + std::to_string(submitted) +
                                                     ",\"responses\":" +
                                                     std::to_string(responses)));
}

void EngineTrace::Running(const ProcessSet& set, const std::vector<Request>& requests,
                          const std::vector<size_t>& ends, const Response& resp,
                          Clock::time_point arrived, Clock::time_point started) {
  if (!timeline_.on()) return;
  if (arrived == Clock::time_point()) arrived = started;
  const char* span = CollectiveName(requests[0].meta.collective);  // written in capitals
  for (size_t k = 0, begin = 0; k < ends.size(); begin = ends[k++]) {
    size_t bytes = 0;
    for (size_t i = begin; i < ends[k]; ++i) bytes += Bytes(requests[i].meta);
    // Every member counts the set's collectives alike: tensors with the
    // same group ran fused, on every rank.
    const auto args = std::make_shared<const std::string>(
        "\"group\":" + std::to_string(set.collectives_run + k) + ",\"tensors\":" +
        std::to_string(ends[k] - begin) + ",\"bytes\":" + std::to_string(bytes) +
        (resp.error.empty() ? "" : ",\"error\":" + Timeline::Quote(resp.error)));
    for (size_t i = begin; i < ends[k]; ++i) {
      auto row = timeline_.Row(requests[i].process_set, requests[i].meta.name);
      row.End(arrived);  // NEGOTIATE
      row.Begin(span, arrived, args);
      row.Nested("QUEUE", arrived, started);
    }
  }
}

void EngineTrace::Ran(const Request* begin, const Request* end, Path,
                      std::initializer_list<Phase> phases) {
  if (!timeline_.on() || phases.begin()->start == Clock::time_point()) return;
  for (const Request* req = begin; req != end; ++req) {
    auto row = timeline_.Row(req->process_set, req->meta.name);
    for (const Phase& p : phases) row.Nested(p.name, p.start, p.end);
  }
}

void EngineTrace::Completed(const Request& req, Clock::time_point start, Clock::time_point end) {
  if (!timeline_.on() || start == Clock::time_point()) return;
  auto row = timeline_.Row(req.process_set, req.meta.name);
  row.Nested("DONE", start, end);
  row.End(end);
}

}  // namespace keras_ring
