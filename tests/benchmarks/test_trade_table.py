"""benchmarks/trade_table.py: each kl_arms row is joined with the A/B arm of the same switches, cache size and PCIe
share, an A/B baseline is the exact row with its noise floor, nothing is matched across PCIe shares, and a bad file
is one line."""
from __future__ import annotations

import json
import random
import subprocess
import sys

from benchmarks import trade_table
from conftest import REPO


def kl_row(name, slots, pcie, switches, kl_all, rng):
    return dict(name=name, kind="base" if name == "base" else "run", slots=slots, pcie_frac=pcie, switches=switches,
                kl={"all": kl_all, "640+": kl_all * 1.5}, top1=1.0 - 3 * kl_all, hit_rate=rng.random(),
                fetched_per_token=rng.random() * 10)


def ab_result(slots, pcie, arms, rng):
    """An agent_turns_bench JSON: arms = [(name, env)], the first the baseline."""
    summary = []
    for i, (name, env) in enumerate(arms):
        med = rng.uniform(0.7, 1.3)
        summary.append(dict(name=name, baseline=i == 0, env=env, per_turn=[{}] * 6, hit_rate_mean=rng.random(),
                            decode_tok_s_mean=rng.uniform(50, 500), turns_won=rng.randrange(7),
                            ratio=dict(median=med, min=med - 0.2, max=med + 0.2, n=6)))
    noise = dict(ratio=dict(median=rng.uniform(0.9, 1.1), min=0.8, max=1.2, n=6), faster_turns=rng.randrange(7))
    return dict(benchmark="agent_turns_bench", settings=dict(expert_cache_slots=str(slots), pcie_frac=str(pcie)),
                summary=summary, baseline_noise=noise)


def test_join_matches_switches_slots_and_pcie(tmp_path):
    rng = random.Random(35)  # the KL values only need to differ between arms
    kl = dict(benchmark="kl_arms", rows=[
        kl_row("base", 16, 1.0, {}, 0.0, rng),
        kl_row("skip S=16", 16, 1.0, {"route_tail_skip": "5"}, rng.uniform(0.01, 0.03), rng),
        kl_row("defer S=16", 16, 0.5, {"verify_defer_cpu": "1"}, rng.uniform(0.001, 0.01), rng),
        kl_row("skip S=32", 32, 1.0, {"route_tail_skip": "5"}, rng.uniform(0.01, 0.03), rng),
        kl_row("exact all", "all", 1.0, {}, 0.0, rng)])
    route16 = ab_result(16, 1, [("base", {}), ("skip", {"STRATA_ROUTE_TAIL_SKIP": "5"})], rng)
    defer16 = ab_result(16, 0.5, [("base", {}), ("split", {"STRATA_VERIFY_DEFER_CPU": "1"}),
                                  ("every", {"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "1"})],
                        rng)
    rows = trade_table.join(kl, [route16, defer16])
    by = {(r["slots"], r["pcie_frac"], r["name"]): r for r in rows}

    skip = by[("16", 1.0, "skip S=16")]
    assert skip["ab"]["arm"] == "skip" and skip["ab"]["ratio"] == route16["summary"][1]["ratio"]
    assert skip["kl_all"] == kl["rows"][1]["kl"]["all"]
    base = by[("16", 1.0, "base")]  # the KL base and route16's baseline: the noise floor, not a ratio to itself
    assert base["ab"]["noise_floor"] and base["ab"]["ratio"] == route16["baseline_noise"]["ratio"]
    assert by[("16", 0.5, "base")]["kl_all"] == 0.0  # defer16's baseline: exact, KL 0 by definition
    assert by[("16", 0.5, "base")]["ab"]["ratio"] == defer16["baseline_noise"]["ratio"]
    assert by[("16", 0.5, "defer S=16")]["ab"]["arm"] == "split"
    assert by[("16", 0.5, "every")]["kl_all"] is None  # an A/B arm kl_arms did not read
    assert by[("32", 1.0, "skip S=32")]["ab"] is None  # no A/B at 32 slots
    assert [r["slots"] for r in rows] == ["16"] * 5 + ["32", "all"]
    assert [r["pcie_frac"] for r in rows[:5]] == [1.0, 1.0, 0.5, 0.5, 0.5]
    assert [r["name"] for r in rows[:3]] == ["base", "skip S=16", "base"]  # each exact row before its arms

    table = trade_table.make_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    skip_line = next(ln for ln in lines if "skip S=16" in ln)
    assert f"{route16['summary'][1]['ratio']['median']:.2f}"[:3] in skip_line and "ROUTE_TAIL_SKIP=5" in skip_line
    assert "(noise floor)" in next(ln for ln in lines if "| base" in ln)

    # The CLI: the same table from files; a file that is not an A/B result is one line.
    paths = []
    for name, obj in (("kl.json", kl), ("r16.json", route16), ("d16.json", defer16)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(obj))
    ok = subprocess.run([sys.executable, "-m", "benchmarks.trade_table", f"--kl={paths[0]}",
                         f"--ab={paths[1]},{paths[2]}", f"--json={tmp_path / 'out.json'}"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert table in ok.stdout and json.loads((tmp_path / "out.json").read_text())["table"] == table
    bad = subprocess.run([sys.executable, "-m", "benchmarks.trade_table", f"--kl={paths[0]}", f"--ab={paths[0]}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    err = bad.stderr.strip().splitlines()  # one line naming the flag and the file, and why
    assert len(err) == 1 and err[0].startswith(f"error: --ab={paths[0]}") and "not an agent_turns_bench result" in err[0]
