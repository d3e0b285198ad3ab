"""GGUF Q2_K experts kept packed (issue 36: the engine format "int2-q2k", strata_jax/model/quant.py): a tiny
Qwen3-MoE GGUF written with gguf's writer, its expert stacks Q2_K (gguf.quants has no Q2_K quantizer: the blocks are
made by quant.q2k_blocks from random weights, llama.cpp's block_q2_K layout; gguf.quants.dequantize reads them), the
rest F32. The engine keeps the experts as read (expert_dtype=auto) at the file's 2.625 bits a weight, their
dequantized values equal gguf.quants.dequantize's exactly, and its logits equal those of a safetensors checkpoint of
the dequantized values, all experts resident and offloaded: placement-independent."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import test_gguf
from helpers import gguf_kernel_offload_check, rel_fro
from strata_jax import Engine
from strata_jax.io import checkpoint, gguf_file
from strata_jax.io.embedded import random_checkpoint
from strata_jax.model import quant
from strata_jax.model.config import load_config
from strata_jax.offload.slots import layer_states

EXACT = dict(dtype="float32", expert_cache_slots="all")
IDS = test_gguf.IDS


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    return quant.q2k_blocks(x) if qtype == Q.Q2_K else test_gguf.encode(x, qtype)


@pytest.fixture(scope="module")
def q2k_model(tmp_path_factory):
    """(the GGUF, a safetensors folder of its dequantized values, the written values by Hub name)."""
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=256, num_local_experts=8,
               num_experts_per_tok=2, num_hidden_layers=2)
    hub = test_gguf.stacked(random_checkpoint(raw, seed=31), 2, 8)
    rng = np.random.default_rng(32)
    for name in hub:  # experts of a trained model's spread, with an offset: the minima matter
        if ".mlp.experts." in name:
            hub[name] = (rng.standard_normal(hub[name].shape) * 0.05 + 0.01).astype(np.float32)
    tmp = tmp_path_factory.mktemp("q2k")
    path = tmp / "q2k.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: Q.Q2_K if "_exps" in g else Q.F32, encoder=encode)
    return path, test_gguf.dequantized_folder(tmp, raw, written), written


def test_experts_are_kept_and_dequantize_to_gguf_values(q2k_model, cache_dir):
    path, _, written = q2k_model
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == quant.Q2K
    cfg = load_config(folder)
    w = checkpoint.load_weights(folder, cfg, jnp.float32, expert_format=quant.Q2K)
    for i, layer in enumerate(w.layers):
        for which in ("gate", "up", "down"):
            q, codes = getattr(layer.ffn, which), getattr(layer.ffn, which + "_scale")
            assert q.dtype == jnp.uint8 and codes.dtype == jnp.uint8 and q.shape[-1] == 64  # 256 inputs, 4 a byte
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_q2k(q, codes, jnp.float32)), want)
            host = quant.q2k_dequantize(np.asarray(q), np.swapaxes(np.asarray(codes), -1, -2))
            np.testing.assert_array_equal(host, want)
    assert np.any(quant.q2k_scales(np.swapaxes(np.asarray(w.layers[0].ffn.gate_scale), -1, -2))[1] > 0)


@pytest.mark.parametrize("placement", [
    dict(expert_cache_slots="all"),
    dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2),
    dict(expert_cache_slots="3", pcie_frac="1"),
])
def test_logits_equal_the_dequantized_model(q2k_model, engine_factory, cache_dir, placement, capfd):
    path, dequantized, _ = q2k_model
    ref = engine_factory(dequantized, **EXACT).prefill_logits(IDS)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **placement)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == quant.Q2K
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    assert "experts Q2_K (2.62 bpw) -> int2-q2k (2.62 bpw: Q2_K's blocks as stored)" in line, line
    assert "packed on the device: the experts (int2-q2k)" in line, line
    assert "experts: int2-q2k, GGUF Q2_K's blocks" in err, err
    assert rel_fro(engine.prefill_logits(IDS), ref) < 1e-5
    if placement["expert_cache_slots"] != "all":  # the slots and the pool hold the packed form
        assert layer_states(engine.cache.experts)[0].gate.shape[-1] == 64  # [S+1, I, H/4] uint8
        assert engine.placement.pool.store.format == quant.Q2K
    assert engine.generate(IDS, max_new_tokens=4) == engine_factory(dequantized, **EXACT).generate(IDS,
                                                                                                    max_new_tokens=4)


def test_q2k_experts_under_the_kernel_scan_offloaded(q2k_model, engine_factory, cache_dir, monkeypatch):
    """The GGUF's Q2_K experts offloaded to 3 slots with expert_kernel=pallas (bf16, interpret mode on the CPU): the
    scanned offload graph, the kernel reading the uint8 codes by window position, fetches and the pool's C kernel
    (FMT_INT2K) in the windows, within bf16 rounding of all resident through the XLA path."""
    path, _, _ = q2k_model
    gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, IDS, np.uint8, np.uint8, "int2-q2k")


def test_random_weights_for_benchmarks(cache_dir):
    """Engine.from_random(expert_dtype=int2-q2k) (the benchmarks' engines): made on the device in the format,
    resident and offloaded alike."""
    from strata_jax.model.config import config_from_dict
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)
    cfg = config_from_dict(raw)
    opts = dict(verbose=False, cache_dir=str(cache_dir), dtype="float32", expert_dtype="int2-q2k", window=2, context=64)
    resident = Engine.from_random(cfg, seed=3, expert_cache_slots="all", **opts)
    offloaded = Engine.from_random(cfg, seed=3, expert_cache_slots="3", pcie_frac="0.5", **opts)
    assert resident.weights.layers.ffn.gate_scale.dtype == jnp.uint8
    assert rel_fro(offloaded.prefill_logits(IDS), resident.prefill_logits(IDS)) < 1e-5


def test_saved_state_keeps_the_blocks(q2k_model, engine_factory, tmp_path, cache_dir):
    """--save_state of the kept Q2_K experts saves q and the uint8 codes; the state restores with
    expert_dtype=int2-q2k (offloaded: the pool gets the codes too) to the same logits."""
    path, _, _ = q2k_model
    src = engine_factory(path, **EXACT)
    state = tmp_path / "state"
    src.save_state(state)
    back = Engine.from_pretrained(state, verbose=False, cache_dir=str(cache_dir), dtype="float32",
                                  expert_cache_slots="3", pcie_frac="0.5", expert_dtype="int2-q2k")
    assert back.placement.pool.store.format == quant.Q2K
    assert rel_fro(back.prefill_logits(IDS), src.prefill_logits(IDS)) < 1e-5


def test_q2k_gate_up_beside_q4k_down(tmp_path, engine_factory, cache_dir):
    """A Q2_K-mix-like file (gate/up Q2_K, down Q4_K, llama.cpp's Q2_K mixes keep down in more bits): each family
    kept in its own block format ("int2-q2k/int4-q4k": a uint8-code family beside a uint16-code one in the slots, the
    pool and the graphs), logits those of the dequantized checkpoint resident and offloaded."""
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
    hub = test_gguf.stacked(random_checkpoint(raw, seed=33), 1, 4)
    rng = np.random.default_rng(34)
    for name in hub:
        if ".mlp.experts." in name:
            hub[name] = (rng.standard_normal(hub[name].shape) * 0.05 + 0.01).astype(np.float32)
    path = tmp_path / "q2k_mix.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: (Q.Q4_K if "down_exps" in g else Q.Q2_K)
                                   if "_exps" in g else Q.F32,
                                   encoder=lambda x, t: quant.q4k_blocks(x) if t == Q.Q4_K else encode(x, t))
    dequantized = test_gguf.dequantized_folder(tmp_path, raw, written)
    assert gguf_file.kept_expert_format(gguf_file.gguf_model_folder(path, cache_dir)) == "int2-q2k/int4-q4k"
    ref = engine_factory(dequantized, **EXACT).prefill_logits(IDS)
    for placement in (dict(expert_cache_slots="all"), dict(expert_cache_slots="2", pcie_frac="0.5", cpu_threads=2)):
        engine = Engine.from_pretrained(path, verbose=False, cache_dir=str(cache_dir), dtype="float32", **placement)
        assert engine.options.expert_dtype == "int2-q2k/int4-q4k"
        assert rel_fro(engine.prefill_logits(IDS), ref) < 1e-5
    state = layer_states(engine.cache.experts)[0]
    assert state.gate.shape[-1] == 64 and state.down.shape[-1] == 128  # H/4 and I/2
    assert engine.placement.pool.store.format == "int2-q2k/int4-q4k"
