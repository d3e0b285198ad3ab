"""Decode speed of the exact engine, all experts resident, beside the HBM roofline measured in the same run.

    python -m benchmarks.decode_bench --model=tiny --iters=5                       # CPU, seconds
    python -m benchmarks.decode_bench --model=qwen3-30b-a3b --windows=1,2,4,8 --json=out/decode.json   # H200

One question: how long does one `decode_window` call (embed -> all layers -> logits -> greedy argmax) take per window
size T, and how close is that to the time the bytes it must read take at the measured HBM bandwidth?

Bytes one step must read = non-expert weights (attention, norms, routers, dense MLPs, T embedding rows, final norm,
lm_head) + the distinct experts the window routes to (x expert size, per MoE layer) + the whole static KV cache
(the attention reads every position of it: 2 * layers * context * kv_heads * head_dim * itemsize). The distinct
expert count is measured from the routing of the benchmark's own windows (a per-layer probe replaying the same
tokens through the same weights), with the uniform-routing expectation E * (1 - (1 - K/E)^T) beside it.
Random weights route near-uniformly; a real checkpoint's windows share more experts (fewer distinct ones).

The bandwidth is a read measured back to back (common.measure_read_bandwidth: the larger of a big sum and a big
GEMV; ~4.4 TB/s on an H200, beside the datasheet's 4.8): what a decode step does, with no launch gap in it. The
"host ms (call)" column is the time the call takes to return: the host's share of a window, which the device
waits for when it is longer than the window's device time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()  # our own flag set, so this module can be imported beside strata_jax.decode
flags.DEFINE_string("model", "tiny", "Model preset from configs/ (tiny, qwen3-30b-a3b).", flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("windows", "1,2,4", "Window sizes T to time, comma-separated.", flag_values=FLAGS)
flags.DEFINE_integer("context", 2048, "KV cache length (static; the attention reads all of it every step).",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("pos", 512, "Fill position: the window is decoded at positions pos..pos+T-1.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight, activation and KV cache dtype.",
                  flag_values=FLAGS)
flags.DEFINE_integer("iters", 20, "Timed steps per window size (median and mean reported).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed steps per window size before timing.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each window size).",
                    flag_values=FLAGS)
flags.DEFINE_enum("hf", "auto", ["auto", "off"], "Also time Hugging Face transformers on the same shape (random "
                  "weights; benchmarks/hf_decode.py in a subprocess, before JAX takes the device) when torch and "
                  "transformers are importable, and print the ratio to it.", flag_values=FLAGS)
flags.DEFINE_enum("expert_kernel", "auto", ["auto", "xla", "pallas"], "Expert FFN: XLA gather + einsums, or the Pallas "
                  "kernel (pallas_kernels/expert_ffn.py; bf16 on a GPU).", flag_values=FLAGS)
flags.DEFINE_enum("route_kernel", "xla", ["xla", "pallas"], "The Pallas expert path's route: XLA's softmax and "
                  "sort, or softmax and top-K in one Pallas kernel (pallas_kernels/route_topk.py; engine option "
                  "route_kernel).", flag_values=FLAGS)
flags.DEFINE_enum("attention_kernel", "auto", ["auto", "xla", "pallas"], "Attention: XLA einsums over the whole static "
                  "cache, or the Pallas decode-attention kernel (reads the cache up to the window's last position).",
                  flag_values=FLAGS)
flags.DEFINE_enum("dense_kernel", "auto", ["auto", "xla", "pallas"], "Attention products (q/k/v, o): "
                  "pallas_kernels/stacked_linear.py (scanned: the stacks read in place) or XLA's.", flag_values=FLAGS)
flags.DEFINE_enum("delta_kernel", "auto", ["auto", "xla", "pallas"], "Qwen3-Next's DeltaNet decode rule (engine "
                  "option delta_kernel).", flag_values=FLAGS)
flags.DEFINE_enum("layer_loop", "scan", ["scan", "unrolled"], "Layers as one scanned body over weights stacked on "
                  "a layer axis (the engine's default), or unrolled (one copy per layer).", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the random weights and token ids.", flag_values=FLAGS)
flags.DEFINE_integer("bw_mib", 0, "Array size of the bandwidth read in MiB (0 = 4096 on an accelerator, 64 on CPU).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("probe_windows", 8, "Windows of the run whose routing is replayed to count distinct experts "
                     "(0 = off: the uniform expectation is used for the bytes).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("attention_splits", 0, "Splits of the cache positions in the Pallas decode-attention kernel "
                     "(0 = its auto_splits: two waves of programs on the GPU).", lower_bound=0, flag_values=FLAGS)
runner.define_output_flag(FLAGS)
flags.DEFINE_string("compilation_cache_dir", "", "Persistent JAX compilation cache folder ('' = off; then the "
                    "compile times shown are real compiles).", flag_values=FLAGS)


def expected_distinct(e: int, k: int, t: int) -> float:
    """Expected distinct experts of a T-token window when each token picks K of E uniformly at random."""
    return e * (1.0 - (1.0 - k / e) ** t)


def weight_bytes(cfg, abstract_weights, itemsize: int) -> dict:
    """Split the parameter bytes into what every step reads whatever the routing, and the experts."""
    import jax
    from strata_jax.model import moe
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_weights))
    experts = 0
    for layer in abstract_weights.layers:
        if isinstance(layer.ffn, moe.MoEWeights):
            experts += sum(x.size * x.dtype.itemsize for x in (layer.ffn.gate, layer.ffn.up, layer.ffn.down))
    embed = abstract_weights.embed.size * abstract_weights.embed.dtype.itemsize
    tied = abstract_weights.lm_head is None
    # Untied: a step reads T rows of the embedding table and all of lm_head. Tied: the table is the head, read whole.
    fixed = total - experts - (0 if tied else embed)
    return dict(total=total, experts_all=experts, embed_table=embed, tied=tied, fixed_non_expert=fixed,
                embed_row=cfg.hidden_size * itemsize, expert=cfg.expert_bytes(itemsize))


def make_probe(cfg, context: int, dtype):
    """Replays a window layer by layer (one small graph, compiled once per T) and returns each MoE layer's top-K ids.

    The timed run's cache holds zeros below `pos` and the window writes its own keys before attending, so a fresh
    zero cache per layer gives the same hidden states, hence the same routing, as the timed graph."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model import deltanet, moe
    from strata_jax.model import transformer
    from strata_jax.model.weights import MLPWeights

    @jax.jit
    def embed(table, tokens):
        return table[tokens]

    @jax.jit
    def layer_fn(layer, h, pos):
        t = h.shape[0]
        zeros = jnp.zeros((context, cfg.num_kv_heads, cfg.head_dim), dtype)
        x = transformer.norm(h, layer.attn_norm, cfg)
        if isinstance(layer.attn, deltanet.DeltaNetWeights):  # Qwen3-Next: a fresh state, as zeros for attention
            ring = t + 1
            a, _ = deltanet.deltanet(x, layer.attn, deltanet.init_state(cfg, ring, dtype),
                                     jnp.full((ring,), -1, jnp.int32), pos, jnp.int32(t), cfg)
        else:
            a, _, _ = transformer.attention(x, layer.attn, zeros, zeros, pos, cfg)
        h = h + a
        x = transformer.norm(h, layer.ffn_norm, cfg)
        if layer.shared is not None:
            h = h + transformer.shared_expert(x, layer)
        if isinstance(layer.ffn, MLPWeights):
            return h + transformer.dense_mlp(x, layer.ffn), jnp.zeros((t, 0), jnp.int32)
        valid = jnp.ones((t,), bool)
        ids = moe.route(x, layer.ffn.router, cfg, valid).topk_ids
        return h + moe.moe_block(x, layer.ffn, cfg, valid), ids

    def probe(weights, tokens, pos):
        h = embed(weights.embed, tokens)
        out = []
        for i in range(cfg.num_layers):
            layer = jax.tree.map(lambda a: a[i], weights.layers) if weights.stacked else weights.layers[i]
            h, ids = layer_fn(layer, h, pos)
            if cfg.sparse_layers[i]:
                out.append(ids)
        return [jax.device_get(x) for x in out]  # per MoE layer [T, K]
    return probe


def routing_stats(ids_per_window: list) -> dict:
    """Distinct experts per MoE layer per window: [windows][MoE layers] of top-K id arrays [T, K]."""
    import numpy as np
    arr = np.asarray([[len(np.unique(ids)) for ids in layers] for layers in ids_per_window], np.float64)
    return dict(windows=len(ids_per_window), mean_distinct=float(arr.mean()), min_distinct=int(arr.min()),
                max_distinct=int(arr.max()), mean_distinct_per_layer=arr.mean(axis=0).tolist())


def _xla_bytes(compiled) -> float | None:
    try:
        ca = compiled.cost_analysis()
        if isinstance(ca, (list, tuple)):
            ca = ca[0] if ca else {}
        v = (ca or {}).get("bytes accessed")
        return float(v) if v is not None else None
    except Exception:
        return None


def run_hf(s, windows) -> dict | None:
    """benchmarks/hf_decode.py in a subprocess (it needs torch and transformers, not JAX); its JSON plus a line."""
    import importlib.util
    import json
    import subprocess
    import tempfile
    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
        return dict(line="HF transformers: torch or transformers is not importable here: no comparison")
    out = Path(tempfile.mkdtemp(prefix="hf_decode_")) / "hf.json"
    cmd = [sys.executable, "-m", "benchmarks.hf_decode", f"--model={s.model}", f"--layers={s.layers}",
           f"--windows={','.join(map(str, windows))}", f"--pos={s.pos}", f"--iters={s.iters}",
           f"--warmup={s.warmup}", f"--dtype={s.dtype}", f"--json={out}"]
    common.progress("HF transformers on the same shape (subprocess): " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0 or not out.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(line=f"HF transformers: the comparison failed ({last})")
    hf = json.loads(out.read_text())
    hf["line"] = (f"HF transformers {hf['transformers']} (torch {hf['torch']}, {hf['device_name']}): the same shape, "
                  f"random weights, one window step synchronised, the fastest of {', '.join(hf['impls'])} per T; "
                  "x vs HF = its ms/step / ours (each step synced)")
    return hf


def run(s) -> dict:
    """The benchmark with settings `s` (the parsed FLAGS or any object with the same attributes); returns all
    numbers (also written to s.json when set)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.engine import graphs
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import can_stack, random_weights
    from strata_jax.model import moe
    from strata_jax.model.config import preset
    from strata_jax.engine.plan import resolve_delta_kernel
    from strata_jax.options import EngineOptions, build
    from strata_jax.errors import StrataError

    windows = sorted(common.int_list(s.windows, "windows"))
    from strata_jax.engine.api import kernel_tuning_lines
    tuning_lines = kernel_tuning_lines()  # STRATA_KERNEL_TUNING (a kernel-sweep file) applies here as at an Engine's start
    if s.attention_splits:
        from strata_jax.pallas_kernels import decode_attention as decode_attention_mod
        decode_attention_mod.FORCE_SPLITS = s.attention_splits
    cfg = preset(s.model, layers=s.layers or None)
    if s.layers and len(cfg.sparse_layers) < s.layers:
        raise StrataError(f"--layers={s.layers}: the {s.model} preset has fewer layers")
    if s.pos + max(windows) > s.context:
        raise StrataError(f"--pos={s.pos} + the largest window {max(windows)} exceeds --context={s.context}")
    if s.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", s.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    hf = run_hf(s, windows) if s.hf == "auto" else None  # before JAX holds the device's memory
    dtype = jnp.dtype(s.dtype)
    itemsize = dtype.itemsize
    dev = common.device_info()
    on_cpu = dev["platform"] == "cpu"
    e, k, n_moe, n_layers = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_sparse_layers, cfg.num_layers

    # ---- bandwidth, before anything else holds memory ----
    bw_bytes = (s.bw_mib or (64 if on_cpu else 4096)) * 2**20
    common.progress(f"measuring read bandwidth over {bw_bytes / 2**30:.2f} GiB (a sum and a GEMV, back to back)")
    bw = common.measure_read_bandwidth(bw_bytes, reps=10)
    bandwidth = bw["bandwidth_Bps"]
    nominal = common.nominal_bandwidth(dev["device_kind"])

    # ---- sizes, before allocating ----
    abstract = jax.eval_shape(lambda: random_weights(cfg, s.seed, dtype))
    wb = weight_bytes(cfg, abstract, itemsize)
    kv_bytes = 2 * cfg.num_full_layers * s.context * cfg.num_kv_heads * cfg.head_dim * itemsize
    # Qwen3-Next's DeltaNet layers: a window reads one position's state and writes one per row (the state ring)
    ring_bytes = (max(windows) + 1) * cfg.state_bytes(itemsize) if cfg.has_linear else 0
    limit = dev["memory_limit_bytes"]
    if not limit and on_cpu:
        try:
            import os
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            limit = None
    if limit and wb["total"] + kv_bytes + ring_bytes > 0.97 * limit:
        raise StrataError(f"{common.gb(wb['total']):.1f} GB of weights + {common.gb(kv_bytes):.2f} GB of KV cache "
                          f"do not fit in {common.gb(limit):.1f} GB of {'host' if on_cpu else 'device'} memory (cut with --layers)")

    say = common.say
    for line in tuning_lines:
        say(line)
    say(f"decode_bench: {s.model}, {n_layers} layers ({n_moe} MoE, {e} experts top-{k}, H={cfg.hidden_size}, "
        f"expert I={cfg.moe_intermediate_size}, V={cfg.vocab_size}), {s.dtype}")
    memory = f", {common.gb(limit):.1f} GB {'host RAM' if on_cpu else 'usable'}" if limit else ""
    say(f"device: {dev['device_kind']} ({dev['platform']}, {dev['device_count']} device(s){memory}); "
        f"jax {dev['jax']}, python {dev['python']}" + (f"; XLA_FLAGS={dev['xla_flags']}" if dev["xla_flags"] else ""))
    say(f"memory read bandwidth (measured now, the roofline's denominator): {bandwidth / 1e9:,.0f} GB/s  "
        f"[{bw['method']}; sum {bw['kernels']['sum']['Bps'] / 1e9:,.0f}, GEMV {bw['kernels']['gemv']['Bps'] / 1e9:,.0f} "
        f"GB/s]" + (f"; nominal {nominal / 1e9:,.0f} GB/s (datasheet)" if nominal else ""))
    say(f"weights: random (seed {s.seed}), made on the device, all experts resident: {common.fmt_bytes(wb['total'])} "
        f"({common.fmt_bytes(wb['experts_all'])} of experts, {common.fmt_bytes(wb['expert'])} each)")
    say(f"KV cache: {s.context} positions (static), {common.fmt_bytes(kv_bytes)}, contents zero; windows decoded at "
        f"positions {s.pos}..{s.pos}+T-1 (fill position {s.pos})")
    say("timed: one decode_window call as the engine's generate loop makes it (AOT-compiled graph; embed -> all "
        "layers -> logits [T, V] -> greedy argmax), random token ids, the donated cache threaded through; each "
        "step synchronised with block_until_ready: ms/step INCLUDES Python dispatch (shown alone as 'dispatch ms'); "
        "'pipelined ms' = steps dispatched back to back, one sync at the end (dispatch hidden)")
    say(f"routing: random weights route near-uniformly; distinct experts per layer are counted from this run's own "
        f"windows ({s.probe_windows} per T, replayed layer by layer)" if s.probe_windows else
        "routing: random weights route near-uniformly; distinct experts per layer = uniform expectation "
        "E*(1-(1-K/E)^T) (probe off)")
    say("tok/s counts all T tokens of a window (every draft accepted: the upper bound of speculative decoding)")
    say()

    result = dict(benchmark="decode_bench", settings={name: getattr(s, name) for name in FLAGS}, windows=windows,
                  device=dev, model=dict(preset=s.model, layers=n_layers, moe_layers=n_moe, experts=e, top_k=k,
                                         hidden=cfg.hidden_size, expert_intermediate=cfg.moe_intermediate_size,
                                         vocab=cfg.vocab_size, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
                  bandwidth=bw, weight_bytes=wb, kv_cache_bytes=kv_bytes,
                  timing_scope=("one AOT-compiled decode_window call (embed -> layers -> logits -> greedy argmax), "
                                "block_until_ready after each; includes Python dispatch"),
                  routing_note="random weights: near-uniform routing", rows=[], complete=False)

    # ---- weights, layer by layer as the device finishes them ----
    t0 = time.perf_counter()
    common.progress(f"making {common.fmt_bytes(wb['total'])} of random {s.dtype} weights on the device")
    scanned = s.layer_loop == "scan" and can_stack(cfg)
    weights = random_weights(cfg, s.seed, dtype, progress=common.progress, stacked=scanned)
    jax.block_until_ready(weights)
    common.progress(f"  weights: embedding, final norm, lm_head done ({common.fmt_bytes(wb['total'])}, "
                    f"{time.perf_counter() - t0:.1f} s)")
    result["weights_made_s"] = time.perf_counter() - t0
    cache = init_cache(cfg, s.context, dtype, stacked=scanned, ring=max(windows) + 1)  # the engine's ring
    jax.block_until_ready(cache)
    result["device_bytes_in_use"] = common.device_memory_in_use()

    expert_kernel, attention_kernel, dense_kernel = common.kernels(s, cfg)
    result["kernels"] = dict(expert=expert_kernel, attention=attention_kernel)
    dense = dense_kernel == "pallas"
    result["kernels"]["dense"] = dense_kernel
    delta_kernel = resolve_delta_kernel(build(EngineOptions, dict(delta_kernel=s.delta_kernel)), cfg)
    result["kernels"]["delta"] = delta_kernel
    result["kernels"]["route"] = s.route_kernel
    say(f"kernels: expert FFN {expert_kernel}, attention {attention_kernel}, attention products "
        f"{'pallas' if dense else 'xla'}, route {s.route_kernel}" + (f", DeltaNet rule {delta_kernel}" if cfg.has_linear else "")
        + f"; layers {'scanned over stacked weights' if scanned else 'unrolled'}")
    experts = (moe.ResidentExperts(cfg, interpret=dev["platform"] != "gpu", route_kernel=s.route_kernel == "pallas")
               if expert_kernel == "pallas" else None)
    decode = graphs.jit_decode_window(cfg, experts, attention_kernel=attention_kernel == "pallas", dense_kernel=dense,
                                      delta_kernel=delta_kernel == "pallas")
    probe = make_probe(cfg, s.context, dtype) if s.probe_windows and n_moe else None
    pos = jax.device_put(jnp.int32(s.pos))
    rng = np.random.default_rng(s.seed)
    base_ms = None

    for t in windows:
        n_calls = s.warmup + s.iters
        token_rows = rng.integers(0, cfg.vocab_size, size=(n_calls, t), dtype=np.int32)
        tokens = [jax.device_put(row) for row in token_rows]

        common.progress(f"T={t}: compiling decode_window ({n_layers} layers "
                        f"{'in one scanned body' if scanned else 'unrolled'})")
        t0 = time.perf_counter()
        lowered = decode.lower(weights, cache, tokens[0], pos)
        lower_s = time.perf_counter() - t0
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0 - lower_s
        common.progress(f"T={t}: traced+lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s")

        def call(i):
            nonlocal cache
            next_tokens, _, cache = compiled(weights, cache, tokens[i % n_calls], pos)
            return next_tokens  # the cache comes out of the same executable, ready with it

        common.progress(f"T={t}: {s.warmup} warm-up + {s.iters} timed steps")
        timing = common.time_synced(call, iters=s.iters, warmup=s.warmup)
        pipelined_s = common.time_pipelined(call, iters=s.iters)

        uniform = expected_distinct(e, k, t)
        routing = None
        if probe is not None:
            n_probe = min(s.probe_windows, s.iters)
            common.progress(f"T={t}: replaying {n_probe} timed windows' routing")
            ids = [probe(weights, tokens[s.warmup + i], pos) for i in range(n_probe)]
            routing = routing_stats(ids)
        distinct = routing["mean_distinct"] if routing else uniform
        distinct_source = "measured" if routing else "uniform"

        non_expert = wb["fixed_non_expert"] + (0 if wb["tied"] else t * wb["embed_row"])
        expert_bytes = n_moe * distinct * wb["expert"]
        state_bytes = (1 + t) * cfg.state_bytes(itemsize) if cfg.has_linear else 0
        step_bytes = non_expert + expert_bytes + kv_bytes + state_bytes
        roofline_ms = step_bytes / bandwidth * 1e3
        ms = timing.median_ms
        tok_s = t / (ms * 1e-3)
        if t == 1:
            base_ms = ms
        gathered = n_moe * min(t * k, e) * wb["expert"]  # what the graph's gather reads (pads re-read expert 0)
        row = dict(T=t, ms_per_step=ms, ms_per_step_mean=timing.mean_ms, ms_per_step_pipelined=pipelined_s * 1e3,
                   dispatch_ms=timing.dispatch_median_ms, ms_per_token=ms / t, tok_s=tok_s,
                   tok_s_vs_T1=(base_ms / ms * t) if base_ms else None,
                   distinct_experts_per_layer=distinct, distinct_source=distinct_source,
                   distinct_uniform_expectation=uniform, routing=routing,
                   bytes=dict(non_expert=non_expert, experts=expert_bytes, kv_cache=kv_bytes, delta_state=state_bytes,
                              total=step_bytes,
                              experts_gathered_by_graph=gathered),
                   roofline_ms=roofline_ms, roofline_fraction=roofline_ms / ms,
                   roofline_fraction_pipelined=roofline_ms / (pipelined_s * 1e3),
                   achieved_Bps=step_bytes / (ms * 1e-3), lower_s=lower_s, compile_s=compile_s,
                   xla_bytes_accessed=_xla_bytes(compiled), timing=timing.summary())
        result["rows"].append(row)
        common.progress(f"T={t}: {ms:.3f} ms/step (mean {timing.mean_ms:.3f}, pipelined {pipelined_s * 1e3:.3f}), "
                        f"{tok_s:,.1f} tok/s, {100 * roofline_ms / ms:.1f}% of roofline")
        if s.json:
            common.write_json(s.json, result)
        del compiled, lowered

    result["complete"] = True
    headers = ["T", "ms/step", "mean ms", "pipelined ms", "host ms (call)", "ms/token", "tok/s", "x tok/s vs T=1",
               "experts/layer (run)", "experts/layer (uniform)", "GB/step", "roofline ms/step", "% of roofline",
               "% of roofline (pipelined)"]
    rows = []
    for r in result["rows"]:
        rows.append([r["T"], r["ms_per_step"], r["ms_per_step_mean"], r["ms_per_step_pipelined"], r["dispatch_ms"],
                     r["ms_per_token"], r["tok_s"], r["tok_s_vs_T1"] if r["tok_s_vs_T1"] is not None else "-",
                     r["distinct_experts_per_layer"] if r["distinct_source"] == "measured" else "-",
                     r["distinct_uniform_expectation"], common.gb(r["bytes"]["total"]), r["roofline_ms"],
                     100 * r["roofline_fraction"], 100 * r["roofline_fraction_pipelined"]])
    if hf and hf.get("best"):
        headers += ["HF ms/step (fastest impl)", "x vs HF"]
        for row, r in zip(rows, result["rows"]):
            best = hf["best"].get(str(r["T"]))
            row += [f"{best['ms']:.2f} ({best['impl']})", best["ms"] / r["ms_per_step"]] if best else ["-", "-"]
        result["hf"] = hf
    table = common.format_table(headers, rows)
    result["table"] = table
    runner.emit(runner.rows_from_table(
        "decode_bench", headers, rows, params=["T"], fixed=dict(model=s.model, layers=n_layers, dtype=s.dtype,
                                                                context=s.context, pos=s.pos),
        timing=f"one decode_window call synced (dispatch + device), median of {s.iters} after {s.warmup} untimed; "
               "'pipelined': back to back, one sync", units={"x tok/s vs T=1": "x", "GB/step": "GB"}),
        s.output, table=table, result=result)
    say()
    if hf is not None:
        say(hf["line"])
    say(f"baseline: the engine's own decode_window graph; roofline: bytes/step at the {bandwidth / 1e9:,.0f} GB/s "
        f"measured above. bytes/step = {common.fmt_bytes(wb['fixed_non_expert'])} non-expert + distinct experts x "
        f"{common.fmt_bytes(wb['expert'])} x {n_moe} MoE layers + {common.fmt_bytes(kv_bytes)} KV (whole "
        f"static cache)" + (" + the DeltaNet state read once and written per row" if cfg.has_linear else "")
        + "; experts/layer for the bytes: "
        + ("measured from this run's routing" if probe is not None else "the uniform expectation"))
    if probe is not None and result["rows"]:
        ratios = ", ".join(f"T={r['T']}: {r['distinct_experts_per_layer'] / r['distinct_uniform_expectation']:.3f}"
                           for r in result["rows"])
        say(f"routing: random weights, near-uniform: distinct experts measured / uniform expectation = {ratios} "
            f"(a real checkpoint's windows share more experts)")
    if on_cpu:
        say("CPU: a small model's weights sit in the CPU caches, faster than the DRAM copy above, so % of roofline "
            "can pass 100 there; the roofline is meant for the accelerator")
    if s.json:
        common.write_json(s.json, result)
        say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.decode_bench", run)


if __name__ == "__main__":
    main(sys.argv)
