"""pallas_kernels.stacked_linear: the kernel in interpret mode against its reference (fresh random inputs, other
layers of the stacks poisoned with NaN/inf so a wrong layer offset shows), and the CUDA lowering at the
Qwen3-30B-A3B attention shapes (q/k/v in one launch, o alone), the stacks passed in place.

Bounds (Frobenius, ||kernel - ref|| / ||ref||): float32 1e-5 (both accumulate in f32 at full precision; only the
split-K summation order differs); bfloat16 inputs 1e-5 too (f32 accumulation of exact bf16 products)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.stacked_linear import stacked_linear, stacked_linear_reference


def make(seed, t, k, ns, n_layers, layer, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    ws = []
    for n in ns:
        w = rng.standard_normal((n_layers, k, n)) / np.sqrt(k)
        poison = np.where(rng.random(w.shape) < 0.5, np.nan, np.inf)
        w = np.where(np.arange(n_layers)[:, None, None] == layer, w, poison)  # only `layer` is finite
        ws.append(jnp.asarray(w, dtype))
    return x, tuple(ws)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,k,ns,tuning", [
    (1, 64, (64,), dict(block_n=16, block_k=16, k_splits=2)),
    (3, 128, (64, 32, 32), dict(block_n=16, block_k=32, k_splits=4)),  # q/k/v-like: three matrices, one launch
    (8, 96, (48,), dict(block_n=32, block_k=32, k_splits=3)),  # blocks shrink to divide N and K
    (17, 64, (32, 16), {}),  # T past 16: padded to 32
    (1, 64, (64,), dict(block_n=16, block_k=16, k_splits=2, reduce="sum")),  # a GEMV a token
    (3, 128, (64, 32, 32), dict(block_n=16, block_k=32, k_splits=4, reduce="sum")),
    (8, 96, (48,), dict(block_n=32, block_k=32, reduce="sum")),  # wider than 4: tl.dot all the same
    (1, 64, (64,), dict(block_n=16, block_k=16, k_splits=2, reduce="acc")),  # kept elementwise, summed after
    (2, 128, (64, 32, 32), dict(block_n=16, block_k=32, k_splits=2, reduce="acc")),
])
def test_kernel_matches_reference(dtype, t, k, ns, tuning):
    n_layers, layer = 3, 1
    x, ws = make(t * 7 + k, t, k, ns, n_layers, layer, dtype)
    got = stacked_linear(x, ws, jnp.int32(layer), interpret=True, **tuning)
    want = stacked_linear_reference(x, ws, jnp.int32(layer))
    assert got.shape == (t, sum(ns)) and got.dtype == jnp.float32
    assert np.isfinite(np.asarray(got)).all()  # no other layer's poison was read
    assert rel_fro(got, want) < 1e-5


def test_unknown_reduction_is_refused():
    x, ws = make(4, 1, 64, (32,), 2, 0, jnp.float32)
    with pytest.raises(ValueError, match="reduce"):
        stacked_linear(x, ws, jnp.int32(0), interpret=True, reduce="max")


def test_traced_layer_index():
    x, ws = make(3, 2, 64, (32,), 4, 2, jnp.float32)
    f = jax.jit(lambda x, ws, i: stacked_linear(x, ws, i, interpret=True, block_n=16, block_k=16))
    assert rel_fro(f(x, ws, jnp.int32(2)), stacked_linear_reference(x, ws, jnp.int32(2))) < 1e-5


def test_bad_shapes_are_refused():
    x = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="do not match"):
        stacked_linear(x, (jnp.zeros((2, 32, 16), jnp.float32),), jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        stacked_linear(x, (jnp.zeros((2, 64, 24), jnp.float32),), jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="differ"):
        stacked_linear(x, (jnp.zeros((2, 64, 16), jnp.bfloat16),), jnp.int32(0), interpret=True)


@pytest.mark.parametrize("t", [1, 4, 8, 64])  # the decode, wide and prefill windows' tunings (stacked_linear.TUNING)
def test_lowers_for_cuda_at_the_qwen3_shape(t):
    spec = jax.ShapeDtypeStruct
    L, h = 48, 2048
    qkv = lower_for_cuda(lambda x, a, b, c, i: stacked_linear(x, (a, b, c), i), spec((t, h), jnp.bfloat16),
                         spec((L, h, 4096), jnp.bfloat16), spec((L, h, 512), jnp.bfloat16),
                         spec((L, h, 512), jnp.bfloat16), spec((), jnp.int32))
    assert qkv.count("__gpu$xla.gpu.triton") == 1
    assert re.search(r"__gpu\$xla\.gpu\.triton\([^)]*%arg1, %arg2, %arg3\)", qkv)  # the stacks, in place
    o = lower_for_cuda(lambda x, w, i: stacked_linear(x, (w,), i, reduce={1: "sum", 4: "acc"}.get(t)),
                       spec((t, 4096), jnp.bfloat16),
                       spec((L, 4096, h), jnp.bfloat16), spec((), jnp.int32))
    assert o.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("t,reduce", [(1, "sum"), (2, "acc"), (4, "sum")])
def test_a_gemv_window_adds_no_op_around_the_kernel(t, reduce):
    """reduce sum / acc at T = 1, 2, 4: x goes in as it is (no padded copy: an op of its own in the window's graph)
    and, with one K split, the kernel's output is the product (no sum over splits)."""
    spec = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda x, w, i: stacked_linear(x, (w,), i, reduce=reduce, k_splits=1),
                          spec((t, 4096), jnp.bfloat16), spec((4, 4096, 2048), jnp.bfloat16), spec((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.pad" not in text and "stablehlo.reduce" not in text
    padded = lower_for_cuda(lambda x, w, i: stacked_linear(x, (w,), i, reduce="dot", k_splits=2),
                            spec((t, 4096), jnp.bfloat16), spec((4, 4096, 2048), jnp.bfloat16), spec((), jnp.int32))
    assert "stablehlo.pad" in padded and "stablehlo.reduce" in padded  # tl.dot's 16 rows, two K splits summed


@pytest.mark.parametrize("t,row_in_kernel", [(1, True), (1, False), (3, False)])
def test_the_folded_norm_matches_the_norm_then_the_product(t, row_in_kernel):
    """norm=[L, K] weights: x is the input RMSNorm's input, normalised in the kernel (as transformer.rms_norm: float32
    mean of squares, cast back, times the layer's weight) before the product; row_in_kernel: a one-token x goes in
    unpadded. Against rms_norm then the reference product, within the bf16 step the two norms' sums may round apart."""
    from strata_jax.model.transformer import rms_norm
    n_layers, layer, k = 3, 2, 128
    rng = np.random.default_rng()
    x, ws = make(int(rng.integers(1 << 30)), t, k, (64, 32, 32), n_layers, layer, jnp.bfloat16)
    x = x * 3.0  # not unit rows: the norm matters
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal((n_layers, k)), jnp.bfloat16)
    kw = dict(block_n=16, block_k=32, k_splits=2, reduce="dot")
    got = stacked_linear(x, ws, jnp.int32(layer), interpret=True, norm=norm, eps=1e-6, row_in_kernel=row_in_kernel,
                         **kw)
    want = stacked_linear_reference(rms_norm(x, norm[layer], 1e-6), ws, jnp.int32(layer))
    assert got.shape == (t, 128) and np.isfinite(np.asarray(got)).all()
    assert rel_fro(got, want) < 1e-2
    unnormed = stacked_linear_reference(x, ws, jnp.int32(layer))
    assert rel_fro(unnormed, want) > 0.1  # the test can tell the norm's absence
    plain = stacked_linear(rms_norm(x, norm[layer], 1e-6), ws, jnp.int32(layer), interpret=True,
                           row_in_kernel=row_in_kernel, **kw)
    assert rel_fro(plain, want) < 1e-5  # the row fold alone: the product as it was


def test_the_row_fold_leaves_no_pad_and_the_norm_fold_no_norm():
    """Lowered for CUDA at the 30B shape, T=1: with row_in_kernel x is not padded in the graph, and with the norm
    folded the graph holds no reduction before the kernel (the two ops of ~2 us each in the window)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 2048), jnp.bfloat16), spec((4, 2048, 4096), jnp.bfloat16), spec((4, 2048), jnp.bfloat16),
            spec((), jnp.int32))
    text = lower_for_cuda(lambda x, w, n, i: stacked_linear(x, (w,), i, norm=n, eps=1e-6, row_in_kernel=True,
                                                            k_splits=1), *args)
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.pad" not in text and "stablehlo.reduce" not in text
    with pytest.raises(ValueError, match="dot form only"):
        stacked_linear(jnp.ones((1, 64), jnp.bfloat16), (jnp.ones((2, 64, 32), jnp.bfloat16),), jnp.int32(0),
                       reduce="sum", row_in_kernel=True, interpret=True)


def test_the_scanned_graph_with_the_folds_matches_without(monkeypatch):
    """The tiny model's scanned decode windows (T = 1 and 2, the stacked products in place, bf16) with stacked_linear's
    folds switched on (FOLD: the one-token row in the kernel, the input RMSNorm in the q/k/v product) against off:
    logits within bf16 rounding, greedy picks the same."""
    from strata_jax.engine import graphs
    from strata_jax.model.config import preset
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import random_weights, stack_layers
    from strata_jax.pallas_kernels import stacked_linear as sl
    cfg = preset("tiny")
    weights = stack_layers(random_weights(cfg, seed=9, dtype=jnp.bfloat16, scale=0.05))
    out = {}
    for fold in (0, 1):
        monkeypatch.setitem(sl.FOLD, "decode", {"row": fold, "norm": fold})
        step = graphs.jit_decode_window(cfg, None, dense_kernel=True)
        cache = init_cache(cfg, 64, jnp.bfloat16, stacked=True)
        rows = []
        for t, pos in ((2, 3), (1, 5)):
            tokens = jnp.asarray(np.random.default_rng(t).integers(0, cfg.vocab_size, size=t), jnp.int32)
            _, logits, cache = step(weights, cache, tokens, jnp.int32(pos))
            rows.append(np.asarray(logits))
        out[fold] = rows
    for a, b in zip(out[1], out[0]):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
