"""A/B benchmark of whole engine runs over simulated coding-agent sessions: every arm (a set of STRATA_* switches)
decodes the same turns in its own process, and each turn's decode speed is compared with the baseline arm's.

    python -m benchmarks.agent_turns_bench --model=embedded --dtype=float32 --turns=3 --sessions=1 \\
        --new_tokens=4 --max_prompt_tokens=120 --expert_cache_slots=4 \\
        --arms="base:;skip:STRATA_ROUTE_TAIL_SKIP=2"                                   # CPU, seconds
    python -m benchmarks.agent_turns_bench --arms="base:;skip:STRATA_ROUTE_TAIL_SKIP=5" \\
        --json=out/agent.json --plot=out/agent.png                                      # H200, reference model

Workload (built once, in this process, from --seed; every arm reads the same token ids). Sessions of a simulated
coding agent working in this repository: the sources are the *.py and *.md files under strata_jax/, host_pool/,
pallas_kernels/, benchmarks/ and tests/ (sorted; not tests/fixtures/, strata_jax/models/ nor benchmarks/results/).
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
--plot (matplotlib, when importable).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from absl import flags

from benchmarks import common
from benchmarks.common import known_switches, parse_arms  # noqa: F401 (known_switches: part of this module's API)

REPO = Path(__file__).resolve().parent.parent
PROG = "benchmarks.agent_turns_bench"

FLAGS = flags.FlagValues()  # our own flag set, so this module can be imported beside the others
flags.DEFINE_string("arms", "base:;skip:STRATA_ROUTE_TAIL_SKIP=5", "Arms, ';'-separated, each name:STRATA_VAR=value,"
                    "STRATA_VAR=value or draft=ngram|none|device|mtp (an empty list after the ':' = no switch); the first "
                    "arm is the baseline.",
                    flag_values=FLAGS)
flags.DEFINE_string("model", "reference", "Model: 'reference' (the committed 64-expert top-8 byte-level model), "
                    "'reference-next' (its Qwen3-Next-shaped sibling with an MTP module), 'embedded' (the tiny random "
                    "model) or a model folder.", flag_values=FLAGS)
flags.DEFINE_string("expert_cache_slots", "16", "Engine option: device expert cache slots per MoE layer (16: a "
                    "quarter of the reference model's 64 experts).", flag_values=FLAGS)
flags.DEFINE_string("pcie_frac", "1", "Engine option: share of the missed experts fetched over PCIe (the rest on "
                    "the host pool); the STRATA_VERIFY_DEFER_CPU arms need it below 1.", flag_values=FLAGS)
flags.DEFINE_integer("window", 4, "Engine option: largest verify window W.", lower_bound=1, upper_bound=16,
                     flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Engine option: compute and weight dtype.",
                  flag_values=FLAGS)
flags.DEFINE_integer("context", 0, "Engine option: KV cache tokens; 0 = the model's max_position_embeddings "
                     "(at most 4096).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("cpu_threads", 0, "Engine option: host pool threads; 0 = the cores this process may use.",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("cache_dir", "", "Engine option: folder of the persistent compilation cache and the embedded "
                    "model ('' = ~/.cache/strata_jax).", flag_values=FLAGS)
flags.DEFINE_integer("sessions", 3, "Agent sessions the turns are split over.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("turns", 24, "Turns in all (a generate() call each).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 64, "Tokens each turn decodes (no stop token).", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_integer("max_prompt_tokens", 0, "Longest prompt; 0 = context - new_tokens - 8.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy. Turn i is sampled with seed --seed + i.",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_enum("draft", "ngram", ["ngram", "none", "device", "mtp"], "Draft proposer of the verify windows "
                  "(device: drafting and acceptance on the device, windows back to back; mtp: the checkpoint's MTP "
                  "module, e.g. --model=reference-next).", flag_values=FLAGS)
flags.DEFINE_enum("prefix_reuse", "1", ["1", "0"], "Engine option: keep the last turn's KV rows and prefill only "
                  "a turn's new tokens (an arm may set prefix_reuse=0|1).", flag_values=FLAGS)
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
PROGRESS = "@progress "  # a worker's stderr line the parent shows as progress

# ---- arms ----------------------------------------------------------------------------------------------------

# Per-arm worker flags an arm may set besides STRATA_*: the draft proposer, and prefix reuse (1: a turn that
# extends the one before prefills only its new tokens; 0: every turn prefilled whole, a cold start each time).
ARM_OPTIONS = {"draft": ("ngram", "none", "device", "mtp"), "prefix_reuse": ("1", "0")}


def arm_flags(s, switches: dict[str, str]) -> dict[str, str]:
    """The worker flags of an arm: --draft's value unless the arm sets its own."""
    return {k: switches.get(k, getattr(s, k)) for k in ARM_OPTIONS}


def run_order(names: list[str], rounds: int) -> list[str]:
    """Interleaved and mirrored: A B C C B A, `rounds` times."""
    return (names + names[::-1]) * rounds


def worker_env(switches: dict[str, str], base: dict | None = None) -> dict[str, str]:
    """A copy of the environment without any STRATA_* variable, plus the arm's switches."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith("STRATA_")}
    env.update({k: v for k, v in switches.items() if k not in ARM_OPTIONS})
    return env


# ---- workload ------------------------------------------------------------------------------------------------

SOURCE_DIRS = ("strata_jax", "host_pool", "pallas_kernels", "benchmarks", "tests")
SKIP_PARTS = {"fixtures", "models", "results", "__pycache__"}
SYSTEM = "You are a coding agent. Tools: read_file, list_dir, grep, run_tests."
ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL = "<|system|>\n", "<|user|>\n", "<|assistant|>\n", "<|tool|>\n"
TRUNCATED = "\n[... truncated]\n"
TOOL_WEIGHTS = (("read_file", 5), ("grep", 2), ("run_tests", 2), ("list_dir", 1))
MIN_TASK_CHARS = 16  # a first turn whose task is cut shorter than this does not fit
MIN_CONTENT_CHARS = 64  # a tool result cut shorter than this is left out
ROOM_TOKENS = 32  # after a whole result, another one is added when at least this many tokens are left
MAX_RESULTS = 12  # tool results in one message, at most
TASKS = ("The test {test} in {tfile} fails. Find the cause in {src} and fix it.",
         "Explain what {func} in {src} does, then add a test for it to {tfile}.",
         "Speed up {func} in {src} without changing its results; keep {tfile} passing.",
         "Add a docstring example to {func} in {src} and check it against {tfile}.",
         "Rename {func} in {src} to something clearer and update its callers.")


def source_files(root: Path = REPO) -> list[str]:
    """The workload's files: *.py and *.md under SOURCE_DIRS, sorted relative posix paths."""
    out = []
    for d in SOURCE_DIRS:
        for p in (root / d).rglob("*"):
            rel = p.relative_to(root)
            if p.is_file() and p.suffix in (".py", ".md") and not SKIP_PARTS & set(rel.parts[:-1]):
                out.append(rel.as_posix())
    return sorted(out)


class Repo:
    """The files' texts and what the simulated tools answer about them."""

    def __init__(self, root: Path = REPO):
        self.paths = source_files(root)
        if not self.paths:
            raise ValueError(f"no *.py or *.md file under {', '.join(SOURCE_DIRS)} of {root}")
        self.text = {p: (root / p).read_text(errors="replace") for p in self.paths}
        # Names defined (def / class), 4 characters or more (a grep for `f` would match every line).
        self.defs = {p: re.findall(r"^\s*(?:def|class) ([A-Za-z_]\w{3,})", self.text[p], re.M)
                     for p in self.paths}
        self.tests = {p: re.findall(r"^def (test_\w+)", self.text[p], re.M) for p in self.paths
                      if p.startswith("tests/test_")}
        self.tests = {p: t for p, t in self.tests.items() if t}
        self.sources = [p for p in self.paths if p.endswith(".py") and self.defs[p] and not p.startswith("tests/")]
        dirs: dict[str, set] = {}
        for p in self.paths:
            parts = p.split("/")
            for i in range(len(parts)):
                parent = "/".join(parts[:i]) or "."
                dirs.setdefault(parent, set()).add(parts[i] + ("/" if i < len(parts) - 1 else ""))
        self.dirs = {d: sorted(v) for d, v in sorted(dirs.items())}

    def task(self, rng: random.Random) -> str:
        tfile = rng.choice(sorted(self.tests)) if self.tests else rng.choice(self.paths)
        test = rng.choice(self.tests[tfile]) if tfile in self.tests else "test_all"
        src = rng.choice(self.sources) if self.sources else rng.choice(self.paths)
        func = rng.choice(self.defs[src]) if self.defs.get(src) else "main"
        return rng.choice(TASKS).format(test=test, tfile=tfile, src=src, func=func)

    def tool(self, kind: str, rng: random.Random, unread: list[str]) -> tuple[str, str, str]:
        """(call, result header, content) of one tool call; the footer is '</tool_result>\\n'."""
        if kind == "read_file":
            path = unread.pop(rng.randrange(len(unread))) if unread else rng.choice(self.paths)
            return (f"<tool_call name=read_file path={path}/>", f"<tool_result name=read_file path={path}>\n",
                    self.text[path])
        if kind == "list_dir":
            d = rng.choice(list(self.dirs))
            return (f"<tool_call name=list_dir path={d}/>", f"<tool_result name=list_dir path={d}>\n",
                    "".join(e + "\n" for e in self.dirs[d]))
        if kind == "grep":
            src = rng.choice(self.sources) if self.sources else rng.choice(self.paths)
            name = rng.choice(self.defs[src]) if self.defs.get(src) else "def"
            lines = [f"{p}:{i}:{line}\n" for p in self.paths for i, line in enumerate(self.text[p].splitlines(), 1)
                     if name in line]
            return (f"<tool_call name=grep pattern={name}/>", f"<tool_result name=grep pattern={name}>\n",
                    "".join(lines) or "(no match)\n")
        if kind == "run_tests":
            if not self.tests:
                return self.tool("read_file", rng, unread)
            tfile = rng.choice(sorted(self.tests))
            names = self.tests[tfile]
            failed = rng.choice(names)
            body = [f"$ python -m pytest -q {tfile}\n"]
            body += [f"{tfile}::{t} {'FAILED' if t == failed else 'PASSED'}\n" for t in names]
            src = self.text[tfile].splitlines()
            start = next((i for i, line in enumerate(src) if line.startswith(f"def {failed}")), 0)
            body.append(f"=================================== FAILURES ===================================\n"
                        f"_____ {failed} _____\n")
            body += [f"    {line}\n" for line in src[start:start + 12]]
            body.append(f"E   AssertionError\n{tfile}:{start + 1}: AssertionError\n"
                        f"===== 1 failed, {len(names) - 1} passed =====\n")
            return (f"<tool_call name=run_tests path={tfile}/>", f"<tool_result name=run_tests path={tfile}>\n",
                    "".join(body))
        raise ValueError(f"unknown tool {kind}")


def _largest_fit(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in 0..hi with fits(n) (fits is monotone: true up to some n), or -1 when none."""
    if not fits(0):
        return -1
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def tool_message(calls: list[tuple[str, str, str, int]]) -> str:
    """The reply naming the calls, then the tool message holding their results (content cut to n chars), then the
    next assistant header: what a turn after the first appends to the conversation."""
    reply = "".join(call + "\n" for call, _, _, _ in calls)
    results = "".join(head + (content if n >= len(content) else content[:n] + TRUNCATED) + "</tool_result>\n"
                      for _, head, content, n in calls)
    return reply + ROLE_TOOL + results + ROLE_ASSISTANT


def session_targets(first: int, max_prompt: int, n: int, phase: float) -> list[int]:
    """Prompt lengths turns 1..n-1 of a session aim at: from the first turn's length up to max_prompt."""
    if n <= 1:
        return []
    if n == 2:
        return [max_prompt]
    return [int(first + (max_prompt - first) * (j - 1 + phase) / (n - 2 + phase)) for j in range(1, n)]


def build_workload(encode: Callable[[str], list[int]], max_prompt: int, turns: int, sessions: int, seed: int,
                   root: Path = REPO) -> dict:
    """The turns of every session (text, token ids), from the seed alone: the same for every arm."""
    if turns < sessions:
        raise ValueError(f"--turns={turns} is fewer than --sessions={sessions}")
    repo = Repo(root)
    rng = random.Random(seed)
    per = [turns // sessions + (1 if s < turns % sessions else 0) for s in range(sessions)]
    queue = [(n, (s + 1) / sessions) for s, n in enumerate(per)]  # (turns, phase) of the sessions to run
    out_turns: list[dict] = []
    out_sessions: list[dict] = []
    count = lambda text: len(encode(text))  # noqa: E731
    while queue:
        n, phase = queue.pop(0)
        s = len(out_sessions)
        head = ROLE_SYSTEM + SYSTEM + "\n" + ROLE_USER
        task = repo.task(rng)
        first = lambda k: head + (task if k >= len(task) else task[:k]) + "\n" + ROLE_ASSISTANT  # noqa: E731
        k = _largest_fit(lambda k: count(first(k)) <= max_prompt, len(task))
        if k < min(MIN_TASK_CHARS, len(task)):
            raise ValueError(f"the longest prompt ({max_prompt} tokens) cannot hold a session's first turn (the "
                             f"system prompt and a task need {count(first(MIN_TASK_CHARS))} tokens): raise "
                             "--max_prompt_tokens or --context, or lower --new_tokens")
        text = first(k)
        unread = list(repo.paths)
        rng.shuffle(unread)
        session = dict(index=s, planned_turns=n, turns=0, ended_by_context=False, task=task[:k],
                       first_tokens=count(text))
        targets = session_targets(session["first_tokens"], max_prompt, n, phase)
        for j in range(n):
            calls: list[tuple[str, str, str, int]] = []
            if j > 0:
                target = max(targets[j - 1], count(text) + 1)
                kinds = [rng.choices([t for t, _ in TOOL_WEIGHTS], [w for _, w in TOOL_WEIGHTS])[0]]
                kinds += ["read_file"] * (MAX_RESULTS - 1)
                for kind in kinds:
                    call, head_, content = repo.tool(kind, rng, unread)
                    trial = lambda m: text + tool_message(calls + [(call, head_, content, m)])  # noqa: E731
                    if count(trial(len(content))) <= target:
                        calls.append((call, head_, content, len(content)))
                        if target - count(text + tool_message(calls)) < ROOM_TOKENS:
                            break
                        continue
                    m = _largest_fit(lambda m: count(trial(m)) <= target, len(content))
                    if m >= min(MIN_CONTENT_CHARS, len(content)):
                        calls.append((call, head_, content, m))
                    elif not calls:  # the target is too close: the shortest message, if max_prompt allows
                        m = _largest_fit(lambda m: count(trial(m)) <= max_prompt, len(content))
                        if m >= min(MIN_CONTENT_CHARS, len(content)):
                            calls.append((call, head_, content, min(m, MIN_CONTENT_CHARS)))
                    break
                if not calls:  # the conversation is full: this session ends, a new one takes the turns left
                    session["ended_by_context"] = True
                    queue.insert(0, (n - j, phase))
                    break
                text = text + tool_message(calls)
            ids = encode(text)
            tools = [call[len("<tool_call name="):-2].replace(" path=", " ").replace(" pattern=", " ")
                     for call, _, _, _ in calls]
            out_turns.append(dict(index=len(out_turns), session=s, turn=j, prompt_tokens=len(ids), tools=tools,
                                  truncated=any(m < len(c) for _, _, c, m in calls), text=text, ids=ids,
                                  prompt_sha256=ids_sha(ids)))
            session["turns"] += 1
        session["last_tokens"] = out_turns[-1]["prompt_tokens"]
        out_sessions.append(session)
    digest = hashlib.sha256("".join(t["prompt_sha256"] for t in out_turns).encode()).hexdigest()
    return dict(seed=seed, max_prompt_tokens=max_prompt, turns=out_turns, sessions=out_sessions, files=len(repo.paths),
                sha256=digest, system=SYSTEM)


def ids_sha(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


# ---- one run (the worker process) ----------------------------------------------------------------------------


def engine_options(s) -> dict:
    return dict(window=s.window, dtype=s.dtype, context=s.context, cache_dir=s.cache_dir,
                expert_cache_slots=s.expert_cache_slots, pcie_frac=s.pcie_frac, cpu_threads=s.cpu_threads,
                prefix_reuse=s.prefix_reuse == "1")


def logpos_target(path: str, run_index: int) -> str:
    if run_index == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.run{run_index}{p.suffix}"))


def worker(s) -> dict:
    """Build the engine once, run every turn of the workload, write the per-turn rows to --worker_out."""
    from strata_jax.engine import Engine
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


# ---- the benchmark (the parent process) ----------------------------------------------------------------------


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


def make_table(summary: list[dict], noise: dict, n_turns: int) -> str:
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
    return common.format_table(headers, rows)


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


def benchmark(s) -> dict:
    from strata_jax.config import config_from_dict
    from strata_jax.embedded import resolve_model
    from strata_jax.engine import context_and_chunk
    from strata_jax.errors import StrataError
    from strata_jax.options import EngineOptions, build
    from strata_jax.tokenizer import load_tokenizer

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
    say(table)
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


def run(s) -> dict:
    if s.worker:
        return worker(s)
    return from_json(s) if s.from_json else benchmark(s)


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, PROG, run)


if __name__ == "__main__":
    main(sys.argv)
