// The C ABI over the process's Engine.
#include "c_api.h"

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "engine.h"
#include "log.h"
#include "reduce.h"

using keras_ring::Engine;
using keras_ring::KernelLevel;

namespace {

kr_status WithError(kr_status status, const std::string& message, char* err, size_t err_len) {
  if (err && err_len) {
    std::strncpy(err, message.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return status;
}

}  // namespace

extern "C" {

kr_status kr_init(char* err, size_t err_len) {
  std::string message;
  kr_status s = Engine::Get().Init(&message);
  return WithError(s, message, err, err_len);
}

kr_status kr_shutdown(char* err, size_t err_len) {
  std::string message;
  kr_status s = Engine::Get().Shutdown(&message);
  return WithError(s, message, err, err_len);
}

void kr_finalize(void) { Engine::Get().Finalize(); }

int kr_is_initialized(void) { return Engine::Get().initialized() ? 1 : 0; }

kr_status kr_get_topology(kr_topology* out) {
  if (!Engine::Get().initialized()) return KR_NOT_INITIALIZED;
  *out = Engine::Get().topology();
  return KR_OK;
}

kr_status kr_enqueue(const kr_request* request) {
  if (!request || !request->done) return KR_INVALID_ARGUMENT;
  return Engine::Get().Enqueue(request, 1);
}

kr_status kr_enqueue_and_drive(const kr_request* requests, int n, const char* group,
                               int (*finished)(void* ctx), void* ctx) {
  if (n < 0 || (n > 0 && !requests) || !finished) return KR_INVALID_ARGUMENT;
  for (int i = 0; i < n; ++i) {
    if (!requests[i].done) return KR_INVALID_ARGUMENT;
  }
  kr_status status = Engine::Get().Enqueue(requests, n, /*wake=*/false, group);
  Engine::Get().Drive(finished, ctx);
  return status;
}

void kr_drive(int (*finished)(void* ctx), void* ctx) {
  if (finished) Engine::Get().Drive(finished, ctx);
}

void kr_get_stats(kr_stats* out) { *out = Engine::Get().stats(); }

void kr_get_parameters(kr_parameters* out) { *out = Engine::Get().parameters(); }

kr_status kr_start_timeline(const char* file_path, int mark_cycles, char* err, size_t err_len) {
  if (!file_path || !*file_path) {
    return WithError(KR_INVALID_ARGUMENT, "keras-ring: start_timeline needs a file path", err,
                     err_len);
  }
  std::string message;
  kr_status s = Engine::Get().StartTimeline(file_path, mark_cycles != 0, &message);
  return WithError(s, message, err, err_len);
}

void kr_stop_timeline(void) { Engine::Get().StopTimeline(); }

void kr_log(int level, const char* message, int once) {
  using keras_ring::LogLevel;
  const auto l = static_cast<LogLevel>(std::min(std::max(level, 0), 4));
  const std::string text = message ? message : "";
  if (once) {
    keras_ring::LogOnce(l, text, text);
  } else {
    keras_ring::Log(l, text);
  }
}

kr_status kr_add_process_set(const int* ranks, int nranks, int32_t* id, char* err,
                             size_t err_len) {
  if (!id || nranks < 0 || (nranks > 0 && !ranks)) {
    return WithError(KR_INVALID_ARGUMENT, "kr_add_process_set: invalid arguments", err, err_len);
  }
  std::string message;
  kr_status s = Engine::Get().AddProcessSet(std::vector<int>(ranks, ranks + nranks), id, &message);
  return WithError(s, message, err, err_len);
}

kr_status kr_remove_process_set(int32_t id, char* err, size_t err_len) {
  std::string message;
  kr_status s = Engine::Get().RemoveProcessSet(id, &message);
  return WithError(s, message, err, err_len);
}

int kr_process_set_ranks(int32_t id, int* ranks, int max_ranks) {
  std::vector<int> members;
  if (!Engine::Get().ProcessSetRanks(id, &members)) return -1;
  for (int i = 0; i < max_ranks && i < static_cast<int>(members.size()); ++i) ranks[i] = members[i];
  return static_cast<int>(members.size());
}

const char* kr_mpi_library_version(void) {
  static std::string version = [] {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return std::string(text, len);
  }();
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
  try {
    keras_ring::ReduceInto(dst, src, count, static_cast<keras_ring::DataType>(dtype),
                           static_cast<keras_ring::ReduceOp>(op), level);
  } catch (const keras_ring::EngineError& e) {
    return WithError(KR_INVALID_ARGUMENT, e.what(), err, err_len);
  }
  return KR_OK;
}

}  // extern "C"
