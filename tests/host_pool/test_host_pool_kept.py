"""Host pool with GGUF types kept as read (strata_jax/model/quant.py: int8-g for Q8_0 / Q6_K / Q3_K, with minima for
Q5_K / Q2_K; int4 with float32 scales for Q4_0, and minima for Q4_1). The store keeps the float32 group scales (and
minima); the numpy jobs dequantize row chunks to exactly gguf's values; the C expert kernel (native_experts.c
FMT_INT8G / FMT_INT8GM, FMT_INT4 / FMT_INT4K) against the numpy jobs and the float64 reference over
gguf.quants.dequantize's weights (tests/helpers.py's `reference_ffn`). The IQ types IQ2_XS, IQ3_S and IQ4_XS are
held as int8-g too (grid or table values up to +-127)."""

import gguf
import numpy as np
import pytest

from helpers import reference_ffn, rel_fro, rng_for, rounding
from strata_jax.host_pool import native
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

LAYERS, E, H, I = 2, 4, 256, 512  # whole K super-blocks
TOL = {"float32": 1e-5, "bfloat16": 2.0**-8}
D = {"Q8_0": 0.1 / 127, "Q6_K": 0.1 / 4000, "Q3_K": 0.1 / 128, "Q5_K": 0.1 / 2000, "Q2_K": 0.1 / 45,
     "Q4_0": 0.1 / 8, "Q4_1": 0.1 / 15}  # |w| ~ 0.1
D.update({"IQ2_XS": 0.1 / 50, "IQ3_S": 0.1 / 128, "IQ4_XS": 0.1 / 1000})  # IQ types: int8-g16, int8-g32 (q to +-127)
TYPES = list(D)
FORMATS = {"Q8_0": "int8-g", "Q6_K": "int8-g", "Q3_K": "int8-g", "Q5_K": "int8-g", "Q2_K": "int8-g",
           "Q4_0": "int4", "Q4_1": "int4-m", "IQ2_XS": "int8-g", "IQ3_S": "int8-g", "IQ4_XS": "int8-g"}


def make_layers(qtype: str, seed: int):
    """Per layer: (gguf.quants.dequantize's weights of random `qtype` blocks, float64; the store's layer tuple (q, q,
    q, scale, scale, scale) in the pool's layout)."""
    layers = []
    for layer in range(LAYERS):
        ws, stored, scales = [], [], []
        for k, shape in enumerate(((E, I, H), (E, I, H), (E, H, I))):
            raw = quant.gguf_blocks_random(qtype, shape, seed=seed * 100 + layer * 10 + k, d_scale=D[qtype])
            ws.append(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float64))
            q, sc = quant.gguf_kept(raw, qtype)
            stored.append(q)
            scales.append(sc)
        layers.append((ws, (*stored, *scales)))
    return layers


@pytest.mark.parametrize("qtype", TYPES)
def test_chunks_are_gguf_values(monkeypatch, qtype):
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 7 * H)
    (ws, layer), *_ = make_layers(qtype, 1)
    store = store_module.HostExpertStore([layer])
    assert store.format == FORMATS[qtype] and store.minima == (qtype in ("Q5_K", "Q2_K", "Q4_1"))
    rows, scales = store.expert_rows("up", 0, 1, 3, 38)
    blocks = [(r0, b.copy()) for r0, b, s in store_module.row_chunks_f32(rows, scales, minima=store.minima)]
    assert [r0 for r0, _ in blocks] == [0, 7, 14, 21, 28]
    want = ws[1][1, 3:38].astype(np.float32)
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q5_K", "Q4_1"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_plain_jobs_match_reference(make_pool, pool_path, compute_dtype, qtype):
    rng = rng_for(f"kept-plain-{qtype}-{compute_dtype}")
    layers = make_layers(qtype, 2)
    pool = make_pool([s for _, s in layers], compute_dtype, threads=2)
    ids = np.array([3, -1, 0, 2, 1], np.int32)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (3, ids.size)) * (ids >= 0)).astype(np.float32)
    y = pool.compute(1, x, ids, w)
    assert y.dtype == np.float32 and y.shape == (3, H)
    assert rel_fro(y, reference_ffn(layers[1][0], x, ids, w, rounding(compute_dtype))) < TOL[compute_dtype]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_c_kernel_matches_numpy(make_pool, monkeypatch, qtype, T):
    """The C expert kernel's layer job against the numpy jobs' (float32 compute: only summation order differs)."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    rng = rng_for(f"kept-c-numpy-{qtype}-{T}")
    layers = make_layers(qtype, 3)
    ids = np.array([3, 0, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, ids.size)).astype(np.float32)
    out = {}
    for path in ("1", "0"):
        monkeypatch.setenv(native.ENV, path)
        out[path] = make_pool([s for _, s in layers], "float32", threads=2).compute(0, x, ids, w)
    # int8-g dequantizes in registers (the same weights as numpy's); Q4_1 runs int4-q4k's form, s (x . (q - 8)) +
    # (8 s - mn) sum(x), whose float32 sums drift more where the minima are all of one sign (random blocks' are)
    tol = 2e-5 if qtype == "Q4_1" else 1e-6
    assert rel_fro(out["1"], out["0"]) < tol
    assert rel_fro(out["1"], reference_ffn(layers[0][0], x, ids, w, rounding("float32"))) < tol


def test_store_refuses_mixed_scales():
    (_, layer), = make_layers("Q8_0", 4)[:1]
    q, u, d, gs, us, ds = layer
    with pytest.raises(ValueError, match="ranks"):  # gate and up: one family, one format
        store_module.HostExpertStore([(q, u, d, gs, us[..., None, :], ds)])
    with pytest.raises(ValueError, match=r"2, G\]"):  # down may hold another format, but a whole one
        store_module.HostExpertStore([(q, u, d, gs, us, ds[..., None, :])])
    (_, plain), = make_layers("Q5_K", 5)[:1]
    with pytest.raises(TypeError, match="minima"):
        store_module.HostExpertStore([layer, plain])
