"""The q/k/v product's epilogue kernel (split sum, q/k RMSNorm, RoPE, K/V rows written in place; interpret mode on the
CPU) against its jnp reference (the XLA path's ops), the scanned model graph with it against without, its switch, and
its CUDA lowering."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.pallas_kernels import qkv_rope as qkv_rope_mod
from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.qkv_rope import qkv_rope, qkv_rope_reference

BF16_STEP = 2.0 ** -7  # one rounding step of the model dtype apart, relative, where XLA kept float32 in a fusion
# RoPE's x1 cos - x2 sin cancels: a step of each product (|x| <= ~4 here) is an absolute error of the difference
ROPE_ATOL = 4 * 4 * 2.0 ** -8


def inputs(rng, t, tp, splits, nq, nkv, d, layers, seq, dtype=jnp.bfloat16):
    n = (nq + 2 * nkv) * d
    partials = rng.standard_normal((splits, tp, n)).astype(np.float32) * 0.5
    partials[:, t:] = 0.0  # padding rows of x are zero: so are their products
    return dict(partials=jnp.asarray(partials),
                q_norm=jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), dtype),
                k_norm=jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), dtype),
                k_cache=jnp.asarray(rng.standard_normal((layers, seq, nkv, d)), dtype),
                v_cache=jnp.asarray(rng.standard_normal((layers, seq, nkv, d)), dtype))


@pytest.mark.parametrize("t,tp,splits,nq,nkv,d", [(1, 16, 4, 4, 2, 32), (3, 16, 2, 8, 2, 64), (4, 4, 1, 4, 1, 32)])
def test_kernel_matches_reference(t, tp, splits, nq, nkv, d):
    rng = np.random.default_rng()
    layers, seq = 3, 256
    a = inputs(rng, t, tp, splits, nq, nkv, d, layers, seq)
    layer, pos = jnp.int32(rng.integers(layers)), jnp.int32(rng.integers(seq - tp))
    kw = dict(t=t, num_heads=nq, num_kv_heads=nkv, eps=1e-6, theta=1e6)
    args = (a["partials"], a["q_norm"], a["k_norm"], pos)
    q, k_cache, v_cache = qkv_rope(*args, a["k_cache"], a["v_cache"], layer, interpret=True, **kw)
    want_q, want_k, want_v = qkv_rope_reference(*args, a["k_cache"], a["v_cache"], layer, **kw)
    assert q.shape == (tp, nq, d) and q.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(q[:t], np.float32), np.asarray(want_q, np.float32), rtol=BF16_STEP,
                               atol=ROPE_ATOL)
    np.testing.assert_allclose(np.asarray(k_cache, np.float32), np.asarray(want_k, np.float32), rtol=BF16_STEP,
                               atol=ROPE_ATOL)
    np.testing.assert_array_equal(np.asarray(v_cache), np.asarray(want_v))  # v: the sum, rounded, as it is
    # only the window's rows of its layer changed: every other row is the cache as it was
    changed = np.any(np.asarray(k_cache) != np.asarray(a["k_cache"]), axis=(2, 3))  # [L, S]
    rows = np.zeros_like(changed)
    rows[int(layer), int(pos):int(pos) + t] = True
    assert not (changed & ~rows).any()
    assert changed[int(layer), int(pos)]
    wrong = np.asarray(qkv_rope_reference(*args, a["k_cache"], a["v_cache"], layer, **{**kw, "theta": 1e4})[0])
    assert np.abs(wrong.astype(np.float32) - np.asarray(want_q, np.float32)).max() > 10 * ROPE_ATOL  # RoPE counts


def test_the_scanned_graph_with_it_matches_without(monkeypatch):
    """The tiny model's scanned decode window (stacked products in place, bf16) with the kernel switched on
    (qkv_rope.TUNING) against off: logits within bf16 rounding, greedy picks the same, the caches close."""
    from strata_jax.engine import graphs
    from strata_jax.model.config import preset
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import random_weights, stack_layers
    cfg = preset("tiny")
    weights = stack_layers(random_weights(cfg, seed=5, dtype=jnp.bfloat16, scale=0.05))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=2), jnp.int32)  # fixed: argmax
    out, calls = {}, []
    kernel = qkv_rope_mod.qkv_rope
    monkeypatch.setattr(qkv_rope_mod, "qkv_rope", lambda *a, **k: calls.append(k["t"]) or kernel(*a, **k))
    for fuse in (0, 1):
        monkeypatch.setitem(qkv_rope_mod.TUNING, "decode", {"fuse": fuse})
        cache = init_cache(cfg, 64, jnp.bfloat16, stacked=True)
        step = graphs.jit_decode_window(cfg, None, dense_kernel=True)
        _, logits, cache = step(weights, cache, tokens, jnp.int32(5))
        _, logits2, cache = step(weights, cache, tokens[::-1], jnp.int32(7))  # reads the rows the first wrote
        out[fuse] = (np.asarray(logits), np.asarray(logits2), np.asarray(cache.k, np.float32))
        assert len(calls) == fuse  # traced once (the scanned body, one window size), when switched on
    for i in range(2):
        a, b = out[1][i], out[0][i]
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    np.testing.assert_allclose(out[1][2], out[0][2], rtol=BF16_STEP, atol=ROPE_ATOL)


def test_the_switch_reads_a_tuning_file(tmp_path):
    from strata_jax.pallas_kernels import tuning
    path = tmp_path / "picks.json"
    path.write_text('{"picks": {"qkv_rope:decode": {"fuse": 1}}}')
    before = tuning.apply(tuning.read(str(path)))
    try:
        assert qkv_rope_mod.fused(1) and qkv_rope_mod.fused(16) and not qkv_rope_mod.fused(17)
    finally:
        tuning.restore(before)
    assert not qkv_rope_mod.fused(1)


@pytest.mark.parametrize("t,tp,splits", [(1, 16, 4), (2, 2, 1)])
def test_lowers_for_cuda(t, tp, splits):
    nq, nkv, d, layers, seq = 32, 4, 128, 2, 128
    spec = jax.ShapeDtypeStruct
    text = lower_for_cuda(functools.partial(qkv_rope, t=t, num_heads=nq, num_kv_heads=nkv, eps=1e-6, theta=1e6),
                          spec((splits, tp, (nq + 2 * nkv) * d), jnp.float32), spec((layers, d), jnp.bfloat16),
                          spec((layers, d), jnp.bfloat16), spec((), jnp.int32),
                          spec((layers, seq, nkv, d), jnp.bfloat16), spec((layers, seq, nkv, d), jnp.bfloat16),
                          spec((), jnp.int32))
    assert "qkv_rope" in text
