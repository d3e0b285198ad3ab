"""The routing approximations (strata_jax/offload/approx.py): each rule against a plain-numpy implementation of its
text, the switches' values table, and the engine-level guarantees: off = the exact path; lambda = 0, R >= K and a full cache
change nothing.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from strata_jax.model import moe
from strata_jax.offload import approx
from strata_jax.offload import slots as slots_mod
from strata_jax.model.config import preset
from strata_jax.offload.approx import route_approx
from strata_jax.options import EngineOptions, build

CFG = preset("tiny")  # 16 experts, top-4
E, K = CFG.num_experts, CFG.num_experts_per_tok


def softmax(v):
    v = np.asarray(v, np.float64)
    z = np.exp(v - v.max())
    return z / z.sum()


def numpy_route(logits, ids_per_token, norm=True):
    """The router's weights of a picked set, ordered by weight (heaviest first, ties: lower id)."""
    out_ids, out_w = [], []
    for row, ids in zip(logits, ids_per_token):
        p = softmax(row)
        ids = sorted(ids, key=lambda e: (-row[e], e))
        w = p[ids]
        out_ids.append(ids)
        out_w.append(w / w.sum() if norm else w)
    return np.array(out_ids), np.array(out_w)


def numpy_prior(logits, resident, lam, k, keep):
    """'each token's top-K is picked again with lambda added to the logit of every expert resident'; the unbiased
    top-`keep` always kept."""
    picks = []
    for t, row in enumerate(logits):
        unbiased = sorted(range(len(row)), key=lambda e: (-row[e], e))
        kept = unbiased[:keep]
        key = row.astype(np.float64) + lam[t] * resident
        rest = sorted((e for e in range(len(row)) if e not in kept), key=lambda e: (-key[e], e))
        picks.append(kept + rest[:k - keep])
    return numpy_route(logits, picks)


def numpy_swap(logits, resident, first, margin):
    """'a missed expert at rank >= first is swapped for the resident expert of highest logit not already picked, if
    its logit is within margin of the missed one's'."""
    picks, swaps = [], 0
    for row in logits:
        ids = sorted(range(len(row)), key=lambda e: (-row[e], e))[:K]
        for r in range(first, K):
            if resident[ids[r]]:
                continue
            cands = [e for e in range(len(row)) if resident[e] and e not in ids]
            if not cands:
                continue
            best = max(cands, key=lambda e: (row[e], -e))
            if row[best] >= row[ids[r]] - margin:
                ids[r] = best
                swaps += 1
        picks.append(ids)
    return (*numpy_route(logits, picks), swaps)


def random_state(rng, slots, w=None):
    """A slot cache whose table holds `slots` random experts (their weights in the slots when `w` is given)."""
    state = slots_mod.init_slot_cache(CFG, slots, jnp.float32)
    experts = rng.permutation(E)[:slots].astype(np.int32)
    if w is not None:
        return slots_mod.fill_slots(state, w.gate, w.up, w.down, jnp.asarray(experts)), np.isin(np.arange(E), experts)
    table = np.full(E, -1, np.int32)
    table[experts] = np.arange(slots)
    return state.replace(table=jnp.asarray(table)), np.isin(np.arange(E), experts)


def random_layer(rng):
    h, i = CFG.hidden_size, CFG.moe_intermediate_size
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.1)
    return moe.MoEWeights(router=f(h, E) * 10, gate=f(E, i, h), up=f(E, i, h), down=f(E, h, i))


def route_with(rule: approx.RouteApprox, x, w, state, valid=None):
    valid = jnp.ones((x.shape[0],), bool) if valid is None else valid
    return slots_mod.OffloadedExperts(CFG, route=rule).route(x, w, valid, state)


@pytest.mark.parametrize("seed", range(4))
def test_prior_is_the_rule_in_numpy(seed):
    rng = np.random.default_rng(seed)
    w, x = random_layer(rng), jnp.asarray(rng.standard_normal((4, CFG.hidden_size)).astype(np.float32))
    state, resident = random_state(rng, slots=int(rng.integers(2, E - 2)))
    logits = np.asarray(moe.router_logits(x, w.router))
    lam, keep = float(rng.uniform(0.2, 3.0)), int(rng.integers(0, 3))
    r, extra, _ = route_with(approx.RouteApprox(prior=lam, prior_keep=keep), x, w, state)
    ids, weights = numpy_prior(logits, resident, np.full(4, lam), K, keep)
    np.testing.assert_array_equal(np.asarray(r.topk_ids), ids)
    np.testing.assert_allclose(np.asarray(r.topk_weights), weights, rtol=1e-6)
    unbiased = numpy_route(logits, [sorted(range(E), key=lambda e: (-row[e], e))[:K] for row in logits])[0]
    changed = sum(set(a) != set(b) for a, b in zip(ids, unbiased))
    assert int(extra["prior_tokens_changed"]) == changed
    assert int(extra["prior_hits"]) == resident[ids].sum() >= int(extra["prior_hits_unbiased"]) == resident[unbiased].sum()


def test_prior_range_mode_scales_lambda_by_the_running_mean_range():
    rng = np.random.default_rng(7)
    w = random_layer(rng)
    state, resident = random_state(rng, slots=6)
    rule = approx.RouteApprox(prior=0.05, prior_mode="range", prior_keep=1)
    ranges = []
    for window in range(2):  # the second window's lambda uses the first window's tokens too
        x = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)).astype(np.float32))
        logits = np.asarray(moe.router_logits(x, w.router))
        ranges += list(logits.max(-1) - logits.min(-1))
        r, _, state = route_with(rule, x, w, state)
        ids, weights = numpy_prior(logits, resident, np.full(3, 0.05 * np.mean(ranges)), K, keep=1)
        np.testing.assert_array_equal(np.asarray(r.topk_ids), ids)
        np.testing.assert_allclose(np.asarray(r.topk_weights), weights, rtol=1e-6)
    assert int(state.range_count) == 6


@pytest.mark.parametrize("seed", range(4))
def test_resident_swap_is_the_rule_in_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    w, x = random_layer(rng), jnp.asarray(rng.standard_normal((4, CFG.hidden_size)).astype(np.float32))
    state, resident = random_state(rng, slots=int(rng.integers(3, E - 3)))
    logits = np.asarray(moe.router_logits(x, w.router))
    first, margin = int(rng.integers(1, K)), float(rng.uniform(0.5, 4.0))
    r, extra, _ = route_with(approx.RouteApprox(resident=True, resident_rank=first, resident_margin=margin), x, w, state)
    ids, weights, swaps = numpy_swap(logits, resident, first, margin)
    np.testing.assert_array_equal(np.asarray(r.topk_ids), ids)
    np.testing.assert_allclose(np.asarray(r.topk_weights), weights, rtol=1e-6)
    assert int(extra["swaps"]) == swaps


@pytest.mark.parametrize("seed", range(6))
def test_tail_skip_is_the_rule_in_numpy(seed):
    rng = np.random.default_rng(200 + seed)
    t, tail = int(rng.integers(1, 5)), int(rng.integers(1, K))
    topk = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)  # [T, K], rank order
    weights = np.sort(rng.random((t, K)).astype(np.float32), axis=1)[:, ::-1]
    r = moe.make_route(jnp.asarray(topk), jnp.asarray(weights.copy()), CFG, jnp.ones((t,), bool), jnp.float32)
    state, resident = random_state(rng, slots=int(rng.integers(0, E)))
    kind, _ = slots_mod.plan(r, state, cpu=False, tail_skip=tail)
    kind, experts = np.asarray(kind), np.asarray(r.expert_ids)
    for n, e in enumerate(experts):
        if e < 0:
            continue
        ranks = [k for row in topk for k, x in enumerate(row) if x == e]
        expect_skip = (not resident[e]) and min(ranks) >= tail
        assert (kind[n] == slots_mod.SKIP) == expect_skip, (e, ranks, resident[e])
    # an expert that any token ranks below R is never skipped
    skipped = set(experts[kind == slots_mod.SKIP])
    assert not skipped & set(topk[:, :tail].reshape(-1))


def test_tail_skip_drops_the_skipped_contributions_without_renormalising():
    """The layer's output with the skip = the exact sum over the experts that were not skipped, same weights."""
    rng = np.random.default_rng(11)
    w = random_layer(rng)
    x = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)).astype(np.float32))
    state, _ = random_state(rng, slots=4, w=w)
    valid = jnp.ones((3,), bool)
    path = slots_mod.OffloadedExperts(CFG, route=approx.RouteApprox(tail_skip=2))
    with jax.default_matmul_precision("highest"):
        y, new_state, _ = jax.jit(path, static_argnums=0)(0, x, w, valid, state)
        r = moe.route(x, w.router, CFG, valid)
        kind, _ = slots_mod.plan(r, state, cpu=False, tail_skip=2)
        served = np.asarray(kind) != slots_mod.SKIP
        assert (~served).any(), "the draw should skip something"
        combine = r.combine * jnp.asarray(served)[None, :]
        ids = jnp.maximum(r.expert_ids, 0)
        want = moe.expert_ffn(x, w.gate[ids], w.up[ids], w.down[ids], combine)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    counters = dict(zip(slots_mod.COUNTERS, np.asarray(new_state.counters)))
    assert counters["distinct_skipped"] == (~served).sum() > 0


def test_every_rule_is_a_no_op_with_everything_resident():
    rng = np.random.default_rng(3)
    w, x = random_layer(rng), jnp.asarray(rng.standard_normal((4, CFG.hidden_size)).astype(np.float32))
    state, _ = random_state(rng, slots=E)
    exact = moe.route(x, w.router, CFG, jnp.ones((4,), bool))
    rule = approx.RouteApprox(prior=5.0, prior_keep=0, resident=True, resident_rank=1, tail_skip=1)
    r, extra, _ = route_with(rule, x, w, state)
    np.testing.assert_array_equal(np.asarray(r.topk_ids), np.asarray(exact.topk_ids))
    np.testing.assert_array_equal(np.asarray(r.topk_weights), np.asarray(exact.topk_weights))
    kind, _ = slots_mod.plan(r, state, cpu=False, tail_skip=1)
    assert (np.asarray(kind)[np.asarray(r.expert_ids) >= 0] == slots_mod.RESIDENT).all()
    assert int(extra["swaps"]) == 0 and int(extra["prior_tokens_changed"]) == 0


# ---- the switches' values -------------------------------------------------------------------------------------

def parse(env=None, k=10, offload_on=True, **opts):
    return route_approx(build(EngineOptions, opts), k, offload_on, environ=env or {})


def test_unset_is_off_and_prints_nothing():
    rule, lines = parse()
    assert rule == approx.OFF and not rule.active and lines == []


@pytest.mark.parametrize("env,expect,line", [
    ({"STRATA_ROUTE_TAIL_SKIP": "7"}, dict(tail_skip=7), "R = 7"),
    ({"STRATA_ROUTE_TAIL_SKIP": "12"}, dict(tail_skip=12), "skips nothing"),
    ({"STRATA_ROUTE_TAIL_SKIP": "0"}, {}, "not an integer >= 1; tail skip off"),
    ({"STRATA_ROUTE_TAIL_SKIP": "seven"}, {}, "not an integer >= 1; tail skip off"),
    ({"STRATA_ROUTE_PRIOR": "0.5"}, dict(prior=0.5, prior_mode="plain", prior_keep=0), "lambda = 0.5"),
    ({"STRATA_ROUTE_PRIOR": "-1"}, {}, "not a number >= 0; prior off"),
    ({"STRATA_ROUTE_PRIOR": "nan"}, {}, "not a number >= 0; prior off"),
    ({"STRATA_ROUTE_PRIOR": "0.5", "STRATA_ROUTE_PRIOR_MODE": "range"},
     dict(prior=0.5, prior_mode="range", prior_keep=1), "running mean logit range"),
    ({"STRATA_ROUTE_PRIOR": "0.5", "STRATA_ROUTE_PRIOR_MODE": "range", "STRATA_ROUTE_PRIOR_KEEP": "3"},
     dict(prior=0.5, prior_mode="range", prior_keep=3), "top-3"),
    ({"STRATA_ROUTE_PRIOR": "0.5", "STRATA_ROUTE_PRIOR_MODE": "wide"}, dict(prior=0.5), "is not plain or range"),
    ({"STRATA_ROUTE_PRIOR_MODE": "range"}, {}, "the prior is off: ignored"),
    ({"STRATA_ROUTE_RESIDENT": "1"}, dict(resident=True, resident_rank=6, resident_margin=1.0), "rank 6..9"),
    ({"STRATA_ROUTE_RESIDENT": "1", "STRATA_ROUTE_RESIDENT_RANK": "8", "STRATA_ROUTE_RESIDENT_MARGIN": "0.25"},
     dict(resident=True, resident_rank=8, resident_margin=0.25), "rank 8..9"),
    ({"STRATA_ROUTE_RESIDENT": "1", "STRATA_ROUTE_RESIDENT_RANK": "10"}, dict(resident=True, resident_rank=6),
     "not an integer in 0..9; 6"),
    ({"STRATA_ROUTE_RESIDENT": "yes"}, {}, "is not 0 or 1; off"),
    ({"STRATA_ROUTE_RESIDENT": "0"}, {}, None),
    ({"STRATA_ROUTE_RESIDENT_MARGIN": "0.5"}, {}, "the swap is off: ignored"),
    ({"STRATA_ROUTE_RESIDENT": "0", "STRATA_ROUTE_RESIDENT_RANK": "3"}, {}, "the swap is off: ignored"),
])
def test_switch_values(env, expect, line):
    rule, lines = parse(env)
    for name, value in expect.items():
        assert getattr(rule, name) == value, (name, rule)
    if not expect:
        assert rule == approx.OFF
    if line is None:
        assert lines == []
    else:
        assert len([l for l in lines if line in l]) == 1, lines


def test_an_unknown_strata_variable_is_named_at_start_up():
    """A typo (STRATA_DEFER_CPU for STRATA_VERIFY_DEFER_CPU) is one line with the nearest switch, not ignored
    silently; the switches themselves are not flagged."""
    from strata_jax.options import unknown_switches
    lines = unknown_switches({"STRATA_DEFER_CPU": "1", "STRATA_ROUTE_PRIOR": "0.5", "STRATA_LOGPOS": "x",
                              "STRATA_WHATEVER": "2", "HOME": "/root", "STRATA_OFFLOAD_SIGNAL": "memops",
                              "STRATA_POOL_SPIN_US": "1000"})  # the last two: read by the pool's native code
    assert len(lines) == 2, lines
    assert lines[0].startswith("STRATA_DEFER_CPU: not a strata_jax switch") and "STRATA_VERIFY_DEFER_CPU" in lines[0]
    assert lines[1].startswith("STRATA_WHATEVER:")


def test_the_option_overrides_the_environment_and_offload_off_disables():
    rule, _ = parse({"STRATA_ROUTE_TAIL_SKIP": "7"}, route_tail_skip=5, route_resident=True)
    assert rule.tail_skip == 5 and rule.resident
    rule, lines = parse({"STRATA_ROUTE_TAIL_SKIP": "7"}, offload_on=False)
    assert rule == approx.OFF and "nothing to do" in lines[-1]


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(20261130).integers(0, 256, size=21).tolist()


def scores(engine_factory, tokens, slots, **switches):
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=slots, pcie_frac=1.0,
                         cpu_threads=2, **switches)
    eng.reconfigure(pcie_frac=1.0, cache_policy="lru")  # a fresh expert cache
    return eng, {w: eng.score(tokens, window=w) for w in (1, 4)}


def test_lambda_zero_and_r_at_least_k_are_identical_to_unset(engine_factory, tokens):
    _, base = scores(engine_factory, tokens, 5)
    for switches in (dict(route_prior="0"), dict(route_tail_skip=str(K)), dict(route_prior="0", route_tail_skip="9")):
        eng, got = scores(engine_factory, tokens, 5, **switches)
        assert eng.approx.active
        for w in base:
            np.testing.assert_array_equal(got[w], base[w], err_msg=str(switches))


def full_cache_scores(engine_factory, tokens, **switches):
    """Scores with every expert resident: a fresh cache of E slots, each layer's filled with all E experts."""
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=E, pcie_frac=1.0,
                         cpu_threads=2, **switches)
    eng.reconfigure(pcie_frac=1.0, cache_policy="lru")
    every = jnp.arange(E, dtype=jnp.int32)
    eng.cache = eng.cache.replace(experts=slots_mod.fill_every_layer(eng.cache.experts, eng.weights.layers, every))
    assert all((np.asarray(s.table) >= 0).all() for s in slots_mod.layer_states(eng.cache.experts))
    return eng, eng.score(tokens, window=4)


def test_a_full_cache_makes_every_rule_a_no_op(engine_factory, tokens):
    _, base = full_cache_scores(engine_factory, tokens)
    eng, got = full_cache_scores(engine_factory, tokens, route_prior="2", route_tail_skip="1", route_resident=True)
    np.testing.assert_array_equal(got, base)
    d = eng.stats.last.decode_experts
    assert d.distinct_skipped == d.swaps == d.prior_tokens_changed == 0 and d.prior_tokens > 0


def test_the_rules_cut_misses_and_count_them(engine_factory, tokens):
    _, base = scores(engine_factory, tokens, 5)
    eng_base = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0,
                              cpu_threads=2)
    base_fetched = eng_base.stats.last.decode_experts.distinct_fetched
    eng, got = scores(engine_factory, tokens, 5, route_prior="1", route_tail_skip="2", route_resident=True)
    d = eng.stats.last.decode_experts
    assert d.distinct_skipped > 0 and d.prior_tokens_changed > 0 and d.prior_hits > d.prior_hits_unbiased
    assert d.distinct_fetched < base_fetched
    assert not np.array_equal(got[4], base[4])  # they do change the output
    lines = d.approx_lines(eng.approx)
    assert len(lines) == 3 and "missed experts skipped" in lines[0]
