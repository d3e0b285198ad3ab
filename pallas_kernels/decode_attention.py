"""Window decode attention over the engine's KV cache, read in place and only up to the last filled position.

Semantics (`decode_attention` and `decode_attention_reference`; the reference is `model.attention`'s arithmetic from
the GQA reshape to the output einsum, without the wo projection):

- q [T, Nq, D]: the window's T tokens (already RMS-normed and RoPE'd) at positions pos..pos+T-1; k_cache, v_cache
  [S, Nkv, D]: the engine's layout, the window's own keys/values already written at rows pos..pos+T-1; pos: int32
  scalar (traced). Nq = r * Nkv; q head h uses kv head h // r (transformers' repeat_kv).
- scores[t, h, s] = (q[t, h] . k_cache[s, h // r]) * D**-0.5 in float32 (the cache cast to q.dtype first);
  causal mask: query token t sees keys s <= pos + t; softmax in float32; the probabilities cast to q.dtype;
  out[t, h] = sum_s probs[t, h, s] * v_cache[s, h // r] (f32 accumulation), cast to q.dtype.
- Rows s > pos + T - 1 are never read by the kernel (whatever they hold, NaN included, cannot reach the output).
  The engine keeps pos + T <= S; positions past S do not exist, so the kernel clamps its reads to S.

Rounding: the kernel is flash attention (online softmax), so it casts the UNnormalised exp(score - running max) to
q.dtype before the p @ v dot and divides by the f32 row sum at the end, where the reference rounds the normalised
probabilities. In float32 the two agree to ~1e-7 relative; in bfloat16 to bf16 rounding (~1e-2 relative).

Kernel (flash decoding, as jax.experimental.pallas.ops.gpu.decode_attention's attn_forward_kernel):
- grid (Nkv, k_splits). Program (g, j) takes kv head g's r query heads of all T tokens as the rows of one
  [Mp, D] tile (row i = t * r + h', T*r padded with zero rows to Mp, a power of 2 >= 16 for tl.dot) and the j-th
  split of the cache positions [j * split_len, (j + 1) * split_len).
- The cache is read in place: k_cache / v_cache are passed whole, with a BlockSpec (S, None, D) per kv head g (the
  kv-head dim squeezed: a strided view, not a copy; no transpose of the cache anywhere). The kernel loads
  [block_k, D] chunks of it with a dynamic trip count: only the blocks up to the last needed position
  last = min(pos + T - 1, S - 1), and inside the last block the rows past `last` are masked loads (not read, zeros).
  A split that starts past `last` does no work (lax.cond) and writes m = -big, l = 0, o = 0.
- Per row: causal mask s <= pos + t (padding rows use t = T - 1), online-softmax state (m, l, o) in f32; each split
  writes its unnormalised o [Mp, D] f32 and its m, l [Mp] f32. The wrapper combines the splits in jnp (the "final
  round of flash" of decode_attn_unbatched) and normalises: out = sum_j o_j e^(m_j - M) / sum_j l_j e^(m_j - M).
  Key 0 is visible to every row, so the final row sum is never 0.

Blocks: block_k is the largest power of 2 <= the requested block_k that divides S, at least 16 (tl.dot), else a
ValueError (S is context + prefill chunk in the engine, e.g. 2048 + 64 = 2112 = 64 * 33, so block_k = 64 there):
every block then lies inside the cache, and nothing is padded. A split is a power of 2 of blocks:
blocks_per_split = next_pow2(ceil((S / block_k) / k_splits)), and the number of splits actually launched is
ceil((S / block_k) / blocks_per_split) (the last split may be shorter; its loop simply ends at S). k_splits=None
picks `auto_splits`: two waves of programs on the GPU's SMs, at least 16 (JAX's default).

int8 caches (the engine's kv_dtype=int8): k_cache / v_cache int8 with k_scale / v_scale [S, Nkv] float32 (stacked:
[L, S, Nkv]), value = int8 * scale per (position, kv head). The kernel loads the int8 block and its [block_k]
scales in place and widens to q.dtype in registers (exact: |int8| <= 127); the K scales multiply the f32 scores,
the V scales the f32 exp(score - max) before its cast to q.dtype (the row sum l stays unscaled). The reference
does the same on the whole cache (scores times K scales; normalised probabilities times V scales, then the cast).

Triton constraints: every in-kernel array has a power-of-2 element count (Mp, block_k and D are powers of 2: D must
be a power of 2 >= 16, else a ValueError) and tl.dot needs dims >= 16. Both dots run at Precision.HIGHEST, so
float32 inputs use IEEE f32 (not TF32) on the GPU; bf16 inputs are unaffected.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocks import MIN_DOT, pow2_divisor

DEFAULT_SPLITS = 16  # the least splits; on a GPU, auto_splits asks for two waves of programs
FORCE_SPLITS: int | None = None  # benchmarks only (decode_bench --attention_splits): k_splits=None uses this


def auto_splits(nkv: int) -> int:
    """k_splits=None: enough (kv head, split) programs for two waves on the GPU's SMs (a T=1 window deep in the
    context has Nkv * splits programs; 4 kv heads x 16 splits filled under half of an H200's 132 SMs), at least
    DEFAULT_SPLITS. Splits past the last filled position do no work."""
    if FORCE_SPLITS:
        return FORCE_SPLITS
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0) or 0) if jax.default_backend() == "gpu" else 0
    except Exception:
        sms = 0
    return max(DEFAULT_SPLITS, -(-2 * sms // nkv)) if sms else DEFAULT_SPLITS
M_INIT = float(jnp.finfo(jnp.float32).min)  # running max before any key: finite, so exp(M_INIT - m) is 0, never nan


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _decode_attention_kernel(pos_ref, q_ref, k_ref, v_ref, *rest, t: int, r: int, block_k: int,
                             blocks_per_split: int, sm_scale: float, stacked: bool, quant: bool):
    """pos [2] int32 (position, layer); q block [Mp, D] (kv head g's rows); k, v blocks [L, S, D] (kv head g's
    strided view of the stacked cache, the layer picked in-kernel; [S, D] when not stacked); quant: then the int8
    caches' scale blocks ks, vs [L, S] ([S]); outputs for split j: o [Mp, D] f32 (unnormalised), l [Mp] f32 (row
    sums), m [Mp] f32 (row maxima)."""
    ks_ref, vs_ref, o_ref, l_ref, m_ref = rest if quant else (None, None, *rest)
    j = pl.program_id(1)
    mp, d = q_ref.shape
    seq = k_ref.shape[1 if stacked else 0]
    split_len = blocks_per_split * block_k
    pos, layer = pos_ref[0], pos_ref[1]
    last = jnp.minimum(pos + (t - 1), seq - 1)  # the last key any row needs
    start = j * split_len

    row_token = jnp.minimum(lax.broadcasted_iota(jnp.int32, (mp, 1), 0) // r, t - 1)  # [Mp, 1]; padding rows: T - 1
    row_limit = pos + row_token  # [Mp, 1]: row i sees keys <= pos + t_i

    o0 = jnp.zeros((mp, d), jnp.float32)
    l0 = jnp.zeros((mp,), jnp.float32)
    m0 = jnp.full((mp,), M_INIT, jnp.float32)

    def compute(state):
        q = q_ref[...]  # [Mp, D], stays in registers for the whole loop
        # Blocks of this split holding a position <= last (>= 1, as start <= last here).
        n_blocks = jnp.minimum(pl.cdiv(last + 1 - start, block_k), blocks_per_split)

        def body(b, carry):
            o_prev, l_prev, m_prev = carry
            first = pl.multiple_of(start + b * block_k, block_k)
            key_pos = first + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [BK, 1]
            in_range = key_pos <= last  # rows past the last needed position are not read
            rows = pl.ds(first, block_k)
            at = (layer, rows, slice(None)) if stacked else (rows, slice(None))
            k = plgpu.load(k_ref.at[at], mask=in_range, other=0).astype(q.dtype)  # [BK, D]
            v = plgpu.load(v_ref.at[at], mask=in_range, other=0).astype(q.dtype)  # [BK, D]
            s = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST)  # [Mp, BK] f32
            if quant:  # the int8 rows' scales, [BK] f32 (masked loads past `last`, as the rows)
                at_s = (layer, rows) if stacked else (rows,)
                in_range_1d = in_range.reshape(block_k)
                s = s * plgpu.load(ks_ref.at[at_s], mask=in_range_1d, other=0.0)[None, :]
            s = s * sm_scale
            visible = key_pos.reshape(1, block_k) <= row_limit  # [Mp, BK] causal mask
            s = jnp.where(visible, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [Mp]; stays M_INIT while a row sees nothing
            correction = jnp.exp(m_prev - m_next)  # [Mp]
            p = jnp.exp(s - m_next[:, None])  # [Mp, BK]; masked keys give exactly 0
            l_next = correction * l_prev + jnp.sum(p, axis=1)
            pv = p * plgpu.load(vs_ref.at[at_s], mask=in_range_1d, other=0.0)[None, :] if quant else p
            o_next = correction[:, None] * o_prev + plgpu.dot(pv.astype(q.dtype), v, precision=lax.Precision.HIGHEST)
            return o_next, l_next, m_next

        return lax.fori_loop(0, n_blocks, body, state)

    o, l, m = lax.cond(start > last, lambda state: state, compute, (o0, l0, m0))
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _block_k(seq: int, want: int) -> int:
    """The largest power of 2 <= want that divides seq; >= 16 (tl.dot), else a ValueError."""
    b = pow2_divisor(seq, want)
    if b is None:
        raise ValueError(f"decode_attention: the cache length S={seq} must be a multiple of {MIN_DOT} with block_k="
                         f"{want} (blocks are powers of 2 >= {MIN_DOT} dividing S); the kernel does not pad the cache")
    return b


@functools.partial(jax.jit, static_argnames=("block_k", "k_splits", "num_warps", "num_stages", "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
                     layer: jax.Array | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None, *, block_k: int = 64, k_splits: int | None = None,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """q [T, Nq, D], k_cache / v_cache [S, Nkv, D], pos int32 scalar -> out [T, Nq, D] (q.dtype). With `layer` (an
    int32 scalar, traced or not) the caches are the stacked [L, S, Nkv, D] arrays and layer `layer` is read, in
    place. k_scale / v_scale [S, Nkv] float32 ([L, S, Nkv] stacked): the caches are int8, value = int8 * scale.
    See the module docstring for the semantics and the kernel."""
    stacked = layer is not None
    quant = k_scale is not None
    t, nq, d = q.shape
    n_layers, seq, nkv, d_k = k_cache.shape if stacked else (1, *k_cache.shape)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: v_cache {v_cache.shape} must have k_cache's shape {k_cache.shape}")
    if quant != (v_scale is not None) or (quant and not (k_scale.shape == v_scale.shape == k_cache.shape[:-1])):
        raise ValueError(f"decode_attention: an int8 cache needs k_scale and v_scale of shape {k_cache.shape[:-1]}")
    if d_k != d:
        raise ValueError(f"decode_attention: head_dim of q ({d}) and of the cache ({d_k}) differ")
    if nq % nkv:
        raise ValueError(f"decode_attention: Nq={nq} is not a multiple of Nkv={nkv}")
    if d < MIN_DOT or d & (d - 1):
        raise ValueError(f"decode_attention: head_dim D={d} must be a power of 2 >= {MIN_DOT} (Triton blocks)")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"decode_attention: k_splits must be >= 1, got {k_splits}")
    r = nq // nkv
    bk = _block_k(seq, block_k)
    total_blocks = seq // bk
    blocks_per_split = _next_pow2(pl.cdiv(total_blocks, k_splits or auto_splits(nkv)))
    splits = pl.cdiv(total_blocks, blocks_per_split)
    mp = max(MIN_DOT, _next_pow2(t * r))

    # q is small ([T, Nq, D]): regroup it per kv head, row t * r + h', padded to Mp rows. The cache is not touched.
    qg = q.reshape(t, nkv, r, d).transpose(1, 0, 2, 3).reshape(nkv, t * r, d)
    qg = jnp.pad(qg, ((0, 0), (0, mp - t * r), (0, 0)))  # [Nkv, Mp, D]
    pos_arr = jnp.stack([jnp.asarray(pos, jnp.int32), jnp.asarray(0 if layer is None else layer, jnp.int32)])  # [2]

    kernel = functools.partial(_decode_attention_kernel, t=t, r=r, block_k=bk, blocks_per_split=blocks_per_split,
                               sm_scale=d ** -0.5, stacked=stacked, quant=quant)
    if stacked:  # kv head g's [L, S, D] view, read in place
        cache_spec = pl.BlockSpec((n_layers, seq, None, d), lambda g, j: (0, 0, g, 0))
        scale_spec = pl.BlockSpec((n_layers, seq, None), lambda g, j: (0, 0, g))
    else:  # kv head g's [S, D] view, read in place
        cache_spec = pl.BlockSpec((seq, None, d), lambda g, j: (0, g, 0))
        scale_spec = pl.BlockSpec((seq, None), lambda g, j: (0, g))
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quant else ()
    o, l, m = pl.pallas_call(
        kernel,
        grid=(nkv, splits),
        in_specs=[
            pl.BlockSpec((2,), lambda g, j: (0,)),
            pl.BlockSpec((None, mp, d), lambda g, j: (g, 0, 0)),
            cache_spec,
            cache_spec,
            *([scale_spec, scale_spec] if quant else []),
        ],
        out_specs=[
            pl.BlockSpec((None, None, mp, d), lambda g, j: (j, g, 0, 0)),
            pl.BlockSpec((None, None, mp), lambda g, j: (j, g, 0)),
            pl.BlockSpec((None, None, mp), lambda g, j: (j, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, nkv, mp, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((splits, nkv, mp), jnp.float32),  # l
            jax.ShapeDtypeStruct((splits, nkv, mp), jnp.float32),  # m
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(pos_arr, qg, k_cache, v_cache, *scales)

    # The final round of flash: rescale every split to the global row maximum and normalise.
    m_all = m.max(axis=0)  # [Nkv, Mp]
    m_all = lax.optimization_barrier(m_all)  # as decode_attn_unbatched (b/389925439)
    correction = jnp.exp(m - m_all[None])  # [splits, Nkv, Mp]; 0 for a split that saw nothing
    l_all = (l * correction).sum(axis=0)  # [Nkv, Mp] > 0 for every row (key 0 is visible to all)
    out = (o * correction[..., None]).sum(axis=0) / l_all[..., None]  # [Nkv, Mp, D] f32
    out = out[:, :t * r].reshape(nkv, t, r, d).transpose(1, 0, 2, 3).reshape(t, nq, d)
    return out.astype(q.dtype)


@jax.jit
def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
                               k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """model.attention's arithmetic from the GQA reshape to the output einsum (no wo): [T, Nq, D] in q.dtype.
    k_scale / v_scale [S, Nkv]: int8 caches, scaled as model._xla_attention does."""
    t, nq, d = q.shape
    nkv = k_cache.shape[1]
    positions = pos + jnp.arange(t, dtype=jnp.int32)
    qg = q.reshape(t, nkv, nq // nkv, d)  # head h uses kv head h // (Nq/Nkv), as transformers' repeat_kv
    scores = jnp.einsum("tgrd,sgd->tgrs", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32)
    if k_scale is not None:
        scores = scores * k_scale.astype(jnp.float32).T[None, :, None, :]  # [S, Nkv] -> [1, Nkv, 1, S]
    scores = scores * (d ** -0.5)
    key_pos = jnp.arange(k_cache.shape[0], dtype=jnp.int32)
    causal = key_pos[None, :] <= positions[:, None]  # [T, S]
    scores = jnp.where(causal[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if v_scale is not None:
        probs = probs * v_scale.astype(jnp.float32).T[None, :, None, :]
    return jnp.einsum("tgrs,sgd->tgrd", probs.astype(q.dtype), v_cache.astype(q.dtype)).reshape(t, nq, d)
