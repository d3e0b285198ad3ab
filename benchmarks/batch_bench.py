"""Aggregate decode speed of batched windows (issue 38): B sequences decoded together (Engine.generate_batch), every
expert resident or offloaded (--expert_cache_slots), beside one sequence alone through the engine's own T=1 loop
(generate, spec=0).

    python -m benchmarks.batch_bench --model=tiny --batch=1,2,4 --new_tokens=16        # CPU, seconds
    python -m benchmarks.batch_bench --model=tiny --batch=1,2,4 --new_tokens=16 --expert_cache_slots=25% --pcie_frac=0.5
    python -m benchmarks.batch_bench --model=qwen3-30b-a3b --batch=1,2,4,8 --json=$OUT/batch.json   # a GPU
    python -m benchmarks.batch_bench --model=qwen3-30b-a3b --batch=1,2,4,8 --expert_cache_slots=25% --pcie_frac=1

One engine over random weights (max_batch = the largest B); for each B, B random prompts of --prompt tokens, a
warm-up batch (the bucket's graph compiles), then the timed batch: every prompt generates --new_tokens greedy
tokens (no stop token). Aggregate tok/s = the batch's decoded tokens (each prompt's first token comes from its
prefill, as RequestStats.decode_tok_s counts) over the batched decode's wall time; per-stream tok/s = aggregate / B.
The 'alone' row is the T=1 loop of generate(spec=0) on the first prompt: what B=1 of the batched graph costs
beside it. Random weights route near-uniformly: a batch's rows share fewer experts than a trained model's would.

With offload (--expert_cache_slots a number or a share of the experts, N%; --pcie_frac the split of the misses) a
batched window's rows share its plan: the union of their experts is fetched once and the pool's job runs over all
the rows. Extra columns: the distinct experts a window (summed over layers) that were fetched and that ran on the
pool, and the slot hit rate (the share of a window's distinct experts already in a slot), from the in-graph counters.

--attention_share: for each B also one layer's batched attention alone (`attention_layer_ms`: the rows' K/V scatter
and model/batch.batch_attend_cache, the engine's attention kernel, without the q/k/v and o products), timed back to
back on a fresh batch cache at the decode's middle position, and its share of a window: layers x that / ms/window
(ms/window includes the host loop, so the share is a floor on the device's).
"""
from __future__ import annotations

import sys
import time

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "tiny", "Model preset from configs/ (a Qwen3-MoE shape: tiny, qwen3-30b-a3b).",
                    flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("batch", "1,2,4,8", "Batch sizes B to time, comma-separated (max_batch = the largest).",
                    flag_values=FLAGS)
flags.DEFINE_integer("prompt", 128, "Prompt tokens per sequence.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 128, "Tokens each sequence generates.", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight, activation and KV cache dtype.",
                  flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompts.", flag_values=FLAGS)
flags.DEFINE_float("embed_scale", 50.0, "The random embedding scaled by this (Engine.from_random: 50 spreads the "
                   "routing over most experts, as a trained model's).", flag_values=FLAGS)
flags.DEFINE_string("expert_cache_slots", "all", "Device expert slots a layer: all (every expert resident), a "
                    "number, or a share of the experts (25%: offload at a quarter of them).", flag_values=FLAGS)
flags.DEFINE_string("pcie_frac", "1", "With offload: the share of missed experts fetched over PCIe (0..1, or auto); "
                    "the rest run on the host pool.", flag_values=FLAGS)
flags.DEFINE_string("cache_dir", "", "The engine's cache_dir ('' = its default).", flag_values=FLAGS)
flags.DEFINE_bool("attention_share", False, "Also time one layer's batched attention alone (K/V scatter + "
                  "attention, per B) and print its share of a window.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

HEADERS = ["B", "aggregate tok/s", "per-stream tok/s", "ms/window", "x alone"]
TIMING = "wall time of the batched decode (after each prompt's prefill), host loop included"
ATTENTION_HEADERS = ["attn ms/layer", "attn share"]
OFFLOAD_HEADERS = ["fetched/window", "pool/window", "hit rate"]


def slots_option(text: str, n_experts: int) -> str:
    """--expert_cache_slots: 'all', a number, or N% of the experts (at least 0, rounded down) -> the engine's value."""
    text = text.strip()
    if text.endswith("%"):
        return str(int(float(text[:-1]) / 100 * n_experts))
    return text


def offload_cells(stats, windows: int) -> tuple[dict, list]:
    """A run's expert counters (ExpertStats) -> the offload numbers per window (distinct experts summed over
    layers) and their cells."""
    per = max(windows, 1)
    row = dict(fetched_per_window=stats.distinct_fetched / per, pool_per_window=stats.distinct_cpu / per,
               hit_rate=stats.hit_rate, pcie_bytes=stats.pcie_bytes)
    return row, [row["fetched_per_window"], row["pool_per_window"], row["hit_rate"]]


def attention_layer_ms(engine, b: int, position: int, iters: int = 50) -> float:
    """One layer's batched attention as batch_attention runs it, without the q/k/v and o products: B rows' K/V
    scattered into slots 0..B-1 of layer 0 at `position`, then batch_attend_cache over them (the engine's attention
    kernel) -> ms per call, back to back, a fresh batch cache donated and threaded from call to call (in place)."""
    import functools

    import jax
    import jax.numpy as jnp
    from strata_jax.model.batch import batch_attend_cache
    from strata_jax.model.kv_cache import _scatter_rows
    cfg = engine.cfg
    kernel = engine.plan.attention_kernel == "pallas"

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(q, k_all, v_all, rows, pos, kv):
        k_all, v_all = _scatter_rows(k_all, rows, pos, kv), _scatter_rows(v_all, rows, pos, kv)
        return batch_attend_cache(q, k_all, v_all, rows, pos, kernel), k_all, v_all

    keys = jax.random.split(jax.random.key(b), 2)
    q = jax.random.normal(keys[0], (b, cfg.num_heads, cfg.head_dim), engine.dtype)  # [B, Nq, D]
    kv = jax.random.normal(keys[1], (b, cfg.num_kv_heads, cfg.head_dim), engine.dtype)  # [B, Nkv, D]
    rows, pos = jnp.arange(b, dtype=jnp.int32), jnp.full((b,), position, jnp.int32)
    cache = engine._init_batch_cache()  # [L*M, S, Nkv, D]
    state = [cache.k, cache.v]

    def call(_):
        out, state[0], state[1] = step(q, state[0], state[1], rows, pos, kv)
        return out, state[0]
    jax.block_until_ready(call(0))  # compiles
    return common.time_pipelined(call, iters) * 1e3


def run(s) -> dict:
    import numpy as np
    from strata_jax.engine.api import Engine
    from strata_jax.model.config import preset

    batches = runner.parse_list(s.batch, int, "batch", lo=1, hi=64)
    full = preset(s.model)
    cfg = preset(s.model, layers=s.layers if s.layers and s.layers < full.num_layers else None)
    dev = common.device_info()
    slots = slots_option(s.expert_cache_slots, cfg.num_experts)
    offload = slots != "all"
    common.say(f"batch_bench: {s.model}, {cfg.num_layers} layers, {cfg.num_experts} experts top-"
               f"{cfg.num_experts_per_tok}, {s.dtype}, random weights (seed {s.seed}); {dev['device_kind']}; "
               f"{s.prompt} prompt tokens, {s.new_tokens} greedy tokens per sequence; "
               + (f"offload: {slots} slots a layer, pcie_frac={s.pcie_frac}" if offload else "every expert resident"))
    options = dict(dtype=s.dtype, context=s.prompt + s.new_tokens, expert_cache_slots=slots, window=1,
                   max_batch=max(batches))
    if offload:
        options["pcie_frac"] = s.pcie_frac
    if s.cache_dir:
        options["cache_dir"] = s.cache_dir
    t0 = time.perf_counter()
    engine = Engine.from_random(cfg, seed=s.seed, verbose=False, embed_scale=s.embed_scale, **options)
    common.progress(f"engine built in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(s.seed + 1)
    prompts = [rng.integers(0, cfg.vocab_size, s.prompt).tolist() for _ in range(max(batches))]
    request = dict(max_new_tokens=s.new_tokens, stop_token_ids=[])
    result = dict(benchmark="batch_bench", settings={n: getattr(s, n) for n in FLAGS}, device=dev, rows=[],
                  timing_scope=TIMING)

    engine.generate(prompts[0], **request, spec=0)  # warm-up: the T=1 loop alone
    engine.generate(prompts[0], **request, spec=0)
    alone = engine.stats.last
    alone_tok_s = alone.decode_tok_s
    result["alone"] = dict(tok_s=alone_tok_s, ms_window=alone.decode_s / max(alone.windows, 1) * 1e3)
    headers = HEADERS + (OFFLOAD_HEADERS if offload else []) + (ATTENTION_HEADERS if s.attention_share else [])
    cells = [["alone (generate, spec=0)", alone_tok_s, alone_tok_s, result["alone"]["ms_window"], 1.0]]
    if offload:
        numbers, more = offload_cells(alone.decode_experts, alone.windows)
        result["alone"].update(numbers)
        cells[-1] += more
    cells[-1] += ["-", "-"] if s.attention_share else []
    for b in batches:
        engine.generate_batch(prompts[:b], **request)  # warm-up: the bucket's graph compiles
        engine.generate_batch(prompts[:b], **request)
        last = engine.stats.last
        decoded = last.generated_tokens - b  # each prompt's first token came from its prefill
        tok_s = decoded / last.decode_s if last.decode_s > 0 else 0.0
        row = dict(batch=b, aggregate_tok_s=tok_s, per_stream_tok_s=tok_s / b,
                   ms_window=last.decode_s / max(last.windows, 1) * 1e3,
                   vs_alone=tok_s / alone_tok_s if alone_tok_s else None)
        cells.append([b, tok_s, tok_s / b, row["ms_window"], row["vs_alone"]])
        if offload:  # the batch's decode windows' counters (one ExpertStats for all its prompts)
            numbers, more = offload_cells(engine.stats.batch[0].decode_experts, last.windows)
            row.update(numbers)
            cells[-1] += more
        if s.attention_share:
            row["attention_ms_layer"] = attention_layer_ms(engine, b, s.prompt + s.new_tokens // 2)
            row["attention_share"] = cfg.num_layers * row["attention_ms_layer"] / row["ms_window"]
            cells[-1] += [row["attention_ms_layer"], row["attention_share"]]
        result["rows"].append(row)
        common.progress(f"B={b}: {tok_s:,.1f} tok/s aggregate")
    result["table"] = runner.table(s, "batch_bench", headers, cells, params=["B"], timing=TIMING,
                                   fixed=dict(model=s.model, layers=cfg.num_layers, dtype=s.dtype, prompt=s.prompt,
                                              new_tokens=s.new_tokens, expert_cache_slots=slots,
                                              pcie_frac=s.pcie_frac if offload else None),
                                   units={"ms/window": "ms", "x alone": "x", "attn ms/layer": "ms"}, result=result)
    if s.json:
        common.write_json(s.json, result)
        common.say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.batch_bench", run)


if __name__ == "__main__":
    main(sys.argv)
