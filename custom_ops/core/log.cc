#include "log.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <unordered_set>

#include "common.h"

namespace keras_ring {

namespace log_internal {
std::atomic<int> level{static_cast<int>(LogLevel::kWarning)};
}

namespace {

constexpr const char* kLevelNames[] = {"trace", "debug", "info", "warning", "error"};

std::mutex mu;  // guards the fields below and keeps lines whole
int log_rank = -1;
thread_local int thread_log_rank = -1;  // -1: the process's log_rank
std::string host;
bool hide_time = false;
std::unordered_set<std::string> said_once;

const char* Env(std::initializer_list<const char*> names, const char** which) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text && *text) {
      *which = name;
      return text;
    }
  }
  return nullptr;
}

void Write(LogLevel level, const std::string& message) {
  std::string line;
  if (!hide_time) {
    const auto now = std::chrono::system_clock::now();
    const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
    const int ms = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() %
        1000);
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    char stamp[40];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &utc);
    line = std::string("[") + stamp + "." + std::to_string(1000 + ms).substr(1) + " UTC ";
  } else {
    line = "[";
  }
  const int rank = thread_log_rank >= 0 ? thread_log_rank : log_rank;
  line += (rank >= 0 ? "rank " + std::to_string(rank) + " " : std::string()) + host +
          "] keras-ring " + kLevelNames[static_cast<int>(level)] + ": ";
  for (char c : message) {
    line += c;
    if (c == '\n') line += "    ";
  }
  line += '\n';
  // One write per message: lines of different threads and ranks never mix.
  ssize_t unused = ::write(2, line.data(), line.size());
  (void)unused;
}

// Reads the settings when the library loads, so that messages logged before
// init() are filtered too; a bad value is reported by init().
const bool configured_at_load = [] {
  try {
    ConfigureLog();
  } catch (const std::exception&) {
  }
  return true;
}();

}  // namespace

void ConfigureLog() {
  const char* which = nullptr;
  const char* text = Env({"KERAS_RING_LOG_LEVEL", "HOROVOD_LOG_LEVEL"}, &which);
  int level = static_cast<int>(LogLevel::kWarning);
  if (text) {
    std::string name(text);
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    if (name == "fatal") name = "error";  // Horovod's highest level
    const auto* found = std::find(std::begin(kLevelNames), std::end(kLevelNames), name);
    if (found == std::end(kLevelNames)) {
      throw EngineError(std::string("keras-ring: ") + which +
                        " must be one of trace, debug, info, warning, error. Received: " +
                        which + "=" + text);
    }
    level = static_cast<int>(found - std::begin(kLevelNames));
  }
  const char* hide = Env({"KERAS_RING_LOG_HIDE_TIME", "HOROVOD_LOG_HIDE_TIME"}, &which);
  std::lock_guard<std::mutex> lock(mu);
  log_internal::level = level;
  hide_time = hide && std::string(hide) != "0";
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    host = name;
  }
}

void SetLogRank(int rank) {
  std::lock_guard<std::mutex> lock(mu);
  log_rank = rank;
}

ThreadLogRank::ThreadLogRank(int rank) : previous_(thread_log_rank) { thread_log_rank = rank; }

ThreadLogRank::~ThreadLogRank() { thread_log_rank = previous_; }

void Log(LogLevel level, const std::string& message) {
  if (!LogEnabled(level)) return;
  std::lock_guard<std::mutex> lock(mu);
  Write(level, message);
}

void LogOnce(LogLevel level, const std::string& key, const std::string& message) {
  if (!LogEnabled(level)) return;
  std::lock_guard<std::mutex> lock(mu);
  if (said_once.insert(key).second) Write(level, message);
}

}  // namespace keras_ring
