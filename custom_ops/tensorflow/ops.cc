// Registrations of the keras-ring collective ops: signatures, shape functions
// and documentation. The kernels live in kernels.cc.
//
// Every op is stateful: a collective has effects on other processes, so TF
// must neither prune, deduplicate nor constant-fold it.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace keras_ring {
namespace {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

absl::Status GroupedUnchangedShape(InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

absl::Status AllgatherShape(InferenceContext* c) {
  ShapeHandle output;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &output));
  // The first dimension is the sum over ranks, known only at run time.
  TF_RETURN_IF_ERROR(c->ReplaceDim(output, 0, c->UnknownDim(), &output));
  c->set_output(0, output);
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("KerasRingAllreduce")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("tensor_name: string = ''")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Reduces a tensor over all ranks; every rank receives the result.

The tensor must have the same shape and dtype on every rank. Ranks match
requests by name, so they may issue them in any order.

tensor: This rank's contribution.
output: The reduction over all ranks, with the shape and dtype of `tensor`.
reduce_op: 0 = Average, 1 = Sum, 3 = Min, 4 = Max, 5 = Product.
prescale_factor: Multiplies each rank's input before the reduction.
postscale_factor: Multiplies the result after the reduction.
tensor_name: The name that matches this request across ranks; empty means the
  node name.
)doc");

REGISTER_OP("KerasRingGroupedAllreduce")
    .Attr("T: list({half, bfloat16, float, double, int8, uint8, int32, int64}) >= 1")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("tensor_name: string = ''")
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(GroupedUnchangedShape)
    .Doc(R"doc(
Reduces a list of tensors, possibly of different dtypes, over all ranks.

Tensor i is matched across ranks as `<name>.<i>`; the op finishes when all of
them have, and reports the first error.

tensors: This rank's contributions.
outputs: The reductions over all ranks, with the shapes and dtypes of `tensors`.
reduce_op: 0 = Average, 1 = Sum, 3 = Min, 4 = Max, 5 = Product.
prescale_factor: Multiplies each rank's inputs before the reduction.
postscale_factor: Multiplies the results after the reduction.
tensor_name: The name `<name>` above; empty means the node name.
)doc");

REGISTER_OP("KerasRingAllgather")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64}")
    .Attr("tensor_name: string = ''")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(AllgatherShape)
    .Doc(R"doc(
Concatenates the tensors of all ranks along the first dimension, in rank order.

The first dimension may differ between ranks (and be 0); the other dimensions
and the dtype must agree.

tensor: This rank's rows; rank at least 1.
output: Every rank's rows; the first dimension is their sum over ranks.
tensor_name: The name that matches this request across ranks; empty means the
  node name.
)doc");

REGISTER_OP("KerasRingBroadcast")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64}")
    .Attr("root_rank: int")
    .Attr("tensor_name: string = ''")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies the tensor of the root rank to every rank.

tensor: The value to send on the root; elsewhere only its shape and dtype
  matter, and they must agree with the root's.
output: The root's tensor.
root_rank: The rank whose tensor is broadcast.
tensor_name: The name that matches this request across ranks; empty means the
  node name.
)doc");

}  // namespace keras_ring
