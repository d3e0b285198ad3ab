"""One dense product of a window's rows, `x [T, in] @ w [in, out]`, as every projection of the model runs it.

At T = 1 the row is padded to two (a zero row, behind an optimization barrier so XLA cannot fold it away) and the
first row kept: XLA:GPU otherwise rewrites a one-row product into a multiply and a reduction, which ran the attention
projections at 97 us a layer against 52 us for the padded GEMM on an H200 (`python -m benchmarks.dense_bench`,
Qwen3-30B-A3B shape; T = 2 takes 49 us). The extra row costs no weight bytes, which is all a decode step pays for.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [T, in] @ w [in, out] -> [T, out] (in `preferred_element_type` when given, else the product's dtype)."""
    if x.shape[0] != 1:
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
    x2 = jax.lax.optimization_barrier(jnp.concatenate([x, jnp.zeros_like(x)]))  # [2, in]
    return jnp.matmul(x2, w, preferred_element_type=preferred_element_type)[:1]
