"""benchmarks/agent_turns_bench.py: the workload (deterministic, the same for every arm, growing, capped), the arms'
syntax, the mirrored order, a tiny end-to-end A/B run of two arms in worker processes, and its one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from benchmarks import agent_turns_bench as bench
from conftest import REPO


def byte_encode():
    from strata_jax.io.tokenizer import byte_level_tokenizer
    tok = byte_level_tokenizer()
    return lambda text: tok.encode(text).ids


def cli(*args, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run([sys.executable, "-m", "benchmarks.agent_turns_bench", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=timeout)


# ---- the workload ----------------------------------------------------------------------------------------------


def synthetic_repo(root):
    """A fixed little repository (its files never change, unlike this one's, which the workload would read)."""
    import random
    rng = random.Random(0)
    words = ["engine", "window", "expert", "slot", "layer", "cache", "token", "route", "fetch", "pool"]
    for d, n in (("strata_jax", 6), ("benchmarks", 3), ("tests", 4)):
        (root / d).mkdir(parents=True)
        for i in range(n):
            name = f"test_{d}_{i}.py" if d == "tests" else f"{d}_{i}.py"
            body = []
            for j in range(12):
                fn = f"test_{rng.choice(words)}_{j}" if d == "tests" else f"{rng.choice(words)}_{rng.choice(words)}_{j}"
                body.append(f"def {fn}(x):\n    return " + " + ".join(rng.choice(words) for _ in range(12)) + "\n")
            (root / d / name).write_text("\n".join(body))
    return root


def test_workload_is_deterministic_grows_and_respects_the_cap(tmp_path):
    enc = byte_encode()
    root = synthetic_repo(tmp_path)
    build = lambda seed: bench.build_workload(enc, 900, 7, 2, seed=seed, root=root)  # noqa: E731
    a = build(3)
    b = build(3)
    assert a == b  # the same seed: the same texts and ids, whoever asks (each arm reads this one workload)
    other = build(4)
    assert [t["ids"] for t in other["turns"]] != [t["ids"] for t in a["turns"]]
    turns = a["turns"]
    assert len(turns) == 7 and [t["index"] for t in turns] == list(range(7))
    for t in turns:
        assert t["ids"] == enc(t["text"]) and t["prompt_tokens"] == len(t["ids"]) <= 900
        assert t["prompt_sha256"] == bench.ids_sha(t["ids"])
    by_session: dict[int, list] = {}
    for t in turns:
        by_session.setdefault(t["session"], []).append(t)
    assert len(by_session) >= 2
    for ts in by_session.values():
        assert [t["turn"] for t in ts] == list(range(len(ts)))
        first = ts[0]
        assert first["text"].startswith(bench.ROLE_SYSTEM + bench.SYSTEM) and first["tools"] == []
        assert 150 <= first["prompt_tokens"] <= 260  # a short first turn: system prompt and task
        for prev, cur in zip(ts, ts[1:]):
            # The conversation grows by appending: earlier text (with its fixed placeholder replies) is kept.
            assert cur["text"].startswith(prev["text"]) and cur["prompt_tokens"] > prev["prompt_tokens"]
            assert cur["tools"] and "<tool_result name=" in cur["text"][len(prev["text"]):]
            assert cur["text"].endswith(bench.ROLE_ASSISTANT)
    # A session planned with more turns reaches the longest prompt.
    assert max(t["prompt_tokens"] for t in turns) >= 900 - 40
    # Every source file is in the repository's code folders, none from fixtures or assets.
    files = bench.source_files()
    assert files == sorted(files) and "strata_jax/engine/api.py" in files and "benchmarks/agent_turns_bench.py" in files
    assert not [f for f in files if "/fixtures/" in f or "/assets/" in f or not f.endswith((".py", ".md"))]


def test_workload_sessions_end_at_the_context():
    enc = byte_encode()
    w = bench.build_workload(enc, 120, 3, 1, seed=0)  # too short for a second turn: one turn a session
    assert len(w["turns"]) == 3 and all(t["prompt_tokens"] <= 120 for t in w["turns"])
    assert [s["turns"] for s in w["sessions"]] == [1, 1, 1]
    assert [s["ended_by_context"] for s in w["sessions"]] == [True, True, False]
    with pytest.raises(ValueError, match="cannot hold a session's first turn"):
        bench.build_workload(enc, 60, 3, 1, seed=0)
    with pytest.raises(ValueError, match="fewer than --sessions"):
        bench.build_workload(enc, 900, 2, 3, seed=0)


# ---- arms and order --------------------------------------------------------------------------------------------


def test_parse_arms_order_and_env():
    arms = bench.parse_arms("base:; skip:STRATA_ROUTE_TAIL_SKIP=5;both:STRATA_ROUTE_TAIL_SKIP=5, "
                            "STRATA_ROUTE_PRIOR=0.5;defer:STRATA_VERIFY_DEFER_CPU=1,STRATA_VERIFY_DEFER_CPU_BELOW=1")
    assert arms == [("base", {}), ("skip", {"STRATA_ROUTE_TAIL_SKIP": "5"}),
                    ("both", {"STRATA_ROUTE_TAIL_SKIP": "5", "STRATA_ROUTE_PRIOR": "0.5"}),
                    ("defer", {"STRATA_VERIFY_DEFER_CPU": "1", "STRATA_VERIFY_DEFER_CPU_BELOW": "1"})]
    assert "STRATA_LOGPOS" in bench.known_switches() and "STRATA_ROUTE_RESIDENT_MARGIN" in bench.known_switches()
    for bad, what in (("base", "no ':'"), ("base:;base:", "twice"), ("x:STRATA_NOPE=1", "unknown variable"),
                      ("x:STRATA_WINDOW=2", "unknown variable"), ("x:STRATA_ROUTE_PRIOR", "not STRATA_VAR=value"),
                      ("x:STRATA_ROUTE_PRIOR=1,STRATA_ROUTE_PRIOR=2", "twice"), (":STRATA_ROUTE_PRIOR=1", "name"),
                      (";", "empty")):
        with pytest.raises(ValueError, match=what):
            bench.parse_arms(bad)
    assert bench.run_order(["A", "B", "C"], 1) == ["A", "B", "C", "C", "B", "A"]
    assert bench.run_order(["A", "B"], 2) == ["A", "B", "B", "A", "A", "B", "B", "A"]
    env = bench.worker_env({"STRATA_ROUTE_TAIL_SKIP": "2", "draft": "device"},
                           {"PATH": "/bin", "STRATA_ROUTE_PRIOR": "0.5", "STRATA_LOGPOS": "x"})
    assert env == {"PATH": "/bin", "STRATA_ROUTE_TAIL_SKIP": "2"}  # draft= is a worker flag, not a variable
    # draft=: the arm's own proposer, the --draft flag's otherwise.
    arms = bench.parse_arms("ngram:;device:draft=device", options=bench.ARM_OPTIONS)
    assert arms == [("ngram", {}), ("device", {"draft": "device"})]
    s = types.SimpleNamespace(draft="ngram", prefix_reuse="1")  # the --draft and --prefix_reuse flags
    assert [bench.arm_flags(s, e) for _, e in arms] == [{"draft": "ngram", "prefix_reuse": "1"},
                                                        {"draft": "device", "prefix_reuse": "1"}]
    # prefix_reuse=: time to first token with and without the last turn's KV rows
    arms = bench.parse_arms("reuse:;cold:prefix_reuse=0", options=bench.ARM_OPTIONS)
    assert [bench.arm_flags(s, e)["prefix_reuse"] for _, e in arms] == ["1", "0"]
    s = types.SimpleNamespace(draft="ngram", prefix_reuse=False)  # --prefix_reuse is strata_jax.options' bool flag
    assert [bench.arm_flags(s, e)["prefix_reuse"] for _, e in arms] == ["0", "0"]
    for bad, what in (("x:draft=gpu", "is not one of ngram, none, device"), ("x:draft=none,draft=device", "twice")):
        with pytest.raises(ValueError, match=what):
            bench.parse_arms(bad, options=bench.ARM_OPTIONS)
    with pytest.raises(ValueError, match="unknown variable draft"):
        bench.parse_arms("x:draft=device")  # only where the benchmark takes it


# ---- end to end ------------------------------------------------------------------------------------------------

# window=2: each worker compiles graphs of T = 1, 2 (not 1..4); the A/B's bookkeeping is the same at any window
TINY = ["--model=embedded", "--dtype=float32", "--turns=3", "--sessions=1", "--new_tokens=4",
        "--expert_cache_slots=4", "--window=2"]


def test_two_arms_end_to_end(tmp_path, cache_dir):
    out, plot = tmp_path / "agent.json", tmp_path / "agent.png"
    # A stray switch in the caller's environment must not reach any run.
    res = cli(*TINY, "--max_prompt_tokens=700", "--arms=base:;skip:STRATA_ROUTE_TAIL_SKIP=2,draft=device",
              f"--json={out}",
              f"--plot={plot}", f"--cache_dir={cache_dir}", env={"STRATA_ROUTE_PRIOR": "0.5"})
    assert res.returncode == 0, res.stderr[-3000:]
    table = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
    assert "x median" in table[0] and "turns won" in table[0]
    assert [ln.split("|")[1].strip() for ln in table[2:]] == ["base", "skip"]
    assert "removed from every run's environment" in res.stdout
    saved = json.loads(out.read_text())
    assert saved["complete"] and saved["order"] == ["base", "skip", "skip", "base"]
    assert saved["warmup_run"]["arm"] == "base" and saved["warmup_run"]["decode_tok_s_mean"] > 0  # not counted
    assert "order: (warm-up base) base skip skip base" in res.stdout
    runs = saved["runs"]
    assert [r["arm"] for r in runs] == saved["order"] and [r["run"] for r in runs] == [1, 1, 2, 2]
    lengths = [t["prompt_tokens"] for t in saved["workload"]["turns"]]
    assert len(lengths) == 3 and max(lengths) <= 700
    # The turns grow within a session. The workload is drawn from this repository's files, so whether the three
    # turns fit one session (or the context ends it and a new session takes the last turn) follows its content.
    sessions = saved["workload"]["sessions"]
    for i, session in enumerate(sessions):
        own = [t["prompt_tokens"] for t in saved["workload"]["turns"] if t["session"] == session["index"]]
        assert own == sorted(own) and len(own) == session["turns"] >= 1
        assert session["ended_by_context"] == (i < len(sessions) - 1)  # only a full context starts a new one
    assert lengths[0] < lengths[1]  # the first session's second turn read tool results
    for r in runs:
        assert r["workload_sha256"] == saved["workload"]["sha256"]
        assert r["env"] == ({} if r["arm"] == "base" else {"STRATA_ROUTE_TAIL_SKIP": "2"})
        assert r["draft"] == ("auto" if r["arm"] == "base" else "device")  # base: the default
        assert [t["prompt_tokens"] for t in r["turns"]] == lengths
        assert [t["prompt_sha256"] for t in r["turns"]] == [t["prompt_sha256"] for t in runs[0]["turns"]]
        for t in r["turns"]:
            assert t["generated_tokens"] == 4 and t["decode_tok_s"] > 0 and 0 <= t["hit_rate"] <= 1
    base, skip = saved["summary"]
    assert base["baseline"] and base["name"] == "base" and skip["name"] == "skip"
    assert base["approx"]["prior"] is None and not base["approx_active"]  # the stray STRATA_ROUTE_PRIOR was removed
    assert skip["approx"]["tail_skip"] == 2 and skip["approx_active"]
    for a in (base, skip):
        assert len(a["per_turn"]) == 3 and a["runs"] == 2
        assert all(p["ratio"] > 0 for p in a["per_turn"])
        assert a["ratio"]["median"] > 0 and a["ratio"]["min"] <= a["ratio"]["median"] <= a["ratio"]["max"]
    assert base["counters_total"]["distinct_skipped"] == 0
    assert skip["counters_total"]["distinct_skipped"] > 0
    assert sum(t["distinct_skipped"] for r in runs if r["arm"] == "skip" for t in r["turns"]) > 0
    noise = saved["baseline_noise"]
    assert len(noise["per_turn"]) == 3 and noise["ratio"]["median"] > 0
    assert saved["table"] in res.stdout
    if saved.get("plot"):
        assert plot.stat().st_size > 0
    else:
        assert "matplotlib is not importable" in res.stdout

    # --from_json: the same report from the file, and from a file cut short before base's second run.
    again = cli(f"--from_json={out}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert saved["table"] in again.stdout
    cut = dict(saved, runs=saved["runs"][:3], complete=False)
    cut_path = tmp_path / "cut.json"
    cut_path.write_text(json.dumps(cut))
    partial = cli(f"--from_json={cut_path}", f"--json={tmp_path / 'cut_report.json'}")
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert "1 of the 4 runs of the order are missing" in partial.stdout
    report = json.loads((tmp_path / "cut_report.json").read_text())
    assert not report["complete"] and report["baseline_noise"]["ratio"]["n"] == 0
    skip_cut = report["summary"][1]
    assert skip_cut["runs"] == 2 and skip_cut["ratio"]["median"] > 0  # against base's one run
    bad = cli(f"--from_json={tmp_path / 'missing.json'}")
    assert bad.returncode == 1 and "--from_json=" in bad.stderr and "Traceback" not in bad.stderr


def test_bad_arms_is_one_line():
    for arms, what in (("base;skip:STRATA_ROUTE_TAIL_SKIP=5", "no ':'"),
                       ("base:;skip:STRATA_ROUTE_TAILSKIP=5", "unknown variable STRATA_ROUTE_TAILSKIP")):
        res = cli("--model=embedded", f"--arms={arms}", timeout=60)
        assert res.returncode == 1, res.stderr
        assert "Traceback" not in res.stderr and res.stdout == ""
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --arms") and what in err[0], res.stderr


def test_failing_worker_is_one_line(tmp_path, cache_dir):
    from strata_jax.io.embedded import embedded_model_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    src = embedded_model_dir(cache_dir)
    for name in ("config.json", "tokenizer.json"):  # no weights: the worker's engine cannot load
        shutil.copy(src / name, broken / name)
    res = cli(*TINY[1:], f"--model={broken}", "--max_prompt_tokens=120", "--arms=base:", f"--cache_dir={cache_dir}",
              timeout=120)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0]
    assert "arm base run 1" in errors[0] and "worker failed" in errors[0], errors[0]  # which run, and that it failed


def test_engine_flags_come_from_strata_jax_options(capsys):
    import dataclasses
    from benchmarks import common
    from strata_jax.options import EngineOptions, RequestOptions
    fields = {f.name: f for cls in (EngineOptions, RequestOptions) for f in dataclasses.fields(cls)}
    for name in ("window", "dtype", "context", "cpu_threads", "cache_dir", "expert_cache_slots", "pcie_frac",
                 "prefix_reuse", "temperature", "draft"):
        assert fields[name].metadata["help"] in bench.FLAGS[name].help, name
    assert bench.FLAGS["expert_cache_slots"].default == "16" and bench.FLAGS["pcie_frac"].default == "1"
    common.parse_flags(bench.FLAGS, ["agent_turns_bench", "--prefix_reuse=0", "--window=2"])
    assert bench.FLAGS.prefix_reuse is False and bench.FLAGS.window == 2
    for bad in ("--window=20", "--pcie_frac=2", "--dtype=float16"):  # the option's own check: one line, exit 2
        with pytest.raises(SystemExit) as e:
            common.parse_flags(bench.FLAGS, ["agent_turns_bench", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and bad.split("=")[0] in err[0]
    common.parse_flags(bench.FLAGS, ["agent_turns_bench"])
