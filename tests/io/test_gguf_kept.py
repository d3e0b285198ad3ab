"""GGUF expert types kept as read with float32 group scales (issue 36; strata_jax/model/quant.py GGUF_KEPT): Q4_0
(int4-g32f), Q4_1 (int4-g32m), Q8_0 (int8-g32), Q5_K (int8-g32m), Q6_K and Q3_K (int8-g16) and Q2_K (int8-g16m) by
expert_dtype (auto holds them packed: int6-q6k, int2-q2k; tests/io/test_gguf_q6k.py, test_gguf_q2k.py), the IQ types (int8-g16:
IQ2_XS, IQ2_S, IQ1_M; int8-g32: IQ2_XXS, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, IQ1_S). A tiny
Qwen3-MoE GGUF written with gguf's writer, its expert stacks of one type (Q4_0 / Q4_1 / Q8_0 by gguf.quants.quantize;
the K and IQ types as random valid blocks, quant.gguf_blocks_random: gguf.quants cannot quantize them), the rest F32. The
engine keeps the experts as read (expert_dtype=auto), their values equal gguf.quants.dequantize's bit for bit, and
its logits equal those of a safetensors checkpoint of the dequantized values, resident and offloaded."""
from __future__ import annotations

import json

import gguf
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

EXACT = dict(dtype="float32", expert_cache_slots="all")
IDS = test_gguf.IDS
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")  # gguf.quants.quantize writes these
D = {"Q6_K": 0.05 / 4000, "Q3_K": 0.05 / 128, "Q5_K": 0.05 / 2000, "Q2_K": 0.05 / 45}  # random blocks: |w| ~ 0.05
IQ_D = {"IQ2_XS": 0.05 / 50, "IQ3_S": 0.05 / 128, "IQ2_XXS": 0.05 / 50, "IQ3_XXS": 0.05 / 120, "IQ4_XS": 0.05 / 1000,
        "IQ4_NL": 0.05 / 60, "IQ2_S": 0.05 / 50, "IQ1_S": 0.05 / 5, "IQ1_M": 0.05 / 5}  # the IQ types (int8-g16/-g32)
D.update(IQ_D)
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q6_K", "Q3_K", "Q5_K", "Q2_K", *IQ_D)
# the one byte a weight forms of the packed types, asked for by name (quant.BYTE_KEPT)
KEPT_AS = {**quant.GGUF_KEPT, **{t: f for f, t in quant.BYTE_KEPT}}


def write_kept_model(tmp, qtype: str, seed: int = 31):
    """(the GGUF, a safetensors folder of its dequantized values, the written values by Hub name). qtype
    "A/B": gate/up experts of type A, down experts of B."""
    gate_up, _, down = qtype.partition("/")
    raw, hub = test_gguf.block_checkpoint(seed)
    counter = iter(range(1000))

    def encode(x, t):
        if t.name in D:
            return quant.gguf_blocks_random(t.name, x.shape, seed=seed * 1000 + next(counter), d_scale=D[t.name])
        return test_gguf.encode(x, t)
    path = tmp / f"{qtype.replace('/', '-')}.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: Q[down if down and "down_exps" in g else gate_up]
                                   if "_exps" in g else Q.F32,
                                   encoder=encode)
    dequantized = test_gguf.dequantized_folder(tmp, raw, written)
    return path, dequantized, written


@pytest.fixture(scope="module")
def kept_models(tmp_path_factory):
    """{type: write_kept_model's triple}, written on first use."""
    made = {}

    def get(qtype):
        if qtype not in made:
            made[qtype] = write_kept_model(tmp_path_factory.mktemp(qtype.replace("/", "-")), qtype)
        return made[qtype]
    return get


@pytest.mark.parametrize("qtype", TYPES)
def test_experts_are_kept_and_dequantize_to_gguf_values(kept_models, cache_dir, qtype):
    path, _, written = kept_models(qtype)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    fmt = KEPT_AS[qtype]
    assert gguf_file.kept_expert_format(folder) == quant.GGUF_KEPT[qtype]
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format=fmt)
    for i, layer in enumerate(w.layers):
        for which in ("gate", "up", "down"):
            q, scale = getattr(layer.ffn, which), getattr(layer.ffn, which + "_scale")
            assert q.dtype == (jnp.int8 if fmt.startswith("int8") else jnp.uint8) and scale.dtype == jnp.float32
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            got = np.asarray(quant.dequantize_engine_grouped(q, scale, jnp.float32))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            host = quant.kept_dequantize(np.asarray(q), quant.pool_scale(np.asarray(scale)))
            np.testing.assert_array_equal(host.view(np.uint32), want.view(np.uint32))


PLACEMENTS = [dict(expert_cache_slots="all"), dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2),
              dict(expert_cache_slots="3", pcie_frac="1")]


@pytest.mark.parametrize("qtype,placement", [("Q8_0", p) for p in PLACEMENTS] + [
    (t, PLACEMENTS[1]) for t in ("Q4_0", "Q4_1", "Q5_K", "Q2_K")] + [  # Q6_K / Q3_K's int8-g16: the IQ rows
    (t, PLACEMENTS[0]) for t in ("IQ2_XS", "IQ3_S")] + [(t, PLACEMENTS[1]) for t in IQ_D])
def test_logits_equal_the_dequantized_model(kept_models, engine_factory, cache_dir, qtype, placement, capfd):
    path, dequantized, _ = kept_models(qtype)
    fmt = KEPT_AS[qtype]
    ref = engine_factory(dequantized, **EXACT)
    by_name = {} if fmt == quant.GGUF_KEPT[qtype] else dict(expert_dtype=fmt)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **placement,
                                    **by_name)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == fmt
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    bits = quant.get_format(fmt).bits_per_weight(256)
    assert f"experts {qtype} (" in line and f"-> {fmt} ({bits:.2f} bpw: {qtype}'s blocks as stored)" in line, line
    assert f"packed on the device: the experts ({fmt})" in line, line
    assert f"experts: {fmt}, GGUF " in err, err
    if placement.get("pcie_frac") == "0.5":
        assert engine.placement.pool.store.format == {"int4-g32f": "int4", "int4-g32m": "int4-m"}.get(fmt, "int8-g")
    assert rel_fro(engine.prefill_logits(IDS), ref.prefill_logits(IDS)) < 1e-5
    assert engine.generate(IDS, max_new_tokens=4) == ref.generate(IDS, max_new_tokens=4)


def test_mixed_types_and_refusals(kept_models, tmp_path, cache_dir):
    """Experts of types no one format holds (Q8_0 gate/up, Q6_K down) are kept per family under auto
    (int8-g32/int6-q6k: tests/io/test_gguf_mixed.py), and expert_dtype=int8-g32 keeps the Q8_0 stacks, requantizing
    the rest (the line says so); a format whose groups do not divide the experts' widths is one line; a type no
    reader handles is one line naming it (test_gguf)."""
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
    hub = test_gguf.stacked(random_checkpoint(raw, seed=41), 1, 4)
    path = tmp_path / "mix.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: (Q.Q6_K if "down_exps" in g else Q.Q8_0)
                                   if "_exps" in g else Q.F32,
                                   encoder=lambda x, t: quant.gguf_blocks_random("Q6_K", x.shape, 5, D["Q6_K"])
                                   if t == Q.Q6_K else test_gguf.encode(x, t))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == "int8-g32/int6-q6k"
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    line = gguf_file.formats_line(source, "bfloat16", "int8-g32")
    assert "-> int8-g32 (9.00 bpw: Q8_0's blocks as stored, the other types requantized at load" in line, line
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format="int8-g32")
    ffn = w.layers[0].ffn
    np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_grouped(ffn.gate, ffn.gate_scale, jnp.float32)),
                                  written["model.layers.0.mlp.experts.gate_proj.weight"])
    down = np.asarray(quant.dequantize_engine_grouped(ffn.down, ffn.down_scale, jnp.float32))
    assert 0 < rel_fro(down, written["model.layers.0.mlp.experts.down_proj.weight"]) < 0.02
    with pytest.raises(ValueError, match="groups of 32 inputs: the experts' widths 256 and 48"):
        quant.engine_format("int8-g32", (256, 48))


def test_saved_state_keeps_the_blocks(kept_models, engine_factory, tmp_path, cache_dir):
    """--save_state of kept Q8_0 experts saves q and the float32 scales; the state restores with
    expert_dtype=int8-g32 (offloaded: the pool gets them too) to the same logits."""
    path, _, _ = kept_models("Q8_0")
    src = engine_factory(path, **EXACT)
    state = tmp_path / "state"
    src.save_state(state)
    back = Engine.from_pretrained(state, verbose=False, cache_dir=str(cache_dir), dtype="float32",
                                  expert_cache_slots="3", pcie_frac="0.5", expert_dtype="int8-g32")
    assert back.placement.pool.store.format == "int8-g"
    assert rel_fro(back.prefill_logits(IDS), src.prefill_logits(IDS)) < 1e-5


def test_iq_families(kept_models, engine_factory, cache_dir, capfd):
    """IQ2_XS gate/up beside IQ3_S down (an IQ file's mix of types): each family kept as read in its own format
    (int8-g16/int8-g32) under auto, the values gguf's bit for bit, the logits the dequantized checkpoint's with the
    experts offloaded to the pool."""
    path, dequantized, written = kept_models("IQ2_XS/IQ3_S")
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == "int8-g16/int8-g32"
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format="int8-g16/int8-g32")
    for which in ("gate", "down"):
        ffn = w.layers[1].ffn
        got = quant.dequantize_engine_grouped(getattr(ffn, which), getattr(ffn, which + "_scale"), jnp.float32)
        want = written[f"model.layers.1.mlp.experts.{which}_proj.weight"]
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    ref = engine_factory(dequantized, **EXACT)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **PLACEMENTS[1])
    line = next(l for l in capfd.readouterr().err.splitlines() if l.startswith("gguf:"))
    assert "experts gate/up IQ2_XS (" in line and "-> int8-g16 (10.00 bpw: IQ2_XS's blocks as stored)" in line, line
    assert "experts down IQ3_S (" in line and "-> int8-g32 (9.00 bpw: IQ3_S's blocks as stored)" in line, line
    assert engine.options.expert_dtype == "int8-g16/int8-g32"
    assert rel_fro(engine.prefill_logits(IDS), ref.prefill_logits(IDS)) < 1e-5


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_K", "IQ2_XS"])
def test_kept_experts_under_the_kernel_scan_offloaded(kept_models, engine_factory, cache_dir, monkeypatch, qtype):
    """The GGUF's kept experts offloaded to 3 slots with expert_kernel=pallas (bf16, interpret mode on the CPU; the
    engine's GPU-only check passed here as test_quant does): the scanned offload graph, the kernel reading the
    float32 group scales (and minima) by window position, fetches and the pool's C kernel (FMT_INT8G / FMT_INT8GM),
    within bf16 rounding of all resident through the XLA path."""
    path, _, _ = kept_models(qtype)
    gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, IDS, np.int8, np.int8, "int8-g")
