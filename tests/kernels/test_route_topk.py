"""The exact router's softmax + top-K kernel (interpret mode on the CPU) against its jnp reference (XLA's softmax and
`jax.lax.top_k`, what moe.route runs without it), ties, padding rows, the model's Route built from either, and its
CUDA lowering."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.route_topk import route_topk, route_topk_reference

# (T, E, K, norm_topk_prob, dtype): E and K powers of 2 and not (padded in the kernel); T = 1 (a decode window's
# one program) and wider. Each row is one compile.
CASES = [(1, 128, 8, True, jnp.bfloat16), (1, 60, 4, False, jnp.bfloat16), (3, 16, 4, True, jnp.float32),
         (5, 512, 10, True, jnp.bfloat16)]
BF16_STEP = 2.0 ** -8  # a weight's rounding to bf16 may land one step apart where the two softmaxes differ by a bit


def kernel(logits, valid, **kw):
    return route_topk(logits, valid, interpret=True, **kw)


def random_logits(rng, t: int, e: int):
    return jnp.asarray(rng.standard_normal((t, e)) * rng.uniform(0.5, 3.0), jnp.float32)  # [T, E]


@pytest.mark.parametrize("t,e,k,norm,dtype", CASES)
def test_kernel_matches_reference(t, e, k, norm, dtype):
    rng = np.random.default_rng()
    kw = dict(k=k, norm_topk_prob=norm, dtype=dtype)
    for _ in range(3):  # fresh data, same compiled shapes
        logits = random_logits(rng, t, e)
        valid = jnp.asarray(rng.random(t) < 0.7).at[0].set(True)  # [T]: some padding rows beyond the first
        ids, w = kernel(logits, valid, **kw)
        want_ids, want_w = route_topk_reference(logits, valid, **kw)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=BF16_STEP, atol=1e-7)
        assert ids.dtype == jnp.int32 and w.dtype == jnp.float32 and ids.shape == w.shape == (t, k)
        v = np.asarray(valid)
        assert (np.asarray(ids)[~v] == e).all() and (np.asarray(w)[~v] == 0).all()  # padding rows route nowhere
        w_valid = np.asarray(w)[v]
        assert (np.diff(w_valid, axis=1) <= 0).all()  # by weight, descending
        np.testing.assert_array_equal(w_valid, np.asarray(jnp.asarray(w_valid).astype(dtype).astype(jnp.float32)))
        if norm:
            np.testing.assert_allclose(w_valid.sum(axis=1), 1.0, atol=k * BF16_STEP)


def test_ties_pick_lower_index():
    """Equal probabilities: the lower expert index first, as jax.lax.top_k."""
    logits = jnp.asarray([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5, 0.5, 3.0]], jnp.float32)
    kw = dict(k=4, norm_topk_prob=False, dtype=jnp.float32)
    ids, _ = kernel(logits, jnp.ones((1,), bool), **kw)
    want, _ = route_topk_reference(logits, jnp.ones((1,), bool), **kw)
    np.testing.assert_array_equal(np.asarray(ids), [[7, 1, 2, 4]])
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))


@pytest.mark.parametrize("t", [1, 3])
def test_route_with_the_kernel_is_the_route(t):
    """moe.route(kernel=True) against moe.route: the same Route (ids, distinct experts, combine matrix, counts) from
    the tiny model's router on fresh hidden states, with a padding row at T = 3."""
    from strata_jax.model import moe
    from strata_jax.model.config import preset
    cfg = preset("tiny")
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((t, cfg.hidden_size)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.num_experts)) * 0.1, jnp.bfloat16)
    valid = jnp.arange(t) < max(1, t - 1)
    got, want = moe.route(x, router, cfg, valid, kernel=True), moe.route(x, router, cfg, valid)
    for name in ("topk_ids", "expert_ids", "entry_counts"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    for name in ("topk_weights", "combine"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                   rtol=BF16_STEP, atol=1e-7, err_msg=name)


def test_bad_k_raises():
    with pytest.raises(ValueError, match="1 <= k <= E"):
        kernel(jnp.ones((1, 4), jnp.float32), jnp.ones((1,), bool), k=5)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (4, 60, 10)])
def test_lowers_for_cuda(t, e, k):
    text = lower_for_cuda(functools.partial(route_topk, k=k),
                          jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct((t,), jnp.bool_))
    assert "route_topk" in text
