// What the engine's data path reports as it goes, to what watches it: the
// timeline (EngineTrace) and the counts kr_stats reports (Stats). The data
// path knows only this interface, and reads the clock only for an observer
// that wants times.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "negotiation.h"
#include "process_set.h"
#include "request.h"

namespace keras_ring {

class Observer {
 public:
  using Clock = std::chrono::steady_clock;
  // The way a collective went.
  enum class Path { kNetwork, kSharedMemory, kHierarchical };
  struct Phase {
    const char* name;
    Clock::time_point start, end;  // zero when no times were taken
  };

  virtual ~Observer() = default;
  // Whether it wants the times the events carry.
  virtual bool timed() const { return false; }
  // A request (a group: each member) went to agreement, `by_id`: as its cache id.
  virtual void Negotiating(const Request& /*req*/, bool /*by_id*/) {}
  // A pass of the loop did something: it admitted `submitted` requests and
  // received `responses`.
  virtual void Cycle(size_t /*submitted*/, size_t /*responses*/) {}
  // The requests of one response of `set` start their collectives (cut at
  // `ends`, see PlanAllreduces); its list arrived at `arrived`.
  virtual void Running(const ProcessSet& /*set*/, const std::vector<Request>& /*requests*/,
                       const std::vector<size_t>& /*ends*/, const Response& /*resp*/,
                       Clock::time_point /*arrived*/, Clock::time_point /*started*/) {}
  // One collective over the requests [begin, end) ran, through `phases`.
  virtual void Ran(const Request* /*begin*/, const Request* /*end*/, Path /*path*/,
                   std::initializer_list<Phase> /*phases*/) {}
  // The request's callback ran from `start` to `end`.
  virtual void Completed(const Request& /*req*/, Clock::time_point /*start*/,
                         Clock::time_point /*end*/) {}
};

// Passes every event on to each of its observers.
class Observers : public Observer {
 public:
  explicit Observers(std::vector<Observer*> observers) : observers_(std::move(observers)) {}
  // The time if some observer wants it, else a zero time point.
  Clock::time_point Now() const { return timed() ? Clock::now() : Clock::time_point(); }

  bool timed() const override {
    for (const Observer* o : observers_) {
      if (o->timed()) return true;
    }
    return false;
  }
  void Negotiating(const Request& req, bool by_id) override {
    for (Observer* o : observers_) o->Negotiating(req, by_id);
  }
  void Cycle(size_t submitted, size_t responses) override {
    for (Observer* o : observers_) o->Cycle(submitted, responses);
  }
  void Running(const ProcessSet& set, const std::vector<Request>& requests,
               const std::vector<size_t>& ends, const Response& resp, Clock::time_point arrived,
               Clock::time_point started) override {
    for (Observer* o : observers_) o->Running(set, requests, ends, resp, arrived, started);
  }
  void Ran(const Request* begin, const Request* end, Path path,
           std::initializer_list<Phase> phases) override {
    for (Observer* o : observers_) o->Ran(begin, end, path, phases);
  }
  void Completed(const Request& req, Clock::time_point start, Clock::time_point end) override {
    for (Observer* o : observers_) o->Completed(req, start, end);
  }

 private:
  std::vector<Observer*> observers_;
};

// The counts kr_stats reports; framework threads read them while the loop counts.
class Stats : public Observer {
 public:
  std::atomic<uint64_t> collectives{0}, tensors{0}, fused_tensors{0}, cached_tensors{0},
      shm_collectives{0}, hierarchical_collectives{0};

  void Negotiating(const Request& req, bool by_id) override {
    if (by_id) cached_tensors += req.group ? req.members.size() : 1;
  }
  void Ran(const Request* begin, const Request* end, Path path,
           std::initializer_list<Phase>) override {
    const size_t n = end - begin;
    collectives += 1;
    tensors += n;
    if (n > 1) fused_tensors += n;
    if (path != Path::kNetwork) shm_collectives += 1;
    if (path == Path::kHierarchical) hierarchical_collectives += 1;
  }
};

}  // namespace keras_ring
