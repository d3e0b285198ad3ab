"""agent_turns_bench's workload: simulated coding-agent sessions over this repository's sources, turn by turn, the
same token ids for every arm (built once from the seed; see benchmarks/agent_turns_bench.py's docstring)."""
from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent.parent

SOURCE_DIRS = ("strata_jax", "host_pool", "pallas_kernels", "benchmarks", "tests")
SKIP_PARTS = {"fixtures", "assets", "results", "__pycache__"}
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

