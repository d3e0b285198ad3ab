"""pallas_kernels.decode_attention: the kernel in interpret mode against its reference (with garbage past the window
proving those rows are never read), the reference against model.attention, and the CUDA lowering at the Qwen3-30B-A3B
and tiny shapes.

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

from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.decode_attention import _block_k, decode_attention, decode_attention_reference

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


def with_garbage(cache, first_bad: int, seed: int):
    """Rows >= first_bad replaced by huge random values with NaN and +-inf sprinkled in."""
    rng = np.random.default_rng(seed)
    bad = np.asarray(cache, np.float32).copy()
    tail = rng.standard_normal(bad[first_bad:].shape) * 1e30
    tail[rng.random(tail.shape) < 0.3] = np.nan
    tail[rng.random(tail.shape) < 0.1] = np.inf
    tail[rng.random(tail.shape) < 0.1] = -np.inf
    bad[first_bad:] = tail
    return jnp.asarray(bad, cache.dtype)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("name", CASES.keys())
def test_kernel_matches_reference(name, dtype):
    dtype = DTYPES[dtype]
    t, nq, nkv, d, s, pos = CASES[name]
    q, k, v, p = make_case(len(name), *CASES[name], dtype)
    out = decode_attention(q, k, v, p, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_attention_reference(q, k, v, p)
    assert rel(out, ref) < RTOL[dtype]

    # Garbage (huge, NaN, inf) in every row past the window's last position: the same output, bit for bit.
    if pos + t < s:
        kg, vg = with_garbage(k, pos + t, seed=1), with_garbage(v, pos + t, seed=2)
        garbage_out = np.asarray(decode_attention(q, kg, vg, p, interpret=True))
        assert np.isfinite(garbage_out.astype(np.float32)).all()
        np.testing.assert_array_equal(garbage_out, np.asarray(out))


def make_int8_case(seed: int, t: int, nq: int, nkv: int, d: int, s: int, pos: int, dtype):
    """Random q [T, Nq, D] (dtype) and int8 caches [S, Nkv, D] with their float32 scales [S, Nkv], quantized from
    fresh random rows (strata_jax.model.quantize_kv: kv_dtype=int8)."""
    from strata_jax.model import quantize_kv
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
    assert rel(out, ref) < RTOL[dtype]
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
    assert rel(out, decode_attention_reference(q, k.q, v.q, p, k.scale, v.scale)) < RTOL[jnp.float32]


@pytest.mark.parametrize("tuning", [dict(block_k=16, k_splits=1), dict(block_k=16, k_splits=5),
                                    dict(block_k=32, k_splits=8), dict(block_k=256, k_splits=2)])
def test_blocks_and_splits(tuning):
    """Several blocks per split, several splits (ragged last one, some entirely past the window), block_k larger
    than any divisor of S (192 -> 64): the same result within f32 rounding, garbage still unread."""
    t, nq, nkv, d, s, pos = CASES["t3_r4_s192"]
    q, k, v, p = make_case(7, t, nq, nkv, d, s, pos, jnp.float32)
    kg, vg = with_garbage(k, pos + t, seed=3), with_garbage(v, pos + t, seed=4)
    out = decode_attention(q, kg, vg, p, interpret=True, **tuning)
    assert rel(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


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
    """model.attention on the tiny config with wo = identity (Nq * D == H there) returns the attention output before
    the projection: the reference, fed the q and the updated caches that model.attention builds, equals it exactly;
    the kernel matches it within its bound."""
    from strata_jax import model
    from strata_jax.config import preset
    dtype = DTYPES[dtype]
    cfg = preset("tiny")
    t, s, pos = 4, 128, 37
    nq, nkv, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    assert nq * d == h
    rng = np.random.default_rng(11)
    rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.2, dtype)
    w = model.AttentionWeights(wq=rnd(h, nq * d), wk=rnd(h, nkv * d), wv=rnd(h, nkv * d), wo=jnp.eye(h, dtype=dtype),
                               q_norm=jnp.asarray(1 + rng.random(d) * 0.1, dtype),
                               k_norm=jnp.asarray(1 + rng.random(d) * 0.1, dtype))
    x = rnd(t, h)
    k_cache, v_cache = rnd(s, nkv, d), rnd(s, nkv, d)
    p = jnp.int32(pos)

    def q_of(x):  # model.attention's q, step by step
        q = model.rms_norm((x @ w.wq).reshape(t, nq, d), w.q_norm, cfg.rms_norm_eps)
        return model.rope(q, p + jnp.arange(t, dtype=jnp.int32), cfg.rope_theta)

    with jax.disable_jit():  # op by op, so no fusion decision can differ between the two programs
        got, kc, vc = model.attention(x, w, k_cache, v_cache, p, cfg)
        q = q_of(x)
        ref = decode_attention_reference(q, kc, vc, p).reshape(t, nq * d)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(got, np.float32))
    assert rel(decode_attention(q, kc, vc, p, interpret=True).reshape(t, nq * d), got) < RTOL[dtype]


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
    logits as the XLA einsums up to float summation order (1e-5 relative), windows of 1 and 4, offload on."""
    tokens = np.random.default_rng(41).integers(0, 256, size=23).tolist()
    common = dict(dtype="float32", window=4, context=64, expert_cache_slots=5, pcie_frac=1.0, cpu_threads=2)
    xla = engine_factory(None, **common)
    pallas = engine_factory(None, attention_kernel="pallas", **common)
    assert pallas.cache.length % 64 == 0
    for w in (1, 4):
        xla.reconfigure(pcie_frac=1.0)
        pallas.reconfigure(pcie_frac=1.0)
        a, b = pallas.score(tokens, window=w), xla.score(tokens, window=w)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-5, w
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
    assert rel(out, decode_attention_reference(q, k, v, p)) < RTOL[jnp.float32]


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
