"""Host dispatch against device time of one T=1 decode window (12 layers of the 30B shape, spread routing):
`python dispatch.py ARM [ARM ...]`, ARM = name:slots:layer_loop (slots 'all' = every expert resident). Prints per arm
the median time the step call takes to return (dispatch), the time per window queued back to back (throughput), and
per window synced (latency); with STRATA_OFFLOAD_TRACE=1 in the environment, how often the offload handlers ran."""
import statistics, sys, time
sys.path.insert(0, ".")
import jax, jax.numpy as jnp
from strata_jax.config import preset
from strata_jax.engine import Engine

cfg = preset("qwen3-30b-a3b", layers=12)
for arm in sys.argv[1:]:
    name, slots, loop = arm.split(":")
    opts = dict(expert_cache_slots=slots, layer_loop=loop) | ({} if slots == "all" else dict(pcie_frac="1"))
    e = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50.0, window=1, context=512,
                           compile_graphs="ahead", **opts)
    e.generate(list(range(1, 33)), 16, stop_token_ids=[], draft="none")
    step = e._decode[1]
    cur = jnp.asarray([5], jnp.int32)
    for i in range(10):
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(40 + i))
    jax.block_until_ready(cur)
    print(f"--- {name}: 60 windows queued", file=sys.stderr, flush=True)
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
    print(f"{name:24s} scanned={getattr(e, 'scanned_offload', None) if slots != 'all' else e.scanned!s:5s} "
          f"dispatch {1e3 * statistics.median(ts):.3f} ms (max {1e3 * max(ts):.3f})  queued {1e3 * queued:.3f} "
          f"ms/window  synced {1e3 * statistics.median(synced):.3f} ms/window  compile {e.stats.compile_s:.1f} s",
          flush=True)
    if e.placement:
        e.placement.pool.close()
    del e
