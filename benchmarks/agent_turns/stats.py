"""agent_turns_bench's statistics: per arm, the per-turn means over its runs and the ratios to the baseline arm;
the baseline's noise floor (its mirrored runs over its forward ones)."""
from __future__ import annotations

import statistics


def _stats(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return dict(median=None, min=None, max=None, n=0)
    return dict(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals))


def _mean(values):
    return statistics.fmean(values) if values else 0.0


def summarize(arms: list[tuple[str, dict]], runs: list[dict], workload: dict) -> tuple[list[dict], dict]:
    """Per arm: per-turn means over its runs and ratios to the base; the base's noise floor."""
    n_turns = len(workload["turns"])
    by_arm = {name: [r for r in runs if r["arm"] == name] for name, _ in arms}
    base_name = arms[0][0]

    def turn_mean(rs, key, i):
        return _mean([r["turns"][i][key] for r in rs])

    base_tok = [turn_mean(by_arm[base_name], "decode_tok_s", i) for i in range(n_turns)]
    base_tokens = [by_arm[base_name][0]["turns"][i]["tokens"] for i in range(n_turns)]
    out = []
    for name, switches in arms:
        rs = by_arm[name]
        per_turn = []
        for i in range(n_turns):
            tok = turn_mean(rs, "decode_tok_s", i)
            t = workload["turns"][i]
            row = dict(index=i, session=t["session"], turn=t["turn"], prompt_tokens=t["prompt_tokens"],
                       decode_tok_s=tok, decode_tok_s_runs=[r["turns"][i]["decode_tok_s"] for r in rs],
                       ratio=tok / base_tok[i] if base_tok[i] > 0 else None,
                       prefill_s=turn_mean(rs, "prefill_s", i), hit_rate=turn_mean(rs, "hit_rate", i),
                       cached_tokens=_mean([r["turns"][i].get("cached_tokens", 0) for r in rs]),  # older JSON: 0
                       same_tokens_as_base=rs[0]["turns"][i]["tokens"] == base_tokens[i])
            for key in ("distinct_fetched", "distinct_cpu", "distinct_skipped"):
                row[key] = turn_mean(rs, key, i)
            row["decode_experts"] = {k: _mean([r["turns"][i]["decode_experts"][k] for r in rs])
                                     for k in rs[0]["turns"][i]["decode_experts"]}
            per_turn.append(row)
        ratios = [p["ratio"] for p in per_turn]
        totals = {k: _mean([sum(t["decode_experts"][k] for t in r["turns"]) for r in rs])
                  for k in rs[0]["turns"][0]["decode_experts"] if k != "hit_rate"}
        out.append(dict(name=name, baseline=name == base_name, env=switches, runs=len(rs),
                        run_order_positions=[r["order_index"] for r in rs],
                        decode_tok_s_mean=_mean([p["decode_tok_s"] for p in per_turn]),
                        ratio=_stats(ratios), turns_won=sum(1 for x in ratios if x is not None and x > 1),
                        hit_rate_mean=_mean([p["hit_rate"] for p in per_turn]),
                        same_tokens_as_base=sum(p["same_tokens_as_base"] for p in per_turn),
                        **{k: _mean([sum(t.get(k, 0) for t in r["turns"]) for r in rs])
                           for k in ("windows", "drafts_proposed", "drafts_accepted")},
                        counters_total=totals, approx=rs[0]["approx"], approx_active=rs[0]["approx_active"],
                        defer=rs[0]["defer"], defer_active=rs[0]["defer_active"],
                        switch_lines=rs[0]["switch_lines"], per_turn=per_turn))
    # Noise floor: the base's mirrored runs (2nd of each pair) over its forward ones (1st of each pair).
    b = by_arm[base_name]
    forward, mirrored = b[0::2], b[1::2]
    noise_turns = []
    for i in range(n_turns):
        f, m = turn_mean(forward, "decode_tok_s", i), turn_mean(mirrored, "decode_tok_s", i)
        noise_turns.append(dict(index=i, prompt_tokens=workload["turns"][i]["prompt_tokens"],
                                ratio=m / f if f > 0 and mirrored else None,  # None: a run cut short
                                same_tokens=bool(mirrored)
                                and forward[0]["turns"][i]["tokens"] == mirrored[0]["turns"][i]["tokens"]))
    noise = dict(what="base: per turn, mean decode tok/s of its mirrored runs / its forward runs (run 2 / run 1)",
                 ratio=_stats([t["ratio"] for t in noise_turns]),
                 faster_turns=sum(1 for t in noise_turns if t["ratio"] is not None and t["ratio"] > 1),
                 same_tokens=sum(t["same_tokens"] for t in noise_turns), per_turn=noise_turns)
    return out, noise

