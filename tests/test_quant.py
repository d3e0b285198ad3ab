"""strata_jax/quant.py: the low-bit expert formats round-trip within half a step, pack int4 exactly, and order by
error as their bits and groups say."""
from __future__ import annotations

import numpy as np
import pytest

from strata_jax import quant


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(quant.FORMATS))
def test_dequantized_within_half_a_step(name):
    rng = np.random.default_rng()
    fmt = quant.FORMATS[name]
    w = (rng.standard_normal((3, 8, 128)) * rng.uniform(0.01, 1.0, (3, 8, 1))).astype(np.float32)
    w[1, 2] = 0.0  # an all-zero channel: scale 0, no NaN
    qa = quant.quantize(w, name)
    back = quant.dequantize(qa)
    assert back.shape == w.shape and np.isfinite(back).all()
    assert qa.scale.dtype == quant.BF16 and qa.scale.shape == (3, 8, fmt.groups(128))
    step = np.repeat(qa.scale.astype(np.float32), 128 // fmt.groups(128), axis=-1)
    # half a step, plus the bf16 rounding of the minimum (asymmetric) and float32 slack
    slack = 0 if fmt.symmetric else np.repeat(np.abs(qa.minimum.astype(np.float32)), 128 // fmt.groups(128),
                                              axis=-1) * 2 ** -8
    assert np.all(np.abs(back - w) <= 0.5 * step + slack + 1e-6)
    np.testing.assert_array_equal(back[1, 2], 0.0)
    want_q = {8: np.int8, 4: np.uint8}.get(fmt.bits, np.uint8)
    assert qa.q.dtype == want_q and qa.q.shape[-1] == (64 if fmt.bits == 4 else 128)
    assert qa.nbytes < w.nbytes / 3


def test_error_follows_bits_and_groups():
    rng = np.random.default_rng()
    w = rng.standard_normal((4, 64, 256)).astype(np.float32)
    err = {name: rel(quant.dequantize(quant.quantize(w, name)), w) for name in quant.FORMATS}
    assert err["int8"] < 0.01
    assert err["int8"] < err["int4-g32"] < err["int4"] < err["int4-g128"] < 0.15
    assert err["int4-asym"] < err["int3"] < err["int2"]


@pytest.mark.parametrize("signed", [True, False])
def test_int4_packing_round_trips(signed):
    rng = np.random.default_rng()
    q = rng.integers(-8, 8, (5, 6, 34)).astype(np.int8) if signed else rng.integers(0, 16, (5, 6, 34)).astype(np.uint8)
    packed = quant.pack_int4(q)
    assert packed.shape == (5, 6, 17) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed & 0xF, (q[..., 0::2].astype(np.int16) & 0xF).astype(np.uint8))
    np.testing.assert_array_equal(quant.unpack_int4(packed, signed), q)


def test_bits_per_weight_and_bad_input():
    assert quant.FORMATS["int8"].bits_per_weight(256) == pytest.approx(8 + 16 / 256)
    assert quant.FORMATS["int4"].bits_per_weight(256) == pytest.approx(4.25)
    assert quant.FORMATS["int4-asym"].bits_per_weight(256) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="multiple of the group"):
        quant.quantize(np.ones((2, 96), np.float32), "int4")
    with pytest.raises(ValueError, match="unknown expert format"):
        quant.get_format("fp4")


def test_quality_study_on_the_embedded_model(tmp_path, capsys, cache_dir):
    """benchmarks/quant_quality end to end: a row per format, KL growing as bits fall, a format whose group does not
    divide the experts' width marked n/a."""
    import json
    from benchmarks import quant_quality
    out = tmp_path / "q.json"
    quant_quality.main(["quant_quality", "--models=embedded", "--formats=int8,int4-g32,int4-g128,int2",
                        "--positions=64", f"--cache_dir={cache_dir}", f"--json={out}"])
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert not rows["int4-g128"]["applicable"]  # the embedded experts are 64 wide
    assert 0 <= rows["int8"]["kl_mean"] < rows["int4-g32"]["kl_mean"] < rows["int2"]["kl_mean"]
    assert rows["int8"]["top1"] >= rows["int2"]["top1"] and 0 <= rows["int2"]["top1"] <= 1
    assert rows["int4-g32"]["bits_per_weight"] == pytest.approx(4.5)
    assert "| embedded" in capsys.readouterr().out
