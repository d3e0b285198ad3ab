"""Model configuration: the Qwen3-MoE and Qwen3-Next families, read from a Hugging Face `config.json`.

Every option the engine does not implement is refused with one line naming it, so a checkpoint is never
decoded with silently wrong semantics.

Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration` / `Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe`) is read
as its text model: the `text_config` (model_type `qwen3_5_moe_text`, transformers 5.x's Qwen3_5MoeTextConfig),
whose arithmetic is Qwen3-Next's (arch "qwen3_next"); `variant` "qwen3_5_moe" tells the loader its tensor names.
The vision tower is not loaded (one line says so).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from strata_jax.errors import StrataError

QWEN35_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") + QWEN35_ARCHITECTURES
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # the dense layers' SwiGLU width
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense SwiGLU (False)
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3-Next (arch "qwen3_next"); the defaults describe Qwen3-MoE. Next adds zero-centred RMSNorms (scale
    # 1 + weight), an output gate on full attention (q_proj twice as wide), partial RoPE, a shared expert beside
    # the routed ones, and Gated DeltaNet layers ("linear_attention") between the full-attention ones.
    arch: str = "qwen3_moe"
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "linear_attention"; () = every layer full
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint declares (mtp_num_hidden_layers)
    # "qwen3_5_moe": Qwen3.5-MoE's text model (arch "qwen3_next": the same arithmetic); its checkpoint names the
    # tensors differently (`model.language_model.` prefix, split DeltaNet projections, fused experts): checkpoint.py
    variant: str = ""

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def next(self) -> bool:
        return self.arch == "qwen3_next"

    @property
    def qwen35(self) -> bool:
        return self.variant == "qwen3_5_moe"

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def has_linear(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def num_full_layers(self) -> int:
        return sum(not self.is_linear(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a DeltaNet layer's causal conv: q and k (key heads) and v (value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def state_bytes(self, itemsize: int) -> int:
        """Bytes of one position's recurrent state over every DeltaNet layer (conv inputs + float32 delta state)."""
        per_layer = (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim * itemsize + \
            4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return per_layer * (self.num_layers - self.num_full_layers)

    def expert_bytes(self, itemsize: float) -> int:
        """Bytes of one expert's three matrices (itemsize 0.5: int4, two weights a byte)."""
        return int(3 * self.hidden_size * self.moe_intermediate_size * itemsize)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _rope_theta(raw: dict) -> float:
    # transformers 4.x keeps `rope_theta` and `rope_scaling`; 5.x folds both into `rope_parameters`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    for spec in (params, scaling or {}):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise StrataError(f"unsupported config option: rope scaling type {kind!r} (only the default RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta)


def _partial_rotary(raw: dict, default: float = 1.0) -> float:
    params = raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    return float(factor)


def _next_fields(raw: dict, num_layers: int, where: str) -> dict:
    """The Qwen3-Next part of the config (transformers 5.x's Qwen3NextConfig)."""
    types = raw.get("layer_types")
    if types is None:
        interval = _as_int(raw.get("full_attention_interval", 4), "full_attention_interval")
        if interval <= 0:
            raise StrataError(f"{where}: full_attention_interval must be positive (got {interval})")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise StrataError(f"{where}: layer_types must list one type per layer ({num_layers})")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise StrataError(f"{where}: unsupported config option: layer_types {unknown} (supported: {list(LAYER_TYPES)})")
    if raw.get("attention_bias", False):
        raise StrataError(f"{where}: unsupported config option: attention_bias=true for {raw.get('model_type')}")
    qwen35 = raw.get("model_type") == "qwen3_5_moe"
    fields = dict(
        arch="qwen3_next", variant="qwen3_5_moe" if qwen35 else "", layer_types=tuple(types),
        # Qwen3NextConfig's and Qwen3_5MoeTextConfig's default is 0.25 (a config.json without it decodes as
        # transformers builds it)
        partial_rotary_factor=_partial_rotary(raw, 0.25),
        shared_expert_intermediate_size=_as_int(raw.get("shared_expert_intermediate_size", 0) or 0,
                                                "shared_expert_intermediate_size"),
        mtp_layers=_as_int(raw.get("mtp_num_hidden_layers", 0) or 0, "mtp_num_hidden_layers"))
    if "linear_attention" in types:
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            if name not in raw:
                raise KeyError(name)
            fields[name] = _as_int(raw[name], name)
            if fields[name] <= 0:
                raise StrataError(f"{where}: {name} must be positive (got {fields[name]})")
        if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
            raise StrataError(f"{where}: linear_num_value_heads {fields['linear_num_value_heads']} is not a multiple "
                              f"of linear_num_key_heads {fields['linear_num_key_heads']}")
        if fields["linear_conv_kernel_dim"] < 2:
            raise StrataError(f"{where}: linear_conv_kernel_dim must be at least 2")
    return fields


def _as_int(value, name: str) -> int:
    """A config integer as JSON writes it; a string, float or bool is refused rather than converted silently."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


# Top-level keys of a Qwen3.5-MoE config.json that belong to the vision tower (not loaded).
QWEN35_VISION_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                      "vision_end_token_id")
# Qwen3-MoE / Next keys that Qwen3_5MoeTextConfig deletes: its model makes every layer MoE and always renormalises
# the top-K weights, whatever they say. A config that says otherwise is refused rather than decoded either way.
QWEN35_FIXED = {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}
_told_vision: set[str] = set()


def _qwen35_text(raw: dict, archs: list, where: str) -> dict:
    """The text model's fields of a Qwen3.5-MoE config.json (`text_config`, or the file itself for a text-only
    save), flat in the keys the Qwen3-Next reader takes."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise StrataError(f"{where}: malformed config.json: text_config must be a JSON object")
    kind = text.get("model_type", "qwen3_5_moe_text")
    if kind != "qwen3_5_moe_text":
        raise StrataError(f"{where}: unsupported text_config model_type {kind!r} (supported: 'qwen3_5_moe_text')")
    unsupported = [f"{k}={text[k]!r}" for k, v in QWEN35_FIXED.items() if k in text and text[k] not in (None, v)]
    if text.get("attn_output_gate", True) is not True:  # transformers' Qwen3_5MoeAttention always gates
        unsupported.append(f"attn_output_gate={text['attn_output_gate']!r}")
    if text.get("mtp_use_dedicated_embeddings", False):  # the MTP module here reads the model's embeddings
        unsupported.append(f"mtp_use_dedicated_embeddings={text['mtp_use_dedicated_embeddings']!r}")
    if unsupported:
        raise StrataError(f"{where}: unsupported config option(s) for qwen3_5_moe: {', '.join(unsupported)}")
    flat = dict(text, architectures=archs, model_type="qwen3_5_moe", **QWEN35_FIXED)
    if text is not raw:
        # The multimodal class ties lm_head by its own (top-level) flag; eos may sit at either level.
        flat["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
        if flat.get("eos_token_id") is None:
            flat["eos_token_id"] = raw.get("eos_token_id")
        vision = [k for k in QWEN35_VISION_KEYS if k in raw]
        if vision and where not in _told_vision:
            _told_vision.add(where)
            print(f"{where}: {vision[0]} ignored: the text model only is loaded (no images or video)",
                  file=sys.stderr)
    # mrope_section / mrope_interleaved in rope_parameters: a text position is the same on its three axes, so
    # transformers' interleaved MRoPE is plain RoPE on the rotary dims; nothing else to read.
    return flat


def check_eos_ids(eos_ids, vocab_size: int, where: str) -> None:
    """eos ids (config.json's, generation_config.json's) must be token ids of the vocabulary."""
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise StrataError(f"{where}: eos_token_id {bad[0]} is not a token id (vocab_size {vocab_size})")


def config_from_dict(raw: dict, where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise StrataError(f"{where}: malformed config.json: a JSON object is expected, not a {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if not archs or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
        raise StrataError(f"{where}: unsupported architectures {archs} (supported: {list(SUPPORTED_ARCHITECTURES)})")
    # A pre-quantized checkpoint (FP8 blocks, GPTQ / AWQ packed ints, ...) holds other tensors than the float ones
    # read here: refuse it by name before a tensor is read. (Quantizing a float checkpoint at load is issue 16.)
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise StrataError(f"{where}: unsupported config option: quantization_config (quant_method={method!r}): "
                          f"quantized checkpoints are not supported; use the bfloat16 / float16 / float32 release")
    if any(a in QWEN35_ARCHITECTURES for a in archs) or raw.get("model_type") in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raw = _qwen35_text(raw, archs, where)
    if raw.get("hidden_act", "silu") != "silu":
        raise StrataError(f"{where}: unsupported config option: hidden_act={raw['hidden_act']!r} (only 'silu')")
    if raw.get("use_sliding_window", False):
        raise StrataError(f"{where}: unsupported config option: use_sliding_window=true")
    try:
        num_layers = _as_int(raw["num_hidden_layers"], "num_hidden_layers")
        num_heads = _as_int(raw["num_attention_heads"], "num_attention_heads")
        if num_heads <= 0:
            raise StrataError(f"{where}: num_attention_heads must be positive (got {num_heads})")
        hidden = _as_int(raw["hidden_size"], "hidden_size")
        # transformers 5.x writes `num_local_experts`; Hub checkpoints have `num_experts`.
        num_experts = _as_int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0, "num_experts")
        sparse_step = _as_int(raw.get("decoder_sparse_step", 1), "decoder_sparse_step")
        mlp_only = set(_as_int(i, "mlp_only_layers") for i in (raw.get("mlp_only_layers") or []))
        # As transformers' Qwen3MoeDecoderLayer decides which layers are sparse.
        sparse = tuple(
            (i not in mlp_only) and num_experts > 0 and sparse_step > 0 and (i + 1) % sparse_step == 0
            for i in range(num_layers)
        )
        next_fields = (_next_fields(raw, num_layers, where)
                       if "Qwen3NextForCausalLM" in archs or raw.get("model_type") in ("qwen3_next", "qwen3_5_moe")
                       else {})
        eos = raw.get("eos_token_id")
        eos_ids = tuple(_as_int(e, "eos_token_id") for e in (eos if isinstance(eos, list) else
                                                            ([] if eos is None else [eos])))
        cfg = ModelConfig(
            vocab_size=_as_int(raw["vocab_size"], "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=(num_heads if raw.get("num_key_value_heads") is None
                          else _as_int(raw["num_key_value_heads"], "num_key_value_heads")),
            head_dim=_as_int(raw.get("head_dim") or hidden // num_heads, "head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=_as_int(raw.get("max_position_embeddings", 32768), "max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=num_experts,
            num_experts_per_tok=_as_int(raw.get("num_experts_per_tok", 0), "num_experts_per_tok"),
            moe_intermediate_size=_as_int(raw.get("moe_intermediate_size", 0), "moe_intermediate_size"),
            intermediate_size=_as_int(raw.get("intermediate_size", 0), "intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=sparse,
            eos_token_ids=eos_ids,
            **next_fields,
        )
    except KeyError as e:
        raise StrataError(f"{where}: missing config field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise StrataError(f"{where}: malformed config value: {e}") from None
    for name, value in (("num_hidden_layers", cfg.num_layers), ("num_attention_heads", cfg.num_heads),
                        ("num_key_value_heads", cfg.num_kv_heads), ("hidden_size", cfg.hidden_size),
                        ("head_dim", cfg.head_dim), ("vocab_size", cfg.vocab_size)):
        if value <= 0:
            raise StrataError(f"{where}: {name} must be positive (got {value})")
    import math
    for name, value in (("rope_theta", cfg.rope_theta), ("rms_norm_eps", cfg.rms_norm_eps)):
        if not (math.isfinite(value) and value > 0):
            raise StrataError(f"{where}: {name} must be a finite positive number (got {value})")
    check_eos_ids(cfg.eos_token_ids, cfg.vocab_size, where)
    if len(set(archs)) > 1:
        raise StrataError(f"{where}: architectures {archs} name more than one model class")
    if cfg.next and cfg.rotary_dim % 2:
        raise StrataError(f"{where}: partial_rotary_factor {cfg.partial_rotary_factor} gives an odd rotary dimension")
    if cfg.num_heads % cfg.num_kv_heads:
        raise StrataError(f"{where}: num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    if any(cfg.sparse_layers) and not (0 < cfg.num_experts_per_tok <= cfg.num_experts):
        raise StrataError(f"{where}: num_experts_per_tok {cfg.num_experts_per_tok} must be in 1..num_experts ({cfg.num_experts})")
    if any(cfg.sparse_layers) and cfg.moe_intermediate_size <= 0:
        raise StrataError(f"{where}: moe_intermediate_size must be positive")
    if not all(cfg.sparse_layers) and cfg.intermediate_size <= 0:
        raise StrataError(f"{where}: intermediate_size must be positive for the dense layers")
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise StrataError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StrataError(f"{path}: malformed config.json: {e}") from None
    return config_from_dict(raw, where=str(path))


# The presets: configs/ beside the package in the repository; installed (pip install .), the same files as
# strata_jax/configs (pyproject.toml maps the folder into the package).
_PACKAGE = Path(__file__).resolve().parent.parent  # strata_jax/
CONFIGS_DIR = next((d for d in (_PACKAGE.parent / "configs", _PACKAGE / "configs") if (d / "tiny.json").is_file()),
                   _PACKAGE.parent / "configs")


def preset(name: str, layers: int | None = None) -> ModelConfig:
    """A named model shape from configs/ (e.g. 'tiny', 'qwen3-30b-a3b'), optionally cut to `layers`."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise StrataError(f"unknown model preset {name!r} (known: {known})")
    cfg = load_config(path)
    if layers:
        cfg = cfg.replace(num_layers=layers, sparse_layers=cfg.sparse_layers[:layers],
                          layer_types=cfg.layer_types[:layers])
    return cfg
