#include "common.h"

#include <cstdio>

namespace keras_ring {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
    case DataType::kUInt16:
      return 2;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
  }
  throw EngineError("keras-ring internal: DataTypeSize of invalid dtype " +
                    std::to_string(static_cast<int>(dtype)));
}

// The name functions feed error messages, so an invalid value gets a
// placeholder instead of a second error.
const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kInt16: return "int16";
    case DataType::kUInt16: return "uint16";
    case DataType::kBool: return "bool";
  }
  return "invalid dtype";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "invalid reduce op";
}

const char* CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kAllgather: return "allgather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReducescatter: return "reducescatter";
    case Collective::kAlltoall: return "alltoall";
    case Collective::kJoin: return "join";
    case Collective::kAddProcessSet: return "add_process_set";
    case Collective::kRemoveProcessSet: return "remove_process_set";
  }
  return "invalid collective";
}

bool IsValidDataType(int dtype) { return dtype >= KR_FLOAT16 && dtype <= KR_BOOL; }

bool IsReducibleDataType(int dtype) { return dtype >= 0 && dtype < kReducibleDataTypes; }

std::string NotReducibleMessage(Collective c, DataType dtype) {
  std::string reducible;
  for (int d = 0; d < kReducibleDataTypes; ++d) {
    reducible += std::string(d ? ", " : "") + DataTypeName(static_cast<DataType>(d));
  }
  return std::string(CollectiveName(c)) + " does not take " + DataTypeName(dtype) +
         ": reductions take " + reducible + "; allgather, broadcast and alltoall take " +
         DataTypeName(dtype) + " too";
}

bool IsValidReduceOp(int op) {
  switch (op) {
    case KR_AVERAGE:
    case KR_SUM:
    case KR_MIN:
    case KR_MAX:
    case KR_PRODUCT:
      return true;
    default:
      return false;
  }
}

bool IsValidCollective(int c) { return c >= KR_ALLREDUCE && c <= KR_JOIN; }

std::string FormatSeconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

kr_status StatusOf(const std::exception& e) {
  return dynamic_cast<const PeerLostError*>(&e) != nullptr ? KR_PEER_LOST : KR_INTERNAL;
}

}  // namespace keras_ring
