"""Window decode and prefill attention over the engine's KV cache, read in place and only up to the last filled
position.

Semantics (`decode_attention` and `decode_attention_reference`; the reference is `transformer.attention`'s arithmetic from
the GQA reshape to the output einsum, without the wo projection):

- q [T, Nq, D]: the window's (or prefill chunk's) T tokens (already RMS-normed and RoPE'd) at positions
  pos..pos+T-1; k_cache, v_cache [S, Nkv, D]: the engine's layout, the window's own keys/values already written at
  rows pos..pos+T-1; pos: int32 scalar (traced). Nq = r * Nkv; q head h uses kv head h // r (transformers'
  repeat_kv).
- scores[t, h, s] = (q[t, h] . k_cache[s, h // r]) * D**-0.5 in float32 (the cache cast to q.dtype first);
  causal mask: query token t sees keys s <= pos + t; softmax in float32; the probabilities cast to q.dtype;
  out[t, h] = sum_s probs[t, h, s] * v_cache[s, h // r] (f32 accumulation), cast to q.dtype.
- Rows s > pos + T - 1 are never read by the kernel (whatever they hold, NaN included, cannot reach the output).
  The engine keeps pos + T <= S; positions past S do not exist, so the kernel clamps its reads to S.
- T is any size: a decode / verify window (T <= 16) or a prefill chunk (T = 64..1024). Padding tokens of a chunk
  (past the engine's n_valid) are ordinary rows here: their outputs are computed and the caller ignores them.

Rounding: the kernel is flash attention (online softmax), so it casts the UNnormalised exp(score - running max) to
q.dtype before the p @ v dot and divides by the f32 row sum at the end, where the reference rounds the normalised
probabilities. In float32 the two agree to ~1e-7 relative; in bfloat16 to bf16 rounding (~1e-2 relative).

Kernel (flash decoding, as jax.experimental.pallas.ops.gpu.decode_attention's attn_forward_kernel, with row blocks):
- Rows: kv head g's query rows are its r query heads of all T tokens, row i = t * r + h' (T * r rows). They are
  cut into row_blocks blocks of Mp rows (the last one padded with zero rows); see Blocks for Mp.
- grid (Nkv * row_blocks, k_splits): program (g * row_blocks + b, j) takes row block b of kv head g as one [Mp, D]
  tile (rows b * Mp .. b * Mp + Mp - 1: tokens t0 = b * Mp // r .. t1 = min((b * Mp + Mp - 1) // r, T - 1)) and the
  j-th split of the cache positions [j * split_len, (j + 1) * split_len). A decode window has row_blocks = 1: grid
  (Nkv, k_splits), one tile of all T * r rows.
- The cache is read in place: k_cache / v_cache are passed whole, with a BlockSpec (S, None, D) per kv head g (the
  kv-head dim squeezed: a strided view, not a copy; no transpose of the cache anywhere). The kernel loads
  [block_k, D] chunks of it with a dynamic trip count: only the blocks up to the last position the program's rows
  need, last = min(pos + t1, S - 1) (causal: a chunk's later row blocks see more keys; for a single tile
  t1 = T - 1), and inside the last block the rows past `last` are masked loads (not read, zeros). A split that
  starts past `last` does no work (lax.cond) and writes m = -big, l = 0, o = 0.
- Per row: causal mask s <= pos + t (padding rows use t = T - 1), online-softmax state (m, l, o) in f32; each split
  writes its unnormalised o [Mp, D] f32 and its m, l [Mp] f32 per program. The wrapper combines the splits in jnp
  (the "final round of flash" of decode_attn_unbatched) and normalises: out = sum_j o_j e^(m_j - M) /
  sum_j l_j e^(m_j - M), M the max over the splits (a split that saw none of a row's keys has l = 0, o = 0 and
  m = -big for it: its weight e^(m_j - M) is 0). Key 0 is visible to every row, so the final row sum is never 0.

Blocks:
- block_k is the largest power of 2 <= the requested block_k that divides S, at least 16 (tl.dot), else a
  ValueError (S is context + prefill chunk in the engine, e.g. 2048 + 64 = 2112 = 64 * 33, so block_k = 64 there):
  every block then lies inside the cache, and nothing is padded.
- Rows (`_row_tiling`): Mp_1 = next_pow2(T * r), at least 16. block_m=None: one tile of Mp_1 rows when
  Mp_1 <= 128 (SINGLE_TILE_ROWS; every decode window: T <= 16 at r = 8, the grid and numbers of the single-tile
  kernel), else Mp = 64 (DEFAULT_BLOCK_M: an [Mp, D] q tile and f32 accumulator that fit 4 warps' registers at
  D = 128). block_m given: a power of 2 >= 16 (else a ValueError), Mp = min(block_m, Mp_1). row_blocks =
  ceil(T * r / Mp).
- Splits: a split is a power of 2 of blocks: blocks_per_split = next_pow2(ceil((S / block_k) / k_splits)), and the
  number of splits actually launched is ceil((S / block_k) / blocks_per_split) (the last split may be shorter; its
  loop simply ends at S). k_splits=None picks `auto_splits`: for one row block two waves of programs on the GPU's
  SMs, at least 16 (JAX's default); for several, only enough splits to top the Nkv * row_blocks programs up to two
  waves (often 1: each split costs an [Mp, D] f32 partial output to combine).

int8 caches (the engine's kv_dtype=int8): k_cache / v_cache int8 with k_scale / v_scale [S, Nkv] float32 (stacked:
[L, S, Nkv]), value = int8 * scale per (position, kv head). The kernel loads the int8 block and its [block_k]
scales in place and widens to q.dtype in registers (exact: |int8| <= 127); the K scales multiply the f32 scores,
the V scales the f32 exp(score - max) before its cast to q.dtype (the row sum l stays unscaled). The reference
does the same on the whole cache (scores times K scales; normalised probabilities times V scales, then the cast).

Batched windows (`batch_decode_attention` and `batch_decode_attention_reference`; model/batch.py, issue 38):
- q [B, Nq, D]: B sequences' one token each; k_cache, v_cache [R, S, Nkv, D]: a stack of R caches (the batch cache's
  (layer, slot) rows, layer l's slot s at row l*M + s); rows, pos [B] int32: batch row b's key and value are already
  written at cache row rows[b], position pos[b], and row b attends over keys 0..pos[b] of that cache row alone:
  decode_attention's semantics for a T=1 window at pos[b] over k_cache[rows[b]] (the reference gathers the B cache
  rows and runs one masked batched einsum).
- Kernel: one pallas_call for the batch, grid (B * Nkv, splits); program (b * Nkv + g, j) reads a [2] int32 block
  (rows[b], pos[b]), its [Mp, D] q tile (row b's r query heads of kv head g, zero-padded to Mp = max(16,
  next_pow2(r))), and kv head g's [R, S, D] view of the caches in place, at cache row rows[b], up to pos[b]: the
  same split loop as a single-tile decode window (`_split_attention`), so positions past pos[b] and every other
  cache row are never read. Splits: `auto_splits(B * Nkv)` (the (row, kv head) pairs counted as kv heads); a split
  past a row's position does no work. int8 caches as above, scales [R, S, Nkv].

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

from .blocks import MIN_DOT, pow2_divisor

DEFAULT_SPLITS = 16  # the least splits; on a GPU, auto_splits asks for two waves of programs
FORCE_SPLITS: int | None = None  # benchmarks only (decode_bench --attention_splits): k_splits=None uses this
SINGLE_TILE_ROWS = 128  # block_m=None: up to this many (padded) rows, one tile per kv head (every decode window)
DEFAULT_BLOCK_M = 64  # block_m=None above that (prefill chunks): rows per program


def auto_splits(nkv: int, row_blocks: int = 1) -> int:
    """k_splits=None: enough (kv head, row block, split) programs for two waves on the GPU's SMs.

    One row block (a decode window): at least DEFAULT_SPLITS, more when Nkv * 16 programs fill under two waves (a T=1
    window deep in the context has Nkv * splits programs; 4 kv heads x 16 splits filled under half of an H200's 132
    SMs). Several row blocks (a prefill chunk): the row blocks already give Nkv * row_blocks programs, so the splits
    only top them up to two waves (ceil(2 * SMs / (Nkv * row_blocks)), at least 1; off the GPU, where the SM count is
    unknown, ceil(DEFAULT_SPLITS / row_blocks)): every split adds an [Mp, D] f32 partial output to combine. Splits
    past a row block's last key do no work. FORCE_SPLITS (benchmarks) applies to single-tile calls only."""
    if FORCE_SPLITS and row_blocks == 1:
        return FORCE_SPLITS
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0) or 0) if jax.default_backend() == "gpu" else 0
    except Exception:
        sms = 0
    if row_blocks == 1:
        return max(DEFAULT_SPLITS, -(-2 * sms // nkv)) if sms else DEFAULT_SPLITS
    programs = 2 * sms if sms else DEFAULT_SPLITS * nkv
    return max(1, -(-programs // (nkv * row_blocks)))


M_INIT = float(jnp.finfo(jnp.float32).min)  # running max before any key: finite, so exp(M_INIT - m) is 0, never nan


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _decode_attention_kernel(pos_ref, q_ref, k_ref, v_ref, *rest, t: int, r: int, row_blocks: int, block_k: int,
                             blocks_per_split: int, sm_scale: float, stacked: bool, quant: bool):
    """Program (g * row_blocks + b, j). pos [2] int32 (position, layer); q block [Mp, D] (row block b of kv head g's
    rows); k, v blocks [L, S, D] (kv head g's strided view of the stacked cache, the layer picked in-kernel; [S, D]
    when not stacked); quant: then the int8 caches' scale blocks ks, vs [L, S] ([S]); outputs for split j: o [Mp, D]
    f32 (unnormalised), l [Mp] f32 (row sums), m [Mp] f32 (row maxima)."""
    ks_ref, vs_ref, o_ref, l_ref, m_ref = rest if quant else (None, None, *rest)
    j = pl.program_id(1)
    mp = q_ref.shape[0]
    seq = k_ref.shape[1 if stacked else 0]
    split_len = blocks_per_split * block_k
    pos, layer = pos_ref[0], pos_ref[1]
    if row_blocks == 1:  # one tile holds every row (a decode window)
        first_row, last_token = 0, t - 1
    else:  # row block b: rows b * Mp .. b * Mp + Mp - 1, tokens first_row // r .. last_token
        first_row = (pl.program_id(0) % row_blocks) * mp
        last_token = jnp.minimum((first_row + (mp - 1)) // r, t - 1)
    last = jnp.minimum(pos + last_token, seq - 1)  # the last key any row of this program needs
    start = j * split_len

    row = lax.broadcasted_iota(jnp.int32, (mp, 1), 0)  # [Mp, 1]: i = t * r + h'
    if row_blocks > 1:
        row = first_row + row
    row_token = jnp.minimum(row // r, t - 1)  # [Mp, 1]; padding rows: T - 1
    row_limit = pos + row_token  # [Mp, 1]: row i sees keys <= pos + t_i

    o, l, m = _split_attention(q_ref, k_ref, v_ref, ks_ref, vs_ref, layer, start, last, row_limit,
                               block_k=block_k, blocks_per_split=blocks_per_split, sm_scale=sm_scale,
                               stacked=stacked, quant=quant)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _split_attention(q_ref, k_ref, v_ref, ks_ref, vs_ref, layer, start, last, row_limit, *, block_k: int,
                     blocks_per_split: int, sm_scale: float, stacked: bool, quant: bool):
    """One program's split of the cache positions [start, start + split_len): flash attention of its [Mp, D] q tile
    over the blocks up to `last` (the last key any of its rows needs), row i seeing keys <= row_limit[i] ([Mp, 1], or
    a scalar for all rows) -> (o [Mp, D], l [Mp], m [Mp]) f32, o unnormalised. k_ref / v_ref: a kv head's [L, S, D]
    view read at `layer` (stacked) or its [S, D] view; ks_ref / vs_ref the int8 caches' scale views (quant)."""
    mp, d = q_ref.shape
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

    return lax.cond(start > last, lambda state: state, compute, (o0, l0, m0))


def _block_k(seq: int, want: int) -> int:
    """The largest power of 2 <= want that divides seq; >= 16 (tl.dot), else a ValueError."""
    b = pow2_divisor(seq, want)
    if b is None:
        raise ValueError(f"decode_attention: the cache length S={seq} must be a multiple of {MIN_DOT} with block_k="
                         f"{want} (blocks are powers of 2 >= {MIN_DOT} dividing S); the kernel does not pad the cache")
    return b


def _row_tiling(rows: int, block_m: int | None) -> tuple[int, int]:
    """T * r query rows of a kv head -> (Mp rows per program, row_blocks). Mp_1 = next_pow2(rows), at least 16.
    block_m=None: one tile of Mp_1 rows when Mp_1 <= SINGLE_TILE_ROWS (every decode window: today's grid), else
    DEFAULT_BLOCK_M rows per program. block_m given: a power of 2 >= 16; min(block_m, Mp_1) rows per program."""
    mp = max(MIN_DOT, _next_pow2(rows))
    if block_m is None:
        bm = mp if mp <= SINGLE_TILE_ROWS else DEFAULT_BLOCK_M
    elif block_m < MIN_DOT or block_m & (block_m - 1):
        raise ValueError(f"decode_attention: block_m={block_m} must be a power of 2 >= {MIN_DOT} (Triton blocks)")
    else:
        bm = min(block_m, mp)
    return bm, pl.cdiv(rows, bm)


@functools.partial(jax.jit, static_argnames=("block_k", "block_m", "k_splits", "num_warps", "num_stages",
                                             "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
                     layer: jax.Array | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None, *, block_k: int = 64, block_m: int | None = None,
                     k_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     interpret: bool = False) -> jax.Array:
    """q [T, Nq, D], k_cache / v_cache [S, Nkv, D], pos int32 scalar -> out [T, Nq, D] (q.dtype). With `layer` (an
    int32 scalar, traced or not) the caches are the stacked [L, S, Nkv, D] arrays and layer `layer` is read, in
    place. k_scale / v_scale [S, Nkv] float32 ([L, S, Nkv] stacked): the caches are int8, value = int8 * scale.
    block_m: query rows per program (None: one tile for a decode window, 64-row blocks for a prefill chunk; see
    `_row_tiling`). See the module docstring for the semantics and the kernel."""
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
    mp, nb = _row_tiling(t * r, block_m)
    bk = _block_k(seq, block_k)
    total_blocks = seq // bk
    blocks_per_split = _next_pow2(pl.cdiv(total_blocks, k_splits or auto_splits(nkv, nb)))
    splits = pl.cdiv(total_blocks, blocks_per_split)

    # q ([T, Nq, D], small beside the cache): regroup it per kv head, row t * r + h', padded to nb * Mp rows, row
    # block b of kv head g at [g * nb + b]. The cache is not touched.
    qg = q.reshape(t, nkv, r, d).transpose(1, 0, 2, 3).reshape(nkv, t * r, d)
    qg = jnp.pad(qg, ((0, 0), (0, nb * mp - t * r), (0, 0)))  # [Nkv, nb * Mp, D]
    if nb > 1:
        qg = qg.reshape(nkv * nb, mp, d)  # [Nkv * nb, Mp, D]
    pos_arr = jnp.stack([jnp.asarray(pos, jnp.int32), jnp.asarray(0 if layer is None else layer, jnp.int32)])  # [2]

    kernel = functools.partial(_decode_attention_kernel, t=t, r=r, row_blocks=nb, block_k=bk,
                               blocks_per_split=blocks_per_split, sm_scale=d ** -0.5, stacked=stacked, quant=quant)
    head = (lambda g: g) if nb == 1 else (lambda g: g // nb)  # program g * nb + b reads kv head g
    if stacked:  # kv head g's [L, S, D] view, read in place
        cache_spec = pl.BlockSpec((n_layers, seq, None, d), lambda g, j: (0, 0, head(g), 0))
        scale_spec = pl.BlockSpec((n_layers, seq, None), lambda g, j: (0, 0, head(g)))
    else:  # kv head g's [S, D] view, read in place
        cache_spec = pl.BlockSpec((seq, None, d), lambda g, j: (0, head(g), 0))
        scale_spec = pl.BlockSpec((seq, None), lambda g, j: (0, head(g)))
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quant else ()
    programs = nkv * nb  # the first grid axis: (kv head, row block), folded
    o, l, m = pl.pallas_call(
        kernel,
        grid=(programs, splits),
        in_specs=[
            pl.BlockSpec((2,), lambda g, j: (0,)),
            pl.BlockSpec((None, mp, d), lambda g, j: (g, 0, 0)),
            cache_spec,
            cache_spec,
            *([scale_spec, scale_spec] if quant else []),
        ],
        **_split_outputs(splits, programs, mp, d),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(pos_arr, qg, k_cache, v_cache, *scales)

    out = _combine_splits(o, l, m)  # [Nkv * nb, Mp, D] f32
    if nb > 1:
        out = out.reshape(nkv, nb * mp, d)
    out = out[:, :t * r].reshape(nkv, t, r, d).transpose(1, 0, 2, 3).reshape(t, nq, d)
    return out.astype(q.dtype)


def _split_outputs(splits: int, programs: int, mp: int, d: int) -> dict:
    """The pallas_call outputs of a split attention, grid (programs, splits): each program's partial o [Mp, D], row
    sums l and maxima m [Mp] per split, float32, for _combine_splits."""
    return dict(
        out_specs=[
            pl.BlockSpec((None, None, mp, d), lambda p, j: (j, p, 0, 0)),
            pl.BlockSpec((None, None, mp), lambda p, j: (j, p, 0)),
            pl.BlockSpec((None, None, mp), lambda p, j: (j, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, programs, mp, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((splits, programs, mp), jnp.float32),  # l
            jax.ShapeDtypeStruct((splits, programs, mp), jnp.float32),  # m
        ])


def _combine_splits(o: jax.Array, l: jax.Array, m: jax.Array) -> jax.Array:
    """The final round of flash: o [splits, P, Mp, D], l, m [splits, P, Mp] of P programs' splits -> [P, Mp, D] f32,
    every split rescaled to the global row maximum and normalised."""
    m_all = m.max(axis=0)  # [P, Mp]
    m_all = lax.optimization_barrier(m_all)  # as decode_attn_unbatched (b/389925439)
    correction = jnp.exp(m - m_all[None])  # [splits, P, Mp]; 0 for a split that saw nothing
    l_all = (l * correction).sum(axis=0)  # [P, Mp] > 0 for every row (key 0 is visible to all)
    return (o * correction[..., None]).sum(axis=0) / l_all[..., None]


@jax.jit
def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
                               k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """transformer.attention's arithmetic from the GQA reshape to the output einsum (no wo): [T, Nq, D] in q.dtype.
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


# Batched windows (model/batch.py, issue 38): B sequences' T=1 rows, each over its own row of a stacked cache.

def _batch_decode_attention_kernel(meta_ref, q_ref, k_ref, v_ref, *rest, block_k: int, blocks_per_split: int,
                                   sm_scale: float, quant: bool):
    """Program (b * Nkv + g, j). meta [2] int32 (batch row b's cache row, its position); q block [Mp, D] (batch row
    b's r query heads of kv head g, zero-padded); k, v blocks [R, S, D] (kv head g's strided view of the stacked
    cache, the cache row picked in-kernel); quant: the scale blocks ks, vs [R, S]; outputs for split j as
    _decode_attention_kernel's."""
    ks_ref, vs_ref, o_ref, l_ref, m_ref = rest if quant else (None, None, *rest)
    cache_row, pos = meta_ref[0], meta_ref[1]
    last = jnp.minimum(pos, k_ref.shape[1] - 1)  # one token: every q row sees keys 0..pos
    start = pl.program_id(1) * (blocks_per_split * block_k)
    o, l, m = _split_attention(q_ref, k_ref, v_ref, ks_ref, vs_ref, cache_row, start, last, last,
                               block_k=block_k, blocks_per_split=blocks_per_split, sm_scale=sm_scale,
                               stacked=True, quant=quant)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("block_k", "k_splits", "num_warps", "num_stages", "interpret"))
def batch_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: jax.Array, pos: jax.Array,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, *, block_k: int = 64,
                           k_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           interpret: bool = False) -> jax.Array:
    """q [B, Nq, D]: B sequences' one token each; k_cache / v_cache [R, S, Nkv, D] stacked caches (the batch cache's
    R = L*M (layer, slot) rows); rows, pos [B] int32: batch row b attends over cache row rows[b], keys 0..pos[b]
    (its key already written at pos[b]) -> out [B, Nq, D] (q.dtype). k_scale / v_scale [R, S, Nkv] float32: int8
    caches. One kernel for the batch: grid (B * Nkv, splits), program (b * Nkv + g, j) reads only cache row rows[b]'s
    kv head g, in place, up to pos[b]. See the module docstring ("Batched windows")."""
    quant = k_scale is not None
    b, nq, d = q.shape
    n_rows, seq, nkv, d_k = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"batch_decode_attention: v_cache {v_cache.shape} must have k_cache's shape {k_cache.shape}")
    if quant != (v_scale is not None) or (quant and not (k_scale.shape == v_scale.shape == k_cache.shape[:-1])):
        raise ValueError(f"batch_decode_attention: an int8 cache needs k_scale and v_scale of shape "
                         f"{k_cache.shape[:-1]}")
    if rows.shape != (b,) or pos.shape != (b,):
        raise ValueError(f"batch_decode_attention: rows {rows.shape} and pos {pos.shape} must be [B] = ({b},)")
    if d_k != d:
        raise ValueError(f"batch_decode_attention: head_dim of q ({d}) and of the cache ({d_k}) differ")
    if nq % nkv:
        raise ValueError(f"batch_decode_attention: Nq={nq} is not a multiple of Nkv={nkv}")
    if d < MIN_DOT or d & (d - 1):
        raise ValueError(f"batch_decode_attention: head_dim D={d} must be a power of 2 >= {MIN_DOT} (Triton blocks)")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"batch_decode_attention: k_splits must be >= 1, got {k_splits}")
    r = nq // nkv
    mp = max(MIN_DOT, _next_pow2(r))  # one tile: a row's r query heads of a kv head
    bk = _block_k(seq, block_k)
    total_blocks = seq // bk
    # B * Nkv programs a split: auto_splits counts the (batch row, kv head) pairs as it counts kv heads
    blocks_per_split = _next_pow2(pl.cdiv(total_blocks, k_splits or auto_splits(b * nkv)))
    splits = pl.cdiv(total_blocks, blocks_per_split)
    programs = b * nkv

    qg = jnp.pad(q.reshape(b, nkv, r, d), ((0, 0), (0, 0), (0, mp - r), (0, 0))).reshape(programs, mp, d)
    meta = jnp.stack([rows.astype(jnp.int32), pos.astype(jnp.int32)], axis=1)  # [B, 2]: (cache row, position)

    kernel = functools.partial(_batch_decode_attention_kernel, block_k=bk, blocks_per_split=blocks_per_split,
                               sm_scale=d ** -0.5, quant=quant)
    cache_spec = pl.BlockSpec((n_rows, seq, None, d), lambda p, j: (0, 0, p % nkv, 0))  # kv head's [R, S, D] view
    scale_spec = pl.BlockSpec((n_rows, seq, None), lambda p, j: (0, 0, p % nkv))
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quant else ()
    o, l, m = pl.pallas_call(
        kernel,
        grid=(programs, splits),
        in_specs=[
            pl.BlockSpec((None, 2), lambda p, j: (p // nkv, 0)),
            pl.BlockSpec((None, mp, d), lambda p, j: (p, 0, 0)),
            cache_spec,
            cache_spec,
            *([scale_spec, scale_spec] if quant else []),
        ],
        **_split_outputs(splits, programs, mp, d),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="batch_decode_attention",
    )(meta, qg, k_cache, v_cache, *scales)
    out = _combine_splits(o, l, m)  # [B * Nkv, Mp, D] f32
    return out.reshape(b, nkv, mp, d)[:, :, :r].reshape(b, nq, d).astype(q.dtype)


@jax.jit
def batch_decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: jax.Array,
                                     pos: jax.Array, k_scale: jax.Array | None = None,
                                     v_scale: jax.Array | None = None) -> jax.Array:
    """batch_decode_attention in plain jnp: each batch row's cache row gathered ([B, S, Nkv, D]), one masked
    batched einsum (row b sees keys <= pos[b]), decode_attention_reference's arithmetic per row."""
    b, nq, d = q.shape
    nkv = k_cache.shape[2]
    k_rows, v_rows = k_cache[rows], v_cache[rows]  # [B, S, Nkv, D]
    qg = q.reshape(b, nkv, nq // nkv, d)
    scores = jnp.einsum("bgrd,bsgd->bgrs", qg, k_rows.astype(q.dtype), preferred_element_type=jnp.float32)
    if k_scale is not None:
        scores = scores * k_scale[rows].astype(jnp.float32).transpose(0, 2, 1)[:, :, None, :]  # [B, Nkv, 1, S]
    scores = scores * (d ** -0.5)
    visible = jnp.arange(k_cache.shape[1], dtype=jnp.int32)[None, :] <= pos[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if v_scale is not None:
        probs = probs * v_scale[rows].astype(jnp.float32).transpose(0, 2, 1)[:, :, None, :]
    return jnp.einsum("bgrs,bsgd->bgrd", probs.astype(q.dtype), v_rows.astype(q.dtype)).reshape(b, nq, d)
