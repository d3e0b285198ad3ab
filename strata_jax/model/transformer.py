"""The Qwen3-MoE and Qwen3-Next models as small pytree dataclasses, and the forward pass of one window of T tokens.

Follows transformers' `Qwen3MoeForCausalLM`: RMSNorm computed in float32 then cast back, grouped-query attention
with per-head q/k RMSNorm before RoPE (rotate-half form), a sparse MoE block or a dense SwiGLU MLP per layer, and
a tied or untied `lm_head`. `Qwen3NextForCausalLM` (cfg.next) adds: zero-centred RMSNorms (`norm`), an output gate
on attention (q_proj twice as wide, per head [q, gate]), RoPE on the first `rotary_dim` dims, a shared expert with a
sigmoid gate beside the routed ones (always resident), and Gated DeltaNet layers (strata_jax/model/deltanet.py). Dense matrices are stored [in, out] (transposed from the checkpoint) so that `x @ w`
reads naturally; experts keep the checkpoint's [out, in] layout (see moe.MoEWeights). Shapes: T tokens in the window, H hidden, Nq/Nkv heads, D head_dim, E experts, I expert width,
S cache length, V vocabulary.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from strata_jax.pallas_kernels import qkv_rope as qkv_rope_mod
from strata_jax.pallas_kernels.decode_attention import decode_attention
from strata_jax.pallas_kernels.stacked_linear import folds as sl_folds, stacked_linear
from strata_jax.model.config import ModelConfig
from strata_jax.model import deltanet, moe
from strata_jax.model.deltanet import DeltaNetWeights
from strata_jax.model.linear import linear
from strata_jax.model.kv_cache import KVCache, QuantKV, _layer_of, _write_rows
from strata_jax.model.weights import AttentionWeights, LayerWeights, MLPWeights, Weights


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
    freqs = positions.astype(jnp.float32)[:, None] * qkv_rope_mod.inv_freq(theta, d)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    cos, sin = jnp.cos(emb)[:, None, :].astype(x.dtype), jnp.sin(emb)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def attention(x: jax.Array, w: AttentionWeights, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
              cfg: ModelConfig, kernel: bool = False, layer: jax.Array | None = None,
              w_stack: AttentionWeights | None = None,
              dense_kernel: bool = False, x_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of T window tokens at positions pos..pos+T-1 over the cache. x: [T, H]. kernel: the Pallas
    decode-attention kernel (pallas_kernels/decode_attention.py: reads the cache in place, only up to pos+T-1)
    instead of XLA's einsums over the whole static cache; for decode windows and prefill chunks alike (a chunk's
    T * r query rows per kv head run as row blocks of 64, each reading up to its own last token's position).
    layer: the caches are the stacked [L, S, Nkv, D] arrays and this is the layer's index (a traced int32 in the
    scanned body); they are updated and returned whole.
    w_stack: the stacked weights of every layer; the q/k/v and o products then read layer `layer` of them in place
    (pallas_kernels/stacked_linear.py) instead of products with w's slices (w still gives the norms and biases).
    dense_kernel without w_stack (the unrolled graph): the same kernel over w as a stack of one layer, so both graphs
    sum the products in the same order and round alike.
    x_norm: every layer's input RMSNorm weights [L, H] (with w_stack): x is the norm's input, and the q/k/v product
    normalises it in its kernel (stacked_linear's "norm" fold)."""
    t = x.shape[0]
    positions = pos + jnp.arange(t, dtype=jnp.int32)
    w_stack, product_layer = product_stack(w, layer, w_stack, dense_kernel)
    if layer is not None and w_stack is not None and fuses_qkv_rope(w, k_cache, cfg, t):
        q, k_cache, v_cache = qkv_rope_rows(x, w_stack, layer, k_cache, v_cache, pos, cfg, x_norm)
        out = attend_cache(q, k_cache, v_cache, pos, positions, layer, kernel)
        return attention_out(out, None, w, w_stack, product_layer, x.dtype), k_cache, v_cache
    q, k, v, gate = attention_rows(x, w, positions, cfg, w_stack, product_layer, x_norm)

    # Write this window's keys/values (int8 caches: quantized as written), then attend over the whole static cache
    # with a causal mask.
    if layer is None:
        k_cache = _write_rows(k_cache, k, (pos, 0, 0))  # [S, Nkv, D]
        v_cache = _write_rows(v_cache, v, (pos, 0, 0))
    else:
        k_cache = _write_rows(k_cache, k[None], (layer, pos, 0, 0))
        v_cache = _write_rows(v_cache, v[None], (layer, pos, 0, 0))
    out = attend_cache(q, k_cache, v_cache, pos, positions, layer, kernel)
    return attention_out(out, gate, w, w_stack, product_layer, x.dtype), k_cache, v_cache


def fuses_qkv_rope(w: AttentionWeights, k_cache, cfg: ModelConfig, t: int) -> bool:
    """The scanned graph's decode window runs pallas_kernels/qkv_rope.py after its q/k/v product (its TUNING says
    so): a plain (not int8) cache, Qwen3's attention (no output gate, RoPE on every dim, no q/k/v bias), T <= 16."""
    full_rope = cfg.rotary_dim is None or cfg.rotary_dim == cfg.head_dim
    return (qkv_rope_mod.fused(t) and not isinstance(k_cache, QuantKV) and not cfg.next and full_rope
            and w.bq is None and w.bk is None and w.bv is None)


def qkv_rope_rows(x: jax.Array, w_stack: AttentionWeights, layer, k_cache, v_cache, pos, cfg: ModelConfig,
                  x_norm: jax.Array | None = None):
    """attention_rows and the cache writes of `attention` in two kernels: the stacked q/k/v product's partials, then
    their sum, q/k norms, RoPE and the K/V rows written in place (qkv_rope). -> (q [T, Nq, D], k_cache, v_cache)."""
    t = x.shape[0]
    interpret = jax.default_backend() != "gpu"
    partials = stacked_linear(x, (w_stack.wq, w_stack.wk, w_stack.wv), layer, interpret=interpret, sum_splits=False,
                              **product_folds(t, 3, x_norm, cfg))  # [splits, Tp, N]
    q, k_cache, v_cache = qkv_rope_mod.qkv_rope(partials, w_stack.q_norm, w_stack.k_norm, pos, k_cache, v_cache,
                                                layer, t=t, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                                eps=cfg.rms_norm_eps, theta=cfg.rope_theta, interpret=interpret)
    return q[:t], k_cache, v_cache


def product_folds(t: int, matrices: int, x_norm, cfg: ModelConfig) -> dict:
    """stacked_linear's folds for a window of t tokens (its FOLD switches): the one-token row put in the kernel's tile
    (no pad op), and with x_norm the input RMSNorm in the kernel (_stacked_attention decided by its "norm" fold)."""
    fold = dict(row_in_kernel=sl_folds(t, matrices, "row"))
    if x_norm is not None:
        fold.update(norm=x_norm, eps=cfg.rms_norm_eps)
    return fold


def product_stack(w: AttentionWeights, layer, w_stack: AttentionWeights | None, dense_kernel: bool):
    """The stack the q/k/v and o products read and its layer index, or (None, layer): plain products with w.
    dense_kernel without w_stack (the unrolled graph): w as a stack of one layer."""
    if w_stack is None and dense_kernel:
        return jax.tree.map(lambda a: a[None], w), jnp.int32(0)  # [1, K, N]: a bitcast
    return w_stack, layer


def attention_rows(x: jax.Array, w: AttentionWeights, positions: jax.Array, cfg: ModelConfig,
                   w_stack: AttentionWeights | None = None, product_layer=None, x_norm: jax.Array | None = None):
    """x [T, H] at positions [T] -> q [T, Nq, D], k, v [T, Nkv, D] (normed, rotated) and Next's output gate
    [T, Nq*D] (else None)."""
    t = x.shape[0]
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qw = nq * d * (2 if cfg.next else 1)  # Qwen3-Next: each head's q then its output gate
    if w_stack is not None:
        qkv = stacked_linear(x, (w_stack.wq, w_stack.wk, w_stack.wv), product_layer,
                             interpret=jax.default_backend() != "gpu",
                             **product_folds(t, 3, x_norm, cfg)).astype(x.dtype)
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
    q, k = rope(q, positions, cfg.rope_theta, cfg.rotary_dim), rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    return q, k, v, gate


def attend_cache(q: jax.Array, k_cache, v_cache, pos: jax.Array, positions: jax.Array, layer, kernel: bool):
    """q [T, Nq, D] at positions pos.. over a cache already holding their rows ([S, Nkv, D], or the stacked
    [L, S, Nkv, D] at `layer`) -> [T, Nq*D]: the Pallas kernel (in place, up to pos+T-1) or XLA's einsums."""
    t, nq, d = q.shape
    if kernel:
        interpret = jax.default_backend() != "gpu"
        if isinstance(k_cache, QuantKV):
            return decode_attention(q, k_cache.q, v_cache.q, pos, layer=layer, k_scale=k_cache.scale,
                                    v_scale=v_cache.scale, interpret=interpret).reshape(t, nq * d)
        return decode_attention(q, k_cache, v_cache, pos, layer=layer, interpret=interpret).reshape(t, nq * d)
    if layer is not None:
        k_cache, v_cache = _layer_of(k_cache, layer), _layer_of(v_cache, layer)  # [S, Nkv, D]
    return _xla_attention(q, k_cache, v_cache, positions)


def attention_out(out: jax.Array, gate, w: AttentionWeights, w_stack, product_layer, dtype) -> jax.Array:
    """The attention's [T, Nq*D] rows through Next's gate and the o projection -> [T, H]."""
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)  # in the model dtype, as transformers
    if w_stack is not None:
        out = stacked_linear(out, (w_stack.wo,), product_layer, interpret=jax.default_backend() != "gpu",
                             **product_folds(out.shape[0], 1, None, None)).astype(dtype)
    else:
        out = linear(out, w.wo)
    return out if w.bo is None else out + w.bo


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
    layer0.., all of them or a block: strata_jax/engine/parallel.py's stages) and their cache (lists of the same length).
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
    stacked cache added to h, then the FFN's input. Returns (h, x, k_all, v_all). With stacked_linear's "norm"
    fold the input RMSNorm runs in the q/k/v product's kernel, on every layer's norm weights read at i."""
    with jax.named_scope("attention"):
        fold = dense_kernel and sl_folds(h.shape[0], 3, "norm")
        x = h if fold else rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        a, k_all, v_all = attention(x, layer.attn, k_all, v_all, pos, cfg, kernel=attention_kernel, layer=i,
                                    w_stack=stack.attn if dense_kernel else None,
                                    x_norm=stack.attn_norm if fold else None)
    h = h + a
    return h, rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps), k_all, v_all


def offload_layers(stack: LayerWeights, cache: KVCache, h: jax.Array, pos: jax.Array, n_valid: jax.Array,
                   cfg: ModelConfig, experts, attention_kernel: bool = False,
                   dense_kernel: bool = False, attend: Callable | None = None) -> tuple[jax.Array, KVCache]:
    """scan_layers with offloaded experts: the routed experts of `stack` are tuples of the layers' host arrays
    (stack_layers(keep_experts=True)), cache.experts every layer's slot cache in one (experts/slots.py
    init_stacked_slot_cache), `experts` the offloaded expert path (it gives layer l's view of that cache).

    With the native offload calls (experts.runs_native: decode windows, and prefill chunks in blocks of experts) one
    layer body runs in a `lax.scan`, the layer index traced: the calls name the layer in their plan and address the
    stacked slot arrays by absolute rows, so nothing in the body depends on the layer statically. Without them (the
    graph path's copy loops read layer l's host arrays) the same body unrolls, l a Python int.
    attend: the body's attention half, as scan_layers' (model/batch.py's batched windows: the rows of one window
    are B sequences, each at its own position and KV slot; the MoE half runs them as one window's rows)."""
    attend = attend or _stacked_attention
    t = h.shape[0]
    valid = jnp.arange(t) < n_valid  # [T]
    f = stack.ffn
    hosts = list(zip(f.gate, f.up, f.down))
    dense_part = stack.replace(ffn=f.replace(gate=None, up=None, down=None))

    deferring = experts.carries_late()  # decode windows with the deferral: a layer's late rows join at pre(l+1)
    # prefetch=N (the scanned native body): layer l+1's likely experts into its slots before layer l's own experts
    prefetching = bool(getattr(experts, "prefetch", 0)) and experts.runs_native()
    n_layers = len(hosts)

    def body(carry, i, host=None):
        h, k_all, v_all, state, late = carry
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), dense_part)
        h, x, k_all, v_all = attend(h, layer, stack, k_all, v_all, jnp.asarray(i, jnp.int32), pos, cfg,
                                    attention_kernel, dense_kernel)
        if deferring:  # pre(l): the last layer's late rows, after this layer's mixer, before its FFN half
            h = experts.join_late(h, late)
            x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
        w = layer.ffn if host is None else layer.ffn.replace(gate=host[0], up=host[1], down=host[2])
        if prefetching:  # the last layer's call prefetches nothing (its own layer, inactive): it only joins
            after = jnp.minimum(i + 1, n_layers - 1)
            router = jax.lax.dynamic_index_in_dim(f.router, after, 0, keepdims=False)  # [H, E]
            state = experts.prefetch_layer(state, after, x, router, valid, i + 1 < n_layers)
        out = experts(i, x, w, valid, experts.layer_state(state, i))
        assert deferring or out.pending is None, "the io_callback deferral runs in the unrolled graph (run_layers)"
        assert not deferring or out.pending is not None
        return (h + out.y, k_all, v_all, experts.put_state(state, i, out.state), out.pending if deferring else late), None

    carry = (h, cache.k, cache.v, cache.experts, None)
    if experts.runs_native():
        # the layers' small slot-cache leaves packed into one array for the scan (a slice and an update a layer)
        state = experts.scan_state(cache.experts)
        late = None
        if deferring:  # layer 0's pre(l) collects an empty job
            late, state = experts.late_start(h, min(t * cfg.num_experts_per_tok, cfg.num_experts), state)
        with jax.named_scope("layer"):
            carry, _ = jax.lax.scan(body, (h, cache.k, cache.v, state, late), jnp.arange(len(hosts), dtype=jnp.int32))
        if deferring:  # the last layer's late rows before the final norm: as if it were never deferred
            carry = (experts.join_late(carry[0], carry[4]), *carry[1:])
        carry = (*carry[:3], experts.scan_result(carry[3]), None)
    else:
        for i, host in enumerate(hosts):
            with jax.named_scope(f"layer{i}"):
                carry, _ = body(carry, i, host)
    h, k_all, v_all, state, _ = carry
    return h, cache.replace(k=k_all, v=v_all, experts=state)


def scan_layers(stack: LayerWeights, cache: KVCache, h: jax.Array, pos: jax.Array, n_valid: jax.Array,
                cfg: ModelConfig, experts=None, attention_kernel: bool = False,
                dense_kernel: bool = False, attend: Callable | None = None) -> tuple[jax.Array, KVCache]:
    """The layers of `forward_scanned` alone: hidden states h [T, H] through the stacked layers `stack` ([L', ...]
    leaves, any L' <= L: a block of layers, as strata_jax/engine/parallel.py's pipeline stages run) and their stacked cache
    [L', S, Nkv, D]. Returns (h, cache). attend: the body's attention half, _stacked_attention's signature
    (model/batch.py's: each row a sequence with its own position and KV slot)."""
    attend = attend or _stacked_attention
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
            h, x, k_all, v_all = attend(h, layer, stack, k_all, v_all, i, pos, cfg, attention_kernel, dense_kernel)
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
