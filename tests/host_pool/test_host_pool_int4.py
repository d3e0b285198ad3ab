"""Host pool with int4 experts (strata_jax/model/quant.py "int4": packed two a byte, a bf16 scale per 64 inputs).

The pool dequantizes row chunks exactly ((nibble - 8) * scale fits float32) and runs the float32 products, rounding
to the compute dtype where the bf16 / int8 paths round. The reference is float64 over quant.dequantize's weights
with the same rounding points (tests/helpers.py's `reference_ffn`): 1e-5 relative in float32 compute. In bf16
compute a float32 sum that lands next to a bf16 rounding boundary may round the other way than its float64
reference (one ulp, 2^-8, in that element): the bound is that ulp. The device's XLA path (moe.expert_ffn) gives the
same rows.
"""

import numpy as np
import pytest

from helpers import reference_ffn, reference_rows, rel_fro, rng_for, rounding
from strata_jax.host_pool import HostExpertStore, HostPool, HostPoolError, native
from strata_jax.host_pool import store as store_module
from strata_jax.host_pool.store import BF16
from strata_jax.model import quant

# H and I multiples of the group (64), I not a multiple of the job or chunk rows: tails are exercised.
LAYERS, E, H, I = 2, 6, 192, 128
TOL = {"float32": 1e-5, "bfloat16": 2.0**-8}
THRESHOLD = 0.5


def make_layers(rng, fmt="int4"):
    """Per layer: (float weights (gate, up, down) as quant.dequantize gives them back, float64; the store's layer
    tuple (gate, up, down, gate_scale, up_scale, down_scale) with bf16 scales)."""
    layers = []
    for _ in range(LAYERS):
        qs = [quant.quantize((rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,)))
                             .astype(np.float32), fmt)
              for shape in ((E, I, H), (E, I, H), (E, H, I))]
        layers.append(([quant.dequantize(qa).astype(np.float64) for qa in qs],
                       (*(qa.q for qa in qs), *(qa.scale for qa in qs))))
    return layers


def stored(layers) -> list:
    """make_layers' (reference, stored) pairs -> the store's layers."""
    return [s for _, s in layers]


def force_path(monkeypatch, path):
    """STRATA_POOL_NATIVE for the numpy or the C dequantization; skips C where no compiler builds it."""
    monkeypatch.setenv(native.ENV, "0" if path == "numpy" else "")
    if path == "C" and native.int4_kernel() is None:
        pytest.skip(native.describe())  # says why: no C compiler, or the build failed
    monkeypatch.setenv(native.ENV, "0" if path == "numpy" else "1")


@pytest.mark.parametrize("path", ["numpy", "C"])
@pytest.mark.parametrize("fmt", ["int4", "int4-g32", "int4-g128"])
def test_chunks_are_dequantize_exactly(monkeypatch, fmt, path):
    # Several chunks and a ragged last one: every block is quant.dequantize's float32 weights, bit for bit.
    force_path(monkeypatch, path)
    C = 256  # inputs: a multiple of every group
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 7 * C)
    rng = rng_for(f"chunks-{fmt}")
    qa = quant.quantize(rng.standard_normal((3, 40, C)).astype(np.float32), fmt)
    rows, scales = qa.q[1, 3:38], qa.scale[1, 3:38].astype(np.float32)  # [35, C/2], [35, G]
    blocks = [(r0, block.copy(), row_scales) for r0, block, row_scales in store_module.row_chunks_f32(rows, scales)]
    assert [r0 for r0, _, _ in blocks] == [0, 7, 14, 21, 28] and all(s is None for _, _, s in blocks)
    np.testing.assert_array_equal(np.concatenate([b for _, b, _ in blocks]), quant.dequantize(qa)[1, 3:38])


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T", [1, 4])
def test_plain_jobs_match_reference(make_pool, pool_path, compute_dtype, threads, T):
    rng = rng_for(f"plain-{compute_dtype}-{threads}-{T}")
    layers = make_layers(rng)
    pool = make_pool(stored(layers), compute_dtype, threads=threads)
    assert pool.store.format == "int4" and pool.store.compute_dtype == np.dtype(compute_dtype)
    ids = np.array([5, -1, 0, 3, -1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    y = pool.compute(1, x, ids, w)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert rel_fro(y, reference_ffn(layers[1][0], x, ids, w, rounding(compute_dtype))) < TOL[compute_dtype]


def test_many_chunks_per_job(make_pool, monkeypatch):
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 5 * H)  # a few rows per chunk, a ragged last one
    rng = rng_for("many-chunks")
    layers = make_layers(rng)
    pool = make_pool(stored(layers), "float32", threads=2)
    ids = np.array([2, 1, 4], np.int32)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (3, 3)).astype(np.float32)
    ref = reference_ffn(layers[0][0], x, ids, w, rounding("float32"))
    assert rel_fro(pool.compute(0, x, ids, w), ref) < TOL["float32"]


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,K", [(1, 4), (4, 3)])
def test_split_jobs_match_reference(make_pool, pool_path, compute_dtype, T, K):
    rng = rng_for(f"split-{compute_dtype}-{T}-{K}")
    layers = make_layers(rng)
    pool = make_pool(stored(layers), compute_dtype, threads=2)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)  # [T, K]
    ids[0, -1] = -1  # not a CPU entry
    w = rng.uniform(0.05, 0.95, (T, K)).astype(np.float32)
    w[0, 0] = 0.9    # at least one heavy entry
    ticket = pool.submit_split(0, x, ids, w, THRESHOLD)
    heavy_rows = pool.wait_heavy(ticket).copy()
    rows = pool.collect_split(ticket)
    assert rows.dtype == np.float32 and rows.shape == (T, K, H)
    ref = reference_rows(layers[0][0], x, ids, rounding(compute_dtype))
    for t, k in zip(*np.nonzero(ids >= 0)):
        assert rel_fro(rows[t, k], ref[t, k]) < TOL[compute_dtype], (t, k)
    np.testing.assert_array_equal(rows[ids < 0], 0.0)
    heavy = (ids >= 0) & (w >= np.float32(THRESHOLD))
    np.testing.assert_array_equal(heavy_rows[heavy], rows[heavy])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_rows_as_the_device_xla_path(dtype):
    """moe.expert_ffn (the device's XLA path, group-major scales) on the same int4 experts: 1e-5 relative in float32 compute; bf16
    within a rounding flip's worth (float32 summation orders differ), as the int8 test in test_quant."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model import moe
    rng = rng_for(f"device-{dtype}")
    (_, stored), = make_layers(rng)[:1]
    q, scales = stored[:3], stored[3:]
    ids = np.array([4, -1, 0, 2], np.int32)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (3, ids.size)) * (ids >= 0)).astype(np.float32)
    sel = np.maximum(ids, 0)
    xd = jnp.asarray(x, dtype)
    with jax.default_matmul_precision("highest"):
        device = np.asarray(moe.expert_ffn(xd, *(jnp.asarray(a[sel]) for a in q), jnp.asarray(w),
                                           *(jnp.swapaxes(jnp.asarray(s[sel]), -1, -2) for s in scales)),  # group-major
                        np.float32)
    with HostPool(HostExpertStore([stored], compute_dtype=np.dtype(dtype)), threads=2) as pool:
        host = pool.compute(0, np.asarray(xd, np.float32), ids, w)
    assert rel_fro(host, device) < (1e-5 if dtype == "float32" else 2e-2)


def test_sizes_and_bytes_read(make_pool):
    rng = rng_for("sizes")
    layers = make_layers(rng)
    pool = make_pool(stored(layers), threads=3)
    store = pool.store
    assert (store.hidden_size(0), store.intermediate_size(0), store.num_experts(0)) == (H, I, E)
    assert store.dtype == np.uint8 and store.compute_dtype == BF16
    # q: 3 * I * H / 2 bytes; float32 scales: 2 * I * H / 64 + H * I / 64 floats
    assert store.nbytes(0, 1) == 3 * I * H // 2 + 4 * 3 * I * H // 64
    assert store.total_nbytes == LAYERS * E * store.nbytes(0, 1)
    x = rng.standard_normal((2, H)).astype(np.float32)
    pool.compute(0, x, np.array([1, 4, -1]), rng.uniform(0.1, 1.0, (2, 3)).astype(np.float32))
    assert pool.stats.bytes_read == store.nbytes(0, 1) + store.nbytes(0, 4)  # each expert's q and scales once


def test_bad_shapes_give_clear_errors(make_pool):
    rng = rng_for("bad-shapes")
    (_, (gate, up, down, gs, us, ds)), = make_layers(rng)[:1]
    with pytest.raises(TypeError, match="three scale arrays"):
        HostExpertStore([(gate, up, down)])
    with pytest.raises(ValueError, match="int4: packed"):  # down unpacked-wide
        HostExpertStore([(gate, up, np.zeros((E, H, I), np.uint8), gs, us, ds)])
    with pytest.raises(ValueError, match="int4 gate_scale shape"):  # one scale per row: an int8 layout
        HostExpertStore([(gate, up, down, gs[..., 0], us, ds)])
    with pytest.raises(ValueError, match="int4 down_scale shape"):  # groups of 8 inputs
        HostExpertStore([(gate, up, down, gs, us, np.ones((E, H, I // 8), np.float32))])
    with pytest.raises(ValueError, match="int4 up_scale shape"):  # rows do not match
        HostExpertStore([(gate, up, down, gs, us[:, :-1], ds)])
    pool = make_pool(stored(make_layers(rng)))
    with pytest.raises(HostPoolError, match=f"layer 0 bad input: .*hidden {H}"):  # x as wide as the packed rows
        pool.compute(0, np.ones((1, H // 2), np.float32), np.array([1]), np.ones((1, 1), np.float32))
    with pytest.raises(HostPoolError, match="layer 1 bad input"):
        pool.submit_split(1, np.ones((2, H // 2), np.float32), np.zeros((2, 1), np.int32),
                          np.ones((2, 1), np.float32), THRESHOLD)


def chunks(rows, scales):
    return np.concatenate([block.copy() for _, block, _ in store_module.row_chunks_f32(rows, scales)])


@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("R,C,chunk_rows", [(1, 128, 1), (37, 256, 5), (64, 384, 64), (9, 1024, 4)])
def test_native_chunks_match_numpy_bit_for_bit(monkeypatch, group, R, C, chunk_rows):
    """Any bytes and any float32 scales (not only bf16 ones), ragged last chunks: the C kernel's blocks are the numpy
    path's, bit for bit (both one float32 product of exact operands)."""
    if C % group:
        pytest.skip("group does not divide the inputs")
    force_path(monkeypatch, "C")
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", chunk_rows * C)
    rng = rng_for(f"native-{group}-{R}-{C}")
    packed = rng.integers(0, 256, (R + 2, C // 2), dtype=np.uint8)[1:-1]  # a view inside a larger array
    scales = (rng.standard_normal((R, C // group)) * np.exp2(rng.integers(-30, 30, (R, C // group)))).astype(
        np.float32)
    native_blocks = chunks(packed, scales)
    monkeypatch.setenv(native.ENV, "0")
    np.testing.assert_array_equal(native_blocks, chunks(packed, scales))
    assert native_blocks.shape == (R, C) and np.isfinite(native_blocks).all()


def test_the_switch_picks_the_path(monkeypatch):
    rng = rng_for("switch")
    packed, scales = rng.integers(0, 256, (10, 64), dtype=np.uint8), rng.random((10, 2), dtype=np.float32)
    calls = []
    numpy_path = store_module._dequantize_int4
    monkeypatch.setattr(store_module, "_dequantize_int4", lambda *a: calls.append(1) or numpy_path(*a))
    force_path(monkeypatch, "numpy")
    assert native.int4_kernel() is None and "numpy (STRATA_POOL_NATIVE=0)" in native.describe()
    chunks(packed, scales)
    assert calls
    force_path(monkeypatch, "C")
    calls.clear()
    chunks(packed, scales)
    assert not calls and native.describe().startswith("int4 dequantization: C")


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_switch_value_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv(native.ENV, value)
    (_, stored), = make_layers(rng_for("bad-switch"))[:1]
    with pytest.raises(ValueError, match=f"STRATA_POOL_NATIVE='{value}': not 0 .* or 1 ") as e:
        HostPool(HostExpertStore([stored]), threads=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="STRATA_POOL_NATIVE="):
        chunks(stored[0][0], stored[3][0].astype(np.float32))


def test_no_compiler_falls_back_to_numpy(monkeypatch):
    monkeypatch.setattr(native, "_built", None)  # as if never built in this process
    monkeypatch.setattr(native, "_find_compiler", lambda: None)
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.int4_kernel() is None and "no C compiler found" in native.describe()
    rng = rng_for("no-compiler")
    qa = quant.quantize(rng.standard_normal((4, 128)).astype(np.float32), "int4")
    np.testing.assert_array_equal(chunks(qa.q, qa.scale.astype(np.float32)), quant.dequantize(qa))
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(RuntimeError, match="STRATA_POOL_NATIVE=1 but .*no C compiler found"):
        native.int4_kernel()


def test_build_goes_to_the_user_cache(monkeypatch, tmp_path):
    """A fresh build (no cached library) lands in ~/.cache/strata_jax/native, not in the repo, and loads."""
    if native._find_compiler() is None:
        pytest.skip("no C compiler found (cc, gcc or sysconfig's CC)")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(native, "_built", None)
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.int4_kernel() is not None, native.describe()
    built = list((tmp_path / ".cache" / "strata_jax" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("native_dequant-") and built[0].suffix == ".so"


@pytest.mark.parametrize("group", [16, 64])
def test_plain_c_loop_matches_numpy(monkeypatch, tmp_path, group):
    """The build without -march=native (on x86 no SSE4.1, so native_dequant.c's plain loop, not the intrinsics one):
    bit for bit the numpy path too."""
    compiler = native._find_compiler()
    if compiler is None:
        pytest.skip("no C compiler found (cc, gcc or sysconfig's CC)")
    path = tmp_path / "plain.so"
    native._compile(compiler, native.FLAGS[-1], path)
    rng = rng_for(f"plain-c-{group}")
    packed = rng.integers(0, 256, (13, 96), dtype=np.uint8)
    scales = rng.standard_normal((13, 192 // group)).astype(np.float32)
    out = np.empty((13, 192), np.float32)
    native.int4_filler(native._load(path), packed, scales, out)(0, 13)
    monkeypatch.setenv(native.ENV, "0")
    np.testing.assert_array_equal(out, chunks(packed, scales))
