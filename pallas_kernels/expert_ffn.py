"""The window's SwiGLU experts for decode, read in place from the stacked slot array (no gather copy).

out[t] = sum_n combine[t, n] * bf16(down_n @ bf16(silu(g) * u)),  g = bf16(gate_n x_t), u = bf16(up_n x_t)
(f32 accumulation in every matmul and in the weighted sum; the roundings are the XLA path's, `moe.expert_ffn`).

`moe.resident_experts` gathers the window's experts (`gate[ids]`, ...) before its einsums: XLA materialises that
copy, so each expert's bytes cross HBM three times (read, write, read). Decode is bound by those bytes; these
kernels index the [S, I, H] / [S, H, I] arrays by slot inside the kernel, so every expert is read once per window.

Two Triton kernels (the down projection needs every I row of h, which a gate/up program does not own):
  1. gate/up, grid (N, I / block_i): program (n, j) reads rows j*block_i.. of expert n's gate and up, looping over
     H in block_k chunks, and writes h[n, :, j-block] = bf16(silu(g) * u) for all (padded) tokens.
  2. down, grid (H / block_h, n_split): program (b, s) owns output columns b*block_h.. and the s-th share of the
     experts; per expert it reduces over I in block_i_down chunks, rounds the expert's output to bf16, weights it
     by combine[:, n] and accumulates in f32. The n_split partial sums are added by XLA (n_split * Tp * H floats).
Padding slots (-1) are skipped in both kernels: they read nothing and contribute nothing.
With reduce="sum" (bf16 experts, T <= 4) both loops skip tl.dot, which pads the window to 16 rows: each token's
products with the tile are summed over the chunk (a GEMV a token), f32 as the dot's accumulation; with reduce="acc"
they are kept elementwise, a tile's shape a token, and summed once after the loop (no reduction across the
program's threads in the loop).

int8 experts (issue 16: `strata_jax/model/quant.py`'s "int8", symmetric per output channel): gate/up/down hold int8
q and gate_scale/up_scale [R, I], down_scale [R, H] their rows' scales. The kernels read q (a quarter of the
float32 bytes, half of bf16's), widen each tile to bf16 in registers (exact: |q| <= 127), accumulate the dot in
f32 and scale the result per output row before the bf16 rounding: g = bf16(scale_g * (x . q_g)), and so on. The
reference states that order; the XLA path and the host pool follow it, so int8 experts too give the same rows
wherever they run.

int4 experts ("int4" / "int4-g32": symmetric, one bf16 scale per g = 64 or 32 inputs, packed as GGUF's Q4_0: in
each group byte j holds input j in its low nibble and input j + g/2 in its high one, q + 8): gate/up [S, I, H/2] and
down [S, H, I/2] uint8 with group-major scales [R, H/g, I] and [R, I/g, H] (a group's scales for a block of rows are
one contiguous load). The loops step one group at a time: the low nibbles
widened to bf16 (q in -8..7, exact) are dotted with the group's first g/2 inputs, the high ones with its last g/2,
and the group's f32
partial sum is scaled by its scale before it joins the accumulator: sum_g s_g (x_g . q_g), the float32 dot with
the exactly dequantized weights up to summation order (the reference's arithmetic).

int4-q4k experts (GGUF Q4_K's blocks, `strata_jax/model/quant.py` "int4-q4k": w = s q - mn, q in 0..15, packed
as int4 groups of 32): the scale arrays are uint16 codes, group-major [R, 5G/4, O] (G = In/32 groups: rows 0..G-1
each group's sc | m << 6, then each 256-input super-block's fp16 d, then its dmin). The loops step groups of 32 as
int4's do and decode the group's s = d sc and mn = dmin m in registers (exact in float32); the group adds
s (x_g . (q - 8)) + (8 s - mn) sum(x_g), the dot with the exactly dequantized weights up to float32 rounding.

int2-q2k experts (GGUF Q2_K's blocks, `strata_jax/model/quant.py` "int2-q2k": w = s q - mn, q in 0..3, four a
byte: in each chunk of 64 inputs byte b holds inputs b, b + 16, b + 32, b + 48 at shifts 0, 2, 4, 6): gate/up
[S, I, H/4], down [S, H, I/4] uint8 with uint8 codes, group-major [R, 5G/4, O] (G = In/16: rows 0..G-1 each group's
sc | m << 4, then each super-block's fp16 d as two rows, low byte first, then its dmin likewise). The loops step
groups of 16: group k is chunk k/4's 16 bytes shifted by 2 (k % 4), its crumbs widened to bf16 (exact) and dotted
with the group's 16 inputs; the group adds s (x_g . q) - mn sum(x_g) with s and mn decoded in registers (exact).

int6-q6k experts (GGUF Q6_K's blocks, `strata_jax/model/quant.py` "int6-q6k": w = s (q - 32), q in 0..63, no
minimum; quant.pack_int6: per chunk of 64 inputs 48 bytes, 32 of low nibbles in int4's packing of groups of 32, then
16 of high 2-bit pairs in int2-q2k's order): gate/up [S, I, 3H/4], down [S, H, 3I/4] uint8 with uint8 codes,
group-major [R, 9G/8, O] (G = In/16: rows 0..G-1 each group's int8 sc, then each super-block's fp16 d as two rows,
low byte first). The loops step groups of 16 as int2-q2k's: group k (s = k % 4 of chunk k/4) is the nibbles of bytes
16 (s >> 1) .. + 15 shifted by 4 (s & 1), or'd with the pairs of bytes 32 .. 47 shifted by 2 s, moved up by 4; q - 32
widened to bf16 (exact) and dotted with the group's inputs; the group adds s (x_g . (q - 32)), s = d sc in registers.
int6-q6km experts (`strata_jax/model/quant.py` "int6-q6km": a family of mixed GGUF K types, values unchanged:
w = s (q - 32) - mn): int6-q6k's q with uint8 codes [R, 9G/4, O] (rows 0..G-1 each group's int8 sc, G..2G-1 its uint8
m, then each super-block's fp16 d as two rows, then its dmin likewise); the group adds s (x_g . (q - 32))
- mn sum(x_g), s = d sc and mn = dmin m in registers, as int2-q2k's minima.

int8-g experts and int4 with float32 scales (GGUF types kept as read, `strata_jax/model/quant.py` "int8-g32",
"int8-g16", "int8-g32m", "int8-g16m", "int4-g32f", "int4-g32m"): w = s q (- mn) per group of g inputs (16 or 32),
s and mn float32. int8-g: gate/up/down int8 as int8's, with group-major scales [R, H/g, I], [R, H/g, I],
[R, I/g, H]; with minima one more axis: [R, 2, H/g, I] (scales, then minima). The loops step groups: the group's
q widened to bf16 (exact: |q| <= 128) dotted with its g inputs, times s, minus mn sum(x_g); int4 with minima adds
(8 s - mn) sum(x_g) to s (x_g . (q - 8)). The scales' rank and dtype say the form (`_scale_form`).

Per-family formats (issue 36: a Q4_K_M GGUF's Q4_K gate/up beside its Q6_K down, each kept as read): gate and up
share one format, down may hold another (both quantized); the gate/up kernel takes gate/up's dtype, scales and
form, the down kernel down's (`_family_form`), so e.g. int4-q4k codes feed the first and int8-g16 scales the second.

Where the scales are: program n (the window's expert n) reads its weights at row slot_ids[n] and its scales at row
scale_ids[n] of the scale arrays ([R, ...], read in place like the weights). scale_ids defaults to slot_ids: the
scales stored row for row beside the weights (the resident experts, [E, ...] or stacked [L*E, ...], R = S). The
offloaded path's slots keep only q (the scales stay on the device by expert id), and the scanned offload graph's
slot arrays are every layer's stacked [L*(S+1), ...] while a layer's scales are [E, ...]: it passes the scales of
the window's experts gathered by window position ([N, ...], `sc[expert_ids]`) with scale_ids = arange(N), which
serves resident, fetched and staged experts alike at any slot base. Padding slots (-1) read no scale either.

Triton constraints: every block is a power of 2 and tl.dot needs dims >= 16, so T is padded to Tp = 16 (a power of
2 >= T beyond that) and H and I must be multiples of 16 (each block is the largest power of 2 <= the requested size
that divides its dimension). Other H or I are rejected with a ValueError: padding them would mean copying the
stacked weights, which is what this kernel exists to avoid.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .blocks import MIN_DOT, REDUCE, block_or_error, kept_sums, split_sum, window_rows

# GGUF block forms: storage, format name, codes dtype, inputs per group, code rows per 8 groups (the codes [R, rows, O])
BLOCK_FORMS = {"q4k": ("int4", "int4-q4k", jnp.uint16, 32, 10), "q2k": ("int2", "int2-q2k", jnp.uint8, 16, 10),
               "q6k": ("int6", "int6-q6k", jnp.uint8, 16, 9), "q6km": ("int6", "int6-q6km", jnp.uint8, 16, 18)}
STORED = {"int4": (1, 2), "int2": (1, 4), "int6": (3, 4)}  # bytes a weight, as a fraction: packed width = in * a / b
INT8_GROUPS = (32, 16)  # int8-g inputs per scale (GGUF Q8_0 / Q5_K: 32; Q6_K / Q3_K / Q2_K: 16)
GROUPS = (128, 64, 32)  # int4 inputs per scale (strata_jax/model/quant.py "int4-g128", "int4", "int4-g32"): from the scales' shape


def _int4_group(x_at, w_ref, slot, rows, k, group: int):
    """Group k's f32 partial product [Tp, BO] of int4 rows `rows` of w (group/2 packed bytes each: low nibbles the
    group's first half of inputs, high its second) with x_at(cols) [Tp, group/2], the activations of those inputs."""
    half = group // 2
    packed = w_ref[slot, rows, pl.ds(k * half, half)].astype(jnp.int32)  # [BO, group/2]
    lo = ((packed & 0xF) - 8).astype(jnp.float32).astype(jnp.bfloat16)  # q in -8..7: exact in bf16
    hi = ((packed >> 4) - 8).astype(jnp.float32).astype(jnp.bfloat16)
    x_lo, x_hi = x_at(pl.ds(k * group, half)), x_at(pl.ds(k * group + half, half))
    return plgpu.dot(x_lo, lo, trans_b=True) + plgpu.dot(x_hi, hi, trans_b=True)  # [Tp, BO]


def _shifted(w_ref, slot, rows, start, shift, mask: int):
    """(16 bytes from `start` of rows `rows` >> shift) & mask, int32 [BO, 16]: a 16-input group's bit field."""
    return (w_ref[slot, rows, pl.ds(start, 16)].astype(jnp.int32) >> shift) & mask


def _group_dot(x_at, k, group: int, q):
    """x_at(group k's inputs) [Tp, group] . q [BO, group] int32 (|q| <= 32: exact in bf16) -> [Tp, BO] f32."""
    return plgpu.dot(x_at(pl.ds(k * group, group)), q.astype(jnp.float32).astype(jnp.bfloat16), trans_b=True)


def _int2_group(x_at, w_ref, slot, rows, k, group: int):
    """Group k's f32 partial product [Tp, BO] of int2-q2k rows `rows` of w (group 16: chunk k // 4's 16 bytes,
    shifted by 2 (k % 4)) with x_at(cols) [Tp, 16], the activations of its inputs."""
    # k & 3, not k % 4: Triton's lowering of a traced mod mistypes it (i1)
    return _group_dot(x_at, k, group, _shifted(w_ref, slot, rows, (k // 4) * 16, 2 * (k & 3), 3))  # q in 0..3


def _int6_group(x_at, w_ref, slot, rows, k, group: int):
    """Group k's f32 partial product [Tp, BO] of int6-q6k rows `rows` of w (group 16, s = k % 4 of chunk k // 4's
    48 bytes: low nibbles bytes 16 (s >> 1) .. + 15 shifted by 4 (s & 1), high pairs bytes 32 .. 47 shifted by 2 s)
    with x_at(cols) [Tp, 16]: q - 32 in -32..31 decoded in registers, so no sum(x) term."""
    chunk = (k // 4) * 48
    lo = _shifted(w_ref, slot, rows, chunk + 16 * ((k >> 1) & 1), 4 * (k & 1), 15)
    hi = _shifted(w_ref, slot, rows, chunk + 32, 2 * (k & 3), 3)
    return _group_dot(x_at, k, group, (lo | (hi << 4)) - 32)


def _block_scale(codes_ref, srow, grp, rows, groups: int, form: str):
    """int4-q4k / int2-q2k / int6-q6k(m): group grp's scale s and the factor of sum(x_g) [1, BO] f32 (int6-q6k: None)
    for rows `rows`, from the codes [R, 5G/4, O] (int4-q4k: uint16, 8 s - mn; int2-q2k: uint8, d and dmin two rows
    each, -mn), [R, 9G/8, O] (int6-q6k: uint8, each group's int8 sc, then d two rows; s = d sc) or [R, 9G/4, O]
    (int6-q6km: int8 sc, uint8 m, then d and dmin two rows each; s = d sc, -mn = -dmin m)."""
    q4k = form == "q4k"
    code = codes_ref[srow, grp, rows].astype(jnp.int32)
    if q4k:
        at, bits = lambda first: first + grp // 8, 6
        half = lambda row: codes_ref[srow, row, rows]
    else:  # fp16 bits from a low and a high byte row
        at, bits = lambda first: first + 2 * (grp // 16), 4
        half = lambda row: (codes_ref[srow, row, rows].astype(jnp.int32)
                            | (codes_ref[srow, row + 1, rows].astype(jnp.int32) << 8)).astype(jnp.uint16)
    fp16 = lambda row: jax.lax.bitcast_convert_type(half(row), jnp.float16).astype(jnp.float32)
    if form in ("q6k", "q6km"):  # sc a signed byte
        first = 2 * groups if form == "q6km" else groups  # the d rows, after sc (and m)
        scale = (fp16(at(first)) * (code - ((code & 128) << 1)).astype(jnp.float32))[None, :]
        if form == "q6k":
            return scale, None
        m = codes_ref[srow, groups + grp, rows].astype(jnp.float32)
        return scale, (-(fp16(at(first + groups // 8)) * m))[None, :]
    d, dmin = fp16(at(groups)), fp16(at(groups + groups // 8))
    scale = d * (code & ((1 << bits) - 1)).astype(jnp.float32)
    minimum = dmin * (code >> bits).astype(jnp.float32)
    return scale[None, :], ((8.0 * scale - minimum) if q4k else -minimum)[None, :]


def _int8_group(x_at, w_ref, slot, rows, k, group: int):
    """Group k's f32 partial product [Tp, BO] of int8 rows `rows` of w with x_at(cols) [Tp, group]."""
    w = w_ref[slot, rows, pl.ds(k * group, group)].astype(jnp.bfloat16)  # [BO, group]: exact
    return plgpu.dot(x_at(pl.ds(k * group, group)), w, trans_b=True)


def _group_scale(s_ref, srow, grp, rows, groups: int, form: str, int4: bool):
    """Group grp's scale [1, BO] f32 and the factor of sum(x_g) [1, BO] (None: no such term) for rows `rows`:
    int4's s (x . (q - 8)) + (8 s - mn) sum(x), int8's s (x . q) - mn sum(x)."""
    if form in BLOCK_FORMS:
        return _block_scale(s_ref, srow, grp, rows, groups, form)
    if form == "group_min":  # [R, 2, G, O] float32: scales, then minima
        scale = s_ref[srow, 0, grp, rows].astype(jnp.float32)
        minimum = s_ref[srow, 1, grp, rows].astype(jnp.float32)
        return scale[None, :], ((8.0 * scale - minimum) if int4 else -minimum)[None, :]
    return s_ref[srow, grp, rows].astype(jnp.float32)[None, :], None


# a group's product by storage
_PRODUCTS = {"int4": _int4_group, "int2": _int2_group, "int6": _int6_group, "int8": _int8_group}


def _x_sum(x_at, k, group: int):
    """sum(x_g) [Tp, 1] f32 over group k's inputs."""
    return jnp.sum(x_at(pl.ds(k * group, group)).astype(jnp.float32), axis=1, keepdims=True)


def _row_sums(w, v_at, rows: int, tp: int):
    """The "sum" reduction: [Tp, BO] f32 with row r < rows the products of w [BO, BK] (f32) with v_at(r) [BK]
    summed over BK (a GEMV a token, no 16-row padding of a tl.dot), rows past `rows` zero."""
    out = jnp.zeros((tp, w.shape[0]), jnp.float32)
    at = jax.lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
    for r in range(rows):
        out = out + jnp.where(at == r, jnp.sum(w * v_at(r).astype(jnp.float32)[None, :], axis=1)[None, :], 0.0)
    return out


def _gate_up_kernel(ids_ref, x_ref, gate_ref, up_ref, *refs, block_k: int, quantized: str | None, group: int,
                    form: str | None = None, sum_rows: int = 0, defer: bool = False):
    """ids [Np] int32; x [Tp, H] bf16; gate/up [S, I, H] bf16 or int8, or [S, I, H/2] int4 (whole arrays, indexed
    by slot); quantized ("int8" / "int4"): then scale ids [Np] and gate/up scales [R, I] / [R, H/g, I] (indexed by
    scale id); h block [Tp, BI]."""
    sids_ref, gs_ref, us_ref, h_ref = refs if quantized else (None, None, None, refs[0])
    n, j = pl.program_id(0), pl.program_id(1)
    tp, bi = h_ref.shape
    hidden = x_ref.shape[1]
    slot = ids_ref[n]
    rows = pl.ds(j * bi, bi)

    @pl.when(slot >= 0)  # padding: h is never read (the down kernel skips it too)
    def _():
        srow = sids_ref[n] if quantized else None  # the expert's row of the scale arrays

        def body_grouped(k, carry):  # block_k / group groups per step, each scaled as it is added
            g, u = carry
            product = _PRODUCTS[quantized]
            for j in range(block_k // group):
                grp = k * (block_k // group) + j
                x_at = lambda c: x_ref[:, c]
                g_scale, g_bias = _group_scale(gs_ref, srow, grp, rows, hidden // group, form, quantized == "int4")
                u_scale, u_bias = _group_scale(us_ref, srow, grp, rows, hidden // group, form, quantized == "int4")
                g += product(x_at, gate_ref, slot, rows, grp, group) * g_scale
                u += product(x_at, up_ref, slot, rows, grp, group) * u_scale
                if g_bias is not None:  # minima: their term over the group's sum of x
                    xs = _x_sum(x_at, grp, group)
                    g += xs * g_bias
                    u += xs * u_bias
            return g, u

        def body_sum(k, carry):  # reduce="sum": bf16 weights, the window's sum_rows tokens one GEMV each
            g, u = carry
            cols = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
            wg, wu = (w_ref[slot, rows, cols].astype(jnp.float32) for w_ref in (gate_ref, up_ref))  # [BI, BK]
            x_at = lambda r: x_ref[r, cols]
            return g + _row_sums(wg, x_at, sum_rows, tp), u + _row_sums(wu, x_at, sum_rows, tp)

        def body_acc(k, carry):  # reduce="acc": "sum"'s products kept [BI, BK] a token, summed once after the loop
            cols = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
            wg, wu = (w_ref[slot, rows, cols].astype(jnp.float32) for w_ref in (gate_ref, up_ref))  # [BI, BK]
            xs = [x_ref[r, cols].astype(jnp.float32)[None, :] for r in range(sum_rows)]
            return (tuple(a + wg * x for a, x in zip(carry[0], xs)), tuple(a + wu * x for a, x in zip(carry[1], xs)))

        def body(k, carry):
            g, u = carry
            cols = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
            xk = x_ref[:, cols]  # [Tp, BK]
            wg, wu = gate_ref[slot, rows, cols], up_ref[slot, rows, cols]  # [BI, BK]
            if quantized:  # int8 -> bf16 in registers (exact)
                wg, wu = wg.astype(jnp.bfloat16), wu.astype(jnp.bfloat16)
            g += plgpu.dot(xk, wg, trans_b=True)  # [Tp, BK] x [BI, BK]^T -> [Tp, BI] f32
            u += plgpu.dot(xk, wu, trans_b=True)
            return g, u

        zero = jnp.zeros((tp, bi), jnp.float32)
        if defer:
            kept = tuple(jnp.zeros((bi, block_k), jnp.float32) for _ in range(sum_rows))
            g, u = (kept_sums(a, tp, axis=1) for a in jax.lax.fori_loop(0, hidden // block_k, body_acc, (kept, kept)))
        else:
            g, u = jax.lax.fori_loop(0, hidden // block_k, body_grouped if group else body_sum if sum_rows else body,
                                     (zero, zero))
        if form == "row":  # each output row's scale, before the rounding below
            g = g * gs_ref[srow, rows].astype(jnp.float32)[None, :]
            u = u * us_ref[srow, rows].astype(jnp.float32)[None, :]
        # The XLA path's einsums return bf16 g and u; round them the same way before the SwiGLU.
        g = g.astype(jnp.bfloat16).astype(jnp.float32)
        u = u.astype(jnp.bfloat16).astype(jnp.float32)
        h_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)  # silu(g) * u, [Tp, BI]


def _down_kernel(ids_ref, h_ref, down_ref, *refs, block_i: int, per_split: int, quantized: str | None, group: int,
                 form: str | None = None, sum_rows: int = 0, defer: bool = False):
    """ids [Np]; h [Np, Tp, I] bf16; down [S, H, I] bf16 or int8, or [S, H, I/2] int4 (whole); quantized: then
    scale ids [Np] and down scales [R, H] (int8) or [R, I/g, H] (int4); comb [Np, Tp] f32; out block [Tp, BH] f32."""
    sids_ref, ds_ref, comb_ref, out_ref = refs if quantized else (None, None, *refs)
    b, s = pl.program_id(0), pl.program_id(1)
    tp, bh = out_ref.shape
    inter = h_ref.shape[2]
    cols = pl.ds(b * bh, bh)

    def expert(e, acc):
        n = s * per_split + e
        slot = ids_ref[n]

        def contribute(acc):
            srow = sids_ref[n] if quantized else None  # the expert's row of the scale arrays

            def body_grouped(k, y):
                product = _PRODUCTS[quantized]
                for j in range(block_i // group):
                    grp = k * (block_i // group) + j
                    h_at = lambda c: h_ref[n, :, c]
                    d_scale, d_bias = _group_scale(ds_ref, srow, grp, cols, inter // group, form, quantized == "int4")
                    y += product(h_at, down_ref, slot, cols, grp, group) * d_scale
                    if d_bias is not None:
                        y += _x_sum(h_at, grp, group) * d_bias
                return y

            def body_sum(k, y):  # reduce="sum": the window's sum_rows tokens one GEMV each
                ik = pl.ds(pl.multiple_of(k * block_i, block_i), block_i)
                return y + _row_sums(down_ref[slot, cols, ik].astype(jnp.float32), lambda r: h_ref[n, r, ik],
                                     sum_rows, tp)

            def body(k, y):
                ik = pl.ds(pl.multiple_of(k * block_i, block_i), block_i)
                w = down_ref[slot, cols, ik]  # [BH, BI]
                if quantized:
                    w = w.astype(jnp.bfloat16)
                # [Tp, BI] x [BH, BI]^T -> [Tp, BH] f32
                return y + plgpu.dot(h_ref[n, :, ik], w, trans_b=True)

            def body_acc(k, kept):  # reduce="acc": "sum"'s products kept [BH, BI] a token, summed after the loop
                ik = pl.ds(pl.multiple_of(k * block_i, block_i), block_i)
                w = down_ref[slot, cols, ik].astype(jnp.float32)  # [BH, BI]
                return tuple(a + w * h_ref[n, r, ik].astype(jnp.float32)[None, :] for r, a in enumerate(kept))

            if defer:
                y = kept_sums(jax.lax.fori_loop(0, inter // block_i, body_acc, tuple(
                    jnp.zeros((bh, block_i), jnp.float32) for _ in range(sum_rows))), tp, axis=1)
            else:
                y = jax.lax.fori_loop(0, inter // block_i, body_grouped if group else body_sum if sum_rows else body,
                                      jnp.zeros((tp, bh), jnp.float32))
            if form == "row":
                y = y * ds_ref[srow, cols].astype(jnp.float32)[None, :]
            y = y.astype(jnp.bfloat16).astype(jnp.float32)  # each expert's output rounded to bf16, as the XLA path
            return acc + comb_ref[n, :][:, None] * y  # [Tp, 1] * [Tp, BH]

        return jax.lax.cond(slot >= 0, contribute, lambda a: a, acc)

    out_ref[...] = jax.lax.fori_loop(0, per_split, expert, jnp.zeros((tp, bh), jnp.float32))


def _scale_form(quantized: str | None, scales: tuple, in_dim: int = 0) -> str | None:
    """How the scales are held: "row" (int8, [R, O]), "group" ([R, G, O]), "group_min" ([R, 2, G, O] float32:
    scales, then minima), "q4k" (int4-q4k's uint16 codes [R, 5G/4, O]), "q2k" (int2-q2k's uint8 codes), "q6k" /
    "q6km" (int6's uint8 codes [R, 9G/8, O] / [R, 9G/4, O], G = in_dim / 16: told apart by their rows, other rows
    refused by the shape check as q6k's); None for bf16 experts."""
    if not quantized:
        return None
    if quantized in ("int2", "int6") or any(sc.dtype == jnp.uint16 for sc in scales):
        form = {"int2": "q2k", "int6": "q6k"}.get(quantized, "q4k")
        storage, name, dtype = BLOCK_FORMS[form][:3]
        if quantized != storage or any(sc.dtype != dtype for sc in scales):
            raise ValueError(f"expert_ffn: {name} experts take {jnp.dtype(dtype).name} codes for the scales of a "
                             "whole family")
        if form == "q6k" and scales[0].ndim == 3 and scales[0].shape[1] * 64 == 9 * in_dim:
            return "q6km"  # minima's rows
        return form
    ranks = {sc.ndim for sc in scales}
    if len(ranks) != 1 or scales[0].ndim not in ((2, 3, 4) if quantized == "int8" else (3, 4)):
        raise ValueError(f"expert_ffn: {quantized} scales of ranks {[sc.ndim for sc in scales]} (int8: [R, O] per "
                         "row, [R, G, O] per group, [R, 2, G, O] with minima; int4: the last two)")
    return {2: "row", 3: "group", 4: "group_min"}[scales[0].ndim]


def _family_form(quantized: str | None, scales: tuple, in_dim: int, out_dim: int, what: str) -> tuple:
    """(form, group) of one family's matrices (gate and up, or down) of `in_dim` inputs: `_scale_form`'s form and the
    inputs per scale (0: per row, or bf16); ValueError where the kernel does not take them."""
    form = _scale_form(quantized, scales, in_dim)
    if form in BLOCK_FORMS:
        if in_dim % 256 or out_dim % 256:
            raise ValueError(f"expert_ffn: {BLOCK_FORMS[form][1]} experts need H and I multiples of 256 (got {what} "
                             f"inputs {in_dim}, outputs {out_dim})")
        return form, BLOCK_FORMS[form][3]
    if form in ("group", "group_min"):  # the group: inputs per scale, from the scales' shape
        groups = scales[0].shape[-2]
        group = in_dim // groups if groups else 0
        allowed = GROUPS if quantized == "int4" else INT8_GROUPS
        if group not in allowed or in_dim % group or out_dim % group:
            raise ValueError(f"expert_ffn: {quantized} experts with group scales need groups of "
                             f"{' or '.join(map(str, allowed))} inputs dividing H and I (got {what} inputs {in_dim}, "
                             f"outputs {out_dim}, scale {scales[0].shape})")
        if quantized == "int4" and form == "group_min" and scales[0].dtype != jnp.float32:
            raise ValueError("expert_ffn: int4 experts with minima take float32 scales")
        return form, group
    return form, 0


def _name_tail(quantized: str | None, form: str | None) -> str:
    if not quantized:
        return ""
    tails = {"row": "", "group": "", "group_min": "_min", **{f: f"_{f}" for f in BLOCK_FORMS}}
    return f"_{quantized}" + tails[form] + (
        "_g" if quantized == "int8" and form != "row" else "")


def _block(dim: int, want: int, what: str) -> int:
    """The largest power of 2 <= want that divides dim; >= 16 (tl.dot), else a ValueError."""
    return block_or_error(dim, want, "expert_ffn", what)


# The knobs' defaults: bf16 experts by window size, a decode window (T <= 4) and a wider one up to T = 16 (verify and
# batched windows: T pads to 16 rows either way); prefill chunks (T > 16: tiles of Tp rows) and quantized experts
# (issue 16: their loops step groups, not tiles) keep theirs. All one set today: the 2026-12-06 sweep at the
# Qwen3-30B-A3B shape on an H100 moved none (benchmarks/results/h200-2026-12-06g-sampling); a row changes where a
# sweep and a generate-loop A/B say so.
_KNOBS = dict(block_i=32, block_k=256, block_h=32, block_i_down=256, n_split=4, num_warps=4, num_stages=3,
              reduce="dot")
TUNING = {"decode": _KNOBS, "wide": _KNOBS, "prefill": _KNOBS}


def tuning(t: int, quantized: bool = False) -> dict:
    """The knobs' defaults for a window of t tokens (TUNING)."""
    return dict(TUNING["prefill" if quantized or t > MIN_DOT else "decode" if t <= 4 else "wide"])


@functools.partial(jax.jit, static_argnames=("interpret", "block_i", "block_k", "block_h", "block_i_down",
                                             "n_split", "num_warps", "num_stages", "reduce"))
def expert_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, slot_ids: jax.Array,
               combine: jax.Array, gate_scale: jax.Array | None = None, up_scale: jax.Array | None = None,
               down_scale: jax.Array | None = None, scale_ids: jax.Array | None = None, *, interpret: bool = False,
               block_i: int | None = None, block_k: int | None = None, block_h: int | None = None,
               block_i_down: int | None = None, n_split: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, reduce: str | None = None) -> jax.Array:
    """x [T, H] bf16; gate, up [S, I, H]; down [S, H, I]; slot_ids [N] int32 (-1 = padding); combine [T, N] f32.
    Returns [T, H] float32. Slot ids must be < S (a device value: not checked). T <= 16 costs the same as T = 16.
    int8 experts: gate/up/down int8 with gate_scale, up_scale [R, I] and down_scale [R, H] (float32 or bf16).
    int4 experts: gate/up [S, I, H/2], down [S, H, I/2] uint8 with group-major gate_scale, up_scale [R, H/g, I] and
    down_scale [R, I/g, H], g = 128, 64 or 32 inputs per scale; int4-q4k: the scales uint16 codes [R, 5H/128, I],
    [R, 5H/128, I], [R, 5I/128, H] (H and I multiples of 256); int2-q2k: gate/up [S, I, H/4], down [S, H, I/4]
    with uint8 codes [R, 5H/64, I], [R, 5H/64, I], [R, 5I/64, H]; int6-q6k: gate/up [S, I, 3H/4], down
    [S, H, 3I/4] with uint8 codes [R, 9H/128, I], [R, 9H/128, I], [R, 9I/128, H]; int6-q6km: int6-q6k's q with
    codes [R, 9H/64, I], [R, 9H/64, I], [R, 9I/64, H].
    scale_ids [N] int32: expert n's row of the scale arrays (< R, not checked), read where slot_ids[n] >= 0; None:
    slot_ids (the scales row for row beside the weights, R = S). Scales gathered for the window ([N, ...]) take
    scale_ids = arange(N).

    Tuning (static): block_i rows of I per gate/up program, block_k the H chunk of its loop; block_h output columns
    per down program, block_i_down its I chunk, n_split the programs sharing the experts of one column block;
    num_warps / num_stages for both kernels; reduce "dot" (tl.dot over T padded to 16 rows), "sum" (bf16
    experts, T <= 4: each token's products summed over the chunk, a GEMV a token; quantized experts and wider
    windows take "dot") or "acc" ("sum" with the products kept elementwise, summed once after the loop); None:
    `tuning(T)`'s. Blocks shrink to a power of 2 dividing their dimension."""
    t, hidden = x.shape
    s, inter, _ = gate.shape
    n = slot_ids.shape[0]
    kinds = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "int4"}
    quantized, quantized_down = kinds.get(jnp.dtype(gate.dtype)), kinds.get(jnp.dtype(down.dtype))
    # uint8 codes: int2-q2k's q, four a byte, or int6-q6k's (quant.pack_int6: 48 bytes per 64 inputs)
    blocks = lambda w, sc, width: ("int6" if w.shape[-1] * 4 == 3 * width else "int2") if (
        sc is not None and sc.dtype == jnp.uint8) else "int4"
    quantized = blocks(gate, gate_scale, hidden) if quantized == "int4" else quantized
    quantized_down = blocks(down, down_scale, inter) if quantized_down == "int4" else quantized_down
    floats = {gate.dtype, up.dtype, down.dtype} == {jnp.dtype(jnp.bfloat16)}
    if x.dtype != jnp.bfloat16 or up.dtype != gate.dtype or not (floats or (quantized and quantized_down)):
        raise ValueError(f"expert_ffn: x must be bfloat16 and the experts all bfloat16, or quantized (int8, or int4 "
                         f"as uint8; gate/up one format, down its own) (got x {x.dtype}, gate {gate.dtype}, up "
                         f"{up.dtype}, down {down.dtype})")
    per, per_down = (STORED.get(q, (1, 1)) for q in (quantized, quantized_down))  # bytes a weight (a, b): a / b
    if (gate.shape != (s, inter, hidden * per[0] // per[1]) or up.shape != gate.shape
            or down.shape != (s, hidden, inter * per_down[0] // per_down[1])):
        over = lambda d, ab: (f"{ab[0]}" if ab[0] > 1 else "") + d + (f"/{ab[1]}" if ab[1] > 1 else "")
        raise ValueError(f"expert_ffn: shapes x {x.shape}, gate {gate.shape}, up {up.shape}, down {down.shape} do "
                         f"not match x [T, H], gate/up [S, I, {over('H', per)}], down [S, H, {over('I', per_down)}]")
    scales = (gate_scale, up_scale, down_scale)
    if bool(quantized) != all(sc is not None for sc in scales) or (not quantized and any(sc is not None for sc in scales)):
        raise ValueError("expert_ffn: int8 and int4 experts take gate_scale, up_scale and down_scale (bf16 ones none)")
    if scale_ids is not None and (not quantized or scale_ids.shape != slot_ids.shape):
        raise ValueError(f"expert_ffn: scale_ids {scale_ids.shape} go with quantized experts, one per slot id "
                         f"{slot_ids.shape}")
    # Each family's own format (issue 36's per-family formats: a Q4_K_M file's Q4_K gate/up beside Q6_K down): the
    # gate/up kernel reads gate/up's, the down kernel down's.
    form, group = _family_form(quantized, (gate_scale, up_scale), hidden, inter, "gate/up")
    form_down, group_down = _family_form(quantized_down, (down_scale,), inter, hidden, "down")
    if quantized:
        r = gate_scale.shape[0] if scale_ids is not None else s  # scale rows: the weights' own unless scale_ids
        want = []
        for f, g, (out_dim, in_dim) in ((form, group, (inter, hidden)),) * 2 + ((form_down, group_down,
                                                                                  (hidden, inter)),):
            rows = BLOCK_FORMS[f][4] * (in_dim // g) // 8 if f in BLOCK_FORMS else in_dim // max(g, 1)  # a matrix's
            want.append((r, out_dim) if f == "row" else ((r, 2) if f == "group_min" else (r,)) + (rows, out_dim))
        if tuple(sc.shape for sc in scales) != tuple(want):
            raise ValueError(f"expert_ffn: scales {gate_scale.shape}, {up_scale.shape}, {down_scale.shape} do not "
                             f"match gate/up {want[0]}, down {want[2]}")
    if combine.shape != (t, n):
        raise ValueError(f"expert_ffn: combine {combine.shape} is not [T, N] = {(t, n)}")
    given = dict(block_i=block_i, block_k=block_k, block_h=block_h, block_i_down=block_i_down, n_split=n_split,
                 num_warps=num_warps, num_stages=num_stages, reduce=reduce)
    knobs = {**tuning(t, bool(quantized)), **{k: v for k, v in given.items() if v is not None}}
    block_i, block_k, block_h, block_i_down, n_split, num_warps, num_stages, reduce = (knobs[k] for k in given)
    if reduce not in REDUCE:
        raise ValueError(f"expert_ffn: reduce must be one of {REDUCE} (got {reduce!r})")
    sum_rows = t if reduce != "dot" and t <= 4 and not quantized and not quantized_down else 0
    defer = reduce == "acc" and sum_rows > 0
    bi, bk = _block(inter, block_i, "I"), _block(hidden, block_k, "H")
    bh, bid = _block(hidden, block_h, "H"), _block(inter, block_i_down, "I")
    bk, bid = max(bk, group), max(bid, group_down)  # the loops step whole groups (0: not grouped)
    tp = window_rows(t, gemv=sum_rows > 0)
    splits = max(1, min(n_split, n))
    per_split = -(-n // splits)
    np_ = per_split * splits  # N padded with -1 slots so each split has the same count
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    ids = jnp.pad(slot_ids.astype(jnp.int32), (0, np_ - n), constant_values=-1)  # [Np]
    sids = ()  # quantized: [Np] scale rows (padding's never read)
    if quantized:
        sids = (jnp.pad((slot_ids if scale_ids is None else scale_ids).astype(jnp.int32), (0, np_ - n)),)
    xp = x if tp == t else jnp.pad(x, ((0, tp - t), (0, 0)))  # [Tp, H]
    # Padding experts and padding tokens weigh 0; transposed so an expert's weights are one contiguous row.
    comb = jnp.where(slot_ids[None, :] >= 0, combine.astype(jnp.float32), 0.0)
    comb = jnp.pad(comb, ((0, tp - t), (0, np_ - n))).T  # [Np, Tp]

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # the full array, indexed in-kernel
    gu_scales = (*sids, gate_scale, up_scale) if quantized else ()
    h = pl.pallas_call(  # gate/up in their family's format
        functools.partial(_gate_up_kernel, block_k=bk, quantized=quantized, group=group, form=form,
                          sum_rows=sum_rows, defer=defer),
        grid=(np_, inter // bi),
        in_specs=[whole((np_,)), whole((tp, hidden)), whole(gate.shape), whole(up.shape),
                  *(whole(sc.shape) for sc in gu_scales)],
        out_specs=pl.BlockSpec((None, tp, bi), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((np_, tp, inter), jnp.bfloat16),  # [Np, Tp, I]
        compiler_params=params, interpret=interpret, name="expert_ffn_gate_up" + _name_tail(quantized, form),
    )(ids, xp, gate, up, *gu_scales)

    d_scales = (*sids, down_scale) if quantized else ()
    partials = pl.pallas_call(  # down in its own
        functools.partial(_down_kernel, block_i=bid, per_split=per_split, quantized=quantized_down,
                          group=group_down, form=form_down, sum_rows=sum_rows, defer=defer),
        grid=(hidden // bh, splits),
        in_specs=[whole((np_,)), whole(h.shape), whole(down.shape), *(whole(sc.shape) for sc in d_scales),
                  whole(comb.shape)],
        out_specs=pl.BlockSpec((None, tp, bh), lambda b, sp: (sp, 0, b)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, hidden), jnp.float32),  # [n_split, Tp, H]
        compiler_params=params, interpret=interpret, name="expert_ffn_down" + _name_tail(quantized_down, form_down),
    )(ids, h, down, *d_scales, comb)
    return split_sum(partials, t)  # [T, H]


def expert_ffn_reference(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, slot_ids: jax.Array,
                         combine: jax.Array, gate_scale: jax.Array | None = None, up_scale: jax.Array | None = None,
                         down_scale: jax.Array | None = None, scale_ids: jax.Array | None = None) -> jax.Array:
    """The XLA path's arithmetic (`moe.expert_ffn` on gathered weights, written out here so that the kernel's file
    stands alone), padding slots zero-weighted. [T, H] f32.
    int8 experts: each product accumulated in f32 over the widened q, scaled per output row, then rounded; int4
    experts: each product the f32 dot with the exactly dequantized weights, then rounded. Scales at rows scale_ids
    (None: slot_ids), as the kernel."""
    ids = jnp.maximum(slot_ids, 0)  # [N]: padding reads slot 0 ...
    combine = jnp.where(slot_ids[None, :] >= 0, combine, 0.0)  # ... with weight 0
    if gate_scale is None:
        g = jnp.einsum("th,nih->nti", x, gate[ids])  # [N, T, I] bf16
        u = jnp.einsum("th,nih->nti", x, up[ids])
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)  # rounded once
        y = jnp.einsum("nti,nhi->nth", h, down[ids])  # [N, T, H] bf16
        return jnp.einsum("tn,nth->th", combine, y.astype(jnp.float32))
    rows = ids if scale_ids is None else jnp.maximum(scale_ids, 0)  # [N] scale rows
    g = _scaled_product_reference("th,nih->nti", x, gate[ids], gate_scale[rows])
    u = _scaled_product_reference("th,nih->nti", x, up[ids], up_scale[rows])
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)  # rounded once
    y = _scaled_product_reference("nti,nhi->nth", h, down[ids], down_scale[rows])
    return jnp.einsum("tn,nth->th", combine, y.astype(jnp.float32))


def _scaled_product_reference(spec: str, a: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """einsum(spec, a, w) for quantized w, in float32, rounded to a's dtype: int8 q [N, O, In] with row scales
    [N, O] (the product over q widened, times the scale); int4 packed q [N, O, In/2] (byte j of a group: inputs j
    and j + g/2, as GGUF's Q4_0) with group-major scales [N, In/g, O], dequantized exactly in float32; int4-q4k:
    uint16 codes [N, 5G/4, O] (G = In/32), w = d sc q - dmin m, exact in float32; int2-q2k: q [N, O, In/4] with
    uint8 codes [N, 5G/4, O] (G = In/16, d and dmin two rows each), likewise; int6-q6k: q [N, O, 3In/4] (48 bytes
    per 64 inputs: 32 of low nibbles, 16 of high pairs) with uint8 codes [N, 9G/8, O] (int8 sc, then d two rows),
    w = d sc (q - 32), likewise; int6-q6km: codes [N, 9G/4, O] (int8 sc, uint8 m, then d and dmin two rows each),
    w = d sc (q - 32) - dmin m."""
    if q.dtype == jnp.uint8 and scale.dtype == jnp.uint8 and 3 * q.shape[-1] in (32 * scale.shape[1],
                                                                                 16 * scale.shape[1]):  # int6
        minima = 3 * q.shape[-1] == 16 * scale.shape[1]  # int6-q6km
        n, o, width = q.shape
        groups = width * 4 // 3 // 16
        sc = scale[:, :groups].astype(jnp.int32)
        sc = (sc - ((sc & 128) << 1)).astype(jnp.float32)  # [N, G, O]: int8
        r = scale[:, (2 if minima else 1) * groups:].astype(jnp.int32)
        halves = jax.lax.bitcast_convert_type((r[:, 0::2] | (r[:, 1::2] << 8)).astype(jnp.uint16), jnp.float16)
        halves = jnp.repeat(halves.astype(jnp.float32), 16, 1)  # [N, G (2G), O]: d (, then dmin)
        s = halves[:, :groups] * sc  # [N, G, O]
        mn = halves[:, groups:] * scale[:, groups:2 * groups].astype(jnp.float32) if minima else jnp.zeros_like(s)
        p = q.reshape(n, o, width // 48, 48).astype(jnp.int32)
        lo = jnp.concatenate([p[..., :16] & 0xF, p[..., :16] >> 4, p[..., 16:32] & 0xF, p[..., 16:32] >> 4], -1)
        hi = ((p[..., None, 32:] >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(n, o, -1, 64)
        w = ((lo | (hi << 4)) - 32).reshape(n, o, groups, 16).astype(jnp.float32) * jnp.swapaxes(s, 1, 2)[..., None]
        w = w - jnp.swapaxes(mn, 1, 2)[..., None]  # (int6-q6k: - 0, the same values)
        acc = jnp.einsum(spec, a.astype(jnp.float32), w.reshape(n, o, -1), precision=jax.lax.Precision.HIGHEST)
        return acc.astype(a.dtype)
    if q.dtype == jnp.uint8 and scale.dtype in (jnp.uint16, jnp.uint8):
        q4k = scale.dtype == jnp.uint16
        n, o, _ = q.shape
        groups = scale.shape[1] * 4 // 5
        code = scale[:, :groups].astype(jnp.int32)  # [N, G, O]
        halves = scale[:, groups:].astype(jnp.int32)  # [N, G/4, O]: d, then dmin (int2-q2k: low, high bytes)
        halves = halves if q4k else halves[:, 0::2] | (halves[:, 1::2] << 8)
        halves = jax.lax.bitcast_convert_type(halves.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
        nb, bits = halves.shape[1] // 2, 6 if q4k else 4
        s = jnp.repeat(halves[:, :nb], groups // nb, 1) * (code & ((1 << bits) - 1)).astype(jnp.float32)
        mn = jnp.repeat(halves[:, nb:], groups // nb, 1) * (code >> bits).astype(jnp.float32)
        if q4k:
            p = q.reshape(n, o, groups, 16).astype(jnp.int32)  # [N, O, G, 16]
            w = jnp.concatenate([p & 0xF, p >> 4], axis=-1)  # [N, O, G, 32]: q in 0..15
        else:
            p = q.reshape(n, o, groups // 4, 1, 16).astype(jnp.int32)  # [N, O, chunks, 1, 16]
            w = ((p >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(n, o, groups, 16)  # q in 0..3
        w = w.astype(jnp.float32) * jnp.swapaxes(s, 1, 2)[..., None] - jnp.swapaxes(mn, 1, 2)[..., None]
        w = w.reshape(n, o, -1)
        acc = jnp.einsum(spec, a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return acc.astype(a.dtype)
    if scale.ndim == 4 or (q.dtype == jnp.int8 and scale.ndim == 3):  # float32 groups: s q (- mn), exact
        minima = scale.ndim == 4
        s = jnp.swapaxes(scale[:, 0] if minima else scale, 1, 2).astype(jnp.float32)  # [N, O, G]
        n, o, width = q.shape
        groups = s.shape[-1]
        if q.dtype == jnp.uint8:
            p = q.reshape(n, o, groups, -1).astype(jnp.int32)
            v = jnp.concatenate([p & 0xF, p >> 4], axis=-1) - (0 if minima else 8)  # [N, O, G, g]
        else:
            v = q.reshape(n, o, groups, -1)
        w = v.astype(jnp.float32) * s[..., None]
        if minima:
            w = w - jnp.swapaxes(scale[:, 1], 1, 2).astype(jnp.float32)[..., None]
        acc = jnp.einsum(spec, a.astype(jnp.float32), w.reshape(n, o, -1), precision=jax.lax.Precision.HIGHEST)
        return acc.astype(a.dtype)
    if q.dtype == jnp.uint8:
        n, o, half = q.shape
        groups = scale.shape[1]
        p = q.reshape(n, o, groups, -1).astype(jnp.int32)  # [N, O, G, g/2]
        w = (jnp.concatenate([p & 0xF, p >> 4], axis=-1) - 8).astype(jnp.float32)  # [N, O, G, g]
        w = (w * jnp.swapaxes(scale, 1, 2).astype(jnp.float32)[..., None]).reshape(n, o, 2 * half)
        acc = jnp.einsum(spec, a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return acc.astype(a.dtype)
    acc = jnp.einsum(spec, a, q.astype(a.dtype), preferred_element_type=jnp.float32)  # [N, T, O]
    return (acc * scale.astype(jnp.float32)[:, None, :]).astype(a.dtype)
