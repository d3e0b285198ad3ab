"""Pool throughput for a Qwen3-30B-A3B-sized layer job, per store format and path, beside what the cores can read.

    python -m strata_jax.host_pool.measure [--threads N] [--experts 8] [--formats bf16,int8,int4] [--paths C,numpy]
                                [--read_mb 2048] [--variants "default PREFETCH_BYTES=0 ROWS_UP=64,ROWS_DOWN=32"]
                                [--x bf16|float32] [--hot-intermediate -1] [--timeline] [--gap-us 0]

One row per format, path and window size T: ms per layer job, ms per expert (the job's wall time / its experts),
GB/s = expert weight bytes read (q and scales for int8 / int4) / wall time, that GB/s as a share of the machine's
read bandwidth, and the time against bf16's on the same path and T. The read bandwidth is measured in the same run,
first: `--threads` threads summing one large array (`--read_mb`, far larger than the caches) in native code, best
of 5; the one-thread `np.copyto` rate is printed beside it. Path "C" is the expert kernel of host_pool/native.py
(native_experts.c, one call per job), "numpy" the BLAS thread jobs (STRATA_POOL_NATIVE=0). Experts are drawn from
a larger store (--store-experts) so weights come from DRAM, not cache. int8, int4, int4-q4k and int2-q2k weights are
random q and scales (or codes: the arithmetic's speed does not depend on their values). --variants: path "C" once per build of the kernel, each
with its -D macros (comma-separated; "default": none), side by side; "vs bf16" compares with bf16 of the same build;
"TEAM_OMP,BLOCKS_FIXED" is the former job (an OpenMP region per job, fixed blocks of 32 / 16 rows), "TEAM_OMP" the
job-sized blocks in it, "TEAM_SPIN_US=50" the kept team's idle spin shorter; "FORMER_LOOPS" the former int4, int4-q4k
and int8 loops (the same bits), "INT_FLOAT_PATH" int8 and int4 on the float path at every T (other bits; for Intel
cores, where vdpbf16ps is 4 uops), "INT4_SHIFTS" / "INT4_SHUFFLES" int4's high nibbles by shifts or byte shuffles. --timeline: the mean job's setup, its
threads' entry after the job was posted (the team's wake-up), phase 1 and phase 2, and the region's time against
bf16's (ms/job is the Python pool's: its hand-off to the driver thread adds ~0.1-0.3 ms a job on 16 Intel cores,
benchmarks/results/h100-2026-12-07c-route/call3, that the engine's native calls do not pay); --gap-us: a busy wait between
jobs (a decode step's device share of a layer), so the team's idle spin (or sleep) shows.
x: rounded to bf16 by default, as a bf16 model's device sends it (the C kernel takes bf16 dot products where x is
exactly bf16, else float32 ones; --x float32 measures the latter).

Then the compute ceiling of path C ("hot cache"): one thread, one expert (H x --hot-intermediate, default
the layer's I) computed 8 times per call (so its weights stay in the core's L2 / L3: 2.4 MB int4, 9.4 MB bf16), G weights/s per core = 3 * H * I * 8 / the call's time, best
of 5, and weights per cycle at the clock /proc/cpuinfo reports (nominal: a boosting core runs faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from . import native
from . import pool as pool_module
from . import store as store_module
from .pool import HostPool
from .store import BF16, HostExpertStore

FORMATS = ("float32", "bf16", "bf16-f32-once", "int8", "int4", "int4-q4k", "int2-q2k")
PATHS = ("C", "numpy")
INT4_GROUP = 64  # strata_jax/model/quant.py "int4"
X_DTYPE = BF16  # x's values (--x)


def copy_gbps(nbytes: int, repeats: int) -> float:
    """np.copyto of a large array; GB/s of bytes copied (DRAM traffic is ~2x)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def read_gbps(nbytes: int, threads: int, repeats: int = 5) -> float | None:
    """GB/s of `threads` threads reading one `nbytes` array (native_experts.c's read_words), best of `repeats`;
    None where the native kernel does not build."""
    kernel = native.experts_kernel() if native.mode() != "off" else None
    if kernel is None:
        return None
    words = np.ones(nbytes // 8, np.uint64)  # written once: every page is mapped before the timing
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up the threads
        t0 = time.perf_counter()
        total = kernel.read_words(words.ctypes.data, len(words), threads)
        best = min(best, time.perf_counter() - t0)
    assert total == len(words) // 8 * 8, total
    return words.nbytes / best / 1e9


def team_sched() -> tuple[int, int] | None:
    """(run_delay ns, context switches) summed over this process's pool workers (threads named strata-experts, the
    kept teams of native_experts.c), from /proc/self/task/<tid>/schedstat and status; None without /proc.
    run_delay: the time a worker was runnable but waited for a core; a switch: it slept or was preempted."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    delay = switches = 0  # workers started later (a team's first job) count from 0
    for task in tasks.glob("*"):
        try:
            if (task / "comm").read_text().strip() != "strata-experts":
                continue
            delay += int((task / "schedstat").read_text().split()[1])
            status = (task / "status").read_text()
            switches += sum(int(line.split()[1]) for line in status.splitlines()
                            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
        except (OSError, ValueError, IndexError):  # a thread gone, or no schedstat
            continue
    return delay, switches


def pool_row(pool: HostPool, rng, T: int, n_experts: int, H: int, repeats: int, rounds: int = 3, gap_us: float = 0):
    """Best round of `repeats` layer jobs: (ms per job, GB/s, thread jobs per layer job); `gap_us` of busy wait
    before each job (outside its time), as a decode step's device share of a layer between two pool jobs."""
    store_experts = pool.store.num_experts(0)
    x = rng.standard_normal((T, H), dtype=np.float32).astype(X_DTYPE).astype(np.float32)  # [T, H]
    pool.compute(0, x, np.arange(n_experts), np.ones((T, n_experts), np.float32))  # warm up
    best = None
    for _ in range(rounds):  # best of rounds: this shared VM is noisy
        pool.stats.reset()
        for _ in range(repeats):
            ids = rng.choice(store_experts, n_experts, replace=False)   # [N]
            w = rng.random((T, n_experts), dtype=np.float32)             # [T, N]
            if gap_us:
                until = time.perf_counter() + gap_us * 1e-6
                while time.perf_counter() < until:
                    pass
            pool.compute(0, x, ids, w)
        stats = dataclasses.replace(pool.stats)
        if best is None or stats.wall_seconds < best.wall_seconds:
            best = stats
    return (best.wall_seconds / best.calls * 1e3, best.bytes_read / best.wall_seconds / 1e9,
            best.jobs // best.calls)


def hot_rate(kernel, store: HostExpertStore, T: int, x_dtype, rng, units: int = 8, seconds: float = 0.2) -> float:
    """G weights/s of one thread computing `units` times the store's expert 0 (weights hot after the first) for T
    tokens in one kernel call (pool.py's _run_native arguments), best of 5 timings of >= `seconds` each."""
    H, I = store.hidden_size(0), store.intermediate_size(0)
    x = rng.standard_normal((T, H), dtype=np.float32).astype(x_dtype).astype(np.float32)  # [T, H]
    experts = np.zeros(units, np.int64)
    unit_start = np.arange(units + 1, dtype=np.int64) * T
    entry_token = np.tile(np.arange(T, dtype=np.int64), units)
    entry_weight = np.full(units * T, 1.0 / units, np.float32)
    h = np.empty((units * T, I), np.float32)
    out = np.zeros((T, H), np.float32)
    scales = [getattr(store, name)[0] for name in ("gate_scale", "up_scale", "down_scale")]
    ptr = lambda a: 0 if a is None else a.ctypes.data
    args = (pool_module._format_code(store, "gate"), pool_module._format_code(store, "down"),
            int(store.compute_dtype == BF16), H, I, store.group(0, "gate"), store.group(0, "down"),
            *map(ptr, (store.gate[0], store.up[0], store.down[0], *scales, x)), units, *map(ptr, (
                experts, unit_start, entry_token, entry_token, entry_weight, h, out)), 1)
    kernel.job(*args)  # warm up: weights into cache
    best = float("inf")
    for _ in range(5):
        calls, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or calls == 0:
            kernel.job(*args)
            calls += 1
        best = min(best, elapsed / calls)
    return 3 * H * I * units / best / 1e9


def cpu_ghz() -> float | None:
    """The clock /proc/cpuinfo reports for the first core (GHz), or None."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1e3
    except (OSError, ValueError):
        pass
    return None


def make_store(fmt: str, rng, E: int, H: int, I: int) -> tuple[str, HostExpertStore]:
    """(row label, a one-layer store of E experts in format `fmt`)."""
    shapes = ((E, I, H), (E, I, H), (E, H, I))  # gate, up, down: [E, out, in]
    if fmt == "int8":  # q and one scale per output row
        q = [rng.integers(-127, 128, shape, dtype=np.int8) for shape in shapes]
        scales = [(rng.random(shape[:2], dtype=np.float32) * 1e-3).astype(BF16) for shape in shapes]
        return "int8 (row scales)", HostExpertStore([(*q, *scales)])
    if fmt == "int4":  # packed two a byte, one bf16 scale per (output row, group)
        q = [rng.integers(0, 256, (e, o, i // 2), dtype=np.uint8) for e, o, i in shapes]
        scales = [(rng.random((e, o, i // INT4_GROUP), dtype=np.float32) * 1e-2).astype(BF16)
                  for e, o, i in shapes]
        return f"int4 (g{INT4_GROUP})", HostExpertStore([(*q, *scales)])
    if fmt in ("int4-q4k", "int2-q2k"):  # GGUF Q4_K's / Q2_K's blocks: packed q, codes in the pool layout
        return fmt, HostExpertStore([(*(rng.integers(0, 256, (e, o, i // (2 if fmt == "int4-q4k" else 4)),
                                                     dtype=np.uint8) for e, o, i in shapes),
                                      *(block_codes(fmt, rng, e, o, i) for e, o, i in shapes))])
    weights = [0.02 * rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    if fmt == "float32":
        return "float32", HostExpertStore([tuple(weights)])
    weights = [a.astype(BF16) for a in weights]
    if fmt == "bf16":
        return "bf16", HostExpertStore([tuple(weights)])
    return "bf16 -> f32 once", HostExpertStore([tuple(weights)], bf16_as_f32=True)


def block_codes(fmt: str, rng, E: int, O: int, I: int) -> np.ndarray:
    """Random int4-q4k (uint16) or int2-q2k (uint8) codes [E, O, 5G/4] as strata_jax/model/quant.py lays them out per
    row: G group codes (q4k: sc | m << 6, groups of 32; q2k: sc | m << 4, groups of 16), then each super-block's fp16
    d, then its dmin (q2k: two bytes each)."""
    q4k = fmt == "int4-q4k"
    G, B = I // (32 if q4k else 16), I // 256
    group_codes = rng.integers(0, 4096 if q4k else 256, (E, O, G)).astype(np.uint16 if q4k else np.uint8)
    halves = (rng.random((E, O, 2 * B), dtype=np.float32) * 1e-3).astype(np.float16)  # [E, O, 2B]: d, then dmin
    return np.concatenate([group_codes, halves.view(np.uint16 if q4k else np.uint8)], axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=pool_module.usable_cores())
    parser.add_argument("--blas-threads", type=int, default=1, help="-1: leave OpenBLAS default")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer job")
    parser.add_argument("--store-experts", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--windows", default="1,4", help="comma-separated window sizes T")
    parser.add_argument("--jobs-per-thread", type=int, default=pool_module.JOBS_PER_THREAD)
    parser.add_argument("--chunk-kb", type=int, default=store_module.CHUNK_FLOATS * 4 // 1024,
                        help="float32 scratch per conversion chunk (numpy path: bf16, int8, int4)")
    parser.add_argument("--formats", default="bf16,int8,int4", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of C (the expert kernel), numpy")
    parser.add_argument("--read_mb", type=int, default=2048, help="array size of the read-bandwidth probe")
    parser.add_argument("--x", default="bf16", choices=("bf16", "float32"),
                        help="x's values: rounded to bf16 (as a bf16 model's device sends them) or float32")
    parser.add_argument("--hot-intermediate", type=int, default=-1,
                        help="I of the hot-cache expert (H is --hidden); -1: --intermediate; 0: no hot-cache rows")
    parser.add_argument("--timeline", action="store_true",
                        help="path C: under each row, the mean job's timeline (setup, the team's wake-up, phase 1, "
                             "phase 2) in microseconds")
    parser.add_argument("--gap-us", type=float, default=0,
                        help="busy wait before each job (not timed): the device's share of a decode layer between "
                             "two pool jobs (the kept team's workers spin 200 us, then sleep)")
    parser.add_argument("--variants", default="default",
                        help='space-separated builds of path C: "default" or comma-separated -D macros of '
                             'native_experts.c, e.g. "default PREFETCH_BYTES=0 ROWS_UP=64,ROWS_DOWN=32"')
    args = parser.parse_args()
    pool_module.JOBS_PER_THREAD = args.jobs_per_thread
    global X_DTYPE
    X_DTYPE = BF16 if args.x == "bf16" else np.float32
    store_module.CHUNK_FLOATS = args.chunk_kb * 1024 // 4

    formats, paths = args.formats.split(","), args.paths.split(",")
    if unknown := set(formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}; known: {', '.join(FORMATS)}")
    if unknown := set(paths) - set(PATHS):
        parser.error(f"unknown paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    windows = [int(t) for t in args.windows.split(",")]
    E, H, I = args.store_experts, args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    blas_threads = None if args.blas_threads < 0 else args.blas_threads

    print(f"threads {args.threads}, BLAS threads {blas_threads or 'default'}, "
          f"{args.experts} experts of H={H} I={I}, jobs/thread {args.jobs_per_thread}, "
          f"conversion chunk {args.chunk_kb} KB" + (f", {args.gap_us:g} us between jobs" if args.gap_us else ""),
          flush=True)
    switch = os.environ.get(native.ENV, "")
    print(native.describe_experts())
    print(native.describe())
    read = read_gbps(args.read_mb << 20, args.threads)
    copy = copy_gbps(512 << 20, 5)
    read_text = f"{read:.1f} GB/s" if read else "n/a (no native build)"
    print(f"read bandwidth: {read_text} ({args.threads} threads reading {args.read_mb} MB, best of 5); "
          f"np.copyto 512 MB, 1 thread: {copy:.1f} GB/s", flush=True)
    kernels = {"C": None}  # path -> the variant's kernel (None: native.experts_kernel's default build)
    if "C" in paths and args.variants.split() != ["default"]:
        kernels = {}
        for variant in args.variants.split():
            defines = () if variant == "default" else tuple(variant.split(","))
            kernel, line = native.experts_variant(defines) if defines else (native.experts_kernel(), "default")
            print(f"variant {variant}: {line}")
            if kernel is None:
                parser.error(f"variant {variant} did not build")
            kernels["C" if variant == "default" else f"C {variant}"] = kernel
        paths = [p for p in paths if p != "C"] + list(kernels)
    width = max(5, *map(len, paths))
    print(f"{'store format':20s} {'path':{width}s} {'store MB':>9s} {'T':>2s} {'ms/job':>8s} {'ms/expert':>9s} "
          f"{'GB/s':>7s} {'of read':>8s} {'vs bf16':>8s} {'jobs':>5s}")
    bf16_ms, bf16_region = {}, {}
    default_kernel = native.experts_kernel
    for fmt in formats:
        name, store = make_store(fmt, rng, E, H, I)  # one at a time: only its weights in memory
        host_mb = store.nbytes(0, 0) * E / 1e6
        for path in paths:
            os.environ[native.ENV] = "0" if path == "numpy" else switch  # read at each job
            if path == "C" and native.experts_kernel() is None:
                print(f"{name:20s} {path:{width}s} skipped: {native.describe_experts()}")
                continue
            if kernels.get(path) is not None:  # a variant: the pool's jobs call it instead of the default build
                native.experts_kernel = lambda kernel=kernels[path]: kernel
            pool = HostPool(store, threads=args.threads, blas_threads=blas_threads)
            timeline = (kernels.get(path) or native.experts_kernel()) if args.timeline and path != "numpy" else None
            for T in windows:
                if timeline is not None:
                    timeline.timeline(True)
                sched_before = team_sched() if timeline is not None else None
                ms, gbps, jobs = pool_row(pool, rng, T, args.experts, H, args.repeats, gap_us=args.gap_us)
                sched_after = team_sched() if sched_before is not None else None
                if fmt == "bf16":
                    bf16_ms[path, T] = ms
                share = f"{gbps / read:7.1%}" if read else "n/a"
                ratio = f"{ms / bf16_ms[path, T]:7.2f}x" if (path, T) in bf16_ms else "-"
                print(f"{name:20s} {path:{width}s} {host_mb:9.0f} {T:2d} {ms:8.2f} {ms / args.experts:9.3f} "
                      f"{gbps:7.2f} {share:>8s} {ratio:>8s} {jobs:5d}", flush=True)
                if timeline is not None:
                    t = timeline.timeline(False)
                    if fmt == "bf16":
                        bf16_region[path, T] = t["job"]
                    # the kernel's own time against bf16's: what the engine's native calls (no Python hand-off) see
                    native_ratio = (f", region vs bf16 {t['job'] / bf16_region[path, T]:.2f}x"
                                    if (path, T) in bf16_region and fmt != "bf16" else "")
                    cut = [timeline.blocks(n, args.threads, phase) for phase, n in enumerate((args.experts * I, H))]
                    text = ", ".join(f"phase {k + 1} {len(c)} blocks of {min(c)}" + (f"-{max(c)}" if max(c) > min(c)
                                     else "") + " rows" for k, c in enumerate(cut))
                    print(f"{'':20s} {'':{width}s} {text}")
                    print(f"{'':20s} {'':{width}s} timeline, mean of {t['jobs']} jobs (us): setup {t['setup']:.1f}, "
                          f"{t['threads']:.1f} threads in {t['first_in']:.1f} .. {t['last_in']:.1f}, "
                          f"phase 1 {t['phase1']:.1f}, "
                          f"phase 2 {t['job'] - t['phase1']:.1f}, region {t['job']:.1f}{native_ratio}", flush=True)
                    if sched_after is not None and t["jobs"]:
                        # a worker late into a job: waiting for a core (run delay) or waking (switches: it slept)
                        per = max(args.threads - 1, 1) * t["jobs"]  # worker-jobs
                        delay_us = (sched_after[0] - sched_before[0]) / 1e3 / per
                        switches = (sched_after[1] - sched_before[1]) / per
                        print(f"{'':20s} {'':{width}s} workers: run delay {delay_us:.1f} us a job a worker (runnable, "
                              f"no core), {switches:.2f} context switches a job a worker (each a sleep or a "
                              "preemption)", flush=True)
            pool.close()
            native.experts_kernel = default_kernel
        del store
    os.environ[native.ENV] = switch
    if "C" in args.paths.split(",") and args.hot_intermediate != 0:
        hot_rows(args, kernels, formats, windows, rng)


def hot_rows(args, kernels: dict, formats: list, windows: list, rng) -> None:
    """The hot-cache compute ceiling of each path-C build and format (see the module's doc)."""
    H, ghz = args.hidden, cpu_ghz()
    I = args.intermediate if args.hot_intermediate < 0 else args.hot_intermediate
    print(f"hot cache: 1 thread, one expert of H={H} I={I} computed 8 times per call; G weights/s per core "
          f"(weights/cycle at {ghz or 0:.2f} GHz nominal)")
    print(f"{'store format':20s} {'path':20s} {'KB':>6s} " + " ".join(f"{'T=' + str(T):>16s}" for T in windows))
    for fmt in formats:
        name, store = make_store(fmt, rng, 1, H, I)
        for path, kernel in kernels.items():
            kernel = kernel or native.experts_kernel()
            if kernel is None:
                continue
            rates = [hot_rate(kernel, store, T, X_DTYPE, rng) for T in windows]
            cells = " ".join(f"{r:7.2f} ({r / ghz:5.2f}/c)" if ghz else f"{r:16.2f}" for r in rates)
            print(f"{name:20s} {path:20s} {store.nbytes(0, 0) / 1e3:6.0f} {cells}", flush=True)


if __name__ == "__main__":
    main()
