#include "autotune.h"

#include <algorithm>
#include <cstdio>

#include "common.h"

namespace keras_ring {

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;

// The candidates of each setting besides its current value: a spread wide
// enough to contain the defaults of Horovod and keras-ring and the values
// that the benchmarks found best on one host and across hosts.
std::vector<TunedParams> Candidates(const char* setting, const TunedParams& best) {
  std::vector<TunedParams> out{best};  // the incumbent first: measured again
  auto add = [&](auto field, auto value) {
    TunedParams p = best;
    p.*field = value;
    for (const TunedParams& q : out) {
      if (q == p) return;
    }
    out.push_back(p);
  };
  const std::string s = setting;
  if (s == "fusion_threshold") {
    for (uint64_t v : {uint64_t(0), 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB}) {
      add(&TunedParams::fusion_threshold, v);
    }
  } else if (s == "cycle_time_ms") {
    for (double v : {0.0, 0.5, 1.0, 2.5, 5.0}) add(&TunedParams::cycle_time_ms, v);
  } else if (s == "segment_bytes") {
    for (uint64_t v : {64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB}) add(&TunedParams::segment_bytes, v);
  } else {
    for (uint64_t v : {uint64_t(0), 16 * KiB, 64 * KiB, 256 * KiB}) {
      add(&TunedParams::small_allreduce_bytes, v);
    }
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::string TunedParams::Describe() const {
  char text[200];
  std::snprintf(text, sizeof text,
                "fusion threshold %llu bytes, cycle time %g ms, segment %s, small allreduce up "
                "to %llu bytes",
                static_cast<unsigned long long>(fusion_threshold), cycle_time_ms,
                segment_bytes ? (std::to_string(segment_bytes) + " bytes").c_str()
                              : "chosen by the engine",
                static_cast<unsigned long long>(small_allreduce_bytes));
  return text;
}

Autotuner::Autotuner(const TunedParams& initial, const AutotuneOptions& options)
    : options_(options),
      params_(initial),
      best_(initial),
      warmup_left_(options.warmup_samples) {
  KR_CHECK(options_.steps_per_sample > 0 && options_.samples_per_trial > 0,
           "autotune: steps per sample and samples per trial must be positive");
  order_ = {"fusion_threshold", "cycle_time_ms"};
  if (options_.tune_segment) order_.push_back("segment_bytes");
  if (options_.tune_small_allreduce) order_.push_back("small_allreduce_bytes");
  if (!options_.log_path.empty()) {
    log_.open(options_.log_path, std::ios::out | std::ios::trunc);
    KR_CHECK(log_.good(), "autotune: cannot write the log '" + options_.log_path + "'");
    log_ << "sample,phase,setting,fusion_threshold_bytes,cycle_time_ms,segment_bytes,"
            "small_allreduce_bytes,seconds,bytes,bytes_per_second\n";
    log_.flush();
  }
  StartDimension();
}

bool Autotuner::NextDimension() {
  while (++dimension_ < order_.size()) {
    // The cycle time holds tensors back only for fusion: without fusion it
    // cannot matter.
    if (order_[dimension_] == std::string("cycle_time_ms") && best_.fusion_threshold == 0) {
      continue;
    }
    StartDimension();
    return true;
  }
  return false;
}

void Autotuner::StartDimension() {
  candidates_ = Candidates(order_[dimension_], best_);
  candidate_ = 0;
  params_ = candidates_[0];
}

bool Autotuner::Observe(const std::vector<const std::string*>& names, uint64_t bytes,
                        Clock::time_point now) {
  if (done_) return false;
  if (started_ == Clock::time_point()) {  // the first list: its start is unknown
    started_ = now;
    return false;
  }
  bytes_ += bytes;
  bool sample_over = false;
  for (const std::string* name : names) {
    if (++seen_[*name] >= options_.steps_per_sample) sample_over = true;
  }
  if (!sample_over) return false;
  const double seconds = std::chrono::duration<double>(now - started_).count();
  const double score = seconds > 0 ? bytes_ / seconds : 0;
  const uint64_t bytes_moved = bytes_;
  seen_.clear();
  bytes_ = 0;
  started_ = now;
  if (warmup_left_ > 0) {
    --warmup_left_;
    WriteRow("warmup", seconds, bytes_moved, score);
    return false;
  }
  WriteRow(confirming_ ? "confirm" : "trial", seconds, bytes_moved, score);
  const TunedParams before = params_;
  if (confirming_) {
    Confirm(score);
  } else {
    scores_.push_back(score);
    if (scores_.size() < size_t(options_.samples_per_trial)) return false;
    EndTrial();
  }
  return params_ != before || done_;
}

void Autotuner::EndTrial() {
  const double score = Median(scores_);
  scores_.clear();
  trials_.push_back({order_[dimension_], params_, score});
  // The incumbent's score is measured afresh in each setting's first trial.
  if (candidate_ == 0 || score > best_score_ * (1 + options_.margin)) {
    best_ = params_;
    best_score_ = score;
  }
  if (++candidate_ < candidates_.size()) {
    params_ = candidates_[candidate_];
    return;
  }
  // The values were measured one after another: on a machine whose speed
  // drifts, a later value can win for nothing. Before leaving the value the
  // setting had, compare the two in alternating samples.
  if (best_ != candidates_[0]) {
    confirming_ = true;
    params_ = best_;
    return;
  }
  EndDimension();
}

void Autotuner::EndDimension() {
  if (!NextDimension()) Finish();
}

void Autotuner::Confirm(double score) {
  const TunedParams& incumbent = candidates_[0];
  const bool on_best = params_ == best_;
  (on_best ? confirm_best_ : confirm_incumbent_).push_back(score);
  if (confirm_incumbent_.size() < size_t(options_.samples_per_trial)) {
    params_ = on_best ? incumbent : best_;
    return;
  }
  const double best = Median(confirm_best_), kept = Median(confirm_incumbent_);
  trials_.push_back({"confirm", best_, best});
  trials_.push_back({"confirm", incumbent, kept});
  if (best > kept * (1 + options_.margin)) {
    best_score_ = best;
  } else {
    best_ = incumbent;
    best_score_ = kept;
  }
  confirming_ = false;
  confirm_best_.clear();
  confirm_incumbent_.clear();
  EndDimension();
}

void Autotuner::Finish() {
  params_ = best_;
  done_ = true;
  WriteRow("chosen", 0, 0, best_score_);
}

void Autotuner::WriteRow(const char* phase, double seconds, uint64_t bytes, double score) {
  if (!log_.is_open()) return;
  char row[400];
  std::snprintf(row, sizeof row, "%d,%s,%s,%llu,%g,%llu,%llu,%.6f,%llu,%.6g\n", sample_index_++,
                phase, done_ ? "" : order_[dimension_],
                static_cast<unsigned long long>(params_.fusion_threshold), params_.cycle_time_ms,
                static_cast<unsigned long long>(params_.segment_bytes),
                static_cast<unsigned long long>(params_.small_allreduce_bytes), seconds,
                static_cast<unsigned long long>(bytes), score);
  log_ << row;
  log_.flush();
}

}  // namespace keras_ring
