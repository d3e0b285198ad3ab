"""STRATA_KERNEL_TUNING: a kernel-sweep file's picks in place of the kernels' TUNING rows, a bad file one line."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.engine.api import kernel_tuning_lines
from strata_jax.errors import StrataError
from strata_jax.pallas_kernels import expert_ffn, stacked_linear, tuning


def write(tmp_path, data) -> str:
    path = tmp_path / "sweep.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_picks_replace_the_rows_and_restore(tmp_path, monkeypatch):
    picks = {"qkv:decode": dict(block_n=128, reduce="acc"), "expert_ffn:wide": dict(num_warps=8)}
    monkeypatch.setenv("STRATA_KERNEL_TUNING", write(tmp_path, dict(picks=picks)))
    before_qkv, before_ffn = stacked_linear.tuning(1, 3), expert_ffn.tuning(8)
    shared = dict(expert_ffn._KNOBS)
    lines = tuning.from_environment()
    try:
        assert len(lines) == 1 and "qkv:decode block_n=128, reduce=acc" in lines[0]
        assert stacked_linear.tuning(1, 3) == {**before_qkv, "block_n": 128, "reduce": "acc"}
        assert stacked_linear.tuning(1, 1) == stacked_linear.tuning(1, 1)  # o's row as it was
        assert stacked_linear.tuning(8, 3) == before_qkv  # the wide row as it was
        assert expert_ffn.tuning(8) == {**before_ffn, "num_warps": 8} and expert_ffn.tuning(1) == before_ffn
        assert expert_ffn._KNOBS == shared  # the shared default dict is not changed in place
    finally:
        tuning.restore({"qkv:decode": {**before_qkv}, "expert_ffn:wide": {**before_ffn}})
    assert stacked_linear.tuning(1, 3) == before_qkv and expert_ffn.tuning(8) == before_ffn


def test_the_kernels_take_the_picked_knobs():
    """A call that names no knob runs with the row's pick: a value the kernel refuses (apply does not check) shows
    that it was read; the wide row's call is unaffected and matches the reference."""
    before = tuning.apply({"o:decode": dict(reduce="bogus"), "expert_ffn:decode": dict(reduce="bogus")})
    try:
        rng = np.random.default_rng(0)
        w = jnp.asarray(rng.standard_normal((2, 32, 48)), jnp.float32)
        with pytest.raises(ValueError, match="bogus"):
            stacked_linear.stacked_linear(jnp.ones((1, 32), jnp.float32), (w,), jnp.int32(0), interpret=True)
        x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
        got = stacked_linear.stacked_linear(x, (w,), jnp.int32(1), interpret=True)
        np.testing.assert_allclose(got, stacked_linear.stacked_linear_reference(x, (w,), jnp.int32(1)), rtol=1e-4,
                                   atol=1e-5)
        g = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)
        with pytest.raises(ValueError, match="bogus"):
            expert_ffn.expert_ffn(jnp.ones((1, 64), jnp.bfloat16), g, g, jnp.swapaxes(g, 1, 2),
                                  jnp.arange(2, dtype=jnp.int32), jnp.ones((1, 2), jnp.float32), interpret=True)
    finally:
        tuning.restore(before)


@pytest.mark.parametrize("data,says", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ({"rows": {}}, "no \"picks\""),
    ({"picks": {"qkv:prefill": {}}}, "unknown row 'qkv:prefill'"),
    ({"picks": {"o:decode": {"block_m": 64}}}, "unknown knob 'block_m'"),
    ({"picks": {"o:decode": {"block_n": 48}}}, "block_n must be a power of 2"),
    ({"picks": {"expert_ffn:decode": {"reduce": "max"}}}, "reduce must be one of"),
    ({"picks": {"expert_ffn:decode": {"num_warps": 0}}}, "num_warps must be a positive integer"),
])
def test_a_bad_file_is_one_line(tmp_path, monkeypatch, data, says):
    path = str(tmp_path / "absent.json") if data is None else write(tmp_path, data)
    monkeypatch.setenv("STRATA_KERNEL_TUNING", path)
    rows = {k: dict(v) if isinstance(v, dict) else v for k, v in stacked_linear.TUNING.items()}
    with pytest.raises(StrataError) as e:
        kernel_tuning_lines()
    assert says in str(e.value) and str(e.value).startswith(f"STRATA_KERNEL_TUNING={path}: ")
    assert "\n" not in str(e.value)
    assert stacked_linear.TUNING == rows  # nothing applied


def test_unset_is_silent(monkeypatch):
    monkeypatch.delenv("STRATA_KERNEL_TUNING", raising=False)
    assert kernel_tuning_lines() == []
