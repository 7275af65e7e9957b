// The C ABI over the process's Engine.
#include "c_api.h"

#include <mpi.h>

#include <cstring>
#include <string>

#include "engine.h"

using keras_ring::Engine;

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
  return Engine::Get().Enqueue(*request);
}

void kr_get_stats(kr_stats* out) { *out = Engine::Get().stats(); }

const char* kr_mpi_library_version(void) {
  static std::string version = [] {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return std::string(text, len);
  }();
  return version.c_str();
}

}  // extern "C"
