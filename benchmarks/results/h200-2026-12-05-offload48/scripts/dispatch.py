"""Host dispatch against device time of one T=1 decode window by depth (the 30B shape cut to L layers, spread
routing): `python dispatch.py ARM [ARM ...]`, ARM = name:slots:layers (slots 'all' = every expert resident, else
that many slots of 128, pcie_frac 1; the scanned graphs). Per arm: the median time the step call takes to return
(dispatch), the time per window with 60 queued back to back (throughput), per window synced (latency), the first six calls' times
(before the device's queue fills, a call returns in its host time alone; after, a host-bound loop still returns
in its host time and a device-bound one in the device's), and the dispatch of a graph that takes the same arguments and does nothing (the cost of a call's arguments alone). A
per-launch cost stays flat with depth; a per-layer one grows with it."""
import statistics, sys, time
sys.path.insert(0, ".")
import jax, jax.numpy as jnp
from strata_jax.model.config import preset
from strata_jax.engine import Engine


def timed(step, e, cur, first):
    ts = []
    t0 = time.perf_counter()
    for i in range(60):
        a = time.perf_counter()
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(first + i))
        ts.append(time.perf_counter() - a)
    jax.block_until_ready(cur)
    timed.first = ts[:6]  # before the device's queue fills: a call returns in its host time alone
    return cur, statistics.median(ts), (time.perf_counter() - t0) / 60


for arm in sys.argv[1:]:
    name, slots, layers = arm.split(":")
    cfg = preset("qwen3-30b-a3b", layers=int(layers))
    opts = dict(expert_cache_slots=slots) | ({} if slots == "all" else dict(pcie_frac="1"))
    e = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50.0, window=1, context=512,
                           compile_graphs="ahead", **opts)
    e.generate(list(range(1, 33)), 16, stop_token_ids=[], draft="none")
    step = e.compiled.decode[1]
    cur = jnp.asarray([5], jnp.int32)
    for i in range(10):
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(40 + i))
    jax.block_until_ready(cur)
    cur, dispatch, queued = timed(step, e, cur, 50)
    first = " ".join(f"{1e3 * t:.2f}" for t in timed.first)
    synced = []
    for i in range(30):
        a = time.perf_counter()
        cur, logits, e.cache = step(e.weights, e.cache, cur, jnp.int32(120 + i))
        jax.block_until_ready(cur)
        synced.append(time.perf_counter() - a)
    # the same arguments (weights, donated cache, token, position), no work
    noop = jax.jit(lambda w, c, t, p: (t, jnp.zeros((1,), jnp.float32), c), donate_argnums=(1,))
    _, _, e.cache = noop(e.weights, e.cache, cur, jnp.int32(0))
    cur, noop_dispatch, noop_queued = timed(noop, e, cur, 0)
    leaves = len(jax.tree.leaves((e.weights, e.cache)))
    print(f"{name:20s} L={layers:>2s} scanned={e.scanned!s:5s} dispatch {1e3 * dispatch:.3f} ms  queued "
          f"{1e3 * queued:.3f} ms/window (the first six calls {first} ms)  synced {1e3 * statistics.median(synced):.3f} ms/window  no-op graph "
          f"dispatch {1e3 * noop_dispatch:.3f} ms ({leaves} argument leaves)  compile {e.stats.compile_s:.1f} s",
          flush=True)
    if e.placement:
        e.placement.pool.close()
    del e
    jax.clear_caches()
