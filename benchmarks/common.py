"""Pieces every benchmark shares: flag parsing, progress lines, timing, HBM bandwidth, tables, JSON.

Conventions: the start-up block and the result table go to stdout; progress lines go to stderr (so
`python -m benchmarks.x > table.txt` keeps the table clean). Every number printed is also written to JSON.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from absl import flags


# ---- flags ---------------------------------------------------------------------------------------------------


def parse_flags(flag_values: flags.FlagValues, argv: Sequence[str], prog: str = "") -> list[str]:
    """Parse argv (argv[0] is the program) into `flag_values`, from the defaults every time (so a test can call
    main() twice). `--help` prints the flags and exits 0; a bad flag is one line and exit status 2."""
    argv = list(argv)
    if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
        try:
            print(f"usage: python -m {prog or Path(argv[0]).stem} [--flag=value ...]\n")
            print(flag_values.get_help(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader stopped early
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    flag_values.unparse_flags()
    try:
        rest = flag_values(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if len(rest) > 1:
        print(f"error: unexpected arguments {rest[1:]} (flags look like --name=value)", file=sys.stderr)
        sys.exit(2)
    return rest


def run_main(flag_values: flags.FlagValues, argv: Sequence[str], prog: str, run: Callable[[Any], dict]) -> dict:
    """A benchmark's entry: parse argv into flag_values, then run(flag_values); a bad value or a refused setting is
    one `error:` line and exit status 1, Ctrl-C exit 130."""
    parse_flags(flag_values, argv, prog=prog)
    set_output(getattr(flag_values, "output", "md") if "output" in flag_values else "md")
    from strata_jax.errors import StrataError
    try:
        return run(flag_values)
    except (StrataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def int_list(text: str, name: str = "list") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (positive, deduplicated, in the given order): benchmarks.runner.int_list."""
    from benchmarks.runner import int_list as parse  # runner imports tables, never common
    return parse(text, name)


def define_option_flags(flag_values: flags.FlagValues, names: Sequence[str], defaults: dict | None = None,
                        prefix: str = "Engine option: ") -> None:
    """One absl flag per named EngineOptions / RequestOptions field, from strata_jax.options (its type, help and
    check, as strata_jax.options.define_flags makes them), with a benchmark's own default where `defaults` names
    one. A value the option's check refuses is a flag error (one line, exit status 2)."""
    from strata_jax.options import EngineOptions, RequestOptions, option_kind
    fields = {f.name: f for cls in (EngineOptions, RequestOptions) for f in dataclasses.fields(cls)}
    defaults = defaults or {}
    for name in names:
        f = fields[name]
        kind = option_kind(f)
        define = {"int": flags.DEFINE_integer, "float": flags.DEFINE_float, "str": flags.DEFINE_string,
                  "bool": flags.DEFINE_bool}[kind]
        define(name, defaults.get(name, f.default), prefix + f.metadata["help"], flag_values=flag_values)
        check = f.metadata.get("check")
        if check is not None:
            def validator(v, check=check, name=name):
                msg = check(v)
                if msg:
                    raise flags.ValidationError(f"{v!r} {msg}")
                return True
            flags.register_validator(name, validator, flag_values=flag_values)


# ---- A/B arms ----------------------------------------------------------------------------------------------------


def known_switches() -> list[str]:
    """The STRATA_* variables an arm may set: the route_* and verify_* engine options, and STRATA_LOGPOS."""
    import dataclasses
    from strata_jax.options import EngineOptions, env_name
    names = [env_name(f.name) for f in dataclasses.fields(EngineOptions)
             if f.name.startswith(("route_", "verify_"))]
    return names + ["STRATA_LOGPOS"]


def parse_arms(text: str, flag: str = "arms", options: dict[str, tuple[str, ...]] | None = None
               ) -> list[tuple[str, dict[str, str]]]:
    """'base:;skip:STRATA_ROUTE_TAIL_SKIP=5' -> [('base', {}), ('skip', {'STRATA_ROUTE_TAIL_SKIP': '5'})]: the
    arms of an A/B benchmark (--arms, --switch_arms), each a name and the STRATA_* variables it sets. `options`
    names the benchmark's own lower-case per-arm settings and their values (e.g. {'draft': ('ngram', 'device')});
    they land in the same dict, under their lower-case name."""
    options = options or {}
    known = known_switches() + list(options)
    arms: list[tuple[str, dict[str, str]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, colon, body = part.partition(":")
        name = name.strip()
        if not colon:
            raise ValueError(f"--{flag}: {part!r} is not name:STRATA_VAR=value,... (no ':')")
        if not re.fullmatch(r"[A-Za-z0-9_.+= -]+", name):
            raise ValueError(f"--{flag}: {part!r}: the arm name must be letters, digits, spaces or _.+=- (not {name!r})")
        if name in [a for a, _ in arms]:
            raise ValueError(f"--{flag}: the arm name {name!r} twice")
        env: dict[str, str] = {}
        for item in (i.strip() for i in body.split(",")):
            if not item:
                continue
            var, eq, value = item.partition("=")
            var = var.strip()
            if not eq or not var:
                raise ValueError(f"--{flag}: arm {name}: {item!r} is not STRATA_VAR=value")
            if var not in known:
                raise ValueError(f"--{flag}: arm {name}: unknown variable {var} (known: {', '.join(known)})")
            if var in env:
                raise ValueError(f"--{flag}: arm {name}: {var} twice")
            if var in options and value.strip() not in options[var]:
                raise ValueError(f"--{flag}: arm {name}: {var}={value.strip()} is not one of "
                                 f"{', '.join(options[var])}")
            env[var] = value.strip()
        arms.append((name, env))
    if not arms:
        raise ValueError(f"--{flag} is empty (e.g. --arms='base:;skip:STRATA_ROUTE_TAIL_SKIP=5')")
    return arms


# ---- output: benchmarks/tables.py ------------------------------------------------------------------------------
from benchmarks.tables import _jsonable, format_table, progress, say, set_output, write_json  # noqa: E402,F401


# ---- timing --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Seconds of each timed call, and their summary in milliseconds. `dispatch_s`: for each call, the seconds
    until the Python call returned (before the synchronisation), i.e. the host-side dispatch cost."""
    samples_s: list[float]
    dispatch_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_s) * 1e3

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_s) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.samples_s) * 1e3

    @property
    def max_ms(self) -> float:
        return max(self.samples_s) * 1e3

    @property
    def stdev_ms(self) -> float:
        return statistics.stdev(self.samples_s) * 1e3 if len(self.samples_s) > 1 else 0.0

    @property
    def dispatch_median_ms(self) -> float:
        return statistics.median(self.dispatch_s) * 1e3 if self.dispatch_s else float("nan")

    def summary(self) -> dict:
        return dict(median_ms=self.median_ms, mean_ms=self.mean_ms, min_ms=self.min_ms, max_ms=self.max_ms,
                    stdev_ms=self.stdev_ms, n=len(self.samples_s), samples_ms=[s * 1e3 for s in self.samples_s],
                    dispatch_median_ms=self.dispatch_median_ms)


def time_synced(call: Callable[[int], Any], iters: int, warmup: int = 1) -> Timing:
    """Time `call(i)` `iters` times after `warmup` untimed calls; each call is synchronised with
    `jax.block_until_ready` on what it returns, so a sample covers Python dispatch + device execution."""
    import jax
    for i in range(warmup):
        jax.block_until_ready(call(i))
    samples, dispatch = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        out = call(warmup + i)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        samples.append(t2 - t0)
        dispatch.append(t1 - t0)
    return Timing(samples, dispatch)


def time_pipelined(call: Callable[[int], Any], iters: int) -> float:
    """Seconds per call when `iters` calls are dispatched back to back with one synchronisation at the end (on an
    asynchronous device, host dispatch then overlaps the device work). Only the last call's result is waited on,
    so `call` must chain its results (e.g. thread a donated cache) for the total to cover every call."""
    import jax
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
        out = call(i)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


# ---- machine -------------------------------------------------------------------------------------------------


def device_info() -> dict:
    import jax
    import jaxlib
    d = jax.devices()[0]
    stats = {}
    try:
        stats = d.memory_stats() or {}
    except Exception:  # some backends do not implement it
        pass
    return dict(platform=d.platform, device_kind=d.device_kind, device=str(d), device_count=jax.device_count(),
                memory_limit_bytes=stats.get("bytes_limit"), jax=jax.__version__, jaxlib=jaxlib.__version__,
                python=platform.python_version(), host=platform.node(), xla_flags=os.environ.get("XLA_FLAGS", ""))


def free_engine(engine) -> None:
    """Before an engine's last reference goes: its host pool's threads stop. Then `del` it and call
    free_device_memory."""
    if getattr(engine, "placement", None) is not None:
        engine.placement.pool.close()


def free_device_memory() -> None:
    """The dropped engines' device arrays freed now, and the compiled graphs with them: an Engine holds reference
    cycles, so `del` alone leaves its weights on the device until the next collection (a second engine of a large
    shape in the same process then offloads, or runs out of memory: 24 layers on an 80 GB H100, 2026-12-06)."""
    import gc
    import jax
    gc.collect()
    jax.clear_caches()


def device_memory_in_use() -> int | None:
    import jax
    try:
        return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
    except Exception:
        return None


def kernels(s, cfg) -> tuple[str, str, str]:
    """The (expert, attention, dense) kernels of a benchmark's --expert_kernel / --attention_kernel /
    --dense_kernel / --dtype flags, 'auto' resolved as the engine resolves it (strata_jax.engine.plan.resolve_kernels)."""
    from strata_jax.engine.plan import resolve_kernels
    from strata_jax.options import EngineOptions, build
    return resolve_kernels(build(EngineOptions, dict(dtype=s.dtype, expert_kernel=s.expert_kernel,
                                                     attention_kernel=s.attention_kernel,
                                                     dense_kernel=getattr(s, "dense_kernel", "xla"))), cfg)


NOMINAL_HBM_Bps = {"H200": 4.8e12, "H100": 3.35e12}  # vendor datasheets, printed beside the measured figure


def nominal_bandwidth(device_kind: str) -> float | None:
    return next((v for k, v in NOMINAL_HBM_Bps.items() if k in device_kind), None)


def measure_read_bandwidth(nbytes: int, reps: int = 10) -> dict:
    """The roofline's denominator: device memory READ bandwidth, back to back (calls dispatched one after another,
    one sync at the end, so no launch gap counts), the larger of two read-dominated kernels over `nbytes` of bf16:
    a sum to one float32 (read nbytes) and a [8, 2048] x [2048, n] GEMV (read nbytes of matrix, write n * 8 * 2).
    A decode step is such a read; `x * 2` (read + write, synced) under-reads the bandwidth by 10-30%."""
    import jax
    import jax.numpy as jnp
    out = {}
    cols = max(nbytes // 2 // 2048, 1)
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (2048, cols), jnp.bfloat16)  # random, not zeros
    x = jax.random.normal(key, (8, 2048), jnp.bfloat16)
    moved = {"sum": w.size * 2, "gemv": w.size * 2 + 8 * cols * 2}
    fns = {"sum": (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (w,)),
           "gemv": (jax.jit(lambda a, b: a @ b), (x, w))}
    for name, (fn, args) in fns.items():
        f = fn.lower(*args).compile()
        jax.block_until_ready(f(*args))
        seconds = time_pipelined(lambda _: f(*args), iters=reps)
        out[name] = dict(seconds=seconds, bytes=moved[name], Bps=moved[name] / seconds)
    del w, x
    best = max(out, key=lambda k: out[k]["Bps"])
    return dict(method=f"read-dominated, back to back: the larger of a sum over {nbytes / 2**30:.2f} GiB bf16 and a "
                       f"[8, 2048] x [2048, {cols}] bf16 GEMV ({best})",
                array_bytes=moved["sum"], kernels=out, bandwidth_Bps=out[best]["Bps"], best_Bps=out[best]["Bps"])


def gb(nbytes: float) -> float:
    return nbytes / 1e9


def fmt_bytes(nbytes: float) -> str:
    """Decimal units: '61.1 GB', '9.44 MB', '49.2 kB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            v = nbytes / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{nbytes:.0f} B"
