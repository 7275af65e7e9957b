// Vocabulary shared by every layer of the engine: data types, reduce ops,
// collectives and a small Status type. No MPI, no TensorFlow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "c_api.h"

namespace keras_ring {

enum class DataType : int {
  kFloat16 = KR_FLOAT16,
  kBFloat16 = KR_BFLOAT16,
  kFloat32 = KR_FLOAT32,
  kFloat64 = KR_FLOAT64,
  kInt8 = KR_INT8,
  kUInt8 = KR_UINT8,
  kInt32 = KR_INT32,
  kInt64 = KR_INT64,
  kInt16 = KR_INT16,
  kUInt16 = KR_UINT16,
  kBool = KR_BOOL,
};

// The dtypes that allreduce and reducescatter take are the first ones, up to
// kInt64: the reduction kernels' tables have a row for each.
constexpr int kReducibleDataTypes = KR_INT64 + 1;

// Values follow horovod's ReduceOp numbering so that scripts passing raw ints
// keep their meaning.
enum class ReduceOp : int {
  kAverage = KR_AVERAGE,
  kSum = KR_SUM,
  kMin = KR_MIN,
  kMax = KR_MAX,
  kProduct = KR_PRODUCT,
};

enum class Collective : int {
  kAllreduce = KR_ALLREDUCE,
  kAllgather = KR_ALLGATHER,
  kBroadcast = KR_BROADCAST,
  kReducescatter = KR_REDUCESCATTER,
  kAlltoall = KR_ALLTOALL,
  kJoin = KR_JOIN,
  // Internal, never in a kr_request: every rank adds or removes a process set
  // at the same point of the agreed order (TensorMeta::splits holds the
  // member ranks, or the id of the set to remove).
  kAddProcessSet = 100,
  kRemoveProcessSet = 101,
};

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);
const char* CollectiveName(Collective c);
bool IsValidDataType(int dtype);
bool IsReducibleDataType(int dtype);
// "allreduce does not take int16: ...", saying which dtypes reductions take.
std::string NotReducibleMessage(Collective c, DataType dtype);
bool IsValidReduceOp(int op);
bool IsValidCollective(int c);
// "2.5", "300": seconds for messages.
std::string FormatSeconds(double seconds);

// Error raised inside the engine (transport failure, invariant broken). The
// background thread turns it into a failed request; it never crosses the C ABI.
class EngineError : public std::runtime_error {
 public:
  explicit EngineError(const std::string& what) : std::runtime_error(what) {}
};

// A rank this one depends on died, stopped answering or left the job, so a
// collective or the world's set-up cannot finish; this rank itself is well.
// Reported as KR_PEER_LOST: elastic training re-forms the world without it.
class PeerLostError : public EngineError {
 public:
  using EngineError::EngineError;
};

// The status a failure reports: KR_PEER_LOST for a PeerLostError, else
// KR_INTERNAL.
kr_status StatusOf(const std::exception& e);

// Enforce-style check: says what was expected and what was found.
#define KR_CHECK(cond, msg)                                                  \
  do {                                                                       \
    if (!(cond)) {                                                           \
      throw ::keras_ring::EngineError(std::string("keras-ring internal: ") + \
                                      (msg) + " [" #cond "]");               \
    }                                                                        \
  } while (0)

}  // namespace keras_ring
