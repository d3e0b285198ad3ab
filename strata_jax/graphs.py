"""The pure functions a window runs, for researchers who hold their own weights and caches.

    from strata_jax import graphs, model
    step = graphs.jit_decode_window(cfg)                  # one compiled graph per window size T (by shape)
    next_tokens, logits, cache = step(weights, cache, tokens_T, pos, SamplingParams.make())

`decode_window` runs T tokens at positions pos..pos+T-1 and picks the token after each; `prefill_chunk` runs a
chunk of C prompt tokens of which the first n_valid are real and picks the token after the last real one. Both
donate the cache (updated in place) when jitted with the helpers below.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.model import ExpertPath, KVCache, Weights, forward
from strata_jax.sampling import SamplingParams, sample, sample_row


def decode_window(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, sampling: SamplingParams,
                  *, cfg: ModelConfig, experts: ExpertPath | None = None):
    """tokens [T] at positions pos.. -> (next_tokens [T], logits [T, V] float32, cache)."""
    t = tokens.shape[0]
    logits, cache = forward(weights, cache, tokens, pos, jnp.int32(t), cfg, experts)
    with jax.named_scope("sample"):
        next_tokens = sample(logits, pos + 1 + jnp.arange(t, dtype=jnp.int32), sampling)
    return next_tokens, logits, cache


def prefill_chunk(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, n_valid: jax.Array,
                  sampling: SamplingParams, *, cfg: ModelConfig, experts: ExpertPath | None = None):
    """tokens [C] (first n_valid real) -> (next token after the last real one, logits [C, V] float32, cache)."""
    logits, cache = forward(weights, cache, tokens, pos, n_valid, cfg, experts)
    with jax.named_scope("sample"):
        last = jax.lax.dynamic_index_in_dim(logits, n_valid - 1, keepdims=False)
        next_token = sample_row(last, pos + n_valid, sampling)
    return next_token, logits, cache


def jit_decode_window(cfg: ModelConfig, experts: ExpertPath | None = None):
    return jax.jit(functools.partial(decode_window, cfg=cfg, experts=experts), donate_argnums=(1,))


def jit_prefill_chunk(cfg: ModelConfig, experts: ExpertPath | None = None):
    return jax.jit(functools.partial(prefill_chunk, cfg=cfg, experts=experts), donate_argnums=(1,))
