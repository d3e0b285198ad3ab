"""GGUF Q6_K experts kept packed (issue 36: the engine format "int6-q6k", strata_jax/model/quant.py): Q6_K's blocks
re-laid-out at load (pack_int6: per 64 inputs 32 bytes of low nibbles, then 16 of high 2-bit pairs) with uint8 codes
(each group's int8 scale, each super-block's fp16 d as two bytes): 6.5625 bits a weight, the file's own."""
from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import block_writer_round_trip
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
    assert quant.block_format(codes.dtype, packed.shape[-1], codes.shape[-1]) == quant.Q6K
    np.testing.assert_array_equal(quant.q6k_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(quant.blocks_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
    device_codes = jnp.asarray(np.swapaxes(codes, -1, -2))  # group-major [..., 9G/8, O]
    for dequantize in (quant.dequantize_engine_blocks, quant.dequantize_engine_int4):
        dev = np.asarray(dequantize(jnp.asarray(packed), device_codes, jnp.float32))
        np.testing.assert_array_equal(dev.view(np.uint32), want.view(np.uint32))
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


def _encode(x, qtype):
    import test_gguf
    return quant.q6k_blocks(x) if qtype == Q6_K else test_gguf.encode(x, qtype)


@pytest.fixture(scope="module")
def q6k_model(tmp_path_factory):
    """(a GGUF whose experts are Q6_K, a safetensors folder of its dequantized values, the written values)."""
    import test_gguf
    tmp = tmp_path_factory.mktemp("q6k")
    raw, hub = test_gguf.block_checkpoint(61)
    path = tmp / "q6k.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: Q6_K if "_exps" in g else gguf.GGMLQuantizationType.F32,
                                   encoder=_encode)
    return path, test_gguf.dequantized_folder(tmp, raw, written), written


def test_experts_are_kept_packed(q6k_model, cache_dir):
    """expert_dtype=int6-q6k: the loader keeps a Q6_K stack packed (q [E, O, 3I/4], uint8 codes [E, 9G/8, O]) with
    gguf's values; auto still holds Q6_K as int8-g16 (GGUF_KEPT) until the Pallas kernel has int6-q6k's form."""
    from strata_jax.io import checkpoint, gguf_file
    from strata_jax.model.config import load_config
    path, _, written = q6k_model
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    assert gguf_file.kept_expert_format(folder) == "int8-g16"
    cfg = load_config(folder)
    w = checkpoint.load_weights(folder, cfg, jnp.float32, expert_format=quant.Q6K)
    for i, layer in enumerate(w.layers):
        for which in ("gate", "up", "down"):
            q, codes = getattr(layer.ffn, which), getattr(layer.ffn, which + "_scale")
            assert q.dtype == jnp.uint8 and codes.dtype == jnp.uint8 and q.shape[-1] == 256 * 3 // 4
            want = written[f"model.layers.{i}.mlp.experts.{which}_proj.weight"]
            np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_int4(q, codes, jnp.float32)), want)


@pytest.mark.parametrize("placement", [
    dict(expert_cache_slots="all"),
    dict(expert_cache_slots="3", pcie_frac="0.5", cpu_threads=2),
])
def test_logits_equal_the_dequantized_model(q6k_model, engine_factory, cache_dir, placement, capfd):
    """All resident on the CPU (the XLA path: dequantize_engine_q6k) and offloaded through the slots and the host
    pool: the logits of the dequantized checkpoint (float32, 1e-5); the start-up lines say the blocks are kept."""
    from helpers import rel_fro
    from strata_jax import Engine
    from strata_jax.offload.slots import layer_states
    import test_gguf
    path, dequantized, _ = q6k_model
    ref = engine_factory(dequantized, dtype="float32", expert_cache_slots="all").prefill_logits(test_gguf.IDS)
    engine = Engine.from_pretrained(path, verbose=True, cache_dir=str(cache_dir), dtype="float32",
                                    expert_dtype=quant.Q6K, **placement)
    err = capfd.readouterr().err
    assert engine.options.expert_dtype == quant.Q6K
    line = next(l for l in err.splitlines() if l.startswith("gguf:"))
    assert "experts Q6_K (6.56 bpw) -> int6-q6k (6.56 bpw: Q6_K's blocks as stored)" in line, line
    assert "experts: int6-q6k, GGUF Q6_K's blocks" in err, err
    assert rel_fro(engine.prefill_logits(test_gguf.IDS), ref) < 1e-5
    if placement["expert_cache_slots"] != "all":  # the slots and the pool hold the packed form
        assert layer_states(engine.cache.experts)[0].gate.shape[-1] == 256 * 3 // 4
        assert engine.placement.pool.store.format == quant.Q6K
