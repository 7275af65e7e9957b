#include "shm.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>

#include "reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KR_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define KR_CPU_RELAX() asm volatile("yield")
#else
#define KR_CPU_RELAX() ((void)0)
#endif

namespace keras_ring {

struct ShmGroup::Header {
  alignas(64) std::atomic<uint64_t> step{0};   // the last step this rank reached
  alignas(64) std::atomic<uint32_t> stopped{0};
  pid_t pid = 0;
};

namespace {

constexpr size_t kHeaderBytes = 4096;  // keeps the slots page-aligned
constexpr size_t kAlign = 64;          // block boundaries: whole cache lines
constexpr const char* kPrefix = "kr-";  // segment names: /kr-<pid>x<random>-<rank>
static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory counters must be lock-free");

std::string SegmentName(const std::string& key, int rank) {
  return "/" + std::string(kPrefix) + key + "-" + std::to_string(rank);
}

// Whether `pid` names a live process: not gone, not a zombie.
bool Alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

// Removes segments left in /dev/shm by jobs whose first rank has died
// (a crash between creating and unlinking a segment).
void RemoveStaleSegments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.compare(0, std::strlen(kPrefix), kPrefix) != 0) continue;
    const long pid = std::strtol(name.c_str() + std::strlen(kPrefix), nullptr, 10);
    if (pid > 0 && !Alive(static_cast<pid_t>(pid))) shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Calls fn(pointer, elements, offset) for each piece of the spans that
// overlaps elements [begin, begin + count) of their concatenation; offset
// counts from `begin`. `starts` holds each span's first element.
template <typename Fn>
void ForEachPiece(const std::vector<ShmSpan>& spans, const std::vector<size_t>& starts,
                  size_t begin, size_t count, bool output, size_t esize, Fn&& fn) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (size_t done = 0; done < count; ++i) {
    const ShmSpan& s = spans[i];
    const size_t from = begin + done - starts[i];
    const size_t n = std::min(s.count - from, count - done);
    if (n == 0) continue;  // an empty span
    char* base = output ? static_cast<char*>(s.output)
                        : const_cast<char*>(static_cast<const char*>(s.input));
    fn(base + from * esize, n, done);
    done += n;
  }
}

}  // namespace

std::unique_ptr<ShmGroup> ShmGroup::Create(int rank, const std::vector<int>& world_ranks,
                                           const std::string& key, size_t slot_bytes,
                                           const std::function<bool(bool)>& all_agree,
                                           std::string* why, std::function<void()> progress,
                                           std::chrono::milliseconds timeout) {
  std::unique_ptr<ShmGroup> g(new ShmGroup);
  g->progress_ = std::move(progress);
  g->timeout_ = timeout;
  g->rank_ = rank;
  g->world_ranks_ = world_ranks;
  g->slot_bytes_ = std::max(kAlign, slot_bytes / kAlign * kAlign);
  const int p = static_cast<int>(world_ranks.size());
  g->peers_.resize(p);
  const size_t bytes = kHeaderBytes + 2 * g->slot_bytes_;
  const std::string own = SegmentName(key, rank);
  auto map = [&](int fd, Peer* peer) {
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return false;
    peer->base = base;
    peer->mapped_bytes = bytes;
    peer->header = static_cast<Header*>(base);
    peer->slots = static_cast<char*>(base) + kHeaderBytes;
    return true;
  };

  // 1. Every rank creates, sizes and maps its own segment.
  std::string error;
  if (rank == 0) RemoveStaleSegments();
  const int fd = shm_open(own.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  bool created = fd >= 0;
  if (!created) {
    error = Errno("shm_open(" + own + ")");
  } else {
    // posix_fallocate reserves the pages now: a full /dev/shm (64 MiB in a
    // default Docker container) is an error here rather than a SIGBUS later.
    const int rc = ftruncate(fd, bytes) == 0 ? posix_fallocate(fd, 0, bytes) : errno;
    if (rc != 0) {
      error = "could not reserve " + std::to_string(bytes) + " bytes of shared memory for " + own +
              ": " + std::strerror(rc);
    } else if (!map(fd, &g->peers_[rank])) {
      error = Errno("mmap(" + own + ")");
    } else {
      Header* h = new (g->peers_[rank].header) Header;
      h->pid = getpid();
    }
    close(fd);
  }
  bool ok = all_agree(error.empty());
  // 2. Then maps every peer's.
  for (int q = 0; ok && error.empty() && q < p; ++q) {
    if (q == rank) continue;
    const std::string name = SegmentName(key, q);
    const int peer_fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (peer_fd < 0) {
      error = Errno("shm_open(" + name + ")");
      break;
    }
    struct stat st {};
    if (fstat(peer_fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      error = name + " does not have the expected size " + std::to_string(bytes);
    } else if (!map(peer_fd, &g->peers_[q])) {
      error = Errno("mmap(" + name + ")");
    }
    close(peer_fd);
  }
  if (ok) ok = all_agree(error.empty());
  // 3. Once all have mapped it (or given up), the name is no longer needed.
  if (created) shm_unlink(own.c_str());
  if (!ok) {
    if (why) *why = error;
    return nullptr;
  }
  g->check_pids_ = true;
  for (int q = 0; q < p; ++q) {
    const pid_t pid = g->peers_[q].header->pid;
    if (kill(pid, 0) != 0 && errno == ESRCH) g->check_pids_ = false;  // another pid namespace
  }
  return g;
}

ShmGroup::~ShmGroup() {
  for (Peer& peer : peers_) {
    if (peer.base) munmap(peer.base, peer.mapped_bytes);
  }
}

void ShmGroup::Stop() { peers_[rank_].header->stopped.store(1, std::memory_order_release); }

void ShmGroup::CheckPeers() const {
  if (!check_pids_) return;
  for (int q = 0; q < size(); ++q) {
    const Header* h = peers_[q].header;
    if (q == rank_ || h->stopped.load(std::memory_order_acquire) || Alive(h->pid)) continue;
    throw PeerLostError("keras-ring: rank " + std::to_string(world_ranks_[q]) + " (pid " +
                        std::to_string(h->pid) +
                        ") died: its process ended without shutting keras-ring down");
  }
}

char* ShmGroup::Slot(int peer, uint64_t round) const {
  return peers_[peer].slots + (round % 2) * slot_bytes_;
}

void ShmGroup::WaitFor(int peer, uint64_t step) {
  const Header* h = peers_[peer].header;
  if (h->step.load(std::memory_order_acquire) >= step) return;
  // Spin briefly (the peer is usually a few microseconds behind), then give
  // the core away: with more ranks than cores the peer may need this one.
  using Clock = std::chrono::steady_clock;
  constexpr auto kCheckEvery = std::chrono::milliseconds(100);
  const auto since = Clock::now();
  auto next_check = since + kCheckEvery;
  for (int spins = 0; h->step.load(std::memory_order_acquire) < step; ++spins) {
    if (progress_ && spins % 256 == 255) progress_();
    if (spins < 2000) {
      KR_CPU_RELAX();
      continue;
    }
    if (spins < 20000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (Clock::now() < next_check) continue;
    next_check = Clock::now() + kCheckEvery;
    if (h->stopped.load(std::memory_order_acquire)) {
      throw PeerLostError("keras-ring: rank " + std::to_string(world_ranks_[peer]) +
                        " stopped in the middle of a shared-memory collective");
    }
    if (check_pids_ && !Alive(h->pid)) {
      throw PeerLostError("keras-ring: rank " + std::to_string(world_ranks_[peer]) + " (pid " +
                        std::to_string(h->pid) +
                        ") died in the middle of a shared-memory collective");
    }
    if (Clock::now() - since > timeout_) {
      throw PeerLostError("keras-ring: rank " + std::to_string(world_ranks_[rank_]) + " waited " +
                        FormatSeconds(timeout_.count() / 1e3) +
                        " s (KERAS_RING_TIMEOUT) for rank " + std::to_string(world_ranks_[peer]) +
                        " in a shared-memory collective: rank " +
                        std::to_string(world_ranks_[peer]) + " is stuck or stopped");
    }
  }
}

void ShmGroup::Arrive(uint64_t step) {
  peers_[rank_].header->step.store(step, std::memory_order_release);
  for (int q = 0; q < size(); ++q) {
    if (q != rank_) WaitFor(q, step);
  }
}

// One round per slot's worth of elements. With p ranks the round's elements
// are cut into p blocks of whole cache lines (the last ones may be short or
// empty); rank c owns block c. Steps, each ended by every rank arriving:
//
//   1. copy in:  own slot <- the round's elements of this rank's input
//   2. reduce:   own slot's block r (op)= block r of every peer's slot,
//                then o.combine(block r), then post-scale it
//   then copy out: output <- block c of rank c's slot, for every c
//
// Copying out is not waited for: the next round fills the other slot, and
// the round after it can only start filling this one once every rank has
// arrived at the end of the next round's step 1, i.e. has finished copying
// out of this one.
void ShmGroup::Allreduce(const ShmAllreduceOptions& o) {
  const DataType wire = o.wire_dtype.value_or(o.dtype);
  const size_t esize = DataTypeSize(wire);
  const size_t span_esize = DataTypeSize(o.dtype);
  std::vector<size_t> starts;
  size_t total = 0;
  for (const ShmSpan& s : o.spans) {
    starts.push_back(total);
    total += s.count;
  }
  if (total == 0) return;
  const int p = size();
  double postscale = o.postscale_factor;
  const ReduceOp op = SumForAverage(o.op, p, &postscale);
  const size_t round_bytes =
      o.round_bytes ? std::max(kAlign, std::min(o.round_bytes, slot_bytes_)) : slot_bytes_;
  const size_t per_round = round_bytes / esize;
  const size_t align = kAlign / esize;
  // This rank's own block need not be copied in: it is reduced straight from
  // the input into the slot (dst = input op first peer's), a sixth less
  // memory traffic at 2 ranks. Not when the input must be converted or
  // scaled on the way in.
  const bool reduce_from_input = p > 1 && wire == o.dtype && o.prescale_factor == 1.0;
  for (size_t begin = 0; begin < total; begin += per_round) {
    const uint64_t round = step_ / 2;
    const size_t n = std::min(per_round, total - begin);
    char* mine = Slot(rank_, round);
    const size_t block = (n / p + (n % p != 0) + align - 1) / align * align;
    auto block_range = [&](int c, size_t* first, size_t* count) {
      *first = std::min(n, c * block);
      *count = std::min(n, *first + block) - *first;
    };
    size_t first, count;
    block_range(rank_, &first, &count);
    auto copy_in = [&](size_t from, size_t elements) {
      ForEachPiece(o.spans, starts, begin + from, elements, false, span_esize,
                   [&](char* in, size_t pieces, size_t at) {
                     CopyElements(mine + (from + at) * esize, wire, in, o.dtype, pieces);
                   });
    };
    if (reduce_from_input) {
      copy_in(0, first);
      copy_in(first + count, n - first - count);
    } else {
      copy_in(0, n);
      ScaleBuffer(mine, n, wire, o.prescale_factor);
    }
    Arrive(step_ + 1);

    bool reduced = !reduce_from_input;  // the slot's own block holds this rank's part
    for (int q = 0; q < p && count; ++q) {
      if (q == rank_) continue;
      const char* theirs = Slot(q, round) + first * esize;
      if (reduced) {
        ReduceInto(mine + first * esize, theirs, count, wire, op);
        continue;
      }
      ForEachPiece(o.spans, starts, begin + first, count, false, span_esize,
                   [&](char* in, size_t pieces, size_t at) {
                     ReduceTo(mine + (first + at) * esize, in, theirs + at * esize, pieces,
                              wire, op);
                   });
      reduced = true;
    }
    if (o.combine) o.combine(mine + first * esize, count);
    ScaleBuffer(mine + first * esize, count, wire, postscale);
    Arrive(step_ + 2);
    step_ += 2;

    for (int c = 0; c < p; ++c) {
      block_range(c, &first, &count);
      const char* done = Slot(c, round) + first * esize;
      ForEachPiece(o.spans, starts, begin + first, count, true, span_esize,
                   [&](char* out, size_t elements, size_t at) {
                     CopyElements(out, o.dtype, done + at * esize, wire, elements);
                   });
    }
  }
}

}  // namespace keras_ring
