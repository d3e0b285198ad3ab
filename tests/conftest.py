"""Shared test set-up: the `gpu` marker, one cache folder per session, and engines built once.

Engine construction compiles a graph per window size and the prefill chunk (seconds each on a CPU), so tests share
engines through `engine_factory` (cached per (path, options) for the whole session); a second engine of the same
shapes reuses the first one's executables (graphs.compile_shared). Every CLI subprocess points at the same
`cache_dir`, where JAX's persistent compilation cache lets a later CLI skip compilation (the test process itself
does not use that cache: pytest_configure).
"""
from __future__ import annotations

import functools
import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest tests` (not `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(REPO))

HF_FIXTURES = REPO / "tests" / "fixtures" / "hf"

# On a CPU the suite's time is XLA's compile time (tiny models run in milliseconds), and LLVM's optimizer is most of
# that: the suite (and every CLI subprocess, which inherits the environment) compiles at LLVM -O0 without its
# expensive passes, ~40% less per graph. Set before JAX starts its backend; not where a GPU may be present (the GPU
# tests measure the graphs users run). TESTS_XLA_DEFAULT_OPT=1 keeps XLA's default optimization.
if not shutil.which("nvidia-smi") and os.environ.get("TESTS_XLA_DEFAULT_OPT", "") != "1":
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true"]))


def hf_fixture_names() -> list[str]:
    """Every committed HF reference folder (one with a config.json and a reference.npz)."""
    return sorted(p.name for p in HF_FIXTURES.iterdir()
                  if (p / "config.json").is_file() and (p / "reference.npz").is_file())


def tests_compile_graphs() -> str:
    """When the suite's engines compile their window / prefill graphs: lazy on a CPU (compiling is the suite's time),
    ahead where nvidia-smi is found (the GPU tests run the graphs as users do); TESTS_COMPILE_GRAPHS overrides."""
    return os.environ.get("TESTS_COMPILE_GRAPHS", "ahead" if shutil.which("nvidia-smi") else "lazy")


def run_cli(args, cache_dir, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m strata_jax.decode ARGS --cache_dir=...` from the repo root, with `env` added to the environment;
    stdout and stderr as bytes (the embedded model's text is arbitrary bytes). The run compiles as the test
    process's engines do (tests_compile_graphs: on a CPU --compile_graphs=lazy, the window sizes it runs, not
    T = 1..W and the prefill ahead) unless ARGS name --compile_graphs; the graphs and the output are the same."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, PYTHONIOENCODING="utf-8",
               **(env or {}))
    if not any(str(a).startswith("--model") for a in args):
        args = ["--model=embedded", *args]  # the tests' tiny model (the CLI's default is the reference model)
    if not any(str(a).startswith("--compile_graphs") for a in args):
        args = [*args, f"--compile_graphs={tests_compile_graphs()}"]
    return subprocess.run([sys.executable, "-m", "strata_jax.decode", *args, f"--cache_dir={cache_dir}"],
                          cwd=REPO, env=env, capture_output=True, timeout=timeout)


def fake_devices_env(n: int) -> dict:
    """The environment of a subprocess that sees N fake CPU devices (XLA reads the count before JAX starts): no
    STRATA_* switch of the caller's, the suite's XLA_FLAGS kept and the device count added."""
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    return dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, XLA_FLAGS=flags,
                JAX_PLATFORMS="cpu")


def stderr_until(proc: subprocess.Popen, marker: bytes, timeout_s: float = 240) -> bytes:
    """A subprocess's stderr read line by line until a line holds `marker` (or the stream ends, or the time is up):
    what it read, for the test's messages."""
    import time
    err, deadline = b"", time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stderr.readline()
        err += line
        if marker in line or not line:
            break
    return err


def copy_fixture(tmp_path: Path, name: str) -> Path:
    """A writable copy of one HF fixture folder, to break in a test."""
    dst = tmp_path / name
    shutil.copytree(HF_FIXTURES / name, dst)
    return dst


# TESTS_COMPILE_REPORT=FILE: one JSON line per test appended to FILE with the JAX compile work it did in this process
# (backend compiles and seconds, tracing and lowering seconds, persistent-cache hits): where the suite's time goes.
_COMPILE_REPORT = os.environ.get("TESTS_COMPILE_REPORT", "")
_compile_work: dict = {}


def _count_compile_work():
    from jax import monitoring

    def on_duration(event, seconds, **kwargs):
        name = event.rsplit("/", 1)[-1]
        if "compile" in event or "jaxpr" in event or "cache" in event:
            n, total = _compile_work.get(name, (0, 0.0))
            _compile_work[name] = (n + 1, total + seconds)
    monitoring.register_event_duration_secs_listener(on_duration)


def _lazy_graphs_by_default() -> None:
    """The test process's engines compile each window / prefill graph on its first use (compile_graphs=lazy)
    unless a test asks otherwise: most tests run one or two of an engine's W window sizes, and compiling is the
    suite's time. The graphs, and so every assertion, are the same (test_decode checks lazy against ahead); the
    CLI subprocesses of run_cli pass --compile_graphs the same way. TESTS_COMPILE_GRAPHS=ahead runs the suite with
    the default (the default where nvidia-smi is found)."""
    from strata_jax.engine.api import Engine
    for name in ("from_pretrained", "from_random"):
        original = getattr(Engine, name).__func__

        def lazy(cls, *args, _original=original, **options):
            options.setdefault("compile_graphs", "lazy")
            return _original(cls, *args, **options)
        setattr(Engine, name, classmethod(functools.wraps(original)(lazy)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a JAX GPU backend; skipped (with the reason) elsewhere")
    # No persistent compilation cache in the test process: one process that builds the suite's engines faulted in
    # XLA's cache read or write (benchmarks/results/NOTES.md item 7). Its engines share executables through
    # graphs.compile_shared instead, in memory; the CLI subprocesses keep the cache (their --cache_dir).
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    if tests_compile_graphs() == "lazy":
        _lazy_graphs_by_default()  # on a CPU only, as the -O0 flags: the GPU tests run the graphs as users do
    if _COMPILE_REPORT:
        _count_compile_work()


_outcomes: dict = {}  # nodeid -> its worst phase outcome (the compile report's rows say which tests failed)


def pytest_runtest_logreport(report):
    if _COMPILE_REPORT and (report.when == "call" or report.outcome != "passed"):
        if _outcomes.get(report.nodeid) in (None, "", "passed"):
            _outcomes[report.nodeid] = report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time
    _compile_work.clear()
    t0 = time.perf_counter()
    yield
    if nextitem is None or nextitem.path != item.path:
        _after_file()  # the file's module fixtures are torn down: its engines are held by _ENGINES alone
    if not _COMPILE_REPORT:
        return
    import json
    row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - t0, 2), "maps": memory_maps(),
           "engines": len(_ENGINES), "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
           "outcome": _outcomes.pop(item.nodeid, "")}
    row.update({k: [n, round(s, 2)] for k, (n, s) in sorted(_compile_work.items())})
    with open(_COMPILE_REPORT, "a") as f:
        f.write(json.dumps(row) + "\n")


# The files that take longest on the 2-core CPU machine (tests/conftest.py TESTS_COMPILE_REPORT, 2026-12-06: seconds
# of one worker in `make test`, less this round's cuts; the 2026-12-03 list had fallen behind the files added since,
# so test_slot_plan, test_gguf_kept, test_batch_offload and test_prefetch ran last, each ~1-2 minutes), longest first:
# pytest-xdist hands out whole files in collection order, so these start first and the short ones fill the workers'
# ends (one long file left for last would run alone).
SLOW_FILES = ("test_parallel.py", "test_expert_ffn.py", "test_offload.py", "test_gguf_kept.py",
              "test_batch_offload.py", "test_benchmarks.py", "test_decode_attention.py", "test_spec.py",
              "test_quant.py", "test_sampling.py", "test_hf_next.py", "test_slot_plan.py", "test_gguf_llama.py",
              "test_gguf_q4k.py", "test_hf_reference.py", "test_route_approx.py", "test_prefetch.py", "test_serve.py",
              "test_gguf_mixed.py", "test_defer.py", "test_cli.py", "test_train_reference.py", "test_scan.py",
              "test_kv_int8.py", "test_agent_turns_bench.py", "test_batch.py", "test_decode.py", "test_loader.py",
              "test_gguf.py", "test_gguf_q6k.py", "test_host_pool_native.py", "test_route_prior.py",
              "test_api_inputs.py", "test_gated_delta.py", "test_kernel_benches.py", "test_prefill_chunks.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: a file's order is kept
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax
    backend = jax.default_backend()
    if backend != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU: jax.default_backend() is {backend!r}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One folder per session for the persistent compilation cache and the embedded model."""
    return tmp_path_factory.mktemp("strata_cache")


@pytest.fixture(scope="session")
def engine_factory(cache_dir):
    """`engine_factory(path, **options)` -> an Engine, built once per (path, options) in the session.

    Defaults: verbose=False, the session cache_dir; path None is the embedded model. Engines are shared between
    tests: every request starts at position 0 and the causal mask hides stale cache rows, so reuse is safe.
    """
    from strata_jax import Engine

    engines = _ENGINES

    def get(path=None, **options):
        options.setdefault("cache_dir", str(cache_dir))
        key = (None if path is None else str(path), tuple(sorted(options.items())))
        if key in engines:
            engines[key] = engines.pop(key)  # most recently used last
            return engines[key]
        # Every live XLA CPU executable holds memory maps of its kernels (~400 a window graph); past the kernel's
        # vm.max_map_count (65530) XLA crashes in its next compile. Most are freed between files (_after_file);
        # should one file still take the process near the limit, free JAX's caches and then drop the least
        # recently used engines here (their executables go with them; a later test that asks again rebuilds).
        if memory_maps() > MAX_MEMORY_MAPS:
            _free_memory_maps(MAX_MEMORY_MAPS)
        engines[key] = Engine.from_pretrained(path, verbose=False, **options)
        return engines[key]

    return get


MAX_MEMORY_MAPS = 30000  # of the 65530 a Linux process may hold (vm.max_map_count's default)
# Between two test files, past FILE_END_MAPS maps, free JAX's caches and then drop the least recently used engines
# down to FILE_END_MAPS_LOW. Mid-file, the guard above could free little: the file's module fixtures still hold
# its engines, so it dropped every cached engine (and collected garbage once per engine, ~0.3 s each) on each new
# engine the file asked for, and later files rebuilt what they asked for again.
FILE_END_MAPS = 18000
FILE_END_MAPS_LOW = 12000

_ENGINES: dict = {}  # engine_factory's engines: key -> engine, least recently used first


def _free_memory_maps(target: int) -> None:
    """Bring the process's memory maps to TARGET or below where it can: first JAX's compilation caches (the
    executables of every jitted call a test made, and the engines' small helper graphs; the engines' own window
    and prefill executables are theirs and stay), then the least recently used cached engines."""
    import jax
    jax.clear_caches()
    gc.collect()
    while _ENGINES and memory_maps() > target:
        _ENGINES.pop(next(iter(_ENGINES)))
        gc.collect()


def _after_file() -> None:
    if memory_maps() > FILE_END_MAPS:
        _free_memory_maps(FILE_END_MAPS_LOW)


def memory_maps() -> int:
    """The process's memory maps (Linux); 0 where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(scope="session")
def embedded_engine(engine_factory):
    """The embedded tiny model, exact: float32, every expert resident, W=4, a 64-token context (small, so context
    limits are cheap to reach). test_cli runs the CLI with the same options, so the graphs are compiled once."""
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all")


@pytest.fixture(params=["C", "numpy"])
def pool_path(request, monkeypatch):
    """Each host-pool test that takes it runs twice: the C expert kernel (host_pool/native_experts.c; skipped, saying
    why, where no compiler builds it) and the numpy / BLAS jobs (STRATA_POOL_NATIVE=0)."""
    from strata_jax.host_pool import native
    if request.param == "C":
        monkeypatch.delenv(native.ENV, raising=False)
        if native.experts_kernel() is None:
            pytest.skip(native.describe_experts())
        monkeypatch.setenv(native.ENV, "1")
    else:
        monkeypatch.setenv(native.ENV, "0")
    return request.param


@pytest.fixture
def make_pool():
    """`make_pool(layers, compute_dtype=None, **HostPool options)` -> a HostPool over HostExpertStore(layers) (the
    host-pool tests' one way to build one), closed after the test."""
    import numpy as np
    from strata_jax.host_pool import HostExpertStore, HostPool
    pools = []

    def make(layers, compute_dtype=None, **kwargs):
        dtype = None if compute_dtype is None else np.dtype(compute_dtype)
        pool = HostPool(HostExpertStore(layers, compute_dtype=dtype), **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
