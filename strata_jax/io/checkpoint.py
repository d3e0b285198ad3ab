"""Hugging Face safetensors checkpoints (single file or sharded), read lazily, and the engine's own saved state.

Tensors are read one at a time from memory-mapped files, converted to the compute dtype and placed at once, so the
host never holds a second full copy of the model. Every failure names the file or tensor.
"""
from __future__ import annotations

import contextlib
import os

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from strata_jax.model.config import ModelConfig
from strata_jax.errors import StrataError, make_writable_folder, os_error_behind
from strata_jax.model.weights import Leaf, LayerWeights, Weights, build_layer, weight_specs
from strata_jax.model import quant
from strata_jax.speculative.mtp import MTPWeights, weight_specs as mtp_specs

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
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
                raise StrataError(f"{index}: malformed index (weight_map must map each tensor name to a file name)")
            self.file_of = {name: self.folder / f for name, f in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise StrataError(f"no *.safetensors files in {self.folder}")
            self.file_of = {}
            for f in files:
                for name in self._open(f).keys():
                    if name in self.file_of:  # which copy is real cannot be told: never let the last file win
                        raise StrataError(f"checkpoint tensor {name!r} is in two files, {self.file_of[name].name} "
                                          f"and {f.name} (in {self.folder}, no {INDEX_FILE}): remove the stray one")
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
    """Whether the checkpoint (or a GGUF's folder) holds Qwen3-Next's (or Qwen3.5's) multi-token-prediction module
    (`mtp.*`)."""
    return cfg.next and cfg.mtp_layers > 0 and "mtp.fc.weight" in open_reader(folder)


def load_mtp(folder: str | Path, cfg: ModelConfig, dtype=jnp.float32, place: Placer = default_place) -> MTPWeights:
    """The `mtp.*` tensors as MTPWeights, on the device (see strata_jax/speculative/mtp.py)."""
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


def open_reader(folder: str | Path):
    """A model folder's tensors by Hub name: its safetensors files, or the GGUF file(s) a GGUF's folder stands for
    (strata_jax/io/gguf_file.py)."""
    from strata_jax.io.gguf_file import reader_for
    return reader_for(folder, check_weight) or SafetensorsReader(folder)


def check_layer_count(folder: str | Path, cfg: ModelConfig) -> None:
    """config.json's num_hidden_layers against the layers the checkpoint's tensors hold (`...layers.{i}.` names),
    before anything is sized from the config: a wrong count would size weights, slots and caches for layers that
    are not there (a count of 10^6 ran for minutes) or silently leave layers out."""
    import re
    found = set()
    for name in open_reader(folder).file_of:
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m and not name.startswith("mtp."):
            found.add(int(m.group(1)))
    if found and found != set(range(cfg.num_layers)):
        raise StrataError(f"{Path(folder) / 'config.json'}: num_hidden_layers is {cfg.num_layers}, but the checkpoint "
                          f"holds {len(found)} layers (indices {min(found)}..{max(found)})")


def load_weights(folder: str | Path, cfg: ModelConfig, dtype=jnp.float32, place: Placer = default_place,
                 place_experts: Placer | None = None, progress: Callable[[str], None] | None = None,
                 mtp_only: bool = False, expert_format: str | None = None,
                 place_scales: Placer | None = None) -> Weights:
    """Read a Qwen3-MoE, Qwen3-Next or Qwen3.5-MoE checkpoint in the Hub layout into `Weights` (dense matrices
    transposed to [in, out]): a walk over the declaration weights.weight_specs (names, shapes, layouts). The `mtp.*` tensors (Next's and Qwen3.5's multi-token-prediction head) are read by
    `load_mtp` (mtp_only). Qwen3.5-MoE's own names are mapped here (`text_prefix`, `grouped_deltanet_rows`; experts
    per expert or fused as `experts.gate_up_proj` / `experts.down_proj`, either is read for any model).

    `place_experts` receives each sparse layer's stacked expert arrays (names `layers.{i}.experts.{gate,up,down}`);
    by default they go where `place` puts everything else. expert_format "int8" or "int4" (strata_jax/model/quant.py): the
    routed experts (not the MTP layer's) are quantized as they are read; `place_experts` then receives q (int8, or
    int4 packed in uint8) and `place_scales` (default `place`) the bf16 scales, [E, O] per row (int8) or group-major
    [E, I/g, O] (int4) (names `layers.{i}.experts.{gate,up,down}_scale`). "int4-q4k": a GGUF's Q4_K expert stacks
    are kept as read (their nibbles moved, uint16 codes [E, 5G/4, O]), other experts quantized at load; "int2-q2k"
    likewise Q2_K's (q [E, O, I/4], uint8 codes [E, 5G/4, O]); likewise the
    float32-scaled formats of quant.GGUF_KEPT (int8-g32: Q8_0, ...; scales [E, G, O] or [E, 2, G, O]). A pair
    "gate_up/down" (per-family formats, quant.family_formats): gate and up read in the first, down in the second.
    """
    reader = open_reader(folder)
    place_experts = place_experts or place
    place_scales = place_scales or place
    base = text_prefix(reader, cfg)

    def get(leaf: Leaf):
        return place(leaf.hf, leaf.from_hf(to_dtype(reader.get(leaf.hf, leaf.hf_shape), dtype)))

    def grouped(leaf: Leaf, rows: dict):
        """Qwen3.5's split DeltaNet projections, regrouped per key head (the same conv channels: q, k, v) into the
        declared in_proj_qkvz / in_proj_ba (rows: both, read once per layer)."""
        p, which = leaf.hf.split("in_proj_")
        if not rows:
            h, nv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
            rows["qkvz.weight"], rows["ba.weight"] = grouped_deltanet_rows(
                reader.get(p + "in_proj_qkv.weight", (c, h)), reader.get(p + "in_proj_z.weight", (nv * dv, h)),
                reader.get(p + "in_proj_b.weight", (nv, h)), reader.get(p + "in_proj_a.weight", (nv, h)), cfg)
        return place(leaf.hf, np.ascontiguousarray(to_dtype(rows.pop(which), dtype).T))

    def expert_stacks(spec: LayerWeights, p: str) -> dict[str, np.ndarray]:
        """A layer's routed experts, {gate, up, down} -> [E, O, I] in the checkpoint's layout: per expert, or
        fused as transformers 5.x writes them (Qwen3.5-MoE's Hub files: [E, 2I, H] = gate | up, and [E, H, I])."""
        leaves = [spec.ffn.gate, spec.ffn.up, spec.ffn.down]
        out = {leaf.expert: np.empty(leaf.shape, jnp.dtype(dtype)) for leaf in leaves}
        e, f, h = spec.ffn.gate.shape
        fused = p + "mlp.experts.gate_up_proj"
        if fused in reader:
            gate_up = reader.get(fused, (e, 2 * f, h))
            out["gate"][:], out["up"][:] = to_dtype(gate_up[:, :f], dtype), to_dtype(gate_up[:, f:], dtype)
            del gate_up
            out["down"][:] = to_dtype(reader.get(p + "mlp.experts.down_proj", (e, h, f)), dtype)
        else:
            for j in range(e):
                for leaf in leaves:
                    out[leaf.expert][j] = to_dtype(reader.get(leaf.hf.format(j=j), leaf.hf_shape), dtype)
        return out

    def layer_weights(spec: LayerWeights, p: str, experts_name: str) -> LayerWeights:
        mtp = experts_name.startswith("mtp")  # the MTP layer's experts stay on the device, unquantized
        put = place if mtp else place_experts
        stacks, rows = {}, {}

        def make(leaf: Leaf):
            if cfg.qwen35 and leaf.hf.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
                return grouped(leaf, rows)
            if not leaf.expert:
                return get(leaf)
            name = f"{experts_name}.{leaf.expert}"
            fmt = quant.matrix_format(expert_format, leaf.expert)  # this matrix's family's format
            if fmt in quant.KEPT_FORMATS + quant.BLOCK_FORMATS and not mtp and hasattr(reader, "kept_experts"):
                kept = reader.kept_experts(leaf.hf.format(j=0), fmt)  # a GGUF's stack, not dequantized
                if kept is not None:
                    q, scale = kept  # int4-q4k's / int2-q2k's codes [E, O, 5G/4]; float32 scales [E, O, (2,) G]
                    device = (np.ascontiguousarray(np.swapaxes(scale, -1, -2)) if scale.dtype != np.float32 else
                              quant.engine_scale_of(scale))
                    return put(name, q), place_scales(name + "_scale", device)
            if not stacks:
                stacks.update(expert_stacks(spec, p))
            w = stacks.pop(leaf.expert)
            if not expert_format or mtp:
                return put(name, w)
            qa = quant.quantize(w, fmt)  # q [E, O, I] int8 (int4: [E, O, I/2] uint8)
            del w
            return put(name, qa.q), place_scales(name + "_scale", quant.engine_scale(qa))
        return build_layer(spec, make)

    if mtp_only:
        # Qwen3-Next's MTP module: one full-attention MoE layer over fc([norm(embed(x_{i+1})), norm(hidden_i)])
        spec = mtp_specs(cfg)
        return spec.replace(fc=get(spec.fc), norm_embedding=get(spec.norm_embedding),
                            norm_hidden=get(spec.norm_hidden),
                            layer=layer_weights(spec.layer, "mtp.layers.0.", "mtp.experts"), norm=get(spec.norm))
    specs = weight_specs(cfg, base)
    layers = []
    for i, spec in enumerate(specs.layers):
        layers.append(layer_weights(spec, f"{base}layers.{i}.", f"layers.{i}.experts"))
        if progress:
            progress(f"loading: layer {i + 1}/{cfg.num_layers}")
    return specs.replace(embed=get(specs.embed), layers=layers, final_norm=get(specs.final_norm),
                         lm_head=None if specs.lm_head is None else get(specs.lm_head))


# ---- the engine's own converted state (orbax) -------------------------------------------------------------------

STATE_META = "strata_state.json"


# What a folder holds that marks it as a model or a saved state (save_state refuses to write over one).
MODEL_MARKERS = ("config.json", STATE_META, "model.safetensors", "model.safetensors.index.json", "tokenizer.json")


def check_state_target(path: str | Path, overwrite: bool = False) -> Path:
    """The folder save_state may write (absolute), checked before anything is loaded: a new path whose parent can
    be written, or an empty folder, or (overwrite) any folder. Else one StrataError line."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise StrataError(f"cannot save the state to {path}: it is a file, not a folder")
    try:
        held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    except OSError as e:
        raise StrataError(f"cannot save the state to {path}: {e.strerror or e}") from None
    if held and not overwrite:
        marks = [m for m in MODEL_MARKERS if m in held]
        what = (f"it holds a model or a saved state ({', '.join(marks)})" if marks else
                f"it is not empty ({len(held)} entries, e.g. {held[0]})")
        raise StrataError(f"cannot save the state to {path}: {what}; give a new folder, or overwrite=True "
                          "(--overwrite) to replace it")
    make_writable_folder(path.parent, f"cannot save the state to {path}")
    return path


def save_state(path: str | Path, weights: Weights, cfg_raw: dict, dtype: str, expert_dtype: str = "auto",
               write_files: Callable[[Path], None] | None = None, overwrite: bool = False) -> None:
    """Save converted weights with orbax, beside the model's config.json, so a restore skips the conversion
    (quantized experts are saved quantized, with their scales: a restore needs the same expert_dtype).
    `write_files(folder)` adds the model's other files (tokenizer, generation and chat settings).

    A folder that is not empty (a model, another state) is refused unless `overwrite`. The state is written to a
    hidden sibling folder and renamed into place when complete, so a failure (a full disk, Ctrl-C) never leaves a
    half-written state, nor touches what was there."""
    import shutil
    import orbax.checkpoint as ocp
    path = check_state_target(path, overwrite)
    tmp = path.parent / f".{path.name}.saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        with _quiet_orbax(), ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp / "weights", weights, force=True)
        (tmp / "config.json").write_text(json.dumps(cfg_raw, indent=1))
        if write_files is not None:
            write_files(tmp)
        (tmp / STATE_META).write_text(json.dumps({"dtype": dtype, "format": 1, "expert_dtype": expert_dtype}))
        if path.exists():  # overwrite: the old folder leaves only once the new one is complete
            old = path.parent / f".{path.name}.replaced-{os.getpid()}"
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except Exception as e:  # noqa: BLE001 (orbax wraps a full disk in several exception types)
        os_error = os_error_behind(e)
        reason = (os_error.strerror if os_error is not None and os_error.strerror else
                  (str(e).splitlines() or [type(e).__name__])[0])
        raise StrataError(f"cannot save the state to {path}: {reason} (nothing was written there)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
