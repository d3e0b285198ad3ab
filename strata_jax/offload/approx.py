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

from strata_jax.pallas_kernels.route_prior import route_prior
from strata_jax.options import INT32_MAX, ROUTE_SWITCHES, EngineOptions, env_name, parse_number, switch_values


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


# ---- the switches (STRATA_ROUTE_* or the options of the same names) -------------------------------------------

def route_approx(opts: EngineOptions, k: int, offload: bool, environ=None):
    """(RouteApprox, start-up lines) from the options and the environment; K = the model's experts per token."""
    raw = switch_values(opts, ROUTE_SWITCHES, environ)
    lines, out = [], {}
    if raw["route_tail_skip"]:
        r = parse_number(raw["route_tail_skip"], int)
        name = f"{env_name('route_tail_skip')}={raw['route_tail_skip']}"
        if r is None or r < 1:
            lines.append(f"route tail skip: {name} is not an integer >= 1; tail skip off")
        else:
            r = min(r, INT32_MAX)  # R >= K skips nothing; a huge R must not overflow the graph's int32
            out["tail_skip"] = r
            what = (f"skips nothing (R >= K = {k})" if r >= k else
                    f"a missed expert that every entry of a decode window routes at rank >= {r} (ranks 0..{k - 1}) "
                    "is skipped")
            lines.append(f"route tail skip: R = {r}: {what}")
    if raw["route_prior"]:
        lam = parse_number(raw["route_prior"])
        name = f"{env_name('route_prior')}={raw['route_prior']}"
        if lam is None or lam < 0:
            lines.append(f"route prior: {name} is not a number >= 0; prior off")
        else:
            mode = raw["route_prior_mode"] or "plain"
            if mode not in ("plain", "range"):
                lines.append(f"route prior: {env_name('route_prior_mode')}={mode} is not plain or range; plain")
                mode = "plain"
            keep = 1 if mode == "range" else 0
            if raw["route_prior_keep"]:
                j = parse_number(raw["route_prior_keep"], int)
                if j is None or not 0 <= j <= k:
                    lines.append(f"route prior: {env_name('route_prior_keep')}={raw['route_prior_keep']} is not an "
                                 f"integer in 0..{k}; {keep}")
                else:
                    keep = j
            out.update(prior=float(lam), prior_mode=mode, prior_keep=keep)
            scale = " x the layer's running mean logit range" if mode == "range" else ""
            lines.append(f"route prior: lambda = {lam:g}{scale} added to resident experts' logits, top-K re-picked "
                         f"(Pallas kernel), unbiased top-{keep} always kept; mode {mode}")
    elif raw["route_prior_mode"] or raw["route_prior_keep"]:
        lines.append("route prior: STRATA_ROUTE_PRIOR_MODE / _KEEP set but the prior is off: ignored")
    if raw["route_resident"]:
        if raw["route_resident"] not in ("0", "1"):
            lines.append(f"route resident swap: {env_name('route_resident')}={raw['route_resident']} is not 0 or 1; off")
        elif raw["route_resident"] == "1":
            first = default_resident_rank(k)
            if raw["route_resident_rank"]:
                v = parse_number(raw["route_resident_rank"], int)
                if v is None or not 0 <= v < k:
                    lines.append(f"route resident swap: {env_name('route_resident_rank')}="
                                 f"{raw['route_resident_rank']} is not an integer in 0..{k - 1}; {first}")
                else:
                    first = v
            margin = 1.0
            if raw["route_resident_margin"]:
                v = parse_number(raw["route_resident_margin"])
                if v is None or v < 0:
                    lines.append(f"route resident swap: {env_name('route_resident_margin')}="
                                 f"{raw['route_resident_margin']} is not a number >= 0; 1.0")
                else:
                    margin = v
            out.update(resident=True, resident_rank=first, resident_margin=margin)
            lines.append(f"route resident swap: a missed expert at rank {first}..{k - 1} is swapped for the best "
                         f"resident one within a logit margin of {margin:g}")
    if raw["route_resident"] in ("", "0") and (raw["route_resident_rank"] or raw["route_resident_margin"]):
        lines.append("route resident swap: STRATA_ROUTE_RESIDENT_RANK / _MARGIN set but the swap is off: ignored")
    approx = RouteApprox(**out)
    if approx.active and not offload:
        lines.append("route approximations: every expert is on the device (offload off): nothing to do")
        approx = OFF
    return approx, lines
