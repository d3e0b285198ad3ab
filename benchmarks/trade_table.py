"""Each approximation's two sides in one table: its drift (benchmarks.kl_arms) beside its decode speed
(benchmarks.agent_turns_bench), per arm and expert cache size.

    python -m benchmarks.trade_table --kl=out/kl_arms.json \\
        --ab=out/agent_route16.json,out/agent_route32.json,out/agent_defer16.json,out/agent_defer32.json \\
        --markdown=out/trade.md --json=out/trade.json

A kl_arms row and an A/B arm are the same arm when they set the same switches (kl_arms' engine option names, the
A/B's STRATA_* variables) at the same expert_cache_slots and pcie_frac (kl_arms reads the defer arms at its
--defer_pcie_frac, the A/Bs run at their --pcie_frac). An A/B's baseline (no switch) is an "exact" row: KL 0 by
definition, and its ratio column is the A/B's noise floor (its mirrored runs against its forward runs). A row with
no match shows "-" in the other half (kl_arms' exact reads at other placements: the KL floor, no A/B).

Columns: KL all / KL 640+ (mean top-20 KL(exact || arm) over all positions / the positions past 640), top-1
(agreement with the exact engine's best token), hit rate and fetched/token of the KL read (teacher-forced through
verify windows, so its own cache history), then the A/B's median per-turn decode ratio to its baseline with min and
max, the turns the arm won, and the A/B's mean decode hit rate.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from benchmarks import common, runner
from strata_jax.options import env_name

FLAGS = flags.FlagValues()
flags.DEFINE_string("kl", "", "The JSON file of a benchmarks.kl_arms run.", flag_values=FLAGS)
flags.DEFINE_string("ab", "", "Comma-separated JSON files of benchmarks.agent_turns_bench runs.", flag_values=FLAGS)
flags.DEFINE_string("markdown", "", "Also write the table here.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the joined rows here.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)


def _key(slots, pcie_frac, env: dict[str, str]) -> tuple[str, float, frozenset]:
    return str(slots), float(pcie_frac), frozenset(env.items())


def _order(row: dict) -> tuple:
    """Cache sizes ascending ('all' last), then PCIe share descending, the exact row first, then as given."""
    slots = row["slots"]
    return (slots == "all", int(slots) if slots.isdigit() else 0, -row["pcie_frac"], bool(row["switches"]))


def join(kl: dict, abs_: list[dict]) -> list[dict]:
    """One row per (cache size, PCIe share, arm) of either side; an A/B's baseline without a KL row is an exact row
    (KL 0 by definition)."""
    ab_arms: dict[tuple, dict] = {}
    for ab in abs_:
        slots = ab["settings"]["expert_cache_slots"]
        noise = ab["baseline_noise"]
        for arm in ab["summary"]:
            env = {k: v for k, v in arm["env"].items() if k != "STRATA_LOGPOS"}
            ab_arms[_key(slots, ab["settings"]["pcie_frac"], env)] = dict(
                arm=arm["name"], env=env, pcie_frac=ab["settings"]["pcie_frac"], turns=len(arm["per_turn"]),
                ratio=noise["ratio"] if arm["baseline"] else arm["ratio"], noise_floor=arm["baseline"],
                turns_won=noise["faster_turns"] if arm["baseline"] else arm["turns_won"],
                hit_rate=arm["hit_rate_mean"], decode_tok_s=arm["decode_tok_s_mean"])
    rows, used = [], set()
    for r in kl["rows"]:
        env = {env_name(k): v for k, v in r["switches"].items()}
        key = _key(r["slots"], r["pcie_frac"], env)
        used.add(key)
        rows.append(dict(slots=str(r["slots"]), pcie_frac=float(r["pcie_frac"]), name=r["name"], switches=env,
                         kl_all=r["kl"]["all"],
                         kl_640=r["kl"].get("640+"), top1=r["top1"], kl_hit_rate=r["hit_rate"],
                         kl_fetched_per_token=r["fetched_per_token"],
                         ab=ab_arms.get(key)))
    for key, ab in ab_arms.items():
        if key in used:
            continue
        slots, pcie_frac, _ = key
        exact = not ab["env"]
        rows.append(dict(slots=slots, pcie_frac=pcie_frac, name=ab["arm"], switches=ab["env"],
                         kl_all=0.0 if exact else None, kl_640=0.0 if exact else None, top1=1.0 if exact else None,
                         kl_hit_rate=None, kl_fetched_per_token=None, ab=ab))
    return sorted(rows, key=_order)


HEADERS = ["cache slots", "arm", "switches", "KL all", "KL 640+", "top-1", "hit rate (KL read)",
               "fetched/token (KL read)", "decode x median (A/B)", "x min", "x max", "turns won", "hit rate (A/B)",
               "pcie_frac"]


def make_table(rows: list[dict]) -> str:
    return common.format_table(HEADERS, table_cells(rows))


def table_cells(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        ab = r["ab"]
        sw = ",".join(f"{k.removeprefix('STRATA_')}={v}" for k, v in r["switches"].items()) or "- (exact)"
        x = ab["ratio"] if ab else {}
        won = "-" if not ab else (f"({ab['turns_won']}/{ab['turns']})" if ab["noise_floor"]
                                  else f"{ab['turns_won']}/{ab['turns']}")
        median = x.get("median")
        out.append([r["slots"], r["name"], sw, *(v if v is not None else "-" for v in
                                                  (r["kl_all"], r["kl_640"], r["top1"], r["kl_hit_rate"],
                                                   r["kl_fetched_per_token"])),
                    (f"{median:.2f} (noise floor)" if ab and ab["noise_floor"] and median is not None
                     else median if median is not None else "-"),
                    x.get("min") if x.get("min") is not None else "-", x.get("max") if x.get("max") is not None
                    else "-", won, ab["hit_rate"] if ab else "-", f"{r['pcie_frac']:g}"])
    return out


def _load(path: str, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--{what}={path}: cannot read it as JSON ({e.__class__.__name__}: {e})") from None


def run(s) -> dict:
    if not s.kl or not s.ab:
        raise ValueError("give --kl=<kl_arms JSON> and --ab=<agent_turns_bench JSON>,...")
    kl = _load(s.kl, "kl")
    ab_paths = runner.parse_list(s.ab, str, "ab")
    abs_ = [_load(p, "ab") for p in ab_paths]
    for path, ab in zip(ab_paths, abs_):
        if ab.get("benchmark") != "agent_turns_bench" or "summary" not in ab:
            raise ValueError(f"--ab={path.strip()}: not an agent_turns_bench result (no summary)")
    if kl.get("benchmark") != "kl_arms":
        raise ValueError(f"--kl={s.kl}: not a kl_arms result")
    rows = join(kl, abs_)
    table = make_table(rows)
    result = dict(benchmark="trade_table", kl=s.kl, ab=ab_paths, rows=rows, table=table)
    runner.emit(runner.rows_from_table("trade_table", HEADERS, table_cells(rows),
                                       params=["cache slots", "arm", "switches", "pcie_frac"],
                                       timing="no timing of its own: kl_arms' KL beside the A/B runs' decode ratios",
                                       units={"KL all": "nats", "KL 640+": "nats", "decode x median (A/B)": "x",
                                              "x min": "x", "x max": "x"}),
                getattr(s, "output", "md"), table=table, result=result)
    common.say("KL: mean top-20 KL(exact || arm), teacher-forced reads through verify windows; decode x: per-turn decode "
          "tok/s / the A/B baseline's, median (min, max) over the turns; the exact rows' x is the baseline's noise "
          "floor (its mirrored runs / its forward runs)")
    if s.markdown:
        Path(s.markdown).write_text(table + "\n")
    if s.json:
        common.write_json(s.json, result)
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the rows. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.trade_table", run)


if __name__ == "__main__":
    main(sys.argv)
