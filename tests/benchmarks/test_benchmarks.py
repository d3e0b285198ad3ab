"""The benchmarks run end to end on the tiny preset (CPU, seconds): one row per window size, positive numbers."""
from __future__ import annotations

import json
import math

import numpy as np

import pytest

from benchmarks import common, decode_bench, runner


def test_decode_bench_tiny(tmp_path, capsys):
    out = tmp_path / "decode.json"
    result = decode_bench.main(["decode_bench", "--model=tiny", "--windows=1,2", "--iters=2", "--warmup=1",
                                "--context=64", "--pos=8", "--bw_mib=8", "--probe_windows=2", f"--json={out}"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and result["complete"]
    assert [r["T"] for r in saved["rows"]] == [1, 2]
    for r in saved["rows"]:
        for key in ("ms_per_step", "ms_per_step_mean", "ms_per_step_pipelined", "ms_per_token", "tok_s",
                    "roofline_ms", "roofline_fraction", "distinct_experts_per_layer"):
            assert r[key] > 0 and math.isfinite(r[key]), key
        assert r["bytes"]["total"] == pytest.approx(r["bytes"]["non_expert"] + r["bytes"]["experts"]
                                                    + r["bytes"]["kv_cache"])
        assert r["distinct_source"] == "measured"
        assert r["roofline_fraction_pipelined"] == pytest.approx(r["roofline_ms"] / r["ms_per_step_pipelined"])
    assert saved["rows"][0]["distinct_experts_per_layer"] == 4  # T=1: exactly top-K
    assert saved["bandwidth"]["bandwidth_Bps"] > 0
    # The table: a header, a separator and one line per window size.
    table_lines = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 + 2
    assert "% of roofline" in table_lines[0] and "% of roofline (pipelined)" in table_lines[0]


def test_expected_distinct():
    assert decode_bench.expected_distinct(128, 8, 1) == pytest.approx(8)
    assert decode_bench.expected_distinct(128, 8, 4) == pytest.approx(128 * (1 - (120 / 128) ** 4))
    assert decode_bench.expected_distinct(16, 4, 1000) == pytest.approx(16)


def test_bad_flags_exit(capsys):
    with pytest.raises(SystemExit) as e:
        decode_bench.main(["decode_bench", "--windows=1,x"])
    assert e.value.code == 1
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        decode_bench.main(["decode_bench", "--model=tiny", "--context=16", "--pos=15", "--windows=4"])
    assert e.value.code == 1


def test_format_table():
    table = common.format_table(["T", "name"], [[1, "a"], [16, "bb"]])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[1].startswith("| --:")


def test_parse_list_one_parser_for_every_list_flag():
    assert runner.parse_list("1, 2,4,2,") == [1, 2, 4]  # blanks skipped, deduplicated, in order
    assert runner.parse_list("all,0.5,0.25", float, "slot_fracs", words=("all",), lo=0, hi=1, lo_open=True) == \
        ["all", 0.5, 0.25]
    assert runner.parse_list("a,b,a", str, unique=False) == ["a", "b", "a"]
    assert runner.parse_list("", str, "only", empty_ok=True) == []
    for text, kind, kw, phrase in (("1,x", int, {}, "'x' is not an integer"), ("0", int, dict(lo=1), "positive"),
                                   ("1.5", float, dict(lo=0, hi=1), "must be in [0, 1]"),
                                   ("0", float, dict(lo=0, hi=1, lo_open=True), "must be in (0, 1]"),
                                   ("nan", float, {}, "finite"), ("gpu", str, dict(choices=("xla", "pallas")), "one of"),
                                   (" , ", int, {}, "is empty")):
        with pytest.raises(ValueError, match="--w") as e:
            runner.parse_list(text, kind, "w", **kw)
        assert phrase in str(e.value) and "\n" not in str(e.value)
    assert common.int_list("4,1", "windows") == [4, 1]


def test_runner_grid_rows_and_outputs():
    points = list(runner.grid({"T": [1, 2], "dtype": ["bf16", "f32"]}))
    assert points[:2] == [{"T": 1, "dtype": "bf16"}, {"T": 1, "dtype": "f32"}] and len(points) == 4
    seen = []
    rows = runner.sweep({"T": [1, 2]}, lambda T: runner.Row("b", {"T": T}, {"ms/step": 2.0 * T}, timing="synced"),
                        on_row=seen.append)
    assert [r.values["ms/step"] for r in rows] == [2.0, 4.0] and seen == rows
    table_rows = runner.rows_from_table("b", ["T", "ms/step", "tok/s", "x vs HF", "% of roofline", "hit rate"],
                                        [[1, 2.0, 500.0, 1.5, 40.0, 0.9]], params=["T"], fixed={"model": "tiny"})
    r = table_rows[0].to_dict()
    assert r["params"] == {"model": "tiny", "T": 1} and r["values"]["tok/s"] == 500.0
    assert r["units"] == {"ms/step": "ms", "tok/s": "tok/s", "x vs HF": "x", "% of roofline": "%", "hit rate": ""}
    assert json.loads(runner.render(table_rows, "json"))[0]["benchmark"] == "b"
    csv_lines = runner.render(table_rows, "csv").splitlines()
    assert csv_lines[0].split(",")[:3] == ["benchmark", "model", "T"] and len(csv_lines) == 2
    assert runner.render(table_rows, "md", table="given") == "given"
    assert runner.render(table_rows, "md").splitlines()[0].startswith("| benchmark")


def test_output_json_puts_only_the_rows_on_stdout(tmp_path, capsys):
    out = tmp_path / "decode.json"
    decode_bench.main(["decode_bench", "--model=tiny", "--windows=1", "--iters=1", "--warmup=1", "--context=64",
                       "--pos=8", "--bw_mib=8", "--probe_windows=0", "--hf=off", "--output=json", f"--json={out}"])
    printed = capsys.readouterr()
    rows = json.loads(printed.out)  # stdout: the rows alone; the start-up block and notes went to stderr
    assert [r["params"]["T"] for r in rows] == [1] and rows[0]["units"]["ms/step"] == "ms"
    assert rows[0]["values"]["tok/s"] > 0 and "decode_window" in rows[0]["timing"]
    assert "roofline" in printed.err
    saved = json.loads(out.read_text())  # the --json file: its own keys, and the rows in the shared schema
    assert saved["rows"][0]["T"] == 1 and saved["bench_rows"] == rows
    common.set_output("md")


def test_offload_bench_tiny(tmp_path, capsys, cache_dir):
    from benchmarks import offload_bench
    out = tmp_path / "offload.json"
    new_tokens = 6
    result = offload_bench.main(["offload_bench", "--model=tiny", "--dtype=float32", "--slot_fracs=0.25",
                                 "--pcie_fracs=0.5,auto", f"--new_tokens={new_tokens}", "--prompt_len=5",
                                 "--context=32", "--copy_mib=4", "--cpu_threads=2", f"--cache_dir={cache_dir}",
                                 f"--json={out}"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and result["complete"]
    arms = saved["arms"]
    assert [a["arm"] for a in arms] == ["all-resident", "S=4 pcie=0.5", "S=4 pcie=auto"]
    base = arms[0]
    expert_bytes = saved["model"]["expert_bytes"]
    for a in arms:
        assert a["generated_tokens"] == new_tokens and a["decode_windows"] == new_tokens - 1
        for key in ("decode_tok_s", "ms_per_token", "x_vs_all_resident"):
            assert a[key] > 0 and math.isfinite(a[key]), (a["arm"], key)
        assert a["x_vs_all_resident"] == pytest.approx(a["decode_tok_s"] / base["decode_tok_s"])
        assert 0.0 <= a["hit_rate"] <= 1.0
    assert base["hit_rate"] == 1.0 and base["fetched_per_token"] == base["cpu_per_token"] == 0
    for a in arms[1:]:
        d = a["decode_experts"]
        assert d["distinct"] == d["distinct_resident"] + d["distinct_fetched"] + d["distinct_cpu"] > 0
        assert d["pcie_bytes"] == d["distinct_fetched"] * expert_bytes
        assert a["pcie_bytes_per_token"] * a["decode_windows"] == pytest.approx(d["pcie_bytes"])
        assert a["fetched_per_token"] + a["cpu_per_token"] > 0  # 4 of 16 slots: misses every window
        assert a["expected_hit_rate"] == 0.25 and 0.25 <= a["top_slots_entry_share"] <= 1.0
        # The bound: all-resident time + this arm's fetched bytes at device_put + its CPU bytes at the pool's rate.
        bw = saved["bandwidth"]
        want = base["ms_per_token"] + 1e3 * (a["pcie_bytes_per_token"] / (bw["device_put"]["GBps"] * 1e9)
                                             + a["cpu_per_token"] * expert_bytes / (bw["pool"]["GBps"] * 1e9))
        assert a["bound_ms_per_token"] == pytest.approx(want) and a["bound_ms_per_token"] > base["ms_per_token"]
        assert a["share_of_bound"] == pytest.approx(a["bound_ms_per_token"] / a["ms_per_token"])
    half = arms[1]
    assert half["pcie_frac_chosen"] == 0.5
    assert half["fetched_per_token"] > 0 and half["cpu_per_token"] > 0 and half["pool_ms_per_token"] > 0
    assert arms[2]["pcie_frac_chosen"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    for name in ("device_put", "in_graph_fetch", "pool", "memcpy", "read"):
        assert saved["bandwidth"][name]["GBps"] > 0, name
    # Two tables: the arms (header, separator, one line per arm) and the bandwidths (five copies + the engine's).
    table_lines = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table_lines) == (2 + 3) + (2 + 6)
    assert "of the read bandwidth" in printed and "threads reading a" in printed
    assert "PCIe MB/token" in table_lines[0] and "% of bound" in table_lines[0] and "auto -> " in printed
    assert saved["table"] in printed and saved["bandwidth_table"] in printed


def test_offload_bench_job_summary_reads_the_worker_ring():
    """The worker's ring (POSTED seen, DONE stored, layer, T) of two T=1 windows of three layers after a prefill
    job: each job's time, the gaps between layers of one window and across windows, the tokens' ticks."""
    from benchmarks import offload_bench
    rng = np.random.default_rng(7)
    us = 1000
    jobs, t = [[0, 900 * us, 0, 16]], 1000 * us  # the prefill's job (T=16): not a decode job
    job_us, layer_gap, window_gap = [], [], []
    for window in range(2):
        for layer in range(3):
            j = int(rng.integers(100, 200)) * us
            jobs.append([t, t + j, layer, 1])
            job_us.append(j / us)
            g = int(rng.integers(50, 90) if layer < 2 else rng.integers(300, 400)) * us
            (layer_gap if layer < 2 else window_gap).append(g / us)
            t += j + g
    ring = np.asarray(jobs, np.int64)
    got = offload_bench.job_summary(ring, [0, 1_500 * us, 2_700 * us, 3_700 * us])
    assert got["jobs"] == 6
    assert got["job_us"] == pytest.approx(np.mean(job_us))
    assert got["layer_gap_us"] == pytest.approx(np.mean(layer_gap))
    assert got["window_gap_us"] == pytest.approx(window_gap[0])  # the last window's gap follows no job
    assert got["token_us"] == pytest.approx(1_200)  # the median of 1500, 1200, 1000
    span = ring[-1, 1] - ring[1, 0]
    assert got["busy_share"] == pytest.approx(sum(job_us) * us / span)
    assert offload_bench.job_summary(ring[:2], []) == {}


def test_offload_bench_bad_flags(capsys):
    from benchmarks import offload_bench
    for bad in ("--slot_fracs=0", "--pcie_fracs=1.5", "--pcie_fracs=x", "--new_tokens=40"):
        with pytest.raises(SystemExit) as e:
            offload_bench.main(["offload_bench", "--model=tiny", "--context=32", bad])
        assert e.value.code == 1, bad
        assert "error:" in capsys.readouterr().err
    assert offload_bench.frac_list("1,0.5,auto,1", "x", allow_auto=True, lo_open=False) == [1.0, 0.5, "auto"]


def test_decode_bench_puts_the_hf_baseline_beside_each_window(tmp_path, capsys, monkeypatch):
    """benchmarks/hf_decode.py needs torch (not in this venv): its JSON, as it writes it, stands in for the
    subprocess; the table gets HF's fastest implementation per T and our speed-up over it."""
    hf = {"transformers": "5.x", "torch": "2.x", "device_name": "cpu", "impls": {"eager": {"1": 3.0, "2": 5.0},
          "grouped_mm": {"1": 2.5, "2": 6.0}}, "best": {"1": {"impl": "grouped_mm", "ms": 2.5},
                                                         "2": {"impl": "eager", "ms": 5.0}}, "line": "HF: stand-in"}
    monkeypatch.setattr(decode_bench, "run_hf", lambda s, windows: hf)
    result = decode_bench.main(["decode_bench", "--model=tiny", "--windows=1,2", "--iters=2", "--warmup=1",
                                "--context=64", "--pos=8", "--bw_mib=8", "--probe_windows=0",
                                f"--json={tmp_path / 'd.json'}"])
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert "x vs HF" in table[0]
    for line, row, best in zip(table[2:], result["rows"], ("2.50 (grouped_mm)", "5.00 (eager)")):
        assert best in line
        speedup = float(line.rstrip(" |").split("|")[-1])
        assert speedup == pytest.approx(float(best.split()[0]) / row["ms_per_step"], rel=0.01)


def test_decode_bench_says_when_hf_cannot_run(capsys):
    import importlib.util
    if importlib.util.find_spec("torch"):
        pytest.skip("torch is importable here: the comparison runs instead")
    decode_bench.main(["decode_bench", "--model=tiny", "--windows=1", "--iters=1", "--warmup=0", "--context=32",
                       "--pos=4", "--bw_mib=8", "--probe_windows=0"])
    assert "HF transformers: torch or transformers is not importable here" in capsys.readouterr().out


def test_soak_mixed_requests_reproducible_and_flat(cache_dir, tmp_path):
    """benchmarks/soak.py, shortened: 40 mixed requests on one engine (greedy / sampled, host / device / no drafts,
    the pool's share changed between requests), every answer equal to its kind's first, RSS flat."""
    import json
    from benchmarks import soak
    result = soak.main(["soak", "--requests=40", "--new_tokens=8", f"--cache_dir={cache_dir}",
                        f"--json={tmp_path / 'soak.json'}"])
    assert result["ok"] and not result["mismatches"] and result["rss_growth_mib"] <= 64
    assert json.loads((tmp_path / "soak.json").read_text())["ok"]


FAKE_LLAMA_BENCH = '''#!{python}
"""Stands in for llama-bench -o json: a record per pp<N> (-p) and per tg<n> @ d<N> (-d), as the real one writes."""
import json, sys
a = sys.argv[1:]
arg = lambda flag, default: a[a.index(flag) + 1] if flag in a else default
prompts = [int(x) for x in arg("-p", "512").split(",")]
depths = [int(x) for x in arg("-d", "0").split(",")]
n_gen = int(arg("-n", "128"))
cpu = 10.0 if "-ncmoe" in a else 1.0  # experts on the CPU: ten times slower
out = [dict(n_prompt=p, n_gen=0, n_depth=0, avg_ts=(1000.0 + p) / cpu, stddev_ts=1.0, avg_ns=1, build_commit="fake",
            gpu_info="none") for p in prompts if p > 0]
out += [dict(n_prompt=0, n_gen=n_gen, n_depth=d, avg_ts=50.0 - d / 100, stddev_ts=0.5, avg_ns=1, build_commit="fake",
             gpu_info="none") for d in depths] if n_gen > 0 else []
print(json.dumps(out))
'''


def test_long_context_bench_tiny(tmp_path, capsys, cache_dir):
    """benchmarks/long_context_bench.py on the tiny preset, float32, greedy: a row per (prompt, slots), TTFT and decode
    speed positive, the peer's columns from a stand-in llama-bench, and offload's tokens equal to all-resident's."""
    import sys
    from benchmarks import long_context_bench
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # present: nothing is written
    out = tmp_path / "long.json"
    new_tokens = 6
    result = long_context_bench.main([
        "long_context_bench", "--model=tiny", "--dtype=float32", "--prompts=40,100", "--slot_fracs=all,0.5",
        f"--new_tokens={new_tokens}", "--arms=window=1", "--temperature=0", "--bw_mib=8", "--copy_mib=4",
        "--matmul_n=128", f"--llama_bench={fake}", f"--gguf={gguf}", f"--cache_dir={cache_dir}", f"--json={out}"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and result["complete"]
    rows = {(r["prompt"], str(r["slot_frac"]), r["arm"]): r for r in saved["rows"]}
    assert sorted(rows) == [(p, f, "window=1") for p in (40, 100) for f in ("0.5", "all")]
    for (p, frac, _), r in rows.items():
        assert r["prompt_tokens"] == p and r["cached_tokens"] == 0
        assert r["generated_tokens"] == new_tokens and len(r["tokens"]) == new_tokens
        for key in ("prefill_s", "prefill_tok_s", "decode_tok_s", "ttft_x_all_resident", "decode_x_all_resident"):
            assert r[key] > 0 and math.isfinite(r[key]), (p, frac, key)
        assert r["prefill_tok_s"] == pytest.approx(p / r["prefill_s"])
        assert r["decode_roofline"]["tok_s"] > 0 and r["prefill_floor"]["floor_s"] > 0
        base = rows[(p, "all", "window=1")]
        assert r["ttft_x_all_resident"] == pytest.approx(r["prefill_s"] / base["prefill_s"])
        # offload is exact: the same weights give the same greedy tokens wherever the experts sit
        assert r["tokens"] == base["tokens"] and r["tokens_match_all_resident"]
        if frac == "0.5":
            assert r["slots"] == 8 and r["prefill_experts"]["distinct"] > 0
            assert r["prefill_pcie_bytes"] == r["prefill_experts"]["distinct_fetched"] * 3 * 128 * 64 * 4
        else:
            assert r["prefill_pcie_bytes"] == 0 and r["ttft_x_all_resident"] == 1.0
    # The peer's columns: TTFT = N / pp<N> tok/s, tg @ d<N>.
    assert saved["peer"]["ran"] and saved["peer"]["pp"]["100"]["ttft_s"] == pytest.approx(100 / 1100)
    assert saved["peer"]["tg"]["40"]["tok_s"] == pytest.approx(49.6)
    # One table: a header, a separator and a line per (prompt, slots, arm).
    table_lines = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 + 4 and saved["table"] in printed
    # Beside half the experts in slots, the peer with half its layers' experts on the CPU (-ncmoe), shortest prompt.
    half = saved["peer"]["ncmoe"]["0.5"]
    assert half["ncmoe"] == round(0.5 * result["model"]["layers"]) and half["pp"]["40"]["tok_s"] == pytest.approx(104.0)
    split = [[c.strip() for c in ln.split("|")] for ln in table_lines[2:]]
    cells = {(c[1], c[2]): c[8] for c in split}
    assert float(cells[("40", "8 (0.5)")]) == pytest.approx(40 / 104.0, rel=1e-2)
    assert cells[("100", "8 (0.5)")] == "-" and float(cells[("100", "all")]) == pytest.approx(100 / 1100, rel=1e-2)
    assert "TTFT s" in table_lines[0] and "llama.cpp TTFT s" in table_lines[0] and "% of roofline" in table_lines[0]
    assert "tokens identical to all-resident's (same prompt, same arm) in 2 of 2 offloaded rows" in printed
    assert "TTFT = stats.last.prefill_s" in printed and "roofline, prefill" in printed


def test_long_context_bench_flags_and_missing_peer(capsys):
    from benchmarks import long_context_bench as lcb
    assert lcb.parse_slot_fracs("all,0.5,0.25,all") == ["all", 0.5, 0.25]
    assert lcb.parse_arms("default;spec=0,window=1") == [("default", {}, {}), ("spec=0,window=1", {"window": 1},
                                                                               {"spec": 0})]
    for bad in ("--slot_fracs=0", "--slot_fracs=x", "--arms=pcie_frac=0.5", "--arms=windw=2", "--arms=window=x",
                "--prompts=0"):
        with pytest.raises(SystemExit) as e:
            lcb.main(["long_context_bench", "--model=tiny", bad])
        assert e.value.code == 1, bad
        assert "error:" in capsys.readouterr().err
    s = type("S", (), dict(llama_bench="/nonexistent/llama-bench", model="tiny"))()
    peer = lcb.run_peer(s, None, [40])
    assert not peer["ran"] and "not found" in peer["reason"]


def test_parallel_bench_tiny_on_two_fake_devices(tmp_path, cache_dir):
    """benchmarks/parallel_bench.py on two fake CPU devices (they need XLA_FLAGS before JAX starts: a subprocess):
    the 1-device row, both splits over 2 devices with the 1-device row's greedy tokens (float32: the same), and the
    1-device offload row (4 slots); a 3-device ask is one line, its rows skipped."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import fake_devices_env
    out = tmp_path / "parallel.json"
    env = fake_devices_env(2)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parallel_bench", "--model=tiny", "--dtype=float32",
                           "--devices=1,2,3", "--modes=layers,experts", "--prompt=20", "--new_tokens=6",
                           "--vram_reserve_mib=0", "--offload_slots=4", f"--cache_dir={cache_dir}", f"--json={out}"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [[c.strip() for c in ln.split("|")[1:-1]] for ln in proc.stdout.splitlines() if ln.startswith("|")]
    assert table[0][:7] == ["devices", "parallel", "slots", "decode tok/s", "ms/window", "x 1 GPU", "same tokens"]
    rows = {(c[0], c[1], c[2]): c for c in table[2:]}
    assert sorted(rows) == [("1", "-", "4"), ("1", "-", "all"), ("2", "experts", "all"), ("2", "layers", "all")]
    number = lambda cell: float(cell.replace(",", ""))  # noqa: E731 (the table prints 1,126 for 1126.0)
    for key, c in rows.items():
        assert number(c[3]) > 0 and number(c[4]) > 0 and number(c[5]) > 0, key
        assert c[6] == ("-" if key[2] == "4" else "yes"), key  # the offload row draws other random experts
    assert "skipped: devices=3 (JAX sees 2 device(s))" in proc.stdout
    assert "2 devices all resident (parallel=experts) vs 1 device with offload at half budget (4 slots)" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["complete"] and len(saved["rows"]) == 4 and len(saved["bench_rows"]) == 4
    assert all(r["generated_tokens"] == 6 and r["cached_tokens"] == 0 for r in saved["rows"])


def test_the_peers_sampled_arm_takes_our_settings_and_reads_its_own_timings():
    """peer_bench --peer_sampling: our request settings become llama-completion's flags (min-p off, as ours has
    none), a name it does not know is refused; its perf lines give decode tok/s with the sampling time counted."""
    from benchmarks.peer_bench import completion_tok_s, peer_sampling_args
    assert peer_sampling_args("temperature=0.7,top_k=20,top_p=0.8") == [
        "--min-p", "0", "--temp", "0.7", "--top-k", "20", "--top-p", "0.8"]
    for bad in ("min_p=0.1", "temperature", "top_k=many"):
        with pytest.raises(ValueError):
            peer_sampling_args(bad)
    err = ("common_perf_print:    sampling time =      25.00 ms\n"
           "common_perf_print: prompt eval time =      10.00 ms /     5 tokens (    2.00 ms per token)\n"
           "common_perf_print:        eval time =     225.00 ms /   125 runs   (    1.80 ms per token)\n")
    assert completion_tok_s(err) == (500.0, 125 * 1e3 / 225.0, 125)
    assert completion_tok_s("no perf lines") is None


FAKE_LLAMA_QUANTIZE = '''#!{python}
"""Stands in for `llama-quantize F16 OUT TYPE`: copies the tiny GGUF of TYPE written beforehand."""
import pathlib, shutil, sys
src, out, qtype = sys.argv[1:4]
assert pathlib.Path(src).is_file(), src
shutil.copy(pathlib.Path({made!r}) / (qtype + ".gguf"), out)
'''


def test_peer_bench_quant_reads_each_quantized_file(tmp_path, capsys, cache_dir, monkeypatch):
    """peer_bench --quant=Q4_K_M,Q2_K on a 2-layer, 8-expert model: a stand-in llama-quantize makes each type's file
    beside the F16 one (copies of tiny Q4_K / Q2_K GGUFs), the stand-in llama-bench runs the peer's arms on it, ours
    load it (experts kept packed); a row per (type, engine, arm) with the ratio at the same share of expert bytes in
    VRAM, hit rate and PCIe MB a token. Then --llama_bench= with the files made: ours alone; a bad type: one line."""
    import sys
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    from benchmarks import peer_bench
    from strata_jax.model import quant
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "io"))
    import test_gguf
    raw, hub = test_gguf.block_checkpoint(seed=40)
    made = tmp_path / "made"
    made.mkdir()
    blocks = {Q.Q4_K: quant.q4k_blocks, Q.Q2_K: quant.q2k_blocks}
    for qtype, gate_up in (("Q4_K_M", Q.Q4_K), ("Q2_K", Q.Q2_K)):
        test_gguf.write_gguf(made / f"{qtype}.gguf", raw, hub,
                             types=lambda g: (Q.Q4_K if "down_exps" in g else gate_up) if "_exps" in g else Q.F32,
                             encoder=lambda x, t: blocks[t](x) if t in blocks else test_gguf.encode(x, t))
    bench, quantize = tmp_path / "llama-bench", tmp_path / "llama-quantize"
    bench.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    quantize.write_text(FAKE_LLAMA_QUANTIZE.format(python=sys.executable, made=str(made)))
    bench.chmod(0o755)
    quantize.chmod(0o755)
    f16 = tmp_path / "tiny.gguf"
    f16.write_bytes(b"GGUF")  # present: nothing is written (the stand-in quantizer does not read it)
    ours = f"expert_cache_slots=4,pcie_frac=1,spec=0,dtype=float32,cpu_threads=2,cache_dir={cache_dir}"
    args = ["peer_bench", "--quant=q4_k_m,Q2_K", "--ncmoe=1", f"--ours={ours}", "--n_gen=6", "--prompt_tokens=8",
            "--reps=1", "--read_mib=0", "--nowarmup_arm", f"--gguf={f16}"]
    result = peer_bench.main(args + [f"--llama_bench={bench}"])
    assert sorted(p.name for p in tmp_path.glob("tiny-*.gguf")) == ["tiny-Q2_K.gguf", "tiny-Q4_K_M.gguf"]
    captured = capsys.readouterr()
    table = [[c.strip() for c in ln.split("|")[1:-1]] for ln in captured.out.splitlines() if ln.startswith("|")]
    assert table[0][:4] == ["type", "engine", "arm", "% expert bytes in VRAM"] and len(table) == 2 + 2 * 3
    # each arm's progress line carries its hit rate and PCIe bytes (a run cut before the table keeps them)
    done = [ln for ln in captured.err.splitlines() if f"ours [{ours}]: " in ln and "tok/s" in ln]
    assert len(done) == 2 and all("hit rate " in ln and "MB a token, pcie_frac 1" in ln for ln in done), done
    for qtype, fmt in (("Q4_K_M", "int4-q4k"), ("Q2_K", "int2-q2k/int4-q4k")):
        entry = result["types"][qtype]
        assert entry["path"] == str(tmp_path / f"tiny-{qtype}.gguf") and len(entry["layer_expert_bytes"]) == 2
        assert [(r["ncmoe"], r["tok_s"]) for r in entry["peer"]] == [(0, 50.0), (1, 50.0)]  # the stand-in's tg
        (r,) = entry["ours"]
        assert r["expert_dtype"] == fmt and r["slots"] == 4 and 0 <= r["hit_rate"] < 1 and r["tok_s"] > 0
        assert r["pcie_mb_per_token"] > 0
        rows = {(c[0], c[1], c[2]): c for c in table[2:]}
        mine = rows[(qtype, "strata_jax", ours)]
        assert float(mine[3]) == 50.0 and float(rows[(qtype, "llama.cpp", "-ngl 99 -fa 1 -ncmoe 1")][3]) == 50.0
        assert float(mine[7]) == pytest.approx(r["tok_s"] / 50.0, rel=1e-2)  # beside -ncmoe 1: half the bytes
    # No peer, the files there: no quantizing, our rows alone.
    quantize.unlink()
    result = peer_bench.main(args[:1] + ["--quant=Q2_K"] + args[2:] + ["--llama_bench="])
    assert list(result["types"]) == ["Q2_K"] and not result["types"]["Q2_K"]["peer"]
    assert result["types"]["Q2_K"]["ours"][0]["pcie_mb_per_token"] > 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        peer_bench.main(["peer_bench", "--quant=Q4_K_X", "--llama_bench="])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quant: 'Q4_K_X' is not a llama-quantize type" in err


def test_a_dropped_engine_leaves_the_device(cache_dir):
    """The benchmarks' arms build one engine after another in a process: once an arm drops its engine
    (common.free_engine, del, common.free_device_memory) none of its arrays stays on the device, so the next arm
    sees the whole memory (an Engine's reference cycles kept 24 layers' weights alive on an 80 GB H100)."""
    import jax

    from benchmarks import common
    from strata_jax.engine.api import Engine
    from strata_jax.model.config import preset
    common.free_device_memory()
    before = {id(a) for a in jax.live_arrays()}
    engine = Engine.from_random(preset("tiny"), seed=1, verbose=False, expert_cache_slots=2, cpu_threads=1,
                                cache_dir=cache_dir)
    engine.generate([3, 1, 4, 1, 5], max_new_tokens=3, stop_token_ids=[])
    assert sum(a.nbytes for a in jax.live_arrays() if id(a) not in before) > 1e6
    common.free_engine(engine)
    del engine
    common.free_device_memory()
    assert sum(a.nbytes for a in jax.live_arrays() if id(a) not in before) < 1e4


def test_options_written_as_text_convert_by_their_types():
    """peer_bench --ours="temperature=1,top_p=0.9,..." and the like: text values take their option's type (a request
    option as much as an engine option), bad values are one StrataError line."""
    from benchmarks.peer_bench import parse_ours
    from strata_jax import StrataError
    from strata_jax.options import from_text, split_options
    (name, opts), = parse_ours("temperature=1,top_p=0.9,top_k=20,spec=0,ignore_eos=true,window=2,"
                               "expert_cache_slots=32,pcie_frac=auto")
    engine, request = split_options(from_text(opts))
    assert request == {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "spec": 0, "ignore_eos": True}
    assert engine == {"window": 2, "expert_cache_slots": "32", "pcie_frac": "auto"}
    assert isinstance(request["temperature"], float) and isinstance(engine["window"], int)
    for bad, says in (({"temperature": "warm"}, "temperature"), ({"spec": "1.5"}, "integer"),
                      ({"ignore_eos": "maybe"}, "bool")):
        with pytest.raises(StrataError, match=says) as e:
            from_text(bad)
        assert "\n" not in str(e.value)


def test_the_yardstick_of_cpu_expert_rates():
    """peer_bench's yardstick: llama.cpp's CPU experts at -ncmoe N read at least N layers' top-K F16 experts a token
    (issue 33's figure: -ncmoe 9 at 82.9 tok/s on the 30B shape is >= 56 GB/s); our pool's rate is its cpu experts'
    bytes over its jobs' wall time, none without cpu experts; the read probe reports its threads."""
    from benchmarks.peer_bench import host_read_gbs, ours_pool_gbs, peer_cpu_gbs
    from strata_jax.engine.stats import ExpertStats
    from strata_jax.model.config import preset
    cfg = preset("qwen3-30b-a3b")
    assert peer_cpu_gbs(cfg, 9, 82.9) == pytest.approx(9 * 8 * 3 * 2048 * 768 * 2 * 82.9 / 1e9)
    assert 56.0 < peer_cpu_gbs(cfg, 9, 82.9) < 57.0
    assert ours_pool_gbs(cfg, ExpertStats(distinct_cpu=100, pool_s=0.5), 2) == pytest.approx(
        100 * cfg.expert_bytes(2) / 0.5 / 1e9)
    assert ours_pool_gbs(cfg, ExpertStats(distinct_cpu=0, pool_s=0.0), 2) is None
    read, threads = host_read_gbs(8)
    assert threads >= 1 and (read is None or read > 0)
    assert host_read_gbs(0)[0] is None


def test_batch_bench_tiny(tmp_path, capsys, cache_dir):
    from benchmarks import batch_bench
    out = tmp_path / "batch.json"
    result = batch_bench.main(["batch_bench", "--model=tiny", "--batch=1,3", "--prompt=5", "--new_tokens=4",
                               "--dtype=float32", f"--cache_dir={cache_dir}", f"--json={out}"])
    saved = json.loads(out.read_text())
    assert [r["batch"] for r in saved["rows"]] == [1, 3] == [r["batch"] for r in result["rows"]]
    for r in saved["rows"]:
        assert r["aggregate_tok_s"] > 0 and r["per_stream_tok_s"] == pytest.approx(r["aggregate_tok_s"] / r["batch"])
    table_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 + 3 and "aggregate tok/s" in table_lines[0]  # alone, B=1, B=3


def test_batch_bench_tiny_offload(tmp_path, capsys, cache_dir):
    """--expert_cache_slots=25% (4 of 16) --pcie_frac=0.5: the batched windows with offload, and the offload columns
    (a window's fetched and pooled distinct experts, the hit rate) from the counters."""
    from benchmarks import batch_bench
    result = batch_bench.main(["batch_bench", "--model=tiny", "--batch=1,3", "--prompt=5", "--new_tokens=4",
                               "--dtype=float32", "--expert_cache_slots=25%", "--pcie_frac=0.5",
                               f"--cache_dir={cache_dir}"])
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert r["aggregate_tok_s"] > 0 and r["fetched_per_window"] + r["pool_per_window"] > 0
        assert 0 <= r["hit_rate"] <= 1
    table_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert "fetched/window" in table_lines[0] and len(table_lines) == 2 + 3


FAKE_QUANTIZE_COPY = '''#!{python}
"""Stands in for `llama-quantize [--imatrix F] F32 OUT TYPE [THREADS]`: copies the GGUF of TYPE written beforehand;
an unknown type fails as llama-quantize does."""
import pathlib, shutil, sys
args = sys.argv[1:]
if args[0] == "--imatrix":
    args = args[2:]
src, out, qtype = args[:3]
assert pathlib.Path(src).is_file(), src
made = pathlib.Path({made!r}) / (qtype + ".gguf")
if not made.is_file():
    sys.exit("main: invalid ftype " + repr(qtype))
shutil.copy(made, out)
'''


def test_quant_quality_gguf_types_score_each_file(tmp_path, capsys, cache_dir):
    """quant_quality --gguf_types on the embedded tiny model, no llama.cpp: the model written as an F32 GGUF (the
    checkpoint's logits: KL 0), a stand-in llama-quantize copying a Q8_0 GGUF of the same model (written with
    gguf's quantizer), loaded as a user loads it (experts kept in int8-g32) and scored against the F32 GGUF; a type
    the quantizer refuses is a row saying so; no --llama_quantize is one line."""
    import json
    import sys

    from gguf import GGMLQuantizationType as Q

    from benchmarks import quant_quality
    from strata_jax.io import gguf_write
    from strata_jax.io.embedded import resolve_model
    folder = resolve_model("embedded", cache_dir)
    made = tmp_path / "made"
    made.mkdir()
    quant_quality.write_f32_gguf(folder, made / "F32.gguf")  # the writer's own output, then Q8_0 experts
    raw = json.loads((folder / "config.json").read_text())
    from safetensors.numpy import load_file
    hub = gguf_write.stacked(load_file(folder / "model.safetensors"), raw["num_hidden_layers"], raw["num_experts"])
    gguf_write.write_gguf(made / "Q8_0.gguf", raw, hub, types=lambda g: Q.Q8_0 if "_exps" in g else Q.F32,
                          metadata=gguf_write.hf_tokenizer_metadata(folder, raw["vocab_size"]))
    quantize = tmp_path / "llama-quantize"
    quantize.write_text(FAKE_QUANTIZE_COPY.format(python=sys.executable, made=str(made)))
    quantize.chmod(0o755)
    args = ["quant_quality", "--models=embedded", "--formats=", "--positions=12", f"--cache_dir={cache_dir}",
            "--gguf_types=q8_0,Q9_9", f"--llama_quantize={quantize}", "--llama_imatrix=none",
            f"--gguf_dir={tmp_path / 'work'}"]
    result = quant_quality.main(args)
    f32, q8, bad = result["gguf_rows"]
    assert f32["gguf_type"] == "F32 (vs the checkpoint)" and f32["kl_mean"] < 1e-9 and f32["top1"] == 1.0
    assert f32["families"] == {"gate": ["F32"], "up": ["F32"], "down": ["F32"]} and f32["bits_per_weight"] == 32
    assert q8["families"] == {"gate": ["Q8_0"], "up": ["Q8_0"], "down": ["Q8_0"]}
    assert q8["bits_per_weight"] == 8.5 and q8["engine_holds"] == "int8-g32" and "Q8_0" in q8["gguf_line"]
    assert 0 < q8["kl_mean"] < 1e-2 and q8["top1"] > 0.8 and q8["ref_ppl"] == f32["ppl"]
    assert not bad["applicable"] and "llama-quantize failed (1): main: invalid ftype 'Q9_9'" in bad["why"]
    out = capsys.readouterr().out
    assert "| embedded | Q8_0 " in out and "| embedded | Q9_9 " in out
    with pytest.raises(SystemExit) as e:
        quant_quality.main(args[:-3] + [f"--llama_quantize={tmp_path / 'none'}"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gguf_types needs --llama_quantize=PATH" in err


def test_kernel_sweep_tiny_writes_picks_the_engine_reads(tmp_path, capsys):
    """The sweep on the CPU (interpret mode, tiny shapes): every case and row picked from settings that matched the
    reference, the default timed first, and its file is what STRATA_KERNEL_TUNING reads."""
    from benchmarks import kernel_sweep
    from strata_jax.pallas_kernels import tuning
    out = tmp_path / "sweep.json"
    result = kernel_sweep.main(["kernel_sweep", "--hidden=64", "--inter=32", "--experts=8", "--q_dim=64",
                                "--kv_dim=16", "--layers=2", "--configs=2", "--finalists=1", "--iters=1",
                                "--inner=1", "--warmup=0", "--threads=2", f"--json={out}"])
    assert result["complete"] and set(result["picks"]) == set(tuning.SWEPT)
    for name, case in result["cases"].items():
        assert case["settings"][0]["config"] == result["picks"][name] or case["settings"][0]["us"] > 0
        assert all(st["us"] is not None or st["error"] for st in case["settings"])
    assert "finalists" in result["cases"]["qkv:decode"] and result["cases"]["qkv:decode"]["finalists"]["T"] == 4
    assert tuning.read(str(out)) == result["picks"]
    # the XLA yardstick beside the attention products (none for the expert FFN)
    assert result["cases"]["qkv:decode"]["xla_control_us"] > 0 and result["cases"]["o:wide"]["xla_control_us"] > 0
    assert result["cases"]["qkv:wide"]["xla_stacked_us"] > 0 and result["cases"]["o:decode"]["pick_unrolled_us"] > 0
    assert result["cases"]["expert_ffn:decode"]["xla_control_us"] is None
    printed = capsys.readouterr().out
    assert "STRATA_KERNEL_TUNING" in printed and "XLA, unstacked us" in printed


def test_peer_bench_drop_gguf_deletes_the_file_before_our_arms(tmp_path, capsys, cache_dir, monkeypatch):
    """peer_bench --drop_gguf (48 layers: the GGUF in /dev/shm and our host experts do not fit the host together):
    the peer's arms read the file, it is gone before our arms run, and both kinds of rows are in the table; with
    --quant it is one line."""
    import sys
    from benchmarks import peer_bench
    bench = tmp_path / "llama-bench"
    bench.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    bench.chmod(0o755)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # present: nothing is written
    ours = f"expert_cache_slots=4,spec=0,dtype=float32,cpu_threads=2,cache_dir={cache_dir}"
    args = ["peer_bench", "--model=tiny", "--layers=0", "--ncmoe=1", f"--ours={ours}", "--n_gen=4",
            "--prompt_tokens=8", "--reps=1", "--read_mib=0", "--nowarmup_arm", f"--gguf={gguf}",
            f"--llama_bench={bench}", "--drop_gguf"]
    seen = []  # whether the file was there when our arms began
    run_ours = peer_bench.run_ours
    monkeypatch.setattr(peer_bench, "run_ours", lambda s, cfg: seen.append(gguf.exists()) or run_ours(s, cfg))
    result = peer_bench.main(args)
    assert seen == [False] and not gguf.exists()
    assert [(r["ncmoe"], r["tok_s"]) for r in result["peer"]] == [(0, 50.0), (1, 50.0)]
    (r,) = result["ours"]
    assert r["tok_s"] > 0 and r["slots"] == 4
    captured = capsys.readouterr()
    said = captured.out + captured.err  # say() on stdout, progress on stderr: the order within each
    assert "deleted (--drop_gguf), before our arms" in said
    with pytest.raises(SystemExit) as e:
        peer_bench.main(["peer_bench", "--quant=Q2_K", "--llama_bench=", "--drop_gguf"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "--drop_gguf: not with --quant" in err and "Traceback" not in err
