// keras_ring.core._engine: the engine for NumPy arrays. Used by keras_ring for
// init/topology, by tests and benchmarks that run without TensorFlow, and on
// machines (GPU hosts) that have no TensorFlow.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "c_api.h"

namespace py = pybind11;

namespace {

class Call;

// What the engine leaves for one request: its status and any output it
// allocated (allgather and others). Written from the engine's thread.
struct Outcome {
  Call* call = nullptr;
  kr_status status = KR_OK;
  std::string message;
  size_t element_size = 0;
  // An output the engine asked for, with malloc (the engine's thread holds no
  // GIL, so no NumPy array can be made there): the result array takes it over.
  void* gathered = nullptr;
  std::vector<int64_t> gathered_shape;
  std::vector<int64_t> received_splits;  // alltoall

  Outcome() = default;
  Outcome(const Outcome&) = delete;
  Outcome& operator=(const Outcome&) = delete;
  ~Outcome() { std::free(gathered); }

  static void Done(void* ctx, kr_status status, const char* message);

  static void* Allocate(void* ctx, int ndim, const int64_t* shape) {
    auto* self = static_cast<Outcome*>(ctx);
    try {
      self->gathered_shape.assign(shape, shape + ndim);
    } catch (const std::exception&) {
      return nullptr;  // the engine reports the failed allocation
    }
    size_t count = 1;
    for (int i = 0; i < ndim; ++i) count *= static_cast<size_t>(shape[i]);
    constexpr size_t kAlign = 64;
    const size_t bytes = (count * self->element_size + kAlign) / kAlign * kAlign;  // never 0
    std::free(self->gathered);
    self->gathered = std::aligned_alloc(kAlign, bytes);
    return self->gathered;
  }
};

// The requests of one submit() or run() call and how many are still pending:
// one count and one wake-up for the call, not one per request, which was
// most of the binding's cost per small array. Holds no Python objects: the
// engine's thread (which may be a waiting caller without the GIL) must never
// touch them.
class Call : public std::enable_shared_from_this<Call> {
 public:
  explicit Call(size_t n) : outcomes_(n), pending_(n), all_done_(n == 0) {
    for (Outcome& o : outcomes_) o.call = this;
  }

  Outcome& outcome(size_t i) { return outcomes_[i]; }
  const Outcome& outcome(size_t i) const { return outcomes_[i]; }

  // Whether every request has completed and the engine has let go of the
  // call (the last completion sets this after its count reaches zero).
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return all_done_;
  }

  // Readies a call whose requests have all finished (or never started) to
  // run them again.
  void Reset() {
    for (Outcome& o : outcomes_) {
      o.status = KR_OK;
      o.message.clear();
    }
    pending_.store(outcomes_.size(), std::memory_order_relaxed);
    all_done_ = outcomes_.empty();
  }
  // Runs the engine on this thread until every request is done (the fastest
  // way to wait), then waits for the last completion to let go of the call.
  // Without the GIL.
  void Wait() {
    if (!Finished(this)) kr_drive(&Finished, this);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return all_done_; });
  }

  void OneDone() {
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    // The waiter may free the call once all_done_ is set: keep it meanwhile.
    const std::shared_ptr<Call> keep = shared_from_this();
    std::lock_guard<std::mutex> lock(mu_);
    all_done_ = true;
    cv_.notify_all();
  }

  // For kr_drive: whether every request has completed (the last one may
  // still be inside its done callback: only Wait() and done() say that the
  // call may be freed).
  static int Finished(void* ctx) {
    return static_cast<Call*>(ctx)->pending_.load(std::memory_order_acquire) == 0;
  }

 private:
  std::vector<Outcome> outcomes_;  // never resized: the engine holds pointers into it
  std::atomic<size_t> pending_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool all_done_;
};

void Outcome::Done(void* ctx, kr_status status, const char* message) {
  auto* self = static_cast<Outcome*>(ctx);
  self->status = status;
  if (status != KR_OK && message) self->message = message;
  self->call->OneDone();
}

kr_dtype ToKrDtype(const py::dtype& dt) {
  // By kind and size, read straight from the descriptor: asking NumPy for the
  // name costs a few attribute lookups on every submission. bfloat16
  // (ml_dtypes) is a NumPy extension type of kind 'V', found by its name.
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (kind == 'f' && size == 2) return KR_FLOAT16;
  if (kind == 'f' && size == 4) return KR_FLOAT32;
  if (kind == 'f' && size == 8) return KR_FLOAT64;
  if (kind == 'i' && size == 1) return KR_INT8;
  if (kind == 'u' && size == 1) return KR_UINT8;
  if (kind == 'i' && size == 4) return KR_INT32;
  if (kind == 'i' && size == 8) return KR_INT64;
  if (kind == 'i' && size == 2) return KR_INT16;
  if (kind == 'u' && size == 2) return KR_UINT16;
  if (kind == 'b' && size == 1) return KR_BOOL;
  const std::string name = py::str(dt.attr("name"));
  if (name == "bfloat16") return KR_BFLOAT16;
  throw py::type_error("keras-ring: unsupported dtype " + name +
                       "; supported: float16, bfloat16, float32, float64, int8, uint8, int32, "
                       "int64 and, by allgather, broadcast and alltoall only, int16, uint16, "
                       "bool. Received: dtype=" + name);
}

// ValueError for a bad request and for ranks that disagree on one (Python has
// no class of its own for the second; the TF ops raise InvalidArgumentError
// and FailedPreconditionError); RuntimeError for the rest.
// keras_ring.core._errors.WorkerLostError, imported with this module: the error
// path runs no Python code of its own, so that a launcher's SIGINT that
// follows a rank's death cannot interrupt it halfway.
py::handle worker_lost_error;

void RaiseFor(kr_status status, const std::string& message) {
  if (status == KR_INVALID_ARGUMENT || status == KR_FAILED_PRECONDITION) {
    throw py::value_error(message);
  }
  if (status == KR_PEER_LOST) {
    PyErr_SetString(worker_lost_error.ptr(), message.c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(message);
}

// What the requests of one call share.
struct Args {
  int collective = KR_ALLREDUCE;
  int op = KR_SUM;
  double prescale = 1.0, postscale = 1.0;
  int root_rank = 0;
  std::vector<int64_t> splits;
  int32_t process_set = 0;
  int compression = KR_COMPRESSION_NONE;
};

// The arrays of one call, kept alive until the engine is done with them, and
// the requests that point into them (and into the call's Args).
struct Arrays {
  std::vector<py::array> inputs;
  std::vector<py::array> outputs;  // empty where the engine allocates the outputs
  std::vector<py::object> allocated;  // the engine's outputs, once arrays (else None)
  std::vector<kr_request> requests;
};

static_assert(sizeof(py::ssize_t) == sizeof(int64_t), "shapes are passed to the engine as is");

bool WritesOutput(int collective) {
  return collective == KR_ALLREDUCE || collective == KR_BROADCAST || collective == KR_JOIN;
}

py::array Input(const py::handle& array) {
  py::array input = py::array::ensure(array, py::array::c_style);
  if (!input) throw py::type_error("keras-ring: expected an array-like input");
  return input;
}

size_t DtypeSize(kr_dtype dtype) {
  switch (dtype) {
    case KR_FLOAT16: case KR_BFLOAT16: case KR_INT16: case KR_UINT16: return 2;
    case KR_FLOAT32: case KR_INT32: return 4;
    case KR_FLOAT64: case KR_INT64: return 8;
    default: return 1;
  }
}

// The engine's dtype of each input: `dtypes[i]` where given (a kr_dtype, for
// a type NumPy lacks, bfloat16 held as 16-bit integers), else the array's.
std::vector<kr_dtype> DtypesOf(const std::vector<py::array>& inputs,
                               const std::vector<int>& dtypes) {
  if (!dtypes.empty() && dtypes.size() != inputs.size()) {
    throw py::value_error("keras-ring: dtypes needs one entry per array. Received: " +
                          std::to_string(dtypes.size()) + " dtypes for " +
                          std::to_string(inputs.size()) + " arrays");
  }
  std::vector<kr_dtype> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (dtypes.empty()) {
      out.push_back(ToKrDtype(inputs[i].dtype()));
      continue;
    }
    const auto d = static_cast<kr_dtype>(dtypes[i]);
    if (dtypes[i] < KR_FLOAT16 || dtypes[i] > KR_BOOL ||
        DtypeSize(d) != static_cast<size_t>(inputs[i].itemsize())) {
      throw py::value_error("keras-ring: dtypes[" + std::to_string(i) + "]=" +
                            std::to_string(dtypes[i]) + " is no engine dtype of the array's " +
                            std::to_string(inputs[i].itemsize()) + "-byte elements");
    }
    out.push_back(d);
  }
  return out;
}

// `given` as the outputs of `inputs`: writeable C-contiguous arrays of the
// inputs' shapes and element sizes.
std::vector<py::array> GivenOutputs(const std::vector<py::array>& inputs,
                                    const py::sequence& given) {
  if (given.size() != inputs.size()) {
    throw py::value_error("keras-ring: outputs needs one array per input. Received: " +
                          std::to_string(given.size()) + " outputs for " +
                          std::to_string(inputs.size()) + " inputs");
  }
  std::vector<py::array> outputs;
  outputs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    py::array out = py::reinterpret_borrow<py::object>(given[i]);
    const py::array& in = inputs[i];
    const bool same_shape =
        out.ndim() == in.ndim() && std::equal(in.shape(), in.shape() + in.ndim(), out.shape());
    if (!out.writeable() || !(out.flags() & py::array::c_style) || !same_shape ||
        out.itemsize() != in.itemsize()) {
      throw py::value_error("keras-ring: outputs[" + std::to_string(i) +
                            "] must be a writeable C-contiguous array of its input's shape "
                            "and element size");
    }
    outputs.push_back(std::move(out));
  }
  return outputs;
}

// Outputs shaped like `inputs`, as views into one allocation (one malloc and
// one free per call rather than per array: a 4 KiB array each costs about as
// much as the engine's own work on it).
std::vector<py::array> OutputsLike(const std::vector<py::array>& inputs) {
  std::vector<py::array> outputs;
  outputs.reserve(inputs.size());
  if (inputs.size() == 1) {
    const py::array& in = inputs[0];
    outputs.emplace_back(in.dtype(), std::vector<py::ssize_t>(in.shape(), in.shape() + in.ndim()));
    return outputs;
  }
  constexpr size_t kAlign = 64;
  std::vector<size_t> offsets;
  offsets.reserve(inputs.size());
  size_t total = 0;
  for (const py::array& in : inputs) {
    offsets.push_back(total);
    total += (static_cast<size_t>(in.nbytes()) + kAlign - 1) / kAlign * kAlign;
  }
  py::array_t<uint8_t> base(static_cast<py::ssize_t>(total + kAlign));
  const auto start = reinterpret_cast<uintptr_t>(base.mutable_data());
  uint8_t* aligned = base.mutable_data() + (kAlign - start % kAlign) % kAlign;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const py::array& in = inputs[i];
    outputs.emplace_back(in.dtype(), std::vector<py::ssize_t>(in.shape(), in.shape() + in.ndim()),
                         std::vector<py::ssize_t>(), aligned + offsets[i], base);
  }
  return outputs;
}

// The request for `input` (named `name`, which must outlive the call) whose
// completion goes to `outcome`; `output` is where the result goes (NULL for
// the collectives whose output the engine allocates).
kr_request Prepare(const Args& a, const py::array& input, kr_dtype dtype, void* output,
                   const char* name, Outcome* outcome) {
  outcome->element_size = static_cast<size_t>(input.itemsize());
  if (a.collective == KR_ALLTOALL) {
    const int set_size = kr_process_set_ranks(a.process_set, nullptr, 0);
    outcome->received_splits.resize(set_size > 0 ? set_size : 0);
  }
  kr_request r{};
  r.struct_size = sizeof r;
  r.name = name;
  r.collective = static_cast<kr_collective>(a.collective);
  r.dtype = dtype;
  r.ndim = static_cast<int>(input.ndim());
  r.shape = reinterpret_cast<const int64_t*>(input.shape());
  r.input = input.data();
  r.output = output;
  r.reduce_op = static_cast<kr_reduce_op>(a.op);
  r.prescale_factor = a.prescale;
  r.postscale_factor = a.postscale;
  r.compression = static_cast<kr_compression>(a.compression);
  r.root_rank = a.root_rank;
  r.splits = a.splits.data();
  r.nsplits = static_cast<int>(a.splits.size());
  r.received_splits = outcome->received_splits.empty() ? nullptr
                                                       : outcome->received_splits.data();
  r.device = KR_DEVICE_CPU;
  r.process_set = a.process_set;
  r.allocate_output = &Outcome::Allocate;
  r.done = &Outcome::Done;
  r.ctx = outcome;
  return r;
}

// The requests of a call on `inputs`, with their outputs: `outputs` where
// given (None: new arrays) for the collectives that write into one.
void PrepareAll(const Args& a, std::vector<py::array> inputs, const std::vector<const char*>& names,
                const std::vector<int>& dtypes, const py::object& outputs, Call* call,
                Arrays* arrays) {
  const std::vector<kr_dtype> engine_dtypes = DtypesOf(inputs, dtypes);
  arrays->inputs = std::move(inputs);
  const size_t n = arrays->inputs.size();
  if (WritesOutput(a.collective)) {
    arrays->outputs = outputs.is_none() ? OutputsLike(arrays->inputs)
                                        : GivenOutputs(arrays->inputs, outputs);
  } else {
    arrays->allocated.assign(n, py::none());
  }
  arrays->requests.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    void* output = arrays->outputs.empty() ? nullptr : arrays->outputs[i].mutable_data();
    arrays->requests.push_back(
        Prepare(a, arrays->inputs[i], engine_dtypes[i], output, names[i], &call->outcome(i)));
  }
}

// Request i's result, once its call has finished: raises its error. An
// output the engine allocated becomes the result array's own memory.
py::object Result(Call& call, Arrays& arrays, size_t i) {
  Outcome& o = call.outcome(i);
  if (o.status != KR_OK) RaiseFor(o.status, o.message);
  if (!arrays.outputs.empty()) return arrays.outputs[i];
  if (o.gathered) {
    py::capsule owner(o.gathered, [](void* p) { std::free(p); });
    o.gathered = nullptr;
    arrays.allocated[i] = py::array(arrays.inputs[i].dtype(), o.gathered_shape,
                                    std::vector<py::ssize_t>(), owner.get_pointer(), owner);
  }
  return arrays.allocated[i];
}

// The requests of a run() call on `arrays` (named by `names`), ready to run.
class Batch {
 public:
  Batch(Args args, const py::sequence& arrays, const py::sequence& names, std::string group,
        const std::vector<int>& dtypes = {}, const py::object& outputs = py::none())
      : args_(std::move(args)), group_(std::move(group)) {
    if (PyUnicode_Check(names.ptr())) {
      throw py::type_error("keras-ring: run() needs a sequence of names, one per array. "
                           "Received: names=" + py::repr(names).cast<std::string>());
    }
    const size_t n = arrays.size();
    if (n != names.size()) {
      throw py::value_error("keras-ring: run() needs one name per array. Received: " +
                            std::to_string(n) + " arrays and " + std::to_string(names.size()) +
                            " names");
    }
    // The requests point to the names' UTF-8, which lives in the str objects.
    std::vector<const char*> name_ptrs;
    std::vector<py::array> inputs;
    names_.reserve(n);
    name_ptrs.reserve(n);
    inputs.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      names_.push_back(names[i]);
      if (!PyUnicode_Check(names_.back().ptr())) {
        throw py::type_error("keras-ring: run() names must be str. Received: names[" +
                             std::to_string(i) + "]=" +
                             py::repr(names_.back()).cast<std::string>());
      }
      name_ptrs.push_back(PyUnicode_AsUTF8(names_.back().ptr()));
      if (!name_ptrs.back()) throw py::error_already_set();
      inputs.push_back(Input(arrays[i]));
    }
    call_ = std::make_shared<Call>(n);
    PrepareAll(args_, std::move(inputs), name_ptrs, dtypes, outputs, call_.get(), &arrays_);
  }

  // Runs every request, this thread running the engine while it waits (the
  // fastest way to wait); with a group name, the allreduces form one group
  // (kr_enqueue_and_drive). Raises the first request's error, if any.
  void Execute() {
    // Under the GIL: another thread may not run or read this batch meanwhile.
    if (busy_) throw std::runtime_error("keras-ring: this prepared run is already running");
    busy_ = true;
    struct Idle {
      bool* busy;
      ~Idle() { *busy = false; }
    } idle{&busy_};
    Ready();
    {
      py::gil_scoped_release release;
      // Refusals arrive through done, like any other outcome.
      kr_enqueue_and_drive(arrays_.requests.data(), static_cast<int>(arrays_.requests.size()),
                           group_.c_str(), &Call::Finished, call_.get());
      call_->Wait();
    }
    RaiseFirstError();
  }

  // Hands every request to the engine's thread and returns (submit()).
  void Start() {
    Ready();
    // Refusals arrive through done, like any other outcome.
    kr_enqueue_group(arrays_.requests.data(), static_cast<int>(arrays_.requests.size()),
                     group_.c_str());
  }

  bool done() { return call_->done(); }

  // After Start(): waits for every request; raises the first one's error.
  void Finish() {
    if (!call_->done()) {  // else no need to let go of the GIL
      py::gil_scoped_release release;
      call_->Wait();
    }
    RaiseFirstError();
  }

  // Waits without the GIL, unless done: for a handle dropped while in flight.
  void WaitQuietly() {
    if (call_->done()) return;
    py::gil_scoped_release release;
    call_->Wait();
  }

  py::list received_splits(size_t i) const {
    py::list out;
    for (int64_t s : call_->outcome(i).received_splits) out.append(s);
    return out;
  }

  size_t size() const { return arrays_.requests.size(); }

  // The results of the last Execute(), in order.
  py::list Results() {
    if (busy_ || !ran_) {
      throw std::runtime_error("keras-ring: the results of a prepared run are there once its "
                               "run() has returned");
    }
    py::list results(arrays_.requests.size());
    for (size_t i = 0; i < arrays_.requests.size(); ++i) results[i] = Result(*call_, arrays_, i);
    return results;
  }

 private:
  void Ready() {
    call_->Reset();
    std::fill(arrays_.allocated.begin(), arrays_.allocated.end(), py::none());
    ran_ = true;
  }

  void RaiseFirstError() const {
    for (size_t i = 0; i < arrays_.requests.size(); ++i) {
      const Outcome& o = call_->outcome(i);
      if (o.status != KR_OK) RaiseFor(o.status, o.message);
    }
  }

  Args args_;  // the requests point into its splits
  std::string group_;
  std::vector<py::object> names_;
  Arrays arrays_;
  std::shared_ptr<Call> call_;
  bool busy_ = false, ran_ = false;
};

// Submitted collectives (submit()): their arrays stay alive, and a handle
// dropped while they run waits for them.
class Handle {
 public:
  Handle(std::unique_ptr<Batch> batch, bool single)
      : batch_(std::move(batch)), single_(single) {
    batch_->Start();
  }
  ~Handle() { batch_->WaitQuietly(); }

  bool done() { return batch_->done(); }

  // The result (submit() of one array) or the list of results.
  py::object wait() {
    batch_->Finish();
    py::list results = batch_->Results();
    return single_ ? results[0] : py::object(results);
  }

  // Alltoall: waits, then returns the rows received from each rank (from
  // each array's collective, for several).
  py::object received_splits() {
    batch_->Finish();
    if (single_) return batch_->received_splits(0);
    py::list all;
    for (size_t i = 0; i < batch_->size(); ++i) all.append(batch_->received_splits(i));
    return all;
  }

 private:
  std::unique_ptr<Batch> batch_;
  bool single_;
};

std::unique_ptr<Handle> Submit(int collective, const py::object& arrays, const py::object& names,
                               int op, double prescale, double postscale, int root_rank,
                               std::vector<int64_t> splits, int32_t process_set,
                               int compression, const std::string& group,
                               const std::vector<int>& dtypes, const py::object& outputs) {
  // One array and one name, or a sequence of each.
  const bool single = PyUnicode_Check(names.ptr());
  const Args a{collective, op, prescale, postscale, root_rank, std::move(splits), process_set,
               compression};
  auto batch = single ? std::make_unique<Batch>(
                            a, py::make_tuple(arrays), py::make_tuple(names), group, dtypes,
                            outputs.is_none() ? outputs : py::object(py::make_tuple(outputs)))
                      : std::make_unique<Batch>(a, arrays, names, group, dtypes, outputs);
  return std::make_unique<Handle>(std::move(batch), single);
}

// Runs a collective on each array (named by `names`) and returns their results in order.
py::list Run(int collective, const py::sequence& arrays, const py::sequence& names, int op,
             double prescale, double postscale, int root_rank, std::vector<int64_t> splits,
             int32_t process_set, int compression, const std::string& group,
             const std::vector<int>& dtypes, const py::object& outputs) {
  Batch batch({collective, op, prescale, postscale, root_rank, std::move(splits), process_set,
               compression},
              arrays, names, group, dtypes, outputs);
  batch.Execute();
  return batch.Results();
}

void Check(kr_status status, const char* err) {
  if (status != KR_OK) RaiseFor(status, err);
}

// dst = dst (op) src with the named CPU kernels (None: those in use), for the
// kernel tests and benchmark; `repeat` times, so that the benchmark can time
// the kernel rather than this call's overhead (about 2.5 us).
void ReduceIntoArray(py::array dst, py::array src, int op, const py::object& kernels,
                     int repeat) {
  if (!dst.writeable() || !(dst.flags() & py::array::c_style)) {
    throw py::value_error("keras-ring: dst must be a writeable C-contiguous array");
  }
  if (!(src.flags() & py::array::c_style) || !src.dtype().is(dst.dtype()) ||
      src.size() != dst.size()) {
    throw py::value_error("keras-ring: src must be a C-contiguous array of dst's dtype and size");
  }
  const kr_dtype dtype = ToKrDtype(dst.dtype());
  const std::string name = kernels.is_none() ? "" : kernels.cast<std::string>();
  char err[512] = {0};
  kr_status s = KR_OK;
  {
    py::gil_scoped_release release;
    for (int i = 0; i < repeat && s == KR_OK; ++i) {
      s = kr_reduce_into(dst.mutable_data(), src.data(), static_cast<size_t>(dst.size()), dtype,
                         static_cast<kr_reduce_op>(op),
                         kernels.is_none() ? nullptr : name.c_str(), err, sizeof(err));
    }
  }
  Check(s, err);
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "keras-ring engine binding for NumPy arrays (internal).";
  // Kept for the process's life (a handle, never released at exit).
  worker_lost_error =
      py::object(py::module_::import("keras_ring.core._errors").attr("WorkerLostError")).release();

  m.attr("ALLREDUCE") = static_cast<int>(KR_ALLREDUCE);
  m.attr("ALLGATHER") = static_cast<int>(KR_ALLGATHER);
  m.attr("BROADCAST") = static_cast<int>(KR_BROADCAST);
  m.attr("REDUCESCATTER") = static_cast<int>(KR_REDUCESCATTER);
  m.attr("ALLTOALL") = static_cast<int>(KR_ALLTOALL);
  m.attr("JOIN") = static_cast<int>(KR_JOIN);

  // Settings given to init() (the others come from the environment): names
  // as kr_init_options's fields.
  m.def("init", [](const py::dict& settings) {
    kr_init_options o = KR_INIT_OPTIONS_DEFAULT;
    std::string world_name;  // o.world_name points into it
    for (const auto& item : settings) {
      const std::string key = py::str(item.first);
      const py::handle value = item.second;
      if (key == "fusion_threshold") {
        o.fusion_threshold = value.cast<int64_t>();
      } else if (key == "cycle_time_ms") {
        o.cycle_time_ms = value.cast<double>();
      } else if (key == "stall_check_seconds") {
        o.stall_check_seconds = value.cast<double>();
      } else if (key == "stall_shutdown_seconds") {
        o.stall_shutdown_seconds = value.cast<double>();
      } else if (key == "cache_capacity") {
        o.cache_capacity = value.cast<int64_t>();
      } else if (key == "rank") {
        o.rank = value.cast<int32_t>();
      } else if (key == "size") {
        o.size = value.cast<int32_t>();
      } else if (key == "world_name") {
        world_name = value.cast<std::string>();
        o.world_name = world_name.c_str();
      } else {
        throw py::value_error("keras-ring: unknown engine setting " + key);
      }
    }
    char err[2048] = {0};
    kr_status s;
    {
      py::gil_scoped_release release;
      s = kr_init_with_options(&o, err, sizeof(err));
    }
    Check(s, err);
    // MPICH's launchers take a rank that exits without MPI_Finalize for a
    // failed one (the forker interrupts every rank still running), so
    // whoever starts the engine finalizes at exit: from Python's atexit, in
    // the main thread that started MPI, while the callbacks of requests still
    // pending can take the GIL.
    static bool exit_hook_registered = false;
    if (!exit_hook_registered) {
      py::module_::import("atexit").attr("register")(py::cpp_function([] {
        py::gil_scoped_release release;
        kr_finalize();
      }));
      exit_hook_registered = true;
    }
  }, py::arg("settings") = py::dict());
  m.def("shutdown", [] {
    char err[2048] = {0};
    kr_status s;
    {
      py::gil_scoped_release release;
      s = kr_shutdown(err, sizeof(err));
    }
    Check(s, err);
  });
  m.def("is_initialized", [] { return kr_is_initialized() != 0; });
  m.def("topology", [] {
    kr_topology t;
    if (kr_get_topology(&t) != KR_OK) throw py::value_error("keras-ring is not initialised");
    py::dict d;
    d["rank"] = t.rank;
    d["size"] = t.size;
    d["local_rank"] = t.local_rank;
    d["local_size"] = t.local_size;
    d["cross_rank"] = t.cross_rank;
    d["cross_size"] = t.cross_size;
    d["is_homogeneous"] = t.is_homogeneous != 0;
    d["mpi_threads_supported"] = t.mpi_threads_supported != 0;
    return d;
  });
  m.def("stats", [] {
    kr_stats s;
    kr_get_stats(&s);
    py::dict d;
    d["collectives"] = s.collectives;
    d["tensors"] = s.tensors;
    d["fused_tensors"] = s.fused_tensors;
    d["cached_tensors"] = s.cached_tensors;
    d["shm_collectives"] = s.shm_collectives;
    d["hierarchical_collectives"] = s.hierarchical_collectives;
    return d;
  }, "Counters since the process started: collectives run, tensors completed, fused tensors, "
     "tensors announced by response-cache id.");
  m.def("parameters", [] {
    kr_parameters p;
    kr_get_parameters(&p);
    py::dict d;
    d["fusion_threshold"] = p.fusion_threshold;
    d["cycle_time_ms"] = p.cycle_time_ms;
    d["segment_bytes"] = p.segment_bytes;
    d["small_allreduce_bytes"] = p.small_allreduce_bytes;
    d["autotune"] = p.autotune == 0 ? "off" : p.autotune == 1 ? "tuning" : "tuned";
    return d;
  }, "The performance settings in use (as the autotuner leaves them, the same on every rank).");
  m.def("add_process_set", [](std::vector<int> ranks) {
    char err[2048] = {0};
    int32_t id = -1;
    kr_status s;
    {
      py::gil_scoped_release release;
      s = kr_add_process_set(ranks.data(), static_cast<int>(ranks.size()), &id, err, sizeof(err));
    }
    Check(s, err);
    return id;
  }, "Adds a process set of these world ranks (every rank must call it); returns its id.");
  m.def("remove_process_set", [](int32_t id) {
    char err[2048] = {0};
    kr_status s;
    {
      py::gil_scoped_release release;
      s = kr_remove_process_set(id, err, sizeof(err));
    }
    Check(s, err);
  }, "Removes a process set (every rank must call it).");
  m.def("process_set_ranks", [](int32_t id) -> py::object {
    const int n = kr_process_set_ranks(id, nullptr, 0);
    if (n < 0) return py::none();
    std::vector<int> ranks(n);
    kr_process_set_ranks(id, ranks.data(), n);
    return py::cast(ranks);
  }, "The world ranks of a process set, or None if there is no such set.");
  m.def("mpi_library_version", [] { return std::string(kr_mpi_library_version()); });
  m.def("_cpu_kernels", [] { return std::string(kr_cpu_kernels()); });
  m.def("_cpu_supports_kernels",
        [](const std::string& kernels) { return kr_cpu_supports_kernels(kernels.c_str()) == 1; });
  m.def("_reduce_into", &ReduceIntoArray, py::arg("dst"), py::arg("src"), py::arg("op"),
        py::arg("kernels") = py::none(), py::arg("repeat") = 1);
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    char err[2048] = {0};
    Check(kr_start_timeline(path.c_str(), mark_cycles ? 1 : 0, err, sizeof(err)), err);
  }, py::arg("path"), py::arg("mark_cycles") = false,
     "Records this rank's timeline into exactly this file.");
  m.def("stop_timeline", [] {
    py::gil_scoped_release release;
    kr_stop_timeline();
  }, "Writes the rest of the timeline and closes its file.");
  m.def("log", [](int level, const std::string& message, bool once) {
    kr_log(level, message.c_str(), once ? 1 : 0);
  }, py::arg("level"), py::arg("message"), py::arg("once") = false,
     "Writes to the engine's log if the level (0 trace .. 4 error) is enabled.");

  py::class_<Handle>(m, "Handle")
      .def("done", &Handle::done, "True once the collectives have completed (or failed).")
      .def("wait", &Handle::wait, "Blocks until completion; returns the result(s) or raises.")
      .def("received_splits", &Handle::received_splits,
           "Alltoall: waits, then returns the rows received from each rank.");
  m.def("submit", &Submit, py::arg("collective"), py::arg("arrays"), py::arg("names"),
        py::arg("op") = static_cast<int>(KR_SUM), py::arg("prescale_factor") = 1.0,
        py::arg("postscale_factor") = 1.0, py::arg("root_rank") = 0,
        py::arg("splits") = std::vector<int64_t>(), py::arg("process_set") = 0,
        py::arg("compression") = static_cast<int>(KR_COMPRESSION_NONE), py::arg("group") = "",
        py::arg("dtypes") = std::vector<int>(), py::arg("outputs") = py::none(),
        "Starts collectives and returns a Handle at once; the engine's thread runs them. "
        "Takes one array and its name (the handle's wait() returns its result), or a "
        "sequence of each (wait() returns the list), with run()'s other arguments.");
  m.def("run", &Run, py::arg("collective"), py::arg("arrays"), py::arg("names"),
        py::arg("op") = static_cast<int>(KR_SUM), py::arg("prescale_factor") = 1.0,
        py::arg("postscale_factor") = 1.0, py::arg("root_rank") = 0,
        py::arg("splits") = std::vector<int64_t>(), py::arg("process_set") = 0,
        py::arg("compression") = static_cast<int>(KR_COMPRESSION_NONE), py::arg("group") = "",
        py::arg("dtypes") = std::vector<int>(), py::arg("outputs") = py::none(),
        "Runs a collective on each array (named by `names`) and returns the results in "
        "order; the calling thread runs the engine meanwhile (the fastest way to wait). "
        "With a `group` name, allreduces are agreed as one group: every rank must pass the "
        "same group and names. `dtypes` (DTYPES codes) are the engine's types of the arrays' "
        "elements where NumPy has none (bfloat16 held as 16-bit integers); allreduce and "
        "broadcast write into `outputs` where given. New outputs of one allreduce or "
        "broadcast call are views into one allocation, which lives as long as any of them.");
  py::class_<Batch>(m, "_PreparedRun",
                    "For benchmarks: collectives prepared once, as run() would, to be run "
                    "again and again without run()'s work per array. C-contiguous NumPy inputs "
                    "are read where they lie at every run; other inputs were copied once.")
      .def(py::init([](int collective, const py::sequence& arrays, const py::sequence& names,
                       int op, const std::string& group) {
             return std::make_unique<Batch>(Args{collective, op}, arrays, names, group);
           }),
           py::arg("collective"), py::arg("arrays"), py::arg("names"),
           py::arg("op") = static_cast<int>(KR_SUM), py::arg("group") = "")
      .def("run", &Batch::Execute,
           "Runs the prepared collectives again (every rank alike) into the same outputs.")
      .def("results", &Batch::Results, "The outputs of the last run, in order.");
  py::dict dtypes;
  for (const auto& [name, code] : {std::pair<const char*, kr_dtype>{"float16", KR_FLOAT16},
                                   {"bfloat16", KR_BFLOAT16}, {"float32", KR_FLOAT32},
                                   {"float64", KR_FLOAT64}, {"int8", KR_INT8},
                                   {"uint8", KR_UINT8}, {"int32", KR_INT32}, {"int64", KR_INT64},
                                   {"int16", KR_INT16}, {"uint16", KR_UINT16},
                                   {"bool", KR_BOOL}}) {
    dtypes[name] = static_cast<int>(code);
  }
  m.attr("DTYPES") = dtypes;  // the engine's dtypes by name, for run()'s dtypes
  m.attr("COMPRESSION_FP16") = static_cast<int>(KR_COMPRESSION_FP16);
  m.attr("COMPRESSION_BF16") = static_cast<int>(KR_COMPRESSION_BF16);
}
