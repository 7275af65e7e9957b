// The engine's settings: one struct, filled from the environment by
// EngineOptions::FromEnvironment (the one reader of KERAS_RING_* and of
// Horovod's HOROVOD_* names), then overridden by what init() passes through
// the C ABI (kr_init_options).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "autotune.h"
#include "reduce.h"

namespace keras_ring {

struct EngineOptions {
  // Every rank runs with rank 0's (the engine broadcasts them at start).
  TunedParams params;
  bool autotune = false;
  AutotuneOptions tuning;
  std::chrono::steady_clock::duration stall_check{}, stall_shutdown{};  // 0: off
  size_t cache_capacity = 0;
  bool shared_memory = true;
  bool hierarchical = true;
  size_t shm_slot_bytes = 0;  // 0: the engine's choice
  KernelLevel kernels = KernelLevel::kGeneric;
  // The bound on every wait for another rank (transfers, set-up, shutdown).
  std::chrono::milliseconds timeout{};
  // Names this rank's host instead of the world's own (ranks that give the
  // same name share memory; tests use it to run multi-host paths on one
  // machine). Empty: the world's.
  std::string host_name;
  // The world the C ABI starts: "mpi" (started by an MPI launcher) or "tcp"
  // (started by keras-ring-run --transport tcp, which gives each rank what
  // follows).
  std::string transport = "mpi";
  struct {
    int rank = -1, size = -1;  // -1: not given
    std::string rendezvous;    // host:port of the job's store
    std::string secret;        // the job's; every connection proves it holds it
    // The prefix of the world's keys in the store; empty: "tcp_world.<n>"
    // for the process's n-th world.
    std::string world_name;
  } tcp;

  // Throws EngineError naming the variable and its value for a bad one.
  static EngineOptions FromEnvironment();
};

// Defaults, documented in docs/settings.md.
constexpr size_t kDefaultFusionThreshold = size_t(64) << 20;
constexpr size_t kDefaultCacheCapacity = 1024;
// Up to this size an allreduce over the network uses recursive doubling, the
// ring above (measured: docs/performance.md).
constexpr size_t kDefaultSmallAllreduceBytes = size_t(64) << 10;
constexpr double kDefaultStallCheckSeconds = 60;
// Long enough for a rank that keeps the others waiting on purpose (rank 0
// writing a checkpoint or evaluating alone), short of hanging forever.
constexpr double kDefaultStallShutdownSeconds = 600;
// A transfer or set-up step waits this long for a peer that has started the
// same collective: generous for a loaded, oversubscribed host, short of
// hanging forever behind a stopped one.
constexpr double kDefaultTimeoutSeconds = 300;

std::chrono::steady_clock::duration Seconds(double s);

}  // namespace keras_ring
