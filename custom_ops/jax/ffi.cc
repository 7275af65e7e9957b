// The XLA FFI handler behind keras_ring.jax: a thin adapter that turns one
// custom call into engine requests (c_api.h) and returns when the engine has
// completed them. No collective logic lives here.
//
// One handler serves every collective; its attributes say which. Operands:
// the data buffers, then (alltoall only) the splits as int32[set size] or
// int32[0] for an even split, then the name as uint8 bytes padded with NULs.
// The name is an operand rather than an attribute so that eager calls with
// new names reuse one compiled program; a call of several tensors names
// tensor i `<name>.<i>`, and with `grouped` its allreduces are one engine
// group of that name. Results: one per data buffer, then
// (alltoall only) the received splits as int32[set size]. (int32, as JAX
// has no int64 unless jax_enable_x64 is set.) XLA allocates every
// result before the call, so shapes the engine only learns while it runs
// (allgather, reducescatter, alltoall) must match what was traced.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "c_api.h"
#include "xla/ffi/api/ffi.h"

namespace keras_ring {
namespace {

namespace ffi = ::xla::ffi;

ffi::ErrorCode EngineCode(kr_status status) {
  switch (status) {
    case KR_OK:
      return ffi::ErrorCode::kOk;
    case KR_INVALID_ARGUMENT:
      return ffi::ErrorCode::kInvalidArgument;
    case KR_NOT_INITIALIZED:
    case KR_FAILED_PRECONDITION:
      return ffi::ErrorCode::kFailedPrecondition;
    case KR_ABORTED:
      return ffi::ErrorCode::kAborted;
    case KR_PEER_LOST:  // keras_ring.jax raises WorkerLostError for this code
      return ffi::ErrorCode::kUnavailable;
    case KR_INTERNAL:
      break;
  }
  return ffi::ErrorCode::kInternal;
}

bool EngineDtype(ffi::DataType dtype, kr_dtype* out) {
  switch (dtype) {
    case ffi::DataType::F16: *out = KR_FLOAT16; return true;
    case ffi::DataType::BF16: *out = KR_BFLOAT16; return true;
    case ffi::DataType::F32: *out = KR_FLOAT32; return true;
    case ffi::DataType::F64: *out = KR_FLOAT64; return true;
    case ffi::DataType::S8: *out = KR_INT8; return true;
    case ffi::DataType::U8: *out = KR_UINT8; return true;
    case ffi::DataType::S32: *out = KR_INT32; return true;
    case ffi::DataType::S64: *out = KR_INT64; return true;
    case ffi::DataType::S16: *out = KR_INT16; return true;
    case ffi::DataType::U16: *out = KR_UINT16; return true;
    case ffi::DataType::PRED: *out = KR_BOOL; return true;
    default: return false;
  }
}

std::string ShapeString(const int64_t* dims, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

const char* CollectiveName(int64_t collective) {
  switch (collective) {
    case KR_ALLREDUCE: return "allreduce";
    case KR_ALLGATHER: return "allgather";
    case KR_BROADCAST: return "broadcast";
    case KR_REDUCESCATTER: return "reducescatter";
    case KR_ALLTOALL: return "alltoall";
    default: return "collective";
  }
}

// One custom call's requests. The handler waits until the engine has
// completed every one, so all of it lives on the handler's stack.
class Call {
 public:
  explicit Call(int n) : slots_(n), remaining_(n) {
    for (Slot& slot : slots_) slot.call = this;
  }

  // Routes request i's callbacks here. `output` is XLA's result buffer for
  // it, of shape `dims`.
  void Bind(int i, kr_request* request, void* output, ffi::AnyBuffer::Dimensions dims,
            const std::string* name) {
    Slot& slot = slots_[i];
    slot.output = output;
    slot.dims.assign(dims.begin(), dims.end());
    slot.name = name;
    slot.collective = request->collective;
    request->ctx = &slot;
    request->allocate_output = &AllocateOutput;
    request->done = &Done;
  }

  static int Finished(void* ctx) { return static_cast<Call*>(ctx)->finished_.load(); }

  // Blocks until every request has completed; returns the first error.
  ffi::Error Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return remaining_ == 0; });
    if (status_ == KR_OK) return ffi::Error::Success();
    return ffi::Error(EngineCode(status_), message_);
  }

 private:
  struct Slot {
    Call* call = nullptr;
    void* output = nullptr;
    std::vector<int64_t> dims;
    const std::string* name = nullptr;
    kr_collective collective = KR_ALLREDUCE;
    std::string allocation_error;  // why allocate_output refused, if it did
  };

  // The engine knows the result's shape; XLA allocated the one traced.
  static void* AllocateOutput(void* ctx, int ndim, const int64_t* shape) {
    Slot* slot = static_cast<Slot*>(ctx);
    if (static_cast<size_t>(ndim) == slot->dims.size() &&
        std::equal(shape, shape + ndim, slot->dims.begin())) {
      return slot->output;
    }
    slot->allocation_error =
        std::string("keras-ring: ") + CollectiveName(slot->collective) + " of tensor '" +
        *slot->name + "' received a result of shape " + ShapeString(shape, ndim) +
        ", but the output traced for it has shape " +
        ShapeString(slot->dims.data(), slot->dims.size()) +
        ". Inside jax.jit, a result's shape is fixed when the function is traced: every "
        "rank must gather the same number of rows (alltoall: with an even split); outside "
        "jax.jit they may differ";
    return nullptr;
  }

  static void Done(void* ctx, kr_status status, const char* message) {
    Slot* slot = static_cast<Slot*>(ctx);
    Call* call = slot->call;
    std::lock_guard<std::mutex> lock(call->mu_);
    if (call->status_ == KR_OK && status != KR_OK) {
      // A refused allocation says more than the engine's report of it.
      call->status_ = slot->allocation_error.empty() ? status : KR_INVALID_ARGUMENT;
      call->message_ = slot->allocation_error.empty() ? (message ? message : "")
                                                      : slot->allocation_error;
    }
    if (--call->remaining_ == 0) {
      call->finished_.store(true);
      // Under the lock: Wait() cannot return, and the call end, before this.
      call->cv_.notify_all();
    }
  }

  std::vector<Slot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int remaining_;
  kr_status status_ = KR_OK;
  std::string message_;
  std::atomic<bool> finished_{false};
};

ffi::Error Collective(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t collective,
                      int64_t reduce_op, double prescale_factor, double postscale_factor,
                      int64_t compression, int64_t root_rank, int64_t process_set,
                      int64_t grouped) {
  const bool alltoall = collective == KR_ALLTOALL;
  const size_t extra = alltoall ? 1 : 0;  // splits in, received splits out
  if (args.size() < 2 + extra || rets.size() != args.size() - 1) {
    return ffi::Error::InvalidArgument("keras-ring: malformed custom call (operands and "
                                       "results do not match)");
  }
  const size_t n = args.size() - 1 - extra;

  auto name_buffer = args.get<ffi::AnyBuffer>(args.size() - 1);
  if (name_buffer.has_error()) return name_buffer.error();
  const char* name_bytes = static_cast<const char*>(name_buffer->untyped_data());
  const std::string name(name_bytes, strnlen(name_bytes, name_buffer->size_bytes()));

  std::vector<std::string> names(n);
  std::vector<std::vector<int64_t>> shapes(n);
  std::vector<kr_request> requests(n);
  Call call(static_cast<int>(n));
  std::vector<int64_t> splits;
  std::vector<int64_t> received_splits;
  int32_t* received_output = nullptr;
  if (alltoall) {
    auto given = args.get<ffi::AnyBuffer>(n);
    auto received = rets.get<ffi::AnyBuffer>(n);
    if (given.has_error()) return given.error();
    if (received.has_error()) return received.error();
    const int32_t* values = static_cast<const int32_t*>(given->untyped_data());
    splits.assign(values, values + given->element_count());
    // One entry per rank of the set; without such a set the engine refuses the request.
    const int set_size = kr_process_set_ranks(static_cast<int32_t>(process_set), nullptr, 0);
    if (set_size >= 0) {
      if ((*received)->element_count() != static_cast<size_t>(set_size)) {
        return ffi::Error::InvalidArgument("keras-ring: alltoall of tensor '" + name +
                                           "' was traced for another number of ranks");
      }
      received_splits.resize(set_size);
      received_output = static_cast<int32_t*>((*received)->untyped_data());
    }
  }
  for (size_t i = 0; i < n; ++i) {
    auto input = args.get<ffi::AnyBuffer>(i);
    auto output = rets.get<ffi::AnyBuffer>(i);
    if (input.has_error()) return input.error();
    if (output.has_error()) return output.error();
    names[i] = grouped || n > 1 ? name + "." + std::to_string(i) : name;
    const auto dims = input->dimensions();
    shapes[i].assign(dims.begin(), dims.end());
    kr_request& r = requests[i];
    r.struct_size = sizeof r;
    r.name = names[i].c_str();
    r.collective = static_cast<kr_collective>(collective);
    if (!EngineDtype(input->element_type(), &r.dtype)) {
      return ffi::Error::InvalidArgument("keras-ring: tensor '" + names[i] +
                                         "' has a dtype the engine does not support");
    }
    r.ndim = static_cast<int>(shapes[i].size());
    r.shape = shapes[i].data();
    r.input = input->untyped_data();
    const bool engine_allocates = collective == KR_ALLGATHER ||
                                  collective == KR_REDUCESCATTER || alltoall;
    r.output = engine_allocates ? nullptr : (*output)->untyped_data();
    r.reduce_op = static_cast<kr_reduce_op>(reduce_op);
    r.prescale_factor = prescale_factor;
    r.postscale_factor = postscale_factor;
    r.compression = static_cast<kr_compression>(compression);
    r.root_rank = static_cast<int>(root_rank);
    r.splits = splits.data();
    r.nsplits = static_cast<int>(splits.size());
    r.received_splits = received_output ? received_splits.data() : nullptr;
    r.process_set = static_cast<int32_t>(process_set);
    r.device = KR_DEVICE_CPU;
    call.Bind(static_cast<int>(i), &r, (*output)->untyped_data(), (*output)->dimensions(),
              &names[i]);
  }
  // This thread runs the engine while it waits (kr_drive), as the TF kernels
  // do; a refused request completes through done.
  (void)kr_enqueue_and_drive(requests.data(), static_cast<int>(n),
                             grouped && n > 1 ? name.c_str() : nullptr, &Call::Finished,
                             &call);
  ffi::Error result = call.Wait();
  for (size_t j = 0; result.success() && received_output && j < received_splits.size(); ++j) {
    if (received_splits[j] > std::numeric_limits<int32_t>::max()) {
      return ffi::Error(ffi::ErrorCode::kOutOfRange,
                        "keras-ring: alltoall received " + std::to_string(received_splits[j]) +
                            " rows from rank " + std::to_string(j) +
                            ", more than received_splits (int32) holds");
    }
    received_output[j] = static_cast<int32_t>(received_splits[j]);
  }
  return result;
}

}  // namespace
}  // namespace keras_ring

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasRingJaxCollective, keras_ring::Collective,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("collective")
                                  .Attr<int64_t>("reduce_op")
                                  .Attr<double>("prescale_factor")
                                  .Attr<double>("postscale_factor")
                                  .Attr<int64_t>("compression")
                                  .Attr<int64_t>("root_rank")
                                  .Attr<int64_t>("process_set")
                                  .Attr<int64_t>("grouped"));
