#include "options.h"

#include <cerrno>
#include <cstdlib>
#include <initializer_list>

#include "common.h"

namespace keras_ring {

namespace {

// The first of `names` that is set, parsed by `parse`; Horovod's names are
// read too, so that job scripts written for Horovod keep their tuning.
template <typename T>
T Setting(std::initializer_list<const char*> names, T fallback, const char* what,
          T (*parse)(const char*, char**)) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (!text || !*text) continue;
    char* end = nullptr;
    errno = 0;
    T value = parse(text, &end);
    if (errno || *end || text[0] == '-') {
      throw EngineError(std::string("keras-ring: ") + name + " must be " + what +
                        ". Received: " + name + "=" + text);
    }
    return value;
  }
  return fallback;
}

unsigned long long ParseCount(const char* text, char** end) { return std::strtoull(text, end, 10); }
double ParseDouble(const char* text, char** end) { return std::strtod(text, end); }

// A setting that is free text (a path, a name): the first of `names` that is set.
std::string TextSetting(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text && *text) return text;
  }
  return "";
}

bool Flag(std::initializer_list<const char*> names, bool fallback) {
  return Setting<unsigned long long>(names, fallback, "0 or 1", ParseCount) != 0;
}

}  // namespace

std::chrono::steady_clock::duration Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

EngineOptions EngineOptions::FromEnvironment() {
  EngineOptions o;
  TunedParams& p = o.params;
  p.fusion_threshold = Setting<unsigned long long>(
      {"KERAS_RING_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"}, kDefaultFusionThreshold,
      "a number of bytes", ParseCount);
  p.cycle_time_ms = Setting<double>({"KERAS_RING_CYCLE_TIME", "HOROVOD_CYCLE_TIME"}, 0.0,
                                    "a number of milliseconds", ParseDouble);
  p.segment_bytes = Setting<unsigned long long>(
      {"KERAS_RING_SEGMENT_BYTES"}, 0, "a number of bytes (0: chosen by the engine)", ParseCount);
  p.small_allreduce_bytes = Setting<unsigned long long>(
      {"KERAS_RING_SMALL_ALLREDUCE_BYTES"}, kDefaultSmallAllreduceBytes, "a number of bytes",
      ParseCount);
  o.autotune = Flag({"KERAS_RING_AUTOTUNE", "HOROVOD_AUTOTUNE"}, false);
  o.tuning.log_path = TextSetting({"KERAS_RING_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"});
  o.tuning.warmup_samples = static_cast<int>(Setting<unsigned long long>(
      {"KERAS_RING_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"},
      o.tuning.warmup_samples, "a number of samples", ParseCount));
  o.tuning.steps_per_sample = static_cast<int>(Setting<unsigned long long>(
      {"KERAS_RING_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"},
      o.tuning.steps_per_sample, "a number of steps", ParseCount));
  o.stall_check = Seconds(Setting<double>(
      {"KERAS_RING_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"},
      kDefaultStallCheckSeconds, "a number of seconds", ParseDouble));
  o.stall_shutdown = Seconds(Setting<double>(
      {"KERAS_RING_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"},
      kDefaultStallShutdownSeconds, "a number of seconds", ParseDouble));
  o.cache_capacity = Setting<unsigned long long>(
      {"KERAS_RING_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"}, kDefaultCacheCapacity,
      "a number of tensor names", ParseCount);
  o.shared_memory = Flag({"KERAS_RING_SHM"}, true);
  o.hierarchical = Flag({"KERAS_RING_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE"},
                        true);
  o.shm_slot_bytes = Setting<unsigned long long>(
      {"KERAS_RING_SHM_SLOT_BYTES"}, 0, "a number of bytes (0: chosen by the engine)",
      ParseCount);
  o.kernels = Setting<KernelLevel>({"KERAS_RING_CPU_KERNELS"}, BestKernelLevel(),
                                   "generic, avx2 or avx512", ParseKernelLevel);
  const double timeout = Setting<double>({"KERAS_RING_TIMEOUT"}, kDefaultTimeoutSeconds,
                                         "a number of seconds (more than 0)", ParseDouble);
  if (!(timeout > 0)) {
    throw EngineError("keras-ring: KERAS_RING_TIMEOUT must be more than 0 seconds. Received: "
                      "KERAS_RING_TIMEOUT=" + TextSetting({"KERAS_RING_TIMEOUT"}));
  }
  o.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000));
  o.host_name = TextSetting({"KERAS_RING_HOSTNAME"});
  o.transport = TextSetting({"KERAS_RING_TRANSPORT"});
  if (o.transport.empty()) o.transport = "mpi";
  if (o.transport != "mpi" && o.transport != "tcp") {
    throw EngineError("keras-ring: KERAS_RING_TRANSPORT must be mpi or tcp. Received: "
                      "KERAS_RING_TRANSPORT=" + o.transport);
  }
  if (o.transport == "tcp") {
    for (const char* name : {"KERAS_RING_RENDEZVOUS", "KERAS_RING_SECRET"}) {
      if (TextSetting({name}).empty()) {
        throw EngineError(std::string("keras-ring: KERAS_RING_TRANSPORT=tcp, but ") + name +
                          " is not set: a TCP job is started by `keras-ring-run --transport tcp`, "
                          "which gives every rank its rank, the job's size, the address of its "
                          "rendezvous store and its secret");
      }
    }
    // An elastic job's workers get their rank and size from init() instead.
    if (!TextSetting({"KERAS_RING_SIZE"}).empty()) {
      o.tcp.size = static_cast<int>(
          Setting<unsigned long long>({"KERAS_RING_SIZE"}, 1, "a number of ranks", ParseCount));
    }
    if (!TextSetting({"KERAS_RING_RANK"}).empty()) {
      o.tcp.rank = static_cast<int>(
          Setting<unsigned long long>({"KERAS_RING_RANK"}, 0, "a rank", ParseCount));
    }
    o.tcp.rendezvous = TextSetting({"KERAS_RING_RENDEZVOUS"});
    o.tcp.secret = TextSetting({"KERAS_RING_SECRET"});
  }
  return o;
}

}  // namespace keras_ring
