"""agent_turns_bench's runs: one arm run in its own process (the worker: build the engine once, run every turn,
write a JSON row per turn), and its start from the parent (start_worker)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.agent_turns.arms import arm_flags, worker_env
from benchmarks.agent_turns.workload import REPO, ids_sha

PROG = "benchmarks.agent_turns_bench"
PROGRESS = "@progress "  # a worker's stderr line the parent shows as progress


def engine_options(s) -> dict:
    return dict(window=s.window, dtype=s.dtype, context=s.context, cache_dir=s.cache_dir,
                expert_cache_slots=s.expert_cache_slots, pcie_frac=s.pcie_frac, cpu_threads=s.cpu_threads,
                prefix_reuse=s.prefix_reuse in (True, "1"))


def logpos_target(path: str, run_index: int) -> str:
    if run_index == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.run{run_index}{p.suffix}"))


def worker(s) -> dict:
    """Build the engine once, run every turn of the workload, write the per-turn rows to --worker_out."""
    from strata_jax.engine.api import Engine
    from strata_jax.errors import StrataError
    from strata_jax.options import RequestOptions, logpos_path

    if not s.workload or not s.worker_out:
        raise ValueError("--worker needs --workload and --worker_out")
    workload = json.loads(Path(s.workload).read_text())
    turns = workload["turns"]
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(s.model, **engine_options(s))
    build_s = time.perf_counter() - t0
    for t in turns:
        if engine.tokenizer is not None and engine.encode(t["text"]) != t["ids"]:
            raise StrataError(f"turn {t['index']}: engine.encode of its text differs from the workload's token ids")
    request = dict(max_new_tokens=s.new_tokens, temperature=s.temperature, draft=s.draft, stop_token_ids=[])
    for i in range(s.warmup):
        engine.generate(turns[0]["ids"], seed=s.seed, **request)
    rows = []
    for t in turns:
        tokens = engine.generate(t["ids"], seed=s.seed + t["index"], **request)
        r = engine.stats.last
        d = r.decode_experts
        rows.append(dict(index=t["index"], session=t["session"], turn=t["turn"], prompt_tokens=r.prompt_tokens,
                         prompt_sha256=ids_sha(t["ids"]), prefill_s=r.prefill_s, prefill_tok_s=r.prefill_tok_s,
                         cached_tokens=r.cached_tokens,
                         decode_s=r.decode_s, decode_tok_s=r.decode_tok_s, generated_tokens=r.generated_tokens,
                         windows=r.windows, drafts_proposed=r.drafts_proposed, drafts_accepted=r.drafts_accepted,
                         hit_rate=d.hit_rate if engine.placement else 1.0, distinct_fetched=d.distinct_fetched,
                         distinct_cpu=d.distinct_cpu, distinct_skipped=d.distinct_skipped,
                         decode_experts=dict(vars(d), hit_rate=d.hit_rate), tokens=tokens))
        print(f"{PROGRESS}turn {t['index'] + 1}/{len(turns)} (session {t['session']} turn {t['turn']}): "
              f"{r.prompt_tokens} prompt tokens, prefill {r.prefill_s:.2f} s, decode {r.decode_tok_s:,.1f} tok/s, "
              f"hit rate {rows[-1]['hit_rate']:.1%}", file=sys.stderr, flush=True)
    logpos = logpos_path(RequestOptions())
    written = None
    if logpos:
        longest = max(turns, key=lambda t: t["prompt_tokens"])
        written = logpos_target(logpos, s.run_index)
        n = engine.write_logpos(longest["ids"], written, meta=dict(arm=s.arm, run=s.run_index,
                                                                   turn=longest["index"]))
        print(f"{PROGRESS}logpos: {n} positions of turn {longest['index']}'s prompt written to {written}",
              file=sys.stderr, flush=True)
    out = dict(arm=s.arm, run=s.run_index, device=common.device_info(), build_s=build_s,
               compile_s=engine.stats.compile_s, context=engine.context,
               slots=engine.placement.slots if engine.placement else "all",
               pcie_frac=engine.placement.pcie_frac if engine.placement else None,
               approx=dataclasses.asdict(engine.approx), approx_active=engine.approx.active,
               defer=dataclasses.asdict(engine.defer), defer_active=engine.defer.active,
               env={k: v for k, v in sorted(os.environ.items()) if k.startswith("STRATA_")}, draft=s.draft,
               workload_sha256=workload["sha256"], logpos=written, turns=rows)
    common.write_json(s.worker_out, out)
    return out



def start_worker(s, arm: str, switches: dict, run_index: int, workload_path: Path, out_path: Path,
                 label: str) -> tuple[dict, list[str], float]:
    """Run one arm in its own process; returns (its JSON, its other output lines, wall seconds). A failure is one
    ValueError line quoting the worker's last line."""
    model = s.model if s.model in ("reference", "reference-next", "embedded") else str(Path(s.model).resolve())
    args = [sys.executable, "-m", PROG, "--worker", f"--workload={workload_path}", f"--worker_out={out_path}",
            f"--arm={arm}", f"--run_index={run_index}", f"--model={model}",
            f"--expert_cache_slots={s.expert_cache_slots}", f"--pcie_frac={s.pcie_frac}", f"--window={s.window}",
            f"--dtype={s.dtype}", f"--context={s.context}", f"--cpu_threads={s.cpu_threads}",
            f"--cache_dir={str(Path(s.cache_dir).expanduser().resolve()) if s.cache_dir else ''}",
            f"--new_tokens={s.new_tokens}", f"--temperature={s.temperature}",
            *(f"--{k}={v}" for k, v in arm_flags(s, switches).items()),
            f"--seed={s.seed}", f"--warmup={s.warmup}"]
    env = worker_env(switches)
    if "STRATA_LOGPOS" in env:
        env["STRATA_LOGPOS"] = str(Path(env["STRATA_LOGPOS"]).expanduser().resolve())
    t0 = time.perf_counter()
    lines: list[str] = []
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS):
                common.progress(f"  {label}: {line[len(PROGRESS):]}")
            elif line.strip():
                lines.append(line)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    if rc != 0 or not out_path.is_file():
        last = lines[-1].strip() if lines else "(no output)"
        raise ValueError(f"arm {arm} run {run_index}: the worker failed (exit status {rc}): {last!r}")
    return json.loads(out_path.read_text()), lines, wall

