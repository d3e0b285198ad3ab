"""Host pool with per-family expert formats (issue 36: a Q4_K_M GGUF's Q4_K gate/up beside its Q6_K down, each kept
as read): the store keeps each family in its own format (`format_of`, "int4-q4k/int8-g"), the numpy jobs dequantize
each matrix's chunks in its own, and the C expert kernel runs phase 1 in gate/up's format and phase 2 in down's
(native_experts.c: fmt / fmt_down), against the numpy jobs and the float64 reference over gguf.quants.dequantize's
weights (tests/helpers.py's `reference_ffn`)."""

import gguf
import numpy as np
import pytest

from helpers import reference_ffn, rel_fro, rng_for, rounding
from strata_jax.host_pool import native
from strata_jax.host_pool import store as store_module
from strata_jax.model import quant

LAYERS, E, H, I = 2, 4, 256, 512  # whole K super-blocks
D = {"Q6_K": 0.1 / 4000, "Q8_0": 0.1 / 127, "Q5_K": 0.1 / 2000}  # |w| ~ 0.1
FORMATS = {"Q6_K": "int4-q4k/int8-g", "Q8_0": "int4-q4k/int8-g", "Q5_K": "int4-q4k/int8-g", "Q4_K": "int4-q4k"}


def make_layers(down_type: str, seed: int, gate_up_type: str = "Q4_K"):
    """Per layer: (gguf.quants.dequantize's weights [gate, up, down], float64; the store's layer tuple): gate and up
    Q4_K (q4k_blocks of random weights: packed nibbles and uint16 codes), down `down_type`."""
    rng = np.random.default_rng(seed)
    layers = []
    for layer in range(LAYERS):
        ws, stored, scales = [], [], []
        for k, shape in enumerate(((E, I, H), (E, I, H), (E, H, I))):
            qtype = gate_up_type if k < 2 else down_type
            if qtype == "Q4_K":
                w = (rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,)) + 0.01).astype(np.float32)
                raw = quant.q4k_blocks(w)
                q, sc = quant.q4k_from_blocks(raw)
            else:
                raw = quant.gguf_blocks_random(qtype, shape, seed=seed * 100 + layer * 10 + k, d_scale=D[qtype])
                q, sc = quant.gguf_kept(raw, qtype)
            ws.append(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float64))
            stored.append(q)
            scales.append(sc)
        layers.append((ws, (*stored, *scales)))
    return layers


@pytest.mark.parametrize("down_type", ["Q6_K", "Q8_0", "Q5_K"])
def test_store_keeps_each_family(down_type):
    (ws, layer), *_ = make_layers(down_type, 1)
    store = store_module.HostExpertStore([layer])
    assert store.format == FORMATS[down_type]
    assert store.format_of("gate") == store.format_of("up") == "int4-q4k" and store.format_of("down") == "int8-g"
    assert store.dtype_of("gate") == np.uint8 and store.dtype_of("down") == np.int8
    assert store.minima_of("gate") and store.minima_of("down") == (down_type == "Q5_K")
    assert store.group(0, "gate") == 32 and store.group(0, "down") == {"Q6_K": 16, "Q8_0": 32, "Q5_K": 32}[down_type]
    for which, k in (("up", 1), ("down", 2)):
        rows, scales = store.expert_rows(which, 0, 1, 3, 38)
        got = np.concatenate([b.copy() for _, b, _ in store_module.row_chunks_f32(
            rows, scales, minima=store.minima_of(which))])
        want = ws[k][1, 3:38].astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("down_type", ["Q6_K", "Q8_0", "Q5_K"])
@pytest.mark.parametrize("T", [1, 5])
def test_c_kernel_matches_numpy_and_reference(make_pool, monkeypatch, down_type, T):
    """A mixed job in the C kernel (phase 1 FMT_INT4K, phase 2 FMT_INT8G / FMT_INT8GM) against the numpy jobs and the
    float64 reference (float32 compute: only summation order differs)."""
    monkeypatch.delenv(native.ENV, raising=False)
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    rng = rng_for(f"mixed-c-numpy-{down_type}-{T}")
    layers = make_layers(down_type, 3)
    ids = np.array([3, 0, -1, 2, 1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    out = {}
    for path in ("1", "0"):
        monkeypatch.setenv(native.ENV, path)
        out[path] = make_pool([s for _, s in layers], "float32", threads=2).compute(1, x, ids, w)
    ref = reference_ffn(layers[1][0], x, ids, w, rounding("float32"))
    assert rel_fro(out["1"], out["0"]) < 2e-5  # int4-q4k's form: s (x . (q - 8)) + (8 s - mn) sum(x)
    assert rel_fro(out["1"], ref) < 2e-5 and rel_fro(out["0"], ref) < 1e-5


def test_bf16_jobs_match_reference(make_pool):
    """bf16 compute through the C kernel where built (its bf16 path: x copied for gate/up's format, h for down's)."""
    rng = rng_for("mixed-bf16-split")
    layers = make_layers("Q6_K", 4)
    pool = make_pool([s for _, s in layers], "bfloat16", threads=2)
    x = rng.standard_normal((3, H)).astype(np.float32)
    x = x.astype(store_module.BF16).astype(np.float32)  # bf16 values: the C kernel's bf16 path
    ids = np.array([3, -1, 0, 2], np.int32)
    w = (rng.uniform(0.1, 1.0, (3, ids.size)) * (ids >= 0)).astype(np.float32)
    y = pool.compute(0, x, ids, w)
    assert rel_fro(y, reference_ffn(layers[0][0], x, ids, w, rounding("bfloat16"))) < 2.0**-8
