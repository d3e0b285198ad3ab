"""agent_turns_bench's report: the table, the notes and the plot of the runs made (also of a saved, possibly cut,
run: --from_json), into the result (and --json, --plot)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks import common, runner
from benchmarks.agent_turns.arms import ARM_OPTIONS
from benchmarks.agent_turns.stats import _mean, summarize


TIMING = ("decode tok/s of whole generate() calls (engine.stats.last), each turn the mean over the arm's runs; x: "
          "per turn, the arm's over the baseline's")


def make_table(summary: list[dict], noise: dict, n_turns: int) -> str:
    return common.format_table(*table_rows(summary, noise, n_turns))


def bench_rows(summary: list[dict], noise: dict, n_turns: int) -> list[runner.Row]:
    """The table's rows in benchmarks/runner.py's schema (params: arm, switches)."""
    headers, rows = table_rows(summary, noise, n_turns)
    return runner.rows_from_table("agent_turns_bench", headers, rows, params=("arm", "switches"), timing=TIMING,
                                  units={"TTFT ms (median)": "ms", "x median": "x", "x min": "x", "x max": "x"})


def table_rows(summary: list[dict], noise: dict, n_turns: int) -> tuple[list[str], list[list]]:
    headers = ["arm", "switches", "decode tok/s", "x median", "x min", "x max", "turns won", "TTFT ms (median)",
               "reused tokens/turn", "hit rate",
               "fetched/turn", "cpu/turn", "skipped/turn", "prior changed", "swaps", "windows/turn",
               "drafts accepted", "same tokens"]
    rows = []
    for a in summary:
        c = a["counters_total"]
        if a["baseline"]:
            x, won = noise["ratio"], f"({noise['faster_turns']}/{n_turns})" if noise["ratio"]["n"] else "-"
        else:
            x, won = a["ratio"], f"{a['turns_won']}/{n_turns}"
        switches = ",".join(f"{k.removeprefix('STRATA_')}={v}" for k, v in a["env"].items()) or "-"
        rows.append([a["name"], switches, a["decode_tok_s_mean"],
                     *(x[k] if x[k] is not None else "-" for k in ("median", "min", "max")), won,
                     1e3 * statistics.median(p["prefill_s"] for p in a["per_turn"]),
                     _mean([p["cached_tokens"] for p in a["per_turn"]]), a["hit_rate_mean"],
                     c["distinct_fetched"] / n_turns, c["distinct_cpu"] / n_turns, c["distinct_skipped"] / n_turns,
                     f"{c['prior_tokens_changed']:g}/{c['prior_tokens']:g}" if c["prior_tokens"] else "-",
                     c["swaps"], a["windows"] / n_turns, f"{a['drafts_accepted']:g}/{a['drafts_proposed']:g}",
                     f"{a['same_tokens_as_base']}/{n_turns}"])
    return headers, rows


def make_plot(path: str, summary: list[dict], noise: dict) -> tuple[str | None, str]:
    """The per-turn ratios against prompt tokens; returns (the path written or None, a line saying so)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "plot: matplotlib is not importable; no plot written (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    pts = sorted((t["prompt_tokens"], t["ratio"]) for t in noise["per_turn"] if t["ratio"] is not None)
    if pts:
        ax.plot(*zip(*pts), color="gray", linestyle="none", marker="x", markersize=5,
                label=f"{summary[0]['name']}: run 2 / run 1 (noise)")
    for a in summary[1:]:
        pts = sorted((t["prompt_tokens"], t["ratio"]) for t in a["per_turn"] if t["ratio"] is not None)
        if pts:
            ax.plot(*zip(*pts), linestyle="none", marker="o", markersize=4, alpha=0.8, label=a["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"decode tok/s / {summary[0]['name']}'s (same turn)")
    ax.set_title("agent turns: per-turn decode ratio to the baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ValueError(f"cannot write --plot={path}: {e}") from None
    finally:
        plt.close(fig)
    return path, f"plot: {path}"


def report(s, arms: list[tuple[str, dict]], runs: list[dict], workload: dict, result: dict) -> dict:
    """The summary, table, notes and plot of the runs made; into result (and --json, --plot)."""
    say = common.say

    def save():
        if s.json:
            common.write_json(s.json, result)

    summary, noise = summarize(arms, runs, workload)
    n_turns = len(workload["turns"])
    table = make_table(summary, noise, n_turns)
    notes = [f"x: per turn, the arm's decode tok/s / {arms[0][0]}'s for the same turn (each the mean of the "
             f"runs it has, {2 * result['settings']['rounds']} when complete); median, min and max over the {n_turns} turns; turns won: x > 1",
             f"{arms[0][0]} row (the baseline): the noise floor, its mirrored runs / its forward runs per turn "
             f"(run 2 / run 1); in brackets the turns where run 2 was faster; its runs gave the same tokens in "
             f"{noise['same_tokens']} of {n_turns} turns" if noise["ratio"]["n"] else
             f"{arms[0][0]} row (the baseline): no noise floor (one run of it)",
             "hit rate: share of the distinct experts a decode window needed already in a slot, mean over turns; "
             "fetched / cpu / skipped per turn: distinct experts of the decode windows, summed over layers and "
             "windows; windows/turn: verify windows per turn; drafts accepted: accepted / proposed drafts over all "
             "turns; same tokens: turns whose generated tokens equal the base's (first runs)"]
    for a in summary:
        if set(a["env"]) - {"STRATA_LOGPOS", *ARM_OPTIONS} and not (a["approx_active"] or a["defer_active"]):
            notes.append(f"note: arm {a['name']}: no switch is active in its engine"
                         + (f" ({'; '.join(a['switch_lines'])})" if a["switch_lines"] else ""))
        elif a["switch_lines"]:
            notes.append(f"{a['name']}: {'; '.join(a['switch_lines'])}")
    device = runs[0]["device"]
    missing = len(result["order"]) - len(runs)
    if missing:
        notes.append(f"note: {missing} of the {len(result['order'])} runs of the order are missing (the benchmark was cut "
                     "short): each arm's ratios use the runs it has" + ("" if noise["ratio"]["n"] else
                                                                          f"; {arms[0][0]}'s noise floor needs both its runs"))
    result.update(device=device, summary=summary, baseline_noise=noise, table=table, notes=notes,
                  complete=not missing)
    say()
    runner.emit(bench_rows(summary, noise, n_turns), getattr(s, "output", "md"), table=table, result=result)
    say()
    for line in notes:
        say(line)
    if device["platform"] == "cpu":
        say("CPU: 'device' and host are the same memory here; the numbers check the path, not PCIe")
    if s.plot:
        result["plot"], line = make_plot(s.plot, summary, noise)
        say(line)
    save()
    if s.json:
        say(f"json: {s.json}")
    return result


def from_json(s) -> dict:
    """--from_json: the report of a result file written by an earlier run (complete or cut short), without running."""
    try:
        result = json.loads(Path(s.from_json).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--from_json={s.from_json}: {e}") from None
    if result.get("benchmark") != "agent_turns_bench" or not result.get("runs"):
        raise ValueError(f"--from_json={s.from_json}: not an agent_turns_bench result with runs")
    present = {r["arm"] for r in result["runs"]}
    arms = [(a["name"], a["env"]) for a in result["arms"] if a["name"] in present]
    if not arms or arms[0][0] != result["arms"][0]["name"]:
        raise ValueError(f"--from_json={s.from_json}: the baseline arm {result['arms'][0]['name']} has no run")
    common.say(f"agent_turns_bench: the report of {s.from_json} ({len(result['runs'])} of {len(result['order'])} runs; "
               f"settings {', '.join(f'{k}={v}' for k, v in result['settings'].items() if k != 'arms')})")
    return report(s, arms, result["runs"], result["workload"], result)

