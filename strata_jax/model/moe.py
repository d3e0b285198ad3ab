"""The sparse MoE block: route, experts, combine.

Route: softmax over all E router logits in float32, top-K, optional renormalisation (`norm_topk_prob`), weights
cast to the compute dtype (as transformers). Experts: the window's distinct experts (at most T*K, or all E when the
window is large) each run on every row of the window, and the combine matrix [T, N] keeps only the rows that chose
it; so each expert's weights are read once per window, whoever asked for it. The placement of experts (device slots,
PCIe fetch, host pool) changes where `expert_ffn` reads weights from, never the arithmetic.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.pallas_kernels.expert_ffn import expert_ffn as expert_ffn_kernel
from strata_jax.pallas_kernels.route_topk import route_topk
from strata_jax.model.config import ModelConfig
from strata_jax.model.linear import linear
from strata_jax.model.quant import dequantize_engine_int4, dequantize_engine_grouped


@struct.dataclass
class MoEWeights:
    """Experts keep the checkpoint's [out, in] layout: one layout on the device, in pinned host memory and in the
    host pool, and no transpose at load."""
    router: jax.Array  # [H, E]
    gate: jax.Array  # [E, I, H]
    up: jax.Array  # [E, I, H]
    down: jax.Array  # [E, H, I]
    # expert_dtype=int8: gate/up/down hold int8 q and these their rows' scales; int4: q packed two a byte (uint8,
    # [E, I, H/2] and [E, H, I/2]) and one scale per g = 64 (or 32) inputs, group-major ([E, H/g, I], [E, H/g, I],
    # [E, I/g, H]). The scales are always on the device.
    gate_scale: jax.Array | None = None  # [E, I]
    up_scale: jax.Array | None = None  # [E, I]
    down_scale: jax.Array | None = None  # [E, H]

    @property
    def scales(self) -> tuple:
        """(gate, up, down) scales, or () for float experts."""
        return () if self.gate_scale is None else (self.gate_scale, self.up_scale, self.down_scale)


@struct.dataclass
class Route:
    """Each row's top-K experts, and the window's distinct experts with the combine matrix."""
    topk_ids: jax.Array  # [T, K] int32, E for padding rows
    topk_weights: jax.Array  # [T, K] float32 (0 for padding rows)
    expert_ids: jax.Array  # [N] int32, distinct experts of the window; -1 pads
    combine: jax.Array  # [T, N] float32: routing weight of row t for expert_ids[n], else 0
    entry_counts: jax.Array  # [N] int32: rows of the window that chose expert_ids[n]


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """x [T, H] -> float32 router logits [T, E]."""
    return linear(x, router, preferred_element_type=jnp.float32)


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig, valid: jax.Array, kernel: bool = False) -> Route:
    """x: [T, H]; valid: [T] bool (padding rows route nowhere). kernel: softmax and top-K in one Pallas kernel
    (pallas_kernels/route_topk.py; interpreted off the GPU) instead of XLA's softmax and sort: the same ids, the
    weights to the last bit of the softmax's rounding."""
    logits = router_logits(x, router)  # [T, E]
    k = cfg.num_experts_per_tok
    if kernel:
        topk_ids, topk_w = route_topk(logits, valid, k=k, norm_topk_prob=cfg.norm_topk_prob, dtype=x.dtype,
                                      interpret=jax.default_backend() != "gpu")  # rounded and masked already
        return route_of(topk_ids, topk_w, cfg)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    topk_w, topk_ids = jax.lax.top_k(probs, k)  # [T, K]
    if cfg.norm_topk_prob:
        topk_w = topk_w / jnp.sum(topk_w, axis=-1, keepdims=True)
    return make_route(topk_ids, topk_w, cfg, valid, x.dtype)


def make_route(topk_ids: jax.Array, topk_w: jax.Array, cfg: ModelConfig, valid: jax.Array, dtype) -> Route:
    """Each row's picked experts (ordered by weight) and float32 weights -> the window's Route."""
    # transformers casts the routing weights to the hidden dtype before the weighted sum.
    topk_w = topk_w.astype(dtype).astype(jnp.float32)
    topk_w = jnp.where(valid[:, None], topk_w, 0.0)
    topk_ids = jnp.where(valid[:, None], topk_ids, cfg.num_experts).astype(jnp.int32)
    return route_of(topk_ids, topk_w, cfg)


def route_of(topk_ids: jax.Array, topk_w: jax.Array, cfg: ModelConfig) -> Route:
    """topk_ids [T, K] int32 (E on padding rows), topk_w [T, K] float32 (rounded to the model dtype, 0 on padding
    rows) -> the window's Route: its distinct experts and the combine matrix."""
    t, k = topk_ids.shape
    e = cfg.num_experts
    n = min(t * k, e)
    if t == 1:  # one token's top-K are distinct already: no sort, and the combine row is its weights
        expert_ids = topk_ids[0]
        return Route(topk_ids=topk_ids, topk_weights=topk_w, expert_ids=jnp.where(expert_ids >= e, -1, expert_ids),
                     combine=topk_w, entry_counts=(expert_ids < e).astype(jnp.int32))
    if n == e:  # large windows (prefill chunks): every expert in order, -1 where no row chose it
        expert_ids = jnp.arange(e, dtype=jnp.int32)
        chosen = jnp.zeros((e + 1,), bool).at[topk_ids.reshape(-1)].set(True)[:e]
        expert_ids = jnp.where(chosen, expert_ids, e)
    else:
        expert_ids = jnp.unique(topk_ids, size=n, fill_value=e)
    match = topk_ids[:, :, None] == expert_ids[None, None, :]  # [T, K, N]; padding (E) matches only padding rows
    match = match & (expert_ids < e)[None, None, :]
    expert_ids = jnp.where(expert_ids >= e, -1, expert_ids).astype(jnp.int32)  # [N]
    combine = jnp.sum(jnp.where(match, topk_w[:, :, None], 0.0), axis=1)  # [T, N]
    return Route(topk_ids=topk_ids, topk_weights=topk_w, expert_ids=expert_ids, combine=combine,
                 entry_counts=jnp.sum(match, axis=(0, 1), dtype=jnp.int32))


def expert_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, combine: jax.Array,
               gate_scale: jax.Array | None = None, up_scale: jax.Array | None = None,
               down_scale: jax.Array | None = None) -> jax.Array:
    """SwiGLU experts on every row, weighted: x [T, H], gate/up [N, I, H], down [N, H, I], combine [T, N].

    Returns float32 [T, H] = sum_n combine[t, n] * down_n(silu(gate_n x_t) * up_n x_t).
    int8 experts (strata_jax/model/quant.py "int8"): gate/up/down hold q, gate_scale/up_scale [N, I] and down_scale
    [N, H] their rows' scales; each product is accumulated in float32 over q widened to x's dtype (exact), scaled
    per output row, then rounded as the float path rounds (the Pallas kernel and the host pool do the same).
    int4 experts ("int4"): q packed in uint8 with scales [N, O, In/64]; each product is the float32 dot with the
    exactly dequantized weights (q * scale is exact in float32), then rounded the same way; int8-g ("int8-g32", ...:
    GGUF types kept as read) likewise, q int8 with float32 group scales [N, G, O] or [N, 2, G, O] (minima).
    """
    if gate_scale is None:
        g = jnp.einsum("th,nih->nti", x, gate)
        u = jnp.einsum("th,nih->nti", x, up)
    else:
        g = _scaled_product("th,nih->nti", x, gate, gate_scale)
        u = _scaled_product("th,nih->nti", x, up, up_scale)
    # silu(g) * u in float32, rounded once: the Pallas kernel and the host pool round at the same point, so an
    # expert's rows do not depend on where it ran (XLA would otherwise round after every bf16 op, differently on
    # each backend).
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)
    if gate_scale is None:
        y = jnp.einsum("nti,nhi->nth", h, down)  # [N, T, H]
    else:
        y = _scaled_product("nti,nhi->nth", h, down, down_scale)
    # Each expert's output is rounded to the compute dtype before the weighted sum, as transformers does.
    return jnp.einsum("tn,nth->th", combine, y.astype(jnp.float32))


def _scaled_product(spec: str, a: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """einsum(spec, a, w) in float32, rounded to a's dtype, for quantized w: int8 q [N, O, In] with per-row scale
    [N, O] (the product of q widened, times the scale), or int4 packed q [N, O, In/2] with group-major scale
    [N, In/g, O]; int8-g: int8 q with group-major scales [N, G, O] or [N, 2, G, O] (with minima)."""
    if q.dtype == jnp.uint8 or scale.ndim > 2:  # int4 / int8-g: float32 weights, exact; HIGHEST keeps the GPU's dot
        # from rounding them (TF32)
        w = (dequantize_engine_int4(q, scale, jnp.float32) if q.dtype == jnp.uint8 else
             dequantize_engine_grouped(q, scale, jnp.float32))
        acc = jnp.einsum(spec, a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return acc.astype(a.dtype)
    acc = jnp.einsum(spec, a, q.astype(a.dtype), preferred_element_type=jnp.float32)  # [N, T, O]
    return (acc * scale.astype(jnp.float32)[:, None, :]).astype(a.dtype)


def resident_experts(x: jax.Array, w: MoEWeights, r: Route, offset: jax.Array | int = 0) -> jax.Array:
    """All experts on the device: gather the window's distinct experts (padding reads expert 0, weight 0).
    offset: row of expert 0 in w.gate/up/down (stacked layers: [L*E, ...] arrays, offset = layer * E)."""
    ids = jnp.maximum(r.expert_ids, 0) + offset
    return expert_ffn(x, w.gate[ids], w.up[ids], w.down[ids], r.combine, *(sc[ids] for sc in w.scales))


class ExpertsOut(NamedTuple):
    """What an expert path (model.ExpertPath) returns for a sparse layer."""
    y: jax.Array  # [T, H] the layer's expert rows, combined
    state: object  # the layer's expert state (experts/slots.py's SlotCache with offload), None without
    pending: object = None  # experts/defer.py's Pending: deferred cpu rows still owed to the residual, else None


class ResidentExperts:
    """The expert path of a model whose experts are all on the device, with the Pallas expert FFN kernel
    (pallas_kernels/expert_ffn.py: each distinct expert's weights read in place, once per window, no gather copy)
    instead of XLA's gather + einsums. bf16 on a GPU only; `(layer, x, w, valid, state) -> ExpertsOut(y, state)`.
    route_kernel: the route's softmax and top-K as one Pallas kernel (route(kernel=True))."""

    def __init__(self, cfg: ModelConfig, interpret: bool = False, route_kernel: bool = False):
        self.cfg, self.interpret, self.route_kernel = cfg, interpret, route_kernel

    def __call__(self, layer: int, x: jax.Array, w: MoEWeights, valid: jax.Array, state=None,
                 offset: jax.Array | int = 0):
        with jax.named_scope("moe_route"):
            r = route(x, w.router, self.cfg, valid, kernel=self.route_kernel)
        with jax.named_scope("moe_experts_pallas"):
            rows = jnp.where(r.expert_ids >= 0, r.expert_ids + offset, -1)  # stacked layers: row layer * E + expert
            # quantized: the scales lie row for row beside q ([E, ...] / [L*E, ...]), read in place at the same rows
            y = expert_ffn_kernel(x, w.gate, w.up, w.down, rows, r.combine, *w.scales, interpret=self.interpret)
        with jax.named_scope("moe_combine"):
            return ExpertsOut(y.astype(x.dtype), state)


def moe_block(x: jax.Array, w: MoEWeights, cfg: ModelConfig, valid: jax.Array,
              offset: jax.Array | int = 0) -> jax.Array:
    with jax.named_scope("moe_route"):
        r = route(x, w.router, cfg, valid)
    with jax.named_scope("moe_experts"):
        y = resident_experts(x, w, r, offset)
    with jax.named_scope("moe_combine"):
        return y.astype(x.dtype)
