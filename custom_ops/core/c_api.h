/* The engine's C ABI: the only thing framework adapters (the TF ops, the
 * pybind11 binding, later XLA custom calls) see of the engine.
 *
 * Requests are matched across ranks by name. kr_enqueue never blocks on
 * communication: the engine's background thread negotiates, runs the
 * collective and then calls request->done from that thread, exactly once
 * (or from a thread that lends itself to the engine: kr_drive).
 */
#ifndef KERAS_RING_C_API_H_
#define KERAS_RING_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KR_API __attribute__((visibility("default")))

/* The ABI's version: 2 added struct_size to kr_request and kr_init_options,
 * 3 the TCP world's rank, size and name to kr_init_options and KR_PEER_LOST.
 * A struct whose struct_size is smaller than the engine's is read as far as
 * the caller knew it, the fields after it taking their defaults; one that is
 * larger (a newer caller) is refused. */
#define KR_ABI_VERSION 3

typedef enum {
  KR_FLOAT16 = 0,
  KR_BFLOAT16 = 1,
  KR_FLOAT32 = 2,
  KR_FLOAT64 = 3,
  KR_INT8 = 4,
  KR_UINT8 = 5,
  KR_INT32 = 6,
  KR_INT64 = 7,
  /* Allgather, broadcast and alltoall, which move bytes, take these too;
   * allreduce and reducescatter refuse them. */
  KR_INT16 = 8,
  KR_UINT16 = 9,
  KR_BOOL = 10, /* one byte */
} kr_dtype;

/* Numbering as horovod's ReduceOp (2 was Adasum, which we do not offer). */
typedef enum {
  KR_AVERAGE = 0,
  KR_SUM = 1,
  KR_MIN = 3,
  KR_MAX = 4,
  KR_PRODUCT = 5,
} kr_reduce_op;

typedef enum {
  KR_ALLREDUCE = 0,
  KR_ALLGATHER = 1,
  KR_BROADCAST = 2,
  /* Every rank passes a tensor of the same shape; rank r gets rows
   * [start_r, start_r + rows_r) of the reduction, where the first dimension
   * d is split as evenly as possible and the first d % size ranks get one row
   * more (Horovod's split). */
  KR_REDUCESCATTER = 3,
  KR_ALLTOALL = 4,
  /* This rank has no more data: until every rank has joined, it takes part in
   * the others' allreduces, reducescatters and allgathers with zeros (no
   * rows), without submitting them. Completes once every rank has joined and
   * writes the rank that joined last to output (one int32). The name must be
   * the same on every rank; shape empty, dtype KR_INT32. */
  KR_JOIN = 5,
} kr_collective;

typedef enum {
  KR_OK = 0,
  KR_INVALID_ARGUMENT = 1,   /* bad request, here or on another rank of the collective */
  KR_NOT_INITIALIZED = 2,    /* init() not called, or shut down */
  KR_ABORTED = 3,            /* shutdown with the request still pending */
  KR_INTERNAL = 4,           /* transport or engine failure */
  /* Ranks disagree on the request (collective, dtype, shape, op, root...), or
   * it cannot run while some ranks have joined. */
  KR_FAILED_PRECONDITION = 5,
  /* A rank this one depends on died, stopped answering (KERAS_RING_TIMEOUT)
   * or left the job: the message names it. This rank is well; an elastic job
   * goes on in a new world without that rank. */
  KR_PEER_LOST = 6,
} kr_status;

#define KR_DEVICE_CPU (-1)

typedef enum kr_compression {
  KR_COMPRESSION_NONE = 0,
  KR_COMPRESSION_FP16 = 1,
  KR_COMPRESSION_BF16 = 2,
} kr_compression;

typedef struct kr_request {
  /* sizeof(kr_request) as the caller was built with (see KR_ABI_VERSION). */
  size_t struct_size;
  const char* name;          /* matched across ranks; copied by kr_enqueue */
  kr_collective collective;
  kr_dtype dtype;
  int ndim;
  const int64_t* shape;      /* copied by kr_enqueue */
  const void* input;
  /* Allreduce and broadcast write a result of the input's shape here; it may
   * equal input (in place). Allgather, reducescatter and alltoall leave it
   * NULL and get their output from allocate_output once its first dimension
   * is known. */
  void* output;
  kr_reduce_op reduce_op;    /* allreduce and reducescatter */
  double prescale_factor;    /* allreduce and reducescatter: input scaled before reducing */
  double postscale_factor;   /* allreduce and reducescatter: result scaled after */
  /* Allreduce and reducescatter of float32 or float64 tensors: the data is
   * converted to float16 or bfloat16 as it is copied into the engine's
   * buffers, reduced in that type (in float32 arithmetic, rounded once per
   * step) and converted back as it is copied out. Ignored for other dtypes. */
  kr_compression compression;
  int root_rank;             /* broadcast only */
  /* Alltoall only: splits[j] rows (first-dimension slices) go to rank j, in
   * rank order; nsplits is the world size, or 0 for an even split. Copied by
   * kr_enqueue. received_splits, if not NULL, has room for one entry per rank
   * and receives the rows that came from each rank before done is called. */
  const int64_t* splits;
  int nsplits;
  int64_t* received_splits;
  /* The process set the collective runs in: 0 is the whole job, other ids
   * come from kr_add_process_set. Ranks, sizes and root_rank are then those
   * within the set. */
  int32_t process_set;
  int device;                /* KR_DEVICE_CPU; GPU ordinals come later */
  /* Called from the engine's thread; returns NULL if allocation failed (NULL
   * is accepted for an output of zero bytes). */
  void* (*allocate_output)(void* ctx, int ndim, const int64_t* shape);
  /* Called exactly once from the engine's thread (the background thread, or
   * one in kr_drive), or from kr_enqueue when the request is refused.
   * message is valid only during the call. */
  void (*done)(void* ctx, kr_status status, const char* message);
  void* ctx;
} kr_request;

typedef struct kr_topology {
  int rank, size;
  int local_rank, local_size;
  int cross_rank, cross_size;
  int is_homogeneous;
  int mpi_threads_supported;
} kr_topology;

/* Counters since the process started, for tests, benchmarks and tuning. */
typedef struct kr_stats {
  uint64_t collectives;    /* collectives run (a fused one counts once) */
  uint64_t tensors;        /* requests completed by them */
  uint64_t fused_tensors;  /* of those, requests that shared a fused collective */
  uint64_t cached_tensors; /* requests this rank announced by response-cache id */
  uint64_t shm_collectives;          /* allreduces run through shared memory */
  uint64_t hierarchical_collectives; /* of those, the ones that spanned hosts */
} kr_stats;

/* Settings that init() takes as arguments; each one left negative comes from
 * the environment (see kr_init), as do all the others. */
typedef struct kr_init_options {
  size_t struct_size;          /* sizeof(kr_init_options) as the caller was built with */
  int64_t fusion_threshold;    /* bytes */
  double cycle_time_ms;
  double stall_check_seconds;
  double stall_shutdown_seconds;
  int64_t cache_capacity;      /* tensor names */
  double timeout_seconds;      /* more than 0 */
  /* The TCP world to join: this rank, the size and the prefix of the world's
   * keys in the rendezvous store (every rank of one world gives the same
   * prefix, and no earlier world of the job used it). Elastic jobs give them
   * for each world they form. -1 (NULL): KERAS_RING_RANK, KERAS_RING_SIZE,
   * and "tcp_world.<n>" for the process's n-th world. */
  int32_t rank;
  int32_t size;
  const char* world_name;
} kr_init_options;
/* Every setting from the environment. */
#define KR_INIT_OPTIONS_DEFAULT {sizeof(kr_init_options), -1, -1, -1, -1, -1, -1, -1, -1, NULL}

KR_API int kr_abi_version(void);

/* Starts the engine (and MPI if nobody has). Must be called from the thread
 * that will later let the process exit (the MPI "main" thread). Returns
 * KR_OK or an error with a message in err. Calling it twice is a no-op.
 * Settings come from the environment (Horovod's names are read too):
 * KERAS_RING_FUSION_THRESHOLD (bytes, default 64 MiB, 0 disables fusion),
 * KERAS_RING_CYCLE_TIME (milliseconds, default 0: how long agreed tensors
 * wait for others to fuse with, unless the threshold is reached first),
 * KERAS_RING_CACHE_CAPACITY (tensor names, default 1024, 0 disables the
 * response cache), KERAS_RING_STALL_CHECK_TIME (seconds, default 60, 0
 * disables the report of tensors some ranks wait for),
 * KERAS_RING_STALL_SHUTDOWN_TIME (seconds, default 600, 0 = never: after
 * it, a stalled tensor fails on the waiting ranks),
 * KERAS_RING_CPU_KERNELS (generic, avx2 or avx512, default the best the CPU
 * runs: see kr_cpu_kernels),
 * KERAS_RING_TIMEOUT (seconds, default 300: how long any wait for another
 * rank lasts, in a collective's transfers, at init and at shutdown, before it
 * fails naming that rank),
 * KERAS_RING_LOG_LEVEL (trace, debug, info, warning (default), error).
 * Calling it while initialised does nothing. */
KR_API kr_status kr_init(char* err, size_t err_len);
/* kr_init with some settings given (options may be NULL: kr_init). */
KR_API kr_status kr_init_with_options(const kr_init_options* options, char* err,
                                      size_t err_len);
/* Stops the engine of every rank: pending requests, here and on the other
 * ranks, complete with KR_ABORTED. Returns once every rank's engine has
 * stopped (each rank must call it, or exit, before it can init again).
 * kr_init may be called again. */
KR_API kr_status kr_shutdown(char* err, size_t err_len);
/* Shuts the engine down (kr_shutdown), then finalizes MPI if kr_init
 * started it. Called once at process exit, from the thread that called
 * kr_init: MPICH's launchers take a rank that exits without MPI_Finalize
 * for a failed one and interrupt the others. */
KR_API void kr_finalize(void);
KR_API int kr_is_initialized(void);
KR_API kr_status kr_get_topology(kr_topology* out);
KR_API kr_status kr_enqueue(const kr_request* request);
/* Lends the calling thread to the engine: runs its loop here until
 * finished(ctx) returns nonzero, the engine stops, or the loop has spun idle
 * for a while, and returns; the caller then waits for its requests as usual
 * (they may still be in flight). A thread about to block on a request saves
 * two thread wake-ups this way (the engine thread's, then its own), which
 * are most of a small collective's time on a busy host. Callbacks of any
 * request may run on this thread meanwhile. */
KR_API void kr_drive(int (*finished)(void* ctx), void* ctx);
/* kr_enqueue of requests[0..n) (the first refusal's status is returned),
 * then kr_drive: for a caller that waits for them at once. Unlike n calls of
 * kr_enqueue it does not wake the engine thread, which this thread stands in
 * for (and hands any unfinished work to when it returns).
 *
 * With a group name (not NULL or empty) and n > 1, the requests are one
 * group (a grouped op): allreduces of one process set, of any dtypes and
 * ops, that every rank submits in one call under the same group name, with
 * the same names (unique within the group) in the same order. The ranks
 * agree on the group as one unit (one name to negotiate and cache instead of
 * n, which is most of the engine's cost per small tensor) and it runs as few
 * fused allreduces as the fusion threshold allows. If the ranks' groups differ, every member fails
 * on every rank with an error naming the first tensor that differs. Other
 * collectives in a group are refused (each request's done says why). */
KR_API kr_status kr_enqueue_and_drive(const kr_request* requests, int n, const char* group,
                                      int (*finished)(void* ctx), void* ctx);
/* kr_enqueue of requests[0..n), as one group where group names one (see
 * kr_enqueue_and_drive), waking the engine's thread once; returns at once,
 * like kr_enqueue (for a caller that waits later). */
KR_API kr_status kr_enqueue_group(const kr_request* requests, int n, const char* group);
/* Process sets: subsets of the job's ranks that run collectives among
 * themselves. Every rank of the job must call these, in the same order, with
 * the same arguments (they are agreed like any collective); they block until
 * done. add writes the new set's id (never reused); ranks are world ranks.
 * remove fails the set's pending requests. */
KR_API kr_status kr_add_process_set(const int* ranks, int nranks, int32_t* id, char* err,
                                    size_t err_len);
KR_API kr_status kr_remove_process_set(int32_t id, char* err, size_t err_len);
/* The world ranks of process set id (up to max_ranks written); returns the
 * set's size, or -1 if there is no such set. */
KR_API int kr_process_set_ranks(int32_t id, int* ranks, int max_ranks);
KR_API void kr_get_stats(kr_stats* out);

/* The performance settings in use: from the environment, then as the
 * autotuner (KERAS_RING_AUTOTUNE=1) changes them, the same on every rank. */
typedef struct kr_parameters {
  uint64_t fusion_threshold;      /* bytes */
  double cycle_time_ms;
  uint64_t segment_bytes;         /* 0: the engine's choice */
  uint64_t small_allreduce_bytes;
  int autotune;                   /* 0: off, 1: tuning, 2: tuned */
} kr_parameters;
KR_API void kr_get_parameters(kr_parameters* out);
/* Records this rank's timeline into file_path (created or truncated): Chrome
 * trace event JSON, one row per tensor, valid even if the process dies while
 * recording. mark_cycles != 0 adds a mark for every engine cycle that did
 * something. Fails if the engine is not initialised, a timeline is already
 * recording, or the file cannot be created. */
KR_API kr_status kr_start_timeline(const char* file_path, int mark_cycles, char* err,
                                   size_t err_len);
/* Writes what is buffered and closes the file; no-op when not recording.
 * Shutdown does it too. */
KR_API void kr_stop_timeline(void);
/* Writes message to the log (stderr, prefixed with time, rank and host) if
 * level (0 trace, 1 debug, 2 info, 3 warning, 4 error) is enabled by
 * KERAS_RING_LOG_LEVEL; with once != 0, at most once per process for each
 * distinct message. */
KR_API void kr_log(int level, const char* message, int once);
/* MPI library version string of the MPI we were built against and loaded. */
KR_API const char* kr_mpi_library_version(void);

/* The CPU kernels that reduce, scale and convert: "generic" (any CPU),
 * "avx2" (AVX2 and F16C) or "avx512" (AVX-512 F, BW, DQ and VL). Every one
 * gives the same results; the best the CPU can run is used unless
 * KERAS_RING_CPU_KERNELS, read by kr_init, names another. kr_cpu_kernels
 * names those in use; kr_cpu_supports_kernels returns 1 if this CPU can run
 * the named ones, 0 if not, -1 if none have that name. */
KR_API const char* kr_cpu_kernels(void);
KR_API int kr_cpu_supports_kernels(const char* kernels);
/* For tests and benchmarks; needs no kr_init. dst[i] = dst[i] (op) src[i] for
 * count elements (op is not KR_AVERAGE; dtype one that reductions take, up
 * to KR_INT64), with the named kernels, or with
 * those in use if kernels is NULL. */
KR_API kr_status kr_reduce_into(void* dst, const void* src, size_t count, kr_dtype dtype,
                                kr_reduce_op op, const char* kernels, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* KERAS_RING_C_API_H_ */
