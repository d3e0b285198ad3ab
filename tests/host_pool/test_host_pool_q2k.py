"""Host pool with int2-q2k experts (strata_jax/model/quant.py: GGUF Q2_K's blocks, w = d sc q - dmin m, groups of 16,
q four a byte, uint8 codes). The store keeps q packed and decodes the codes once into float32 scales and minima; the
numpy jobs unpack row chunks to exactly gguf's values (the reference); the C expert kernel (native_experts.c
FMT_INT2K) decodes the crumbs in registers. Both against the float64 reference over gguf.quants.dequantize's weights
with the pool's rounding points (tests/helpers.py's `reference_ffn`), and C against numpy for T = 1..4."""

import gguf
import numpy as np
import pytest

from helpers import reference_ffn, rel_fro, rng_for, rounding
from strata_jax.host_pool import native
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant
from test_host_pool_q4k import H, TOL, make_layers


def test_chunks_are_gguf_values(monkeypatch):
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 7 * H)
    rng = rng_for("q2k-chunks")
    w = (rng.standard_normal((2, 40, H)) * 0.1 + 0.01).astype(np.float32)
    raw = quant.q2k_blocks(w)
    q, codes = quant.q2k_from_blocks(raw)
    scales = store_module.block_scale_min(codes[1, 3:38])  # [35, 2G]
    blocks = [(r0, b.copy()) for r0, b, s in store_module.row_chunks_f32(q[1, 3:38], scales, minima=True, int2=True)]
    assert [r0 for r0, _ in blocks] == [0, 7, 14, 21, 28]
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q2_K)[1, 3:38]
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), want)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads,T", [(1, 1), (2, 3), (2, 7)])
def test_plain_jobs_match_reference(make_pool, pool_path, compute_dtype, threads, T):
    rng = rng_for(f"q2k-plain-{compute_dtype}-{threads}-{T}")
    layers = make_layers(rng, quant.Q2K)
    pool = make_pool([s for _, s in layers], compute_dtype, threads=threads)
    store = pool.store
    assert store.format == "int2-q2k" and store.minima and store.group(1) == 16 and store.group(1, "down") == 16
    assert store.gate[1].shape[-1] == H // 4 and store.inputs_per_byte("down") == 4
    ids = np.array([3, -1, 0, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    y = pool.compute(1, x, ids, w)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert rel_fro(y, reference_ffn(layers[1][0], x, ids, w, rounding(compute_dtype))) < TOL[compute_dtype]


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_c_kernel_matches_numpy(make_pool, monkeypatch, T):
    """The C expert kernel's layer job against the numpy jobs' (float32 compute: only summation order differs)."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    rng = rng_for(f"q2k-c-numpy-{T}")
    layers = make_layers(rng, quant.Q2K)
    ids = np.array([3, 0, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, ids.size)).astype(np.float32)
    out = {}
    for path in ("1", "0"):
        monkeypatch.setenv(native.ENV, path)
        out[path] = make_pool([s for _, s in layers], "float32", threads=2).compute(0, x, ids, w)
    assert rel_fro(out["1"], out["0"]) < 1e-6
    assert rel_fro(out["1"], reference_ffn(layers[0][0], x, ids, w, rounding("float32"))) < 1e-6


def test_store_refuses_mixed_codes():
    rng = rng_for("q2k-mixed")
    (_, layer), = make_layers(rng, quant.Q2K)[:1]
    q, u, d, gs, us, ds = layer
    with pytest.raises(TypeError, match="int2-q2k"):  # gate and up: one family, one format
        store_module.HostExpertStore([(q, u, d, gs, us.astype(np.uint16), ds)])
