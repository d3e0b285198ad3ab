"""The engine format "int6-q6km" (strata_jax/model/quant.py): int6-q6k with a minimum per 16 inputs, w = (d sc)
(q - 32) - (dmin m), which holds each GGUF K type's values unchanged, so a family whose layers mix K types (a Q4_K_M
file's down experts: Q4_K and Q6_K) is held packed at 7.125 bits a weight."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from helpers import assert_blocks_are, block_writer_round_trip
from strata_jax.model import quant

# where each K type's fp16 d and dmin sit in its block (Q6_K and Q3_K: d only)
HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("qtype", quant.K_TYPES)
def test_k_types_held_in_int6_q6km_exactly(qtype):
    """Random valid blocks of each K type (every bit random; d and dmin of both signs, tiny to large) converted by
    q6km_from_blocks dequantize (numpy, and on the device) to gguf.quants.dequantize's float32 values bit for bit."""
    size = quant.GGUF_BLOCKS[qtype][1]
    for k, (shape, d_scale) in enumerate([((3, 8, 512), 1e-3), ((2, 256), 3e3), ((4, 768), 1e-6)]):
        raw = quant.gguf_blocks_random(qtype, shape, seed=70 + k, d_scale=d_scale)
        blocks = raw.reshape(*shape[:-1], -1, size)
        for j, at in enumerate(HALVES[qtype]):  # negative d (and dmin) in some blocks
            blocks[..., j::2, at + 1] ^= 0x80
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        assert np.isfinite(want).all() and np.count_nonzero(want) > want.size // 2 and (want < 0).any()
        packed, codes = quant.q6km_from_blocks(raw, qtype)
        assert packed.shape == (*shape[:-1], shape[-1] * 3 // 4) and codes.shape == (*shape[:-1], shape[-1] * 9 // 64)
        np.testing.assert_array_equal(quant.q6k_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
        assert_blocks_are(packed, codes, want, quant.Q6KM)
        assert quant.keeps(quant.Q6KM, qtype) and quant.holds(quant.Q6KM, qtype)


def test_q6km_format_and_its_quantizer():
    """7.125 bits a weight; q stored as int6-q6k's (3/4 of a byte an input, slot storage Q6K); codes told apart from
    int6-q6k's and int2-q2k's by width; quantize and the device quantizer make Q6_K's numbers with m = 0."""
    fmt = quant.get_format(quant.Q6KM)
    assert fmt.bits_per_weight(512) == 7.125 and quant.Q6KM in quant.ENGINE_FORMATS
    storage = quant.slot_storage(quant.Q6KM)
    assert storage == quant.Q6K and quant.stored_in_dim(512, storage) == 384
    assert quant.engine_format(quant.Q6KM, (256, 512)) == quant.Q6KM
    with pytest.raises(ValueError, match="int6-q6km holds the K types' super-blocks of 256"):
        quant.engine_format(quant.Q6KM, (256, 384))
    # per row of 512 inputs: packed 384 bytes; codes q6k 36, q6km 72, q2k (packed 128) 40
    assert [quant.block_format(np.uint8, p, c) for p, c in ((384, 36), (384, 72), (128, 40))] == [
        quant.Q6K, quant.Q6KM, quant.Q2K]
    with pytest.raises(ValueError, match="no block format's"):
        quant.block_format(np.uint8, 384, 50)
    w, _, qa = block_writer_round_trip(np.random.default_rng(9), quant.Q6KM, quant.q6k_blocks, "Q6_K")
    assert qa.scale.shape == (3, 8, 72)
    s, mn = quant.q6km_scales(qa.scale)
    assert not mn.any() and np.array_equal(s, quant.q6k_scales(quant.q6k_from_blocks(quant.q6k_blocks(w))[1]))
    assert not quant.keeps(quant.Q6KM, "Q8_0") and not quant.holds(quant.Q6KM, "Q4_0")
    with pytest.raises(ValueError, match="int6-q6km holds the K types"):
        quant.q6km_from_blocks(np.zeros((2, 34), np.uint8), "Q8_0")
