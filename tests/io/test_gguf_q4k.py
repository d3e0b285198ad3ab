"""GGUF Q4_K (and Q2_K) experts kept packed (issue 36: the engine formats "int4-q4k" and "int2-q2k",
strata_jax/model/quant.py): a tiny Qwen3-MoE GGUF written with gguf's writer, its expert stacks Q4_K (gguf.quants has
no Q4_K quantizer: the blocks are made by quant.q4k_blocks from random weights, llama.cpp's block_q4_K layout;
gguf.quants.dequantize reads them), the rest F32. The engine keeps the experts as read (expert_dtype=auto), their
dequantized values equal gguf.quants.dequantize's exactly, and its logits equal those of a safetensors checkpoint of
the dequantized values, all experts resident and offloaded (slots < experts, half the misses in the host pool):
placement-independent. The tests taking `block_model` run for Q2_K's blocks too (quant.q2k_blocks; int2-q2k, uint8
codes, q four a byte); tests/io/test_gguf_q2k.py has Q2_K's own."""
from __future__ import annotations

import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import test_gguf
from helpers import gguf_kernel_offload_check, one_line_refusal, rel_fro
from strata_jax import Engine
from strata_jax.errors import StrataError
from strata_jax.io import checkpoint, gguf_file
from strata_jax.io.embedded import random_checkpoint
from strata_jax.model import quant
from strata_jax.model.config import load_config
from strata_jax.offload.slots import layer_states

EXACT = dict(dtype="float32", expert_cache_slots="all")
IDS = test_gguf.IDS


# per block format: the GGUF type, the codes' dtype, inputs a stored byte, the start-up line's words
BLOCKS = {quant.Q4K: (Q.Q4_K, jnp.uint16, 2, "4.50 bpw) -> int4-q4k (4.62 bpw", "int4-q4k, GGUF Q4_K's blocks"),
          quant.Q2K: (Q.Q2_K, jnp.uint8, 4, "2.62 bpw) -> int2-q2k (2.62 bpw", "int2-q2k, GGUF Q2_K's blocks")}


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q2_K):
        return quant.q4k_blocks(x) if qtype == Q.Q4_K else quant.q2k_blocks(x)
    return test_gguf.encode(x, qtype)


def write_block_model(tmp, fmt: str, seed: int):
    """(the GGUF of experts in `fmt`'s type, a safetensors folder of its dequantized values, the written values by Hub
    name, fmt)."""
    raw, hub = test_gguf.block_checkpoint(seed)
    path = tmp / f"{fmt}.gguf"
    qtype = BLOCKS[fmt][0]
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: qtype if "_exps" in g else Q.F32, encoder=encode)
    return path, test_gguf.dequantized_folder(tmp, raw, written), written, fmt


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    return write_block_model(tmp_path_factory.mktemp("q4k"), quant.Q4K, 11)


@pytest.fixture(scope="module")
def q2k_model(tmp_path_factory):
    return write_block_model(tmp_path_factory.mktemp("q2k"), quant.Q2K, 31)


@pytest.fixture(params=[quant.Q4K, quant.Q2K])
def block_model(request):
    """q4k_model, then q2k_model."""
    return request.getfixturevalue("q4k_model" if request.param == quant.Q4K else "q2k_model")


def test_experts_are_kept_and_dequantize_to_gguf_values(block_model, cache_dir):
    path, _, written, fmt = block_model
    _, codes_dtype, per_byte, *_ = BLOCKS[fmt]
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == fmt
    cfg = load_config(folder)
    w = checkpoint.load_weights(folder, cfg, jnp.float32, expert_format=fmt)
    for i, layer in enumerate(w.layers):
        for which in ("gate", "up", "down"):
            q, codes = getattr(layer.ffn, which), getattr(layer.ffn, which + "_scale")
            assert q.dtype == jnp.uint8 and codes.dtype == codes_dtype and q.shape[-1] == 256 // per_byte
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_int4(q, codes, jnp.float32)), want)
            host = quant.blocks_dequantize(np.asarray(q), np.swapaxes(np.asarray(codes), -1, -2))
            np.testing.assert_array_equal(host, want)
    assert np.any(quant.block_scales(np.swapaxes(np.asarray(w.layers[0].ffn.gate_scale), -1, -2))[1] > 0)


@pytest.mark.parametrize("placement", [
    dict(expert_cache_slots="all"),
    dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2),
    dict(expert_cache_slots="3", pcie_frac="1"),
])
def test_logits_equal_the_dequantized_model(block_model, engine_factory, cache_dir, placement, capfd):
    path, dequantized, _, fmt = block_model
    qtype, _, per_byte, bits, how = BLOCKS[fmt]
    ref = engine_factory(dequantized, **EXACT).prefill_logits(IDS)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **placement)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == fmt
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    assert f"experts {qtype.name} ({bits}: {qtype.name}'s blocks as stored)" in line, line
    assert f"packed on the device: the experts ({fmt})" in line, line
    assert f"experts: {how}" in err, err
    assert rel_fro(engine.prefill_logits(IDS), ref) < 1e-5
    if placement["expert_cache_slots"] != "all":  # the slots and the pool hold the packed form
        assert layer_states(engine.cache.experts)[0].gate.shape[-1] == 256 // per_byte  # [S+1, I, H/2 or H/4]
        assert engine.placement.pool.store.format == fmt
    assert engine.generate(IDS, max_new_tokens=4) == engine_factory(dequantized, **EXACT).generate(IDS,
                                                                                                    max_new_tokens=4)


def test_expert_dtype_int4_q4k_elsewhere(q4k_model, cache_dir):
    """expert_dtype=int4-q4k on a safetensors checkpoint quantizes at load (the same rules as q4k_blocks); on
    experts of widths no super-block divides it is one line."""
    _, dequantized, written, _ = q4k_model
    cfg = load_config(dequantized)
    w = checkpoint.load_weights(dequantized, cfg, jnp.float32, expert_format=quant.Q4K)
    # the dequantized Q4_K values requantized: close to them (not bit for bit: q4k_blocks is not llama.cpp's search)
    got = np.asarray(quant.dequantize_engine_int4(w.layers[1].ffn.up, w.layers[1].ffn.up_scale, jnp.float32))
    want = written["model.layers.1.mlp.experts.up_proj.weight"]
    assert rel_fro(got, want) < 0.15  # (here the grid comes back: q4k_blocks of its own values)
    msg = one_line_refusal(Engine.from_pretrained, str(test_gguf.BASE), verbose=False, cache_dir=str(cache_dir),
                           expert_dtype="int4-q4k")
    assert "super-blocks of 256 inputs" in msg and "64 and 32" in msg, msg


def test_q4k_experts_under_the_kernel_scan_offloaded(block_model, engine_factory, cache_dir, monkeypatch):
    """The GGUF's Q4_K (Q2_K) experts offloaded to 3 slots with expert_kernel=pallas (bf16, interpret mode on the
    CPU; the engine's GPU-only check passed here as test_quant does): the scanned offload graph, the kernel reading
    the codes by window position, fetches and the pool's C kernel (FMT_INT4K, FMT_INT2K) in the windows, within bf16
    rounding of all resident through the XLA path."""
    path, _, _, fmt = block_model
    gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, IDS, np.uint8, np.uint8, fmt)


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
def test_random_weights_for_benchmarks(cache_dir, fmt):
    """Engine.from_random(expert_dtype=int4-q4k, int2-q2k) (the benchmarks' engines): made on the device in the
    format, resident and offloaded alike."""
    from strata_jax.model.config import config_from_dict
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)
    cfg = config_from_dict(raw)
    opts = dict(verbose=False, cache_dir=str(cache_dir), dtype="float32", expert_dtype=fmt, window=2, context=64)
    resident = Engine.from_random(cfg, seed=3, expert_cache_slots="all", **opts)
    offloaded = Engine.from_random(cfg, seed=3, expert_cache_slots="3", pcie_frac="0.5", **opts)
    assert resident.weights.layers.ffn.gate_scale.dtype == BLOCKS[fmt][1]
    assert rel_fro(offloaded.prefill_logits(IDS), resident.prefill_logits(IDS)) < 1e-5


def test_q4k_m_mix_with_expert_dtype_int4_q4k(tmp_path, cache_dir):
    """A Q4_K_M-like file (gate/up experts Q4_K, down Q6_K: random blocks, gguf.quants has no Q6_K quantizer):
    expert_dtype=auto keeps each family in its own format (int4-q4k/int6-q6k: tests/io/test_gguf_mixed.py);
    expert_dtype=int4-q4k keeps the Q4_K stacks
    as read and requantizes the Q6_K ones from their values; the start-up line says which."""
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
    hub = test_gguf.stacked(random_checkpoint(raw, seed=21), 1, 4)
    rng = np.random.default_rng(22)

    def encode_mix(x, qtype):
        if qtype == Q.Q6_K:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            return rng.integers(0, 0x40, (*x.shape[:-1], x.shape[-1] // block * size), dtype=np.uint8)
        return encode(x, qtype)
    path = tmp_path / "q4k_m.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: (Q.Q6_K if "down_exps" in g else Q.Q4_K)
                                   if "_exps" in g else Q.F32, encoder=encode_mix)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == "int4-q4k/int6-q6k"
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    line = gguf_file.formats_line(source, "bfloat16", quant.Q4K)
    assert "-> int4-q4k (4.62 bpw: Q4_K's blocks as stored, the other types requantized at load" in line, line
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format=quant.Q4K)
    ffn = w.layers[0].ffn
    for which in ("gate", "up"):
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize_engine_int4(getattr(ffn, which), getattr(ffn, which + "_scale"), jnp.float32)),
            written[f"model.layers.0.mlp.experts.{which}_proj.weight"])
    down = np.asarray(quant.dequantize_engine_int4(ffn.down, ffn.down_scale, jnp.float32))
    assert 0 < rel_fro(down, written["model.layers.0.mlp.experts.down_proj.weight"]) < 0.15


def test_saved_state_keeps_the_blocks(block_model, engine_factory, tmp_path, cache_dir):
    """--save_state of the kept Q4_K (Q2_K) experts saves q and the codes; the state restores with expert_dtype=
    int4-q4k (int2-q2k) (offloaded: the pool gets the codes too) to the same logits."""
    path, _, _, fmt = block_model
    src = engine_factory(path, **EXACT)
    state = tmp_path / "state"
    src.save_state(state)
    back = Engine.from_pretrained(state, verbose=False, cache_dir=str(cache_dir), dtype="float32",
                                  expert_cache_slots="3", pcie_frac="0.5", expert_dtype=fmt)
    assert back.placement.pool.store.format == fmt
    assert rel_fro(back.prefill_logits(IDS), src.prefill_logits(IDS)) < 1e-5
