"""Opt-in routing approximations that cut expert-cache misses in decode windows. Each changes the output; each is
off by default, and with all of them off the decode graphs are the exact ones (the same code path, byte-identical
logits). They act only in decode windows (never in the prompt's prefill) and only with offload on.

Ranks are 0-based: rank 0 is a token's heaviest expert, rank K-1 its lightest. Order in a window:
router -> prior -> resident swap -> plan with tail skip.

- Route prior (`STRATA_ROUTE_PRIOR=lambda`): each token's top-K is picked again from the keys
  `logit - lambda * (expert not resident)` (the same ranking as adding lambda to every resident expert's logit; it
  is exactly the unbiased ranking when every expert is resident). The `keep` unbiased top experts are always picked.
  The weights stay the router's: softmax over all E unbiased logits, taken at the picked experts and renormalised
  over them when the model's router does (`norm_topk_prob`); the picked experts are ordered by weight.
  Mode `range` (after "Mixture of Cache-Conditional Experts", arXiv 2412.00099): lambda is multiplied by the
  layer's running mean of each token's logit range (max - min over the E logits), the mean over every decode token
  this layer has routed since the engine started, this window's tokens included (a per-layer sum and count in the
  expert cache state); `keep` defaults to 1 there (the unbiased top-1 is never moved), 0 in the plain mode.
  The re-pick runs in the Pallas kernel `pallas_kernels/route_prior.py` (interpret mode off the GPU).
- Resident swap (`STRATA_ROUTE_RESIDENT=1`): for ranks r = first..K-1 in turn, a token's expert at rank r that is
  not resident is replaced by the resident expert of highest logit that the token has not picked yet, if that
  logit is at least the missed one's minus the margin. Weights as for the prior (router probabilities of the final
  set, renormalised as the router does, ordered by weight).
- Tail skip (`STRATA_ROUTE_TAIL_SKIP=R`): a missed expert (not resident) that every entry of the window routes at
  rank >= R is neither copied nor computed: its contribution is zero, the other experts keep their weights (no
  renormalisation). An expert that any token ranks below R is served as before. R >= K skips nothing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RouteApprox:
    """The routing approximations of the decode graphs (static: one compiled graph per setting)."""
    tail_skip: int = 0  # R; 0 = off
    prior: float | None = None  # lambda; None = off
    prior_mode: str = "plain"  # plain | range
    prior_keep: int = 0  # J: unbiased top-J always kept
    resident: bool = False
    resident_rank: int = 0  # first rank the swap may replace
    resident_margin: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.tail_skip) or self.prior is not None or self.resident


OFF = RouteApprox()


def default_resident_rank(k: int) -> int:
    """The last 40% of the ranks (6..9 for K = 10)."""
    return k - max(1, round(0.4 * k))


def router_probs(logits: jax.Array) -> jax.Array:
    """Softmax over all E logits in float32, exactly as moe.route computes it."""
    return jax.nn.softmax(logits, axis=-1)


def weights_of(probs: jax.Array, ids: jax.Array, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """The router's weights of a picked set: ids [T, K] -> (ids ordered by weight, weights [T, K] float32).

    The same arithmetic as moe.route on the same set (so the rules are exact no-ops when they pick nothing new)."""
    w = jnp.take_along_axis(probs, ids, axis=-1)  # [T, K]
    order = jnp.argsort(-w, axis=-1, stable=True)
    w, ids = jnp.take_along_axis(w, order, axis=-1), jnp.take_along_axis(ids, order, axis=-1)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids, w


def prior_pick(logits: jax.Array, resident: jax.Array, lam: jax.Array, k: int, keep: int) -> tuple[jax.Array, jax.Array]:
    """The biased re-pick (the Pallas kernel: compiled on a GPU, interpreted elsewhere): logits [T, E],
    resident [E], lam [T] -> (ids [T, K], changed [T]). The weights are recomputed by `weights_of`, with the exact
    router's arithmetic, so a re-pick that changes nothing changes no bit."""
    from pallas_kernels.route_prior import route_prior
    ids, _, changed = route_prior(logits, resident, lam, k=k, keep=keep, interpret=jax.default_backend() != "gpu")
    return ids, changed


def resident_swap(logits: jax.Array, ids: jax.Array, resident: jax.Array, first_rank: int,
                  margin: float) -> tuple[jax.Array, jax.Array]:
    """ids [T, K] ordered by weight -> (ids with the swaps, swaps made per token [T] int32)."""
    t, k = ids.shape
    e = logits.shape[-1]
    picked = jnp.zeros((t, e), bool).at[jnp.arange(t)[:, None], ids].set(True)
    swaps = jnp.zeros((t,), jnp.int32)
    for r in range(first_rank, k):
        current = ids[:, r]  # [T]
        available = resident[None, :] & ~picked  # [T, E]
        best = jnp.argmax(jnp.where(available, logits, -jnp.inf), axis=-1).astype(ids.dtype)  # [T]
        best_logit = jnp.take_along_axis(logits, best[:, None], axis=-1)[:, 0]
        current_logit = jnp.take_along_axis(logits, current[:, None], axis=-1)[:, 0]
        ok = ~resident[current] & jnp.any(available, axis=-1) & (best_logit >= current_logit - margin)
        new = jnp.where(ok, best, current)
        rows = jnp.arange(t)
        picked = picked.at[rows, current].set(jnp.where(ok, False, picked[rows, current]))
        picked = picked.at[rows, new].set(True)
        ids = ids.at[:, r].set(new)
        swaps = swaps + ok.astype(jnp.int32)
    return ids, swaps


def min_rank(route, k: int) -> jax.Array:
    """[N]: the lowest rank at which any entry of the window routes each distinct expert (K when none)."""
    match = route.topk_ids[:, :, None] == route.expert_ids[None, None, :]  # [T, K, N]
    ranks = jnp.arange(k, dtype=jnp.int32)[None, :, None]
    return jnp.min(jnp.where(match, ranks, k), axis=(0, 1))


def logit_range(logits: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum over the valid tokens of (max - min logit), and their count: the range mode's running mean's update."""
    spread = jnp.max(logits, axis=-1) - jnp.min(logits, axis=-1)
    return jnp.sum(jnp.where(valid, spread, 0.0)), jnp.sum(valid).astype(jnp.int32)

