"""The batched window: B sequences decoded together, one row (one token, T=1) each.

Everything of a window but the attention is row-wise already (norms, products, the MoE block, the head), so the
rows of a batch run as the rows of one window of T=B tokens (the weights read once for all of them; the MoE block
routes each row and reads each distinct expert once). The attention is each sequence's own: row b writes its key
and value at its own position pos[b] into its own KV slot slots[b] and attends over that slot alone, exactly as a
T=1 window of the sequence alone (the same code: transformer.attention_rows / attend_cache / attention_out).

The cache (kv_cache.init_batch_cache) is stacked [L*M, S, Nkv, D], M slots a layer: layer l's slot s is row
l*M + s, which the attention reads as the scanned body reads layer l of the engine's own cache. Rows b >= n_active
are padding: they route to no expert (the MoE's valid mask) and write into a slot no active row owns (the caller
points them there), whose rows its next sequence rewrites before it reads them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.model.config import ModelConfig
from strata_jax.model.kv_cache import KVCache, _write_rows
from strata_jax.model.transformer import (attend_cache, attention_out, attention_rows, head_logits, product_stack,
                                          rms_norm, scan_layers)
from strata_jax.model.weights import LayerWeights, Weights


def batch_attention(h: jax.Array, layer: LayerWeights, stack: LayerWeights, k_all, v_all, i: jax.Array,
                    pos: jax.Array, cfg: ModelConfig, attention_kernel: bool, dense_kernel: bool, *,
                    slots: jax.Array, slots_per_layer: int):
    """scan_layers' attention half for a batch: h [B, H], pos [B] and slots [B] int32, k_all / v_all the batch
    cache [L*M, S, Nkv, D] -> (h + attention, the FFN's input x, k_all, v_all)."""
    x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
    w = layer.attn
    w_stack, product_layer = product_stack(w, i, stack.attn if dense_kernel else None, dense_kernel)
    q, k, v, gate = attention_rows(x, w, pos, cfg, w_stack, product_layer)  # [B, Nq, D], [B, Nkv, D] x 2
    rows = []
    for b in range(h.shape[0]):  # each sequence over its own slot: B small (the buckets), unrolled
        row = i * slots_per_layer + slots[b]  # (layer i, slot) in the [L*M, ...] stack
        k_all = _write_rows(k_all, k[b:b + 1][None], (row, pos[b], 0, 0))
        v_all = _write_rows(v_all, v[b:b + 1][None], (row, pos[b], 0, 0))
        rows.append(attend_cache(q[b:b + 1], k_all, v_all, pos[b], pos[b:b + 1], row, attention_kernel))
    out = attention_out(jnp.concatenate(rows), gate, w, w_stack, product_layer, x.dtype)  # [B, H]
    h = h + out
    return h, rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps), k_all, v_all


def forward_batch(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, slots: jax.Array,
                  n_active: jax.Array, cfg: ModelConfig, experts=None, attention_kernel: bool = False,
                  dense_kernel: bool = False) -> tuple[jax.Array, KVCache]:
    """tokens [B] of B sequences, row b at position pos[b] of KV slot slots[b]; the first n_active rows real ->
    float32 logits [B, V] and the updated batch cache. Stacked weights (the scanned all-resident engine)."""
    assert weights.stacked and cache.experts is None, "batched windows: the scanned all-resident layer loop"
    slots_per_layer = cache.k.shape[0] // cfg.num_layers
    attend = functools.partial(batch_attention, slots=slots, slots_per_layer=slots_per_layer)
    h = weights.embed[tokens]  # [B, H]
    h, cache = scan_layers(weights.layers, cache, h, pos, n_active, cfg, experts, attention_kernel, dense_kernel,
                           attend=attend)
    return head_logits(weights, h, cfg), cache
