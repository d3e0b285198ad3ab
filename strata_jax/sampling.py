"""Token choice inside the compiled graph: greedy, or temperature with top-k and top-p, from a key per position.

The key of the token at absolute position p is fold_in(PRNGKey(seed), p): a seeded run is reproducible whatever
the window size or prefill chunking.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Dynamic scalars, so one compiled graph serves every setting."""
    temperature: jax.Array  # float32; 0 = greedy
    top_p: jax.Array  # float32 in (0, 1]; 1 = off
    top_k: jax.Array  # int32; 0 = off
    seed: jax.Array  # uint32

    @staticmethod
    def make(temperature=0.0, top_p=1.0, top_k=0, seed=0) -> "SamplingParams":
        return SamplingParams(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
                              top_k=jnp.int32(top_k), seed=jnp.uint32(seed))


def filtered_logits(logits: jax.Array, params: SamplingParams, filtered: bool = True) -> jax.Array:
    """Temperature, then top-k, then top-p (the smallest set of top tokens whose mass reaches top_p). [V] -> [V].
    filtered=False: the graph for requests with top-k and top-p off (top_k 0, top_p 1), where the filter keeps
    every token: the same values without sorting the vocabulary (a sort of V ~ 152K per token on the GPU)."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(params.temperature, 1e-6)
    if not filtered:
        return scaled
    order = jnp.argsort(-scaled)  # [V], descending
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = jnp.where(params.top_k > 0, rank < params.top_k, True)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < params.top_p) | (rank == 0) | (params.top_p >= 1.0))  # 1 = off, whatever the rounding
    return jnp.full((v,), -jnp.inf, scaled.dtype).at[order].set(jnp.where(keep, sorted_logits, -jnp.inf))


NON_FINITE = -1  # the token a graph returns for a row whose logits hold NaN or inf: the host ends the request


def greedy(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> argmax [...] int32, NON_FINITE where a row is not all finite (argmax would pick a NaN)."""
    return mark_non_finite(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def mark_non_finite(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, NON_FINITE).astype(jnp.int32)


def sample_row(logits: jax.Array, position: jax.Array, params: SamplingParams, filtered: bool = True) -> jax.Array:
    """One token from float32 logits [V]; `position` is the absolute position of the token being chosen.
    Temperature 0 is the argmax (the engine does not call the sampler then; this keeps the function total)."""
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed), position)
    drawn = jax.random.categorical(key, filtered_logits(logits, params, filtered)).astype(jnp.int32)
    return mark_non_finite(logits, jnp.where(params.temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32)))


def sample(logits: jax.Array, positions: jax.Array, params: SamplingParams, filtered: bool = True) -> jax.Array:
    """logits [T, V], positions [T] -> tokens [T]."""
    return jax.vmap(sample_row, in_axes=(0, 0, None, None))(logits, positions, params, filtered)


def verify_row(logits: jax.Array, draft: jax.Array, position: jax.Array, params: SamplingParams,
               filtered: bool = True):
    """Speculative rejection sampling for one row whose draft is a single proposed token (the drafter's q is
    one-hot): accept the draft with probability p(draft); else draw from the residual max(0, p - q), i.e. p
    without the draft, renormalised. The result follows p exactly. Returns (accept, the token drawn if not).
    `position` is the absolute position of the token this row chooses (its key, as in sample_row)."""
    p = jax.nn.softmax(filtered_logits(logits, params, filtered))  # [V]
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed), position)
    accept = jax.random.uniform(jax.random.fold_in(key, 1)) < p[draft]
    residual = p.at[draft].set(0.0)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p)
    drawn = jax.random.categorical(jax.random.fold_in(key, 2), jnp.log(residual)).astype(jnp.int32)
    finite = jnp.all(jnp.isfinite(logits))
    return accept & finite, mark_non_finite(logits, drawn)


def verify(logits: jax.Array, drafts: jax.Array, positions: jax.Array, params: SamplingParams, filtered: bool = True):
    """A verify window: logits [T, V], drafts [T-1] (row i checks drafts[i]), positions [T] of the tokens chosen.

    Returns accept [T-1] bool, and tokens [T]: row i < T-1 the residual draw used when drafts[i] is rejected, row
    T-1 a plain sample (the token after the last draft when every draft is accepted)."""
    t = logits.shape[0]
    accept, drawn = jax.vmap(verify_row, in_axes=(0, 0, 0, None, None))(logits[:t - 1], drafts, positions[:t - 1],
                                                                         params, filtered)
    last = sample_row(logits[t - 1], positions[t - 1], params, filtered)
    return accept, jnp.concatenate([drawn, last[None]])
