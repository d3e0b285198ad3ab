"""A/B benchmark of whole engine runs over simulated coding-agent sessions: every arm (a set of STRATA_* switches)
decodes the same turns in its own process, and each turn's decode speed is compared with the baseline arm's.

    python -m benchmarks.agent_turns_bench --model=embedded --dtype=float32 --turns=3 --sessions=1 \\
        --new_tokens=4 --max_prompt_tokens=120 --expert_cache_slots=4 \\
        --arms="base:;skip:STRATA_ROUTE_TAIL_SKIP=2"                                   # CPU, seconds
    python -m benchmarks.agent_turns_bench --arms="base:;skip:STRATA_ROUTE_TAIL_SKIP=5" \\
        --json=out/agent.json --plot=out/agent.png                                      # H200, reference model

Workload (built once, in this process, from --seed; every arm reads the same token ids). Sessions of a simulated
coding agent working in this repository: the sources are the *.py and *.md files under strata_jax/, host_pool/,
pallas_kernels/, benchmarks/ and tests/ (sorted; not tests/fixtures/, strata_jax/assets/ nor benchmarks/results/).
A session's first turn is a fixed system prompt (an agent with the tools read_file, list_dir, grep and run_tests)
and a user task; every later turn appends the assistant's reply of the turn before and a tool message:

    <|system|>\\n{SYSTEM}\\n<|user|>\\n{task}\\n<|assistant|>\\n                        turn 0 (~200 tokens)
    <tool_call name=read_file path=.../>\\n<|tool|>\\n<tool_result name=read_file path=...>\\n{text}
    </tool_result>\\n<|assistant|>\\n                                                        turn 1, 2, ...

The assistant's reply in the conversation is a fixed placeholder, never what the engine decoded: the tool calls
whose results the next tool message holds (so the text of every turn is independent of the engine and the same in
every arm). A tool message holds read_file (a file's text), list_dir (a folder's entries), grep (the lines holding
a name defined in the repository) or run_tests (a simulated pytest report of a test file, one test failing), and
more read_file results when there is room left; the last result is cut to fit ("[... truncated]"). Prompt lengths
grow turn by turn from the first turn's to the longest prompt, max_prompt = context - new_tokens - 8 (8: slack),
or --max_prompt_tokens when smaller: turn j of a session of n turns aims at L0 + (max_prompt - L0) *
(j - 1 + phase) / (n - 2 + phase), phase = (session + 1) / sessions (the sessions' lengths interleave; every
session's last turn is the longest prompt). The turns are split over the --sessions as evenly as possible. When
the conversation cannot take one more turn (the shortest tool message would pass max_prompt), the session ends and
a new session (a new task) takes the turns left; the JSON records it (ended_by_context). Tokens: the model's
tokenizer.json, as engine.encode (byte-level for the reference and embedded models); each worker checks that
engine.encode of every turn's text gives the ids it was handed.

Arms: --arms="name:ENV=VAL,ENV=VAL;name2:..." (an empty list: no switch), the first arm is the baseline. Only the
approximation switches are taken: STRATA_ + the upper-cased name of an EngineOptions field route_* or verify_*,
draft=ngram|none|device|mtp (the arm's draft proposer instead of --draft's, e.g. --arms="ngram:;device:draft=device"),
prefix_reuse=1|0 (--arms="reuse:;cold:prefix_reuse=0": time to first token with and without prefix reuse),
and STRATA_LOGPOS (then each run also writes the teacher-forced log-probs of the workload's longest prompt there,
after its timed turns: run 1 to the path, run k to <stem>.runk<suffix>; compare arms with benchmarks/kl_report.py).

Runs: each run of an arm is its own process (`python -m benchmarks.agent_turns_bench --worker ...`) whose
environment is this one's without any STRATA_* variable, plus the arm's; it builds the engine once
(Engine.from_pretrained(--model, **engine options)), runs --warmup untimed generate() calls of the first turn's
prompt, then every turn in order, each one generate(prompt_ids, --new_tokens, stop_token_ids=[], temperature,
seed = --seed + turn index) on the same engine (its expert cache carries over from turn to turn), and writes one
JSON row per turn (engine.stats.last: prompt tokens, prefill s, decode tok/s, generated tokens and the decode
windows' expert counters). Runs are interleaved and mirrored: arms A B C run A B C C B A, --rounds times; an arm's
value for a turn is the mean over its runs. Before them, with --warmup_run (the default), one more run of the
baseline arm that is not counted (the first process on a machine runs slower).

Output: per arm, the per-turn decode ratio x = arm tok/s / base tok/s of the same turn, its median, min and max
over the turns, the turns won (x > 1), the median time to first token (the prefill: the first token comes out of
it) and the prompt tokens reused per turn, and the mean decode hit rate and counters; for the base, the noise floor:
its mirrored runs' ratio per turn (run 2 / run 1; with --rounds > 1 the mean of the mirrored runs over the mean of
the forward ones). A Markdown table on stdout, every number in --json, and per-turn ratios against prompt tokens in
--plot (matplotlib, when importable). --output=json|csv: the rows (benchmarks/runner.py's schema) on stdout instead.

Code: this file is the entry (flags, the orchestration of the runs); benchmarks/agent_turns/ holds the parts:
workload.py (the sessions and their turns), arms.py (arm flags, run order, a run's environment), worker.py (one arm
run, its process), stats.py (per-turn ratios, the noise floor), report.py (table, notes, plot, --from_json).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from absl import flags

from benchmarks import common, runner
# The parts, re-exported: this module's names before the split (tests and scripts import them from here).
from benchmarks.agent_turns.arms import ARM_OPTIONS, arm_flags, known_switches, parse_arms, run_order, worker_env
from benchmarks.agent_turns.report import from_json, make_plot, make_table, report
from benchmarks.agent_turns.stats import _mean, _stats, summarize
from benchmarks.agent_turns.worker import PROG, PROGRESS, engine_options, logpos_target, start_worker, worker
from benchmarks.agent_turns.workload import (REPO, ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER,
                                             SYSTEM, Repo, build_workload, ids_sha, session_targets, source_files,
                                             tool_message)

__all__ = ["ARM_OPTIONS", "arm_flags", "known_switches", "parse_arms", "run_order", "worker_env", "from_json",
           "make_plot", "make_table", "report", "summarize", "PROG", "PROGRESS", "engine_options", "logpos_target",
           "start_worker", "worker", "REPO", "ROLE_ASSISTANT", "ROLE_SYSTEM", "ROLE_TOOL", "ROLE_USER", "SYSTEM",
           "Repo", "build_workload", "ids_sha", "session_targets", "source_files", "tool_message", "FLAGS", "main",
           "run", "benchmark", "MARGIN", "_stats", "_mean"]

FLAGS = flags.FlagValues()  # our own flag set, so this module can be imported beside the others
flags.DEFINE_string("arms", "base:;skip:STRATA_ROUTE_TAIL_SKIP=5", "Arms, ';'-separated, each name:STRATA_VAR=value,"
                    "STRATA_VAR=value or draft=ngram|none|device|mtp (an empty list after the ':' = no switch); the first "
                    "arm is the baseline.",
                    flag_values=FLAGS)
flags.DEFINE_string("model", "reference", "Model: 'reference' (the committed 64-expert top-8 byte-level model), "
                    "'reference-next' (its Qwen3-Next-shaped sibling with an MTP module), 'embedded' (the tiny random "
                    "model) or a model folder.", flag_values=FLAGS)
# The engine and request options: strata_jax.options' fields (type, help, check), this benchmark's defaults.
common.define_option_flags(FLAGS, ["expert_cache_slots", "pcie_frac", "window", "dtype", "context", "cpu_threads",
                                   "cache_dir", "prefix_reuse"],
                           defaults=dict(expert_cache_slots="16", pcie_frac="1"))  # 16: a quarter of 64 experts
common.define_option_flags(FLAGS, ["temperature", "draft"], prefix="Request option (an arm may set draft=): ")
runner.define_output_flag(FLAGS)
flags.DEFINE_integer("sessions", 3, "Agent sessions the turns are split over.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("turns", 24, "Turns in all (a generate() call each).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 64, "Tokens each turn decodes (no stop token).", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_integer("max_prompt_tokens", 0, "Longest prompt; 0 = context - new_tokens - 8.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the workload (and of the sampling).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("rounds", 1, "Mirrored rounds: each runs every arm twice (A B C C B A).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_bool("warmup_run", True, "First one untimed run of the baseline arm, not counted: the first process of "
                  "a session is slower (process start, a cold compilation cache, GPU clocks and host caches; on an "
                  "H200 a first base run was 1.18x slower than its mirrored twin).", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 1, "Untimed generate() calls of the first turn's prompt in each run, before the "
                     "timed turns.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("from_json", "", "Print the report (table, notes; --plot, --json) of an earlier run's JSON file, "
                    "also one cut short (its arms' ratios from the runs it has), without running anything.",
                    flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file (rewritten after each run).", flag_values=FLAGS)
flags.DEFINE_string("plot", "", "Write a PNG of the per-turn ratios against prompt tokens here (needs matplotlib).",
                    flag_values=FLAGS)
flags.DEFINE_string("dump_workload", "", "Also write the workload (every turn's text and token ids) to this JSON "
                    "file.", flag_values=FLAGS)
# Internal: one arm run (the parent starts these).
flags.DEFINE_bool("worker", False, "Internal: run one arm in this process (started by the benchmark).",
                  flag_values=FLAGS)
flags.DEFINE_string("workload", "", "Internal (--worker): the workload JSON file.", flag_values=FLAGS)
flags.DEFINE_string("worker_out", "", "Internal (--worker): where the run's JSON goes.", flag_values=FLAGS)
flags.DEFINE_string("arm", "", "Internal (--worker): the arm's name.", flag_values=FLAGS)
flags.DEFINE_integer("run_index", 1, "Internal (--worker): which run of its arm this is (1-based).", lower_bound=1,
                     flag_values=FLAGS)

MARGIN = 8  # tokens kept free past prompt + new_tokens


def benchmark(s) -> dict:
    from strata_jax.model.config import config_from_dict
    from strata_jax.io.embedded import resolve_model
    from strata_jax.engine.plan import context_and_chunk
    from strata_jax.errors import StrataError
    from strata_jax.options import EngineOptions, build
    from strata_jax.io.tokenizer import load_tokenizer

    arms = parse_arms(s.arms, options=ARM_OPTIONS)
    if s.turns < s.sessions:
        raise ValueError(f"--turns={s.turns} is fewer than --sessions={s.sessions}")
    opts = build(EngineOptions, engine_options(s))
    model_dir = resolve_model(s.model, opts.resolved_cache_dir())
    if not (model_dir / "config.json").is_file():
        raise StrataError(f"--model={s.model}: no config.json in {model_dir}")
    cfg = config_from_dict(json.loads((model_dir / "config.json").read_text()), where=str(model_dir))
    tokenizer = load_tokenizer(model_dir)
    context, _ = context_and_chunk(cfg, opts)
    max_prompt = context - s.new_tokens - MARGIN
    if s.max_prompt_tokens:
        max_prompt = min(max_prompt, s.max_prompt_tokens)
    if max_prompt < 1:
        raise ValueError(f"context {context} leaves no room for a prompt with --new_tokens={s.new_tokens}")
    workload = build_workload(lambda text: tokenizer.encode(text).ids, max_prompt, s.turns, s.sessions, s.seed)
    for t in workload["turns"]:
        if max(t["ids"]) >= cfg.vocab_size:
            raise StrataError(f"the tokenizer gives ids past the model's vocab ({cfg.vocab_size})")
    order = run_order([a for a, _ in arms], s.rounds)
    lengths = [t["prompt_tokens"] for t in workload["turns"]]
    ended = sum(x["ended_by_context"] for x in workload["sessions"])
    say = common.say
    say(f"agent_turns_bench: model {s.model} ({cfg.num_layers} layers, {cfg.num_experts} experts "
        f"top-{cfg.num_experts_per_tok}), {s.dtype}, expert_cache_slots {s.expert_cache_slots}, pcie_frac "
        f"{s.pcie_frac}, window {s.window}, context {context}")
    say(f"workload: {len(lengths)} turns in {len(workload['sessions'])} session(s) "
        f"({', '.join(str(x['turns']) for x in workload['sessions'])} turns), prompts {min(lengths)}..{max(lengths)} "
        f"tokens (max {max_prompt}), {s.new_tokens} new tokens a turn, {workload['files']} source files, seed "
        f"{s.seed}, sha256 {workload['sha256'][:16]}" + (f"; {ended} session(s) ended by the context" if ended else ""))
    say(f"arms: {'; '.join(f'{n}: ' + (','.join(f'{k}={v}' for k, v in e.items()) or 'no switch') for n, e in arms)}")
    say(f"order: {'(warm-up ' + arms[0][0] + ') ' if s.warmup_run else ''}{' '.join(order)} (each run its own "
        "process)")
    stray = sorted(k for k in os.environ if k.startswith("STRATA_"))
    if stray:
        say(f"note: {', '.join(stray)} set here: removed from every run's environment (only the arms' switches "
            "reach the runs)")
    result = dict(benchmark="agent_turns_bench", complete=False,
                  settings={k: getattr(s, k) for k in ("arms", "model", "expert_cache_slots", "pcie_frac", "window",
                                                       "dtype", "context", "cpu_threads", "sessions", "turns",
                                                       "new_tokens", "max_prompt_tokens", "temperature", "draft",
                                                       "seed", "rounds", "warmup_run", "warmup")},
                  context=context, arms=[dict(name=n, env=e) for n, e in arms], order=order,
                  workload=dict({k: v for k, v in workload.items() if k != "turns"},
                                turns=[{k: v for k, v in t.items() if k not in ("text", "ids")}
                                       for t in workload["turns"]]),
                  runs=[])

    def save():
        if s.json:
            common.write_json(s.json, result)

    if s.dump_workload:
        common.write_json(s.dump_workload, workload)
    runs: list[dict] = []
    seen: dict[str, int] = {}
    switches = dict(arms)
    with tempfile.TemporaryDirectory(prefix="agent_turns_") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        if s.warmup_run:
            name = arms[0][0]
            label = f"warm-up run {name}"
            common.progress(f"{label}: starting (not counted)")
            env = {k: v for k, v in switches[name].items() if k != "STRATA_LOGPOS"}  # it writes no logpos file
            out, _, wall = start_worker(s, name, env, 1, workload_path, Path(tmp) / "warmup.json", label)
            tok = _mean([t["decode_tok_s"] for t in out["turns"]])
            result["warmup_run"] = dict(arm=name, wall_s=wall, build_s=out["build_s"], decode_tok_s_mean=tok)
            common.progress(f"{label}: done in {wall:.1f} s: mean decode {tok:,.1f} tok/s (not counted)")
        for pos, name in enumerate(order):
            seen[name] = seen.get(name, 0) + 1
            label = f"run {pos + 1}/{len(order)} {name} #{seen[name]}"
            env_text = ",".join(f"{k}={v}" for k, v in switches[name].items()) or "no switch"
            common.progress(f"{label}: starting ({env_text})")
            out, lines, wall = start_worker(s, name, switches[name], seen[name], workload_path,
                                            Path(tmp) / f"run{pos}.json", label)
            if out["workload_sha256"] != workload["sha256"]:
                raise ValueError(f"{label}: the run read another workload ({out['workload_sha256'][:16]})")
            out.update(order_index=pos, wall_s=wall, log=lines,
                       switch_lines=[ln for ln in lines if ln.startswith(("route ", "STRATA_"))])
            runs.append(out)
            result["runs"] = runs
            save()
            tok = _mean([t["decode_tok_s"] for t in out["turns"]])
            common.progress(f"{label}: done in {wall:.1f} s (engine built in {out['build_s']:.1f} s): mean decode "
                            f"{tok:,.1f} tok/s, mean hit rate {_mean([t['hit_rate'] for t in out['turns']]):.1%}")
    return report(s, arms, runs, workload, result)


def run(s) -> dict:
    if s.worker:
        return worker(s)
    return from_json(s) if s.from_json else benchmark(s)


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, PROG, run)


if __name__ == "__main__":
    main(sys.argv)
