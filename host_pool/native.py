"""The int4 chunk dequantization in C (native_dequant.c), compiled on first use and loaded with ctypes.

numpy needs five passes over a chunk to dequantize int4 (store.py `_dequantize_int4`), which made an int4 expert
3-4x slower on the pool than a bf16 one although it reads a quarter of the bytes; the C loop is one pass (51 us per
1 MB of float32 out on a 2-core EPYC, numpy's five 280). bf16 and int8 chunks stay numpy casts: a C loop measured
no faster (57 us bf16, 47 us int8 either way).

STRATA_POOL_NATIVE: unset or empty: the C kernel when a C compiler builds it, else numpy; 1: the C kernel, an error
if it cannot be built; 0: numpy. Read at each use, so tests can switch it.

The library is built once per source, compiler, flags and CPU (-march=native) into ~/.cache/strata_jax/native
(strata_jax's default cache folder), else a per-user temp folder; never into the repo. A build writes a temporary
name and renames it, so processes building at once do not see each other's half-written files.
ctypes.CDLL functions release the GIL while they run, so pool threads dequantize in parallel.

The expert kernel (native_experts.c, `experts_kernel`): a whole layer job (or a split job's phase) in one call,
threads over experts and output rows inside it (a kept thread team in -fopenmp builds on Linux, else an OpenMP
region per job), the weights widened in registers, for float32, bf16, int8 and int4 experts; the pool's numpy / BLAS
jobs remain for windows of many tokens and where it does not build. It is
built the same way, under the same switch (STRATA_POOL_NATIVE=0: numpy for both), with -fopenmp where the compiler
takes it (without: one thread, which its line says).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

ENV = "STRATA_POOL_NATIVE"
SOURCE = Path(__file__).with_name("native_dequant.c")
FLAGS = (("-O3", "-march=native", "-shared", "-fPIC"), ("-O3", "-shared", "-fPIC"))  # the second if -march fails
EXPERTS_SOURCE = Path(__file__).with_name("native_experts.c")
# OpenMP and -march=native where the compiler takes them; each later entry drops what the one before may lack.
EXPERTS_FLAGS = (("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"), ("-O3", "-fopenmp", "-shared", "-fPIC"),
                 ("-O3", "-march=native", "-shared", "-fPIC"), ("-O3", "-shared", "-fPIC"))
LIBS = ("-lm",)
# Build settings of native_experts.c for the engine's pool (its -D knobs: ROWS_DOWN=8, TEAM_SPIN_US=1000, ...), to
# time a setting in the generate loop where measure.py's --variants time it alone; unset: the source's defaults.
DEFINES_ENV = "STRATA_POOL_DEFINES"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: tuple | None = None  # (the kernel or None, a line saying which path and why), once built or failed
_experts_built: tuple | None = None  # the same for the expert kernel: (ExpertsKernel or None, its line)


def mode() -> str:
    """'auto', 'on' or 'off' from STRATA_POOL_NATIVE; ValueError (one line) for any other value."""
    text = os.environ.get(ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{ENV}={text!r}: not 0 (numpy int4 dequantization) or 1 (the C kernel); unset it for "
                         "the C kernel where a compiler builds it")
    return {"": "auto", "0": "off", "1": "on"}[text]


def build_defines() -> tuple[str, ...]:
    """The -D settings STRATA_POOL_DEFINES names ("ROWS_DOWN=8,TEAM_SPIN_US=1000": upper-case names, integer values)
    for the expert kernel and the FFI library; ValueError (one line) for anything else."""
    text = os.environ.get(DEFINES_ENV, "").strip()
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in items if not re.fullmatch(r"[A-Z][A-Z0-9_]*(=-?[0-9]+)?", t)]
    if bad:
        raise ValueError(f"{DEFINES_ENV}={text!r}: {bad[0]!r} is not NAME or NAME=INTEGER (the -D settings of "
                         "host_pool/native_experts.c, comma-separated, e.g. ROWS_DOWN=8)")
    return items


def _with_defines(flag_sets: tuple) -> tuple:
    """Each flag set with STRATA_POOL_DEFINES' -D settings."""
    extra = tuple(f"-D{d}" for d in build_defines())
    return tuple((*flags, *extra) for flags in flag_sets)


def int4_kernel():
    """The C function int4_rows_f32, or None when store.py's numpy path is to run (STRATA_POOL_NATIVE=0, or no
    build in auto mode). Builds it on the first call."""
    if _built is not None and not os.environ.get(ENV):  # the usual case, once per chunked weight: kept short
        return _built[0]
    return _switched(_build)


def _switched(build):
    """The switch applied to a library's build (`build()` -> (library or None, its line)): None when off, the
    library (or None) in auto mode, the library or a RuntimeError saying why not when on."""
    wanted = mode()
    if wanted == "off":
        return None
    kernel, line = build()
    if kernel is None and wanted == "on":
        raise RuntimeError(f"{ENV}=1 but {line}")
    return kernel


def describe() -> str:
    """One line: which int4 dequantization the pool uses now."""
    if mode() == "off":
        return f"int4 dequantization: numpy ({ENV}=0)"
    return _build()[1]


def int4_filler(kernel, packed: np.ndarray, scales: np.ndarray, out: np.ndarray):
    """fill(r0, c): out[:c] = rows r0:r0+c of packed [R, C/2] uint8 dequantized with scales [R, G] float32, through
    `kernel` (from int4_kernel); the caller keeps r0 + c <= R and c <= len(out). The pointers are taken once here.
    """
    if not (packed.flags.c_contiguous and scales.flags.c_contiguous and out.flags.c_contiguous
            and scales.dtype == np.float32 and out.dtype == np.float32 and out.shape[1] == 2 * packed.shape[1]):
        raise ValueError(f"int4 chunks want C-contiguous packed rows {packed.shape}, float32 scales {scales.dtype} "
                         f"{scales.shape} and float32 scratch {out.dtype} {out.shape} [rows, {2 * packed.shape[1]}]")
    in_dim, group = out.shape[1], out.shape[1] // scales.shape[1]
    p, s, o = packed.ctypes.data, scales.ctypes.data, out.ctypes.data
    p_row, s_row = packed.strides[0], scales.strides[0]

    def fill(r0: int, c: int, _keep=(packed, scales, out)) -> None:  # _keep: the arrays outlive their pointers
        kernel(p + r0 * p_row, s + r0 * s_row, o, c, in_dim, group)

    return fill


def _build() -> tuple:
    global _built
    if _built is None:
        with _lock:  # pool threads may ask at once: one build
            if _built is None:
                _built = _compile_and_load(SOURCE, FLAGS, "int4 dequantization", _load)
                log.info("host pool: %s", _built[1])
    return _built


class ExpertsKernel:
    """native_experts.c loaded: `job` (experts_job), `read_words`, `build` (its ISA and threads, a few words)."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))  # CDLL: the GIL is released during each call
        self.job = library.experts_job
        # fmt (phase 1: gate/up), fmt_down (phase 2), round, H, I, group (gate/up's), group_down, ...
        self.job.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 7 + [ctypes.c_long]
                             + [ctypes.c_void_p] * 7 + [ctypes.c_int])
        self.job.restype = ctypes.c_int
        self.read_words = library.read_words
        self.read_words.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        self.read_words.restype = ctypes.c_uint64
        library.experts_build.restype = ctypes.c_char_p
        self.build = library.experts_build().decode()
        self._blocks = library.experts_blocks
        self._blocks.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
        self._blocks.restype = ctypes.c_long
        self._timeline = library.experts_timeline
        self._timeline.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._timeline.restype = None

    def blocks(self, rows: int, threads: int, phase: int) -> list[int]:
        """The rows of each block a job of `threads` threads cuts `rows` into in phase 1 (rows = experts * I) or 2
        (rows = H): job-sized (a multiple of the threads of blocks), or the fixed ones of a -DBLOCKS_FIXED build."""
        count = self._blocks(rows, threads, phase, None, 0)
        starts = np.zeros(count + 1, np.int64)
        self._blocks(rows, threads, phase, starts.ctypes.data, count + 1)
        return np.diff(starts).tolist()

    def timeline(self, on: bool) -> dict[str, float]:
        """The jobs' timeline since the last call (then zeroed; `on`: whether later jobs keep one), as the mean
        microseconds a job: setup (before the job is posted to the threads), first_in / last_in (the first and the
        last thread's first phase-1 block, after the posting), phase1 (to phase 1's end), job (to the job's end);
        jobs; threads (the mean count of threads that took phase-1 blocks)."""
        sums = (ctypes.c_longlong * 7)()
        self._timeline(int(on), sums)
        jobs = sums[5]
        names = ("setup", "first_in", "last_in", "phase1", "job")
        return dict({k: sums[i] / jobs / 1e3 if jobs else 0.0 for i, k in enumerate(names)}, jobs=jobs,
                    threads=sums[6] / jobs if jobs else 0.0)


def experts_kernel() -> ExpertsKernel | None:
    """The expert kernel, or None when the pool's numpy jobs are to run (STRATA_POOL_NATIVE=0, or no build in auto
    mode). Builds it on the first call."""
    if _experts_built is not None and not os.environ.get(ENV):
        return _experts_built[0]
    return _switched(_build_experts)


def describe_experts(short: bool = False) -> str:
    """One line: which expert jobs the pool runs now (short: the C build without its file and flags)."""
    if mode() == "off":
        return f"expert jobs: numpy ({ENV}=0)"
    kernel, line = _build_experts()
    if short and kernel is not None:  # the build settings stay: a timing's start-up line says what it timed
        defines = [f[2:].rstrip(")") for f in line.split() if f.startswith("-D")]
        return line.split(" (", 1)[0] + (f", {DEFINES_ENV}={','.join(defines)}" if defines else "")
    return line


def _build_experts() -> tuple:
    global _experts_built
    if _experts_built is None:
        with _lock:
            if _experts_built is None:
                built, line = _compile_and_load(EXPERTS_SOURCE, _with_defines(EXPERTS_FLAGS), "expert jobs",
                                                ExpertsKernel)
                if built is not None:
                    line = f"expert jobs: C, {built.build} ({line.split('(', 1)[1]}"
                _experts_built = built, line
                log.info("host pool: %s", line)
    return _experts_built


def experts_variant(defines: tuple) -> tuple:
    """(ExpertsKernel or None, its line): native_experts.c built with the first of EXPERTS_FLAGS and -D`define` for
    each of `defines` ("ROWS_UP=64", ...), cached as the default build is; host_pool/measure.py's --variants."""
    flags = (*EXPERTS_FLAGS[0], *(f"-D{define}" for define in defines))
    return _compile_and_load(EXPERTS_SOURCE, (flags,), "expert jobs", ExpertsKernel)


FFI_SOURCE = Path(__file__).with_name("native_ffi.cc")
FFI_TARGET = "strata_pool_layer"
# The offload layer calls (native_ffi.cc): fetch and pool work enqueued on the graph's stream, no read-back.
OFFLOAD_BEGIN = "strata_offload_begin"
OFFLOAD_COLLECT = "strata_offload_collect"
# The same calls in their command-buffer compatible form (constant flag values per layer, no host work per execution:
# XLA records them into its CUDA graphs); bridge.py uses them unless CAPTURE_ENV is 0 or the CUDA driver lacks stream
# memory operations (FfiLibrary.capture_supported).
OFFLOAD_BEGIN_CAPTURE = "strata_offload_begin_v2"
OFFLOAD_COLLECT_CAPTURE = "strata_offload_collect_v2"
# The prefetch (engine option prefetch=N): the next layer's likely experts into its slots, on a side stream on CUDA.
OFFLOAD_PREFETCH = "strata_offload_prefetch"
CAPTURE_ENV = "STRATA_OFFLOAD_CAPTURE"
# pool_counters: jobs, experts, bytes, nanoseconds; fetch calls, experts fetched, bytes fetched; the capture path's
# worker: jobs, nanoseconds from POSTED seen to DONE, gaps (DONE to the next POSTED seen) and their nanoseconds
COUNTERS = 11
_ffi_built: tuple | None = None  # (FfiLibrary or None, its line)


class FfiLibrary:
    """native_ffi.cc + native_experts.c loaded: the FFI handlers (registered with JAX as FFI_TARGET, "cpu" and, where
    jaxlib has it, "CUDA") and the pool registry (`register`, `release`, `counters`)."""

    def __init__(self, path: Path):
        import jax
        library = ctypes.CDLL(str(path))
        self.register = library.pool_register
        self.register.argtypes = [ctypes.c_int] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 12
        self.register.restype = ctypes.c_int64
        self.release = library.pool_release
        self.release.argtypes = [ctypes.c_int64]
        self.release.restype = None
        self.counters = library.pool_counters
        self.counters.argtypes = [ctypes.c_int64, ctypes.c_void_p]
        self.counters.restype = None
        self.worker_ring = library.pool_worker_ring
        self.worker_ring.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        self.worker_ring.restype = ctypes.c_int64
        self.register_fetch = library.pool_register_fetch
        self.register_fetch.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
        self.register_fetch.restype = None
        self.device_fetch = library.pool_device_fetch
        self.device_fetch.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
        self.device_fetch.restype = ctypes.c_int
        self.signal_mode = library.pool_signal_mode
        self.signal_mode.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
        self.signal_mode.restype = ctypes.c_int
        self._capture_supported = library.offload_capture_supported
        self._capture_supported.argtypes = []
        self._capture_supported.restype = ctypes.c_int
        self.platforms = []
        for platform_name, suffix in (("cpu", "_cpu"), ("CUDA", "_cuda")):
            try:
                # the _v2 CUDA handlers declare themselves command-buffer compatible (XLA reads the trait from them)
                for target in (FFI_TARGET, OFFLOAD_BEGIN, OFFLOAD_COLLECT, OFFLOAD_BEGIN_CAPTURE,
                               OFFLOAD_COLLECT_CAPTURE, OFFLOAD_PREFETCH):
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target + suffix)),
                                                platform=platform_name)
                self.platforms.append(platform_name)
            except Exception:  # noqa: BLE001 (a jaxlib without that platform)
                pass
        if "cpu" not in self.platforms:
            raise OSError("jax.ffi.register_ffi_target refused the CPU handler")

    def capture_supported(self) -> bool:
        """Whether the offload calls may take the capture path: the CUDA driver has stream memory operations and
        STRATA_POOL_MEMOPS is not 0 (or there is no CUDA driver: only the CPU handlers run). Read at each call."""
        return bool(self._capture_supported())


def offload_capture() -> bool:
    """STRATA_OFFLOAD_CAPTURE: unset, empty or 1: the capture path where the library supports it; 0: the sequence
    path. ValueError (one line) for any other value. Read at each use (at trace time)."""
    text = os.environ.get(CAPTURE_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{CAPTURE_ENV}={text!r}: not 0 (the sequence-number offload calls) or 1 (the "
                         "command-buffer compatible ones, the default)")
    if text == "0":
        return False
    library = ffi_library()
    return library is not None and library.capture_supported()


def ffi_library() -> FfiLibrary | None:
    """The FFI library, or None where it does not build (or STRATA_POOL_NATIVE=0): the pool is then reached by
    io_callback. Built on the first call, with the C expert kernel compiled into it."""
    global _ffi_built
    if mode() == "off":
        return None
    if _ffi_built is None:
        with _lock:
            if _ffi_built is None:
                _ffi_built = _build_ffi()
                log.info("host pool: %s", _ffi_built[1])
    return _ffi_built[0]


def describe_ffi() -> str:
    if mode() == "off":
        return f"pool calls: io_callback ({ENV}=0)"
    ffi_library()
    return _ffi_built[1]


def _build_ffi() -> tuple:
    compiler, cxx = _find_compiler(), _find_cxx()
    if compiler is None or cxx is None:
        return None, "pool calls: io_callback (no C and C++ compiler found for the FFI handler)"
    try:
        import jax
        include = jax.ffi.include_dir()
        key_parts = [EXPERTS_SOURCE.read_bytes(), FFI_SOURCE.read_bytes(), compiler.encode(), cxx.encode(),
                     include.encode(), jax.__version__.encode(), _cpu_id().encode()]
        folder = _cache_folder()
    except (OSError, AttributeError) as e:
        return None, f"pool calls: io_callback (FFI handler not built: {e})"
    error = ""
    for flags in _with_defines(EXPERTS_FLAGS):
        c_flags = [f for f in flags if f != "-shared"]
        key = hashlib.sha256(b"\0".join(key_parts + [" ".join(flags).encode()])).hexdigest()[:16]
        path = folder / f"native_ffi-{key}.so"
        try:
            if not path.exists():
                _link_ffi(compiler, cxx, c_flags, include, path)
            library = FfiLibrary(path)
            defines = " ".join(f for f in flags if f.startswith("-D"))
            return library, (f"pool calls: XLA FFI ({path.name}; {', '.join(library.platforms)}"
                             + (f"; {defines}" if defines else "") + ")")
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return None, f"pool calls: io_callback (FFI handler not built with {cxx}: {error})"


def _link_ffi(compiler: str, cxx: str, c_flags: list, include: str, path: Path) -> None:
    """native_experts.c to an object with `c_flags`, then native_ffi.cc and it into the library `path`."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".native_ffi-") as tmp:
        obj = Path(tmp) / "native_experts.o"
        done = subprocess.run([compiler, *c_flags, "-c", "-o", str(obj), str(EXPERTS_SOURCE)], capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise OSError(f"{compiler} {' '.join(c_flags)} failed: {done.stderr.strip() or done.returncode}")
        out = Path(tmp) / "native_ffi.so"
        openmp = ["-fopenmp"] if "-fopenmp" in c_flags else []
        done = subprocess.run([cxx, "-std=c++17", "-O2", "-fPIC", "-shared", *openmp, f"-I{include}", "-o", str(out),
                               str(FFI_SOURCE), str(obj), "-ldl", *LIBS], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise OSError(f"{cxx} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        os.replace(out, path)


def _compile_and_load(source_path: Path, flag_sets: tuple, what: str, loader) -> tuple:
    """(loader(the built library) or None, a line "<what>: C (<file>, <compiler> <flags>)" or "<what>: numpy
    (why)"): the first flag set that builds and loads."""
    compiler = _find_compiler()
    if compiler is None:
        return None, f"{what}: numpy (no C compiler found: cc, gcc or sysconfig's CC)"
    try:
        source = source_path.read_bytes()
        folder = _cache_folder()
    except OSError as e:
        return None, f"{what}: numpy (native kernel not built: {e})"
    error = ""
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(),
                                         _cpu_id().encode()])).hexdigest()[:16]
        path = folder / f"{source_path.stem}-{key}.so"
        try:
            if not path.exists():
                _compile(compiler, flags, path, source_path)
            kernel = loader(path)
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            continue
        return kernel, f"{what}: C ({path.name}, {compiler} {' '.join(flags)})"
    return None, f"{what}: numpy (native kernel not built with {compiler}: {error})"


def _load(path: Path):
    kernel = ctypes.CDLL(str(path)).int4_rows_f32  # CDLL, not PyDLL: the GIL is released during the call
    kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    kernel.restype = None
    return kernel


def _compile(compiler: str, flags: tuple, path: Path, source: Path = SOURCE) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source), *LIBS], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise OSError(f"{compiler} {' '.join(flags)} failed: {done.stderr.strip() or done.returncode}")
        os.replace(tmp, path)  # atomic: a racing process loads either its own build or this whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _find_tool(names: tuple, config_var: str) -> str | None:
    """The first of `names`, then sysconfig's `config_var` command, found on PATH."""
    for name in (*names, *shlex.split(sysconfig.get_config_var(config_var) or "")[:1]):
        found = shutil.which(name)
        if found:
            return found
    return None


def _find_cxx() -> str | None:
    return _find_tool(("c++", "g++", "clang++"), "CXX")


def _find_compiler() -> str | None:
    return _find_tool(("cc", "gcc"), "CC")


def _cache_folder() -> Path:
    """~/.cache/strata_jax/native if writable, else <temp>/strata_jax_native-<uid>."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    for folder in (Path.home() / ".cache" / "strata_jax" / "native",
                   Path(tempfile.gettempdir()) / f"strata_jax_native-{uid}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            pass
    raise OSError("no writable cache folder (~/.cache/strata_jax/native or the temp folder)")


def _cpu_id() -> str:
    """The CPU model and flags: a -march=native build is only reused on the same kind of CPU (a shared home)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    keep = {}
    for line in lines:
        name = line.split(":", 1)[0].strip()
        if name in ("model name", "flags", "Features", "CPU part") and name not in keep:
            keep[name] = line
    return platform.machine() + "\n" + "\n".join(keep.values())
