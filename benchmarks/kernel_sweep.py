"""The decode kernels' knobs searched at a model's shape: the expert FFN (bf16 experts) and the stacked attention
products (q/k/v in one launch, o), each for the two window rows of its TUNING table: decode (T <= 4) and wide
(T <= 16). The file it writes is what `STRATA_KERNEL_TUNING=FILE` reads, so whole runs can be compared with its
picks before a row changes in the code.

    python -m benchmarks kernel-sweep --json=out/sweep.json                # a GPU, the Qwen3-30B-A3B shape
    STRATA_KERNEL_TUNING=out/sweep.json python -m benchmarks peer ...      # whole runs with its picks
    python -m benchmarks kernel-sweep --hidden=128 --inter=64 --experts=16 --q_dim=128 --kv_dim=32 --layers=2 \\
        --configs=2 --iters=1 --inner=1                                    # CPU: interpret mode, a check that it runs

Method: each case (kernel, window row) draws --configs distinct random settings from its grid, the kernel's default
first, and compiles them all at once in --threads threads (one Triton compile takes seconds; one at a time a sweep
covers little). Then each is timed: a jitted fori_loop of --inner ops over other experts / another layer each time
(so the L2 serves no repeat), per op = the call's time / --inner, median of --iters synchronised calls after
--warmup. Each setting's summed output is checked against the XLA reference's (relative Frobenius error < 1e-2), a
wrong one is dropped. A decode row is timed at T=1, then its --finalists fastest again at T=4, the pick the least
mean of the two; a wide row at T=8. The table gives the default and the pick beside the bytes an op reads and the
read bandwidth measured in the same run. Times include the loop's own steps (the same for every setting): compare
settings with them, and take a window's time from `profile` or the generate loop.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import time

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("cases", "expert_ffn,qkv,o", "Kernels: expert_ffn, qkv (the three products of one input), o.",
                    flag_values=FLAGS)
flags.DEFINE_string("rows", "decode,wide", "TUNING rows: decode (T=1, finalists at T=4), wide (T=8).",
                    flag_values=FLAGS)
flags.DEFINE_integer("hidden", 2048, "H: the model width (the q/k/v input, the o output).", lower_bound=16,
                     flag_values=FLAGS)
flags.DEFINE_integer("inter", 768, "I: an expert's intermediate size.", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("experts", 128, "E: experts of a layer (the stacked array the FFN reads).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("top_k", 8, "K: experts a token picks.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("q_dim", 4096, "q's width (heads x head_dim; o's input).", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("kv_dim", 512, "k's and v's width each.", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("layers", 24, "Layers of the attention stacks read in place.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("configs", 64, "Settings drawn per case (the default included).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("finalists", 6, "Decode rows: the fastest at T=1 timed again at T=4.", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("threads", 0, "Compile threads (0: the CPU count).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("iters", 15, "Timed calls per setting (median).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "Untimed calls per setting.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("inner", 20, "Ops per timed call (a fori_loop).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the weights, inputs and the draw of settings.", flag_values=FLAGS)
flags.DEFINE_float("budget_s", 0, "Stop drawing new cases past this many seconds (0: none); the file keeps what "
                   "was done.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the picks and every timing to this JSON file (rewritten after each case).",
                    flag_values=FLAGS)
runner.define_output_flag(FLAGS)

# Each knob's values; "reduce" only where T <= 4 (wider windows take tl.dot whatever it says).
FFN_GRID = dict(reduce=["dot", "sum", "acc"], block_i=[16, 32, 64, 128], block_k=[64, 128, 256, 512],
                block_h=[16, 32, 64, 128], block_i_down=[64, 128, 256], n_split=[1, 2, 4, 8], num_warps=[2, 4, 8],
                num_stages=[1, 2, 3, 4])
LINEAR_GRID = dict(reduce=["dot", "sum", "acc"], block_n=[16, 32, 64, 128, 256], block_k=[32, 64, 128, 256, 512],
                   k_splits=[1, 2, 4, 8, 16, 32], num_warps=[1, 2, 4, 8], num_stages=[1, 2, 3, 4, 5])
WINDOWS = {"decode": (1, 4), "wide": (8,)}  # the row's T, then its finalists' T
TOLERANCE = 1e-2


def draw(grid: dict, default: dict, count: int, rng, wide: bool) -> list[dict]:
    """The default, then distinct random settings of the grid (wide rows: reduce fixed at the default's)."""
    grid = {k: (v if not (wide and k == "reduce") else [default[k]]) for k, v in grid.items()}
    out, seen = [dict(default)], {tuple(sorted(default.items()))}
    space = 1
    for values in grid.values():
        space *= len(values)
    while len(out) < min(count, space):
        cfg = {k: values[int(rng.integers(len(values)))] for k, values in grid.items()}
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def compile_all(jobs: list, threads: int, label: str) -> list:
    """jobs: (lower, args) -> [(compiled or None, error or None, seconds)], compiled `threads` at a time."""
    def one(job):
        lower, args = job
        t0 = time.perf_counter()
        try:
            return lower(*args).compile(), None, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (a setting that does not compile or fit: dropped, said in the file)
            return None, (str(e).strip().splitlines() or [type(e).__name__])[0][:200], time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        out = list(pool.map(one, jobs))
    common.progress(f"{label}: {sum(c is not None for c, _, _ in out)} of {len(jobs)} settings compiled in "
                    f"{time.perf_counter() - t0:.0f} s on {threads} threads")
    return out


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.pallas_kernels import expert_ffn as ffn
    from strata_jax.pallas_kernels import stacked_linear as sl

    cases = runner.name_list(s.cases, "cases", choices=["expert_ffn", "qkv", "o"])
    rows = runner.name_list(s.rows, "rows", choices=list(WINDOWS))
    dev = common.device_info()
    interpret = dev["platform"] != "gpu"
    threads = s.threads or os.cpu_count() or 1
    say = common.say
    bw_bytes = (4096 if dev["platform"] != "cpu" else 64) * 2**20
    common.progress(f"measuring read bandwidth over {bw_bytes / 2**30:.2f} GiB")
    bandwidth = common.measure_read_bandwidth(bw_bytes, reps=5)["bandwidth_Bps"]
    say(f"kernel_sweep: H={s.hidden}, I={s.inter}, E={s.experts}, K={s.top_k}, q {s.q_dim}, k/v {s.kv_dim}, "
        f"{s.layers} layers stacked, bf16; {s.configs} settings a case, compiled on {threads} threads")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}"
        + ("" if not interpret else "; kernels in INTERPRET mode (not a GPU: the times mean nothing)"))
    say(f"memory read bandwidth (measured now): {bandwidth / 1e9:,.0f} GB/s")
    say(f"timed: per op, median of {s.iters} synchronised calls (after {s.warmup}), each a jitted fori_loop of "
        f"{s.inner} ops on other experts / another layer each")
    say()

    rng = np.random.default_rng(s.seed)
    key = jax.random.key(s.seed)
    normal = lambda i, shape, fan_in: (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
                                       / np.sqrt(fan_in)).astype(jnp.bfloat16)
    weights = {}
    controls = {}  # (case, T) -> the time of its XLA reference loop (the stacked path: layer slice, then XLA's product)

    def experts():
        if "ffn" not in weights:
            common.progress(f"making {s.experts} random bf16 experts")
            weights["ffn"] = (normal(1, (s.experts, s.inter, s.hidden), s.hidden),
                              normal(2, (s.experts, s.inter, s.hidden), s.hidden),
                              normal(3, (s.experts, s.hidden, s.inter), s.inter))
        return weights["ffn"]

    def stacks(case):
        if case not in weights:
            ns, kdim = ((s.q_dim, s.kv_dim, s.kv_dim), s.hidden) if case == "qkv" else ((s.hidden,), s.q_dim)
            weights[case] = (tuple(normal(10 + j + 5 * (case == "o"), (s.layers, kdim, nj), kdim)
                                   for j, nj in enumerate(ns)), kdim)
        return weights[case]

    def problem(case, t):
        """(op(cfg) -> a jitted loop of `inner` ops, its args, the reference loop's output, bytes an op reads)"""
        if case == "expert_ffn":
            gate, up, down = experts()
            n = min(t * s.top_k, s.experts)
            x = jnp.asarray(rng.standard_normal((t, s.hidden)), jnp.bfloat16)
            comb = np.zeros((t, n), np.float32)
            for j in range(t):
                comb[j, [(j * s.top_k + c) % n for c in range(s.top_k)]] = 1.0 / s.top_k
            comb = jnp.asarray(comb)
            sets = jnp.asarray(np.stack([rng.choice(s.experts, n, replace=False) for _ in range(s.inner)]),
                               jnp.int32)

            def loop(op):
                @jax.jit
                def f(x, sets, gate, up, down):  # the weights as arguments: jit embeds closed-over arrays as
                    # constants, a device copy of them in each compiled setting (out of memory on an H100)
                    return jax.lax.fori_loop(0, s.inner, lambda r, a: a + op(x, gate, up, down, sets[r], comb),
                                             jnp.zeros(x.shape, jnp.float32))
                return f

            make = lambda cfg: loop(functools.partial(ffn.expert_ffn, interpret=interpret, **cfg))
            args = (x, sets, gate, up, down)
            ref = loop(ffn.expert_ffn_reference)(*args)
            return make, args, ref, n * 3 * s.hidden * s.inter * 2
        ws, kdim = stacks(case)
        x = jnp.asarray(rng.standard_normal((t, kdim)), jnp.bfloat16)
        width = sum(w.shape[2] for w in ws)

        def loop(op):
            @jax.jit
            def f(x, start, ws):  # the stacks as arguments (as the expert loop's weights)
                return jax.lax.fori_loop(0, s.inner, lambda r, a: a + op(x, ws, (start + r) % s.layers),
                                         jnp.zeros((x.shape[0], width), jnp.float32))
            return f

        make = lambda cfg: loop(functools.partial(sl.stacked_linear, interpret=interpret, **cfg))
        reference = loop(sl.stacked_linear_reference)
        args = (x, jnp.int32(0), ws)
        ref = reference(*args)
        controls[case, t] = lambda: common.time_synced(lambda i: reference(*args), iters=s.iters,
                                                    warmup=s.warmup).median_ms * 1e3 / s.inner
        return make, args, ref, kdim * width * 2

    def unrolled_us(case, t, product, per_layer: bool):
        """us an op of `product` over `inner` layers unrolled in one graph (no loop: the yardstick against the
        sweep's fori_loop), each op behind an optimization barrier so XLA keeps them apart. per_layer: the
        product gets one unstacked [K, sum N_j] array a layer (XLA's own dot); else the stacks and a layer index."""
        ws, kdim = stacks(case)
        per = [jnp.concatenate([w[layer] for w in ws], axis=1) for layer in range(min(s.inner, s.layers))] \
            if per_layer else None
        x = jnp.asarray(rng.standard_normal((t, kdim)), jnp.bfloat16)

        @jax.jit
        def f(x, arrays):
            acc = jnp.zeros((t, sum(w.shape[2] for w in ws)), jnp.float32)
            for r in range(s.inner):
                x, acc = jax.lax.optimization_barrier((x, acc))
                acc = acc + (product(x, arrays[r % len(arrays)]) if per_layer
                             else product(x, arrays, jnp.int32(r % s.layers)))
            return acc

        arrays = per if per_layer else ws
        jax.block_until_ready(f(x, arrays))
        return common.time_synced(lambda i: f(x, arrays), iters=s.iters, warmup=s.warmup).median_ms * 1e3 / s.inner

    def xla_control(case, t):
        """XLA's own product (cuBLAS on a GPU) over one unstacked weight array a layer (no in-place read, no slice
        copy), unrolled: what a product of this shape takes."""
        return unrolled_us(case, t, lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32), True)

    def kernel_unrolled(case, t, cfg):
        """The kernel with setting `cfg`, reading the stacks in place, unrolled as xla_control: against the sweep's
        fori_loop time of the same setting, what the loop costs an op."""
        return unrolled_us(case, t, functools.partial(sl.stacked_linear, interpret=interpret, **cfg), False)

    def time_all(make, args, ref, cfgs, label):
        """[(cfg, us or None, error or None)] for the settings, compiled at once, then timed one by one."""
        compiled = compile_all([(make(c).lower, args) for c in cfgs], threads, label)
        out = []
        for cfg, (exe, error, _) in zip(cfgs, compiled):
            if exe is not None:
                got = exe(*args)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                if not err < TOLERANCE:
                    exe, error = None, f"wrong result: relative error {err:.3g}"
            if exe is None:
                out.append((cfg, None, error))
                continue
            timing = common.time_synced(lambda i: exe(*args), iters=s.iters, warmup=s.warmup)
            out.append((cfg, timing.median_ms * 1e3 / s.inner, None))
        return out

    defaults = {"expert_ffn": lambda row: ffn.TUNING[row], "qkv": lambda row: sl.TUNING[("qkv", row)],
                "o": lambda row: sl.TUNING[("o", row)]}
    result = dict(benchmark="kernel_sweep", settings={n: getattr(s, n) for n in FLAGS}, device=dev,
                  bandwidth_Bps=bandwidth, interpret=interpret, picks={}, cases={}, complete=False)
    t_start = time.perf_counter()
    table = []
    for case in cases:
        for row in rows:
            if s.budget_s and time.perf_counter() - t_start > s.budget_s:
                common.progress(f"budget of {s.budget_s:.0f} s spent: {case}:{row} and later cases not swept")
                continue
            default = dict(defaults[case](row))
            grid = FFN_GRID if case == "expert_ffn" else LINEAR_GRID
            cfgs = draw(grid, default, s.configs, rng, wide=row == "wide")
            first, *later = WINDOWS[row]
            make, args, ref, nbytes = problem(case, first)
            timed = time_all(make, args, ref, cfgs, f"{case}:{row} T={first}")
            record = dict(T=first, bytes=nbytes, settings=[dict(config=c, us=us, error=e) for c, us, e in timed])
            ok = sorted((us, i) for i, (_, us, _) in enumerate(timed) if us is not None)
            if not ok:
                raise ValueError(f"{case}:{row}: no setting compiled and matched the reference "
                                 f"(first error: {timed[0][2]})")
            score = {i: us for us, i in ok}
            if later:  # the finalists (and the default) again at the row's other T
                finalists = sorted({0, *[i for _, i in ok[:s.finalists]]} & set(score))
                make2, args2, ref2, nbytes2 = problem(case, later[0])
                again = time_all(make2, args2, ref2, [cfgs[i] for i in finalists], f"{case}:{row} T={later[0]}")
                record["finalists"] = dict(T=later[0], bytes=nbytes2, settings=[
                    dict(config=c, us=us, error=e) for c, us, e in again])
                score = {i: (score[i] + us) / 2 for i, (_, us, _) in zip(finalists, again) if us is not None}
            pick = min(score, key=score.get)
            result["picks"][f"{case}:{row}"] = cfgs[pick]
            result["cases"][f"{case}:{row}"] = record
            us_default, us_pick = timed[0][1], timed[pick][1]
            us_xla = xla_control(case, first) if case != "expert_ffn" else None
            us_slice = controls[case, first]() if case != "expert_ffn" else None
            us_unrolled = kernel_unrolled(case, first, cfgs[pick]) if case != "expert_ffn" else None
            record["xla_control_us"], record["xla_stacked_us"] = us_xla, us_slice
            record["pick_unrolled_us"] = us_unrolled
            table.append([f"{case}:{row}", first, nbytes / 1e6, "-" if us_xla is None else us_xla,
                          "-" if us_slice is None else us_slice, us_default, us_pick,
                          "-" if us_unrolled is None else us_unrolled,
                          nbytes / (us_pick * 1e-6) / bandwidth * 100 if us_pick else None,
                          (us_default / us_pick) if us_default and us_pick else None, len(ok), len(cfgs),
                          ", ".join(f"{k}={v}" for k, v in cfgs[pick].items() if v != default.get(k)) or "default"])
            said = f"{us_default:.1f} us" if us_default else f"failed ({timed[0][2]})"
            common.progress(f"{case}:{row}: default {said}, pick {us_pick:.1f} us ({table[-1][-1]})")
            if s.json:
                common.write_json(s.json, result)
    result["complete"] = True
    headers = ["case", "T", "MB an op", "XLA, unstacked us", "XLA, stacked us", "default us", "pick us",
               "pick unrolled us", "pick % of read bw", "speed-up", "settings ran", "drawn",
               "pick (knobs unlike the default)"]
    result["table"] = common.format_table(headers, table)
    runner.emit(runner.rows_from_table(
        "kernel_sweep", headers, table, params=["case"], fixed=dict(hidden=s.hidden, inter=s.inter),
        timing=f"per op: a synced call of {s.inner} ops (fori_loop) / {s.inner}, median of {s.iters}",
        units={"MB an op": "MB", "XLA, unstacked us": "us", "XLA, stacked us": "us", "pick unrolled us": "us",
               "speed-up": "x", "settings ran": "", "drawn": ""}),
        getattr(s, "output", "md"), table=result["table"], result=result)
    say()
    say("XLA, unstacked: the q/k/v or o product by XLA's own dot over one weight array a layer (not stacked: no "
        "in-place read), unrolled in one graph; the yardstick of a product of this shape (none for the expert FFN). "
        "XLA, stacked: the engine's XLA path (dense_kernel=xla) in the sweep's loop: the layer sliced out of each "
        "stack, then XLA's product (with XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true the slice may be "
        "read in place). Pick unrolled: the picked setting timed as the XLA, unstacked column is (no loop)")
    say("decode rows: the pick is the least mean of its T=1 and T=4 times among the T=1 finalists; its T=1 time is "
        "shown. Use the picks in whole runs: STRATA_KERNEL_TUNING=<this --json file>")
    if s.json:
        common.write_json(s.json, result)
        say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.kernel_sweep", run)


if __name__ == "__main__":
    main(sys.argv)
