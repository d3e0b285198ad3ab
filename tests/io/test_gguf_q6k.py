"""GGUF Q6_K experts kept packed (issue 36: the engine format "int6-q6k", strata_jax/model/quant.py): Q6_K's blocks
re-laid-out at load (pack_int6: per 64 inputs 32 bytes of low nibbles, then 16 of high 2-bit pairs) with uint8 codes
(each group's int8 scale, each super-block's fp16 d as two bytes): 6.5625 bits a weight, the file's own."""
from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_blocks_are, block_writer_round_trip
from strata_jax.model import quant

Q6_K = gguf.GGMLQuantizationType.Q6_K


def test_int6_packing_round_trips_and_groups_are_shifts():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 64, (3, 5, 256), dtype=np.uint8)
    packed = quant.pack_int6(q)
    assert packed.shape == (3, 5, 192) and packed.dtype == np.uint8
    np.testing.assert_array_equal(quant.unpack_int6(packed), q)
    chunks = packed.reshape(3, 5, 4, 48)
    for s in range(4):  # group s of each chunk of 64: shifts of contiguous bytes
        lo = (chunks[..., 16 * (s >> 1):16 * (s >> 1) + 16] >> (4 * (s & 1))) & 15
        hi = (chunks[..., 32:] >> (2 * s)) & 3
        np.testing.assert_array_equal(lo | (hi << 4), q.reshape(3, 5, 4, 4, 16)[..., s, :])
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.pack_int6(q[..., :96])


@pytest.mark.parametrize("seed", [5, 6])
def test_q6k_blocks_dequantize_to_gguf_values(seed):
    """Random valid Q6_K blocks (every ql, qh and scale bit random) read into packed q and uint8 codes dequantize
    (numpy, and on the device) to gguf.quants.dequantize's float32 values bit for bit, in the file's bytes."""
    raw = quant.gguf_blocks_random("Q6_K", (3, 8, 512), seed=seed)
    want = gguf.quants.dequantize(raw, Q6_K)
    packed, codes = quant.q6k_from_blocks(raw)
    assert packed.shape == (3, 8, 384) and packed.dtype == np.uint8
    assert codes.shape == (3, 8, 36) and codes.dtype == np.uint8
    assert packed.nbytes + codes.nbytes == raw.nbytes  # the file's bytes, moved
    np.testing.assert_array_equal(quant.q6k_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
    assert_blocks_are(packed, codes, want, quant.Q6K)
    # the same values gguf_kept's int8-g16 held (the one byte a weight form)
    q, s = quant.gguf_kept(raw, "Q6_K")
    np.testing.assert_array_equal(quant.kept_dequantize(q, s), want)
    np.testing.assert_array_equal(quant.q6k_scales(codes), s)


def test_q6k_blocks_of_float_weights():
    """q6k_blocks writes bytes gguf reads; quantize and the device quantizer make the same numbers, within half a
    step of the weights; 6.5625 bits a weight, storage 3/4 of a byte an input."""
    w, want, qa = block_writer_round_trip(np.random.default_rng(7), quant.Q6K, quant.q6k_blocks, "Q6_K")
    s = quant.q6k_scales(qa.scale)
    assert np.all(np.abs(want - w) <= np.repeat(s, 16, axis=-1) * 0.5 + 1e-6 + np.abs(w) * 1e-6)
    assert quant.get_format(quant.Q6K).bits_per_weight(512) == 6.5625
    assert quant.slot_storage(quant.Q6K) == quant.Q6K and quant.stored_in_dim(512, quant.Q6K) == 384
    assert quant.engine_format(quant.Q6K, (256, 512)) == quant.Q6K


def test_q3k_blocks_held_in_int6_q6k_exactly():
    """Q3_K (d (sc - 32) q, q in -4..3) held in int6-q6k's form (q + 32, sc - 32 as the int8 scale): random valid
    Q3_K blocks (d from tiny to large, both signs) dequantize (numpy, and on the device) to gguf.quants.dequantize's
    float32 values bit for bit."""
    for k, (shape, d_scale) in enumerate([((3, 8, 512), 0.05 / 128), ((2, 256), 3e3), ((4, 768), 1e-6)]):
        raw = quant.gguf_blocks_random("Q3_K", shape, seed=40 + k, d_scale=d_scale)
        if k == 0:  # negative d in half the blocks
            raw.reshape(*shape[:-1], -1, 110)[..., ::2, 109] ^= 0x80
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q3_K)
        assert np.isfinite(want).all() and np.count_nonzero(want) > want.size // 2
        packed, codes = quant.q6k_from_q3k_blocks(raw)
        assert packed.shape == (*shape[:-1], shape[-1] * 3 // 4) and codes.shape == (*shape[:-1], shape[-1] * 9 // 128)
        np.testing.assert_array_equal(quant.q6k_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
        assert_blocks_are(packed, codes, want, quant.Q6K)
    assert quant.GGUF_KEPT["Q3_K"] == quant.GGUF_KEPT["Q6_K"] == quant.Q6K
    assert quant.keeps("int8-g16", "Q3_K") and quant.keeps(quant.Q6K, "Q3_K") and not quant.keeps(quant.Q6K, "Q4_K")


# The files: every expert Q6_K; every expert Q3_K; and down experts Q3_K in layer 0, Q6_K in layer 1 beside Q6_K
# gate / up (as llama-quantize's Q2_K / Q3_K_M files mix them): auto holds each in int6-q6k, one form
MODELS = {"Q6_K": lambda g: "Q6_K", "Q3_K": lambda g: "Q3_K",
          "Q3_K+Q6_K": lambda g: "Q3_K" if "blk.0.ffn_down" in g else "Q6_K"}


def _encode(x, qtype):
    if qtype == gguf.GGMLQuantizationType.Q3_K:
        return quant.gguf_blocks_random("Q3_K", x.shape, seed=int(abs(x).sum() * 1e3) % 2**31, d_scale=0.05 / 128)
    import test_gguf
    return quant.q6k_blocks(x) if qtype == Q6_K else test_gguf.encode(x, qtype)


@pytest.fixture(scope="module")
def q6k_models(tmp_path_factory):
    """{name: (a GGUF whose experts are of MODELS[name]'s types, a safetensors folder of its dequantized values,
    the written values)}, written on first use."""
    import test_gguf
    made = {}

    def get(name):
        if name not in made:
            tmp = tmp_path_factory.mktemp(name.replace("+", "-"))
            raw, hub = test_gguf.block_checkpoint(61)
            path = tmp / "experts.gguf"
            types = lambda g: getattr(gguf.GGMLQuantizationType, MODELS[name](g)) if "_exps" in g else \
                gguf.GGMLQuantizationType.F32
            written = test_gguf.write_gguf(path, raw, hub, types=types, encoder=_encode)
            made[name] = path, test_gguf.dequantized_folder(tmp, raw, written), written
        return made[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_experts_are_kept_packed(q6k_models, cache_dir, name):
    """expert_dtype=auto holds Q6_K, Q3_K and a family mixing them in int6-q6k: the loader keeps each stack packed
    (q [E, O, 3I/4], uint8 codes [E, 9G/8, O]) with gguf's values."""
    from strata_jax.io import checkpoint, gguf_file
    from strata_jax.model.config import load_config
    path, _, written = q6k_models(name)
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == quant.Q6K
    cfg = load_config(folder)
    w = checkpoint.load_weights(folder, cfg, jnp.float32, expert_format=quant.Q6K)
    for i, layer in enumerate(w.layers):
        for which in ("gate", "up", "down"):
            q, codes = getattr(layer.ffn, which), getattr(layer.ffn, which + "_scale")
            assert q.dtype == jnp.uint8 and codes.dtype == jnp.uint8 and q.shape[-1] == 256 * 3 // 4
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_int4(q, codes, jnp.float32)), want)


@pytest.mark.parametrize("name,placement", [
    ("Q6_K", dict(expert_cache_slots="all")),
    ("Q3_K+Q6_K", dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2)),
])
def test_logits_equal_the_dequantized_model(q6k_models, engine_factory, cache_dir, name, placement, capfd):
    """expert_dtype=auto, all resident on the CPU (the XLA path: dequantize_engine_q6k) and offloaded through the
    slots and the host pool: the logits of the dequantized checkpoint (float32, 1e-5); the start-up lines say the
    blocks are kept."""
    from helpers import rel_fro
    from strata_jax import Engine
    from strata_jax.offload.slots import layer_states
    import test_gguf
    path, dequantized, _ = q6k_models(name)
    ref = engine_factory(dequantized, dtype="float32", expert_cache_slots="all").prefill_logits(test_gguf.IDS)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32", **placement)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == quant.Q6K
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    if name == "Q6_K":
        assert "experts Q6_K (6.56 bpw) -> int6-q6k (6.56 bpw: Q6_K's blocks as stored)" in line, line
    else:
        assert "-> int6-q6k (6.56 bpw: Q3_K+Q6_K's values as read, in Q6_K's blocks" in line, line
    assert "experts: int6-q6k, GGUF Q6_K's" in err, err
    assert rel_fro(engine.prefill_logits(test_gguf.IDS), ref) < 1e-5
    if placement["expert_cache_slots"] != "all":  # the slots and the pool hold the packed form
        assert layer_states(engine.cache.experts)[0].gate.shape[-1] == 256 * 3 // 4
        assert engine.placement.pool.store.format == quant.Q6K


def test_q6k_experts_under_the_kernel_scan_offloaded(q6k_models, engine_factory, cache_dir, monkeypatch):
    """Q3_K and Q6_K experts held in int6-q6k, offloaded to 3 slots with expert_kernel=pallas (bf16, interpret mode
    on the CPU; the engine's GPU-only check passed here as test_quant does): the scanned offload graph, the kernel
    reading the codes by window position, fetches and the pool's C kernel (FMT_INT6K) in the windows, within bf16
    rounding of all resident through the XLA path."""
    from helpers import gguf_kernel_offload_check
    import test_gguf
    path, _, _ = q6k_models("Q3_K+Q6_K")
    gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, test_gguf.IDS, np.uint8, np.uint8, quant.Q6K)
