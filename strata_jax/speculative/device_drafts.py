"""Verify windows that never wait for the host: the n-gram drafter and the acceptance step as device code, so that
window n+1 is dispatched before window n's tokens reach the host (`generate(draft="device")`).

The host verify loop reads each window's result, proposes the next drafts and only then dispatches: the device
waits for that round trip every window (the "synced" step of `benchmarks/decode_bench.py`). Here one graph runs the
whole window: propose -> forward -> accept -> append to the token history, and the host reads each window's tokens
one window late. The rules are the host's, to the token:

- `ngram_propose` is `drafts.NgramDrafter.propose` (longest suffix of 3..1 tokens, most recent earlier occurrence,
  the tokens that followed it, within the last `window` tokens).
- `accept` is the host loop's acceptance: greedy, the drafts equal to the target's argmax, then its next token;
  sampled, `sampling.verify` on the m drafts and a plain sample after the last one.

The window has a fixed size T (one graph); rows past the 1 + m real ones are padding that routes to no expert
(`forward`'s n_valid), so they cost attention rows but no expert bytes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.speculative.drafters import NGRAM_MAX_N, NGRAM_WINDOW
from strata_jax.sampling import SamplingParams, filter_rows, greedy, sample_filtered, verify_filtered


def ngram_propose(hist: jax.Array, length: jax.Array, k: int, max_n: int = NGRAM_MAX_N,
                  window: int = NGRAM_WINDOW) -> tuple[jax.Array, jax.Array]:
    """hist [C] int32 (the first `length` are the tokens so far) -> (drafts [k] int32, m: how many are real)."""
    c = hist.shape[0]
    j = jnp.arange(c)
    start = jnp.maximum(length - window, 0)
    size = length - start
    match = (j >= start) & (j <= length - 2)
    best = jnp.int32(-1)
    for n in range(1, max_n + 1):
        i = n - 1  # the token n-1 before the occurrence's end must equal the one n-1 before the context's end
        earlier = jnp.concatenate([jnp.full((i,), -1, hist.dtype), hist[:c - i]]) if i else hist  # hist[j - i]
        match = match & (j - i >= start) & (earlier == hist[jnp.maximum(length - 1 - i, 0)]) & (size - 1 >= n)
        best_n = jnp.max(jnp.where(match, j, -1)).astype(jnp.int32)
        best = jnp.where(best_n >= 0, best_n, best)  # the longest suffix with an occurrence wins
    found = (best >= 0) & (length >= 2)
    m = jnp.where(found, jnp.minimum(k, length - (best + 1)), 0).astype(jnp.int32)
    drafts = jax.lax.dynamic_slice_in_dim(jnp.concatenate([hist, jnp.zeros((k,), hist.dtype)]),
                                          jnp.maximum(best + 1, 0), k)
    return jnp.where(jnp.arange(k) < m, drafts, 0).astype(jnp.int32), m


def accept(logits: jax.Array, drafts: jax.Array, m: jax.Array, positions: jax.Array, sampling: SamplingParams,
           form: str | None) -> tuple[jax.Array, jax.Array]:
    """logits [T, V] float32, drafts [T-1] (the first m real), positions [T] of the tokens chosen -> (new [T]: the
    accepted drafts then the target's token, zeros after; n_new = accepted + 1). form: greedy (None), or a sampled
    request's filter form (sampling.FORMS)."""
    t = logits.shape[0]
    real = jnp.arange(t - 1) < m
    if form is not None:
        f = filter_rows(logits, sampling, form)  # the window filtered once
        acc, drawn = verify_filtered(logits[:t - 1], f[:t - 1], drafts, positions[:t - 1], sampling)
        plain = sample_filtered(logits, f, positions, sampling)
        tokens = jnp.where(jnp.arange(t) < m, jnp.concatenate([drawn, plain[-1:]]), plain)  # row m: a plain sample
    else:
        tokens = greedy(logits)  # NON_FINITE rows never match a draft
        acc = drafts == tokens[:t - 1]
    accepted = jnp.sum(jnp.cumprod((acc & real).astype(jnp.int32))).astype(jnp.int32)
    new = jnp.where(jnp.arange(t) < accepted, jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]), 0)
    new = new.at[accepted].set(tokens[accepted]).astype(jnp.int32)
    return new, accepted + 1
