"""int4-q4k and int2-q2k held packed in the host store (issue 36): their codes kept as per-row super-block records
(store.py `block_records`: fp16 d, dmin, then the groups' codes), the GGUF file's 4.5 / 2.625 bits a weight, decoded
where the pool reads them (native_experts.c a row at a time, `scale_row`; numpy a chunk at a time,
`records_scale_min`) into the same float32 s and mn as `block_scale_min` gives."""


import gguf
import numpy as np
import pytest

from helpers import KERNEL_BUILDS, pool_error_float32, rng_for, use_kernel_build
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

E, H, I = 3, 512, 256  # whole super-blocks of 256
FILE_BITS = {quant.Q4K: 4.5, quant.Q2K: 2.625}  # Q4_K: 144 bytes / 256, Q2_K: 84 / 256
BLOCKS = {quant.Q4K: (quant.q4k_blocks, quant.q4k_from_blocks, gguf.GGMLQuantizationType.Q4_K),
          quant.Q2K: (quant.q2k_blocks, quant.q2k_from_blocks, gguf.GGMLQuantizationType.Q2_K)}


def make_layer(rng, fmt):
    """(gguf.quants.dequantize's float32 weights (gate, up, down), the store's layer tuple (q, q, q, codes x 3))."""
    blocks, from_blocks, qtype = BLOCKS[fmt]
    weights, stored = [], []
    for shape in ((E, I, H), (E, I, H), (E, H, I)):
        w = (rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,)) + 0.01).astype(np.float32)
        raw = blocks(w)
        weights.append(gguf.quants.dequantize(raw, qtype))
        stored.append(from_blocks(raw))
    return weights, (*(q for q, _ in stored), *(c for _, c in stored))


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
def test_store_holds_the_files_bits(fmt):
    _, layer = make_layer(rng_for(f"packed-bits-{fmt}"), fmt)
    store = store_module.HostExpertStore([layer, layer])
    assert store.format == fmt and all(s.dtype == np.uint8 for s in (store.gate_scale[0], store.down_scale[1]))
    weights = 3 * H * I
    for expert in range(E):
        assert store.nbytes(1, expert) * 8 / weights == FILE_BITS[fmt]
    assert store.total_nbytes * 8 / (2 * E * weights) == FILE_BITS[fmt]


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
def test_records_decode_to_the_codes_values(fmt):
    """Every code value (random 12-bit / 8-bit codes, fp16 d and dmin of all magnitudes): the records decode to
    block_scale_min's float32 bits."""
    rng = rng_for(f"packed-records-{fmt}")
    q4k = fmt == quant.Q4K
    G = 1024 // (32 if q4k else 16)
    group_codes = rng.integers(0, 4096 if q4k else 256, (5, 7, G)).astype(np.uint16 if q4k else np.uint8)
    halves = (rng.standard_normal((5, 7, 2 * (G // (8 if q4k else 16)))) * 10.0 ** rng.integers(-7, 3)).astype(
        np.float16)
    codes = np.concatenate([group_codes, halves.view(np.uint16 if q4k else np.uint8)], -1)
    records = store_module.block_records(codes)
    assert records.dtype == np.uint8 and records.shape == (5, 7, 1024 // 256 * (16 if q4k else 20))
    want = store_module.block_scale_min(codes)
    np.testing.assert_array_equal(store_module.records_scale_min(records, int2=not q4k).view(np.uint32),
                                  want.view(np.uint32))


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
def test_chunks_of_the_store_are_gguf_values(fmt, pool_path):
    weights, layer = make_layer(rng_for(f"packed-chunks-{fmt}"), fmt)
    store = store_module.HostExpertStore([layer])
    for which, w in zip(("gate", "up", "down"), weights):
        rows, records = store.expert_rows(which, 0, 2, 5, 200)
        chunks = store_module.row_chunks_f32(rows, records, minima=True, int2=store.inputs_per_byte(which) == 4)
        np.testing.assert_array_equal(np.concatenate([b.copy() for _, b, _ in chunks]), w[2, 5:200])


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
@pytest.mark.parametrize("T", [1, 3, 6])
def test_pool_is_gguf_weights_times_x(make_pool, pool_path, fmt, T):
    """The pool (float32 compute) against the float64 FFN over gguf.quants.dequantize's float32 weights."""
    rng = rng_for(f"packed-pool-{fmt}-{T}")
    weights, layer = make_layer(rng, fmt)
    assert pool_error_float32(make_pool([layer], "float32", threads=2), weights, rng, T) < 1e-6


@pytest.mark.parametrize("build", KERNEL_BUILDS)
def test_q4k_records_give_the_float_scales_bits(make_pool, monkeypatch, tmp_path, build):
    """The C kernel on int4-q4k's records (decoded a row at a time, native_experts.c scale_row) and on the same
    weights held as int4-m's float32 scale rows (block_scale_min, the former store's form): the same bits, in the
    default build, the AVX2 one and the portable fallback (each built here, as test_host_pool_native's plain build
    test does: native._compile, then native.experts_kernel patched)."""
    use_kernel_build(build, monkeypatch, tmp_path)
    rng = rng_for(f"packed-float-bits-{build}")
    _, layer = make_layer(rng, quant.Q4K)
    held = (*layer[:3], *(store_module.block_scale_min(c).reshape(*c.shape[:2], 2, -1) for c in layer[3:]))
    for compute in ("float32", "bfloat16"):
        pools = [make_pool([layer], compute if compute == "float32" else None, threads=2),
                 make_pool([held], compute if compute == "float32" else None, threads=2)]
        assert [p.store.format for p in pools] == ["int4-q4k", "int4-m"]
        for T in (1, 2, 4, 6):
            x = rng.standard_normal((T, H)).astype(np.float32)
            for values in (x, (x.view(np.uint32) & 0xFFFF0000).view(np.float32)):  # float32, and bf16 values
                ids = np.array([2, -1, 0, 1], np.int32)
                w = rng.uniform(0.1, 1.0, (T, ids.size)).astype(np.float32)
                y_records, y_held = (p.compute(0, values, ids, w) for p in pools)
                np.testing.assert_array_equal(y_records.view(np.uint32), y_held.view(np.uint32))
