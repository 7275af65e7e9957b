// The whole engine (negotiation, response cache, fusion, join, process sets,
// stalls, failures and shutdown) on the in-process world: ranks are threads,
// each with an Engine of its own.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../core/engine.h"
#include "harness.h"
#include "../core/transport/inprocess_job.h"

using keras_ring::Engine;
using keras_ring::EngineOptions;
using keras_ring::InProcessJob;

namespace {

using namespace std::chrono_literals;

EngineOptions TestOptions() {
  EngineOptions o;
  o.params.fusion_threshold = size_t(64) << 20;
  o.params.small_allreduce_bytes = keras_ring::kDefaultSmallAllreduceBytes;
  o.cache_capacity = keras_ring::kDefaultCacheCapacity;
  o.shared_memory = false;
  o.kernels = keras_ring::BestKernelLevel();
  o.timeout = 20s;
  return o;
}

// One request's completion, waited for by the test's rank thread.
struct Outcome {
  std::string name;             // the request's tensor name, alive as long as the request
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  kr_status status = KR_OK;
  std::string message;
  std::vector<char> allocated;  // the output of allgather, reducescatter, alltoall
  std::vector<int64_t> shape;   // its shape

  static void Done(void* ctx, kr_status status, const char* message) {
    auto* self = static_cast<Outcome*>(ctx);
    std::lock_guard<std::mutex> lock(self->mu);
    self->status = status;
    self->message = message ? message : "";
    self->done = true;
    self->cv.notify_all();
  }
  static void* Allocate(void* ctx, int ndim, const int64_t* shape) {
    auto* self = static_cast<Outcome*>(ctx);
    self->shape.assign(shape, shape + ndim);
    size_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= static_cast<size_t>(shape[i]);
    self->allocated.resize(n * sizeof(float) + 1);
    return self->allocated.data();
  }
  // Waits (bounded, so that a broken engine fails the test instead of hanging it).
  kr_status Wait(std::chrono::milliseconds bound = 30s) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, bound, [&] { return done; })) {
      KR_FAIL("a request did not complete within " + std::to_string(bound.count()) + " ms");
      return KR_INTERNAL;
    }
    return status;
  }
  std::vector<float> Floats() const {
    std::vector<float> v(allocated.size() / sizeof(float));
    std::memcpy(v.data(), allocated.data(), v.size() * sizeof(float));
    return v;
  }
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> input, output;
};

kr_request Request(const std::string& name, kr_collective c, const std::vector<int64_t>& shape,
                   const void* input, void* output, Outcome* outcome) {
  kr_request r{};
  r.struct_size = sizeof r;
  outcome->name = name;
  r.name = outcome->name.c_str();
  r.collective = c;
  r.dtype = KR_FLOAT32;
  r.ndim = static_cast<int>(shape.size());
  r.shape = shape.data();
  r.input = input;
  r.output = output;
  r.reduce_op = KR_SUM;
  r.prescale_factor = 1.0;
  r.postscale_factor = 1.0;
  r.device = KR_DEVICE_CPU;
  r.allocate_output = &Outcome::Allocate;
  r.done = &Outcome::Done;
  r.ctx = outcome;
  return r;
}

// A float32 allreduce of `count` elements, input rank + i, summed.
kr_status Allreduce(Engine& e, const std::string& name, size_t count, int rank,
                    std::vector<float>* out, int32_t process_set = 0,
                    kr_reduce_op op = KR_SUM, std::string* message = nullptr) {
  std::vector<float> in(count);
  for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(rank + i);
  out->assign(count, -1);
  const std::vector<int64_t> shape = {static_cast<int64_t>(count)};
  Outcome o;
  kr_request r = Request(name, KR_ALLREDUCE, shape, in.data(), out->data(), &o);
  r.process_set = process_set;
  r.reduce_op = op;
  e.Enqueue(&r, 1);
  const kr_status s = o.Wait();
  if (message) *message = o.message;
  return s;
}

// Runs `body` on `size` rank threads, each with its own engine on one
// in-process job; fails the test on any exception.
void RunEngines(int size, const EngineOptions& options,
                const std::function<void(Engine&, int rank)>& body,
                std::vector<std::string> hosts = {}) {
  InProcessJob job(size, options.timeout, std::move(hosts));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        Engine engine(options, job.Join(r));
        body(engine, r);
        std::string error;
        engine.Shutdown(&error);
      } catch (const std::exception& e) {
        KR_FAIL("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

float SumOverRanks(int size, size_t i) {
  float s = 0;
  for (int r = 0; r < size; ++r) s += static_cast<float>(r + i);
  return s;
}

}  // namespace

KR_TEST_CASES(RegisterEngineTopology) {
  // Two hosts of two ranks: local and cross ranks as MPI's splits give them.
  kr_test::Register("engine/topology/2x2", [] {
    RunEngines(4, TestOptions(), [](Engine& e, int r) {
      const kr_topology t = e.topology();
      KR_EXPECT_EQ(t.rank, r);
      KR_EXPECT_EQ(t.size, 4);
      KR_EXPECT_EQ(t.local_size, 2);
      KR_EXPECT_EQ(t.local_rank, r % 2);
      KR_EXPECT_EQ(t.cross_size, 2);
      KR_EXPECT_EQ(t.cross_rank, r / 2);
      KR_EXPECT_EQ(t.is_homogeneous, 1);
    }, {"a", "a", "b", "b"});
  });
  kr_test::Register("engine/topology/uneven", [] {
    RunEngines(3, TestOptions(), [](Engine& e, int r) {
      const kr_topology t = e.topology();
      KR_EXPECT_EQ(t.local_size, r == 2 ? 1 : 2);
      KR_EXPECT_EQ(t.is_homogeneous, 0);
    }, {"a", "a", "b"});
  });
}

KR_TEST_CASES(RegisterEngineAgreement) {
  // Every rank submits the same names in its own random order, in bursts:
  // the engine pairs them by name.
  for (int size : {2, 3}) {
    kr_test::Register("engine/agreement/random_order/" + std::to_string(size), [size] {
      constexpr int kTensors = 40;
      RunEngines(size, TestOptions(), [size](Engine& e, int r) {
        std::vector<int> order(kTensors);
        std::iota(order.begin(), order.end(), 0);
        std::mt19937 rng(1234 + r);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::string> names(kTensors);
        std::vector<Tensor> tensors(kTensors);
        std::vector<Outcome> outcomes(kTensors);
        for (int k : order) {
          names[k] = "t" + std::to_string(k);
          Tensor& t = tensors[k];
          const size_t count = 1 + 37 * k % 101;
          t.shape = {static_cast<int64_t>(count)};
          t.input.resize(count);
          for (size_t i = 0; i < count; ++i) t.input[i] = static_cast<float>(r + i);
          t.output.assign(count, -1);
          kr_request req =
              Request(names[k], KR_ALLREDUCE, t.shape, t.input.data(), t.output.data(),
                      &outcomes[k]);
          e.Enqueue(&req, 1);
          if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 500));
        }
        for (int k = 0; k < kTensors; ++k) {
          KR_EXPECT_EQ(outcomes[k].Wait(), KR_OK);
          for (size_t i = 0; i < tensors[k].output.size(); ++i) {
            if (tensors[k].output[i] != SumOverRanks(size, i)) {
              KR_FAIL("tensor t" + std::to_string(k) + "[" + std::to_string(i) + "] = " +
                      std::to_string(tensors[k].output[i]));
              break;
            }
          }
        }
      });
    });
  }
}

KR_TEST_CASES(RegisterEngineCache) {
  // A name agreed twice is cached and then announced by id; a changed
  // description of it takes the full path again and still runs correctly.
  kr_test::Register("engine/cache/hits_and_invalidation", [] {
    RunEngines(2, TestOptions(), [](Engine& e, int r) {
      std::vector<float> out;
      for (int step = 0; step < 5; ++step) {
        KR_EXPECT_EQ(Allreduce(e, "grad", 16, r, &out), KR_OK);
        KR_EXPECT_EQ(out[3], SumOverRanks(2, 3));
      }
      KR_EXPECT(e.stats().cached_tensors >= 3);
      // Another shape under the cached name: on both ranks alike.
      KR_EXPECT_EQ(Allreduce(e, "grad", 40, r, &out), KR_OK);
      KR_EXPECT_EQ(out[39], SumOverRanks(2, 39));
      KR_EXPECT_EQ(Allreduce(e, "grad", 40, r, &out), KR_OK);
      KR_EXPECT_EQ(out[20], SumOverRanks(2, 20));
    });
  });
  // The cache off: the same results, no hits.
  kr_test::Register("engine/cache/off", [] {
    EngineOptions o = TestOptions();
    o.cache_capacity = 0;
    RunEngines(2, o, [](Engine& e, int r) {
      std::vector<float> out;
      for (int step = 0; step < 3; ++step) KR_EXPECT_EQ(Allreduce(e, "g", 8, r, &out), KR_OK);
      KR_EXPECT_EQ(out[7], SumOverRanks(2, 7));
      KR_EXPECT_EQ(e.stats().cached_tensors, 0u);
    });
  });
}

KR_TEST_CASES(RegisterEngineFusion) {
  // Tensors submitted together are fused up to the threshold: with room for
  // three of them per collective, ten take at least four collectives.
  kr_test::Register("engine/fusion/threshold", [] {
    EngineOptions o = TestOptions();
    o.params.fusion_threshold = 3 * 100 * sizeof(float);
    o.params.cycle_time_ms = 50;  // lets all ten be agreed before the list goes
    RunEngines(3, o, [](Engine& e, int r) {
      constexpr int kTensors = 10;
      std::vector<Tensor> tensors(kTensors);
      std::vector<Outcome> outcomes(kTensors);
      std::vector<std::string> names(kTensors);
      std::vector<kr_request> requests;
      for (int k = 0; k < kTensors; ++k) {
        Tensor& t = tensors[k];
        names[k] = "f" + std::to_string(k);
        t.shape = {100};
        t.input.assign(100, static_cast<float>(r + k));
        t.output.assign(100, -1);
        requests.push_back(Request(names[k], KR_ALLREDUCE, t.shape, t.input.data(),
                                   t.output.data(), &outcomes[k]));
      }
      const kr_stats before = e.stats();
      e.Enqueue(requests.data(), kTensors);
      for (int k = 0; k < kTensors; ++k) {
        KR_EXPECT_EQ(outcomes[k].Wait(), KR_OK);
        KR_EXPECT_EQ(tensors[k].output[99], static_cast<float>(0 + 1 + 2 + 3 * k));
      }
      const kr_stats after = e.stats();
      KR_EXPECT_EQ(after.tensors - before.tensors, 10u);
      KR_EXPECT(after.fused_tensors - before.fused_tensors >= 6);
      KR_EXPECT(after.collectives - before.collectives >= 4);
      KR_EXPECT(after.collectives - before.collectives < 10);
    });
  });
  // A group of mixed ops and dtypes fuses only alike members.
  kr_test::Register("engine/fusion/group_of_mixed_ops", [] {
    RunEngines(2, TestOptions(), [](Engine& e, int r) {
      Tensor a{{4}, {1.f + r, 2, 3, 4}, std::vector<float>(4)};
      Tensor b{{4}, {1.f + r, 2, 3, 4}, std::vector<float>(4)};
      Outcome oa, ob;
      const std::string na = "a", nb = "b";
      kr_request reqs[2] = {Request(na, KR_ALLREDUCE, a.shape, a.input.data(), a.output.data(), &oa),
                            Request(nb, KR_ALLREDUCE, b.shape, b.input.data(), b.output.data(), &ob)};
      reqs[1].reduce_op = KR_MAX;
      e.Enqueue(reqs, 2, true, "grp");
      KR_EXPECT_EQ(oa.Wait(), KR_OK);
      KR_EXPECT_EQ(ob.Wait(), KR_OK);
      KR_EXPECT_EQ(a.output[0], 3.f);  // 1 + 2
      KR_EXPECT_EQ(b.output[0], 2.f);  // max(1, 2)
    });
  });
}

KR_TEST_CASES(RegisterEngineCollectives) {
  // Every collective once through the engine, with and without shared
  // memory, on one host and (hierarchical) on two.
  struct Layout {
    const char* name;
    int size;
    std::vector<std::string> hosts;
    bool shm;
  };
  for (const Layout& l : {Layout{"3", 3, {}, false}, Layout{"3_shm", 3, {}, true},
                          Layout{"2x2_hierarchical", 4, {"a", "a", "b", "b"}, true}}) {
    kr_test::Register("engine/collectives/" + std::string(l.name), [l] {
      EngineOptions o = TestOptions();
      o.shared_memory = l.shm;
      RunEngines(l.size, o, [&](Engine& e, int r) {
        const int p = l.size;
        std::vector<float> out;
        for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(100003)}) {
          KR_EXPECT_EQ(Allreduce(e, "ar" + std::to_string(count), count, r, &out), KR_OK);
          for (size_t i = 0; i < count; i += 997) KR_EXPECT_EQ(out[i], SumOverRanks(p, i));
        }
        KR_EXPECT_EQ(Allreduce(e, "avg", 5, r, &out, 0, KR_AVERAGE), KR_OK);
        KR_EXPECT_EQ(out[2], SumOverRanks(p, 2) / p);
        KR_EXPECT_EQ(Allreduce(e, "min", 5, r, &out, 0, KR_MIN), KR_OK);
        KR_EXPECT_EQ(out[2], 2.f);
        if (l.shm && l.hosts.empty()) KR_EXPECT(e.stats().shm_collectives > 0);
        if (!l.hosts.empty()) KR_EXPECT(e.stats().hierarchical_collectives > 0);

        // Allgather: rank r gives r + 1 rows of 2.
        {
          const std::vector<int64_t> shape = {r + 1, 2};
          std::vector<float> in(2 * (r + 1), static_cast<float>(r));
          Outcome oc;
          kr_request req = Request("ag", KR_ALLGATHER, shape, in.data(), nullptr, &oc);
          e.Enqueue(&req, 1);
          KR_EXPECT_EQ(oc.Wait(), KR_OK);
          KR_EXPECT_EQ(oc.shape[0], static_cast<int64_t>(p * (p + 1) / 2));
          const std::vector<float> got = oc.Floats();
          KR_EXPECT_EQ(got[0], 0.f);
          KR_EXPECT_EQ(got[2 * (p * (p + 1) / 2) - 1], static_cast<float>(p - 1));
        }
        // Broadcast from the last rank.
        {
          const std::vector<int64_t> shape = {3};
          std::vector<float> buf(3, static_cast<float>(r));
          Outcome oc;
          kr_request req = Request("bc", KR_BROADCAST, shape, buf.data(), buf.data(), &oc);
          req.root_rank = p - 1;
          e.Enqueue(&req, 1);
          KR_EXPECT_EQ(oc.Wait(), KR_OK);
          KR_EXPECT_EQ(buf[1], static_cast<float>(p - 1));
        }
        // Reducescatter of p + 1 rows: rank 0 gets two, the others one.
        {
          const std::vector<int64_t> shape = {p + 1};
          std::vector<float> in(p + 1);
          for (int i = 0; i <= p; ++i) in[i] = static_cast<float>(r + i);
          Outcome oc;
          kr_request req = Request("rs", KR_REDUCESCATTER, shape, in.data(), nullptr, &oc);
          e.Enqueue(&req, 1);
          KR_EXPECT_EQ(oc.Wait(), KR_OK);
          KR_EXPECT_EQ(oc.shape[0], r == 0 ? 2 : 1);
          const int first = r == 0 ? 0 : r + 1;
          const float got = oc.Floats()[0];
          KR_EXPECT_EQ(got, SumOverRanks(p, first));
        }
        // Alltoall, one row to each rank.
        {
          const std::vector<int64_t> shape = {p};
          std::vector<float> in(p);
          for (int j = 0; j < p; ++j) in[j] = static_cast<float>(10 * r + j);
          Outcome oc;
          kr_request req = Request("a2a", KR_ALLTOALL, shape, in.data(), nullptr, &oc);
          e.Enqueue(&req, 1);
          KR_EXPECT_EQ(oc.Wait(), KR_OK);
          const std::vector<float> got = oc.Floats();
          for (int j = 0; j < p; ++j) KR_EXPECT_EQ(got[j], static_cast<float>(10 * j + r));
        }
      }, l.hosts);
    });
  }
}

KR_TEST_CASES(RegisterEngineErrors) {
  // Shapes that differ fail on every rank, naming the tensor and each view.
  kr_test::Register("engine/errors/shape_mismatch", [] {
    RunEngines(3, TestOptions(), [](Engine& e, int r) {
      std::vector<float> out;
      const kr_status s = Allreduce(e, "mismatched", r == 1 ? 5 : 4, r, &out);
      KR_EXPECT_EQ(s, KR_FAILED_PRECONDITION);
      // And the engine goes on.
      KR_EXPECT_EQ(Allreduce(e, "after", 4, r, &out), KR_OK);
    });
  });
  // A tensor one rank never submits fails on the others after the stall
  // shutdown time, naming the missing rank.
  kr_test::Register("engine/errors/stall", [] {
    EngineOptions o = TestOptions();
    o.stall_shutdown = std::chrono::milliseconds(300);
    std::atomic<int> failed{0};
    RunEngines(3, o, [&](Engine& e, int r) {
      if (r != 2) {
        Outcome oc;
        std::vector<float> in(4, 1), buf(4);
        const std::vector<int64_t> shape = {4};
        kr_request req = Request("lonely", KR_ALLREDUCE, shape, in.data(), buf.data(), &oc);
        e.Enqueue(&req, 1);
        KR_EXPECT_EQ(oc.Wait(), KR_ABORTED);
        KR_EXPECT(Contains(oc.message, "'lonely'"));
        KR_EXPECT(Contains(oc.message, "for ranks [2]"));
        ++failed;
      } else {
        // Rank 2's next tensor comes once the others have given up, or it
        // would stall too.
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        while (failed < 2 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(1ms);
        }
      }
      std::vector<float> out;
      KR_EXPECT_EQ(Allreduce(e, "together", 4, r, &out), KR_OK);
    });
  });
}

KR_TEST_CASES(RegisterEngineJoin) {
  // Rank 1 joins at once; rank 0's allreduces go on with zeros from it.
  kr_test::Register("engine/join", [] {
    RunEngines(2, TestOptions(), [](Engine& e, int r) {
      int32_t last = -1;
      Outcome join;
      const std::string name = "join";
      kr_request jr = Request(name, KR_JOIN, {}, nullptr, &last, &join);
      jr.dtype = KR_INT32;
      if (r == 1) {
        e.Enqueue(&jr, 1);
        KR_EXPECT_EQ(join.Wait(), KR_OK);
      } else {
        std::vector<float> out;
        for (int step = 0; step < 3; ++step) {
          KR_EXPECT_EQ(Allreduce(e, "alone", 6, r, &out), KR_OK);
          KR_EXPECT_EQ(out[5], 5.f);  // rank 0's own, plus zeros
        }
        e.Enqueue(&jr, 1);
        KR_EXPECT_EQ(join.Wait(), KR_OK);
      }
      KR_EXPECT_EQ(last, 0);
    });
  });
}

KR_TEST_CASES(RegisterEngineProcessSets) {
  kr_test::Register("engine/process_sets", [] {
    RunEngines(3, TestOptions(), [](Engine& e, int r) {
      int32_t id = -1;
      std::string error;
      KR_EXPECT_EQ(e.AddProcessSet({0, 2}, &id, &error), KR_OK);
      KR_EXPECT_EQ(id, 1);
      std::vector<float> out;
      if (r != 1) {
        KR_EXPECT_EQ(Allreduce(e, "pair", 3, r, &out, id), KR_OK);
        KR_EXPECT_EQ(out[1], static_cast<float>((0 + 1) + (2 + 1)));
      } else {
        // Not a member: refused here at once.
        KR_EXPECT_EQ(Allreduce(e, "pair", 3, r, &out, id), KR_INVALID_ARGUMENT);
      }
      KR_EXPECT_EQ(Allreduce(e, "all", 3, r, &out), KR_OK);
      KR_EXPECT_EQ(e.RemoveProcessSet(id, &error), KR_OK);
      std::vector<int> ranks;
      KR_EXPECT(!e.ProcessSetRanks(id, &ranks));
      // Bad ranks fail on every rank alike.
      KR_EXPECT(e.AddProcessSet({0, 7}, &id, &error) != KR_OK);
      KR_EXPECT(Contains(error, "ranks must lie in"));
    });
  });
}

KR_TEST_CASES(RegisterEngineShutdown) {
  // A rank that shuts down while another's request is pending: it fails,
  // naming the rank, and the engine of every rank stops.
  kr_test::Register("engine/shutdown/with_pending", [] {
    RunEngines(2, TestOptions(), [](Engine& e, int r) {
      if (r == 0) {
        Outcome oc;
        std::vector<float> in(4, 1), buf(4);
        const std::vector<int64_t> shape = {4};
        kr_request req = Request("never", KR_ALLREDUCE, shape, in.data(), buf.data(), &oc);
        e.Enqueue(&req, 1);
        // Rank 1 left the job: lost, for this rank.
        KR_EXPECT_EQ(oc.Wait(), KR_PEER_LOST);
        KR_EXPECT(Contains(oc.message, "rank 1 shut down"));
        // Refused afterwards, saying why.
        std::vector<float> out;
        KR_EXPECT_EQ(Allreduce(e, "later", 4, r, &out), KR_PEER_LOST);
      } else {
        std::this_thread::sleep_for(100ms);
        std::string error;
        KR_EXPECT_EQ(e.Shutdown(&error), KR_OK);
      }
    });
  });
  // Shutdown twice, and from two threads at once: one joins, both return.
  kr_test::Register("engine/shutdown/concurrent", [] {
    RunEngines(2, TestOptions(), [](Engine& e, int) {
      std::thread other([&] { e.Shutdown(nullptr); });
      e.Shutdown(nullptr);
      other.join();
      KR_EXPECT(!e.initialized());
    });
  });
}

KR_TEST_CASES(RegisterEngineFaults) {
  // A rank whose transport fails: its engine stops and tells the others,
  // whose pending requests fail naming it and the reason.
  kr_test::Register("engine/faults/failed_rank", [] {
    EngineOptions o = TestOptions();
    InProcessJob job(3, o.timeout);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        Engine e(o, job.Join(r));
        std::vector<float> out;
        KR_EXPECT_EQ(Allreduce(e, "before", 8, r, &out), KR_OK);
        if (r == 2) job.Fail(2, "keras-ring: injected transport failure");
        std::string message;
        const kr_status s = Allreduce(e, "during", 100, r, &out, 0, KR_SUM, &message);
        // The others lost rank 2 (an elastic job goes on without it); rank 2 failed.
        KR_EXPECT_EQ(s, r == 2 ? KR_INTERNAL : KR_PEER_LOST);
        if (r != 2) KR_EXPECT(Contains(message, "rank 2"));
        std::vector<float> later;
        const kr_status after = Allreduce(e, "after", 8, r, &later);
        KR_EXPECT(after != KR_OK);
        e.Shutdown(nullptr);
      });
    }
    for (std::thread& t : threads) t.join();
  });
  // A rank stopped in the middle of a collective (alive, never answering):
  // the others' waits end after the timeout, naming it; so does rank 0's
  // wait for its shutdown.
  kr_test::Register("engine/faults/frozen_rank", [] {
    EngineOptions o = TestOptions();
    o.timeout = 500ms;
    InProcessJob job(2, o.timeout);
    std::vector<std::thread> threads;
    std::vector<std::string> messages(2);
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Engine e(o, job.Join(r));
        std::vector<float> out;
        KR_EXPECT_EQ(Allreduce(e, "before", 8, r, &out), KR_OK);
        if (r == 1) job.Freeze(1);
        const auto start = std::chrono::steady_clock::now();
        std::vector<float> in(1000, 1.f), buf(1000);
        const std::vector<int64_t> shape = {1000};
        Outcome oc;
        kr_request req = Request("stuck", KR_ALLREDUCE, shape, in.data(), buf.data(), &oc);
        e.Enqueue(&req, 1);
        const kr_status s = oc.Wait(10s);
        KR_EXPECT(s != KR_OK);
        if (r == 0) KR_EXPECT_EQ(s, KR_PEER_LOST);
        KR_EXPECT(std::chrono::steady_clock::now() - start < 5s);
        messages[r] = oc.message;
        e.Shutdown(nullptr);
      });
    }
    for (std::thread& t : threads) t.join();
    KR_EXPECT(Contains(messages[0], "waited"));
    KR_EXPECT(Contains(messages[0], "from rank 1"));
  });
}
