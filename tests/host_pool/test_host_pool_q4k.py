"""Host pool with int4-q4k experts (strata_jax/model/quant.py: GGUF Q4_K's blocks, w = d sc q - dmin m, groups of 32
packed as int4's, uint16 codes). The store decodes the codes once into float32 scales and minima; the numpy jobs
dequantize row chunks to exactly gguf's values; the C expert kernel (native_experts.c FMT_INT4K) runs int4's loops
plus the minima's term over group sums of x and h. Both against the float64 reference over gguf.quants.dequantize's
weights with the pool's rounding points (tests/helpers.py's `reference_ffn`), and C against numpy.
The tests taking `fmt` run for int2-q2k too (GGUF Q2_K's blocks: groups of 16, q four a byte kept packed, uint8
codes): its numpy chunks unpack the crumbs (the reference), the C kernel (FMT_INT2K) decodes them in registers,
each weight fma(q, s, -mn) as int8-g's; C against numpy for T = 1..4."""

import gguf
import numpy as np
import pytest

from helpers import reference_ffn, rel_fro, rng_for, rounding
from strata_jax.host_pool import native
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

LAYERS, E, H, I = 2, 4, 256, 512  # whole Q4_K super-blocks
TOL = {"float32": 1e-5, "bfloat16": 2.0**-8}


BLOCKS = {quant.Q4K: (quant.q4k_blocks, quant.q4k_from_blocks, gguf.GGMLQuantizationType.Q4_K),
          quant.Q2K: (quant.q2k_blocks, quant.q2k_from_blocks, gguf.GGMLQuantizationType.Q2_K)}
SHORT = {quant.Q4K: "q4k", quant.Q2K: "q2k"}  # the tests' seed names


def make_layers(rng, fmt=quant.Q4K):
    """Per layer: (gguf.quants.dequantize's weights of the Q4_K (fmt int2-q2k: Q2_K) bytes, float64; the store's
    layer tuple (q, q, q, codes, codes, codes))."""
    blocks, from_blocks, qtype = BLOCKS[fmt]
    layers = []
    for _ in range(LAYERS):
        ws, stored, codes = [], [], []
        for shape in ((E, I, H), (E, I, H), (E, H, I)):
            w = (rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,)) + 0.01).astype(np.float32)
            raw = blocks(w)
            ws.append(gguf.quants.dequantize(raw, qtype).astype(np.float64))
            q, c = from_blocks(raw)
            stored.append(q)
            codes.append(c)
        layers.append((ws, (*stored, *codes)))
    return layers


def force_path(monkeypatch, path):
    monkeypatch.setenv(native.ENV, "0" if path == "numpy" else "")
    if path == "C" and native.int4_kernel() is None:
        pytest.skip(native.describe())
    monkeypatch.setenv(native.ENV, "0" if path == "numpy" else "1")


@pytest.mark.parametrize("fmt,path", [(quant.Q4K, "numpy"), (quant.Q4K, "C"), (quant.Q2K, "numpy")])
def test_chunks_are_gguf_values(monkeypatch, fmt, path):  # (int2-q2k's chunks: numpy's, the reference)
    force_path(monkeypatch, path)
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 7 * H)
    blocks, from_blocks, qtype = BLOCKS[fmt]
    rng = rng_for(f"{SHORT[fmt]}-chunks")
    w = (rng.standard_normal((2, 40, H)) * 0.1 + 0.01).astype(np.float32)
    raw = blocks(w)
    q, codes = from_blocks(raw)
    scales = store_module.block_scale_min(codes[1, 3:38])  # [35, 2G]
    chunks = store_module.row_chunks_f32(q[1, 3:38], scales, minima=True, int2=fmt == quant.Q2K)
    blocks = [(r0, b.copy()) for r0, b, s in chunks]
    assert [r0 for r0, _ in blocks] == [0, 7, 14, 21, 28]
    want = gguf.quants.dequantize(raw, qtype)[1, 3:38]
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), want)


@pytest.mark.parametrize("fmt", [quant.Q4K, quant.Q2K])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads,T", [(1, 1), (3, 4), (2, 7)])
def test_plain_jobs_match_reference(make_pool, pool_path, compute_dtype, threads, T, fmt):
    rng = rng_for(f"{SHORT[fmt]}-plain-{compute_dtype}-{threads}-{T}")
    layers = make_layers(rng, fmt)
    pool = make_pool([s for _, s in layers], compute_dtype, threads=threads)
    store, (group, per_byte) = pool.store, (32, 2) if fmt == quant.Q4K else (16, 4)
    assert store.format == fmt and store.minima and store.group(1) == group and store.group(1, "down") == group
    assert store.gate[1].shape[-1] == H // per_byte and store.inputs_per_byte("down") == per_byte
    ids = np.array([3, -1, 0, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    y = pool.compute(1, x, ids, w)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert rel_fro(y, reference_ffn(layers[1][0], x, ids, w, rounding(compute_dtype))) < TOL[compute_dtype]


@pytest.mark.parametrize("fmt,T", [(quant.Q4K, 3), *((quant.Q2K, t) for t in (1, 2, 3, 4))])
def test_c_kernel_matches_numpy(make_pool, monkeypatch, fmt, T):
    """The C expert kernel's layer job against the numpy jobs' (float32 compute: only summation order differs)."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    rng = rng_for(f"{SHORT[fmt]}-c-numpy" + (f"-{T}" if fmt == quant.Q2K else ""))
    layers = make_layers(rng, fmt)
    ids = np.array([3, 0, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, ids.size)).astype(np.float32)
    out = {}
    for path in ("1", "0"):
        monkeypatch.setenv(native.ENV, path)
        out[path] = make_pool([s for _, s in layers], "float32", threads=2).compute(0, x, ids, w)
    assert rel_fro(out["1"], out["0"]) < 1e-6
    assert rel_fro(out["1"], reference_ffn(layers[0][0], x, ids, w, rounding("float32"))) < 1e-6


def test_the_former_team_and_blocks_give_the_same_bits(make_pool, monkeypatch):
    """int4-q4k's h group sums (now on the last thread into the job's one barrier) and job-sized blocks: the bits of
    the former job (an OpenMP region, fixed blocks, -DTEAM_OMP -DBLOCKS_FIXED) for 1 to 3 threads."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    former, line = native.experts_variant(("TEAM_OMP", "BLOCKS_FIXED"))
    if former is None:
        pytest.skip(line)
    rng = rng_for("q4k-former")
    layers = make_layers(rng)
    monkeypatch.setenv(native.ENV, "1")
    for compute_dtype in ("float32", "bfloat16"):
        for threads, T, ids in ((1, 1, [2]), (2, 1, [3, 1]), (3, 5, [3, -1, 0, 2])):
            ids = np.array(ids, np.int32)
            x = rng.standard_normal((T, H)).astype(np.float32)
            w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
            pool = make_pool([s for _, s in layers], compute_dtype, threads=threads)
            y_new = pool.compute(1, x, ids, w)
            with monkeypatch.context() as m:
                m.setattr(native, "experts_kernel", lambda: former)
                y_former = pool.compute(1, x, ids, w)
            np.testing.assert_array_equal(y_new, y_former)


def test_the_former_loops_give_the_same_bits(make_pool, monkeypatch):
    """int4-q4k's minima term summed inside the bf16 int4 loop (a constant half group of 16): the bits of the former
    loops (-DFORMER_LOOPS: the term's chains before the dot products), for bf16 and float32 x, 1 to 5 tokens."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    former, line = native.experts_variant(("FORMER_LOOPS",))
    if former is None:
        pytest.skip(line)
    rng = rng_for("q4k-former-loops")
    layers = make_layers(rng)
    monkeypatch.setenv(native.ENV, "1")
    for threads, T, ids in ((1, 1, [2]), (2, 1, [3, 1]), (2, 2, [0, 2]), (3, 5, [3, -1, 0, 2])):
        ids = np.array(ids, np.int32)
        x = rng.standard_normal((T, H)).astype(np.float32)
        w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
        pool = make_pool([s for _, s in layers], None, threads=threads)
        for values in (x, (x.view(np.uint32) & 0xFFFF0000).view(np.float32)):  # float32, and bf16 values
            y_new = pool.compute(1, values, ids, w)
            with monkeypatch.context() as m:
                m.setattr(native, "experts_kernel", lambda: former)
                y_former = pool.compute(1, values, ids, w)
            np.testing.assert_array_equal(y_new.view(np.uint32), y_former.view(np.uint32))


def test_store_refuses_mixed_scales():
    rng = rng_for("q4k-mixed")
    (_, layer), = make_layers(rng)[:1]
    q, u, d, gs, us, ds = layer
    with pytest.raises(TypeError, match="int4-q4k"):  # gate and up: one family, one format
        store_module.HostExpertStore([(q, u, d, gs, us.astype(np.float32), ds)])
    with pytest.raises(ValueError, match="down_scale"):  # down's own format, checked as such (codes' shape)
        store_module.HostExpertStore([(q, u, d, gs, us, ds.astype(np.float32))])
    (_, layer), = make_layers(rng_for("q2k-mixed"), quant.Q2K)[:1]
    q, u, d, gs, us, ds = layer
    with pytest.raises(TypeError, match="int2-q2k"):  # uint8 codes beside uint16 ones in one family
        store_module.HostExpertStore([(q, u, d, gs, us.astype(np.uint16), ds)])
