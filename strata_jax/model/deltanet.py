"""Qwen3-Next's Gated DeltaNet layer ("linear_attention"): weights, its recurrent state, and one window's forward.

Follows transformers' `Qwen3NextGatedDeltaNet`: the fused q/k/v/z and b/a projections (HF's layout, grouped by key
head), a causal depthwise conv over q, k, v with SiLU, L2-normalised q and k, the gated delta rule
(S <- S * exp(g); S <- S + k (beta (v - k S)); out = q S, per value head), the gated RMSNorm (norm, then times
silu(z)), and the output projection. Shapes: T window tokens, H hidden, Nk/Nv key/value heads, Dk/Dv their dims,
C = 2*Nk*Dk + Nv*Dv conv channels, K conv taps, R the ring depth of kept states.

The state a window needs is the state after the position before it. A verify window may be rolled back (rejected
drafts), so the state of every position a decode window runs is kept in a ring of R slots, slot = position % R,
and `state_pos` [R] names the position each slot holds (-1: none). A window at `pos` reads slot (pos-1) % R;
the engine keeps R > the largest window, so the accepted position's state is always there. A long window (a
prefill chunk, T > R) runs the chunked form of the rule and keeps only its last valid position's state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.model.config import ModelConfig
from strata_jax.model.linear import linear
from strata_jax.pallas_kernels.gated_delta import gated_delta_step, gated_delta_step_reference

CHUNK = 64  # the chunked rule's block, as transformers' torch_chunk_gated_delta_rule


@struct.dataclass
class DeltaNetWeights:
    in_qkvz: jax.Array  # [H, Nk*(2*Dk + 2*(Nv/Nk)*Dv)]: per key head its q, k, then v and z of its value heads
    in_ba: jax.Array  # [H, Nk*2*(Nv/Nk)]: per key head b then a of its value heads
    conv: jax.Array  # [K, C] depthwise causal conv taps (oldest first) over the channels q, k, v
    dt_bias: jax.Array  # [Nv]
    a_log: jax.Array  # [Nv]
    norm: jax.Array  # [Dv] the gated RMSNorm's scale (not zero-centred)
    out: jax.Array  # [Nv*Dv, H]


@struct.dataclass
class DeltaState:
    """The recurrent state of one DeltaNet layer: the last K-1 conv inputs and the delta state, per ring slot."""
    conv: jax.Array  # [R, K-1, C] in the compute dtype
    rec: jax.Array  # [R, Nv, Dk, Dv] float32


def init_state(cfg: ModelConfig, ring: int, dtype) -> DeltaState:
    k, c = cfg.linear_conv_kernel_dim, cfg.linear_conv_dim
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return DeltaState(conv=jnp.zeros((ring, k - 1, c), dtype), rec=jnp.zeros((ring, nv, dk, dv), jnp.float32))


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' Qwen3NextRMSNormGated: normalise in float32, cast back, scale, times silu(z) in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = weight * x32.astype(x.dtype)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def chunked_rule(q, k, v, g, beta, state):
    """The gated delta rule over a long window in blocks of CHUNK (transformers' torch_chunk_gated_delta_rule):
    q, k [T, Nv, Dk] (normalised, q scaled), v [T, Nv, Dv], g, beta [T, Nv] float32, state [Nv, Dk, Dv] float32.
    Rows whose beta and g are 0 change nothing. -> (out [T, Nv, Dv] float32, final state)."""
    t = q.shape[0]
    pad = (-t) % CHUNK
    n = (t + pad) // CHUNK
    # [T, Nv, X] -> [n, Nv, CHUNK, X]
    blocks = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
        n, CHUNK, *x.shape[1:]).swapaxes(1, 2)
    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g[..., None], beta[..., None]))
    g, beta = g[..., 0], beta[..., 0]  # [n, Nv, CHUNK]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [n, Nv, CHUNK]
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))  # j <= i
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [n, Nv, C, C]
    hp = jax.lax.Precision.HIGHEST
    system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=hp) * decay
    system = jnp.where(jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1), system, 0.0) + jnp.eye(CHUNK)
    solve = lambda b: jax.lax.linalg.triangular_solve(system, b, left_side=True, lower=True, unit_diagonal=True)
    new_values = solve(v_beta)  # [n, Nv, C, Dv]
    k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])  # [n, Nv, C, Dk]
    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=hp) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [n, Nv, 1, 1]

    def step(s, xs):
        nv_i, kc_i, q_i, k_i, intra_i, cd_i = xs
        v_new = nv_i - jnp.einsum("hcd,hde->hce", kc_i, s, precision=hp)
        out = jnp.einsum("hcd,hde->hce", q_i, s, precision=hp) + jnp.einsum("hij,hje->hie", intra_i, v_new,
                                                                              precision=hp)
        s = s * cd_i + jnp.einsum("hcd,hce->hde", k_i, v_new, precision=hp)
        return s, out

    state, out = jax.lax.scan(step, state, (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    out = out.swapaxes(1, 2).reshape(n * CHUNK, *out.shape[1:2], out.shape[-1])[:t]  # [T, Nv, Dv]
    return out, state


def deltanet(x: jax.Array, w: DeltaNetWeights, state: DeltaState, state_pos: jax.Array, pos: jax.Array,
             n_valid: jax.Array, cfg: ModelConfig, kernel: bool = False) -> tuple[jax.Array, DeltaState]:
    """One window of a DeltaNet layer: x [T, H] at positions pos.. (the first n_valid real) -> (y [T, H], state).
    state_pos [R]: the position each ring slot holds before this window (the caller updates it: `commit_pos`).
    kernel: the decode-time rule through the Pallas kernel (pallas_kernels/gated_delta.py) instead of XLA."""
    t = x.shape[0]
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r = nv // nk
    ring = state.rec.shape[0]
    with jax.named_scope("projections"):
        qkvz = linear(x, w.in_qkvz).reshape(t, nk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]  # [T, Nk, Dk]
        v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(t, nv * dv)
        z = qkvz[..., 2 * dk + r * dv:].reshape(t, nv, dv)
        ba = linear(x, w.in_ba).reshape(t, nk, 2 * r)
        b, a = ba[..., :r].reshape(t, nv), ba[..., r:].reshape(t, nv)
        mixed = jnp.concatenate([q.reshape(t, nk * dk), k.reshape(t, nk * dk), v], axis=-1)  # [T, C]

    slot = jnp.mod(pos - 1, ring)
    started = pos > 0  # position 0 starts from zeros
    with jax.named_scope("conv"):
        prev = jnp.where(started, jax.lax.dynamic_index_in_dim(state.conv, slot, 0, keepdims=False), 0)
        taps = w.conv.shape[0]
        window = jnp.concatenate([prev, mixed.astype(prev.dtype)], axis=0)  # [K-1+T, C]
        conv = sum(window[j:j + t].astype(jnp.float32) * w.conv[j].astype(jnp.float32) for j in range(taps))
        mixed = jax.nn.silu(conv).astype(x.dtype)  # as transformers: conv in the weight dtype, then cast back

    q = mixed[:, :nk * dk].reshape(t, nk, dk).astype(jnp.float32)
    k = mixed[:, nk * dk:2 * nk * dk].reshape(t, nk, dk).astype(jnp.float32)
    v = mixed[:, 2 * nk * dk:].reshape(t, nv, dv).astype(jnp.float32)
    q, k = _l2norm(q) * dk ** -0.5, _l2norm(k)
    valid = (jnp.arange(t) < n_valid)[:, None]  # [T, 1]: padding rows leave the state as it is
    beta = jnp.where(valid, jax.nn.sigmoid(b).astype(jnp.float32), 0.0)  # sigmoid in the model dtype, as HF
    g = -jnp.exp(w.a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + w.dt_bias.astype(jnp.float32))
    g = jnp.where(valid, g, 0.0)  # [T, Nv]
    s0 = jnp.where(started, jax.lax.dynamic_index_in_dim(state.rec, slot, 0, keepdims=False), 0.0)

    with jax.named_scope("delta_rule"):
        if t < ring:  # a decode window: every position's state is kept
            step = gated_delta_step if kernel else gated_delta_step_reference
            extra = {"interpret": jax.default_backend() != "gpu"} if kernel else {}
            out, states = step(q, k, v, g, beta, s0, n_valid, **extra)  # [T, Nv, Dv], [T, Nv, Dk, Dv]
            slots = jnp.mod(pos + jnp.arange(t), ring)
            rec = state.rec.at[slots].set(states)
            conv_states = jnp.stack([window[j + 1:j + taps] for j in range(t)])  # [T, K-1, C]
            conv_ring = state.conv.at[slots].set(conv_states)
        else:  # a prefill chunk: the chunked rule, only the last valid position's state is kept
            rep = lambda x_: jnp.repeat(x_, r, axis=1)  # key head i serves value heads i*r..i*r+r-1
            out, last = chunked_rule(rep(q), rep(k), v, g, beta, s0)
            end = jnp.mod(pos + n_valid - 1, ring)
            rec = jax.lax.dynamic_update_index_in_dim(state.rec, last, end, 0)
            conv_ring = jax.lax.dynamic_update_index_in_dim(
                state.conv, jax.lax.dynamic_slice_in_dim(window, n_valid, taps - 1, axis=0), end, 0)

    with jax.named_scope("out"):
        core = _gated_norm(out.astype(x.dtype), z, w.norm, cfg.rms_norm_eps)  # [T, Nv, Dv]
        y = linear(core.reshape(t, nv * dv), w.out)
    return y, DeltaState(conv=conv_ring, rec=rec)


def commit_pos(state_pos: jax.Array, pos: jax.Array, n_valid: jax.Array, t: int) -> jax.Array:
    """The ring's position labels after a window of t rows at pos (n_valid real): what `deltanet` wrote."""
    ring = state_pos.shape[0]
    if t < ring:
        offs = jnp.arange(t)
        return state_pos.at[jnp.mod(pos + offs, ring)].set(jnp.where(offs < n_valid, pos + offs, -1))
    last = pos + n_valid - 1
    return state_pos.at[jnp.mod(last, ring)].set(last)
