// Kernels of the keras-ring ops: thin adapters that turn one op invocation
// into engine requests (c_api.h) and finish the op from the engine's
// completion callback. No collective logic lives here.
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "c_api.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/tensor_types.h"
#include "tensorflow/core/framework/types.h"

namespace keras_ring {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

absl::Status EngineStatus(kr_status status, const char* message) {
  // The engine's message reaches the Python exception unchanged.
  const std::string text = message != nullptr ? message : "";
  switch (status) {
    case KR_OK:
      return absl::OkStatus();
    case KR_INVALID_ARGUMENT:
      return absl::InvalidArgumentError(text);
    case KR_FAILED_PRECONDITION:  // ranks disagree: tf.errors.FailedPreconditionError, as Horovod
      return absl::FailedPreconditionError(text);
    case KR_NOT_INITIALIZED:
      return absl::FailedPreconditionError(text);
    case KR_ABORTED:
      return absl::AbortedError(text);
    case KR_INTERNAL:
      return absl::InternalError(text);
    case KR_PEER_LOST:  // kr.elastic.run recovers from tf.errors.UnavailableError from us
      return absl::UnavailableError(text);
  }
  return absl::InternalError("keras-ring engine returned unknown status " +
                             std::to_string(status) + ": " + text);
}

absl::Status EngineDtype(::tensorflow::DataType dtype, kr_dtype* out) {
  switch (dtype) {
    case ::tensorflow::DT_HALF:
      *out = KR_FLOAT16;
      return absl::OkStatus();
    case ::tensorflow::DT_BFLOAT16:
      *out = KR_BFLOAT16;
      return absl::OkStatus();
    case ::tensorflow::DT_FLOAT:
      *out = KR_FLOAT32;
      return absl::OkStatus();
    case ::tensorflow::DT_DOUBLE:
      *out = KR_FLOAT64;
      return absl::OkStatus();
    case ::tensorflow::DT_INT8:
      *out = KR_INT8;
      return absl::OkStatus();
    case ::tensorflow::DT_UINT8:
      *out = KR_UINT8;
      return absl::OkStatus();
    case ::tensorflow::DT_INT32:
      *out = KR_INT32;
      return absl::OkStatus();
    case ::tensorflow::DT_INT64:
      *out = KR_INT64;
      return absl::OkStatus();
    case ::tensorflow::DT_INT16:
      *out = KR_INT16;
      return absl::OkStatus();
    case ::tensorflow::DT_UINT16:
      *out = KR_UINT16;
      return absl::OkStatus();
    case ::tensorflow::DT_BOOL:
      *out = KR_BOOL;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError("keras-ring does not support dtype " +
                                        ::tensorflow::DataTypeString(dtype));
  }
}

// A request and the storage that its name, shape and splits pointers refer
// to; the pointers are set just before kr_enqueue, which copies all three.
struct Request {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall
  // Alltoall: the output that receives the rows received from each rank.
  int received_splits_output = -1;
  kr_request fields{};
};

// The engine requests of one kernel invocation. The engine completes each
// exactly once, from its thread or from within kr_enqueue; the last
// completion finishes the op and deletes this object.
class PendingOp {
 public:
  PendingOp(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, int num_requests)
      : ctx_(ctx), done_(std::move(done)), slots_(num_requests), remaining_(num_requests) {
    for (int i = 0; i < num_requests; ++i) {
      slots_[i].op = this;
      slots_[i].output_index = i;
    }
  }

  // Set once the op has finished; outlives this object.
  std::shared_ptr<std::atomic<bool>> finished() const { return finished_; }

  // Routes request i's callbacks to this object; output i is its result.
  // With received_splits_output >= 0 (alltoall), that output receives the
  // engine's received splits as int32 when the request succeeds.
  void Bind(int i, kr_request* request, int received_splits_output) {
    Slot& slot = slots_[i];
    request->ctx = &slot;
    request->allocate_output = &AllocateOutput;
    request->done = &Done;
    if (received_splits_output < 0) return;
    // Alltoall: one entry per rank of the set; without such a set the engine
    // refuses the request.
    const int set_size = kr_process_set_ranks(request->process_set, nullptr, 0);
    if (set_size >= 0) {
      slot.received_splits.resize(set_size);
      slot.received_splits_output = received_splits_output;
      request->received_splits = slot.received_splits.data();
    }
  }

 private:
  struct Slot {
    PendingOp* op = nullptr;
    int output_index = 0;
    absl::Status allocation;  // why allocate_output failed, if it did
    std::vector<int64_t> received_splits;  // alltoall: filled by the engine
    int received_splits_output = -1;

    absl::Status OutputReceivedSplits() {
      Tensor* output = nullptr;
      const int64_t n = static_cast<int64_t>(received_splits.size());
      TF_RETURN_IF_ERROR(
          op->ctx_->allocate_output(received_splits_output, TensorShape({n}), &output));
      auto out = output->vec<int32_t>();
      for (int64_t i = 0; i < n; ++i) {
        if (received_splits[i] > std::numeric_limits<int32_t>::max()) {
          return absl::OutOfRangeError(
              "keras-ring: alltoall received " + std::to_string(received_splits[i]) +
              " rows from rank " + std::to_string(i) + ", more than received_splits (int32) holds");
        }
        out(i) = static_cast<int32_t>(received_splits[i]);
      }
      return absl::OkStatus();
    }
  };

  static void* AllocateOutput(void* ctx, int ndim, const int64_t* shape) {
    Slot* slot = static_cast<Slot*>(ctx);
    TensorShape tf_shape;
    Tensor* output = nullptr;
    absl::Status status =
        TensorShape::BuildTensorShape(absl::MakeConstSpan(shape, ndim), &tf_shape);
    if (status.ok()) {
      status = slot->op->ctx_->allocate_output(slot->output_index, tf_shape, &output);
    }
    if (!status.ok()) {
      slot->allocation = status;
      return nullptr;
    }
    return output->data();
  }

  static void Done(void* ctx, kr_status status, const char* message) {
    Slot* slot = static_cast<Slot*>(ctx);
    // A failed allocation says more than the engine's report of it.
    absl::Status result =
        slot->allocation.ok() ? EngineStatus(status, message) : slot->allocation;
    if (result.ok() && slot->received_splits_output >= 0) result = slot->OutputReceivedSplits();
    slot->op->Complete(std::move(result));
  }

  void Complete(absl::Status status) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok()) status_ = std::move(status);
      last = --remaining_ == 0;
    }
    if (!last) return;
    ctx_->SetStatus(status_);
    done_();
    finished_->store(true);
    delete this;
  }

  OpKernelContext* const ctx_;
  const AsyncOpKernel::DoneCallback done_;
  std::vector<Slot> slots_;
  std::mutex mu_;
  int remaining_;
  absl::Status status_;  // the first error
  const std::shared_ptr<std::atomic<bool>> finished_ = std::make_shared<std::atomic<bool>>(false);
};

// What the kernels share: the request name and the engine submission.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
  }

 protected:
  // The inputs before the last, tensor_name (see ops.cc).
  static int DataInputs(OpKernelContext* ctx) { return ctx->num_inputs() - 1; }

  // The request's name: the tensor_name input, or else the node name, which
  // is equal on every rank that built the same graph.
  absl::Status RequestName(OpKernelContext* ctx, std::string* out) const {
    const Tensor& given = ctx->input(DataInputs(ctx));
    if (!::tensorflow::TensorShapeUtils::IsScalar(given.shape())) {
      return absl::InvalidArgumentError(
          "keras-ring: tensor_name must be a string scalar; received shape " +
          given.shape().DebugString());
    }
    *out = std::string(given.scalar<::tensorflow::tstring>()());
    if (out->empty()) *out = name();
    return absl::OkStatus();
  }

  // Describes input `index` of `ctx` to the engine; output may be null
  // (allgather, reducescatter, alltoall), in which case the engine asks for
  // it via allocate_output.
  absl::Status NewRequest(OpKernelContext* ctx, int index, std::string name,
                          kr_collective collective, Tensor* output, Request* out) const {
    const Tensor& input = ctx->input(index);
    out->name = std::move(name);
    const auto dims = input.shape().dim_sizes();
    out->shape.assign(dims.begin(), dims.end());
    kr_request& r = out->fields;
    r.struct_size = sizeof r;
    r.collective = collective;
    TF_RETURN_IF_ERROR(EngineDtype(input.dtype(), &r.dtype));
    r.input = input.data();
    r.output = output != nullptr ? output->data() : nullptr;
    r.prescale_factor = 1.0;
    r.postscale_factor = 1.0;
    r.process_set = process_set_;
    // Only CPU kernels exist so far; GPU kernels will pass their device
    // ordinal here, with an event the engine waits on before reading.
    r.device = KR_DEVICE_CPU;
    return absl::OkStatus();
  }

  // Enqueues the requests; the op finishes when the last one completes. This
  // thread runs the engine meanwhile (kr_drive), so that a collective whose
  // peers are ready finishes here, without waking the engine thread and then
  // TensorFlow's; if the peers are not ready, the call returns after a short
  // spin and the engine thread finishes the op.
  // `group`: the requests are a grouped op's allreduces (kr_enqueue_and_drive).
  static void Submit(OpKernelContext* ctx, DoneCallback done, std::vector<Request> requests,
                     const char* group = nullptr) {
    auto* pending = new PendingOp(ctx, std::move(done), static_cast<int>(requests.size()));
    // `pending` deletes itself when the last request completes, possibly
    // during kr_enqueue_and_drive: the flag outlives it.
    std::shared_ptr<std::atomic<bool>> finished = pending->finished();
    std::vector<kr_request> fields(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      kr_request& r = fields[i];
      r = requests[i].fields;
      r.name = requests[i].name.c_str();
      r.ndim = static_cast<int>(requests[i].shape.size());
      r.shape = requests[i].shape.data();
      r.splits = requests[i].splits.data();
      r.nsplits = static_cast<int>(requests[i].splits.size());
      pending->Bind(static_cast<int>(i), &r, requests[i].received_splits_output);
    }
    // A refused request is completed through done, so the result adds nothing.
    (void)kr_enqueue_and_drive(
        fields.data(), static_cast<int>(fields.size()), group,
        [](void* flag) -> int { return static_cast<std::atomic<bool>*>(flag)->load(); },
        finished.get());
  }

  int32_t process_set_ = 0;
};

// The name of request i of a kernel that serves a single and a grouped op
// (`<name>.<i>` for the grouped one).
std::string TensorName(const std::string& name, bool grouped, int i) {
  return grouped ? name + "." + std::to_string(i) : name;
}

// What allreduce and reducescatter share: the reduction attrs.
class ReductionKernel : public CollectiveKernel {
 public:
  explicit ReductionKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_factor_));
    OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_factor_));
    OP_REQUIRES_OK(c, c->GetAttr("compression", &compression_));
  }

 protected:
  void SetReduction(kr_request* r) const {
    r->reduce_op = static_cast<kr_reduce_op>(reduce_op_);
    r->prescale_factor = prescale_factor_;
    r->postscale_factor = postscale_factor_;
    r->compression = static_cast<kr_compression>(compression_);
  }

 private:
  int reduce_op_ = KR_AVERAGE;
  float prescale_factor_ = 1.0f;
  float postscale_factor_ = 1.0f;
  int compression_ = KR_COMPRESSION_NONE;
};

// KerasRingAllreduce, and KerasRingGroupedAllreduce whose tensor i is named
// `<name>.<i>`.
class AllreduceOp : public ReductionKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c)
      : ReductionKernel(c), grouped_(type_string() == "KerasRingGroupedAllreduce") {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, RequestName(ctx, &name), done);
    std::vector<Request> requests(DataInputs(ctx));
    for (int i = 0; i < DataInputs(ctx); ++i) {
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(
          ctx, ctx->forward_input_or_allocate_output({i}, i, ctx->input(i).shape(), &output),
          done);
      OP_REQUIRES_OK_ASYNC(ctx,
                           NewRequest(ctx, i, TensorName(name, grouped_, i), KR_ALLREDUCE,
                                      output, &requests[i]),
                           done);
      SetReduction(&requests[i].fields);
    }
    // The group is named like the op; its tensor i as `<name>.<i>`.
    Submit(ctx, std::move(done), std::move(requests), grouped_ ? name.c_str() : nullptr);
  }

 private:
  const bool grouped_;
};

// KerasRingReducescatter, and KerasRingGroupedReducescatter whose tensor i is
// named `<name>.<i>`. The engine allocates each output once it has split the
// first dimension.
class ReducescatterOp : public ReductionKernel {
 public:
  explicit ReducescatterOp(OpKernelConstruction* c)
      : ReductionKernel(c), grouped_(type_string() == "KerasRingGroupedReducescatter") {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, RequestName(ctx, &name), done);
    std::vector<Request> requests(DataInputs(ctx));
    for (int i = 0; i < DataInputs(ctx); ++i) {
      OP_REQUIRES_OK_ASYNC(ctx,
                           NewRequest(ctx, i, TensorName(name, grouped_, i), KR_REDUCESCATTER,
                                      nullptr, &requests[i]),
                           done);
      SetReduction(&requests[i].fields);
    }
    Submit(ctx, std::move(done), std::move(requests));
  }

 private:
  const bool grouped_;
};

// KerasRingAllgather, and KerasRingGroupedAllgather whose tensor i is named
// `<name>.<i>`.
class AllgatherOp : public CollectiveKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction* c)
      : CollectiveKernel(c), grouped_(type_string() == "KerasRingGroupedAllgather") {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, RequestName(ctx, &name), done);
    std::vector<Request> requests(DataInputs(ctx));
    for (int i = 0; i < DataInputs(ctx); ++i) {
      OP_REQUIRES_OK_ASYNC(ctx,
                           NewRequest(ctx, i, TensorName(name, grouped_, i), KR_ALLGATHER,
                                      nullptr, &requests[i]),
                           done);
    }
    Submit(ctx, std::move(done), std::move(requests));
  }

 private:
  const bool grouped_;
};

// KerasRingAlltoall: output 0 comes from the engine's allocate_output, output
// 1 (received_splits) from the rows the engine reports.
class AlltoallOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, RequestName(ctx, &name), done);
    const Tensor& splits = ctx->input(1);
    OP_REQUIRES_ASYNC(ctx, ::tensorflow::TensorShapeUtils::IsVector(splits.shape()),
                      absl::InvalidArgumentError(
                          "keras-ring: alltoall splits must be a vector; received splits of "
                          "shape " + splits.shape().DebugString() + " for tensor '" + name +
                          "'"),
                      done);
    std::vector<Request> requests(1);
    OP_REQUIRES_OK_ASYNC(ctx, NewRequest(ctx, 0, name, KR_ALLTOALL, nullptr, &requests[0]),
                         done);
    // The engine checks the values (one per rank, none negative, adding up to
    // the first dimension) and names the tensor when they are wrong.
    const auto values = splits.vec<int32_t>();
    requests[0].splits.assign(values.data(), values.data() + values.size());
    requests[0].received_splits_output = 1;
    Submit(ctx, std::move(done), std::move(requests));
  }
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, RequestName(ctx, &name), done);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, ctx->input(0).shape(), &output),
        done);
    std::vector<Request> requests(1);
    OP_REQUIRES_OK_ASYNC(ctx, NewRequest(ctx, 0, name, KR_BROADCAST, output, &requests[0]),
                         done);
    requests[0].fields.root_rank = root_rank_;
    Submit(ctx, std::move(done), std::move(requests));
  }

 private:
  int root_rank_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("KerasRingAllreduce").Device(::tensorflow::DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedAllreduce").Device(::tensorflow::DEVICE_CPU),
                        AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingReducescatter").Device(::tensorflow::DEVICE_CPU),
                        ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedReducescatter").Device(::tensorflow::DEVICE_CPU),
                        ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingAllgather").Device(::tensorflow::DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedAllgather").Device(::tensorflow::DEVICE_CPU),
                        AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingAlltoall").Device(::tensorflow::DEVICE_CPU), AlltoallOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingBroadcast").Device(::tensorflow::DEVICE_CPU), BroadcastOp);

}  // namespace
}  // namespace keras_ring
