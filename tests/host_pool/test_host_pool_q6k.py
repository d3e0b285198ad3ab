"""int6-q6k held packed in the host store (issue 36): GGUF Q6_K's blocks (quant.pack_int6's q, 48 bytes per 64
inputs) with their codes kept as per-row 18-byte super-block records (store.py `block_records(fmt="int6-q6k")`: fp16 d,
then the 16 int8 scales), the file's 6.5625 bits a weight, decoded where the pool reads them (native_experts.c
`q6k_record` a row at a time; numpy `q6k_records_scales` a chunk at a time)."""

import gguf
import numpy as np
import pytest

from helpers import pool_error_float32, rng_for, use_kernel_build
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

E, H, I = 3, 512, 256  # whole super-blocks of 256
Q6_K = gguf.GGMLQuantizationType.Q6_K


def make_layer(rng, random_blocks=False):
    """(gguf.quants.dequantize's float32 weights (gate, up, down), the store's layer tuple (q, q, q, codes x 3))."""
    weights, stored = [], []
    for k, shape in enumerate(((E, I, H), (E, I, H), (E, H, I))):
        if random_blocks:  # every ql, qh and scale bit random
            raw = quant.gguf_blocks_random("Q6_K", shape, seed=int(rng.integers(1 << 30)), d_scale=1e-4)
        else:
            w = (rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,)) + 0.01).astype(np.float32)
            raw = quant.q6k_blocks(w)
        weights.append(gguf.quants.dequantize(raw, Q6_K))
        stored.append(quant.q6k_from_blocks(raw))
    return weights, (*(q for q, _ in stored), *(c for _, c in stored))


def test_store_holds_the_files_bits():
    _, layer = make_layer(rng_for("q6k-bits"))
    store = store_module.HostExpertStore([layer, layer])
    assert store.format == "int6-q6k" and not store.minima and store.int6("down")
    assert store.gate_scale[0].shape == (E, I, H // 256 * 18) and store.group(0, "down") == 16
    weights = 3 * H * I
    for expert in range(E):
        assert store.nbytes(1, expert) * 8 / weights == 6.5625
    assert store.total_nbytes * 8 / (2 * E * weights) == 6.5625


def test_records_decode_to_the_codes_values():
    rng = rng_for("q6k-records")
    codes = quant.q6k_from_blocks(quant.gguf_blocks_random("Q6_K", (5, 7, 1024), seed=3))[1]
    records = store_module.block_records(codes, fmt="int6-q6k")
    assert records.dtype == np.uint8 and records.shape == (5, 7, 4 * 18)
    want = quant.q6k_scales(codes)
    np.testing.assert_array_equal(store_module.q6k_records_scales(records).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(store_module.q6k_codes_scales(codes).view(np.uint32), want.view(np.uint32))
    del rng


@pytest.mark.parametrize("random_blocks", [False, True])
def test_chunks_of_the_store_are_gguf_values(random_blocks):
    weights, layer = make_layer(rng_for(f"q6k-chunks-{random_blocks}"), random_blocks)
    store = store_module.HostExpertStore([layer])
    for which, w in zip(("gate", "up", "down"), weights):
        rows, records = store.expert_rows(which, 0, 2, 5, 200)
        chunks = store_module.row_chunks_f32(rows, records, int6=store.int6(which))
        got = np.concatenate([b.copy() for _, b, _ in chunks])
        np.testing.assert_array_equal(got.view(np.uint32), w[2, 5:200].view(np.uint32))


@pytest.mark.parametrize("T", [1, 3, 6])
def test_pool_is_gguf_weights_times_x(make_pool, pool_path, T):
    """The pool (float32 compute; the C kernel and numpy's chunks: pool_path) against the float64 FFN over
    gguf.quants.dequantize's float32 weights."""
    rng = rng_for(f"q6k-pool-{T}")
    weights, layer = make_layer(rng)
    pool = make_pool([layer], "float32", threads=2)
    assert pool.store.format == "int6-q6k"
    assert pool_error_float32(pool, weights, rng, T) < 1e-6


@pytest.mark.parametrize("build", ["avx2", "plain"])
def test_other_builds(make_pool, monkeypatch, tmp_path, build):
    """The C kernel's int6-q6k loop in the AVX2 build and the portable fallback (each built here, as
    test_host_pool_packed's builds test does): gguf's weights times x, float32 and bf16 compute."""
    use_kernel_build(build, monkeypatch, tmp_path)
    rng = rng_for(f"q6k-build-{build}")
    weights, layer = make_layer(rng, random_blocks=True)
    for T in (1, 4, 5):
        assert pool_error_float32(make_pool([layer], "float32", threads=2), weights, rng, T) < 1e-6
