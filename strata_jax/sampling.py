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


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p (the smallest set of top tokens whose mass reaches top_p). [V] -> [V]."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(params.temperature, 1e-6)
    order = jnp.argsort(-scaled)  # [V], descending
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = jnp.where(params.top_k > 0, rank < params.top_k, True)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < params.top_p) | (rank == 0) | (params.top_p >= 1.0))  # 1 = off, whatever the rounding
    return jnp.full((v,), -jnp.inf, scaled.dtype).at[order].set(jnp.where(keep, sorted_logits, -jnp.inf))


def sample_row(logits: jax.Array, position: jax.Array, params: SamplingParams) -> jax.Array:
    """One token from float32 logits [V]; `position` is the absolute position of the token being chosen.
    Temperature 0 is the argmax (the engine does not call the sampler then; this keeps the function total)."""
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed), position)
    drawn = jax.random.categorical(key, filtered_logits(logits, params)).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32))


def sample(logits: jax.Array, positions: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [T, V], positions [T] -> tokens [T]."""
    return jax.vmap(sample_row, in_axes=(0, 0, None))(logits, positions, params)
