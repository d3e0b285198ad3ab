"""Thread pool that computes Qwen3-MoE expert FFNs on the host.

One layer job: y[T, H] = sum_n w[t, n] * down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t])),
e = ids[n], ids == -1 skipped. It runs in two phases of thread jobs, each cut by
output rows so that all threads stay busy even for a single expert:
  1. (expert, slice of gate/up rows) -> hT[n, slice] = w * silu(gate x) * (up x)
  2. (slice of down rows = slice of H) -> yT[slice] = sum_n down_e[slice] hT[n]
Each job writes a disjoint slice, so no locks and a fixed summation order.
numpy's BLAS releases the GIL, so the jobs run in parallel. Activations are
kept transposed ([rows, T]): OpenBLAS runs W @ xT about 2x faster than
x @ W^T for T = 4 (measured), and the same for T = 1.

Where host_pool/native.py builds its expert kernel (native_experts.c), a layer job
or a split phase of at most NATIVE_MAX_TOKENS tokens per expert is one C call
instead: the same two phases, threads inside it, the weights widened in
registers, no Python per expert. The BLAS jobs below run the rest (prefill-sized
windows, STRATA_POOL_NATIVE=0, no compiler).

Split jobs (`submit_split`, for deferred CPU rows) return per-entry unweighted
rows [T, K, H] instead of the weighted sum, in two phases: first the "heavy"
entries (routing weight >= threshold), then a signal, then the "light" ones.
Each phase runs the same two kinds of thread jobs, over entries grouped by
expert (one weight read per expert and phase).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import numpy as np

from . import native
from .blas import set_blas_threads
from .store import BF16, U8
from .store import HostExpertStore, row_chunks_f32

# Thread jobs per thread and phase: >1 evens out uneven job times, more costs
# submit overhead (~10 us per job).
JOBS_PER_THREAD = 2
MIN_ROWS_PER_JOB = 16
# Tokens per expert up to which a job runs in the C kernel: it reads each weight row once per 4 tokens from cache,
# so past a few dozen tokens BLAS's blocked products are the faster path.
NATIVE_MAX_TOKENS = 16
def _format_code(store, which: str = "gate") -> int:
    """native_experts.c's FMT_* of a store's matrix `which` (gate/up's, or down's: a job's phase 1 and phase 2 may
    differ; int8-g with minima: FMT_INT8GM)."""
    fmt = store.format_of(which)
    return 6 if fmt == "int8-g" and store.minima_of(which) else _FORMAT_CODES[fmt]


_FORMAT_CODES = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3, "int4-q4k": 8, "int4-m": 4, "int8-g": 5,
                 "int2-q2k": 7, "int6-q6k": 9, "int6-q6km": 10}  # native_experts.c's FMT_*


class HostPoolError(RuntimeError):
    """A layer job failed or timed out. `layer` is the layer index; `phase` is
    "heavy" or "light" for a split job's phase, else None."""

    def __init__(self, message: str, layer: int | None = None, phase: str | None = None):
        super().__init__(message)
        self.layer = layer
        self.phase = phase


@dataclasses.dataclass
class PoolStats:
    calls: int = 0             # layer jobs finished
    jobs: int = 0              # thread jobs run
    job_seconds: float = 0.0   # time inside thread jobs, summed over threads
    wall_seconds: float = 0.0  # submit -> result ready, summed over layer jobs
    bytes_read: int = 0        # expert weight bytes read

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


def worker_timeline(before: tuple, after: tuple) -> dict:
    """Means of the GPU offload worker between two `HostPool.worker_counters` readings, in microseconds: `busy` (a
    job's POSTED seen to DONE), `job` (the layer job itself: its part of busy), `gap` (a DONE to the next POSTED seen:
    the stream's side of a layer), with the counts they come from."""
    jobs, busy, gaps, gap_ns, job_ns = (a - b for a, b in zip(after, before))
    return dict(jobs=jobs, gaps=gaps, busy_us=busy / jobs / 1e3 if jobs else None,
                job_us=job_ns / jobs / 1e3 if jobs else None, gap_us=gap_ns / gaps / 1e3 if gaps else None)


@dataclasses.dataclass
class PoolHandle:
    """A submitted layer job; pass to `HostPool.collect`."""
    layer: int
    future: Future          # -> y [T, H] float32
    deadline: float         # perf_counter() time
    generation: "_Generation"


PHASES = ("heavy", "light")
# Split jobs kept in the registry at most; beyond it, the oldest finished ones
# (never collected, e.g. because the graph failed before collect_split) go.
MAX_SPLIT_JOBS = 256


@dataclasses.dataclass
class SplitJob:
    """A submitted split job (see `HostPool.submit_split`), found by its ticket."""
    layer: int
    ticket: int
    heavy_rows: np.ndarray          # [T, K, H] float32, written by the heavy phase only
    light_rows: np.ndarray          # [T, K, H] float32, written by the light phase only
    heavy_done: threading.Event     # set when the heavy phase ends, fails, or the job is dropped
    future: Future | None           # the whole job -> None (set right after submit)
    deadline: float                 # perf_counter() time, from submit
    generation: "_Generation"
    failed_phase: str | None = None  # set by the driver before it raises
    heavy_error: BaseException | None = None


class _Generation:
    """The executors a layer job runs on; replaced when a job times out, so a
    stuck thread cannot hold up later calls. (A thread stuck for good would
    still delay interpreter exit: concurrent.futures joins its threads.)"""

    def __init__(self, threads: int):
        self.workers = ThreadPoolExecutor(threads, thread_name_prefix="host-pool")
        # Runs the phases of one layer job at a time, in submit order.
        self.driver = ThreadPoolExecutor(1, thread_name_prefix="host-pool-driver")
        self.release_hangs = threading.Event()  # set when abandoned: frees injected "hang" faults and the driver

    def shutdown(self, wait: bool) -> None:
        self.release_hangs.set()
        self.driver.shutdown(wait=wait, cancel_futures=True)
        self.workers.shutdown(wait=wait, cancel_futures=True)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, a container's cpuset), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity on this OS
        return os.cpu_count() or 1


class HostPool:
    """Computes expert FFN rows for one layer at a time on `threads` threads.

    timeout_s counts from submit (waiting behind earlier layer jobs included).
    blas_threads: BLAS threads per numpy call (process-wide setting, applied
    here). 1 avoids oversubscription: the pool's own threads already fill the
    cores. None leaves BLAS as it is.
    """

    def __init__(self, store: HostExpertStore, threads: int | None = None,
                 timeout_s: float = 20.0, blas_threads: int | None = 1, native_calls: bool = True):
        native.mode()  # a bad STRATA_POOL_NATIVE fails here, not in a job
        native.build_defines()  # and a bad STRATA_POOL_DEFINES
        if U8 in (store.dtype_of("gate"), store.dtype_of("down")):  # int4, int4-q4k, int4-m
            native.int4_kernel()  # compiled now (once per machine), not inside the first job's timeout
        native.experts_kernel()  # the same
        self.store = store
        self.threads = threads or usable_cores()
        self.timeout_s = timeout_s
        # bf16 compute (bf16 experts; int8 and int4 by default): round where the device rounds (g, u, h and each
        # expert's output), so an expert's rows do not depend on where it ran beyond float32 summation order.
        self.round_bf16 = store.compute_dtype == BF16
        self._stats = PoolStats()
        # native_calls: jitted graphs reach this pool through the XLA FFI handler (host_pool/native_ffi.cc) where it
        # builds, else (or False) through io_callback; see `ffi_handle`.
        self._native_calls = native_calls
        self._ffi: tuple | None = None  # (library, pool id, [the counters folded into stats so far]) once registered
        self._lock = threading.Lock()       # guards stats, faults, generation
        # layer (plain jobs) or (layer, phase) (split jobs) -> "raise" | "hang", one-shot
        self._faults: dict[int | tuple[int, str], str] = {}
        self._splits: dict[int, SplitJob] = {}  # ticket -> in-flight split job
        self._tickets = itertools.count(1)
        self._generation = _Generation(self.threads)
        if blas_threads is not None:
            set_blas_threads(blas_threads)

    # ---- public API --------------------------------------------------------

    @property
    def stats(self) -> PoolStats:
        """Layer jobs run so far (since the last `stats.reset()`), through either path: the Python jobs' own
        counts plus what the native FFI calls counted meanwhile."""
        if self._ffi is not None:
            seen = self._ffi[2]
            counts = self._native_counters()
            calls, _, nbytes, nanos = (c - s for c, s in zip(counts[:4], seen))
            seen[:] = list(counts[:4])
            with self._lock:
                self._stats.calls += calls
                self._stats.jobs += calls
                self._stats.bytes_read += nbytes
                self._stats.wall_seconds += nanos * 1e-9
                self._stats.job_seconds += nanos * 1e-9 * self.threads
        return self._stats

    def ffi_handle(self) -> int | None:
        """This pool's id in the native FFI handler's registry (registered on the first call), or None when jitted
        graphs are to reach it by io_callback: native_calls=False, STRATA_POOL_NATIVE=0, no compiler, or a store
        the kernel does not take. Layer jobs through the handler run natively in the thread that meets them (CPU)
        or in CUDA's host-function thread (GPU): no Python, no timeout (native code that cannot hang), no faults
        to inject."""
        if not self._native_calls:
            return None
        if self._ffi is None:
            library = native.ffi_library()
            if library is None or native.experts_kernel() is None:
                return None
            store = self.store
            L = store.num_layers
            arrays = [store.gate, store.up, store.down, store.gate_scale, store.up_scale, store.down_scale]
            pointers = [(ctypes.c_void_p * L)(*[0 if a is None else a.ctypes.data for a in arr]) for arr in arrays]
            ints = [(ctypes.c_int64 * L)(*values) for values in (
                [store.hidden_size(i) for i in range(L)], [store.intermediate_size(i) for i in range(L)],
                [store.group(i, "gate") for i in range(L)], [store.group(i, "down") for i in range(L)],
                [store.num_experts(i) for i in range(L)], [store.nbytes(i, 0) for i in range(L)])]
            pool_id = library.register(_format_code(store, "gate"), _format_code(store, "down"),
                                       int(self.round_bf16), self.threads, L, *pointers, *ints)
            self._ffi = (library, pool_id, [0, 0, 0, 0])
        return self._ffi[1]

    def register_fetch(self, layer: int, gate: int, up: int, down: int) -> bool:
        """Tell the native handler where layer `layer`'s experts sit in pinned host memory (addresses of arrays
        laid out as the slot arrays' rows, kept alive by the caller), so the offload calls (bridge.offload_begin)
        can fetch them. False where the pool has no native handle."""
        pool_id = self.ffi_handle()
        if pool_id is None:
            return False
        self._ffi[0].register_fetch(pool_id, int(layer), gate, up, down)
        return True

    def _native_mode(self, query: str, other: str) -> str:
        """"kernel", "<other>: <why>" or "" from the native library's mode query `query` (1, -1 and why, 0)."""
        if self._ffi is None:
            return ""
        library, pool_id, _ = self._ffi
        why = ctypes.create_string_buffer(256)
        mode = getattr(library, query)(pool_id, why, len(why))
        return {1: "kernel", -1: f"{other}: {why.value.decode(errors='replace')}"}.get(mode, "")

    def fetch_mode(self) -> str:
        """How the native offload calls fetch on a GPU: "kernel" (the begin call's stream copies with the device
        fetch kernel), "worker: <why>" (the worker's copies), or "" (not decided: no fetch recorded yet, or no GPU)."""
        return self._native_mode("device_fetch", "worker")

    def signal_mode(self) -> str:
        """How the native offload calls reach the worker on a GPU: "kernel" (STRATA_OFFLOAD_SIGNAL=kernel: a begin
        posts its plan and a collect waits for y with one kernel each), "memops: <why>" (copies and stream memory
        operations, the default), or "" (not decided: no begin with pool work recorded yet, or no GPU)."""
        return self._native_mode("signal_mode", "memops")

    def fetch_counters(self) -> tuple[int, int, int]:
        """(offload calls that fetched, experts fetched, bytes fetched) by the native offload calls' host copies so
        far: the CPU handler's, and on a GPU the worker's (STRATA_OFFLOAD_FETCH=worker, or where the device fetch
        kernel does not load). The kernel's fetches are counted by the graphs' own counters (ExpertStats)."""
        if self._ffi is None:
            return 0, 0, 0
        counts = self._native_counters()
        return counts[4], counts[5], counts[6]

    def worker_counters(self) -> tuple[int, int, int, int, int]:
        """The GPU offload worker's host-clock counters so far (capture path; zeros elsewhere): (jobs it took, ns from
        POSTED seen to DONE stored, gaps, ns of the gaps from a DONE to the next POSTED seen within 5 ms, ns inside
        the layer jobs). Differences of two readings give one request's means (`worker_timeline`)."""
        if self._ffi is None:
            return 0, 0, 0, 0, 0
        counts = self._native_counters()
        return counts[7], counts[8], counts[9], counts[10], counts[3]

    def _native_counters(self) -> list[int]:
        """The native handler's counters of this pool (native_ffi.cc's pool_counters; the FFI handle registered)."""
        library, pool_id, _ = self._ffi
        counts = (ctypes.c_int64 * native.COUNTERS)()
        library.counters(pool_id, counts)
        return [int(c) for c in counts]

    def worker_jobs(self, most: int = 1 << 16) -> np.ndarray:
        """The GPU offload worker's last jobs where STRATA_OFFLOAD_TIMELINE=N was set when the pool registered: int64
        [n, 4], oldest first: POSTED seen and DONE stored (ns of the monotonic clock, as Python's time.monotonic_ns),
        the layer, T. Empty elsewhere. Read between requests."""
        if self._ffi is None:
            return np.zeros((0, 4), np.int64)
        library, pool_id, _ = self._ffi
        out = np.zeros((most, 4), np.int64)
        n = library.worker_ring(pool_id, out.ctypes.data, most)
        return out[:n]

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """y [T, H] float32 for x [T, H], ids [N] (-1 = padding), w [T, N]."""
        return self.collect(self.submit(layer, x, ids, w))

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> PoolHandle:
        """Start a layer job and return at once."""
        layer = int(layer)
        x, ids, w = self._check_inputs(layer, x, ids, w)
        keep = ids >= 0
        experts, weights = ids[keep], np.ascontiguousarray(w[:, keep])  # [Nv], [T, Nv]
        started = time.perf_counter()
        with self._lock:  # so a concurrent timeout cannot shut the generation in between
            fault = self._faults.pop(layer, None)
            generation = self._generation
            future = generation.driver.submit(
                self._run_layer, generation, layer, x, experts, weights, fault, started)
        return PoolHandle(layer, future, started + self.timeout_s, generation)

    def collect(self, handle: PoolHandle) -> np.ndarray:
        """Wait for a submitted layer job; raises HostPoolError on failure or timeout."""
        layer = handle.layer
        return self._finish(
            handle.future, handle.generation, max(0.0, handle.deadline - time.perf_counter()),
            lambda: _pool_error(layer, f"did not answer within {self.timeout_s} s"),
            lambda error: _pool_error(layer, f"expert job failed: {_failure(error)}", cause=error))

    def inject_fault(self, layer: int, kind: str = "raise", phase: str | None = None) -> None:
        """Test hook: the next job of `layer` raises ("raise") or never
        answers ("hang", until the pool gives up on it).

        Faults reach the jobs this Python pool runs: its own calls, and graphs that reach it by io_callback; a
        graph's FFI calls (see `ffi_handle`) run native code that never sees them (engines: pool_calls=callback).

        phase None: the next plain job (`submit`/`compute`); "heavy" or
        "light": that phase of the next split job (`submit_split`) of `layer`.
        """
        if kind not in ("raise", "hang"):
            raise ValueError(f"fault kind {kind!r}, want 'raise' or 'hang'")

        if phase is not None and phase not in PHASES:
            raise ValueError(f"fault phase {phase!r}, want None, 'heavy' or 'light'")
        with self._lock:
            self._faults[int(layer) if phase is None else (int(layer), phase)] = kind

    # ---- split jobs: per-entry rows, heavy entries first --------------------

    def submit_split(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                     threshold: float) -> int:
        """Start a split job and return its ticket (an int > 0, < 2**31) at once.

        x [T, H] float32, ids [T, K] int (-1 = not a CPU entry), weights [T, K].
        The job fills rows[t, k] = down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t])),
        e = ids[t, k], UNWEIGHTED (the caller applies weights); rows of ids == -1
        stay zero. Entries with weights[t, k] >= threshold ("heavy", compared in
        float32, so a weight equal to the threshold is heavy) are computed first,
        then `wait_heavy` can return, then the light ones. Both phases count
        their timeout from this submit (queueing behind earlier jobs included).
        Pass the ticket to `wait_heavy` (optional) and then `collect_split`.
        """
        layer = int(layer)
        x, ids, weights = self._check_inputs(layer, x, ids, weights, split=True)
        heavy = (ids >= 0) & (weights >= np.float32(threshold))
        light = (ids >= 0) & ~heavy
        T, K = ids.shape
        started = time.perf_counter()
        with self._lock:  # so a concurrent timeout cannot shut the generation in between
            faults = {phase: self._faults.pop((layer, phase), None) for phase in PHASES}
            ticket = self._new_ticket()
            rows_shape = (T, K, x.shape[1])
            job = SplitJob(layer, ticket, np.zeros(rows_shape, np.float32),
                           np.zeros(rows_shape, np.float32), threading.Event(), None,
                           started + self.timeout_s, self._generation)
            job.future = job.generation.driver.submit(
                self._run_split, job, x, ids, heavy, light, faults, started)
            # A job dropped before it ran never reaches its heavy phase: wake wait_heavy.
            job.future.add_done_callback(lambda _: job.heavy_done.set())
            self._splits[ticket] = job
        return ticket

    def wait_heavy(self, ticket: int, timeout: float | None = None) -> np.ndarray:
        """rows [T, K, H] float32 with the heavy entries filled, the others zero.

        Waits until the split job's heavy phase is done; the light phase may
        still run. timeout None: until `timeout_s` after submit; else `timeout`
        seconds from now. Raises HostPoolError (phase "heavy") on timeout or
        failure. The ticket stays registered: `collect_split` it afterwards.
        The returned array is the job's own: do not modify it.
        """
        job = self._split_job(ticket, remove=False)
        limit, remaining = self._wait_limit(job, timeout)
        if not job.heavy_done.wait(remaining):
            self._abandon(job.generation)
            raise self._split_error(job, "heavy", f"did not arrive within {limit} s")
        if job.future.cancelled():
            raise self._split_failure(job, "heavy", None)
        if job.heavy_error is not None:
            raise self._split_failure(job, "heavy", job.heavy_error)
        return job.heavy_rows

    def collect_split(self, ticket: int, timeout: float | None = None) -> np.ndarray:
        """rows [T, K, H] float32 with every entry filled (heavy and light).

        Waits for the whole split job and removes its ticket, also when it
        raises. timeout as for `wait_heavy`. Raises HostPoolError naming the
        phase that failed or was still running at the timeout.
        """
        job = self._split_job(ticket, remove=True)
        limit, remaining = self._wait_limit(job, timeout)
        self._finish(
            job.future, job.generation, remaining,
            lambda: self._split_error(job, "light" if job.heavy_done.is_set() else "heavy",
                                      f"did not arrive within {limit} s"),
            lambda error: self._split_failure(job, "heavy" if error is None else job.failed_phase or "heavy", error))
        # Heavy and light entries are disjoint (the other is 0 there): exact.
        return job.heavy_rows + job.light_rows

    def compute_split(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                      threshold: float = 0.0) -> np.ndarray:
        """submit_split + collect_split: rows [T, K, H] float32 for every entry."""
        return self.collect_split(self.submit_split(layer, x, ids, weights, threshold))

    def split_tickets(self) -> list[int]:
        """Tickets of split jobs submitted and not yet collected (or dropped)."""
        with self._lock:
            return list(self._splits)

    def drop_split_jobs(self) -> int:
        """Forget every uncollected split job (e.g. after a graph failed
        before its collect_split ran); returns how many. Running jobs finish
        on their own; their tickets become unknown."""
        with self._lock:
            count = len(self._splits)
            self._splits.clear()
        return count

    def close(self) -> None:
        if self._ffi is not None:  # later FFI calls with its id fail in one line instead of reading freed memory
            self.stats  # noqa: B018 (folds the native counters in first)
            library, pool_id, _ = self._ffi
            self._ffi, self._native_calls = None, False
            library.release(pool_id)
        with self._lock:
            self._generation.shutdown(wait=True)

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------

    def _check_inputs(self, layer, x, ids, w, split: bool = False):
        """(x [T, H] float32, ids int64, w float32) if they fit the store, else HostPoolError "bad input".
        Plain job: ids [N] (flattened), w [T, N]; split job (`split`): ids and w [T, K]."""
        store = self.store
        fail = lambda why: _pool_error(layer, f"bad input: {why}")
        if not 0 <= layer < store.num_layers:
            raise fail(f"store has {store.num_layers} layers")
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.asarray(ids) if split else np.asarray(ids).reshape(-1)
        w = np.asarray(w, dtype=np.float32)
        T, H = len(x), store.hidden_size(layer)
        if split:
            shapes_fit = ids.ndim == 2 and ids.shape[0] == T and w.shape == ids.shape
        else:
            shapes_fit = w.shape == (T, ids.size)
        if x.ndim != 2 or x.shape[1] != H or not shapes_fit:
            raise fail(f"x {x.shape}, ids {ids.shape}, {'weights' if split else 'w'} {w.shape}, hidden {H}")
        if ids.size and not (-1 <= ids.min() and ids.max() < store.num_experts(layer)):
            raise fail(f"expert ids outside [-1, {store.num_experts(layer)})")
        return x, ids.astype(np.int64), w

    def _new_ticket(self) -> int:
        """A fresh ticket (caller holds the lock); makes room in the registry."""
        if len(self._splits) >= MAX_SPLIT_JOBS:
            for ticket in [t for t, job in self._splits.items() if job.future.done()]:
                del self._splits[ticket]
                if len(self._splits) < MAX_SPLIT_JOBS // 2:
                    break
        while True:  # tickets fit an int32 and skip any still registered
            ticket = next(self._tickets) % (2**31 - 1) + 1
            if ticket not in self._splits:
                return ticket

    def _split_job(self, ticket, remove: bool) -> SplitJob:
        ticket = int(ticket)
        with self._lock:
            job = self._splits.pop(ticket, None) if remove else self._splits.get(ticket)
        if job is None:
            raise HostPoolError(f"host pool: unknown split job ticket {ticket} "
                                "(collected already, dropped, or never submitted)")
        return job

    def _wait_limit(self, job: SplitJob, timeout: float | None) -> tuple[float, float]:
        """(limit for the message, seconds left to wait)."""
        if timeout is None:
            return self.timeout_s, max(0.0, job.deadline - time.perf_counter())
        return timeout, max(0.0, timeout)

    @staticmethod
    def _split_error(job: SplitJob, phase: str, what: str) -> HostPoolError:
        return _pool_error(job.layer, f"{phase} rows {what}", phase)

    @staticmethod
    def _split_failure(job: SplitJob, phase: str, error: BaseException | None) -> HostPoolError:
        """`phase` raised `error`, or (None) was dropped after an earlier timeout."""
        return _pool_error(job.layer, f"{phase} rows failed: {_failure(error)}", phase, cause=error)

    def _finish(self, future: Future, generation: _Generation, seconds: float, timed_out, failed):
        """The result of a layer job's driver `future`, waited on for `seconds` at most. Raises timed_out()
        if it is not done by then (and gives up on its generation), failed(None) if it was dropped after
        an earlier timeout, failed(error) if it raised `error`."""
        done, _ = wait([future], timeout=seconds)
        if not done:
            error = timed_out()  # worded before the generation goes: giving it up lets a hung phase end
            self._abandon(generation)
            raise error
        if future.cancelled():
            raise failed(None)
        error = future.exception()
        if error is not None:
            raise failed(error)
        return future.result()

    def _abandon(self, generation: _Generation) -> None:
        """Give up on a generation whose job timed out: later calls get fresh threads."""
        with self._lock:
            if self._generation is generation:
                self._generation = _Generation(self.threads)
        generation.shutdown(wait=False)

    def _run_layer(self, generation, layer, x, experts, weights, fault, started):
        """Driver thread: a plain layer job (see `submit`); returns y [T, H]."""
        T, H = x.shape
        N = len(experts)
        yT = np.zeros((H, T), np.float32)
        if N == 0:
            return yT.T.copy()
        kernel = self._native(T)
        if kernel is not None:  # entries: each expert's tokens of nonzero weight, all into the token's row of y
            entry_unit, entry_token = np.nonzero(weights.T)  # [J] each, grouped by expert (row-major [N, T])
            y = np.zeros((T, H), np.float32)
            self._record(self._run_native(kernel, generation, layer, x, experts, np.bincount(entry_unit, minlength=N),
                                          entry_token, entry_token, weights.T[entry_unit, entry_token], y, fault),
                         started)
            return y
        xT = np.ascontiguousarray(x.T)  # [H, T]
        # SwiGLU activations, unweighted: each expert's output is weighted.
        hT = np.empty((N, self.store.intermediate_size(layer), T), np.float32)
        w_rows = [weights[:, n][None, :] for n in range(N)]  # [1, T] per entry

        def add_weighted(n, r0, r1, y_n):  # entry n's output rows [r0:r1, T], weighted into the sum
            yT[r0:r1] += y_n * w_rows[n]

        results = self._run_thread_jobs(
            generation, layer, [(int(expert), xT, hT[n]) for n, expert in enumerate(experts)],
            fault, add_weighted)
        self._record(results, started)
        return np.ascontiguousarray(yT.T)

    def _native(self, tokens_per_expert: int):
        """The C expert kernel when it is built and the job is small enough for it, else None (the BLAS jobs)."""
        if tokens_per_expert > NATIVE_MAX_TOKENS:
            return None
        return native.experts_kernel()

    def _run_native(self, kernel, generation, layer, x, experts, counts, entry_token, entry_out, entry_weight,
                    out, fault) -> list:
        """One C call for a layer job or split phase: units = experts [U] with counts [U] entries each (in order),
        entry j reads x[entry_token[j]] and adds entry_weight[j] * its row into out[entry_out[j]] (out [R, H],
        float32, zeroed or partly summed). Returns [(seconds summed over the threads, bytes read)]."""
        _injected_fault(fault, generation)
        store, t0 = self.store, time.perf_counter()
        keep = counts > 0
        experts, counts = np.ascontiguousarray(experts[keep], np.int64), counts[keep]
        unit_start = np.zeros(len(experts) + 1, np.int64)
        np.cumsum(counts, out=unit_start[1:])
        entry_token = np.ascontiguousarray(entry_token, np.int64)
        entry_out = np.ascontiguousarray(entry_out, np.int64)
        entry_weight = np.ascontiguousarray(entry_weight, np.float32)
        H, I = store.hidden_size(layer), store.intermediate_size(layer)
        h = np.empty((len(entry_token), I), np.float32)  # [J, I] SwiGLU activations
        gate, up, down = store.gate[layer], store.up[layer], store.down[layer]
        scales = [getattr(store, name)[layer] for name in ("gate_scale", "up_scale", "down_scale")]
        ptr = lambda a: 0 if a is None else a.ctypes.data
        threads = kernel.job(  # phase 1 in gate/up's format, phase 2 in down's
            _format_code(store, "gate"), _format_code(store, "down"), int(self.round_bf16), H, I,
            store.group(layer, "gate"), store.group(layer, "down"), ptr(gate), ptr(up), ptr(down),
            *map(ptr, scales), ptr(x), len(experts), ptr(experts), ptr(unit_start), ptr(entry_token),
            ptr(entry_out), ptr(entry_weight), ptr(h), ptr(out), self.threads)
        seconds = time.perf_counter() - t0
        return [(seconds * threads, sum(store.nbytes(layer, int(e)) for e in experts))]

    def _record(self, results: list, started: float) -> None:
        """Add one finished layer job's thread jobs ((seconds, bytes) each) to the stats."""
        with self._lock:
            stats = self._stats
            stats.calls += 1
            stats.jobs += len(results)
            stats.job_seconds += sum(seconds for seconds, _ in results)
            stats.bytes_read += sum(nbytes for _, nbytes in results)
            stats.wall_seconds += time.perf_counter() - started

    def _run_split(self, job, x, ids, heavy, light, faults, started):
        """Driver thread: heavy phase, signal, light phase (see submit_split)."""
        results = []
        try:
            job.failed_phase = "heavy"
            results += self._run_split_phase(job, x, ids, heavy, job.heavy_rows, faults["heavy"])
        except BaseException as error:
            job.heavy_error = error
            raise
        finally:
            job.heavy_done.set()
        job.failed_phase = "light"
        results += self._run_split_phase(job, x, ids, light, job.light_rows, faults["light"])
        job.failed_phase = None
        self._record(results, started)

    def _run_split_phase(self, job, x, ids, mask, rows, fault) -> list:
        """rows[t, k] = unweighted expert output for every entry in mask [T, K]: the thread jobs of a plain
        layer job, over the phase's entries grouped by expert (one weight read per expert)."""
        layer, generation = job.layer, job.generation
        groups = _group_by_expert(ids, mask)  # [(expert, tokens, ks)]
        if not groups:
            _injected_fault(fault, generation)
            return []
        kernel = self._native(max(len(tokens) for _, tokens, _ in groups))
        if kernel is not None:  # one entry per (token, k), into its own row of rows [T * K, H], weight 1
            K = ids.shape[1]
            tokens = np.concatenate([tokens for _, tokens, _ in groups])
            outs = np.concatenate([tokens * K + ks for _, tokens, ks in groups])
            return self._run_native(
                kernel, generation, layer, x, np.array([expert for expert, _, _ in groups]),
                np.array([len(t) for _, t, _ in groups]), tokens, outs, np.ones(len(tokens), np.float32),
                rows.reshape(-1, rows.shape[2]), fault)
        I = self.store.intermediate_size(layer)
        # Per group: its tokens' activations [H, n] and SwiGLU activations [I, n].
        units = [(expert, np.ascontiguousarray(x[tokens].T), np.empty((I, len(tokens)), np.float32))
                 for expert, tokens, _ in groups]

        def put_rows(g, r0, r1, y_g):  # group g's output rows [r0:r1, n], one per entry
            _, tokens, ks = groups[g]
            rows[tokens, ks, r0:r1] = y_g.T

        return self._run_thread_jobs(generation, layer, units, fault, put_rows)

    def _run_thread_jobs(self, generation, layer, units, fault, put) -> list:
        """Driver thread: the two kinds of thread jobs of a layer job (or split phase) on the worker threads.

        units [(expert, xT [H, n], hT [I, n])]: gate/up jobs cut by (unit, rows of I) fill each hT from its
        xT (the first job acts out `fault`); then down jobs cut by rows of H hand each unit's output rows to
        `put` (see `_down_job`). Each job writes a disjoint slice. Returns the jobs' (seconds, bytes).
        """
        H, I = self.store.hidden_size(layer), self.store.intermediate_size(layer)
        target_jobs = self.threads * JOBS_PER_THREAD
        rows_up = _rows_per_job(len(units) * I, target_jobs, I)
        gate_up_jobs = [(unit, r0, min(r0 + rows_up, I)) for unit in units for r0 in range(0, I, rows_up)]
        rows_down = _rows_per_job(H, target_jobs, H)
        down_jobs = [(r0, min(r0 + rows_down, H)) for r0 in range(0, H, rows_down)]

        pool = generation.workers
        results = _run_all([
            pool.submit(self._gate_up_job, layer, xT, expert, hT, r0, r1, fault if i == 0 else None, generation)
            for i, ((expert, xT, hT), r0, r1) in enumerate(gate_up_jobs)], generation.release_hangs)
        hTs = [(expert, hT) for expert, _, hT in units]
        results += _run_all([
            pool.submit(self._down_job, layer, hTs, r0, r1, put) for r0, r1 in down_jobs],
            generation.release_hangs)
        return results

    def _round(self, a: np.ndarray) -> np.ndarray:
        """a rounded to bf16 (kept in float32) when the experts are bf16, as the device's products round."""
        return a.astype(BF16).astype(np.float32) if self.round_bf16 else a

    def _gate_up_job(self, layer, xT, expert, hT_n, r0, r1, fault, generation):
        """hT_n[r0:r1] = silu(g) * u, g = gate[r0:r1] @ xT, u = up[r0:r1] @ xT (bf16: g, u and the result rounded)."""
        t0 = time.perf_counter()
        _injected_fault(fault, generation)
        gate_rows = self.store.expert_rows("gate", layer, expert, r0, r1)  # [R, H] (int4 [R, H/2]), scales
        up_rows = self.store.expert_rows("up", layer, expert, r0, r1)      # [R, H] (int4 [R, H/2]), scales
        out = hT_n[r0:r1]                                                   # [R, T] view
        minima, int2 = self.store.minima_of("gate"), self.store.inputs_per_byte("gate") == 4
        int6 = self.store.int6("gate")
        for (c0, gate, gate_s), (_, up, up_s) in zip(row_chunks_f32(*gate_rows, minima=minima, int2=int2, int6=int6),
                                                     row_chunks_f32(*up_rows, minima=minima, int2=int2, int6=int6)):
            g = self._round(_scaled(gate @ xT, gate_s))  # [c, T]
            u = self._round(_scaled(up @ xT, up_s))      # [c, T]
            # silu(g) = g * sigmoid(g); tanh form does not overflow.
            out[c0:c0 + len(gate)] = self._round(g * (0.5 + 0.5 * np.tanh(0.5 * g)) * u)
        return time.perf_counter() - t0, _nbytes(gate_rows) + _nbytes(up_rows)

    def _down_job(self, layer, hTs, r0, r1, put):
        """put(n, c0, c1, down[e, c0:c1] @ hT) [c, n] for each (e, hT [I, n]) in hTs, over rows r0:r1 of H in
        chunks (bf16: each expert's output rounded, as the device rounds it before it weights and sums)."""
        t0 = time.perf_counter()
        nbytes = 0
        for n, (expert, hT) in enumerate(hTs):
            down_rows = self.store.expert_rows("down", layer, expert, r0, r1)  # [R, I] (int4 [R, I/2]), scales
            nbytes += _nbytes(down_rows)
            for c0, down, scale in row_chunks_f32(*down_rows, minima=self.store.minima_of("down"),
                                                  int2=self.store.inputs_per_byte("down") == 4,
                                                  int6=self.store.int6("down")):
                put(n, r0 + c0, r0 + c0 + len(down), self._round(_scaled(down @ hT, scale)))
        return time.perf_counter() - t0, nbytes


def _pool_error(layer: int, what: str, phase: str | None = None,
                cause: BaseException | None = None) -> HostPoolError:
    """HostPoolError "host pool: layer <layer> <what>", raised from `cause` if any."""
    error = HostPoolError(f"host pool: layer {layer} {what}", layer, phase)
    if cause is not None:
        error.__cause__ = cause
    return error


def _failure(error: BaseException | None) -> str:
    """How a job failed: `error`, or (None) dropped after an earlier timeout."""
    return "dropped after an earlier timeout" if error is None else f"{type(error).__name__}: {error}"


def _scaled(product: np.ndarray, row_scales: np.ndarray | None) -> np.ndarray:
    """A [c, T] product of a row chunk times its rows' scales [c, 1] (int8: before any rounding, as the device's
    kernels scale); other formats come back as they are (int4's blocks are dequantized already)."""
    return product if row_scales is None else product * row_scales


def _nbytes(expert_rows: tuple) -> int:
    """Bytes of a `HostExpertStore.expert_rows` slice: stored rows and their scales."""
    rows, scales = expert_rows
    return rows.nbytes + (0 if scales is None else scales.nbytes)


def _injected_fault(fault: str | None, generation: _Generation) -> None:
    """Act out an injected test fault (see HostPool.inject_fault), if any."""
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "hang":
        generation.release_hangs.wait()
        raise RuntimeError("injected hang released")


def _group_by_expert(ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """[(expert, token indices, k indices)] of the entries (t, k) where mask
    is true, one item per expert, in expert order."""
    tokens, ks = np.nonzero(mask)
    experts = ids[tokens, ks]
    return [(int(e), tokens[experts == e], ks[experts == e]) for e in np.unique(experts)]


def _rows_per_job(total_rows: int, target_jobs: int, limit: int) -> int:
    """Rows per job so that `total_rows` splits into about `target_jobs` jobs."""
    return max(1, min(limit, max(MIN_ROWS_PER_JOB, math.ceil(total_rows / target_jobs))))


ABANDON_POLL_S = 0.05  # how often a driver waiting on thread jobs looks whether its generation was abandoned


def _run_all(futures: list[Future], abandoned: threading.Event | None = None) -> list:
    """Results of all futures; on the first failure cancel the rest and raise it. `abandoned` (the generation's
    event, set when a timeout gives it up): raise instead of waiting on. Thread jobs cancelled by the executor's
    shutdown never wake a plain wait(), so without this the driver thread would wait forever, and the process
    would hang at exit joining it."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=ABANDON_POLL_S if abandoned is not None else None,
                             return_when=FIRST_EXCEPTION)
        if any(not f.cancelled() and f.exception() is not None for f in done):
            break
        if pending and abandoned is not None and abandoned.is_set():
            for future in pending:
                future.cancel()
            raise HostPoolError("host pool: job abandoned after a timeout")
    for future in pending:
        future.cancel()
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()
    return [future.result() for future in futures]
