"""Where does one decode window's time go? Each phase of the model timed on its own, over the same layers.

    python -m benchmarks.phase_bench --model=qwen3-30b-a3b --layers=8

Phases (each one jitted graph over all `--layers` layers, random weights, all experts resident):
  full       decode_window: embed -> layers -> logits -> argmax (the engine's graph)
  sample     the sampler graph alone (temperature, top-k, top-p over the vocabulary)
  attention  the attention half of every layer (norm, q/k/v, RoPE, cache write, attention over the static cache)
  moe        the MoE half of every layer (route, gather the window's experts, expert FFN)
  head       final norm + lm_head + argmax
Timing: median of `--iters` calls each synchronised (covers dispatch + device), and back to back with one final
synchronisation (device throughput when dispatch overlaps). Both in ms per call; per layer in the last column.
"""
from __future__ import annotations

import functools
import sys

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "tiny", "Model preset.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 8, "Layers to keep.", flag_values=FLAGS)
flags.DEFINE_string("windows", "1,4", "Window sizes.", flag_values=FLAGS)
flags.DEFINE_integer("context", 2048, "KV cache length.", flag_values=FLAGS)
flags.DEFINE_integer("iters", 30, "Timed calls.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the numbers here.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)


def main(argv) -> dict:
    common.parse_flags(FLAGS, argv, "phase_bench")
    common.set_output(FLAGS.output)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.engine import graphs
    from strata_jax.model import transformer
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import random_weights
    from strata_jax.model import moe
    from strata_jax.model.config import preset
    from strata_jax.sampling import SamplingParams

    cfg = preset(FLAGS.model, layers=FLAGS.layers)
    common.progress(f"{FLAGS.model} x {cfg.num_layers} layers on {jax.devices()[0].device_kind}")
    w = random_weights(cfg, 0, jnp.bfloat16)
    cache = init_cache(cfg, FLAGS.context, jnp.bfloat16)
    pos = jnp.int32(FLAGS.context // 2)
    rng = np.random.default_rng(0)

    def attention_all(w, cache, h, pos):
        for i, layer in enumerate(w.layers):
            a, _, _ = transformer.attention(transformer.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps), layer.attn,
                                      cache.k[i], cache.v[i], pos, cfg)
            h = h + a
        return h

    def moe_all(w, h):
        valid = jnp.ones((h.shape[0],), bool)
        for layer in w.layers:
            h = h + moe.moe_block(transformer.rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps), layer.ffn, cfg, valid)
        return h

    def head(w, h):
        h = transformer.rms_norm(h, w.final_norm, cfg.rms_norm_eps)
        return jnp.argmax(jnp.einsum("th,hv->tv", h, w.lm_head, preferred_element_type=jnp.float32), -1)


    rows = []
    for t in common.int_list(FLAGS.windows, "windows"):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)
        h = jnp.asarray(rng.standard_normal((t, cfg.hidden_size)), jnp.bfloat16)
        full = jax.jit(functools.partial(graphs.decode_window, cfg=cfg))
        logits = jnp.asarray(rng.standard_normal((t, cfg.vocab_size)), jnp.float32)
        phases = {
            "full": (full, (w, cache, tokens, pos)),
            "sample": (graphs.jit_sample(), (logits, tokens, SamplingParams.make(0.7, 0.9, 40))),
            "attention": (jax.jit(attention_all), (w, cache, h, pos)),
            "moe": (jax.jit(moe_all), (w, h)),
            "head": (jax.jit(head), (w, h)),
        }
        for name, (fn, args) in phases.items():
            common.progress(f"T={t} {name}: compiling")
            jax.block_until_ready(fn(*args))
            timing = common.time_synced(lambda i: fn(*args), FLAGS.iters, warmup=2)
            piped = common.time_pipelined(lambda i: fn(*args), FLAGS.iters)
            per_layer = timing.median_ms / cfg.num_layers if name not in ("head",) else float("nan")
            rows.append(dict(T=t, phase=name, synced_ms=timing.median_ms, dispatch_ms=timing.dispatch_median_ms,
                             pipelined_ms=piped * 1e3, per_layer_us=per_layer * 1e3))
            common.progress(f"T={t} {name}: {timing.median_ms:.3f} ms synced, {piped * 1e3:.3f} ms pipelined")
    result = dict(model=FLAGS.model, layers=cfg.num_layers, context=FLAGS.context, rows=rows,
                  device=common.device_info())
    runner.table(FLAGS, "phase_bench", ["T", "phase", "synced ms", "dispatch ms", "pipelined ms", "us/layer (synced)"],
                 [[r["T"], r["phase"], r["synced_ms"], r["dispatch_ms"], r["pipelined_ms"], r["per_layer_us"]]
                  for r in rows], params=["T", "phase"], fixed=dict(model=FLAGS.model, layers=cfg.num_layers),
                 timing=f"each phase its own graph: synced calls (median of {FLAGS.iters}) and back to back",
                 result=result)
    if FLAGS.json:
        common.write_json(FLAGS.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv)
