"""pallas_kernels.gated_delta: the kernel in interpret mode against its reference (padding rows filled with NaN, inf
and huge values, proving they never reach the state), the reference against a naive per-head numpy loop, the CUDA
lowering at the Qwen3-Next-80B shape, and (GPU only) the compiled kernel against the reference.

Bounds (Frobenius, ||a - b|| / ||b||, for out and for states separately):
- kernel vs reference: 1e-5, float32 and bfloat16 inputs alike (both cast the same bf16 values to float32 and run the
  same float32 recurrence; only the order of the dk sums can differ). Measured 0 to ~1e-7 in interpret mode.
- reference vs the float64 numpy loop: 1e-5 (float32 rounding over <= 5 steps, ~1e-7).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro, with_garbage
from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
from strata_jax.pallas_kernels.gated_delta import gated_delta_step, gated_delta_step_reference

RTOL = 1e-5
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

CASES = {  # (T, Hk, Hv, dk, dv, n_valid, block_dv)
    "t1": (1, 1, 2, 16, 16, 1, 32),  # one token, r = 2
    "t2_r1_pad": (2, 2, 2, 8, 16, 1, 32),  # r = 1, one padding row
    "t3_r2_pad": (3, 2, 4, 16, 16, 2, 32),
    "t5_r2_full": (5, 1, 2, 16, 16, 5, 32),  # the longest verify window, every row valid
    "t4_no_valid_row": (4, 2, 4, 8, 16, 0, 32),  # every row padding: each state is the initial one
    "t4_dv_split": (4, 2, 4, 16, 32, 3, 16),  # two column blocks per head
}
QWEN3_NEXT_80B = dict(hk=16, hv=32, dk=128, dv=128)


def make_case(seed: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype):
    """Inputs as Qwen3-Next makes them: q, k L2-normalised (q also scaled by dk**-0.5), v ~ N(0, 1),
    g = -exp(A) * softplus(a) < 0, beta = sigmoid(b), q/k/v/beta in `dtype`, g and the state in float32."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = jnp.asarray(unit(rng.standard_normal((t, hk, dk))) * dk ** -0.5, dtype)  # [T, Hk, dk]
    k = jnp.asarray(unit(rng.standard_normal((t, hk, dk))), dtype)  # [T, Hk, dk]
    v = jnp.asarray(rng.standard_normal((t, hv, dv)), dtype)  # [T, Hv, dv]
    g = jnp.asarray(-np.exp(rng.uniform(-2, 0.5, (t, hv))) * np.log1p(np.exp(rng.standard_normal((t, hv)))),
                    jnp.float32)  # [T, Hv]
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((t, hv)))), dtype)  # [T, Hv]
    state = jnp.asarray(rng.standard_normal((hv, dk, dv)) * 0.5, jnp.float32)  # [Hv, dk, dv]
    return q, k, v, g, beta, state


def naive(q, k, v, g, beta, state, n_valid):
    """transformers' torch_recurrent_gated_delta_rule, one value head and one row at a time, in float64."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    t, hk, _ = q.shape
    hv, dv = v.shape[1:]
    out = np.zeros((t, hv, dv))
    states = np.zeros((t, *state.shape))
    for h in range(hv):
        kh = h // (hv // hk)  # repeat_interleave
        s = np.asarray(state[h], np.float64)  # [dk, dv]
        for i in range(t):
            if i < n_valid:
                s = s * np.exp(g[i, h])
                kv_mem = (s * k[i, kh][:, None]).sum(axis=0)
                delta = (v[i, h] - kv_mem) * beta[i, h]
                s = s + k[i, kh][:, None] * delta[None, :]
            out[i, h] = (s * q[i, kh][:, None]).sum(axis=0)
            states[i, h] = s
    return out, states


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("name", CASES.keys())
def test_kernel_matches_reference(name, dtype):
    t, hk, hv, dk, dv, n_valid, block_dv = CASES[name]
    args = make_case(len(name), t, hk, hv, dk, dv, DTYPES[dtype])
    nv = jnp.int32(n_valid)
    out, states = gated_delta_step(*args, nv, block_dv=block_dv, interpret=True)
    assert out.shape == (t, hv, dv) and out.dtype == jnp.float32
    assert states.shape == (t, hv, dk, dv) and states.dtype == jnp.float32
    want_out, want_states = gated_delta_step_reference(*args, nv)
    assert rel_fro(out, want_out) < RTOL and rel_fro(states, want_states) < RTOL

    # Padding rows keep the state of the last valid row (the initial state when none is valid), bit for bit.
    last = np.asarray(states[n_valid - 1]) if n_valid else np.asarray(args[-1])
    for i in range(n_valid, t):
        np.testing.assert_array_equal(np.asarray(states[i]), last)

    # NaN, inf and 1e30 in the padding rows of k, v, g and beta: the same results, bit for bit, in both.
    if n_valid < t:
        q, k, v, g, beta, state = args
        bad = (q, *(with_garbage(a, n_valid, seed) for seed, a in enumerate((k, v, g, beta))), state)
        for fn, clean in ((lambda *a: gated_delta_step(*a, block_dv=block_dv, interpret=True), (out, states)),
                          (gated_delta_step_reference, (want_out, want_states))):
            got = fn(*bad, nv)
            for a, b in zip(got, clean):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("name", ["t1", "t2_r1_pad", "t3_r2_pad", "t5_r2_full", "t4_no_valid_row"])
def test_reference_matches_naive_loop(name, dtype):
    t, hk, hv, dk, dv, n_valid, _ = CASES[name]
    args = make_case(100 + len(name), t, hk, hv, dk, dv, DTYPES[dtype])
    out, states = gated_delta_step_reference(*args, jnp.int32(n_valid))
    want_out, want_states = naive(*args, n_valid)
    assert rel_fro(out, want_out) < RTOL and rel_fro(states, want_states) < RTOL


def test_unsupported_shapes():
    args = make_case(5, 2, 1, 2, 24, 16, jnp.float32)
    with pytest.raises(ValueError, match="dk=24 must be a power of 2"):
        gated_delta_step(*args, jnp.int32(2), interpret=True)
    gated_delta_step_reference(*args, jnp.int32(2))  # the reference takes any dk
    q, k, v, g, beta, state = make_case(5, 2, 2, 3, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="Hv=3 is not a multiple of Hk=2"):
        gated_delta_step(q, k, v, g, beta, state, jnp.int32(2), interpret=True)
    q, k, v, g, beta, state = make_case(5, 2, 1, 2, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="state must be float32"):
        gated_delta_step(q, k, v, g, beta, state.astype(jnp.bfloat16), jnp.int32(2), interpret=True)
    with pytest.raises(ValueError, match=r"beta must be \[2, 2\]"):
        gated_delta_step(q, k, v, g, beta[:1], state, jnp.int32(2), interpret=True)
    with pytest.raises(ValueError, match="block_dv=24 must be a power of 2"):
        gated_delta_step(q, k, v, g, beta, state, jnp.int32(2), block_dv=24, interpret=True)


def specs(t: int, hk: int, hv: int, dk: int, dv: int, dtype):
    spec = jax.ShapeDtypeStruct
    return (spec((t, hk, dk), dtype), spec((t, hk, dk), dtype), spec((t, hv, dv), dtype), spec((t, hv), jnp.float32),
            spec((t, hv), dtype), spec((hv, dk, dv), jnp.float32), spec((), jnp.int32))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("t", [1, 3, 5])
def test_lowers_for_cuda(t, dtype):
    text = lower_for_cuda(gated_delta_step, *specs(t, **QWEN3_NEXT_80B, dtype=DTYPES[dtype]))
    assert text.count("__gpu$xla.gpu.triton") == 1
    # Every array goes straight from the arguments into the kernel: no transpose, no cast, no copy.
    assert re.search(r"__gpu\$xla\.gpu\.triton\(%\d+, %arg0, %arg1, %arg2, %arg3, %arg4, %arg5\)", text)
    assert "grid_x = 32 : i32, grid_y = 4 : i32" in text  # Hv x dv / 32


# ------------------------------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("block_dv", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES.keys())
def test_compiled_kernel_matches_reference_on_gpu(dtype, block_dv):
    """The compiled Triton kernel at the Qwen3-Next-80B shape, T = 1..5, every n_valid, fresh inputs per T."""
    for t in range(1, 6):
        args = make_case(10 * t + block_dv, t, **QWEN3_NEXT_80B, dtype=DTYPES[dtype])
        for n_valid in range(t + 1):
            nv = jnp.int32(n_valid)
            out, states = gated_delta_step(*args, nv, block_dv=block_dv)
            want_out, want_states = gated_delta_step_reference(*args, nv)
            assert rel_fro(out, want_out) < RTOL and rel_fro(states, want_states) < RTOL, (t, n_valid)
            assert rel_fro(states, naive(*args, n_valid)[1]) < RTOL, (t, n_valid)
