"""How far each approximation moves the output: teacher-forced log-probs of one known text through the verify
windows, for the exact engine and for every arm, then KL(exact || arm) by position bucket, top-1 agreement and
perplexity (benchmarks/kl_report.py), beside the hit rate and experts fetched per token of the same reads.

    python -m benchmarks.kl_arms --json=out/kl_arms.json        # the reference model, its default arms

Every arm is its own engine over the same checkpoint (the switches are read at start-up), at each cache size
(--slot_fracs of the experts) and --pcie_frac; defer arms need CPU rows, so they run at --defer_pcie_frac. The
exact engine's result does not depend on the placement (tests/offload/test_offload.py), so one exact read at the first cache
size is the base of every row; "exact again" (another placement: the other cache size, every expert resident) is the
floor: what float summation order alone gives. The text (--text_file, default this repository's
strata_jax/offload/slots.py) is not in the reference model's training data (the Python standard library).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARMS = ("skip:STRATA_ROUTE_TAIL_SKIP=5;prior:STRATA_ROUTE_PRIOR=0.5;both:STRATA_ROUTE_TAIL_SKIP=5,"
                "STRATA_ROUTE_PRIOR=0.5;resident:STRATA_ROUTE_RESIDENT=1;defer every:STRATA_VERIFY_DEFER_CPU=1,"
                "STRATA_VERIFY_DEFER_CPU_BELOW=1;defer 0.1:STRATA_VERIFY_DEFER_CPU=1;defer check:"
                "STRATA_VERIFY_DEFER_CPU=check")

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "reference", "Model: reference, reference-next, embedded or a folder.", flag_values=FLAGS)
flags.DEFINE_string("text_file", str(REPO / "strata_jax" / "offload" / "slots.py"), "The known text.",
                    flag_values=FLAGS)
flags.DEFINE_integer("positions", 1200, "Positions scored (bytes of the text for the byte-level models).",
                     lower_bound=2, flag_values=FLAGS)
flags.DEFINE_string("slot_fracs", "0.25,0.5", "Expert cache sizes as a share of the experts.", flag_values=FLAGS)
flags.DEFINE_float("pcie_frac", 1.0, "pcie_frac of the routing arms and the exact base.", lower_bound=0.0,
                   upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_float("defer_pcie_frac", 0.5, "pcie_frac of the defer arms (they need CPU rows).", lower_bound=0.0,
                   upper_bound=0.99, flag_values=FLAGS)
flags.DEFINE_string("arms", DEFAULT_ARMS, "Arms, ';'-separated name:STRATA_VAR=value,... (the R = K - 3 = 5 of the "
                    "reference model's top-8).", flag_values=FLAGS)
flags.DEFINE_integer("window", 4, "Verify window of the reads (every position takes the decode path).",
                     lower_bound=1, upper_bound=16, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.", flag_values=FLAGS)
flags.DEFINE_integer("cpu_threads", 0, "Host pool threads (0 = the cores this process may use).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("out_dir", "", "Keep the logpos files here ('' = a temporary folder).", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
flags.DEFINE_string("cache_dir", "", "Engine cache_dir ('' = ~/.cache/strata_jax).", flag_values=FLAGS)


def run(s) -> dict:
    from benchmarks.kl_report import HEADERS, _table_row, report
    from benchmarks.offload_bench import frac_list, parse_switch_arms
    from strata_jax.engine.api import Engine
    from strata_jax.errors import StrataError

    arms = parse_switch_arms(s.arms)
    fracs = frac_list(s.slot_fracs, "slot_fracs", allow_auto=False, lo_open=True)
    try:
        text = Path(s.text_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read --text_file {s.text_file}: {e}") from None
    out_dir = Path(s.out_dir or tempfile.mkdtemp(prefix="kl_arms_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    common_opts = dict(window=s.window, dtype=s.dtype, cpu_threads=s.cpu_threads, cache_dir=s.cache_dir)
    result = dict(benchmark="kl_arms", settings={n: getattr(s, n) for n in FLAGS}, device=common.device_info(),
                  rows=[])

    def read(name: str, slots, pcie_frac: float, switches: dict) -> tuple[Path, dict]:
        t0 = time.perf_counter()
        eng = Engine.from_pretrained(s.model, verbose=False, expert_cache_slots=str(slots), pcie_frac=pcie_frac,
                                     **common_opts, **switches)
        ids = eng.encode(text)[:s.positions + 1]
        path = out_dir / f"{name.replace(' ', '_')}.jsonl"
        n = eng.write_logpos(ids, path, read="windows", window=s.window, meta=dict(arm=name, switches=switches))
        d = eng.stats.last.decode_experts
        windows = -(-n // s.window)
        info = dict(arm=name, slots=slots, pcie_frac=pcie_frac, switches=switches, positions=n,
                    hit_rate=d.hit_rate if eng.placement else 1.0, fetched_per_token=d.distinct_fetched / n,
                    cpu_per_token=d.distinct_cpu / n, skipped_per_token=d.distinct_skipped / n, windows=windows,
                    approx_lines=d.approx_lines(eng.approx), seconds=time.perf_counter() - t0)
        common.progress(f"{name}: {n} positions, hit rate {info['hit_rate']:.1%}, "
                        f"{info['fetched_per_token']:.2f} fetched + {info['cpu_per_token']:.2f} cpu experts/token "
                        f"({info['seconds']:.0f} s)")
        if eng.placement:
            eng.placement.pool.close()
        return path, info

    from strata_jax.model.config import load_config
    from strata_jax.io.embedded import resolve_model
    from strata_jax.options import EngineOptions, build
    cfg = load_config(resolve_model(s.model, build(EngineOptions, dict(cache_dir=s.cache_dir)).resolved_cache_dir()))
    e = cfg.num_experts
    sizes = [max(1, round(f * e)) for f in fracs]
    common.progress(f"kl_arms: {s.model} ({e} experts top-{cfg.num_experts_per_tok}), {s.positions} positions of "
                    f"{s.text_file}, windows of {s.window}, {s.dtype}; cache sizes {sizes}; arms "
                    + ", ".join(n for n, _ in arms))
    base_path, base_info = read(f"exact S={sizes[0]}", sizes[0], s.pcie_frac, {})
    again = [read(f"exact S={sz}", sz, s.pcie_frac, {}) for sz in sizes[1:]] + [read("exact all", "all", 1.0, {})]
    rows_info = {base_info["arm"]: base_info, **{i["arm"]: i for _, i in again}}
    runs = {i["arm"]: p for p, i in again}
    for sz in sizes:
        for name, switches in arms:
            frac = s.defer_pcie_frac if any(k.startswith("verify_defer") for k in switches) else s.pcie_frac
            label = f"{name} S={sz}"
            path, info = read(label, sz, frac, switches)
            runs[label], rows_info[label] = path, info
    rep = report(base_path, runs)
    table_rows = []
    for r in rep["rows"]:
        info = rows_info.get(r["name"], base_info if r["kind"] == "base" else {})
        r.update({k: info.get(k) for k in ("slots", "pcie_frac", "hit_rate", "fetched_per_token", "cpu_per_token",
                                           "skipped_per_token", "switches", "approx_lines")})
        table_rows.append(_table_row(r) + [info.get("hit_rate"), info.get("fetched_per_token"),
                                           info.get("cpu_per_token")])
        result["rows"].append(r)
    table = common.format_table(HEADERS + ["hit rate", "fetched/token", "cpu/token"], table_rows)
    result["table"] = table
    common.say(f"KL(exact || arm) in nats by position bucket, teacher-forced through windows of {s.window}; base: "
               f"the exact engine at S={sizes[0]}; 'exact S=...' / 'exact all' rows: other placements of the exact "
               "engine (the floor)")
    runner.emit(runner.rows_from_table("kl_arms", HEADERS + ["hit rate", "fetched/token", "cpu/token"], table_rows,
                                       params=HEADERS[:1], timing="no timing: KL of teacher-forced reads",
                                       units={h: "nats" for h in HEADERS[2:7]}),
                getattr(s, "output", "md"), table=table, result=result)
    common.say("hit rate / fetched / cpu per token: distinct experts summed over the MoE layers, per scored "
               "position, in these reads")
    if s.json:
        common.write_json(s.json, result)
        common.say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.kl_arms", run)


if __name__ == "__main__":
    main(sys.argv)
