// The timeline writer and the log's settings, without MPI.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../core/common.h"
#include "../core/log.h"
#include "../core/timeline.h"
#include "harness.h"

namespace keras_ring {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string TempPath(const char* name) {
  return "/tmp/kr_timeline_test_" + std::to_string(getpid()) + "_" + name + ".json";
}

KR_TEST(TimelineWritesOneEventPerLineAndClosesTheArray) {
  const std::string path = TempPath("closed");
  Timeline t;
  std::string error;
  KR_EXPECT(!t.on());
  KR_EXPECT(t.Start(path, 3, false, &error));
  KR_EXPECT(t.on());
  KR_EXPECT(!t.Start(path, 3, false, &error));  // already recording
  KR_EXPECT(error.find("already") != std::string::npos);
  const auto t0 = Timeline::Clock::now();
  using std::chrono::microseconds;
  {
    auto row = t.Row(0, "grad \"a\"");
    row.Begin("NEGOTIATE", t0, std::make_shared<const std::string>("\"request\":\"x\""));
    row.End(t0 + microseconds(10));
    row.Begin("allreduce", t0 + microseconds(10));
    row.Nested("PACK", t0 + microseconds(11), t0 + microseconds(12));
    row.End(t0 + microseconds(20));
    row.End(t0 + microseconds(30));  // nothing open: dropped
  }
  t.Mark("CYCLE", t0, nullptr);
  t.Stop();
  KR_EXPECT(!t.on());
  const std::string text = Read(path);
  const auto lines = Lines(text);
  // "[", 2 process and 2 row metadata events, 6 events, "]".
  KR_EXPECT_EQ(lines.size(), 12u);
  KR_EXPECT_EQ(lines.front(), std::string("["));
  KR_EXPECT_EQ(lines.back(), std::string("]"));
  for (size_t i = 1; i + 1 < lines.size(); ++i) {
    KR_EXPECT_EQ(lines[i].front(), '{');
    KR_EXPECT(lines[i].back() == (i + 2 == lines.size() ? '}' : ','));
    KR_EXPECT(lines[i].find("\"pid\":3") != std::string::npos);
  }
  KR_EXPECT(text.find("\"args\":{\"name\":\"grad \\\"a\\\"\"}") != std::string::npos);
  KR_EXPECT(text.find("\"name\":\"ALLREDUCE\"") != std::string::npos);  // in capitals
  KR_EXPECT(lines[8].find("\"ph\":\"X\"") != std::string::npos);
  KR_EXPECT(lines[8].find("\"name\":\"PACK\"") != std::string::npos);
  KR_EXPECT(text.find("\"dur\":1.000") != std::string::npos);
  std::remove(path.c_str());
}

KR_TEST(TimelineFileIsWholeEventsWhileRecording) {
  const std::string path = TempPath("open");
  Timeline t;
  std::string error;
  KR_EXPECT(t.Start(path, 0, true, &error));
  KR_EXPECT(t.mark_cycles());
  const auto t0 = Timeline::Clock::now();
  for (int i = 0; i < 100; ++i) {
    t.Mark("CYCLE", t0, std::make_shared<const std::string>("\"i\":" + std::to_string(i)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the writer's interval passes
  const std::string text = Read(path);
  // No closing bracket yet, and none needed: whole events, no trailing comma.
  KR_EXPECT_EQ(text.front(), '[');
  KR_EXPECT_EQ(text.back(), '}');
  KR_EXPECT_EQ(Lines(text).size(), 103u);
  t.Stop();
  KR_EXPECT(!t.mark_cycles());
  // Recording again truncates the file.
  KR_EXPECT(t.Start(path, 0, false, &error));
  t.Stop();
  const auto again = Lines(Read(path));
  KR_EXPECT_EQ(again.size(), 4u);  // the two process metadata events
  KR_EXPECT_EQ(again.back(), std::string("]"));
  std::remove(path.c_str());
}

KR_TEST(TimelineRowsNeverOverlap) {
  const std::string path = TempPath("rows");
  Timeline t;
  std::string error;
  KR_EXPECT(t.Start(path, 0, false, &error));
  const auto t0 = Timeline::Clock::now();
  using std::chrono::microseconds;
  {
    auto row = t.Row(0, "x");
    row.Begin("allreduce", t0);
    row.End(t0 + microseconds(50));
    // Submitted again while the previous completion was still returning.
    row.Begin("NEGOTIATE", t0 + microseconds(40));
    row.End(t0 + microseconds(60));
  }
  t.Stop();
  const auto lines = Lines(Read(path));
  KR_EXPECT_EQ(lines.size(), 10u);
  auto ts = [&](const std::string& line) {
    return line.substr(line.find("\"ts\":") + 5, line.find_first_of(",}", line.find("\"ts\":")) -
                                                     line.find("\"ts\":") - 5);
  };
  KR_EXPECT_EQ(ts(lines[7]), ts(lines[6]));  // the second span starts where the first ended
  std::remove(path.c_str());
}

KR_TEST(TimelineReportsAFileItCannotCreate) {
  Timeline t;
  std::string error;
  KR_EXPECT(!t.Start("/nonexistent-dir/trace.json", 0, false, &error));
  KR_EXPECT(error.find("cannot create the timeline file '/nonexistent-dir/trace.json'") !=
            std::string::npos);
  KR_EXPECT(!t.on());
}

KR_TEST(TimelineQuotesJsonStrings) {
  KR_EXPECT_EQ(Timeline::Quote("a\"b\\c\n"), std::string("\"a\\\"b\\\\c\\u000a\""));
}

KR_TEST(LogLevelComesFromTheEnvironment) {
  setenv("KERAS_RING_LOG_LEVEL", "DEBUG", 1);
  ConfigureLog();
  KR_EXPECT(LogEnabled(LogLevel::kDebug));
  KR_EXPECT(!LogEnabled(LogLevel::kTrace));
  unsetenv("KERAS_RING_LOG_LEVEL");
  setenv("HOROVOD_LOG_LEVEL", "error", 1);
  ConfigureLog();
  KR_EXPECT(!LogEnabled(LogLevel::kWarning));
  KR_EXPECT(LogEnabled(LogLevel::kError));
  setenv("HOROVOD_LOG_LEVEL", "loud", 1);
  KR_EXPECT_THROW(ConfigureLog(), EngineError,
                  "HOROVOD_LOG_LEVEL must be one of trace, debug, info, warning, error. "
                  "Received: HOROVOD_LOG_LEVEL=loud");
  unsetenv("HOROVOD_LOG_LEVEL");
  ConfigureLog();
  KR_EXPECT(LogEnabled(LogLevel::kWarning));
  KR_EXPECT(!LogEnabled(LogLevel::kInfo));
}

KR_TEST(LogLinesNameTheRankOfTheirThread) {
  // Several engines in one process (one per rank thread): each thread's
  // lines name its own rank, others the process's.
  const std::string path = TempPath("log");
  const int saved = dup(2);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  dup2(fd, 2);
  close(fd);
  SetLogRank(3);
  Log(LogLevel::kError, "from the process");
  std::thread([] {
    const ThreadLogRank rank(5);
    Log(LogLevel::kError, "from rank 5's thread");
  }).join();
  Log(LogLevel::kError, "from the process again");
  dup2(saved, 2);
  close(saved);
  SetLogRank(-1);
  const std::vector<std::string> lines = Lines(Read(path));
  std::remove(path.c_str());
  KR_EXPECT_EQ(lines.size(), 3u);
  if (lines.size() != 3) return;
  KR_EXPECT(lines[0].find("rank 3 ") != std::string::npos);
  KR_EXPECT(lines[1].find("rank 5 ") != std::string::npos);
  KR_EXPECT(lines[2].find("rank 3 ") != std::string::npos);
}

}  // namespace
}  // namespace keras_ring
