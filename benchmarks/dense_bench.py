"""The attention block's dense projections (q, k, v, o) at T rows, by how they are written, beside the bytes'
roofline measured in the same run: which formulation XLA runs near the copy bandwidth at T = 1.

    python -m benchmarks.dense_bench --layers=2 --hidden=256 --q_out=512 --kv_out=128 --iters=3   # CPU, seconds
    python -m benchmarks.dense_bench --json=out/dense.json                                        # H200

Formulations (each jitted as --layers chained layers of x -> q, k, v projections -> o projection of q -> x + o, so
XLA can neither hoist nor drop a layer):
  matmul      `x @ w` in the weights' dtype (the model's code)
  einsum_f32  `einsum(x, w, preferred_element_type=float32)`, cast back
  pad2        `strata_jax.model.linear.linear`, the model's own: at T = 1 the row padded to two (a zero row behind an
              optimization barrier), `x @ w`, the row sliced
  fused_qkv   one `x @ [wq | wk | wv]` (the three weights concatenated once, outside the timing), then `q @ wo`
Bytes per layer = the four weight matrices (activations are kilobytes). Timing: one jitted call of all layers,
synchronised, median of --iters after --warmup; per-layer time = call / layers (includes the kernels' launches).
"""
from __future__ import annotations

import sys
from typing import Any

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("t", "1,2,4,8", "Row counts T, comma-separated.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 16, "Chained layers per timed call.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("hidden", 2048, "H.", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("q_out", 4096, "Nq x D (q projection's outputs; o projection's inputs).", lower_bound=16,
                     flag_values=FLAGS)
flags.DEFINE_integer("kv_out", 512, "Nkv x D (k and v projections' outputs).", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations.", flag_values=FLAGS)
flags.DEFINE_integer("iters", 30, "Timed calls per (formulation, T).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed calls first.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("bw_mib", 0, "Array size of the bandwidth read in MiB (0 = 4096 on an accelerator, 64 on CPU).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

FORMULATIONS = ("matmul", "einsum_f32", "pad2", "fused_qkv")


def project(kind: str, x, w):
    """x [T, H] @ w [H, N] -> [T, N] as formulation `kind` (fused_qkv's single products use matmul)."""
    import jax.numpy as jnp
    if kind == "einsum_f32":
        return jnp.einsum("th,hn->tn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if kind == "pad2":
        from strata_jax.model.linear import linear
        return linear(x, w)
    return x @ w


def layers_fn(kind: str):
    import jax.numpy as jnp

    def run(x, weights):
        for wq, wk, wv, wo, wqkv in weights:
            if kind == "fused_qkv":
                qkv = x @ wqkv
                q, k, v = qkv[:, :wq.shape[1]], qkv[:, wq.shape[1]:wq.shape[1] + wk.shape[1]], qkv[:, -wv.shape[1]:]
            else:
                q, k, v = project(kind, x, wq), project(kind, x, wk), project(kind, x, wv)
            o = project("matmul" if kind == "fused_qkv" else kind, q, wo)
            # k and v feed the next layer too (as the cache write would), so no projection is dead code.
            x = x + o + jnp.tile(k + v, (1, x.shape[1] // k.shape[1]))[:, :x.shape[1]]
        return x
    return run


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    ts = common.int_list(s.t, "t")
    dtype = jnp.dtype(s.dtype)
    dev = common.device_info()
    on_accel = dev["platform"] != "cpu"
    bw = common.measure_read_bandwidth((s.bw_mib or (4096 if on_accel else 64)) << 20)
    rng = np.random.default_rng(0)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)

    weights = []
    for _ in range(s.layers):
        wq, wk, wv, wo = rnd(s.hidden, s.q_out), rnd(s.hidden, s.kv_out), rnd(s.hidden, s.kv_out), rnd(s.q_out, s.hidden)
        weights.append((wq, wk, wv, wo, jnp.concatenate([wq, wk, wv], axis=1)))
    layer_bytes = (2 * s.hidden * s.q_out + 2 * s.hidden * s.kv_out) * dtype.itemsize
    roof_us = layer_bytes / bw["bandwidth_Bps"] * 1e6
    common.progress(f"dense_bench: {s.layers} layers of q/k/v/o ({common.fmt_bytes(layer_bytes)} a layer), "
                    f"{s.dtype}, on {dev['device_kind']}; bandwidth {bw['bandwidth_Bps'] / 1e9:,.0f} GB/s -> {roof_us:.1f} us "
                    "a layer at the roofline")
    result = dict(benchmark="dense_bench", settings={n: getattr(s, n) for n in FLAGS}, device=dev, bandwidth=bw,
                  layer_bytes=layer_bytes, roofline_us_per_layer=roof_us, rows=[])
    inputs: dict[int, Any] = {}
    for point in runner.grid({"T": ts, "formulation": FORMULATIONS}):  # T slowest: one row per T
        t, kind = point["T"], point["formulation"]
        if t not in inputs:
            inputs[t] = rnd(t, s.hidden)
            result["rows"].append(dict(T=t))
        x = inputs[t]
        fn = jax.jit(layers_fn(kind))
        compiled = fn.lower(x, weights).compile()
        timing = common.time_synced(lambda i, c=compiled, x=x: c(x, weights), iters=s.iters, warmup=s.warmup)
        us = timing.median_ms * 1e3 / s.layers
        result["rows"][-1][kind] = us
        common.progress(f"  T={t} {kind}: {us:.1f} us a layer ({roof_us / us:.0%} of the roofline)")
    headers = ["T", *(f"{k} us/layer" for k in FORMULATIONS), "roofline us/layer",
               *(f"{k} % roof" for k in FORMULATIONS)]
    rows = [[r["T"], *(r[k] for k in FORMULATIONS), roof_us, *(100 * roof_us / r[k] for k in FORMULATIONS)]
            for r in result["rows"]]
    result["table"] = runner.table(s, "dense_bench", headers, rows, params=["T"], result=result,
                                   timing=f"one jitted call of {s.layers} chained layers, synced, median of {s.iters}, "
                                          "/ layers (launches included)", units={"roofline us/layer": "us"})
    common.say(f"roofline: {common.fmt_bytes(layer_bytes)} of q/k/v/o weights a layer at the {bw['bandwidth_Bps'] / 1e9:,.0f} "
               f"GB/s measured now; timing: one jitted call of {s.layers} chained layers, synchronised, median of "
               f"{s.iters}, divided by the layers (launches included)")
    if s.json:
        common.write_json(s.json, result)
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.dense_bench", run)


if __name__ == "__main__":
    main(sys.argv)
