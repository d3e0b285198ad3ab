"""int6-q6km held packed in the host store: int6-q6k's q (quant.pack_int6) with codes kept as per-row 36-byte
super-block records (store.py `block_records(fmt="int6-q6km")`: fp16 d, fp16 dmin, the 16 int8 sc, the 16 uint8 m),
7.125 bits a weight, decoded where the pool reads them (native_experts.c `q6km_record` a row at a time; numpy
`q6k_records_scales(minima=True)` a chunk at a time); each weight fma(q - 32, s, -mn) in int2-q2k's dot loop."""


import gguf
import numpy as np
import pytest

from helpers import KERNEL_BUILDS, pool_error_float32, rng_for, use_kernel_build
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

E, H, I = 3, 512, 256  # whole super-blocks of 256


def make_layer(rng, qtypes=("Q4_K", "Q5_K", "Q6_K"), fmt=quant.Q6KM):
    """Random valid blocks of qtypes (gate, up, down) -> (gguf.quants.dequantize's float32 weights, the store's layer
    tuple (q, q, q, codes x 3) in `fmt`: int6-q6km, or the type's own block format)."""
    own = {"Q2_K": quant.q2k_from_blocks, "Q6_K": quant.q6k_from_blocks}
    weights, stored = [], []
    for qtype, shape in zip(qtypes, ((E, I, H), (E, I, H), (E, H, I))):
        d = {"Q2_K": 2e-3, "Q3_K": 1e-3, "Q4_K": 5e-4, "Q5_K": 2e-4, "Q6_K": 1e-4}[qtype]  # |w| ~ 0.1
        raw = quant.gguf_blocks_random(qtype, shape, seed=int(rng.integers(1 << 30)), d_scale=d)
        weights.append(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
        stored.append(quant.q6km_from_blocks(raw, qtype) if fmt == quant.Q6KM else own[qtype](raw))
    return weights, (*(q for q, _ in stored), *(c for _, c in stored))


def test_store_holds_q6km_records():
    _, layer = make_layer(rng_for("q6km-bits"))
    store = store_module.HostExpertStore([layer, layer])
    assert store.format == "int6-q6km" and store.minima and store.int6("down") and store.inputs_per_byte("up") == 4 / 3
    assert store.gate_scale[0].shape == (E, I, H // 256 * 36) and store.group(0, "down") == 16
    weights = 3 * H * I
    assert store.nbytes(1, 0) * 8 / weights == 7.125 and store.total_nbytes * 8 / (2 * E * weights) == 7.125


def test_records_decode_to_the_codes_values():
    """Random code bytes and fp16 d, dmin of all magnitudes and both signs: records and codes decode to q6km_scales'
    float32 bits."""
    rng = rng_for("q6km-records")
    G = 1024 // 16
    groups = rng.integers(0, 256, (5, 7, 2 * G)).astype(np.uint8)
    halves = (rng.standard_normal((5, 7, 2 * G // 16)) * 10.0 ** rng.integers(-7, 3)).astype(np.float16)
    codes = np.concatenate([groups, halves.view(np.uint8)], -1)
    records = store_module.block_records(codes, fmt="int6-q6km")
    assert records.dtype == np.uint8 and records.shape == (5, 7, 4 * 36)
    want = np.concatenate(quant.q6km_scales(codes), -1)
    np.testing.assert_array_equal(store_module.q6k_records_scales(records, minima=True).view(np.uint32),
                                  want.view(np.uint32))
    np.testing.assert_array_equal(store_module.q6k_codes_scales(codes, minima=True).view(np.uint32),
                                  want.view(np.uint32))


def test_chunks_of_the_store_are_gguf_values():
    weights, layer = make_layer(rng_for("q6km-chunks"), ("Q2_K", "Q3_K", "Q4_K"))
    store = store_module.HostExpertStore([layer])
    for which, w in zip(("gate", "up", "down"), weights):
        rows, records = store.expert_rows(which, 0, 2, 5, 200)
        chunks = store_module.row_chunks_f32(rows, records, minima=store.minima_of(which), int6=store.int6(which))
        got = np.concatenate([b.copy() for _, b, _ in chunks])
        np.testing.assert_array_equal(got.view(np.uint32), w[2, 5:200].view(np.uint32))


@pytest.mark.parametrize("T", [1, 5])
def test_pool_is_gguf_weights_times_x(make_pool, pool_path, T):
    """The pool (float32 compute; the C kernel and numpy's chunks: pool_path) against the float64 FFN over gguf's
    weights."""
    rng = rng_for(f"q6km-pool-{T}")
    weights, layer = make_layer(rng)
    pool = make_pool([layer], "float32", threads=2)
    assert pool.store.format == "int6-q6km"
    assert pool_error_float32(pool, weights, rng, T) < 1e-6


@pytest.mark.parametrize("build", KERNEL_BUILDS)
def test_builds_give_int2_q2k_and_int6_q6k_bits(make_pool, monkeypatch, tmp_path, build):
    """In each build (default, AVX2, portable): Q2_K blocks held as int6-q6km (q + 32, the same s and mn) give
    int2-q2k's output bits, Q6_K blocks held as int6-q6km (m = dmin = 0) int6-q6k's (fma(q, s, -0) is q s), float32
    and bf16 compute; and a layer of Q4_K, Q5_K, Q6_K is gguf's weights times x."""
    use_kernel_build(build, monkeypatch, tmp_path)
    rng = rng_for(f"q6km-build-{build}")
    for qtype, own in (("Q2_K", "int2-q2k"), ("Q6_K", "int6-q6k")):
        seed = int(rng.integers(1 << 30))
        (_, mine), (_, theirs) = (make_layer(np.random.default_rng(seed), (qtype,) * 3, fmt)
                                  for fmt in (quant.Q6KM, own))
        for compute in ("float32", None):
            pools = [make_pool([layer], compute, threads=2) for layer in (mine, theirs)]
            assert [p.store.format for p in pools] == ["int6-q6km", own]
            for T in (1, 4, 6):
                x = rng.standard_normal((T, H)).astype(np.float32)
                ids = np.array([2, -1, 0, 1], np.int32)
                w = rng.uniform(0.1, 1.0, (T, ids.size)).astype(np.float32)
                y_mine, y_theirs = (p.compute(0, x, ids, w) for p in pools)
                assert np.abs(y_mine).max() > 0
                np.testing.assert_array_equal(y_mine.view(np.uint32), y_theirs.view(np.uint32))
    weights, layer = make_layer(rng)
    for T in (1, 5):
        assert pool_error_float32(make_pool([layer], "float32", threads=2), weights, rng, T) < 1e-6
