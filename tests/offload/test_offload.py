"""Experts off the device: the exact path does not depend on placement, and the counters tell what happened.

Exactness tolerance: float32 logits, ||offloaded - all_resident||_F / ||all_resident||_F <= 1e-5 over the whole
[N, V] matrix (the host pool and the block-wise device sums add in another order; nothing else differs).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers import one_line_refusal, rel_fro
from strata_jax import Engine, StrataError
from strata_jax.model.config import preset
from strata_jax.offload import placement as placement_mod
from strata_jax.offload.placement import Placement, adapt_pcie_frac, choose_pcie_frac
from strata_jax.offload.slots import layer_states
from strata_jax.engine.stats import ExpertStats
from conftest import run_cli

REL_TOL = 1e-5
N_EXPERTS = 16  # the embedded model (configs/tiny.json)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(20261129)
    return rng.integers(0, 256, size=29).tolist()


@pytest.fixture(scope="module")
def reference(engine_factory, tokens):
    """All experts resident on the device (the layers scanned over stacked weights, the default): score() per window
    size, and a greedy continuation. Every offloaded engine (unrolled graphs) must match it."""
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all")
    assert eng.placement is None and eng.scanned
    scores = {w: eng.score(tokens, window=w) for w in (1, 2, 3, 4)}
    return scores, eng.generate(tokens[:9], 12, stop_token_ids=[])


def offload_engine(engine_factory, slots):
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=slots, pcie_frac=1.0,
                          cpu_threads=2)


@pytest.mark.parametrize("slots", [0, 5, N_EXPERTS])
def test_logits_and_greedy_do_not_depend_on_placement(engine_factory, reference, tokens, slots):
    ref_scores, ref_greedy = reference
    eng = offload_engine(engine_factory, slots)
    assert eng.placement is not None and eng.placement.slots == slots
    # the default pool_calls=auto: the native offload calls where the FFI handler builds, and the line says so
    pool = eng.placement.pool
    native = pool.ffi_handle() is not None
    assert eng.placement.native == native
    line = next(x for x in eng.placement.lines if x.startswith("offload calls: "))
    assert line.startswith("offload calls: native") == native, line
    before, fetched = pool.fetch_counters(), 0
    for frac in (1.0, 0.0, 0.5):  # 1.0 compiles without the host pool, the others with it
        for policy in ("lru", "static"):
            eng.reconfigure(pcie_frac=frac, cache_policy=policy)
            # every window size at 5 slots (some resident, some not); the empty and the full cache (what their slot
            # counts change is the plan, not the window's rows) at T = 1 and 4, the smallest and the widest graph
            for w in (1, 2, 3, 4) if slots == 5 else (1, 4):
                got = eng.score(tokens, window=w)
                assert rel_fro(got, ref_scores[w]) <= REL_TOL, (policy, frac, w)
                # the same window run again on a now-warm cache
            assert rel_fro(eng.score(tokens, window=4), ref_scores[4]) <= REL_TOL
            assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy, (policy, frac)
            d = eng.stats.last.decode_experts
            assert d.entries == d.entries_resident + d.entries_fetched + d.entries_cpu > 0
            fetched += d.distinct_fetched
            if frac == 0.0:
                assert d.distinct_fetched == 0
            if frac == 1.0:
                assert d.distinct_cpu == 0
            if slots == 0:
                assert d.distinct_resident == 0
    calls, experts, nbytes = (b - a for a, b in zip(before, pool.fetch_counters()))
    assert fetched > 0
    if native and pool.fetch_mode() == "kernel":  # a GPU's begin call copies on the stream: no host copy, no count
        assert (calls, experts, nbytes) == (0, 0, 0)
    elif native:  # the CPU handler's (or a GPU worker's) host copies; bytes are whole experts
        assert calls > 0 and experts > 0 and nbytes == experts * preset("tiny").expert_bytes(4)


def test_offloaded_decode_windows_run_one_scanned_body(engine_factory, reference, tokens):
    """With the native offload calls (the default where their handler builds, as here) the decode windows run one
    scanned layer body (transformer.offload_layers): their graph holds one begin call, not one a layer, and the start-up
    line says so; layer_loop=unrolled keeps a call a layer. Both give all resident's logits and tokens."""
    ref_scores, ref_greedy = reference
    scanned = offload_engine(engine_factory, 5)
    unrolled = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0,
                              cpu_threads=2, layer_loop="unrolled")
    assert scanned.placement.native and scanned.scanned_offload and scanned.scanned
    assert not unrolled.scanned_offload and not unrolled.scanned

    def begins(eng, t):  # the offload begin calls in the compiled window graph
        return eng.compiled.decode[t].as_text().count('custom_call_target="strata_offload_begin')
    assert (begins(scanned, 2), begins(unrolled, 2)) == (1, preset("tiny").num_layers)
    for eng in (scanned, unrolled):
        eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
        assert rel_fro(eng.score(tokens, window=3), ref_scores[3]) <= REL_TOL
        assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
        d = eng.stats.last.decode_experts
        assert d.distinct_fetched > 0 and d.distinct_cpu > 0  # both halves of the split ran


def test_scanned_offload_runs_prefill_chunks_in_blocks_of_experts(engine_factory):
    """The reference model (64 experts top-8): a prefill chunk's 64 distinct experts are more than one pair of native
    calls takes (32), so the scanned body runs them in two blocks, a begin and a collect each, over the same stacked
    slot cache: the prefill graph holds two begin calls (not two a layer). Prompt logits and greedy tokens are all
    resident's under lru and static (which fills the stacked cache from the prefill's usage)."""
    rng = np.random.default_rng(20261204)
    prompt = rng.integers(0, 256, size=80).tolist()
    kw = dict(dtype="float32", window=4, context=256, prefill_chunk=64)
    ref = engine_factory("reference", expert_cache_slots="all", **kw)
    want_logits, want_tokens = ref.prefill_logits(prompt), ref.generate(prompt[:70], 8, stop_token_ids=[])
    eng = engine_factory("reference", expert_cache_slots=12, pcie_frac=0.5, cpu_threads=2, **kw)
    assert eng.scanned_offload
    begins = eng.compiled.prefill[64].as_text().count('custom_call_target="strata_offload_begin')
    assert begins == 2, begins
    for policy in ("lru", "static"):
        eng.reconfigure(pcie_frac=0.5, cache_policy=policy)
        assert rel_fro(eng.prefill_logits(prompt), want_logits) <= REL_TOL, policy
        assert eng.generate(prompt[:70], 8, stop_token_ids=[]) == want_tokens, policy
        p, d = eng.stats.last.prefill_experts, eng.stats.last.decode_experts
        assert p.distinct_fetched > 0 and p.distinct_cpu > 0 and d.distinct_fetched > 0 and d.distinct_cpu > 0
        if policy == "static":
            assert all((np.asarray(s.table) >= 0).sum() == 12 for s in layer_states(eng.cache.experts))


@pytest.mark.parametrize("pool_calls", ["layer", "callback"])
def test_the_graph_paths_to_the_pool_are_exact(engine_factory, reference, tokens, pool_calls):
    """pool_calls=layer (graph fetch loops, the pool by one FFI call) and callback (io_callback): the same logits and
    greedy tokens as all resident (the default, auto, is test_logits_and_greedy_do_not_depend_on_placement), and
    the start-up line says the decode graphs take the graph path."""
    ref_scores, ref_greedy = reference
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=0.5,
                         cpu_threads=2, pool_calls=pool_calls)
    pool = eng.placement.pool
    assert not eng.placement.native
    assert f"offload calls: graph loops and lax.cond (pool_calls={pool_calls})" in eng.placement.lines
    before = pool.fetch_counters()
    for policy in ("lru", "static"):
        eng.reconfigure(cache_policy=policy)
        assert rel_fro(eng.score(tokens, window=4), ref_scores[4]) <= REL_TOL, policy
        assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy, policy
    assert pool.fetch_counters() == before  # no native offload call


def test_counters_add_up(engine_factory, tokens):
    cfg = preset("tiny")  # the embedded model's shape
    eng = offload_engine(engine_factory, 5)
    assert "cache_policy" in one_line_refusal(eng.reconfigure, cache_policy="")  # not a silent no-op
    eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
    prompt, new = tokens[:20], 10
    out = eng.generate(prompt, new, stop_token_ids=[])
    assert len(out) == new
    k, layers = cfg.num_experts_per_tok, cfg.num_sparse_layers
    p, d = eng.stats.last.prefill_experts, eng.stats.last.decode_experts
    # Every valid row routes to K experts in every MoE layer; padding rows of the prefill chunk route nowhere.
    assert p.entries == len(prompt) * k * layers
    # Every token a decode window ran (accepted or a rejected draft) routes K entries in every MoE layer.
    assert d.entries == eng.stats.last.window_tokens * k * layers
    assert eng.stats.last.window_tokens >= new - 1
    for s in (p, d):
        assert s.distinct == s.distinct_resident + s.distinct_fetched + s.distinct_cpu
        assert s.pcie_bytes == s.distinct_fetched * cfg.expert_bytes(4)
        assert 0.0 <= s.hit_rate <= 1.0
    # Distinct experts of a window are at most its entries, and at most E per layer.
    assert d.distinct <= d.entries
    # The prefill chunk streams each missed expert once per layer: an empty cache has no hits.
    eng.reconfigure(pcie_frac=1.0)
    eng.generate(prompt, 1)
    p = eng.stats.last.prefill_experts
    assert p.distinct_resident == 0 and p.distinct_fetched == p.distinct <= N_EXPERTS * layers
    # Since-start totals add the requests up.
    assert eng.stats.total.decode_experts.entries >= d.entries


def test_no_callback_without_cpu_entries(engine_factory, tokens):
    eng = offload_engine(engine_factory, 5)
    pool = eng.placement.pool
    eng.reconfigure(pcie_frac=1.0)
    pool.stats.reset()
    eng.generate(tokens[:9], 6)
    assert pool.stats.calls == 0
    eng.reconfigure(pcie_frac=0.0)
    eng.generate(tokens[:9], 6)
    assert eng.stats.last.decode_experts.pool_s > 0
    assert eng.stats.last.decode_experts.distinct_cpu > 0


def test_lru_keeps_experts_and_static_freezes(engine_factory, tokens):
    eng = offload_engine(engine_factory, N_EXPERTS)
    eng.reconfigure(pcie_frac=1.0, cache_policy="lru")
    eng.generate(tokens[:9], 8)
    # Every expert fits: a second identical request finds all of them resident.
    eng.generate(tokens[:9], 8)
    assert eng.stats.last.prefill_experts.hit_rate == 1.0
    assert eng.stats.last.decode_experts.hit_rate == 1.0

    small = offload_engine(engine_factory, 5)
    small.reconfigure(pcie_frac=1.0, cache_policy="static")
    small.generate(tokens[:20], 1)  # prefill, then the fill from its usage
    tables = [np.asarray(s.table) for s in layer_states(small.cache.experts)]
    for t in tables:
        assert (t >= 0).sum() == 5  # the 5 slots hold 5 distinct experts
    small.generate(tokens[:20], 10)
    after = [np.asarray(s.table) for s in layer_states(small.cache.experts)]
    for t0, t1 in zip(tables, after):
        np.testing.assert_array_equal(t0, t1)  # decode never changes a static cache


def test_static_policy_fills_the_prefills_most_used_experts(engine_factory, tokens):
    eng = offload_engine(engine_factory, 5)
    eng.reconfigure(pcie_frac=1.0, cache_policy="lru")
    eng.generate(tokens[:20], 1)  # the prefill only: usage holds the prompt's routing
    usage = [np.asarray(s.usage) for s in layer_states(eng.cache.experts)]
    eng.reconfigure(cache_policy="static")
    eng.generate(tokens[:20], 1)  # the same prefill, then the fill
    for u, s in zip(usage, layer_states(eng.cache.experts)):
        chosen = np.asarray(s.table) >= 0
        assert chosen.sum() == 5
        assert u[chosen].min() >= u[~chosen].max()  # no expert left out was used more than one kept


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_pool_failure_is_one_error_and_the_engine_recovers(engine_factory, reference, tokens, fault):
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=0, pcie_frac=0.0,
                         cpu_threads=2, callback_timeout_s=1.0, pool_calls="callback")  # faults: the Python pool
    _, ref_greedy = reference
    eng.placement.pool.inject_fault(1, fault)
    with pytest.raises(StrataError) as info:
        eng.generate(tokens[:9], 12, stop_token_ids=[])
    msg = str(info.value)
    assert "layer 1" in msg and "\n" not in msg
    if fault == "hang":
        assert "did not answer within 1.0 s" in msg
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy


def test_auto_split_counts_filled_slots_at_pcie_frac_0_under_either_policy():
    """pcie_frac=auto's cost model: a split that fetches nothing fills the slots from each prompt's prefill under lru
    as under static (placement.fills_from_prefill), so the two policies cost the same at every split, and a pool
    faster than PCIe wins the whole split under either."""
    from strata_jax.offload.placement import choose_pcie_frac, fills_from_prefill
    cfg = preset("qwen3-30b-a3b")
    costs = dict(pcie_gbs=50.0, pcie_call_s=2e-4, pool_gbs=100.0, callback_s=2e-5, overlap=True)
    lru, by_lru = choose_pcie_frac(cfg, cfg.num_experts // 2, 2, **costs, policy="lru")
    static, by_static = choose_pcie_frac(cfg, cfg.num_experts // 2, 2, **costs, policy="static")
    assert lru == static == 0.0 and by_lru == by_static
    slow_pool, _ = choose_pcie_frac(cfg, cfg.num_experts // 2, 2, **dict(costs, pool_gbs=5.0), policy="lru")
    assert slow_pool > 0.0
    assert fills_from_prefill("lru", 0.0) and fills_from_prefill("static", 0.7)
    assert not fills_from_prefill("lru", 0.25) and not fills_from_prefill("lru", 1.0)


def test_lru_with_pcie_frac_0_fills_the_slots_from_the_prefill(engine_factory, reference, tokens):
    """lru with pcie_frac 0 fetches nothing, so its slots would stay empty and every entry go to the pool: they take
    each prompt's most used experts after its prefill, as under static, and decode hits them; still exact."""
    _, ref_greedy = reference
    eng = offload_engine(engine_factory, 5)
    eng.reconfigure(pcie_frac=0.0, cache_policy="lru")
    assert eng.placement.fills_from_prefill
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    for s in layer_states(eng.cache.experts):
        assert (np.asarray(s.table) >= 0).sum() == 5
    stats = eng.stats.last.decode_experts
    assert stats.entries_resident > 0 and stats.entries_fetched == 0 and stats.entries_cpu > 0
    # the fill is waited for and counted on its own (not decode time); a later prompt copies only the experts that
    # were not in a slot already, and stays exact
    first = eng.stats.last
    assert 0 < first.slot_fill_experts <= 5 * len(layer_states(eng.cache.experts)) and first.slot_fill_s > 0
    held = [set(np.asarray(s.expert_of)[:-1].tolist()) - {-1} for s in layer_states(eng.cache.experts)]
    eng._kv_tokens = []  # no prefix reuse: the same prompt's prefill again picks the experts its slots hold
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    assert eng.stats.last.slot_fill_experts == 0
    assert [set(np.asarray(s.expert_of)[:-1].tolist()) - {-1} for s in layer_states(eng.cache.experts)] == held
    eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
    assert not eng.placement.fills_from_prefill


def test_slot_refresh_retakes_the_decodes_experts_and_stays_exact(engine_factory, reference, tokens):
    """slot_refresh=N (lru with pcie_frac 0): every N T=1 decode windows the slots re-take the request's most used
    experts so far; the tokens stay the all-resident ones, the refreshes are counted, and afterwards each layer's
    slots hold its most used experts by the usage the decode counted. Where the slots are not filled from the
    prefill, one line says it is ignored."""
    _, ref_greedy = reference
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=0.0,
                         cpu_threads=2, slot_refresh=3)
    assert placement_mod.slot_refresh_lines(eng.options, eng.placement)[0].startswith(
        "slot_refresh: every 3 decode windows")
    assert eng.generate(tokens[:9], 12, stop_token_ids=[], spec=0) == ref_greedy
    st = eng.stats.last
    assert st.slot_refreshes == st.windows // 3 > 0 and st.slot_refresh_s > 0
    assert "slot refreshes" in st.summary()
    for s in layer_states(eng.cache.experts):  # each slot's expert is where the table says
        table, held = np.asarray(s.table), np.asarray(s.expert_of)[:-1]
        assert all(table[e] == i for i, e in enumerate(held) if e >= 0)
        assert (held >= 0).sum() == (table >= 0).sum()
    eng.reconfigure(pcie_frac=0.5)
    line = placement_mod.slot_refresh_lines(eng.options, eng.placement)
    assert line and "ignored" in line[0]


def test_auto_split_follows_the_misses_a_request_met():
    """pcie_frac=auto after a request (placement.adapt_pcie_frac): few misses a layer fetch everything (the pool's
    fixed cost a call outweighs its share of the bytes), many misses with a pool as fast as PCIe split them, unless
    the host's memory, which both read, is too slow for the two together; from 1 (graphs built without the pool) as
    from a split. A split asked for by number or too short a request leave it."""
    cfg = preset("tiny")  # 98 kB float32 experts, top-4
    costs = dict(pcie_gbs=10.0, pcie_call_s=1e-5, pool_gbs=10.0, callback_s=5e-6, host_read_gbs=40.0)

    def placement(frac=0.25, auto=True, **changes):
        return Placement(slots=4, policy="lru", pcie_frac=frac, pool=None, host_kind="pinned_host", lines=[],
                         costs=dict(costs, **changes), native=True, auto=auto)
    few = ExpertStats(entries=400, distinct_fetched=20, distinct_cpu=5)  # 0.25 misses a layer
    many = ExpertStats(entries=400, distinct_fetched=300, distinct_cpu=100)  # 4: every entry
    assert adapt_pcie_frac(cfg, placement(), 4, few) == (1.0, 0.25)
    assert adapt_pcie_frac(cfg, placement(), 4, many) == (0.5, 4.0)
    # both paths read the host's memory: a split goes no faster than it lets the two together
    split = lambda read: choose_pcie_frac(cfg, 4, 4, **dict(costs, host_read_gbs=read), overlap=True, misses=4.0)[1]
    assert split(12.0)[0.5] > split(40.0)[0.5] == split(None)[0.5]
    assert split(12.0)[1.0] == split(40.0)[1.0]
    assert adapt_pcie_frac(cfg, placement(frac=0.5), 4, many) is None  # already there
    assert adapt_pcie_frac(cfg, placement(auto=False), 4, few) is None
    assert adapt_pcie_frac(cfg, placement(frac=1.0), 4, many) == (0.5, 4.0)  # the engine takes the pool's graphs
    assert adapt_pcie_frac(cfg, placement(frac=1.0), 4, few) is None
    assert adapt_pcie_frac(cfg, placement(), 4, ExpertStats(entries=40, distinct_fetched=1)) is None


def test_auto_split_after_frozen_slots_counts_what_lru_would_meet():
    """After a request whose slots stayed as its prefill filled them (lru at pcie_frac 0), the misses it met are the
    frozen slots'; a split's lru fetches follow the decode, so its candidates count the misses the decode's own most
    used experts would have left (following_misses: hindsight, from the usage since the fill)."""
    rng = np.random.default_rng(20261207)
    for _ in range(50):  # against a plain count: entries outside each layer's S most used, per window of K
        layers, e, k = rng.integers(1, 5), rng.integers(4, 20), rng.integers(1, 4)
        s = int(rng.integers(0, e + 1))
        usage = rng.integers(0, 9, size=(layers, e)) * (rng.random((layers, e)) < 0.7)
        total = usage.sum()
        left = sum(sum(sorted(row)[:e - s]) for row in usage)
        got = placement_mod.following_misses(usage, s, k)
        assert (got is None) if total == 0 else got == pytest.approx(k * left / total)
    cfg = preset("tiny")
    costs = dict(pcie_gbs=10.0, pcie_call_s=1e-5, pool_gbs=10.0, callback_s=5e-6, host_read_gbs=40.0)
    frozen = Placement(slots=4, policy="lru", pcie_frac=0.0, pool=None, host_kind="pinned_host", lines=[],
                       costs=costs, native=True, auto=True)
    many = ExpertStats(entries=400, distinct_fetched=0, distinct_cpu=400)  # 4 misses a layer with the frozen slots
    assert adapt_pcie_frac(cfg, frozen, 4, many) == (0.5, 4.0)
    assert adapt_pcie_frac(cfg, frozen, 4, many, following=0.25) == (1.0, 4.0)  # lru would have met 0.25
    static = dataclasses.replace(frozen, policy="static")  # static slots stay frozen whatever the split
    assert adapt_pcie_frac(cfg, static, 4, many, following=0.25) == adapt_pcie_frac(cfg, static, 4, many)


def test_engine_gives_auto_the_decodes_usage_after_frozen_slots(engine_factory, tokens, monkeypatch):
    """An auto engine at pcie_frac 0 under lru (slots frozen after the prefill) hands the rule the misses that slots
    following the decode would have met, from the usage counted since the fill; at a split (lru fetching) none."""
    eng = offload_engine(engine_factory, 5)
    seen = []
    monkeypatch.setattr(placement_mod, "adapt_pcie_frac", lambda *a: seen.append(a[-1]))
    for frac, frozen in ((0.0, True), (0.5, False)):
        eng.reconfigure(pcie_frac=frac, cache_policy="lru")
        eng.placement.auto = True
        eng.generate(tokens[:9], 12, stop_token_ids=[])
        states = layer_states(eng.cache.experts)
        usage = np.stack([np.asarray(s.usage) for s in states])
        if frozen:
            k = preset("tiny").num_experts_per_tok
            assert usage.sum() == eng.stats.last.decode_experts.entries  # the decode's entries, since the fill
            assert seen[-1] == pytest.approx(placement_mod.following_misses(usage, 5, k)) and 0 < seen[-1] < k
        else:
            assert seen[-1] is None


def test_engine_applies_a_new_auto_split_as_data(engine_factory, reference, tokens, monkeypatch):
    """When the rule moves the split below 1, the engine sets it in every layer's slot cache without a recompile or
    a reset, and stays exact."""
    ref_scores, ref_greedy = reference
    eng = offload_engine(engine_factory, 5)
    eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
    monkeypatch.setattr(placement_mod, "adapt_pcie_frac", lambda *a: (0.25, 2.0))
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    graphs = dict(eng.compiled.decode)  # the graphs the request used (tests may compile them on first use)
    assert graphs and eng.placement.pcie_frac == 0.25
    assert {float(np.asarray(s.pcie_frac)) for s in layer_states(eng.cache.experts)} == {0.25}
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    assert eng.stats.last.decode_experts.distinct_cpu > 0
    assert all(eng.compiled.decode[t] is g for t, g in graphs.items())  # the same compiled graphs: nothing recompiled


def test_auto_takes_the_graphs_without_the_pool_at_1_and_back(engine_factory, reference, tokens, monkeypatch):
    """pcie_frac=auto's choice crossing 1 swaps the graph tables: at 1 those without the host pool (no pool call a
    layer, as pcie_frac=1's), below 1 those with it, each compiled once and kept; the slot caches' experts stay,
    the logits and greedy tokens stay all resident's, and the start-up's compile time is not overwritten."""
    ref_scores, ref_greedy = reference
    eng = offload_engine(engine_factory, 5)
    eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
    eng.placement.auto = True  # as pcie_frac=auto at start-up, its split below 1
    start_up, pool_graphs = eng.stats.compile_s, eng.compiled
    choice = [1.0]
    monkeypatch.setattr(placement_mod, "adapt_pcie_frac", lambda *a: (choice[0], 1.0))
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy  # ran with the pool, then crossed to 1
    assert eng.placement.pcie_frac == 1.0 and not eng.placement.cpu_path
    assert eng.compiled is not pool_graphs and eng.decode_expert_path.pool is None
    cached = [np.asarray(s.table).copy() for s in layer_states(eng.cache.experts)]
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    d = eng.stats.last.decode_experts
    assert d.entries > 0 and d.distinct_cpu == 0 and d.entries_cpu == 0
    assert d.entries_resident > 0  # the experts cached before the swap served this request
    assert all((t >= 0).any() for t in cached)
    no_pool_graphs = eng.compiled
    choice[0] = 0.5
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy  # ran without the pool, then crossed back
    assert eng.placement.pcie_frac == 0.5 and eng.placement.cpu_path and eng.compiled is pool_graphs  # kept
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    assert eng.stats.last.decode_experts.distinct_cpu > 0
    choice[0] = 1.0
    assert eng.generate(tokens[:9], 12, stop_token_ids=[]) == ref_greedy
    assert eng.compiled is no_pool_graphs  # kept too
    assert rel_fro(eng.score(tokens, window=4), ref_scores[4]) <= REL_TOL
    assert eng.stats.compile_s == start_up


def test_auto_slots_and_refusals(engine_factory, cache_dir):
    import jax
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="auto", pcie_frac="auto")
    if not (jax.devices()[0].memory_stats() or {}).get("bytes_limit"):
        # The CPU backend reports no device memory: auto takes half the experts, and auto pcie_frac is measured.
        assert eng.placement.slots == N_EXPERTS // 2
        assert eng.placement.costs["pcie_gbs"] > 0 and eng.placement.costs["pool_gbs"] > 0
        assert 0.0 <= eng.placement.pcie_frac <= 1.0
    else:
        assert eng.placement is None  # a GPU holds the whole tiny model: auto turns offload off
    with pytest.raises(StrataError, match="expert_cache_slots"):
        Engine.from_pretrained(None, expert_cache_slots="many", cache_dir=str(cache_dir))
    with pytest.raises(StrataError, match="pcie_frac"):
        Engine.from_pretrained(None, pcie_frac="1.5", cache_dir=str(cache_dir))
    with pytest.raises(StrataError, match="cache_policy"):
        Engine.from_pretrained(None, cache_policy="fifo", cache_dir=str(cache_dir))


def test_cli_prints_the_offload_counters(cache_dir):
    # compile_graphs=lazy: the run compiles the windows it runs, not every size (the counters are the same; the
    # ahead compile of the CLI is test_cli's)
    out = run_cli(["--dtype=float32", "--window=4", "--context=64", "--expert_cache_slots=5", "--pcie_frac=0.5",
                   "--max_new_tokens=6", "--compile_graphs=lazy"], cache_dir, timeout=600)
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 0, err
    assert "expert cache: 5 of 16 slots per MoE layer" in err
    assert "pcie_frac: 0.5" in err
    lines = err.splitlines()  # the statistics go to stderr
    assert any(line.startswith("experts, decode: hit rate") for line in lines)
    assert any(line.startswith("experts, prefill: hit rate") for line in lines)


def test_bf16_logits_do_not_depend_on_history(engine_factory):
    """bf16, part of the misses on the host pool: the same request scores the same whatever ran before (which
    decides what is in the slots, hence which experts the pool computes). The pool rounds g, u, silu(g)*u and each
    expert's output to bf16 where the device does (the XLA path rounds silu(g) * u once, as the Pallas kernel)."""
    eng = engine_factory(None, dtype="bfloat16", window=4, context=64, expert_cache_slots=4, pcie_frac=0.5)
    tokens = np.random.default_rng(77).integers(0, 255, size=25).tolist()
    before = eng.score(tokens, window=4)
    for seed in range(3):  # other requests change the slots' contents
        eng.generate(np.random.default_rng(seed).integers(0, 255, size=9).tolist(), 8, stop_token_ids=[])
    after = eng.score(tokens, window=4)
    assert eng.stats.last.decode_experts.entries_cpu > 0
    # float32 summation order (GPU blocks and the pool's share change with the slots) may flip a bf16 rounding of
    # a layer's output; on a CPU nothing moves (0 measured; 7e-3 with the pool in float32 throughout, 6e-4 with
    # XLA's excess precision on). The reference is the default all-resident engine: the scanned graph.
    assert rel_fro(after, before) < 1e-3
    resident_engine = engine_factory(None, dtype="bfloat16", window=4, context=64, expert_cache_slots="all")
    assert resident_engine.scanned
    resident = resident_engine.score(tokens, window=4)
    assert max(rel_fro(after, resident), rel_fro(before, resident)) < 1e-3
