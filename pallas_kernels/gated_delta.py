"""The decode-time step of the gated delta rule (Qwen3-Next's Gated DeltaNet linear attention) over a window of T
tokens, keeping the state after every token (the engine commits the accepted position's state of a verify window).

Semantics (`gated_delta_step` and `gated_delta_step_reference`; transformers' torch_recurrent_gated_delta_rule
without its L2 norm and q scaling, which the caller has applied), per value head h, in float32:

- q, k [T, Hk, dk] (L2-normalised; q scaled by dk**-0.5), v [T, Hv, dv], g [T, Hv] (log decay, <= 0), beta [T, Hv]
  in (0, 1): float32 or bfloat16, cast to float32; state [Hv, dk, dv] float32, the state before row 0; n_valid: an
  int32 scalar (traced). Hv = r * Hk; value head h uses key head h // r (transformers' repeat_interleave).
- for t < T:  S = S * exp(g[t, h]);  kv_mem = k_t @ S [dv];  delta = (v_t - kv_mem) * beta[t, h];
  S = S + outer(k_t, delta);  out[t, h] = q_t @ S.
  Both matvecs are sums over dk of elementwise products (as transformers writes them): exact float32, no TF32.
- Rows t >= n_valid are padding: S stays as it was (as if g = 0 and beta = 0, but by a select, so their k, v, g and
  beta are never used, NaN included); their out is q_t @ S, S being the state after the last valid row.
- Returns out [T, Hv, dv] float32 and states [T, Hv, dk, dv] float32 (states[t]: the state after row t).

Kernel: grid (Hv, dv / block_dv). Program (h, j) loads columns [j * block_dv, (j + 1) * block_dv) of value head h's
state once, as a [dk, block_dv] float32 tile kept in registers, runs the T rows (a static unroll: T is 1..5) and
stores each row's tile to states[t, h, :, cols] and its out[t, h, cols]. Every operation of the recurrence is per
column of S (the dk sums stay inside a column), so the dv split is exact and programs share nothing. The arrays are
read in place (BlockSpecs over the caller's layouts; the wrapper adds no XLA op but the [1]-reshape of n_valid): q
and k rows of key head h // r (re-read by the r value heads' programs: a few hundred bytes, from L2), v [T, block_dv],
g and beta scalars. HBM traffic: the state once, T states and T out rows written; q, k, v, g, beta are kilobytes.
The matvecs are broadcast-multiply-sums, not tl.dot (a single row: tl.dot needs every dim >= 16, and the step is
memory-bound).

Blocks: dk and dv must be powers of 2 (Triton arrays; a ValueError otherwise); block_dv = min(block_dv, dv), a power
of 2. The default 32 at the Qwen3-Next-80B shape (Hv 32, dk = dv = 128): a [128, 32] float32 tile (32 registers a
thread at 4 warps), 128-byte rows, grid 32 x 4 = 128 programs on the H200's 132 SMs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_BLOCK_DV = 32


# ------------------------------------------------------------------------------------------------------------ kernel

def _gated_delta_kernel(nv_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, states_ref, *, t: int):
    """nv [1] int32; q, k [T, dk]; v [T, BV]; g, beta [T]; state [dk, BV] f32 -> out [T, BV], states [T, dk, BV]."""
    n_valid = nv_ref[0]
    s = s_ref[...]  # [dk, BV] f32: read once, in registers for the whole window
    for i in range(t):  # static unroll over the window's rows
        q = q_ref[i, :].astype(jnp.float32)  # [dk]
        k = k_ref[i, :].astype(jnp.float32)  # [dk]
        v = v_ref[i, :].astype(jnp.float32)  # [BV]
        g = g_ref[i].astype(jnp.float32)  # scalar
        beta = beta_ref[i].astype(jnp.float32)  # scalar
        decayed = s * jnp.exp(g)  # [dk, BV]
        kv_mem = jnp.sum(k[:, None] * decayed, axis=0)  # [BV]
        delta = (v - kv_mem) * beta  # [BV]
        updated = decayed + k[:, None] * delta[None, :]  # [dk, BV]
        s = jnp.where(i < n_valid, updated, s)  # padding rows keep the state (a select: their inputs never reach it)
        states_ref[i, :, :] = s
        o_ref[i, :] = jnp.sum(q[:, None] * s, axis=0)  # [BV]


# ----------------------------------------------------------------------------------------------------------- wrapper

def _check(q, k, v, g, beta, state, kernel: bool) -> tuple[int, int, int, int, int, int]:
    """The shapes' (T, Hk, Hv, dk, dv, r), or a ValueError naming what does not fit."""
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    want = dict(k=(k.shape, (t, hk, dk)), v=(v.shape, (t, hv, dv)), g=(g.shape, (t, hv)), beta=(beta.shape, (t, hv)),
                state=(state.shape, (hv, dk, dv)))
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"gated_delta_step: {name} must be {list(shape)}, got {list(got)}")
    if state.dtype != jnp.float32:
        raise ValueError(f"gated_delta_step: state must be float32, got {state.dtype}")
    if hv % hk:
        raise ValueError(f"gated_delta_step: Hv={hv} is not a multiple of Hk={hk}")
    if kernel:
        for name, d in (("dk", dk), ("dv", dv)):
            if d & (d - 1):
                raise ValueError(f"gated_delta_step: {name}={d} must be a power of 2 (Triton blocks)")
    return t, hk, hv, dk, dv, hv // hk


@functools.partial(jax.jit, static_argnames=("block_dv", "num_warps", "interpret"))
def gated_delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                     n_valid: jax.Array, *, block_dv: int = DEFAULT_BLOCK_DV, num_warps: int = 4,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv] f32, n_valid int32 -> (out [T, Hv, dv]
    f32, states [T, Hv, dk, dv] f32). See the module docstring."""
    t, hk, hv, dk, dv, r = _check(q, k, v, g, beta, state, kernel=True)
    if block_dv < 1 or block_dv & (block_dv - 1):
        raise ValueError(f"gated_delta_step: block_dv={block_dv} must be a power of 2")
    bv = min(block_dv, dv)
    nv = jnp.reshape(jnp.asarray(n_valid, jnp.int32), (1,))  # [1]
    return pl.pallas_call(
        functools.partial(_gated_delta_kernel, t=t),
        grid=(hv, dv // bv),
        in_specs=[
            pl.BlockSpec((1,), lambda h, j: (0,)),  # n_valid
            pl.BlockSpec((t, None, dk), lambda h, j: (0, h // r, 0)),  # q [T, dk] of key head h // r
            pl.BlockSpec((t, None, dk), lambda h, j: (0, h // r, 0)),  # k [T, dk]
            pl.BlockSpec((t, None, bv), lambda h, j: (0, h, j)),  # v [T, BV]
            pl.BlockSpec((t, None), lambda h, j: (0, h)),  # g [T]
            pl.BlockSpec((t, None), lambda h, j: (0, h)),  # beta [T]
            pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j)),  # state [dk, BV]
        ],
        out_specs=[
            pl.BlockSpec((t, None, bv), lambda h, j: (0, h, j)),  # out [T, BV]
            pl.BlockSpec((t, None, dk, bv), lambda h, j: (0, h, 0, j)),  # states [T, dk, BV]
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, hv, dv), jnp.float32),
            jax.ShapeDtypeStruct((t, hv, dk, dv), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gated_delta_step",
    )(nv, q, k, v, g, beta, state)


# --------------------------------------------------------------------------------------------------------- reference

@jax.jit
def gated_delta_step_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               state: jax.Array, n_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recurrence in jnp, all heads at once, the T rows unrolled: (out [T, Hv, dv], states [T, Hv, dk, dv]) f32."""
    t, hk, hv, dk, dv, r = _check(q, k, v, g, beta, state, kernel=False)
    q = jnp.repeat(q.astype(jnp.float32), r, axis=1)  # [T, Hv, dk]: value head h uses key head h // r
    k = jnp.repeat(k.astype(jnp.float32), r, axis=1)  # [T, Hv, dk]
    v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    valid = jnp.arange(t, dtype=jnp.int32) < n_valid  # [T]
    s = state  # [Hv, dk, dv]
    outs, states = [], []
    for i in range(t):
        decayed = s * jnp.exp(g[i])[:, None, None]  # [Hv, dk, dv]
        kv_mem = jnp.sum(k[i][:, :, None] * decayed, axis=1)  # [Hv, dv]
        delta = (v[i] - kv_mem) * beta[i][:, None]  # [Hv, dv]
        s = jnp.where(valid[i], decayed + k[i][:, :, None] * delta[:, None, :], s)
        states.append(s)
        outs.append(jnp.sum(q[i][:, :, None] * s, axis=1))  # [Hv, dv]
    return jnp.stack(outs), jnp.stack(states)
