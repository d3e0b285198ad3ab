"""What only a GPU shows about the Pallas kernels: compiled (Triton, not interpret mode) against their jnp references
on realistic shapes, with fresh random inputs for each compiled shape. Skipped without a GPU.

Bounds, as the CPU tests of the same kernels (tests/kernels/test_route_prior.py, test_copy_rows.py, test_expert_ffn.py):
- route_prior: ids and changed equal, weights within 1e-6; route_topk: ids equal, weights within a bf16 step;
- copy_rows: within 1e-6 of the reference (relative), heavy + light within 1e-6 of the whole sum;
- expert_ffn: ||kernel - reference||_F / ||reference||_F < 1e-2 (bf16 roundings differ by an ulp here and there);
- decode_attention: 1e-5 (f32) / 2e-2 (bf16) relative, and rows past the window (NaN, inf, 1e30) never read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro, with_garbage
from strata_jax.pallas_kernels.copy_rows import copy_rows_by_weight, copy_rows_by_weight_reference, copy_rows_from_mapped, copy_rows_from_mapped_reference
from strata_jax.pallas_kernels.decode_attention import (batch_decode_attention, batch_decode_attention_reference,
                                                        decode_attention, decode_attention_reference)
from strata_jax.pallas_kernels.expert_ffn import expert_ffn, expert_ffn_reference
from strata_jax.pallas_kernels.route_prior import route_prior, route_prior_reference
from strata_jax.pallas_kernels.route_topk import route_topk, route_topk_reference
from strata_jax.pallas_kernels.qkv_rope import qkv_rope, qkv_rope_reference
from test_decode_attention import BATCH_CASES as ATTN_BATCH_CASES
from test_decode_attention import CASES as ATTN_CASES
from test_decode_attention import PREFILL_CASES as ATTN_PREFILL_CASES
from test_decode_attention import DTYPES as ATTN_DTYPES
from test_decode_attention import RTOL as ATTN_RTOL
from test_decode_attention import _batch_args, make_batch_case, make_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")]

DRAWS = 3  # fresh random inputs per compiled shape
EXPERT_FFN_RTOL = 1e-2  # tests/kernels/test_expert_ffn.py's REF_RTOL


# ------------------------------------------------------------------------------------------------------- route_prior

@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("t", [1, 4, 64])
@pytest.mark.parametrize("e,k", [(128, 8), (512, 10)])
def test_route_prior_matches_reference(e, k, t, keep):
    rng = np.random.default_rng(1000 * e + 10 * t + keep)
    kw = dict(k=k, keep=keep)
    for _ in range(DRAWS):
        logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)  # [T, E]
        resident = jnp.asarray(rng.random(e) < rng.uniform(0.1, 0.9))  # [E]: a random share resident
        lam = jnp.asarray(rng.random(t) * 2.0, jnp.float32)  # [T]: large enough to change routes
        ids, w, changed = route_prior(logits, resident, lam, interpret=False, **kw)
        want_ids, want_w, want_changed = route_prior_reference(logits, resident, lam, **kw)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(changed), np.asarray(want_changed))


# -------------------------------------------------------------------------------------------------------- route_topk

@pytest.mark.parametrize("t", [1, 4, 64])
@pytest.mark.parametrize("e,k", [(128, 8), (512, 10)])
def test_route_topk_matches_reference(e, k, t):
    """Compiled: the ids of XLA's softmax + top_k, the weights within a bf16 step (the two softmaxes' last bit)."""
    rng = np.random.default_rng()
    for _ in range(DRAWS):
        logits = jnp.asarray(rng.standard_normal((t, e)) * 2.0, jnp.float32)  # [T, E]
        valid = jnp.asarray(rng.random(t) < 0.8).at[0].set(True)  # [T]
        ids, w = route_topk(logits, valid, k=k, interpret=False)
        want_ids, want_w = route_topk_reference(logits, valid, k=k)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=2.0 ** -8, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------- qkv_rope

@pytest.mark.parametrize("t,tp,splits", [(1, 16, 4), (4, 16, 4), (16, 16, 4), (2, 2, 1)])
def test_qkv_rope_matches_reference(t, tp, splits):
    """Compiled at the 30B shape (32 q heads, 4 kv heads, D=128, a stacked cache of 4 layers): q and the written
    K rows within a bf16 step of the XLA path's ops (RoPE's difference of products: absolute), V rows equal."""
    rng = np.random.default_rng()
    nq, nkv, d, layers, seq = 32, 4, 128, 4, 256
    step, atol = 2.0 ** -7, 4 * 4 * 2.0 ** -8
    for _ in range(DRAWS):
        partials = rng.standard_normal((splits, tp, (nq + 2 * nkv) * d)).astype(np.float32) * 0.5
        partials[:, t:] = 0.0
        args = (jnp.asarray(partials), jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), jnp.bfloat16),
                jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), jnp.bfloat16), jnp.int32(rng.integers(seq - tp)))
        k0 = jnp.asarray(rng.standard_normal((layers, seq, nkv, d)), jnp.bfloat16)
        v0 = jnp.asarray(rng.standard_normal((layers, seq, nkv, d)), jnp.bfloat16)
        layer = jnp.int32(rng.integers(layers))
        kw = dict(t=t, num_heads=nq, num_kv_heads=nkv, eps=1e-6, theta=1e6)
        want = [np.asarray(a, np.float32) for a in qkv_rope_reference(*args, k0, v0, layer, **kw)]
        q, k, v = qkv_rope(*args, k0, v0, layer, interpret=False, **kw)
        np.testing.assert_allclose(np.asarray(q[:t], np.float32), want[0], rtol=step, atol=atol)
        np.testing.assert_allclose(np.asarray(k, np.float32), want[1], rtol=step, atol=atol)
        np.testing.assert_array_equal(np.asarray(v, np.float32), want[2])


# --------------------------------------------------------------------------------------------------------- copy_rows

def copy_rows_inputs(rng, t: int, k: int, h: int, dtype):
    """y [T, H] f32, mapped [T, K, H] dtype with NaN in the rows of non-CPU entries (undefined there), weights
    [T, K] top-K-like (positive, rows sum to 1), cpu mask [T, K] with at least one CPU entry per token."""
    y = rng.standard_normal((t, h)).astype(np.float32)
    mapped = rng.standard_normal((t, k, h)).astype(np.float32)
    w = rng.random((t, k)).astype(np.float32) + 0.01
    w /= w.sum(axis=1, keepdims=True)
    mask = rng.random((t, k)) < 0.5
    mask[:, 0] = True
    mapped[~mask] = np.nan
    return jnp.asarray(y), jnp.asarray(mapped, dtype), jnp.asarray(w), jnp.asarray(mask)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t", [1, 4])
def test_copy_rows_match_references(t, dtype):
    k, h = 8, 2048
    rng = np.random.default_rng(10 * t + (dtype == jnp.float32))
    thr = jnp.float32(1.0 / k)  # about half the weights on each side
    for _ in range(DRAWS):
        y, mapped, w, mask = copy_rows_inputs(rng, t, k, h, dtype)
        whole = copy_rows_from_mapped(y, mapped, w, mask, interpret=False)
        want = copy_rows_from_mapped_reference(y, mapped, w, mask)
        assert np.isfinite(np.asarray(whole)).all()  # the NaN rows were selected out, not multiplied by 0
        assert rel_fro(whole, want) <= 1e-6
        np.testing.assert_allclose(np.asarray(whole), np.asarray(want), rtol=1e-6, atol=1e-6)
        for heavy in (True, False):
            got = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=heavy, interpret=False)
            want = copy_rows_by_weight_reference(y, mapped, w, mask, thr, heavy=heavy)
            assert rel_fro(got, want) <= 1e-6
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        heavy = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=True, interpret=False)
        both = copy_rows_by_weight(heavy, mapped, w, mask, thr, heavy=False, interpret=False)
        assert rel_fro(both, whole) <= 1e-6


# -------------------------------------------------------------------------------------------------------- expert_ffn

QWEN3 = dict(h=2048, i=768, s=64, k=8)  # Qwen3-30B-A3B: hidden, expert intermediate; a 64-slot cache, top-8


@pytest.fixture(scope="module")
def qwen3_experts():
    """Random bf16 stacked experts gate, up [S, I, H], down [S, H, I] at the Qwen3 shape, made on the device."""
    h, i, s = QWEN3["h"], QWEN3["i"], QWEN3["s"]
    kg, ku, kd = jax.random.split(jax.random.key(0), 3)
    gate = (jax.random.normal(kg, (s, i, h), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (s, i, h), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (s, h, i), jnp.float32) / np.sqrt(i)).astype(jnp.bfloat16)
    return jax.block_until_ready((gate, up, down))


def expert_ffn_inputs(rng, t: int):
    """x [T, H] bf16, slot_ids [N] with N = min(T * K, S) (distinct slots but one repeated, the last one padding
    -1), combine [T, N]: each token K random columns with positive weights summing to 1, plus a nonzero weight on the
    padding column that the kernel must ignore."""
    h, s, k = QWEN3["h"], QWEN3["s"], QWEN3["k"]
    n = min(t * k, s)
    ids = rng.permutation(s)[:n].astype(np.int32)
    ids[-2] = ids[0]  # a repeated slot
    ids[-1] = -1  # a padding slot
    combine = np.zeros((t, n), np.float32)
    for j in range(t):
        cols = rng.choice(n, k, replace=False)
        w = rng.random(k) + 0.1
        combine[j, cols] = w / w.sum()
    combine[0, [0, n - 2]] += 0.2  # both copies of the repeated slot used
    combine[:, n - 1] = 0.3  # padding: ignored by kernel and reference alike
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    return x, jnp.asarray(ids), jnp.asarray(combine)


@pytest.mark.parametrize("t", [1, 4, 8])
def test_expert_ffn_matches_reference(qwen3_experts, t):
    gate, up, down = qwen3_experts
    rng = np.random.default_rng(100 + t)
    for _ in range(DRAWS):
        x, ids, combine = expert_ffn_inputs(rng, t)
        out = expert_ffn(x, gate, up, down, ids, combine, interpret=False)
        assert out.shape == x.shape and out.dtype == jnp.float32
        assert np.isfinite(np.asarray(out)).all()
        # The reference op by op, as the CPU test calls it (under one jit, XLA:CPU's fused bf16 einsums land ~2e-2
        # from a float64 model; op by op ~5e-3).
        assert rel_fro(out, expert_ffn_reference(x, gate, up, down, ids, combine)) < EXPERT_FFN_RTOL


# -------------------------------------------------------------------------------------------------- decode_attention

# The CPU test's cases (tests/kernels/test_decode_attention.py), compiled: its bounds, and garbage past the window unread.
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["t1_pos77", "t4_pos60", "t3_r4_s192", "qwen3_t1_s2112", "t4_to_the_end"])
def test_decode_attention_matches_reference(name, dtype):
    dtype = ATTN_DTYPES[dtype]
    t, nq, nkv, d, s, pos = ATTN_CASES[name]
    for draw in range(DRAWS):
        q, k, v, p = make_case(100 * draw + len(name), *ATTN_CASES[name], dtype)
        out = decode_attention(q, k, v, p, interpret=False)
        assert out.shape == q.shape and out.dtype == q.dtype
        with jax.default_matmul_precision("highest"):  # the reference's f32 einsums, not TF32
            ref = decode_attention_reference(q, k, v, p)
        assert rel_fro(out, ref) < ATTN_RTOL[dtype]
        if pos + t < s:
            kg, vg = with_garbage(k, pos + t, seed=draw + 1), with_garbage(v, pos + t, seed=draw + 2)
            np.testing.assert_array_equal(np.asarray(decode_attention(q, kg, vg, p, interpret=False)),
                                          np.asarray(out))


# Prefill chunks (row blocks, each reading up to its own last key), compiled, plus the Qwen3 shape at T=1024.
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", [*ATTN_PREFILL_CASES, "qwen3_t1024"])
def test_prefill_attention_matches_reference(name, dtype):
    dtype = ATTN_DTYPES[dtype]
    shape = (1024, 32, 4, 128, 4096 + 1024, 2000) if name == "qwen3_t1024" else ATTN_PREFILL_CASES[name]
    t, nq, nkv, d, s, pos = shape
    q, k, v, p = make_case(7 + len(name), *shape, dtype)
    out = decode_attention(q, k, v, p, interpret=False)
    with jax.default_matmul_precision("highest"):
        ref = decode_attention_reference(q, k, v, p)
    assert rel_fro(out, ref) < ATTN_RTOL[dtype]
    if pos + t < s:
        kg, vg = with_garbage(k, pos + t, seed=1), with_garbage(v, pos + t, seed=2)
        np.testing.assert_array_equal(np.asarray(decode_attention(q, kg, vg, p, interpret=False)), np.asarray(out))


# Batched windows (issue 38): B rows, each over its own cache row up to its own position, in one compiled kernel;
# the CPU test's cases plus B = 8 at the Qwen3 shape over a 48-layer x 8-slot batch cache's rows.
@pytest.mark.parametrize("kv", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("name", [*ATTN_BATCH_CASES, "qwen3_b8"])
def test_batch_decode_attention_matches_reference(name, kv):
    dtype = jnp.bfloat16 if kv == "bf16" else jnp.float32
    case = ((8, 32, 4, 128, 16, 2112, (9, 0, 15, 3, 4, 12, 6, 1), (0, 2111, 1000, 63, 64, 500, 2047, 7))
            if name == "qwen3_b8" else ATTN_BATCH_CASES[name])
    for draw in range(DRAWS):
        q, k, v, kg, vg, rows, pos = make_batch_case(100 * draw + len(name), *case, dtype, int8=kv == "int8")
        (kc, vc), scales = _batch_args(k, v)
        out = batch_decode_attention(q, kc, vc, rows, pos, **scales, interpret=False)
        assert out.shape == q.shape and out.dtype == q.dtype
        with jax.default_matmul_precision("highest"):
            ref = batch_decode_attention_reference(q, kc, vc, rows, pos, **scales)
        assert rel_fro(out, ref) < ATTN_RTOL[dtype]
        (kgc, vgc), garbage_scales = _batch_args(kg, vg)
        np.testing.assert_array_equal(
            np.asarray(batch_decode_attention(q, kgc, vgc, rows, pos, **garbage_scales, interpret=False)),
            np.asarray(out))


# ---------------------------------------------------------------------------------------------------- stacked_linear

@pytest.mark.parametrize("t", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_stacked_linear_compiled(t, dtype):
    """The q/k/v launch and the o launch at the Qwen3-30B-A3B shapes (8 stacked layers), compiled, against the
    sliced XLA product; the other layers are NaN so a wrong offset shows. bf16: f32 accumulation both sides."""
    from strata_jax.pallas_kernels.stacked_linear import stacked_linear, stacked_linear_reference
    rng = np.random.default_rng(t)
    n_layers, layer, h = 8, 5, 2048
    for k, ns in ((h, (4096, 512, 512)), (4096, (h,))):
        x = jnp.asarray(rng.standard_normal((t, k)), dtype)
        ws = tuple(jnp.asarray(np.where(np.arange(n_layers)[:, None, None] == layer,
                                        rng.standard_normal((n_layers, k, n)) / np.sqrt(k), np.nan), dtype)
                   for n in ns)
        got = stacked_linear(x, ws, jnp.int32(layer))
        assert np.isfinite(np.asarray(got)).all()
        want = stacked_linear_reference(x, ws, jnp.int32(layer))
        assert rel_fro(got, want) < (1e-5 if dtype == jnp.float32 else 1e-3)


@pytest.mark.parametrize("t", [1, 4])
def test_stacked_linear_folds_compiled(t):
    """The folds (the input RMSNorm in the q/k/v launch, a one-token row put in the tile), compiled at the 30B shape:
    against rms_norm then the sliced XLA product, within the bf16 step the two norms' sums may round apart."""
    from strata_jax.model.transformer import rms_norm
    from strata_jax.pallas_kernels.stacked_linear import stacked_linear, stacked_linear_reference
    rng = np.random.default_rng()
    n_layers, layer, h = 8, 3, 2048
    x = jnp.asarray(rng.standard_normal((t, h)) * 3.0, jnp.bfloat16)
    ws = tuple(jnp.asarray(np.where(np.arange(n_layers)[:, None, None] == layer,
                                    rng.standard_normal((n_layers, h, n)) / np.sqrt(h), np.nan), jnp.bfloat16)
               for n in (4096, 512, 512))
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal((n_layers, h)), jnp.bfloat16)
    got = stacked_linear(x, ws, jnp.int32(layer), norm=norm, eps=1e-6, row_in_kernel=True, reduce="dot")
    assert np.isfinite(np.asarray(got)).all()
    want = stacked_linear_reference(rms_norm(x, norm[layer], 1e-6), ws, jnp.int32(layer))
    assert rel_fro(got, want) < 1e-2


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("reduce", ["sum", "acc"])
def test_the_gemv_reductions_compiled(qwen3_experts, t, reduce):
    """reduce="sum" and "acc" (T <= 4: no 16-row tl.dot), compiled at the Qwen3-30B-A3B shapes: the expert FFN and
    the q/k/v and o launches against their references (the stacks' other layers NaN)."""
    from strata_jax.pallas_kernels.stacked_linear import stacked_linear, stacked_linear_reference
    gate, up, down = qwen3_experts
    rng = np.random.default_rng(200 + t)
    x, ids, combine = expert_ffn_inputs(rng, t)
    out = expert_ffn(x, gate, up, down, ids, combine, reduce=reduce)
    assert rel_fro(out, expert_ffn_reference(x, gate, up, down, ids, combine)) < EXPERT_FFN_RTOL
    n_layers, layer, h = 4, 2, 2048
    for k, ns in ((h, (4096, 512, 512)), (4096, (h,))):
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        ws = tuple(jnp.asarray(np.where(np.arange(n_layers)[:, None, None] == layer,
                                        rng.standard_normal((n_layers, k, n)) / np.sqrt(k), np.nan), jnp.bfloat16)
                   for n in ns)
        got = stacked_linear(x, ws, jnp.int32(layer), reduce=reduce)
        assert np.isfinite(np.asarray(got)).all()
        assert rel_fro(got, stacked_linear_reference(x, ws, jnp.int32(layer))) < 1e-3
