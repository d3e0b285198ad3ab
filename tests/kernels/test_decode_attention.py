"""pallas_kernels.decode_attention: the kernel in interpret mode against its reference (with garbage past the window
proving those rows are never read), the reference against transformer.attention, and the CUDA lowering at the Qwen3-30B-A3B
and tiny shapes; for decode windows (one tile per kv head) and prefill chunks (row blocks, each reading the cache
only up to its own last token's position).

Bounds (Frobenius, ||kernel - ref|| / ||ref||):
- float32: 1e-5. The kernel divides by the row sum at the end and sums the splits in another order than the
  reference's softmax; both stay in f32, measured <= ~1.3e-6.
- bfloat16: 2e-2. The kernel rounds the unnormalised exp(score - running max) to bf16 before p @ v, the reference
  the normalised probabilities: single bf16 roundings apart, measured ~3e-3.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro, with_garbage
from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.decode_attention import (_block_k, batch_decode_attention, batch_decode_attention_reference,
                                                        decode_attention, decode_attention_reference)

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

CASES = {  # (T, Nq, Nkv, D, S, pos)
    "t1_pos0": (1, 4, 2, 32, 128, 0),  # one visible key
    "t1_pos77": (1, 4, 2, 32, 128, 77),  # the last block half filled: its tail rows are masked loads
    "t4_pos60": (4, 4, 2, 32, 128, 60),  # the window straddles the block boundary at 64
    "t3_r4_s192": (3, 8, 2, 32, 192, 150),  # r = 4, S = 3 * 64
    "qwen3_t1_s2112": (1, 32, 4, 128, 2112, 1000),  # the Qwen3-30B-A3B attention shape, S = 2048 + 64
    "t4_to_the_end": (4, 8, 2, 32, 128, 124),  # the window's last row is the cache's last row
}


def make_case(seed: int, t: int, nq: int, nkv: int, d: int, s: int, pos: int, dtype):
    """Random q [T, Nq, D] and caches [S, Nkv, D] (every row filled with unit-scale values)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, nq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((s, nkv, d)) * 2.0, dtype)  # peaky enough that the softmax is not flat
    v = jnp.asarray(rng.standard_normal((s, nkv, d)), dtype)
    return q, k, v, jnp.int32(pos)


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("name", CASES.keys())
def test_kernel_matches_reference(name, dtype):
    dtype = DTYPES[dtype]
    t, nq, nkv, d, s, pos = CASES[name]
    q, k, v, p = make_case(len(name), *CASES[name], dtype)
    out = decode_attention(q, k, v, p, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_attention_reference(q, k, v, p)
    assert rel_fro(out, ref) < RTOL[dtype]

    # Garbage (huge, NaN, inf) in every row past the window's last position: the same output, bit for bit.
    if pos + t < s:
        kg, vg = with_garbage(k, pos + t, seed=1), with_garbage(v, pos + t, seed=2)
        garbage_out = np.asarray(decode_attention(q, kg, vg, p, interpret=True))
        assert np.isfinite(garbage_out.astype(np.float32)).all()
        np.testing.assert_array_equal(garbage_out, np.asarray(out))


def make_int8_case(seed: int, t: int, nq: int, nkv: int, d: int, s: int, pos: int, dtype):
    """Random q [T, Nq, D] (dtype) and int8 caches [S, Nkv, D] with their float32 scales [S, Nkv], quantized from
    fresh random rows (strata_jax.model.quantize_kv: kv_dtype=int8)."""
    from strata_jax.model.kv_cache import quantize_kv
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, nq, d)), dtype)
    k = quantize_kv(jnp.asarray(rng.standard_normal((s, nkv, d)) * 2.0 * rng.uniform(0.2, 3, (s, nkv, 1)),
                                jnp.float32))  # row scales that differ by position and head
    v = quantize_kv(jnp.asarray(rng.standard_normal((s, nkv, d)) * rng.uniform(0.2, 3, (s, nkv, 1)), jnp.float32))
    return q, k, v, jnp.int32(pos)


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("name", ["t1_pos0", "t1_pos77", "t4_pos60", "t3_r4_s192", "t4_to_the_end"])
def test_int8_cache_kernel_matches_reference(name, dtype):
    """kv_dtype=int8: the kernel reads the int8 rows and their scales in place; the same bounds as the float
    caches against the reference's int8 arithmetic. Rows past the window: random int8 and NaN / inf scales, never
    read (the same output, bit for bit)."""
    dtype = DTYPES[dtype]
    t, nq, nkv, d, s, pos = CASES[name]
    q, k, v, p = make_int8_case(len(name) + 100, *CASES[name], dtype)
    out = decode_attention(q, k.q, v.q, p, k_scale=k.scale, v_scale=v.scale, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_attention_reference(q, k.q, v.q, p, k.scale, v.scale)
    assert rel_fro(out, ref) < RTOL[dtype]
    if pos + t < s:
        rng = np.random.default_rng(5)
        bad_q = lambda c: c.q.at[pos + t:].set(jnp.asarray(rng.integers(-128, 128, c.q[pos + t:].shape), jnp.int8))
        bad_s = lambda c: with_garbage(c.scale[..., None], pos + t, seed=6)[..., 0]
        garbage = decode_attention(q, bad_q(k), bad_q(v), p, k_scale=bad_s(k), v_scale=bad_s(v), interpret=True)
        np.testing.assert_array_equal(np.asarray(garbage), np.asarray(out))


def test_int8_stacked_cache_reads_its_layer_only():
    t, nq, nkv, d, s, pos = 4, 8, 2, 32, 128, 70
    q, k, v, p = make_int8_case(9, t, nq, nkv, d, s, pos, jnp.float32)
    stack = lambda c, seed: (jnp.stack([c.q] * 3).at[1].set(-c.q),  # other layers: other rows, NaN scales
                             with_garbage(jnp.stack([c.scale] * 3)[..., None], 0, seed)[..., 0].at[2].set(c.scale))
    (kq, ks), (vq, vs) = stack(k, 1), stack(v, 2)
    out = jax.jit(lambda q, kq, vq, p, i, ks, vs: decode_attention(q, kq, vq, p, i, ks, vs, interpret=True))(
        q, kq, vq, p, jnp.int32(2), ks, vs)
    assert rel_fro(out, decode_attention_reference(q, k.q, v.q, p, k.scale, v.scale)) < RTOL[jnp.float32]


@pytest.mark.parametrize("tuning", [dict(block_k=16, k_splits=1), dict(block_k=16, k_splits=5),
                                    dict(block_k=32, k_splits=8), dict(block_k=256, k_splits=2)])
def test_blocks_and_splits(tuning):
    """Several blocks per split, several splits (ragged last one, some entirely past the window), block_k larger
    than any divisor of S (192 -> 64): the same result within f32 rounding, garbage still unread."""
    t, nq, nkv, d, s, pos = CASES["t3_r4_s192"]
    q, k, v, p = make_case(7, t, nq, nkv, d, s, pos, jnp.float32)
    kg, vg = with_garbage(k, pos + t, seed=3), with_garbage(v, pos + t, seed=4)
    out = decode_attention(q, kg, vg, p, interpret=True, **tuning)
    assert rel_fro(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


def test_block_choice_and_unsupported_shapes():
    assert _block_k(2112, 64) == 64 and _block_k(2112, 256) == 64  # 2112 = 64 * 33
    assert _block_k(128, 64) == 64 and _block_k(192, 128) == 64 and _block_k(48, 64) == 16
    assert _block_k(100 * 16, 100) == 64  # a requested size that is not a power of 2 rounds down
    q, k, v, p = make_case(8, 1, 4, 2, 32, 200, 3, jnp.float32)  # 200 = 8 * 25: no block of >= 16 divides it
    with pytest.raises(ValueError, match="S=200 must be a multiple of 16"):
        decode_attention(q, k, v, p, interpret=True)
    q, k, v, p = make_case(8, 1, 4, 2, 24, 128, 3, jnp.float32)
    with pytest.raises(ValueError, match="D=24 must be a power of 2"):
        decode_attention(q, k, v, p, interpret=True)
    q, k, v, p = make_case(8, 1, 6, 4, 32, 128, 3, jnp.float32)
    with pytest.raises(ValueError, match="not a multiple of Nkv"):
        decode_attention(q, k, v, p, interpret=True)


@pytest.mark.parametrize("dtype", DTYPES.keys())
def test_reference_is_model_attention(dtype):
    """transformer.attention on the tiny config with wo = identity (Nq * D == H there) returns the attention output before
    the projection: the reference, fed the q and the updated caches that transformer.attention builds, equals it exactly;
    the kernel matches it within its bound."""
    from strata_jax.model import transformer
    from strata_jax.model.weights import AttentionWeights
    from strata_jax.model.config import preset
    dtype = DTYPES[dtype]
    cfg = preset("tiny")
    t, s, pos = 4, 128, 37
    nq, nkv, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    assert nq * d == h
    rng = np.random.default_rng(11)
    rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.2, dtype)
    w = AttentionWeights(wq=rnd(h, nq * d), wk=rnd(h, nkv * d), wv=rnd(h, nkv * d), wo=jnp.eye(h, dtype=dtype),
                               q_norm=jnp.asarray(1 + rng.random(d) * 0.1, dtype),
                               k_norm=jnp.asarray(1 + rng.random(d) * 0.1, dtype))
    x = rnd(t, h)
    k_cache, v_cache = rnd(s, nkv, d), rnd(s, nkv, d)
    p = jnp.int32(pos)

    def q_of(x):  # transformer.attention's q, step by step
        q = transformer.rms_norm((x @ w.wq).reshape(t, nq, d), w.q_norm, cfg.rms_norm_eps)
        return transformer.rope(q, p + jnp.arange(t, dtype=jnp.int32), cfg.rope_theta)

    with jax.disable_jit():  # op by op, so no fusion decision can differ between the two programs
        got, kc, vc = transformer.attention(x, w, k_cache, v_cache, p, cfg)
        q = q_of(x)
        ref = decode_attention_reference(q, kc, vc, p).reshape(t, nq * d)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(got, np.float32))
    assert rel_fro(decode_attention(q, kc, vc, p, interpret=True).reshape(t, nq * d), got) < RTOL[dtype]


@pytest.mark.parametrize("kv", ["bf16", "int8"])
@pytest.mark.parametrize("t, nq, nkv, d, s", [(1, 32, 4, 128, 2112), (4, 32, 4, 128, 2112), (1, 4, 2, 32, 128)])
def test_lowers_for_cuda(t, nq, nkv, d, s, kv):
    spec = jax.ShapeDtypeStruct
    if kv == "int8":  # kv_dtype=int8: int8 caches and their float32 [S, Nkv] scales
        text = lower_for_cuda(lambda q, kc, vc, p, ks, vs: decode_attention(q, kc, vc, p, k_scale=ks, v_scale=vs),
                              spec((t, nq, d), jnp.bfloat16), spec((s, nkv, d), jnp.int8), spec((s, nkv, d), jnp.int8),
                              spec((), jnp.int32), spec((s, nkv), jnp.float32), spec((s, nkv), jnp.float32))
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2, %arg4, %arg5\)", text)  # all in place
    else:
        text = lower_for_cuda(decode_attention, spec((t, nq, d), jnp.bfloat16), spec((s, nkv, d), jnp.bfloat16),
                              spec((s, nkv, d), jnp.bfloat16), spec((), jnp.int32))
        # The caches go straight from the arguments into the kernel: no transpose, no copy of the cache.
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2\)", text)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f"x{s}x" not in text  # no [.., S, ..] array other than the [S, Nkv, D] arguments


def test_the_engine_with_the_kernel_matches_the_xla_path(engine_factory):
    """attention_kernel=pallas (interpret mode here) in every decode window of the tiny model, float32: the same
    logits as the XLA einsums up to float summation order (1e-5 relative), windows of 1 and 4, offload on. 24
    tokens: whole windows of 4 (23 ran a last window of 3, one more interpreted-kernel graph per engine)."""
    tokens = np.random.default_rng(41).integers(0, 256, size=24).tolist()
    common = dict(dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0, cpu_threads=2)
    xla = engine_factory(None, **common)
    pallas = engine_factory(None, attention_kernel="pallas", **common)
    assert pallas.cache.length % 64 == 0
    for w in (1, 4):
        xla.reconfigure(pcie_frac=1.0)
        pallas.reconfigure(pcie_frac=1.0)
        a, b = pallas.score(tokens, window=w), xla.score(tokens, window=w)
        assert rel_fro(a, b) <= 1e-5, w
    assert pallas.generate(tokens[:7], 6, stop_token_ids=[]) == xla.generate(tokens[:7], 6, stop_token_ids=[])


@pytest.mark.parametrize("layer", [0, 2])
def test_stacked_cache_reads_its_layer_only(layer):
    """The scanned model's form: [L, S, Nkv, D] caches and a traced layer index. The kernel reads that layer's rows
    only: every other layer is NaN/inf garbage, and the result equals the reference on the layer's own cache."""
    t, nq, nkv, d, s, pos = 4, 8, 2, 32, 128, 70
    q, k, v, p = make_case(layer + 7, t, nq, nkv, d, s, pos, jnp.float32)
    garbage_k = with_garbage(jnp.stack([k] * 3), 0, seed=1)  # [3, S, Nkv, D], all garbage
    garbage_v = with_garbage(jnp.stack([v] * 3), 0, seed=2)
    kc, vc = garbage_k.at[layer].set(k), garbage_v.at[layer].set(v)
    out = jax.jit(lambda q, kc, vc, p, i: decode_attention(q, kc, vc, p, layer=i, interpret=True))(
        q, kc, vc, p, jnp.int32(layer))
    assert np.isfinite(np.asarray(out)).all()
    assert rel_fro(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


def test_stacked_cache_lowers_for_cuda():
    spec = jax.ShapeDtypeStruct
    s, nkv, d = 2112, 4, 128
    text = lower_for_cuda(lambda q, kc, vc, p, i: decode_attention(q, kc, vc, p, layer=i),
                          spec((1, 32, d), jnp.bfloat16), spec((48, s, nkv, d), jnp.bfloat16),
                          spec((48, s, nkv, d), jnp.bfloat16), spec((), jnp.int32), spec((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2\)", text)  # the stacked caches, in place


def test_int8_stacked_cache_lowers_for_cuda():
    spec = jax.ShapeDtypeStruct
    s, nkv, d = 2112, 4, 128
    text = lower_for_cuda(lambda q, kc, vc, p, i, ks, vs: decode_attention(q, kc, vc, p, i, ks, vs),
                          spec((1, 32, d), jnp.bfloat16), spec((48, s, nkv, d), jnp.int8),
                          spec((48, s, nkv, d), jnp.int8), spec((), jnp.int32), spec((), jnp.int32),
                          spec((48, s, nkv), jnp.float32), spec((48, s, nkv), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2, %arg5, %arg6\)", text)


# Prefill chunks: T * r query rows per kv head cut into row blocks (block_m=None: 64 rows once next_pow2(T * r) >
# 128), each row block reading the cache only up to its own last token's position.
PREFILL_CASES = {  # (T, Nq, Nkv, D, S, pos)
    "t64_pos0": (64, 8, 2, 16, 256, 0),  # the first chunk: 4 row blocks, block b sees keys 0 .. 16b + 15
    "t64_pos100": (64, 8, 2, 32, 256, 100),  # mid-context, the chunk straddles block boundaries
    "t100_pos300": (100, 8, 2, 32, 512, 300),  # 400 rows: 7 row blocks, the last one 16 rows + padding
    "t100_to_the_end": (100, 8, 2, 16, 512, 412),  # the chunk's last row is the cache's last row
}


@pytest.mark.parametrize("name, dtype", [(name, "f32") for name in PREFILL_CASES]
                         + [("t64_pos100", "bf16"), ("t100_pos300", "bf16")])
def test_prefill_kernel_matches_reference(name, dtype):
    dtype = DTYPES[dtype]
    t, nq, nkv, d, s, pos = PREFILL_CASES[name]
    q, k, v, p = make_case(len(name) + 200, *PREFILL_CASES[name], dtype)
    out = decode_attention(q, k, v, p, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_fro(out, decode_attention_reference(q, k, v, p)) < RTOL[dtype]
    if pos + t < s:  # garbage past the chunk's last position: never read
        kg, vg = with_garbage(k, pos + t, seed=1), with_garbage(v, pos + t, seed=2)
        np.testing.assert_array_equal(np.asarray(decode_attention(q, kg, vg, p, interpret=True)), np.asarray(out))


@pytest.mark.parametrize("tuning", [dict(), dict(k_splits=1), dict(k_splits=5, block_k=16)])
def test_prefill_row_block_reads_only_its_own_keys(tuning):
    """Causal trip counts: row block 0 (tokens 0..15 at r = 4, block_m = 64) reads keys up to pos + 15 only. With
    garbage in every row from pos + 16 on, its rows come out as with the clean cache, bit for bit (a block reading
    past its own last key would pull NaN in through p @ v even where the mask zeroes p)."""
    t, nq, nkv, d, s, pos = 64, 8, 2, 16, 256, 120
    q, k, v, p = make_case(13, t, nq, nkv, d, s, pos, jnp.float32)
    out = np.asarray(decode_attention(q, k, v, p, interpret=True, block_m=64, **tuning))
    kg, vg = with_garbage(k, pos + 16, seed=3), with_garbage(v, pos + 16, seed=4)
    garbage = np.asarray(decode_attention(q, kg, vg, p, interpret=True, block_m=64, **tuning))
    np.testing.assert_array_equal(garbage[:16], out[:16])
    assert rel_fro(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


@pytest.mark.parametrize("tuning", [dict(block_m=16, k_splits=1), dict(block_m=128, k_splits=3, block_k=32),
                                    dict(block_m=256, k_splits=16)])
def test_prefill_blocks_and_splits(tuning):
    """Row blocks of 16 (25 blocks of one token and a quarter), 128 (ragged last block) and one tile of 512 rows
    (block_m >= next_pow2(T * r)); one split, ragged splits, splits past every row block's last key: the same result
    within f32 rounding, garbage unread."""
    t, nq, nkv, d, s, pos = 100, 8, 2, 16, 512, 200
    q, k, v, p = make_case(17, t, nq, nkv, d, s, pos, jnp.float32)
    kg, vg = with_garbage(k, pos + t, seed=5), with_garbage(v, pos + t, seed=6)
    out = decode_attention(q, kg, vg, p, interpret=True, **tuning)
    assert rel_fro(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


@pytest.mark.parametrize("dtype", DTYPES.keys())
def test_prefill_int8_cache_kernel_matches_reference(dtype):
    """kv_dtype=int8 with row blocks: int8 rows and scales read in place; rows past the chunk (random int8, NaN / inf
    scales) never read."""
    dtype = DTYPES[dtype]
    t, nq, nkv, d, s, pos = PREFILL_CASES["t100_pos300"]
    q, k, v, p = make_int8_case(23, t, nq, nkv, d, s, pos, dtype)
    out = decode_attention(q, k.q, v.q, p, k_scale=k.scale, v_scale=v.scale, interpret=True)
    assert rel_fro(out, decode_attention_reference(q, k.q, v.q, p, k.scale, v.scale)) < RTOL[dtype]
    rng = np.random.default_rng(7)
    bad_q = lambda c: c.q.at[pos + t:].set(jnp.asarray(rng.integers(-128, 128, c.q[pos + t:].shape), jnp.int8))
    bad_s = lambda c: with_garbage(c.scale[..., None], pos + t, seed=8)[..., 0]
    garbage = decode_attention(q, bad_q(k), bad_q(v), p, k_scale=bad_s(k), v_scale=bad_s(v), interpret=True)
    np.testing.assert_array_equal(np.asarray(garbage), np.asarray(out))


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_prefill_stacked_cache_reads_its_layer_only(kv):
    """The scanned model's form with row blocks: [L, S, Nkv, D] caches (and [L, S, Nkv] scales), a traced layer; the
    other layers are garbage (float caches) or negated rows with NaN / inf scales (int8)."""
    t, nq, nkv, d, s, pos, layer = 64, 8, 2, 16, 256, 150, 1
    if kv == "int8":
        q, k, v, p = make_int8_case(29, t, nq, nkv, d, s, pos, jnp.float32)
        stack = lambda c, seed: (jnp.stack([-c.q] * 3).at[layer].set(c.q),
                                 with_garbage(jnp.stack([c.scale] * 3)[..., None], 0, seed)[..., 0].at[layer].set(
                                     c.scale))
        (kq, ks), (vq, vs) = stack(k, 1), stack(v, 2)
        args, ref = (kq, vq, p, jnp.int32(layer), ks, vs), decode_attention_reference(q, k.q, v.q, p, k.scale, v.scale)
    else:
        q, k, v, p = make_case(29, t, nq, nkv, d, s, pos, jnp.float32)
        kc = with_garbage(jnp.stack([k] * 3), 0, seed=1).at[layer].set(k)
        vc = with_garbage(jnp.stack([v] * 3), 0, seed=2).at[layer].set(v)
        args, ref = (kc, vc, p, jnp.int32(layer)), decode_attention_reference(q, k, v, p)
    out = jax.jit(lambda q, *a: decode_attention(q, *a, interpret=True))(q, *args)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_fro(out, ref) < RTOL[jnp.float32]


def test_row_tiling_and_splits():
    """block_m=None keeps every decode window (next_pow2(T * r) <= 128) on one tile: the single-tile grid
    (Nkv, splits) and its numbers; prefill chunks get 64-row blocks. auto_splits off the GPU: 16 splits for one
    tile, 16 / row_blocks (at least 1) for several."""
    from strata_jax.pallas_kernels.decode_attention import _row_tiling, auto_splits
    assert _row_tiling(1 * 8, None) == (16, 1) and _row_tiling(4 * 8, None) == (32, 1)
    assert _row_tiling(16 * 8, None) == (128, 1) and _row_tiling(3 * 4, None) == (16, 1)
    assert _row_tiling(64 * 8, None) == (64, 8) and _row_tiling(100 * 4, None) == (64, 7)
    assert _row_tiling(1024 * 8, None) == (64, 128)
    assert _row_tiling(64 * 4, 128) == (128, 2) and _row_tiling(8, 64) == (16, 1) and _row_tiling(400, 1024) == (512, 1)
    for bad in (8, 48):
        with pytest.raises(ValueError, match=f"block_m={bad} must be a power of 2"):
            _row_tiling(64, bad)
    if jax.default_backend() != "gpu":
        assert auto_splits(2) == 16 and auto_splits(2, 1) == 16
        assert auto_splits(2, 4) == 4 and auto_splits(2, 7) == 3 and auto_splits(4, 128) == 1


@pytest.mark.parametrize("kv", ["bf16", "int8"])
@pytest.mark.parametrize("t, grid_x", [(1, 4), (16, 4), (64, 32), (1024, 512)])
def test_prefill_lowers_for_cuda(t, grid_x, kv):
    """The Qwen3-30B-A3B shape (r = 8, D = 128, S = 2112) for a decode window (one tile per kv head: grid_x = Nkv = 4)
    and prefill chunks of 64 and 1024 tokens (64-row blocks: grid_x = Nkv * T * r / 64), caches in place."""
    spec = jax.ShapeDtypeStruct
    nq, nkv, d, s = 32, 4, 128, 2112
    if kv == "int8":
        text = lower_for_cuda(lambda q, kc, vc, p, ks, vs: decode_attention(q, kc, vc, p, k_scale=ks, v_scale=vs),
                              spec((t, nq, d), jnp.bfloat16), spec((s, nkv, d), jnp.int8), spec((s, nkv, d), jnp.int8),
                              spec((), jnp.int32), spec((s, nkv), jnp.float32), spec((s, nkv), jnp.float32))
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2, %arg4, %arg5\)", text)
    else:
        text = lower_for_cuda(decode_attention, spec((t, nq, d), jnp.bfloat16), spec((s, nkv, d), jnp.bfloat16),
                              spec((s, nkv, d), jnp.bfloat16), spec((), jnp.int32))
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2\)", text)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.search(rf"grid_x = {grid_x} : i32", text)
    assert f"x{s}x" not in text


def test_prefill_stacked_cache_lowers_for_cuda():
    spec = jax.ShapeDtypeStruct
    s, nkv, d = 2112, 4, 128
    text = lower_for_cuda(lambda q, kc, vc, p, i: decode_attention(q, kc, vc, p, layer=i),
                          spec((64, 32, d), jnp.bfloat16), spec((48, s, nkv, d), jnp.bfloat16),
                          spec((48, s, nkv, d), jnp.bfloat16), spec((), jnp.int32), spec((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1 and re.search(r"grid_x = 32 : i32", text)
    assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2\)", text)


@pytest.mark.parametrize("stacked", [False, True])
def test_prefill_chunk_with_the_kernel_matches_the_xla_path(stacked):
    """graphs.prefill_logits(attention_kernel=True) on the tiny model (r = 2: a 128-token chunk has 256 rows per kv
    head, 4 row blocks), unrolled and scanned, float32: a full chunk at 0, then a chunk of 70 real tokens whose padding
    reaches the cache's last row. The real rows' logits and the written caches match the XLA path's (1e-5)."""
    import functools
    from strata_jax.engine import graphs
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import random_weights
    from strata_jax.model.config import preset
    cfg = preset("tiny")
    weights = random_weights(cfg, 5, jnp.float32, scale=0.1, stacked=stacked)
    tokens = jnp.asarray(np.random.default_rng(43).integers(0, cfg.vocab_size, size=256), jnp.int32)
    runs = {}
    for kernel in (False, True):
        step = jax.jit(functools.partial(graphs.prefill_logits, cfg=cfg, attention_kernel=kernel))
        cache = init_cache(cfg, 256, jnp.float32, stacked=stacked)
        first, cache = step(weights, cache, tokens[:128], jnp.int32(0), jnp.int32(128))
        second, cache = step(weights, cache, tokens[128:], jnp.int32(128), jnp.int32(70))
        runs[kernel] = (np.asarray(first), np.asarray(second[:70]), cache)
    (a1, a2, ca), (b1, b2, cb) = runs[True], runs[False]
    assert rel_fro(a1, b1) < 1e-5 and rel_fro(a2, b2) < 1e-5
    for x, y in zip(jax.tree.leaves((ca.k, ca.v)), jax.tree.leaves((cb.k, cb.v))):
        assert rel_fro(np.asarray(x)[..., :198, :, :], np.asarray(y)[..., :198, :, :]) < 1e-5


# Batched windows (model/batch.py, issue 38): B sequences' T=1 rows in one kernel, row b over cache row rows[b] of a
# stacked [R, S, Nkv, D] cache (the batch cache's (layer, slot) rows), up to its own position pos[b].
BATCH_CASES = {  # (B, Nq, Nkv, D, R, S, rows, pos)
    "b4_mixed": (4, 8, 2, 32, 6, 128, (5, 0, 3, 1), (0, 127, 64, 30)),  # position 0, S - 1, a block's first, mid
    "b3_r4_s192": (3, 8, 2, 32, 4, 192, (2, 3, 0), (150, 1, 190)),  # r = 4, near S
    "b1": (1, 4, 2, 16, 2, 128, (1,), (77,)),
    "qwen3_b4_s2112": (4, 32, 4, 128, 9, 2112, (8, 1, 4, 6), (0, 2111, 1000, 63)),  # the Qwen3-30B-A3B shape
}


def make_batch_case(seed: int, b: int, nq: int, nkv: int, d: int, n_rows: int, s: int, rows, pos, dtype,
                    int8: bool = False):
    """Random q [B, Nq, D], clean caches [R, S, Nkv, D] (int8: QuantKV of random rows, scales [R, S, Nkv]) and their
    garbage twins: in cache row rows[b] every position past pos[b], and every row no batch row reads, replaced by
    huge / NaN / inf values (int8: random int8 rows, NaN / inf scales)."""
    from strata_jax.model.kv_cache import QuantKV, quantize_kv
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, nq, d)), dtype)
    shape = (n_rows, s, nkv, d)
    if int8:
        k = quantize_kv(jnp.asarray(rng.standard_normal(shape) * 2.0 * rng.uniform(0.2, 3, (*shape[:-1], 1)),
                                    jnp.float32))
        v = quantize_kv(jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.2, 3, (*shape[:-1], 1)), jnp.float32))
    else:
        k = jnp.asarray(rng.standard_normal(shape) * 2.0, dtype)
        v = jnp.asarray(rng.standard_normal(shape), dtype)
    first_bad = np.zeros(n_rows, int)  # per cache row: where its garbage starts (0: all of it)
    first_bad[list(rows)] = np.asarray(pos) + 1

    def spoil(c, seed):
        if int8:
            rows_q = [c.q[i].at[f:].set(jnp.asarray(rng.integers(-128, 128, c.q[i, f:].shape), jnp.int8))
                      for i, f in enumerate(first_bad)]
            rows_s = [with_garbage(c.scale[i][..., None], int(f), seed + i)[..., 0] for i, f in enumerate(first_bad)]
            return QuantKV(q=jnp.stack(rows_q), scale=jnp.stack(rows_s))
        return jnp.stack([with_garbage(c[i], int(f), seed + i) for i, f in enumerate(first_bad)])
    return (q, k, v, spoil(k, 100), spoil(v, 200), jnp.asarray(rows, jnp.int32), jnp.asarray(pos, jnp.int32))


def _batch_args(k, v):
    """The kernel's cache arguments: (k, v) or, for QuantKV, (k.q, v.q) and the scales."""
    return ((k.q, v.q), dict(k_scale=k.scale, v_scale=v.scale)) if hasattr(k, "scale") else ((k, v), {})


# every case in every cache dtype but the Qwen3 shape in bf16 (~10 s interpreted): bf16 at that shape is
# test_kernel_matches_reference[qwen3_t1_s2112-bf16], the batch kernel's bf16 path the three small cases'
@pytest.mark.parametrize("name,kv", [(name, kv) for name in BATCH_CASES for kv in ("f32", "bf16", "int8")
                                     if (name, kv) != ("qwen3_b4_s2112", "bf16")])
def test_batch_kernel_matches_reference(name, kv):
    """Each row over its own cache row up to its own position: the kernel (interpreted) against the batched
    reference within the single-sequence bounds; with garbage past every row's position and in every cache row no
    batch row reads, the same output bit for bit (never read)."""
    dtype = jnp.bfloat16 if kv == "bf16" else jnp.float32
    b, nq, nkv, d, n_rows, s, rows, pos = BATCH_CASES[name]
    q, k, v, kg, vg, r, p = make_batch_case(len(name) + 300, *BATCH_CASES[name], dtype, int8=kv == "int8")
    (kc, vc), scales = _batch_args(k, v)
    out = batch_decode_attention(q, kc, vc, r, p, **scales, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = batch_decode_attention_reference(q, kc, vc, r, p, **scales)
    assert rel_fro(out, ref) < RTOL[dtype]
    (kgc, vgc), garbage_scales = _batch_args(kg, vg)
    garbage = np.asarray(batch_decode_attention(q, kgc, vgc, r, p, **garbage_scales, interpret=True))
    assert np.isfinite(garbage.astype(np.float32)).all()
    np.testing.assert_array_equal(garbage, np.asarray(out))


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_batch_reference_is_each_row_alone(kv):
    """The batched reference is decode_attention_reference of each row over its own cache row (T=1 at pos[b])."""
    q, k, v, _, _, rows, pos = make_batch_case(31, *BATCH_CASES["b4_mixed"], jnp.float32, int8=kv == "int8")
    (kc, vc), scales = _batch_args(k, v)
    got = batch_decode_attention_reference(q, kc, vc, rows, pos, **scales)
    for i in range(q.shape[0]):
        row = int(rows[i])
        alone = decode_attention_reference(q[i:i + 1], kc[row], vc[row], pos[i],
                                           *([scales["k_scale"][row], scales["v_scale"][row]] if scales else []))
        assert rel_fro(got[i:i + 1], alone) < 1e-6


@pytest.mark.parametrize("tuning", [dict(block_k=16, k_splits=1), dict(block_k=32, k_splits=5),
                                    dict(block_k=256, k_splits=2)])
def test_batch_blocks_and_splits(tuning):
    q, k, v, kg, vg, rows, pos = make_batch_case(37, *BATCH_CASES["b3_r4_s192"], jnp.float32)
    out = batch_decode_attention(q, kg, vg, rows, pos, interpret=True, **tuning)
    assert rel_fro(out, batch_decode_attention_reference(q, k, v, rows, pos)) < RTOL[jnp.float32]


def test_batch_bad_shapes():
    q, k, v, _, _, rows, pos = make_batch_case(41, *BATCH_CASES["b1"], jnp.float32)
    with pytest.raises(ValueError, match="must be \\[B\\]"):
        batch_decode_attention(q, k, v, jnp.concatenate([rows, rows]), pos, interpret=True)
    with pytest.raises(ValueError, match="int8 cache needs"):
        batch_decode_attention(q, k, v, rows, pos, k_scale=k[..., 0], interpret=True)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_batch_lowers_for_cuda(kv):
    """The Qwen3-30B-A3B shape, B = 8 rows over a batch cache of 48 layers x 8 slots: one Triton kernel, grid_x =
    B * Nkv = 32, the caches (and scales) straight from the arguments, no [.., S, ..] copy."""
    spec = jax.ShapeDtypeStruct
    b, nq, nkv, d, s, n_rows = 8, 32, 4, 128, 2112, 48 * 8
    ints = spec((b,), jnp.int32)
    if kv == "int8":
        text = lower_for_cuda(lambda q, kc, vc, r, p, ks, vs: batch_decode_attention(q, kc, vc, r, p, ks, vs),
                              spec((b, nq, d), jnp.bfloat16), spec((n_rows, s, nkv, d), jnp.int8),
                              spec((n_rows, s, nkv, d), jnp.int8), ints, ints, spec((n_rows, s, nkv), jnp.float32),
                              spec((n_rows, s, nkv), jnp.float32))
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2, %arg5, %arg6\)", text)
    else:
        text = lower_for_cuda(batch_decode_attention, spec((b, nq, d), jnp.bfloat16),
                              spec((n_rows, s, nkv, d), jnp.bfloat16), spec((n_rows, s, nkv, d), jnp.bfloat16), ints,
                              ints)
        assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2\)", text)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.search(rf"grid_x = {b * nkv} : i32", text)
    # the only arrays with an S axis: the caches and scales as given (no gathered [B, S, ..] copy)
    with_s = set(re.findall(rf"tensor<(\d+x{s}x[\dx]*\d)x(?:bf16|i8|f32)>", text))
    assert with_s == ({f"{n_rows}x{s}x{nkv}x{d}", f"{n_rows}x{s}x{nkv}"} if kv == "int8" else {f"{n_rows}x{s}x{nkv}x{d}"})
