"""The gated delta rule's decode step (Qwen3-Next's linear attention) alone: the XLA path (the jnp reference, jitted)
against the Pallas kernel, beside the bytes' roofline measured in the same run.

    python -m benchmarks.delta_bench --tiny --layers=2 --iters=2 --warmup=1   # CPU, seconds (interpret mode)
    python -m benchmarks.delta_bench --json=out/delta.json                    # H200, the Qwen3-Next-80B shape

For each window size T: per layer, random inputs as the model makes them (q, k L2-normalised, q scaled by
dk**-0.5, g < 0, beta in (0, 1); q/k/v/beta in --dtype, g and the state float32), n_valid = T. Bytes per step =
the state read once + T states written (Hv * dk * dv * 4 * (1 + T)): the least any implementation must move (q, k,
v, g, beta and the [T, Hv, dv] output are kilobytes and left out). Roofline = bytes / the read bandwidth measured now
(common.measure_read_bandwidth over --bw_mib).

Timing: each sample is one jitted call of --layers independent steps (each layer its own state and inputs, passed
as separate arrays, so nothing is sliced or copied; every output returned), as the model's linear-attention layers
run one after another in a decode step; per-step time = sample / layers; the median over --iters synchronised
samples after --warmup untimed calls. A sample includes one Python dispatch and one synchronisation, 1/layers of it
per step. Pallas = one kernel launch per layer (the wrapper adds only a reshape of n_valid); XLA = the fusions XLA
makes of gated_delta_step_reference.
On a backend other than GPU the kernel runs in Pallas interpret mode (slow; a check that it runs, not a timing).
"""
from __future__ import annotations

import functools
import sys

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_integer("heads_k", 16, "Hk: key heads.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("heads_v", 32, "Hv: value heads (a multiple of Hk).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("dk", 128, "Key head dim (a power of 2 for the kernel).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("dv", 128, "Value head dim (a power of 2 for the kernel).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_bool("tiny", False, "Tiny shapes for a CPU smoke run: Hk=1, Hv=2, dk=dv=16 (override the four flags "
                  "above).", flag_values=FLAGS)
flags.DEFINE_string("windows", "1,2,4", "Window sizes T, comma-separated.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 36, "Independent steps per timed call (Qwen3-Next-80B: 36 linear-attention layers).",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of q, k, v and beta (g and the state are "
                  "float32).", flag_values=FLAGS)
flags.DEFINE_integer("iters", 50, "Timed samples per T and path (median reported).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed calls per T and path before timing.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the inputs.", flag_values=FLAGS)
flags.DEFINE_integer("bw_mib", 0, "Array size of the bandwidth read in MiB (0 = 4096 on an accelerator, 64 on CPU).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each T).", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
# Kernel tuning (see strata_jax.pallas_kernels.gated_delta.gated_delta_step).
flags.DEFINE_integer("block_dv", 32, "Columns of the state per program (a power of 2).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("num_warps", 4, "Triton warps per program.", lower_bound=1, flag_values=FLAGS)


def layer_inputs(rng, t: int, hk: int, hv: int, dk: int, dv: int, dtype):
    """One layer's (q, k, v, g, beta, state) as the model makes them."""
    import jax.numpy as jnp
    import numpy as np
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = jnp.asarray(unit(rng.standard_normal((t, hk, dk), np.float32)) * dk ** -0.5, dtype)  # [T, Hk, dk]
    k = jnp.asarray(unit(rng.standard_normal((t, hk, dk), np.float32)), dtype)  # [T, Hk, dk]
    v = jnp.asarray(rng.standard_normal((t, hv, dv), np.float32), dtype)  # [T, Hv, dv]
    g = jnp.asarray(-rng.uniform(0.01, 2.0, (t, hv)), jnp.float32)  # [T, Hv]
    beta = jnp.asarray(rng.uniform(0.05, 0.95, (t, hv)), dtype)  # [T, Hv]
    state = jnp.asarray(rng.standard_normal((hv, dk, dv), np.float32) * 0.5)  # [Hv, dk, dv] f32
    return q, k, v, g, beta, state


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.pallas_kernels import gated_delta

    hk, hv, dk, dv = (1, 2, 16, 16) if s.tiny else (s.heads_k, s.heads_v, s.dk, s.dv)
    if hv % hk:
        raise ValueError(f"--heads_v={hv} is not a multiple of --heads_k={hk}")
    for name, d in (("dk", dk), ("dv", dv), ("block_dv", s.block_dv)):
        if d & (d - 1):
            raise ValueError(f"--{name}={d} must be a power of 2 (Triton blocks)")
    windows = common.int_list(s.windows, "windows")
    dtype = jnp.dtype(s.dtype)
    dev = common.device_info()
    on_gpu = dev["platform"] == "gpu"
    interpret = not on_gpu
    state_bytes = hv * dk * dv * 4

    bw_bytes = (s.bw_mib or (4096 if dev["platform"] != "cpu" else 64)) * 2**20
    common.progress(f"measuring read bandwidth over {bw_bytes / 2**30:.2f} GiB (a sum and a GEMV, back to back)")
    bw = common.measure_read_bandwidth(bw_bytes, reps=10)
    bandwidth = bw["bandwidth_Bps"]
    nominal = common.nominal_bandwidth(dev["device_kind"])

    say = common.say
    say(f"delta_bench: gated delta rule decode step, Hk={hk}, Hv={hv}, dk={dk}, dv={dv}, q/k/v/beta {dtype.name}, "
        f"g and state float32; {common.fmt_bytes(state_bytes)} of state per layer; {s.layers} layer(s) per call")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}"
        + ("" if on_gpu else "; Pallas kernel in INTERPRET mode (not a GPU: its time means nothing)"))
    say(f"memory read bandwidth (measured now): {bandwidth / 1e9:,.0f} GB/s  [{bw['method']}]"
        + (f"; nominal {nominal / 1e9:,.0f} GB/s" if nominal else ""))
    say(f"timed: per step, the median of {s.iters} synchronised calls (after {s.warmup} warm-up) / {s.layers}; a call "
        f"is one jitted function of {s.layers} independent steps (own state and inputs each, every output returned) "
        "and includes one Python dispatch and one sync; XLA = gated_delta_step_reference, Pallas = gated_delta_step "
        f"(block_dv={s.block_dv}, num_warps={s.num_warps}); n_valid = T")
    say(f"bytes per step = state read once + T states written = {common.fmt_bytes(state_bytes)} x (1 + T); "
        "roofline = bytes / the measured read bandwidth")
    say()

    pallas_op = functools.partial(gated_delta.gated_delta_step, block_dv=s.block_dv, num_warps=s.num_warps,
                                  interpret=interpret)

    def layered(op):
        @jax.jit
        def f(layers, n_valid):  # layers: a list of per-layer (q, k, v, g, beta, state)
            return [op(*args, n_valid) for args in layers]
        return f

    paths = dict(xla=layered(gated_delta.gated_delta_step_reference), pallas=layered(pallas_op))
    rng = np.random.default_rng(s.seed)
    result = dict(benchmark="delta_bench", settings={name: getattr(s, name) for name in FLAGS}, device=dev,
                  shape=dict(heads_k=hk, heads_v=hv, dk=dk, dv=dv), bandwidth=bw, interpret=interpret,
                  state_bytes=state_bytes,
                  timing_scope=(f"median over iters of synchronised jitted calls, each {s.layers} independent steps; "
                                "per-step time = call time / layers (one dispatch + sync shared by the layers)"),
                  rows=[], complete=False)

    for t in windows:
        layers = [layer_inputs(rng, t, hk, hv, dk, dv, dtype) for _ in range(s.layers)]
        jax.block_until_ready(layers)
        n_valid = jnp.int32(t)

        out, states = pallas_op(*layers[0], n_valid)
        want_out, want_states = gated_delta.gated_delta_step_reference(*layers[0], n_valid)
        rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        row = dict(T=t, bytes=state_bytes * (1 + t), out_rel_err=rel(out, want_out),
                   states_rel_err=rel(states, want_states))
        for name, f in paths.items():
            common.progress(f"T={t}: {name}: compiling, then {s.warmup} warm-up + {s.iters} timed calls")
            timing = common.time_synced(lambda i: f(layers, n_valid), iters=s.iters, warmup=s.warmup)
            row[f"{name}_us"] = timing.median_ms * 1e3 / s.layers
            row[f"{name}_timing"] = timing.summary()
        row["roofline_us"] = row["bytes"] / bandwidth * 1e6
        for name in paths:
            row[f"{name}_roofline_fraction"] = row["roofline_us"] / row[f"{name}_us"]
        result["rows"].append(row)
        common.progress(f"T={t}: XLA {row['xla_us']:.2f} us, Pallas {row['pallas_us']:.2f} us, roofline "
                        f"{row['roofline_us']:.2f} us per step; rel err out {row['out_rel_err']:.1e}, states "
                        f"{row['states_rel_err']:.1e}")
        if s.json:
            common.write_json(s.json, result)

    result["complete"] = True
    headers = ["T", "XLA us", "Pallas us", "MB moved", "roofline us", "XLA % of roofline", "Pallas % of roofline",
               "rel err"]
    rows = [[r["T"], r["xla_us"], r["pallas_us"], r["bytes"] / 1e6, r["roofline_us"], 100 * r["xla_roofline_fraction"],
             100 * r["pallas_roofline_fraction"], max(r["out_rel_err"], r["states_rel_err"])]
            for r in result["rows"]]
    result["table"] = runner.table(s, "delta_bench", headers, rows, params=["T"], result=result,
                                   timing="per step: a synced call over the layers / layers, median")
    say()
    say("us = per step (one layer's step, the call's time / layers); MB moved = state read + T states written; "
        "rel err = max over out and states of ||Pallas - XLA||_F / ||XLA||_F on the first layer (float32 math in "
        "both, only the order of the dk sums differs: ~1e-7 expected)")
    if s.json:
        common.write_json(s.json, result)
        say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.delta_bench", run)


if __name__ == "__main__":
    main(sys.argv)
