// Kernels of the keras-ring ops: thin adapters that turn one op invocation
// into engine requests (c_api.h) and finish the op from the engine's
// completion callback. No collective logic lives here.
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "c_api.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
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
    case KR_NOT_INITIALIZED:
      return absl::FailedPreconditionError(text);
    case KR_ABORTED:
      return absl::AbortedError(text);
    case KR_INTERNAL:
      return absl::InternalError(text);
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
    default:
      return absl::InvalidArgumentError("keras-ring does not support dtype " +
                                        ::tensorflow::DataTypeString(dtype));
  }
}

// A request and the storage that its name and shape pointers refer to; the
// pointers are set just before kr_enqueue, which copies both.
struct Request {
  std::string name;
  std::vector<int64_t> shape;
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

  // Routes request i's callbacks to this object; output i is its result.
  void Bind(int i, kr_request* request) {
    request->ctx = &slots_[i];
    request->allocate_output = &AllocateOutput;
    request->done = &Done;
  }

 private:
  struct Slot {
    PendingOp* op = nullptr;
    int output_index = 0;
    absl::Status allocation;  // why allocate_output failed, if it did
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
    slot->op->Complete(slot->allocation.ok() ? EngineStatus(status, message)
                                             : slot->allocation);
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
    delete this;
  }

  OpKernelContext* const ctx_;
  const AsyncOpKernel::DoneCallback done_;
  std::vector<Slot> slots_;
  std::mutex mu_;
  int remaining_;
  absl::Status status_;  // the first error
};

// What the four kernels share: the request name and the engine submission.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    // Node names are equal on every rank that built the same graph.
    if (name_.empty()) name_ = name();
  }

 protected:
  // Describes input `index` of `ctx` to the engine; output may be null
  // (allgather), in which case the engine asks for it via allocate_output.
  absl::Status NewRequest(OpKernelContext* ctx, int index, std::string name,
                          kr_collective collective, Tensor* output, Request* out) const {
    const Tensor& input = ctx->input(index);
    out->name = std::move(name);
    const auto dims = input.shape().dim_sizes();
    out->shape.assign(dims.begin(), dims.end());
    kr_request& r = out->fields;
    r.collective = collective;
    TF_RETURN_IF_ERROR(EngineDtype(input.dtype(), &r.dtype));
    r.input = input.data();
    r.output = output != nullptr ? output->data() : nullptr;
    r.prescale_factor = 1.0;
    r.postscale_factor = 1.0;
    // Only CPU kernels exist so far; GPU kernels will pass their device
    // ordinal here, with an event the engine waits on before reading.
    r.device = KR_DEVICE_CPU;
    return absl::OkStatus();
  }

  // Enqueues the requests; the op finishes when the last one completes.
  static void Submit(OpKernelContext* ctx, DoneCallback done, std::vector<Request> requests) {
    auto* pending = new PendingOp(ctx, std::move(done), static_cast<int>(requests.size()));
    for (size_t i = 0; i < requests.size(); ++i) {
      kr_request& r = requests[i].fields;
      r.name = requests[i].name.c_str();
      r.ndim = static_cast<int>(requests[i].shape.size());
      r.shape = requests[i].shape.data();
      // Until request i is enqueued, at least one request is incomplete, so
      // `pending` is alive; after the last kr_enqueue it may be gone.
      pending->Bind(static_cast<int>(i), &r);
      // A refused request is completed through done, so the result adds nothing.
      (void)kr_enqueue(&r);
    }
  }

  std::string name_;
};

// KerasRingAllreduce, and KerasRingGroupedAllreduce whose tensor i is named
// `<name>.<i>`.
class AllreduceOp : public CollectiveKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c)
      : CollectiveKernel(c), grouped_(type_string() == "KerasRingGroupedAllreduce") {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_factor_));
    OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_factor_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<Request> requests(ctx->num_inputs());
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(
          ctx, ctx->forward_input_or_allocate_output({i}, i, ctx->input(i).shape(), &output),
          done);
      std::string name = grouped_ ? name_ + "." + std::to_string(i) : name_;
      OP_REQUIRES_OK_ASYNC(
          ctx, NewRequest(ctx, i, std::move(name), KR_ALLREDUCE, output, &requests[i]), done);
      kr_request& r = requests[i].fields;
      r.reduce_op = static_cast<kr_reduce_op>(reduce_op_);
      r.prescale_factor = prescale_factor_;
      r.postscale_factor = postscale_factor_;
    }
    Submit(ctx, std::move(done), std::move(requests));
  }

 private:
  const bool grouped_;
  int reduce_op_ = KR_AVERAGE;
  float prescale_factor_ = 1.0f;
  float postscale_factor_ = 1.0f;
};

class AllgatherOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<Request> requests(1);
    OP_REQUIRES_OK_ASYNC(ctx, NewRequest(ctx, 0, name_, KR_ALLGATHER, nullptr, &requests[0]),
                         done);
    Submit(ctx, std::move(done), std::move(requests));
  }
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, ctx->input(0).shape(), &output),
        done);
    std::vector<Request> requests(1);
    OP_REQUIRES_OK_ASYNC(ctx, NewRequest(ctx, 0, name_, KR_BROADCAST, output, &requests[0]),
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
REGISTER_KERNEL_BUILDER(Name("KerasRingAllgather").Device(::tensorflow::DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("KerasRingBroadcast").Device(::tensorflow::DEVICE_CPU), BroadcastOp);

}  // namespace
}  // namespace keras_ring
