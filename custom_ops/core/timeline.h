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
// Events are formatted by the engine thread into a memory buffer and written
// by a thread of their own in batches, so the engine never waits for the disk.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

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

  // A span on the tensor's row. Spans of one row never overlap: a span that
  // would start before the row's previous top-level span ended starts there.
  void Begin(const std::string& tensor, const char* name, Clock::time_point at,
             const std::string& args = "");
  void End(const std::string& tensor, Clock::time_point at);
  // A complete span nested inside the row's open span.
  void Nested(const std::string& tensor, const char* name, Clock::time_point start,
              Clock::time_point end);
  // A mark across this rank's rows (an engine cycle).
  void Mark(const char* name, Clock::time_point at, const std::string& args);

  // The JSON string literal for `text` (quotes included).
  static std::string Quote(const std::string& text);

 private:
  struct Row {
    int id;
    Clock::time_point free_from;  // end of the last top-level span
    int open = 0;                 // Begin without End yet
  };
  Row& RowOf(const std::string& tensor);  // mu_ held
  void Append(const std::string& event);  // mu_ held
  std::string Ts(Clock::time_point at) const;
  void WriteLoop();

  std::atomic<bool> on_{false};
  std::atomic<bool> mark_cycles_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  std::string buffer_;  // whole events not yet written
  bool stopping_ = false;
  bool first_event_ = true;
  int fd_ = -1;
  int rank_ = 0;
  // Timestamps are microseconds of the system clock since 2025-01-01 UTC, so
  // that the files of different hosts line up (as well as their clocks
  // agree) and stay small enough for a double to hold nanoseconds; measured
  // on the steady clock from this offset so that they never go backwards.
  std::chrono::microseconds epoch_offset_{};
  std::unordered_map<std::string, Row> rows_;
  std::thread writer_;
};

}  // namespace keras_ring
