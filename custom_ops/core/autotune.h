// Autotuning: the engine's performance settings chosen from measured
// throughput during the first steps of training (KERAS_RING_AUTOTUNE=1).
//
// Only the coordinator tunes. After each response list it has run, it tells
// the Autotuner which tensors ran and how many bytes they moved. Training
// repeats the same tensor names every step, so the tuner counts steps by
// names coming back: a sample ends when some name has been seen
// `steps_per_sample` times, and its score is the bytes moved divided by the
// time it took (bytes per step are fixed, so that is steps per second).
//
// The search is coordinate descent over a few candidates for each setting:
// the first `warmup_samples` samples are dropped (tracing, allocation, the
// response cache filling), then each setting in turn is tried at each of its
// candidates with the others held at their best so far, each trial scored by
// the median of `samples_per_trial` samples; a candidate replaces the best
// one only if it beats it by more than `margin` (noise must not move us off
// the starting point for nothing). The starting values are always among the
// candidates. Trials run one after another, so a machine whose speed drifts
// can make a later trial win for nothing: when a setting's best value is not
// the one it had, the two are compared once more in alternating samples, and
// the new value is kept only if it still wins by the margin. When every
// setting has been tried the chosen values stay for the rest of the run.
//
// The engine sends every change to all ranks in its next response list, and
// each rank applies it before running that list, so the settings that every
// rank must share (segment size, algorithm crossover) change at the same point
// everywhere. The tuner itself knows nothing of MPI or the engine.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace keras_ring {

struct TunedParams {
  uint64_t fusion_threshold = 0;       // bytes
  double cycle_time_ms = 0;            // how long agreed tensors may wait for more
  uint64_t segment_bytes = 0;          // pipelining granularity; 0: the engine's choice
  uint64_t small_allreduce_bytes = 0;  // up to this size: the latency-optimal algorithm
  bool operator==(const TunedParams& o) const {
    return fusion_threshold == o.fusion_threshold && cycle_time_ms == o.cycle_time_ms &&
           segment_bytes == o.segment_bytes && small_allreduce_bytes == o.small_allreduce_bytes;
  }
  bool operator!=(const TunedParams& o) const { return !(*this == o); }
  std::string Describe() const;
};

struct AutotuneOptions {
  int warmup_samples = 3;
  int steps_per_sample = 10;
  int samples_per_trial = 3;
  double margin = 0.02;
  std::string log_path;  // CSV, one row per sample; empty: no log
  // Settings that cannot matter for this job are left alone (for example the
  // crossover when every allreduce goes through shared memory).
  bool tune_segment = true;
  bool tune_small_allreduce = true;
};

class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws EngineError if the log cannot be opened.
  Autotuner(const TunedParams& initial, const AutotuneOptions& options);

  // After a response list has run: the names of the tensors that ran (names
  // may repeat) and the bytes they moved. Returns true when params() changed:
  // the engine must pass the new values on.
  bool Observe(const std::vector<const std::string*>& names, uint64_t bytes, Clock::time_point now);

  const TunedParams& params() const { return params_; }
  bool done() const { return done_; }
  // The trials so far: which setting, which value, the median score.
  struct Trial {
    std::string setting;
    TunedParams params;
    double bytes_per_second = 0;
  };
  const std::vector<Trial>& trials() const { return trials_; }

 private:
  void StartDimension();
  bool NextDimension();  // false when every setting has been tried
  void EndTrial();
  void Confirm(double score);
  void EndDimension();
  void Finish();
  void WriteRow(const char* phase, double seconds, uint64_t bytes, double score);

  AutotuneOptions options_;
  TunedParams params_, best_;
  double best_score_ = 0;
  std::vector<const char*> order_;  // names of the settings to tune, in order
  size_t dimension_ = 0;            // index into order_
  std::vector<TunedParams> candidates_;
  size_t candidate_ = 0;
  std::vector<double> scores_;  // of the current trial's samples
  int warmup_left_ = 0;
  bool confirming_ = false;
  std::vector<double> confirm_best_, confirm_incumbent_;
  bool done_ = false;

  std::unordered_map<std::string, int> seen_;  // names in the current sample
  uint64_t bytes_ = 0;
  Clock::time_point started_{};
  int sample_index_ = 0;
  std::vector<Trial> trials_;
  std::ofstream log_;
};

}  // namespace keras_ring
