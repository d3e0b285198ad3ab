"""After the q/k/v product of a decode window, in one kernel: the product's split partials summed and rounded, the
per-head q/k RMSNorm, RoPE, and the window's keys and values written into the stacked cache in place.

XLA runs these as ~6 small ops a layer (the split sum, the q and k norms, RoPE's concatenation, one
dynamic-update-slice per cache), 1.0-1.7 us each on an H100 whatever their size: ~9 us of a ~100 us layer of the
30B shape (benchmarks/results/h100-2026-12-07-kernels, the ninth session's profile).

partials [splits, Tp, Nq*D + 2*Nkv*D] float32: `stacked_linear(..., sum_splits=False)`'s (rows >= T are padding);
norms q_norm, k_norm [L, D] (every layer's, in the model dtype; read at `layer` in the kernel: a slice of them is a
copy op of its own in the scanned body); RoPE's cos and sin of positions pos.. computed in the kernel (transformers'
rotate-half form has cos(emb) = cos(freqs) twice over: [Tp, D/2] is all of it; tables passed in were two pad ops);
k_cache, v_cache [L, S, Nkv, D] written at layer `layer`, rows pos..pos+T-1 (aliased: the returned caches are the
given buffers). Returns q [Tp, Nq, D] (rows >= T unspecified), k_cache, v_cache.

Arithmetic as `transformer.attention_rows` (the XLA path): the product rounded to the model dtype once summed; the
norm in float32 on the rounded values, cast back, times the weight; RoPE x * cos + rotate_half(x) * sin. Where XLA
keeps a fused op's intermediates in float32 (its excess precision) the two may round apart by a step of the model
dtype here and there.

Kernel: grid (Nq + Nkv,): program g < Nq owns q head g; program Nq + h owns kv head h (its k, normed and rotated,
and its v). Each reads its head's columns of the partials as two halves [Tp, D/2] (no slicing of values in
registers: rotate_half pairs the halves), sums the splits in order, and stores q, or the cache rows under a mask of
the window's T rows. The cache rows are stored at pos.. directly (the GPU writes nothing past the mask; interpret
mode clamps a block reaching past S, as dynamic_slice does: keep pos + Tp <= S there).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


# Whether the scanned graph's decode windows (T <= 16, bf16 cache, no q/k/v bias, full-width RoPE) run this kernel
# after the q/k/v product (1) or XLA's ops (0). Off until a generate-loop A/B backs it; a kernel-sweep file's
# "qkv_rope:decode": {"fuse": 1} (STRATA_KERNEL_TUNING) turns it on for a whole run.
TUNING = {"decode": {"fuse": 0}}


def fused(t: int) -> bool:
    return t <= 16 and bool(TUNING["decode"]["fuse"])


def _qkv_rope_kernel(pos_ref, layer_ref, part_ref, qn_ref, kn_ref, inv_freq_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
                     nq: int, nkv: int, d: int, t: int, splits: int, eps: float):
    """pos, layer [1] int32; part [splits, Tp, N] f32 (whole); qn, kn [L, D] (every layer's norms, read at `layer`:
    a slice of them would be a copy op); inv_freq [D/2] f32; q_ref: this q head's [Tp, D] block; k_ref / v_ref: this
    kv head's [L, S, D] view of the (aliased) caches."""
    g = pl.program_id(0)
    pos, layer = pos_ref[0], layer_ref[0]
    half = d // 2
    dtype = q_ref.dtype
    tp = q_ref.shape[0]

    def halves(col):
        """The head at column `col`: its two halves [Tp, D/2], splits summed in order, rounded to the model dtype."""
        out = []
        for h in range(2):
            cols = pl.ds(col + h * half, half)
            acc = part_ref[0, :, cols]
            for s in range(1, splits):
                acc = acc + part_ref[s, :, cols]
            out.append(acc.astype(dtype))
        return out

    # RoPE's tables for the window's positions, as transformer.rope computes them (f32 angle, cast)
    positions = (pos + lax.broadcasted_iota(jnp.int32, (tp, 1), 0)).astype(jnp.float32)  # [Tp, 1]
    freqs = positions * inv_freq_ref[...][None, :]  # [Tp, D/2]
    cos, sin = jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)

    def norm_rope(x1, x2, w_ref):
        """RMSNorm over the head's D values (both halves), cast back, times the weight; then rotate_half RoPE."""
        a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
        mean = (jnp.sum(a * a, axis=1, keepdims=True) + jnp.sum(b * b, axis=1, keepdims=True)) / d  # [Tp, 1]
        inv = lax.rsqrt(mean + eps)
        n1 = w_ref[layer, pl.ds(0, half)][None, :] * (a * inv).astype(dtype)  # [Tp, D/2] in the model dtype
        n2 = w_ref[layer, pl.ds(half, half)][None, :] * (b * inv).astype(dtype)
        return n1 * cos + (-n2) * sin, n2 * cos + n1 * sin

    @pl.when(g < nq)
    def _():
        x1, x2 = halves(g * d)
        r1, r2 = norm_rope(x1, x2, qn_ref)
        q_ref[:, pl.ds(0, half)] = r1.astype(dtype)
        q_ref[:, pl.ds(half, half)] = r2.astype(dtype)

    @pl.when(g >= nq)
    def _():
        h = g - nq
        rows = pl.ds(pos, tp)
        mask = jnp.broadcast_to(lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t, (tp, half))  # the window's rows
        k1, k2 = halves(nq * d + h * d)
        r1, r2 = norm_rope(k1, k2, kn_ref)
        plgpu.store(k_ref.at[layer, rows, pl.ds(0, half)], r1.astype(k_ref.dtype), mask=mask)
        plgpu.store(k_ref.at[layer, rows, pl.ds(half, half)], r2.astype(k_ref.dtype), mask=mask)
        v1, v2 = halves(nq * d + nkv * d + h * d)
        plgpu.store(v_ref.at[layer, rows, pl.ds(0, half)], v1.astype(v_ref.dtype), mask=mask)
        plgpu.store(v_ref.at[layer, rows, pl.ds(half, half)], v2.astype(v_ref.dtype), mask=mask)


def inv_freq(theta: float, d: int) -> jax.Array:
    """RoPE's [D/2] inverse frequencies (a constant of the graph): transformer.rope's too, so the kernel and the XLA
    path turn by the same angles."""
    return 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))


@functools.partial(jax.jit, static_argnames=("t", "num_heads", "num_kv_heads", "eps", "theta", "interpret"))
def qkv_rope(partials: jax.Array, q_norm: jax.Array, k_norm: jax.Array, pos: jax.Array, k_cache: jax.Array,
             v_cache: jax.Array, layer: jax.Array, *, t: int, num_heads: int, num_kv_heads: int, eps: float,
             theta: float, interpret: bool = False):
    """See the module docstring; q_norm, k_norm [L, D] (every layer's). -> (q [Tp, Nq, D] in the norms' dtype,
    k_cache, v_cache)."""
    splits, tp, n = partials.shape
    n_layers, seq, nkv, d = k_cache.shape
    nq = num_heads
    if nkv != num_kv_heads or n != (nq + 2 * nkv) * d or d % 32 or d & (d - 1):
        raise ValueError(f"qkv_rope: partials {partials.shape}, cache {k_cache.shape}, Nq={nq}, Nkv={num_kv_heads}: "
                         "need N = (Nq + 2 Nkv) D and D a power of 2 >= 32")
    if not 1 <= t <= tp or tp & (tp - 1) or q_norm.shape != (n_layers, d) or k_norm.shape != q_norm.shape:
        raise ValueError(f"qkv_rope: t={t}, Tp={tp} (a power of 2 >= t), norms {q_norm.shape} {k_norm.shape} "
                         f"(want [L, D] = [{n_layers}, {d}])")
    dtype = q_norm.dtype
    whole = lambda shape: pl.BlockSpec(shape, lambda g: (0,) * len(shape))
    kv_head = lambda g: (0, 0, jnp.maximum(g - nq, 0), 0)  # q programs get head 0's view and never touch it
    cache_spec = pl.BlockSpec((n_layers, seq, None, d), kv_head)
    kernel = functools.partial(_qkv_rope_kernel, nq=nq, nkv=nkv, d=d, t=t, splits=splits, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(nq + nkv,),
        in_specs=[whole((1,)), whole((1,)), whole(partials.shape), whole(q_norm.shape), whole(k_norm.shape),
                  whole((d // 2,)), cache_spec, cache_spec],
        out_specs=[pl.BlockSpec((tp, None, d), lambda g: (0, jnp.minimum(g, nq - 1), 0)), cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct((tp, nq, d), dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qkv_rope",
    )(jnp.asarray(pos, jnp.int32).reshape(1), jnp.asarray(layer, jnp.int32).reshape(1), partials, q_norm, k_norm,
      inv_freq(theta, d), k_cache, v_cache)


def qkv_rope_reference(partials: jax.Array, q_norm: jax.Array, k_norm: jax.Array, pos: jax.Array, k_cache: jax.Array,
                       v_cache: jax.Array, layer: jax.Array, *, t: int, num_heads: int, num_kv_heads: int, eps: float,
                       theta: float, interpret: bool = False):
    """The XLA path's ops (transformer.attention_rows and attention's cache writes, written again here: the kernels'
    room does not import the model's) on the same inputs; same signature and results as `qkv_rope` (`interpret`
    ignored)."""
    del interpret
    d = k_cache.shape[-1]
    nq, nkv = num_heads, num_kv_heads
    dtype = q_norm.dtype
    y = partials.sum(axis=0)[:t].astype(dtype)  # [T, N]
    q, k, v = jnp.split(y, [nq * d, (nq + nkv) * d], axis=1)
    freqs = (pos + jnp.arange(t, dtype=jnp.int32)).astype(jnp.float32)[:, None] * inv_freq(theta, d)[None, :]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], axis=-1)).astype(dtype)[:, None, :]  # [T, 1, D]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], axis=-1)).astype(dtype)[:, None, :]

    def norm_rope(x, weight):  # transformer.rms_norm, then transformer.rope (rotate-half), in plain jnp
        x32 = x.astype(jnp.float32)
        x = weight * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
        return x * cos + jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * sin

    q = norm_rope(q.reshape(t, nq, d), q_norm[layer])
    k = norm_rope(k.reshape(t, nkv, d), k_norm[layer])
    v = v.reshape(t, nkv, d)
    start = (layer, pos, 0, 0)
    k_cache = lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), start)
    v_cache = lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), start)
    return q, k_cache, v_cache
