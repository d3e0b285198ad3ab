"""The window's plan and the slot-table update without sorts or scatters (slots.stable_ranks / prefix_counts /
set_at: dense comparisons that fuse into a few kernels per layer on a GPU) give exactly what the sort-and-scatter
forms gave: every WindowPlan field and every updated SlotCache leaf, on random slot states and routes (ties in the
routing mass and in the LRU clock, empty slots, padding rows, lru and static, every pcie_frac and window size)."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.model import moe
from strata_jax.model.config import preset
from strata_jax.offload import approx, slots as slots_mod
from strata_jax.offload.slots import CPU, FETCH, NONE, RESIDENT, SKIP, OffloadedExperts, WindowPlan


# ---- the sort-and-scatter forms (the engine's until 2026-12-06), the reference ------------------------------------

def plan_reference(r, state, cpu=True, tail_skip=0):
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
    mass = jnp.sum(r.combine, axis=0)
    order = jnp.argsort(jnp.where(miss, -mass, jnp.inf))
    miss_rank = jnp.zeros_like(ids).at[order].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    fetch = miss & (miss_rank < n_fetch)
    kind = jnp.where(resident, RESIDENT, jnp.where(fetch, FETCH, jnp.where(miss, CPU, NONE)))
    return jnp.where(skip, SKIP, kind).astype(jnp.int32), slot


def victims_reference(kind, slot, state):
    s = state.slots
    read = jnp.zeros((s + 1,), bool).at[jnp.where(kind == RESIDENT, slot, s)].set(True).at[s].set(True)
    victims = jnp.argsort(jnp.where(read, jnp.iinfo(jnp.int32).max, state.last_use)).astype(jnp.int32)
    n_victims = jnp.where(state.lru, s - jnp.sum(read[:s]), 0)
    fetch = kind == FETCH
    fetch_rank = jnp.cumsum(fetch) - 1
    insert = fetch & (fetch_rank < n_victims)
    return insert, jnp.where(insert, victims[jnp.clip(fetch_rank, 0, s)], s)


def update_reference(state, r, kind, slot, insert, dest):
    ids, s, e = r.expert_ids, state.slots, state.table.shape[0]
    evicted = state.expert_of[dest]
    table = state.table.at[jnp.where(insert & (evicted >= 0), evicted, e)].set(-1, mode="drop")
    table = table.at[jnp.where(insert, ids, e)].set(dest, mode="drop")
    expert_of = state.expert_of.at[jnp.where(insert, dest, s + 1)].set(ids, mode="drop")
    last_use = state.last_use.at[jnp.where(insert, dest, s + 1)].set(state.clock, mode="drop")
    last_use = last_use.at[jnp.where(kind == RESIDENT, slot, s + 1)].set(state.clock, mode="drop")
    usage = state.usage.at[jnp.where(ids >= 0, ids, e)].add(r.entry_counts, mode="drop")
    return table, expert_of, last_use, usage


# ---- random states and routes --------------------------------------------------------------------------------------

CFG = preset("tiny")


def random_state(rng, s, policy, pcie_frac):
    """A consistent slot cache: a random set of experts in random slots (some empty), clocks with ties."""
    e = CFG.num_experts
    state = slots_mod.init_slot_cache(CFG, s, jnp.float32, policy, pcie_frac)
    table = np.full(e, -1, np.int32)
    expert_of = np.full(s + 1, -1, np.int32)
    full = rng.integers(0, s + 1)
    for slot, expert in zip(rng.permutation(s)[:full], rng.permutation(e)[:full]):
        table[expert], expert_of[slot] = slot, expert
    clock = int(rng.integers(5, 40))
    last_use = np.where(expert_of >= 0, rng.integers(0, 4, s + 1) * rng.integers(1, clock, s + 1), -1)
    last_use[s] = -1
    return state.replace(table=jnp.asarray(table), expert_of=jnp.asarray(expert_of),
                         last_use=jnp.asarray(last_use, jnp.int32), clock=jnp.int32(clock),
                         usage=jnp.asarray(rng.integers(0, 50, e), jnp.int32))


def random_route(rng, t):
    e, k = CFG.num_experts, CFG.num_experts_per_tok
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    if rng.random() < 0.5:  # ties in the routing mass
        w = np.round(w * 4) / 4
    valid = rng.random(t) < 0.8
    valid[0] = True
    return moe.make_route(jnp.asarray(ids), jnp.asarray(w), CFG, jnp.asarray(valid), jnp.float32)


def xla_plan_and_update(r, state):
    """The XLA forms the reference and the kernel are held against: a graph with the host pool and the expert
    kernel's plan_window, then update_slots (the slot arrays as they were)."""
    self = SimpleNamespace(pool=object(), kernel=True, approx=approx.OFF)
    p = OffloadedExperts.plan_window(self, r, state)
    return p, slots_mod.update_slots(state, r, p, (state.gate, state.up, state.down), {})


@pytest.mark.parametrize("policy", ["lru", "static"])
def test_plan_and_update_equal_the_sort_and_scatter_forms(policy):
    rng = np.random.default_rng()

    @jax.jit
    def both(r, state):
        p, new = xla_plan_and_update(r, state)
        kind, slot = plan_reference(r, state)
        insert, dest = victims_reference(kind, slot, state)
        return p, new, (kind, slot, insert, dest), update_reference(state, r, kind, slot, insert, dest)

    inserted = 0
    for trial in range(60):
        s = int(rng.choice([0, 1, 3, 7, CFG.num_experts]))
        frac = float(rng.choice([0.0, 0.3, 0.5, 1.0]))
        state = random_state(rng, s, policy, frac)
        r = random_route(rng, int(rng.choice([1, 2, 3, 4])))
        p, new, (kind, slot, insert, dest), (table, expert_of, last_use, usage) = both(r, state)
        np.testing.assert_array_equal(p.kind, kind)
        np.testing.assert_array_equal(p.slot, slot)
        np.testing.assert_array_equal(p.insert, insert)
        np.testing.assert_array_equal(p.dest, dest)
        np.testing.assert_array_equal(new.table, table)
        np.testing.assert_array_equal(new.expert_of, expert_of)
        np.testing.assert_array_equal(new.last_use, last_use)
        np.testing.assert_array_equal(new.usage, usage)
        inserted += int(np.sum(insert))
        # the table and the slots still name each other
        t, eo = np.asarray(new.table), np.asarray(new.expert_of)
        for expert in np.flatnonzero(t >= 0):
            assert eo[t[expert]] == expert
    if policy == "lru":
        assert inserted > 20  # the victims' path was taken, not only the all-resident one


def test_lru_windows_no_wider_than_the_slots_never_stage():
    """What OffloadedExperts.can_stage rests on: under lru a window of at most S distinct experts finds every fetch a
    victim slot (insert == fetch), whatever the slots hold and read, so its graphs leave the staging call out; a
    wider one, or the static policy, may stage."""
    rng = np.random.default_rng()
    staged_wide = 0
    # one jitted plan a (slots, window) shape, as the engine runs it, and a few slot counts a window size: exactly
    # the window's experts, the most, one between (narrow: none, half, one too few), so the 60 random states and
    # routes reuse ~24 compiled shapes (each slot count of a range was a new shape's ~18 eager ops, 45 s)
    plan = jax.jit(xla_plan_and_update)
    for trial in range(60):
        t = int(rng.choice([1, 2, 3, 4]))
        r = random_route(rng, t)
        n = r.expert_ids.shape[0]
        s = int(rng.choice([n, (n + CFG.num_experts + 1) // 2, CFG.num_experts]))
        state = random_state(rng, s, "lru", float(rng.choice([0.3, 0.5, 1.0])))
        p, _ = plan(r, state)
        np.testing.assert_array_equal(p.insert, p.fetch)
        assert not OffloadedExperts.can_stage(SimpleNamespace(lru=True), r, state)
        assert OffloadedExperts.can_stage(SimpleNamespace(lru=False), r, state)
        narrow = random_state(rng, int(rng.choice([0, n // 2, n - 1])), "lru", 1.0)  # fewer slots than experts
        p, _ = plan(r, narrow)
        staged_wide += int(np.sum(np.asarray(p.fetch & ~p.insert)))
        assert OffloadedExperts.can_stage(SimpleNamespace(lru=True), r, narrow)
    assert staged_wide > 0  # the narrow caches did stage: the rule is not vacuous


def test_stable_ranks_is_argsorts_inverse_on_ties():
    rng = np.random.default_rng()
    for m in (1, 5, 33, 129):
        key = jnp.asarray(rng.integers(-3, 3, m), jnp.int32)
        want = np.empty(m, np.int32)
        want[np.argsort(np.asarray(key), kind="stable")] = np.arange(m)
        np.testing.assert_array_equal(slots_mod.stable_ranks(key), want)
        np.testing.assert_array_equal(slots_mod.prefix_counts(key > 0), np.cumsum(np.asarray(key) > 0))


def test_set_at_applies_updates_in_turn():
    rng = np.random.default_rng()
    base = jnp.asarray(rng.integers(-5, 5, 12), jnp.int32)
    i1, i2 = jnp.asarray(rng.permutation(12)[:5], jnp.int32), jnp.asarray(rng.permutation(12)[:4], jnp.int32)
    w1, w2 = jnp.asarray(rng.random(5) < 0.7), jnp.asarray(rng.random(4) < 0.7)
    v2 = jnp.asarray(rng.integers(100, 200, 4), jnp.int32)
    want = base.at[jnp.where(w1, i1, 12)].set(-1, mode="drop").at[jnp.where(w2, i2, 12)].set(v2, mode="drop")
    np.testing.assert_array_equal(slots_mod.set_at(base, (w1, i1, -1), (w2, i2, v2)), want)


def test_packed_states_round_trip_bit_for_bit():
    """The scanned body's packed small leaves give every leaf back exactly (float32 bits, bools), per layer too."""
    rng = np.random.default_rng()
    stack = slots_mod.init_stacked_slot_cache(CFG, 3, 5, jnp.float32, "lru", 0.37)
    stack = stack.replace(table=jnp.asarray(rng.integers(-1, 5, stack.table.shape), jnp.int32),
                          range_sum=jnp.asarray(rng.standard_normal(3), jnp.float32).at[1].set(-0.0),
                          lru=jnp.asarray([True, False, True]), counters=jnp.asarray(
                              rng.integers(0, 1 << 30, stack.counters.shape), jnp.int32))
    packed = slots_mod.pack_states(stack)
    assert packed.packed.shape[0] == 3 and packed.packed.dtype == jnp.int32
    back = slots_mod.unpack_states(packed)
    for name in slots_mod.SMALL:
        a, b = np.asarray(getattr(stack, name)), np.asarray(getattr(back, name))
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    view = slots_mod.packed_layer_view(packed, jnp.int32(1))
    ref = slots_mod.layer_view(stack, 1)
    for name in slots_mod.SMALL:
        np.testing.assert_array_equal(np.asarray(getattr(view, name)), np.asarray(getattr(ref, name)), err_msg=name)
    view = view.replace(clock=view.clock + 7, range_sum=jnp.float32(2.5), lru=jnp.bool_(False))
    again = slots_mod.unpack_states(slots_mod.packed_put_layer(packed, jnp.int32(1), view))
    want = slots_mod.put_layer(stack, 1, view)
    for name in slots_mod.SMALL:
        np.testing.assert_array_equal(np.asarray(getattr(again, name)), np.asarray(getattr(want, name)), err_msg=name)


def test_the_scanned_offload_body_has_no_sort_or_scatter(engine_factory):
    """What the dense forms are for: the layer body of a scanned offloaded decode window holds no sort and no scatter
    (each was a kernel of its own a layer on a GPU), and its small slot-cache leaves go back in one update."""
    eng = engine_factory(None, dtype="float32", window=1, context=64, expert_cache_slots=5, pcie_frac=1.0,
                         cpu_threads=2)
    if not eng.scanned_offload:
        pytest.skip(f"the scanned offload graph needs the native offload calls: {eng.placement.lines[-1]}")
    eng.generate([3, 1, 4, 1, 5], 2, stop_token_ids=[], draft="none")
    text = eng.compiled.decode[1].as_text()
    body = re.search(r"while\([^)]*\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", text).group(1)
    lines = text.split(f"%{body} ")[1].split("\n}\n")[0] if f"%{body} " in text else text.split(f"{body} ")[1].split("\n}\n")[0]
    called = set(re.findall(r"calls=%?([\w.\-]+)", lines))
    bodies = lines + "".join(text.split(f"%{c} ")[1].split("\n}\n")[0] for c in called if f"%{c} " in text)
    assert not re.search(r"[\s)](sort|scatter)\(", bodies)
    assert len(re.findall(r"dynamic-update-slice\(", bodies)) <= 3  # the packed leaves, and the K and V caches


# ---- the same plan in one Pallas kernel (pallas_kernels/slot_plan.py) ----------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "static"])
def test_the_slot_plan_kernel_equals_the_xla_forms(policy):
    """pallas_kernels/slot_plan.py (interpreted) and its reference give every plan field, updated leaf and counter
    the XLA forms give (plan_window, update_slots), on random states and routes."""
    from strata_jax.pallas_kernels.slot_plan import slot_plan, slot_plan_reference
    rng = np.random.default_rng()
    xla = jax.jit(xla_plan_and_update)
    args = lambda r, s: (r.expert_ids, r.combine, r.entry_counts, s.table, s.expert_of, s.last_use, s.usage,  # noqa
                         s.pcie_frac, s.clock, s.lru)
    for trial in range(24):
        s = int(rng.choice([0, 1, 3, 7, CFG.num_experts]))
        state = random_state(rng, s, policy, float(rng.choice([0.0, 0.3, 0.5, 1.0])))
        r = random_route(rng, int(rng.choice([1, 2, 3, 4])))
        p, new = xla(r, state)
        for got in (slot_plan(*args(r, state), cpu=True, interpret=True),
                    slot_plan_reference(*args(r, state), cpu=True)):
            for name in ("kind", "slot", "insert", "dest"):
                np.testing.assert_array_equal(got[name], getattr(p, name), err_msg=name)
            for name in ("table", "expert_of", "last_use", "usage"):
                np.testing.assert_array_equal(got[name], getattr(new, name), err_msg=name)
            c = np.asarray(new.counters - state.counters)
            np.testing.assert_array_equal(np.asarray(got["sums"])[[0, 1, 2, 4, 5, 6, 7, 3]],
                                          np.concatenate([c[1:4], c[5:8], c[8:10]]))


def test_the_slot_plan_kernel_lowers_for_cuda():
    from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
    from strata_jax.pallas_kernels.slot_plan import slot_plan
    e, s, n, t = 128, 32, 32, 4
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((n,), jnp.int32), ((t, n), jnp.float32), ((n,), jnp.int32), ((e,), jnp.int32), ((s + 1,), jnp.int32),
        ((s + 1,), jnp.int32), ((e,), jnp.int32), ((), jnp.float32), ((), jnp.int32), ((), jnp.bool_))]
    text = lower_for_cuda(lambda *a: slot_plan(*a, cpu=True), *specs)
    assert "slot_plan" in text


def test_the_engine_with_the_plan_kernel_matches_the_xla_plan(engine_factory):
    """plan_kernel=pallas (interpreted here) gives the engine the same logits (on a GPU to 1e-5), tokens and expert
    counters as the XLA plan, under lru and static, with and without the host pool."""
    rng = np.random.default_rng()
    tokens = rng.integers(0, 256, size=21).tolist()
    engines = {k: engine_factory(None, dtype="float32", window=2, context=64, expert_cache_slots=5, pcie_frac=0.5,
                                 cpu_threads=2, plan_kernel=k) for k in ("xla", "pallas")}
    assert engines["pallas"].decode_expert_path.plan_kernel == engines["pallas"].placement.native
    for frac, policy in ((0.5, "lru"), (1.0, "lru"), (0.0, "static")):
        got = {}
        for k, eng in engines.items():
            eng.reconfigure(pcie_frac=frac, cache_policy=policy)
            scores = eng.score(tokens, window=2)
            out = eng.generate(tokens[:7], 6, stop_token_ids=[])
            got[k] = (scores, out, eng.stats.last.decode_experts)
        if jax.default_backend() == "gpu":  # two graphs compiled apart may fuse a float sum differently (1 ulp)
            assert rel_fro(got["pallas"][0], got["xla"][0]) <= 1e-5, (frac, policy)
        else:
            np.testing.assert_array_equal(got["pallas"][0], got["xla"][0])
        assert got["pallas"][1] == got["xla"][1]
        counters = lambda st: {k: v for k, v in dataclasses.asdict(st).items() if k != "pool_s"}  # noqa: E731
        assert counters(got["pallas"][2]) == counters(got["xla"][2]), (frac, policy)
        assert got["pallas"][2].entries > 0


def test_refill_order_keeps_the_experts_already_in_a_slot():
    """The host's half of the fill after a prefill: every wanted expert ends in exactly one slot, one already in a
    slot stays there, only the others are copied (into slots whose expert is not wanted), and slots left over are
    emptied (the table holds what a full fill of `top` would)."""
    rng = np.random.default_rng(31)
    for _ in range(200):
        E, S = int(rng.integers(4, 40)), int(rng.integers(1, 12))
        S = min(S, E)
        current = np.full(S + 1, -1, np.int32)  # [S + 1]: the trash row's -1 last, as SlotCache.expert_of
        held = rng.permutation(E)[:int(rng.integers(0, S + 1))]
        current[rng.permutation(S)[:held.size]] = held
        top = np.where(np.arange(S) < int(rng.integers(0, S + 1)), rng.permutation(E)[:S], -1).astype(np.int32)
        expert_of, ids, rows, count = slots_mod.refill_order(current, top)
        want = set(top[top >= 0].tolist())
        assert sorted(expert_of[expert_of >= 0].tolist()) == sorted(want)
        for s in range(S):
            if current[s] in want:
                assert expert_of[s] == current[s]  # stays, uncopied
        new = want - set(current[:S].tolist())
        assert count == len(new)
        assert sorted(ids[:count].tolist()) == sorted(new)
        assert all(expert_of[rows[k]] == ids[k] for k in range(count))
        assert not (ids[count:].any() or rows[count:].any())


def test_refill_slots_holds_each_experts_own_weights():
    """A fill of one prompt's experts, then a refill to another's from refill_order: each slot's rows are its
    expert's host rows (the copies went to the right slots), the table maps each wanted expert to its slot and the
    others to -1; in a stacked cache the other layers' rows are untouched."""
    cfg = preset("tiny")
    rng = np.random.default_rng(32)
    E, I, H, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, 5
    host = tuple(jnp.asarray(rng.standard_normal(shape).astype(np.float32)) for shape in ((E, I, H), (E, I, H), (E, H, I)))
    stack = slots_mod.init_stacked_slot_cache(cfg, 3, S, jnp.float32)
    first = np.array([3, 1, -1, 6, 0], np.int32)
    stack = slots_mod.fill_layer_slots(stack, 1, *host, jnp.asarray(first))
    before = [np.asarray(a).copy() for a in (stack.gate, stack.up, stack.down)]
    top = np.array([6, 2, 3, 7, -1], np.int32)  # 6 and 3 stay; 2 and 7 are copied; 1 and 0 leave
    expert_of, ids, rows, count = slots_mod.refill_order(np.asarray(stack.expert_of[1]), top)
    assert count == 2
    refill = jax.jit(slots_mod.refill_layer_slots)
    stack = refill(stack, jnp.int32(1), *host, *map(jnp.asarray, (expert_of, ids, rows)), jnp.int32(count))
    view = slots_mod.layer_view(stack, 1)
    base = int(view.base)
    table = np.asarray(view.table)
    for e in range(E):
        if e in top:
            s = table[e]
            assert s >= 0 and np.asarray(view.expert_of)[s] == e
            for got, want in zip((stack.gate, stack.up, stack.down), host):
                np.testing.assert_array_equal(np.asarray(got[base + s]), np.asarray(want[e]))
        else:
            assert table[e] == -1
    other = np.r_[0:base, base + S + 1:3 * (S + 1)]
    for got, was in zip((stack.gate, stack.up, stack.down), before):
        np.testing.assert_array_equal(np.asarray(got)[other], was[other])
