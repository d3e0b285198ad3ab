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
