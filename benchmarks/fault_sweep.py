"""How does the engine meet bad input and faults? Each case runs (the CLI in a subprocess, the API in this process)
and is classed the way issue 18's hostile run tallied them:

  clean      the promised behaviour: a refusal is one `error:` line (CLI) or one-line StrataError (API); a bad
             STRATA_* switch is one line and the run goes on with the switch off; a good request gives the right
             answer; Ctrl-C exits 130 quietly
  traceback  a Python traceback, or a raw exception from the API instead of StrataError
  hang       no exit within the case's time limit
  silent     the run went on as if nothing were wrong, or gave a wrong answer without a word

    python -m benchmarks.fault_sweep                 # every case, 2 CLI runs at a time
    python -m benchmarks.fault_sweep --only=ckpt,api --json=sweep.json

Timing is not the point: the table lists each case's class and what it printed (its last stderr line)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
flags.DEFINE_string("only", "", "Comma-separated groups to run (flags, env, files, ckpt, runtime, api); empty = all.")
flags.DEFINE_integer("jobs", 2, "CLI cases run at a time.")
flags.DEFINE_integer("limit_s", 180, "A case that has not ended after this many seconds is a hang.")
flags.DEFINE_string("cache_dir", "", "Compilation cache and embedded model folder (default: a temporary folder).")
flags.DEFINE_string("json", "", "Also write the rows here.")

CLASSES = ("clean", "traceback", "hang", "silent")
BASE = ["--dtype=float32", "--window=4", "--context=64", "--max_new_tokens=4", "--prompt=hello"]


@dataclasses.dataclass
class Case:
    group: str
    name: str
    run: Callable[[], tuple[str, str]]  # -> (class, what it printed or returned, one line)


# ---- CLI cases ---------------------------------------------------------------------------------------------------

def cli(args: list[str], cache_dir: Path, env: dict | None = None, sigint_after: str | None = None,
        limit_s: int = 180, sigint_at: float | None = None) -> tuple[int | None, str, str]:
    """Run `python -m strata_jax.decode`; (returncode or None on a hang, stdout, stderr). sigint_after: send
    SIGINT one second after this text shows on stderr; sigint_at: this many seconds after the start."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, PYTHONIOENCODING="utf-8",
               **(env or {}))
    if not any(a.startswith("--model") for a in args):
        args = ["--model=embedded", *args]
    cmd = [sys.executable, "-m", "strata_jax.decode", *args, f"--cache_dir={cache_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # SIGINT as from a terminal, even when this sweep runs as a background job (which
                            # hands its children SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = b""
    if sigint_at is not None:
        time.sleep(sigint_at)
        proc.send_signal(signal.SIGINT)
    if sigint_after:
        deadline = time.time() + limit_s
        while time.time() < deadline:
            line = proc.stderr.readline()
            err += line
            if sigint_after.encode() in line or not line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
    try:
        out, rest = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, rest = proc.communicate()
        return None, out.decode("utf-8", "replace"), (err + rest).decode("utf-8", "replace")
    return proc.returncode, out.decode("utf-8", "replace"), (err + rest).decode("utf-8", "replace")


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def refuse(args, cache_dir, match: str = "", env=None, limit_s=180):
    """The CLI must refuse: exit != 0 with one `error:` line (mentioning `match`) and no traceback."""
    def run():
        rc, out, err = cli(args, cache_dir, env, limit_s=limit_s)
        if rc is None:
            return "hang", last_line(err)
        if "Traceback" in err or "Traceback" in out:
            return "traceback", last_line(err)
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        if rc == 0:
            return "silent", "exit 0: " + last_line(out)
        if len(errors) != 1 or match.lower() not in errors[0].lower():
            return "traceback", f"exit {rc}: " + last_line(err)  # a raw failure, not the promised line
        return "clean", errors[0][:160]
    return run


def warn(args, cache_dir, env, match: str):
    """A STRATA_* switch: a line naming it (a bad value: what is used instead), and the run goes on."""
    def run():
        rc, out, err = cli(args, cache_dir, env)
        if rc is None:
            return "hang", last_line(err)
        if "Traceback" in err:
            return "traceback", last_line(err)
        said = [ln for ln in (err + out).splitlines() if match in ln]
        if rc != 0:
            return "traceback", f"exit {rc}: " + last_line(err)
        return ("clean", said[0][:160]) if said else ("silent", "exit 0 without a word on " + match)
    return run


def sigint(args, cache_dir, at: float | None = None):
    def run():
        rc, out, err = cli(args, cache_dir, sigint_after=None if at is not None else "graphs:", sigint_at=at)
        if rc is None:
            return "hang", last_line(err)
        if "Traceback" in err:
            return "traceback", last_line(err)
        if "Exception ignored" in err:
            return "traceback", last_line(err)
        return ("clean", "exit 130") if rc == 130 else ("silent", f"exit {rc}: " + last_line(out))
    return run


def flag_cases(cache_dir: Path) -> list[Case]:
    bad = [("--window=0", "window"), ("--window=abc", "window"), ("--window=-2", "window"),
           ("--context=-1", "context"), ("--context=abc", "context"), ("--max_new_tokens=-5", "max_new_tokens"),
           ("--temperature=-1", "temperature"), ("--temperature=nan", "temperature"), ("--top_p=0", "top_p"),
           ("--top_p=1.5", "top_p"), ("--top_k=-1", "top_k"), ("--top_k=3000000000", "top_k"),
           ("--seed=-1", "seed"), ("--dtype=float16", "dtype"), ("--expert_cache_slots=-3", "expert_cache_slots"),
           ("--expert_cache_slots=many", "expert_cache_slots"), ("--pcie_frac=1.5", "pcie_frac"),
           ("--pcie_frac=abc", "pcie_frac"), ("--cache_policy=fifo", "cache_policy"), ("--draft=magic", "draft"),
           ("--spec=99", "spec"), ("--spec=9", "spec"), ("--cpu_threads=-1", "cpu_threads"),
           ("--callback_timeout_s=-1", "callback_timeout_s"), ("--layer_loop=sideways", "layer_loop"),
           ("--expert_kernel=cuda", "expert_kernel"), ("--logpos_read=both", "logpos_read"),
           ("--no_such_flag=1", "no_such_flag"), ("--ignore_eos=maybe", "ignore_eos")]
    cases = [Case("flags", a, refuse([*BASE, a], cache_dir, m)) for a, m in bad]
    cases.append(Case("flags", "a positional argument", refuse([*BASE, "stray"], cache_dir, "unexpected")))
    cases.append(Case("flags", "--context=2000000000 (KV cache too large)",
                      refuse([*BASE, "--context=2000000000"], cache_dir, "")))
    return cases


def env_cases(cache_dir: Path) -> list[Case]:
    args = [*BASE, "--expert_cache_slots=8", "--pcie_frac=1"]
    bad = [({"STRATA_ROUTE_TAIL_SKIP": "abc"}, "STRATA_ROUTE_TAIL_SKIP"),
           ({"STRATA_ROUTE_TAIL_SKIP": "-1"}, "STRATA_ROUTE_TAIL_SKIP"),
           ({"STRATA_ROUTE_TAIL_SKIP": "1.5"}, "STRATA_ROUTE_TAIL_SKIP"),
           ({"STRATA_ROUTE_TAIL_SKIP": "3000000000"}, "route tail skip: R = 2147483647"),
           ({"STRATA_ROUTE_PRIOR": "-2"}, "STRATA_ROUTE_PRIOR"), ({"STRATA_ROUTE_PRIOR": "abc"}, "STRATA_ROUTE_PRIOR"),
           ({"STRATA_ROUTE_PRIOR": "nan"}, "STRATA_ROUTE_PRIOR"),
           ({"STRATA_ROUTE_PRIOR": "1", "STRATA_ROUTE_PRIOR_MODE": "sideways"}, "STRATA_ROUTE_PRIOR_MODE"),
           ({"STRATA_ROUTE_PRIOR": "1", "STRATA_ROUTE_PRIOR_KEEP": "99"}, "STRATA_ROUTE_PRIOR_KEEP"),
           ({"STRATA_ROUTE_PRIOR_MODE": "range"}, "the prior is off"),
           ({"STRATA_ROUTE_RESIDENT": "abc"}, "STRATA_ROUTE_RESIDENT"),
           ({"STRATA_ROUTE_RESIDENT": "1", "STRATA_ROUTE_RESIDENT_MARGIN": "-3"}, "STRATA_ROUTE_RESIDENT_MARGIN"),
           ({"STRATA_ROUTE_RESIDENT": "1", "STRATA_ROUTE_RESIDENT_RANK": "9"}, "STRATA_ROUTE_RESIDENT_RANK"),
           ({"STRATA_ROUTE_RESIDENT_MARGIN": "0.5"}, "the swap is off"),
           ({"STRATA_VERIFY_DEFER_CPU": "sometimes"}, "STRATA_VERIFY_DEFER_CPU"),
           ({"STRATA_VERIFY_DEFER_CPU_BELOW": "0.3"}, "STRATA_VERIFY_DEFER_CPU_BELOW"),
           ({"STRATA_DEFER_CPU": "1"}, "STRATA_DEFER_CPU: not a strata_jax switch"),
           ({"STRATA_ROUTE_PRIOR": "0.5"}, "route prior: lambda = 0.5")]  # a good value: its line, not silence
    return [Case("env", " ".join(f"{k}={v}" for k, v in env.items()), warn(args, cache_dir, env, said))
            for env, said in bad]


def file_cases(cache_dir: Path, scratch: Path) -> list[Case]:
    a_file = scratch / "a_file"
    a_file.write_text("x")
    bad_utf8 = scratch / "bad_utf8.txt"
    bad_utf8.write_bytes(b"hello \xff\xfe world")
    under_file = a_file / "state"
    return [
        Case("files", "--model missing", refuse(["--model=/no/such/model", "--prompt=hi"], cache_dir, "")),
        Case("files", "--model a file", refuse([f"--model={a_file}", "--prompt=hi"], cache_dir, "not a folder")),
        Case("files", "--prompt empty", refuse([*BASE, "--prompt="], cache_dir, "empty")),
        Case("files", "--prompt longer than the context",
             refuse([*BASE, "--prompt=" + "word " * 200], cache_dir, "context")),
        Case("files", "--prompt_file missing", refuse([*BASE, "--prompt_file=/no/such/file"], cache_dir, "")),
        Case("files", "--prompt_file a folder", refuse([*BASE, f"--prompt_file={scratch}"], cache_dir, "")),
        Case("files", "--prompt_file invalid UTF-8", refuse([*BASE, f"--prompt_file={bad_utf8}"], cache_dir, "")),
        Case("files", "--cache_dir a file", lambda: refuse(BASE, a_file, "")()),
        Case("files", "--save_state under a file", refuse([*BASE, f"--save_state={under_file}"], cache_dir, "")),
        Case("files", "--logpos a folder", refuse([*BASE, f"--logpos={scratch}"], cache_dir, "")),
        Case("files", "--logpos under a file", refuse([*BASE, f"--logpos={under_file}"], cache_dir, "")),
    ]


def checkpoint_cases(cache_dir: Path, scratch: Path) -> list[Case]:
    """Broken copies of the embedded model's folder (config.json, model.safetensors, tokenizer.json)."""
    from safetensors.numpy import load_file, save_file
    from strata_jax.io.embedded import embedded_model_dir
    src = embedded_model_dir(cache_dir)
    cases = []

    def broken(name: str, change: Callable[[Path], None], match: str = "") -> None:
        folder = scratch / ("ckpt_" + "".join(c if c.isalnum() else "_" for c in name))
        shutil.copytree(src, folder)
        change(folder)
        cases.append(Case("ckpt", name, refuse([f"--model={folder}", *BASE[:-1], "--prompt=hi"], cache_dir, match)))

    def config(edit):
        def change(folder):
            raw = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(edit(raw)))
        return change

    def tensors(edit):
        def change(folder):
            t = load_file(folder / "model.safetensors")
            edit(t)
            save_file(t, folder / "model.safetensors")
        return change

    def poison(name, value):
        def edit(t):
            a = t[name].copy()
            a.reshape(-1)[7] = value
            t[name] = a
        return edit

    broken("no config.json", lambda f: (f / "config.json").unlink(), "config.json")
    broken("config.json not JSON", lambda f: (f / "config.json").write_text("{oops"), "config.json")
    broken("config.json a list", lambda f: (f / "config.json").write_text("[1, 2]"), "config")
    broken("config.json zero heads", config(lambda r: dict(r, num_attention_heads=0)), "num_attention_heads")
    broken("config.json unknown architecture", config(lambda r: dict(r, architectures=["GPT2LMHeadModel"],
                                                                      model_type="gpt2")))
    broken("config.json hidden_size a string", config(lambda r: dict(r, hidden_size="128")), "hidden_size")
    broken("config.json top-k above experts", config(lambda r: dict(r, num_experts_per_tok=99)))
    broken("no safetensors", lambda f: (f / "model.safetensors").unlink())
    broken("safetensors truncated", lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:100_000]))
    broken("safetensors garbage header", lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64))
    broken("tensor missing", tensors(lambda t: t.pop("model.layers.1.post_attention_layernorm.weight")),
           "post_attention_layernorm")
    broken("tensor of the wrong shape", tensors(lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.weight": np.ones((3, 3), np.float32)})), "q_proj")
    broken("NaN final norm", tensors(poison("transformer.norm.weight", np.nan)), "non-finite")
    broken("+inf router row", tensors(poison("model.layers.0.mlp.gate.weight", np.inf)), "non-finite")
    broken("NaN expert", tensors(poison("model.layers.2.mlp.experts.5.down_proj.weight", np.nan)), "non-finite")
    broken("int32 expert tensor", tensors(lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.weight": np.ones(
        t["model.layers.0.mlp.experts.0.up_proj.weight"].shape, np.int32)})), "int32")
    broken("config.json a million layers", config(lambda r: dict(r, num_hidden_layers=1_000_000)),
           "num_hidden_layers")
    broken("config.json rope_theta inf", config(lambda r: dict(r, rope_theta=float("inf"))), "rope_theta")
    broken("config.json eos outside the vocabulary", config(lambda r: dict(r, eos_token_id=10**12)), "eos_token_id")

    def stray_shard(folder):  # a second file, no index, holding one of the real tensors with other values
        t = load_file(folder / "model.safetensors")
        name = "model.layers.1.mlp.gate.weight"
        save_file({name: (t[name] * 2).astype(t[name].dtype)}, folder / "zz-extra.safetensors")
    broken("a tensor in two files (no index)", stray_shard, "two files")
    broken("index weight_map a list", lambda f: (f / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": ["model.safetensors"]})), "malformed index")
    broken("no tokenizer.json, text prompt", lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json")
    broken("tokenizer.json not JSON", lambda f: (f / "tokenizer.json").write_text("{oops"), "tokenizer")
    over = scratch / "ckpt_save_state_target"
    shutil.copytree(src, over)
    cases.append(Case("ckpt", "--save_state into a model folder", refuse([*BASE, f"--save_state={over}"], cache_dir,
                                                                         "holds a model")))
    state = scratch / "state_meta"
    cases.append(Case("ckpt", "strata_state.json malformed", lambda: _state_case(cache_dir, state, "meta")))
    cases.append(Case("ckpt", "orbax data corrupt", lambda: _state_case(cache_dir, scratch / "state_data", "data")))
    return cases


def _state_case(cache_dir: Path, folder: Path, what: str) -> tuple[str, str]:
    rc, _, err = cli([*BASE, f"--save_state={folder}"], cache_dir)
    if rc != 0:
        return "traceback", "could not save a state to break: " + last_line(err)
    if what == "meta":
        (folder / "strata_state.json").write_text('{"format": ')
    else:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.name != "strata_state.json" and p.stat().st_size > 1000:
                p.write_bytes(b"\x00" * p.stat().st_size)
    return refuse([*BASE, f"--model={folder}"], cache_dir)()


def runtime_cases(cache_dir: Path) -> list[Case]:
    pool = [*BASE, "--expert_cache_slots=8", "--max_new_tokens=8"]
    return [
        Case("runtime", "pool timeout while decoding (pcie_frac=0)",
             refuse([*pool, "--pcie_frac=0", "--callback_timeout_s=0.000001"], cache_dir, "did not answer")),
        Case("runtime", "pool timeout at start-up (pcie_frac=auto)",
             refuse([*pool, "--pcie_frac=auto", "--callback_timeout_s=0.000001"], cache_dir, "start-up")),
        Case("runtime", "Ctrl-C while the pool works",
             sigint(["--prompt=hello world", "--max_new_tokens=16000", "--context=16384", "--ignore_eos",
                     "--expert_cache_slots=0", "--pcie_frac=0", "--spec=0"], cache_dir)),
    ] + [Case("runtime", f"Ctrl-C {at:g} s after the start (imports, loading, compiling)",
              sigint(["--prompt=hello world", "--max_new_tokens=3000", "--context=4096", "--ignore_eos",
                      "--expert_cache_slots=4"], cache_dir, at=at)) for at in (0.1, 0.3, 0.8, 1.5, 2.5, 4.0)]
    # (earlier than ~0.05 s the signal lands in the interpreter's own start-up, before the package's first line)


# ---- API cases (in this process) ---------------------------------------------------------------------------------

def _in_thread(fn: Callable, limit_s: float) -> dict | None:
    """fn() in a daemon thread: {'value': ...} or {'error': exception}; None when it has not ended in limit_s."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (the caller classes it)
            box["error"] = e
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit_s)
    return None if th.is_alive() else box


def _raw(e: BaseException) -> tuple[str, str]:
    return "traceback", f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"


def api_call(fn: Callable, limit_s: float) -> tuple[str, str]:
    """A refusal: StrataError of one line -> clean; another exception -> traceback; a return -> silent."""
    from strata_jax import StrataError
    box = _in_thread(fn, limit_s)
    if box is None:
        return "hang", f"no answer in {limit_s:g} s"
    e = box.get("error")
    if e is None:
        return "silent", f"returned {str(box.get('value'))[:100]}"
    if isinstance(e, StrataError) and "\n" not in str(e):
        return "clean", str(e)[:160]
    return _raw(e)


def api_check(fn: Callable[[], bool | str], limit_s: float) -> tuple[str, str]:
    """A correctness check: fn returns True (clean) or a string saying what was wrong (silent)."""
    box = _in_thread(fn, limit_s)
    if box is None:
        return "hang", f"no answer in {limit_s:g} s"
    if "error" in box:
        return _raw(box["error"])
    return ("clean", "as expected") if box["value"] is True else ("silent", str(box["value"])[:160])


def api_cases(cache_dir: Path, limit_s: float) -> list[Case]:
    from strata_jax import Engine
    engines: dict = {}

    def engine(**kw):
        key = tuple(sorted(kw.items()))
        if key not in engines:
            engines[key] = Engine.from_pretrained(None, verbose=False, cache_dir=str(cache_dir), window=4,
                                                  context=64, **kw)
        return engines[key]

    exact = dict(dtype="float32", expert_cache_slots="all")
    ids = [5, 9, 17, 33, 65]
    bad_ids = {"float ids": [1.7, 2.2], "nested ids": [[1, 2], [3]], "2-D array": np.ones((2, 3), np.int64),
               "text": "hello", "None": None, "bools": [True, False], "negative id": [1, -1],
               "id >= vocab": [1, 10_000], "id > int32": [1, 2**40], "empty": []}
    cases = [Case("api", f"generate({name})", (lambda v=v: api_call(lambda: engine(**exact).generate(v, 4), limit_s)))
             for name, v in bad_ids.items()]
    bad_kw = {"stop_token_ids=5": dict(stop_token_ids=5), "stop_token_ids=[1.5]": dict(stop_token_ids=[1.5]),
              "draft=object()": dict(draft=object()), "draft='magic'": dict(draft="magic"),
              "max_new_tokens=-1": dict(max_new_tokens=-1), "max_new_tokens=2.5": dict(max_new_tokens=2.5),
              "temperature=nan": dict(temperature=float("nan")), "top_p=0": dict(top_p=0.0),
              "top_k='3'": dict(top_k="3"), "seed=-1": dict(seed=-1), "spec=9": dict(spec=9),
              "ignore_eos='yes'": dict(ignore_eos="yes")}
    cases += [Case("api", f"generate(ids, {name})",
                   (lambda kw=kw: api_call(lambda: engine(**exact).generate(ids, **dict(dict(max_new_tokens=4), **kw)),
                                           limit_s)))
              for name, kw in bad_kw.items()]
    cases += [
        Case("api", "decode(out-of-range ids)", lambda: api_call(lambda: engine(**exact).decode([1, 10_000]), limit_s)),
        Case("api", "encode(None)", lambda: api_call(lambda: engine(**exact).encode(None), limit_s)),
        Case("api", "score(ids, window=9)", lambda: api_call(lambda: engine(**exact).score(ids, window=9), limit_s)),
        Case("api", "prompt as long as the context", lambda: api_call(lambda: engine(**exact).generate([1] * 64, 4),
                                                                      limit_s)),
        Case("api", "from_pretrained(window=0)", lambda: api_call(lambda: Engine.from_pretrained(
            None, verbose=False, cache_dir=str(cache_dir), window=0), limit_s)),
        Case("api", "from_pretrained(no_such_option=1)", lambda: api_call(lambda: Engine.from_pretrained(
            None, verbose=False, cache_dir=str(cache_dir), no_such_option=1), limit_s)),
        Case("api", "4 threads on one engine", lambda: api_check(lambda: _threads(engine(**exact)), limit_s)),
        Case("api", "generate() from inside on_token", lambda: api_call(lambda: engine(**exact).generate(
            ids, 4, on_token=lambda t: engine(**exact).generate(ids, 2)), limit_s)),
        Case("api", "list(stream()) from inside on_token", lambda: api_call(lambda: engine(**exact).generate(
            ids, 4, on_token=lambda t: list(engine(**exact).stream(ids, max_new_tokens=2))), limit_s)),
        Case("api", "reconfigure() from inside on_token", lambda: api_call(lambda: engine(**exact).generate(
            ids, 4, on_token=lambda t: engine(**exact).reconfigure(pcie_frac=0.5)), limit_s)),
        Case("api", "the engine exact after refused re-entrant calls",
             lambda: api_check(lambda: _after_reentry(engine(**exact)), limit_s)),
        Case("api", "a Drafter returning a string", lambda: api_call(lambda: engine(**exact).generate(
            ids, 4, draft=_Drafter(lambda k: "abc")), limit_s)),
        Case("api", "a Drafter returning too many drafts", lambda: api_call(lambda: engine(**exact).generate(
            ids, 4, draft=_Drafter(lambda k: [1] * (k + 3))), limit_s)),
        Case("api", "generate(ids, 4, foo=1)", lambda: api_call(lambda: engine(**exact).generate(ids, 4, foo=1),
                                                                 limit_s)),
        Case("api", "score(ids, window=2.0)", lambda: api_call(lambda: engine(**exact).score(ids, window=2.0),
                                                               limit_s)),
        Case("api", "generate(dict of ids)", lambda: api_call(lambda: engine(**exact).generate({1: 2, 3: 4}, 4),
                                                              limit_s)),
        Case("api", "bf16: a request after others (pool share 0.5)",
             lambda: api_check(lambda: _history(engine(dtype="bfloat16", expert_cache_slots=4, pcie_frac=0.5),
                                                engine(dtype="bfloat16", expert_cache_slots="all")), limit_s)),
        Case("api", "fp32: offload (slots 4, PCIe / pool / split) equals resident",
             lambda: api_check(lambda: _placement(engine, exact), limit_s)),
    ]
    return cases


class _Drafter:
    def __init__(self, propose):
        self._propose = propose

    def propose(self, tokens, k):
        return self._propose(k)

    def observe(self, accepted):
        pass


def _after_reentry(eng) -> bool | str:
    """Refused calls from on_token leave nothing behind: the next requests give the plain tokens."""
    from strata_jax import StrataError
    prompt = np.random.default_rng(79).integers(0, 255, 9).tolist()
    want = eng.generate(prompt, 10, stop_token_ids=[])

    def reenter(token):
        try:
            eng.generate(prompt[::-1], 3)
        except StrataError:
            pass
    outer = eng.generate(prompt, 10, stop_token_ids=[], on_token=reenter)
    after = [eng.generate(prompt, 10, stop_token_ids=[]) for _ in range(3)]
    return True if outer == want and all(a == want for a in after) else "other tokens after re-entrant calls"


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _threads(eng) -> bool | str:
    prompts = [np.random.default_rng(s).integers(0, 255, 9).tolist() for s in range(4)]
    want = [eng.generate(p, 12, stop_token_ids=[]) for p in prompts]
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: eng.generate(p, 12, stop_token_ids=[]), prompts))
    wrong = sum(g != w for g, w in zip(got, want))
    return True if not wrong else f"{wrong} of 4 threads got other tokens"


def _history(eng, resident) -> bool | str:
    tokens = np.random.default_rng(77).integers(0, 255, 25).tolist()
    before = eng.score(tokens, window=4)
    for s in range(3):
        eng.generate(np.random.default_rng(s).integers(0, 255, 9).tolist(), 8, stop_token_ids=[])
    after = eng.score(tokens, window=4)
    ref = resident.score(tokens, window=4)
    worst = max(_rel(after, before), _rel(after, ref))
    return True if worst <= 1e-3 else f"logits moved {worst:.1e} (relative; promise <= 1e-3)"


def _placement(engine, exact) -> bool | str:
    tokens = np.random.default_rng(78).integers(0, 255, 21).tolist()
    ref = engine(**exact).score(tokens, window=4)
    worst = max(_rel(engine(dtype="float32", expert_cache_slots=4, pcie_frac=f).score(tokens, window=4), ref)
                for f in (1.0, 0.0, 0.5))
    return True if worst <= 1e-5 else f"logits moved {worst:.1e} with placement"


# ---- the sweep ---------------------------------------------------------------------------------------------------

def main(argv):
    del argv
    from benchmarks.common import say
    from benchmarks.runner import parse_list
    only = set(parse_list(FLAGS.only, str, "only", empty_ok=True))
    scratch = Path(tempfile.mkdtemp(prefix="strata_sweep_"))
    cache_dir = Path(FLAGS.cache_dir) if FLAGS.cache_dir else scratch / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    groups = {"flags": lambda: flag_cases(cache_dir), "env": lambda: env_cases(cache_dir),
              "files": lambda: file_cases(cache_dir, scratch), "ckpt": lambda: checkpoint_cases(cache_dir, scratch),
              "runtime": lambda: runtime_cases(cache_dir), "api": lambda: api_cases(cache_dir, FLAGS.limit_s)}
    unknown = only - set(groups)
    if unknown:
        raise app.UsageError(f"--only: unknown group(s) {sorted(unknown)} (known: {', '.join(groups)})")
    # Warm the compilation cache and write the embedded model once, so the parallel CLI runs only read it.
    say("warming the compilation cache ...")
    cli(BASE, cache_dir)
    rows = []
    started = time.time()
    for group, make in groups.items():
        if only and group not in only:
            continue
        cases = make()
        say(f"{group}: {len(cases)} cases ...")
        jobs = 1 if group == "api" else FLAGS.jobs  # API cases share engines in this process
        with ThreadPoolExecutor(jobs) as ex:
            for case, (cls, said) in zip(cases, ex.map(lambda c: c.run(), cases)):
                rows.append(dict(group=case.group, case=case.name, outcome=cls, said=said))
                say(f"  {cls:9s} {case.name}: {said}")
    shutil.rmtree(scratch, ignore_errors=True)
    print()
    print("| group | case | outcome | what it said |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['group']} | {r['case']} | {r['outcome']} | {r['said'].replace('|', '/')} |")
    totals = {c: sum(r["outcome"] == c for r in rows) for c in CLASSES}
    print()
    print(f"tried {len(rows)}: " + ", ".join(f"{c} {n}" for c, n in totals.items())
          + f" ({time.time() - started:.0f} s)")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(dict(rows=rows, totals=totals), indent=1))
    return 0 if totals["clean"] == len(rows) else 1


if __name__ == "__main__":
    app.run(main)
