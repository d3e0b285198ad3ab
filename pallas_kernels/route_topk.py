"""The exact router's top-K as one Pallas kernel: softmax over a token's E router logits, its K largest
probabilities (ties: the lower expert index first, as `jax.lax.top_k`), renormalised when norm_topk_prob, rounded to
the model dtype and zeroed on padding rows, as `strata_jax.model.moe.make_route` takes them.

XLA runs the same steps as a softmax fusion, a sort of the E probabilities (its top_k at K=8 of 128 is a sort:
~3.3 us of a ~100 us layer on an H100) and the fusions around them; here one program per token does it in
registers (K rounds of a masked max, `select`), and the window's route is one launch. Measured on an H100 (24
layers of the 30B shape, T=1): the kernel takes 3.3 us, as long as XLA's sort alone, and the window 0.3% less op time
(benchmarks/results/h100-2026-12-07c-route): not the engine's default (route_kernel=xla). All experts ranked at
once ([Ep, Ep] comparisons, four reductions) took 54 us a launch: registers spilled.

Semantics (`route_topk` and `route_topk_reference` agree exactly on ids, on weights to float rounding, as the two
softmaxes' exp and sum may round differently in their last bit):
- logits [T, E] float32 (finite), valid [T] bool -> ids [T, K] int32 (E on padding rows), weights [T, K] float32
  (0 on padding rows), ordered by probability, descending.
- The pieces shared with the route prior (pallas_kernels/route_prior.py): `next_pow2`, `PAD_LOGIT`, `select`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

PAD_LOGIT = -1e30  # padded experts' logit: finite (no inf - inf), and masked out of every selection anyway


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def select(score, avail, iota_e, rounds: int, k_pad: int, values=None):
    """`rounds` rounds of: the available expert of largest score (lowest index among equal maxima), then mark it taken.

    score, avail, iota_e: [1, Ep]. The index picked in round r goes to slot r of ids [1, Kp], and values[idx]
    (when values [1, Ep] is given; else 0) to slot r of picked_values [1, Kp]. A fori_loop, not a Python loop: one
    loop body to compile whatever K is. (A Pallas Triton kernel has no top_k or sort.)
    Returns (ids [1, Kp] int32, picked_values [1, Kp] float32, avail [1, Ep] bool with the picked experts removed).
    """
    iota_k = jax.lax.broadcasted_iota(jnp.int32, (1, k_pad), 1)
    no_index = jnp.int32(iota_e.shape[1])  # larger than any expert index: loses every min

    def one_round(r, carry):
        ids, picked_values, avail = carry
        best = jnp.max(jnp.where(avail, score, -jnp.inf), axis=1, keepdims=True)  # [1, 1]
        idx = jnp.min(jnp.where(avail & (score == best), iota_e, no_index), axis=1, keepdims=True)  # [1, 1]
        ids = jnp.where(iota_k == r, idx, ids)
        if values is not None:  # a one-hot sum is a gather of one element; skipped where nobody reads it
            value = jnp.sum(jnp.where(iota_e == idx, values, 0.0), axis=1, keepdims=True)  # [1, 1]: values[idx]
            picked_values = jnp.where(iota_k == r, value, picked_values)
        return ids, picked_values, avail & (iota_e != idx)

    init = (jnp.zeros((1, k_pad), jnp.int32), jnp.zeros((1, k_pad), jnp.float32), avail)
    return jax.lax.fori_loop(0, rounds, one_round, init)


def route_topk_kernel(logits_ref, valid_ref, ids_ref, weights_ref, *, num_experts: int, k: int,
                      norm_topk_prob: bool, dtype):
    """One token per program. logits_ref [1, Ep] f32; valid_ref [1, 1] int32 (0/1); ids_ref [1, Kp] int32;
    weights_ref [1, Kp] f32."""
    e_pad = logits_ref.shape[1]
    k_pad = ids_ref.shape[1]
    logits = logits_ref[...]  # [1, Ep]
    iota_e = jax.lax.broadcasted_iota(jnp.int32, (1, e_pad), 1)
    real = iota_e < num_experts  # padded experts are never available
    top = jnp.max(jnp.where(real, logits, -jnp.inf), axis=1, keepdims=True)
    exp = jnp.where(real, jnp.exp(logits - top), 0.0)
    probs = exp / jnp.sum(exp, axis=1, keepdims=True)  # [1, Ep], as jax.nn.softmax
    ids, weights, _ = select(probs, real, iota_e, k, k_pad, values=probs)  # [1, Kp]; padded slots hold 0
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    weights = weights.astype(dtype).astype(jnp.float32)  # transformers casts them to the hidden dtype
    valid = valid_ref[...] != 0  # [1, 1]
    ids_ref[...] = jnp.where(valid, ids, num_experts)
    weights_ref[...] = jnp.where(valid, weights, 0.0)


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "dtype", "interpret"))
def route_topk(logits: jax.Array, valid: jax.Array, *, k: int, norm_topk_prob: bool = True, dtype=jnp.bfloat16,
               interpret: bool = False):
    """logits [T, E] f32, valid [T] bool -> (ids [T, K] int32, weights [T, K] f32). See the module docstring."""
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"route_topk needs 1 <= k <= E, got k={k}, E={e}")
    e_pad, k_pad = next_pow2(e), next_pow2(k)
    logits = logits.astype(jnp.float32)
    if e_pad != e:  # (no op where E is a power of 2: every op counts in a T=1 window)
        logits = jnp.pad(logits, ((0, 0), (0, e_pad - e)), constant_values=PAD_LOGIT)  # [T, Ep]
    kernel = functools.partial(route_topk_kernel, num_experts=e, k=k, norm_topk_prob=norm_topk_prob,
                               dtype=jnp.dtype(dtype))
    ids, weights = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[pl.BlockSpec((1, e_pad), lambda i: (i, 0)), pl.BlockSpec((1, 1), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((1, k_pad), lambda i: (i, 0)), pl.BlockSpec((1, k_pad), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, k_pad), jnp.int32), jax.ShapeDtypeStruct((t, k_pad), jnp.float32)],
        # One token's row is small: one warp up to 512 experts (16 per thread), more beyond.
        compiler_params=plgpu.CompilerParams(num_warps=min(4, max(1, e_pad // 512))),
        interpret=interpret,
        name="route_topk",
    )(logits, valid.astype(jnp.int32).reshape(t, 1))  # the mask as int32 0/1: no bool (i1) refs in Triton
    return (ids, weights) if k == k_pad else (ids[:, :k], weights[:, :k])


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "dtype", "interpret"))
def route_topk_reference(logits: jax.Array, valid: jax.Array, *, k: int, norm_topk_prob: bool = True,
                         dtype=jnp.bfloat16, interpret: bool = False):
    """Plain jnp: XLA's softmax and `jax.lax.top_k` (the engine's router without the kernel, moe.route); same
    signature and results as `route_topk` (`interpret` is accepted and ignored)."""
    del interpret
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, ids = jax.lax.top_k(probs, k)  # [T, K]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(dtype).astype(jnp.float32)
    ids = jnp.where(valid[:, None], ids, logits.shape[1]).astype(jnp.int32)
    return ids, jnp.where(valid[:, None], weights, 0.0)
