"""Route prior: re-pick each token's top-K experts with a bonus for experts resident in the device expert cache.

Semantics (`route_prior` and `route_prior_reference` agree exactly on ids, on weights to float rounding):

- logits [T, E] float32 router logits (unbiased, finite); resident [E] bool (expert is in the device cache);
  lam [T] float32 >= 0 (per-token lambda).
- Biased key: key = logits - lam[:, None] * (~resident). Subtracting lambda from missed experts ranks like adding
  it to resident ones, and is exactly a no-op when every expert is resident or lam == 0. (Computed as
  where(resident, logits, logits - lam), so lam = inf gives -inf, never 0 * inf = nan.)
- keep = J: the top-J experts of the UNBIASED ranking are always picked (J = 0: none forced); the other K - J are
  the best by the biased key among the remaining experts.
- Ties, in every ranking: the lower expert index wins (as `jax.lax.top_k`).
- Output order: the K picked experts by unbiased logit, descending (ties: lower index first), so rank 0 is the
  heaviest by routing weight.
- Weights: probs = softmax(logits) over all E experts in float32 (unbiased); topk_weights = probs[picked], divided by
  their sum when norm_topk_prob.
- changed [T] bool: the token's picked SET differs from its unbiased top-K set.
- Any E >= K >= 1 and any T: the wrapper pads E (padded experts are masked out, never picked) and K to powers of 2,
  as every array in a Triton kernel must have a power-of-2 number of elements, and slices the outputs back. T needs
  no padding: each program reads one token's row (a block of 1 row).

The kernel has no top_k or sort (a Pallas Triton kernel has neither): each selection is K rounds (a fori_loop) of a
masked max and the lowest index among the maxima, accumulated into a small [1, K] vector and stored once at the end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .route_topk import PAD_LOGIT, next_pow2, select


def route_prior_kernel(logits_ref, resident_ref, lam_ref, ids_ref, weights_ref, changed_ref, *,
                       num_experts: int, k: int, keep: int, norm_topk_prob: bool):
    """One token per program. logits_ref [1, Ep] f32; resident_ref [1, Ep] int32 (0/1); lam_ref [1, 1] f32;
    ids_ref [1, Kp] int32; weights_ref [1, Kp] f32; changed_ref [1, 1] int32 (0/1)."""
    e_pad = logits_ref.shape[1]
    k_pad = ids_ref.shape[1]
    logits = logits_ref[...]  # [1, Ep]
    resident = resident_ref[...] != 0  # [1, Ep]
    lam = lam_ref[...]  # [1, 1]
    iota_e = jax.lax.broadcasted_iota(jnp.int32, (1, e_pad), 1)
    valid = iota_e < num_experts  # padded experts are never available
    key = jnp.where(resident, logits, logits - lam)  # [1, Ep]; exactly logits where resident or lam == 0

    # Unbiased top-K; its first `keep` rounds are the forced experts.
    _, _, after_keep = select(logits, valid, iota_e, keep, k_pad)
    _, _, after_unbiased = select(logits, after_keep, iota_e, k - keep, k_pad)
    unbiased_set = valid & ~after_unbiased  # [1, Ep]
    # The rest by the biased key among the experts not forced.
    _, _, after_biased = select(key, after_keep, iota_e, k - keep, k_pad)
    picked = valid & ~after_biased  # [1, Ep]
    changed = jnp.max((picked != unbiased_set).astype(jnp.int32), axis=1, keepdims=True)  # [1, 1]

    # Unbiased softmax over the real experts.
    top = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=1, keepdims=True)
    exp = jnp.where(valid, jnp.exp(logits - top), 0.0)
    probs = exp / jnp.sum(exp, axis=1, keepdims=True)  # [1, Ep]
    # Order the picked experts by unbiased logit (K more rounds restricted to the picked mask), gathering their probs.
    ids, weights, _ = select(logits, picked, iota_e, k, k_pad, values=probs)  # [1, Kp] each; padded slots hold 0
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)

    ids_ref[...] = ids
    weights_ref[...] = weights
    changed_ref[...] = changed


@functools.partial(jax.jit, static_argnames=("k", "keep", "norm_topk_prob", "interpret"))
def route_prior(logits: jax.Array, resident: jax.Array, lam: jax.Array, *, k: int, keep: int = 0,
                norm_topk_prob: bool = True, interpret: bool = False):
    """logits [T, E] f32, resident [E] bool, lam [T] f32 -> (topk_ids [T, K] int32, topk_weights [T, K] f32,
    changed [T] bool). See the module docstring for the semantics."""
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"route_prior needs 1 <= k <= E, got k={k}, E={e}")
    if not 0 <= keep <= k:
        raise ValueError(f"route_prior needs 0 <= keep <= k, got keep={keep}, k={k}")
    e_pad, k_pad = next_pow2(e), next_pow2(k)
    logits_p = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, e_pad - e)), constant_values=PAD_LOGIT)  # [T, Ep]
    # The mask travels as int32 0/1: bool (i1) refs are avoided in Triton kernels.
    resident_p = jnp.pad(resident.astype(jnp.int32), (0, e_pad - e)).reshape(1, e_pad)  # [1, Ep]
    lam_p = lam.astype(jnp.float32).reshape(t, 1)  # [T, 1]

    kernel = functools.partial(route_prior_kernel, num_experts=e, k=k, keep=keep, norm_topk_prob=norm_topk_prob)
    ids, weights, changed = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[
            pl.BlockSpec((1, e_pad), lambda i: (i, 0)),
            pl.BlockSpec((1, e_pad), lambda i: (0, 0)),
            pl.BlockSpec((1, 1), lambda i: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((1, k_pad), lambda i: (i, 0)),
            pl.BlockSpec((1, k_pad), lambda i: (i, 0)),
            pl.BlockSpec((1, 1), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, k_pad), jnp.int32),
            jax.ShapeDtypeStruct((t, k_pad), jnp.float32),
            jax.ShapeDtypeStruct((t, 1), jnp.int32),
        ],
        # One token's row is small: one warp up to 512 experts (16 per thread), more beyond.
        compiler_params=plgpu.CompilerParams(num_warps=min(4, max(1, e_pad // 512))),
        interpret=interpret,
        name="route_prior",
    )(logits_p, resident_p, lam_p)
    return ids[:, :k], weights[:, :k], changed[:, 0] != 0


@functools.partial(jax.jit, static_argnames=("k", "keep", "norm_topk_prob", "interpret"))
def route_prior_reference(logits: jax.Array, resident: jax.Array, lam: jax.Array, *, k: int, keep: int = 0,
                          norm_topk_prob: bool = True, interpret: bool = False):
    """Plain jnp with `jax.lax.top_k` (lower index first on ties); same signature and results as `route_prior`
    (`interpret` is accepted and ignored, so tests can call either one the same way)."""
    del interpret
    t, e = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(t)[:, None]  # [T, 1]
    key = jnp.where(resident[None, :], logits, logits - lam[:, None])  # [T, E]
    kept = jnp.zeros((t, e), bool)
    if keep:
        kept = kept.at[rows, jax.lax.top_k(logits, keep)[1]].set(True)  # [T, E]
    _, picked_ids = jax.lax.top_k(jnp.where(kept, jnp.inf, key), k)  # [T, K]: kept first, then the best keys
    _, unbiased_ids = jax.lax.top_k(logits, k)  # [T, K]
    picked = jnp.zeros((t, e), bool).at[rows, picked_ids].set(True)
    unbiased_set = jnp.zeros((t, e), bool).at[rows, unbiased_ids].set(True)
    changed = jnp.any(picked != unbiased_set, axis=1)  # [T]

    # Order by unbiased logit descending, then by index: sort the (-logit, id) pairs lexicographically.
    picked_logits = jnp.take_along_axis(logits, picked_ids, axis=1)  # [T, K]
    _, ids = jax.lax.sort((-picked_logits, picked_ids), dimension=1, num_keys=2)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    weights = jnp.take_along_axis(probs, ids, axis=1)  # [T, K]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    return ids.astype(jnp.int32), weights, changed
