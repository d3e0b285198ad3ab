"""What only a GPU shows: experts in pinned host memory, the in-graph PCIe fetch and the io_callback pool on a real
device stream, with the same exactness as on the CPU (float32, ||a-b||_F/||b||_F <= 1e-5; the engine runs float32
matmuls at full precision, not TF32). Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import rel_fro
from strata_jax import StrataError
from strata_jax.model.weights import unstack_layers
from strata_jax.offload.slots import layer_states

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, 256, size=27).tolist()


def test_experts_live_in_pinned_host_memory(engine_factory):
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0)
    assert eng.placement.host_kind == "pinned_host"
    layers = unstack_layers(eng.weights).layers
    ffn = layers[0].ffn
    assert {a.sharding.memory_kind for a in (ffn.gate, ffn.up, ffn.down)} == {"pinned_host"}
    assert layer_states(eng.cache.experts)[0].gate.sharding.memory_kind == "device"


@pytest.mark.parametrize("pool_calls", ["auto", "layer"])
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_offload_is_exact_on_gpu(engine_factory, tokens, frac, pool_calls):
    """pool_calls=auto: the native offload calls (copies on their own stream into victim slots, or staging rows
    under static; the pool started by stream flags); layer: the graph's fetch loops and one FFI pool call."""
    ref = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all")
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0,
                         pool_calls=pool_calls)
    assert eng.placement.native == (pool_calls == "auto")
    assert eng.scanned_offload == (pool_calls == "auto")  # the native calls: decode windows in one scanned body
    for policy in ("lru", "static"):
        eng.reconfigure(pcie_frac=frac, cache_policy=policy)
        for w in (1, 4):
            assert rel_fro(eng.score(tokens, window=w), ref.score(tokens, window=w)) <= 1e-5, policy
        assert eng.generate(tokens[:9], 10, stop_token_ids=[]) == ref.generate(tokens[:9], 10, stop_token_ids=[])
        d = eng.stats.last.decode_experts
        assert d.entries == d.entries_resident + d.entries_fetched + d.entries_cpu > 0
    if pool_calls == "auto" and frac > 0:  # the fetches ran as the device kernel on the graph's stream
        assert eng.placement.pool.fetch_mode() == "kernel"
    if pool_calls == "auto" and frac < 1:  # by default the pool's jobs posted by a copy and a stream flag write
        assert eng.placement.pool.signal_mode().startswith("memops: the default")


def test_prefill_chunks_in_blocks_of_experts_are_exact_on_gpu(engine_factory):
    """The reference model (64 experts top-8): a prefill chunk's 64 distinct experts run in two blocks of native
    calls (a begin and a collect each, the fetch kernel on the stream) in the scanned body; the prompt's logits and
    the greedy tokens are all resident's under lru and static, with both halves of the split."""
    rng = np.random.default_rng(20261205)
    prompt = rng.integers(0, 256, size=80).tolist()
    kw = dict(dtype="float32", window=4, context=256, prefill_chunk=64)
    ref = engine_factory("reference", expert_cache_slots="all", **kw)
    want_logits, want_tokens = ref.prefill_logits(prompt), ref.generate(prompt[:70], 8, stop_token_ids=[])
    eng = engine_factory("reference", expert_cache_slots=12, pcie_frac=0.5, **kw)
    assert eng.scanned_offload
    for policy in ("lru", "static"):
        eng.reconfigure(pcie_frac=0.5, cache_policy=policy)
        assert rel_fro(eng.prefill_logits(prompt), want_logits) <= 1e-5, policy
        assert eng.generate(prompt[:70], 8, stop_token_ids=[]) == want_tokens, policy
        p = eng.stats.last.prefill_experts
        assert p.distinct_fetched > 0 and p.distinct_cpu > 0, policy
    assert eng.placement.pool.fetch_mode() == "kernel"


@pytest.mark.parametrize("switch, value, mode, context, want", [
    ("STRATA_OFFLOAD_FETCH", "worker", "fetch_mode", 64, "worker: STRATA_OFFLOAD_FETCH=worker"),
    ("STRATA_OFFLOAD_SIGNAL", "kernel", "signal_mode", 72, "kernel")])
def test_the_native_calls_other_ways_are_exact_on_gpu(engine_factory, tokens, monkeypatch, switch, value, mode,
                                                      context, want):
    """The native calls' other ways, each read once per pool (so an engine of its own: the context): the fetches by
    the worker's copies (STRATA_OFFLOAD_FETCH=worker, the way before the fetch kernel), and the pool's jobs posted
    and collected by the signal kernels (STRATA_OFFLOAD_SIGNAL=kernel, opt-in); the same logits and tokens."""
    monkeypatch.setenv(switch, value)
    ref = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all")
    eng = engine_factory(None, dtype="float32", window=4, context=context, expert_cache_slots=5, pcie_frac=0.5)
    for policy in ("lru", "static"):
        eng.reconfigure(pcie_frac=0.5, cache_policy=policy)
        for w in (1, 4):
            assert rel_fro(eng.score(tokens, window=w), ref.score(tokens, window=w)) <= 1e-5, policy
        assert eng.generate(tokens[:9], 10, stop_token_ids=[]) == ref.generate(tokens[:9], 10, stop_token_ids=[])
    assert getattr(eng.placement.pool, mode)() == want


def test_pool_failure_on_gpu_is_one_line_and_recovers(engine_factory, tokens):
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=0, pcie_frac=0.0,
                         callback_timeout_s=2.0, pool_calls="callback")  # faults: the Python pool
    expected = eng.generate(tokens[:9], 8, stop_token_ids=[])
    eng.placement.pool.inject_fault(2, "raise")
    with pytest.raises(StrataError, match="layer 2"):
        eng.generate(tokens[:9], 8, stop_token_ids=[])
    assert eng.generate(tokens[:9], 8, stop_token_ids=[]) == expected


@pytest.mark.parametrize("slots", ["all", "5"])
def test_the_pallas_expert_kernel_in_the_engine(engine_factory, tokens, slots):
    """expert_kernel=pallas (bf16): the decode windows' logits within bf16 rounding of the XLA path, all experts
    resident and offloaded (resident and fetched experts read in their slots)."""
    common = dict(dtype="bfloat16", window=4, context=64, expert_cache_slots=slots, pcie_frac=1.0)
    xla = engine_factory(None, expert_kernel="xla", attention_kernel="xla", **common)
    pallas = engine_factory(None, expert_kernel="pallas", attention_kernel="xla", **common)
    for policy in ("lru", "static") if slots != "all" else ("lru",):  # static: fetched experts in staging rows
        if slots != "all":
            xla.reconfigure(cache_policy=policy)
            pallas.reconfigure(cache_policy=policy)
        want, got = xla.score(tokens, window=4), pallas.score(tokens, window=4)
        assert rel_fro(got, want) < 3e-2, policy
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.8, policy


@pytest.mark.parametrize("slots", ["all", "5"])
def test_the_route_kernel_in_the_engine(engine_factory, tokens, slots):
    """route_kernel=pallas (softmax and top-K in one kernel) against XLA's softmax and sort, the Pallas expert FFN in
    both, all resident and offloaded: the decode windows' logits within the last bits of the routing weights (the
    same experts; a weight's bf16 rounding one step apart at most), greedy picks mostly the same."""
    common = dict(dtype="bfloat16", window=4, context=64, expert_cache_slots=slots, pcie_frac=1.0,
                  expert_kernel="pallas", attention_kernel="xla")
    xla = engine_factory(None, route_kernel="xla", **common)
    pallas = engine_factory(None, route_kernel="pallas", **common)
    assert pallas.plan.route_kernel == "pallas" and xla.plan.route_kernel == "xla"
    want, got = xla.score(tokens, window=4), pallas.score(tokens, window=4)
    assert rel_fro(got, want) < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_the_pallas_attention_kernel_in_the_engine(engine_factory, tokens, dtype, bound):
    """attention_kernel=pallas, compiled: every decode window's logits against the XLA attention (offloaded, so the
    kernel runs beside the fetches), within f32 / bf16 rounding; greedy tokens mostly the same."""
    common = dict(dtype=dtype, window=4, context=64, expert_cache_slots="5", pcie_frac=1.0)
    xla = engine_factory(None, expert_kernel="xla", attention_kernel="xla", **common).score(tokens, window=4)
    pallas = engine_factory(None, expert_kernel="xla", attention_kernel="pallas", **common).score(tokens, window=4)
    assert rel_fro(pallas, xla) < bound
    assert (pallas.argmax(-1) == xla.argmax(-1)).mean() > 0.8


def test_the_pallas_expert_kernel_is_refused_off_bfloat16(engine_factory):
    with pytest.raises(StrataError, match="bfloat16"):
        engine_factory(None, dtype="float32", window=2, context=64, expert_cache_slots="all", expert_kernel="pallas")


@pytest.mark.parametrize("dtype,kernels,bound", [
    ("float32", {}, 1e-5),
    ("bfloat16", {}, 3e-2),
    ("bfloat16", dict(dense_kernel="pallas"), 3e-2),
    ("bfloat16", dict(expert_kernel="pallas", attention_kernel="pallas", dense_kernel="pallas"), 3e-2)])
def test_the_scanned_layers_on_gpu(engine_factory, tokens, dtype, kernels, bound):
    """layer_loop=scan (stacked weights, one layer body), compiled for the GPU, with and without both kernels:
    every decode window's logits against the unrolled XLA graph (float32: summation order only), greedy the same."""
    common = dict(dtype=dtype, window=4, context=64, expert_cache_slots="all")
    unrolled = engine_factory(None, layer_loop="unrolled", expert_kernel="xla", attention_kernel="xla", **common)
    scanned = engine_factory(None, layer_loop="scan", **{"expert_kernel": "xla", "attention_kernel": "xla",
                                                          "dense_kernel": "xla", **kernels}, **common)
    assert scanned.scanned and not unrolled.scanned
    for w in (1, 4):
        a, b = scanned.score(tokens, window=w), unrolled.score(tokens, window=w)
        assert rel_fro(a, b) < bound
        assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8
    assert scanned.generate(tokens[:9], 10, stop_token_ids=[]) == scanned.generate(tokens[:9], 10, stop_token_ids=[])
