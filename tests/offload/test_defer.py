"""Deferred CPU rows (strata_jax/offload/defer.py): the switches' values table, `check` against unset, `=1` against a
plain-jnp model of "layer l's deferred CPU rows join before layer l+1's FFN half", and the timeout path.

The engines here put every expert on the host pool (expert_cache_slots=0, pcie_frac=0): every entry is a CPU row.
Tolerance: float32 logits, ||a - b||_F / ||b||_F <= 1e-5 over [N, V] (the rows are added in another order; the
exact path's own placement tolerance).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax import StrataError
from strata_jax.model import transformer
from strata_jax.model.kv_cache import init_cache
from strata_jax.model.weights import unstack_layers
from strata_jax.model import moe
from strata_jax.offload import defer
from strata_jax.offload import slots as slots_mod
from strata_jax.offload.defer import defer_cpu
from strata_jax.options import EngineOptions, build

REL_TOL = 1e-5


# ---- the values table -----------------------------------------------------------------------------------------

def parse(env, makes_cpu_rows=True, **opts):
    return defer_cpu(build(EngineOptions, opts), makes_cpu_rows, environ=env)


@pytest.mark.parametrize("env,mode,below,line", [
    ({}, "off", None, None),
    ({"STRATA_VERIFY_DEFER_CPU": "0"}, "off", None, None),
    ({"STRATA_VERIFY_DEFER_CPU": "yes"}, "off", None, "not 0, 1 or check; the deferral is off"),
    ({"STRATA_VERIFY_DEFER_CPU": "1"}, "defer", 0.1, "=0.1 (the default)"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": ""}, "defer", 0.1, "(the default)"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "0.3"}, "defer", 0.3, "weight >= 0.3"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "1"}, "defer", 1.0, "every CPU row joins late"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "4"}, "defer", 4.0, "every CPU row joins late"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "0"}, "defer", 0.1, "not a number above 0; 0.1"),
    ({"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "x"}, "defer", 0.1, "not a number above 0; 0.1"),
    ({"STRATA_VERIFY_DEFER_CPU": "check"}, "check", 0.1, "=check: bookkeeping only"),
    ({"STRATA_VERIFY_DEFER_CPU_BELOW": "0.2"}, "off", None, "ignored (STRATA_VERIFY_DEFER_CPU is off)"),
    ({"STRATA_VERIFY_DEFER_CPU": "0", "STRATA_VERIFY_DEFER_CPU_BELOW": "0.2"}, "off", None, "ignored"),
])
def test_values(env, mode, below, line):
    got, lines = parse(env)
    assert got.mode == mode
    if below is not None:
        assert got.below == below
    if line is None:
        assert lines == []
    else:
        assert sum(line in l for l in lines) == 1, lines


def test_no_cpu_rows_means_nothing_to_defer_and_the_option_overrides_the_environment():
    got, lines = parse({"STRATA_VERIFY_DEFER_CPU": "1"}, makes_cpu_rows=False)
    assert got == defer.OFF and "nothing to defer" in lines[-1]
    got, _ = parse({"STRATA_VERIFY_DEFER_CPU": "1"}, verify_defer_cpu="check", verify_defer_cpu_below="0.5")
    assert (got.mode, got.below) == ("check", 0.5)


# ---- the engine -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(20261131).integers(0, 256, size=17).tolist()


def all_cpu_engine(engine_factory, **switches):
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=0, pcie_frac=0.0,
                         cpu_threads=2, callback_timeout_s=2.0, **switches)
    eng.reconfigure(pcie_frac=0.0, cache_policy="lru")
    return eng


def deferred_reference(eng, tokens, window: int, below: float) -> np.ndarray:
    """Plain-jnp model of the rule, every entry on the CPU: each layer's rows of weight >= below join in the layer;
    the others (all of them when below >= 1) join after the next layer's mixer, before its FFN half; the last
    layer's all join in it."""
    cfg, w = eng.cfg, (unstack_layers(eng.weights) if eng.scanned else eng.weights)  # the scanned offload: stacked
    cache = init_cache(cfg, 64 + 8, jnp.float32)
    k_cache, v_cache = list(cache.k), list(cache.v)
    last = cfg.num_layers - 1
    # the experts live in pinned host memory: device copies for the reference
    experts = [[jnp.asarray(np.asarray(getattr(layer.ffn, n))) for n in ("gate", "up", "down")] for layer in w.layers]

    def one_window(w, experts, k_cache, v_cache, part, start):  # jitted below: op by op it was ~250 compiles
        valid = jnp.ones(part.shape, bool)
        h = w.embed[part]
        late = None
        for i, layer in enumerate(w.layers):
            a, k_cache[i], v_cache[i] = transformer.attention(transformer.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps),
                                                        layer.attn, k_cache[i], v_cache[i], start, cfg)
            h = h + a
            if late is not None:
                h, late = h + late, None
            x = transformer.rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
            r = moe.route(x, layer.ffn.router, cfg, valid)
            heavy = r.topk_weights >= below if below < 1 else jnp.zeros(r.topk_weights.shape, bool)
            rows = []
            for mask in (heavy, ~heavy):
                kept = jnp.where(mask, r.topk_weights, 0.0)
                combine = jnp.sum(jnp.where(r.topk_ids[:, :, None] == r.expert_ids[None, None, :],
                                            kept[:, :, None], 0.0), axis=1)
                ids = jnp.maximum(r.expert_ids, 0)
                gate, up, down = experts[i]
                rows.append(moe.expert_ffn(x, gate[ids], up[ids], down[ids], combine))
            if i == last:
                h = h + (rows[0] + rows[1])
            else:
                h, late = h + rows[0], rows[1]
        h = transformer.rms_norm(h, w.final_norm, cfg.rms_norm_eps)
        head = w.embed.T if w.lm_head is None else w.lm_head
        return h @ head, k_cache, v_cache

    step = jax.jit(one_window)  # one graph per window length (the window, and the last one's remainder)
    out = []
    with jax.default_matmul_precision("highest"):
        for start in range(0, len(tokens), window):
            logits, k_cache, v_cache = step(w, experts, k_cache, v_cache,
                                            jnp.asarray(tokens[start:start + window], jnp.int32), jnp.int32(start))
            out.append(np.asarray(logits, np.float32))
    return np.concatenate(out)


def test_check_equals_unset_up_to_summation_order(engine_factory, tokens):
    base = all_cpu_engine(engine_factory)
    check = all_cpu_engine(engine_factory, verify_defer_cpu="check", verify_defer_cpu_below="0.3")
    assert check.defer.mode == "check" and check.decode_expert_path.defers_native() == check.scanned_offload
    for w in (1, 4):
        assert rel_fro(check.score(tokens, window=w), base.score(tokens, window=w)) <= REL_TOL
    d = check.stats.last.decode_experts
    assert d.distinct_cpu == d.distinct > 0  # every expert ran on the pool


@pytest.mark.parametrize("pool_calls", ["auto", "callback"])
@pytest.mark.parametrize("below", ["1", "0.3"])
def test_defer_matches_the_rule(engine_factory, tokens, below, pool_calls):
    """Both forms of the deferral follow the rule: through the native calls in the scanned body (a layer's late job
    collected at the next layer's pre(l+1), the last one's before the final norm), and through io_callbacks in the
    unrolled graph (pool_calls=callback)."""
    eng = all_cpu_engine(engine_factory, verify_defer_cpu="1", verify_defer_cpu_below=below, pool_calls=pool_calls)
    native = eng.placement.pool.ffi_handle() is not None and pool_calls == "auto"
    assert eng.scanned_offload == native and eng.decode_expert_path.carries_late() == native
    base = all_cpu_engine(engine_factory)
    for w in (1, 4):
        got = eng.score(tokens, window=w)
        want = deferred_reference(eng, tokens, w, float(below))
        assert rel_fro(got, want) <= REL_TOL, (below, w)
        assert rel_fro(got, base.score(tokens, window=w)) > 1e-3  # the deferral does change the output


def test_split_rows_exist_on_both_sides_of_the_threshold(engine_factory, tokens):
    """The 0.3 case above is a real split: the tiny model's top-4 weights fall on both sides of 0.3."""
    eng = all_cpu_engine(engine_factory)
    cfg, w = eng.cfg, unstack_layers(eng.weights)  # the base engine (no deferral) scans: stacked weights
    x = w.embed[jnp.asarray(tokens)]
    r = moe.route(transformer.rms_norm(x, w.layers[0].ffn_norm, cfg.rms_norm_eps), w.layers[0].ffn.router, cfg,
                  jnp.ones((len(tokens),), bool))
    weights = np.asarray(r.topk_weights)
    assert (weights >= 0.3).any() and (weights < 0.3).any()


@pytest.mark.parametrize("phase", ["heavy", "light"])
def test_a_late_phase_is_one_error_naming_layer_and_phase(engine_factory, tokens, phase):
    # the io_callback deferral's split jobs (the Python pool's phases, where faults are injected)
    eng = all_cpu_engine(engine_factory, verify_defer_cpu="1", verify_defer_cpu_below="0.3", pool_calls="callback")
    want = eng.score(tokens, window=4)
    eng.reconfigure(pcie_frac=0.0)
    eng.generate(tokens[:6], 1, stop_token_ids=[])  # the prefill takes the exact path: no split job
    eng.placement.pool.inject_fault(1, "hang", phase=phase)
    with pytest.raises(StrataError) as info:
        eng.score(tokens, window=4)
    msg = str(info.value)
    assert "layer 1" in msg and f"{phase} rows did not arrive within 2.0 s" in msg and "\n" not in msg
    eng.reconfigure(pcie_frac=0.0)
    assert rel_fro(eng.score(tokens, window=4), want) <= REL_TOL  # usable again, same result


def test_a_window_without_cpu_entries_makes_no_callback(engine_factory, tokens):
    """Every expert resident (a full cache, filled): the deferring graph submits nothing to the pool (the exact
    prefill's FFI call meets no cpu expert and computes no job)."""
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=16, pcie_frac=0.5,
                         cpu_threads=2, callback_timeout_s=2.0, verify_defer_cpu="1")
    eng.reconfigure(pcie_frac=0.5, cache_policy="lru")
    every = jnp.arange(16, dtype=jnp.int32)
    eng.cache = eng.cache.replace(experts=slots_mod.fill_every_layer(eng.cache.experts, eng.weights.layers, every))
    eng.placement.pool.stats.reset()
    eng.score(tokens, window=4)
    assert eng.stats.last.decode_experts.distinct_resident > 0
    assert eng.placement.pool.stats.calls == 0 and eng.placement.pool.split_tickets() == []


@pytest.mark.parametrize("defer,kind,phase", [(False, "raise", None), (False, "hang", None),
                                              (True, "raise", "heavy"), (True, "raise", "light")])
def test_fault_injection_sweep(engine_factory, tokens, defer, kind, phase):
    """Each pool phase raising or hanging, plain jobs and deferred split jobs: one StrataError line naming the layer
    (and the phase), no hang, and the engine's next request gives the same tokens as before the fault."""
    opts = dict(verify_defer_cpu="1", verify_defer_cpu_below="0.3") if defer else {}
    eng = all_cpu_engine(engine_factory, pool_calls="callback", **opts)  # faults are injected into the Python pool
    eng.reconfigure(pcie_frac=0.0)
    want = eng.generate(tokens[:6], 5, stop_token_ids=[])
    eng.reconfigure(pcie_frac=0.0)
    if defer:  # the prefill takes the exact path: the fault must wait for a decode window's split job
        eng.generate(tokens[:6], 1, stop_token_ids=[])
    eng.placement.pool.inject_fault(1, kind, phase=phase)
    with pytest.raises(StrataError) as info:
        eng.score(tokens, window=4) if defer else eng.generate(tokens[:6], 5, stop_token_ids=[])
    msg = str(info.value)
    assert "layer 1" in msg and "\n" not in msg and (phase is None or phase in msg), msg
    eng.reconfigure(pcie_frac=0.0)
    assert eng.generate(tokens[:6], 5, stop_token_ids=[]) == want
