"""Experts off the GPU: a device expert cache of S slots per layer, the window's plan, in-graph PCIe fetch from
pinned host memory, and the host pool reached with io_callback.

Per sparse layer and window (all inside the compiled graph, no host round trip but the pool's):

    route   -> the window's distinct experts ids [N] and the combine matrix [T, N]
    plan    -> each distinct expert is `resident` (slot table hit), `fetch` or `cpu` (the misses, heaviest by routing
               mass first over PCIe: round(pcie_frac * misses) of them)
    gpu     -> in blocks of B experts: gather resident slots, copy fetched experts from pinned host memory into the
               block (a bounded loop), run the expert FFN; the lru policy also writes each fetched expert into a
               victim slot (least recently used, never one this window reads); overflow goes to a trash row
    cpu     -> one io_callback hands the pool the cpu experts' rows, under lax.cond (no callback when none)
    combine -> y = gpu rows + cpu rows

The arithmetic of every expert is the same wherever it runs, so the logits do not depend on placement up to
float summation order.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import SingleDeviceSharding

from strata_jax.host_pool import cpu_expert_rows
from strata_jax.host_pool.bridge import native_calls, offload_begin, offload_collect, offload_prefetch
from strata_jax.pallas_kernels.expert_ffn import expert_ffn as expert_ffn_kernel
from strata_jax.pallas_kernels.slot_plan import slot_plan
from strata_jax.model import moe, quant
from strata_jax.offload import approx, defer
from strata_jax.model.config import ModelConfig

NONE, RESIDENT, FETCH, CPU, SKIP = 0, 1, 2, 3, 4
COUNTERS = ("entries", "entries_resident", "entries_fetched", "entries_cpu",
            "distinct", "distinct_resident", "distinct_fetched", "distinct_cpu",
            # the routing approximations (experts/approx.py); zero when they are off
            "distinct_skipped", "entries_skipped", "prior_tokens", "prior_tokens_changed", "prior_entries",
            "prior_hits_unbiased", "prior_hits", "swaps",
            # prefetch=N: experts copied into this layer's slots on the last layer's prediction, and how many of them
            # a window then read (each counted once, at its first read)
            "prefetched", "prefetch_used")
POLICIES = ("lru", "static")


@struct.dataclass
class SlotCache:
    """One sparse layer's device expert cache. Row S of the weight arrays is a trash row: never in the table."""
    gate: jax.Array  # [S+1, I, H]
    up: jax.Array  # [S+1, I, H]
    down: jax.Array  # [S+1, H, I]
    table: jax.Array  # [E] int32: expert -> slot, -1 when not resident
    expert_of: jax.Array  # [S+1] int32: slot -> expert, -1 when empty
    last_use: jax.Array  # [S+1] int32: window clock of the last read (lru)
    clock: jax.Array  # [] int32
    usage: jax.Array  # [E] int32: entries routed to each expert (the static policy fills from the prefill's)
    counters: jax.Array  # [len(COUNTERS)] int32, summed over windows until reset
    # Settings as data, so one compiled graph serves every policy and PCIe share.
    pcie_frac: jax.Array  # [] float32: share of misses fetched over PCIe; the rest go to the host pool
    lru: jax.Array  # [] bool: fetched experts enter slots (lru); False: slots frozen (static)
    # The route prior's range mode: running sum and count of decode tokens' logit ranges (max - min).
    range_sum: jax.Array  # [] float32
    range_count: jax.Array  # [] int32
    prefetched: jax.Array  # [S+1] int32: 1 while a slot holds a prefetched expert no window has read yet
    # Row of this layer's slot 0 in gate / up / down: 0 for a layer's own cache; l * (S+1) for layer l's view of a
    # stacked cache (init_stacked_slot_cache), whose weight arrays hold every layer's slots, flat [L*(S+1), ...].
    base: jax.Array | int = 0  # [] int32

    @property
    def slots(self) -> int:
        return self.expert_of.shape[-1] - 1


def device_sharding(memory_kind: str = "device") -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)


def host_memory_kind() -> str:
    """pinned_host where the backend has it (GPU, and CPU in jax 0.11), else the device itself."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "device"


def slot_storage_of(state: SlotCache, cfg: ModelConfig) -> tuple:
    """A slot cache's storage per family (gate/up's, down's) as init_slot_cache takes it: the dtype, or quant.Q2K
    where a uint8 row holds four inputs (int2-q2k)."""
    quarter = lambda a, width: a.dtype == jnp.uint8 and a.shape[-1] * 4 == width
    three_quarters = lambda a, width: a.dtype == jnp.uint8 and a.shape[-1] * 4 == 3 * width  # int6-q6k
    return tuple(quant.Q2K if quarter(a, w) else quant.Q6K if three_quarters(a, w) else a.dtype
                 for a, w in ((state.gate, cfg.hidden_size), (state.down, cfg.moe_intermediate_size)))


def init_slot_cache(cfg: ModelConfig, slots: int, dtype, policy: str = "lru", pcie_frac: float = 1.0) -> SlotCache:
    """dtype: how the experts are stored (uint8: int4 packed two a byte along the input dimension; quant.Q2K: uint8,
    four a byte); a pair (gate/up's, down's) where the two families are held in formats of different storage
    (int4-q4k/int8-g16)."""
    assert policy in POLICIES and 0.0 <= pcie_frac <= 1.0
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gu_dtype, down_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    fi, hi = quant.stored_in_dim(f, down_dtype), quant.stored_in_dim(h, gu_dtype)
    gu_dtype, down_dtype = (jnp.uint8 if isinstance(d, str) else d for d in (gu_dtype, down_dtype))
    return SlotCache(
        gate=jnp.zeros((slots + 1, f, hi), gu_dtype), up=jnp.zeros((slots + 1, f, hi), gu_dtype),  # [S+1, I, H']
        down=jnp.zeros((slots + 1, h, fi), down_dtype),  # [S+1, H, I']
        table=jnp.full((e,), -1, jnp.int32), expert_of=jnp.full((slots + 1,), -1, jnp.int32),
        last_use=jnp.full((slots + 1,), -1, jnp.int32), clock=jnp.int32(0),
        usage=jnp.zeros((e,), jnp.int32), counters=jnp.zeros((len(COUNTERS),), jnp.int32),
        pcie_frac=jnp.float32(pcie_frac), lru=jnp.bool_(policy == "lru"),
        range_sum=jnp.float32(0), range_count=jnp.int32(0), prefetched=jnp.zeros((slots + 1,), jnp.int32),
        base=jnp.int32(0))


# ---- every layer's slot cache in one (the scanned offload graph) --------------------------------------------------

WEIGHTS = ("gate", "up", "down")


def init_stacked_slot_cache(cfg: ModelConfig, layers: int, slots: int, dtype, policy: str = "lru",
                            pcie_frac: float = 1.0) -> SlotCache:
    """`layers` layers' slot caches in one SlotCache for the scanned graph: the weights flat [L*(S+1), ...] (layer
    l's slots and trash row at rows l*(S+1)..: the native offload calls and the Pallas kernel address one array
    with absolute rows, and nothing is sliced out), every other leaf with a leading layer axis [L, ...]."""
    one = init_slot_cache(cfg, slots, dtype, policy, pcie_frac)
    weights = {k: jnp.zeros((layers * (slots + 1), *getattr(one, k).shape[1:]), getattr(one, k).dtype)
               for k in WEIGHTS}
    rest = {f.name: jnp.broadcast_to(getattr(one, f.name), (layers, *jnp.shape(getattr(one, f.name))))
            for f in dataclasses.fields(one) if f.name not in WEIGHTS and f.name != "base"}
    return SlotCache(**weights, **{k: jnp.array(v) for k, v in rest.items()},
                     base=jnp.arange(layers, dtype=jnp.int32) * (slots + 1))


def layer_view(stack: SlotCache, layer) -> SlotCache:
    """Layer `layer` (a Python int or a traced int32) of a stacked cache: its small leaves sliced out, the weight
    arrays whole (the view's `base` says where its rows are)."""
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
    return stack.replace(**{f.name: pick(getattr(stack, f.name)) for f in dataclasses.fields(stack)
                            if f.name not in WEIGHTS})


def layer_states(experts) -> list[SlotCache]:
    """The sparse layers' slot caches of a KVCache's `experts`, in layer order, whichever form it holds: the
    per-layer list (None for dense layers: left out), or one stacked cache (each layer's view: its own table,
    usage, counters; the weight arrays shared)."""
    if isinstance(experts, SlotCache):
        return [layer_view(experts, i) for i in range(experts.expert_of.shape[0])]
    return [s for s in experts if s is not None]


def put_layer(stack: SlotCache, layer, view: SlotCache) -> SlotCache:
    """layer_view's inverse: the view's small leaves written back at `layer`, its weight arrays taken whole."""
    put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), layer, 0)
    return stack.replace(**{f.name: (getattr(view, f.name) if f.name in WEIGHTS
                                     else put(getattr(stack, f.name), getattr(view, f.name)))
                            for f in dataclasses.fields(stack)})


SMALL = tuple(f.name for f in dataclasses.fields(SlotCache) if f.name not in WEIGHTS)


@struct.dataclass
class PackedStates:
    """A stacked cache as the scanned offload body carries it: the weight arrays as they are, the small leaves of
    every layer (table, expert_of, last_use, clock, usage, counters, settings, base) in one int32 array [L, P], so a
    layer reads its state with one slice and writes it back with one in-place update, where eleven leaves took a
    slice and an update each (22 small kernels a layer, a quarter of the body's). float32 leaves ride bitcast,
    bools as 0 / 1: unpacking gives the leaves back bit for bit."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    packed: jax.Array  # [L, P] int32
    spec: tuple = struct.field(pytree_node=False)  # ((name, per-layer shape, dtype name), ...) in SMALL's order


def _to_int32(a: jax.Array) -> jax.Array:
    if a.dtype == jnp.int32:
        return a
    if a.dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(a, jnp.int32)
    assert a.dtype == jnp.bool_, a.dtype
    return a.astype(jnp.int32)


def _from_int32(a: jax.Array, dtype: str) -> jax.Array:
    if dtype == "float32":
        return jax.lax.bitcast_convert_type(a, jnp.float32)
    return a != 0 if dtype == "bool" else a


def pack_states(stack: SlotCache) -> PackedStates:
    """A stacked cache (init_stacked_slot_cache) as PackedStates; unpack_states is its inverse."""
    layers = stack.expert_of.shape[0]
    leaves = [jnp.asarray(getattr(stack, name)) for name in SMALL]
    spec = tuple((name, a.shape[1:], str(a.dtype)) for name, a in zip(SMALL, leaves))
    packed = jnp.concatenate([_to_int32(a).reshape(layers, -1) for a in leaves], axis=1)
    return PackedStates(gate=stack.gate, up=stack.up, down=stack.down, packed=packed, spec=spec)


def _unpack(packed: jax.Array, spec: tuple) -> dict:
    """The small leaves from packed [..., P] (one layer's row, or every layer's [L, P])."""
    out, at, lead = {}, 0, packed.shape[:-1]
    for name, shape, dtype in spec:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = _from_int32(packed[..., at:at + n].reshape(*lead, *shape), dtype)
        at += n
    return out


def unpack_states(states: PackedStates) -> SlotCache:
    return SlotCache(gate=states.gate, up=states.up, down=states.down, **_unpack(states.packed, states.spec))


def packed_layer_view(states: PackedStates, layer) -> SlotCache:
    """layer_view of PackedStates: one slice of the packed rows."""
    row = jax.lax.dynamic_index_in_dim(states.packed, layer, 0, keepdims=False)
    return SlotCache(gate=states.gate, up=states.up, down=states.down, **_unpack(row, states.spec))


def packed_put_layer(states: PackedStates, layer, view: SlotCache) -> PackedStates:
    """put_layer of PackedStates: the view's small leaves as one row, written back in place."""
    row = jnp.concatenate([_to_int32(jnp.asarray(getattr(view, name)).astype(dtype)).reshape(-1)
                           for name, _, dtype in states.spec])
    return states.replace(gate=view.gate, up=view.up, down=view.down,
                          packed=jax.lax.dynamic_update_index_in_dim(states.packed, row, layer, 0))


def to_device(x: jax.Array) -> jax.Array:
    """Inside jit: a slice of a pinned-host array copied to device memory (in-graph PCIe copy), on the device the
    graph runs on (parallel=layers: each block's own)."""
    return jax.device_put(x, jax.memory.Space.Device)


def copy_experts(dests: Sequence[tuple[tuple, jax.Array]], hosts: tuple, expert_ids: jax.Array, count) -> tuple:
    """The in-graph PCIe copy: for i < count (a bounded loop; a traced count keeps a dynamic trip count), each host
    array's expert expert_ids[i] is copied to device memory once and written at row rows[i] of that array's
    destination in every (arrays, rows) of `dests` (arrays: one per host array). Returns each dest's arrays."""
    def one(i, arrays):
        expert, at = expert_ids[i], [rows[i] for _, rows in dests]
        out = [list(a) for a in arrays]
        for k, host in enumerate(hosts):
            wk = to_device(jax.lax.dynamic_index_in_dim(host, expert, keepdims=True))  # PCIe
            for d in range(len(dests)):
                out[d][k] = jax.lax.dynamic_update_index_in_dim(out[d][k], wk, at[d], 0)
        return tuple(tuple(a) for a in out)

    return jax.lax.fori_loop(0, count, one, tuple(tuple(a) for a, _ in dests))


def stable_ranks(key: jax.Array) -> jax.Array:
    """Each element's position [M] int32 in a stable ascending sort of key [M] (the inverse of jnp.argsort's
    permutation), from an [M, M] comparison: one fused elementwise + reduce on a GPU, where a sort and the scatter
    that inverts it are kernels of their own (a window's plan runs per layer, M <= E + 1)."""
    m = key.shape[0]
    idx = jnp.arange(m, dtype=jnp.int32)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (idx[None, :] < idx[:, None]))
    return jnp.sum(before, axis=1, dtype=jnp.int32)


def prefix_counts(flags: jax.Array) -> jax.Array:
    """cumsum(flags) [N] int32 as a triangular masked sum (fuses with its neighbours; N is a window's experts)."""
    n = flags.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    return jnp.sum((idx[None, :] <= idx[:, None]) & flags[None, :], axis=1, dtype=jnp.int32)


def set_at(base: jax.Array, *updates) -> jax.Array:
    """base.at[index[where]].set(value[where]) for each (where, index, value) of `updates` in turn (a later update
    wins where two name one element; within one the indices are distinct), as one dense [len(base), M] match and one
    max-reduction that finds each element's last update (no scatter kernel: the slot table's updates fuse into a few
    loop fusions a layer). value: [N] or a scalar."""
    where = jnp.concatenate([w for w, _, _ in updates])
    index = jnp.concatenate([i.astype(jnp.int32) for _, i, _ in updates])
    value = jnp.concatenate([jnp.broadcast_to(jnp.asarray(v, base.dtype), i.shape) for _, i, v in updates])
    rows = jnp.arange(base.shape[0], dtype=jnp.int32)
    order = jnp.arange(1, index.shape[0] + 1, dtype=jnp.int32)
    last = jnp.max(jnp.where(where[None, :] & (index[None, :] == rows[:, None]), order[None, :], 0), axis=1)  # [B]
    return jnp.where(last > 0, value[jnp.maximum(last - 1, 0)], base)


def lru_victims(state: SlotCache, kept: jax.Array, wanted: jax.Array, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where each wanted expert [M] goes, by its rank [M] among the wanted (0, 1, ...): (insert [M], dest [M]). The
    victims are the slots not `kept` [S+1], least recently used (empty ones first), the trash row S never; under
    lru the wanted one of rank j takes the j-th victim while there is one, else (and under static) the trash row S.
    In sort order without a sort: slot t is the victim of the rank equal to t's rank."""
    s = state.slots
    rows = jnp.arange(s + 1, dtype=jnp.int32)
    kept = kept | (rows == s)
    victim_rank = stable_ranks(jnp.where(kept, jnp.iinfo(jnp.int32).max, state.last_use))  # [S+1]
    n_victims = jnp.where(state.lru, s - jnp.sum(kept[:s]), 0)
    insert = wanted & (rank < n_victims)
    victim = jnp.sum(jnp.where(victim_rank[None, :] == rank[:, None], rows[None, :], 0), axis=1)
    return insert, jnp.where(insert, victim, s).astype(jnp.int32)  # the trash row s when not kept


def plan(r: moe.Route, state: SlotCache, cpu: bool = True, tail_skip: int = 0) -> tuple[jax.Array, jax.Array]:
    """Kinds [N] (NONE / RESIDENT / FETCH / CPU / SKIP) and slots [N] of the window's distinct experts. cpu=False
    (a graph built without the host pool): every miss is fetched, whatever state.pcie_frac says. tail_skip=R > 0:
    a miss that every entry routes at rank >= R is skipped (approx.py)."""
    ids = r.expert_ids
    used = ids >= 0
    slot = jnp.where(used, state.table[jnp.maximum(ids, 0)], -1)
    resident = used & (slot >= 0)
    miss = used & ~resident
    skip = jnp.zeros_like(miss)
    if tail_skip:
        skip = miss & (approx.min_rank(r, r.topk_ids.shape[1]) >= tail_skip)
        miss = miss & ~skip
    frac = state.pcie_frac if cpu else 1.0
    n_fetch = jnp.floor(frac * jnp.sum(miss) + 0.5).astype(jnp.int32)
    mass = jnp.sum(r.combine, axis=0)  # [N]
    miss_rank = stable_ranks(jnp.where(miss, -mass, jnp.inf))  # misses, heaviest first
    fetch = miss & (miss_rank < n_fetch)
    kind = jnp.where(resident, RESIDENT, jnp.where(fetch, FETCH, jnp.where(miss, CPU, NONE)))
    kind = jnp.where(skip, SKIP, kind).astype(jnp.int32)
    return kind, slot


def count(kind: jax.Array, r: moe.Route, extra: dict | None = None) -> jax.Array:
    """This window's counters [len(COUNTERS)]; `extra`: the approximations' counters by name. The per-kind sums in
    one reduction over a [8, N] matrix (entries, then distinct experts, of RESIDENT, FETCH, CPU, SKIP)."""
    is_kind = kind[None, :] == jnp.array([RESIDENT, FETCH, CPU, SKIP], jnp.int32)[:, None]  # [4, N]
    sums = jnp.sum(jnp.concatenate([jnp.where(is_kind, r.entry_counts[None, :], 0), is_kind.astype(jnp.int32)]),
                   axis=1, dtype=jnp.int32)  # [8]
    entries, distinct = sums[:3], sums[4:7]
    values = dict(distinct_skipped=sums[7], entries_skipped=sums[3], **(extra or {}))
    rest = [jnp.asarray(values.get(name, 0), jnp.int32) for name in COUNTERS[8:]]
    return jnp.concatenate([jnp.sum(entries)[None], entries, jnp.sum(distinct)[None], distinct, jnp.stack(rest)])


class WindowPlan(NamedTuple):
    """A window's plan of its distinct experts [N] (moe.Route.expert_ids): plan() and the victim slots."""
    kind: jax.Array  # [N] int32: NONE / RESIDENT / FETCH / CPU / SKIP
    slot: jax.Array  # [N] int32: the slot of a resident expert, -1 otherwise
    fetch: jax.Array  # [N] bool: kind == FETCH
    insert: jax.Array  # [N] bool: fetched and kept in a victim slot (lru, while victims last)
    dest: jax.Array  # [N] int32: the victim slot of an inserted expert, the trash row S otherwise
    block_kind: jax.Array  # [N] int32: the kinds the XLA blocks run (all but the Pallas kernel's)
    gpu_order: jax.Array  # [N] int32: positions of the blocks' experts first
    n_gpu: jax.Array  # [] int32: how many experts the blocks run


class NativeOffload(NamedTuple):
    """The native offload calls of a window (host_pool/native_ffi.cc): one FFI call per layer copies the window's
    fetched experts into their victim slots (or, without one: static policy, no victim left, into the window's
    staging rows) and hands its cpu experts to the pool; a second collects the pool's rows after the GPU has run its
    own. Nothing depends on a count the host would read back. One pair of calls takes at most `max_experts`
    distinct experts (the staging rows are a temporary of that many experts): a larger window (a prefill chunk) runs
    in blocks of that many, a pair each (OffloadedExperts.native_window)."""
    pool: object  # strata_jax.host_pool.HostPool, with its layers' pinned experts registered
    max_experts: int = 32  # NATIVE_MAX_EXPERTS


def native_defer_fits(cfg: ModelConfig, window: int) -> bool:
    """Whether every decode window (T <= window) has few enough distinct experts for one pair of native calls, as
    the deferral through them wants (OffloadedExperts.native_deferred)."""
    return min(window * cfg.num_experts_per_tok, cfg.num_experts) <= NativeOffload._field_defaults["max_experts"]


class OffloadedExperts:
    """The expert path of a sparse layer with offload: `(layer, x, host weights, valid, state) -> moe.ExpertsOut`
    (y, state, and the deferred cpu rows still owed (defer.Pending) or None).

    One window runs route -> plan_window -> submit_cpu (deferral only) -> gpu_experts -> cpu_rows -> combine ->
    update_slots, each in its own named scope (the profiles' phases).

    `w.gate/up/down` are the layer's experts in host memory (int8 experts: their q, with `w.scales` on the device,
    read by expert id); `pool` computes the cpu kind. Without a pool the
    graph has no callback and no lax.cond around it (each makes the GPU stream wait for the host): every miss is
    fetched. `block`: experts per GPU block (bounds the staging memory of prefill chunks). `route`: the routing
    approximations (experts/approx.py; the decode graphs only), off by default. `block_ends`: layers after which a
    block of layers ends on one device (parallel=layers): like the model's last layer, never deferred (their rows
    must be in the activations that leave the device).
    """

    def __init__(self, cfg: ModelConfig, pool=None, block: int = 32, route: approx.RouteApprox = approx.OFF,
                 defer_cpu: defer.DeferCPU = defer.OFF, kernel: bool = False, block_ends: tuple = (),
                 native: NativeOffload | None = None, native_defer: bool = False, plan_kernel: bool = False,
                 prefetch: int = 0, lru: bool = False, route_kernel: bool = False):
        self.cfg, self.pool, self.block, self.approx = cfg, pool, block, route
        self.route_kernel = route_kernel  # the exact route's softmax and top-K in one Pallas kernel (moe.route)
        # lru: the cache policy is lru for these graphs' lifetime (Placement.reconfigure rebuilds them when it
        # changes). A window of at most S distinct experts then finds every fetch a victim slot (lru_victims: S less
        # the slots it reads >= its fetches), so nothing stages and the native windows leave the staging rows'
        # expert-kernel call out (can_stage): two kernels a layer fewer in decode.
        self.lru = lru
        self.native = native  # the native offload calls (NativeOffload), or None: the graph path
        self.no_defer = frozenset(block_ends) | {cfg.num_layers - 1}
        # kernel: the Pallas expert FFN (pallas_kernels/expert_ffn.py) reads resident and fetched experts in their
        # slots (fetched ones are copied straight into their victim slots); bf16 on a GPU.
        self.kernel = kernel
        self.defer = defer_cpu if pool is not None else defer.OFF
        # check mode: the layer's late rows join right after its own combine (transformer.forward asks).
        self.join_now = self.defer.mode == "check"
        # the deferral through the native calls in the scanned body: every decode window fits one pair of calls
        # (native_defer_fits); else the deferral keeps the unrolled graph and its io_callbacks
        self.native_defer = bool(native_defer and native is not None and self.defer.active)
        # the plan and the slot-cache update of the native windows in one Pallas kernel (pallas_kernels/slot_plan.py);
        # the routing approximations' tail skip keeps the XLA forms (the kernel has no skipped kind)
        self.plan_kernel = bool(plan_kernel and native is not None and not route.tail_skip)
        # prefetch=N: each layer copies the N experts a token that the next layer's router picks on this layer's
        # FFN input into the next layer's slots (prefetch_layer); the scanned native body only (offload_layers)
        self.prefetch = min(int(prefetch), cfg.num_experts) if native is not None else 0

    def layer_state(self, stack, layer) -> SlotCache:
        """Layer `layer`'s view of a stacked slot cache, or of its scan_state form (transformer.offload_layers)."""
        return packed_layer_view(stack, layer) if isinstance(stack, PackedStates) else layer_view(stack, layer)

    def put_state(self, stack, layer, view: SlotCache):
        return (packed_put_layer if isinstance(stack, PackedStates) else put_layer)(stack, layer, view)

    def scan_state(self, stack: SlotCache) -> PackedStates:
        """The stacked cache as the scanned body carries it (pack_states); scan_result undoes it after the scan."""
        return pack_states(stack)

    def scan_result(self, states: PackedStates) -> SlotCache:
        return unpack_states(states)

    def runs_native(self) -> bool:
        """Whether the windows run through the native offload calls (the only path of the scanned graph, whose
        layer index is traced): every window, decode and prefill; one of more than max_experts distinct experts (a
        prefill chunk) in blocks of that many (native_window). With the deferral, only where every decode window
        fits one pair of calls (native_defer_fits): its rows then cross layers in the scanned body
        (defers_native)."""
        return self.native is not None and (not self.defer.active or self.native_defer)

    def defers_native(self) -> bool:
        """The deferral through the native calls (native_deferred: the traced layers of the scanned body)."""
        return self.runs_native() and self.defer.active

    def carries_late(self) -> bool:
        """Whether transformer.offload_layers carries each layer's late job to the next layer's pre(l+1): the
        native deferral, not in check mode (whose late rows join in their own layer)."""
        return self.defers_native() and not self.join_now

    def late_start(self, x: jax.Array, n: int, state) -> tuple:
        """Before the scanned body's first layer: a job with no rows on the traced slot, so that layer 0's pre(l)
        collect has one to collect (zeros). Returns (its token, the state with the begin's aliased slot arrays)."""
        t = x.shape[0]
        none = jnp.full((n,), -1, jnp.int32)
        slots, _, token = offload_begin(self.native.pool, jnp.int32(0), jnp.zeros_like(x), none,
                                        jnp.zeros((t, n), jnp.float32), none, none,
                                        (state.gate, state.up, state.down), cpu=True)
        return token, state.replace(gate=slots[0], up=slots[1], down=slots[2])

    def join_late(self, h: jax.Array, token: jax.Array) -> jax.Array:
        """pre(l+1): the last layer's late rows (its light job, or with no split every cpu row) collected and added
        to the residual h [T, H]; the collect waits for h, so layer l+1's mixer runs before it."""
        with jax.named_scope("moe_deferred_join"):
            late = offload_collect(self.native.pool, jnp.int32(0), token, h.astype(jnp.float32))
            return (h.astype(jnp.float32) + late).astype(h.dtype)

    def join(self, h: jax.Array, pending: defer.Pending) -> jax.Array:
        """Add a deferred layer's rows still owed to the residual h (transformer.forward: pre(l+1), or post(l) in check
        mode)."""
        with jax.named_scope(f"moe_deferred_join_layer{pending.layer}"):
            return defer.join_light(self.pool, h, pending, self.defer.below)

    def route(self, x: jax.Array, w: moe.MoEWeights, valid: jax.Array, state: SlotCache):
        """The window's Route with the approximations applied (prior, then resident swap), their counters, and
        the state (the range mode's running mean)."""
        cfg, a = self.cfg, self.approx
        if a.prior is None and not a.resident:
            return moe.route(x, w.router, cfg, valid, kernel=self.route_kernel), {}, state
        k = cfg.num_experts_per_tok
        logits = moe.router_logits(x, w.router)  # [T, E] float32
        probs = approx.router_probs(logits)
        _, unbiased = jax.lax.top_k(probs, k)  # [T, K], the exact path's choice
        resident = state.table >= 0  # [E]
        ids, extra = unbiased, {}
        if a.prior is not None:
            with jax.named_scope("moe_route_prior"):
                lam = jnp.full((x.shape[0],), a.prior, jnp.float32)
                if a.prior_mode == "range":
                    add_sum, add_count = approx.logit_range(logits, valid)
                    state = state.replace(range_sum=state.range_sum + add_sum, range_count=state.range_count + add_count)
                    lam = lam * state.range_sum / jnp.maximum(state.range_count, 1).astype(jnp.float32)
                ids, changed = approx.prior_pick(logits, resident, lam, k, a.prior_keep)

                def hits(picked):  # entries of the valid tokens on a resident expert
                    return jnp.sum(jnp.where(valid[:, None], resident[picked], False))
                extra.update(prior_tokens=jnp.sum(valid), prior_tokens_changed=jnp.sum(changed & valid),
                             prior_entries=jnp.sum(valid) * k,
                             prior_hits_unbiased=hits(unbiased), prior_hits=hits(ids))
        if a.resident:
            with jax.named_scope("moe_route_resident"):
                ids, _ = approx.weights_of(probs, ids, cfg.norm_topk_prob)
                ids, swaps = approx.resident_swap(logits, ids, resident, a.resident_rank, a.resident_margin)
                extra["swaps"] = jnp.sum(jnp.where(valid, swaps, 0))
        ids, weights = approx.weights_of(probs, ids, cfg.norm_topk_prob)
        return moe.make_route(ids, weights, cfg, valid, x.dtype), extra, state

    def __call__(self, layer: int, x: jax.Array, w: moe.MoEWeights, valid: jax.Array,
                 state: SlotCache) -> moe.ExpertsOut:
        with jax.named_scope("moe_route"):
            r, extra, state = self.route(x, w, valid, state)
        # the native calls: every window without the deferral; with it, the scanned body's (a traced layer)
        deferred = self.defers_native() and not isinstance(layer, int)
        native = deferred or (self.runs_native() and not self.defer.active)
        with jax.named_scope("moe_plan"):
            if native and self.plan_kernel:
                p, updated = self.plan_and_update(r, state)
                extra = dict(extra, _updated=updated)
            else:
                p = self.plan_window(r, state)
        if deferred:
            return self.native_deferred(layer, x, w, r, p, state, extra)
        if native:
            return self.native_window(layer, x, w, r, p, state, extra)
        assert isinstance(layer, int), "a traced layer (the scanned graph) takes the native offload calls only"
        pending = None
        if self.defer.active and layer not in self.no_defer:  # the model's (or a device block's) last layer
            with jax.named_scope("moe_cpu_submit"):
                pending = self.submit_cpu(layer, x, r, p)
        with jax.named_scope("moe_experts"):
            y, slots = self.gpu_experts(x, w, r, p, state)
        with jax.named_scope("moe_cpu"):
            y, y_cpu = self.cpu_rows(layer, x, r, p, y, pending)
        with jax.named_scope("moe_combine"):
            y = (y + y_cpu).astype(x.dtype)
        with jax.named_scope("moe_slot_table"):
            state = update_slots(state, r, p, slots, extra, self.prefetch > 0)
        return moe.ExpertsOut(y, state, pending)

    def prefetch_plan(self, x: jax.Array, router: jax.Array, valid: jax.Array, state: SlotCache,
                      active=True) -> tuple[jax.Array, jax.Array, SlotCache]:
        """Pre-gating: the experts the next layer's router [H, E] picks (top self.prefetch a valid token) on this
        layer's FFN input x [T, H], those not resident in the next layer's cache `state` taken heaviest (summed
        probability) first, each given a victim slot as lru gives a fetch one (least recently used, empty first;
        never a slot holding a predicted expert; none under static) and entered in the slot table as an insert, with
        last_use = the layer's clock (this window's) and its `prefetched` flag set. Returns (src [M] expert ids or
        -1, dst [M] rows of the slot arrays (base + slot) or -1, the state); M = min(T * N, E, S). The copy is the
        caller's (prefetch_layer). active: a traced bool, False: nothing (the last layer's call)."""
        e, s = self.cfg.num_experts, state.slots
        m = min(x.shape[0] * self.prefetch, e, s)
        if m == 0:  # no slots: nothing to plan (the call still joins)
            none = jnp.zeros((0,), jnp.int32)
            return none, none, state
        logits = moe.router_logits(x, router)  # [T, E] float32
        probs = jax.nn.softmax(logits, axis=-1)
        _, top = jax.lax.top_k(logits, self.prefetch)  # [T, N]
        e_rows = jnp.arange(e, dtype=jnp.int32)
        picked = jnp.any((top[:, :, None] == e_rows) & valid[:, None, None], axis=(0, 1))  # [E]
        mass = jnp.sum(jnp.where(valid[:, None], probs, 0.0), axis=0)  # [E] >= 0
        want = picked & (state.table < 0) & active
        _, ids = jax.lax.top_k(jnp.where(want, mass, -1.0), m)  # [M]: the wanted first (a prefix), heaviest first
        ids = ids.astype(jnp.int32)
        holds_picked = (state.expert_of >= 0) & picked[jnp.maximum(state.expert_of, 0)]  # [S+1]: never a victim
        insert, dest = lru_victims(state, holds_picked, want[ids], jnp.arange(m, dtype=jnp.int32))
        evicted = state.expert_of[dest]
        at = COUNTERS.index("prefetched")
        state = state.replace(
            table=set_at(state.table, (insert & (evicted >= 0), evicted, -1), (insert, ids, dest)),
            expert_of=set_at(state.expert_of, (insert, dest, ids)),
            last_use=set_at(state.last_use, (insert, dest, state.clock)),
            prefetched=set_at(state.prefetched, (insert, dest, 1)),
            counters=state.counters.at[at].add(jnp.sum(insert, dtype=jnp.int32)))
        return jnp.where(insert, ids, -1), jnp.where(insert, dest + state.base, -1), state

    def prefetch_layer(self, stack, layer, x: jax.Array, router: jax.Array, valid: jax.Array, active):
        """The scanned body's prefetch (before layer l's own experts): layer `layer` (= l+1, or l itself at the last
        layer, with active False) of the stacked cache `stack` (PackedStates or SlotCache) planned by prefetch_plan
        and its rows copied by one native call (bridge.offload_prefetch: on a GPU on a side stream, joined by the next
        layer's call, before that layer's begin). Every layer makes the call, the last one too: it joins."""
        with jax.named_scope("moe_prefetch"):
            view = self.layer_state(stack, layer)
            src, dst, view = self.prefetch_plan(x, router, valid, view, active)
            slots = offload_prefetch(self.native.pool, layer, src, dst, (view.gate, view.up, view.down))
            return self.put_state(stack, layer, view.replace(gate=slots[0], up=slots[1], down=slots[2]))

    def native_window(self, layer: int, x: jax.Array, w: moe.MoEWeights, r: moe.Route, p: WindowPlan,
                      state: SlotCache, extra: dict) -> moe.ExpertsOut:
        """The window through the native offload calls (NativeOffload): begin (each fetched expert copied into its
        victim slot or its staging row, the pool starts on the cpu experts), the resident and fetched experts read
        where they are, collect. A window of more distinct experts than one call takes (a prefill chunk) runs its
        expert list in blocks of `max_experts`, one begin and collect each, in order: the staging is one call's,
        and the plan (kinds, victim slots) is the window's, so no block's fetch overwrites a slot another reads."""
        n, b = r.expert_ids.shape[0], self.native.max_experts
        slots = (state.gate, state.up, state.down)
        y = None
        for start in range(0, n, b):
            sel = slice(start, min(start + b, n))
            if y is not None:  # this block's begin after the last one's collect (one staging, one pool job)
                x_now, y = jax.lax.optimization_barrier((x, y))
            else:
                x_now = x
            y_block, slots, _ = self.native_block(layer, x_now, w, r, p, state, slots, sel)
            y = y_block if y is None else y + y_block
        with jax.named_scope("moe_combine"):
            y = y.astype(x.dtype)
        with jax.named_scope("moe_slot_table"):
            state = update_slots(state, r, p, slots, extra, self.prefetch > 0)
        return moe.ExpertsOut(y, state, None)

    def native_deferred(self, layer, x: jax.Array, w: moe.MoEWeights, r: moe.Route, p: WindowPlan,
                        state: SlotCache, extra: dict) -> moe.ExpertsOut:
        """A decode window's layer with the deferral through the native calls (one pair of calls' worth of experts):
        the cpu rows of routing weight >= below (the heavy ones) are a job of their own, begun with the fetches and
        collected at post(l) after the GPU's experts; the light ones are a second job begun right after that collect
        and returned as the pending token, which transformer.offload_layers collects at pre(l+1) (join_late), after
        layer l+1's mixer. No split (below >= 1): one job, every cpu row late. check: both jobs collected here, in
        turn (the exact sums in another order). Each begin with cpu is collected before the traced slot's next
        begin, as the calls want."""
        n = r.expert_ids.shape[0]
        assert n <= self.native.max_experts, "native_defer_fits: a decode window fits one pair of calls"
        cpu = (p.kind == CPU)[None, :]  # [1, N]
        heavy = cpu & (r.combine >= self.defer.below)  # [T, N]: the rows joined at post(l) (with a split)
        light = cpu & ~heavy if self.defer.split else cpu
        slots = (state.gate, state.up, state.down)
        with jax.named_scope("moe_deferred_heavy"):  # no split: the fetches and every cpu row, none collected
            y, slots, token = self.native_block(layer, x, w, r, p, state, slots, slice(0, n),
                                                cpu_w=jnp.where(heavy if self.defer.split else light, r.combine, 0.0),
                                                collect=self.defer.split)
        if self.defer.split:  # the light job, after the heavy collect: one job in flight on the traced slot
            with jax.named_scope("moe_deferred_light_begin"):
                x, y = jax.lax.optimization_barrier((x, y))
                none = jnp.full((n,), -1, jnp.int32)
                cpu_ids = jnp.where(jnp.any(light, axis=0), r.expert_ids, -1)
                slots, _, token = offload_begin(self.native.pool, layer, x, cpu_ids, jnp.where(light, r.combine, 0.0),
                                                none, none, slots, cpu=True)
        if self.defer.mode == "check":  # bookkeeping: the late rows join in this layer, right after
            with jax.named_scope("moe_deferred_check"):
                y = y + offload_collect(self.native.pool, layer, token, y)
            token = None
        with jax.named_scope("moe_combine"):
            y = y.astype(x.dtype)
        with jax.named_scope("moe_slot_table"):
            state = update_slots(state, r, p, slots, extra, self.prefetch > 0)
        return moe.ExpertsOut(y, state, token)

    def native_block(self, layer, x: jax.Array, w: moe.MoEWeights, r: moe.Route, p: WindowPlan, state: SlotCache,
                     slots: tuple, sel: slice, cpu_w: jax.Array | None = None,
                     collect: bool = True) -> tuple[jax.Array, tuple]:
        """(The rows [T, H] float32 of the window's experts at positions `sel` (at most max_experts), the slot
        arrays after their fetches, the begin's token). cpu_w [T, n]: the pool's weights (default: every cpu
        expert's routing weights); collect=False leaves the pool's rows to the caller (native_deferred: its token
        collected at pre(l+1)), so y holds the GPU's experts alone."""
        ids, kind, combine = r.expert_ids[sel], p.kind[sel], r.combine[:, sel]
        fetch, insert, dest, slot = p.fetch[sel], p.insert[sel], p.dest[sel], p.slot[sel]
        n, s = ids.shape[0], state.slots
        cpu = kind == CPU
        stages = self.can_stage(r, state)
        staged = fetch & ~insert  # [n] fetched with no victim slot: into staging row j
        with jax.named_scope("moe_offload_begin"):
            slots, stage, token = offload_begin(
                self.native.pool, layer, x, jnp.where(cpu, ids, -1),
                combine * cpu[None, :] if cpu_w is None else cpu_w[:, sel],
                jnp.where(fetch, ids, -1), jnp.where(insert, dest + state.base, -1), slots,
                cpu=self.pool is not None)
        slot_ids = jnp.where(kind == RESIDENT, slot, jnp.where(insert, dest, -1)).astype(jnp.int32)  # [n]
        slot_ids = jnp.where(slot_ids >= 0, slot_ids + state.base, -1)  # rows of the (maybe stacked) slot arrays
        stage_ids = jnp.where(staged, jnp.arange(n, dtype=jnp.int32), -1)  # [n]
        # int8/int4: the block's experts' scales [n, ...] each, by block position (gathered here: in the scanned graph
        # w.scales is the layer's slice of a stack, which a kernel operand would copy whole)
        scales = tuple(sc[jnp.maximum(ids, 0)] for sc in w.scales)
        with jax.named_scope("moe_experts"):
            if self.kernel:
                interpret = jax.default_backend() != "gpu"
                # the kernel reads expert n's scales at row n (scale_ids), whatever slot or staging row holds it
                by_position = jnp.arange(n, dtype=jnp.int32) if w.scales else None
                y = expert_ffn_kernel(x, *slots, slot_ids, combine, *scales, scale_ids=by_position,
                                      interpret=interpret)
                if stages:
                    y = y + expert_ffn_kernel(x, *stage, stage_ids, combine, *scales, scale_ids=by_position,
                                              interpret=interpret)
            else:  # every gpu expert of the block gathered at once (slot or staging row), the rest weighted 0
                rows = jnp.where(slot_ids >= 0, slot_ids, state.base + s)
                block = tuple(jnp.where(staged.reshape(-1, *([1] * (a.ndim - 1))), st, a[rows]) if stages else a[rows]
                              for a, st in zip(slots, stage))
                gpu = (slot_ids >= 0) | staged
                y = moe.expert_ffn(x, *block, combine * gpu[None, :], *scales)
        if self.pool is not None and collect:
            with jax.named_scope("moe_offload_collect"):
                y = y + offload_collect(self.native.pool, layer, token, y)
        return y, slots, token

    def can_stage(self, r: moe.Route, state: SlotCache) -> bool:
        """Whether a fetch of this window may find no victim slot and go to a staging row (static: the shapes decide):
        always under the static policy (no fetch enters a slot), under lru only for windows of more distinct experts
        than slots (a prefill chunk)."""
        return not (self.lru and r.expert_ids.shape[0] <= state.slots)

    def plan_and_update(self, r: moe.Route, state: SlotCache) -> tuple[WindowPlan, dict]:
        """plan_window and update_slots' small leaves in one Pallas kernel (pallas_kernels/slot_plan.py): the plan's
        fields the native calls read, and the leaves update_slots then takes as they are."""
        out = slot_plan(r.expert_ids, r.combine, r.entry_counts, state.table, state.expert_of, state.last_use,
                        state.usage, state.pcie_frac, state.clock, state.lru, cpu=self.pool is not None,
                        interpret=jax.default_backend() != "gpu")
        kind = out["kind"]
        none = jnp.zeros_like(kind)
        p = WindowPlan(kind=kind, slot=out["slot"], fetch=kind == FETCH, insert=out["insert"], dest=out["dest"],
                       block_kind=none, gpu_order=none, n_gpu=jnp.int32(0))  # the last three: the graph path's only
        return p, out

    def plan_window(self, r: moe.Route, state: SlotCache) -> WindowPlan:
        """plan(), then where each fetched expert goes: a victim slot (lru) or the trash row."""
        kind, slot = plan(r, state, cpu=self.pool is not None, tail_skip=self.approx.tail_skip)
        rows = jnp.arange(state.slots + 1, dtype=jnp.int32)
        read = jnp.any((kind == RESIDENT)[None, :] & (slot[None, :] == rows[:, None]), axis=1)  # [S+1]
        fetch = kind == FETCH
        insert, dest = lru_victims(state, read, fetch, prefix_counts(fetch) - 1)
        # The XLA blocks run the resident and fetched experts; with the Pallas kernel they run only the fetched
        # ones that found no slot (overflow, staged in the block), the kernel reads the rest in their slots.
        block_kind = jnp.where(fetch & ~insert, FETCH, NONE) if self.kernel else kind
        gpu = (block_kind == RESIDENT) | (block_kind == FETCH)
        gpu_order = jnp.argsort(~gpu, stable=True).astype(jnp.int32)  # gpu experts first
        return WindowPlan(kind=kind, slot=slot, fetch=fetch, insert=insert, dest=dest, block_kind=block_kind,
                          gpu_order=gpu_order, n_gpu=jnp.sum(gpu))

    def submit_cpu(self, layer: int, x: jax.Array, r: moe.Route, p: WindowPlan) -> defer.Pending:
        """Deferral: hand the cpu entries to the pool now; their rows join later (transformer.forward)."""
        cpu_entries = defer.cpu_entries(r, p.kind, CPU)
        ticket = defer.submit(self.pool, layer, x, r, cpu_entries, self.defer.below)
        return defer.Pending(layer=layer, ticket=ticket, weights=r.topk_weights, cpu=cpu_entries)

    def gpu_experts(self, x: jax.Array, w: moe.MoEWeights, r: moe.Route, p: WindowPlan,
                    state: SlotCache) -> tuple[jax.Array, tuple]:
        """The resident and fetched experts' rows [T, H] float32, and the slot weights after this window's fetches."""
        ids, n, s = r.expert_ids, r.expert_ids.shape[0], state.slots
        y = jnp.zeros(x.shape, jnp.float32)
        slots = (state.gate, state.up, state.down)
        hosts = (w.gate, w.up, w.down)
        if self.kernel:
            with jax.named_scope("moe_fetch"):  # straight into their victim slots
                into = p.fetch & p.insert
                order = jnp.argsort(~into, stable=True)
                (slots,) = copy_experts([(slots, p.dest[order] + state.base)], hosts, ids[order], jnp.sum(into))
            with jax.named_scope("moe_experts_pallas"):
                slot_ids = jnp.where(p.kind == RESIDENT, p.slot, jnp.where(p.fetch & p.insert, p.dest, -1))
                slot_ids = jnp.where(slot_ids >= 0, slot_ids + state.base, -1)
                # int8/int4: the layer's own scales [E, ...] (unrolled graph: whole arrays), read in place by expert id
                by_expert = jnp.maximum(ids, 0).astype(jnp.int32) if w.scales else None
                y = expert_ffn_kernel(x, *slots, slot_ids.astype(jnp.int32), r.combine, *w.scales,
                                      scale_ids=by_expert, interpret=jax.default_backend() != "gpu")
        b = min(self.block, n)
        for start in range(0, n, b):
            def run_block(carry, start=start):
                y, slots = carry
                sel = p.gpu_order[start:start + b]  # [B] positions in the window's expert list
                in_block = (start + jnp.arange(sel.shape[0])) < p.n_gpu
                k_sel = jnp.where(in_block, p.block_kind[sel], NONE)
                rows = jnp.where(k_sel == RESIDENT, p.slot[sel], s) + state.base
                block = tuple(a[rows] for a in slots)  # gather resident experts [B, ...]
                is_fetch = k_sel == FETCH
                fetch_order = jnp.argsort(~is_fetch, stable=True)  # block positions j, the fetched first
                with jax.named_scope("moe_fetch"):  # each into the block at j and its victim slot (or the trash row)
                    fetched = sel[fetch_order]
                    block, slots = copy_experts([(block, fetch_order), (slots, p.dest[fetched] + state.base)], hosts,
                                                ids[fetched], jnp.sum(is_fetch))
                combine = r.combine[:, sel] * (k_sel != NONE)[None, :]
                block_scales = tuple(sc[jnp.maximum(ids[sel], 0)] for sc in w.scales)  # int8: [B, O] each
                return y + moe.expert_ffn(x, *block, combine, *block_scales), slots

            if start == 0 and not self.kernel:
                y, slots = run_block((y, slots))
            else:
                y, slots = jax.lax.cond(start < p.n_gpu, run_block, lambda c: c, (y, slots))
        return y, slots

    def cpu_rows(self, layer: int, x: jax.Array, r: moe.Route, p: WindowPlan, y: jax.Array,
                 pending: defer.Pending | None) -> tuple[jax.Array, jax.Array]:
        """(y, the cpu experts' rows [T, H] float32): from the pool now (one io_callback, none when the window has
        no cpu expert), or zeros when they are deferred (split: y gains the heavy rows here) or there is no pool."""
        ids, cpu = r.expert_ids, p.kind == CPU
        if pending is not None:
            y_cpu = jnp.zeros(x.shape, jnp.float32)
            if self.defer.split:  # post(l) waits for the heavy rows only
                y = defer.join_heavy(self.pool, y, pending, self.defer.below, after=y[0, :1])
        elif self.pool is not None and native_calls(self.pool):
            # The FFI call costs little with no cpu expert; a lax.cond would read its predicate back on a GPU.
            y_cpu = cpu_expert_rows(self.pool, layer, x, jnp.where(cpu, ids, -1), r.combine * cpu[None, :])
        elif self.pool is not None:
            y_cpu = jax.lax.cond(
                jnp.any(cpu),
                lambda: cpu_expert_rows(self.pool, layer, x, jnp.where(cpu, ids, -1), r.combine * cpu[None, :]),
                lambda: jnp.zeros(x.shape, jnp.float32))
        else:
            y_cpu = jnp.zeros(x.shape, jnp.float32)
        return y, y_cpu


def update_slots(state: SlotCache, r: moe.Route, p: WindowPlan, slots: tuple, extra: dict,
                 prefetch: bool = False) -> SlotCache:
    """The state after a window: the slot weights and table with the inserted experts, the clock, the routing
    usage and the counters. prefetch: the engine prefetches (without it no slot is ever flagged, so the flags'
    bookkeeping is left out of the layer body)."""
    extra = dict(extra)
    updated = extra.pop("_updated", None)
    if prefetch:
        # prefetched experts read for the first time (counted once), and the flags left: a slot read or refilled
        # is no longer a prefetched expert waiting
        resident = p.kind == RESIDENT
        extra["prefetch_used"] = jnp.sum(jnp.where(resident, state.prefetched[jnp.where(resident, p.slot, 0)], 0))
        state = state.replace(prefetched=set_at(state.prefetched, (resident, p.slot, 0), (p.insert, p.dest, 0)))
    if updated is not None:  # plan_and_update's kernel made the small leaves already
        sums = updated["sums"]  # entries, distinct of RESIDENT, FETCH, CPU, SKIP
        values = dict(distinct_skipped=sums[7], entries_skipped=sums[3], **extra)
        rest = [jnp.asarray(values.get(name, 0), jnp.int32) for name in COUNTERS[8:]]
        counts = jnp.concatenate([jnp.sum(sums[:3])[None], sums[:3], jnp.sum(sums[4:7])[None], sums[4:7],
                                  jnp.stack(rest)])
        return state.replace(gate=slots[0], up=slots[1], down=slots[2], table=updated["table"],
                             expert_of=updated["expert_of"], last_use=updated["last_use"], clock=state.clock + 1,
                             usage=updated["usage"], counters=state.counters + counts)
    # Dense matches instead of scatters (set_at): the inserted experts are distinct, their victim slots too, and an
    # evicted expert is resident, never one inserted, so the order of the updates does not matter.
    ids = r.expert_ids
    evicted = state.expert_of[p.dest]
    table = set_at(state.table, (p.insert & (evicted >= 0), evicted, -1), (p.insert, ids, p.dest))
    expert_of = set_at(state.expert_of, (p.insert, p.dest, ids))
    last_use = set_at(state.last_use, (p.insert, p.dest, state.clock), (p.kind == RESIDENT, p.slot, state.clock))
    e_rows = jnp.arange(state.usage.shape[0], dtype=jnp.int32)
    usage = state.usage + jnp.sum(jnp.where(ids[None, :] == e_rows[:, None], r.entry_counts[None, :], 0), axis=1,
                                  dtype=state.usage.dtype)
    return state.replace(gate=slots[0], up=slots[1], down=slots[2], table=table, expert_of=expert_of,
                         last_use=last_use, clock=state.clock + 1, usage=usage,
                         counters=state.counters + count(p.kind, r, extra))


def fill_slots(state: SlotCache, host_gate, host_up, host_down, experts: jax.Array) -> SlotCache:
    """Static policy: load `experts` [S] (-1 = leave empty) into slots 0..S-1 from host memory; jit with donation."""
    s = state.slots
    if s == 0:
        return state
    return refill_slots(state, host_gate, host_up, host_down, experts, jnp.maximum(experts, 0),
                        jnp.arange(s, dtype=jnp.int32), s)


def refill_order(current: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The host's half of a fill after a prefill: the slots' experts after it, each of `top`'s [S] (-1: none) in a
    slot, where an expert already in a slot stays in it (nothing copied) and the others take, in order, the slots
    whose expert is not in `top`; those slots not taken are emptied. Returns (expert_of [S], copy_ids [S],
    copy_slots [S], count): the first `count` copies are the ones to make (the rest of both arrays zeros)."""
    S = top.shape[0]
    current = np.asarray(current[:S], np.int32)
    want = top[top >= 0].astype(np.int32)
    stays = (current >= 0) & np.isin(current, want)
    expert_of = np.where(stays, current, -1).astype(np.int32)
    to_place = want[~np.isin(want, current[stays])]
    free = np.flatnonzero(~stays)[:to_place.size]
    expert_of[free] = to_place
    copy_ids, copy_slots = np.zeros(S, np.int32), np.zeros(S, np.int32)
    copy_ids[:to_place.size], copy_slots[:to_place.size] = to_place, free
    return expert_of, copy_ids, copy_slots, int(to_place.size)


def refill_slots(state: SlotCache, host_gate, host_up, host_down, expert_of: jax.Array, copy_ids: jax.Array,
                 copy_slots: jax.Array, count) -> SlotCache:
    """The slots hold `expert_of` [S] (-1: empty) once the first `count` (traced: a bounded loop) of copy_ids [S] are
    copied from host memory into slots copy_slots [S] (refill_order: those not in a slot already); jit with
    donation."""
    s = state.slots
    if s == 0:
        return state
    (gate, up, down), = copy_experts([((state.gate, state.up, state.down), state.base + copy_slots)],
                                     (host_gate, host_up, host_down), copy_ids, count)
    valid = expert_of >= 0
    e = state.table.shape[0]
    table = jnp.full_like(state.table, -1).at[jnp.where(valid, expert_of, e)].set(
        jnp.arange(s, dtype=jnp.int32), mode="drop")
    expert_of = jnp.concatenate([jnp.where(valid, expert_of, -1), jnp.full((1,), -1, jnp.int32)]).astype(jnp.int32)
    return state.replace(gate=gate, up=up, down=down, table=table, expert_of=expert_of,
                         last_use=jnp.full_like(state.last_use, -1), prefetched=jnp.zeros_like(state.prefetched))


def prefill_top(usage: np.ndarray, s: int) -> np.ndarray:
    """A layer's S most used experts by the prefill's usage [E] (-1 past those used at all), most used first."""
    top = np.argsort(-usage, kind="stable")[:s]
    return np.where(usage[top] > 0, top, -1).astype(np.int32)


def fill_static_stacked(stack: SlotCache, layers, fill, keep_usage: bool = False) -> tuple[SlotCache, int]:
    """fill_static_slots for a stacked cache (init_stacked_slot_cache) and stacked weights whose experts stay a
    tuple of per-layer host arrays (weights.stack_layers(keep_experts=True)); `fill`: refill_layer_slots, jitted
    with donation of the stack."""
    usage = np.asarray(stack.usage)  # [L, E]
    current = np.asarray(stack.expert_of)  # [L, S + 1]
    s = current.shape[-1] - 1
    if not keep_usage:
        stack = stack.replace(usage=jnp.zeros_like(stack.usage))
    f = layers.ffn
    copied = 0
    for i in range(usage.shape[0]):
        expert_of, ids, rows, count = refill_order(current[i], prefill_top(usage[i], s))
        stack = fill(stack, jnp.int32(i), f.gate[i], f.up[i], f.down[i], jnp.asarray(expert_of), jnp.asarray(ids),
                     jnp.asarray(rows), jnp.int32(count))
        copied += count
    return stack, copied


def fill_layer_slots(stack: SlotCache, layer, host_gate, host_up, host_down, experts: jax.Array) -> SlotCache:
    """fill_slots on layer `layer` of a stacked cache."""
    return put_layer(stack, layer, fill_slots(layer_view(stack, layer), host_gate, host_up, host_down, experts))


def refill_layer_slots(stack: SlotCache, layer, host_gate, host_up, host_down, expert_of, copy_ids, copy_slots,
                       count) -> SlotCache:
    """refill_slots on layer `layer` of a stacked cache."""
    return put_layer(stack, layer, refill_slots(layer_view(stack, layer), host_gate, host_up, host_down, expert_of,
                                                copy_ids, copy_slots, count))


def with_pcie_frac(experts, frac: float):
    """A KVCache's `experts` (either form) with the split set to `frac` in every layer's cache (it is data in the
    graphs: nothing recompiles, the cached experts stay), each leaf on its own device."""
    def one(s):
        return s.replace(pcie_frac=jax.device_put(jnp.full(s.pcie_frac.shape, frac, s.pcie_frac.dtype),
                                                  s.pcie_frac.sharding))
    if isinstance(experts, SlotCache):
        return one(experts)
    return [None if s is None else one(s) for s in experts]


def fill_every_layer(experts, layers, ids: jax.Array):
    """A KVCache's `experts` (either form, as layer_states) with each sparse layer's slots loaded with `ids` [S]
    from its host experts (`layers`: the Weights' layers, a list or stacked with per-layer host tuples)."""
    if isinstance(experts, SlotCache):
        f = layers.ffn
        for i in range(experts.expert_of.shape[0]):
            experts = fill_layer_slots(experts, i, f.gate[i], f.up[i], f.down[i], ids)
        return experts
    return [None if s is None else fill_slots(s, layers[i].ffn.gate, layers[i].ffn.up, layers[i].ffn.down, ids)
            for i, s in enumerate(experts)]


def fill_static_slots(states: list, layers: list, fill, keep_usage: bool = False) -> tuple[list, int]:
    """Static policy (and lru with pcie_frac 0), after the prompt's prefill: each layer's slots take its most used
    experts (by the usage the prefill counted, which starts again from zero; keep_usage: a refresh during the
    decode, by the usage counted so far, kept); an expert already in a slot stays there uncopied (refill_order).
    `fill`: refill_slots, jitted with donation. Returns the states and the experts copied."""
    new, copied = [], 0
    for i, s in enumerate(states):
        if s is None:
            new.append(None)
            continue
        expert_of, ids, rows, count = refill_order(np.asarray(s.expert_of), prefill_top(np.asarray(s.usage), s.slots))
        w = layers[i].ffn
        new.append(fill(s if keep_usage else s.replace(usage=jnp.zeros_like(s.usage)), w.gate, w.up, w.down,
                        jnp.asarray(expert_of), jnp.asarray(ids), jnp.asarray(rows), jnp.int32(count)))
        copied += count
    return new, copied
