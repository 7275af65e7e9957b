#include "engine.h"

#include <algorithm>
#include <chrono>
#include <type_traits>
#include <unordered_set>

#include "algorithms.h"
#include "fusion.h"
#include "log.h"
#include "reduce.h"

namespace keras_ring {

namespace {

constexpr int kCoordinator = 0;

// While requests are in flight the loop polls the world; it spins (yielding)
// for a few idle passes, then sleeps with a backoff capped at kMaxPollSleep.
// With no request in flight it sleeps until one arrives: an idle engine
// costs nothing.
constexpr int kSpinPasses = 32;
constexpr auto kMaxPollSleep = std::chrono::microseconds(1000);

// The engine whose pass this thread is running, if any (see Drive).
thread_local const void* running_pass = nullptr;

// A caller lending its thread (Drive) spins this long without progress
// before it hands over. Measured (docs/performance.md): 32 passes, as the
// background thread spins, handed over too soon when the ranks were tens of
// microseconds apart, and the hand-off then cost more than the spin saved.
constexpr auto kDriveSpin = std::chrono::microseconds(200);

std::chrono::microseconds PollSleep(int idle_passes) {
  int doublings = std::min(idle_passes - kSpinPasses, 7);
  return std::min(kMaxPollSleep, std::chrono::microseconds(10) * (1 << doublings));
}

void SetError(std::string* error, const std::string& message) {
  if (error) *error = message;
}

// The largest shared-memory round the autotuner tries.
constexpr size_t kShmSlotBytesAutotune = size_t(4) << 20;

// How often an otherwise idle coordinator wakes to receive ready lists and
// look for stalls: once a second costs nothing measurable.
constexpr auto kStallTick = std::chrono::seconds(1);
// How often rank 0 looks for ranks that tensors have waited the timeout for
// (CheckOverdueRanks), and for the answers of those it asked; how long it
// waits for an answer: an idle rank takes its question in once a stall tick.
constexpr auto kOverdueTick = std::chrono::milliseconds(100);
constexpr auto kOverdueAnswerWait = kStallTick + kAnswerWait + std::chrono::seconds(1);
// How often a rank looks whether the processes of its shared-memory peers
// still exist (CheckLocalPeers): a peer that died while this rank waits for
// its next submission, or for its shutdown, is named within this.
constexpr auto kPeerCheckTick = std::chrono::seconds(1);
// How often an idle coordinator looks for ready lists of sets it is not in:
// the first collective such a set runs while rank 0 idles waits up to this
// long (later ones find rank 0 polling); measured idle cost about 0.5% of a core.
constexpr auto kOutsideSetPoll = std::chrono::milliseconds(10);
// A rank waiting for rank 0's answer asks it this often whether it is alive
// (a ready list of this set id, which rank 0 answers with an empty list).
constexpr auto kPingInterval = std::chrono::seconds(1);
constexpr int32_t kPingSet = -1;
// How much longer than KERAS_RING_TIMEOUT such a rank waits for any word
// from rank 0: rank 0 itself waiting (bounded) on a stuck rank must be the
// one to fail first and name that rank (its pongs can lag by a ping interval
// and a stall tick).
constexpr auto kCoordinatorGrace = std::chrono::seconds(5);

// Why alltoall cannot split `rows` rows as asked, or "".
std::string CheckSplits(const std::vector<int64_t>& splits, int64_t rows, int size) {
  const std::string received = "received splits of length " + std::to_string(splits.size()) +
                               " for a first dimension of " + std::to_string(rows);
  if (splits.empty()) {
    if (rows % size == 0) return "";
    return "alltoall without splits needs a first dimension divisible by the number of ranks (" +
           std::to_string(size) + "); got " + std::to_string(rows) + ". Pass splits";
  }
  if (splits.size() != size_t(size)) {
    return "alltoall needs one split per rank (" + std::to_string(size) + "); " + received;
  }
  for (int64_t s : splits) {
    if (s < 0) return "alltoall splits must not be negative; " + received;
  }
  int64_t total = 0;
  for (int64_t s : splits) {
    if (s > rows - total) {  // without overflowing
      return "alltoall splits must add up to the first dimension; they add up to more, the "
             "first dimension is " + std::to_string(rows);
    }
    total += s;
  }
  if (total != rows) {
    return "alltoall splits must add up to the first dimension; they add up to " +
           std::to_string(total) + ", the first dimension is " + std::to_string(rows);
  }
  return "";
}

std::string RankList(const std::vector<int>& ranks) {
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  return "[" + listed + "]";
}

}  // namespace

Engine::Engine(EngineOptions options, std::unique_ptr<World> world)
    : options_(std::move(options)),
      world_(std::move(world)),
      executor_(
          params_, observers_,
          [this](const std::vector<int>& ranks, int32_t* id) { CreateProcessSet(ranks, id); },
          [this](int32_t id) { DestroyProcessSet(id); }) {
  Start();
}

Engine::~Engine() { Shutdown(nullptr); }

bool Engine::initialized() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void Engine::Start() {
  UseKernelLevel(options_.kernels);
  TunedParams params = options_.params;
  autotune_ = options_.autotune;
  kr_topology t{};
  t.rank = world_->rank();
  t.size = world_->size();
  SetLogRank(t.rank);
  const ThreadLogRank log_rank(t.rank);
  ProcessSet& world = sets_[0];
  for (int r = 0; r < t.size; ++r) world.ranks.push_back(r);
  world.rank = t.rank;
  world.transport = world_->Connect(world.ranks, GroupId(0, 0));

  // The host topology, from every rank's host name.
  constexpr size_t kNameBytes = 256;
  std::string mine = options_.host_name.empty() ? world_->host() : options_.host_name;
  mine.resize(kNameBytes, '\0');
  std::vector<char> names(kNameBytes * t.size);
  AllgatherBytes(*world.transport, mine.data(), kNameBytes, names.data());
  hosts_.clear();
  for (int r = 0; r < t.size; ++r) hosts_.emplace_back(names.data() + r * kNameBytes);
  const HostLayout layout(world.ranks, hosts_, t.rank);
  t.local_rank = layout.local_rank;
  t.local_size = static_cast<int>(layout.local.size());
  t.cross_rank = IndexOf(layout.cross, t.rank);
  t.cross_size = static_cast<int>(layout.cross.size());
  t.is_homogeneous = layout.min_local == layout.max_local;
  t.mpi_threads_supported = world_->threads_supported();
  topology_ = t;

  // Every rank runs with rank 0's settings, as Horovod does: the ranks must
  // cut a group into the same collectives and pick the same algorithms.
  static_assert(std::is_trivially_copyable<TunedParams>::value, "sent as bytes");
  BroadcastOptions bcast;
  bcast.buffer = &params;
  bcast.bytes = sizeof params;
  Broadcast(*world.transport, bcast);
  if (params != options_.params) {
    Log(LogLevel::kWarning, "this rank's settings (" + options_.params.Describe() +
                                ") differ from rank 0's; every rank uses rank 0's (" +
                                params.Describe() + ")");
  }
  // Alone, a collective is a copy at most: packing a fusion buffer would
  // only add two more.
  if (t.size == 1) {
    params.fusion_threshold = 0;
    autotune_ = false;  // nothing to tune
  }
  params_ = params;
  coordinating_ = t.rank == kCoordinator;
  if (coordinating_) {
    world.coordinator = std::make_unique<Coordinator>(world.size(), options_.cache_capacity);
  } else {
    // Control messages come from rank 0 only: another rank's connection
    // ending is no failure of the control channel (a rank that shut down
    // cleanly may close it before rank 0's word of the shutdown arrives; a
    // collective that needs a lost rank fails by itself, and rank 0 tells
    // every rank of one it lost).
    for (int r = 0; r < t.size; ++r) {
      if (r != kCoordinator && r != t.rank) world_->Release(r);
    }
  }
  SetUpSharedMemory(world, 0, *world_, hosts_, SharedMemory());
  if (autotune_ && coordinating_) {
    AutotuneOptions tuning = options_.tuning;
    // The crossover matters only where allreduces can go over the network.
    tuning.tune_small_allreduce =
        !world.shm || world.shm_oversubscribed || world.cross != nullptr;
    autotuner_ = std::make_unique<Autotuner>(params_, tuning);
  }
  set_ranks_ = {{0, world.ranks}};
  running_ = true;
  thread_ = std::thread(&Engine::Loop, this);
  KR_LOG(kInfo, "engine started: rank " + std::to_string(t.rank) + " of " +
                    std::to_string(t.size) + ", " + params_.Describe() + ", cache capacity " +
                    std::to_string(options_.cache_capacity) + (autotune_ ? ", autotuning" : ""));
}

kr_parameters Engine::parameters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {params_.fusion_threshold, params_.cycle_time_ms, params_.segment_bytes,
          params_.small_allreduce_bytes, autotune_ ? 1 + autotune_done_ : 0};
}
void Engine::Apply(const TunedParams& params, bool tuned) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    params_ = params;
    autotune_done_ = tuned;
  }
  KR_LOG(kDebug, "autotune: trying " + params.Describe());
  if (tuned) KR_LOG(kInfo, "autotune chose " + params.Describe());
}

void Engine::Tune(const ResponseList& list) {
  std::vector<const std::string*> names;
  uint64_t bytes = 0;
  for (const Response& resp : list.responses) {
    // The sets this rank is in (their cached names were looked up in Execute).
    auto found = sets_.find(resp.process_set);
    if (found == sets_.end() || found->second.rank < 0 || !resp.error.empty()) continue;
    for (const std::string& name : resp.names) names.push_back(&name);
    bytes += resp.bytes;
  }
  if (autotuner_->Observe(names, bytes, Autotuner::Clock::now())) params_changed_ = true;
}

kr_status Engine::Shutdown(std::string* error) {
  if (running_pass == this || std::this_thread::get_id() == thread_.get_id()) {
    SetError(error, "keras-ring: shutdown() cannot be called from the engine's own thread (a "
                    "request's completion callback); call it from another thread");
    return KR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) return KR_OK;
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  thread_.join();
  timeline_.Stop();
  std::lock_guard<std::mutex> lock(mu_);
  running_ = false;
  stopped_ = {};
  sets_.clear();
  set_ranks_.clear();
  executor_.Release();
  SetError(error, "");
  return KR_OK;
}

kr_status Engine::Prepare(const kr_request& r, Request* out) {
  auto refuse = [&](kr_status status, const std::string& message) {
    r.done(r.ctx, status, message.c_str());
    return status;
  };
  // Filled in place: a request is prepared for every tensor of every step.
  Request& req = *out;
  req.meta.name = r.name ? r.name : "";
  auto bad = [&](const std::string& what) {
    return refuse(KR_INVALID_ARGUMENT, "keras-ring: invalid request for tensor '" +
                                           req.meta.name + "': " + what);
  };
  if (req.meta.name.empty()) return bad("a tensor name is required");
  if (!IsValidCollective(r.collective)) return bad("unknown collective " + std::to_string(r.collective));
  if (!IsValidDataType(r.dtype)) return bad("unsupported dtype code " + std::to_string(r.dtype));
  if (r.ndim < 0 || (r.ndim > 0 && !r.shape)) return bad("invalid shape");
  if (r.device != KR_DEVICE_CPU) return bad("only host (CPU) memory is supported in this build");

  req.meta.collective = static_cast<Collective>(r.collective);
  req.meta.dtype = static_cast<DataType>(r.dtype);
  req.meta.wire_dtype = req.meta.dtype;
  req.meta.shape.assign(r.shape, r.shape + r.ndim);
  for (int64_t d : req.meta.shape) {
    if (d < 0) return bad("negative dimension in shape");
  }
  const Collective c = req.meta.collective;
  const bool allocates = c == Collective::kAllgather || c == Collective::kReducescatter ||
                         c == Collective::kAlltoall;
  if (c == Collective::kAllreduce || c == Collective::kReducescatter) {
    if (!IsReducibleDataType(r.dtype)) return bad(NotReducibleMessage(c, req.meta.dtype));
    if (!IsValidReduceOp(r.reduce_op)) return bad("unknown reduce op " + std::to_string(r.reduce_op));
    req.meta.op = static_cast<ReduceOp>(r.reduce_op);
    req.meta.prescale_factor = r.prescale_factor;
    req.meta.postscale_factor = r.postscale_factor;
    if (r.compression < KR_COMPRESSION_NONE || r.compression > KR_COMPRESSION_BF16) {
      return bad("unknown compression " + std::to_string(r.compression));
    }
    const bool compressible =
        req.meta.dtype == DataType::kFloat32 || req.meta.dtype == DataType::kFloat64;
    if (compressible && r.compression != KR_COMPRESSION_NONE) {
      req.meta.wire_dtype =
          r.compression == KR_COMPRESSION_FP16 ? DataType::kFloat16 : DataType::kBFloat16;
    }
  }
  if (c == Collective::kBroadcast) req.meta.root_rank = r.root_rank;
  if (allocates) {
    if (r.ndim < 1) return bad(std::string(CollectiveName(c)) + " needs a tensor of rank 1 or more");
    if (!r.allocate_output) {
      return bad(std::string(CollectiveName(c)) + " needs an allocate_output callback");
    }
  }
  if (c == Collective::kJoin) {
    if (r.ndim != 0 || r.dtype != KR_INT32 || !r.output) {
      return bad("join takes no input and writes one int32 (shape [], an output buffer)");
    }
  } else if (ElementCount(req.meta.shape) > 0 && (!r.input || (!allocates && !r.output))) {
    return bad("input and output buffers are required");
  }
  if (c == Collective::kAlltoall) {
    if (r.nsplits < 0 || (r.nsplits > 0 && !r.splits)) return bad("invalid splits");
    req.meta.splits.assign(r.splits, r.splits + r.nsplits);
    req.received_splits = r.received_splits;
  }
  req.input = r.input;
  req.output = r.output;
  req.device = r.device;
  req.allocate_output = r.allocate_output;
  req.done = r.done;
  req.ctx = r.ctx;
  req.process_set = r.process_set;
  req.submitted = observers_.Now();
  return KR_OK;
}

kr_status Engine::Enqueue(const kr_request* requests, int n, bool wake, const char* group) {
  std::vector<Request> prepared;
  prepared.reserve(n);
  kr_status status = KR_OK;
  for (int i = 0; i < n; ++i) {
    prepared.emplace_back();
    kr_status s = Prepare(requests[i], &prepared.back());
    if (s != KR_OK) {
      prepared.pop_back();
      if (status == KR_OK) status = s;
    }
  }
  if (group && *group && n > 1) {
    // A member refused here is missing from the group, which then fails on
    // every rank as a disagreement instead of leaving the others waiting;
    // with every member refused, the group still goes, as this rank's
    // objection.
    Request g;
    g.group = true;
    if (prepared.empty()) {
      g.meta.error = "every tensor of the group was refused here (each one's error says why)";
    } else {
      g.meta = prepared[0].meta;  // its reduction fields: what fusion compares
      g.meta.shape.clear();
      g.submitted = prepared[0].submitted;
    }
    g.meta.name = group;
    g.meta.collective = Collective::kAllreduce;
    g.process_set = requests[0].process_set;
    for (const Request& m : prepared) {
      if (m.meta.collective != Collective::kAllreduce || m.process_set != g.process_set) {
        // Every member fails, here and (as this rank's objection) on the other ranks.
        g.meta.error = "a group holds allreduces of one process set; tensor '" + m.meta.name +
                       "' is " +
                       (m.meta.collective != Collective::kAllreduce
                            ? "a " + std::string(CollectiveName(m.meta.collective))
                            : "of process set " + std::to_string(m.process_set));
        for (const Request& r : prepared) {
          r.Complete(KR_INVALID_ARGUMENT,
                     "keras-ring: invalid group '" + g.meta.name + "': " + g.meta.error);
        }
        prepared.clear();
        status = KR_INVALID_ARGUMENT;
        break;
      }
    }
    g.members = std::move(prepared);
    prepared.clear();
    prepared.push_back(std::move(g));
  }
  if (prepared.empty()) return status;
  std::lock_guard<std::mutex> lock(mu_);
  auto refuse_all = [&](kr_status s, const std::string& why) {
    for (const Request& req : prepared) req.Complete(s, why + " (tensor '" + req.meta.name + "')");
    return s;
  };
  if (!stopped_.why.empty()) {
    // The engine stopped by itself: say why, until shutdown() or init().
    return refuse_all(stopped_.status, stopped_.why);
  }
  if (!running_ || shutdown_requested_) {
    return refuse_all(KR_NOT_INITIALIZED, "keras-ring is not initialised (call init() first) "
                                          "or has been shut down");
  }
  // The loop takes the whole queue at once, so only the first request of a
  // burst needs to wake it; a caller driving the loop takes them itself, or
  // hands them to the background thread when it leaves.
  wake = wake && queue_.empty() && drivers_ == 0;
  for (Request& req : prepared) queue_.push_back(std::move(req));
  if (wake) cv_.notify_one();
  return status;
}

bool Engine::InFlight() const {
  for (const auto& [id, set] : sets_) {
    if (!set.pending.empty()) return true;
  }
  return false;
}

namespace {

// Whether `req` is the request cached as `cached` (a group: member by member,
// without building the group's description).
bool SameAsCached(const TensorMeta& cached, const Request& req) {
  if (!req.group) return cached == req.meta;
  if (!cached.members || cached.members->size() != req.members.size() ||
      cached.name != req.meta.name || !SameReduction(cached, req.meta) ||
      cached.error != req.meta.error) {
    return false;
  }
  for (size_t i = 0; i < req.members.size(); ++i) {
    if (!((*cached.members)[i] == req.members[i].meta)) return false;
  }
  return true;
}

// The first name that two of a group's members share, or "".
std::string RepeatedMember(const Request& req) {
  std::unordered_set<std::string> names;
  for (const Request& m : req.members) {
    if (!names.insert(m.meta.name).second) return m.meta.name;
  }
  return "";
}

}  // namespace

bool Engine::Admit(Request& req, std::unordered_map<int32_t, ReadyList>* ready) {
  const std::string& name = req.meta.name;
  auto refuse = [&](const std::string& why) {
    req.Complete(KR_INVALID_ARGUMENT,
                 "keras-ring: invalid request for tensor '" + name + "': " + why);
    return false;
  };
  auto found = sets_.find(req.process_set);
  auto set_name = [&] { return "process set " + std::to_string(req.process_set); };
  if (found == sets_.end()) {
    return refuse(set_name() + " does not exist (add_process_set() returns the ids; a removed "
                  "set is gone)");
  }
  ProcessSet& set = found->second;
  if (set.rank < 0) {
    std::string ranks;
    for (int r : set.ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return refuse("rank " + std::to_string(topology_.rank) + " is not in " + set_name() +
                  " (ranks [" + ranks + "])");
  }
  // Arguments that may be wrong on one rank only: every rank fails the name.
  TensorMeta& m = req.meta;
  if (m.collective == Collective::kBroadcast && (m.root_rank < 0 || m.root_rank >= set.size())) {
    m.error = "root_rank " + std::to_string(m.root_rank) + " is outside [0, " +
              std::to_string(set.size()) + ")" +
              (req.process_set ? " (ranks within " + set_name() + ")" : "");
  }
  if (m.collective == Collective::kAlltoall) m.error = CheckSplits(m.splits, m.shape[0], set.size());
  if (set.joined) {
    return refuse("rank " + std::to_string(topology_.rank) + " has joined " + set_name() +
                  "; until every rank has joined it takes part in the others' collectives "
                  "with zeros and may not submit its own");
  }
  if (set.pending.count(name)) {
    req.Complete(KR_INVALID_ARGUMENT,
                 "keras-ring: tensor '" + name + "' was submitted again while a "
                 "collective of the same name is still in flight on rank " +
                     std::to_string(topology_.rank) + "; names must be unique among "
                     "concurrent operations (pass name=...)");
    return false;
  }
  ReadyList& list = (*ready)[req.process_set];
  list.process_set = req.process_set;
  ReadyList::Item item;
  auto cached = set.cache_ids.find(name);
  const bool by_id =
      cached != set.cache_ids.end() && SameAsCached(set.cached[cached->second], req);
  if (by_id) {
    item.cache_id = cached->second;
  } else {
    // A group described in full has new members: their names must be unique
    // (a cached group's were checked when it was described).
    const std::string twice = req.group ? RepeatedMember(req) : "";
    if (!twice.empty()) {
      m.error = "it names two tensors '" + twice + "'; names must be unique within a group";
      req.Complete(KR_INVALID_ARGUMENT, "keras-ring: invalid group '" + name + "': " + m.error);
      req.members.clear();
    }
    req.DescribeMembers();
    item.meta = m;
  }
  KR_LOG(kTrace, "submitted tensor '" + name + "' (" + m.Describe() + ")" +
                     (by_id ? " by cache id" : ""));
  list.items.push_back(std::move(item));
  observers_.Negotiating(req, by_id);
  set.joined = set.joined || m.collective == Collective::kJoin;
  set.pending.emplace(name, std::move(req));
  return true;
}

void Engine::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto has_news = [&] {
        return loop_over_ ||
               (drivers_ == 0 && (resume_ || !queue_.empty() ||
                                  (shutdown_requested_ && !pace_.shutdown_sent)));
      };
      if (drivers_ > 0 || !pace_.in_flight) {
        // Idle, or a caller runs the loop. The coordinator still looks for
        // stalls and for other ranks' shutdowns once a second, and more often
        // for sets it is not in, whose members may need it while it has
        // nothing of its own to do; every rank answers rank 0's question
        // whether it is alive (CheckOverdueRanks) within a second.
        cv_.wait_for(lock, coordinating_ && pace_.outside_a_set ? kOutsideSetPoll : kStallTick,
                     has_news);
      } else if (pace_.idle_passes > kSpinPasses && !has_news()) {
        cv_.wait_for(lock, PollSleep(pace_.idle_passes), has_news);
      }
      if (loop_over_) return;
      if (drivers_ > 0) continue;
      resume_ = false;
      if (pace_.idle_passes > 0 && pace_.idle_passes <= kSpinPasses) {
        lock.unlock();
        std::this_thread::yield();
      }
    }
    std::lock_guard<std::mutex> pass(pass_mu_);
    bool progress;
    if (loop_over_ || !Step(&progress)) return;
  }
}

void Engine::Drive(int (*finished)(void* ctx), void* ctx) {
  // A callback run by a pass may submit and drive again (a TF kernel that
  // TensorFlow starts from another kernel's completion): the pass this
  // thread is already running takes care of it.
  if (running_pass == this) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (loop_over_ || !running_) return;
    ++drivers_;
  }
  {
    // The background thread finishes the pass it may be in, then leaves the
    // loop to this caller until the last driver has gone.
    std::lock_guard<std::mutex> pass(pass_mu_);
    // Spins (yielding) while its peers catch up; once they have kept it idle
    // for kDriveSpin, hands over to the background thread, which sleeps
    // between polls.
    auto idle_since = std::chrono::steady_clock::now();
    bool progress = false;
    while (!loop_over_ && !finished(ctx) && Step(&progress)) {
      const auto now = std::chrono::steady_clock::now();
      if (progress) {
        idle_since = now;
      } else if (now - idle_since > kDriveSpin) {
        break;
      } else {
        std::this_thread::yield();
      }
    }
  }
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--drivers_ == 0 && !loop_over_ &&
        (pace_.in_flight || !queue_.empty() || shutdown_requested_)) {
      resume_ = wake = true;
      // The background thread starts its poll backoff afresh (20 us, then
      // doubling) rather than at the full sleep that the caller's idle spin
      // has earned: a peer that is just late is then heard within tens of
      // microseconds, not a millisecond later (measured in model.fit at 2
      // ranks: responses reached the second rank up to 2 ms late).
      pace_.idle_passes = std::min(pace_.idle_passes, kSpinPasses);
    }
  }
  if (wake) cv_.notify_one();
}

bool Engine::Step(bool* progress) {
  running_pass = this;
  struct Clear {
    ~Clear() { running_pass = nullptr; }
  } clear;
  const ThreadLogRank log_rank(topology_.rank);
  try {
    const int shut_down_by = Pass(progress);
    if (shut_down_by < 0) return true;
    // Every rank sends the coordinator exactly one shutdown message (its own
    // request, or this acknowledgement) and the coordinator waits for all of
    // them, so no control message is left behind on the communicator.
    // This rank's process may end from now on: its shared-memory peers
    // (CheckLocalPeers) need not know it before they leave too.
    for (auto& entry : sets_) {
      if (entry.second.shm) entry.second.shm->Stop();
    }
    if (!shutdown_sent_) {
      ReadyList last;
      last.shutdown = true;
      SendReadyList(std::move(last));
      shutdown_sent_ = true;
    }
    if (coordinating_) AwaitShutdowns();
    world_->Flush();
    StopAccepting(shut_down_by == topology_.rank ? KR_NOT_INITIALIZED : KR_PEER_LOST,
                  shut_down_by == topology_.rank
                      ? "keras-ring has been shut down"
                      : "keras-ring: rank " + std::to_string(shut_down_by) +
                            " shut down (shutdown() or its process exiting), which stops the "
                            "engine of every rank; init() starts it again");
  } catch (const std::exception& e) {
    // The ranks can no longer be assumed to be in step: fail everything, tell
    // the others, and refuse new work until shutdown() (which returns at
    // once: no negotiation).
    KR_LOG(kError, std::string("the engine stopped: ") + e.what());
    FailAll(StatusOf(e), e.what());
    Abandon(e.what());
    StopAccepting(StatusOf(e), e.what());
  }
  return false;
}

int Engine::Pass(bool* progress) {
  std::deque<Request> fresh;
  bool shutdown;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fresh.swap(queue_);
    shutdown = shutdown_requested_;
  }
  *progress = !fresh.empty();
  std::unordered_map<int32_t, ReadyList> ready;
  for (auto& req : fresh) Admit(req, &ready);
  if (shutdown && !shutdown_sent_) {
    ready[0].shutdown = true;
    shutdown_sent_ = true;
  }
  for (auto& entry : ready) SendReadyList(std::move(entry.second));
  ResponseList list;
  bool got = coordinating_ ? ReceiveOnCoordinator(&list) : ReceiveResponses(&list);
  if (got) {
    *progress = true;
    Execute(list);
    if (autotuner_ && !autotuner_->done()) Tune(list);
    if (list.shutdown_rank >= 0) {
      // Every rank now leaves; only the coordinator has more to say (it
      // waits for every rank's acknowledgement, releasing each as it comes).
      return list.shutdown_rank;
    }
  }
  if (!coordinating_) CheckCoordinator(got);
  CheckLocalPeers();
  if (*progress) observers_.Cycle(fresh.size(), got ? list.responses.size() : 0);
  const bool in_flight = InFlight() || shutdown_sent_ || CoordinatorBusy();
  std::lock_guard<std::mutex> lock(mu_);
  pace_.in_flight = in_flight;
  pace_.outside_a_set = OutsideASet();
  pace_.shutdown_sent = shutdown_sent_;
  pace_.idle_passes = *progress ? 0 : pace_.idle_passes + 1;
  return -1;
}

void Engine::CheckCoordinator(bool heard) {
  // A stopped (SIGSTOP) rank 0 answers nothing and fails nothing: the rank
  // would otherwise wait for its responses, or its shutdown, forever.
  const auto now = std::chrono::steady_clock::now();
  const bool waiting = !heard && (InFlight() || shutdown_sent_);
  if (!waiting || !waiting_on_coordinator_) quiet_since_ = pinged_ = now;
  waiting_on_coordinator_ = waiting;
  if (!waiting) return;
  const auto bound = world_->timeout() + kCoordinatorGrace;
  if (now - quiet_since_ > bound) {
    throw PeerLostError(
        "keras-ring: rank " + std::to_string(topology_.rank) + " heard nothing from rank 0 " +
        "(the coordinator) for " + FormatSeconds(std::chrono::duration<double>(bound).count()) +
        " s (KERAS_RING_TIMEOUT + " +
        FormatSeconds(std::chrono::duration<double>(kCoordinatorGrace).count()) +
        " s) while waiting for its answer: rank 0 is stuck or stopped");
  }
  if (now - pinged_ >= kPingInterval) {
    ReadyList ping;
    ping.process_set = kPingSet;
    world_->Post(kCoordinator, std::make_shared<const std::vector<char>>(SerializeReadyList(ping)));
    pinged_ = now;
  }
}

bool Engine::CoordinatorBusy() const {
  if (!coordinating_) return false;
  if (!decided_.empty()) return true;  // held back by the cycle time
  for (const auto& [id, set] : sets_) {
    // Names some ranks wait for: poll (backing off to 1 ms) instead of
    // sleeping until the next tick.
    if (set.coordinator->HasWaiting()) return true;
  }
  return false;
}

bool Engine::OutsideASet() const {
  for (const auto& [id, set] : sets_) {
    if (set.rank < 0) return true;
  }
  return false;
}

void Engine::Abandon(const std::string& reason) {
  // Peers waiting in shared memory for this rank stop waiting.
  for (auto& entry : sets_) {
    if (entry.second.shm) entry.second.shm->Stop();
  }
  // Best effort: the transport may be what failed.
  try {
    if (coordinating_) {
      ResponseList list;
      list.shutdown_rank = topology_.rank;
      list.shutdown_reason = reason;
      SendResponses(list);
    } else if (!shutdown_sent_) {
      ReadyList list;
      list.shutdown = true;
      list.shutdown_reason = reason;
      SendReadyList(std::move(list));
      shutdown_sent_ = true;
    }
    world_->Flush();
  } catch (const std::exception&) {
  }
  world_->Abort(reason);
}

void Engine::StopAccepting(kr_status status, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  running_ = false;
  loop_over_ = true;
  stopped_ = {status, message};
  for (auto& req : queue_) req.Complete(status, message + " (tensor '" + req.meta.name + "')");
  queue_.clear();
  cv_.notify_all();  // the background thread ends too, if a caller ran this pass
}

void Engine::AddToCoordinator(int world_rank, ReadyList list) {
  if (list.shutdown) {
    sets_[0].coordinator->RequestShutdown(world_rank, list.shutdown_reason);
    if (world_rank != kCoordinator) world_->Release(world_rank);  // its last message
  }
  auto found = sets_.find(list.process_set);
  // A set removed since the rank sent this: its requests have failed there.
  if (found == sets_.end()) return;
  ProcessSet& set = found->second;
  const int rank = IndexOf(set.ranks, world_rank);
  KR_CHECK(rank >= 0, "rank " + std::to_string(world_rank) + " sent requests for process set " +
                          std::to_string(list.process_set) + ", which it is not in");
  const size_t first_new = decided_.size();
  const auto now = Coordinator::Clock::now();
  for (auto& item : list.items) {
    if (item.cache_id >= 0) {
      set.coordinator->AddCached(rank, item.cache_id, &decided_, now);
    } else {
      set.coordinator->Add(rank, std::move(item.meta), &decided_, now);
    }
  }
  for (size_t i = first_new; i < decided_.size(); ++i) decided_[i].process_set = list.process_set;
}

void Engine::SendReadyList(ReadyList list) {
  if (coordinating_) {
    AddToCoordinator(kCoordinator, std::move(list));
    return;
  }
  world_->Post(kCoordinator, std::make_shared<const std::vector<char>>(SerializeReadyList(list)));
}

void Engine::AwaitShutdowns() {
  const auto deadline = std::chrono::steady_clock::now() + world_->timeout();
  for (;;) {
    const std::vector<int> missing = sets_[0].coordinator->NotShutDown();
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      throw PeerLostError("keras-ring: rank 0 waited " +
                          FormatSeconds(world_->timeout().count() / 1e3) +
                          " s (KERAS_RING_TIMEOUT) for ranks " + RankList(missing) +
                        " to shut down; they are stuck or stopped");
    }
    CheckLocalPeers();
    if (!ReceiveReadyLists()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Engine::CheckLocalPeers() {
  const auto now = std::chrono::steady_clock::now();
  if (now - peers_checked_ < kPeerCheckTick) return;
  peers_checked_ = now;
  for (const auto& entry : sets_) {
    if (entry.second.shm) entry.second.shm->CheckPeers();
  }
}

bool Engine::ReceiveReadyLists() {
  bool any = false;
  int source;
  std::vector<char> bytes;
  while (world_->Receive(&source, &bytes)) {
    ReadyList list = DeserializeReadyList(bytes);
    if (list.process_set == kPingSet) {
      world_->Post(source,
                   std::make_shared<const std::vector<char>>(SerializeResponses(ResponseList())));
      continue;
    }
    AddToCoordinator(source, std::move(list));
    any = true;
  }
  return any;
}

void Engine::CheckOverdueRanks(std::chrono::steady_clock::time_point now) {
  if (now - overdue_checked_ < kOverdueTick) return;
  overdue_checked_ = now;
  std::map<int, std::string> overdue;
  for (auto& [id, set] : sets_) {
    if (!set.coordinator) continue;
    for (auto& [rank, stall] : set.coordinator->Overdue(now, world_->timeout())) {
      if (rank != topology_.rank) overdue.emplace(rank, std::move(stall));
    }
  }
  for (auto it = asked_.begin(); it != asked_.end();) {
    it = overdue.count(it->first) ? std::next(it) : asked_.erase(it);
  }
  for (auto it = next_ask_.begin(); it != next_ask_.end();) {
    it = overdue.count(it->first) ? std::next(it) : next_ask_.erase(it);
  }
  for (const auto& [rank, stall] : overdue) {
    const auto asked = asked_.find(rank);
    if (asked == asked_.end()) {
      if (now < next_ask_[rank]) continue;
      world_->Ask(rank);
      asked_[rank] = now;
    } else if (world_->Answered(rank)) {
      // Alive: it will submit, or the stall rules end the wait.
      asked_.erase(asked);
      next_ask_[rank] = now + world_->timeout();
    } else if (now - asked->second >= kOverdueAnswerWait) {
      throw PeerLostError("keras-ring: rank " + std::to_string(rank) +
                          " is stuck or stopped (it does not answer): " + stall);
    }
  }
}

bool Engine::ReceiveOnCoordinator(ResponseList* out) {
  ReceiveReadyLists();
  const auto now = Coordinator::Clock::now();
  CheckOverdueRanks(now);
  for (auto& [id, set] : sets_) {
    if (options_.stall_check.count()) {
      for (const std::string& report : set.coordinator->StallReports(now, options_.stall_check)) {
        Log(LogLevel::kWarning, "stall: " + report);
      }
    }
    if (!options_.stall_shutdown.count()) continue;
    const size_t first_new = decided_.size();
    set.coordinator->FailStalled(now, options_.stall_shutdown, &decided_);
    for (size_t i = first_new; i < decided_.size(); ++i) decided_[i].process_set = id;
  }
  out->shutdown_rank = sets_[0].coordinator->FirstShutdownRank();
  if (decided_.empty() && out->shutdown_rank < 0) return false;
  if (decided_since_ == Coordinator::Clock::time_point()) decided_since_ = now;
  // The cycle time holds agreed tensors back for a moment, so that tensors
  // that become ready just after them share their fused collective.
  size_t decided_bytes = 0;
  for (const Response& r : decided_) decided_bytes += r.bytes;
  const auto cycle_time = std::chrono::duration<double, std::milli>(params_.cycle_time_ms);
  if (out->shutdown_rank < 0 && now - decided_since_ < cycle_time &&
      decided_bytes < params_.fusion_threshold) {
    return false;
  }
  decided_since_ = Coordinator::Clock::time_point();
  out->responses = Fuse(std::move(decided_), params_.fusion_threshold);
  if (params_changed_) {
    out->params = autotuner_->params();
    out->tuned = autotuner_->done();
    params_changed_ = false;
  }
  decided_.clear();
  out->shutdown_reason = sets_[0].coordinator->ShutdownReason();
  SendResponses(*out);
  return true;
}

void Engine::SendResponses(const ResponseList& list) {
  // To the members of the sets the responses belong to (everyone for a
  // shutdown): a rank outside them has nothing to run, and an idle one would
  // let the messages pile up.
  std::vector<bool> to(topology_.size, list.shutdown_rank >= 0 || list.params);
  for (const Response& resp : list.responses) {
    auto found = sets_.find(resp.process_set);
    if (found == sets_.end()) continue;
    for (int r : found->second.ranks) to[r] = true;
  }
  auto bytes = std::make_shared<const std::vector<char>>(SerializeResponses(list));
  for (int r = 0; r < topology_.size; ++r) {
    if (r != kCoordinator && to[r]) world_->Post(r, bytes);
  }
}

bool Engine::ReceiveResponses(ResponseList* out) {
  int source;
  std::vector<char> bytes;
  if (!world_->Receive(&source, &bytes)) return false;
  *out = DeserializeResponses(bytes);
  return true;
}

void Engine::Execute(ResponseList& list) {
  if (list.params) Apply(*list.params, list.tuned);
  executor_.Execute(list, sets_);
  if (list.shutdown_rank >= 0) {
    const std::string who = "keras-ring: rank " + std::to_string(list.shutdown_rank);
    // Another rank's shutdown is its leaving the job: an elastic job goes on without it.
    FailAll(list.shutdown_rank == topology_.rank ? KR_ABORTED : KR_PEER_LOST,
            list.shutdown_rank == topology_.rank
                ? "keras-ring: shutdown() was called while this operation was pending"
            : list.shutdown_reason.empty()
                ? who + " shut down (shutdown() or its process exiting) while this operation "
                        "was pending here; it can no longer complete"
                : who + " stopped, its engine failed (" + list.shutdown_reason +
                      "), while this operation was pending here; it can no longer complete");
  }
}

kr_status Engine::StartTimeline(const std::string& path, bool mark_cycles, std::string* error) {
  if (!initialized()) {
    SetError(error, "keras-ring is not initialised: call init() before start_timeline()");
    return KR_NOT_INITIALIZED;
  }
  if (!timeline_.Start(path, topology_.rank, mark_cycles, error)) return KR_INVALID_ARGUMENT;
  KR_LOG(kInfo, "recording the timeline into " + path);
  return KR_OK;
}

void Engine::FailAll(kr_status status, const std::string& message) {
  for (auto& [id, set] : sets_) {
    for (auto& entry : set.pending) {
      entry.second.Complete(status, message + " (tensor '" + entry.first + "')");
    }
    set.pending.clear();
  }
}

void Engine::CreateProcessSet(const std::vector<int>& ranks, int32_t* id) {
  *id = next_set_id_++;
  ProcessSet& set = sets_[*id];
  set.ranks = ranks;
  set.rank = IndexOf(ranks, topology_.rank);
  if (set.rank >= 0) {
    set.transport = world_->Connect(ranks, GroupId(*id, 0));
    SetUpSharedMemory(set, *id, *world_, hosts_, SharedMemory());
  }
  if (coordinating_) {
    set.coordinator = std::make_unique<Coordinator>(set.size(), options_.cache_capacity);
    set.coordinator->SetWorldRanks(ranks, "in process set " + std::to_string(*id) + ", ");
  }
  std::lock_guard<std::mutex> lock(mu_);
  set_ranks_[*id] = ranks;
}

SharedMemoryOptions Engine::SharedMemory() const {
  SharedMemoryOptions o;
  o.enabled = options_.shared_memory;
  o.hierarchical = options_.hierarchical;
  o.slot_bytes = options_.shm_slot_bytes;
  o.largest_round = std::max<uint64_t>(params_.segment_bytes,
                                       autotune_ ? kShmSlotBytesAutotune : 0);
  return o;
}

void Engine::DestroyProcessSet(int32_t id) {
  auto found = sets_.find(id);
  if (found == sets_.end()) return;
  ProcessSet& set = found->second;
  for (auto& entry : set.pending) {
    entry.second.Complete(KR_ABORTED, "keras-ring: process set " + std::to_string(id) +
                                          " was removed while tensor '" + entry.first +
                                          "' was pending in it");
  }
  sets_.erase(found);
  std::lock_guard<std::mutex> lock(mu_);
  set_ranks_.erase(id);
}

bool Engine::ProcessSetRanks(int32_t id, std::vector<int>* ranks) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = set_ranks_.find(id);
  if (found == set_ranks_.end()) return false;
  *ranks = found->second;
  return true;
}

namespace {

// Lets a framework thread wait for an internal request.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  kr_status status = KR_OK;
  std::string message;

  static void Done(void* ctx, kr_status status, const char* message) {
    auto* self = static_cast<Waiter*>(ctx);
    std::lock_guard<std::mutex> lock(self->mu);
    self->status = status;
    self->message = message ? message : "";
    self->finished = true;
    self->cv.notify_all();
  }
};

}  // namespace

kr_status Engine::RunControl(Request req, std::string* error) {
  Waiter waiter;
  req.done = &Waiter::Done;
  req.ctx = &waiter;
  req.meta.dtype = DataType::kInt32;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_ || shutdown_requested_) {
      SetError(error, "keras-ring is not initialised (call init() first) or has been shut down");
      return KR_NOT_INITIALIZED;
    }
    // Every rank makes these calls in the same order, so the counter names
    // them alike everywhere.
    req.meta.name = "keras_ring." + std::string(CollectiveName(req.meta.collective)) + "." +
                    std::to_string(control_calls_++);
    queue_.push_back(std::move(req));
  }
  cv_.notify_one();
  std::unique_lock<std::mutex> lock(waiter.mu);
  waiter.cv.wait(lock, [&] { return waiter.finished; });
  SetError(error, waiter.message);
  return waiter.status;
}

kr_status Engine::AddProcessSet(std::vector<int> ranks, int32_t* id, std::string* error) {
  std::sort(ranks.begin(), ranks.end());
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  // Checked here but agreed like any request, so that every rank takes part
  // even when only some pass bad ranks, and all get the error.
  Request req;
  req.meta.collective = Collective::kAddProcessSet;
  req.meta.splits.assign(ranks.begin(), ranks.end());
  req.output = id;
  const int size = topology().size;
  std::string why;
  if (ranks.empty()) {
    why = "a process set needs at least one rank";
  } else if (std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end()) {
    why = "a rank repeats";
  } else if (ranks.front() < 0 || ranks.back() >= size) {
    why = "ranks must lie in [0, " + std::to_string(size) + ")";
  }
  if (!why.empty()) req.meta.error = "add_process_set: " + why + " (ranks [" + listed + "])";
  return RunControl(std::move(req), error);
}

kr_status Engine::RemoveProcessSet(int32_t id, std::string* error) {
  std::vector<int> ranks;
  Request req;
  req.meta.collective = Collective::kRemoveProcessSet;
  req.meta.splits = {id};
  if (id == 0 || !ProcessSetRanks(id, &ranks)) {
    req.meta.error = "remove_process_set: " +
                     std::string(id == 0 ? "the global process set (id 0) cannot be removed"
                                         : "there is no process set with id " + std::to_string(id));
  }
  return RunControl(std::move(req), error);
}

}  // namespace keras_ring
