"""Token choice inside the compiled graph: greedy, or temperature with top-k and top-p, from a key per position.

The key of the token at absolute position p is fold_in(PRNGKey(seed), p): a seeded run is reproducible whatever
the window size or prefill chunking.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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
        # numpy scalars: a jnp scalar is a device array made through JAX's dispatch (~0.1 ms each on a slow host,
        # per request and per batched window); the graphs take either, and move these with their call
        return SamplingParams(temperature=np.float32(temperature), top_p=np.float32(top_p),
                              top_k=np.int32(top_k), seed=np.uint32(seed))


# The largest top_k the sort-free "top_k" form serves (_top_k_filter): its kept set is compacted into this many
# slots before top-p (Qwen3's generation config asks for 20).
TOP_CANDIDATES = 64


def _sorted_filter(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """top-k, then top-p (the smallest set of top tokens whose mass reaches top_p) by a sort of the vocabulary."""
    v = scaled.shape[-1]
    order = jnp.argsort(-scaled)  # [V], descending
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = jnp.where(params.top_k > 0, rank < params.top_k, True)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < params.top_p) | (rank == 0) | (params.top_p >= 1.0))  # 1 = off, whatever the rounding
    return jnp.full((v,), -jnp.inf, scaled.dtype).at[order].set(jnp.where(keep, sorted_logits, -jnp.inf))


# Radix select of the "top_p" form (a mass above each candidate) and the "top_k" form (a count of the keys at least
# each): the threshold's float32 order key (32 bits) settled RADIX_BITS a round, each round one fused masked sum
# over [V] for 2^RADIX_BITS candidate thresholds at once. On a GPU the rounds are the cost (each a dependent
# reduction; the 32-step bisection before this took ~0.27 ms a token on an H100): 4 bits gives 8 rounds of 16 x V;
# 8 bits would be 4 rounds of 256 x V, 16x the reads. The CPU backend writes the [16, V] masks out before its
# reduce, so there the top_p form takes ~2x the bisection's time at T=1 (6x at T=4): off a GPU the rounds take 2
# bits (about the bisection's time there; the top_k form there is ~4x lax.top_k's time, which XLA's CPU serves
# well). None: by the backend (radix_bits); a number: that.
RADIX_BITS = None


def radix_bits() -> int:
    """The digit width of the top_p form's radix select on this backend (RADIX_BITS where set)."""
    return RADIX_BITS or (4 if jax.default_backend() == "gpu" else 2)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (-0.0 and +0.0 one key, tied as the sort compares them): a search over
    these keys ends on an exact logit value, where one over the float values stalls when the midpoint rounds to an
    end."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _threshold_filter(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """top-p with top-k off, without a sort: keeps the tokens whose logit is at least a threshold, found by a radix
    select over the logits' order keys (32 / radix_bits() rounds, each one masked sum over [V] for 2^radix_bits()
    candidates), then settles the tokens tied at the threshold by token id.

    The rule is the sorted filter's: rank r is kept while the mass of the ranks before it is below top_p (rank 0
    always; top_p >= 1 keeps everything), probabilities the softmax over the whole vocabulary. A token with logit
    x has before it every token with a larger logit, then the tokens tied with x of lower id (the stable sort's
    order), so with the threshold t the smallest key whose mass above is below top_p: every token above t is kept,
    none below, and a token tied at t is kept while the mass above t plus its lower-id ties (a cumsum over the
    ties, in id order) is below top_p: the same kept set and the same values as _sorted_filter, ties included. The
    one difference is float32 rounding of the masses (a masked sum and a cumsum of the ties, against the sorted
    filter's cumsum in rank order): where the exact mass before a token lies within that rounding of top_p (1e-7
    to 1e-6 over 40,000 tokens; the test allows 1e-5) the two may decide that token differently: one token more or
    less at the boundary. No device loop: the rounds are unrolled (the compiled graph holds no while)."""
    probs = jax.nn.softmax(scaled)  # [V], as the sorted filter normalises with top-k off
    key = _order_key(scaled)  # [V]

    def mass_above(k):  # the probability of the tokens whose key is above each of k [...]
        return jnp.sum(jnp.where(key > k[..., None], probs, 0.0), axis=-1)

    # The largest key m whose mass above reaches top_p, most significant digit first: each round keeps the largest
    # digit whose smallest value (lower bits 0) still has mass above >= top_p (mass above does not grow with the
    # key, so digit 0, the prefix itself, qualifies; where even key 0 does not (top_p above the whole mass), m stays
    # 0 and every token is kept). The threshold is m + 1: the smallest key whose mass above is below top_p.
    bits = radix_bits()
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    m = jnp.uint32(0)
    for shift in range(32 - bits, -1, -bits):  # unrolled: a device loop reads its predicate on the host
        candidates = m | (digits << shift)  # [2^bits]
        reaches = mass_above(candidates) >= params.top_p
        m = m | (jnp.max(jnp.where(reaches, digits, 0)) << shift)
    threshold = jnp.where(m == jnp.uint32(0xFFFFFFFF), m, m + 1)  # top_p <= 0: nothing above it, rank 0 alone
    tied = key == threshold  # [V]
    tied_probs = jnp.where(tied, probs, 0.0)
    mass_before = mass_above(threshold) + jnp.cumsum(tied_probs) - tied_probs  # [V], meaningful where tied
    keep = (key > threshold) | (tied & (mass_before < params.top_p)) | (params.top_p >= 1.0)
    keep = keep | (jnp.arange(scaled.shape[-1]) == jnp.argmax(scaled))  # rank 0 (the lowest id of the largest)
    return jnp.where(keep, scaled, -jnp.inf)


def _candidate_filter(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """The "top_k" form off a GPU (top_k_select() "lax"): the filter over the TOP_CANDIDATES most likely tokens
    (lax.top_k, which XLA's CPU serves well; ties to the lower id, as the stable sort), exact for 1 <= top_k <=
    TOP_CANDIDATES: top-k among them, probabilities normalised over the top-k, then top-p."""
    v = scaled.shape[-1]
    vals, idx = jax.lax.top_k(scaled, min(TOP_CANDIDATES, v))  # [k], descending
    rank = jnp.arange(vals.shape[0])
    keep = rank < params.top_k
    kept = jnp.where(keep, vals, -jnp.inf)
    probs = jax.nn.softmax(kept)
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < params.top_p) | (rank == 0) | (params.top_p >= 1.0))
    return jnp.full((v,), -jnp.inf, scaled.dtype).at[idx].set(jnp.where(keep, vals, -jnp.inf))


# How the "top_k" form finds the top-k set: "radix" (_top_k_filter: on a GPU, where lax.top_k of 64 over [V] takes
# a slow path, XLA's TopK kernel serving k <= 16) or "lax" (_candidate_filter: elsewhere, where lax.top_k is ~4x
# faster than the radix rounds). None: by the backend (top_k_select); a name: that.
TOP_K_SELECT = None


def top_k_select() -> str:
    """The "top_k" form's way on this backend (TOP_K_SELECT where set)."""
    return TOP_K_SELECT or ("radix" if jax.default_backend() == "gpu" else "lax")


def _top_k_filter(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """top-k, then top-p, without a sort of the vocabulary, for 1 <= top_k <= TOP_CANDIDATES (a top_k outside is
    clipped into that range: this form serves no other, form_of never picks it for one).

    The key of the top_k-th largest logit is found by a radix select over the logits' order keys with counts (32 /
    radix_bits() rounds, each one masked sum over [V] for 2^radix_bits() candidates: how many keys are >= each).
    Every token above it is kept (fewer than top_k), then the tokens tied at it in id order until top_k are taken:
    the stable sort's top-k set. One cumsum over [V] gives both the ties' rank and each kept token's slot, and a
    scatter compacts the set into TOP_CANDIDATES slots; those are sorted as the stable sort orders them (value
    descending, then id) and top-p runs over them as _sorted_filter does over its ranks (probabilities normalised
    over the top-k set, a rank kept while the mass before it is below top_p, rank 0 always, top_p >= 1 keeps all).
    The same kept set and values as _sorted_filter; the masses' float32 sums run over the slots where the sorted
    filter's run over [V] (zeros after the top-k), so a different summation order could decide a token whose exact
    mass before lies within float32 rounding of top_p differently. No device loop, no lax.top_k (XLA's GPU TopK
    serves k <= 16: top_k(64) over [V] fell back to a slow path, ~130 us a token on an H100)."""
    v = scaled.shape[-1]
    assert v < 1 << 23, v  # the packed cumsum below holds the ties' count in 23 bits
    k = jnp.clip(params.top_k, 1, min(TOP_CANDIDATES, v))
    key = _order_key(scaled)  # [V]

    def count_at_least(c):  # how many keys are >= each of c [...]
        return jnp.sum((key >= c[..., None]).astype(jnp.int32), axis=-1)

    # The largest key whose count at least reaches k (the k-th largest key), most significant digit first: each
    # round keeps the largest digit whose smallest value (lower bits 0) still counts k keys at least (the count
    # does not grow with the key, so digit 0, the prefix itself, qualifies).
    bits = radix_bits()
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    kth = jnp.uint32(0)
    for shift in range(32 - bits, -1, -bits):  # unrolled: a device loop reads its predicate on the host
        candidates = kth | (digits << shift)  # [2^bits]
        reaches = count_at_least(candidates) >= k
        kth = kth | (jnp.max(jnp.where(reaches, digits, 0)) << shift)
    above = key > kth  # [V]: fewer than k tokens
    tied = key == kth  # [V]: at least k minus those above
    # One pass for both counts: the tokens above before each (inclusive) in the low 8 bits (< k <= 64), the tied
    # ones (the ties' rank, from 1) above them.
    counts = jnp.cumsum(above.astype(jnp.int32) + (tied.astype(jnp.int32) << 8))  # [V]
    above_before, tie_rank = counts & 0xFF, counts >> 8  # [V], [V]
    ties_taken = k - (counts[-1] & 0xFF)  # the lowest ids of the tie fill the top-k set
    in_top_k = above | (tied & (tie_rank <= ties_taken))  # [V]: k tokens
    slot = above_before + jnp.minimum(tie_rank, ties_taken) - 1  # [V]: kept tokens before each, in id order
    ids = jnp.full((TOP_CANDIDATES,), v, jnp.int32).at[jnp.where(in_top_k, slot, TOP_CANDIDATES)].set(
        jnp.arange(v, dtype=jnp.int32), mode="drop")  # [TOP_CANDIDATES]: v in the slots past k
    vals = scaled.at[ids].get(mode="fill", fill_value=-jnp.inf)  # [TOP_CANDIDATES]
    # in the stable sort's order: the larger key first (-0.0 and +0.0 one key), then the lower id; empty slots
    # (id v) last
    _, ids, vals = jax.lax.sort((~_order_key(vals), ids, vals), num_keys=2)
    rank = jnp.arange(TOP_CANDIDATES)
    probs = jax.nn.softmax(vals)  # normalised over the top-k set, as the sorted filter's with top-k on
    mass_before = jnp.cumsum(probs) - probs
    keep = (rank < k) & ((mass_before < params.top_p) | (rank == 0) | (params.top_p >= 1.0))
    return jnp.full((v,), -jnp.inf, scaled.dtype).at[ids].set(jnp.where(keep, vals, -jnp.inf), mode="drop")


# The filter's forms, picked on the host per request (form_of) so that no graph branches on the data (a lax.cond
# in a graph makes the GPU stream wait for the host): "plain" (top-k and top-p off: nothing to filter), "top_k"
# (1 <= top_k <= TOP_CANDIDATES, with or without top-p: the k-th largest logit by a radix select, the top-k set
# compacted into TOP_CANDIDATES slots, top-p over those, _top_k_filter, no sort of the vocabulary), "top_p" (top-p
# alone: a threshold logit found by a radix select, _threshold_filter, no sort), "sorted" (a top_k beyond
# TOP_CANDIDATES, with or without top-p: a sort of the vocabulary). The same tokens and values in each.
FORMS = ("plain", "top_k", "top_p", "sorted")


def form_of(top_k: int, top_p: float) -> str:
    """The filter form of a request's settings (FORMS)."""
    if top_k <= 0:
        return "plain" if top_p >= 1.0 else "top_p"
    return "top_k" if 0 < top_k <= TOP_CANDIDATES else "sorted"


def filter_rows(logits: jax.Array, params: SamplingParams, form: str = "sorted") -> jax.Array:
    """Temperature, then top-k, then top-p, for every row: [T, V] -> [T, V], in the given form (FORMS; form_of
    picks it from the settings; "sorted" is right for any). "top_k": the top-k set by radix select, then top-p over
    it (_top_k_filter; off a GPU lax.top_k's candidates, _candidate_filter), exact only for 1 <= top_k <= TOP_CANDIDATES; "top_p": a threshold by radix select, exact
    only with top-k off; "plain": the scaled logits (exact only with top-k and top-p off)."""
    if form not in FORMS:
        raise ValueError(f"filter form {form!r} is not one of {FORMS}")
    scaled = logits / jnp.maximum(params.temperature, 1e-6)
    if form == "plain":
        return scaled
    if form == "top_k":
        one = _top_k_filter if top_k_select() == "radix" else _candidate_filter
        return jax.vmap(one, in_axes=(0, None))(scaled, params)
    if form == "top_p":
        return jax.vmap(_threshold_filter, in_axes=(0, None))(scaled, params)
    return jax.vmap(_sorted_filter, in_axes=(0, None))(scaled, params)


def filtered_logits(logits: jax.Array, params: SamplingParams, form: str = "sorted") -> jax.Array:
    """One row of `filter_rows`: [V] -> [V]."""
    return filter_rows(logits[None], params, form)[0]


NON_FINITE = -1  # the token a graph returns for a row whose logits hold NaN or inf: the host ends the request


def greedy(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> argmax [...] int32, NON_FINITE where a row is not all finite (argmax would pick a NaN)."""
    return mark_non_finite(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def mark_non_finite(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, NON_FINITE).astype(jnp.int32)


def _sample_one(logits: jax.Array, f: jax.Array, position: jax.Array, params: SamplingParams) -> jax.Array:
    """One token from float32 logits [V] and their filtered form f [V] (filter_rows); `position` is the absolute
    position of the token being chosen. Temperature 0 is the argmax (the engine does not call the sampler then;
    this keeps the function total)."""
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed), position)
    drawn = jax.random.categorical(key, f).astype(jnp.int32)
    return mark_non_finite(logits, jnp.where(params.temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32)))


def sample_filtered(logits: jax.Array, f: jax.Array, positions: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [T, V], their filter_rows f [T, V], positions [T] -> tokens [T]."""
    return jax.vmap(_sample_one, in_axes=(0, 0, 0, None))(logits, f, positions, params)


def sample(logits: jax.Array, positions: jax.Array, params: SamplingParams, form: str = "sorted") -> jax.Array:
    """logits [T, V], positions [T] -> tokens [T]."""
    return sample_filtered(logits, filter_rows(logits, params, form), positions, params)


def _verify_one(logits: jax.Array, f: jax.Array, draft: jax.Array, position: jax.Array, params: SamplingParams):
    """Speculative rejection sampling for one row whose draft is a single proposed token (the drafter's q is
    one-hot): accept the draft with probability p(draft); else draw from the residual max(0, p - q), i.e. p
    without the draft, renormalised. The result follows p exactly. Returns (accept, the token drawn if not).
    f: the row's filtered logits (filter_rows); `position`: the absolute position of the token this row chooses
    (its key, as in sample)."""
    p = jax.nn.softmax(f)  # [V]
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed), position)
    accept = jax.random.uniform(jax.random.fold_in(key, 1)) < p[draft]
    residual = p.at[draft].set(0.0)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p)
    drawn = jax.random.categorical(jax.random.fold_in(key, 2), jnp.log(residual)).astype(jnp.int32)
    finite = jnp.all(jnp.isfinite(logits))
    return accept & finite, mark_non_finite(logits, drawn)


def verify_filtered(logits: jax.Array, f: jax.Array, drafts: jax.Array, positions: jax.Array,
                    params: SamplingParams):
    """Rows [N] of rejection sampling (_verify_one): logits and their filtered form [N, V], drafts [N], positions
    [N] -> (accept [N], drawn [N])."""
    return jax.vmap(_verify_one, in_axes=(0, 0, 0, 0, None))(logits, f, drafts, positions, params)


def verify(logits: jax.Array, drafts: jax.Array, positions: jax.Array, params: SamplingParams, form: str = "sorted"):
    """A verify window: logits [T, V], drafts [T-1] (row i checks drafts[i]), positions [T] of the tokens chosen.

    Returns accept [T-1] bool, and tokens [T]: row i < T-1 the residual draw used when drafts[i] is rejected, row
    T-1 a plain sample (the token after the last draft when every draft is accepted). The window is filtered once."""
    t = logits.shape[0]
    f = filter_rows(logits, params, form)
    accept, drawn = verify_filtered(logits[:t - 1], f[:t - 1], drafts, positions[:t - 1], params)
    last = sample_filtered(logits[t - 1:], f[t - 1:], positions[t - 1:], params)
    return accept, jnp.concatenate([drawn, last])
