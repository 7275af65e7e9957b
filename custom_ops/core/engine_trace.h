// The engine's events as timeline spans: per tensor row, NEGOTIATE from
// submission to the response's arrival, then the collective's span (QUEUE,
// its phases, DONE nested in it), and a CYCLE mark per busy pass if asked.
#pragma once

#include "observer.h"
#include "timeline.h"

namespace keras_ring {

class EngineTrace : public Observer {
 public:
  explicit EngineTrace(Timeline& timeline) : timeline_(timeline) {}

  bool timed() const override { return timeline_.on(); }
  void Negotiating(const Request& req, bool by_id) override;
  void Cycle(size_t submitted, size_t responses) override;
  void Running(const ProcessSet& set, const std::vector<Request>& requests,
               const std::vector<size_t>& ends, const Response& resp, Clock::time_point arrived,
               Clock::time_point started) override;
  void Ran(const Request* begin, const Request* end, Path path,
           std::initializer_list<Phase> phases) override;
  void Completed(const Request& req, Clock::time_point start, Clock::time_point end) override;

 private:
  Timeline& timeline_;
};

}  // namespace keras_ring
