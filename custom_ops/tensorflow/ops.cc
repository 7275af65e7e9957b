// Registrations of the keras-ring collective ops: signatures, shape functions
// and documentation. The kernels live in kernels.cc.
//
// Every op is stateful: a collective has effects on other processes, so TF
// must neither prune, deduplicate nor constant-fold it. The ops that move
// bytes (allgather, broadcast, alltoall) take int16, uint16 and bool too; the
// reductions do not.
//
// The name that matches a request across ranks is every op's last input, a
// string scalar, not an attr: eager TensorFlow keeps a kernel for each set of
// attrs an op is called with, for the life of the process, so a new name per
// call (a metric's name per epoch, say) would grow memory by a kernel each.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace keras_ring {
namespace {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Every op's last input is its tensor_name; output i has the shape of input i.
absl::Status GroupedUnchangedShape(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

// Output i is input i with its first dimension known only at run time (the
// sum over ranks for allgather, this rank's share for reducescatter).
absl::Status FirstDimensionUnknownShape(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) {
    ShapeHandle output;
    TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(i), 1, &output));
    TF_RETURN_IF_ERROR(c->ReplaceDim(output, 0, c->UnknownDim(), &output));
    c->set_output(i, output);
  }
  return absl::OkStatus();
}

absl::Status AlltoallShape(InferenceContext* c) {
  ShapeHandle output, splits;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &output));
  TF_RETURN_IF_ERROR(c->ReplaceDim(output, 0, c->UnknownDim(), &output));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
  c->set_output(0, output);
  // One entry per rank: as many as the splits when they are given; an empty
  // splits (an even split) says nothing about the number of ranks.
  const auto length = c->Dim(splits, 0);
  const bool given = c->ValueKnown(length) && c->Value(length) > 0;
  c->set_output(1, c->Vector(given ? length : c->UnknownDim()));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("KerasRingAllreduce")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("tensor_name: string")
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
compression: 0 = none; 1 = float16, 2 = bfloat16 on the wire for float and
  double tensors (converted as the engine copies them in and out).
tensor_name: A string scalar: the name that matches this request across ranks;
  empty means the node name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingGroupedAllreduce")
    .Attr("T: list({half, bfloat16, float, double, int8, uint8, int32, int64}) >= 1")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Input("tensor_name: string")
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
compression: 0 = none; 1 = float16, 2 = bfloat16 on the wire for float and
  double tensors (converted as the engine copies them in and out).
tensor_name: A string scalar: the name `<name>` above; empty means the node
  name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingAllgather")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64, int16, uint16, bool}")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimensionUnknownShape)
    .Doc(R"doc(
Concatenates the tensors of all ranks along the first dimension, in rank order.

The first dimension may differ between ranks (and be 0); the other dimensions
and the dtype must agree.

tensor: This rank's rows; rank at least 1.
output: Every rank's rows; the first dimension is their sum over ranks.
tensor_name: A string scalar: the name that matches this request across ranks;
  empty means the node name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingGroupedAllgather")
    .Attr("T: list({half, bfloat16, float, double, int8, uint8, int32, int64, int16, uint16, "
          "bool}) >= 1")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Input("tensor_name: string")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimensionUnknownShape)
    .Doc(R"doc(
Allgathers a list of tensors, possibly of different dtypes, as one operation.

Tensor i is matched across ranks as `<name>.<i>`; the op finishes when all of
them have, and reports the first error. Each tensor's first dimension may
differ between ranks (and be 0); its other dimensions and dtype must agree.

tensors: This rank's rows of each tensor; each of rank at least 1.
outputs: Every rank's rows of each tensor, in rank order; each first dimension
  is the sum over ranks.
tensor_name: A string scalar: the name `<name>` above; empty means the node
  name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingReducescatter")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimensionUnknownShape)
    .Doc(R"doc(
Reduces a tensor over all ranks; each rank receives its rows of the result.

The tensor must have the same shape and dtype on every rank. Its first
dimension d is split as evenly as possible: the first d % size ranks get
d / size + 1 rows, the others d / size, in rank order.

tensor: This rank's contribution; rank at least 1.
output: This rank's rows of the reduction over all ranks.
reduce_op: 0 = Average, 1 = Sum, 3 = Min, 4 = Max, 5 = Product.
prescale_factor: Multiplies each rank's input before the reduction.
postscale_factor: Multiplies the result after the reduction.
compression: 0 = none; 1 = float16, 2 = bfloat16 on the wire for float and
  double tensors (converted as the engine copies them in and out).
tensor_name: A string scalar: the name that matches this request across ranks;
  empty means the node name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingGroupedReducescatter")
    .Attr("T: list({half, bfloat16, float, double, int8, uint8, int32, int64}) >= 1")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Input("tensor_name: string")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimensionUnknownShape)
    .Doc(R"doc(
Reducescatters a list of tensors, possibly of different dtypes, as one operation.

Tensor i is matched across ranks as `<name>.<i>`; the op finishes when all of
them have, and reports the first error. Each tensor is split along its first
dimension as in KerasRingReducescatter.

tensors: This rank's contributions; each of rank at least 1.
outputs: This rank's rows of each reduction over all ranks.
reduce_op: 0 = Average, 1 = Sum, 3 = Min, 4 = Max, 5 = Product.
prescale_factor: Multiplies each rank's inputs before the reduction.
postscale_factor: Multiplies the results after the reduction.
compression: 0 = none; 1 = float16, 2 = bfloat16 on the wire for float and
  double tensors (converted as the engine copies them in and out).
tensor_name: A string scalar: the name `<name>` above; empty means the node
  name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingAlltoall")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64, int16, uint16, bool}")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("splits: int32")
    .Input("tensor_name: string")
    .Output("output: T")
    .Output("received_splits: int32")
    .SetIsStateful()
    .SetShapeFn(AlltoallShape)
    .Doc(R"doc(
Sends rows of the tensor to every rank and receives rows from every rank.

Rank i sends its first splits[0] rows to rank 0, the next splits[1] to rank 1,
and so on; every rank concatenates what it receives in rank order. The first
dimension may differ between ranks; the other dimensions and the dtype must
agree.

tensor: This rank's rows; rank at least 1.
splits: The rows for each rank, one entry per rank, adding up to the first
  dimension; empty to split it evenly (it must then be divisible by the number
  of ranks).
output: The rows received from every rank, in rank order.
received_splits: The rows received from each rank, one entry per rank.
tensor_name: A string scalar: the name that matches this request across ranks;
  empty means the node name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

REGISTER_OP("KerasRingBroadcast")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int32, int64, int16, uint16, bool}")
    .Attr("root_rank: int")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies the tensor of the root rank to every rank.

tensor: The value to send on the root; elsewhere only its shape and dtype
  matter, and they must agree with the root's.
output: The root's tensor.
root_rank: The rank whose tensor is broadcast.
tensor_name: A string scalar: the name that matches this request across ranks;
  empty means the node name.
process_set_id: The process set to run in (0: every rank); ranks and sizes
  count within it.
)doc");

}  // namespace keras_ring
