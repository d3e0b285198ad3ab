"""The embedded default model: configs/tiny.json with weights drawn from a seed by this code, and the byte-level
tokenizer, written once as a real checkpoint folder (config.json, model.safetensors, tokenizer.json) and then
loaded like any other, so `make run` works offline on a fresh machine."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from strata_jax.io.chat import CODE_CHAT_TEMPLATE
from strata_jax.model.config import CONFIGS_DIR, config_from_dict
from strata_jax.errors import StrataError, make_writable_folder
from strata_jax.io.tokenizer import EOS_TOKEN, byte_level_tokenizer

EMBEDDED_NAME = "embedded"
FORMAT_VERSION = 2  # 2: tokenizer_config.json (chat template) and generation_config.json
# The reference model: a small MoE (64 experts, top-8) trained on the Python standard library's sources by
# training/train_reference.py, committed; the default model of the CLI (`make run`).
REFERENCE_NAME = "reference"
REFERENCE_DIR = Path(__file__).resolve().parent.parent / "assets" / "moe-stdlib"
# Its Qwen3-Next-shaped sibling (DeltaNet + gated attention, a shared expert, 64 experts top-8, an MTP module trained
# on the token after next: draft=mtp), trained on the same bytes by the same program with --arch=qwen3_next.
REFERENCE_NEXT_NAME = "reference-next"
REFERENCE_NEXT_DIR = Path(__file__).resolve().parent.parent / "assets" / "next-stdlib"
NAMED_MODELS = {REFERENCE_NAME: REFERENCE_DIR, REFERENCE_NEXT_NAME: REFERENCE_NEXT_DIR}


def resolve_model(model: str | Path | None, cache_dir: Path) -> Path:
    """A model argument -> its folder: None / 'embedded' (the tiny random model, written on first use),
    'reference' / 'reference-next' (the committed trained models), or a path."""
    if model is not None and not str(model).strip():  # Path("") is the working folder: never read it by accident
        raise StrataError("model is empty: give a model folder, a saved state, 'reference', 'reference-next' or "
                          "'embedded'")
    if model is None or str(model) == EMBEDDED_NAME:
        return embedded_model_dir(cache_dir)
    if str(model) in NAMED_MODELS:
        return NAMED_MODELS[str(model)]
    if str(model).lower().endswith(".gguf"):  # its metadata as a folder under the cache, its tensors read from it
        from strata_jax.io.gguf_file import gguf_model_folder
        return gguf_model_folder(Path(model), cache_dir)
    return Path(model)


def random_checkpoint(raw_config: dict, seed: int) -> dict[str, np.ndarray]:
    """Hub-layout float32 tensors for a config (weights.weight_specs), drawn from `seed` in the Hub files' order
    (numpy: the same on every machine)."""
    from strata_jax.model.weights import hub_walk, weight_specs
    cfg = config_from_dict(raw_config)
    rng = np.random.default_rng(seed)

    def draw(leaf, shape):
        if leaf.init in ("ones", "zeros"):
            return np.full(shape, 1.0 if leaf.init == "ones" else 0.0, np.float32)
        if leaf.init == "norm":
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if leaf.init == "embed":
            return rng.standard_normal(shape).astype(np.float32)
        # scaled by the fan-in so activations stay O(1); the router 4x: far from uniform
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        x = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        return 4.0 * x if leaf.init == "router" else x

    return {name: draw(leaf, leaf.hf_shape) for name, leaf, _, _ in hub_walk(weight_specs(cfg))}


def write_checkpoint(folder: Path, raw_config: dict, seed: int, with_tokenizer: bool = True) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json) atomically (a temp folder, then a rename)."""
    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # two processes may write it at once
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(raw_config, indent=1))
    save_file(random_checkpoint(raw_config, seed), str(tmp / "model.safetensors"))
    if with_tokenizer:
        byte_level_tokenizer().save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
             "pad_token": EOS_TOKEN, "chat_template": CODE_CHAT_TEMPLATE}, indent=1))
        eos = raw_config.get("eos_token_id")
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").is_file():
            raise
    return folder


def embedded_model_dir(cache_dir: Path, seed: int = 0) -> Path:
    """The embedded model's folder under the cache, written on first use."""
    raw = json.loads((CONFIGS_DIR / "tiny.json").read_text())
    folder = Path(cache_dir) / f"{EMBEDDED_NAME}-tiny-seed{seed}-v{FORMAT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        make_writable_folder(cache_dir, f"cache_dir {cache_dir}: not a writable folder for the embedded model")
        write_checkpoint(folder, raw, seed)
    return folder
