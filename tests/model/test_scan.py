"""layer_loop=scan: the layers as one scanned body over weights stacked on a layer axis (the default with every
expert resident). The same logits as the unrolled graph (float32: summation order only, 1e-5) in every window size,
in bf16 too, with the Pallas attention and attention-product kernels (interpret mode here) too. Placement independence of the
scanned engine against offloaded ones (which keep the unrolled graph) is test_offload's: its reference is the
scanned all-resident engine. A model that mixes dense and MoE layers falls back to unrolled."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.model.weights import can_stack, random_weights, stack_layers, unstack_layers
from strata_jax.model.config import preset
from strata_jax.engine.api import Engine
from strata_jax.options import EngineOptions, build


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(123).integers(0, 256, size=21).tolist()


@pytest.fixture(scope="module")
def unrolled(engine_factory):
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all",
                          layer_loop="unrolled")


@pytest.mark.parametrize("kernels", [{}, dict(attention_kernel="pallas", dense_kernel="pallas")])
def test_scanned_matches_unrolled(engine_factory, unrolled, tokens, kernels):
    """The unrolled reference keeps XLA's kernels: the Pallas ones (interpret mode) are checked against XLA too."""
    scanned = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all", **kernels)
    assert scanned.scanned and scanned.weights.stacked and scanned.cache.k.ndim == 4
    assert not unrolled.scanned and isinstance(unrolled.cache.k, list)
    for w in ((1, 3, 4) if not kernels else (1, 4)):
        assert rel_fro(scanned.score(tokens, window=w), unrolled.score(tokens, window=w)) <= 1e-5
    assert scanned.generate(tokens[:7], 9, stop_token_ids=[]) == unrolled.generate(tokens[:7], 9, stop_token_ids=[])


def test_scanned_matches_unrolled_in_bf16(engine_factory, tokens):
    """bf16: both graphs round at the points the model code names (graphs.MODEL_COMPILER_OPTIONS turns XLA's excess
    precision off), so fusing one layer body or L of them gives the same logits; 7e-3 apart before (CPU, 0 now)."""
    opts = dict(dtype="bfloat16", window=4, context=64, expert_cache_slots="all")
    scanned, unrolled_bf16 = engine_factory(None, **opts), engine_factory(None, layer_loop="unrolled", **opts)
    assert scanned.scanned and not unrolled_bf16.scanned
    assert rel_fro(scanned.score(tokens, window=4), unrolled_bf16.score(tokens, window=4)) <= 1e-5


def test_the_unrolled_graph_runs_the_same_product_kernel(engine_factory, tokens):
    """dense_kernel=pallas in the unrolled graph (offload's) runs stacked_linear over a stack of one layer: the same
    kernel, the same sums as the scanned graph's, so the two agree to the bit (3.4e-3 apart in bf16 on the H200 when
    the unrolled graph used XLA's products; benchmarks/rounding_check.py: 0 now). float32 on a GPU: XLA's attention
    einsums over a stacked and a per-layer cache may sum in another order (4e-7)."""
    opts = dict(dtype="float32", window=4, context=64, expert_cache_slots="all", dense_kernel="pallas")
    scanned, unrolled_k = engine_factory(None, **opts), engine_factory(None, layer_loop="unrolled", **opts)
    a, b = scanned.score(tokens[:9], window=4), unrolled_k.score(tokens[:9], window=4)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(a, b)
    assert rel_fro(a, b) <= 1e-6


def test_stack_and_unstack_round_trip():
    cfg = preset("tiny")
    w = random_weights(cfg, 3, jnp.float32)
    s = stack_layers(w)
    assert s.stacked and jax.tree.leaves(s.layers)[0].shape[0] == cfg.num_layers
    back = unstack_layers(s)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stacked_random_weights_are_random_and_stacked():
    cfg = preset("tiny")
    w = random_weights(cfg, 0, jnp.float32, stacked=True)
    assert w.stacked
    gate = np.asarray(w.layers.ffn.gate)  # [L, E, I, H]
    assert gate.shape[0] == cfg.num_layers and np.std(gate) > 0.01
    assert not np.allclose(gate[0], gate[1])  # each layer its own draw
    np.testing.assert_array_equal(np.asarray(w.layers.attn_norm), 1.0)


def test_mixed_layers_fall_back_to_unrolled(tokens):
    """mlp_only_layers: dense and MoE layers cannot share one body; the engine unrolls and still decodes."""
    cfg = preset("tiny")
    cfg = cfg.replace(sparse_layers=(False,) + tuple(cfg.sparse_layers[1:]))
    assert not can_stack(cfg)
    opts = build(EngineOptions, dict(dtype="float32", window=2, context=64, expert_cache_slots="all"))
    eng = Engine(cfg, random_weights(cfg, 0, jnp.float32), opts, verbose=False)
    assert not eng.scanned
    assert len(eng.generate(tokens[:5], 4, stop_token_ids=[])) == 4
