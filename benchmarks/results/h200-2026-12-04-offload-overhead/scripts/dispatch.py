"""Host dispatch against device time of one T=1 decode window: all resident (scanned, unrolled) and offloaded S=E."""
import os, statistics, sys, time
sys.path.insert(0, ".")
import numpy as np
import jax, jax.numpy as jnp
from strata_jax.config import preset
from strata_jax.engine import Engine
layers = int(sys.argv[1]); model = sys.argv[2] if len(sys.argv) > 2 else "qwen3-30b-a3b"
cfg = preset(model, layers=layers)
for name, opts in (("resident scanned", dict(expert_cache_slots="all")),
                   ("resident unrolled", dict(expert_cache_slots="all", layer_loop="unrolled")),
                   ("offload S=E", dict(expert_cache_slots=str(cfg.num_experts), pcie_frac="1"))):
    e = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50.0, window=1, context=512,
                           compile_graphs="ahead", **opts)
    e.generate(list(range(1, 33)), 16, stop_token_ids=[], draft="none")
    step = e._decode[1]
    cur = jnp.asarray([5], jnp.int32)
    for i in range(10):
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(40 + i))
    jax.block_until_ready(cur)
    ts = []
    t0 = time.perf_counter()
    for i in range(60):
        a = time.perf_counter()
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(50 + i))
        ts.append(time.perf_counter() - a)
    jax.block_until_ready(cur)
    queued = (time.perf_counter() - t0) / 60
    synced = []
    for i in range(30):
        a = time.perf_counter()
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(120 + i))
        jax.block_until_ready(cur)
        synced.append(time.perf_counter() - a)
    print(f"{name:18s} dispatch {1e3 * statistics.median(ts):.3f} ms (max {1e3 * max(ts):.3f})  queued back to back "
          f"{1e3 * queued:.3f} ms/window  synced {1e3 * statistics.median(synced):.3f} ms/window", flush=True)
    if e.placement:
        e.placement.pool.close()
    del e
