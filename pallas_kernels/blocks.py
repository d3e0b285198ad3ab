"""Block sizes for the Triton backend: every in-kernel array has a power-of-2 element count, and tl.dot needs every
dimension >= 16."""
from __future__ import annotations

MIN_DOT = 16  # tl.dot: every dimension >= 16


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
