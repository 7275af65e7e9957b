// The timeline: what the engine does, per tensor, as Chrome trace events
// (chrome://tracing and https://ui.perfetto.dev open the file).
//
// Each rank writes its own file (keras_ring.timeline merges them): process id
// = rank, one thread row per tensor name. The file is the trace format's JSON
// array, written incrementally: every event goes out as one line that starts
// with the separator, so that the file is always "[" followed by whole
// events; the closing "]" is written when recording stops. The format
// declares that bracket optional, for traces cut short, so a file whose
// process was killed still opens (and keras_ring.timeline reads it).
//
// The engine thread only records events into memory (a few tens of
// nanoseconds each); a thread of its own formats and writes them in batches,
// so the engine never waits for formatting or for the disk.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace keras_ring {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  ~Timeline() { Stop(); }

  // Starts recording into `path` (truncated). False, with the reason in
  // *error, if it is already recording or the file cannot be created.
  bool Start(const std::string& path, int rank, bool mark_cycles, std::string* error);
  // Writes what is buffered, closes the array and the file. No-op when off.
  void Stop();
  // The engine's guard around every event: one relaxed load.
  bool on() const { return on_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_.load(std::memory_order_relaxed); }
  // The time, read only while recording (else a zero time point).
  Clock::time_point Now() const { return on() ? Clock::now() : Clock::time_point(); }

  // Shared by the events of a fused collective, formatted once.
  using Args = std::shared_ptr<const std::string>;
  class RowEvents;
  // The row of `tensor` in process set `set` (created on first use), held
  // locked for a few events: one lookup, one lock. Call from one thread (the
  // engine's).
  RowEvents Row(int32_t set, const std::string& tensor);
  // A mark across this rank's rows (an engine cycle).
  void Mark(const char* name, Clock::time_point at, Args args);

  // The JSON string literal for `text` (quotes included).
  static std::string Quote(const std::string& text);

 private:
  struct RowState {
    int id;
    Clock::time_point free_from;  // end of the last top-level span
    int open = 0;                 // Begin without End yet
  };
  // An event as recorded; `name` points to a string literal. ph 'M' names
  // row `row` (args holds the name).
  struct Event {
    char ph;
    const char* name;
    int row;
    Clock::time_point ts;
    Clock::duration dur;
    Args args;  // ph 'M': the row's name
  };
  RowState* RowOf(int32_t set, const std::string& tensor);  // mu_ held; null when stopped
  void Record(Event event);                             // mu_ held
  void Format(const Event& e, std::string* out) const;
  void WriteLoop();

  std::atomic<bool> on_{false};
  std::atomic<bool> mark_cycles_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Event> events_;  // recorded, not yet written
  bool stopping_ = false;
  int fd_ = -1;
  int rank_ = 0;
  std::string host_;
  // Timestamps are microseconds of the system clock since 2025-01-01 UTC, so
  // that the files of different hosts line up (as well as their clocks
  // agree) and stay small enough for a double to hold nanoseconds; measured
  // on the steady clock from this offset so that they never go backwards.
  std::chrono::microseconds epoch_offset_{};
  std::unordered_map<int32_t, std::unordered_map<std::string, RowState>> rows_;
  int next_row_ = 1;
  std::thread writer_;
};

class Timeline::RowEvents {
 public:
  // `name` must outlive the recording (a string literal). Spans on a row
  // never overlap the row's previous top-level span: one that would start
  // before it ended starts there.
  void Begin(const char* name, Clock::time_point at, Args args = nullptr);
  void End(Clock::time_point at);
  // A complete span nested inside the row's open span.
  void Nested(const char* name, Clock::time_point start, Clock::time_point end);

 private:
  friend class Timeline;
  RowEvents(Timeline* timeline, std::unique_lock<std::mutex> lock, RowState* row)
      : timeline_(timeline), lock_(std::move(lock)), row_(row) {}
  Timeline* timeline_;
  std::unique_lock<std::mutex> lock_;
  RowState* row_;  // null: not recording
};

}  // namespace keras_ring
