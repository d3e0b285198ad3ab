"""Start-up side of offload: how many expert slots fit, experts into host memory, the host pool, the cost model
that picks `pcie_frac=auto`, and the one rule for what a pcie_frac change costs (needs_cpu_path). The in-graph side
is experts/slots.py."""
from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from strata_jax.host_pool import HostExpertStore, HostPool, HostPoolError, blas, cpu_expert_rows, native
from strata_jax.host_pool.bridge import native_calls, offload_begin, offload_collect
from strata_jax.host_pool.pool import usable_cores
from strata_jax.model.weights import Weights, random_weights
from strata_jax.model import moe, quant
from strata_jax.model.config import ModelConfig
from strata_jax.errors import StrataError
from strata_jax.offload import approx, defer, slots as slots_mod
from strata_jax.options import EngineOptions


@dataclasses.dataclass
class Placement:
    """Where the experts live when offload is on."""
    slots: int
    policy: str
    pcie_frac: float
    pool: object  # strata_jax.host_pool.HostPool
    host_kind: str  # memory kind of the host expert arrays (pinned_host on GPU)
    lines: list[str]  # start-up lines
    costs: dict | None = None  # the measured cost model, when pcie_frac=auto
    # The native offload calls (bridge.offload_begin / offload_collect: fetches and pool work enqueued on the
    # stream, no read-back) where the pool's FFI handler built and the layers' pinned experts are registered.
    native: bool = False
    auto: bool = False  # pcie_frac=auto: re-chosen after each request from the misses it met (adapt_pcie_frac)

    @property
    def cpu_path(self) -> bool:
        """Whether the graphs are built with the host pool's callback (needs_cpu_path)."""
        return needs_cpu_path(self.pcie_frac)

    def native_offload(self) -> slots_mod.NativeOffload | None:
        """The graphs' native offload calls, or None (the graph path of loops and lax.cond)."""
        return slots_mod.NativeOffload(pool=self.pool) if self.native else None

    @property
    def fills_from_prefill(self) -> bool:
        """The slots take each prompt's most used experts after its prefill: the static policy, and lru with
        pcie_frac 0 (nothing is ever fetched, so lru's slots would stay empty and every entry go to the pool)."""
        return fills_from_prefill(self.policy, self.pcie_frac)

    @property
    def frozen_lru(self) -> bool:
        """lru whose slots stay as each prefill filled them (pcie_frac 0): the misses it meets are not those of the
        lru that fetches (F > 0), which follows the decode (adapt_pcie_frac's `following`)."""
        return self.policy == "lru" and self.fills_from_prefill

    def reconfigure(self, pcie_frac: float, policy: str) -> bool:
        """Take a new split and policy; whether the graphs must be rebuilt (the split crossed 1: needs_cpu_path; or
        the policy changed: the decode windows under lru are built without staging, OffloadedExperts.can_stage)."""
        rebuild = needs_cpu_path(pcie_frac) != self.cpu_path or policy != self.policy
        self.pcie_frac, self.policy = pcie_frac, policy
        return rebuild

    def init_state(self, cfg: ModelConfig, dtype) -> list:
        """Each sparse layer's slot cache; dtype: how the experts are stored (int8 with expert_dtype=int8; a pair
        (gate/up's, down's) for per-family formats of two storages)."""
        return [slots_mod.init_slot_cache(cfg, self.slots, dtype, self.policy, self.pcie_frac) if sparse else None
                for sparse in cfg.sparse_layers]


    def init_stacked_state(self, cfg: ModelConfig, dtype) -> slots_mod.SlotCache:
        """Every layer's slot cache in one (the scanned offload graph; every layer sparse)."""
        return slots_mod.init_stacked_slot_cache(cfg, cfg.num_layers, self.slots, dtype, self.policy, self.pcie_frac)


def fills_from_prefill(policy: str, pcie_frac: float) -> bool:
    """The one rule for when the slots are filled from a prompt's prefill (Placement.fills_from_prefill)."""
    return policy == "static" or pcie_frac == 0.0


def needs_cpu_path(pcie_frac: float) -> bool:
    """Whether graphs for this split include the host pool: pcie_frac < 1 sends some misses to the pool (an
    io_callback under lax.cond, and the deferral when it is on); pcie_frac == 1 builds them without the pool, so
    every miss is fetched over PCIe whatever the slot cache's pcie_frac says. The split is data in the graphs
    (SlotCache.pcie_frac) otherwise: a change recompiles exactly when this answer changes (the split moves to or
    from 1); the cache policy never recompiles."""
    return pcie_frac < 1


def non_expert_bytes(cfg: ModelConfig, itemsize: int, expert_format: str | None = None) -> int:
    """Device bytes of everything but the routed experts' weights; quantized experts' scales (always on the device,
    int4's a sixteenth of its q bytes) count here."""
    shapes = jax.eval_shape(lambda: random_weights(cfg, 0, jnp.float32))
    total = sum(x.size for x in jax.tree.leaves(shapes)) * itemsize
    rest = total - cfg.num_sparse_layers * cfg.num_experts * cfg.expert_bytes(itemsize)
    if expert_format:
        h, f = cfg.hidden_size, cfg.moe_intermediate_size
        for name, rows in zip(quant.MATRICES, (f, f, h)):  # each matrix at its family's format
            one = quant.matrix_format(expert_format, name)
            fmt = quant.get_format(one)
            group = fmt.group
            # int6-q6k: G sc bytes and 2 bytes a super-block; int6-q6km: G sc and G m bytes, 4 a super-block
            codes = {quant.Q6K: (9, 8), quant.Q6KM: (9, 4)}.get(one, (5, 4))
            per_matrix = (rows if one == "int8" else f * h // group * codes[0] // codes[1] if one in quant.BLOCK_FORMATS
                          else f * h // group * (1 if fmt.symmetric else 2))  # scales (and minima); q4k/q2k: codes
            rest += cfg.num_sparse_layers * cfg.num_experts * per_matrix * fmt.scale_bits // 8
    return rest


def expert_format(opts: EngineOptions, cfg: ModelConfig | None = None) -> str | None:
    """The quantized format of the routed experts (strata_jax/model/quant.py), or None when they stay in `dtype`; with
    cfg, int4's group (64, or 32 for experts whose widths are multiples of 32 only): one line if neither fits."""
    if opts.expert_dtype == "auto" or cfg is None:
        return None if opts.expert_dtype == "auto" else opts.expert_dtype
    try:
        return quant.engine_format(opts.expert_dtype, (cfg.hidden_size, cfg.moe_intermediate_size))
    except ValueError as e:
        raise StrataError(str(e)) from None


def expert_storage(opts: EngineOptions) -> np.dtype | tuple[np.dtype, np.dtype]:
    """How a routed expert's weights are stored in host memory and the slots: int8 q (expert_dtype=int8), int4
    packed two a byte in uint8 (int4), four a byte for int2-q2k (quant.Q2K in place of its uint8: slot_storage), else
    the compute dtype. The scales sit on the device (a fraction of a slot). Per-family formats of two storages
    ("int4-q4k/int8-g16"): the pair (gate/up's, down's)."""
    fmt = expert_format(opts)
    if not fmt:
        return jnp.dtype(opts.dtype)
    gate_up, down = (quant.slot_storage(f) for f in quant.family_formats(fmt))
    return gate_up if gate_up == down else (gate_up, down)


def expert_itemsize(opts: EngineOptions) -> float:
    """Bytes a stored expert weight takes (0.5 for int4, 0.25 for int2-q2k; per-family formats: the mean over gate,
    up and down)."""
    fmt = expert_format(opts)
    if not fmt:
        return jnp.dtype(opts.dtype).itemsize
    sizes = [quant.get_format(f).bits / 8 if quant.get_format(f).bits < 8 else quant.storage_dtype(f).itemsize
             for f in (quant.matrix_format(fmt, m) for m in quant.MATRICES)]
    return sum(sizes) / 3


def decide_slots(cfg: ModelConfig, opts: EngineOptions, kv_bytes: int, devices: int = 1) -> tuple[int | None, str]:
    """Slots per MoE layer, or None for no offload (every expert on the device), and why. devices: the model's
    layers split over that many devices of one kind (parallel=layers): their memory counts together."""
    if not any(cfg.sparse_layers):
        return None, "no MoE layers"
    v = opts.expert_cache_slots
    if v == "all":
        return None, "expert_cache_slots=all"
    if v != "auto":
        return min(int(v), cfg.num_experts), f"expert_cache_slots={v}"
    itemsize = jnp.dtype(opts.dtype).itemsize
    slots, why = auto_slots(cfg, non_expert_bytes(cfg, itemsize, expert_format(opts, cfg)), kv_bytes, expert_itemsize(opts),
                            opts.vram_reserve_mib, devices)
    if slots >= cfg.num_experts:
        return None, f"auto: all {cfg.num_experts} experts fit ({why})"
    return slots, f"auto: {why}"


def auto_slots(cfg: ModelConfig, other_bytes: int, kv_bytes: int, itemsize: int, reserve_mib: int,
               devices: int = 1) -> tuple[int, str]:
    """Slots per sparse layer that fit in the device memory left after the rest of the model (other_bytes: its
    non_expert_bytes), the KV cache and the reserve (on each of `devices` devices, which hold 1/devices each)."""
    free = device_free_bytes()
    if free is None:
        return cfg.num_experts // 2, "half the experts (this backend reports no device memory)"
    free = free * devices - other_bytes - kv_bytes - reserve_mib * 2**20 * devices
    per_slot = max(cfg.num_sparse_layers, 1) * cfg.expert_bytes(itemsize)
    # One block of staging per layer graph at most: keep room for it.
    free -= 32 * cfg.expert_bytes(itemsize)
    slots = max(0, min(cfg.num_experts, int(free // per_slot)))
    over = f" over {devices} devices" if devices > 1 else ""
    return slots, f"{free / 2**30:.1f} GiB free{over} after weights, KV cache and a {reserve_mib} MiB reserve"


def device_free_bytes() -> int | None:
    """The device's free memory, or None where the backend does not say (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit - stats.get("bytes_in_use", 0) if limit else None


def slot_bytes(cfg: ModelConfig, slots: int, itemsize: int) -> int:
    return cfg.num_sparse_layers * (slots + 1) * cfg.expert_bytes(itemsize)


class HostExperts:
    """Collects each MoE layer's stacked experts from the loader: a numpy copy for the host pool and a jax array in
    host memory (pinned on a GPU) that the graph fetches from. layer_device(i): the device whose graph fetches layer
    i's experts (parallel=layers: its block's; default the first device)."""

    def __init__(self, cfg: ModelConfig, compute_dtype=None, layer_device=None):
        self.kind = slots_mod.host_memory_kind()
        self.sharding = slots_mod.device_sharding(self.kind)
        self.layer_device = layer_device
        self.numpy: dict[int, dict[str, np.ndarray]] = {}
        self.compute_dtype = compute_dtype  # how the pool rounds (int8 experts do not say it themselves)

    def place(self, name: str, x):
        """x: numpy (from a checkpoint) or a device array (random weights for benchmarks)."""
        _, layer, _, which = name.split(".")  # layers.{i}.experts.{gate,up,down}
        on_host = jax.device_put(x, self._sharding(int(layer)))
        self.numpy.setdefault(int(layer), {})[which] = x if isinstance(x, np.ndarray) else np.asarray(on_host)
        return on_host

    def place_scale(self, name: str, x):
        """int8 experts' row scales (layers.{i}.experts.{which}_scale; numpy from a checkpoint, a device array from
        random weights): kept for the pool, and on the device."""
        _, layer, _, which = name.split(".")
        self.numpy.setdefault(int(layer), {})[which] = quant.pool_scale(np.asarray(x))
        return jax.device_put(x, self.layer_device(int(layer)) if self.layer_device else None)

    def _sharding(self, layer: int):
        if self.layer_device is None:
            return self.sharding
        return jax.sharding.SingleDeviceSharding(self.layer_device(layer), memory_kind=self.kind)

    def keep_restored(self, cfg: ModelConfig, weights: Weights, quantized: bool) -> None:
        """A saved state's experts, restored into host memory: the pool's numpy copies (quantized: and the
        scales)."""
        which_arrays = ("gate", "up", "down") + (("gate_scale", "up_scale", "down_scale") if quantized else ())
        for i, layer in enumerate(weights.layers):
            if cfg.sparse_layers[i]:
                for which in which_arrays:
                    x = np.asarray(getattr(layer.ffn, which))
                    self.numpy.setdefault(i, {})[which] = quant.pool_scale(x) if "scale" in which else x

    def store(self, cfg: ModelConfig):
        layers = []
        some = next(iter(self.numpy.values()), {})  # a sparse layer's arrays: the formats of every family
        for i in range(cfg.num_layers):
            if i in self.numpy:
                d = self.numpy[i]
                scales = tuple(d[f"{w}_scale"] for w in ("gate", "up", "down") if f"{w}_scale" in d)
                layers.append((d["gate"], d["up"], d["down"], *scales))
            else:  # a dense layer: a 1-expert placeholder keeps the pool's layer numbers the model's; zeros in
                # each family's own format (zero scales, zero codes: w = 0), so the store sees one format a family
                names = ("gate", "up", "down") + tuple(f"{w}_scale" for w in ("gate", "up", "down")
                                                       if f"{w}_scale" in some)
                layers.append(tuple(np.zeros_like(some[name][:1]) for name in names))
        return HostExpertStore(layers, compute_dtype=self.compute_dtype)


# Calls a timing graph makes one after the other (a fori_loop): a window's layers reach the fetch and the pool as
# many times, so the cost of dispatching the graph, which a lone call pays in full, counts 1/CALLS_A_GRAPH of it.
CALLS_A_GRAPH = 12


def measure_costs(cfg: ModelConfig, weights: Weights, pool, repeats: int = 5, native: bool = False) -> dict:
    """PCIe GB/s and fixed cost of an in-graph fetch, host pool GB/s, and the cost of one pool call from a graph (the
    FFI call or io_callback the decode graphs make, with no expert to compute). native: the fetch and the pool call
    as the native offload calls make them (bridge.offload_begin / offload_collect; the layers' pinned experts
    registered). Each figure is timed as CALLS_A_GRAPH calls in one graph, one after the other, as a decode window's
    layers make them (the pool's rate too: jobs of 4 and of 1 experts, as the graphs reach it): timed alone, a call also paid the graph's dispatch (0.2-0.9 ms "a call" on a GPU host, against
    0.025 ms a layer in the decode graphs), which made the model shun the pool."""
    layer = cfg.sparse_layers.index(True)
    w = weights.layers[layer].ffn
    ebytes = sum(a.nbytes for a in (w.gate, w.up, w.down)) // cfg.num_experts  # stored bytes (int4: packed)
    n = min(8, cfg.num_experts)
    e = cfg.num_experts
    loops = CALLS_A_GRAPH

    def fetch_graph(count):
        """CALLS_A_GRAPH of the decode graph's copies (slots.copy_experts, or the native begin) of `count` experts
        into n device rows, each call's rows feeding the next (the same buffers whatever the count, so the two
        graphs differ by the copies only)."""
        @jax.jit
        def fetch(g, u, d, ids):
            def one(i, dest):
                if native:
                    src = jnp.where(jnp.arange(n) < count, ids, -1)
                    rows, _, _ = offload_begin(pool, layer, jnp.zeros((1, cfg.hidden_size), jnp.float32),
                                               jnp.full((n,), -1, jnp.int32), jnp.zeros((1, n), jnp.float32), src,
                                               jnp.arange(n, dtype=jnp.int32), dest, cpu=False)
                    return rows
                (rows,) = slots_mod.copy_experts([(dest, jnp.arange(n, dtype=jnp.int32))], (g, u, d), ids, count)
                return rows
            dest = tuple(jnp.zeros((n, *a.shape[1:]), a.dtype) for a in (g, u, d))
            return jax.lax.fori_loop(0, loops, one, dest)
        return fetch

    def timed(fn, *args):  # median seconds of `repeats` calls after one warm-up
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    ids = jnp.arange(n, dtype=jnp.int32)
    t_n = timed(fetch_graph(n), w.gate, w.up, w.down, ids) / loops
    t_1 = timed(fetch_graph(1), w.gate, w.up, w.down, ids) / loops
    # The bytes' share of the time is t_n - t_1; where the fixed cost swamps it (small experts, a CPU: timing noise
    # can even make it negative) it counts as at least 5% of one call, so the rate stays finite and plausible
    # (it printed 1,032,192 GB/s once) and the fixed cost takes the rest.
    pcie_gbs = (n - 1) * ebytes / max(t_n - t_1, 0.05 * t_1, 1e-9) / 1e9
    pcie_call_s = max(t_1 - ebytes / (pcie_gbs * 1e9), 0.0)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    k = min(4, cfg.num_experts)
    # Other experts each call (as a decode's layers meet them), so the timing does not read them from the CPU's caches.
    turns = iter(range(1, 1 << 30))

    def pool_graph(experts: int):
        """CALLS_A_GRAPH pool jobs of `experts` experts each (FFI or io_callback, as the decode graphs reach the
        pool), each waiting for the last one's rows, as the next layer does."""
        @jax.jit
        def pool_calls(v, start):
            def one(i, v):
                first = (start + i * k) % e
                call_ids = jnp.where(jnp.arange(k) < experts, (first + jnp.arange(k)) % e, -1).astype(jnp.int32)
                weights = jnp.where(call_ids >= 0, 1.0, 0.0)[None, :].astype(jnp.float32)
                if native:
                    dest = tuple(jnp.zeros((1, *a.shape[1:]), a.dtype) for a in (w.gate, w.up, w.down))
                    none = jnp.full((k,), -1, jnp.int32)
                    _, _, token = offload_begin(pool, layer, v, call_ids, weights, none, none, dest, cpu=True)
                    rows = offload_collect(pool, layer, token, v)
                else:
                    rows = cpu_expert_rows(pool, layer, v, call_ids, weights)
                return v + 0.0 * rows
            return jax.lax.fori_loop(0, loops, one, v)
        return lambda v: pool_calls(v, jnp.int32(next(turns) * loops * k))

    # One job through the pool's own call first: it keeps callback_timeout_s (the FFI calls have none), so a timeout
    # shorter than one expert's product ends the start-up in one line, not the decode later.
    pool.compute(layer, x, np.arange(k, dtype=np.int32) % e, rng.random((1, k)).astype(np.float32))
    xv = jnp.asarray(x)
    t_empty = timed(pool_graph(0), xv) / loops
    p_1 = timed(pool_graph(1), xv) / loops
    p_k = timed(pool_graph(k), xv) / loops
    # The pool's rate is the (k-1) more experts' bytes over the time they add (a floor as for the fetch above); the
    # cost of reaching it beyond its compute is one expert's job less that expert's bytes, at least an empty call's.
    pool_gbs = (k - 1) * ebytes / max(p_k - p_1, 0.05 * p_1, 1e-9) / 1e9
    callback_s = max(p_1 - ebytes / (pool_gbs * 1e9), t_empty)
    pool.stats.reset()
    host_read_gbs = None
    if native:  # what the host's cores read together: the fetches and the pool share it
        from strata_jax.host_pool.measure import read_gbps
        host_read_gbs = read_gbps(256 << 20, pool.threads, repeats=2)
    return dict(pcie_gbs=pcie_gbs, pcie_call_s=pcie_call_s, pool_gbs=pool_gbs, callback_s=callback_s,
                host_read_gbs=host_read_gbs)


def following_misses(usage: np.ndarray, slots: int, k: int) -> float | None:
    """Misses a layer per T=1 window that slots following the decode would have met, from its usage [L, E] (entries
    routed to each expert since the slots were filled): each layer's entries outside its S most used experts, as a
    share of its entries, times K. Hindsight's best static slots: lru, which follows the decode as it goes, meets
    somewhat more. None where nothing was counted."""
    u = np.asarray(usage, np.int64).reshape(-1, np.shape(usage)[-1])
    total = int(u.sum())
    if total == 0:
        return None
    kept = int(-np.sort(-u, axis=1)[:, :slots].sum())
    return k * (total - kept) / total


def adapt_pcie_frac(cfg: ModelConfig, placement: Placement, itemsize: int, stats,
                    following: float | None = None) -> tuple[float, float] | None:
    """pcie_frac=auto after a request: (the share the cost model picks for the misses a layer its decode windows
    met, those misses), or None when it stays. The start-up choice assumes near-uniform routing, which misses
    more than real routing does (the spread 30B shape at half its experts in slots: 1.1 misses a layer, not 4).
    Below 1 the split is data in the graphs (they hold the pool); a choice that crosses 1 makes the engine take the
    other path's graphs (Engine._switch_graphs: at 1 no pool call a layer, as pcie_frac=1's). `stats`: the
    request's decode ExpertStats (T=1 windows: a window's layer holds K entries). following: after a request whose
    slots stayed as its prefill filled them (lru at 0), the misses slots that follow the decode would have met
    (following_misses): what a split's lru fetches meet, where the frozen slots' misses are what 0 meets (the
    spread 30B shape at 64 of 128 slots: 2.7 misses a layer frozen, ~1.1 under lru)."""
    if not placement.auto or not placement.costs or stats.entries < 64:
        return None
    misses = (stats.distinct_fetched + stats.distinct_cpu) * cfg.num_experts_per_tok / stats.entries
    costs = {k: placement.costs[k] for k in ("pcie_gbs", "pcie_call_s", "pool_gbs", "callback_s", "host_read_gbs")
             if k in placement.costs}
    frac, _ = choose_pcie_frac(cfg, placement.slots, itemsize, **costs, overlap=placement.native,
                               policy=placement.policy, misses=misses,
                               following=following if placement.frozen_lru else None)
    return None if frac == placement.pcie_frac else (frac, misses)


def expected_misses(cfg: ModelConfig, slots: int) -> float:
    """Misses per layer of a T=1 window when routing is near-uniform."""
    return cfg.num_experts_per_tok * (1.0 - slots / max(cfg.num_experts, 1))


def choose_pcie_frac(cfg: ModelConfig, slots: int, itemsize: int, pcie_gbs: float, pcie_call_s: float,
                     pool_gbs: float, callback_s: float, overlap: bool = False, policy: str = "lru",
                     host_read_gbs: float | None = None, misses: float | None = None,
                     following: float | None = None) -> tuple[float, dict]:
    """The share of misses to fetch that minimises a T=1 window's miss time in the measured cost model.

    The graph path runs the fetch and the pool one after the other (the pool call stalls the stream):
      cost(F) = [F>0] * pcie_call + F*m*b/pcie + [F<1] * (callback + (1-F)*m*b/pool)
    overlap (the native offload calls): the fetch and the pool work at once, so the slower one counts, and both
    read the same host memory, so together they go no faster than its read bandwidth (host_read_gbs):
      cost(F) = [F>0] * pcie_call + [F<1] * callback + max(F*m*b/pcie, (1-F)*m*b/pool, m*b/host_read)
    m: misses a layer per window, `misses` where measured (adapt_pcie_frac), else near-uniform routing's
    (expected_misses). At F = 0 the slots hold each prompt's most used experts under either policy
    (fills_from_prefill); misses measured under lru (which follows the decode) are not what such frozen slots
    meet, so there lru counts at least near-uniform routing's. following: misses measured with such frozen slots
    are not what lru's fetches (F > 0) would meet; where given (adapt_pcie_frac), F > 0 counts these instead.
    """
    b = cfg.expert_bytes(itemsize)
    costs = {}
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        m = misses if misses is not None else expected_misses(cfg, slots)
        if f > 0.0 and following is not None:
            m = following
        if f == 0.0 and policy == "lru":
            m = max(m, expected_misses(cfg, slots))
        fetch_s, pool_s = f * m * b / (pcie_gbs * 1e9), (1 - f) * m * b / (pool_gbs * 1e9)
        fixed = (pcie_call_s if f > 0 else 0.0) + (callback_s if f < 1 else 0.0)
        both = m * b / (host_read_gbs * 1e9) if host_read_gbs and 0 < f < 1 else 0.0
        costs[f] = fixed + (max(fetch_s, pool_s, both) if overlap else fetch_s + pool_s)
    best = min(costs, key=lambda f: (costs[f], -f))
    return best, costs


def build(cfg: ModelConfig, opts: EngineOptions, weights: Weights, host: HostExperts, slots: int,
          why: str) -> Placement:
    # A failed pool job is reported as one line by the engine; JAX's own traceback log would repeat it.
    logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL)
    threads = opts.cpu_threads or usable_cores()
    try:  # a bad STRATA_POOL_NATIVE, or =1 where no C compiler builds the int4 kernel: one line
        pool = HostPool(host.store(cfg), threads=threads, timeout_s=opts.callback_timeout_s,
                        native_calls=opts.pool_calls in ("auto", "layer"))
    except (ValueError, RuntimeError, OSError) as e:
        raise StrataError(f"host pool: {e}") from None
    host.numpy.clear()
    itemsize = expert_itemsize(opts)
    lines = [f"expert cache: {slots} of {cfg.num_experts} slots per MoE layer ({why}), policy {opts.cache_policy}, "
             f"{slot_bytes(cfg, slots, itemsize) / 2**20:.1f} MiB on the device; experts in "
             f"{host.kind} memory; host pool: {threads} threads ({native.describe_experts(short=True)}; "
             f"{blas.describe()}" + (f"; {native.describe()}" if np.uint8 in (pool.store.dtype_of("gate"), pool.store.dtype_of("down"))
                                  else "")
             + f"), reached by {'XLA FFI' if native_calls(pool) else 'io_callback'}"]
    native_offload, why_not = False, f"pool_calls={opts.pool_calls}"
    if opts.pool_calls == "auto":
        several = opts.devices != "1" and not (opts.devices == "all" and jax.device_count() == 1)
        why_not = "several devices" if several else register_native_fetch(cfg, weights, pool)
        native_offload = why_not is None
    costs = None
    if opts.pcie_frac == "auto":
        try:
            costs = measure_costs(cfg, weights, pool, native=native_offload)
        except HostPoolError as e:  # e.g. a --callback_timeout_s shorter than one expert's product
            pool.close()
            raise StrataError(f"{e} while measuring start-up costs for pcie_frac=auto "
                              f"(see --callback_timeout_s)") from None
        frac, by_frac = choose_pcie_frac(cfg, slots, itemsize, **costs, overlap=native_offload,
                                          policy=opts.cache_policy)
        lines.append(
            f"pcie_frac: {frac:g} (auto: PCIe {costs['pcie_gbs']:.1f} GB/s + {costs['pcie_call_s'] * 1e3:.2f} ms a "
            f"fetch {'call' if native_offload else 'loop'}, host pool {costs['pool_gbs']:.1f} GB/s, a pool call "
            f"{costs['callback_s'] * 1e3:.2f} ms{', both at once' if native_offload else ''}"
            + (f" within the host's {costs['host_read_gbs']:.1f} GB/s" if costs.get("host_read_gbs") else "")
            + "; re-chosen after each request from its misses; "
            f"modelled ms per layer at T=1: " + ", ".join(f"{f:g}: {c * 1e3:.2f}" for f, c in by_frac.items()) + ")")
        costs["by_frac"] = by_frac
    else:
        frac = float(opts.pcie_frac)
        lines.append(f"pcie_frac: {frac:g}" + (" (nothing fetched: the slots take each prompt's most used experts "
                                                 "after its prefill, as under the static policy)"
                                                 if frac == 0.0 and opts.cache_policy == "lru" else ""))
    lines.append("offload calls: " + ("native (fetches and pool jobs enqueued on the stream; no read-back)"
                                      if native_offload else f"graph loops and lax.cond ({why_not})"))
    return Placement(slots=slots, policy=opts.cache_policy, pcie_frac=frac, pool=pool, host_kind=host.kind,
                     lines=lines, costs=costs, native=native_offload, auto=opts.pcie_frac == "auto")


def plan_placement(cfg: ModelConfig, opts: EngineOptions, reserved_bytes: int, devices: int = 1,
                   layer_device=None):
    """Before the weights are read: the slot count (None: every expert on the device), why, and where the host
    copies of the experts go when offload is on. reserved_bytes: the device memory the engine keeps for the KV cache
    and the largest prefill chunk's activations."""
    if any(cfg.sparse_layers):
        expert_format(opts, cfg)  # int4 on experts no group divides: one line before anything loads
    slots, why = decide_slots(cfg, opts, reserved_bytes, devices)
    return slots, why, (HostExperts(cfg, jnp.dtype(opts.dtype), layer_device) if slots is not None else None)


def quantized_line(cfg: ModelConfig, weights: Weights, opts: EngineOptions, on_host: bool) -> str:
    """The start-up line of quantized experts: their bytes where they live, beside the same experts in `dtype`."""
    moe_ffns = [layer.ffn for layer in weights.layers if isinstance(layer.ffn, moe.MoEWeights)]
    q_bytes = sum(a.nbytes for f in moe_ffns for a in (f.gate, f.up, f.down))
    scale_bytes = sum(a.nbytes for f in moe_ffns for a in f.scales)
    formats = quant.family_formats(expert_format(opts, cfg))
    how = {"int8": "one bf16 scale per output row", "int4": "one bf16 scale per 64 inputs, two weights a byte",
           "int4-g32": "one bf16 scale per 32 inputs, two weights a byte",
           quant.Q4K: "GGUF Q4_K's blocks: 6-bit scales and minima per 32 inputs, fp16 d and dmin per 256, two "
                      "weights a byte",
           quant.Q2K: "GGUF Q2_K's blocks: 4-bit scales and minima per 16 inputs, fp16 d and dmin per 256, four "
                      "weights a byte",
           quant.Q6K: "GGUF Q6_K's (or Q3_K's, values unchanged) blocks: int8 scales per 16 inputs, fp16 d per "
                      "256, 48 bytes per 64 weights",
           quant.Q6KM: "a family of mixed GGUF K types' blocks (Q4_K_M's down: Q4_K, Q6_K), values unchanged: int8 "
                       "scales and uint8 minima per 16 inputs, fp16 d and dmin per 256, 48 bytes per 64 weights",
           "int4-g32f": "GGUF Q4_0's blocks: one float32 scale per 32 inputs, two weights a byte",
           "int4-g32m": "GGUF Q4_1's blocks: a float32 scale and minimum per 32 inputs, two weights a byte",
           "int8-g32": "GGUF Q8_0 / Q5_0's (or IQ2_XXS, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, IQ1_S's) blocks: one float32 "
                       "scale per 32 inputs, a byte a weight",
           "int8-g16": "GGUF IQ2_XS, IQ2_S, IQ1_M's (or Q6_K / Q3_K's, by name) blocks: one float32 scale per 16 "
                       "inputs, a byte a weight",
           "int8-g32m": "GGUF Q5_K / Q5_1's blocks: a float32 scale and minimum per 32 inputs, a byte a weight",
           "int8-g16m": "GGUF Q2_K's blocks (by name) or the values of a family of mixed types int6-q6km does not "
                        "hold (Q8_0 beside Q6_K): a float32 scale and minimum per 16 inputs, a byte a weight"}
    full = cfg.num_sparse_layers * cfg.num_experts * cfg.expert_bytes(jnp.dtype(opts.dtype).itemsize)
    kept = all(f in quant.GGUF_KEPT.values() or f in (quant.WIDE, quant.Q6KM) for f in formats)  # GGUF's values
    at_load = "read as stored or quantized at load" if kept else "quantized at load"
    held = (f"{formats[0]}, {how[formats[0]]}" if formats[0] == formats[1] else  # per family: each its own
            f"gate/up {formats[0]}, {how[formats[0]]}; down {formats[1]}, {how[formats[1]]}")
    return (f"experts: {held} ({at_load}): {q_bytes / 2**20:.1f} MiB "
            f"{'in host memory' if on_host else 'on the device'} + {scale_bytes / 2**20:.1f} MiB of scales on the "
            f"device ({full / 2**20:.1f} MiB as {opts.dtype})")


def expert_paths(cfg: ModelConfig, placement: Placement, route: approx.RouteApprox, defer_cpu: defer.DeferCPU,
                 kernel: bool, block_ends: tuple = (), native_defer: bool = False,
                 plan_kernel: bool = False, route_kernel: bool = False,
                 prefetch: int = 0) -> tuple[slots_mod.OffloadedExperts, slots_mod.OffloadedExperts]:
    """The offloaded expert paths of the prefill and of the decode graphs. The routing approximations, the deferral
    and the Pallas expert FFN act in decode windows only; the prefill keeps the exact XLA path. Without the cpu
    path (needs_cpu_path) both are built without the host pool (no callback). block_ends: the last layer of each
    device's block (parallel=layers), never deferred. native_defer: the decode graphs scan (plan.scans_offload),
    so the deferral runs through the native calls there (OffloadedExperts.native_deferred). plan_kernel: the
    decode windows' plan and slot-cache update as one Pallas kernel (OffloadedExperts.plan_and_update). prefetch:
    the decode windows' experts a token prefetched for the next layer (prefetch_setting: 0 where not served).
    route_kernel: the decode windows' exact route in one Pallas kernel (moe.route(kernel=True))."""
    pool = placement.pool if placement.cpu_path else None
    native = placement.native_offload()
    lru = placement.policy == "lru"
    exact = slots_mod.OffloadedExperts(cfg, pool, native=native, lru=lru)
    if not (route.active or defer_cpu.active or kernel or plan_kernel or prefetch or route_kernel):
        return exact, exact
    return exact, slots_mod.OffloadedExperts(cfg, pool, route=route, defer_cpu=defer_cpu, kernel=kernel,
                                             block_ends=block_ends, native=native, native_defer=native_defer,
                                             plan_kernel=plan_kernel, prefetch=prefetch, lru=lru,
                                             route_kernel=route_kernel)


def prefetch_setting(opts: EngineOptions, placement: Placement | None, scanned_offload: bool,
                     approx_active: bool) -> tuple[int, list[str]]:
    """(experts a token the decode windows prefetch, the start-up lines): opts.prefetch where the scanned offload
    graph runs the native calls (plan.scans_offload), else 0 with one line saying why it is ignored."""
    n = opts.prefetch
    if not n:
        return 0, []
    if placement is None:
        return 0, [f"prefetch={n}: ignored (every expert is on the device)"]
    if not scanned_offload:
        return 0, [f"prefetch={n}: ignored (served by the scanned offload graph only: layer_loop=scan, the native "
                   "offload calls, one device, one kind of layer)"]
    return n, [f"prefetch: {n} experts a token of layer l+1's router on layer l's FFN input, copied into layer "
               "l+1's slots (lru victims) while layer l computes; decode windows of the scanned graph"
               + ("; the static policy prefetches nothing" if placement.policy == "static" else "")
               + ("; with the routing approximations on, outputs depend on the slots (not exact)"
                  if approx_active else "")]


def slot_refresh_lines(opts: EngineOptions, placement: Placement | None) -> list[str]:
    """The start-up line of slot_refresh: on where the slots are filled from each prefill, else ignored, with why."""
    n = opts.slot_refresh
    if not n:
        return []
    if placement is None or not placement.fills_from_prefill:
        return [f"slot_refresh={n}: ignored (the slots are filled from the prefill only under the static policy or "
                "lru with pcie_frac 0)"]
    return [f"slot_refresh: every {n} decode windows (T=1) the slots re-take the request's most used experts so far, "
            "copying those not in a slot"]


def register_native_fetch(cfg: ModelConfig, weights: Weights, pool) -> str | None:
    """Give the pool's native handler each sparse layer's pinned host experts (weights.layers[i].ffn.gate/up/down),
    for the native offload calls; None when done, else why not (one device, the FFI handler, host arrays whose
    address is known)."""
    if pool.ffi_handle() is None:
        return "no FFI handler"
    for i, layer in enumerate(weights.layers):
        if not cfg.sparse_layers[i]:
            continue
        try:
            arrays = [getattr(layer.ffn, which) for which in ("gate", "up", "down")]
            if any(len(a.sharding.device_set) != 1 for a in arrays):
                return "experts spread over devices"
            pointers = [a.addressable_data(0).unsafe_buffer_pointer() for a in arrays]
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:  # jax.errors.JaxRuntimeError is one
            return f"host expert address unknown ({type(e).__name__})"
        pool.register_fetch(i, *pointers)
    return None
