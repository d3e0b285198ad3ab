"""The route prior alone: what re-picking each token's top-K with a bonus for resident experts costs per MoE layer,
beside the plain router's top-K (XLA), for the Pallas kernel and for the same rule in jnp.

    python -m benchmarks.route_prior_bench --shapes=16x4 --tokens=1,3 --iters=2 --inner=2   # CPU, seconds
    python -m benchmarks.route_prior_bench --json=out/route_prior.json                      # H200

For each shape E x K (experts, experts per token) and window size T, three paths on the same random inputs:
- XLA top-k: `jax.lax.top_k(jax.nn.softmax(logits), K)` and the renormalisation, what the exact router does;
- Pallas prior: `strata_jax.pallas_kernels.route_prior.route_prior` (interpret mode off the GPU);
- jnp prior: `route_prior_reference`, the same rule in jnp (XLA's top_k and sort).
Inputs: logits [T, E] ~ N(0, 1) float32, a resident mask with round(--resident_frac * E) random experts resident,
lam [T] = --lam for every token, keep = --keep.

Timing: each sample is one jitted call that runs the op --inner times in a fori_loop, each time on other random
logits and another resident mask (so XLA cannot hoist the op), summing every output of the op into the loop carry
(so none of it is dead code), synchronised with block_until_ready; per-op time = sample / inner; the median over
--iters samples after --warmup untimed calls. The samples rotate over a few input sets. The loop is unrolled, so a
call is `inner` ops back to back as in a forward pass: the ops take microseconds, and a rolled loop's own per-step
cost on a GPU is of the same order (a few us per op on an H200). Per-op time still holds 1/inner of the call's
dispatch and synchronisation (tens of us on a GPU): a larger --inner shrinks that share; with --inner=1 it is all
in.

Check: on the first input set, the kernel against the reference, op by op: ids equal, weights within 1e-6
(absolute), changed equal; "ok" or "MISMATCH". Changed tokens: how many of the T tokens got a top-K set other than
the unbiased one, the mean over those ops.
"""
from __future__ import annotations

import sys

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("shapes", "128x8,512x10", "E x K pairs (experts x experts per token), comma-separated.",
                    flag_values=FLAGS)
flags.DEFINE_string("tokens", "1,4,8,64", "Window sizes T, comma-separated.", flag_values=FLAGS)
flags.DEFINE_float("lam", 0.5, "Lambda: the logit bonus of a resident expert, the same for every token.",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("keep", 0, "J: the unbiased top-J experts are always kept (at most every shape's K).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_float("resident_frac", 0.5, "Share of the E experts resident in the device cache.", lower_bound=0.0,
                   upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_integer("iters", 50, "Timed samples per row and path (median reported).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed calls per row and path before timing.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("inner", 10, "Ops per timed call (a fori_loop over input sets); 1 = one op per call.",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the logits and resident masks.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each row).", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

INPUT_SETS = 4  # timed calls rotate over this many [inner, ...] input sets
WEIGHT_ATOL = 1e-6


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'128x8,512x10' -> [(128, 8), (512, 10)]; 1 <= K <= E (benchmarks.runner.parse_list)."""
    def shape(part: str) -> tuple[int, int]:
        e, k = (int(v) for v in part.lower().split("x"))
        return e, k
    out = runner.parse_list(text, shape, "shapes", what="ExK (e.g. 128x8)")
    for e, k in out:
        if not 1 <= k <= e:
            raise ValueError(f"--shapes: {e}x{k} needs 1 <= K <= E")
    return out


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.pallas_kernels.route_prior import route_prior, route_prior_reference

    shapes = parse_shapes(s.shapes)
    windows = common.int_list(s.tokens, "tokens")
    if s.keep > min(k for _, k in shapes):
        raise ValueError(f"--keep={s.keep} is larger than the smallest K in --shapes={s.shapes}")
    dev = common.device_info()
    on_gpu = dev["platform"] == "gpu"
    interpret = not on_gpu

    say = common.say
    say(f"route_prior_bench: shapes (E x K) {s.shapes}, T {s.tokens}; lam={s.lam}, keep={s.keep}, "
        f"resident_frac={s.resident_frac}; logits float32 ~ N(0, 1)")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}"
        + ("" if on_gpu else "; Pallas kernel in INTERPRET mode (not a GPU: its time means nothing)"))
    say(f"timed: per op, median of {s.iters} synchronised calls (after {s.warmup} warm-up), each call a jitted "
        f"unrolled fori_loop of {s.inner} op(s) on different random logits and resident masks, every output summed "
        "into the loop carry; XLA top-k = top_k(softmax(logits), K) + renormalisation, Pallas prior = route_prior, "
        "jnp prior = route_prior_reference")

    def looped(op):
        """A jitted, unrolled fori_loop of op over [inner, ...] input sets, summing every output (bools as int32)."""
        @jax.jit
        def f(logits_sets, resident_sets, lam):  # [inner, T, E], [inner, E], [T]
            shapes_ = jax.eval_shape(op, logits_sets[0], resident_sets[0], lam)
            init = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.int32 if a.dtype == jnp.bool_ else a.dtype),
                                shapes_)

            def body(r, acc):
                out = op(logits_sets[r], resident_sets[r], lam)
                return jax.tree.map(lambda a, o: a + o.astype(a.dtype), acc, out)
            return jax.lax.fori_loop(0, logits_sets.shape[0], body, init, unroll=True)
        return f

    rng = np.random.default_rng(s.seed)
    result = dict(benchmark="route_prior_bench", settings={name: getattr(s, name) for name in FLAGS}, device=dev,
                  interpret=interpret,
                  timing_scope=(f"median over iters of synchronised jitted calls, each an unrolled fori_loop of "
                                f"{s.inner} ops on different logits and resident masks; per-op = call / inner"),
                  rows=[], complete=False)

    for e, k in shapes:
        n_resident = round(s.resident_frac * e)

        def xla_op(logits, resident, lam, k=k):
            weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
            return ids, weights / jnp.sum(weights, axis=-1, keepdims=True)

        def pallas_op(logits, resident, lam, k=k):
            return route_prior(logits, resident, lam, k=k, keep=s.keep, interpret=interpret)

        def jnp_op(logits, resident, lam, k=k):
            return route_prior_reference(logits, resident, lam, k=k, keep=s.keep)

        paths = dict(xla=looped(xla_op), pallas=looped(pallas_op), jnp=looped(jnp_op))

        for t in windows:
            def input_set():
                logits = rng.standard_normal((s.inner, t, e)).astype(np.float32)
                resident = np.zeros((s.inner, e), bool)
                for r in range(s.inner):
                    resident[r, rng.choice(e, n_resident, replace=False)] = True
                return jnp.asarray(logits), jnp.asarray(resident)

            sets = [input_set() for _ in range(INPUT_SETS)]  # each ([inner, T, E], [inner, E])
            lam = jnp.full((t,), s.lam, jnp.float32)  # [T]

            # Check the kernel against the reference, op by op, on the first set.
            ok, max_weight_diff, changed_counts = True, 0.0, []
            logits0, resident0 = sets[0]
            for r in range(s.inner):
                ids, w, changed = pallas_op(logits0[r], resident0[r], lam)
                ref_ids, ref_w, ref_changed = jnp_op(logits0[r], resident0[r], lam)
                diff = float(jnp.max(jnp.abs(w - ref_w)))
                max_weight_diff = max(max_weight_diff, diff)
                ok &= bool(jnp.array_equal(ids, ref_ids) and jnp.array_equal(changed, ref_changed)
                           and diff <= WEIGHT_ATOL)
                changed_counts.append(int(jnp.sum(ref_changed)))

            row = dict(E=e, K=k, T=t, resident=n_resident, check="ok" if ok else "MISMATCH",
                       max_weight_diff=max_weight_diff, changed_tokens_mean=float(np.mean(changed_counts)),
                       changed_fraction=float(np.mean(changed_counts)) / t)
            for name, f in paths.items():
                common.progress(f"E={e} K={k} T={t}: {name}: compiling, then {s.warmup} warm-up + {s.iters} timed "
                                "calls")
                timing = common.time_synced(lambda i: f(*sets[i % INPUT_SETS], lam), iters=s.iters,
                                            warmup=s.warmup)
                row[f"{name}_us"] = timing.median_ms * 1e3 / s.inner
                row[f"{name}_timing"] = timing.summary()
            row["pallas_over_xla"] = row["pallas_us"] / row["xla_us"]
            row["jnp_over_xla"] = row["jnp_us"] / row["xla_us"]
            result["rows"].append(row)
            common.progress(f"E={e} K={k} T={t}: XLA {row['xla_us']:.1f} us, Pallas {row['pallas_us']:.1f} us, jnp "
                            f"{row['jnp_us']:.1f} us, changed {row['changed_tokens_mean']:.2f} of {t}, {row['check']}")
            if s.json:
                common.write_json(s.json, result)

    result["complete"] = True
    headers = ["E", "K", "T", "XLA top-k us", "Pallas prior us", "jnp prior us", "Pallas/XLA", "changed tokens",
               "check"]
    rows = [[r["E"], r["K"], r["T"], r["xla_us"], r["pallas_us"], r["jnp_us"], r["pallas_over_xla"],
             r["changed_tokens_mean"], r["check"]] for r in result["rows"]]
    result["table"] = runner.table(s, "route_prior_bench", headers, rows, params=["E", "K", "T"], result=result,
                                   timing="per op, synced calls, median", units={"Pallas/XLA": "x"})
    say()
    say(f"changed tokens = tokens (of T) whose top-K set the prior changed, mean over the {s.inner} checked ops; "
        f"check = kernel vs route_prior_reference on those ops: ids and changed equal, weights within {WEIGHT_ATOL:g}")
    if s.json:
        common.write_json(s.json, result)
        say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.route_prior_bench", run)


if __name__ == "__main__":
    main(sys.argv)
