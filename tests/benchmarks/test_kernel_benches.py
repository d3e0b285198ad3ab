"""The kernel benchmarks end to end on tiny flags (seconds; off the GPU the Pallas kernels run in interpret mode)."""
from __future__ import annotations

import json
import math

import jax
import pytest

from benchmarks import route_prior_bench


def test_route_prior_bench_tiny(tmp_path, capsys):
    out = tmp_path / "route_prior.json"
    result = route_prior_bench.main(["route_prior_bench", "--shapes=16x4", "--tokens=1,3", "--iters=2", "--inner=2",
                                     "--warmup=1", "--keep=1", f"--json={out}"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and result["complete"]
    assert saved["interpret"] == (jax.default_backend() != "gpu")  # interpret mode exactly off the GPU
    assert [(r["E"], r["K"], r["T"]) for r in saved["rows"]] == [(16, 4, 1), (16, 4, 3)]
    for r in saved["rows"]:
        assert r["check"] == "ok" and r["max_weight_diff"] <= 1e-6
        assert r["resident"] == 8
        assert 0 <= r["changed_tokens_mean"] <= r["T"]
        for key in ("xla_us", "pallas_us", "jnp_us", "pallas_over_xla"):
            assert r[key] > 0 and math.isfinite(r[key]), key
    # The table: a header, a separator and one line per (shape, T), each with the check column "ok".
    table = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + 2
    assert "Pallas/XLA" in table[0] and table[0].rstrip(" |").endswith("check")
    assert all(ln.rstrip(" |").endswith("ok") for ln in table[2:])
    assert "MISMATCH" not in printed


@pytest.mark.parametrize("bad", ["--shapes=16x20", "--shapes=16by4", "--tokens=1,x", "--keep=5"])
def test_route_prior_bench_bad_flags_exit(bad, capsys):
    with pytest.raises(SystemExit) as e:
        route_prior_bench.main(["route_prior_bench", "--shapes=16x4", "--tokens=1", bad])
    assert e.value.code == 1
    assert "error:" in capsys.readouterr().err


def test_profile_window_attributes_op_time_to_the_named_scopes(tmp_path):
    import warnings
    from benchmarks import profile_window
    assert profile_window.scope_of("jit(decode_window)/layer3/moe_experts/nti,nhi->nth/dot_general") == "moe_experts"
    assert profile_window.scope_of("jit(decode_window)/layer0/attention/add") == "attention"
    assert profile_window.scope_of("jit(decode_window)/argmax") == "(outside the layers)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        result = profile_window.main(["profile_window", "--model=tiny", "--windows=4", "--context=64", "--pos=8",
                                      "--iters=2", f"--json={tmp_path / 'p.json'}"])
    phases = result["windows"][0]["phases"]
    for scope in ("attention", "moe_route", "moe_experts"):
        assert phases.get(scope, 0) > 0, phases
    assert abs(sum(phases.values()) - result["windows"][0]["op_us"]) < 1e-6 * result["windows"][0]["op_us"] + 1e-9
    assert result["windows"][0]["wall_us"] > 0


def test_profile_window_finds_scopes_of_gpu_kernels_and_command_buffers():
    """On a GPU an event's hlo_op can be a command buffer (a call of many fusions) and its name the kernel's: the
    fusion's name with '.' made '_', or a Pallas kernel's own name from the custom call's backend config."""
    from benchmarks import profile_window
    hlo = "\n".join([
        "%fused_computation.1 (p: bf16[4]) -> bf16[4] {",
        '  ROOT %m = bf16[4] multiply(%p, %p), metadata={op_name="jit(decode_window)/layer1/attention/mul"}',
        "}",
        "%command_buffer (a: bf16[4]) -> bf16[4] {",
        '  %loop_multiply_fusion.3 = bf16[4] fusion(%a), kind=kLoop, calls=%fused_computation.1, '
        'metadata={op_name="jit(decode_window)/layer1/attention/mul"}',
        '  ROOT %custom-call.7 = bf16[4] custom-call(%loop_multiply_fusion.3), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={"name":"expert_ffn_kernel","num_warps":4}, '
        'metadata={op_name="jit(decode_window)/layer1/moe_experts/pallas_call"}',
        "}",
        "ENTRY %main (x: bf16[4]) -> bf16[4] {",
        "  ROOT %call.2 = bf16[4] call(%x), to_apply=%command_buffer",
        "}",
    ])
    scopes = profile_window.instruction_scopes(hlo)
    assert profile_window.scope_for("call.2", "loop_multiply_fusion_3", scopes) == "attention"
    assert profile_window.scope_for("call.2", "expert_ffn_kernel", scopes) == "moe_experts"
    assert profile_window.scope_for("custom-call.7", "", scopes) == "moe_experts"
    assert profile_window.scope_for("call.9", "unknown_kernel", scopes) is None
    # A kernel named only inside a custom call's serialized config (another version's format) still finds its scope.
    other = hlo.replace('backend_config={"name":"expert_ffn_kernel","num_warps":4}',
                        "backend_config=kernel_name: decode_attention_split ir: 0x1f")
    scopes = profile_window.instruction_scopes(other)
    assert profile_window.scope_for("call.2", "decode_attention_split", scopes) == "moe_experts"
    assert profile_window.scope_for("call.2", "loop_multiply_fusion_3", scopes) == "attention"


def test_dense_bench_formulations_compute_the_same_projections():
    """Every way dense_bench writes the q/k/v/o projections gives the model's `x @ w` result (float32, T = 1 and 3),
    and the benchmark runs end to end with its table."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import dense_bench
    rng = np.random.default_rng(7)
    h, nq, nkv = 64, 128, 32

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)

    weights = []
    for _ in range(2):
        wq, wk, wv, wo = rnd(h, nq), rnd(h, nkv), rnd(h, nkv), rnd(nq, h)
        weights.append((wq, wk, wv, wo, jnp.concatenate([wq, wk, wv], axis=1)))
    for t in (1, 3):
        x = rnd(t, h)
        want = np.asarray(jax.jit(dense_bench.layers_fn("matmul"))(x, weights))
        for kind in dense_bench.FORMULATIONS[1:]:
            got = np.asarray(jax.jit(dense_bench.layers_fn(kind))(x, weights))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{kind} T={t}")
    result = dense_bench.main(["dense_bench", "--layers=1", "--hidden=64", "--q_out=128", "--kv_out=32", "--t=1",
                               "--iters=1", "--warmup=0", "--dtype=float32"])
    assert set(dense_bench.FORMULATIONS) <= set(result["rows"][0]) and "roofline us/layer" in result["table"]


def test_delta_bench_tiny(tmp_path, capsys):
    """The gated delta rule bench on --tiny shapes (Pallas in interpret mode off the GPU): one row per T, the kernel
    within 1e-5 of the XLA reference, the bytes = state read + T states written, the table and the JSON agree."""
    from benchmarks import delta_bench
    out = tmp_path / "delta.json"
    result = delta_bench.main(["delta_bench", "--tiny", "--windows=1,3", "--layers=2", "--iters=2", "--warmup=1",
                               "--bw_mib=8", f"--json={out}"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and result["complete"]
    assert saved["interpret"] == (jax.default_backend() != "gpu")
    assert saved["shape"] == dict(heads_k=1, heads_v=2, dk=16, dv=16)
    assert [r["T"] for r in saved["rows"]] == [1, 3]
    for r in saved["rows"]:
        assert r["bytes"] == 2 * 16 * 16 * 4 * (1 + r["T"])
        assert r["out_rel_err"] < 1e-5 and r["states_rel_err"] < 1e-5
        for key in ("xla_us", "pallas_us", "roofline_us"):
            assert r[key] > 0 and math.isfinite(r[key]), key
    table = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + 2
    assert table[0].startswith("|   T | XLA us | Pallas us |") and "roofline us" in table[0]
    assert "INTERPRET mode" in printed or saved["interpret"] is False
