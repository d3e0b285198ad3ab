// The host pool reached from a jitted graph without Python: an XLA FFI custom call per MoE layer (issue 33 item 2).
//
// host_pool/native.py builds this file with native_experts.c into one library; host_pool/bridge.py registers its two
// handlers as the FFI target "strata_pool_layer" and calls it with jax.ffi.ffi_call where the pool has a native
// handle (HostPool.ffi_handle):
//   * CPU: the handler runs the layer job on the graph's host buffers, in the thread that runs the graph.
//   * CUDA: nothing waits on the host. The handler enqueues on the graph's stream: x, ids and w copied into pinned
//     staging buffers, a host function (cuLaunchHostFunc: CUDA's own thread runs it when the stream reaches it) that
//     computes the job, and y copied back. The stream waits for the host function; the thread that launches XLA's
//     kernels goes on at once. The CUDA driver's entry points are looked up in libcuda at run time (no CUDA headers).
// One layer job: y [T, H] = sum_n w[t, n] * expert_{ids[n]}(x[t]) over ids[n] >= 0 and w[t, n] != 0 (pool.py's plain
// job; native_experts.c computes it). Staging buffers are kept per (pool, layer, T, N) for the pool's life: a stream
// runs one window's copies, host function and copies in order, so a later window never overwrites them early.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int experts_job(int fmt, int round_bf16_out, long H, long I, long group, const void *gate, const void *up,
                           const void *down, const float *gate_scale, const float *up_scale,
                           const float *down_scale, const float *x, long units, const int64_t *unit_expert,
                           const int64_t *unit_start, const int64_t *entry_token, const int64_t *entry_out,
                           const float *entry_weight, float *h, float *out, int threads);

namespace {

struct Layer {
  const void *gate, *up, *down;
  const float *gate_scale, *up_scale, *down_scale;
  long hidden, intermediate, group, experts, expert_bytes;
};

struct Staging;

struct Pool {
  int fmt, round_bf16, threads;
  std::vector<Layer> layers;
  std::atomic<int64_t> calls{0}, experts_run{0}, bytes{0}, nanos{0};
  std::mutex staging_mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Staging>> staging;
};

std::mutex registry_mutex;
std::vector<Pool *> registry;  // id -> pool (nullptr once released; ids are never reused)

Pool *find_pool(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return id >= 0 && id < (int64_t)registry.size() ? registry[id] : nullptr;
}

// The work buffers of one job: units, entries and the SwiGLU activations h [T * N, I].
struct Scratch {
  std::vector<int64_t> unit_expert, unit_start, entry_token;
  std::vector<float> entry_weight, h;
};

// y [T, H] (zeroed here) for x [T, H], ids [N], w [T, N].
void run_job(Pool *pool, int64_t layer_index, const float *x, const int32_t *ids, const float *w, float *y,
             int64_t T, int64_t N, Scratch &s) {
  const auto t0 = std::chrono::steady_clock::now();
  const Layer &layer = pool->layers[layer_index];
  std::memset(y, 0, sizeof(float) * T * layer.hidden);
  s.unit_expert.clear();
  s.unit_start.assign(1, 0);
  s.entry_token.clear();
  s.entry_weight.clear();
  int64_t bytes = 0;
  for (int64_t n = 0; n < N; n++) {
    const int64_t expert = ids[n];
    if (expert < 0 || expert >= layer.experts) continue;  // padding (-1); the graph gives nothing else
    const size_t before = s.entry_token.size();
    for (int64_t t = 0; t < T; t++)
      if (w[t * N + n] != 0.0f) {
        s.entry_token.push_back(t);
        s.entry_weight.push_back(w[t * N + n]);
      }
    if (s.entry_token.size() == before) continue;
    s.unit_expert.push_back(expert);
    s.unit_start.push_back((int64_t)s.entry_token.size());
    bytes += layer.expert_bytes;
  }
  const int64_t units = (int64_t)s.unit_expert.size();
  if (units == 0) return;  // a window with no cpu expert in this layer: zeros, not counted as a job
  {
    s.h.resize(s.entry_token.size() * layer.intermediate);
    experts_job(pool->fmt, pool->round_bf16, layer.hidden, layer.intermediate, layer.group, layer.gate, layer.up,
                layer.down, layer.gate_scale, layer.up_scale, layer.down_scale, x, units, s.unit_expert.data(),
                s.unit_start.data(), s.entry_token.data(), s.entry_token.data(), s.entry_weight.data(),
                s.h.data(), y, pool->threads);
  }
  pool->calls += 1;
  pool->experts_run += units;
  pool->bytes += bytes;
  pool->nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// ---- the CUDA driver, looked up at run time ----------------------------------------------------------------------

using CUresult = int;
using CUstream = void *;
using CUdeviceptr = unsigned long long;
struct Driver {
  CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t, CUstream) = nullptr;
  CUresult (*launch_host_func)(CUstream, void (*)(void *), void *) = nullptr;
  CUresult (*host_alloc)(void **, size_t, unsigned int) = nullptr;
  CUresult (*host_free)(void *) = nullptr;
  std::string error;
};

const Driver &driver() {
  static Driver d = [] {
    Driver d;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      d.error = "libcuda.so.1 not found";
      return d;
    }
    d.memcpy_dtoh = (decltype(d.memcpy_dtoh))dlsym(lib, "cuMemcpyDtoHAsync_v2");
    d.memcpy_htod = (decltype(d.memcpy_htod))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    d.launch_host_func = (decltype(d.launch_host_func))dlsym(lib, "cuLaunchHostFunc");
    d.host_alloc = (decltype(d.host_alloc))dlsym(lib, "cuMemHostAlloc");
    d.host_free = (decltype(d.host_free))dlsym(lib, "cuMemFreeHost");
    if (!d.memcpy_dtoh || !d.memcpy_htod || !d.launch_host_func || !d.host_alloc || !d.host_free)
      d.error = "libcuda.so.1 lacks cuMemcpyDtoHAsync_v2 / cuMemcpyHtoDAsync_v2 / cuLaunchHostFunc / cuMemHostAlloc";
    return d;
  }();
  return d;
}

// Pinned x [T, H], ids [N], w [T, N], y [T, H] of one (layer, T, N), and what the host function needs.
struct Staging {
  Pool *pool = nullptr;
  int64_t layer = 0, T = 0, N = 0;
  void *memory = nullptr;
  float *x = nullptr, *w = nullptr, *y = nullptr;
  int32_t *ids = nullptr;
  Scratch scratch;
  ~Staging() {
    if (memory) driver().host_free(memory);
  }
};

void host_job(void *data) {
  Staging *s = static_cast<Staging *>(data);
  run_job(s->pool, s->layer, s->x, s->ids, s->w, s->y, s->T, s->N, s->scratch);
}

size_t padded(size_t bytes) { return (bytes + 255) & ~size_t(255); }

Staging *staging_for(Pool *pool, int64_t layer, int64_t T, int64_t N, std::string &error) {
  std::lock_guard<std::mutex> lock(pool->staging_mutex);
  auto &slot = pool->staging[{layer, T, N}];
  if (slot) return slot.get();
  auto s = std::make_unique<Staging>();
  const int64_t H = pool->layers[layer].hidden;
  const size_t xb = padded(sizeof(float) * T * H), ib = padded(sizeof(int32_t) * N), wb = padded(sizeof(float) * T * N);
  if (driver().host_alloc(&s->memory, 2 * xb + ib + wb, 0) != 0) {
    error = "cuMemHostAlloc failed";
    pool->staging.erase({layer, T, N});
    return nullptr;
  }
  char *base = static_cast<char *>(s->memory);
  s->x = reinterpret_cast<float *>(base);
  s->y = reinterpret_cast<float *>(base + xb);
  s->ids = reinterpret_cast<int32_t *>(base + 2 * xb);
  s->w = reinterpret_cast<float *>(base + 2 * xb + ib);
  s->pool = pool;
  s->layer = layer;
  s->T = T;
  s->N = N;
  slot = std::move(s);
  return slot.get();
}

// ---- the handlers -----------------------------------------------------------------------------------------------

ffi::Error check(Pool *pool, int64_t layer, ffi::Buffer<ffi::F32> &x, ffi::Buffer<ffi::S32> &ids,
                 ffi::Buffer<ffi::F32> &w, int64_t &T, int64_t &N) {
  if (!pool) return ffi::Error::InvalidArgument("strata_pool_layer: unknown or released host pool");
  if (layer < 0 || layer >= (int64_t)pool->layers.size())
    return ffi::Error::InvalidArgument("strata_pool_layer: layer outside the host pool's store");
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || ids.dimensions().size() != 1 || xd[1] != pool->layers[layer].hidden ||
      wd[0] != xd[0] || wd[1] != ids.dimensions()[0])
    return ffi::Error::InvalidArgument("strata_pool_layer: want x [T, H], ids [N], w [T, N]");
  T = xd[0];
  N = wd[1];
  return ffi::Error::Success();
}

ffi::Error PoolLayerCpu(int64_t pool_id, int64_t layer, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  Pool *pool = find_pool(pool_id);
  int64_t T = 0, N = 0;
  ffi::Error error = check(pool, layer, x, ids, w, T, N);
  if (!error.success()) return error;
  thread_local Scratch scratch;
  run_job(pool, layer, x.typed_data(), ids.typed_data(), w.typed_data(), y->typed_data(), T, N, scratch);
  return ffi::Error::Success();
}

ffi::Error PoolLayerCuda(void *stream, int64_t pool_id, int64_t layer, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const Driver &d = driver();
  if (!d.error.empty()) return ffi::Error::Internal("strata_pool_layer: " + d.error);
  Pool *pool = find_pool(pool_id);
  int64_t T = 0, N = 0;
  ffi::Error error = check(pool, layer, x, ids, w, T, N);
  if (!error.success()) return error;
  std::string why;
  Staging *s = staging_for(pool, layer, T, N, why);
  if (!s) return ffi::Error::Internal("strata_pool_layer: " + why);
  const int64_t H = pool->layers[layer].hidden;
  auto dev = [](const void *p) { return (CUdeviceptr)(uintptr_t)p; };
  if (d.memcpy_dtoh(s->x, dev(x.untyped_data()), sizeof(float) * T * H, stream) ||
      d.memcpy_dtoh(s->ids, dev(ids.untyped_data()), sizeof(int32_t) * N, stream) ||
      d.memcpy_dtoh(s->w, dev(w.untyped_data()), sizeof(float) * T * N, stream) ||
      d.launch_host_func(stream, host_job, s) ||
      d.memcpy_htod(dev(y->untyped_data()), s->y, sizeof(float) * T * H, stream))
    return ffi::Error::Internal("strata_pool_layer: a CUDA copy or cuLaunchHostFunc failed");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_pool_layer_cpu, PoolLayerCpu,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("pool")
                                  .Attr<int64_t>("layer")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_pool_layer_cuda, PoolLayerCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void *>>()
                                  .Attr<int64_t>("pool")
                                  .Attr<int64_t>("layer")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ---- the registry, called from Python (ctypes) --------------------------------------------------------------------

extern "C" {

// A pool over `layers` layers of stacked experts (pointers stay valid until pool_release: the caller keeps the
// arrays); returns its id.
int64_t pool_register(int fmt, int round_bf16, int threads, int64_t layers, const void *const *gate,
                      const void *const *up, const void *const *down, const float *const *gate_scale,
                      const float *const *up_scale, const float *const *down_scale, const int64_t *hidden,
                      const int64_t *intermediate, const int64_t *group, const int64_t *experts,
                      const int64_t *expert_bytes) {
  auto *pool = new Pool();
  pool->fmt = fmt;
  pool->round_bf16 = round_bf16;
  pool->threads = threads;
  for (int64_t l = 0; l < layers; l++)
    pool->layers.push_back({gate[l], up[l], down[l], gate_scale[l], up_scale[l], down_scale[l], (long)hidden[l],
                            (long)intermediate[l], (long)group[l], (long)experts[l], (long)expert_bytes[l]});
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(pool);
  return (int64_t)registry.size() - 1;
}

// Forget a pool: later calls with its id fail. Its memory stays (a graph still queued on a stream may run its host
// function after this; a pool is released once per engine).
void pool_release(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (id >= 0 && id < (int64_t)registry.size()) registry[id] = nullptr;
}

// out[4] = layer jobs, experts computed, weight bytes read, nanoseconds inside the jobs (since registration).
void pool_counters(int64_t id, int64_t *out) {
  Pool *pool = find_pool(id);
  out[0] = pool ? pool->calls.load() : 0;
  out[1] = pool ? pool->experts_run.load() : 0;
  out[2] = pool ? pool->bytes.load() : 0;
  out[3] = pool ? pool->nanos.load() : 0;
}

}  // extern "C"
