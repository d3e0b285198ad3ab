"""pallas_kernels/copy_rows.py: the kernels in interpret mode against their jnp references, heavy + light against
the whole sum, NaN garbage in non-CPU rows, y donated (input_output_aliases), and the CUDA (Triton) lowering."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.pallas_kernels.copy_rows import copy_rows_by_weight, copy_rows_by_weight_reference, copy_rows_from_mapped, copy_rows_from_mapped_reference
from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda

SHAPES = [(1, 4, 128), (3, 8, 100), (4, 10, 2048)]  # (T, K, H): one block, H padded, several blocks
DTYPES = [jnp.float32, jnp.bfloat16]


def make_inputs(seed, T, K, H, dtype=jnp.float32, garbage=None):
    """y [T, H] f32, mapped [T, K, H] dtype, weights [T, K] f32 (top-K-like: positive, rows sum to 1), mask [T, K]
    (at least one True and one False); rows of non-CPU entries hold `garbage` if given (e.g. NaN)."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((T, H)).astype(np.float32)
    mapped = rng.standard_normal((T, K, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32) + 0.01
    w /= w.sum(axis=1, keepdims=True)
    mask = rng.random((T, K)) < 0.5
    mask.flat[0], mask.flat[-1] = True, False
    if garbage is not None:
        mapped[~mask] = garbage
    return jnp.asarray(y), jnp.asarray(mapped, dtype), jnp.asarray(w), jnp.asarray(mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_match_references(shape, dtype):
    y, mapped, w, mask = make_inputs(sum(shape), *shape, dtype)
    got = copy_rows_from_mapped(y, mapped, w, mask, interpret=True)
    want = copy_rows_from_mapped_reference(y, mapped, w, mask)
    assert got.shape == y.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, y)  # the CPU rows were really added
    thr = jnp.float32(0.1)
    for heavy in (True, False):
        got = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=heavy, interpret=True)
        want = copy_rows_by_weight_reference(y, mapped, w, mask, thr, heavy=heavy)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threshold", [0.0, 0.1, 1.0])
def test_heavy_plus_light_is_the_whole_sum(threshold):
    y, mapped, w, mask = make_inputs(11, 3, 8, 100)
    w = w.at[1, 2].set(0.1)  # exactly on the 0.1 threshold: heavy
    mask = mask.at[1, 2].set(True)
    thr = jnp.float32(threshold)
    heavy = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=True, interpret=True)
    both = copy_rows_by_weight(heavy, mapped, w, mask, thr, heavy=False, interpret=True)
    whole = copy_rows_from_mapped(y, mapped, w, mask, interpret=True)
    assert rel_fro(both, whole) <= 1e-6
    if threshold == 0.0:  # every weight is heavy: the light pass adds nothing
        np.testing.assert_array_equal(heavy, both)
    if threshold == 1.0:  # no weight reaches 1: the heavy pass adds nothing
        np.testing.assert_array_equal(heavy, y)


def test_weight_equal_to_threshold_is_heavy():
    y, mapped, w, mask = make_inputs(12, 2, 4, 128)
    w = jnp.full_like(w, 0.25)
    thr = jnp.float32(0.25)
    heavy = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=True, interpret=True)
    light = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=False, interpret=True)
    np.testing.assert_allclose(heavy, copy_rows_from_mapped(y, mapped, w, mask, interpret=True), rtol=1e-6)
    np.testing.assert_array_equal(light, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_nan_garbage_in_non_cpu_rows_does_not_leak(dtype):
    y, mapped, w, mask = make_inputs(13, 3, 8, 100, dtype, garbage=np.nan)
    w = jnp.where(mask, w, 0.0)  # as the caller passes them: 0 * NaN would still be NaN
    clean = copy_rows_from_mapped_reference(y, jnp.where(mask[..., None], mapped, 0), w, mask)
    got = copy_rows_from_mapped(y, mapped, w, mask, interpret=True)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, clean, rtol=1e-6, atol=1e-6)
    for heavy in (True, False):
        got = copy_rows_by_weight(y, mapped, w, mask, jnp.float32(0.1), heavy=heavy, interpret=True)
        assert np.isfinite(got).all()


def test_donated_y_is_updated_in_place():
    """y is input 0 aliased to output 0; under jit with y donated the result is still right (on the GPU the
    output then reuses y's buffer; the CPU may copy, so no buffer identity is asserted)."""
    y, mapped, w, mask = make_inputs(14, 4, 8, 256)
    want = copy_rows_from_mapped_reference(y, mapped, w, mask)
    thr = jnp.float32(0.1)
    jaxpr = str(jax.make_jaxpr(lambda y: copy_rows_by_weight(y, mapped, w, mask, thr, heavy=True))(y))
    assert "input_output_aliases=((0, 0),)" in jaxpr

    @functools.partial(jax.jit, donate_argnums=0)
    def step(y, mapped, w, mask):
        y = copy_rows_by_weight(y, mapped, w, mask, thr, heavy=True, interpret=True)
        return copy_rows_by_weight(y, mapped, w, mask, thr, heavy=False, interpret=True)

    y_in = jnp.array(y)
    got = step(y_in, mapped, w, mask)
    assert y_in.is_deleted()  # the donation was taken
    assert rel_fro(got, want) <= 1e-6
    y_in = jnp.array(y)
    got = jax.jit(lambda y: copy_rows_from_mapped(y, mapped, w, mask, interpret=True), donate_argnums=0)(y_in)
    assert y_in.is_deleted()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("shape", [(3, 10, 2048), (1, 8, 100), (5, 3, 384)], ids=lambda s: "x".join(map(str, s)))
def test_lowers_for_cuda(shape):
    T, K, H = shape
    S = jax.ShapeDtypeStruct
    args = (S((T, H), jnp.float32), S((T, K, H), jnp.bfloat16), S((T, K), jnp.float32), S((T, K), jnp.bool_))
    text = lower_for_cuda(copy_rows_from_mapped, *args)
    assert "xla.gpu.triton" in text and "copy_rows_from_mapped_kernel" in text
    assert "output_operand_alias" in text  # y -> out reaches the custom call
    for heavy in (True, False):
        text = lower_for_cuda(functools.partial(copy_rows_by_weight, heavy=heavy), *args, S((), jnp.float32))
        assert "xla.gpu.triton" in text and f"copy_rows_{'heavy' if heavy else 'light'}_kernel" in text
