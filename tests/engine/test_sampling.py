"""The sampler's filter forms against the sort of the vocabulary, and its draws against the exact distribution.

sampling.FORMS must keep the same tokens with the same values as _sorted_filter (the definition of top-k / top-p),
and every draw, plain or through speculative verification, must follow the filtered softmax: checked here with a
chi-square test of 20,000 draws over a vocabulary of 50.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from strata_jax import sampling
from strata_jax.sampling import SamplingParams

sorted_rows = jax.jit(jax.vmap(sampling._sorted_filter, in_axes=(0, None)))
threshold_rows = jax.jit(jax.vmap(sampling._threshold_filter, in_axes=(0, None)))
jit_sample = jax.jit(sampling.sample, static_argnums=3)  # (logits, positions, params, form)


def logit_rows(rng, t: int, v: int, scale: float) -> np.ndarray:
    """[t, v] float32 rows: random (peaked for a large scale, flat for a small one), then, where t allows, rows of
    ties: logits rounded to halves (many ties at every level), all equal, and -0.0 beside +0.0 (tied in the sort)."""
    x = rng.standard_normal((t, v)).astype(np.float32) * scale  # [T, V]
    if t > 1:
        x[1] = np.round(x[1] * 2) / 2
    if t > 2:
        x[2] = 0.0
    if t > 3:
        x[3] = np.where(rng.random(v) < 0.5, np.float32(-0.0), np.float32(0.0))
        x[3, : v // 10] = 1.0
    return x


# How far from top_p the exact mass before a token may lie where the two filters decide it differently: the float32
# sums over up to 40,000 tokens (a cumsum in rank order, a masked sum) round ~1e-7 apart.
MASS_ROUNDING = 1e-5


def exact_mass_before(scaled: np.ndarray) -> np.ndarray:
    """[T, V]: each token's probability mass before it in the stable sort's order, in float64."""
    z = scaled.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    order = np.argsort(-z, axis=1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=1)
    out = np.empty_like(p)
    np.put_along_axis(out, order, np.cumsum(sorted_p, axis=1) - sorted_p, axis=1)
    return out


@pytest.mark.parametrize("t,v,scale", [(1, 7, 3.0), (5, 50, 0.1), (5, 50, 2.0), (4, 3000, 0.5), (4, 3000, 6.0),
                                       (2, 40000, 1.0)])
def test_threshold_filter_keeps_what_the_sort_keeps(t, v, scale):
    """The "top_p" form (a threshold by radix select, no sort) keeps the sorted filter's tokens with its values, tied
    logits included (settled by id, as the stable sort), and the seeded draws after it are the same tokens."""
    rng = np.random.default_rng(v + t + int(scale * 10))
    logits = jnp.asarray(logit_rows(rng, t, v, scale))
    positions = jnp.arange(t, dtype=jnp.int32) + 17
    top_p_rows = jax.jit(functools.partial(sampling.filter_rows, form="top_p"))
    for top_p in (0.1, 0.5, 0.8, 0.95, 0.999, 1.0):
        for temperature in (0.3, 1.0, 1.5):
            params = SamplingParams.make(temperature, top_p, 0, seed=5)
            assert sampling.form_of(0, top_p) == ("top_p" if top_p < 1 else "plain")
            scaled = logits / temperature
            got, want = np.asarray(top_p_rows(logits, params)), np.asarray(sorted_rows(scaled, params))
            differ = np.isfinite(got) != np.isfinite(want)  # [T, V]
            if differ.any():  # only where float32 rounding of the masses decides (the docstring's one exception)
                assert np.all(np.abs(exact_mass_before(np.asarray(scaled))[differ] - top_p) < MASS_ROUNDING)
            same = ~differ
            np.testing.assert_array_equal(got[same], want[same], err_msg=f"top_p={top_p} temperature={temperature}")
            rows = ~differ.any(axis=1)  # the draws after identical filtered rows are the same tokens
            assert np.array_equal(np.asarray(jit_sample(logits, positions, params, "top_p"))[rows],
                                  np.asarray(jit_sample(logits, positions, params, "sorted"))[rows])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_threshold_filter_keeps_the_same_set_whatever_the_radix(monkeypatch, bits):
    """The radix select's threshold is the smallest key whose mass above is below top_p, whatever the digit width:
    the same filtered rows as the backend's own width (radix_bits)."""
    rng = np.random.default_rng(bits)
    logits = jnp.asarray(logit_rows(rng, 4, 300, 1.0))
    want = [np.asarray(threshold_rows(logits, SamplingParams.make(1.0, top_p))) for top_p in (0.0, 0.3, 0.9, 1.0)]
    monkeypatch.setattr(sampling, "RADIX_BITS", bits)
    rows = jax.jit(jax.vmap(sampling._threshold_filter, in_axes=(0, None)))  # traced again with this width
    for top_p, w in zip((0.0, 0.3, 0.9, 1.0), want):
        np.testing.assert_array_equal(np.asarray(rows(logits, SamplingParams.make(1.0, top_p))), w)


def test_threshold_filter_keeps_rank_zero_and_the_lower_ids_of_a_tie():
    """Rank 0 is kept whatever top_p; among equal logits at the boundary, the lower ids first."""
    flat = jnp.zeros((1, 10), jnp.float32)  # ten ties: each 0.1 of the mass
    for top_p, kept in ((0.0, 1), (1e-9, 1), (0.1, 1), (0.15, 2), (0.35, 4), (0.999, 10)):
        got = np.asarray(threshold_rows(flat, SamplingParams.make(1.0, top_p)))[0]
        assert np.isfinite(got).tolist() == [True] * kept + [False] * (10 - kept), top_p


def tied_rows(rng, t: int, v: int, scale: float) -> np.ndarray:
    """[t, v] float32 rows for the "top_k" form, none zero: random, then (where t allows) logits rounded to halves
    (a few tokens above the k-th value, many tied at it), four values (hundreds tied at the top: the top-k set all
    one tie, settled by id alone) and all one value."""
    x = rng.standard_normal((t, v)).astype(np.float32) * scale + np.float32(0.3)  # [T, V]
    if t > 1:
        x[1] = np.round(x[1] * 2) / 2 + np.float32(0.25)
    if t > 2:
        x[2] = rng.integers(1, 5, v).astype(np.float32) * np.float32(0.75)
    if t > 3:
        x[3] = np.float32(-1.5)
    return x


def assert_top_k_form_is_the_sort(logits: np.ndarray, top_ks, top_ps, temperature: float = 1.0,
                                  draws: bool = True, rows=None) -> None:
    """filter_rows "top_k" keeps exactly _sorted_filter's tokens with its values (the same -inf pattern), and (draws)
    the seeded draws after it are the same tokens."""
    logits = jnp.asarray(logits)
    t = logits.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32) + 29
    for top_k in top_ks:
        for top_p in top_ps:
            params = SamplingParams.make(temperature, top_p, top_k, seed=9)
            assert sampling.form_of(top_k, top_p) == "top_k"
            got = np.asarray((rows or top_k_rows)(logits, params))
            want = np.asarray(sorted_rows(logits / temperature, params))
            what = f"v={logits.shape[1]} top_k={top_k} top_p={top_p}"
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
            np.testing.assert_array_equal(got, want, err_msg=what)
            if draws:
                assert np.array_equal(np.asarray(jit_sample(logits, positions, params, "top_k")),
                                      np.asarray(jit_sample(logits, positions, params, "sorted"))), what


top_k_rows = jax.jit(functools.partial(sampling.filter_rows, form="top_k"))
TOP_KS, TOP_PS = (1, 2, 20, 64), (0.5, 0.8, 0.95, 1.0)


@pytest.mark.parametrize("t,v,scale", [(4, 7, 2.0), (4, 100, 0.5), (4, 3000, 3.0), (3, 3000, 0.2)])
def test_top_k_filter_keeps_what_the_sort_keeps(t, v, scale):
    """The "top_k" form (the k-th largest logit by radix select, the top-k set compacted, top-p over it; no sort of
    the vocabulary) keeps the sorted filter's tokens with its values, heavy ties at the k-th value included (the
    lower ids first, as the stable sort); a vocabulary under top_k keeps it whole, as the sort does."""
    rng = np.random.default_rng(1000 + v + t + int(scale * 10))
    assert_top_k_form_is_the_sort(tied_rows(rng, t, v, scale), TOP_KS, TOP_PS, temperature=0.7)


def test_top_k_filter_keeps_what_the_sort_keeps_over_qwen3s_vocabulary():
    """The same at Qwen3's vocabulary (151,936 tokens): a random row and one of many ties (the filtered rows only:
    two sorts of this vocabulary a setting would double the test's time)."""
    rng = np.random.default_rng(151936)
    radix = jax.jit(lambda x, p: jax.vmap(sampling._top_k_filter, in_axes=(0, None))(x / p.temperature, p))
    for rows in (None, radix):  # this backend's way, and the GPU's (the radix select) whatever this backend is
        assert_top_k_form_is_the_sort(tied_rows(rng, 2, 151936, 2.0), TOP_KS, TOP_PS, draws=False, rows=rows)


@pytest.mark.parametrize("select", ["radix", "lax"])
def test_both_ways_of_the_top_k_form_keep_what_the_sort_keeps(select):
    """The two ways of the "top_k" form, each traced here whatever this backend picks (top_k_select): the radix
    select (GPU) and lax.top_k's candidates (elsewhere) keep the sorted filter's set on tie-heavy rows."""
    one = sampling._top_k_filter if select == "radix" else sampling._candidate_filter
    rows = jax.jit(jax.vmap(one, in_axes=(0, None)))
    logits = jnp.asarray(tied_rows(np.random.default_rng(77), 4, 700, 1.5)) / 0.7
    for top_k in TOP_KS:
        for top_p in TOP_PS:
            params = SamplingParams.make(1.0, top_p, top_k)
            np.testing.assert_array_equal(np.asarray(rows(logits, params)), np.asarray(sorted_rows(logits, params)),
                                          err_msg=f"{select} top_k={top_k} top_p={top_p}")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_top_k_filter_keeps_the_same_set_whatever_the_radix(monkeypatch, bits):
    """The radix select's k-th key is exact whatever the digit width (4 on a GPU, 2 on this CPU)."""
    monkeypatch.setattr(sampling, "RADIX_BITS", bits)
    rows = jax.jit(jax.vmap(sampling._top_k_filter, in_axes=(0, None)))  # traced again with this width
    logits = jnp.asarray(tied_rows(np.random.default_rng(40 + bits), 4, 500, 1.0))
    for top_k, top_p in ((1, 1.0), (2, 0.5), (20, 0.8), (64, 0.95)):
        params = SamplingParams.make(1.0, top_p, top_k)
        np.testing.assert_array_equal(np.asarray(rows(logits, params)), np.asarray(sorted_rows(logits, params)))


def test_top_k_filter_takes_the_lower_ids_of_a_tie():
    """Among equal logits at the k-th value, the lower ids fill the top-k set; top-p then counts them in id order."""
    row = np.full((1, 12), 0.5, np.float32)
    row[0, 9] = 2.0  # one token above the tie
    for top_k, top_p, kept in ((1, 1.0, [9]), (3, 1.0, [0, 1, 9]), (5, 1.0, [0, 1, 2, 3, 9]), (12, 1.0, range(12)),
                               (64, 1.0, range(12)), (5, 1e-9, [9])):
        got = np.asarray(top_k_rows(jnp.asarray(row), SamplingParams.make(1.0, top_p, top_k)))[0]
        assert np.flatnonzero(np.isfinite(got)).tolist() == list(kept), (top_k, top_p)
        np.testing.assert_array_equal(got[list(kept)], row[0, list(kept)])


# Settings of each form (form_of), on a vocabulary of V_STAT tokens.
FORM_SETTINGS = {"plain": (1.0, 0, 1.0), "top_k": (0.8, 7, 0.9), "top_p": (1.2, 0, 0.8), "sorted": (0.9, 100, 0.7)}
V_STAT, N_DRAWS, P_MIN = 50, 20_000, 1e-4


def exact_distribution(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The filtered softmax [V] in float64, from the sorted filter's kept set."""
    kept = np.isfinite(np.asarray(sorted_rows(jnp.asarray(row[None] / np.float32(temperature)),
                                              SamplingParams.make(temperature, top_p, top_k)))[0])
    z = row.astype(np.float64) / temperature
    p = np.where(kept, np.exp(z - z[kept].max()), 0.0)
    return p / p.sum()


def assert_follows(tokens: np.ndarray, p: np.ndarray, what: str) -> None:
    """Chi-square of the tokens' counts against N * p; tokens of p = 0 must never come out; bins expected under 5
    draws pooled into one."""
    counts = np.bincount(tokens, minlength=p.size)
    assert counts[p == 0].sum() == 0, what
    expected = p * tokens.size
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (p > 0)].sum())
    exp = np.append(expected[big], expected[~big & (p > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    pvalue = stats.chisquare(obs, exp).pvalue
    assert pvalue > P_MIN, (what, pvalue)


@pytest.fixture(scope="module")
def stat_row():
    return np.random.default_rng(23).standard_normal(V_STAT).astype(np.float32) * 2.0  # [V]


@pytest.mark.parametrize("form", sampling.FORMS)
def test_draws_follow_the_filtered_distribution(form, stat_row):
    """N_DRAWS draws of one row through sampling.sample (a key per position) follow the exact filtered softmax."""
    temperature, top_k, top_p = FORM_SETTINGS[form]
    assert sampling.form_of(top_k, top_p) == form
    params = SamplingParams.make(temperature, top_p, top_k, seed=7)
    logits = jnp.broadcast_to(jnp.asarray(stat_row), (N_DRAWS, V_STAT))  # [N, V]: one row at N positions
    positions = jnp.arange(N_DRAWS, dtype=jnp.int32)
    tokens = np.asarray(jax.jit(functools.partial(sampling.sample, form=form))(logits, positions, params))
    assert_follows(tokens, exact_distribution(stat_row, temperature, top_k, top_p), form)


@pytest.mark.parametrize("form", sampling.FORMS)
def test_verified_tokens_follow_the_filtered_distribution_whatever_the_draft(form, stat_row):
    """Speculative verification (verify_filtered): the draft if accepted, else the residual draw, follows the
    target's filtered softmax for a draft the target likes, a middling one and one it filters out."""
    temperature, top_k, top_p = FORM_SETTINGS[form]
    params = SamplingParams.make(temperature, top_p, top_k, seed=11)
    p = exact_distribution(stat_row, temperature, top_k, top_p)
    order = np.argsort(-p, kind="stable")
    logits = jnp.broadcast_to(jnp.asarray(stat_row), (N_DRAWS, V_STAT))  # [N, V]
    positions = jnp.arange(N_DRAWS, dtype=jnp.int32) + 1000

    @jax.jit  # logits as an argument: a captured constant would have XLA fold the filter while compiling
    def emitted(logits, draft):
        f = jnp.broadcast_to(sampling.filter_rows(logits[:1], params, form), logits.shape)  # one row's filter
        accept, drawn = sampling.verify_filtered(logits, f, jnp.full((N_DRAWS,), draft, jnp.int32), positions,
                                                 params)
        return jnp.where(accept, draft, drawn), jnp.mean(accept)

    for draft in (int(order[0]), int(order[2]), int(order[-1])):
        tokens, accepted = emitted(logits, draft)
        np.testing.assert_allclose(float(accepted), p[draft], atol=0.02)  # accepted with probability p(draft)
        assert_follows(np.asarray(tokens), p, f"{form} draft {draft}")
