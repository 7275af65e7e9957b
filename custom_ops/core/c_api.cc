// The C ABI: owns the process's Engine, and no exception crosses it (each
// function catches everything and reports KR_INTERNAL with the message).
#include "c_api.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "log.h"
#include "options.h"
#include "reduce.h"
#include "transport/mpi/mpi_world.h"
#include "transport/tcp/store.h"
#include "transport/tcp/tcp_world.h"

using keras_ring::Engine;
using keras_ring::EngineOptions;
using keras_ring::KernelLevel;

namespace {

kr_status WithError(kr_status status, const std::string& message, char* err, size_t err_len) {
  if (err && err_len) {
    std::strncpy(err, message.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return status;
}

// Runs `body`, turning any exception into its status (StatusOf) with its message.
template <typename Body>
kr_status Guarded(char* err, size_t err_len, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    return WithError(keras_ring::StatusOf(e), e.what(), err, err_len);
  } catch (...) {
    return WithError(KR_INTERNAL, "keras-ring: unknown internal error", err, err_len);
  }
}

constexpr const char* kNotInitialized =
    "keras-ring is not initialised (call init() first) or has been shut down";

// Serialises init, shutdown and finalize.
std::mutex lifecycle_mu;
// The engine between init and shutdown; read without the lock by every other
// call (an engine stays alive while a caller holds it).
std::shared_ptr<Engine> current;

std::shared_ptr<Engine> Current() { return std::atomic_load(&current); }

// The engine's shutdown, with lifecycle_mu held.
kr_status ShutdownLocked(std::string* message) {
  std::shared_ptr<Engine> engine = Current();
  if (!engine) return KR_OK;
  const kr_status s = engine->Shutdown(message);
  if (s == KR_OK) std::atomic_store(&current, std::shared_ptr<Engine>());
  return s;
}

// `options` read as far as its caller knew it (see KR_ABI_VERSION).
bool ReadOptions(const kr_init_options* given, kr_init_options* out) {
  *out = KR_INIT_OPTIONS_DEFAULT;
  if (!given) return true;
  if (given->struct_size > sizeof *out || given->struct_size < sizeof(size_t)) return false;
  std::memcpy(out, given, given->struct_size);
  out->struct_size = sizeof *out;
  return true;
}

EngineOptions Options(const kr_init_options& o) {
  EngineOptions options = EngineOptions::FromEnvironment();
  if (o.fusion_threshold >= 0) options.params.fusion_threshold = o.fusion_threshold;
  if (o.cycle_time_ms >= 0) options.params.cycle_time_ms = o.cycle_time_ms;
  if (o.stall_check_seconds >= 0) options.stall_check = keras_ring::Seconds(o.stall_check_seconds);
  if (o.stall_shutdown_seconds >= 0) {
    options.stall_shutdown = keras_ring::Seconds(o.stall_shutdown_seconds);
  }
  if (o.cache_capacity >= 0) options.cache_capacity = o.cache_capacity;
  if (o.timeout_seconds > 0) {
    options.timeout = std::chrono::milliseconds(static_cast<long long>(o.timeout_seconds * 1e3));
  }
  if (o.rank >= 0) options.tcp.rank = o.rank;
  if (o.size >= 0) options.tcp.size = o.size;
  if (o.world_name != nullptr) options.tcp.world_name = o.world_name;
  return options;
}

// The world `options` ask for.
std::unique_ptr<keras_ring::World> NewWorld(const EngineOptions& options) {
  if (options.transport != "tcp") return keras_ring::NewMpiWorld(options.timeout);
  const auto& tcp = options.tcp;
  if (tcp.size < 1 || tcp.rank < 0 || tcp.rank >= tcp.size) {
    throw keras_ring::EngineError(
        "keras-ring: a TCP world needs a rank in [0, size) and a size of at least 1 "
        "(KERAS_RING_RANK and KERAS_RING_SIZE, given by keras-ring-run --transport tcp). "
        "Received: rank " + std::to_string(tcp.rank) + ", size " + std::to_string(tcp.size) +
        " (-1: not given)");
  }
  keras_ring::TcpStoreClient store(tcp.rendezvous, tcp.secret, "rank " + std::to_string(tcp.rank),
                                   options.timeout);
  keras_ring::TcpWorldOptions o;
  o.rank = tcp.rank;
  o.size = tcp.size;
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  o.host = name;
  o.store = &store;
  o.secret = tcp.secret;
  o.timeout = options.timeout;
  // The address this host reaches the store from is one the launcher's host
  // (and so, as a rule, the other hosts) can reach it on; loopback for a
  // one-host job, whose store listens on loopback.
  o.listen_host = store.local_host();
  // Every rank starts its n-th world together (init and shutdown are
  // collective): its keys must not meet the addresses of an earlier one. An
  // elastic job names each world it forms, so that a newcomer meets them.
  static int worlds = 0;
  o.store_prefix = tcp.world_name.empty() ? "tcp_world." + std::to_string(worlds++)
                                          : tcp.world_name;
  return std::make_unique<keras_ring::TcpWorld>(o);
}

// The requests as this engine's kr_request, read as far as their caller
// knew the struct (`copies` holds them where that is not the whole struct).
const kr_request* Normalise(const kr_request* requests, int n, std::vector<kr_request>* copies) {
  const size_t size = requests[0].struct_size;
  if (size == sizeof(kr_request)) return requests;
  if (size > sizeof(kr_request) || size < offsetof(kr_request, ctx) + sizeof(void*)) {
    return nullptr;
  }
  copies->assign(n, kr_request{});
  const char* at = reinterpret_cast<const char*>(requests);
  for (int i = 0; i < n; ++i) std::memcpy(&(*copies)[i], at + size_t(i) * size, size);
  return copies->data();
}

kr_status Enqueue(const kr_request* requests, int n, bool wake, const char* group) {
  std::vector<kr_request> copies;
  const kr_request* all = n > 0 ? Normalise(requests, n, &copies) : requests;
  if (!all) return KR_INVALID_ARGUMENT;
  for (int i = 0; i < n; ++i) {
    if (!all[i].done) return KR_INVALID_ARGUMENT;
  }
  std::shared_ptr<Engine> engine = Current();
  if (!engine) {
    for (int i = 0; i < n; ++i) {
      all[i].done(all[i].ctx, KR_NOT_INITIALIZED, kNotInitialized);
    }
    return KR_NOT_INITIALIZED;
  }
  return engine->Enqueue(all, n, wake, group);
}

}  // namespace

extern "C" {

int kr_abi_version(void) { return KR_ABI_VERSION; }

kr_status kr_init_with_options(const kr_init_options* given, char* err, size_t err_len) {
  return Guarded(err, err_len, [&] {
    kr_init_options o;
    if (!ReadOptions(given, &o)) {
      return WithError(KR_INVALID_ARGUMENT,
                       "keras-ring: kr_init_options has struct_size " +
                           std::to_string(given->struct_size) + "; this engine knows " +
                           std::to_string(sizeof o) + " bytes at most",
                       err, err_len);
    }
    std::lock_guard<std::mutex> lock(lifecycle_mu);
    std::shared_ptr<Engine> engine = Current();
    if (engine && engine->initialized()) return WithError(KR_OK, "", err, err_len);
    std::string message;
    // The engine stopped by itself (another rank shut down, or it failed):
    // finish that shutdown before starting again.
    if (engine && ShutdownLocked(&message) != KR_OK) {
      return WithError(KR_INTERNAL, message, err, err_len);
    }
    keras_ring::ConfigureLog();
    EngineOptions options = Options(o);
    std::atomic_store(&current, std::make_shared<Engine>(options, NewWorld(options)));
    return WithError(KR_OK, "", err, err_len);
  });
}

kr_status kr_init(char* err, size_t err_len) { return kr_init_with_options(nullptr, err, err_len); }

kr_status kr_shutdown(char* err, size_t err_len) {
  return Guarded(err, err_len, [&] {
    std::lock_guard<std::mutex> lock(lifecycle_mu);
    std::string message;
    const kr_status s = ShutdownLocked(&message);
    return WithError(s, message, err, err_len);
  });
}

void kr_finalize(void) {
  Guarded(nullptr, 0, [] {
    std::lock_guard<std::mutex> lock(lifecycle_mu);
    ShutdownLocked(nullptr);
    keras_ring::FinalizeMpi();
    return KR_OK;
  });
}

int kr_is_initialized(void) {
  std::shared_ptr<Engine> engine = Current();
  return engine && engine->initialized() ? 1 : 0;
}

kr_status kr_get_topology(kr_topology* out) {
  std::shared_ptr<Engine> engine = Current();
  if (!engine || !engine->initialized()) return KR_NOT_INITIALIZED;
  *out = engine->topology();
  return KR_OK;
}

kr_status kr_enqueue(const kr_request* request) {
  if (!request) return KR_INVALID_ARGUMENT;
  return Guarded(nullptr, 0, [&] { return Enqueue(request, 1, /*wake=*/true, nullptr); });
}

kr_status kr_enqueue_group(const kr_request* requests, int n, const char* group) {
  if (n < 0 || (n > 0 && !requests)) return KR_INVALID_ARGUMENT;
  return Guarded(nullptr, 0, [&] { return Enqueue(requests, n, /*wake=*/true, group); });
}

kr_status kr_enqueue_and_drive(const kr_request* requests, int n, const char* group,
                               int (*finished)(void* ctx), void* ctx) {
  if (n < 0 || (n > 0 && !requests) || !finished) return KR_INVALID_ARGUMENT;
  return Guarded(nullptr, 0, [&] {
    const kr_status status = Enqueue(requests, n, /*wake=*/false, group);
    if (std::shared_ptr<Engine> engine = Current()) engine->Drive(finished, ctx);
    return status;
  });
}

void kr_drive(int (*finished)(void* ctx), void* ctx) {
  if (!finished) return;
  Guarded(nullptr, 0, [&] {
    if (std::shared_ptr<Engine> engine = Current()) engine->Drive(finished, ctx);
    return KR_OK;
  });
}

void kr_get_stats(kr_stats* out) {
  std::shared_ptr<Engine> engine = Current();
  *out = engine ? engine->stats() : kr_stats{};
}

void kr_get_parameters(kr_parameters* out) {
  std::shared_ptr<Engine> engine = Current();
  *out = engine ? engine->parameters() : kr_parameters{};
}

kr_status kr_start_timeline(const char* file_path, int mark_cycles, char* err, size_t err_len) {
  if (!file_path || !*file_path) {
    return WithError(KR_INVALID_ARGUMENT, "keras-ring: start_timeline needs a file path", err,
                     err_len);
  }
  return Guarded(err, err_len, [&] {
    std::shared_ptr<Engine> engine = Current();
    if (!engine || !engine->initialized()) {
      return WithError(KR_NOT_INITIALIZED,
                       "keras-ring is not initialised: call init() before start_timeline()",
                       err, err_len);
    }
    std::string message;
    kr_status s = engine->StartTimeline(file_path, mark_cycles != 0, &message);
    return WithError(s, message, err, err_len);
  });
}

void kr_stop_timeline(void) {
  if (std::shared_ptr<Engine> engine = Current()) engine->StopTimeline();
}

void kr_log(int level, const char* message, int once) {
  Guarded(nullptr, 0, [&] {
    using keras_ring::LogLevel;
    const auto l = static_cast<LogLevel>(std::min(std::max(level, 0), 4));
    const std::string text = message ? message : "";
    if (once) {
      keras_ring::LogOnce(l, text, text);
    } else {
      keras_ring::Log(l, text);
    }
    return KR_OK;
  });
}

kr_status kr_add_process_set(const int* ranks, int nranks, int32_t* id, char* err,
                             size_t err_len) {
  if (!id || nranks < 0 || (nranks > 0 && !ranks)) {
    return WithError(KR_INVALID_ARGUMENT, "kr_add_process_set: invalid arguments", err, err_len);
  }
  return Guarded(err, err_len, [&] {
    std::shared_ptr<Engine> engine = Current();
    if (!engine) {
      return WithError(KR_NOT_INITIALIZED, kNotInitialized, err, err_len);
    }
    std::string message;
    kr_status s = engine->AddProcessSet(std::vector<int>(ranks, ranks + nranks), id, &message);
    return WithError(s, message, err, err_len);
  });
}

kr_status kr_remove_process_set(int32_t id, char* err, size_t err_len) {
  return Guarded(err, err_len, [&] {
    std::shared_ptr<Engine> engine = Current();
    if (!engine) {
      return WithError(KR_NOT_INITIALIZED, kNotInitialized, err, err_len);
    }
    std::string message;
    kr_status s = engine->RemoveProcessSet(id, &message);
    return WithError(s, message, err, err_len);
  });
}

int kr_process_set_ranks(int32_t id, int* ranks, int max_ranks) {
  std::vector<int> members;
  std::shared_ptr<Engine> engine = Current();
  if (!engine || !engine->ProcessSetRanks(id, &members)) return -1;
  for (int i = 0; i < max_ranks && i < static_cast<int>(members.size()); ++i) ranks[i] = members[i];
  return static_cast<int>(members.size());
}

const char* kr_mpi_library_version(void) {
  static const std::string version = keras_ring::MpiLibraryVersion();
  return version.c_str();
}

const char* kr_cpu_kernels(void) {
  return keras_ring::KernelLevelName(keras_ring::KernelLevelInUse());
}

int kr_cpu_supports_kernels(const char* kernels) {
  char* end = nullptr;
  const KernelLevel level = keras_ring::ParseKernelLevel(kernels ? kernels : "", &end);
  if (*end) return -1;
  return keras_ring::CpuSupports(level) ? 1 : 0;
}

kr_status kr_reduce_into(void* dst, const void* src, size_t count, kr_dtype dtype,
                         kr_reduce_op op, const char* kernels, char* err, size_t err_len) {
  KernelLevel level = keras_ring::KernelLevelInUse();
  if (kernels) {
    char* end = nullptr;
    level = keras_ring::ParseKernelLevel(kernels, &end);
    if (*end || !*kernels) {
      return WithError(KR_INVALID_ARGUMENT,
                       std::string("keras-ring: kernels must be generic, avx2 or avx512. "
                                   "Received: kernels=") + kernels, err, err_len);
    }
  }
  if (!keras_ring::IsReducibleDataType(dtype) || !keras_ring::IsValidReduceOp(op) ||
      op == KR_AVERAGE) {
    return WithError(KR_INVALID_ARGUMENT,
                     "kr_reduce_into: dtype must be a kr_dtype that reductions take (float16 to "
                     "int64) and op sum, min, max or product. "
                     "Received: dtype=" + std::to_string(dtype) + ", op=" + std::to_string(op),
                     err, err_len);
  }
  return Guarded(err, err_len, [&] {
    try {
      keras_ring::ReduceInto(dst, src, count, static_cast<keras_ring::DataType>(dtype),
                             static_cast<keras_ring::ReduceOp>(op), level);
    } catch (const keras_ring::EngineError& e) {
      return WithError(KR_INVALID_ARGUMENT, e.what(), err, err_len);
    }
    return KR_OK;
  });
}

}  // extern "C"
