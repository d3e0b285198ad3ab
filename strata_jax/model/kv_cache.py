"""The KV cache: [S, Nkv, D] rows per layer (or stacked [L, S, Nkv, D]), bf16 / float32 or int8 rows with float32
scales per (position, kv head) (`QuantKV`), and Qwen3-Next's DeltaNet state ring beside it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.model.config import ModelConfig
from strata_jax.model import deltanet
from strata_jax.model.deltanet import DeltaState


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


def _scatter_rows(cache, rows: jax.Array, pos: jax.Array, new: jax.Array):
    """new [B, Nkv, D]: row b into cache[rows[b], pos[b]] of a stacked [R, S, Nkv, D] cache (plain or QuantKV,
    quantized as written), all B rows in one scatter (model/batch.py: each sequence at its own (layer, slot) row
    and position)."""
    if isinstance(cache, QuantKV):
        q = quantize_kv(new)
        return QuantKV(q=cache.q.at[rows, pos].set(q.q), scale=cache.scale.at[rows, pos].set(q.scale))
    return cache.at[rows, pos].set(new.astype(cache.dtype))


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


def init_batch_cache(cfg: ModelConfig, slots: int, length: int, dtype=jnp.float32, kv_dtype: str = "auto") -> KVCache:
    """The KV cache of batched windows (model/batch.py): `slots` sequences of `length` positions each, stacked
    [L*M, S, Nkv, D] (layer l's slot s at row l*M + s: the stacked cache's layout with M rows a layer, so the
    attention reads one (layer, slot) as it reads one layer). Full-attention layers only (the scanned body)."""
    shape = (cfg.num_layers * slots, length, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=kv_zeros(shape, dtype, kv_dtype), v=kv_zeros(shape, dtype, kv_dtype))


def put_slot(batch: KVCache, one: KVCache, slot: jax.Array) -> KVCache:
    """One sequence's stacked K/V rows [L, S, Nkv, D] (the engine's own cache, after its prefill) into slot `slot`
    of a batch cache [L*M, S, Nkv, D]: the whole slot, so no row of its last sequence stays."""
    def put(b, o):
        n_layers = o.shape[0]
        view = b.reshape(n_layers, b.shape[0] // n_layers, *b.shape[1:])  # [L, M, S, ...]: a bitcast
        return jax.lax.dynamic_update_slice_in_dim(view, o[:, None], slot, axis=1).reshape(b.shape)
    return batch.replace(k=jax.tree.map(put, batch.k, one.k), v=jax.tree.map(put, batch.v, one.v))


def get_slot(batch: KVCache, one: KVCache, slot: jax.Array) -> KVCache:
    """put_slot's reverse: slot `slot` of a batch cache [L*M, S, Nkv, D] into the engine's stacked cache [L, S, Nkv, D]
    (the whole slot; its other fields, the slot caches, kept): a prompt whose prefix the slot holds prefills the
    rest from there (BatchDecoder.begin)."""
    def get(b, o):
        n_layers = o.shape[0]
        view = b.reshape(n_layers, b.shape[0] // n_layers, *b.shape[1:])  # [L, M, S, ...]: a bitcast
        return jax.lax.dynamic_index_in_dim(view, slot, axis=1, keepdims=False).astype(o.dtype)
    return one.replace(k=jax.tree.map(get, batch.k, one.k), v=jax.tree.map(get, batch.v, one.v))


def with_slot_caches(batch: KVCache, one: KVCache) -> KVCache:
    """The batch cache carrying the engine's slot caches (one.experts) into a batched window: with offload the
    window plans, fetches and counts in the slot caches the engine's own windows use (one set for every sequence);
    without offload (one.experts None) the batch cache as it is."""
    return batch if one.experts is None else batch.replace(experts=one.experts)


def split_slot_caches(batch: KVCache, one: KVCache) -> tuple[KVCache, KVCache]:
    """A batched window's cache back apart: (the batch cache without the slot caches, the engine's cache with
    them, as the window left them)."""
    if batch.experts is None:
        return batch, one
    return batch.replace(experts=None), one.replace(experts=batch.experts)
