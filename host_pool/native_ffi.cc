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

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <initializer_list>
#include <utility>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include <sched.h>
#include <cstdio>
#include <cstdlib>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int experts_job(int fmt, int fmt_down, int round_bf16_out, long H, long I, long group, long group_down,
                           const void *gate, const void *up, const void *down, const float *gate_scale, const float *up_scale,
                           const float *down_scale, const float *x, long units, const int64_t *unit_expert,
                           const int64_t *unit_start, const int64_t *entry_token, const int64_t *entry_out,
                           const float *entry_weight, float *h, float *out, int threads);

namespace {

struct Layer {
  const void *gate, *up, *down;
  const float *gate_scale, *up_scale, *down_scale;
  long hidden, intermediate, group, group_down, experts, expert_bytes;  // group: gate/up's inputs per scale
};

struct Staging;
struct Offload;
struct Prefetch;

struct Pool {
  int fmt, fmt_down, round_bf16, threads;  // fmt: gate/up's FMT_* (a job's phase 1), fmt_down: down's (phase 2)
  std::vector<Layer> layers;
  std::atomic<int64_t> calls{0}, experts_run{0}, bytes{0}, nanos{0};
  std::atomic<int64_t> fetch_calls{0}, fetched{0}, fetch_bytes{0};
  // The capture path's worker, timed on the host clock: jobs it took, their time from POSTED seen to DONE stored,
  // and the gaps from a DONE to the next POSTED seen (under kGapMax: one decode window's layers, not the idle time
  // between requests). A gap is the stream's side of a layer: its wait for DONE waking, y's copy back, the layer's
  // rest and the next layer's attention, route and plan, the plan's copy out and POSTED.
  std::atomic<int64_t> worker_jobs{0}, worker_busy_ns{0}, worker_gaps{0}, worker_gap_ns{0};
  // STRATA_OFFLOAD_TIMELINE=N (read at registration): the worker's last N jobs, each (POSTED seen, DONE stored, on the
  // host's monotonic clock in ns, the layer, T), for a benchmark to lay beside its own clock (pool_worker_ring).
  std::vector<int64_t> ring;
  std::atomic<int64_t> ring_jobs{0};
  std::mutex staging_mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Staging>> staging;
  // The offload layer calls (strata_offload_begin / _collect): each layer's experts in pinned host memory (gate, up,
  // down; what a fetch copies from) and the worker thread that fetches and computes.
  std::vector<std::array<const char *, 3>> fetch_host;
  std::mutex offload_mutex;
  std::unique_ptr<Offload> offload;
  // strata_offload_prefetch's side stream, events and plan copy (made on its first CUDA call; under offload_mutex)
  std::unique_ptr<Prefetch> prefetch;
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
    experts_job(pool->fmt, pool->fmt_down, pool->round_bf16, layer.hidden, layer.intermediate, layer.group,
                layer.group_down, layer.gate, layer.up, layer.down, layer.gate_scale, layer.up_scale,
                layer.down_scale, x, units, s.unit_expert.data(),
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
using CUcontext = void *;
struct Driver {
  CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t, CUstream) = nullptr;
  CUresult (*launch_host_func)(CUstream, void (*)(void *), void *) = nullptr;
  CUresult (*host_alloc)(void **, size_t, unsigned int) = nullptr;
  CUresult (*host_free)(void *) = nullptr;
  // The offload calls: stream memory operations (a stream writes or waits for a 32-bit flag in mapped host memory),
  // a copy stream of the worker's own, the context the graph's stream runs in.
  CUresult (*host_device_pointer)(CUdeviceptr *, void *, unsigned int) = nullptr;
  CUresult (*write_value)(CUstream, CUdeviceptr, uint32_t, unsigned int) = nullptr;
  CUresult (*wait_value)(CUstream, CUdeviceptr, uint32_t, unsigned int) = nullptr;
  CUresult (*stream_create)(CUstream *, unsigned int) = nullptr;
  CUresult (*stream_ctx)(CUstream, CUcontext *) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  // The device fetch kernel (PTX loaded by the driver): optional, the worker's copies serve without it.
  CUresult (*module_load)(void **, const void *, unsigned int, int *, void **) = nullptr;
  CUresult (*module_function)(void **, void *, const char *) = nullptr;
  CUresult (*launch_kernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void **, void **) = nullptr;
  // The prefetch (strata_offload_prefetch): its plan copied into memory of its own, a side stream ordered by events.
  CUresult (*mem_alloc)(CUdeviceptr *, size_t) = nullptr;
  CUresult (*memcpy_dtod)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*event_create)(void **, unsigned int) = nullptr;
  CUresult (*event_record)(void *, CUstream) = nullptr;
  CUresult (*stream_wait_event)(CUstream, void *, unsigned int) = nullptr;
  std::string error, offload_error;
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
    auto either = [&](const char *a, const char *b) { void *f = dlsym(lib, a); return f ? f : dlsym(lib, b); };
    d.host_device_pointer = (decltype(d.host_device_pointer))either("cuMemHostGetDevicePointer_v2",
                                                                    "cuMemHostGetDevicePointer");
    d.write_value = (decltype(d.write_value))either("cuStreamWriteValue32_v2", "cuStreamWriteValue32");
    d.wait_value = (decltype(d.wait_value))either("cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    d.stream_create = (decltype(d.stream_create))dlsym(lib, "cuStreamCreate");
    d.stream_ctx = (decltype(d.stream_ctx))dlsym(lib, "cuStreamGetCtx");
    d.ctx_set_current = (decltype(d.ctx_set_current))dlsym(lib, "cuCtxSetCurrent");
    d.module_load = (decltype(d.module_load))dlsym(lib, "cuModuleLoadDataEx");
    d.module_function = (decltype(d.module_function))dlsym(lib, "cuModuleGetFunction");
    d.launch_kernel = (decltype(d.launch_kernel))dlsym(lib, "cuLaunchKernel");
    d.mem_alloc = (decltype(d.mem_alloc))either("cuMemAlloc_v2", "cuMemAlloc");
    d.memcpy_dtod = (decltype(d.memcpy_dtod))either("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync");
    d.event_create = (decltype(d.event_create))dlsym(lib, "cuEventCreate");
    d.event_record = (decltype(d.event_record))dlsym(lib, "cuEventRecord");
    d.stream_wait_event = (decltype(d.stream_wait_event))dlsym(lib, "cuStreamWaitEvent");
    if (!d.host_device_pointer || !d.write_value || !d.wait_value || !d.stream_create || !d.stream_ctx ||
        !d.ctx_set_current)
      d.offload_error = "libcuda.so.1 lacks cuStreamWaitValue32 / cuStreamWriteValue32 / cuStreamGetCtx";
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

// ---- the offload layer calls: fetch and pool work with no read-back ------------------------------------------------
//
// strata_offload_begin (one per offloaded MoE layer and window) enqueues on the graph's stream: one copy of the
// layer's packed plan (x [T, H], the cpu combine w [T, N], the cpu ids [N], the fetch sources and slots [M] each)
// into pinned staging, then a write of the job's sequence number to the `posted` flag (mapped host memory), then,
// when the layer fetches, a wait until the `fetched` flag reaches it. The worker thread (one per pool), told of the
// job when the handler ran, sees `posted`, reads the plan, enqueues each fetched expert's three copies (pinned host
// -> its victim slot, or the window's staging row when it has none) on its own copy stream, then a write of
// `fetched`, then computes the cpu experts (the C kernel,
// OpenMP) and stores `done`. strata_offload_collect waits on the stream until `done` reaches the job and copies y
// back. So the GPU runs the layer's resident experts while the pool computes, no host thread waits on the GPU, and
// the number of misses never reaches the host's control flow (no lax.cond, no loop with a traced trip count).
// Where stream memory operations are missing the flags are set and awaited by host functions instead.
//
// That sequence path does host work at each execution (a sequence number, a queued job), so XLA cannot record its
// calls into a command buffer (CUDA graph) and splits the graph around each one (0.13 ms a layer on an H200). The
// capture path (strata_offload_begin_v2 / _collect_v2, the default; bridge.py picks it) enqueues only operations
// with constant arguments: three flags per layer with constant values, the job named by the id of a descriptor
// (layer, shape, buffers, context) made when the handler runs, which is once at recording (and again when XLA
// records the graph anew for other buffers). Its worker polls every layer's POSTED flag (Offload::poll says why
// that is race-free). STRATA_OFFLOAD_CAPTURE=0, or no stream memory operations: the sequence path.
//
// Traced layer (attribute layer == -1; the layer loop is a lax.scan, so the index is data): the layer index rides
// at the end of the packed plan (one int32), and the worker (both paths) reads it from the staged plan after POSTED
// (the plan's copy precedes the post in stream order); a bad index is printed and answered without work. Such calls
// use a slot of their own, as if they were one more layer: staging and descriptors keyed with layer -1, on the
// capture path the flag triple at index `layers` (the "traced slot"). A scan's iterations then follow one another
// on that slot exactly as one layer's windows do. Fetch destinations are absolute rows of whatever slot arrays the
// call got (the caller passes flat [L*(S+1), ...] stacks). The CPU handlers read the index in place.

struct alignas(64) Flag {
  uint32_t value;
  char pad[60];
};

struct OffloadStaging {
  void *memory = nullptr;
  std::vector<float> plain;            // CPU: ordinary memory
  float *in = nullptr, *y = nullptr;  // in: x [T*H], w [T*N], then int32 ids [N], src [M], dst [M]
  CUdeviceptr in_dev = 0, y_dev = 0;  // CUDA: their device-mapped addresses (0: none; the signal kernels pass)
  Scratch scratch;
  ~OffloadStaging() {
    if (memory) driver().host_free(memory);
  }
};

struct OffloadJob {
  uint32_t seq = 0;
  int64_t layer = 0, T = 0, N = 0, M = 0;
  bool cpu = false, fetch = false;
  OffloadStaging *staging = nullptr;
  CUdeviceptr slot[3] = {0, 0, 0}, stage[3] = {0, 0, 0};  // the slot arrays [S+1, ...], the staging rows [N, ...]
  int64_t slot_row_bytes[3] = {0, 0, 0};
  CUcontext ctx = nullptr;
};

enum { POSTED = 0, FETCHED = 1, DONE = 2 };

// STRATA_OFFLOAD_TRACE=1: one stderr line per offload call and worker step (a hang shows where it stopped).
bool tracing() {
  static const bool on = [] {
    const char *e = std::getenv("STRATA_OFFLOAD_TRACE");
    return e && std::string(e) == "1";
  }();
  return on;
}
#define OFFLOAD_TRACE(...)                 \
  do {                                     \
    if (tracing()) {                       \
      std::fprintf(stderr, "[offload] " __VA_ARGS__); \
      std::fflush(stderr);                 \
    }                                      \
  } while (0)

uint32_t load_flag(const Flag *f) { return __atomic_load_n(&f->value, __ATOMIC_ACQUIRE); }
void store_flag(Flag *f, uint32_t v) { __atomic_store_n(&f->value, v, __ATOMIC_RELEASE); }
bool reached(uint32_t value, uint32_t seq) { return (int32_t)(value - seq) >= 0; }

void spin_until(const Flag *f, uint32_t seq, const std::atomic<bool> &stop) {
  for (long i = 0; !reached(load_flag(f), seq); i++) {
    if (stop.load(std::memory_order_relaxed)) return;
    if (i > 20000) sched_yield();  // a long wait (a prefill ahead of it): give the core back now and then
    else __builtin_ia32_pause();
  }
}

// STRATA_OFFLOAD_SPIN_US (default 20000): how long the capture path's worker keeps polling the flags with `pause`
// after its last job; idle longer, it sleeps kIdleSleep between polls (an idle engine does not hold a core; the first
// layer after a pause pays up to about that sleep).
int64_t spin_us() {
  static const int64_t us = [] {
    const char *e = std::getenv("STRATA_OFFLOAD_SPIN_US");
    return e && *e ? std::max<int64_t>(0, std::atoll(e)) : int64_t(20000);
  }();
  return us;
}
constexpr auto kIdleSleep = std::chrono::microseconds(50);
// Descriptors a pool may hold: one per distinct (layer, shape, buffers, context) a graph was recorded with.
constexpr uint32_t kMaxDescriptors = 1u << 16;

// The device fetch (capture path, the default where it loads): the begin call's stream copies the fetched experts
// itself, a kernel reading the layers' pinned host experts through their device-mapped addresses (zero-copy over
// PCIe), with the plan's rows read on the device. No worker, no flag, no driver call outside the graph's own stream
// takes part in a fetch: a worker that enqueued copies could deadlock against a host thread blocked in the driver
// while it queues many launches (a scanned window is a launch per layer), and each handshake cost a round trip.
// Block (x, m) of the grid copies window position m's expert (src[m] >= 0) from table[3 * layer + k] + src * rb_k
// into its slot row dst[m] (or staging row m when dst[m] < 0), 16 bytes a thread and step, for k = gate, up, down.
// The layer is p_layer_static, or (traced, -1) the int32 at p_layer. Written as PTX (sm_70 and up, JIT-compiled by
// the driver for the GPU): no CUDA toolkit at run time.
const char *kFetchPtx = R"PTX(
.version 7.0
.target sm_70
.address_size 64

.visible .entry strata_fetch_experts(
    .param .u64 p_src, .param .u64 p_dst, .param .u64 p_layer, .param .u32 p_layer_static,
    .param .u32 p_layers, .param .u32 p_experts, .param .u64 p_table,
    .param .u64 p_slot0, .param .u64 p_slot1, .param .u64 p_slot2,
    .param .u64 p_stage0, .param .u64 p_stage1, .param .u64 p_stage2,
    .param .u64 p_rb0, .param .u64 p_rb1, .param .u64 p_rb2)
{
    .reg .pred %p<4>;
    .reg .b32 %r<20>;
    .reg .b64 %rd<32>;

    mov.u32 %r1, %ctaid.y;
    ld.param.u64 %rd1, [p_src];
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.s32 %r2, [%rd3];
    setp.lt.s32 %p1, %r2, 0;
    @%p1 bra $DONE;
    ld.param.u32 %r3, [p_experts];
    setp.ge.s32 %p1, %r2, %r3;
    @%p1 bra $DONE;
    ld.param.u64 %rd4, [p_dst];
    add.s64 %rd5, %rd4, %rd2;
    ld.s32 %r4, [%rd5];
    ld.param.u32 %r5, [p_layer_static];
    setp.ge.s32 %p2, %r5, 0;
    @%p2 bra $LAYER;
    ld.param.u64 %rd6, [p_layer];
    ld.s32 %r5, [%rd6];
$LAYER:
    setp.lt.s32 %p1, %r5, 0;
    @%p1 bra $DONE;
    ld.param.u32 %r6, [p_layers];
    setp.ge.s32 %p1, %r5, %r6;
    @%p1 bra $DONE;
    ld.param.u64 %rd7, [p_table];
    mul.lo.s32 %r7, %r5, 24;
    cvt.s64.s32 %rd8, %r7;
    add.s64 %rd9, %rd7, %rd8;
    mov.u32 %r8, %ctaid.x;
    mov.u32 %r9, %ntid.x;
    mov.u32 %r10, %tid.x;
    mov.u32 %r11, %nctaid.x;
    mad.lo.s32 %r12, %r8, %r9, %r10;
    mul.lo.s32 %r13, %r11, %r9;
    cvt.u64.u32 %rd10, %r12;
    cvt.u64.u32 %rd11, %r13;
    cvt.s64.s32 %rd12, %r2;
    cvt.s64.s32 %rd13, %r4;
    cvt.u64.u32 %rd14, %r1;
    setp.ge.s32 %p3, %r4, 0;
@COPIES@
$DONE:
    ret;
}
)PTX";

// One matrix's copy in kFetchPtx (@K@: 0, 1, 2; @OFF@: its table offset).
const char *kFetchCopyPtx = R"PTX(
    ld.param.u64 %rd15, [p_rb@K@];
    ld.u64 %rd16, [%rd9+@OFF@];
    mad.lo.s64 %rd17, %rd12, %rd15, %rd16;
    ld.param.u64 %rd18, [p_slot@K@];
    mad.lo.s64 %rd19, %rd13, %rd15, %rd18;
    ld.param.u64 %rd20, [p_stage@K@];
    mad.lo.s64 %rd21, %rd14, %rd15, %rd20;
    selp.b64 %rd22, %rd19, %rd21, %p3;
    shr.u64 %rd23, %rd15, 4;
    mov.u64 %rd24, %rd10;
$LOOP@K@:
    setp.ge.u64 %p1, %rd24, %rd23;
    @%p1 bra $END@K@;
    shl.b64 %rd25, %rd24, 4;
    add.s64 %rd26, %rd17, %rd25;
    add.s64 %rd27, %rd22, %rd25;
    ld.v4.u32 {%r14, %r15, %r16, %r17}, [%rd26];
    st.v4.u32 [%rd27], {%r14, %r15, %r16, %r17};
    add.s64 %rd24, %rd24, %rd11;
    bra.uni $LOOP@K@;
$END@K@:
)PTX";

std::string replace_all(std::string text, const std::string &what, const std::string &with) {
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + with.size()))
    text.replace(at, what.size(), with);
  return text;
}

std::string fetch_ptx() {
  std::string copies;
  for (int k = 0; k < 3; k++)
    copies += replace_all(replace_all(kFetchCopyPtx, "@K@", std::to_string(k)), "@OFF@", std::to_string(8 * k));
  return replace_all(kFetchPtx, "@COPIES@", copies);
}

// The signal kernels (capture path, opt-in: STRATA_OFFLOAD_SIGNAL=kernel; by default the stream memory operations
// and copies). A begin with work for the worker posts it with one kernel where it used a copy of
// the plan into pinned staging and a flag write, and the collect waits and copies y back with one kernel where it
// used a flag wait, a flag write and a copy: each is one node of the layer's command buffer instead of two or three.
//   strata_post_plan (one block): the packed plan (device) into the staging's mapped `in`, then, after the block's
//     barrier, one thread: fence.sc.sys (the block's writes seen by the host before the flag) and POSTED = id.
//   strata_collect_y (one block): one thread polls DONE (acquire, system scope) until the worker sets it, clears it,
//     then the block copies y from the staging's mapped memory, not cached (ld.cv), into the call's output.
// Words: p_quads 16-byte steps, then single words up to p_words (p_quads 0 where either side is not 16-byte aligned).
// Used for plans and y of at most kSignalBytes (decode windows); a larger prefill chunk keeps the copies, which one
// block writing over PCIe would not match.
// One block's copy of p_words words from %rd1 to %rd2 (p_quads of them in 16-byte steps first), loads by @LD@; labels
// suffixed @L@. Registers as both kernels below declare them.
const char *kBlockCopyPtx = R"PTX(
    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_dst];
    ld.param.u64 %rd3, [p_quads];
    ld.param.u64 %rd4, [p_words];
    mov.u32 %r2, %ntid.x;
    cvt.u64.u32 %rd5, %r1;
    cvt.u64.u32 %rd6, %r2;
    mov.u64 %rd7, %rd5;
$QUAD@L@:
    setp.ge.u64 %p1, %rd7, %rd3;
    @%p1 bra $QUAD_END@L@;
    shl.b64 %rd8, %rd7, 4;
    add.s64 %rd9, %rd1, %rd8;
    add.s64 %rd10, %rd2, %rd8;
    @LD@.v4.u32 {%r3, %r4, %r5, %r6}, [%rd9];
    st.global.v4.u32 [%rd10], {%r3, %r4, %r5, %r6};
    add.s64 %rd7, %rd7, %rd6;
    bra.uni $QUAD@L@;
$QUAD_END@L@:
    shl.b64 %rd11, %rd3, 2;
    add.s64 %rd12, %rd11, %rd5;
$WORD@L@:
    setp.ge.u64 %p2, %rd12, %rd4;
    @%p2 bra $WORD_END@L@;
    shl.b64 %rd13, %rd12, 2;
    add.s64 %rd14, %rd1, %rd13;
    add.s64 %rd15, %rd2, %rd13;
    @LD@.u32 %r7, [%rd14];
    st.global.u32 [%rd15], %r7;
    add.s64 %rd12, %rd12, %rd6;
    bra.uni $WORD@L@;
$WORD_END@L@:
)PTX";

const char *kSignalPtx = R"PTX(
.version 7.0
.target sm_70
.address_size 64

.visible .entry strata_post_plan(
    .param .u64 p_src, .param .u64 p_dst, .param .u64 p_quads, .param .u64 p_words,
    .param .u64 p_flag, .param .u32 p_value)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<24>;

    mov.u32 %r1, %tid.x;
@POST_COPY@
    bar.sync 0;
    setp.ne.u32 %p3, %r1, 0;
    @%p3 bra $POST_END;
    fence.sc.sys;
    ld.param.u64 %rd16, [p_flag];
    ld.param.u32 %r8, [p_value];
    st.relaxed.sys.global.u32 [%rd16], %r8;
$POST_END:
    ret;
}

.visible .entry strata_collect_y(
    .param .u64 p_src, .param .u64 p_dst, .param .u64 p_quads, .param .u64 p_words, .param .u64 p_flag)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<24>;

    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p3, %r1, 0;
    @%p3 bra $WAITED;
    ld.param.u64 %rd16, [p_flag];
$SPIN:
    ld.acquire.sys.global.u32 %r8, [%rd16];
    setp.ne.u32 %p1, %r8, 1;
    @%p1 bra $SPIN;
    st.relaxed.sys.global.u32 [%rd16], 0;
$WAITED:
    bar.sync 0;
    fence.acq_rel.gpu;
@COLLECT_COPY@
    ret;
}
)PTX";

std::string signal_ptx() {
  const std::string copy = kBlockCopyPtx;
  return replace_all(replace_all(kSignalPtx, "@POST_COPY@",
                                 replace_all(replace_all(copy, "@L@", "_POST"), "@LD@", "ld.global")),
                     "@COLLECT_COPY@", replace_all(replace_all(copy, "@L@", "_COLLECT"), "@LD@", "ld.global.cv"));
}
constexpr size_t kSignalBytes = 64 << 10;
constexpr unsigned kSignalThreads = 512;

struct Offload {
  Pool *pool = nullptr;
  void *flag_memory = nullptr;
  Flag *flags = nullptr;  // sequence path: POSTED, FETCHED, DONE; capture path: those three per layer + traced
  CUdeviceptr flag_dev[3] = {0, 0, 0}, flag_base_dev = 0;
  bool mem_ops = true;
  // The capture path (strata_offload_begin_v2 / _collect_v2): flags of constant values per layer, jobs named by
  // descriptor id (below) instead of queued per execution.
  bool capture = false;
  int64_t layers = 0;
  uint32_t next_seq = 0;
  std::vector<uint32_t> last_seq;                 // per layer (+ traced slot): the job of its last begin
  std::vector<OffloadStaging *> last_staging;     // per layer (+ traced slot): where that job's y lands
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<OffloadStaging>> staging;
  // Capture path: the job descriptors, append-only (the worker reads one without the lock: a slot, once set,
  // never changes) and found by content, so a graph recorded again with the same buffers posts the same id.
  std::map<std::array<uint64_t, 16>, uint32_t> descriptor_ids;
  std::vector<std::unique_ptr<OffloadJob>> descriptor_store;
  std::unique_ptr<std::atomic<const OffloadJob *>[]> descriptors;  // id - 1 -> job
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<OffloadJob> queue;
  std::atomic<bool> stop{false};
  std::thread worker;
  std::map<CUcontext, CUstream> copy_streams;
  CUcontext current = nullptr;
  // The device fetch (kFetchPtx), set up on the first capture-path begin that fetches: 0 not tried, 1 ready,
  // -1 unavailable (`fetch_why`; the worker copies). table: [layers][3] device addresses of the pinned host experts,
  // in mapped pinned memory the kernel reads.
  int device_fetch = 0;
  std::string fetch_why;
  void *fetch_fn = nullptr;
  uint64_t *fetch_table = nullptr;
  CUdeviceptr fetch_table_dev = 0;
  // The signal kernels (kSignalPtx), loaded on the first capture-path begin: 0 not tried, 1 ready, -1 unavailable.
  int signal = 0;
  std::string signal_why;
  void *post_fn = nullptr, *collect_fn = nullptr;

  ~Offload() {
    stop = true;
    wake.notify_all();
    if (worker.joinable()) worker.join();
    // flag_memory stays: a stream may still hold a wait on it (a graph given up on). Capture path: the staging
    // memory stays too, since a recorded graph replays its copies without asking us.
    if (capture)
      for (auto &entry : staging) entry.second.release();
  }

  // A call's slot: its layer, or `layers` for the traced slot (layer -1).
  int64_t slot_of(int64_t layer) const { return layer < 0 ? layers : layer; }
  Flag *flag(int64_t layer, int which) { return &flags[3 * slot_of(layer) + which]; }
  CUdeviceptr flag_device(int64_t layer, int which) {
    return flag_base_dev + (CUdeviceptr)(sizeof(Flag) * (3 * slot_of(layer) + which));
  }

  // One job's fetches and cpu experts, its plan read from its staging's `in`: the fetched experts' copies on the
  // copy stream, then `fetched` (set to `value` behind the copies, or here when nothing is copied), then the cpu
  // experts into the staging's y; `done` is the caller's to store. A traced job's layer is read from the plan.
  // Returns the job's layer (-1: a bad index, answered without work).
  int64_t process(const OffloadJob &job, Flag *fetched, CUdeviceptr fetched_dev, uint32_t value) {
    const Driver &d = driver();
    OffloadStaging *s = job.staging;
    const int64_t H = pool->layers[job.layer >= 0 ? job.layer : 0].hidden;  // traced: all layers' (check_begin)
    const float *x = s->in, *w = s->in + job.T * H;
    const int32_t *ids = reinterpret_cast<const int32_t *>(w + job.T * job.N);
    const int32_t *src = ids + job.N, *dst = src + job.M;
    const int64_t l = job.layer >= 0 ? job.layer : dst[job.M];
    if (l < 0 || l >= layers) {
      // a bad index from the graph: answer so the stream does not hang, compute nothing (y zeros)
      std::fprintf(stderr, "[offload] worker: the plan names layer %ld, outside the pool's %ld; answered without "
                   "work\n", (long)l, (long)layers);
      if (job.cpu) std::memset(s->y, 0, sizeof(float) * job.T * H);
      if (job.fetch) store_flag(fetched, value);
      return -1;
    }
    int64_t to_fetch = 0;
    for (int64_t m = 0; job.fetch && m < job.M; m++) to_fetch += src[m] >= 0;
    if (job.fetch && to_fetch == 0) {
      // Nothing to copy (every expert resident or on the pool): say so at once, not behind a copy-stream op.
      // Safe: the stream passed the previous job's wait before it posted this one, so no earlier write is due.
      pool->fetch_calls += 1;
      store_flag(fetched, value);
    } else if (job.fetch) {
      if (job.ctx != current) {
        d.ctx_set_current(job.ctx);
        current = job.ctx;
      }
      CUstream &copy = copy_streams[job.ctx];
      if (!copy) d.stream_create(&copy, 1 /* CU_STREAM_NON_BLOCKING */);
      const auto &host = pool->fetch_host[l];
      int64_t count = 0;
      for (int64_t m = 0; m < job.M; m++) {
        if (src[m] < 0) continue;
        for (int k = 0; k < 3; k++) {  // into its victim slot, or (dst -1) into staging row m
          const int64_t rb = job.slot_row_bytes[k];
          const CUdeviceptr to = dst[m] >= 0 ? job.slot[k] + (CUdeviceptr)(dst[m] * rb) : job.stage[k] + m * rb;
          d.memcpy_htod(to, host[k] + src[m] * rb, rb, copy);
        }
        count++;
      }
      // counted before the flag: a graph that waits for nothing else may finish as soon as it is set
      pool->fetch_calls += 1;
      pool->fetched += count;
      pool->fetch_bytes += count * (job.slot_row_bytes[0] + job.slot_row_bytes[1] + job.slot_row_bytes[2]);
      if (mem_ops) {
        d.write_value(copy, fetched_dev, value, 0);
      } else {
        // no stream memory operations: wait for the copies here (this thread may call CUDA), then say so
        CUresult (*sync)(CUstream) = (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "cuStreamSynchronize");
        if (sync) sync(copy);
        store_flag(fetched, value);
      }
    }
    if (job.cpu) run_job(pool, l, x, ids, w, s->y, job.T, job.N, s->scratch);
    return l;
  }

  // The sequence path: jobs queued by each begin, awaited by sequence number.
  void run() {
    for (;;) {
      OffloadJob job;
      {
        std::unique_lock<std::mutex> lock(mutex);
        // Spin a little before sleeping: the next layer's job is usually enqueued long before the GPU posts it.
        for (int i = 0; queue.empty() && i < 2000 && !stop; i++) {
          lock.unlock();
          __builtin_ia32_pause();
          lock.lock();
        }
        wake.wait(lock, [&] { return stop.load() || !queue.empty(); });
        if (stop) return;
        job = queue.front();
        queue.pop_front();
      }
      OFFLOAD_TRACE("worker: job %u layer %ld, waiting for posted (now %u)\n", job.seq, (long)job.layer,
                    load_flag(&flags[POSTED]));
      spin_until(&flags[POSTED], job.seq, stop);
      if (stop) return;
      OFFLOAD_TRACE("worker: job %u posted\n", job.seq);
      process(job, &flags[FETCHED], flag_dev[FETCHED], job.seq);
      store_flag(&flags[DONE], job.seq);
      OFFLOAD_TRACE("worker: job %u done (fetched %u)\n", job.seq, load_flag(&flags[FETCHED]));
    }
  }

  // The capture path: every layer's POSTED polled; a nonzero value names the job's descriptor.
  //   stream (begin):   copy plan -> in; POSTED[l] = d; if fetch: wait FETCHED[l] == 1; FETCHED[l] = 0
  //   worker:           sees POSTED[l] == d; POSTED[l] = 0; fetch copies; FETCHED[l] = 1 (copy stream, or here);
  //                     cpu experts -> y; if cpu: DONE[l] = 1
  //   stream (collect): wait DONE[l] == 1; DONE[l] = 0; copy y back
  // A flag is written again only after the write it answers was seen: the worker clears POSTED before it answers
  // (FETCHED / DONE), and the stream posts the layer's next job only after it has passed this job's waits and
  // cleared FETCHED and DONE (stream order, each stream write fenced after the ones before it). So between a
  // layer's collect (or, with no cpu part, its FETCHED wait) and its next begin all three flags are 0, and no
  // value is lost or seen twice. The plan and y are safe the same way: the next begin's copy into `in` follows the
  // DONE / FETCHED wait, after which the worker no longer reads it; the worker writes y only after a post, which
  // follows the previous collect's copy of y. Needs: a begin with cpu is followed by one collect of its layer
  // before the layer's next begin (bridge.py and its callers keep that), on one stream. The traced slot (index
  // `layers`, calls with layer -1) is one more "layer" here: a traced begin with cpu is collected (layer -1) before
  // the next traced begin, whichever layers the plans name.
  void poll() {
    const auto spin_for = std::chrono::microseconds(spin_us());
    auto last = std::chrono::steady_clock::now();
    auto last_done = last - std::chrono::hours(1);  // none yet
    constexpr auto kGapMax = std::chrono::milliseconds(5);
    int64_t next = 0;
    const int64_t slots = layers + 1;  // the layers' flags and the traced slot's
    while (!stop.load(std::memory_order_relaxed)) {
      int64_t found = -1;
      uint32_t id = 0;
      for (int64_t i = 0, l = next; i < slots; i++, l = l + 1 == slots ? 0 : l + 1)
        if ((id = load_flag(flag(l, POSTED))) != 0) {
          found = l;
          break;
        }
      if (found < 0) {
        if (std::chrono::steady_clock::now() - last < spin_for) __builtin_ia32_pause();
        else std::this_thread::sleep_for(kIdleSleep);
        continue;
      }
      const auto seen = std::chrono::steady_clock::now();
      if (seen - last_done < kGapMax) {
        pool->worker_gaps += 1;
        pool->worker_gap_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(seen - last_done).count();
      }
      store_flag(flag(found, POSTED), 0);  // before any answer: see above
      const OffloadJob *job = id <= kMaxDescriptors ? descriptors[id - 1].load(std::memory_order_acquire) : nullptr;
      if (!job || slot_of(job->layer) != found) {
        // cannot happen unless the flags were overwritten; answer both so the stream does not hang
        std::fprintf(stderr, "[offload] worker: layer %ld posted unknown job %u; answered without work\n",
                     (long)found, id);
        store_flag(flag(found, FETCHED), 1);
        store_flag(flag(found, DONE), 1);
        continue;
      }
      OFFLOAD_TRACE("worker: layer %ld job %u posted (T %ld N %ld M %ld cpu %d fetch %d)\n", (long)found, id,
                    (long)job->T, (long)job->N, (long)job->M, (int)job->cpu, (int)job->fetch);
      const int64_t job_layer = process(*job, flag(found, FETCHED), flag_device(found, FETCHED), 1);
      if (job->cpu) store_flag(flag(found, DONE), 1);  // no cpu part: no collect waits for it
      OFFLOAD_TRACE("worker: layer %ld job %u done\n", (long)found, id);
      next = found + 1 == slots ? 0 : found + 1;  // the next layer's post is the likely next one
      last = std::chrono::steady_clock::now();
      last_done = last;
      pool->worker_jobs += 1;
      pool->worker_busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(last - seen).count();
      if (!pool->ring.empty()) {  // one writer (this thread); a reader copies between requests
        const int64_t n = pool->ring_jobs.load(std::memory_order_relaxed);
        int64_t *at = &pool->ring[4 * (n % (int64_t)(pool->ring.size() / 4))];
        at[0] = std::chrono::duration_cast<std::chrono::nanoseconds>(seen.time_since_epoch()).count();
        at[1] = std::chrono::duration_cast<std::chrono::nanoseconds>(last.time_since_epoch()).count();
        at[2] = job_layer;
        at[3] = job->T;
        pool->ring_jobs.store(n + 1, std::memory_order_release);
      }
    }
  }
};

// The stream sets flag `which` to seq once its earlier work is done.
struct HostFlag {
  Offload *offload;
  int which;
  uint32_t seq;
};
void host_store_flag(void *data) {
  auto *f = static_cast<HostFlag *>(data);
  store_flag(&f->offload->flags[f->which], f->seq);
  delete f;
}
void host_wait_flag(void *data) {
  auto *f = static_cast<HostFlag *>(data);
  spin_until(&f->offload->flags[f->which], f->seq, f->offload->stop);
  delete f;
}

CUresult stream_write(Offload *o, CUstream stream, int which, uint32_t seq) {
  const Driver &d = driver();
  if (o->mem_ops) return d.write_value(stream, o->flag_dev[which], seq, 0);
  return d.launch_host_func(stream, host_store_flag, new HostFlag{o, which, seq});
}

CUresult stream_wait(Offload *o, CUstream stream, int which, uint32_t seq) {
  const Driver &d = driver();
  if (o->mem_ops) return d.wait_value(stream, o->flag_dev[which], seq, 0 /* CU_STREAM_WAIT_VALUE_GEQ */);
  return d.launch_host_func(stream, host_wait_flag, new HostFlag{o, which, seq});
}

// XLA records a command-buffer-compatible call under stream capture in CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, which
// forbids the capturing thread calls such as cuMemHostAlloc (they would end the capture with an error). The capture
// path's allocations therefore run in a short-lived thread of their own, in the stream's context (once per
// staging, not per execution).
template <typename F>
CUresult off_thread(CUcontext ctx, F fn) {
  CUresult result = 0;
  std::thread([&] {
    if (ctx) driver().ctx_set_current(ctx);
    result = fn();
  }).join();
  return result;
}

// The pool's offload part, made on its first begin (CUDA: mapped flags; STRATA_POOL_MEMOPS=0 forces host functions).
// capture: the capture path's flags (three per layer, three for the traced slot) and polling worker; ctx: the
// stream's context (capture path: the allocations are made off this thread in it). A pool's offload calls keep the
// path of the first one.
Offload *offload_for(Pool *pool, bool cuda, bool capture, CUcontext ctx, std::string &error) {
  std::lock_guard<std::mutex> lock(pool->offload_mutex);
  if (pool->offload) {
    if (cuda && pool->offload->capture != capture) {
      error = capture ? "this pool's offload calls already run the sequence path (STRATA_OFFLOAD_CAPTURE=0)"
                      : "this pool's offload calls already run the capture path (_v2 handlers)";
      return nullptr;
    }
    return pool->offload.get();
  }
  auto o = std::make_unique<Offload>();
  o->pool = pool;
  o->layers = (int64_t)pool->layers.size();
  o->last_seq.assign(pool->layers.size() + 1, 0);  // + the traced slot
  o->last_staging.assign(pool->layers.size() + 1, nullptr);
  if (cuda) {
    const Driver &d = driver();
    if (!d.offload_error.empty()) {
      error = d.offload_error;
      return nullptr;
    }
    const char *env = std::getenv("STRATA_POOL_MEMOPS");
    o->mem_ops = !(env && std::string(env) == "0");
    if (capture && !o->mem_ops) {
      error = "the capture path needs stream memory operations (STRATA_POOL_MEMOPS=0: set STRATA_OFFLOAD_CAPTURE=0)";
      return nullptr;
    }
    o->capture = capture;
    const size_t count = capture ? 3 * (pool->layers.size() + 1) : 3;  // capture: + the traced slot's
    auto alloc = [&] {
      CUresult r = d.host_alloc(&o->flag_memory, count * sizeof(Flag), 0x01 | 0x02 /* PORTABLE | DEVICEMAP */);
      return r ? r : d.host_device_pointer(&o->flag_base_dev, o->flag_memory, 0);
    };
    if ((capture ? off_thread(ctx, alloc) : alloc()) != 0) {
      error = "cuMemHostAlloc / cuMemHostGetDevicePointer of the flags failed";
      return nullptr;
    }
    std::memset(o->flag_memory, 0, count * sizeof(Flag));
    o->flags = static_cast<Flag *>(o->flag_memory);
    for (int k = 0; k < 3; k++) o->flag_dev[k] = o->flag_base_dev + (CUdeviceptr)(k * sizeof(Flag));
    Offload *raw = o.get();
    if (capture) {
      o->descriptors.reset(new std::atomic<const OffloadJob *>[kMaxDescriptors]());
      o->worker = std::thread([raw] { raw->poll(); });
    } else {
      o->worker = std::thread([raw] { raw->run(); });
    }
  }
  pool->offload = std::move(o);
  return pool->offload.get();
}

// A PTX module JIT-compiled by the driver and its kernels by name (in the current context; off a capturing thread).
CUresult load_kernels(const std::string &ptx, std::initializer_list<std::pair<const char *, void **>> kernels,
                      const char *what, std::string &why) {
  const Driver &d = driver();
  static char log[4096];
  int options[2] = {5 /* CU_JIT_ERROR_LOG_BUFFER */, 6 /* CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES */};
  void *values[2] = {log, (void *)(uintptr_t)sizeof(log)};
  void *module = nullptr;
  CUresult r = d.module_load(&module, ptx.c_str(), 2, options, values);
  if (r) {
    why = std::string(what) + " did not load: " + log;
    return r;
  }
  for (const auto &kernel : kernels)
    if ((r = d.module_function(kernel.second, module, kernel.first))) {
      why = "cuModuleGetFunction failed";
      return r;
    }
  return 0;
}

// x [T, H], w [T, N], ids [N], src [M], dst [M], and for a traced layer (attribute -1) the layer index last.
// The device fetch of this pool's offload calls, set up once (under o->mutex; the module load and allocation off
// this thread, which may be capturing): whether the kernel serves. STRATA_OFFLOAD_FETCH=worker keeps the worker's
// copies (the A/B, and the way back should a driver refuse the kernel).
bool device_fetch_ready(Offload *o, CUcontext ctx) {
  if (o->device_fetch) return o->device_fetch > 0;
  o->device_fetch = -1;
  const Driver &d = driver();
  const char *env = std::getenv("STRATA_OFFLOAD_FETCH");
  Pool *pool = o->pool;
  if (env && std::string(env) == "worker") {
    o->fetch_why = "STRATA_OFFLOAD_FETCH=worker";
  } else if (!d.module_load || !d.module_function || !d.launch_kernel) {
    o->fetch_why = "libcuda.so.1 lacks cuModuleLoadDataEx / cuLaunchKernel";
  } else if ((int64_t)pool->fetch_host.size() < o->layers) {
    o->fetch_why = "the layers' host experts are not registered";
  } else {
    std::string why;
    CUresult failed = off_thread(ctx, [&]() -> CUresult {
      CUresult r = load_kernels(fetch_ptx(), {{"strata_fetch_experts", &o->fetch_fn}}, "the fetch kernel", why);
      if (r) return r;
      void *table = nullptr;
      if ((r = d.host_alloc(&table, sizeof(uint64_t) * 3 * o->layers, 0x01 | 0x02 /* PORTABLE | DEVICEMAP */)) ||
          (r = d.host_device_pointer(&o->fetch_table_dev, table, 0))) {
        why = "cuMemHostAlloc of the fetch table failed";
        return r;
      }
      o->fetch_table = static_cast<uint64_t *>(table);
      for (int64_t l = 0; l < o->layers; l++)
        for (int k = 0; k < 3; k++) {
          CUdeviceptr dev = 0;  // stays 0 for a layer with no experts registered (a dense layer fetches nothing)
          const char *host = pool->fetch_host[l][k];
          if (host && (r = d.host_device_pointer(&dev, (void *)host, 0))) {
            why = "a layer's host experts have no device address (not mapped pinned memory)";
            return r;
          }
          o->fetch_table[3 * l + k] = dev;
        }
      return 0;
    });
    if (failed) o->fetch_why = why.empty() ? "setup failed (error " + std::to_string(failed) + ")" : why;
    else o->device_fetch = 1;
  }
  if (o->device_fetch < 0)
    std::fprintf(stderr, "[offload] fetches by the worker's copies, not the device kernel: %s\n", o->fetch_why.c_str());
  return o->device_fetch > 0;
}

// The signal kernels of this pool's offload calls, loaded once (under o->mutex; off this thread, which may be
// capturing): whether they serve. Only with STRATA_OFFLOAD_SIGNAL=kernel: an H100 ran the host pool alone as fast
// with the copies and stream memory operations (h200-2026-12-06d-offload), and their GPU tests have not all run.
bool signal_ready(Offload *o, CUcontext ctx) {
  if (o->signal) return o->signal > 0;
  o->signal = -1;
  const Driver &d = driver();
  const char *env = std::getenv("STRATA_OFFLOAD_SIGNAL");
  const bool asked = env && std::string(env) == "kernel";
  std::string &why = o->signal_why;
  if (!asked) {
    why = "the default (STRATA_OFFLOAD_SIGNAL=kernel: the signal kernels)";
  } else if (!d.module_load || !d.module_function || !d.launch_kernel) {
    why = "libcuda.so.1 lacks cuModuleLoadDataEx / cuLaunchKernel";
  } else {
    CUresult failed = off_thread(ctx, [&]() -> CUresult {
      return load_kernels(signal_ptx(), {{"strata_post_plan", &o->post_fn}, {"strata_collect_y", &o->collect_fn}},
                          "the signal kernels", why);
    });
    if (!failed) o->signal = 1;
    else if (why.empty()) why = "setup failed (error " + std::to_string(failed) + ")";
  }
  if (o->signal < 0 && asked)
    std::fprintf(stderr, "[offload] the pool's calls signal with copies and stream memory operations: %s\n",
                 why.c_str());
  return o->signal > 0;
}

// One of the signal kernels on `stream`: `bytes` from `src` to `dst` (one of them mapped host memory), and the flag.
// value: POSTED's (strata_post_plan), or nullptr (strata_collect_y, which has no such parameter).
CUresult launch_signal(void *fn, CUstream stream, CUdeviceptr src, CUdeviceptr dst, size_t bytes, CUdeviceptr flag,
                       uint32_t *value) {
  uint64_t words = bytes / 4, quads = (src % 16 == 0 && dst % 16 == 0) ? words / 4 : 0;
  void *params[] = {&src, &dst, &quads, &words, &flag, value};  // the collect kernel reads the first five
  return driver().launch_kernel(fn, 1, 1, 1, kSignalThreads, 1, 1, 0, stream, params, nullptr);
}

// The fetch kernel on `stream` for a capture-path begin: src / dst (and, traced, the layer) read from the packed plan
// on the device.
CUresult launch_fetch(Offload *o, CUstream stream, const OffloadJob &job, const float *packed, int64_t H) {
  const int32_t *ints = reinterpret_cast<const int32_t *>(packed + job.T * H + job.T * job.N);
  CUdeviceptr src = (CUdeviceptr)(uintptr_t)(ints + job.N), dst = src + sizeof(int32_t) * job.M,
              layer_at = dst + sizeof(int32_t) * job.M;
  uint32_t layer_static = job.layer >= 0 ? (uint32_t)job.layer : 0xffffffffu;
  uint32_t layers = (uint32_t)o->layers, experts = (uint32_t)o->pool->layers[job.layer >= 0 ? job.layer : 0].experts;
  uint64_t rb[3] = {(uint64_t)job.slot_row_bytes[0], (uint64_t)job.slot_row_bytes[1], (uint64_t)job.slot_row_bytes[2]};
  void *params[] = {&src, &dst, &layer_at, &layer_static, &layers, &experts, &o->fetch_table_dev,
                    (void *)&job.slot[0], (void *)&job.slot[1], (void *)&job.slot[2],
                    (void *)&job.stage[0], (void *)&job.stage[1], (void *)&job.stage[2], &rb[0], &rb[1], &rb[2]};
  return driver().launch_kernel(o->fetch_fn, 128, (unsigned)job.M, 1, 256, 1, 1, 0, stream, params, nullptr);
}

size_t packed_floats(int64_t T, int64_t H, int64_t N, int64_t M, bool traced) {
  return T * H + T * N + N + 2 * M + (traced ? 1 : 0);
}
// The hidden size of a call's plan: its layer's, or (traced) layer 0's, which check_begin saw all layers share.
int64_t plan_hidden(const Pool *pool, int64_t layer) { return pool->layers[layer >= 0 ? layer : 0].hidden; }

// layer -1: the traced slot's staging. alloc_ctx (capture path): allocate off this thread, in that context.
OffloadStaging *offload_staging(Offload *o, int64_t layer, int64_t T, int64_t N, int64_t M, bool cuda,
                                std::string &error, CUcontext alloc_ctx = nullptr) {
  auto &slot = o->staging[{layer, T, N, M}];
  if (slot) return slot.get();
  auto s = std::make_unique<OffloadStaging>();
  const int64_t H = plan_hidden(o->pool, layer);
  const size_t inb = padded(sizeof(float) * packed_floats(T, H, N, M, layer < 0));
  const size_t yb = padded(sizeof(float) * T * H);
  if (cuda) {
    // mapped (DEVICEMAP): the signal kernels write the plan and read y through the device addresses
    auto alloc = [&] { return driver().host_alloc(&s->memory, inb + yb, 0x01 | 0x02 /* PORTABLE | DEVICEMAP */); };
    if ((alloc_ctx ? off_thread(alloc_ctx, alloc) : alloc()) != 0) {
      error = "cuMemHostAlloc failed";
      o->staging.erase({layer, T, N, M});
      return nullptr;
    }
    s->in = static_cast<float *>(s->memory);
    CUdeviceptr dev = 0;
    if (driver().host_device_pointer && driver().host_device_pointer(&dev, s->memory, 0) == 0 && dev) {
      s->in_dev = dev;
      s->y_dev = dev + inb;
    }
  } else {
    s->plain.resize((inb + yb) / sizeof(float));
    s->in = s->plain.data();
  }
  s->y = reinterpret_cast<float *>(reinterpret_cast<char *>(s->in) + inb);
  slot = std::move(s);
  return slot.get();
}

// Capture path: the id (>= 1) of `job`'s descriptor, added if new; 0 when the table is full. Under o->mutex.
uint32_t descriptor_for(Offload *o, const OffloadJob &job) {
  const std::array<uint64_t, 16> key = {
      (uint64_t)job.layer, (uint64_t)job.T, (uint64_t)job.N, (uint64_t)job.M, (uint64_t)job.cpu,
      (uint64_t)job.fetch, job.slot[0], job.slot[1], job.slot[2], job.stage[0], job.stage[1], job.stage[2],
      (uint64_t)job.slot_row_bytes[0], (uint64_t)job.slot_row_bytes[1], (uint64_t)job.slot_row_bytes[2],
      (uint64_t)(uintptr_t)job.ctx};
  auto found = o->descriptor_ids.find(key);
  if (found != o->descriptor_ids.end()) return found->second;
  if (o->descriptor_store.size() >= kMaxDescriptors) return 0;
  o->descriptor_store.push_back(std::make_unique<OffloadJob>(job));
  const uint32_t id = (uint32_t)o->descriptor_store.size();
  o->descriptor_store.back()->seq = id;
  o->descriptors[id - 1].store(o->descriptor_store.back().get(), std::memory_order_release);
  o->descriptor_ids[key] = id;
  if (id >= 1024 && (id & (id - 1)) == 0)  // growing without end means XLA records the calls anew each time
    std::fprintf(stderr, "[offload] %u distinct offload calls recorded for this pool (the table holds %u): the "
                 "graphs' buffers keep moving\n", id, kMaxDescriptors);
  return id;
}

ffi::Error check_begin(Pool *pool, int64_t layer, int64_t T, int64_t N, int64_t M, bool fetch,
                       ffi::Buffer<ffi::F32> &packed, ffi::AnyBuffer *slots[3]) {
  if (!pool) return ffi::Error::InvalidArgument("strata_offload_begin: unknown or released host pool");
  const int64_t L = (int64_t)pool->layers.size();
  if (layer < -1 || layer >= L || L == 0)
    return ffi::Error::InvalidArgument("strata_offload_begin: layer outside the host pool's store");
  // layer -1 (traced: the plan names it): one staging serves every layer, so they must share the hidden size
  for (int64_t l = 0; layer < 0 && l < L; l++)
    if (pool->layers[l].hidden != pool->layers[0].hidden)
      return ffi::Error::InvalidArgument("strata_offload_begin: a traced layer needs one hidden size for all layers");
  if (packed.element_count() != packed_floats(T, plan_hidden(pool, layer), N, M, layer < 0))
    return ffi::Error::InvalidArgument("strata_offload_begin: the packed plan has the wrong size");
  for (int k = 0; k < 3; k++)
    if (slots[k]->dimensions().size() < 1 || slots[k]->dimensions()[0] < 1)
      return ffi::Error::InvalidArgument("strata_offload_begin: want slot arrays [S+1, ...]");
  for (int64_t l = layer < 0 ? 0 : layer; fetch && l <= (layer < 0 ? L - 1 : layer); l++)
    if ((int64_t)pool->fetch_host.size() <= l || !pool->fetch_host[l][0])
      return ffi::Error::InvalidArgument("strata_offload_begin: no host experts registered for this layer "
                                         "(HostPool.register_fetch; a traced layer needs every layer's)");
  return ffi::Error::Success();
}

int64_t row_bytes(ffi::AnyBuffer &b) { return (int64_t)b.size_bytes() / (int64_t)b.dimensions()[0]; }

ffi::Error OffloadBeginCuda(void *stream, int64_t pool_id, int64_t layer, int64_t T, int64_t N, int64_t M,
                            int64_t cpu, int64_t fetch, ffi::Buffer<ffi::F32> packed, ffi::AnyBuffer gate,
                            ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_out,
                            ffi::Result<ffi::AnyBuffer> up_out, ffi::Result<ffi::AnyBuffer> down_out,
                            ffi::Result<ffi::AnyBuffer> gate_stage, ffi::Result<ffi::AnyBuffer> up_stage,
                            ffi::Result<ffi::AnyBuffer> down_stage, ffi::ResultBuffer<ffi::S32> token) {
  const Driver &d = driver();
  if (!d.error.empty()) return ffi::Error::Internal("strata_offload_begin: " + d.error);
  Pool *pool = find_pool(pool_id);
  ffi::AnyBuffer *slots[3] = {&gate, &up, &down};
  ffi::Error error = check_begin(pool, layer, T, N, M, fetch != 0, packed, slots);
  if (!error.success()) return error;
  std::string why;
  Offload *o = offload_for(pool, true, false, nullptr, why);
  if (!o) return ffi::Error::Internal("strata_offload_begin: " + why);
  OffloadJob job;
  {
    std::lock_guard<std::mutex> lock(o->mutex);
    job.staging = offload_staging(o, layer, T, N, M, true, why);
    if (!job.staging) return ffi::Error::Internal("strata_offload_begin: " + why);
    job.seq = ++o->next_seq;
  }
  job.layer = layer;
  job.T = T;
  job.N = N;
  job.M = M;
  job.cpu = cpu != 0;
  job.fetch = fetch != 0;
  ffi::AnyBuffer *outs[3] = {&*gate_out, &*up_out, &*down_out}, *stages[3] = {&*gate_stage, &*up_stage, &*down_stage};
  for (int k = 0; k < 3; k++) {
    job.slot[k] = (CUdeviceptr)(uintptr_t)outs[k]->untyped_data();
    job.stage[k] = (CUdeviceptr)(uintptr_t)stages[k]->untyped_data();
    job.slot_row_bytes[k] = row_bytes(*slots[k]);
  }
  if (job.fetch && d.stream_ctx(stream, &job.ctx) != 0)
    return ffi::Error::Internal("strata_offload_begin: cuStreamGetCtx failed");
  o->last_seq[o->slot_of(layer)] = job.seq;
  o->last_staging[o->slot_of(layer)] = job.staging;
  {
    std::lock_guard<std::mutex> lock(o->mutex);
    o->queue.push_back(job);
  }
  o->wake.notify_one();
  OFFLOAD_TRACE("begin: job %u layer %ld T %ld N %ld M %ld cpu %d fetch %d\n", job.seq, (long)layer, (long)T,
                (long)N, (long)M, (int)job.cpu, (int)job.fetch);
  if (d.memcpy_dtoh(job.staging->in, (CUdeviceptr)(uintptr_t)packed.untyped_data(), packed.size_bytes(), stream) ||
      stream_write(o, stream, POSTED, job.seq) || (job.fetch && stream_wait(o, stream, FETCHED, job.seq)))
    return ffi::Error::Internal("strata_offload_begin: a CUDA copy or stream flag operation failed");
  return ffi::Error::Success();
}

ffi::Error OffloadCollectCuda(void *stream, int64_t pool_id, int64_t layer, ffi::Buffer<ffi::S32> token,
                              ffi::Buffer<ffi::F32> after, ffi::ResultBuffer<ffi::F32> y) {
  const Driver &d = driver();
  Pool *pool = find_pool(pool_id);
  if (!pool || !pool->offload || layer < -1 || layer >= (int64_t)pool->layers.size() ||
      !pool->offload->last_staging[pool->offload->slot_of(layer)])
    return ffi::Error::InvalidArgument("strata_offload_collect: no begin of this layer before it");
  Offload *o = pool->offload.get();
  const int64_t slot = o->slot_of(layer);  // -1: the last traced begin's
  OFFLOAD_TRACE("collect: layer %ld waits for job %u\n", (long)layer, o->last_seq[slot]);
  if (stream_wait(o, stream, DONE, o->last_seq[slot]) ||
      d.memcpy_htod((CUdeviceptr)(uintptr_t)y->untyped_data(), o->last_staging[slot]->y,
                    sizeof(float) * after.element_count(), stream))
    return ffi::Error::Internal("strata_offload_collect: a CUDA copy or stream flag operation failed");
  return ffi::Error::Success();
}

// The capture path (strata_offload_begin_v2 / _collect_v2, command-buffer compatible): what each handler enqueues
// has constant arguments (fixed host and device addresses, constant flag values), and its host work (staging,
// descriptor) is done once, so XLA may record it into a CUDA graph and replay it without calling us. See
// Offload::poll for the flags.
ffi::Error OffloadBeginCaptureCuda(void *stream, int64_t pool_id, int64_t layer, int64_t T, int64_t N, int64_t M,
                                   int64_t cpu, int64_t fetch, ffi::Buffer<ffi::F32> packed, ffi::AnyBuffer gate,
                                   ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_out,
                                   ffi::Result<ffi::AnyBuffer> up_out, ffi::Result<ffi::AnyBuffer> down_out,
                                   ffi::Result<ffi::AnyBuffer> gate_stage, ffi::Result<ffi::AnyBuffer> up_stage,
                                   ffi::Result<ffi::AnyBuffer> down_stage, ffi::ResultBuffer<ffi::S32> token) {
  const Driver &d = driver();
  if (!d.error.empty()) return ffi::Error::Internal("strata_offload_begin_v2: " + d.error);
  Pool *pool = find_pool(pool_id);
  ffi::AnyBuffer *slots[3] = {&gate, &up, &down};
  ffi::Error error = check_begin(pool, layer, T, N, M, fetch != 0, packed, slots);
  if (!error.success()) return error;
  OffloadJob job;
  if (d.stream_ctx(stream, &job.ctx) != 0)
    return ffi::Error::Internal("strata_offload_begin_v2: cuStreamGetCtx failed");
  std::string why;
  Offload *o = offload_for(pool, true, true, job.ctx, why);
  if (!o) return ffi::Error::Internal("strata_offload_begin_v2: " + why);
  job.layer = layer;
  job.T = T;
  job.N = N;
  job.M = M;
  job.cpu = cpu != 0;
  job.fetch = fetch != 0;
  ffi::AnyBuffer *outs[3] = {&*gate_out, &*up_out, &*down_out}, *stages[3] = {&*gate_stage, &*up_stage, &*down_stage};
  for (int k = 0; k < 3; k++) {
    job.slot[k] = (CUdeviceptr)(uintptr_t)outs[k]->untyped_data();
    job.stage[k] = (CUdeviceptr)(uintptr_t)stages[k]->untyped_data();
    job.slot_row_bytes[k] = row_bytes(*slots[k]);
  }
  uint32_t id = 0;
  bool kernel_fetch = false;  // the fetch by the device kernel on this stream: the worker computes only
  bool signal_post = false;   // the plan and POSTED by strata_post_plan, not a copy and a flag write
  {
    std::lock_guard<std::mutex> lock(o->mutex);
    job.staging = offload_staging(o, layer, T, N, M, true, why, job.ctx);
    if (!job.staging) return ffi::Error::Internal("strata_offload_begin_v2: " + why);
    kernel_fetch = job.fetch && device_fetch_ready(o, job.ctx) && job.slot_row_bytes[0] % 16 == 0 &&
                   job.slot_row_bytes[1] % 16 == 0 && job.slot_row_bytes[2] % 16 == 0;
    if (kernel_fetch) job.fetch = false;
    id = descriptor_for(o, job);
    signal_post = (job.cpu || job.fetch) && packed.size_bytes() <= kSignalBytes && job.staging->in_dev &&
                  packed.size_bytes() % 4 == 0 && signal_ready(o, job.ctx);
  }
  if (!id)
    return ffi::Error::Internal("strata_offload_begin_v2: too many distinct offload calls recorded for this pool");
  OFFLOAD_TRACE("begin_v2: layer %ld job %u T %ld N %ld M %ld cpu %d fetch %s (recorded or run)\n", (long)layer, id,
                (long)T, (long)N, (long)M, (int)job.cpu, kernel_fetch ? "kernel" : job.fetch ? "worker" : "none");
  CUresult failed = 0;
  if (kernel_fetch) {
    OffloadJob fetch_job = job;
    failed = launch_fetch(o, stream, fetch_job, static_cast<const float *>(packed.untyped_data()),
                          plan_hidden(pool, layer));
  }
  // the worker reads the plan only for its own part (its cpu experts, or the copies without the kernel); nothing
  // left to the worker: nothing to post (and no collect follows)
  if (!failed && signal_post) {
    failed = launch_signal(o->post_fn, stream, (CUdeviceptr)(uintptr_t)packed.untyped_data(), job.staging->in_dev,
                           packed.size_bytes(), o->flag_device(layer, POSTED), &id);
  } else if (!failed && (job.cpu || job.fetch)) {
    failed = d.memcpy_dtoh(job.staging->in, (CUdeviceptr)(uintptr_t)packed.untyped_data(), packed.size_bytes(),
                           stream);
    if (!failed) failed = d.write_value(stream, o->flag_device(layer, POSTED), id, 0);
  }
  if (!failed && job.fetch)
    failed = d.wait_value(stream, o->flag_device(layer, FETCHED), 1, 0x1 /* CU_STREAM_WAIT_VALUE_EQ */);
  if (!failed && job.fetch) failed = d.write_value(stream, o->flag_device(layer, FETCHED), 0, 0);
  if (failed)
    return ffi::Error::Internal("strata_offload_begin_v2: a CUDA copy or stream flag operation failed (error " +
                                std::to_string(failed) + ")");
  return ffi::Error::Success();
}

// The staging whose y the collect of (layer, T from `after` [T, H], n) reads: the begin of the same layer and
// shape made it (bridge.py keeps M == N). Found from the collect's own attributes, whichever begin ran last.
// layer -1: the traced slot's, {-1, T, n, n}.
OffloadStaging *collect_staging(Pool *pool, int64_t layer, int64_t n, ffi::Buffer<ffi::F32> &after,
                                std::string &error) {
  if (!pool || layer < -1 || layer >= (int64_t)pool->layers.size() || pool->layers.empty()) {
    error = "unknown or released host pool, or a layer outside its store";
    return nullptr;
  }
  auto dims = after.dimensions();
  if (dims.size() != 2 || dims[1] != plan_hidden(pool, layer)) {
    error = "want `after` [T, H]";
    return nullptr;
  }
  Offload *o = pool->offload.get();
  OffloadStaging *s = nullptr;
  if (o) {
    std::lock_guard<std::mutex> lock(o->mutex);
    auto found = o->staging.find({layer, (int64_t)dims[0], n, n});
    if (found != o->staging.end()) s = found->second.get();
  }
  if (!s) error = "no begin of this layer and shape before it";
  return s;
}

ffi::Error OffloadCollectCaptureCuda(void *stream, int64_t pool_id, int64_t layer, int64_t n,
                                     ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> after,
                                     ffi::ResultBuffer<ffi::F32> y) {
  const Driver &d = driver();
  Pool *pool = find_pool(pool_id);
  std::string why;
  OffloadStaging *s = collect_staging(pool, layer, n, after, why);
  if (!s) return ffi::Error::InvalidArgument("strata_offload_collect_v2: " + why);
  Offload *o = pool->offload.get();
  if (!o->capture)
    return ffi::Error::InvalidArgument("strata_offload_collect_v2: this pool's begin ran the sequence path");
  OFFLOAD_TRACE("collect_v2: layer %ld T %ld N %ld (recorded or run)\n", (long)layer, (long)after.dimensions()[0],
                (long)n);
  const size_t y_bytes = sizeof(float) * after.element_count();
  bool signal_collect = false;  // as the begin chose: a loaded kernel, mapped staging, a decode window's y
  {
    std::lock_guard<std::mutex> lock(o->mutex);
    signal_collect = o->signal > 0 && s->y_dev && y_bytes <= kSignalBytes;
  }
  if (signal_collect) {
    if (launch_signal(o->collect_fn, stream, s->y_dev, (CUdeviceptr)(uintptr_t)y->untyped_data(), y_bytes,
                      o->flag_device(layer, DONE), nullptr))
      return ffi::Error::Internal("strata_offload_collect_v2: the collect kernel failed to launch");
    return ffi::Error::Success();
  }
  if (d.wait_value(stream, o->flag_device(layer, DONE), 1, 0x1 /* CU_STREAM_WAIT_VALUE_EQ */) ||
      d.write_value(stream, o->flag_device(layer, DONE), 0, 0) ||
      d.memcpy_htod((CUdeviceptr)(uintptr_t)y->untyped_data(), s->y, y_bytes, stream))
    return ffi::Error::Internal("strata_offload_collect_v2: a CUDA copy or stream flag operation failed");
  return ffi::Error::Success();
}

// CPU: the same calls done in place, in the thread that runs the graph (the tests' path).
ffi::Error OffloadBeginCpu(int64_t pool_id, int64_t layer, int64_t T, int64_t N, int64_t M, int64_t cpu,
                           int64_t fetch, ffi::Buffer<ffi::F32> packed, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                           ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_out,
                           ffi::Result<ffi::AnyBuffer> up_out, ffi::Result<ffi::AnyBuffer> down_out,
                           ffi::Result<ffi::AnyBuffer> gate_stage, ffi::Result<ffi::AnyBuffer> up_stage,
                           ffi::Result<ffi::AnyBuffer> down_stage, ffi::ResultBuffer<ffi::S32> token) {
  Pool *pool = find_pool(pool_id);
  ffi::AnyBuffer *slots[3] = {&gate, &up, &down};
  ffi::Error error = check_begin(pool, layer, T, N, M, fetch != 0, packed, slots);
  if (!error.success()) return error;
  std::string why;
  Offload *o = offload_for(pool, false, false, nullptr, why);
  if (!o) return ffi::Error::Internal("strata_offload_begin: " + why);
  std::lock_guard<std::mutex> lock(o->mutex);
  OffloadStaging *s = offload_staging(o, layer, T, N, M, false, why);
  if (!s) return ffi::Error::Internal("strata_offload_begin: " + why);
  const int64_t H = plan_hidden(pool, layer);
  const float *in = packed.typed_data();
  const float *x = in, *w = in + T * H;
  const int32_t *ids = reinterpret_cast<const int32_t *>(w + T * N);
  const int32_t *src = ids + N, *dst = src + M;
  const int64_t l = layer >= 0 ? layer : dst[M];  // traced: the plan's last int32 names it
  if (l < 0 || l >= (int64_t)pool->layers.size())
    return ffi::Error::InvalidArgument("strata_offload_begin: the plan names layer " + std::to_string(l) +
                                       ", outside the host pool's store");
  ffi::AnyBuffer *outs[3] = {&*gate_out, &*up_out, &*down_out}, *stages[3] = {&*gate_stage, &*up_stage, &*down_stage};
  for (int k = 0; k < 3; k++)
    if (outs[k]->untyped_data() != slots[k]->untyped_data())
      std::memcpy(outs[k]->untyped_data(), slots[k]->untyped_data(), slots[k]->size_bytes());
  if (fetch) {
    int64_t count = 0;
    const auto &host = pool->fetch_host[l];
    for (int64_t m = 0; m < M; m++) {
      if (src[m] < 0) continue;
      for (int k = 0; k < 3; k++) {  // into its victim slot, or (dst -1) into staging row m
        const int64_t rb = row_bytes(*slots[k]);
        if (dst[m] >= (int64_t)slots[k]->dimensions()[0] || src[m] >= pool->layers[l].experts)
          return ffi::Error::InvalidArgument("strata_offload_begin: a fetch outside the store or the cache");
        char *to = dst[m] >= 0 ? static_cast<char *>(outs[k]->untyped_data()) + dst[m] * rb
                               : static_cast<char *>(stages[k]->untyped_data()) + m * rb;
        std::memcpy(to, host[k] + src[m] * rb, rb);
      }
      count++;
    }
    pool->fetch_calls += 1;
    pool->fetched += count;
    pool->fetch_bytes += count * (row_bytes(gate) + row_bytes(up) + row_bytes(down));
  }
  if (cpu) run_job(pool, l, x, ids, w, s->y, T, N, s->scratch);
  else std::memset(s->y, 0, sizeof(float) * T * H);
  o->last_staging[o->slot_of(layer)] = s;
  std::memset(token->untyped_data(), 0, token->size_bytes());
  return ffi::Error::Success();
}

ffi::Error OffloadCollectCpu(int64_t pool_id, int64_t layer, ffi::Buffer<ffi::S32> token,
                             ffi::Buffer<ffi::F32> after, ffi::ResultBuffer<ffi::F32> y) {
  Pool *pool = find_pool(pool_id);
  if (!pool || !pool->offload || layer < -1 || layer >= (int64_t)pool->layers.size() ||
      !pool->offload->last_staging[pool->offload->slot_of(layer)])
    return ffi::Error::InvalidArgument("strata_offload_collect: no begin of this layer before it");
  std::memcpy(y->typed_data(), pool->offload->last_staging[pool->offload->slot_of(layer)]->y,
              sizeof(float) * after.element_count());
  return ffi::Error::Success();
}

// The capture path's collect on CPU: the staging found as the CUDA one finds it (the begin is the shared CPU one).
ffi::Error OffloadCollectCaptureCpu(int64_t pool_id, int64_t layer, int64_t n, ffi::Buffer<ffi::S32> token,
                                    ffi::Buffer<ffi::F32> after, ffi::ResultBuffer<ffi::F32> y) {
  std::string why;
  OffloadStaging *s = collect_staging(find_pool(pool_id), layer, n, after, why);
  if (!s) return ffi::Error::InvalidArgument("strata_offload_collect_v2: " + why);
  std::memcpy(y->typed_data(), s->y, sizeof(float) * after.element_count());
  return ffi::Error::Success();
}

// ---- the prefetch: the next layer's likely experts copied while this layer computes (issue 34 item 3) ------------
//
// strata_offload_prefetch (one per offloaded layer l of a decode window, before layer l's begin): the experts that
// layer l+1's router picks for layer l's hidden state, already given victim slots of layer l+1 by the graph (its
// slot table updated as for any insert), copied from the pinned host experts into those slot rows. The packed plan
// is int32 src [M] (expert ids, -1: none), dst [M] (absolute slot rows), and for a traced layer (attribute -1) the
// layer index last. Exact by construction: the graph only calls an expert resident once its rows are copied (below).
//
// Why a stream of its own: every other copy of the offload calls runs in the graph's stream order (the device fetch
// kernel on the graph's stream; the worker's copies on its stream, which the begin awaits at once), so no copy
// overlaps compute. Here, on CUDA, the call (1) joins the last prefetch: the graph's stream waits for its `done`
// event (no later than this call, i.e. before layer l's begin reads layer l's slots); (2) copies its plan into
// memory of its own (XLA may reuse the plan's buffer once the stream has passed this call), records `ready` and
// launches the fetch kernel (kFetchPtx, a grid of STRATA_PREFETCH_BLOCKS x M blocks) on a side stream behind
// `ready`, then records `done` there. The copy of layer l+1's experts then runs beside layer l's experts and layer
// l+1's attention, and layer l+1's prefetch call joins it before layer l+1's begin. Nothing is left in flight past
// a window: its last layer's call only joins (M rows of -1). No host thread waits on the GPU, and every driver call
// is made by the thread that launches the graph, in launch order (the worker path's deadlock cannot arise).
//
// Such a call must run at each execution (its events are recorded anew each time), so the handler does not declare
// itself command-buffer compatible: XLA ends its command buffer before each prefetch call and starts another after
// it (one split a layer: what prefetch costs on the host side, to measure). If XLA moved the slot arrays between a
// prefetch and its join (a copy of the whole arrays), the join sees other addresses: it then copies the prefetched
// rows again on the graph's stream into the arrays it was given (exact, no overlap) and says so once.
struct Prefetch {
  CUcontext ctx = nullptr;
  CUstream side = nullptr;
  void *ready = nullptr, *done = nullptr;  // CUevent
  CUdeviceptr plan = 0;
  size_t plan_bytes = 0;
  // the prefetch in flight (until the next call joins it): its kernel's arguments
  bool pending = false, warned = false;
  CUdeviceptr slot[3] = {0, 0, 0};
  uint64_t rb[3] = {0, 0, 0};
  int64_t M = 0, layer = 0;
  uint32_t experts = 0;
};

// STRATA_PREFETCH_BLOCKS (default 32): the x extent of the prefetch kernel's grid (each of its M rows of blocks
// strides over an expert's bytes): fewer blocks leave more of the GPU to the layer it runs beside.
unsigned prefetch_blocks() {
  static const unsigned n = [] {
    const char *e = std::getenv("STRATA_PREFETCH_BLOCKS");
    long v = e && *e ? std::atol(e) : 32;
    return (unsigned)std::min<long>(std::max<long>(v, 1), 1024);
  }();
  return n;
}

// The fetch kernel over a prefetch plan in device memory at `plan` (src [M], dst [M], the traced layer after them).
CUresult launch_prefetch(Offload *o, CUstream stream, const Prefetch &p, CUdeviceptr plan) {
  CUdeviceptr src = plan, dst = plan + sizeof(int32_t) * p.M, layer_at = dst + sizeof(int32_t) * p.M;
  uint32_t layer_static = p.layer >= 0 ? (uint32_t)p.layer : 0xffffffffu, layers = (uint32_t)o->layers,
           experts = p.experts;
  CUdeviceptr slot[3] = {p.slot[0], p.slot[1], p.slot[2]};
  uint64_t rb[3] = {p.rb[0], p.rb[1], p.rb[2]};
  // the staging arguments are the slot arrays: the graph gives a row (dst >= 0) to every expert it names
  void *params[] = {&src, &dst, &layer_at, &layer_static, &layers, &experts, &o->fetch_table_dev,
                    &slot[0], &slot[1], &slot[2], &slot[0], &slot[1], &slot[2], &rb[0], &rb[1], &rb[2]};
  return driver().launch_kernel(o->fetch_fn, prefetch_blocks(), (unsigned)p.M, 1, 256, 1, 1, 0, stream, params,
                                nullptr);
}

ffi::Error check_prefetch(Pool *pool, int64_t layer, int64_t M, ffi::Buffer<ffi::S32> &packed,
                          ffi::AnyBuffer *slots[3]) {
  if (!pool) return ffi::Error::InvalidArgument("strata_offload_prefetch: unknown or released host pool");
  const int64_t L = (int64_t)pool->layers.size();
  if (layer < -1 || layer >= L || L == 0)
    return ffi::Error::InvalidArgument("strata_offload_prefetch: layer outside the host pool's store");
  if ((int64_t)packed.element_count() != 2 * M + (layer < 0 ? 1 : 0))
    return ffi::Error::InvalidArgument("strata_offload_prefetch: the packed plan has the wrong size");
  for (int k = 0; k < 3; k++)
    if (slots[k]->dimensions().size() < 1 || slots[k]->dimensions()[0] < 1)
      return ffi::Error::InvalidArgument("strata_offload_prefetch: want slot arrays [rows, ...]");
  for (int64_t l = layer < 0 ? 0 : layer; l <= (layer < 0 ? L - 1 : layer); l++)
    if ((int64_t)pool->fetch_host.size() <= l || !pool->fetch_host[l][0])
      return ffi::Error::InvalidArgument("strata_offload_prefetch: no host experts registered for this layer "
                                         "(HostPool.register_fetch)");
  return ffi::Error::Success();
}

ffi::Error OffloadPrefetchCuda(void *stream, int64_t pool_id, int64_t layer, int64_t M, int64_t capture,
                               ffi::Buffer<ffi::S32> packed, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                               ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_out,
                               ffi::Result<ffi::AnyBuffer> up_out, ffi::Result<ffi::AnyBuffer> down_out) {
  const Driver &d = driver();
  if (!d.error.empty()) return ffi::Error::Internal("strata_offload_prefetch: " + d.error);
  if (!d.mem_alloc || !d.memcpy_dtod || !d.event_create || !d.event_record || !d.stream_wait_event)
    return ffi::Error::Internal("strata_offload_prefetch: libcuda.so.1 lacks cuMemAlloc / cuMemcpyDtoDAsync / "
                                "cuEventCreate / cuEventRecord / cuStreamWaitEvent");
  Pool *pool = find_pool(pool_id);
  ffi::AnyBuffer *slots[3] = {&gate, &up, &down}, *outs[3] = {&*gate_out, &*up_out, &*down_out};
  ffi::Error error = check_prefetch(pool, layer, M, packed, slots);
  if (!error.success()) return error;
  CUcontext ctx = nullptr;
  if (d.stream_ctx(stream, &ctx) != 0) return ffi::Error::Internal("strata_offload_prefetch: cuStreamGetCtx failed");
  std::string why;
  Offload *o = offload_for(pool, true, capture != 0, ctx, why);
  if (!o) return ffi::Error::Internal("strata_offload_prefetch: " + why);
  {
    std::lock_guard<std::mutex> lock(o->mutex);
    if (!device_fetch_ready(o, ctx))
      return ffi::Error::Internal("strata_offload_prefetch: needs the device fetch kernel (" + o->fetch_why +
                                  "): run with prefetch=0");
  }
  for (int k = 0; k < 3; k++)
    if (row_bytes(*slots[k]) % 16)
      return ffi::Error::InvalidArgument("strata_offload_prefetch: slot rows must be multiples of 16 bytes");
  std::lock_guard<std::mutex> lock(pool->offload_mutex);
  if (!pool->prefetch) pool->prefetch = std::make_unique<Prefetch>();
  Prefetch &p = *pool->prefetch;
  if (p.ctx != ctx) {  // first call (or another context): the side stream and events made in the stream's context
    if (d.ctx_set_current(ctx) || d.stream_create(&p.side, 1 /* CU_STREAM_NON_BLOCKING */) ||
        d.event_create(&p.ready, 2 /* CU_EVENT_DISABLE_TIMING */) ||
        d.event_create(&p.done, 2 /* CU_EVENT_DISABLE_TIMING */))
      return ffi::Error::Internal("strata_offload_prefetch: the side stream or its events could not be made");
    p.ctx = ctx;
    p.pending = false;
    p.plan = 0;
    p.plan_bytes = 0;
  }
  CUresult failed = 0;
  // (1) the join of the last prefetch
  if (p.pending) failed = d.stream_wait_event(stream, p.done, 0);
  // the outputs alias the inputs (bridge.offload_prefetch); should XLA ever give other buffers, take the inputs
  for (int k = 0; k < 3 && !failed; k++)
    if (outs[k]->untyped_data() != slots[k]->untyped_data())
      failed = d.memcpy_dtod((CUdeviceptr)(uintptr_t)outs[k]->untyped_data(),
                             (CUdeviceptr)(uintptr_t)slots[k]->untyped_data(), slots[k]->size_bytes(), stream);
  if (!failed && p.pending) {
    bool moved = false;
    for (int k = 0; k < 3; k++) moved |= p.slot[k] != (CUdeviceptr)(uintptr_t)outs[k]->untyped_data();
    if (!failed && moved) {  // its rows went into arrays XLA has since replaced: copy them again, in stream order
      if (!p.warned)
        std::fprintf(stderr, "[offload] prefetch: the slot arrays moved between a prefetch and its join; its rows "
                     "were copied again on the graph's stream (exact, no overlap)\n");
      p.warned = true;
      for (int k = 0; k < 3; k++) p.slot[k] = (CUdeviceptr)(uintptr_t)outs[k]->untyped_data();
      failed = launch_prefetch(o, stream, p, p.plan);
    }
    p.pending = false;
  }
  // (2) this layer's prefetch on the side stream
  if (!failed && M > 0) {
    const size_t bytes = packed.size_bytes();
    if (bytes > p.plan_bytes) {
      // the old plan's last reader was joined above; free nothing (a few bytes, once per larger window)
      if (d.mem_alloc(&p.plan, std::max<size_t>(bytes, 256)))
        return ffi::Error::Internal("strata_offload_prefetch: cuMemAlloc of the plan failed");
      p.plan_bytes = std::max<size_t>(bytes, 256);
    }
    p.M = M;
    p.layer = layer;
    p.experts = (uint32_t)pool->layers[layer >= 0 ? layer : 0].experts;
    for (int k = 0; k < 3; k++) {
      p.slot[k] = (CUdeviceptr)(uintptr_t)outs[k]->untyped_data();
      p.rb[k] = (uint64_t)row_bytes(*slots[k]);
    }
    failed = d.memcpy_dtod(p.plan, (CUdeviceptr)(uintptr_t)packed.untyped_data(), bytes, stream);
    if (!failed) failed = d.event_record(p.ready, stream);
    if (!failed) failed = d.stream_wait_event(p.side, p.ready, 0);
    if (!failed) failed = launch_prefetch(o, p.side, p, p.plan);
    if (!failed) failed = d.event_record(p.done, p.side);
    p.pending = !failed;
  }
  if (failed)
    return ffi::Error::Internal("strata_offload_prefetch: a CUDA copy, event or launch failed (error " +
                                std::to_string(failed) + ")");
  return ffi::Error::Success();
}

// CPU: the rows copied in place, in the thread that runs the graph (the tests' path; nothing to join).
ffi::Error OffloadPrefetchCpu(int64_t pool_id, int64_t layer, int64_t M, int64_t capture,
                              ffi::Buffer<ffi::S32> packed, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                              ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_out,
                              ffi::Result<ffi::AnyBuffer> up_out, ffi::Result<ffi::AnyBuffer> down_out) {
  Pool *pool = find_pool(pool_id);
  ffi::AnyBuffer *slots[3] = {&gate, &up, &down}, *outs[3] = {&*gate_out, &*up_out, &*down_out};
  ffi::Error error = check_prefetch(pool, layer, M, packed, slots);
  if (!error.success()) return error;
  const int32_t *src = packed.typed_data(), *dst = src + M;
  const int64_t l = layer >= 0 ? layer : dst[M];  // traced: the plan's last int32 names it
  if (l < 0 || l >= (int64_t)pool->layers.size())
    return ffi::Error::InvalidArgument("strata_offload_prefetch: the plan names layer " + std::to_string(l) +
                                       ", outside the host pool's store");
  for (int k = 0; k < 3; k++)
    if (outs[k]->untyped_data() != slots[k]->untyped_data())
      std::memcpy(outs[k]->untyped_data(), slots[k]->untyped_data(), slots[k]->size_bytes());
  const auto &host = pool->fetch_host[l];
  for (int64_t m = 0; m < M; m++) {
    if (src[m] < 0) continue;
    for (int k = 0; k < 3; k++) {
      const int64_t rb = row_bytes(*slots[k]);
      if (dst[m] < 0 || dst[m] >= (int64_t)slots[k]->dimensions()[0] || src[m] >= pool->layers[l].experts)
        return ffi::Error::InvalidArgument("strata_offload_prefetch: a copy outside the store or the cache");
      std::memcpy(static_cast<char *>(outs[k]->untyped_data()) + dst[m] * rb, host[k] + src[m] * rb, rb);
    }
  }
  return ffi::Error::Success();
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

#define STRATA_OFFLOAD_BEGIN_BIND(...)                                                                        \
  ffi::Ffi::Bind()                                                                                                 \
      __VA_ARGS__.Attr<int64_t>("pool")                                                                            \
      .Attr<int64_t>("layer")                                                                                      \
      .Attr<int64_t>("tokens")                                                                                     \
      .Attr<int64_t>("n")                                                                                          \
      .Attr<int64_t>("m")                                                                                          \
      .Attr<int64_t>("cpu")                                                                                        \
      .Attr<int64_t>("fetch")                                                                                      \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                                \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::Buffer<ffi::S32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_begin_cpu, OffloadBeginCpu, STRATA_OFFLOAD_BEGIN_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_begin_cuda, OffloadBeginCuda,
                              STRATA_OFFLOAD_BEGIN_BIND(.Ctx<ffi::PlatformStream<void *>>()));

#define STRATA_OFFLOAD_COLLECT_BIND(...)                                                                      \
  ffi::Ffi::Bind()                                                                                                 \
      __VA_ARGS__.Attr<int64_t>("pool")                                                                            \
      .Attr<int64_t>("layer")                                                                                      \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                                \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_collect_cpu, OffloadCollectCpu, STRATA_OFFLOAD_COLLECT_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_collect_cuda, OffloadCollectCuda,
                              STRATA_OFFLOAD_COLLECT_BIND(.Ctx<ffi::PlatformStream<void *>>()));

// The capture path: the same begin binding; collect also takes `n` (the window's N, so it finds its staging itself).
// The CUDA handlers carry kCmdBufferCompatible: XLA records them into its command buffers (CUDA graphs).
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_begin_v2_cpu, OffloadBeginCpu, STRATA_OFFLOAD_BEGIN_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_begin_v2_cuda, OffloadBeginCaptureCuda,
                              STRATA_OFFLOAD_BEGIN_BIND(.Ctx<ffi::PlatformStream<void *>>()),
                              {ffi::Traits::kCmdBufferCompatible});

#define STRATA_OFFLOAD_COLLECT_V2_BIND(...)                                                                   \
  ffi::Ffi::Bind()                                                                                                 \
      __VA_ARGS__.Attr<int64_t>("pool")                                                                            \
      .Attr<int64_t>("layer")                                                                                      \
      .Attr<int64_t>("n")                                                                                          \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                                \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_collect_v2_cpu, OffloadCollectCaptureCpu,
                              STRATA_OFFLOAD_COLLECT_V2_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_collect_v2_cuda, OffloadCollectCaptureCuda,
                              STRATA_OFFLOAD_COLLECT_V2_BIND(.Ctx<ffi::PlatformStream<void *>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// The prefetch: CPU and CUDA alike, not command-buffer compatible (its CUDA handler records events at each run).
#define STRATA_OFFLOAD_PREFETCH_BIND(...)                                                                     \
  ffi::Ffi::Bind()                                                                                                 \
      __VA_ARGS__.Attr<int64_t>("pool")                                                                            \
      .Attr<int64_t>("layer")                                                                                      \
      .Attr<int64_t>("m")                                                                                          \
      .Attr<int64_t>("capture")                                                                                    \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Arg<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()                                                                                       \
      .Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_prefetch_cpu, OffloadPrefetchCpu, STRATA_OFFLOAD_PREFETCH_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(strata_offload_prefetch_cuda, OffloadPrefetchCuda,
                              STRATA_OFFLOAD_PREFETCH_BIND(.Ctx<ffi::PlatformStream<void *>>()));

// ---- the registry, called from Python (ctypes) --------------------------------------------------------------------

extern "C" {

// A pool over `layers` layers of stacked experts (pointers stay valid until pool_release: the caller keeps the
// arrays); returns its id.
int64_t pool_register(int fmt, int fmt_down, int round_bf16, int threads, int64_t layers, const void *const *gate,
                      const void *const *up, const void *const *down, const float *const *gate_scale,
                      const float *const *up_scale, const float *const *down_scale, const int64_t *hidden,
                      const int64_t *intermediate, const int64_t *group, const int64_t *group_down,
                      const int64_t *experts, const int64_t *expert_bytes) {
  auto *pool = new Pool();
  pool->fmt = fmt;
  pool->fmt_down = fmt_down;
  pool->round_bf16 = round_bf16;
  pool->threads = threads;
  if (const char *e = std::getenv("STRATA_OFFLOAD_TIMELINE"); e && std::atoll(e) > 0)
    pool->ring.assign(4 * std::min<int64_t>(std::atoll(e), int64_t(1) << 20), 0);
  for (int64_t l = 0; l < layers; l++)
    pool->layers.push_back({gate[l], up[l], down[l], gate_scale[l], up_scale[l], down_scale[l], (long)hidden[l],
                            (long)intermediate[l], (long)group[l], (long)group_down[l], (long)experts[l],
                            (long)expert_bytes[l]});
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(pool);
  return (int64_t)registry.size() - 1;
}

// Forget a pool: later calls with its id fail. Its memory stays (a graph still queued on a stream may run its host
// function after this; a pool is released once per engine).
void pool_release(int64_t id) {
  Pool *pool = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (id >= 0 && id < (int64_t)registry.size()) std::swap(pool, registry[id]);
  }
  if (pool) {  // the worker stops (a job it still waits for is given up: its graph has failed or finished)
    std::lock_guard<std::mutex> lock(pool->offload_mutex);
    pool->offload.reset();
  }
}

// The worker's last jobs (STRATA_OFFLOAD_TIMELINE=N): up to `most` of them, oldest first, each 4 int64 (POSTED seen and
// DONE stored in ns of the monotonic clock, the layer, T) into out; returns how many. Read it while no request runs.
int64_t pool_worker_ring(int64_t id, int64_t *out, int64_t most) {
  Pool *pool = find_pool(id);
  if (!pool || pool->ring.empty()) return 0;
  const int64_t size = (int64_t)pool->ring.size() / 4, n = pool->ring_jobs.load(std::memory_order_acquire);
  const int64_t count = std::min({n, size, most});
  for (int64_t i = 0; i < count; i++) {
    const int64_t k = (n - count + i) % size;
    std::memcpy(out + 4 * i, &pool->ring[4 * k], 4 * sizeof(int64_t));
  }
  return count;
}

// 1 when the offload calls may take the capture path (strata_offload_begin_v2 / _collect_v2): the CUDA driver has
// stream memory operations and STRATA_POOL_MEMOPS is not 0, or there is no CUDA driver (only the CPU handlers run).
int offload_capture_supported() {
  const char *env = std::getenv("STRATA_POOL_MEMOPS");
  if (env && std::string(env) == "0") return 0;
  const Driver &d = driver();
  return !d.error.empty() || d.offload_error.empty();
}

// out[11] = layer jobs, experts computed, weight bytes read, nanoseconds inside the jobs; fetch calls, experts
// fetched, bytes fetched; the capture path's worker: jobs, nanoseconds from POSTED seen to DONE stored, gaps and their
// nanoseconds from a DONE to the next POSTED seen (since registration).
void pool_counters(int64_t id, int64_t *out) {
  Pool *pool = find_pool(id);
  out[0] = pool ? pool->calls.load() : 0;
  out[1] = pool ? pool->experts_run.load() : 0;
  out[2] = pool ? pool->bytes.load() : 0;
  out[3] = pool ? pool->nanos.load() : 0;
  out[4] = pool ? pool->fetch_calls.load() : 0;
  out[5] = pool ? pool->fetched.load() : 0;
  out[6] = pool ? pool->fetch_bytes.load() : 0;
  out[7] = pool ? pool->worker_jobs.load() : 0;
  out[8] = pool ? pool->worker_busy_ns.load() : 0;
  out[9] = pool ? pool->worker_gaps.load() : 0;
  out[10] = pool ? pool->worker_gap_ns.load() : 0;
}

}  // extern "C"

namespace {
// A kernel's mode of this pool's offload calls (Offload::device_fetch or ::signal) and why it is not the kernel.
int offload_mode(int64_t id, char *why, int64_t size, int Offload::*mode, std::string Offload::*reason) {
  Pool *pool = find_pool(id);
  if (!pool) return 0;
  std::lock_guard<std::mutex> lock(pool->offload_mutex);
  Offload *o = pool->offload.get();
  if (!o) return 0;
  std::lock_guard<std::mutex> inner(o->mutex);
  if (why && size > 0) std::snprintf(why, (size_t)size, "%s", (o->*reason).c_str());
  return o->*mode;
}
}  // namespace

extern "C" {
// How this pool's capture-path offload calls fetch: 1 the device kernel, -1 the worker's copies (why: into
// `why`, `size` bytes), 0 not decided yet (no fetching begin recorded, or no offload calls on a GPU).
int pool_device_fetch(int64_t id, char *why, int64_t size) {
  return offload_mode(id, why, size, &Offload::device_fetch, &Offload::fetch_why);
}

// How this pool's capture-path offload calls signal the worker: 1 the signal kernels, -1 the copies and stream memory
// operations (why: into `why`), 0 not decided yet (no begin with pool work recorded, or no offload calls on a GPU).
int pool_signal_mode(int64_t id, char *why, int64_t size) {
  return offload_mode(id, why, size, &Offload::signal, &Offload::signal_why);
}

// Layer `layer`'s experts in pinned host memory (what strata_offload_begin fetches from; rows laid out as the slot
// arrays' rows). The caller keeps them alive until pool_release.
void pool_register_fetch(int64_t id, int64_t layer, const void *gate, const void *up, const void *down) {
  Pool *pool = find_pool(id);
  if (!pool || layer < 0 || layer >= (int64_t)pool->layers.size()) return;
  std::lock_guard<std::mutex> lock(pool->offload_mutex);
  if ((int64_t)pool->fetch_host.size() < (int64_t)pool->layers.size())
    pool->fetch_host.resize(pool->layers.size(), {nullptr, nullptr, nullptr});
  pool->fetch_host[layer] = {static_cast<const char *>(gate), static_cast<const char *>(up),
                             static_cast<const char *>(down)};
}

}  // extern "C"
