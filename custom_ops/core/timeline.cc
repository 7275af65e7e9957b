#include "timeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

namespace keras_ring {

namespace {

// The writer wakes this often, or sooner when this much is buffered: after a
// crash the file lacks at most the last moments.
constexpr auto kWriteInterval = std::chrono::milliseconds(100);
constexpr size_t kWriteSoon = 16384;  // events

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
  rows_.clear();
  next_row_ = 1;
  events_.clear();
  constexpr std::chrono::seconds k2025(1735689600);  // 2025-01-01T00:00:00Z in Unix time
  epoch_offset_ = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch() - k2025 -
      Clock::now().time_since_epoch());
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  host_ = host;
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
  const std::string pid = ",\"pid\":" + std::to_string(rank_);
  std::string text = "[\n{\"name\":\"process_name\",\"ph\":\"M\"" + pid + ",\"args\":{\"name\":" +
                     Quote("rank " + std::to_string(rank_) + " (" + host_ + ")") +
                     "}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\"" + pid +
                     ",\"args\":{\"sort_index\":" + std::to_string(rank_) + "}}";
  bool ok = WriteAll(fd_, text);
  text.clear();
  std::vector<Event> batch;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait_for(lock, kWriteInterval, [&] { return stopping_ || events_.size() >= kWriteSoon; });
    batch.swap(events_);
    const bool last = stopping_;
    lock.unlock();
    for (const Event& e : batch) Format(e, &text);
    batch.clear();
    if (last) text += "\n]\n";
    ok = ok && WriteAll(fd_, text);  // after a failed write, drop the rest
    text.clear();
    lock.lock();
    if (last) break;
  }
  ::close(fd_);
  fd_ = -1;
}

namespace {

// Appends `value` in decimal.
void AppendInt(long long value, std::string* out) {
  char digits[24];
  auto end = std::to_chars(digits, digits + sizeof digits, value).ptr;
  out->append(digits, end);
}

// Appends nanoseconds as microseconds with three decimals: what the format's
// "ts" and "dur" are in.
void AppendMicros(long long ns, std::string* out) {
  if (ns < 0) {
    *out += '-';
    ns = -ns;
  }
  AppendInt(ns / 1000, out);
  const int frac = static_cast<int>(ns % 1000);
  const char decimals[] = {'.', char('0' + frac / 100), char('0' + frac / 10 % 10),
                           char('0' + frac % 10)};
  out->append(decimals, sizeof decimals);
}

}  // namespace

void Timeline::Format(const Event& e, std::string* out) const {
  // Each event on a line of its own that begins with the separator: the file
  // is whole events at any moment. Written by hand: this runs for every event.
  if (e.ph == 'M') {
    for (const char* field : {"thread_sort_index", "thread_name"}) {
      *out += ",\n{\"name\":\"";
      *out += field;
      *out += "\",\"ph\":\"M\",\"pid\":";
      AppendInt(rank_, out);
      *out += ",\"tid\":";
      AppendInt(e.row, out);
      *out += ",\"args\":{";
      if (field[7] == 's') {
        *out += "\"sort_index\":";
        AppendInt(e.row, out);
      } else {
        *out += "\"name\":" + Quote(*e.args);
      }
      *out += "}}";
    }
    return;
  }
  *out += ",\n{\"ph\":\"";
  *out += e.ph;
  *out += "\",\"pid\":";
  AppendInt(rank_, out);
  *out += ",\"tid\":";
  AppendInt(e.row, out);
  *out += ",\"ts\":";
  AppendMicros(std::chrono::duration_cast<std::chrono::nanoseconds>(e.ts.time_since_epoch() +
                                                                    epoch_offset_).count(),
               out);
  if (e.name) {
    *out += ",\"name\":\"";
    for (const char* c = e.name; *c; ++c) {  // literals, written in capitals
      *out += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
    }
    *out += '"';
  }
  if (e.ph == 'X') {
    *out += ",\"dur\":";
    AppendMicros(std::chrono::duration_cast<std::chrono::nanoseconds>(e.dur).count(), out);
  }
  if (e.ph == 'i') *out += ",\"s\":\"p\"";
  if (e.args) {
    *out += ",\"args\":{";
    *out += *e.args;
    *out += '}';
  }
  *out += '}';
}

void Timeline::Record(Event event) {
  events_.push_back(std::move(event));
  if (events_.size() == kWriteSoon) wake_.notify_one();
}

Timeline::RowState* Timeline::RowOf(int32_t set, const std::string& tensor) {
  if (stopping_ || fd_ < 0) return nullptr;
  auto& rows = rows_[set];
  auto found = rows.find(tensor);
  if (found != rows.end()) return &found->second;
  const int id = next_row_++;
  Record({'M', nullptr, id, {}, {},
          std::make_shared<const std::string>(
              set == 0 ? tensor : tensor + " (process set " + std::to_string(set) + ")")});
  return &rows.emplace(tensor, RowState{id, Clock::time_point(), 0}).first->second;
}

Timeline::RowEvents Timeline::Row(int32_t set, const std::string& tensor) {
  std::unique_lock<std::mutex> lock(mu_);
  RowState* row = RowOf(set, tensor);
  return RowEvents(this, std::move(lock), row);
}

void Timeline::RowEvents::Begin(const char* name, Clock::time_point at, Args args) {
  if (!row_) return;
  if (row_->open == 0) at = std::max(at, row_->free_from);
  row_->open += 1;
  timeline_->Record({'B', name, row_->id, at, {}, std::move(args)});
}

void Timeline::RowEvents::End(Clock::time_point at) {
  if (!row_ || row_->open == 0) return;  // begun before recording started
  row_->open -= 1;
  if (row_->open == 0) {
    at = std::max(at, row_->free_from);
    row_->free_from = at;
  }
  timeline_->Record({'E', nullptr, row_->id, at, {}, nullptr});
}

void Timeline::RowEvents::Nested(const char* name, Clock::time_point start,
                                 Clock::time_point end) {
  if (!row_ || row_->open == 0) return;
  timeline_->Record({'X', name, row_->id, start, end - start, nullptr});
}

void Timeline::Mark(const char* name, Clock::time_point at, Args args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || fd_ < 0) return;
  Record({'i', name, 0, at, {}, std::move(args)});
}

}  // namespace keras_ring
