"""Block sizes for the Triton backend: every in-kernel array has a power-of-2 element count, and tl.dot needs every
dimension >= 16. And the GEMV kernels' reductions of a small window, shared by expert_ffn and stacked_linear."""
from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_DOT = 16  # tl.dot: every dimension >= 16
# How the GEMV kernels (expert_ffn, stacked_linear) reduce a window of T <= 4 tokens: tl.dot over T padded to
# MIN_DOT rows, each token's products summed over the chunk ("sum"), or kept elementwise and summed after the loop
REDUCE = ("dot", "sum", "acc")


def pow2_divisor(dim: int, want: int) -> int | None:
    """The largest power of 2 <= want that divides dim and is >= MIN_DOT; None when there is none."""
    b = 1 << (max(want, 1).bit_length() - 1)
    while b >= MIN_DOT and dim % b:
        b //= 2
    return b if b >= MIN_DOT else None


def block_or_error(dim: int, want: int, kernel: str, what: str) -> int:
    """pow2_divisor(dim, want), or a ValueError naming the kernel and the dimension: the kernels do not pad the
    (stacked, in-place) arrays they read."""
    b = pow2_divisor(dim, want)
    if b is None:
        raise ValueError(f"{kernel}: {what}={dim} must be a multiple of {MIN_DOT} (Triton blocks are powers of 2 "
                         f">= {MIN_DOT}); the kernel does not pad the stacked weights")
    return b


def kept_sums(kept, tp: int, axis: int):
    """The "acc" reduction's end: [Tp, BO] f32 whose row r < len(kept) is kept[r] (a tile's shape, the products of
    token r) summed over `axis` (its input dimension), the rows past them zero."""
    out = jnp.zeros((tp, kept[0].shape[1 - axis]), jnp.float32)
    at = jax.lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
    for r, a in enumerate(kept):
        out = out + jnp.where(at == r, jnp.sum(a, axis=axis)[None, :], 0.0)
    return out


def window_rows(t: int, gemv: bool) -> int:
    """The rows a window of t tokens runs as: tl.dot's (MIN_DOT, a power of 2 beyond), or for a GEMV a token (reduce
    sum / acc) t's power of 2, so x needs no padded copy for t = 1, 2, 4 (a separate op of the window's graph)."""
    rows = 1 << (t - 1).bit_length()
    return rows if gemv else max(MIN_DOT, rows)


def split_sum(partials, t: int):
    """A kernel's [splits, Tp, O] partials -> [t, O]: summed over the splits (one split: as it is, no op) and cut to
    the window's t rows (none to cut: no op)."""
    out = partials[0] if partials.shape[0] == 1 else partials.sum(axis=0)
    return out if out.shape[0] == t else out[:t]
