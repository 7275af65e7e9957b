#include <cstring>

#include "../core/common.h"
#include "harness.h"

namespace kr_test {
namespace {

using namespace keras_ring;

KR_TEST(DataTypeSizesAndNames) {
  KR_EXPECT_EQ(DataTypeSize(DataType::kFloat16), 2u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kBFloat16), 2u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kFloat32), 4u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kFloat64), 8u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kInt8), 1u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kUInt8), 1u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kInt32), 4u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kInt64), 8u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kInt16), 2u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kUInt16), 2u);
  KR_EXPECT_EQ(DataTypeSize(DataType::kBool), 1u);
  KR_EXPECT_THROW(DataTypeSize(static_cast<DataType>(11)), EngineError, "invalid dtype 11");
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kBFloat16)), std::string("bfloat16"));
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kUInt8)), std::string("uint8"));
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kInt16)), std::string("int16"));
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kUInt16)), std::string("uint16"));
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kBool)), std::string("bool"));
  KR_EXPECT_EQ(std::string(DataTypeName(static_cast<DataType>(99))), std::string("invalid dtype"));
}

KR_TEST(EnumValidityFollowsTheCApi) {
  for (int d = -1; d <= 12; ++d) {
    KR_EXPECT_EQ(IsValidDataType(d), d >= 0 && d <= 10);
    KR_EXPECT_EQ(IsReducibleDataType(d), d >= 0 && d <= 7);
  }
  KR_EXPECT_EQ(NotReducibleMessage(Collective::kReducescatter, DataType::kBool),
               std::string("reducescatter does not take bool: reductions take float16, bfloat16, "
                           "float32, float64, int8, uint8, int32, int64; allgather, broadcast "
                           "and alltoall take bool too"));
  for (int op = -1; op <= 7; ++op) {
    KR_EXPECT_EQ(IsValidReduceOp(op), op == 0 || op == 1 || op == 3 || op == 4 || op == 5);
  }
  for (int c = -1; c <= 6; ++c) KR_EXPECT_EQ(IsValidCollective(c), c >= 0 && c <= 5);
  KR_EXPECT_EQ(std::string(ReduceOpName(ReduceOp::kAverage)), std::string("average"));
  KR_EXPECT_EQ(std::string(ReduceOpName(ReduceOp::kProduct)), std::string("product"));
  KR_EXPECT_EQ(std::string(ReduceOpName(static_cast<ReduceOp>(2))),
               std::string("invalid reduce op"));
  KR_EXPECT_EQ(std::string(CollectiveName(Collective::kAllgather)), std::string("allgather"));
  KR_EXPECT_EQ(std::string(CollectiveName(static_cast<Collective>(7))),
               std::string("invalid collective"));
}

}  // namespace
}  // namespace kr_test
