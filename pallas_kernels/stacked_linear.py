"""A window's dense products against weights stacked on a layer axis, read in place (no per-layer copy).

y = x @ concat_j(w_j[layer], axis=1):  x [T, K], w_j [L, K, N_j] (the model's [in, out] layout, stacked by
`weights.stack_layers`), layer an int32 scalar (traced inside the scanned layer body). Returns float32 [T, sum N_j]
(f32 accumulation; the caller rounds to the compute dtype where the XLA path's product does).

Why: in the scanned graph, XLA slices layer l's q/k/v/o matrices out of the stacks before each product, a copy of
every attention weight per layer (read + write + read again: ~20 us a layer at the Qwen3-30B-A3B shape on an H200).
This kernel reads the stacked arrays at the layer's offset directly, like the expert FFN kernel reads experts by slot.
Several matrices of one input (q, k, v) run in one launch: the output columns are cut into blocks over all of them.

Kernel: grid (column blocks over sum N_j, k_splits). Program (b, s) owns output columns b*BN.. (inside one w_j) and
the s-th share of K; it loops over its share in BK chunks, [Tp, BK] x [BK, BN] tl.dot per chunk (each weight row
segment of BN bf16 is contiguous), and writes its f32 partial [Tp, BN]. The wrapper sums the k_splits partials
(k_splits * Tp * N floats: small). T is padded to Tp = 16 (tl.dot's minimum; a power of 2 beyond that); with
reduce="sum" (T <= 4) each token's products are summed over the chunk instead (a GEMV a token; Tp is T's power of
2, so x is not copied for T = 1, 2, 4);
with reduce="acc" they are kept elementwise [BK, BN] a token across the loop and summed once at its end (no
reduction across the program's threads in the loop).
Every N_j must be a multiple of the column block and K of k_splits * BK (powers of 2, >= 16), else ValueError.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .blocks import MIN_DOT, REDUCE, block_or_error, kept_sums, pow2_divisor, split_sum, window_rows


def _stacked_linear_kernel(layer_ref, x_ref, *refs, block_n: int, block_k: int, k_per_split: int,
                           col_blocks: tuple[int, ...], sum_rows: int = 0, defer: bool = False, normed: bool = False,
                           eps: float = 0.0):
    """layer [1] int32; x [Tp, K] (or [1, K]: one token, its row put in a [Tp, BK] tile here, not padded in the
    graph); w_j [L, K, N_j] (whole, indexed in-kernel); normed: then a norm [L, K] (every layer's RMSNorm weights:
    x is the norm's input); out block [Tp, BN] f32."""
    w_refs, o_ref = refs[:-1], refs[-1]
    if normed:
        w_refs, norm_ref = w_refs[:-1], w_refs[-1]
    b, s = pl.program_id(0), pl.program_id(1)
    tp = o_ref.shape[0]
    rows = x_ref.shape[0]
    layer = layer_ref[0]
    precision = lax.Precision.HIGHEST  # float32 inputs: IEEE f32, not TF32 (bf16 is unaffected)
    inv = None
    if normed:  # as transformer.rms_norm: float32 mean of squares over the whole row, then per chunk below
        k_all = x_ref.shape[1]

        def squares(kk, acc):
            xs = x_ref[:, pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)].astype(jnp.float32)
            return acc + jnp.sum(xs * xs, axis=1, keepdims=True)

        total = lax.fori_loop(0, k_all // block_k, squares, jnp.zeros((rows, 1), jnp.float32))
        inv = lax.rsqrt(total / k_all + eps)  # [rows, 1]

    def x_tile(ks):
        """x's [Tp, BK] tile at columns ks: normed (x32 * inv, cast back, times the weight) and, for one token, its
        row in row 0 of a tile of zeros."""
        xs = x_ref[:, ks]  # [rows, BK]
        if normed:
            xs = norm_ref[layer, ks][None, :] * (xs.astype(jnp.float32) * inv).astype(xs.dtype)
        if rows < tp:
            at = lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
            xs = jnp.where(at == 0, jnp.broadcast_to(xs, (tp, xs.shape[1])), jnp.zeros((), xs.dtype))
        return xs

    def run(w_ref, first_block):
        cols = pl.ds(pl.multiple_of((b - first_block) * block_n, block_n), block_n)

        def body(k, acc):
            ks = pl.ds(pl.multiple_of(s * k_per_split + k * block_k, block_k), block_k)
            return acc + plgpu.dot(x_tile(ks), w_ref[layer, ks, cols], precision=precision)  # [Tp, BN]

        def body_sum(k, acc):  # reduce="sum": each of the window's sum_rows tokens a GEMV, no 16-row tl.dot
            ks = pl.ds(pl.multiple_of(s * k_per_split + k * block_k, block_k), block_k)
            w = w_ref[layer, ks, cols].astype(jnp.float32)  # [BK, BN]
            at = lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
            for r in range(sum_rows):
                y = jnp.sum(w * x_ref[r, ks].astype(jnp.float32)[:, None], axis=0)  # [BN]
                acc = acc + jnp.where(at == r, y[None, :], 0.0)
            return acc

        def body_acc(k, accs):  # reduce="acc": as "sum", the products kept [BK, BN] a token, summed once after
            ks = pl.ds(pl.multiple_of(s * k_per_split + k * block_k, block_k), block_k)
            w = w_ref[layer, ks, cols].astype(jnp.float32)  # [BK, BN]
            return tuple(a + w * x_ref[r, ks].astype(jnp.float32)[:, None] for r, a in enumerate(accs))

        steps = k_per_split // block_k
        if defer:
            o_ref[...] = kept_sums(lax.fori_loop(0, steps, body_acc, tuple(
                jnp.zeros((block_k, block_n), jnp.float32) for _ in range(sum_rows))), tp, axis=0)
        else:
            o_ref[...] = lax.fori_loop(0, steps, body_sum if sum_rows else body, jnp.zeros((tp, block_n), jnp.float32))

    first = 0
    for w_ref, n_blocks in zip(w_refs, col_blocks):  # the matrix that owns column block b
        pl.when((b >= first) & (b < first + n_blocks))(functools.partial(run, w_ref, first))
        first += n_blocks


# The knobs' defaults by window size, a decode window (T <= 4) and a wider one up to T = 16 ("qkv": the three
# products of one input; "o": one matrix); prefill chunks (T > 16: tiles of Tp rows) keep theirs. All one set today:
# the 2026-12-06 sweep at the Qwen3-30B-A3B shape on an H100 moved none by itself (reduce="sum" made q/k/v at T=1 13%
# faster, not yet backed by a generate-loop A/B: benchmarks/results/h200-2026-12-06g-sampling).
_KNOBS = dict(block_n=64, block_k=128, k_splits=4, num_warps=4, num_stages=3, reduce="dot")
# Folds into the dot form of a decode window, off until a generate-loop A/B backs them: "row" (a one-token window's
# x put in its tile in the kernel: no pad op in the graph), "norm" (the attention's input RMSNorm folded into the
# q/k/v product: no norm op). A kernel-sweep file's "fold:decode" row turns them on (tuning.py).
FOLD = {"decode": {"row": 0, "norm": 0}}
TUNING = {("qkv", "decode"): _KNOBS, ("qkv", "wide"): _KNOBS, ("o", "decode"): _KNOBS, ("o", "wide"): _KNOBS,
          "prefill": _KNOBS}


def tuning(t: int, matrices: int) -> dict:
    """The knobs' defaults for a window of t tokens over `matrices` weight stacks (TUNING)."""
    if t > MIN_DOT:
        return dict(TUNING["prefill"])
    return dict(TUNING[("qkv" if matrices > 1 else "o", "decode" if t <= 4 else "wide")])


def folds(t: int, matrices: int, what: str) -> bool:
    """Whether a window of t tokens over `matrices` stacks takes the fold `what` ("row", "norm"): on in FOLD and the
    window runs the dot form ("norm" needs "row" too at T=1, and T <= 16)."""
    if t > MIN_DOT or not FOLD["decode"][what] or (what == "norm" and t == 1 and not FOLD["decode"]["row"]):
        return False
    knobs = tuning(t, matrices)
    return knobs["reduce"] == "dot" or t > 4


def _pick(dim: int, want: int, what: str) -> int:
    return block_or_error(dim, want, "stacked_linear", what)


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k", "k_splits", "num_warps",
                                             "num_stages", "reduce", "sum_splits", "eps", "row_in_kernel"))
def stacked_linear(x: jax.Array, weights: tuple[jax.Array, ...], layer: jax.Array, *, interpret: bool = False,
                   block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   reduce: str | None = None, sum_splits: bool = True, norm: jax.Array | None = None,
                   eps: float = 0.0, row_in_kernel: bool = False) -> jax.Array:
    """x [T, K]; weights: a tuple of [L, K, N_j] arrays of x's dtype; layer: int32 scalar -> float32 [T, sum N_j].
    The layer index is a device value: not checked (0 <= layer < L is the caller's promise). reduce: "dot"
    (tl.dot over T padded to 16 rows), "sum" (T <= 4: a GEMV a token; wider windows take "dot") or "acc" ("sum"
    with the products kept elementwise and summed once after the loop). Knobs None:
    `tuning(T, len(weights))`'s. sum_splits=False: the kernel's float32 partials [k_splits, Tp, sum N_j] as they are
    (rows >= T padding), for a kernel that sums them itself (qkv_rope.py). norm [L, K] (every layer's RMSNorm
    weights, read at `layer`) with eps: x is the norm's input, normalised in the kernel as transformer.rms_norm does
    (dot form only). row_in_kernel: a one-token x goes in unpadded, its row put in the kernel's tile (dot form)."""
    t, k = x.shape
    weights = tuple(weights)
    given = dict(block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps, num_stages=num_stages,
                 reduce=reduce)
    knobs = {**tuning(t, len(weights)), **{n: v for n, v in given.items() if v is not None}}
    block_n, block_k, k_splits, num_warps, num_stages, reduce = (knobs[n] for n in given)
    if reduce not in REDUCE:
        raise ValueError(f"stacked_linear: reduce must be one of {REDUCE} (got {reduce!r})")
    if not weights or any(w.ndim != 3 or w.shape[:2] != weights[0].shape[:2] or w.shape[1] != k for w in weights):
        raise ValueError(f"stacked_linear: x {x.shape} and weights {[w.shape for w in weights]} do not match "
                         "x [T, K], w_j [L, K, N_j]")
    if any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"stacked_linear: x ({x.dtype}) and the weights ({[str(w.dtype) for w in weights]}) differ")
    bn = min(_pick(w.shape[2], block_n, "N") for w in weights)
    splits = max(1, k_splits)
    while splits > 1 and (k % splits or pow2_divisor(k // splits, block_k) is None):
        splits //= 2
    k_per_split = k // splits
    bk = _pick(k_per_split, block_k, "K / k_splits")
    col_blocks = tuple(w.shape[2] // bn for w in weights)
    n_total = sum(w.shape[2] for w in weights)
    gemv = reduce != "dot" and t <= 4
    if (norm is not None or row_in_kernel) and gemv:
        raise ValueError("stacked_linear: norm and row_in_kernel fold into the dot form only (reduce='dot' or T > 4)")
    if norm is not None and norm.shape != (weights[0].shape[0], k):
        raise ValueError(f"stacked_linear: norm {norm.shape} must be [L, K] = [{weights[0].shape[0]}, {k}]")
    tp = window_rows(t, gemv)  # a padded copy of x is an op of ~2 us on an H100 where the product takes ~10
    one_row = row_in_kernel and t == 1
    xp = x if tp == t or one_row else jnp.pad(x, ((0, tp - t), (0, 0)))  # [Tp, K] (or [1, K])
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    partials = pl.pallas_call(
        functools.partial(_stacked_linear_kernel, block_n=bn, block_k=bk, k_per_split=k_per_split,
                          col_blocks=col_blocks, sum_rows=t if gemv else 0, defer=reduce == "acc" and gemv,
                          normed=norm is not None, eps=eps),
        grid=(sum(col_blocks), splits),
        in_specs=[whole((1,)), whole(xp.shape), *[whole(w.shape) for w in weights],
                  *([] if norm is None else [whole(norm.shape)])],
        out_specs=pl.BlockSpec((None, tp, bn), lambda b, s: (s, 0, b)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n_total), jnp.float32),  # [k_splits, Tp, sum N_j]
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="stacked_linear",
    )(jnp.asarray(layer, jnp.int32).reshape(1), xp, *weights, *([] if norm is None else [norm]))
    return split_sum(partials, t) if sum_splits else partials  # [T, sum N_j]


def stacked_linear_reference(x: jax.Array, weights: tuple[jax.Array, ...], layer: jax.Array) -> jax.Array:
    """The XLA path: slice the layer out of each stack, one float32-accumulated product over the concatenation."""
    w = jnp.concatenate([lax.dynamic_index_in_dim(w_, layer, 0, keepdims=False) for w_ in weights], axis=1)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
