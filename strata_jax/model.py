"""The Qwen3-MoE and Qwen3-Next models as small pytree dataclasses, and the forward pass of one window of T tokens.

Follows transformers' `Qwen3MoeForCausalLM`: RMSNorm computed in float32 then cast back, grouped-query attention
with per-head q/k RMSNorm before RoPE (rotate-half form), a sparse MoE block or a dense SwiGLU MLP per layer, and
a tied or untied `lm_head`. `Qwen3NextForCausalLM` (cfg.next) adds: zero-centred RMSNorms (`norm`), an output gate
on attention (q_proj twice as wide, per head [q, gate]), RoPE on the first `rotary_dim` dims, a shared expert with a
sigmoid gate beside the routed ones (always resident), and Gated DeltaNet layers (strata_jax/deltanet.py). Dense matrices are stored [in, out] (transposed from the checkpoint) so that `x @ w`
reads naturally; experts keep the checkpoint's [out, in] layout (see moe.MoEWeights). Shapes: T tokens in the window, H hidden, Nq/Nkv heads, D head_dim, E experts, I expert width,
S cache length, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.pallas_kernels.decode_attention import decode_attention
from strata_jax.pallas_kernels.stacked_linear import stacked_linear
from strata_jax.config import ModelConfig
from strata_jax import deltanet, moe
from strata_jax.deltanet import DeltaNetWeights, DeltaState
from strata_jax.linear import linear


@struct.dataclass
class AttentionWeights:
    wq: jax.Array  # [H, Nq*D]; Qwen3-Next [H, Nq*2D]: per head its q then its output gate
    wk: jax.Array  # [H, Nkv*D]
    wv: jax.Array  # [H, Nkv*D]
    wo: jax.Array  # [Nq*D, H]
    q_norm: jax.Array  # [D]
    k_norm: jax.Array  # [D]
    bq: jax.Array | None = None  # [Nq*D] when attention_bias
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None  # [H]


@struct.dataclass
class MLPWeights:
    """A dense SwiGLU MLP (layers listed in mlp_only_layers / off the decoder_sparse_step)."""
    gate: jax.Array  # [H, I]
    up: jax.Array  # [H, I]
    down: jax.Array  # [I, H]


@struct.dataclass
class LayerWeights:
    attn_norm: jax.Array  # [H]
    attn: AttentionWeights | DeltaNetWeights
    ffn_norm: jax.Array  # [H]
    ffn: moe.MoEWeights | MLPWeights
    shared: MLPWeights | None = None  # Qwen3-Next's shared expert of a sparse layer (resident)
    shared_gate: jax.Array | None = None  # [H, 1]: its sigmoid gate


@struct.dataclass
class Weights:
    """`layers` is a list (one LayerWeights per layer: the graph unrolls the layers) or one LayerWeights whose
    leaves carry a leading layer axis [L, ...] (`stack_layers`: the graph runs one scanned layer body)."""
    embed: jax.Array  # [V, H]
    layers: list[LayerWeights] | LayerWeights
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None when tied to `embed`

    @property
    def stacked(self) -> bool:
        return isinstance(self.layers, LayerWeights)


@struct.dataclass
class QuantKV:
    """An int8 K or V cache (kv_dtype=int8): one scale per (position, kv head), symmetric, value = q * scale.
    float32 scales: 4 bytes beside D int8 values (3% at D = 128) and no second rounding on top of int8's."""
    q: jax.Array  # [S, Nkv, D] int8, or stacked [L, S, Nkv, D]
    scale: jax.Array  # [S, Nkv] float32 (absmax / 127 over D), or stacked [L, S, Nkv]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def quantize_kv(x: jax.Array) -> QuantKV:
    """x [..., D] -> int8 rows and their float32 scales [...] (absmax / 127; an all-zero row gets scale 0)."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    q = jnp.round(x32 / jnp.where(scale > 0, scale, 1.0)[..., None])
    return QuantKV(q=jnp.clip(q, -127, 127).astype(jnp.int8), scale=scale)


def dequantize_kv(c: QuantKV) -> jax.Array:
    """The float32 values of an int8 cache (tests and references: attention scales in place instead)."""
    return c.q.astype(jnp.float32) * c.scale[..., None]


def _write_rows(cache, rows: jax.Array, start: tuple):
    """rows [T, Nkv, D] (or [1, T, Nkv, D] stacked) into cache at start: a plain array in its dtype, or an int8
    QuantKV quantized as written (rows and scales together, so a rewritten position never keeps a stale scale)."""
    if isinstance(cache, QuantKV):
        new = quantize_kv(rows)
        return QuantKV(q=jax.lax.dynamic_update_slice(cache.q, new.q, start),
                       scale=jax.lax.dynamic_update_slice(cache.scale, new.scale, start[:-1]))
    return jax.lax.dynamic_update_slice(cache, rows.astype(cache.dtype), start)


def _layer_of(cache, layer: jax.Array):
    """Layer `layer` of a stacked cache (plain or QuantKV)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), cache)


@struct.dataclass
class KVCache:
    """What a window updates: the static-size key/value cache (one array per layer, or one [L, S, Nkv, D] array for
    stacked weights; a donated step updates it in place) and, when experts are offloaded, each sparse layer's device
    expert cache (experts/slots.py's SlotCache)."""
    k: list[jax.Array | QuantKV | None] | jax.Array | QuantKV  # per layer [S, Nkv, D] (None: a DeltaNet layer),
    v: list[jax.Array | QuantKV | None] | jax.Array | QuantKV  # or stacked [L, S, Nkv, D]; QuantKV: kv_dtype=int8
    experts: list | None = None  # per layer SlotCache (None for dense layers), or None when all experts resident
    delta: list[DeltaState | None] | None = None  # per layer: a DeltaNet layer's recurrent state ring
    state_pos: jax.Array | None = None  # [R] int32: the position each ring slot holds (-1: none)

    @property
    def length(self) -> int:
        if not isinstance(self.k, list):
            return self.k.shape[1]
        return next(k for k in self.k if k is not None).shape[0]


def kv_zeros(shape: tuple[int, ...], dtype, kv_dtype: str = "auto"):
    """An empty K or V cache of shape [..., S, Nkv, D]: in `dtype`, or int8 with float32 scales [..., S, Nkv]."""
    if kv_dtype == "int8":
        return QuantKV(q=jnp.zeros(shape, jnp.int8), scale=jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def init_cache(cfg: ModelConfig, length: int, dtype=jnp.float32, stacked: bool = False, ring: int = 8,
               kv_dtype: str = "auto") -> KVCache:
    """ring: how many positions' recurrent states a DeltaNet layer keeps (more than the largest window).
    kv_dtype: auto (K/V in `dtype`) or int8 (QuantKV; the DeltaNet states stay in `dtype`)."""
    shape = (length, cfg.num_kv_heads, cfg.head_dim)
    if stacked:
        return KVCache(k=kv_zeros((cfg.num_layers, *shape), dtype, kv_dtype),
                       v=kv_zeros((cfg.num_layers, *shape), dtype, kv_dtype))
    full = [not cfg.is_linear(i) for i in range(cfg.num_layers)]
    cache = KVCache(k=[kv_zeros(shape, dtype, kv_dtype) if f else None for f in full],
                    v=[kv_zeros(shape, dtype, kv_dtype) if f else None for f in full])
    if cfg.has_linear:
        cache = cache.replace(delta=[None if f else deltanet.init_state(cfg, ring, dtype) for f in full],
                              state_pos=jnp.full((ring,), -1, jnp.int32))
    return cache


def cache_bytes(cfg: ModelConfig, length: int, itemsize: int, ring: int = 8, kv_dtype: str = "auto") -> int:
    """Bytes of init_cache: K and V rows of the full-attention layers, the DeltaNet layers' state rings."""
    row = cfg.head_dim * itemsize if kv_dtype == "auto" else cfg.head_dim + 4  # int8: D bytes + a float32 scale
    kv = 2 * cfg.num_full_layers * length * cfg.num_kv_heads * row
    return kv + (ring * cfg.state_bytes(itemsize) if cfg.has_linear else 0)


def can_stack(cfg: ModelConfig) -> bool:
    """One scanned body needs every layer of one kind (all MoE or all dense); Qwen3-Next layers run unrolled."""
    return len(set(cfg.sparse_layers)) <= 1 and not cfg.next


def stack_layers(weights: Weights, consume: bool = False, keep_experts: bool = False) -> Weights:
    """The per-layer list -> one LayerWeights with a leading layer axis on every leaf. consume: each layer's array
    is deleted as soon as it is copied into its stack (the peak is the model plus one layer-stacked leaf, not two
    copies of the model); only for weights nobody else holds. keep_experts: the routed experts (offload's host
    arrays) are not stacked: each of ffn.gate / up / down becomes a tuple of the layers' arrays (their scales, on
    the device, are stacked)."""
    if weights.stacked:
        return weights
    layers = weights.layers
    if keep_experts:
        hosts = {k: tuple(getattr(layer.ffn, k) for layer in layers) for k in ("gate", "up", "down")}
        dense = weights.replace(layers=[layer.replace(ffn=layer.ffn.replace(gate=None, up=None, down=None))
                                        for layer in layers])
        del layers
        stacked = stack_layers(dense, consume=consume)
        return stacked.replace(layers=stacked.layers.replace(ffn=stacked.layers.ffn.replace(**hosts)))
    treedef = jax.tree.structure(layers[0])
    if any(jax.tree.structure(layer) != treedef for layer in layers):
        raise ValueError("stack_layers: the layers differ in kind (dense and MoE): they cannot share one body")
    leaves_per_layer = [jax.tree.leaves(layer) for layer in layers]
    del layers
    stacked = []
    for j in range(len(leaves_per_layer[0])):
        first = leaves_per_layer[0][j]
        # Written in place into a buffer of the stacked shape (jnp.stack would hold a second copy of the parts).
        buf = jax.device_put(jnp.zeros((len(leaves_per_layer), *first.shape), first.dtype), _stacked(first.sharding))
        for i, leaves in enumerate(leaves_per_layer):
            buf = _put_layer(buf, leaves[j], jnp.int32(i))
            if consume:
                buf.block_until_ready()
                leaves[j].delete()
        stacked.append(buf)
    return weights.replace(layers=jax.tree.unflatten(treedef, stacked))


def _stacked(sharding):
    """The sharding of a layer-stacked leaf: a layer's NamedSharding (parallel=experts: experts split on axis 0)
    shifted by the new leading layer axis; a single device's as it is."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec),
                                          memory_kind=sharding.memory_kind)
    return sharding


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_layer(buf: jax.Array, part: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, part.astype(buf.dtype), i, 0)


def unstack_layers(weights: Weights) -> Weights:
    """Stacked -> the per-layer list (slices: a copy of the layer weights)."""
    if not weights.stacked:
        return weights
    stack = weights.layers
    hosts = None
    if isinstance(stack.ffn, moe.MoEWeights) and isinstance(stack.ffn.gate, tuple):  # stack_layers(keep_experts)
        hosts = {k: getattr(stack.ffn, k) for k in ("gate", "up", "down")}
        stack = stack.replace(ffn=stack.ffn.replace(gate=None, up=None, down=None))
    n = jax.tree.leaves(stack)[0].shape[0]
    layers = [jax.tree.map(lambda a, i=i: a[i], stack) for i in range(n)]
    if hosts:
        layers = [layer.replace(ffn=layer.ffn.replace(**{k: v[i] for k, v in hosts.items()}))
                  for i, layer in enumerate(layers)]
    return weights.replace(layers=layers)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As transformers: normalise in float32, cast back to the input dtype, then scale.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's RMSNorm: Qwen3-Next's is zero-centred and scales in float32 before the cast back."""
    if not cfg.next:
        return rms_norm(x, weight, cfg.rms_norm_eps)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Rotary embedding in transformers' rotate-half form on the first rotary_dim dims (all by default).
    x: [T, N, D], positions: [T]."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return jnp.concatenate([rope(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], axis=-1)
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    cos, sin = jnp.cos(emb)[:, None, :].astype(x.dtype), jnp.sin(emb)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def attention(x: jax.Array, w: AttentionWeights, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
              cfg: ModelConfig, kernel: bool = False, layer: jax.Array | None = None,
              w_stack: AttentionWeights | None = None,
              dense_kernel: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of T window tokens at positions pos..pos+T-1 over the cache. x: [T, H]. kernel: the Pallas
    decode-attention kernel (pallas_kernels/decode_attention.py: reads the cache in place, only up to pos+T-1)
    instead of XLA's einsums over the whole static cache; for decode windows and prefill chunks alike (a chunk's
    T * r query rows per kv head run as row blocks of 64, each reading up to its own last token's position).
    layer: the caches are the stacked [L, S, Nkv, D] arrays and this is the layer's index (a traced int32 in the
    scanned body); they are updated and returned whole.
    w_stack: the stacked weights of every layer; the q/k/v and o products then read layer `layer` of them in place
    (pallas_kernels/stacked_linear.py) instead of products with w's slices (w still gives the norms and biases).
    dense_kernel without w_stack (the unrolled graph): the same kernel over w as a stack of one layer, so both graphs
    sum the products in the same order and round alike."""
    t = x.shape[0]
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qw = nq * d * (2 if cfg.next else 1)  # Qwen3-Next: each head's q then its output gate
    interpret = jax.default_backend() != "gpu"
    product_layer = layer
    if w_stack is None and dense_kernel:
        w_stack, product_layer = jax.tree.map(lambda a: a[None], w), jnp.int32(0)  # [1, K, N]: a bitcast
    if w_stack is not None:
        qkv = stacked_linear(x, (w_stack.wq, w_stack.wk, w_stack.wv), product_layer,
                             interpret=interpret).astype(x.dtype)
        ys = jnp.split(qkv, [qw, qw + nkv * d], axis=1)  # as linear() rounds each product to x.dtype
    else:
        ys = [linear(x, w.wq), linear(x, w.wk), linear(x, w.wv)]

    def proj(y, b_, n):
        return (y if b_ is None else y + b_).reshape(t, n, d)

    gate = None
    if cfg.next:
        q_gate = ys[0].reshape(t, nq, 2 * d)
        ys[0], gate = q_gate[..., :d].reshape(t, nq * d), q_gate[..., d:].reshape(t, nq * d)
    q = norm(proj(ys[0], w.bq, nq), w.q_norm, cfg)  # [T, Nq, D]
    k = norm(proj(ys[1], w.bk, nkv), w.k_norm, cfg)  # [T, Nkv, D]
    v = proj(ys[2], w.bv, nkv)  # [T, Nkv, D]
    positions = pos + jnp.arange(t, dtype=jnp.int32)
    q, k = rope(q, positions, cfg.rope_theta, cfg.rotary_dim), rope(k, positions, cfg.rope_theta, cfg.rotary_dim)

    # Write this window's keys/values (int8 caches: quantized as written), then attend over the whole static cache
    # with a causal mask.
    if layer is None:
        k_cache = _write_rows(k_cache, k, (pos, 0, 0))  # [S, Nkv, D]
        v_cache = _write_rows(v_cache, v, (pos, 0, 0))
        k_layer, v_layer = k_cache, v_cache
    else:
        k_cache = _write_rows(k_cache, k[None], (layer, pos, 0, 0))
        v_cache = _write_rows(v_cache, v[None], (layer, pos, 0, 0))
        if not kernel:
            k_layer, v_layer = _layer_of(k_cache, layer), _layer_of(v_cache, layer)  # [S, Nkv, D]
    if kernel:
        if isinstance(k_cache, QuantKV):
            out = decode_attention(q, k_cache.q, v_cache.q, pos, layer=layer, k_scale=k_cache.scale,
                                   v_scale=v_cache.scale, interpret=interpret).reshape(t, nq * d)
        else:
            out = decode_attention(q, k_cache, v_cache, pos, layer=layer, interpret=interpret).reshape(t, nq * d)
    else:
        out = _xla_attention(q, k_layer, v_layer, positions)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)  # in the model dtype, as transformers
    if w_stack is not None:
        out = stacked_linear(out, (w_stack.wo,), product_layer, interpret=interpret).astype(x.dtype)
    else:
        out = linear(out, w.wo)
    return (out if w.bo is None else out + w.bo), k_cache, v_cache


def _xla_attention(q: jax.Array, k_layer, v_layer, positions: jax.Array) -> jax.Array:
    """q [T, Nq, D] over one layer's whole static cache [S, Nkv, D], causal mask -> [T, Nq*D] in q.dtype.
    An int8 cache (QuantKV) is read as int8 widened to q.dtype (exact: |q| <= 127); its scales multiply the f32
    scores (K) and the f32 probabilities before their cast (V), so no dequantized copy of the cache is made."""
    t, nq, d = q.shape
    nkv = k_layer.shape[1]
    quant = isinstance(k_layer, QuantKV)
    k_vals, v_vals = (k_layer.q, v_layer.q) if quant else (k_layer, v_layer)
    qg = q.reshape(t, nkv, nq // nkv, d)  # head h uses kv head h // (Nq/Nkv), as transformers' repeat_kv
    scores = jnp.einsum("tgrd,sgd->tgrs", qg, k_vals.astype(q.dtype), preferred_element_type=jnp.float32)
    if quant:
        scores = scores * k_layer.scale.T[None, :, None, :]  # [S, Nkv] -> [1, Nkv, 1, S]
    scores = scores * (d ** -0.5)
    key_pos = jnp.arange(k_vals.shape[0], dtype=jnp.int32)
    causal = key_pos[None, :] <= positions[:, None]  # [T, S]
    scores = jnp.where(causal[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if quant:
        probs = probs * v_layer.scale.T[None, :, None, :]
    return jnp.einsum("tgrs,sgd->tgrd", probs.astype(q.dtype), v_vals.astype(q.dtype)).reshape(t, nq * d)


def dense_mlp(x: jax.Array, w: MLPWeights) -> jax.Array:
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


# The expert path of a sparse layer with its own state: (layer, x [T, H], MoEWeights, valid [T], state)
# -> moe.ExpertsOut(y [T, H], state, pending); pending is not None when the layer's CPU rows join later:
# `experts.join(h, pending)` adds them before the next layer's FFN half (right away when `experts.join_now`).
# None: all experts resident on the device (moe.moe_block); experts/slots.py's OffloadedExperts reads them from
# slots, pinned host memory and the host pool.
ExpertPath = Callable[[int, jax.Array, "moe.MoEWeights", jax.Array, object], "moe.ExpertsOut"]


def shared_expert(x: jax.Array, layer: LayerWeights) -> jax.Array:
    """Qwen3-Next's shared expert: sigmoid(x @ gate) * SwiGLU(x), on every token."""
    return jax.nn.sigmoid(linear(x, layer.shared_gate)) * dense_mlp(x, layer.shared)


def forward(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, n_valid: jax.Array,
            cfg: ModelConfig, experts: ExpertPath | None = None,
            attention_kernel: bool = False, dense_kernel: bool = False,
            delta_kernel: bool = False, return_hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """One window: tokens [T] at positions pos.., of which the first n_valid are real (the rest padding).

    Returns float32 logits [T, V] and the updated cache (return_hidden: and the final hidden states [T, H], after
    the final norm; unrolled graph only). delta_kernel: DeltaNet layers' decode-time rule through the Pallas kernel.
    """
    if weights.stacked:
        assert not return_hidden, "return_hidden: the unrolled graph only"
        return forward_scanned(weights, cache, tokens, pos, n_valid, cfg, experts, attention_kernel, dense_kernel)
    h = weights.embed[tokens]  # [T, H]
    h, new_cache = run_layers(weights.layers, cache, h, pos, n_valid, cfg, experts, attention_kernel, dense_kernel,
                              delta_kernel)
    if return_hidden:  # Qwen3-Next's MTP drafter reads the final hidden states (after the final norm)
        hidden = norm(h, weights.final_norm, cfg)
        return lm_head(weights, hidden), new_cache, hidden
    return head_logits(weights, h, cfg), new_cache


def run_layers(layers: list, cache: KVCache, h: jax.Array, pos: jax.Array, n_valid: jax.Array, cfg: ModelConfig,
               experts: ExpertPath | None = None, attention_kernel: bool = False, dense_kernel: bool = False,
               delta_kernel: bool = False, layer0: int = 0) -> tuple[jax.Array, KVCache]:
    """The layers of `forward` alone: hidden states h [T, H] through the per-layer `layers` (the model's layers
    layer0.., all of them or a block: strata_jax/parallel.py's stages) and their cache (lists of the same length).
    Returns (h, cache)."""
    expert_state = list(cache.experts) if cache.experts is not None else None
    t = h.shape[0]
    valid = jnp.arange(t) < n_valid  # [T]
    new_k, new_v = [], []
    new_delta = list(cache.delta) if cache.delta is not None else None
    pending = None  # a deferred layer's CPU rows (experts/defer.py), owed before the next FFN half
    for j, layer in enumerate(layers):
        i = layer0 + j  # the model's layer index (the expert path and the host pool know layers by it)
        with jax.named_scope(f"layer{i}"):
            if isinstance(layer.attn, DeltaNetWeights):
                with jax.named_scope("deltanet"):
                    a, new_delta[j] = deltanet.deltanet(norm(h, layer.attn_norm, cfg), layer.attn, cache.delta[j],
                                                        cache.state_pos, pos, n_valid, cfg, kernel=delta_kernel)
                kc = vc = None
            else:
                with jax.named_scope("attention"):
                    a, kc, vc = attention(norm(h, layer.attn_norm, cfg), layer.attn,
                                          cache.k[j], cache.v[j], pos, cfg, kernel=attention_kernel,
                                          dense_kernel=dense_kernel)
            h = h + a
            new_k.append(kc)
            new_v.append(vc)
            if pending is not None:  # pre(i): layer i-1's late rows join before this FFN half
                h, pending = experts.join(h, pending), None
            x = norm(h, layer.ffn_norm, cfg)
            if layer.shared is not None:
                with jax.named_scope("shared_expert"):
                    h = h + shared_expert(x, layer)
            if isinstance(layer.ffn, MLPWeights):
                with jax.named_scope("mlp"):
                    h = h + dense_mlp(x, layer.ffn)
            elif experts is None:
                h = h + moe.moe_block(x, layer.ffn, cfg, valid)
            else:
                state = expert_state[j] if expert_state is not None else None
                y, state, pending = experts(i, x, layer.ffn, valid, state)
                if expert_state is not None:
                    expert_state[j] = state
                h = h + y
                if pending is not None and experts.join_now:
                    h, pending = experts.join(h, pending), None
    state_pos = cache.state_pos
    if state_pos is not None:
        state_pos = deltanet.commit_pos(state_pos, pos, n_valid, t)
    assert pending is None, "a block's last layer is never deferred (OffloadedExperts.no_defer)"
    return h, KVCache(k=new_k, v=new_v, experts=expert_state, delta=new_delta, state_pos=state_pos)


def lm_head(weights: Weights, hidden: jax.Array) -> jax.Array:
    """hidden [T, H] (after the final norm) -> float32 logits [T, V]."""
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    return linear(hidden, head, preferred_element_type=jnp.float32)  # a GEMM at T=1 too (linear.py)


def head_logits(weights: Weights, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and lm_head: h [T, H] -> float32 logits [T, V]."""
    return lm_head(weights, norm(h, weights.final_norm, cfg))


def forward_scanned(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, n_valid: jax.Array,
                    cfg: ModelConfig, experts=None, attention_kernel: bool = False,
                    dense_kernel: bool = False) -> tuple[jax.Array, KVCache]:
    """`forward` over stacked weights (`stack_layers`) and a stacked cache: one layer body in a `lax.scan`.

    The graph holds one copy of the layer's kernels instead of L (fewer launches for the host to issue, a tenth of
    the compile time) and takes a handful of arguments instead of ~10 per layer. The body reads layer i's dense
    weights as slices of the stacked arrays; the experts stay one flat [L*E, ...] array indexed by i*E + expert, so
    no layer's experts are sliced out whole. The stacked KV cache rides in the carry and is updated in place.
    dense_kernel: the attention products read the stacks in place too (pallas_kernels/stacked_linear.py), where
    XLA would copy layer i's q/k/v/o matrices out of the stacks first.
    With offload (cache.experts: one stacked SlotCache): offload_layers."""
    h = weights.embed[tokens]  # [T, H]
    run = offload_layers if cache.experts is not None else scan_layers
    h, cache = run(weights.layers, cache, h, pos, n_valid, cfg, experts, attention_kernel, dense_kernel)
    return head_logits(weights, h, cfg), cache


def _stacked_attention(h, layer: LayerWeights, stack: LayerWeights, k_all, v_all, i, pos, cfg: ModelConfig,
                       attention_kernel: bool, dense_kernel: bool):
    """The attention half of a stacked layer body (scan_layers, offload_layers): layer i's attention over the
    stacked cache added to h, then the FFN's input. Returns (h, x, k_all, v_all)."""
    with jax.named_scope("attention"):
        a, k_all, v_all = attention(rms_norm(h, layer.attn_norm, cfg.rms_norm_eps), layer.attn, k_all, v_all, pos,
                                    cfg, kernel=attention_kernel, layer=i,
                                    w_stack=stack.attn if dense_kernel else None)
    h = h + a
    return h, rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps), k_all, v_all


def offload_layers(stack: LayerWeights, cache: KVCache, h: jax.Array, pos: jax.Array, n_valid: jax.Array,
                   cfg: ModelConfig, experts, attention_kernel: bool = False,
                   dense_kernel: bool = False) -> tuple[jax.Array, KVCache]:
    """scan_layers with offloaded experts: the routed experts of `stack` are tuples of the layers' host arrays
    (stack_layers(keep_experts=True)), cache.experts every layer's slot cache in one (experts/slots.py
    init_stacked_slot_cache), `experts` the offloaded expert path (it gives layer l's view of that cache).

    With the native offload calls (experts.runs_native: decode windows, and prefill chunks in blocks of experts) one
    layer body runs in a `lax.scan`, the layer index traced: the calls name the layer in their plan and address the
    stacked slot arrays by absolute rows, so nothing in the body depends on the layer statically. Without them (the
    graph path's copy loops read layer l's host arrays) the same body unrolls, l a Python int."""
    t = h.shape[0]
    valid = jnp.arange(t) < n_valid  # [T]
    f = stack.ffn
    hosts = list(zip(f.gate, f.up, f.down))
    dense_part = stack.replace(ffn=f.replace(gate=None, up=None, down=None))

    def body(carry, i, host=None):
        h, k_all, v_all, state = carry
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), dense_part)
        h, x, k_all, v_all = _stacked_attention(h, layer, stack, k_all, v_all, jnp.asarray(i, jnp.int32), pos, cfg,
                                                attention_kernel, dense_kernel)
        w = layer.ffn if host is None else layer.ffn.replace(gate=host[0], up=host[1], down=host[2])
        out = experts(i, x, w, valid, experts.layer_state(state, i))
        assert out.pending is None, "the deferral runs in the unrolled graph (engine.scans_offload)"
        return (h + out.y, k_all, v_all, experts.put_state(state, i, out.state)), None

    carry = (h, cache.k, cache.v, cache.experts)
    if experts.runs_native():
        with jax.named_scope("layer"):
            carry, _ = jax.lax.scan(body, carry, jnp.arange(len(hosts), dtype=jnp.int32))
    else:
        for i, host in enumerate(hosts):
            with jax.named_scope(f"layer{i}"):
                carry, _ = body(carry, i, host)
    h, k_all, v_all, state = carry
    return h, cache.replace(k=k_all, v=v_all, experts=state)


def scan_layers(stack: LayerWeights, cache: KVCache, h: jax.Array, pos: jax.Array, n_valid: jax.Array,
                cfg: ModelConfig, experts=None, attention_kernel: bool = False,
                dense_kernel: bool = False) -> tuple[jax.Array, KVCache]:
    """The layers of `forward_scanned` alone: hidden states h [T, H] through the stacked layers `stack` ([L', ...]
    leaves, any L' <= L: a block of layers, as strata_jax/parallel.py's pipeline stages run) and their stacked cache
    [L', S, Nkv, D]. Returns (h, cache)."""
    t = h.shape[0]
    valid = jnp.arange(t) < n_valid  # [T]
    n_layers = jax.tree.leaves(stack)[0].shape[0]
    sparse = isinstance(stack.ffn, moe.MoEWeights)
    if sparse:  # [L, E, I, H] -> [L*E, I, H]: a bitcast, read in place by the gather or the kernel
        flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])
        experts_flat = moe.MoEWeights(router=stack.ffn.router, gate=flat(stack.ffn.gate), up=flat(stack.ffn.up),
                                      down=flat(stack.ffn.down), gate_scale=flat(stack.ffn.gate_scale),
                                      up_scale=flat(stack.ffn.up_scale), down_scale=flat(stack.ffn.down_scale))
        dense_part = stack.replace(ffn=None)
    else:
        dense_part = stack

    def body(carry, i):
        h, k_all, v_all = carry
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), dense_part)
        with jax.named_scope("layer"):
            h, x, k_all, v_all = _stacked_attention(h, layer, stack, k_all, v_all, i, pos, cfg, attention_kernel,
                                                    dense_kernel)
            if not sparse:
                with jax.named_scope("mlp"):
                    h = h + dense_mlp(x, layer.ffn)
            else:
                router = jax.lax.dynamic_index_in_dim(experts_flat.router, i, 0, keepdims=False)  # [H, E]
                w = experts_flat.replace(router=router)
                offset = i * cfg.num_experts
                if experts is None:
                    h = h + moe.moe_block(x, w, cfg, valid, offset=offset)
                else:
                    h = h + experts(i, x, w, valid, None, offset=offset).y
        return (h, k_all, v_all), None

    (h, k_all, v_all), _ = jax.lax.scan(body, (h, cache.k, cache.v), jnp.arange(n_layers, dtype=jnp.int32))
    return h, cache.replace(k=k_all, v=v_all)


def param_bytes(weights: Weights) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))


def random_weights(cfg: ModelConfig, seed: int, dtype=jnp.bfloat16, scale: float = 0.02,
                   place_experts: Callable[[str, jax.Array], jax.Array] | None = None,
                   progress: Callable[[str], None] | None = None, stacked: bool = False,
                   expert_format: str | None = None,
                   place_scales: Callable[[str, jax.Array], jax.Array] | None = None,
                   layer_device: Callable[[int], jax.Device] | None = None) -> Weights:
    """Random weights made on the device layer by layer (benchmarks: no checkpoint needed, no host copy), drawn in
    the declaration's order (weight_specs: the layers, then embed and lm_head).

    `place_experts(name, array)` may move each MoE layer's stacked experts elsewhere (host memory) as they are
    made, so the device never holds all of them. stacked: the layers made directly as [L, ...] leaves (other random
    values than the list form; no second copy of the model at any time). expert_format "int8" / "int4": the experts
    are quantized as they are made (strata_jax/quant.py; `place_scales(name, scale)` sees their scales).
    layer_device(i): the device layer i is made on (parallel=layers: its block's), so no device ever holds more than
    its block; with stacked, the layers then come as the per-layer list of the stacked form's values (stacked per
    block by strata_jax/parallel.py)."""
    if stacked:
        return _random_stacked(cfg, seed, dtype, scale, progress, layer_device)
    place_experts = place_experts or (lambda name, x: x)
    place_scales = place_scales or (lambda name, x: x)
    specs = weight_specs(cfg)
    draw = Draw(cfg, jax.random.PRNGKey(seed), dtype, scale)

    def make(i: int):
        def leaf_of(leaf: Leaf):
            x = draw(leaf)
            if not leaf.expert:
                return x
            name = f"layers.{i}.experts.{leaf.expert}"
            if not expert_format:
                return place_experts(name, x)
            from strata_jax.quant import quantize_device
            q, q_scale = quantize_device(x, expert_format)
            return place_experts(name, q), place_scales(name + "_scale", q_scale)
        return leaf_of

    layers = []
    for i, spec in enumerate(specs.layers):
        with jax.default_device(layer_device(i) if layer_device else None):
            layers.append(build_layer(spec, make(i)))
        if progress:
            jax.block_until_ready(layers[-1])
            progress(f"random weights: layer {i + 1}/{cfg.num_layers}")
    return Weights(embed=draw(specs.embed), layers=layers, final_norm=draw(specs.final_norm),
                   lm_head=None if specs.lm_head is None else draw(specs.lm_head))


# Module level, so that every engine of a process draws with the same compiled graphs (one per leaf shape).
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _fill_stacked(key, n: int, shape: tuple, dtype, scale: float, ones: bool):
    """[n, *shape]: layer i drawn from fold_in(key, i) (ones: a norm's ones), filled one layer at a time."""
    def body(i, buf):
        return jax.lax.dynamic_update_index_in_dim(buf, _stacked_layer(key, i, shape, dtype, scale, ones), i, 0)
    return jax.lax.fori_loop(0, n, body, jnp.zeros((n, *shape), dtype))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _stacked_layer(key, i, shape: tuple, dtype, scale: float, ones: bool):
    """Layer i of _fill_stacked's buffer alone."""
    return jnp.ones(shape, dtype) if ones else (
        jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * scale).astype(dtype)


def _random_stacked(cfg: ModelConfig, seed: int, dtype, scale: float, progress, layer_device=None) -> Weights:
    """random_weights(stacked=True): each [L, ...] leaf filled layer by layer inside one graph (the float32 draw of
    one layer at a time is the only temporary); leaf j of the declared layer draws from fold_in(key, j).
    layer_device: the same values as a per-layer list, layer i made on layer_device(i)."""
    if not can_stack(cfg):
        raise ValueError("random_weights(stacked=True) needs every layer of one kind")
    specs = weight_specs(cfg)
    n = cfg.num_layers

    dtype = jnp.dtype(dtype)
    fill = lambda key, shape, ones: _fill_stacked(key, n, shape, dtype, scale, ones)
    one = lambda key, i, shape, ones: _stacked_layer(key, i, shape, dtype, scale, ones)

    key = jax.random.PRNGKey(seed)
    leaves, treedef = jax.tree.flatten(specs.layers[0])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(specs.layers[0])[0]]
    if layer_device is not None:
        layers = []
        for i in range(n):
            with jax.default_device(layer_device(i)):
                layers.append(jax.tree.unflatten(treedef, [
                    one(jax.random.fold_in(key, j), jnp.int32(i), tuple(leaf.shape), leaf.init == "norm")
                    for j, leaf in enumerate(leaves)]))
            if progress:
                jax.block_until_ready(layers[-1])
                progress(f"random weights (stacked values): layer {i + 1}/{n} on {layer_device(i)}")
    stacked = []
    for j, (leaf, path) in enumerate(zip(leaves, paths)):
        assert leaf.init in ("normal", "router", "norm"), leaf  # can_stack: no Qwen3-Next (zero-centred) norms
        if layer_device is not None:
            continue
        stacked.append(fill(jax.random.fold_in(key, j), tuple(leaf.shape), leaf.init == "norm"))
        if progress:
            jax.block_until_ready(stacked[-1])
            progress(f"random weights (stacked): {path.strip('.')} [{n}, {', '.join(map(str, leaf.shape))}]")
    key, k_embed, k_head = jax.random.split(key, 3)
    normal = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)
    return Weights(embed=normal(k_embed, specs.embed.shape),
                   layers=layers if layer_device is not None else jax.tree.unflatten(treedef, stacked),
                   final_norm=jnp.ones(specs.final_norm.shape, dtype),
                   lm_head=None if specs.lm_head is None else normal(k_head, specs.lm_head.shape))


# ---- the weight declaration ----------------------------------------------------------------------------------------
# Every weight is declared once, in weight_specs / layer_specs (and mtp.weight_specs): the engine's shape, the Hub
# tensor it comes from, how it is drawn at random and whether it is a routed expert stack. random_weights,
# abstract_weights, checkpoint.load_weights, embedded.random_checkpoint and train_reference.hf_tensors all walk it.


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One weight's declaration (a pytree leaf: a Weights tree of these mirrors the Weights of arrays)."""
    shape: tuple[int, ...]  # the engine's layout (unquantized)
    hf: str  # the Hub tensor; a routed expert stack: expert {j}'s matrix
    layout: str = ""  # "": as the Hub's; "T": the Hub stores [out, in]; "conv": [K, C] is the Hub's [C, 1, K]
    init: str = "normal"  # normal / embed / router (drawn), norm (the model's RMSNorm identity), ones, zeros
    gain: int = 1  # random_weights multiplies the draw by this (after the cast)
    expert: str = ""  # "gate" / "up" / "down": a routed expert stack [E, O, I], the Hub's [O, I] per expert

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of the Hub tensor (of one expert's, for an expert stack)."""
        if self.expert:
            return self.shape[1:]
        if self.layout == "T":
            return self.shape[::-1]
        if self.layout == "conv":
            return (self.shape[1], 1, self.shape[0])
        return self.shape

    def from_hf(self, x: np.ndarray) -> np.ndarray:
        """The Hub tensor -> the engine's layout (a transposed copy, contiguous)."""
        if self.layout == "T":
            return np.ascontiguousarray(x.T)
        if self.layout == "conv":
            return np.ascontiguousarray(x[:, 0, :].T)
        return x

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """The engine's layout -> the Hub tensor's (the inverse of from_hf)."""
        if self.layout == "T":
            return x.T
        if self.layout == "conv":
            return x.T[:, None, :]
        return x


def _mlp_specs(p: str, h: int, f: int) -> MLPWeights:
    return MLPWeights(gate=Leaf((h, f), p + "gate_proj.weight", "T"), up=Leaf((h, f), p + "up_proj.weight", "T"),
                      down=Leaf((f, h), p + "down_proj.weight", "T"))


def _deltanet_specs(cfg: ModelConfig, p: str) -> DeltaNetWeights:
    h, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, k = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    return DeltaNetWeights(
        in_qkvz=Leaf((h, 2 * nk * dk + 2 * nv * dv), p + "in_proj_qkvz.weight", "T"),
        in_ba=Leaf((h, 2 * nv), p + "in_proj_ba.weight", "T"),
        conv=Leaf((k, cfg.linear_conv_dim), p + "conv1d.weight", "conv", gain=10),  # taps O(0.2): input passes on
        dt_bias=Leaf((nv,), p + "dt_bias", init="ones"), a_log=Leaf((nv,), p + "A_log", init="zeros"),
        norm=Leaf((dv,), p + "norm.weight", init="ones"),  # the gated RMSNorm: not zero-centred
        out=Leaf((nv * dv, h), p + "out_proj.weight", "T"))


def layer_specs(cfg: ModelConfig, p: str, linear: bool, sparse: bool) -> LayerWeights:
    """The declaration of one decoder layer whose Hub tensors are named p + ... (`model.layers.{i}.`)."""
    h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if linear:
        attn = _deltanet_specs(cfg, p + "linear_attn.")
    else:
        a = p + "self_attn."
        qw = nq * d * (2 if cfg.next else 1)  # Qwen3-Next's q_proj holds each head's q and output gate
        attn = AttentionWeights(
            wq=Leaf((h, qw), a + "q_proj.weight", "T"), wk=Leaf((h, nkv * d), a + "k_proj.weight", "T"),
            wv=Leaf((h, nkv * d), a + "v_proj.weight", "T"), wo=Leaf((nq * d, h), a + "o_proj.weight", "T"),
            q_norm=Leaf((d,), a + "q_norm.weight", init="norm"), k_norm=Leaf((d,), a + "k_norm.weight", init="norm"))
        if cfg.attention_bias:
            attn = attn.replace(bq=Leaf((nq * d,), a + "q_proj.bias"), bk=Leaf((nkv * d,), a + "k_proj.bias"),
                                bv=Leaf((nkv * d,), a + "v_proj.bias"), bo=Leaf((h,), a + "o_proj.bias"))
    if sparse:
        e, f, x = cfg.num_experts, cfg.moe_intermediate_size, p + "mlp.experts.{j}."
        ffn = moe.MoEWeights(router=Leaf((h, e), p + "mlp.gate.weight", "T", init="router"),
                             gate=Leaf((e, f, h), x + "gate_proj.weight", expert="gate"),  # [E, I, H]
                             up=Leaf((e, f, h), x + "up_proj.weight", expert="up"),  # [E, I, H]
                             down=Leaf((e, h, f), x + "down_proj.weight", expert="down"))  # [E, H, I]
    else:
        ffn = _mlp_specs(p + "mlp.", h, cfg.intermediate_size)
    layer = LayerWeights(attn_norm=Leaf((h,), p + "input_layernorm.weight", init="norm"), attn=attn,
                         ffn_norm=Leaf((h,), p + "post_attention_layernorm.weight", init="norm"), ffn=ffn)
    if sparse and cfg.shared_expert_intermediate_size:
        layer = layer.replace(shared=_mlp_specs(p + "mlp.shared_expert.", h, cfg.shared_expert_intermediate_size),
                              shared_gate=Leaf((h, 1), p + "mlp.shared_expert_gate.weight", "T"))
    return layer


def weight_specs(cfg: ModelConfig, base: str = "model.") -> Weights:
    """The declaration of the whole model (list-form layers); base: the Hub prefix of the text model's tensors."""
    h, v = cfg.hidden_size, cfg.vocab_size
    layers = [layer_specs(cfg, f"{base}layers.{i}.", cfg.is_linear(i), cfg.sparse_layers[i])
              for i in range(cfg.num_layers)]
    return Weights(embed=Leaf((v, h), base + "embed_tokens.weight", init="embed"), layers=layers,
                   final_norm=Leaf((h,), base + "norm.weight", init="norm"),
                   lm_head=None if cfg.tie_word_embeddings else Leaf((h, v), "lm_head.weight", "T"))


def build_layer(spec: LayerWeights, make: Callable) -> LayerWeights:
    """One layer's arrays from its declaration: make(leaf) for each leaf in declaration order (random_weights' RNG
    stream follows this order). make may return (q, scale) for an expert stack (quantized experts): the scale
    becomes the MoEWeights' `{gate,up,down}_scale`."""
    leaves, treedef = jax.tree.flatten(spec)
    made, scales = [], {}
    for leaf in leaves:
        x = make(leaf)
        if isinstance(x, tuple):
            x, scales[leaf.expert + "_scale"] = x
        made.append(x)
    layer = jax.tree.unflatten(treedef, made)
    return layer.replace(ffn=layer.ffn.replace(**scales)) if scales else layer


def hub_order(tree) -> list:
    """The leaves of a Weights / MTPWeights / LayerWeights tree (of Leafs or of arrays, in step) in the Hub files'
    order: as the tree's, except that a layer lists its two norms before its attention."""
    if tree is None:
        return []
    if isinstance(tree, LayerWeights):
        parts = [tree.attn_norm, tree.ffn_norm, tree.attn, tree.ffn, tree.shared, tree.shared_gate]
    elif isinstance(tree, list):
        parts = tree
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, Leaf):
        parts = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    else:
        return [tree]
    return [leaf for part in parts for leaf in hub_order(part)]


def hub_walk(specs, values=None):
    """(Hub name, Leaf, expert index or None, value) for each Hub tensor of a declaration, in the Hub files' order
    (train_reference.hf_tensors writes it, embedded.random_checkpoint draws in it): an expert stack gives one tensor
    per expert, the stacks of a layer interleaved per expert (gate_j, up_j, down_j). values: the matching tree of
    (float) arrays."""
    leaves = hub_order(specs)
    vals = hub_order(values) if values is not None else [None] * len(leaves)
    i = 0
    while i < len(leaves):
        if not leaves[i].expert:
            yield leaves[i].hf, leaves[i], None, vals[i]
            i += 1
            continue
        n = next((k for k in range(i, len(leaves)) if not leaves[k].expert), len(leaves)) - i
        for j in range(leaves[i].shape[0]):
            for leaf, x in zip(leaves[i:i + n], vals[i:i + n]):
                yield leaf.hf.format(j=j), leaf, j, x
        i += n


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], scale: float, dtype) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


class Draw:
    """random_weights' values for declared leaves: each drawn leaf takes the next key of one split chain, so the
    values depend on the declaration order (fixtures and test expectations rely on this stream)."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype, scale: float):
        self.cfg, self.key, self.dtype, self.scale = cfg, key, dtype, scale

    def __call__(self, leaf: Leaf) -> jax.Array:
        const = {"norm": 0 if self.cfg.next else 1, "ones": 1, "zeros": 0}.get(leaf.init)
        if const is not None:  # Qwen3-Next's norms are zero-centred (scale 1 + weight): zeros are its identity
            return (jnp.ones if const else jnp.zeros)(leaf.shape, self.dtype)
        self.key, sub = jax.random.split(self.key)
        x = _normal(sub, tuple(leaf.shape), self.scale, self.dtype)
        return x * leaf.gain if leaf.gain != 1 else x


def map_experts(weights: Weights, fn: Callable[[jax.Array], jax.Array]) -> Weights:
    """weights with fn applied to every routed expert stack (gate / up / down of each MoE layer; not their scales)."""
    def layer_of(layer):
        if not isinstance(layer.ffn, moe.MoEWeights):
            return layer
        f = layer.ffn
        return layer.replace(ffn=f.replace(gate=fn(f.gate), up=fn(f.up), down=fn(f.down)))
    return weights.replace(layers=[layer_of(layer) for layer in weights.layers])


def abstract_weights(cfg: ModelConfig, dtype, expert_format: str | None = None, sharding=None,
                     expert_sharding=None) -> Weights:
    """jax.ShapeDtypeStruct per leaf (an orbax restore's target): every leaf in `dtype` on `sharding`, the expert
    stacks on expert_sharding (default `sharding`); quantized experts: q and its scales as quant.quantize_device
    makes them (the scales on `sharding`)."""
    from strata_jax.quant import quantize_device
    expert_sharding = expert_sharding or sharding

    def make(leaf: Leaf):
        if not leaf.expert:
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
        if not expert_format:
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=expert_sharding)
        q, s = jax.eval_shape(lambda w: quantize_device(w, expert_format), jax.ShapeDtypeStruct(leaf.shape, dtype))
        return (jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=expert_sharding),
                jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding))

    specs = weight_specs(cfg)
    return specs.replace(layers=[build_layer(s, make) for s in specs.layers], embed=make(specs.embed),
                         final_norm=make(specs.final_norm),
                         lm_head=None if specs.lm_head is None else make(specs.lm_head))
