"""Hugging Face safetensors checkpoints (single file or sharded), read lazily, and the engine's own saved state.

Tensors are read one at a time from memory-mapped files, converted to the compute dtype and placed at once, so the
host never holds a second full copy of the model. Every failure names the file or tensor.
"""
from __future__ import annotations

import contextlib

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from strata_jax.config import ModelConfig
from strata_jax.errors import StrataError, make_writable_folder
from strata_jax.deltanet import DeltaNetWeights
from strata_jax.model import AttentionWeights, LayerWeights, MLPWeights, Weights
from strata_jax.moe import MoEWeights
from strata_jax import quant
from strata_jax.mtp import MTPWeights

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """name -> tensor over one or several safetensors files, opened lazily."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise StrataError(f"model folder {self.folder} does not exist")
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise StrataError(f"{index}: malformed index ({e})") from None
            self.file_of = {name: self.folder / f for name, f in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise StrataError(f"no *.safetensors files in {self.folder}")
            self.file_of = {}
            for f in files:
                for name in self._open(f).keys():
                    self.file_of[name] = f
        self._handles: dict[Path, object] = {}

    def _open(self, path: Path):
        if path in getattr(self, "_handles", {}):
            return self._handles[path]
        if not path.is_file():
            raise StrataError(f"checkpoint file {path} is missing")
        try:
            handle = safe_open(str(path), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise StrataError(f"cannot read checkpoint file {path}: {e}") from None
        if hasattr(self, "_handles"):
            self._handles[path] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.file_of:
            raise StrataError(f"checkpoint tensor {name!r} is missing (in {self.folder})")
        path = self.file_of[name]
        handle = self._open(path)
        try:
            got = tuple(handle.get_slice(name).get_shape())
        except Exception as e:
            raise StrataError(f"checkpoint tensor {name!r} cannot be read from {path}: {e}") from None
        if got != tuple(shape):
            raise StrataError(f"checkpoint tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        try:
            x = handle.get_tensor(name)
        except Exception as e:
            raise StrataError(f"checkpoint tensor {name!r} cannot be read from {path}: {e}") from None
        check_weight(name, x)
        return x


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
EXPONENT_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80}  # all exponent bits set: inf or NaN


def check_weight(name: str, x: np.ndarray) -> None:
    """One line for a tensor that would load silently wrong: a non-float dtype (an int or FP8 tensor would be cast
    and change the output) or a non-finite value (NaN / inf). One pass over the tensor as it is read; 16-bit types
    test their exponent bits, so no float copy is made."""
    kind = str(x.dtype)
    if kind not in FLOAT_DTYPES:
        raise StrataError(f"checkpoint tensor {name!r} has dtype {kind}: expected a floating-point type "
                          f"({', '.join(FLOAT_DTYPES[:3])}); quantized and integer weights are not supported")
    if kind in EXPONENT_MASK:
        mask = EXPONENT_MASK[kind]
        bad = int(np.count_nonzero((x.view(np.uint16) & mask) == mask))
    else:
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    if bad:
        raise StrataError(f"checkpoint tensor {name!r} holds {bad} non-finite value(s) (NaN or inf): the checkpoint "
                          "is damaged")


def to_dtype(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(jnp.dtype(dtype), copy=False)


# place(name, host array) -> the array the engine keeps (a device array by default).
Placer = Callable[[str, np.ndarray], object]


def default_place(name: str, x: np.ndarray):
    return jax.device_put(x)


def has_mtp(folder: str | Path, cfg: ModelConfig) -> bool:
    """Whether the checkpoint holds Qwen3-Next's (or Qwen3.5's) multi-token-prediction module (`mtp.*`)."""
    return cfg.next and cfg.mtp_layers > 0 and "mtp.fc.weight" in SafetensorsReader(folder)


def load_mtp(folder: str | Path, cfg: ModelConfig, dtype=jnp.float32, place: Placer = default_place) -> MTPWeights:
    """The `mtp.*` tensors as MTPWeights, on the device (see strata_jax/mtp.py)."""
    return load_weights(folder, cfg, dtype, place, mtp_only=True)


def text_prefix(reader: SafetensorsReader, cfg: ModelConfig) -> str:
    """Where the text model's tensors live: `model.` (Qwen3-MoE, Qwen3-Next, a text-only Qwen3.5 save) or
    `model.language_model.` (Qwen3.5-MoE's multimodal Hub checkpoints, beside `model.visual.*`)."""
    if cfg.qwen35 and "model.language_model.embed_tokens.weight" in reader:
        return "model.language_model."
    return "model."


def grouped_deltanet_rows(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                          cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3.5's split DeltaNet projections -> Qwen3-Next's grouped in_proj_qkvz / in_proj_ba rows (the layout
    DeltaNetWeights and deltanet() take). Qwen3.5: in_proj_qkv [q of every key head | k | v of every value head],
    in_proj_z [Nv*Dv], in_proj_b / in_proj_a [Nv], each in head order (rows x H). Next groups per key head i:
    [q_i | k_i | v, z of value heads i*r..i*r+r-1] and [b, a of those heads]; value head j reads key head j // r in
    both (transformers' repeat_interleave), so this is a row permutation: the model computes the same numbers."""
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r, h = nv // nk, qkv.shape[-1]
    q = qkv[:nk * dk].reshape(nk, dk, h)
    k = qkv[nk * dk:2 * nk * dk].reshape(nk, dk, h)
    v = qkv[2 * nk * dk:].reshape(nk, r * dv, h)
    qkvz = np.concatenate([q, k, v, z.reshape(nk, r * dv, h)], axis=1).reshape(-1, h)  # [Nk*(2Dk+2rDv), H]
    ba = np.concatenate([b.reshape(nk, r, h), a.reshape(nk, r, h)], axis=1).reshape(-1, h)  # [Nk*2r, H]
    return qkvz, ba


def load_weights(folder: str | Path, cfg: ModelConfig, dtype=jnp.float32, place: Placer = default_place,
                 place_experts: Placer | None = None, progress: Callable[[str], None] | None = None,
                 mtp_only: bool = False, expert_format: str | None = None,
                 place_scales: Placer | None = None) -> Weights:
    """Read a Qwen3-MoE, Qwen3-Next or Qwen3.5-MoE checkpoint in the Hub layout into `Weights` (dense matrices
    transposed to [in, out]). The `mtp.*` tensors (Next's and Qwen3.5's multi-token-prediction head) are read by
    `load_mtp` (mtp_only). Qwen3.5-MoE's own names are mapped here (`text_prefix`, `grouped_deltanet_rows`; experts
    per expert or fused as `experts.gate_up_proj` / `experts.down_proj`, either is read for any model).

    `place_experts` receives each sparse layer's stacked expert arrays (names `layers.{i}.experts.{gate,up,down}`);
    by default they go where `place` puts everything else. expert_format "int8" or "int4" (strata_jax/quant.py): the
    routed experts (not the MTP layer's) are quantized as they are read; `place_experts` then receives q (int8, or
    int4 packed in uint8) and `place_scales` (default `place`) the bf16 scales, [E, O] per row (int8) or [E, O, I/64]
    (int4) (names `layers.{i}.experts.{gate,up,down}_scale`).
    """
    reader = SafetensorsReader(folder)
    place_experts = place_experts or place
    place_scales = place_scales or place
    h, d, nq, nkv, v = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    base = text_prefix(reader, cfg)

    def get(name, shape, transpose=False):
        x = to_dtype(reader.get(name, shape), dtype)
        return place(name, np.ascontiguousarray(x.T) if transpose else x)

    def maybe_bias(name, n):
        return get(name, (n,)) if cfg.attention_bias else None

    def deltanet_weights(p):
        nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        c, k = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        conv = to_dtype(reader.get(p + "conv1d.weight", (c, 1, k)), dtype)[:, 0, :]  # [C, K] -> [K, C] below
        if cfg.qwen35:  # split projections, regrouped per key head (the same conv channels: q, k, v)
            qkvz, ba = grouped_deltanet_rows(
                reader.get(p + "in_proj_qkv.weight", (c, h)), reader.get(p + "in_proj_z.weight", (nv * dv, h)),
                reader.get(p + "in_proj_b.weight", (nv, h)), reader.get(p + "in_proj_a.weight", (nv, h)), cfg)
            in_qkvz = place(p + "in_proj_qkvz.weight", np.ascontiguousarray(to_dtype(qkvz, dtype).T))
            in_ba = place(p + "in_proj_ba.weight", np.ascontiguousarray(to_dtype(ba, dtype).T))
        else:
            in_qkvz = get(p + "in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, h), True)
            in_ba = get(p + "in_proj_ba.weight", (2 * nv, h), True)
        return DeltaNetWeights(
            in_qkvz=in_qkvz, in_ba=in_ba,
            conv=place(p + "conv1d.weight", np.ascontiguousarray(conv.T)),
            dt_bias=get(p + "dt_bias", (nv,)), a_log=get(p + "A_log", (nv,)),
            norm=get(p + "norm.weight", (dv,)), out=get(p + "out_proj.weight", (h, nv * dv), True))

    qw = nq * d * (2 if cfg.next else 1)  # Qwen3-Next's q_proj holds each head's q and output gate

    def layer_weights(p: str, linear: bool, sparse: bool, experts_name: str) -> LayerWeights:
        attn = deltanet_weights(p + "linear_attn.") if linear else AttentionWeights(
            wq=get(p + "self_attn.q_proj.weight", (qw, h), True),
            wk=get(p + "self_attn.k_proj.weight", (nkv * d, h), True),
            wv=get(p + "self_attn.v_proj.weight", (nkv * d, h), True),
            wo=get(p + "self_attn.o_proj.weight", (h, nq * d), True),
            q_norm=get(p + "self_attn.q_norm.weight", (d,)),
            k_norm=get(p + "self_attn.k_norm.weight", (d,)),
            bq=maybe_bias(p + "self_attn.q_proj.bias", nq * d),
            bk=maybe_bias(p + "self_attn.k_proj.bias", nkv * d),
            bv=maybe_bias(p + "self_attn.v_proj.bias", nkv * d),
            bo=maybe_bias(p + "self_attn.o_proj.bias", h),
        )
        if sparse:
            e, f = cfg.num_experts, cfg.moe_intermediate_size
            gate = np.empty((e, f, h), jnp.dtype(dtype))  # [E, I, H], the checkpoint's layout
            up = np.empty((e, f, h), jnp.dtype(dtype))
            down = np.empty((e, h, f), jnp.dtype(dtype))  # [E, H, I]
            fused = p + "mlp.experts.gate_up_proj"
            if fused in reader:  # transformers 5.x's own layout (Qwen3.5-MoE's Hub files): [E, 2I, H] = gate | up
                gate_up = reader.get(fused, (e, 2 * f, h))
                gate[:], up[:] = to_dtype(gate_up[:, :f], dtype), to_dtype(gate_up[:, f:], dtype)
                del gate_up
                down[:] = to_dtype(reader.get(p + "mlp.experts.down_proj", (e, h, f)), dtype)
            else:
                for j in range(e):
                    q = p + f"mlp.experts.{j}."
                    gate[j] = to_dtype(reader.get(q + "gate_proj.weight", (f, h)), dtype)
                    up[j] = to_dtype(reader.get(q + "up_proj.weight", (f, h)), dtype)
                    down[j] = to_dtype(reader.get(q + "down_proj.weight", (h, f)), dtype)
            put = place if experts_name.startswith("mtp") else place_experts  # the MTP layer stays on the device
            router = get(p + "mlp.gate.weight", (e, h), True)
            if expert_format and not experts_name.startswith("mtp"):
                parts = {}
                for which, w in (("gate", gate), ("up", up), ("down", down)):
                    qa = quant.quantize(w, expert_format)  # q [E, O, I] int8 (int4: [E, O, I/2] uint8)
                    parts[which] = put(f"{experts_name}.{which}", qa.q)
                    parts[which + "_scale"] = place_scales(f"{experts_name}.{which}_scale", quant.engine_scale(qa))
                ffn = MoEWeights(router=router, **parts)
            else:
                ffn = MoEWeights(router=router, gate=put(f"{experts_name}.gate", gate),
                                 up=put(f"{experts_name}.up", up), down=put(f"{experts_name}.down", down))
            del gate, up, down
        else:
            f = cfg.intermediate_size
            ffn = MLPWeights(gate=get(p + "mlp.gate_proj.weight", (f, h), True),
                             up=get(p + "mlp.up_proj.weight", (f, h), True),
                             down=get(p + "mlp.down_proj.weight", (h, f), True))
        layer = LayerWeights(attn_norm=get(p + "input_layernorm.weight", (h,)), attn=attn,
                             ffn_norm=get(p + "post_attention_layernorm.weight", (h,)), ffn=ffn)
        if sparse and cfg.shared_expert_intermediate_size:
            f, q = cfg.shared_expert_intermediate_size, p + "mlp.shared_expert."
            layer = layer.replace(
                shared=MLPWeights(gate=get(q + "gate_proj.weight", (f, h), True), up=get(q + "up_proj.weight", (f, h), True),
                                  down=get(q + "down_proj.weight", (h, f), True)),
                shared_gate=get(p + "mlp.shared_expert_gate.weight", (1, h), True))
        return layer

    if mtp_only:
        # Qwen3-Next's MTP module: one full-attention MoE layer over fc([norm(embed(x_{i+1})), norm(hidden_i)])
        return MTPWeights(fc=get("mtp.fc.weight", (h, 2 * h), True),
                          norm_embedding=get("mtp.pre_fc_norm_embedding.weight", (h,)),
                          norm_hidden=get("mtp.pre_fc_norm_hidden.weight", (h,)),
                          layer=layer_weights("mtp.layers.0.", False, True, "mtp.experts"),
                          norm=get("mtp.norm.weight", (h,)))
    layers = []
    for i in range(cfg.num_layers):
        layers.append(layer_weights(f"{base}layers.{i}.", cfg.is_linear(i), cfg.sparse_layers[i], f"layers.{i}.experts"))
        if progress:
            progress(f"loading: layer {i + 1}/{cfg.num_layers}")
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = get("lm_head.weight", (v, h), True)
    return Weights(embed=get(base + "embed_tokens.weight", (v, h)), layers=layers,
                   final_norm=get(base + "norm.weight", (h,)), lm_head=lm_head)


# ---- the engine's own converted state (orbax) -------------------------------------------------------------------

STATE_META = "strata_state.json"


def save_state(path: str | Path, weights: Weights, cfg_raw: dict, dtype: str, expert_dtype: str = "auto") -> None:
    """Save converted weights with orbax, beside the model's config.json, so a restore skips the conversion
    (quantized experts are saved quantized, with their scales: a restore needs the same expert_dtype)."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    make_writable_folder(path, f"cannot save the state to {path}")
    with _quiet_orbax(), ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "weights", weights, force=True)
    (path / "config.json").write_text(json.dumps(cfg_raw, indent=1))
    (path / STATE_META).write_text(json.dumps({"dtype": dtype, "format": 1, "expert_dtype": expert_dtype}))


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax and its asyncio workers log every failure with whole tracebacks (thousands of lines for a corrupt
    state); the engine reports one line itself, so their loggers stay at ERROR-free silence meanwhile."""
    import logging as py_logging
    names = ("orbax", "absl", "asyncio", "tensorstore")
    loggers = [py_logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(py_logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def is_state_dir(path: str | Path) -> bool:
    return (Path(path) / STATE_META).is_file()


def read_state_meta(path: str | Path) -> dict:
    """The saved state's strata_state.json, checked: one line when it is malformed or incomplete."""
    meta_path = Path(path) / STATE_META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise StrataError(f"{meta_path}: malformed saved-state file: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) or "format" not in meta:
        raise StrataError(f"{meta_path}: incomplete saved-state file (dtype and format expected); save it again "
                          "with --save_state")
    return meta


def restore_state(path: str | Path, abstract: Weights) -> Weights:
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    try:
        with _quiet_orbax(), ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(path / "weights", abstract)
    except Exception as e:
        raise StrataError(f"cannot restore the saved state at {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
