// The autotuner's search, driven by a simulated training loop whose step
// time is a known function of the settings.
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "../core/autotune.h"
#include "../core/common.h"
#include "harness.h"

namespace keras_ring {
namespace {

constexpr uint64_t MiB = 1 << 20, KiB = 1 << 10;
constexpr uint64_t kStepBytes = 8 * MiB;

using StepTime = std::function<double(const TunedParams&)>;  // seconds

// Runs `steps` training steps of three tensors each (two lists per step, as
// fusion may split them), each step taking step_time(params) seconds of a
// simulated clock. Returns how many times the parameters changed.
int Train(Autotuner& tuner, int steps, const StepTime& step_time) {
  static auto now = Autotuner::Clock::now();
  const std::string a = "grad/a", b = "grad/b", c = "grad/c";
  int changes = 0;
  for (int s = 0; s < steps; ++s) {
    const double seconds = step_time(tuner.params());
    now += std::chrono::duration_cast<Autotuner::Clock::duration>(
        std::chrono::duration<double>(seconds / 2));
    if (tuner.Observe({&a, &b}, kStepBytes / 2, now)) ++changes;
    now += std::chrono::duration_cast<Autotuner::Clock::duration>(
        std::chrono::duration<double>(seconds / 2));
    if (tuner.Observe({&c}, kStepBytes / 2, now)) ++changes;
  }
  return changes;
}

// Fastest at 16 MiB fusion, 1 ms cycle, 256 KiB segments, 64 KiB crossover;
// each setting's effect independent of the others.
double Separable(const TunedParams& p) {
  double t = 0.010;
  t += 0.002 * std::abs(std::log2(double(p.fusion_threshold + MiB) / (17 * MiB)));
  t += 0.001 * std::abs(p.cycle_time_ms - 1.0);
  t += 0.0005 * std::abs(std::log2(double(p.segment_bytes + 1) / (256 * KiB)));
  t += 0.0005 * std::abs(std::log2(double(p.small_allreduce_bytes + KiB) / (65 * KiB)));
  return t;
}

AutotuneOptions Quick() {
  AutotuneOptions o;
  o.warmup_samples = 2;
  o.steps_per_sample = 3;
  o.samples_per_trial = 3;
  return o;
}

KR_TEST(AutotuneFindsTheBestOfEachSettingAndStops) {
  TunedParams start;
  start.fusion_threshold = 0;
  start.cycle_time_ms = 5;
  start.segment_bytes = 4 * MiB;
  start.small_allreduce_bytes = 0;
  Autotuner tuner(start, Quick());
  KR_EXPECT(!tuner.done());
  Train(tuner, 2000, Separable);
  KR_EXPECT(tuner.done());
  KR_EXPECT_EQ(tuner.params().fusion_threshold, 16 * MiB);
  KR_EXPECT_EQ(tuner.params().cycle_time_ms, 1.0);
  KR_EXPECT_EQ(tuner.params().segment_bytes, 256 * KiB);
  KR_EXPECT_EQ(tuner.params().small_allreduce_bytes, 64 * KiB);
  // Each setting's candidates, the incumbent (measured again) among them,
  // then, as every setting moved, its new value against its old once more.
  KR_EXPECT_EQ(tuner.trials().size(), size_t(6 + 5 + 4 + 4 + 4 * 2));
  KR_EXPECT_EQ(tuner.trials().back().setting, std::string("confirm"));
  const TunedParams chosen = tuner.params();
  Train(tuner, 100, Separable);  // done: nothing moves any more
  KR_EXPECT(tuner.params() == chosen);
}

KR_TEST(AutotuneSamplesAreCountedInStepsByRepeatedNames) {
  AutotuneOptions o = Quick();
  o.warmup_samples = 0;
  Autotuner tuner(TunedParams{}, o);
  // The first list only starts the clock; a sample ends at the third
  // sighting of any name, which is about three steps; three samples end the
  // first trial.
  int steps = 0;
  while (tuner.trials().empty()) {
    Train(tuner, 1, Separable);
    ++steps;
  }
  KR_EXPECT(steps >= 8 && steps <= 9);
  const double expected = kStepBytes / Separable(TunedParams{});
  KR_EXPECT(std::abs(tuner.trials()[0].bytes_per_second / expected - 1) < 0.2);
}

KR_TEST(AutotuneKeepsTheStartingValuesUnlessClearlyBeaten) {
  // Every other value is 1% faster: within the margin, so nothing changes.
  TunedParams start;
  start.fusion_threshold = 64 * MiB;
  start.cycle_time_ms = 0;
  start.small_allreduce_bytes = 64 * KiB;
  Autotuner tuner(start, Quick());
  const auto slightly_worse_start = [&](const TunedParams& p) { return p == start ? 0.0101 : 0.01; };
  Train(tuner, 2000, slightly_worse_start);
  KR_EXPECT(tuner.done());
  KR_EXPECT(tuner.params() == start);
}

KR_TEST(AutotuneGoesBackToTheStartWhenOnlyDriftMadeOthersWin) {
  // Every setting costs the same, but the machine gets faster and faster:
  // each setting's last value wins its trials, and the alternating
  // comparison shows it was the drift.
  TunedParams start;
  start.fusion_threshold = 64 * MiB;
  int step = 0;
  const auto speeding_up = [&](const TunedParams&) { return 0.02 / (1 + 0.01 * step++); };
  Autotuner tuner(start, Quick());
  Train(tuner, 2000, speeding_up);
  KR_EXPECT(tuner.done());
  const auto& trials = tuner.trials();
  KR_EXPECT_EQ(trials[trials.size() - 2].setting, std::string("confirm"));
  KR_EXPECT(!(trials[trials.size() - 2].params == start));  // the search had moved away
  KR_EXPECT(tuner.params() == start);
}

KR_TEST(AutotuneSkipsTheCycleTimeWhenFusionIsOff) {
  const auto unfused_is_best = [](const TunedParams& p) {
    return 0.01 + 1e-10 * double(p.fusion_threshold) + 0.001 * p.cycle_time_ms;
  };
  TunedParams start;
  start.fusion_threshold = 64 * MiB;
  Autotuner tuner(start, Quick());
  Train(tuner, 2000, unfused_is_best);
  KR_EXPECT(tuner.done());
  KR_EXPECT_EQ(tuner.params().fusion_threshold, uint64_t(0));
  for (const auto& trial : tuner.trials()) KR_EXPECT(trial.setting != "cycle_time_ms");
  KR_EXPECT_EQ(tuner.trials().size(), size_t(6 + 5 + 4 + 2));  // segment: 0 and four sizes
}

KR_TEST(AutotuneLeavesOutSettingsThatCannotMatterAndWritesItsLog) {
  AutotuneOptions o = Quick();
  o.tune_segment = false;
  o.tune_small_allreduce = false;
  o.log_path = "/tmp/kr_autotune_test_" + std::to_string(getpid()) + ".csv";
  Autotuner tuner(TunedParams{}, o);
  Train(tuner, 2000, Separable);
  KR_EXPECT(tuner.done());
  KR_EXPECT_EQ(tuner.trials().size(), size_t(6 + 2 + 5 + 2));  // both settings moved
  for (const auto& trial : tuner.trials()) {
    KR_EXPECT(trial.setting == "fusion_threshold" || trial.setting == "cycle_time_ms" ||
              trial.setting == "confirm");
  }
  std::ifstream in(o.log_path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  unlink(o.log_path.c_str());
  // Header, warm-up samples, three samples per trial (the confirmation's two
  // trials alternate), the choice.
  KR_EXPECT_EQ(lines.size(), size_t(1 + 2 + 3 * tuner.trials().size() + 1));
  // The last sample: the cycle time's old value, against the new one.
  KR_EXPECT(lines[lines.size() - 2].find(",confirm,cycle_time_ms,16777216,0,") !=
            std::string::npos);
  KR_EXPECT(lines[0].rfind("sample,phase,setting,fusion_threshold_bytes", 0) == 0);
  KR_EXPECT(lines[1].find(",warmup,fusion_threshold,") != std::string::npos);
  KR_EXPECT(lines.back().find(",chosen,,16777216,1,") != std::string::npos);
}

KR_TEST(AutotuneRefusesALogItCannotWrite) {
  AutotuneOptions o = Quick();
  o.log_path = "/nonexistent-dir/autotune.csv";
  KR_EXPECT_THROW(Autotuner(TunedParams{}, o), EngineError, "/nonexistent-dir/autotune.csv");
}

}  // namespace
}  // namespace keras_ring
