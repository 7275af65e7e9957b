// keras_ring._engine: the engine for NumPy arrays. Used by keras_ring for
// init/topology, by tests and benchmarks that run without TensorFlow, and on
// machines (GPU hosts) that have no TensorFlow.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "c_api.h"

namespace py = pybind11;

namespace {

// Completion state shared by the engine's thread and Python. Holds no Python
// objects: the engine's thread (which may be a waiting caller without the
// GIL) must never touch them.
struct Completion {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  kr_status status = KR_OK;
  std::string message;
  std::vector<char> gathered;           // output the engine allocates (allgather and others)
  std::vector<int64_t> gathered_shape;
  std::vector<int64_t> received_splits;  // alltoall

  static void Done(void* ctx, kr_status status, const char* message) {
    auto* self = static_cast<std::shared_ptr<Completion>*>(ctx);
    {
      std::lock_guard<std::mutex> lock((*self)->mu);
      (*self)->status = status;
      (*self)->message = message ? message : "";
      (*self)->finished = true;
    }
    (*self)->cv.notify_all();
    delete self;
  }

  static int Finished(void* ctx) {
    auto* self = static_cast<Completion*>(ctx);
    std::lock_guard<std::mutex> lock(self->mu);
    return self->finished;
  }

  static void* Allocate(void* ctx, int ndim, const int64_t* shape) {
    auto& self = *static_cast<std::shared_ptr<Completion>*>(ctx);
    try {
      self->gathered_shape.assign(shape, shape + ndim);
      size_t count = 1;
      for (int i = 0; i < ndim; ++i) count *= static_cast<size_t>(shape[i]);
      self->gathered.resize(count * self->element_size + 1);  // +1: never a null data()
      return self->gathered.data();
    } catch (const std::exception&) {
      return nullptr;  // the engine reports the failed allocation
    }
  }

  size_t element_size = 0;
};

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
  const std::string name = py::str(dt.attr("name"));
  if (name == "bfloat16") return KR_BFLOAT16;
  throw py::type_error("keras-ring: unsupported dtype " + name +
                       "; supported: float16, bfloat16, float32, float64, int8, uint8, int32, "
                       "int64. Received: dtype=" + name);
}

void RaiseFor(kr_status status, const std::string& message) {
  if (status == KR_INVALID_ARGUMENT) throw py::value_error(message);
  throw std::runtime_error(message);
}

// A submitted collective. Keeps the arrays alive until the engine is done.
class Handle {
 public:
  Handle(py::array input, py::object output, std::shared_ptr<Completion> completion)
      : input_(std::move(input)), output_(std::move(output)), completion_(std::move(completion)) {}
  ~Handle() {
    if (Completion::Finished(completion_.get())) return;
    py::gil_scoped_release release;
    WaitFinished();
  }

  bool done() {
    std::lock_guard<std::mutex> lock(completion_->mu);
    return completion_->finished;
  }

  py::list received_splits() {
    wait();
    py::list out;
    for (int64_t s : completion_->received_splits) out.append(s);
    return out;
  }

  py::array wait() {
    if (!Completion::Finished(completion_.get())) {  // else no need to let go of the GIL
      py::gil_scoped_release release;
      WaitFinished();
    }
    if (completion_->status != KR_OK) RaiseFor(completion_->status, completion_->message);
    if (!output_.is_none()) return output_;
    py::array out(input_.dtype(), completion_->gathered_shape);
    std::memcpy(out.mutable_data(), completion_->gathered.data(), out.nbytes());
    return out;
  }

  Completion* completion() const { return completion_.get(); }

 private:
  void WaitFinished() {
    if (!Completion::Finished(completion_.get())) kr_drive(&Completion::Finished, completion_.get());
    std::unique_lock<std::mutex> lock(completion_->mu);
    completion_->cv.wait(lock, [&] { return completion_->finished; });
  }

  py::array input_;
  py::object output_;  // None when the engine allocates the output
  std::shared_ptr<Completion> completion_;
};

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

// A request ready to enqueue and the handle that waits for it. The request
// points into this object and into the Args it was made from.
struct Prepared {
  kr_request request{};
  std::string name;
  std::vector<int64_t> shape;
  std::unique_ptr<Handle> handle;
};

std::unique_ptr<Prepared> Prepare(const Args& a, py::array array, std::string name) {
  auto p = std::make_unique<Prepared>();
  py::array input = py::array::ensure(array, py::array::c_style);
  if (!input) throw py::type_error("keras-ring: expected an array-like input");
  kr_dtype dtype = ToKrDtype(input.dtype());
  p->name = std::move(name);
  p->shape.assign(input.shape(), input.shape() + input.ndim());
  py::object output = py::none();
  void* output_data = nullptr;
  if (a.collective == KR_ALLREDUCE || a.collective == KR_BROADCAST || a.collective == KR_JOIN) {
    py::array out(input.dtype(), std::vector<py::ssize_t>(p->shape.begin(), p->shape.end()));
    output_data = out.mutable_data();
    output = std::move(out);
  }
  auto completion = std::make_shared<Completion>();
  completion->element_size = static_cast<size_t>(input.itemsize());
  if (a.collective == KR_ALLTOALL) {
    const int set_size = kr_process_set_ranks(a.process_set, nullptr, 0);
    completion->received_splits.resize(set_size > 0 ? set_size : 0);
  }

  kr_request& r = p->request;
  r.name = p->name.c_str();
  r.collective = static_cast<kr_collective>(a.collective);
  r.dtype = dtype;
  r.ndim = static_cast<int>(p->shape.size());
  r.shape = p->shape.data();
  r.input = input.data();
  r.output = output_data;
  r.reduce_op = static_cast<kr_reduce_op>(a.op);
  r.prescale_factor = a.prescale;
  r.postscale_factor = a.postscale;
  r.compression = static_cast<kr_compression>(a.compression);
  r.root_rank = a.root_rank;
  r.splits = a.splits.data();
  r.nsplits = static_cast<int>(a.splits.size());
  r.received_splits = completion->received_splits.empty() ? nullptr
                                                          : completion->received_splits.data();
  r.device = KR_DEVICE_CPU;
  r.process_set = a.process_set;
  r.allocate_output = &Completion::Allocate;
  r.done = &Completion::Done;
  r.ctx = new std::shared_ptr<Completion>(completion);
  p->handle = std::make_unique<Handle>(std::move(input), std::move(output), std::move(completion));
  return p;
}

std::unique_ptr<Handle> Submit(int collective, py::array array, const std::string& name, int op,
                               double prescale, double postscale, int root_rank,
                               std::vector<int64_t> splits, int32_t process_set,
                               int compression) {
  const Args a{collective, op, prescale, postscale, root_rank, std::move(splits), process_set,
               compression};
  auto p = Prepare(a, std::move(array), name);
  kr_enqueue(&p->request);  // refusals arrive through done, like any other outcome
  return std::move(p->handle);
}

// Whether every completion of a call has finished; `next` skips those seen.
struct AllFinished {
  std::vector<Completion*> completions;
  size_t next = 0;

  static int Check(void* ctx) {
    auto* self = static_cast<AllFinished*>(ctx);
    while (self->next < self->completions.size() &&
           Completion::Finished(self->completions[self->next])) {
      ++self->next;
    }
    return self->next == self->completions.size();
  }
};

// Submits a collective for each array (named by `names`) and waits for all,
// this thread running the engine meanwhile; returns their results in order.
// With a `group` name, the allreduces form one group (kr_enqueue_and_drive).
py::list Run(int collective, const std::vector<py::array>& arrays,
             const std::vector<std::string>& names, int op, double prescale, double postscale,
             int root_rank, std::vector<int64_t> splits, int32_t process_set, int compression,
             const std::string& group) {
  if (arrays.size() != names.size()) {
    throw py::value_error("keras-ring: run() needs one name per array. Received: " +
                          std::to_string(arrays.size()) + " arrays and " +
                          std::to_string(names.size()) + " names");
  }
  const Args a{collective, op, prescale, postscale, root_rank, std::move(splits), process_set,
               compression};
  std::vector<std::unique_ptr<Prepared>> prepared;
  std::vector<kr_request> requests;
  AllFinished all;
  prepared.reserve(arrays.size());
  requests.reserve(arrays.size());
  all.completions.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    prepared.push_back(Prepare(a, arrays[i], names[i]));
    requests.push_back(prepared.back()->request);
    all.completions.push_back(prepared.back()->handle->completion());
  }
  {
    py::gil_scoped_release release;
    // Refusals arrive through done, like any other outcome.
    kr_enqueue_and_drive(requests.data(), static_cast<int>(requests.size()), group.c_str(),
                         &AllFinished::Check, &all);
  }
  py::list results;
  for (auto& p : prepared) results.append(p->handle->wait());
  return results;
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

  m.attr("ALLREDUCE") = static_cast<int>(KR_ALLREDUCE);
  m.attr("ALLGATHER") = static_cast<int>(KR_ALLGATHER);
  m.attr("BROADCAST") = static_cast<int>(KR_BROADCAST);
  m.attr("REDUCESCATTER") = static_cast<int>(KR_REDUCESCATTER);
  m.attr("ALLTOALL") = static_cast<int>(KR_ALLTOALL);
  m.attr("JOIN") = static_cast<int>(KR_JOIN);

  m.def("init", [] {
    char err[2048] = {0};
    kr_status s;
    {
      py::gil_scoped_release release;
      s = kr_init(err, sizeof(err));
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
  });
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
      .def("done", &Handle::done, "True once the collective has completed (or failed).")
      .def("wait", &Handle::wait, "Blocks until completion; returns the result or raises.")
      .def("received_splits", &Handle::received_splits,
           "Alltoall: waits, then returns the rows received from each rank.");
  m.def("submit", &Submit, py::arg("collective"), py::arg("array"), py::arg("name"),
        py::arg("op") = static_cast<int>(KR_SUM), py::arg("prescale_factor") = 1.0,
        py::arg("postscale_factor") = 1.0, py::arg("root_rank") = 0,
        py::arg("splits") = std::vector<int64_t>(), py::arg("process_set") = 0,
        py::arg("compression") = static_cast<int>(KR_COMPRESSION_NONE),
        "Starts a collective on a NumPy array and returns a Handle.");
  m.def("run", &Run, py::arg("collective"), py::arg("arrays"), py::arg("names"),
        py::arg("op") = static_cast<int>(KR_SUM), py::arg("prescale_factor") = 1.0,
        py::arg("postscale_factor") = 1.0, py::arg("root_rank") = 0,
        py::arg("splits") = std::vector<int64_t>(), py::arg("process_set") = 0,
        py::arg("compression") = static_cast<int>(KR_COMPRESSION_NONE), py::arg("group") = "",
        "Runs a collective on each array (named by `names`) and returns the results in "
        "order; the calling thread runs the engine meanwhile (the fastest way to wait). "
        "With a `group` name, allreduces are agreed as one group: every rank must pass the "
        "same group and names.");
  m.attr("COMPRESSION_FP16") = static_cast<int>(KR_COMPRESSION_FP16);
  m.attr("COMPRESSION_BF16") = static_cast<int>(KR_COMPRESSION_BF16);
}
