#include "timeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace keras_ring {

namespace {

// The writer wakes this often, or sooner when this much is buffered: after a
// crash the file lacks at most the last moments.
constexpr auto kWriteInterval = std::chrono::milliseconds(100);
constexpr size_t kWriteSoon = size_t(1) << 20;

bool WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::string Timeline::Quote(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

bool Timeline::Start(const std::string& path, int rank, bool mark_cycles, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) {
    *error = "keras-ring: a timeline is already being recorded; call stop_timeline() first";
    return false;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = "keras-ring: cannot create the timeline file '" + path + "': " + std::strerror(errno);
    return false;
  }
  fd_ = fd;
  rank_ = rank;
  stopping_ = false;
  first_event_ = true;
  rows_.clear();
  buffer_ = "[";
  constexpr std::chrono::seconds k2025(1735689600);  // 2025-01-01T00:00:00Z in Unix time
  epoch_offset_ = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch() - k2025 -
      Clock::now().time_since_epoch());
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string pid = ",\"pid\":" + std::to_string(rank);
  Append("{\"name\":\"process_name\",\"ph\":\"M\"" + pid + ",\"args\":{\"name\":" +
         Quote("rank " + std::to_string(rank) + " (" + host + ")") + "}}");
  Append("{\"name\":\"process_sort_index\",\"ph\":\"M\"" + pid + ",\"args\":{\"sort_index\":" +
         std::to_string(rank) + "}}");
  mark_cycles_ = mark_cycles;
  writer_ = std::thread(&Timeline::WriteLoop, this);
  on_ = true;
  return true;
}

void Timeline::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ < 0 || stopping_) return;
    on_ = false;
    mark_cycles_ = false;
    stopping_ = true;
  }
  wake_.notify_one();
  writer_.join();
}

void Timeline::WriteLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  bool ok = true;
  for (;;) {
    wake_.wait_for(lock, kWriteInterval, [&] { return stopping_ || buffer_.size() >= kWriteSoon; });
    std::string batch;
    batch.swap(buffer_);
    const bool last = stopping_;
    lock.unlock();
    if (last) batch += "\n]\n";
    ok = ok && WriteAll(fd_, batch);  // after a failed write, drop the rest
    lock.lock();
    if (last) break;
  }
  ::close(fd_);
  fd_ = -1;
}

void Timeline::Append(const std::string& event) {
  buffer_ += first_event_ ? "\n" : ",\n";
  buffer_ += event;
  first_event_ = false;
  if (buffer_.size() >= kWriteSoon) wake_.notify_one();
}

std::string Timeline::Ts(Clock::time_point at) const {
  const long long ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           at.time_since_epoch() + epoch_offset_).count();
  char text[40];
  std::snprintf(text, sizeof text, "%lld.%03lld", ns / 1000, ns % 1000);
  return text;
}

Timeline::Row& Timeline::RowOf(const std::string& tensor) {
  auto found = rows_.find(tensor);
  if (found != rows_.end()) return found->second;
  const int id = static_cast<int>(rows_.size()) + 1;
  const std::string ids = ",\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(id);
  Append("{\"name\":\"thread_name\",\"ph\":\"M\"" + ids + ",\"args\":{\"name\":" + Quote(tensor) +
         "}}");
  Append("{\"name\":\"thread_sort_index\",\"ph\":\"M\"" + ids + ",\"args\":{\"sort_index\":" +
         std::to_string(id) + "}}");
  return rows_.emplace(tensor, Row{id, Clock::time_point(), 0}).first->second;
}

void Timeline::Begin(const std::string& tensor, const char* name, Clock::time_point at,
                     const std::string& args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || fd_ < 0) return;
  Row& row = RowOf(tensor);
  if (row.open == 0) at = std::max(at, row.free_from);
  row.open += 1;
  Append("{\"name\":\"" + std::string(name) + "\",\"ph\":\"B\",\"pid\":" + std::to_string(rank_) +
         ",\"tid\":" + std::to_string(row.id) + ",\"ts\":" + Ts(at) +
         (args.empty() ? "" : ",\"args\":{" + args + "}") + "}");
}

void Timeline::End(const std::string& tensor, Clock::time_point at) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || fd_ < 0) return;
  Row& row = RowOf(tensor);
  if (row.open == 0) return;  // begun before recording started
  row.open -= 1;
  if (row.open == 0) {
    at = std::max(at, row.free_from);
    row.free_from = at;
  }
  Append("{\"ph\":\"E\",\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(row.id) +
         ",\"ts\":" + Ts(at) + "}");
}

void Timeline::Nested(const std::string& tensor, const char* name, Clock::time_point start,
                      Clock::time_point end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || fd_ < 0) return;
  Row& row = RowOf(tensor);
  if (row.open == 0) return;
  const double us = std::chrono::duration<double, std::micro>(end - start).count();
  char dur[32];
  std::snprintf(dur, sizeof dur, "%.3f", us);
  Append("{\"name\":\"" + std::string(name) + "\",\"ph\":\"X\",\"pid\":" + std::to_string(rank_) +
         ",\"tid\":" + std::to_string(row.id) + ",\"ts\":" + Ts(start) + ",\"dur\":" + dur + "}");
}

void Timeline::Mark(const char* name, Clock::time_point at, const std::string& args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || fd_ < 0) return;
  Append("{\"name\":\"" + std::string(name) + "\",\"ph\":\"i\",\"s\":\"p\",\"pid\":" +
         std::to_string(rank_) + ",\"tid\":0,\"ts\":" + Ts(at) +
         (args.empty() ? "" : ",\"args\":{" + args + "}") + "}");
}

}  // namespace keras_ring
