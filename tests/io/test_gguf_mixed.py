"""Per-family expert formats (issue 36: the GGUF files users have). A Q4_K_M Qwen3-MoE GGUF holds its expert gate
and up stacks Q4_K and its down stacks Q6_K (some layers' down Q4_K): expert_dtype=auto keeps each family in the
format holding its type as read ("int4-q4k/int6-q6k"), a family of mixed K types in int6-q6km, other mixes in
int8-g16m, each holding their values exactly (one int8-g16m cannot hold: in the format of most of its weights, the
others requantized). A tiny GGUF written with gguf's writer (Q4_K blocks by quant.q4k_blocks,
Q6_K as random valid blocks, quant.gguf_blocks_random; Q8_0 by gguf.quants.quantize), the rest F32: the engine's
weights equal gguf.quants.dequantize per family bit for bit, and its logits equal those of a safetensors checkpoint
of the dequantized values (float32, within 1e-5), resident and offloaded, with the same greedy tokens."""
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
from strata_jax.model import quant
from strata_jax.model.config import load_config

EXACT = dict(dtype="float32", expert_cache_slots="all")
IDS = test_gguf.IDS
D = {"Q6_K": 0.05 / 4000, "Q3_K": 0.05 / 128, "Q5_K": 0.05 / 2000}  # random blocks: |w| ~ 0.05
HELD = {"Q6_K": "int4-q4k/int6-q6k", "Q8_0": "int4-q4k/int8-g32"}


def write_mixed_model(tmp, down_types: tuple[str, ...], seed: int = 51):
    """A 2-layer GGUF with Q4_K gate/up experts and layer l's down experts of down_types[l]: (the GGUF, a
    safetensors folder of its dequantized values, the written values by Hub name)."""
    raw, hub = test_gguf.block_checkpoint(seed)
    counter = iter(range(1000))

    def encode(x, t):
        if t == Q.Q4_K:
            return quant.q4k_blocks(x)
        if t.name in D:
            return quant.gguf_blocks_random(t.name, x.shape, seed=seed * 1000 + next(counter), d_scale=D[t.name])
        return test_gguf.encode(x, t)

    def types(g: str) -> Q:
        if "_exps" not in g:
            return Q.F32
        return Q[down_types[int(g.split(".")[1])]] if "down_exps" in g else Q.Q4_K

    path = tmp / f"mixed-{'-'.join(down_types)}.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=types, encoder=encode)
    dequantized = test_gguf.dequantized_folder(tmp, raw, written)
    return path, dequantized, written


@pytest.fixture(scope="module")
def mixed_models(tmp_path_factory):
    """{down type: write_mixed_model's triple} (every layer's down of that type; a pair: layer l's down of type l),
    written on first use."""
    made = {}

    def get(down_type):
        if down_type not in made:
            types = down_type if isinstance(down_type, tuple) else (down_type,) * 2
            made[down_type] = write_mixed_model(tmp_path_factory.mktemp("-".join(types)), types)
        return made[down_type]
    return get


def dequantized(q, scale):
    """The engine's weights of one stack in its own format, float32."""
    deq = quant.dequantize_engine_int4 if q.dtype == jnp.uint8 else quant.dequantize_engine_grouped
    return np.asarray(deq(q, scale, jnp.float32))


@pytest.mark.parametrize("down_type", ["Q6_K", "Q8_0"])
def test_families_are_kept_and_dequantize_to_gguf_values(mixed_models, cache_dir, down_type):
    path, _, written = mixed_models(down_type)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    fmt = HELD[down_type]
    assert gguf_file.kept_expert_format(folder) == fmt
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format=fmt)
    for i, layer in enumerate(w.layers):
        ffn = layer.ffn
        assert ffn.gate.dtype == ffn.up.dtype == jnp.uint8 and ffn.gate_scale.dtype == jnp.uint16
        if down_type == "Q6_K":  # packed: uint8 q, uint8 codes
            assert ffn.down.dtype == ffn.down_scale.dtype == jnp.uint8
        else:
            assert ffn.down.dtype == jnp.int8 and ffn.down_scale.dtype == jnp.float32
        for which in ("gate", "up", "down"):
            got = dequantized(getattr(ffn, which), getattr(ffn, which + "_scale"))
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


PLACEMENTS = [dict(expert_cache_slots="all"), dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2),
              dict(expert_cache_slots="3", pcie_frac="1")]


@pytest.mark.parametrize("down_type,placement", [("Q6_K", p) for p in PLACEMENTS[:2]] + [("Q8_0", PLACEMENTS[1])])
def test_logits_equal_the_dequantized_model(mixed_models, engine_factory, cache_dir, down_type, placement, capfd):
    path, deq_folder, _ = mixed_models(down_type)
    fmt = HELD[down_type]
    down_fmt = quant.family_formats(fmt)[1]
    ref = engine_factory(deq_folder, **EXACT)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **placement)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == fmt
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    down_bits = quant.get_format(down_fmt).bits_per_weight(256)
    assert "experts gate/up Q4_K (4.50 bpw) -> int4-q4k (4.62 bpw: Q4_K's blocks as stored)" in line, line
    assert f"experts down {down_type} (" in line and (
        f"-> {down_fmt} ({down_bits:.2f} bpw: {down_type}'s blocks as stored)") in line, line
    assert f"packed on the device: the experts ({fmt})" in line, line
    assert f"experts: gate/up int4-q4k, GGUF Q4_K's blocks" in err and f"; down {down_fmt}, GGUF " in err, err
    if placement.get("expert_cache_slots") == "3":
        state = engine.cache.experts
        from strata_jax.offload.slots import layer_states
        first = layer_states(state)[0]
        assert first.gate.dtype == np.uint8 and first.down.dtype == (np.uint8 if down_fmt == quant.Q6K else np.int8)
    if placement.get("pcie_frac") == "0.5":
        store, held = engine.placement.pool.store, down_fmt if down_fmt == quant.Q6K else "int8-g"
        assert store.format == f"int4-q4k/{held}" and store.format_of("down") == held
    assert rel_fro(engine.prefill_logits(IDS), ref.prefill_logits(IDS)) < 1e-5
    assert engine.generate(IDS, max_new_tokens=4) == ref.generate(IDS, max_new_tokens=4)


def held_mix(tmp, down_types: tuple[str, str], cache_dir, fmt: str):
    """write_mixed_model's GGUF of these down types: (its start-up line, its weights in `fmt`, the written values),
    fmt being what expert_dtype=auto chose."""
    path, _, written = write_mixed_model(tmp, down_types)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == fmt
    line = gguf_file.formats_line(json.loads((folder / gguf_file.SOURCE_FILE).read_text()), "bfloat16", fmt)
    return line, checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format=fmt), written


def test_a_family_of_mixed_types_is_widened(tmp_path, cache_dir):
    """Q4_K_M's down stacks of layers Q6_K and Q4_K: the down family is held in int6-q6km (a scale and a minimum per
    16 inputs, q + 32 in 6 bits), which holds both K types' values exactly; gate/up stay int4-q4k. A mix of a K type
    and another (Q8_0 beside Q6_K) in int8-g16m, which holds both exactly too. A mix neither holds (Q4_0 beside
    Q6_K) is held in the format of most of its weights, the other stack requantized (close, not exact)."""
    (tmp_path / "q4_0").mkdir()
    (tmp_path / "q8_0").mkdir()
    line, w, written = held_mix(tmp_path, ("Q6_K", "Q4_K"), cache_dir, "int4-q4k/int6-q6km")
    assert ("experts down Q4_K+Q6_K (" in line and "-> int6-q6km (7.12 bpw: Q4_K+Q6_K's values as read, q + 32 in "
            "6 bits, a scale and a minimum per 16 inputs)") in line, line
    for i in range(2):
        ffn = w.layers[i].ffn
        assert ffn.down.dtype == ffn.down_scale.dtype == jnp.uint8 and ffn.down_scale.shape[-2] == 9 * 256 // 64
        for which in ("gate", "up", "down"):
            np.testing.assert_array_equal(dequantized(getattr(ffn, which), getattr(ffn, which + "_scale")),
                                          written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"])

    line, w, written = held_mix(tmp_path / "q8_0", ("Q6_K", "Q8_0"), cache_dir, "int4-q4k/int8-g16m")
    assert ("experts down Q6_K+Q8_0 (" in line and "-> int8-g16m (12.00 bpw: Q6_K+Q8_0's values as read, a scale "
            "and a minimum per 16 inputs)") in line, line
    for i in range(2):
        ffn = w.layers[i].ffn
        assert ffn.down.dtype == jnp.int8
        for which in ("gate", "up", "down"):
            np.testing.assert_array_equal(dequantized(getattr(ffn, which), getattr(ffn, which + "_scale")),
                                          written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"])

    line, w, written = held_mix(tmp_path / "q4_0", ("Q6_K", "Q4_0"), cache_dir, "int4-q4k/int6-q6k")
    assert ("experts down Q4_0+Q6_K (" in line and "-> int6-q6k (6.56 bpw: Q6_K's blocks as stored, the other "
            "types requantized at load from their values)") in line, line
    down = [dequantized(w.layers[i].ffn.down, w.layers[i].ffn.down_scale) for i in range(2)]
    want = [written[f"model.layers.{i}.mlp.experts.down_proj.weight"] for i in range(2)]
    np.testing.assert_array_equal(down[0], want[0])
    assert 0 < rel_fro(down[1], want[1]) < 0.02


def test_k_type_mixes_take_int6_q6km():
    """expert_dtype=auto per family: mixed K types (Q3_K_M's down: Q3_K, Q4_K, Q5_K) -> int6-q6km; one K type stays
    in its own format; Q3_K beside Q6_K stays int6-q6k (no minima needed); a mix with a non-K type as before. A GGUF
    whose down stacks are Q3_K and Q5_K is held so, its weights gguf's values."""
    one = [1000, 500]
    assert gguf_file.family_format({"Q3_K": one, "Q4_K": one, "Q5_K": one}) == quant.Q6KM
    assert gguf_file.family_format({"Q2_K": one, "Q4_K": one}) == quant.Q6KM
    assert [gguf_file.family_format({t: one}) for t in ("Q4_K", "Q6_K", "Q3_K", "Q2_K", "Q5_K")] == [
        quant.Q4K, quant.Q6K, quant.Q6K, quant.Q2K, "int8-g32m"]
    assert gguf_file.family_format({"Q3_K": one, "Q6_K": one}) == quant.Q6K
    assert gguf_file.family_format({"Q5_K": one, "Q8_0": one}) == "int8-g16m"


def test_a_q3k_q5k_down_family_is_held_in_int6_q6km(mixed_models, cache_dir):
    path, _, written = mixed_models(("Q3_K", "Q5_K"))
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == "int4-q4k/int6-q6km"
    w = checkpoint.load_weights(folder, load_config(folder), jnp.float32, expert_format="int4-q4k/int6-q6km")
    for i, layer in enumerate(w.layers):
        assert layer.ffn.down.dtype == layer.ffn.down_scale.dtype == jnp.uint8
        got = dequantized(layer.ffn.down, layer.ffn.down_scale)
        want = written[f"model.layers.{i}.mlp.experts.down_proj.weight"]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("placement", PLACEMENTS[:2])
def test_q4k_q6k_down_mix_logits_equal_the_dequantized_model(mixed_models, engine_factory, cache_dir, placement,
                                                             capfd):
    """Down stacks Q6_K in layer 0, Q4_K in layer 1 (int6-q6km) beside Q4_K gate/up: float32 logits equal the
    dequantized checkpoint's, resident and offloaded (the slots, PCIe fetches and the pool's C kernel); the
    experts' start-up line says they are read as stored."""
    path, deq_folder, _ = mixed_models(("Q6_K", "Q4_K"))
    ref = engine_factory(deq_folder, **EXACT)
    engine = Engine.from_pretrained(path, cache_dir=str(cache_dir), dtype="float32", verbose=True, **placement)
    line = next(ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("experts: "))
    assert "; down int6-q6km, " in line and "(read as stored or quantized at load)" in line, line
    assert engine.options.expert_dtype == "int4-q4k/int6-q6km"
    if placement.get("pcie_frac") == "0.5":
        store = engine.placement.pool.store
        assert store.format == "int4-q4k/int6-q6km" and store.minima_of("down")
        from strata_jax.offload.slots import layer_states
        assert layer_states(engine.cache.experts)[0].down.dtype == np.uint8
    assert rel_fro(engine.prefill_logits(IDS), ref.prefill_logits(IDS)) < 1e-5
    assert engine.generate(IDS, max_new_tokens=4) == ref.generate(IDS, max_new_tokens=4)


def test_each_family_takes_its_own_width():
    """A family's format needs only its own input width to fit (gate / up read the hidden size, down the
    intermediate one): llama-quantize's Q2_K of experts 96 wide keeps gate/up Q2_K and falls back to Q4_0 for down,
    and the engine holds each as read; one format for both still needs both widths."""
    assert quant.engine_format("int2-q2k/int4-g32f", (256, 96)) == "int2-q2k/int4-g32f"
    assert quant.engine_format("int4-q4k/int8-g32", (256, 96)) == "int4-q4k/int8-g32"
    with pytest.raises(ValueError, match="widths 256 and 96 are not multiples of 256"):
        quant.engine_format("int2-q2k", (256, 96))
    with pytest.raises(ValueError, match="width"):
        quant.engine_format("int8-g32/int2-q2k", (256, 96))


def test_q4k_q6km_families_under_the_kernel_scan_offloaded(mixed_models, engine_factory, cache_dir, monkeypatch):
    """Q4_K gate/up beside a Q6_K/Q4_K down family (int4-q4k/int6-q6km) offloaded with expert_kernel=pallas: the
    kernel's int6 form with minima in the scanned offload graph, within bf16 rounding of the XLA path."""
    path, _, _ = mixed_models(("Q6_K", "Q4_K"))
    gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, IDS, np.uint8, np.uint8,
                              "int4-q4k/int6-q6km")
