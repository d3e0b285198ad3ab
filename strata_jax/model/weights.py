"""The weights as pytree dataclasses, declared once: every leaf's engine shape, Hub name and layout, init and
expert-stack flag (`weight_specs` / `layer_specs`, walked by `random_weights`, `abstract_weights`, the loaders and
the reference trainer); stacking the layers on a layer axis for the scanned graph. Shapes as in transformer.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.model.config import ModelConfig
from strata_jax.model import moe
from strata_jax.model.deltanet import DeltaNetWeights


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
    are quantized as they are made (strata_jax/model/quant.py; `place_scales(name, scale)` sees their scales).
    layer_device(i): the device layer i is made on (parallel=layers: its block's), so no device ever holds more than
    its block; with stacked, the layers then come as the per-layer list of the stacked form's values (stacked per
    block by strata_jax/engine/parallel.py)."""
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
            from strata_jax.model.quant import matrix_format, quantize_device
            q, q_scale = quantize_device(x, matrix_format(expert_format, leaf.expert))  # per family
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


TRANSPOSE_BLOCK = 128


def transposed(x: np.ndarray) -> np.ndarray:
    """x.T as a contiguous copy, made in square blocks of TRANSPOSE_BLOCK: numpy's copy of a large transposed
    matrix reads across every row of x for each row it writes (the lm_head's [151936, 2048] took ~4 s on a CPU,
    blocks take ~0.7 s)."""
    if x.ndim != 2 or x.size <= TRANSPOSE_BLOCK * TRANSPOSE_BLOCK:
        return np.ascontiguousarray(x.T)
    out = np.empty(x.shape[::-1], x.dtype)
    b = TRANSPOSE_BLOCK
    for r in range(0, x.shape[0], b):
        for c in range(0, x.shape[1], b):
            out[c:c + b, r:r + b] = x[r:r + b, c:c + b].T
    return out


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
            return transposed(x)
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
    from strata_jax.model.quant import matrix_format, quantize_device
    expert_sharding = expert_sharding or sharding

    def make(leaf: Leaf):
        if not leaf.expert:
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
        if not expert_format:
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=expert_sharding)
        fmt = matrix_format(expert_format, leaf.expert)  # per family: gate/up's, down's
        q, s = jax.eval_shape(lambda w: quantize_device(w, fmt), jax.ShapeDtypeStruct(leaf.shape, dtype))
        return (jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=expert_sharding),
                jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding))

    specs = weight_specs(cfg)
    return specs.replace(layers=[build_layer(s, make) for s in specs.layers], embed=make(specs.embed),
                         final_norm=make(specs.final_norm),
                         lm_head=None if specs.lm_head is None else make(specs.lm_head))
