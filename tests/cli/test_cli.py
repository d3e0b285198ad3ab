"""`python -m strata_jax.decode`: the printed continuation and summary, and one-line refusals (no traceback).

Every run is a subprocess that imports JAX and maybe compiles, so the runs are few, share the session's
compilation cache, and the refusals run a few at a time in parallel."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import HF_FIXTURES, REPO, run_cli, stderr_until
from strata_jax.io.embedded import embedded_model_dir

SUMMARY = re.compile(r"prompt tokens: (\d+), prefill: [\d.]+ tok/s, generated tokens: 8, decode: [\d.]+ tok/s")


cli = run_cli


def prompt_text(seed, n):
    """Random words of ASCII letters with some non-ASCII characters (multi-byte in UTF-8)."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz") + ["é", "ß", "λ", "ж", "字"]
    words = ["".join(rng.choice(alphabet, rng.integers(1, 7))) for _ in range(n)]
    return " ".join(words)


PROMPT = prompt_text(31, 4)
LONG_PROMPT = prompt_text(32, 6)  # well over 8 bytes

REFUSALS = {  # case: (args, what the error line must name)
    "window=0": (["--window=0"], "window"),
    "window=abc": (["--window=abc"], "window"),
    "temperature=-1": (["--temperature=-1"], "temperature"),
    "no model": (["--model=/nonexistent"], "/nonexistent"),
    "no prompt_file": (["--prompt_file=/nonexistent"], "/nonexistent"),
    "endless prompt_file": (["--prompt_file=/dev/zero"], "/dev/zero"),  # read with a bound
    "unknown flag": (["--no_such_flag=1"], "no_such_flag"),
    "positional": (["stray"], "stray"),
    "save_state over a model": ([f"--save_state={HF_FIXTURES / 'base'}"], "holds a model or a saved state"),
    "prompt too long": (["--context=8", "--window=1", "--expert_cache_slots=all", f"--prompt={LONG_PROMPT}"],
                        "context"),
}


@pytest.fixture(scope="module")
def refusals(cache_dir):
    embedded_model_dir(cache_dir)  # written once here, not raced by parallel first uses
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case: pool.submit(cli, args, cache_dir) for case, (args, _) in REFUSALS.items()}
        return {case: f.result() for case, f in futures.items()}


@pytest.fixture(scope="module")
def success(cache_dir):
    # the embedded_engine fixture's options (float32, all experts resident, 64-token context): the same graphs
    # (compiled once) and the same output
    return cli(["--max_new_tokens=8", "--window=2", "--dtype=float32", "--context=64", "--expert_cache_slots=all",
                f"--prompt={PROMPT}"], cache_dir)


def test_decode_prints_continuation_and_summary(success, embedded_engine):
    err = success.stderr.decode("utf-8", "replace")
    assert success.returncode == 0, err
    assert "Traceback" not in err
    out = success.stdout.decode("utf-8")
    # stdout is the text alone (prompt, continuation, a newline); the summary is one line on stderr
    found = list(re.finditer(f"^{SUMMARY.pattern}$", err, re.MULTILINE))
    assert len(found) == 1, err
    m = found[0]
    assert out.endswith("\n") and not SUMMARY.search(out)
    text = out[:-1]
    assert int(m.group(1)) == len(PROMPT.encode("utf-8"))  # byte-level tokenizer: one token per byte
    assert text.startswith(PROMPT)
    # the same continuation as the API on the same model and options
    new = embedded_engine.generate(embedded_engine.encode(PROMPT), 8)
    assert len(new) == 8, "the prompt's greedy continuation meets <|endoftext|>: pick another prompt"
    assert text == PROMPT + embedded_engine.decode(new)


def test_a_budget_cut_by_the_context_is_said_even_under_quiet(cache_dir):
    res = cli(["--max_new_tokens=100", "--window=2", "--dtype=float32", "--context=64", "--expert_cache_slots=all",
               "--ignore_eos", "--quiet", f"--prompt={PROMPT}"], cache_dir)
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 0, err
    n = 64 - len(PROMPT.encode("utf-8"))  # byte-level tokenizer: one token per byte
    assert err.splitlines() == [f"warning: stopped at the end of the context (64 tokens): {n} of max_new_tokens=100 "
                                "generated"], err


def test_a_damaged_compilation_cache_is_one_note_and_nothing_under_quiet(tmp_path):
    """Every entry of the persistent cache truncated: the graphs are compiled again, the text is the same, and JAX's
    per-entry UserWarnings (nine of them) become one note line, none under --quiet."""
    args = ["--max_new_tokens=4", "--window=1", "--dtype=float32", "--context=64", "--expert_cache_slots=all",
            f"--prompt={PROMPT}"]
    first = cli(args, tmp_path)
    assert first.returncode == 0, first.stderr.decode(errors="replace")
    entries = [f for f in (tmp_path / "jax").rglob("*") if f.is_file()]
    assert entries
    for f in entries:
        f.write_bytes(f.read_bytes()[:20])
    for quiet in (True, False):
        res = cli(args + (["--quiet"] if quiet else []), tmp_path)
        err = res.stderr.decode(errors="replace")
        assert res.returncode == 0 and res.stdout == first.stdout, err
        assert "Warning" not in err and "Traceback" not in err, err
        notes = [ln for ln in err.splitlines() if ln.startswith("note: the compilation cache")]
        assert (notes == []) if quiet else (len(notes) == 1), err
        if quiet:
            assert err == "", err
        for f in entries:  # damaged again for the second run (the first rewrote them)
            if f.exists():
                f.write_bytes(f.read_bytes()[:20])


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_error_line(refusals, case):
    result, culprit = refusals[case], REFUSALS[case][1]
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode != 0
    assert "Traceback" not in err
    assert result.stdout == b""
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert culprit in errors[0], errors[0]
    if case != "prompt too long":
        # refused before the model loads: the error is all there is on stderr. (A too-long prompt is found after
        # the engine is built, so the loading/compile progress lines come first.)
        assert lines == errors, err


def test_switches_print_their_lines_and_logpos_writes_the_prompt(cache_dir, tmp_path):
    """STRATA_* switches: a start-up line each (a bad value is a line, not an error), the cumulative counter line
    after the request; --logpos writes every prompt position."""
    from strata_jax.io.logpos import read_logpos
    path = tmp_path / "run.jsonl"
    env = {"STRATA_ROUTE_TAIL_SKIP": "2", "STRATA_ROUTE_PRIOR": "much", "STRATA_VERIFY_DEFER_CPU_BELOW": "0.2"}
    result = cli(["--max_new_tokens=8", "--dtype=float32", "--context=64", "--expert_cache_slots=4",
                  "--pcie_frac=1", f"--prompt={PROMPT}", f"--logpos={path}"], cache_dir, env=env)
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 0 and "Traceback" not in err, err
    assert "route tail skip: R = 2" in err
    assert "STRATA_ROUTE_PRIOR=much is not a number >= 0; prior off" in err
    assert "STRATA_VERIFY_DEFER_CPU_BELOW=0.2: ignored (STRATA_VERIFY_DEFER_CPU is off)" in err
    assert re.search(r"^route tail skip: \d+ missed experts skipped \(\d+ entries\) since the start$", err, re.M), err
    header, records = read_logpos(path)
    n = len(PROMPT.encode("utf-8"))
    assert header["meta"]["read"] == "windows" and header["meta"]["route"]["tail_skip"] == 2
    assert list(records["pos"]) == list(range(n - 1)) and (records["target_logp"] <= 0).all()



def test_ctrl_c_at_any_moment_of_start_up_exits_130_quietly(cache_dir):
    """SIGINT during the imports, the engine's build and its compile (0.1 to 4 s after the start, runs side by
    side): always exit 130, no traceback, no "Exception ignored" (one that landed in XLA's gc callback during a
    compile was dropped, and the run went on to decode every token)."""
    import signal
    import time
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, PYTHONIOENCODING="utf-8")
    procs = []
    for delay in (0.1, 0.6, 1.5, 2.5, 4.0):
        procs.append((delay, subprocess.Popen(
            [sys.executable, "-m", "strata_jax.decode", "--model=embedded", "--prompt=hello world",
             "--max_new_tokens=3000", "--context=4096", "--ignore_eos", "--window=3", "--expert_cache_slots=4",
             f"--cache_dir={cache_dir}"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))))
    t0 = time.time()
    for delay, proc in procs:
        time.sleep(max(0.0, t0 + delay - time.time()))
        proc.send_signal(signal.SIGINT)
    for delay, proc in procs:
        out, err = proc.communicate(timeout=60)
        err = err.decode(errors="replace")
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert "Traceback" not in err and "Exception ignored" not in err, (delay, err[-2000:])


def test_ctrl_c_while_the_host_pool_works_exits_130_quietly(cache_dir):
    """SIGINT while the host pool computes every expert (pcie_frac=0): exit 130, no traceback. --ignore_eos keeps
    the run going for seconds (without it the tiny model meets its eos within a second and a late signal found an
    exited process). An interrupt that lands inside the io_callback comes back wrapped in JAX's error:
    test_api_inputs raises one there directly. (A run that inherits SIGINT ignored, as a background job does, keeps
    ignoring it: the Unix convention; the two clean-clone failures of this test were that.)"""
    import signal
    import time
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "strata_jax.decode", "--model=embedded", "--prompt=hello world",
                             "--max_new_tokens=16000", "--context=16384", "--ignore_eos", "--expert_cache_slots=0",
                             "--pcie_frac=0", "--spec=0", f"--cache_dir={cache_dir}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # As from a terminal: a suite started in the background (`make test &`, CI) hands its
                            # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = stderr_until(proc, b"graphs:")
    time.sleep(1.0)
    assert proc.poll() is None, err.decode(errors="replace")  # still decoding when interrupted
    proc.send_signal(signal.SIGINT)
    try:
        out, rest = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # stuck: its threads' stacks (the CLI dumps them on SIGUSR1), then fail
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        proc.kill()
        out, rest = proc.communicate()
        raise AssertionError("no exit within 60 s of SIGINT; stacks:\n" + rest.decode(errors="replace")[-6000:])
    err += rest
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode(errors="replace")[-3000:]
    assert b"generated tokens" not in out  # stopped, not finished


INSTALLED_CHECK = """
import sys
from pathlib import Path
import importlib.util
import strata_jax, strata_jax.host_pool, strata_jax.pallas_kernels.expert_ffn
from strata_jax.host_pool import native
from strata_jax import Engine, serve
from strata_jax.model.config import preset
from strata_jax.io.embedded import REFERENCE_DIR
here = Path.cwd()
for module in (strata_jax, strata_jax.host_pool, strata_jax.pallas_kernels):  # installed, not the repository's
    assert "site-packages" in module.__file__, module.__file__
package = Path(strata_jax.__file__).parent
assert Path(strata_jax.host_pool.__file__).parent == package / "host_pool", strata_jax.host_pool.__file__
assert strata_jax.__path__ == [str(package)], strata_jax.__path__  # the repository's mapping stays off
for name in ("host_pool", "pallas_kernels"):  # no generic top-level packages
    assert importlib.util.find_spec(name) is None and name not in sys.modules, name
assert preset("tiny").num_experts > 0 and preset("qwen3-30b-a3b").num_layers == 48
assert native.SOURCE.is_file() and native.EXPERTS_SOURCE.is_file() and native.FFI_SOURCE.is_file()
assert serve.PAGE.is_file() and (REFERENCE_DIR / "config.json").is_file()
engine = Engine.from_pretrained(None, window=1, dtype="float32", expert_cache_slots=8, pcie_frac=0.5,
                                compile_graphs="lazy", verbose=False)  # the README's example, embedded model
out = engine.generate(engine.encode("The quick brown fox"), max_new_tokens=3, temperature=0.7, seed=1)
assert len(out) == 3, out
print("ok", engine.decode(out).encode("unicode_escape").decode())
"""


def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path):
    """`pip install` of the built wheel (not -e) into a fresh environment, then, from another folder: the presets,
    the C sources, the chat page and the reference models are in the package, host_pool and pallas_kernels too (as
    strata_jax.host_pool / strata_jax.pallas_kernels, no top-level folder of theirs), the README's API example
    decodes, and both console scripts answer --help. Offline: the wheel builds with the pinned setuptools (no build isolation),
    installs with no dependencies into a venv that sees this one's packages (a .pth file)."""
    import sys
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("STRATA_")}
    import shutil  # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    source = tmp_path / "source"
    for part in ("strata_jax", "host_pool", "pallas_kernels", "configs"):
        shutil.copytree(REPO / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for part in ("pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy(REPO / part, source / part)
    build = subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("strata_jax-*.whl"))
    import zipfile  # host_pool/ and pallas_kernels/ inside the package, under its name; no other top-level folder
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"strata_jax"}, names
    for name in ("host_pool/native_ffi.cc", "host_pool/native_experts.c", "pallas_kernels/expert_ffn.py"):
        assert "strata_jax/" + name in names, name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    import site  # the new venv sees this one's packages (the dependencies) through a .pth file, after its own
    inner = next((venv / "lib").glob("python3*/site-packages"))
    (inner / "outer_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index",
                              str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    for name in ("host_pool", "pallas_kernels"):
        assert not (inner / name).exists() and (inner / "strata_jax" / name / "__init__.py").is_file(), name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([str(venv / "bin" / "python"), "-c", INSTALLED_CHECK], capture_output=True, text=True,
                         timeout=600, cwd=elsewhere, env=env)
    assert run.returncode == 0 and run.stdout.startswith("ok "), (run.stdout + run.stderr)[-3000:]
    for script in ("strata-decode", "strata-serve"):
        shown = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True, timeout=120,
                               cwd=elsewhere, env=env)
        assert shown.returncode == 0 and "--expert_cache_slots" in shown.stdout, (script, shown.stderr[-2000:])


REPO_CHECK = """
import sys
from pathlib import Path
import strata_jax.host_pool, strata_jax.pallas_kernels.expert_ffn
from strata_jax.offload import placement
repo = Path.cwd()
assert Path(strata_jax.host_pool.__file__) == repo / "host_pool" / "__init__.py", strata_jax.host_pool.__file__
assert Path(strata_jax.pallas_kernels.__file__) == repo / "pallas_kernels" / "__init__.py"
assert placement.native is sys.modules["strata_jax.host_pool.native"]  # one copy of the pool's module state
assert not {"host_pool", "pallas_kernels"} & set(sys.modules), sorted(sys.modules)
print("ok")
"""


def test_from_the_repository_the_sibling_folders_are_the_packages_modules():
    """Not installed (`make test`, `make run`: the repository root on sys.path): strata_jax.host_pool and
    strata_jax.pallas_kernels are the root's host_pool/ and pallas_kernels/ (strata_jax/__init__.py), imported once,
    never also as top-level modules; `python -m strata_jax.host_pool.measure` runs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("STRATA_")}
    run = subprocess.run([sys.executable, "-c", REPO_CHECK], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.stdout + run.stderr)[-3000:]
    shown = subprocess.run([sys.executable, "-m", "strata_jax.host_pool.measure", "--help"], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env=env)
    assert shown.returncode == 0 and "--formats" in shown.stdout, shown.stderr[-2000:]
    assert not {"host_pool", "pallas_kernels"} & set(sys.modules)  # this test process too
