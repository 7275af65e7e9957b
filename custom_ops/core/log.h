// The engine's log: one line per message on stderr, prefixed with the time,
// the rank and the host, filtered by KERAS_RING_LOG_LEVEL (HOROVOD_LOG_LEVEL
// is read too). The Python layer logs through it as well (kr_log), so both
// share one level and one format.
#pragma once

#include <atomic>
#include <string>

namespace keras_ring {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarning = 3, kError = 4 };

// Reads the level (and KERAS_RING_LOG_HIDE_TIME / HOROVOD_LOG_HIDE_TIME) from
// the environment; throws EngineError naming the variable for an unknown
// level. Runs when the library loads and again at each init().
void ConfigureLog();
// Once the job has started: the rank every line names.
void SetLogRank(int rank);

// While it lives, the lines of the calling thread name `rank` instead of the
// process's: the C++ tests run several engines in one process, one per rank
// thread, and each engine's threads hold one.
class ThreadLogRank {
 public:
  explicit ThreadLogRank(int rank);
  ~ThreadLogRank();
  ThreadLogRank(const ThreadLogRank&) = delete;
  ThreadLogRank& operator=(const ThreadLogRank&) = delete;

 private:
  int previous_;
};

namespace log_internal {
extern std::atomic<int> level;
}

// A relaxed load and a compare: cheap enough to guard any message.
inline bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= log_internal::level.load(std::memory_order_relaxed);
}

// Writes the message if its level is enabled. Continuation lines of a
// multi-line message are indented under the first.
void Log(LogLevel level, const std::string& message);
// The same, at most once per process for each key (a warning that would
// otherwise repeat every step).
void LogOnce(LogLevel level, const std::string& key, const std::string& message);

}  // namespace keras_ring

// Builds the message only when its level is enabled.
#define KR_LOG(level, message)                                                    \
  do {                                                                            \
    if (::keras_ring::LogEnabled(::keras_ring::LogLevel::level)) {                \
      ::keras_ring::Log(::keras_ring::LogLevel::level, (message));                \
    }                                                                             \
  } while (0)
