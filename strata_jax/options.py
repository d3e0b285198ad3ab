"""One place for switches: every engine option and request option, its default, its check and its help.

The CLI flags (`python -m strata_jax.decode --window=4`) and the API keywords (`Engine.from_pretrained(path,
window=4)`, `engine.generate(..., temperature=0.7)`) are both made from the tables below, so a flag and an option
never disagree. A bad value is one line (StrataError); nothing is silently replaced.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from strata_jax.errors import StrataError

DTYPES = ("float32", "bfloat16")


def _choice(*allowed):
    def check(v):
        return None if v in allowed else f"must be one of {', '.join(allowed)}"
    return check


EXPERT_FORMATS = ("int8", "int4", "int4-q4k", "int2-q2k", "int6-q6k", "int6-q6km", "int4-g32f", "int4-g32m", "int8-g32",
                  "int8-g16", "int8-g32m", "int8-g16m")


def _expert_dtype_check(v):
    """auto, one expert format, or a pair gate_up/down (strata_jax/model/quant.py family_formats)."""
    parts = v.split("/") if isinstance(v, str) else [v]
    if v == "auto" or (len(parts) in (1, 2) and all(p in EXPERT_FORMATS for p in parts)):
        return None
    return f"must be auto, one of {', '.join(EXPERT_FORMATS)}, or a pair gate_up/down of them (int4-q4k/int6-q6k)"


INT32_MAX = 2**31 - 1  # the graphs hold counts and positions in int32


def _int_range(lo, hi=None):
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            return f"must be an integer in {lo}..{hi if hi is not None else 'inf'}"
        return None
    return check


def _float_range(lo, hi, lo_open=False):
    def check(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            return "must be a number"
        if (v <= lo if lo_open else v < lo) or v > hi:
            return f"must be in {'(' if lo_open else '['}{lo}, {hi}]"
        return None
    return check


def _bool(v):
    return None if isinstance(v, bool) else "must be true or false"


def _slots(v):
    if v in ("auto", "all"):
        return None
    try:
        return None if int(v) >= 0 else "must be auto, all or a number >= 0"
    except (TypeError, ValueError):
        return "must be auto, all or a number >= 0"


def _frac(v):
    if v == "auto":
        return None
    try:
        return None if 0.0 <= float(v) <= 1.0 else "must be auto or a number in [0, 1]"
    except (TypeError, ValueError):
        return "must be auto or a number in [0, 1]"


def _devices(v):
    if v == "all":
        return None
    try:
        return None if int(v) >= 1 else "must be all or a number >= 1"
    except (TypeError, ValueError):
        return "must be all or a number >= 1"


def opt(default, help: str, check: Callable[[Any], str | None] | None = None, flag_type: str | None = None):
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "flag_type": flag_type})


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Options fixed when an engine is built (graphs are compiled for them)."""
    window: int = opt(4, "Largest verify window W: graphs for T = 1..W tokens are compiled at start-up.", _int_range(1, 16))
    compile_graphs: str = opt("ahead", "When the window and prefill graphs compile: ahead (all at start-up, so no "
                              "request pays a compile) or lazy (each the first time a request needs it: a faster "
                              "start where compiling is most of it, as on a CPU; the graphs and tokens are the same).",
                              _choice("ahead", "lazy"))
    dtype: str = opt("bfloat16", "Compute and weight dtype.", _choice(*DTYPES))
    context: int = opt(0, "Tokens the KV cache holds (prompt + generated); 0 = auto: with the Pallas attention (a GPU in "
                       "bf16) the model's max_position_embeddings, halved while the KV cache would take more than an "
                       "eighth of the device memory; else min(max_position_embeddings, 4096).",
                       _int_range(0, INT32_MAX))
    prefill_chunk: int = opt(0, "Prompt tokens per prefill step; 0 = auto: on a GPU, chunks of up to 1024 (fewer "
                             "where the context or the device memory is smaller) while a quarter of one or more "
                             "prompt tokens remain, then chunks of 64; on a CPU, 64.", _int_range(0, 8192))
    cache_dir: str = opt("", "Folder for the persistent compilation cache and the embedded model; '' = ~/.cache/strata_jax.")
    expert_cache_slots: str = opt("auto", "Device expert cache slots per MoE layer: a number (offload on; 0 = no "
                                  "cache), 'all' (every expert on the device, offload off), or 'auto' (what fits "
                                  "in the device memory left; 'all' when everything fits).", _slots)
    cache_policy: str = opt("lru", "Expert cache policy: lru (fetched experts replace the least recently used), or "
                            "static (filled with the experts the prompt's prefill used most, then frozen).",
                            _choice("lru", "static"))
    pcie_frac: str = opt("auto", "Share of missed experts fetched over PCIe (0..1); the rest run on the host pool "
                         "(0: nothing fetched, the slots take each prompt's most used experts as under static). "
                         "'auto' picks it from costs measured at start-up.", _frac)
    cpu_threads: int = opt(0, "Host pool threads; 0 = the cores this process may use.", _int_range(0, 1024))
    vram_reserve_mib: int = opt(1024, "Device memory (MiB) kept free when expert_cache_slots=auto.",
                                _int_range(0, INT32_MAX))
    expert_kernel: str = opt("auto", "Expert FFN of the decode windows: pallas (pallas_kernels/expert_ffn.py: each "
                             "expert read in place, once per window; bf16 on a GPU only), xla (gather + einsums), or "
                             "auto (pallas on a GPU in bfloat16, else xla).", _choice("auto", "xla", "pallas"))
    attention_kernel: str = opt("auto", "Attention of the decode windows: pallas (pallas_kernels/decode_attention.py: "
                                "the cache read in place up to the window's last position; interpreted, slowly, off "
                                "the GPU), xla (einsums over the whole static cache), or auto (pallas on a GPU in "
                                "bfloat16 when head_dim is a power of 2 >= 16, else xla).",
                                _choice("auto", "xla", "pallas"))
    dense_kernel: str = opt("auto", "Attention products (q/k/v, o) of the decode graphs: pallas "
                            "(pallas_kernels/stacked_linear.py: the scanned graph's stacked weights read in place; "
                            "the unrolled graph runs the same kernel, so both round alike), xla (XLA's product; "
                            "scanned: each layer's matrices sliced out of the stacks first, a copy), or auto (pallas "
                            "on a GPU in bfloat16, else xla).",
                            _choice("auto", "xla", "pallas"))
    route_kernel: str = opt("xla", "The exact route of the decode windows' Pallas and offloaded expert paths: xla "
                            "(XLA's softmax and sort) or pallas (pallas_kernels/route_topk.py: softmax and top-K in "
                            "one kernel; the same ids, the weights to the last bit of the softmax's rounding; on an "
                            "H100 as fast as xla, not faster: benchmarks/results/h100-2026-12-07c-route).",
                            _choice("xla", "pallas"))
    plan_kernel: str = opt("xla", "The offloaded layers' plan and slot-cache update (the native offload calls' "
                           "windows): pallas (pallas_kernels/slot_plan.py: one program a layer; interpreted off the "
                           "GPU; not yet timed on one), or xla (~10 small fusions a layer).", _choice("xla", "pallas"))
    prefetch: int = opt(0, "Experts a token to prefetch (0: off, the default: slower at every N on an H100, 12-33%, benchmarks/results/h200-2026-12-06b-offload): while layer l "
                        "computes, the N experts layer l+1's router picks on layer l's FFN input (pre-gating) are "
                        "copied into layer l+1's slots (lru victims; nothing under static), on a side stream on a GPU. "
                        "Exact: a wrong guess costs PCIe bytes, never output (with the routing approximations off). "
                        "Decode windows of the scanned offload graph (layer_loop=scan, native offload calls, one "
                        "device) only; ignored elsewhere, with one line.", _int_range(0, 64))
    slot_refresh: int = opt(0, "Where the slots are filled from each prompt's prefill (lru with pcie_frac 0, the static "
                            "policy): every N decode windows of the T=1 loop they re-take the request's most used "
                            "experts so far (its decode's usage), copying only the experts not in a slot already; the "
                            "decode waits for the copies (counted as decode time: slot_refreshes, "
                            "slot_refresh_experts). 0: off, the default (not yet timed on a GPU). Exact: placement "
                            "only. Ignored, with one line, where the slots are not filled from the prefill.",
                            _int_range(0, 1 << 20))
    delta_kernel: str = opt("auto", "Qwen3-Next's DeltaNet layers, the decode-time gated delta rule: pallas "
                            "(pallas_kernels/gated_delta.py: one program per value head and block of dv, the state "
                            "kept in registers across the window's rows), xla (the rule unrolled over the rows in "
                            "jnp), or auto (pallas on a GPU in bfloat16 when both linear head dims are powers of 2, else xla).",
                            _choice("auto", "xla", "pallas"))
    expert_dtype: str = opt("auto", "How the routed experts are stored: auto (unquantized, in `dtype`), int8 "
                            "(quantized at load: symmetric, one bf16 scale per output row: a byte a weight) or int4 "
                            "(symmetric, one bf16 scale per 64 inputs, two weights a byte) or int4-q4k (GGUF Q4_K's "
                            "blocks: groups of 32 with 6-bit scales and minima, 4.625 bits a weight; a GGUF's Q4_K "
                            "experts are kept as read, others quantized at load) or int2-q2k (GGUF Q2_K's blocks: "
                            "groups of 16 with 4-bit scales and minima, 2.625 bits a weight, likewise) or int6-q6k "
                            "(GGUF Q6_K's blocks, 6.5625 bits a weight; Q3_K's too, values unchanged) or "
                            "int6-q6km (int6-q6k with a minimum per 16 inputs, 7.125 bits a weight: every K "
                            "type's values unchanged, for a family mixing them); GGUF types "
                            "kept as read with float32 group scales: int4-g32f (Q4_0), int4-g32m (Q4_1), int8-g32 "
                            "(Q8_0), int8-g32m (Q5_K), and by name int8-g16 (Q6_K, Q3_K) and int8-g16m (Q2_K), a "
                            "byte a weight; "
                            "the IQ types as int8-g16 (IQ2_XS, IQ2_S, IQ1_M) or int8-g32 (the others). auto keeps a "
                            "GGUF's experts as read where one of these formats holds every expert tensor's type. "
                            "Host RAM, slots, PCIe fetches and the host pool hold the quantized form; the expert FFNs "
                            "dequantize in their products (strata_jax/model/quant.py). Per family: gate_up/down, e.g. "
                            "int4-q4k/int6-q6k "
                            "(a Q4_K_M GGUF's Q4_K gate/up and Q6_K down, each kept as read); auto picks each "
                            "family's format where one holds all of that family's tensors.",
                            _expert_dtype_check)
    kv_dtype: str = opt("auto", "How the KV cache is stored: auto (in `dtype`) or int8 (symmetric, one float32 scale "
                        "per (position, kv head) for K and one for V, absmax/127; quantized as rows are written, read "
                        "in place by the XLA attention and the Pallas decode-attention kernel; about half the bf16 "
                        "cache's bytes: strata_jax/model/ QuantKV). Qwen3-Next's DeltaNet states stay in `dtype`.",
                        _choice("auto", "int8"))
    layer_loop: str = opt("scan", "How a window's graph runs the layers: scan (weights stacked on a layer axis, one "
                          "layer body in a loop: a few hundred kernel launches less per layer count, a fraction of "
                          "the compile time) or unrolled (one copy of the body per layer). Offload and models that "
                          "mix dense and MoE layers always unroll.", _choice("scan", "unrolled"))
    callback_timeout_s: float = opt(20.0, "A host pool job that does not answer within this many seconds ends the "
                               "request with an error (pool_calls=callback: the native FFI calls have no "
                               "timeout, their code cannot hang).", _float_range(0.0, 3600.0, lo_open=True))
    pool_calls: str = opt("auto", "How the decode graphs reach the host pool and fetch misses: auto (native "
                          "offload calls where the FFI handler builds: per layer one call fetches the misses and "
                          "starts the pool, one collects its rows after the GPU's own experts; no Python, no host "
                          "read-back, the pool computing while the GPU does), layer (one FFI pool call per layer, "
                          "misses fetched by the graph's loops under lax.cond), or callback (io_callback into the "
                          "Python pool: timeouts, fault injection, any store).",
                          _choice("auto", "layer", "callback"))
    prefix_reuse: bool = opt(True, "Keep the KV cache of the last request: a request whose tokens start with it "
                             "prefills only the new part (exact: the same logits as a cold run).", _bool)
    max_batch: int = opt(1, "Most sequences one batched window decodes together (Engine.generate_batch): above 1, "
                         "a KV slot of the context per sequence beside the engine's own cache, and one window graph "
                         "per bucket of rows (1, 2, 4, ... max_batch) compiled on first use; every expert resident on "
                         "one device, the scanned layer loop (Qwen3-MoE).", _int_range(1, 64))
    devices: str = opt("1", "Devices the model runs on: a number >= 1 or 'all' (every device JAX sees). Above 1 "
                       "every expert is resident (offload with several devices is not implemented) and --parallel "
                       "says how the model is split (strata_jax/engine/parallel.py).", _devices)
    parallel: str = opt("layers", "How the model is split over --devices > 1: layers (each device holds a contiguous "
                        "block of layers and their KV cache; a window runs stage by stage, the [T, H] activations "
                        "copied to the next device) or experts (each MoE layer's experts split over the devices, "
                        "everything else replicated; each device runs its experts for every token, summed across "
                        "the devices).", _choice("layers", "experts"))

    # The routing approximations (strata_jax/offload/approx.py): '' = read the STRATA_* environment variable of the
    # same name.
    # A bad value is one line and the switch stays off (as the original engine does), not an error.
    route_tail_skip: str = opt("", "STRATA_ROUTE_TAIL_SKIP=R: skip a missed expert that every token of a decode "
                               "window routes at rank >= R (0-based). Off when unset.")
    route_prior: str = opt("", "STRATA_ROUTE_PRIOR=lambda: re-pick each token's top-K with lambda added to the "
                           "logits of resident experts. Off when unset.")
    route_prior_mode: str = opt("", "STRATA_ROUTE_PRIOR_MODE=plain|range: range scales lambda by the layer's "
                                "running mean logit range (max - min). Default plain.")
    route_prior_keep: str = opt("", "STRATA_ROUTE_PRIOR_KEEP=J: the unbiased top-J are always kept. Default 1 in "
                                "range mode, 0 in plain mode.")
    route_resident: str = opt("", "STRATA_ROUTE_RESIDENT=1: swap a missed tail expert for the best resident one "
                              "within a margin. Off when unset.")
    route_resident_rank: str = opt("", "STRATA_ROUTE_RESIDENT_RANK=r: first rank the swap may replace. Default: the "
                                   "last 40% of the ranks (6 for K = 10).")
    route_resident_margin: str = opt("", "STRATA_ROUTE_RESIDENT_MARGIN=m: largest logit gap of a swap. Default 1.0.")

    verify_defer_cpu: str = opt("", "STRATA_VERIFY_DEFER_CPU=1|check: 1: a decode window's CPU expert rows of layer "
                                "l join before layer l+1's FFN half (the GPU does not wait for the host pool); "
                                "check: bookkeeping only. Off when unset or 0.")
    verify_defer_cpu_below: str = opt("", "STRATA_VERIFY_DEFER_CPU_BELOW=w: defer only the CPU rows of routing "
                                      "weight below w (heavier ones are waited for in their own layer); w >= 1: "
                                      "every row. Default 0.1.")

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else Path.home() / ".cache" / "strata_jax"


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """Options of one generate() call."""
    max_new_tokens: int = opt(64, "Most tokens to generate.", _int_range(0, INT32_MAX))
    temperature: float = opt(0.0, "Sampling temperature; 0 = greedy.", _float_range(0.0, 100.0))
    top_p: float = opt(1.0, "Nucleus sampling mass in (0, 1]; 1 = off.", _float_range(0.0, 1.0, lo_open=True))
    top_k: int = opt(0, "Sample among the k most likely tokens; 0 = off.", _int_range(0, INT32_MAX))
    seed: int = opt(0, "Sampling seed (same seed, same output).", _int_range(0, 2**32 - 1))
    draft: str = opt("auto", "Draft proposer for verify windows: auto (device for a greedy request when every "
                     "expert is on one device and the checkpoint has no MTP module, else ngram), ngram (prompt "
                     "lookup, on the host), none, or device (the same n-gram rule and the acceptance run on the "
                     "device: windows of spec+1 tokens go back to back, read one window late, so the device never "
                     "waits for the host), or mtp (Qwen3-Next's multi-token-prediction module, where the "
                     "checkpoint has one; else ngram).",
                     _choice("auto", "ngram", "none", "device", "mtp"))
    logpos: str = opt("", "STRATA_LOGPOS=path: first write the prompt's teacher-forced top-20 log-probs of every "
                      "position to this file (strata_jax.io.logpos; compare runs with benchmarks/kl_report.py).")
    logpos_read: str = opt("windows", "How --logpos reads the prompt: windows (every position takes the decode "
                           "path, verify windows of --window tokens) or prefill.", _choice("windows", "prefill"))
    ignore_eos: bool = opt(False, "Keep generating past the model's end-of-sequence tokens, up to "
                           "--max_new_tokens (as llama.cpp's --ignore-eos: fixed-length runs for timing).", _bool)
    spec: int = opt(-1, "Most drafts per verify window (window size spec+1, at most --window); -1 = window - 1, "
                    "0 = no speculation.", _int_range(-1, 15))


def validate(obj) -> None:
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        value = getattr(obj, f.name)
        if f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if f.type == "str" and isinstance(value, bool):
            value = "1" if value else "0"  # route_resident=True from the API
        if f.type == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # expert_cache_slots=8, pcie_frac=0.5 from the API
        object.__setattr__(obj, f.name, value)
        msg = check(value) if check else None
        if msg:
            raise StrataError(f"bad value for {f.name}: {value!r} ({msg})")


def build(cls, options: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise StrataError(f"unknown option(s) {unknown} (known: {sorted(names)})")
    obj = cls(**options)
    validate(obj)
    return obj


def split_options(options: dict[str, Any]) -> tuple[dict, dict]:
    """Split keyword options into (engine, request) by the tables above; unknown names stay with the engine."""
    request_names = {f.name for f in dataclasses.fields(RequestOptions)}
    return ({k: v for k, v in options.items() if k not in request_names},
            {k: v for k, v in options.items() if k in request_names})


HELP_FLAGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")  # the commands print their own flags (decode, serve)


def option_kind(f: dataclasses.Field) -> str:
    """An option field's value type as its flag has it: int, float, str or bool."""
    return f.metadata.get("flag_type") or f.type


def define_flags(flag_values, classes=(EngineOptions, RequestOptions)) -> None:
    """Define one absl flag per option field (same name, default and help)."""
    from absl import flags
    for cls in classes:
        for f in dataclasses.fields(cls):
            kind = option_kind(f)
            define = {"int": flags.DEFINE_integer, "float": flags.DEFINE_float, "str": flags.DEFINE_string,
                      "bool": flags.DEFINE_bool}[kind]
            define(f.name, f.default, f.metadata["help"], flag_values=flag_values)


def from_text(options: dict[str, str]) -> dict[str, Any]:
    """Options written as text (`name=value` lists of the benchmarks) converted by their fields' types (engine and
    request options alike; unknown names kept as given, for build() to refuse): "1" is a number for temperature,
    "true" / "0" a bool for ignore_eos. A value that does not convert is one StrataError line."""
    types = {f.name: option_kind(f) for cls in (EngineOptions, RequestOptions) for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for name, value in options.items():
        kind, text = types.get(name), str(value).strip()
        try:
            if kind == "int":
                out[name] = int(text)
            elif kind == "float":
                out[name] = float(text)
            elif kind == "bool":
                if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(text)
                out[name] = text.lower() in ("1", "true", "yes")
            else:
                out[name] = value
        except ValueError:
            raise StrataError(f"bad value for {name}: {text!r} (must be {'a number' if kind != 'bool' else 'a bool'}"
                              f"{'' if kind != 'int' else ', an integer'})") from None
    return out


def from_flags(cls, flag_values):
    return build(cls, {f.name: getattr(flag_values, f.name) for f in dataclasses.fields(cls)})


# ---- the STRATA_* switches (the expert wing parses them: strata_jax/offload/approx.py and defer.py) -------------

ROUTE_SWITCHES = ("route_tail_skip", "route_prior", "route_prior_mode", "route_prior_keep", "route_resident",
                  "route_resident_rank", "route_resident_margin")
DEFER_SWITCHES = ("verify_defer_cpu", "verify_defer_cpu_below")


def env_name(option: str) -> str:
    return "STRATA_" + option.upper()


def switch_values(opts: EngineOptions, names, environ=None) -> dict[str, str]:
    """Each switch's raw text: the option (flag / API keyword) when given, else its STRATA_* variable, else ''."""
    import os
    environ = os.environ if environ is None else environ
    return {n: (getattr(opts, n) or environ.get(env_name(n), "")).strip() for n in names}


def parse_number(text: str, kind=float):
    try:
        v = kind(text)
    except ValueError:
        return None
    return v if v == v else None  # NaN is not a number here


# Variables read outside the options: the host pool's native code (diagnostics and A/Bs: WORKSPACE.md's host_pool
# rows) and the server's API key. Known, so the start-up lines do not call them ignored.
OTHER_VARIABLES = ("STRATA_OFFLOAD_CAPTURE", "STRATA_OFFLOAD_FETCH", "STRATA_OFFLOAD_SIGNAL", "STRATA_OFFLOAD_SPIN_US",
                   "STRATA_OFFLOAD_TIMELINE", "STRATA_OFFLOAD_TRACE", "STRATA_POOL_MEMOPS", "STRATA_POOL_SPIN_US",
                   "STRATA_PREFETCH_BLOCKS", "STRATA_POOL_DEFINES",
                   "STRATA_API_KEY", "STRATA_KERNEL_TUNING")


def unknown_switches(environ=None) -> list[str]:
    """One start-up line for each STRATA_* variable that is no switch (a typo would otherwise be ignored silently)."""
    import difflib
    import os
    environ = os.environ if environ is None else environ
    known = [env_name(n) for n in (*ROUTE_SWITCHES, *DEFER_SWITCHES, "logpos", "pool_native")] + list(OTHER_VARIABLES)
    lines = []
    for name in sorted(v for v in environ if v.startswith("STRATA_") and v not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "known: " + ", ".join(known)
        lines.append(f"{name}: not a strata_jax switch; ignored ({hint})")
    return lines


def logpos_path(request: RequestOptions, environ=None) -> str:
    """The --logpos file, else STRATA_LOGPOS, else '' (none)."""
    import os
    environ = os.environ if environ is None else environ
    return request.logpos or environ.get("STRATA_LOGPOS", "").strip()
