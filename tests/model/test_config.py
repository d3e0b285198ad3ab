"""config.json -> ModelConfig: both transformers spellings, the sparse-layer rule, and one-line refusals."""
from __future__ import annotations

import json

import pytest

from conftest import HF_FIXTURES, REPO, hf_fixture_names
from helpers import one_line_refusal
from strata_jax import StrataError
from strata_jax.model import config
from strata_jax.model.config import config_from_dict, load_config


def fixture_raw(name="base") -> dict:
    return json.loads((HF_FIXTURES / name / "config.json").read_text())


def hub_style(raw: dict) -> dict:
    """The transformers 4.x / Hub spelling of a 5.x config: num_experts and a top-level rope_theta."""
    raw = dict(raw)
    if "num_local_experts" in raw:  # Qwen3-MoE; Qwen3-Next's 5.x config says num_experts already
        raw["num_experts"] = raw.pop("num_local_experts")
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:  # Qwen3-Next: top level on the Hub
        raw["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return raw


def refusal(raw: dict) -> str:
    return one_line_refusal(config_from_dict, raw, where="cfg.json")


@pytest.mark.parametrize("name", hf_fixture_names())
def test_fixture_config_matches_transformers(name):
    """The fields the fixture's transformers model was built from (reference.json lists its sparse/dense layers)."""
    raw = fixture_raw(name)
    meta = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    cfg = config_from_dict(raw)
    text = raw.get("text_config", raw)  # Qwen3.5-MoE: the text model's fields are nested
    assert [i for i, s in enumerate(cfg.sparse_layers) if s] == meta["sparse_layers"]
    assert [i for i, s in enumerate(cfg.sparse_layers) if not s] == meta["dense_layers"]
    assert cfg.num_experts == text["num_local_experts" if "num_local_experts" in text else "num_experts"]
    assert cfg.rope_theta == text["rope_parameters"]["rope_theta"]
    assert cfg.tie_word_embeddings == raw["tie_word_embeddings"]
    assert cfg.head_dim == text["head_dim"]
    assert (cfg.num_heads, cfg.num_kv_heads) == (text["num_attention_heads"], text["num_key_value_heads"])
    assert cfg.norm_topk_prob == text.get("norm_topk_prob", True)  # Qwen3.5-MoE always renormalises
    assert cfg.attention_bias == text["attention_bias"]
    # The same model written by transformers 4.x (num_experts, rope_theta) maps to the same config.
    assert config_from_dict(dict(raw, text_config=hub_style(text)) if text is not raw else hub_style(raw)) == cfg


def test_rope_theta_spellings():
    raw = fixture_raw()
    assert config_from_dict(dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 123456.0})).rope_theta == 123456.0
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    assert config_from_dict(dict(legacy, rope_theta=54321.0)).rope_theta == 54321.0
    assert config_from_dict(dict(legacy, rope_theta=54321.0, rope_scaling=None)).rope_theta == 54321.0


# (num_hidden_layers, decoder_sparse_step, mlp_only_layers); transformers' Qwen3MoeDecoderLayer makes layer i sparse
# iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
@pytest.mark.parametrize("layers,step,mlp_only,expected", [
    (4, 1, [], [0, 1, 2, 3]),
    (4, 2, [], [1, 3]),
    (6, 3, [], [2, 5]),
    (6, 3, [5], [2]),
    (5, 1, [0, 4], [1, 2, 3]),
    (3, 4, [], []),
])
def test_sparse_layers(layers, step, mlp_only, expected):
    raw = dict(fixture_raw(), num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    cfg = config_from_dict(raw)
    assert len(cfg.sparse_layers) == layers
    assert [i for i, s in enumerate(cfg.sparse_layers) if s] == expected
    assert cfg.num_sparse_layers == len(expected)


def test_sparse_layers_defaults_and_no_experts():
    raw = {k: v for k, v in fixture_raw().items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
    assert all(config_from_dict(raw).sparse_layers)  # defaults: step 1, no mlp-only layers
    assert not any(config_from_dict(dict(raw, num_local_experts=0)).sparse_layers)  # no experts: all dense


def test_tied():
    raw = fixture_raw()
    assert config_from_dict(dict(raw, tie_word_embeddings=True)).tie_word_embeddings is True
    assert config_from_dict(dict(raw, tie_word_embeddings=False)).tie_word_embeddings is False
    # transformers' Qwen3MoeConfig default is untied
    assert config_from_dict({k: v for k, v in raw.items() if k != "tie_word_embeddings"}).tie_word_embeddings is False


@pytest.mark.parametrize("archs", [["LlamaForCausalLM"], ["Qwen3MoeForCausalLM", "MixtralForCausalLM"], []])
def test_refuses_architecture(archs):
    msg = refusal(dict(fixture_raw(), architectures=archs))
    assert "architectures" in msg and all(a in msg for a in archs)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_refuses_yarn(field):
    spec = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    if field == "rope_parameters":
        spec["rope_theta"] = 10000.0
    msg = refusal(dict(fixture_raw(), **{field: spec}))
    assert "yarn" in msg and "rope" in msg


def test_refuses_legacy_scaling_type_key():
    msg = refusal(dict(fixture_raw(), rope_scaling={"type": "linear", "factor": 2.0}))
    assert "linear" in msg and "rope" in msg


def test_refuses_sliding_window():
    msg = refusal(dict(fixture_raw(), use_sliding_window=True, sliding_window=128))
    assert "use_sliding_window" in msg


@pytest.mark.parametrize("quant", [
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},  # Qwen3-30B-A3B-FP8's
    {"quant_method": "gptq", "bits": 4, "group_size": 128},
])
def test_refuses_a_quantized_checkpoint(quant):
    """A pre-quantized release is refused by its config, naming the method, before any tensor is read."""
    msg = refusal(dict(fixture_raw(), quantization_config=quant))
    assert "quantization_config" in msg and quant["quant_method"] in msg


def test_refuses_gelu():
    msg = refusal(dict(fixture_raw(), hidden_act="gelu"))
    assert "hidden_act" in msg and "gelu" in msg


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_refuses_missing_field(field):
    msg = refusal({k: v for k, v in fixture_raw().items() if k != field})
    assert field in msg and "cfg.json" in msg


def test_refuses_malformed_value():
    msg = refusal(dict(fixture_raw(), hidden_size="sixty-four"))
    assert "cfg.json" in msg


def test_refuses_heads_not_multiple_of_kv_heads():
    msg = refusal(dict(fixture_raw(), num_attention_heads=6, num_key_value_heads=4))
    assert "num_attention_heads" in msg and "num_key_value_heads" in msg and "6" in msg and "4" in msg


def test_refuses_top_k_above_experts():
    msg = refusal(dict(fixture_raw(), num_experts_per_tok=17))
    assert "num_experts_per_tok" in msg


@pytest.mark.parametrize("field,value", [("rope_theta", float("inf")), ("rope_theta", 0), ("rms_norm_eps", -1.0),
                                         ("eos_token_id", 10**12), ("eos_token_id", [1, -1])])
def test_refuses_values_that_would_decode_wrong(field, value):
    msg = refusal(dict(hub_style(fixture_raw()), **{field: value}))  # rope_theta at the top level (4.x spelling)
    assert field in msg


def test_load_config_errors(tmp_path):
    with pytest.raises(StrataError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(StrataError, match="malformed"):
        load_config(tmp_path)


def test_preset_qwen3_30b_a3b():
    raw = json.loads((REPO / "configs" / "qwen3-30b-a3b.json").read_text())
    cfg = config.preset("qwen3-30b-a3b", layers=4)
    assert cfg.num_layers == 4 and cfg.sparse_layers == (True,) * 4
    full = config_from_dict(raw)
    assert full.num_layers == raw["num_hidden_layers"] and len(full.sparse_layers) == raw["num_hidden_layers"]
    assert cfg == full.replace(num_layers=4, sparse_layers=full.sparse_layers[:4])
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (raw["num_experts"], raw["num_experts_per_tok"])
    assert cfg.expert_bytes(2) == 3 * raw["hidden_size"] * raw["moe_intermediate_size"] * 2
    assert cfg.eos_token_ids == (raw["eos_token_id"],)
    assert config.preset("qwen3-30b-a3b") == full


def test_preset_unknown():
    with pytest.raises(StrataError, match="qwen3-30b-a3b"):  # the message lists the known presets
        config.preset("no-such-model")
