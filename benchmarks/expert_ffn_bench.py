"""The window's expert FFN alone: the XLA path (gather, then einsums) against the Pallas kernel that reads the experts
in place from the stacked slot array, beside the bytes' roofline measured in the same run.

    python -m benchmarks.expert_ffn_bench --hidden=128 --inter=64 --slots=16 --iters=2 --inner=1   # CPU, seconds
    python -m benchmarks.expert_ffn_bench --t=1,2,4,8 --json=out/expert_ffn.json                    # H200

For each window size T: N = min(T * K, slots) distinct random slots (every token picks K experts no other token
picks: the most distinct experts a window can have), random routing weights. Bytes = N experts x (gate + up + down)
x itemsize: each expert read once, the least any implementation must read (x, h and the output are ignored:
kilobytes). Roofline = bytes / the read bandwidth measured now (common.measure_read_bandwidth over --bw_mib).

Timing: each sample is one jitted call that runs the op --inner times in a fori_loop, each time on another set of
random slots (so neither XLA can hoist the op nor the L2 cache serve a repeat), synchronised with block_until_ready;
per-op time = sample / inner; the median over --iters samples after --warmup untimed calls. With --inner=1 a sample
is one call and includes Python dispatch (microseconds: a large share at T=1 on a GPU).
On a backend other than GPU the kernel runs in Pallas interpret mode (slow; a check that it runs, not a timing).
"""
from __future__ import annotations

import functools
import sys

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("t", "1,2,4,8", "Window sizes T, comma-separated.", flag_values=FLAGS)
flags.DEFINE_integer("n_experts_per_token", 8, "K: experts each token picks.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("slots", 128, "S: experts in the stacked slot array.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("hidden", 2048, "H (a multiple of 16).", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("inter", 768, "I, the expert intermediate size (a multiple of 16).", lower_bound=16,
                     flag_values=FLAGS)
flags.DEFINE_integer("iters", 50, "Timed samples per T and path (median reported).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed calls per T and path before timing.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("inner", 10, "Ops per timed call (a fori_loop over slot sets); 1 = one op per call.",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the weights, slots and routing weights.", flag_values=FLAGS)
flags.DEFINE_integer("bw_mib", 0, "Array size of the bandwidth read in MiB (0 = 4096 on an accelerator, 64 on CPU).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each T).", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
# Kernel tuning (see strata_jax.pallas_kernels.expert_ffn.expert_ffn); 0: the kernel's own for the window size
# (expert_ffn.tuning).
flags.DEFINE_integer("block_i", 0, "Gate/up kernel: rows of I per program.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("block_k", 0, "Gate/up kernel: H chunk of its loop.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("block_h", 0, "Down kernel: output columns per program.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("block_i_down", 0, "Down kernel: I chunk of its loop.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("n_split", 0, "Down kernel: programs sharing one column block's experts.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("num_warps", 0, "Triton warps per program (both kernels).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("formats", "int8,int4", "Comma list: also time the kernel on quantized experts (strata_jax.model.quant 'int8': one "
                  "scale per output row; 'int4': one per 64 inputs, two weights a byte), quantized from the same bf16 "
                  "experts, each beside its own roofline; empty: bf16 only.", flag_values=FLAGS)
flags.DEFINE_integer("num_stages", 0, "Triton pipeline stages (both kernels).", lower_bound=0, flag_values=FLAGS)

ID_SETS = 4  # timed calls rotate over this many [inner, N] slot sets


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.pallas_kernels import expert_ffn as kernel
    from strata_jax.model import moe

    windows = common.int_list(s.t, "t")
    k, slots, hidden, inter = s.n_experts_per_token, s.slots, s.hidden, s.inter
    dev = common.device_info()
    on_gpu = dev["platform"] == "gpu"
    interpret = not on_gpu
    tuning = {k: v for k, v in dict(block_i=s.block_i, block_k=s.block_k, block_h=s.block_h,
                                     block_i_down=s.block_i_down, n_split=s.n_split, num_warps=s.num_warps,
                                     num_stages=s.num_stages).items() if v}  # the rest: expert_ffn.tuning(T)
    itemsize = 2  # bf16
    expert_bytes = 3 * inter * hidden * itemsize

    bw_bytes = (s.bw_mib or (4096 if dev["platform"] != "cpu" else 64)) * 2**20
    common.progress(f"measuring read bandwidth over {bw_bytes / 2**30:.2f} GiB (a sum and a GEMV, back to back)")
    bw = common.measure_read_bandwidth(bw_bytes, reps=10)
    bandwidth = bw["bandwidth_Bps"]

    say = common.say
    say(f"expert_ffn_bench: S={slots} slots, H={hidden}, I={inter}, K={k}, bf16; "
        f"{common.fmt_bytes(expert_bytes)} per expert")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}"
        + ("" if on_gpu else "; Pallas kernel in INTERPRET mode (not a GPU: its time means nothing)"))
    say(f"memory read bandwidth (measured now): {bandwidth / 1e9:,.0f} GB/s  [{bw['method']}]")
    say(f"timed: per op, median of {s.iters} synchronised calls (after {s.warmup} warm-up), each call a jitted "
        f"fori_loop of {s.inner} op(s) on different random slots; XLA = moe.expert_ffn on gate[ids], up[ids], "
        f"down[ids] (the gather copy included); Pallas = the two kernels + the wrapper's padding and split sum"
        + ("; includes Python dispatch" if s.inner == 1 else ""))
    say(f"kernel tuning: {tuning or 'the kernel defaults'} (by T: {kernel.TUNING})")
    say()

    kw, kg, ku, kd = jax.random.split(jax.random.key(s.seed), 4)
    common.progress(f"making {common.fmt_bytes(slots * expert_bytes)} of random bf16 experts")
    # Scaled so g, u and the output are O(1): the error check then compares numbers of a sensible size.
    gate = (jax.random.normal(kg, (slots, inter, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (slots, inter, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (slots, hidden, inter), jnp.float32) / np.sqrt(inter)).astype(jnp.bfloat16)
    jax.block_until_ready((gate, up, down))
    quantized = {}  # format -> (q gate, up, down, their scales, bytes an expert's FFN reads)
    formats = (runner.parse_list(s.formats, str, "formats", empty_ok=True) if isinstance(s.formats, str)
               else list(s.formats))
    for fmt in formats:  # the same experts quantized, on the device
        from strata_jax.model import quant
        if fmt not in (*quant.ENGINE_FORMATS, "int4-g128"):  # g128: the kernel runs it; the engine picks 64 or 32
            raise ValueError(f"--formats: {fmt!r} is not one of {', '.join(quant.ENGINE_FORMATS)}, int4-g128")
        qs = [quant.quantize(np.asarray(w, np.float32), fmt) for w in (gate, up, down)]
        quantized[fmt] = (tuple(jnp.asarray(qa.q) for qa in qs), tuple(jnp.asarray(quant.engine_scale(qa)) for qa in qs),
                          sum(qa.nbytes for qa in qs) // slots)

    def xla_op(x, g, u, d, ids, combine):
        ids = jnp.maximum(ids, 0)
        return moe.expert_ffn(x, g[ids], u[ids], d[ids], combine)

    pallas_op = functools.partial(kernel.expert_ffn, interpret=interpret, **tuning)

    def looped(op):
        @jax.jit
        def f(x, g, u, d, ids_sets, combine):  # ids_sets [inner, N]
            def body(r, acc):
                return acc + op(x, g, u, d, ids_sets[r], combine)
            return jax.lax.fori_loop(0, ids_sets.shape[0], body, jnp.zeros(x.shape, jnp.float32))
        return f

    paths = dict(xla=looped(xla_op), pallas=looped(pallas_op))
    for fmt, (_, scales, _) in quantized.items():
        paths[f"pallas_{fmt}"] = looped(lambda x, g, u, d, ids, c, sc=scales: pallas_op(x, g, u, d, ids, c, *sc))
    rng = np.random.default_rng(s.seed)
    result = dict(benchmark="expert_ffn_bench", settings={name: getattr(s, name) for name in FLAGS}, device=dev,
                  bandwidth=bw, interpret=interpret, expert_bytes=expert_bytes, tuning=tuning,
                  timing_scope=(f"median over iters of synchronised jitted calls, each a fori_loop of {s.inner} ops "
                                "on different slot sets; per-op time = call time / inner"),
                  rows=[], complete=False)

    for t in windows:
        n = min(t * k, slots)
        x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.bfloat16)  # [T, H]
        # Token j picks experts j*K .. j*K+K-1 (wrapped when T*K > S), softmax-like positive weights summing to 1.
        combine = np.zeros((t, n), np.float32)
        for j in range(t):
            cols = [(j * k + c) % n for c in range(k)]
            w = rng.random(len(cols)) + 0.1
            combine[j, cols] = w / w.sum()
        combine = jnp.asarray(combine)  # [T, N]
        id_sets = [jnp.asarray(np.stack([rng.choice(slots, n, replace=False) for _ in range(s.inner)]), jnp.int32)
                   for _ in range(ID_SETS)]  # each [inner, N]

        ids0 = id_sets[0][0]
        out = pallas_op(x, gate, up, down, ids0, combine)
        ref = kernel.expert_ffn_reference(x, gate, up, down, ids0, combine)
        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        err_fro = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

        row = dict(T=t, distinct_experts=n, bytes=n * expert_bytes, max_rel_err=err, fro_rel_err=err_fro)
        for name, f in paths.items():
            common.progress(f"T={t}: {name}: compiling, then {s.warmup} warm-up + {s.iters} timed calls")
            w = quantized[name[7:]][0] if name[7:] in quantized else (gate, up, down)
            timing = common.time_synced(lambda i: f(x, *w, id_sets[i % ID_SETS], combine),
                                        iters=s.iters, warmup=s.warmup)
            row[f"{name}_us"] = timing.median_ms * 1e3 / s.inner
            row[f"{name}_timing"] = timing.summary()
        row["roofline_us"] = row["bytes"] / bandwidth * 1e6
        for name in ("xla", "pallas"):
            row[f"{name}_roofline_fraction"] = row["roofline_us"] / row[f"{name}_us"]
        for fmt, (qw, scales, q_expert_bytes) in quantized.items():
            row[f"{fmt}_bytes"] = n * q_expert_bytes
            row[f"{fmt}_roofline_us"] = row[f"{fmt}_bytes"] / bandwidth * 1e6
            row[f"pallas_{fmt}_roofline_fraction"] = row[f"{fmt}_roofline_us"] / row[f"pallas_{fmt}_us"]
            out_q = pallas_op(x, *qw, ids0, combine, *scales)
            ref_q = kernel.expert_ffn_reference(x, *qw, ids0, combine, *scales)
            row[f"{fmt}_max_rel_err"] = float(jnp.max(jnp.abs(out_q - ref_q)) / jnp.max(jnp.abs(ref_q)))
            row[f"{fmt}_vs_bf16_rel"] = float(jnp.linalg.norm(out_q - ref) / jnp.linalg.norm(ref))
        result["rows"].append(row)
        common.progress(f"T={t}: N={n}, XLA {row['xla_us']:.1f} us, Pallas {row['pallas_us']:.1f} us, roofline "
                        f"{row['roofline_us']:.1f} us, max rel err {err:.2e}")
        if s.json:
            common.write_json(s.json, result)

    result["complete"] = True
    headers = ["T", "distinct experts", "MB read", "XLA us", "Pallas us", "roofline us", "XLA % of roofline",
               "Pallas % of roofline", "max rel err"]
    rows = [[r["T"], r["distinct_experts"], r["bytes"] / 1e6, r["xla_us"], r["pallas_us"], r["roofline_us"],
             100 * r["xla_roofline_fraction"], 100 * r["pallas_roofline_fraction"], r["max_rel_err"]]
            for r in result["rows"]]
    for fmt in quantized:
        headers += [f"{fmt} Pallas us", f"{fmt} roofline us", f"{fmt} % of roofline", f"{fmt} vs bf16 rel"]
        for row, r in zip(rows, result["rows"]):
            row += [r[f"pallas_{fmt}_us"], r[f"{fmt}_roofline_us"], 100 * r[f"pallas_{fmt}_roofline_fraction"],
                    r[f"{fmt}_vs_bf16_rel"]]
    result["table"] = common.format_table(headers, rows)
    runner.emit(runner.rows_from_table(
        "expert_ffn_bench", headers, rows, params=["T"],
        fixed=dict(k=k, slots=slots, hidden=hidden, inter=inter, inner=s.inner),
        timing=f"per op: a synced call of {s.inner} ops (fori_loop over slot sets) / {s.inner}, median of {s.iters} "
               f"after {s.warmup} untimed", units={"MB read": "MB", "max rel err": ""}),
        getattr(s, "output", "md"), table=result["table"], result=result)
    say()
    say("max rel err = max |Pallas - reference| / max |reference| on the first slot set (reference: the XLA path's "
        "arithmetic, expert_ffn_reference); bf16 roundings differ by an ulp here and there, ~1e-2 is expected")
    if s.json:
        common.write_json(s.json, result)
        say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.expert_ffn_bench", run)


if __name__ == "__main__":
    main(sys.argv)
