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
  KR_EXPECT_THROW(DataTypeSize(static_cast<DataType>(8)), EngineError, "invalid dtype 8");
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kBFloat16)), std::string("bfloat16"));
  KR_EXPECT_EQ(std::string(DataTypeName(DataType::kUInt8)), std::string("uint8"));
  KR_EXPECT_EQ(std::string(DataTypeName(static_cast<DataType>(99))), std::string("invalid dtype"));
}

KR_TEST(EnumValidityFollowsTheCApi) {
  for (int d = -1; d <= 9; ++d) KR_EXPECT_EQ(IsValidDataType(d), d >= 0 && d <= 7);
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
