"""`--model=file.gguf`: tiny Qwen3-MoE GGUFs written here with gguf's own writer and quantizers (as llama.cpp's
convert_hf_to_gguf lays them out: its metadata keys, TensorNameMap's names, experts stacked [E, O, I]) load into
the same weights and logits as the safetensors checkpoint they came from (or one holding their dequantized
values); Qwen3-Next GGUFs written as convert_hf_to_gguf's Qwen3NextModel writes them (`qwen3next_gguf`) load into
the Hub checkpoint's weights, logits and MTP module; the tokenizer built from tokenizer.ggml.* gives the Hugging
Face tokenizer's ids; bad files are refused in one line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from conftest import HF_FIXTURES, run_cli
from helpers import one_line_refusal, random_mtp_tensors, rel_fro
from strata_jax import Engine
from strata_jax.io import checkpoint, gguf_file
from strata_jax.io.chat import load_generation_config
from strata_jax.io.embedded import random_checkpoint
from strata_jax.io.gguf_write import encode, qwen3next_gguf, stacked, tensor_name, write_gguf  # noqa: F401
from strata_jax.io.gguf_write import hf_tokenizer_metadata as tokenizer_metadata
from strata_jax.io.tokenizer import load_tokenizer
from strata_jax.model.config import CONFIGS_DIR, load_config

EXACT = dict(dtype="float32", expert_cache_slots="all")  # every expert on the device, float32: the exact engine
IDS = [3, 17, 200, 45, 9, 128, 77, 1, 250, 30, 64, 99]


# ---- writing GGUFs as convert_hf_to_gguf does (strata_jax/io/gguf_write.py) --------------------------------------

def block_checkpoint(seed: int) -> tuple[dict, dict[str, np.ndarray]]:
    """The quantized-expert tests' model: (config, Hub tensors with stacked experts) of a 2-layer Qwen3-MoE whose
    widths are multiples of 256 (the K types' super-blocks), its experts drawn with a trained model's spread and an
    offset (the minima matter)."""
    raw = dict(json.loads((BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=256, num_local_experts=8,
               num_experts_per_tok=2, num_hidden_layers=2)
    hub = stacked(random_checkpoint(raw, seed=seed), 2, 8)
    rng = np.random.default_rng(seed + 1)
    for name in hub:
        if ".mlp.experts." in name:
            hub[name] = (rng.standard_normal(hub[name].shape) * 0.05 + 0.01).astype(np.float32)
    return raw, hub



def unstacked(hub: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Hub's per-expert layout of stacked tensors (a safetensors checkpoint of the same values)."""
    out = {}
    for name, x in hub.items():
        if ".mlp.experts." in name:
            p, w = name.split(".mlp.experts.")
            out.update({f"{p}.mlp.experts.{j}.{w}": np.ascontiguousarray(x[j]) for j in range(x.shape[0])})
        else:
            out[name] = np.ascontiguousarray(x)
    return out


def assert_same_weights(got, want) -> None:
    """Two Weights trees leaf by leaf, exactly (dtype and values)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(kp)


BASE = HF_FIXTURES / "base"


@pytest.fixture(scope="module")
def base_hub():
    cfg = load_config(BASE)
    return (json.loads((BASE / "config.json").read_text()),
            stacked(load_file(BASE / "model.safetensors"), cfg.num_layers, cfg.num_experts))


# ---- weights and logits -------------------------------------------------------------------------------------------

def test_f32_logits_equal_the_safetensors_checkpoint(tmp_path, base_hub, engine_factory, cache_dir):
    raw, hub = base_hub
    path = tmp_path / "base-f32.gguf"
    write_gguf(path, raw, hub)
    ref = engine_factory(BASE, **EXACT).prefill_logits(IDS)
    engine = engine_factory(path, **EXACT)
    assert engine.cfg == load_config(BASE).replace(eos_token_ids=()), "the config read from the metadata"
    got = engine.prefill_logits(IDS)
    assert rel_fro(got, ref) < 1e-5


def quantized_types(g: str) -> Q:
    """A mix as llama.cpp's quantize makes them: experts Q4_0 (down Q8_0), attention Q8_0, router F16, embeddings
    BF16, the output Q4_1."""
    if "_exps" in g:
        return Q.Q8_0 if "down" in g else Q.Q4_0
    if "gate_inp" in g:
        return Q.F16
    if g.startswith("token_embd"):
        return Q.BF16
    if g.startswith("output"):
        return Q.Q4_1
    return Q.Q8_0


def test_quantized_weights_and_logits(tmp_path, base_hub, engine_factory, cache_dir, capfd):
    """Every engine weight equals gguf.quants.dequantize of its tensor (float32, exactly), and the logits equal
    those of a safetensors checkpoint holding the dequantized values."""
    raw, hub = base_hub
    path = tmp_path / "base-q.gguf"
    written = write_gguf(path, raw, hub, types=quantized_types)
    dequantized = dequantized_folder(tmp_path, raw, written)

    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    got = checkpoint.load_weights(folder, cfg, jnp.float32)
    assert_same_weights(got, checkpoint.load_weights(dequantized, cfg, jnp.float32))
    assert got.embed.dtype == jnp.float32 and not np.array_equal(np.asarray(got.layers[0].ffn.gate), hub["model.layers.0.mlp.experts.gate_proj.weight"])
    # expert_dtype=int8: the dequantized experts requantized at load, as from the safetensors checkpoint
    got8 = checkpoint.load_weights(folder, cfg, jnp.float32, expert_format="int8")
    assert got8.layers[1].ffn.gate.dtype == jnp.int8
    assert_same_weights(got8, checkpoint.load_weights(dequantized, cfg, jnp.float32, expert_format="int8"))

    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), **EXACT)
    line = next(l for l in capfd.readouterr().err.splitlines() if l.startswith("gguf:"))
    # expert_dtype=auto: a format per family, each kept as read (Q4_0 gate/up, Q8_0 down)
    assert "experts gate/up Q4_0 (" in line and "-> int4-g32f (5.00 bpw: Q4_0's blocks as stored)" in line, line
    assert "experts down Q8_0 (" in line and "-> int8-g32 (9.00 bpw: Q8_0's blocks as stored)" in line, line
    assert "router F16 (16.00 bpw) -> f32," in line and "embeddings BF16+Q4_1" in line, line
    assert "packed on the device: the experts (int4-g32f/int8-g32)" in line, line
    ref = engine_factory(dequantized, **EXACT).prefill_logits(IDS)
    assert rel_fro(engine.prefill_logits(IDS), ref) < 1e-5


K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS)


def quantized_gguf(path: Path, types: tuple, experts: int, replace=None) -> dict[str, np.ndarray]:
    """A one-layer qwen3moe GGUF of 256-wide rows (as the K types need) with `experts` experts, its matrices in
    `types` in turn (gguf.quants' quantizer where it has one, else random blocks whose half-precision scales stay
    finite, bytes below 0x40); replace: {GGUF name: raw bytes written instead}. Returns the values
    gguf.quants.dequantize gives each whole tensor, by Hub name (stacked experts)."""
    raw = dict(json.loads((BASE / "config.json").read_text()), hidden_size=256, head_dim=128, num_attention_heads=2,
               num_key_value_heads=1, moe_intermediate_size=256, num_local_experts=experts, num_experts_per_tok=1,
               num_hidden_layers=1)
    rng = np.random.default_rng()
    hub = stacked(random_checkpoint(raw, seed=int(rng.integers(1 << 30))), 1, experts)
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", 1), ("context_length", 512), ("embedding_length", 256),
                       ("attention.head_count", 2), ("attention.head_count_kv", 1), ("attention.key_length", 128),
                       ("attention.layer_norm_rms_epsilon", 1e-6), ("expert_count", experts), ("expert_used_count", 1),
                       ("expert_feed_forward_length", 256)):
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"qwen3moe.{key}", value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 1)
    want, matrices = {}, 0
    for name, x in hub.items():
        g = names.get_name(name, try_suffixes=(".weight",))
        if x.ndim == 1:
            w.add_tensor(g, x)
            want[name] = x
            continue
        qtype = types[matrices % len(types)]
        matrices += 1
        try:
            data = gguf.quants.quantize(x, qtype)
        except NotImplementedError:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 0x40, (*x.shape[:-1], x.shape[-1] // block * size), dtype=np.uint8)
        data = (replace or {}).get(g, data)
        w.add_tensor(g, data, raw_dtype=qtype)
        want[name] = gguf.quants.dequantize(data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def test_k_and_iq_types_dequantize_at_load(tmp_path, cache_dir):
    """The K and IQ types (no quantizer in gguf-py: random blocks whose half-precision scales stay finite, bytes
    below 0x40) load as gguf.quants.dequantize gives them; 256-wide rows, as those types need."""
    path = tmp_path / "k.gguf"
    want = quantized_gguf(path, K_TYPES, experts=2)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    assert_same_weights(checkpoint.load_weights(folder, cfg, jnp.float32),
                        checkpoint.load_weights(dequantized_folder(tmp_path, folder, want), cfg, jnp.float32))
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    assert set(t for family in source["types"].values() for t in family) == {"F32"} | {q.name for q in K_TYPES}


def dequantized_folder(tmp_path: Path, config: Path | dict, want: dict) -> Path:
    """A Hugging Face folder beside the GGUF's: its config (a folder's config.json, or the raw dict) and `want` (the
    values written) as safetensors."""
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    text = json.dumps(config) if isinstance(config, dict) else (config / "config.json").read_text()
    (dequantized / "config.json").write_text(text)
    save_file(unstacked(want), str(dequantized / "model.safetensors"))
    return dequantized


def test_threaded_dequantization_is_bit_identical(tmp_path, cache_dir, monkeypatch):
    """The load's dequantization in threads (rows cut in jobs, the next experts read ahead) gives
    gguf.quants.dequantize's values of each whole tensor, bit for bit, as the one-thread load does; a damaged expert
    read ahead is refused in one line naming it."""
    types = (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q5_K, Q.IQ4_XS)
    path = tmp_path / "mixed.gguf"
    want = quantized_gguf(path, types, experts=5)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    dequantized = dequantized_folder(tmp_path, folder, want)
    cfg = load_config(folder)
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    assert {t for family in source["types"].values() for t in family} == {"F32"} | {q.name for q in types}
    monkeypatch.setattr(gguf_file, "CHUNK_VALUES", 3 * 256 + 17)  # jobs of 3 rows: 86 jobs for 256 rows
    ref = checkpoint.load_weights(dequantized, cfg, jnp.float32)
    for threads in (1, 3):
        monkeypatch.setattr(gguf_file, "LOAD_THREADS", threads)
        assert_same_weights(checkpoint.load_weights(folder, cfg, jnp.float32), ref)
    assert gguf_file.GGUFTensors(folder, checkpoint.check_weight).threads == 3

    g = "blk.0.ffn_up_exps.weight"
    t = source["tensors"][g]
    data = np.fromfile(path, np.uint8, count=t[4], offset=t[3]).reshape(t[2][0], t[2][1], -1).copy()
    qtype = Q[t[1]]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    d = size - 2 if qtype == Q.Q6_K else 0  # where a block holds its f16 scale d
    data[3, 7, d:d + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # expert 3's row 7, first block
    bad = tmp_path / "bad.gguf"
    quantized_gguf(bad, types, experts=5, replace={g: data})
    msg = one_line_refusal(checkpoint.load_weights, gguf_file.gguf_model_folder(bad, cache_dir), cfg, jnp.float32)
    assert f"checkpoint tensor '{g}[3]' holds" in msg and "non-finite" in msg, msg


def test_tied_embeddings_and_format_lines(tmp_path, base_hub, cache_dir):
    """No `output` tensor: the lm_head is the embedding (tie_word_embeddings), as llama.cpp reads it. The start-up
    line with expert_dtype=int4: the dequantized experts requantized in the engine's format."""
    raw, hub = base_hub
    path = tmp_path / "tied.gguf"
    write_gguf(path, raw, hub, drop=("output.weight",))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    assert cfg.tie_word_embeddings
    weights = checkpoint.load_weights(folder, cfg, jnp.float32)
    assert weights.lm_head is None and np.array_equal(weights.embed, hub["model.embed_tokens.weight"])
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    line = gguf_file.formats_line(dict(source, types=dict(source["types"], experts={"Q4_K": [256, 144]})),
                                  "bfloat16", "int4")
    assert "experts Q4_K (4.50 bpw) -> int4 (requantized at load from the dequantized values)" in line, line
    assert "attention F32 (32.00 bpw) -> bf16," in line and "(qwen3moe, 1 file)" in line, line


def test_split_gguf_reads_every_part(tmp_path, base_hub, cache_dir):
    raw, hub = base_hub
    path = tmp_path / "base.gguf"
    write_gguf(path, raw, hub, types=quantized_types, split_max_tensors=8)
    parts = sorted(tmp_path.glob("base-*-of-*.gguf"))
    assert len(parts) > 2, parts
    folder = gguf_file.gguf_model_folder(parts[0], cache_dir)
    assert json.loads((folder / gguf_file.SOURCE_FILE).read_text())["files"] == [str(p) for p in parts]
    single = tmp_path / "single" / "base.gguf"
    single.parent.mkdir()
    write_gguf(single, raw, hub, types=quantized_types)
    cfg = load_config(folder)
    assert_same_weights(checkpoint.load_weights(folder, cfg, jnp.float32),
                        checkpoint.load_weights(gguf_file.gguf_model_folder(single, cache_dir), cfg, jnp.float32))
    parts[-1].unlink()
    msg = one_line_refusal(gguf_file.gguf_model_folder, parts[0], cache_dir)
    assert parts[-1].name in msg and "missing" in msg, msg


# ---- qwen3next: Qwen3-Next GGUFs as llama.cpp's converter writes them ----------------------------------------------

NEXT_BASE, NEXT_MIXED = HF_FIXTURES / "next_base", HF_FIXTURES / "next_mixed"



def assert_next_weights(got, want) -> None:
    """Two Weights (or MTPWeights) trees leaf by leaf: the matrices exactly, the norms (stored + 1) and A_log
    (stored -exp(A_log)) within their float32 round trip."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(kp)
        if a.ndim > 1:
            assert np.array_equal(a, b), jax.tree_util.keystr(kp)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(kp))


def next_hub(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def test_qwen3next_logits_equal_the_safetensors_checkpoint(tmp_path, engine_factory, cache_dir):
    """next_base as convert_hf_to_gguf writes it (F32): through --model=file.gguf the config, every weight and the
    logits of random tokens are the safetensors checkpoint's."""
    raw, hub = next_hub(NEXT_BASE)
    path = tmp_path / "next-f32.gguf"
    qwen3next_gguf(path, raw, hub)
    ids = np.random.default_rng().integers(0, raw["vocab_size"], 12).tolist()
    ref = engine_factory(NEXT_BASE, **EXACT)
    engine = engine_factory(path, **EXACT)
    assert engine.cfg == ref.cfg, "the config read from the metadata"
    assert engine.cfg.next and engine.cfg.linear_num_value_heads > engine.cfg.linear_num_key_heads
    assert_next_weights(engine.weights, ref.weights)
    assert engine.mtp is None
    assert rel_fro(engine.prefill_logits(ids), ref.prefill_logits(ids)) <= 1e-5


def test_qwen3next_converter_variants(tmp_path, cache_dir):
    """The converter's other forms read back to the same weights: the older files' ssm_in, --fuse-qkv (the
    full-attention layers' attn_qkv), --fuse-gate-up-exps, the layer types from full_attention_interval alone, the
    shared expert gate as [H]; next_mixed (one key head, two value heads each, conv kernel 3)."""
    raw, hub = next_hub(NEXT_MIXED)
    path = tmp_path / "next-variants.gguf"
    qwen3next_gguf(path, raw, hub, legacy_ssm_in=True, fuse_qkv=True, fuse_gate_up_exps=True,
                   recurrent_layers=False, shexp_gate_1d=True)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    assert cfg == load_config(NEXT_MIXED)
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    assert "blk.1.attn_qkv.weight" in source["tensors"] and "blk.0.ssm_in.weight" in source["tensors"]
    assert_next_weights(checkpoint.load_weights(folder, cfg, jnp.float32),
                        checkpoint.load_weights(NEXT_MIXED, cfg, jnp.float32))


def test_qwen3next_mtp_layer(tmp_path, cache_dir, capfd):
    """The converter's MTP block (blk.{L}: nextn.* and a full-attention MoE layer) loads as the engine's MTP module,
    equal to the safetensors checkpoint's; a file that declares it without its tensors runs without MTP and says
    so in one start-up line."""
    import shutil
    from strata_jax import Engine
    raw, hub = next_hub(NEXT_BASE)
    raw = dict(raw, mtp_num_hidden_layers=1)
    mtp = random_mtp_tensors(raw, np.random.default_rng())
    hf = tmp_path / "hf"
    shutil.copytree(NEXT_BASE, hf)
    (hf / "config.json").write_text(json.dumps(raw))
    save_file(mtp, str(hf / "mtp.safetensors"))
    path = tmp_path / "next-mtp.gguf"
    qwen3next_gguf(path, raw, dict(hub, **mtp))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    assert cfg == load_config(hf) and cfg.mtp_layers == 1 and checkpoint.has_mtp(folder, cfg)
    assert_next_weights(checkpoint.load_mtp(folder, cfg), checkpoint.load_mtp(hf, cfg))
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    assert source["mtp_block"] == 4 and source["types"]["mtp"]["F32"][0] > 0
    engine = Engine.from_pretrained(path, verbose=False, cache_dir=str(cache_dir), **EXACT)
    assert engine.mtp is not None  # draft=mtp drafts with it (tests/model/test_hf_next.py runs the drafter)

    cut = tmp_path / "next-no-mtp.gguf"
    qwen3next_gguf(cut, raw, hub, mtp_declared=1)
    capfd.readouterr()
    engine = Engine.from_pretrained(cut, verbose=True, cache_dir=str(cache_dir), **EXACT)
    assert engine.mtp is None and engine.cfg.mtp_layers == 0
    lines = [l for l in capfd.readouterr().err.splitlines() if "MTP" in l]
    assert len(lines) == 1 and "declares 1 MTP layer(s) (nextn_predict_layers) but holds none of their tensors: " \
        "the engine runs without MTP" in lines[0], lines


def test_qwen3next_refusals(tmp_path, cache_dir):
    raw, hub = next_hub(NEXT_BASE)
    path = tmp_path / "dense.gguf"  # llama.cpp's qwen3next has no dense MLP layer (the converter cannot write one)
    qwen3next_gguf(path, raw, hub, replace={"blk.1.ffn_up.weight": np.zeros((64, 32), np.float32)})
    msg = refused(path, cache_dir)
    assert "GGUF tensor 'blk.1.ffn_up.weight' is not part of a qwen3next model as this engine reads it" in msg, msg

    path = tmp_path / "a.gguf"  # ssm_a is -exp(A_log): a value >= 0 is no such thing
    qwen3next_gguf(path, raw, hub, replace={"blk.2.ssm_a": np.array([-1.0, 0.5, -2.0, -1.0], np.float32)})
    msg = refused(path, cache_dir)
    assert "GGUF tensor 'blk.2.ssm_a'" in msg and "holds values >= 0" in msg, msg

    mtp = random_mtp_tensors(raw, np.random.default_rng(1))
    path = tmp_path / "own-embeddings.gguf"  # an MTP layer with its own embeddings: the engine reads the model's
    qwen3next_gguf(path, raw, dict(hub, **mtp), replace={"blk.4.nextn.embed_tokens.weight": np.zeros((128, 32),
                                                                                                     np.float32)})
    msg = refused(path, cache_dir)
    assert "GGUF tensor 'blk.4.nextn.embed_tokens.weight' is not part of a qwen3next model" in msg, msg

    path = tmp_path / "mtp-only.gguf"  # convert_hf_to_gguf --mtp: the MTP layer with the embeddings and head only
    qwen3next_gguf(path, raw, dict(hub, **mtp), drop=[f"blk.{i}." for i in range(4)])
    msg = refused(path, cache_dir)
    assert "the GGUF holds only the MTP layer (blk.4" in msg, msg

    path = tmp_path / "inner.gguf"
    qwen3next_gguf(path, raw, hub)
    bad = tmp_path / "inner-bad.gguf"
    data = path.read_bytes()
    # ssm.inner_size 64 -> 66: not a multiple of the 4 value heads
    key = b"qwen3next.ssm.inner_size"
    at = data.index(key) + len(key) + 4  # the key, its value type (uint32)
    bad.write_bytes(data[:at] + np.uint32(66).tobytes() + data[at + 4:])
    msg = refused(bad, cache_dir)
    assert "qwen3next.ssm.inner_size 66 is not a multiple of ssm.time_step_rank 4" in msg, msg


# ---- the tokenizer ------------------------------------------------------------------------------------------------

QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_USER = ["<think>", "</think>"]  # Qwen3's added tokens that are not special
TEXTS = [
    "Hello, world! It's a test: don't we'll I'd they're.",
    "我想在apple工作1314151天～ 你好，世界。中文分词测试",
    "emoji 🚀🦙 😶‍🌫️ ✅ and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "   leading and    runs   of   spaces\t\t\ttabs\n\n\n\n  \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|endoftext|>",
    "Ünïcödé café naïve Å (NFC: e\u0301 vs é) 3.14159 1234567 ---====",
]


def qwen2_style_tokenizer() -> Tokenizer:
    """A small BPE with Qwen2's tokenizer.json pipeline (NFC, its split regex, byte level), trained here."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(gguf_file.QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([t for t in TEXTS for _ in range(3)] + [Path(gguf_file.__file__).read_text()],
                            trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN2_SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN2_USER])
    return tok



CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tokenizer_gives_the_hf_ids(tmp_path, base_hub, cache_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    tok = qwen2_style_tokenizer()
    tok.save(str(hf / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
         "add_bos_token": False}))
    (hf / "config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": im_end}))
    raw, hub = base_hub
    vocab = tok.get_vocab_size() + 5  # the model's vocabulary is larger than the tokenizer's, as Qwen's is
    raw = dict(raw, vocab_size=vocab)
    hub = dict(hub, **{k: np.resize(hub[k], (vocab, hub[k].shape[1]))
                       for k in ("model.embed_tokens.weight", "lm_head.weight")})
    path = tmp_path / "tok.gguf"
    write_gguf(path, raw, hub, metadata=tokenizer_metadata(hf, vocab))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    ours = load_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text).ids == tok.encode(text).ids, text
        assert ours.decode(tok.encode(text).ids, skip_special_tokens=False) == \
            tok.decode(tok.encode(text).ids, skip_special_tokens=False)
    assert tok.encode(TEXTS[5]).ids.count(tok.token_to_id("<think>")) == 1  # user-defined tokens stay whole
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == im_end
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [im_end, eot]
    from strata_jax.io.chat import load_chat_template
    template = load_chat_template(folder)
    assert template.source == CHAT_TEMPLATE
    assert template.special_tokens["eos_token"] == "<|im_end|>" and template.special_tokens["pad_token"] == \
        "<|endoftext|>"


# ---- sampling defaults --------------------------------------------------------------------------------------------

def sampling_metadata(temp=None, top_k=None, top_p=None, min_p=None):
    def add(w: gguf.GGUFWriter):
        for value, adder in ((temp, w.add_sampling_temp), (top_k, w.add_sampling_top_k), (top_p, w.add_sampling_top_p),
                             (min_p, w.add_sampling_min_p)):
            if value is not None:
                adder(value)
    return add


def test_sampling_defaults(tmp_path, base_hub, cache_dir, engine_factory, capfd):
    """general.sampling.temp / top_k / top_p become generation_config.json's temperature / top_k / top_p with
    do_sample: the GGUF engine's request defaults are a Hugging Face folder's with that generation_config.json, and
    a request without sampling options samples with them. min_p (no request option takes it): one start-up line.
    Without the keys: greedy, as before; llama.cpp's 'off' values (temp <= 0, top_k <= 0, top_p >= 1) read as off."""
    raw, hub = base_hub
    rng = np.random.default_rng()
    temp, top_p = round(float(rng.uniform(0.3, 1.5)), 2), round(float(rng.uniform(0.5, 0.95)), 2)
    top_k = int(rng.integers(2, 60))
    path = tmp_path / "sampling.gguf"
    write_gguf(path, raw, hub, metadata=sampling_metadata(temp, top_k, top_p, min_p=0.05))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [], "do_sample": True, "temperature": temp, "top_k": top_k,
                          "top_p": top_p}, generation
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        (hf / name).write_bytes((BASE / name).read_bytes())
    (hf / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": temp, "top_k": top_k, "top_p": top_p}))
    capfd.readouterr()
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), **EXACT)
    lines = [l for l in capfd.readouterr().err.splitlines() if "general.sampling" in l]
    assert len(lines) == 1 and "sets general.sampling.min_p 0.05, which no request option here takes" in lines[0], \
        lines
    want = dict(temperature=temp, top_p=top_p, top_k=top_k)
    assert engine.generation_defaults.request_defaults() == want
    assert engine_factory(hf, **EXACT).generation_defaults.request_defaults() == want
    ids = rng.integers(0, raw["vocab_size"], 6).tolist()
    seed = int(rng.integers(1 << 30))
    assert engine.generate(ids, max_new_tokens=4, seed=seed) == \
        engine.generate(ids, max_new_tokens=4, seed=seed, **want)

    plain = tmp_path / "plain.gguf"  # no general.sampling.*: greedy, the folder as before
    write_gguf(plain, raw, hub)
    folder = gguf_file.gguf_model_folder(plain, cache_dir)
    assert json.loads((folder / "generation_config.json").read_text()) == {"eos_token_id": [], "do_sample": False}
    assert load_generation_config(folder).request_defaults() == dict(temperature=0.0, top_p=1.0, top_k=0)
    assert "sampling_unused" in json.loads((folder / gguf_file.SOURCE_FILE).read_text())

    off = tmp_path / "off.gguf"  # llama.cpp's off values; top_k, top_p without temp stay greedy
    write_gguf(off, raw, hub, metadata=sampling_metadata(0.0, -1, 1.5))
    generation = json.loads((gguf_file.gguf_model_folder(off, cache_dir) / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [], "do_sample": False, "temperature": 0.0, "top_k": 0, "top_p": 1.0}
    only = tmp_path / "only.gguf"
    write_gguf(only, raw, hub, metadata=sampling_metadata(top_k=top_k, top_p=top_p))
    folder = gguf_file.gguf_model_folder(only, cache_dir)
    assert load_generation_config(folder).request_defaults() == dict(temperature=0.0, top_p=1.0, top_k=0)
    bad = tmp_path / "nan.gguf"
    write_gguf(bad, raw, hub, metadata=sampling_metadata(temp=float("nan")))
    msg = one_line_refusal(gguf_file.gguf_model_folder, bad, cache_dir)
    assert "general.sampling.temp is nan, not a number" in msg, msg


# ---- refusals -----------------------------------------------------------------------------------------------------

def refused(path, cache_dir) -> str:
    return one_line_refusal(Engine.from_pretrained, path, verbose=False, cache_dir=str(cache_dir), **EXACT)


def test_refusals(tmp_path, base_hub, cache_dir):
    raw, hub = base_hub
    path = tmp_path / "llama.gguf"
    write_gguf(path, raw, {"model.norm.weight": hub["model.norm.weight"]}, arch="llama")
    msg = refused(path, cache_dir)
    assert "GGUF architecture 'llama' is not supported (supported: 'qwen3moe', 'qwen3next')" in msg, msg

    path = tmp_path / "missing.gguf"
    write_gguf(path, raw, hub, drop=("blk.1.ffn_up_exps.weight",))
    msg = refused(path, cache_dir)
    assert "'blk.1.ffn_up_exps.weight'" in msg and "missing" in msg, msg

    def extra(*pairs):
        def add(w):
            for key, value in pairs:
                w.add_string(key, value)
        return add
    path = tmp_path / "yarn.gguf"
    write_gguf(path, raw, hub, metadata=extra(("qwen3moe.rope.scaling.type", "yarn")))
    msg = refused(path, cache_dir)
    assert "rope scaling 'yarn' (rope.scaling.type) is not supported" in msg, msg
    path = tmp_path / "spm.gguf"
    write_gguf(path, raw, hub, metadata=extra(("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.pre", "default")))
    msg = refused(path, cache_dir)
    assert "tokenizer 'llama' with pre-tokenizer 'default' is not supported" in msg, msg

    path = tmp_path / "blocks.gguf"
    write_gguf(path, dict(raw, num_hidden_layers=3), hub)
    msg = refused(path, cache_dir)
    assert "block_count is 3, but the GGUF holds tensors of 2 blocks (blk.0..blk.1)" in msg, msg

    path = tmp_path / "shape.gguf"
    write_gguf(path, raw, hub, replace={"blk.1.attn_k.weight": np.zeros((65, 64), np.float32)})
    msg = refused(path, cache_dir)
    assert "GGUF tensor 'blk.1.attn_k.weight' has shape [65, 64] (numpy order), expected [64, 64]" in msg, msg

    path = tmp_path / "shexp.gguf"
    write_gguf(path, raw, hub, replace={"blk.0.ffn_gate_shexp.weight": np.zeros((8, 64), np.float32)})
    msg = refused(path, cache_dir)
    assert "GGUF tensor 'blk.0.ffn_gate_shexp.weight' is not part of a qwen3moe model" in msg, msg

    path = tmp_path / "int.gguf"
    q = hub["model.layers.0.self_attn.q_proj.weight"]
    write_gguf(path, raw, hub, replace={"blk.0.attn_q.weight": np.zeros(q.shape, np.int32)})
    msg = refused(path, cache_dir)
    assert "'blk.0.attn_q.weight' has type I32, which this engine does not read" in msg, msg

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    for name in ("junk.gguf", "cut.gguf"):
        msg = refused(tmp_path / name, cache_dir)
        assert f"cannot read GGUF file {tmp_path / name} (cut short, damaged or not a GGUF file)" in msg, msg
    msg = refused(tmp_path / "absent.gguf", cache_dir)
    assert "absent.gguf does not exist" in msg, msg


# ---- the command line ---------------------------------------------------------------------------------------------

def byte_level_metadata(w: gguf.GGUFWriter) -> None:
    """The embedded model's tokenizer (byte value = id, <|endoftext|> 256) as Qwen2-style GGUF metadata."""
    from strata_jax.io.tokenizer import bytes_to_unicode
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([bytes_to_unicode()[b] for b in range(256)] + ["<|endoftext|>"])
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL])
    w.add_token_merges([])
    w.add_eos_token_id(256)
    w.add_chat_template(CHAT_TEMPLATE)


def test_cli_decodes_a_gguf(tmp_path, cache_dir, engine_factory):
    """The embedded tiny model's shape (the CLI tests' compiled graphs) as a Q8_0 GGUF with a tokenizer: the CLI
    says the types, decodes text and saves the state, which restores the same model."""
    raw = json.loads((CONFIGS_DIR / "tiny.json").read_text())
    hub = stacked(random_checkpoint(raw, seed=0), raw["num_hidden_layers"], raw["num_experts"])
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(path, raw, hub, types=lambda g: Q.Q8_0, metadata=byte_level_metadata)
    state = tmp_path / "state"
    out = run_cli([f"--model={path}", "--prompt=def fib(n):", "--max_new_tokens=6", "--dtype=float32",
                   "--expert_cache_slots=all", f"--save_state={state}"], cache_dir)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "gguf: " in err and "experts Q8_0 (8.50 bpw) -> int8-g32 (9.00 bpw: Q8_0's blocks as stored)" in err, err
    assert re.search(r"^loading: layer 3/3 \(\d+\.\d s\)$", err, re.MULTILINE), err  # the time spent
    assert out.stdout.startswith(b"def fib(n):") and len(out.stdout) > len(b"def fib(n):"), out.stdout
    # --save_state of a GGUF engine: the converted weights, the tokenizer and the chat template come back
    restored = engine_factory(state, **EXACT)
    engine = engine_factory(path, **EXACT)
    assert restored.chat_template.source == CHAT_TEMPLATE and restored.encode("def") == list(b"def")
    ids = restored.encode("def fib(n):\n    return")
    assert np.array_equal(restored.prefill_logits(ids), engine.prefill_logits(ids))
