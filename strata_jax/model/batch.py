"""The batched window: B sequences decoded together, one row (one token, T=1) each.

Everything of a window but the attention is row-wise already (norms, products, the MoE block, the head), so the
rows of a batch run as the rows of one window of T=B tokens (the weights read once for all of them; the MoE block
routes each row and reads each distinct expert once). The attention is each sequence's own: row b writes its key
and value at its own position pos[b] into its own KV slot slots[b] and attends over that slot alone, as a T=1
window of the sequence alone: the same q/k/v and output pieces (transformer.attention_rows / attention_out), all B
rows' K/V written in one scatter, and their attention one computation (batch_attend_cache: the Pallas kernel's
batched form, pallas_kernels/decode_attention.batch_decode_attention, or the single-sequence XLA attention vmapped
over the rows' gathered slots).

The cache (kv_cache.init_batch_cache) is stacked [L*M, S, Nkv, D], M slots a layer: layer l's slot s is row
l*M + s, which the attention reads as the scanned body reads layer l of the engine's own cache. Rows b >= n_active
are padding: they route to no expert (the MoE's valid mask) and write into a slot no active row owns (the caller
points them there), whose rows its next sequence rewrites before it reads them.

With offload the batch cache carries the engine's stacked slot cache for the window (kv_cache.with_slot_caches) and
the rows run through the scanned offload body (transformer.offload_layers with the same attention hook): the MoE
half is OffloadedExperts' window of T=B rows, so moe.make_route gives the union of the rows' experts, the plan
fetches each missed expert of the union once, and the pool's job computes every row's cpu entries; a window of
more distinct experts than one pair of native calls takes (B * K > 32) runs its expert list in blocks of 32, as a
prefill chunk does (OffloadedExperts.native_window).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.pallas_kernels.decode_attention import batch_decode_attention
from strata_jax.model.config import ModelConfig
from strata_jax.model.kv_cache import KVCache, QuantKV, _scatter_rows
from strata_jax.model.transformer import (_xla_attention, attention_out, attention_rows, head_logits,
                                          offload_layers, product_stack, rms_norm, scan_layers)
from strata_jax.model.weights import LayerWeights, Weights


def batch_attention(h: jax.Array, layer: LayerWeights, stack: LayerWeights, k_all, v_all, i: jax.Array,
                    pos: jax.Array, cfg: ModelConfig, attention_kernel: bool, dense_kernel: bool, *,
                    slots: jax.Array, slots_per_layer: int):
    """scan_layers' attention half for a batch: h [B, H], pos [B] and slots [B] int32, k_all / v_all the batch
    cache [L*M, S, Nkv, D] -> (h + attention, the FFN's input x, k_all, v_all). The B rows' keys and values go in
    with one scatter a cache, and their attention is one computation (batch_attend_cache), no loop over B."""
    x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
    w = layer.attn
    w_stack, product_layer = product_stack(w, i, stack.attn if dense_kernel else None, dense_kernel)
    q, k, v, gate = attention_rows(x, w, pos, cfg, w_stack, product_layer)  # [B, Nq, D], [B, Nkv, D] x 2
    rows = i * slots_per_layer + slots  # [B]: each sequence's (layer i, slot) row of the [L*M, ...] stack
    # Padding rows may share a (row, position) with each other (never with a real row): they write the same key
    # and value there (token 0 at position 0), so whichever write the scatter keeps is the same.
    k_all = _scatter_rows(k_all, rows, pos, k)
    v_all = _scatter_rows(v_all, rows, pos, v)
    out = batch_attend_cache(q, k_all, v_all, rows, pos, attention_kernel)  # [B, Nq*D]
    h = h + attention_out(out, gate, w, w_stack, product_layer, x.dtype)
    return h, rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps), k_all, v_all


def batch_attend_cache(q: jax.Array, k_all, v_all, rows: jax.Array, pos: jax.Array, kernel: bool) -> jax.Array:
    """q [B, Nq, D], row b at position pos[b] over cache row rows[b] of the stacked [R, S, Nkv, D] caches (plain or
    QuantKV), its own key already written -> [B, Nq*D]. kernel: pallas_kernels' batch_decode_attention (one kernel,
    each row's cache row read in place up to pos[b]); else XLA: the rows' caches gathered [B, S, Nkv, D] and the
    single-sequence _xla_attention vmapped over them (one masked batched einsum, each row's arithmetic as alone)."""
    b, nq, d = q.shape
    if kernel:
        interpret = jax.default_backend() != "gpu"
        if isinstance(k_all, QuantKV):
            out = batch_decode_attention(q, k_all.q, v_all.q, rows, pos, k_all.scale, v_all.scale,
                                         interpret=interpret)
        else:
            out = batch_decode_attention(q, k_all, v_all, rows, pos, interpret=interpret)
        return out.reshape(b, nq * d)
    k_rows, v_rows = (jax.tree.map(lambda a: jnp.take(a, rows, axis=0), c) for c in (k_all, v_all))  # [B, S, ..]
    one = lambda q1, k1, v1, p1: _xla_attention(q1[None], k1, v1, p1[None])[0]  # a T=1 window at p1
    return jax.vmap(one)(q, k_rows, v_rows, pos)


def forward_batch(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, slots: jax.Array,
                  n_active: jax.Array, cfg: ModelConfig, experts=None, attention_kernel: bool = False,
                  dense_kernel: bool = False) -> tuple[jax.Array, KVCache]:
    """tokens [B] of B sequences, row b at position pos[b] of KV slot slots[b]; the first n_active rows real ->
    float32 logits [B, V] and the updated batch cache. Stacked weights: the scanned all-resident body, or with
    offload (cache.experts: the engine's stacked slot cache, carried in the batch cache for the window) the scanned
    offload body (transformer.offload_layers), whose MoE half runs the B rows as one window's: the union of their
    experts planned once, each fetched once, the pool's job over all the rows."""
    assert weights.stacked, "batched windows: the scanned layer loop"
    slots_per_layer = cache.k.shape[0] // cfg.num_layers
    attend = functools.partial(batch_attention, slots=slots, slots_per_layer=slots_per_layer)
    h = weights.embed[tokens]  # [B, H]
    run = scan_layers if cache.experts is None else offload_layers
    h, cache = run(weights.layers, cache, h, pos, n_active, cfg, experts, attention_kernel, dense_kernel,
                   attend=attend)
    return head_logits(weights, h, cfg), cache
