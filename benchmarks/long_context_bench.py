"""What does a user of long prompts wait for? The time to the first token (the prefill of the whole prompt) and the
decode speed deep in the context, at prompt lengths like 4K / 32K / 100K, with every expert on the device and with
50% / 25% of the experts in the device's slots, beside llama.cpp on the same shape and beside the roofline.

    python -m benchmarks.long_context_bench --model=tiny --dtype=float32 --prompts=40,100 --new_tokens=8    # CPU
    python -m benchmarks.long_context_bench --layers=24 --json=out/long_context.json                       # H200
    python -m benchmarks.long_context_bench --layers=24 --llama_bench=/tmp/llama.cpp/build/bin/llama-bench

One table: a row per (prompt length, slot fraction, arm).
- TTFT s: engine.stats.last.prefill_s: the whole prompt through the engine's prefill graphs, chunk by chunk, until the
  first new token is known on the host (sampled at --temperature). prefill tok/s = prompt tokens / TTFT.
- decode tok/s: engine.stats.last.decode_tok_s: the generate loop's tokens after the first over their seconds,
  at positions prompt .. prompt + --new_tokens (deep in the context).
- TTFT x all / decode x all: over the all-resident engine with the same arm at the same prompt length. The target:
  a 32K prompt at 25% of the experts in slots within 2x of all-resident's TTFT (a line below the table says).
- Slots: 'all' = expert_cache_slots=all (every expert on the device; the scanned graph); a fraction f =
  expert_cache_slots=round(f * E) per MoE layer and pcie_frac=1 (every miss fetched over PCIe, no host pool).
- PCIe: the engine's expert counters of the prefill (RequestStats.prefill_experts) and of the decode.

Each (slot fraction, arm) is one engine over the same random weights (seed --seed): the offloaded engines are
Engine.from_random(cfg, seed, expert_cache_slots=S, pcie_frac=1, **arm); the all-resident one is made from the same
list-form random_weights (Engine.from_random's all-resident path draws its stacked weights with other values), so
every engine decodes the same model and the tokens of the same prompt can be compared (float32: identical by design).
Per engine: two untimed warm-up requests at the shortest prompt, random and repeating (nothing compiles in the timed
ones, and every verify window size has run once: a GPU loads a graph's kernels at its first launch), then one request
per prompt length, random token ids (numpy, seeded; each prompt's first token differs from the last request's, so
no KV rows are reused), stop tokens off. Engines are freed before the next is built.

Roofline (bandwidth and matmul rate measured at the start of the run, before any engine holds memory):
- decode: bytes a token reads = the non-expert weights (attention, norms, routers, lm_head, one embedding row) +
  top-K experts x every MoE layer + the KV rows up to the mean depth of the decode (prompt + new_tokens / 2), over
  the measured read bandwidth (common.measure_read_bandwidth, as decode_bench); a token a step, no drafts.
- prefill: the larger of (a) FLOPs / the measured rate of a large matmul in --dtype (2 x active params x P + causal
  attention 2 x heads x head_dim x P^2 per attention layer + lm_head once), (b) the bytes read once (every weight,
  each expert the prompt routes to, the KV rows written) / the read bandwidth, (c) offloaded: the routed experts
  beyond the slots fetched once / the pinned host -> device rate measured now. That is a prompt taken layer by
  layer (each expert read or fetched once); the engine's chunked prefill reads them once per chunk.
llama.cpp (--llama_bench, --gguf: as benchmarks/peer_bench.py, F16 GGUF written by benchmarks/peer/write_gguf.py):
`llama-bench -ngl 99 -fa 1 -p <prompts> -n 0` (pp<N>: TTFT = N / its tok/s) and `-p 0 -n <new_tokens> -d <prompts>`
(tg<n> @ d<N>), all on the GPU, mean of --peer_reps; run before JAX takes the GPU's memory. No binary: '-'.
A SIGTERM (gpu_run.sh's time limit) prints the rows measured so far; the JSON is rewritten after each measurement.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()  # our own flag set, so this module can be imported beside the others
flags.DEFINE_string("model", "qwen3-30b-a3b", "Model preset from configs/.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 24, "Cut the model to its first N layers (0 or more than the preset has = all). 24 as "
                     "peer_bench: with offload the host holds the experts twice (pinned + the pool's numpy copy), "
                     "2 x 29 GB at 24 layers of qwen3-30b-a3b.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("prompts", "4096,32768", "Prompt lengths in tokens, comma-separated (e.g. 4096,32768,100000).",
                    flag_values=FLAGS)
flags.DEFINE_string("slot_fracs", "all,0.5,0.25", "Experts in slots, comma-separated: 'all' (every expert on the "
                    "device, offload off) or a share f in (0, 1]: expert_cache_slots = round(f * E), pcie_frac=1.",
                    flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per request (the first from the prefill).", lower_bound=2,
                     flag_values=FLAGS)
flags.DEFINE_string("arms", "default", "Engine / request option sets, ';'-separated; each 'default' (no option) or a "
                    "','-separated list of option=value (e.g. 'default;spec=0;prefill_chunk=512'). The bench sets "
                    "expert_cache_slots, pcie_frac, context, max_new_tokens, temperature and seed itself.",
                    flag_values=FLAGS)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (seeded). 1 by default: greedy decoding over random "
                   "weights falls into repeated tokens; 0 = greedy (the tokens of every placement then compare).",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight, activation and KV cache dtype.",
                  flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each measurement).",
                    flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the random weights, the prompts and the sampling.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("llama_bench", "", "The peer's llama-bench binary ('' = no peer columns).", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

HEADERS = ["prompt", "experts in slots", "arm", "TTFT s", "prefill tok/s", "TTFT x all", "TTFT floor s",
           "llama.cpp TTFT s", "decode tok/s", "decode x all", "roofline tok/s", "% of roofline",
           "llama.cpp tg tok/s", "prefill PCIe GB", "decode PCIe MB/token"]
TIMING = ("TTFT: one generate() call's prefill (prompt -> first token), synced; decode tok/s: the same call's decode "
          "windows (engine.stats)")
flags.DEFINE_string("gguf", "", "The peer's GGUF of the same shape; written with benchmarks/peer/write_gguf.py when "
                    "missing ('' = /tmp/<model>-<layers>.gguf).", flag_values=FLAGS)
flags.DEFINE_string("gguf_py", "/tmp/llama.cpp/gguf-py", "gguf-py of the peer's source tree (to write the GGUF).",
                    flag_values=FLAGS)
flags.DEFINE_bool("peer_ncmoe", True, "Also run the peer at each slot fraction f < 1 with the experts of round((1 - f) "
                  "x layers) layers on the CPU (llama-bench -ncmoe, the same VRAM budget), at the shortest prompt "
                  "only (its prefill runs at CPU speed), one repetition.", flag_values=FLAGS)
flags.DEFINE_integer("peer_reps", 2, "llama-bench -r (each tg @ d<N> repetition prefills the N tokens again).",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("cache_dir", "", "Engine cache_dir: persistent compilation cache under <dir>/jax ('' = "
                    "~/.cache/strata_jax).", flag_values=FLAGS)
flags.DEFINE_integer("bw_mib", 0, "Array size of the read-bandwidth measurement in MiB (0 = 4096 on an accelerator, "
                     "64 on CPU).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("matmul_n", 0, "Size n of the [n, n] x [n, n] matmul whose rate is the prefill roofline's (0 = "
                     "8192 on an accelerator, 512 on CPU).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("copy_mib", 0, "Array size of the pinned host -> device copy in MiB (0 = 1024 on an accelerator, "
                     "64 on CPU; measured only when an offloaded fraction runs).", lower_bound=0, flag_values=FLAGS)

# Set by the bench (the slot fraction, the prompt lengths and the request flags): not in --arms.
RESERVED = ("expert_cache_slots", "pcie_frac", "context", "max_new_tokens", "temperature", "seed", "stop_token_ids",
            "ignore_eos")
TARGET_PROMPT, TARGET_FRAC, TARGET_RATIO = 32768, 0.25, 2.0


# ---- flags -------------------------------------------------------------------------------------------------------


def parse_slot_fracs(text: str) -> list:
    """'all,0.5,0.25' -> ['all', 0.5, 0.25] (deduplicated, in the given order): benchmarks.runner.parse_list."""
    return runner.parse_list(text, float, "slot_fracs", words=("all",), lo=0.0, hi=1.0, lo_open=True)


def _typed(name: str, value: str, kind: str):
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"--arms: {name}={value!r} is not an integer") from None
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"--arms: {name}={value!r} is not a number") from None
    if kind == "bool":
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"--arms: {name}={value!r} is not true or false")
    return value


def parse_arms(text: str) -> list[tuple[str, dict, dict]]:
    """'default;spec=0,window=1' -> [('default', {}, {}), ('spec=0,window=1', {'window': 1}, {'spec': 0})]: each arm's
    name, engine options and request options, typed as strata_jax.options declares them."""
    from strata_jax.options import EngineOptions, RequestOptions
    kinds = {f.name: (f.type, "engine") for f in dataclasses.fields(EngineOptions)}
    kinds.update({f.name: (f.type, "request") for f in dataclasses.fields(RequestOptions)})
    arms: list[tuple[str, dict, dict]] = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        engine, request = {}, {}
        if part != "default":
            for item in (i.strip() for i in part.split(",") if i.strip()):
                name, eq, value = item.partition("=")
                name, value = name.strip(), value.strip()
                if not eq or not name:
                    raise ValueError(f"--arms: {item!r} is not option=value")
                if name in RESERVED:
                    raise ValueError(f"--arms: {name} is set by the bench (--slot_fracs, --prompts, --new_tokens, "
                                     f"--temperature, --seed), not by an arm")
                if name not in kinds:
                    raise ValueError(f"--arms: unknown option {name} (engine and request options: "
                                     f"{', '.join(sorted(kinds))})")
                kind, where = kinds[name]
                (engine if where == "engine" else request)[name] = _typed(name, value, kind)
        if part in [a[0] for a in arms]:
            raise ValueError(f"--arms: {part!r} twice")
        arms.append((part, engine, request))
    if not arms:
        raise ValueError("--arms is empty (e.g. --arms='default;spec=0')")
    return arms


# ---- what the shape costs ----------------------------------------------------------------------------------------


def expected_distinct(e: int, k: int, tokens: int) -> float:
    """Expected distinct experts of a layer over `tokens` tokens that each route to K of E uniformly."""
    return e * (1.0 - (1.0 - k / e) ** tokens)


def shape_costs(cfg, dtype) -> dict:
    """Weight bytes (decode_bench.weight_bytes) and the matmul parameters a token runs, from the weights' shapes."""
    import jax
    from benchmarks.decode_bench import weight_bytes
    from strata_jax.model.weights import random_weights
    from strata_jax.model import moe
    abstract = jax.eval_shape(lambda: random_weights(cfg, 0, dtype))
    wb = weight_bytes(cfg, abstract, dtype.itemsize)
    layer_params = 0  # every layer's weights but the routed experts (norms are a rounding error)
    for layer in abstract.layers:
        leaves = jax.tree.leaves(layer)
        layer_params += sum(x.size for x in leaves)
        if isinstance(layer.ffn, moe.MoEWeights):
            layer_params -= sum(x.size for x in (layer.ffn.gate, layer.ffn.up, layer.ffn.down))
    return dict(weight_bytes=wb, layer_params=layer_params,
                expert_params=3 * cfg.hidden_size * cfg.moe_intermediate_size,
                head_params=cfg.hidden_size * cfg.vocab_size)


def decode_roofline(cfg, costs: dict, expert_itemsize: float, itemsize: int, kv_dtype: str, depth: float,
                    bandwidth: float) -> dict:
    """Bytes one decode token reads at `depth` (one token a step) and the tok/s they allow at `bandwidth`."""
    from strata_jax.model.kv_cache import cache_bytes
    wb = costs["weight_bytes"]
    non_expert = wb["fixed_non_expert"] + (0 if wb["tied"] else wb["embed_row"])
    experts = cfg.num_sparse_layers * cfg.num_experts_per_tok * cfg.expert_bytes(expert_itemsize)
    kv = cache_bytes(cfg, int(round(depth)), itemsize, 0, kv_dtype)
    state = 2 * cfg.state_bytes(itemsize) if cfg.has_linear else 0
    total = non_expert + experts + kv + state
    return dict(depth=depth, non_expert=non_expert, experts=experts, kv=kv, state=state, bytes=total,
                seconds=total / bandwidth, tok_s=bandwidth / total)


def prefill_floor(cfg, costs: dict, prompt: int, slots: int | None, expert_itemsize: float, itemsize: int,
                  kv_dtype: str, bandwidth: float, flops_per_s: float, pcie_Bps: float | None) -> dict:
    """The least time a prompt of `prompt` tokens can take: max(compute, bytes read once, misses fetched once)."""
    from strata_jax.model.kv_cache import cache_bytes
    wb = costs["weight_bytes"]
    flops = (2.0 * prompt * (costs["layer_params"] + cfg.num_sparse_layers * cfg.num_experts_per_tok
                             * costs["expert_params"])
             + 2.0 * costs["head_params"]
             + 2.0 * cfg.num_heads * cfg.head_dim * float(prompt) ** 2 * cfg.num_full_layers)
    distinct = expected_distinct(cfg.num_experts, cfg.num_experts_per_tok, prompt)
    ebytes = cfg.expert_bytes(expert_itemsize)
    read = (wb["fixed_non_expert"] + cfg.num_sparse_layers * distinct * ebytes
            + cache_bytes(cfg, prompt, itemsize, 0, kv_dtype))
    fetched = cfg.num_sparse_layers * max(0.0, distinct - slots) * ebytes if slots is not None else 0.0
    parts = dict(compute_s=flops / flops_per_s, read_s=read / bandwidth,
                 pcie_s=fetched / pcie_Bps if slots is not None and pcie_Bps else 0.0)
    bound = max(parts, key=parts.get)
    return dict(flops=flops, read_bytes=read, pcie_bytes=fetched, distinct_experts=distinct, **parts,
                floor_s=parts[bound], bound=bound.removesuffix("_s"))


def measure_matmul(n: int, dtype, reps: int = 10) -> dict:
    """FLOP/s of an [n, n] x [n, n] matmul in `dtype`, calls back to back (common.time_pipelined)."""
    import jax
    import jax.numpy as jnp
    key = jax.random.PRNGKey(1)
    a = jax.random.normal(key, (n, n), dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
    jax.block_until_ready(f(a, b))
    seconds = common.time_pipelined(lambda _: f(a, b), iters=reps)
    del a, b
    return dict(method=f"[{n}, {n}] x [{n}, {n}] {jnp.dtype(dtype).name} matmul, {reps} back to back", n=n,
                seconds=seconds, flops_per_s=2.0 * n ** 3 / seconds)


# ---- the peer ----------------------------------------------------------------------------------------------------


def run_peer(s, cfg, prompts: list[int], fracs=()) -> dict:
    """llama-bench pp<N> and tg<new_tokens> @ d<N> for each prompt length N (benchmarks/peer_bench.py's runner); with
    --peer_ncmoe, the same at the shortest prompt for each slot fraction f < 1 with -ncmoe round((1 - f) x layers)."""
    from benchmarks import peer_bench
    peer: dict = dict(ran=False, reason="", pp={}, tg={}, errors=[], ncmoe={})
    if not s.llama_bench:
        peer["reason"] = "no --llama_bench given"
        return peer
    if not Path(s.llama_bench).is_file():
        peer["reason"] = f"{s.llama_bench} not found (build it with benchmarks/peer/build_llama.sh)"
        return peer
    gguf = Path(s.gguf or f"/tmp/{s.model}-{cfg.num_layers}.gguf")
    try:
        peer_bench.ensure_gguf(s.model, cfg.num_layers, gguf, s.gguf_py)
    except Exception as e:  # noqa: BLE001 (gguf-py missing, disk full: the peer columns say why)
        peer["reason"] = f"writing the GGUF {gguf} failed ({e})"
        return peer
    model_args = [s.llama_bench, "-m", str(gguf), "-ngl", "99", "-fa", "1"]
    base = model_args + ["-r", str(s.peer_reps), "-o", "json"]
    sizes = ",".join(map(str, prompts))
    peer["commands"] = [base + ["-p", sizes, "-n", "0"], base + ["-p", "0", "-n", str(s.new_tokens), "-d", sizes]]
    ncmoe_of = {}  # command index -> (slot fraction, -ncmoe N)
    for f in (fracs if s.peer_ncmoe else ()):
        if f == "all":
            continue
        n_cpu = int(round((1 - float(f)) * cfg.num_layers))
        cpu = model_args + ["-r", "1", "-o", "json", "-ncmoe", str(n_cpu), "-t", str(os.cpu_count() or 1)]
        for cmd in (cpu + ["-p", str(min(prompts)), "-n", "0"],
                    cpu + ["-p", "0", "-n", str(s.new_tokens), "-d", str(min(prompts))]):
            ncmoe_of[len(peer["commands"])] = (float(f), n_cpu)
            peer["commands"].append(cmd)
    for i, cmd in enumerate(peer["commands"]):
        into = peer
        if i in ncmoe_of:
            f, n_cpu = ncmoe_of[i]
            into = peer["ncmoe"].setdefault(f, dict(ncmoe=n_cpu, pp={}, tg={}))
        t0 = time.perf_counter()
        records, error = peer_bench.llama_bench(cmd)
        if error is not None:
            peer["errors"].append(f"{' '.join(cmd[len(model_args):])}: {error}")
            common.progress(f"peer: failed: {error}")
            continue
        for rec in records:
            entry = dict(tok_s=rec["avg_ts"], tok_s_stdev=rec.get("stddev_ts"), avg_ns=rec.get("avg_ns"),
                         build=rec.get("build_commit"), gpu=rec.get("gpu_info"))
            if rec.get("n_gen", 0) == 0 and rec.get("n_prompt", 0) > 0:
                entry["ttft_s"] = rec["n_prompt"] / rec["avg_ts"] if rec["avg_ts"] else None
                into["pp"][int(rec["n_prompt"])] = entry
                common.progress(f"peer: pp{rec['n_prompt']}: {rec['avg_ts']:,.1f} tok/s")
            elif rec.get("n_gen", 0) > 0:
                into["tg"][int(rec.get("n_depth", 0))] = entry
                common.progress(f"peer: tg{rec['n_gen']} @ d{rec.get('n_depth', 0)}: {rec['avg_ts']:,.1f} tok/s")
        common.progress(f"peer: {time.perf_counter() - t0:.1f} s")
    peer["ran"] = bool(peer["pp"] or peer["tg"])
    if not peer["ran"]:
        peer["reason"] = "llama-bench failed: " + "; ".join(peer["errors"])
    return peer


# ---- engines -----------------------------------------------------------------------------------------------------


def build_engine(cfg, seed: int, slots: int | None, options: dict):
    """An engine over the random weights of `seed`: offloaded (slots = S) through Engine.from_random; all resident
    (slots None) from the same list-form random_weights, stacked here (from_random's all-resident path draws its
    stacked weights directly, with other values)."""
    import jax.numpy as jnp
    from strata_jax.model.weights import can_stack, random_weights, stack_layers
    from strata_jax.offload import placement as placement_mod
    from strata_jax.engine.api import Engine
    from strata_jax.engine.build import enable_compilation_cache
    from strata_jax.options import EngineOptions, build
    if slots is not None:
        return Engine.from_random(cfg, seed=seed, verbose=False, expert_cache_slots=str(slots), pcie_frac="1",
                                  **options)
    opts = build(EngineOptions, dict(options, expert_cache_slots="all"))
    enable_compilation_cache(opts.resolved_cache_dir())
    weights = random_weights(cfg, seed, jnp.dtype(opts.dtype),
                                   expert_format=placement_mod.expert_format(opts, cfg))
    if opts.layer_loop == "scan" and can_stack(cfg):
        weights = stack_layers(weights, consume=True)  # one copy of the model at a time
    return Engine(cfg, weights, opts, verbose=False)


def make_prompts(cfg, prompts: list[int], seed: int) -> tuple[list[int], dict[int, list[int]]]:
    """The warm-up prompt (the shortest length) and one prompt per length: random ids, every first token different
    (a request never starts with the last one's tokens, so none reuses KV rows)."""
    import numpy as np
    rng = np.random.default_rng(seed + 1)
    firsts = rng.choice(cfg.vocab_size, size=len(prompts) + 1, replace=False)
    made = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in [min(prompts)] + prompts]
    for ids, first in zip(made, firsts):
        ids[0] = int(first)
    return made[0], dict(zip(prompts, made[1:]))


def repeating_prompt(prompt: list[int], motif: int = 8) -> list[int]:
    """A prompt of the same length that repeats its first `motif` tokens: the n-gram drafter proposes from the
    first window on (a warm-up that runs the verify windows of every size)."""
    return (prompt[:motif] * (len(prompt) // motif + 1))[:len(prompt)]


# ---- the table ---------------------------------------------------------------------------------------------------


def slots_cell(r: dict) -> str:
    return "all" if r["slot_frac"] == "all" else f"{r['slots']} ({r['slot_frac']:g})"


def finish_rows(result: dict) -> None:
    """Ratios to the all-resident row of the same arm and prompt, and the token comparison, from what is there."""
    base = {(r["arm"], r["prompt"]): r for r in result["rows"] if r["slot_frac"] == "all"}
    for r in result["rows"]:
        b = base.get((r["arm"], r["prompt"]))
        r["ttft_x_all_resident"] = r["prefill_s"] / b["prefill_s"] if b and b["prefill_s"] else None
        r["decode_x_all_resident"] = r["decode_tok_s"] / b["decode_tok_s"] if b and b["decode_tok_s"] else None
        r["tokens_match_all_resident"] = (r["tokens"] == b["tokens"]) if b else None


def _ncmoe_entry(peer: dict, frac) -> dict:
    """The peer's -ncmoe figures of a slot fraction (JSON turns the float keys into strings)."""
    for key, entry in (peer.get("ncmoe") or {}).items():
        if abs(float(key) - float(frac)) < 1e-9:
            return entry
    return {}


def make_table(result: dict) -> str:
    return common.format_table(HEADERS, table_cells(result))


def bench_rows(s, result: dict) -> list:
    """The table's rows in benchmarks/runner.py's schema."""
    return runner.rows_from_table("long_context_bench", HEADERS, table_cells(result),
                                  params=["prompt", "experts in slots", "arm"], timing=TIMING,
                                  fixed=dict(model=s.model, layers=s.layers, dtype=s.dtype, new_tokens=s.new_tokens,
                                             temperature=s.temperature),
                                  units={"TTFT x all": "x", "decode x all": "x", "prefill PCIe GB": "GB",
                                         "decode PCIe MB/token": "MB"})


def table_cells(result: dict) -> list[list]:
    order = {k: i for i, k in enumerate(result["prompts"])}
    fracs = {(f if f == "all" else float(f)): i for i, f in enumerate(result["slot_fracs"])}
    arms = {a: i for i, a in enumerate(result["arm_names"])}
    rows = sorted(result["rows"], key=lambda r: (order[r["prompt"]], fracs[r["slot_frac"]], arms[r["arm"]]))
    peer = result.get("peer") or {}
    cells = []
    for r in rows:
        # the peer at the same VRAM budget: all on the GPU beside 'all', -ncmoe beside a slot fraction
        same = peer if r["slot_frac"] == "all" else _ncmoe_entry(peer, r["slot_frac"])
        pp = (same.get("pp") or {}).get(r["prompt"]) or {}
        tg = (same.get("tg") or {}).get(r["prompt"]) or {}
        ratio = lambda v: v if v is not None else "-"  # noqa: E731
        cells.append([r["prompt"], slots_cell(r), r["arm"], r["prefill_s"], r["prefill_tok_s"],
                      ratio(r["ttft_x_all_resident"]), r["prefill_floor"]["floor_s"], pp.get("ttft_s") or "-",
                      r["decode_tok_s"], ratio(r["decode_x_all_resident"]), r["decode_roofline"]["tok_s"],
                      100 * r["decode_tok_s"] / r["decode_roofline"]["tok_s"], tg.get("tok_s") or "-",
                      r["prefill_pcie_bytes"] / 1e9, r["decode_pcie_bytes_per_token"] / 1e6])
    return cells


# ---- the run -----------------------------------------------------------------------------------------------------


def run(s) -> dict:
    """The benchmark with settings `s` (the parsed FLAGS or any object with the same attributes); returns all
    numbers (also written to s.json when set)."""
    from strata_jax.model.config import preset
    from strata_jax.errors import StrataError

    prompts = common.int_list(s.prompts, "prompts")
    fracs = parse_slot_fracs(s.slot_fracs)
    arms = parse_arms(s.arms)
    full = preset(s.model)
    cfg = preset(s.model, layers=s.layers if s.layers and s.layers < full.num_layers else None)
    if not any(cfg.sparse_layers):
        raise StrataError(f"the {s.model} preset cut to {cfg.num_layers} layers has no MoE layer")
    context = max(prompts) + s.new_tokens
    e, k, n_moe = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_sparse_layers
    # (slot fraction, S): several fractions may give the same S on a small model: keep the first
    slot_arms: list[tuple] = []
    for f in fracs:
        slots = None if f == "all" else min(e, max(1, int(round(f * e))))
        if slots not in [x[1] for x in slot_arms]:
            slot_arms.append((f, slots))
    offloaded = any(slots is not None for _, slots in slot_arms)
    result = dict(benchmark="long_context_bench", settings={n: getattr(s, n) for n in FLAGS}, prompts=prompts,
                  slot_fracs=[f for f, _ in slot_arms], arm_names=[a[0] for a in arms], context=context,
                  model=dict(preset=s.model, layers=cfg.num_layers, moe_layers=n_moe, experts=e, top_k=k,
                             hidden=cfg.hidden_size, expert_intermediate=cfg.moe_intermediate_size,
                             vocab=cfg.vocab_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings),
                  timing_scope=("TTFT = stats.last.prefill_s: the whole prompt through the prefill graphs until the "
                                "first token is known on the host; decode tok/s = stats.last.decode_tok_s: the "
                                "tokens after the first over the generate loop's seconds"),
                  rows=[], engines=[], complete=False)

    def save():
        finish_rows(result)
        if s.json:
            common.write_json(s.json, result)

    with runner.sigterm_stops(result, common.progress) as stopped:
        _measure(s, cfg, prompts, slot_arms, arms, context, offloaded, result, save)
    save()
    _report(s, cfg, result)
    save()
    if stopped:
        sys.exit(143)
    return result


def _measure(s, cfg, prompts, slot_arms, arms, context, offloaded, result, save) -> None:
    import jax
    import jax.numpy as jnp
    from benchmarks.offload_bench import host_ram_bytes, measure_device_put
    from strata_jax.offload import slots as slots_mod
    from strata_jax.offload import placement as placement_mod
    from strata_jax.errors import StrataError
    from strata_jax.options import EngineOptions, build

    say = common.say
    e, k, n_moe = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_sparse_layers
    # ---- the peer first: JAX takes most of the GPU's memory once it starts ----
    result["peer"] = run_peer(s, cfg, prompts, [f for f, _ in slot_arms])
    save()

    dtype = jnp.dtype(s.dtype)
    dev = common.device_info()
    on_cpu = dev["platform"] == "cpu"
    result["device"] = dev
    experts_total = n_moe * e * cfg.expert_bytes(dtype.itemsize)
    ram = host_ram_bytes()
    if offloaded and ram and 2 * experts_total > 0.85 * ram:
        raise StrataError(f"offload holds the experts twice in host memory (pinned + the pool's copy): 2 x "
                          f"{common.fmt_bytes(experts_total)} do not fit in {common.fmt_bytes(ram)} "
                          "(cut with --layers)")

    # ---- rates of the roofline, before any engine holds memory ----
    bw_bytes = (s.bw_mib or (64 if on_cpu else 4096)) * 2**20
    common.progress(f"measuring the read bandwidth over {bw_bytes / 2**30:.2f} GiB (a sum and a GEMV, back to back)")
    bw = common.measure_read_bandwidth(bw_bytes, reps=10)
    n = s.matmul_n or (512 if on_cpu else 8192)
    common.progress(f"measuring the matmul rate ([{n}, {n}] x [{n}, {n}] {s.dtype})")
    mm = measure_matmul(n, dtype)
    result["bandwidth"] = dict(read=bw, matmul=mm)
    pcie_Bps = None
    if offloaded:
        copy_bytes = (s.copy_mib or (64 if on_cpu else 1024)) * 2**20
        host_kind = slots_mod.host_memory_kind()
        common.progress(f"measuring {host_kind} -> device jax.device_put over {copy_bytes / 2**20:.0f} MiB")
        result["bandwidth"]["device_put"] = measure_device_put(copy_bytes, host_kind)
        pcie_Bps = result["bandwidth"]["device_put"]["GBps"] * 1e9
    costs = shape_costs(cfg, dtype)
    result["shape_costs"] = costs
    save()

    nominal = common.nominal_bandwidth(dev["device_kind"])
    say(f"long_context_bench: {s.model}, {cfg.num_layers} layers ({n_moe} MoE, {e} experts top-{k}, "
        f"H={cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv x {cfg.head_dim}, expert "
        f"I={cfg.moe_intermediate_size}, V={cfg.vocab_size}), {s.dtype}, random weights (seed {s.seed}); experts "
        f"{common.fmt_bytes(experts_total)}")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}, python {dev['python']}; host RAM "
        f"{common.fmt_bytes(ram) if ram else '?'}")
    say(f"prompts: {', '.join(map(str, prompts))} tokens, then {s.new_tokens} new tokens (context {context}); "
        + (f"temperature {s.temperature:g} (seeded)" if s.temperature else "greedy")
        + "; stop tokens off; experts in slots: "
        + ", ".join("all (every expert on the device)" if sl is None else f"{sl} of {e} ({f:g}), pcie_frac=1"
                    for f, sl in slot_arms) + "; arms: " + "; ".join(a[0] for a in arms))
    if max(prompts) > cfg.max_position_embeddings:
        say(f"note: prompts past the preset's max_position_embeddings ({cfg.max_position_embeddings}): random "
            f"weights, so RoPE there is only arithmetic")
    say("timed: per engine, two untimed warm-up requests (the shortest length: random ids, then a repeating motif that "
        "runs every verify window size), then one request per "
        "prompt length. TTFT = stats.last.prefill_s: the whole prompt through the prefill graphs (chunk by chunk) "
        "until the first token is known on the host; prefill tok/s = prompt tokens / TTFT. decode tok/s = "
        "stats.last.decode_tok_s: the generate loop's tokens after the first over their seconds, deep in the "
        "context (positions prompt .. prompt + new tokens)")
    say(f"read bandwidth (measured now): {bw['bandwidth_Bps'] / 1e9:,.0f} GB/s [{bw['method']}]"
        + (f"; nominal {nominal / 1e9:,.0f} GB/s (datasheet)" if nominal else "")
        + f"; matmul: {mm['flops_per_s'] / 1e12:,.2f} TFLOP/s [{mm['method']}]"
        + (f"; pinned host -> device: {pcie_Bps / 1e9:,.1f} GB/s [jax.device_put]" if pcie_Bps else ""))
    say()

    warm_prompt, prompt_ids = make_prompts(cfg, prompts, s.seed)
    for frac, slots in slot_arms:
        for name, engine_opts, request_opts in arms:
            label = f"[{'all' if slots is None else f'S={slots} ({frac:g})'}, {name}]"
            options = dict(engine_opts, dtype=engine_opts.get("dtype", s.dtype), context=context,
                           cache_dir=s.cache_dir)
            opts = build(EngineOptions, dict(options, expert_cache_slots="all" if slots is None else str(slots)))
            expert_itemsize = placement_mod.expert_itemsize(opts)
            itemsize = jnp.dtype(opts.dtype).itemsize
            common.progress(f"{label} building the engine: random weights"
                            + (" (experts to pinned host memory)" if slots is not None else " (all on the device)")
                            + f", compiling its window and prefill graphs (context {context})")
            t0 = time.perf_counter()
            engine = build_engine(cfg, s.seed, slots, options)
            build_s = time.perf_counter() - t0
            chunks = list(getattr(engine, "chunks", None) or [engine.chunk])
            info = dict(slot_frac=frac, slots="all" if slots is None else slots, arm=name, options=options,
                        build_s=build_s, compile_s=engine.stats.compile_s, scanned=engine.scanned,
                        prefill_chunks=chunks, kernels=dict(expert=engine.expert_kernel,
                                                            attention=engine.attention_kernel,
                                                            dense=engine.dense_kernel),
                        placement=list(engine.placement.lines) if engine.placement else None)
            result["engines"].append(info)
            common.progress(f"{label} built in {build_s:.1f} s (compile {engine.stats.compile_s:.1f} s); "
                            f"layers {'scanned' if engine.scanned else 'unrolled'}, prefill chunks "
                            f"{'/'.join(map(str, chunks))}, kernels expert {engine.expert_kernel} / attention "
                            f"{engine.attention_kernel}")
            for line in info["placement"] or []:
                common.progress(f"{label}   {line}")
            request = dict(max_new_tokens=s.new_tokens, temperature=s.temperature, seed=s.seed, stop_token_ids=[],
                           **request_opts)
            common.progress(f"{label} warm-up request ({len(warm_prompt)} tokens, untimed)")
            t0 = time.perf_counter()
            engine.generate(warm_prompt, **request)
            # and one whose n-gram drafts are found at once: every verify window size runs once untimed (a GPU
            # loads a graph's kernels at its first launch, tens of ms, which would land in the first timed request)
            engine.generate(repeating_prompt(warm_prompt), **request)
            info["warmup_s"] = time.perf_counter() - t0
            for p in prompts:
                common.progress(f"{label} prompt {p}: prefill + {s.new_tokens} tokens")
                t0 = time.perf_counter()
                tokens = engine.generate(prompt_ids[p], **request)
                wall = time.perf_counter() - t0
                st = engine.stats.last
                pe, de = st.prefill_experts, st.decode_experts
                steps = max(st.generated_tokens - 1, 1)
                depth = p + s.new_tokens / 2
                row = dict(prompt=p, slot_frac=frac, slots="all" if slots is None else slots, arm=name,
                           prompt_tokens=st.prompt_tokens, cached_tokens=st.cached_tokens, prefill_s=st.prefill_s,
                           prefill_tok_s=st.prefill_tok_s, decode_s=st.decode_s, decode_tok_s=st.decode_tok_s,
                           generated_tokens=st.generated_tokens, request_s=wall, windows=st.windows,
                           drafts_proposed=st.drafts_proposed, drafts_accepted=st.drafts_accepted,
                           prefill_experts=dict(vars(pe), hit_rate=pe.hit_rate) if engine.placement else None,
                           decode_experts=dict(vars(de), hit_rate=de.hit_rate) if engine.placement else None,
                           prefill_pcie_bytes=pe.pcie_bytes, decode_pcie_bytes_per_token=de.pcie_bytes / steps,
                           decode_hit_rate=de.hit_rate if engine.placement else 1.0,
                           decode_roofline=decode_roofline(cfg, costs, expert_itemsize, itemsize, opts.kv_dtype,
                                                           depth, bw["bandwidth_Bps"]),
                           prefill_floor=prefill_floor(cfg, costs, p, slots, expert_itemsize, itemsize,
                                                       opts.kv_dtype, bw["bandwidth_Bps"], mm["flops_per_s"],
                                                       pcie_Bps),
                           tokens=tokens)
                result["rows"].append(row)
                save()
                x = row["ttft_x_all_resident"]
                common.progress(f"{label} prompt {p}: TTFT {st.prefill_s:.3f} s ({st.prefill_tok_s:,.0f} tok/s"
                                + (f", {x:.2f}x all-resident" if x is not None and slots is not None else "")
                                + f"), decode {st.decode_tok_s:,.1f} tok/s"
                                + (f"; PCIe {common.fmt_bytes(pe.pcie_bytes)} in the prefill (hit rate "
                                   f"{pe.hit_rate:.0%}), {common.fmt_bytes(row['decode_pcie_bytes_per_token'])}/token "
                                   f"in the decode (hit rate {de.hit_rate:.0%})" if engine.placement else ""))
                if st.cached_tokens:
                    common.progress(f"{label} note: {st.cached_tokens} prompt tokens reused from the last request")
            common.free_engine(engine)
            del engine
            common.free_device_memory()


def _report(s, cfg, result: dict) -> None:
    say = common.say
    if not result["rows"]:
        say("no measurement finished")
        return
    table = make_table(result)
    result["table"] = table
    runner.emit(bench_rows(s, result), getattr(s, "output", "md"), table=table, result=result)
    say()
    bw = result["bandwidth"]
    mm = bw["matmul"]
    rows = result["rows"]
    say(f"roofline, decode: tok/s = {bw['read']['bandwidth_Bps'] / 1e9:,.0f} GB/s (read bandwidth, measured) / the "
        f"bytes a token reads: non-expert weights + top-{cfg.num_experts_per_tok} experts x {cfg.num_sparse_layers} "
        f"MoE layers + the KV rows up to the mean depth (prompt + new tokens / 2); one token a step (no drafts); "
        f"the same for every slot fraction (fetches are PCIe, not HBM: see the PCIe columns)")
    say(f"roofline, prefill (TTFT floor): the largest of FLOPs / {mm['flops_per_s'] / 1e12:,.2f} TFLOP/s (matmul "
        f"measured; 2 x active params x P + 2 x heads x head_dim x P^2 per attention layer (causal scores and "
        f"values) + lm_head once), the bytes read once / the read bandwidth, and (offloaded) the routed experts "
        f"beyond the slots fetched once / the pinned host -> device rate. Why: a long prompt is compute-bound on "
        f"the device, and with offload the misses must cross PCIe at least once; a layer-by-layer prefill would "
        f"meet it, the engine's chunked prefill reads or fetches the routed experts once per chunk. Bound by "
        f"(prompt / experts in slots): "
        + ", ".join(f"{r['prompt']} / {slots_cell(r)}: {r['prefill_floor']['bound']}" for r in rows
                    if r["arm"] == result["arm_names"][0]))
    chunks = sorted({tuple(i["prefill_chunks"]) for i in result["engines"]})
    say(f"prefill chunks of the engines: {', '.join('/'.join(map(str, c)) for c in chunks)} tokens "
        f"(engine option prefill_chunk, default unless an arm sets it)")
    target = [r for r in rows if r["prompt"] == TARGET_PROMPT and r["slot_frac"] == TARGET_FRAC]
    if target:
        for r in target:
            x = r["ttft_x_all_resident"]
            verdict = ("no all-resident row to compare" if x is None else
                       f"{x:.2f}x: {'met' if x <= TARGET_RATIO else 'not met'}")
            say(f"target: a {TARGET_PROMPT}-token prompt with {TARGET_FRAC:.0%} of the experts in slots within "
                f"{TARGET_RATIO:g}x of all-resident's TTFT, arm {r['arm']}: {verdict}")
    else:
        say(f"target ({TARGET_PROMPT}-token prompt, {TARGET_FRAC:g} of the experts in slots, TTFT within "
            f"{TARGET_RATIO:g}x of all-resident): not in this run")
    compared = [r for r in rows if r["slot_frac"] != "all" and r["tokens_match_all_resident"] is not None]
    if compared:
        same = sum(r["tokens_match_all_resident"] for r in compared)
        say(f"tokens identical to all-resident's (same prompt, same arm) in {same} of {len(compared)} offloaded rows "
            f"(the same weights; {'greedy' if not s.temperature else f'sampled at {s.temperature:g}, seeded'}; a "
            f"difference comes from float summation order flipping a near-tie, bf16 more than float32)")
    spec = []
    for name in result["arm_names"]:
        mine = [r for r in rows if r["arm"] == name]
        proposed = sum(r["drafts_proposed"] for r in mine)
        if proposed:
            spec.append(f"{name}: {sum(r['drafts_accepted'] for r in mine)} of {proposed} drafts accepted in "
                        f"{sum(r['windows'] for r in mine)} windows")
    if spec:
        say("verify windows (decode, all rows): " + "; ".join(spec) + " (llama-bench's tg does not speculate; "
            "spec=0 is the like-for-like arm)")
    peer = result.get("peer") or {}
    if peer.get("ran"):
        gpu = next((v.get("gpu") for d in (peer["pp"], peer["tg"]) for v in d.values()), None)
        say(f"llama.cpp: llama-bench -ngl 99 -fa 1 (every layer on the GPU{f', {gpu}' if gpu else ''}), F16 GGUF of "
            f"the same shape, mean of -r {s.peer_reps}: TTFT = N / pp<N> tok/s; tg = tg{s.new_tokens} @ d<N>"
            + ("; errors: " + "; ".join(peer["errors"]) if peer["errors"] else ""))
        for key, entry in (peer.get("ncmoe") or {}).items():
            say(f"llama.cpp beside {float(key):g} of the experts in slots: -ncmoe {entry['ncmoe']} (the experts of "
                f"{entry['ncmoe']} of {cfg.num_layers} layers in host memory, computed on the CPU with -t "
                f"{os.cpu_count()}), at the shortest prompt, -r 1; '-' at the longer prompts (a CPU-speed prefill "
                f"of them takes minutes)")
    else:
        say(f"llama.cpp columns '-': {peer.get('reason') or 'not run'}")
    if result.get("stopped"):
        say(f"stopped: {result['stopped']}")
    if result.get("device", {}).get("platform") == "cpu":
        say("CPU: 'device' and host are the same memory here; the numbers check the path, not PCIe or HBM")
    if s.json:
        say(f"json: {s.json}")


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.long_context_bench", run)


if __name__ == "__main__":
    main(sys.argv)
