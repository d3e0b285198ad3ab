"""Qwen3-Next's multi-token-prediction (MTP) module as a drafter: `draft="mtp"`.

The module (tensors `mtp.*`) is one full-attention MoE decoder layer over
    x_i = fc([norm_e(embed(t_{i+1})), norm_h(hidden_i)])            # [2H] -> [H]
where hidden_i is the main model's final hidden state (after its final norm) at position i and t_{i+1} the token
that followed; its output, after its own norm, goes through the model's lm_head and predicts t_{i+2}. The pair
(hidden_i, t_{i+1}) sits at position i of the module's own KV cache. Chained drafts feed the module's own output
(after its norm) back as the hidden state, with the token it just proposed, at the next position.

The drafter keeps that cache in step with the main model: after every window (and every prefill chunk) the rows of
the accepted positions are run through the layer ("catch-up"); the same graph then chains the drafts of the next
window from the last accepted row. Rows past the accepted ones write KV entries that a later catch-up overwrites
before any query reads them (causal mask), as in the main cache. Drafts only change how many windows a request
takes: verify windows keep the output exact (greedy) or distributed as without drafts (sampling).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.model import moe
from strata_jax.model.config import ModelConfig
from strata_jax.model.linear import linear
from strata_jax.model.weights import Leaf, LayerWeights, Weights, layer_specs
from strata_jax.model.kv_cache import QuantKV, kv_zeros
from strata_jax.model.transformer import attention, lm_head, norm, shared_expert


@struct.dataclass
class MTPWeights:
    fc: jax.Array  # [2H, H]: [embedding; hidden] -> H
    norm_embedding: jax.Array  # [H]
    norm_hidden: jax.Array  # [H]
    layer: LayerWeights  # full attention + MoE (+ shared expert), all on the device
    norm: jax.Array  # [H]


def weight_specs(cfg: ModelConfig) -> MTPWeights:
    """The module's declaration (the `mtp.*` tensors; see weights.weight_specs): one full-attention MoE layer."""
    h = cfg.hidden_size
    return MTPWeights(fc=Leaf((2 * h, h), "mtp.fc.weight", "T"),
                      norm_embedding=Leaf((h,), "mtp.pre_fc_norm_embedding.weight", init="norm"),
                      norm_hidden=Leaf((h,), "mtp.pre_fc_norm_hidden.weight", init="norm"),
                      layer=layer_specs(cfg, "mtp.layers.0.", linear=False, sparse=True),
                      norm=Leaf((h,), "mtp.norm.weight", init="norm"))


@struct.dataclass
class MTPCache:
    k: jax.Array | QuantKV  # [S, Nkv, D]; kv_dtype=int8: int8 rows and their scales, as the main cache
    v: jax.Array | QuantKV  # [S, Nkv, D]


def init_cache(cfg: ModelConfig, length: int, dtype, kv_dtype: str = "auto") -> MTPCache:
    shape = (length, cfg.num_kv_heads, cfg.head_dim)
    return MTPCache(k=kv_zeros(shape, dtype, kv_dtype), v=kv_zeros(shape, dtype, kv_dtype))


def mtp_layer(weights: Weights, mtp: MTPWeights, cache: MTPCache, hidden: jax.Array, tokens: jax.Array,
              pos: jax.Array, valid: jax.Array, cfg: ModelConfig):
    """hidden [T, H] (normed), tokens [T] (the token after each hidden row) at positions pos.. -> (logits [T, V]
    float32 of the token after next, the module's normed output [T, H], cache)."""
    with jax.named_scope("mtp"):
        e = norm(weights.embed[tokens], mtp.norm_embedding, cfg)
        x = linear(jnp.concatenate([e, norm(hidden, mtp.norm_hidden, cfg)], axis=-1), mtp.fc)  # [T, H]
        layer = mtp.layer
        a, k, v = attention(norm(x, layer.attn_norm, cfg), layer.attn, cache.k, cache.v, pos, cfg)
        x = x + a
        y = norm(x, layer.ffn_norm, cfg)
        if layer.shared is not None:
            x = x + shared_expert(y, layer)
        x = x + moe.moe_block(y, layer.ffn, cfg, valid)
        out = norm(x, mtp.norm, cfg)
        return lm_head(weights, out), out, MTPCache(k=k, v=v)


def catch_up_and_draft(weights: Weights, mtp: MTPWeights, cache: MTPCache, hidden: jax.Array, next_tokens: jax.Array,
                       n_rows: jax.Array, pos: jax.Array, *, cfg: ModelConfig, k: int):
    """Run the first n_rows of hidden [T, H] / next_tokens [T] (positions pos..) through the module, then chain k
    greedy drafts from row n_rows-1. -> (drafts [k] int32, cache)."""
    t = hidden.shape[0]
    valid = jnp.arange(t) < n_rows
    logits, out, cache = mtp_layer(weights, mtp, cache, hidden, next_tokens, pos, valid, cfg)
    if k == 0:
        return jnp.zeros((0,), jnp.int32), cache
    last = n_rows - 1
    draft = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, last, keepdims=False)).astype(jnp.int32)
    state = jax.lax.dynamic_index_in_dim(out, last, keepdims=False)  # [H]
    drafts = [draft]
    for j in range(1, k):
        lg, o, cache = mtp_layer(weights, mtp, cache, state[None], draft[None], pos + last + j,
                                 jnp.ones((1,), bool), cfg)
        draft, state = jnp.argmax(lg[0]).astype(jnp.int32), o[0]
        drafts.append(draft)
    return jnp.stack(drafts), cache


@functools.lru_cache(maxsize=None)
def draft_graph(cfg: ModelConfig, k: int):
    """catch_up_and_draft jitted for k drafts (one compile per row count, kept for the process: every request's
    drafter shares them)."""
    return jax.jit(functools.partial(catch_up_and_draft, cfg=cfg, k=k), donate_argnums=(2,))


def draft_tokens(drafts, vocab: int) -> list[int]:
    """The module's argmax drafts [k] (a device array) as host ints, kept inside the vocabulary."""
    return [int(d) if 0 <= d < vocab else 0 for d in np.asarray(drafts)]


class MTPDrafter:
    """The drafts of a verify window from the MTP module (a drafts.Drafter). The engine hands it the hidden rows of
    every window and prefill chunk (`feed`); `propose` catches its cache up on the rows whose next token is known
    and chains the drafts, in one graph per row count."""

    def __init__(self, weights: Weights, mtp: MTPWeights, cache: MTPCache, cfg: ModelConfig, k_max: int):
        self.weights, self.mtp, self.cache, self.cfg, self.k_max = weights, mtp, cache, cfg, k_max
        self.pending = None  # (hidden [T, H] device array, first position): rows not yet run through the module
        self._next: list[int] = []  # their next tokens, as far as known

    def catch_up(self, hidden: jax.Array, next_tokens, pos: int, k: int = 0) -> np.ndarray:
        """Rows of hidden [T, H] at positions pos.. with their known next tokens (len <= T); -> k drafts."""
        n = len(next_tokens)
        t = hidden.shape[0]
        tokens = np.zeros((t,), np.int32)
        tokens[:n] = next_tokens
        drafts, self.cache = draft_graph(self.cfg, k)(self.weights, self.mtp, self.cache, hidden, tokens,
                                               np.int32(n), np.int32(pos))
        return np.asarray(drafts)

    def feed(self, hidden: jax.Array, pos: int, known=()) -> None:
        """Rows of hidden [T, H] from position pos whose next tokens are `known` and then what observe() brings (the
        tokens the window or the prefill produced)."""
        self.pending, self._next = (hidden, pos), list(known)

    def observe(self, accepted) -> None:
        self._next += list(accepted)

    def propose(self, tokens, k: int) -> list[int]:
        if self.pending is None or k <= 0:
            return []
        (hidden, pos), self.pending = self.pending, None
        return draft_tokens(self.catch_up(hidden, self._next, pos, self.k_max), self.cfg.vocab_size)[:k]
