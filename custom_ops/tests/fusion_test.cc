// Every rank's plan of the allreduces it runs, and the fusion buffer.
#include <string>
#include <vector>

#include "../core/fusion.h"
#include "harness.h"

namespace keras_ring {
namespace {

Request Tensor(const std::string& name, size_t count, DataType dtype = DataType::kFloat32) {
  Request req;
  req.meta.name = name;
  req.meta.dtype = dtype;
  req.meta.wire_dtype = dtype;
  req.meta.shape = {static_cast<int64_t>(count)};
  return req;
}

std::vector<std::string> Names(const std::vector<Request>& requests) {
  std::vector<std::string> names;
  for (const Request& req : requests) names.push_back(req.meta.name);
  return names;
}

KR_TEST(PlanPutsAlikeTensorsTogetherAndCutsAtTheThreshold) {
  std::vector<Request> requests = {Tensor("a", 10), Tensor("b", 10, DataType::kFloat64),
                                   Tensor("c", 10), Tensor("d", 20),
                                   Tensor("e", 5, DataType::kFloat64)};
  // 40-byte and 80-byte float32 tensors, 80-byte and 40-byte float64 ones.
  const std::vector<size_t> ends = PlanAllreduces(&requests, 100);
  KR_EXPECT(Names(requests) == std::vector<std::string>({"a", "c", "d", "b", "e"}));
  KR_EXPECT(ends == std::vector<size_t>({2, 3, 4, 5}));
  // Threshold 0: each alone, still ordered by kind.
  KR_EXPECT(PlanAllreduces(&requests, 0) == std::vector<size_t>({1, 2, 3, 4, 5}));
}

KR_TEST(FusionBufferPacksInTheWireDtypeAndUnpacksIntoEachOutput) {
  std::vector<float> in_a = {1, 2, 3}, in_b = {4, 5}, out_a(3), out_b(2);
  std::vector<Request> requests = {Tensor("a", 3), Tensor("b", 2)};
  requests[0].input = in_a.data();
  requests[0].output = out_a.data();
  requests[1].input = in_b.data();
  requests[1].output = out_b.data();
  FusionBuffer buffer;
  char* packed = buffer.Pack(requests.data(), requests.data() + 2);
  const float* f = reinterpret_cast<const float*>(packed);
  KR_EXPECT(std::vector<float>(f, f + 5) == std::vector<float>({1, 2, 3, 4, 5}));
  buffer.Unpack(requests.data(), requests.data() + 2);
  KR_EXPECT(out_a == in_a);
  KR_EXPECT(out_b == in_b);
  // Compressed: packed as bfloat16 (two bytes each), unpacked back to float32.
  for (Request& req : requests) req.meta.wire_dtype = DataType::kBFloat16;
  buffer.Pack(requests.data(), requests.data() + 2);
  out_a.assign(3, 0);
  buffer.Unpack(requests.data(), requests.data() + 1);
  KR_EXPECT(out_a == in_a);  // small integers are exact in bfloat16
}

}  // namespace
}  // namespace keras_ring
