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
