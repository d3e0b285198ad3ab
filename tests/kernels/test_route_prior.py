"""The route-prior Pallas kernel (interpret mode on the CPU) against its jnp reference, the properties the engine
relies on (no-op at lam == 0 or all resident, keep protects the unbiased top experts), and its CUDA lowering."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.route_prior import route_prior, route_prior_reference

# (T, E, K, keep, norm_topk_prob): E and K powers of 2 and not (K up to 10, padded to 16 in the kernel); every
# (keep, norm) pair once among the first three shapes. Each row is one compile, so not the full product.
CASES = [(1, 16, 4, 0, True), (1, 16, 4, 1, False),
         (3, 60, 4, 2, True), (3, 60, 4, 0, False),
         (4, 128, 8, 1, True), (4, 128, 8, 2, False),
         (5, 512, 10, 2, True), (5, 512, 10, 1, False)]


def kernel(logits, resident, lam, **kw):
    return route_prior(logits, resident, lam, interpret=True, **kw)


def random_inputs(rng, t: int, e: int, lam_scale: float = 2.0):
    """logits [T, E] ~ N(0, 1); resident [E] about half; lam [T] in (0, lam_scale): large enough to change routes."""
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    resident = jnp.asarray(rng.random(e) < 0.5)
    lam = jnp.asarray(rng.random(t) * lam_scale, jnp.float32)
    return logits, resident, lam


def assert_same(got, want):
    got_ids, got_w, got_changed = got
    want_ids, want_w, want_changed = want
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(got_changed), np.asarray(want_changed))
    assert got_ids.dtype == jnp.int32 and got_w.dtype == jnp.float32 and got_changed.dtype == jnp.bool_


def unbiased_topk(logits, k: int, norm: bool = True):
    """The plain router: top-K by logit, softmax weights over all experts, renormalised when `norm`."""
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = jax.lax.top_k(logits, k)
    w = jnp.take_along_axis(probs, ids, axis=1)
    return ids, (w / jnp.sum(w, axis=1, keepdims=True) if norm else w)


@pytest.mark.parametrize("t,e,k,keep,norm", CASES)
def test_kernel_matches_reference(t, e, k, keep, norm):
    rng = np.random.default_rng(1000 * e + 10 * keep + norm)
    kw = dict(k=k, keep=keep, norm_topk_prob=norm)
    any_changed = False
    for _ in range(3):  # fresh data, same compiled shapes
        logits, resident, lam = random_inputs(rng, t, e)
        got = kernel(logits, resident, lam, **kw)
        assert_same(got, route_prior_reference(logits, resident, lam, **kw))
        any_changed |= bool(np.any(got[2]))
    assert any_changed, "lam too small to test anything: no route changed"


@pytest.mark.parametrize("t,e,k,keep", [(4, 64, 8, 1), (3, 60, 6, 0)])
def test_ties_pick_lower_index(t, e, k, keep):
    rng = np.random.default_rng(7 + e)
    # A few half-integer values: many equal logits and, with lam from the same grid, many equal keys.
    logits = jnp.asarray(rng.integers(0, 4, (t, e)) * 0.5, jnp.float32)
    resident = jnp.asarray(rng.random(e) < 0.5)
    lam = jnp.asarray(rng.integers(1, 4, t) * 0.5, jnp.float32)
    want = route_prior_reference(logits, resident, lam, k=k, keep=keep)
    assert_same(kernel(logits, resident, lam, k=k, keep=keep), want)
    # The unbiased part of the tie rule, explicitly: at lam == 0 the ids are lax.top_k's.
    ids, _, _ = kernel(logits, resident, jnp.zeros((t,), jnp.float32), k=k, keep=keep)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(logits, k)[1]))


@pytest.mark.parametrize("norm", [True, False])
def test_zero_lambda_is_plain_routing(norm):
    t, e, k = 3, 60, 4
    logits, resident, _ = random_inputs(np.random.default_rng(11), t, e)
    ids, w, changed = kernel(logits, resident, jnp.zeros((t,), jnp.float32), k=k, norm_topk_prob=norm)
    want_ids, want_w = unbiased_topk(logits, k, norm)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    assert not np.any(changed)


def test_all_resident_is_plain_routing():
    t, e, k = 3, 60, 4
    logits, _, _ = random_inputs(np.random.default_rng(12), t, e)
    lam = jnp.asarray([1e6, np.inf, 5.0], jnp.float32)  # inf too: never 0 * inf = nan
    ids, w, changed = kernel(logits, jnp.ones((e,), bool), lam, k=k, keep=1)
    want_ids, want_w = unbiased_topk(logits, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    assert not np.any(changed)


def test_keep_k_is_plain_routing():
    t, e, k = 3, 60, 4
    logits, resident, lam = random_inputs(np.random.default_rng(13), t, e, lam_scale=100.0)
    ids, _, changed = kernel(logits, resident, lam, k=k, keep=k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(logits, k)[1]))
    assert not np.any(changed)


def test_lambda_pulls_resident_in_and_keep_protects_top1():
    # Experts 0 and 1 lead but are missed; 2 and 3 are resident. K = 2.
    row = np.full(16, -5.0, np.float32)
    row[:4] = [4.0, 3.0, 2.9, 1.0]
    logits = jnp.asarray(np.tile(row, (3, 1)))  # [3, 16]: one token per lambda
    resident = jnp.asarray(np.isin(np.arange(16), [2, 3]))
    lam = jnp.asarray([0.0, 0.5, 10.0], jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits[0]))

    ids, w, changed = kernel(logits, resident, lam, k=2)
    # lam 0: unchanged. lam 0.5: keys 3.5, 2.5, 2.9 -> resident 2 replaces missed 1. lam 10: both resident win.
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1], [0, 2], [2, 3]])
    np.testing.assert_array_equal(np.asarray(changed), [False, True, True])
    np.testing.assert_allclose(np.asarray(w[1]), probs[[0, 2]] / probs[[0, 2]].sum(), rtol=1e-6)

    # keep=1 forces the unbiased top-1 (missed expert 0) even at lam 10; the other slot still goes to 2.
    ids, _, changed = kernel(logits, resident, lam, k=2, keep=1)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1], [0, 2], [0, 2]])
    np.testing.assert_array_equal(np.asarray(changed), [False, True, True])


def test_bad_arguments_raise():
    logits, resident, lam = random_inputs(np.random.default_rng(14), 2, 8)
    with pytest.raises(ValueError, match="k <= E"):
        kernel(logits, resident, lam, k=9)
    with pytest.raises(ValueError, match="keep <= k"):
        kernel(logits, resident, lam, k=2, keep=3)


@pytest.mark.parametrize("t,e,k,keep", [(1, 16, 4, 0), (4, 128, 8, 2), (3, 500, 10, 1)])
def test_lowers_for_cuda(t, e, k, keep):
    text = lower_for_cuda(functools.partial(route_prior, k=k, keep=keep),
                          jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.bool_),
                          jax.ShapeDtypeStruct((t,), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text and 'name = "route_prior"' in text
