"""The logpos file (strata_jax/io/logpos.py) and the KL report over it (benchmarks/kl_report.py): the file round-trips
exactly, the KL is 0 for a run against itself, matches a hand computation of the documented formula, equals the
exact KL when nothing is truncated, and lands in the right position buckets; the CLI fails in one line."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import kl_report
from strata_jax.io.logpos import LogposWriter, read_logpos
from conftest import REPO


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def write(path, logits, start_pos=0, targets=None, top=20, meta=None):
    with LogposWriter(path, top=top, meta=meta) as w:
        w.write_many(start_pos, logits, targets)
    return path


def random_logits(rng, n, v, margin=0.0):
    """float32 logits; `margin` lifts each row's best entry so small perturbations keep the top-1."""
    x = rng.standard_normal((n, v)).astype(np.float32) * 2
    x[np.arange(n), x.argmax(1)] += margin
    return x


# ---- the file ------------------------------------------------------------------------------------------------


def test_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    n, v = 50, 300
    logits = random_logits(rng, n, v)
    targets = rng.integers(0, v, n)
    path = tmp_path / "a.logpos"
    with LogposWriter(path, top=20, meta={"model": "tiny", "window": 4}) as w:
        w.write_many(7, logits[:30], targets[:30])
        for i in range(30, n):  # the one-row call writes the same lines
            w.write(7 + i, logits[i], target=int(targets[i]) if i % 5 else None)
    header, rec = read_logpos(path)
    assert header == {"format": "strata-logpos", "version": 1, "top": 20,
                      "meta": {"model": "tiny", "window": 4, "vocab": v}}  # vocab filled in from the rows
    ref = log_softmax(logits)
    want_ids = np.argsort(-logits, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(rec["pos"], np.arange(7, 7 + n))
    np.testing.assert_array_equal(rec["ids"], want_ids)
    np.testing.assert_allclose(rec["logp"], np.take_along_axis(ref, want_ids, 1), rtol=0, atol=1e-12)
    known = np.array([i < 30 or i % 5 != 0 for i in range(n)])
    np.testing.assert_array_equal(rec["target"], np.where(known, targets, -1))
    np.testing.assert_allclose(rec["target_logp"][known], ref[np.arange(n), targets][known], rtol=0, atol=1e-12)
    assert np.isnan(rec["target_logp"][~known]).all()


def test_ties_lower_id_first(tmp_path):
    row = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0], np.float32)
    write(tmp_path / "t.logpos", row[None], top=4)
    _, rec = read_logpos(tmp_path / "t.logpos")
    assert rec["ids"][0].tolist() == [1, 3, 2, 4]


def test_crashed_writer_keeps_lines(tmp_path):
    path = tmp_path / "c.logpos"
    w = LogposWriter(path, top=2, meta={"vocab": 4})
    w.write(0, np.zeros(4, np.float32), target=1)
    _, rec = read_logpos(path)  # not closed: the line is already in the file
    assert rec["pos"].tolist() == [0] and rec["target_logp"][0] == pytest.approx(math.log(0.25))
    w.close()


HEADER = '{"format": "strata-logpos", "version": 1, "top": 2, "meta": {"vocab": 4}}'
GOOD = '{"pos": 0, "target": 1, "target_logp": -1.0, "ids": [1, 0], "logp": [-1.0, -2.0]}'


@pytest.mark.parametrize("lines, where, what", [
    ([HEADER, GOOD, '{"pos": 1, "ids": [1, 0], "logp": [-1.0,'], ":3:", "not JSON"),
    (['{"format": "other"}'], ":1:", "not a logpos header"),
    ([HEADER, GOOD.replace("[1, 0]", "[1]")], ":2:", "ids must be a list of 2"),
    ([HEADER, GOOD, GOOD], ":3:", "position 0 again"),
    ([HEADER, GOOD.replace("[1, 0]", "[1, 9]")], ":2:", "outside the vocab"),
    ([HEADER, GOOD.replace("[-1.0, -2.0]", "[-2.0, -1.0]")], ":2:", "best first"),
    ([HEADER, GOOD.replace('"target_logp": -1.0', '"target_logp": null')], ":2:", "both"),
])
def test_malformed(tmp_path, lines, where, what):
    path = tmp_path / "bad.logpos"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        read_logpos(path)
    msg = str(e.value)
    assert f"{path}{where}" in msg and what in msg and "\n" not in msg


def test_empty_and_missing(tmp_path):
    (tmp_path / "empty.logpos").write_text("")
    with pytest.raises(ValueError, match="empty file"):
        read_logpos(tmp_path / "empty.logpos")
    with pytest.raises(ValueError, match="no such file"):
        read_logpos(tmp_path / "nope.logpos")


# ---- the KL ----------------------------------------------------------------------------------------------------


def test_self_kl_is_zero(tmp_path):
    rng = np.random.default_rng(2)
    path = write(tmp_path / "base.logpos", random_logits(rng, 700, 64), targets=rng.integers(0, 64, 700))
    out = kl_report.report(path, {"same": path})
    same = out["rows"][1]
    assert same["positions"] == 700
    assert all(v == 0.0 for v in same["kl"].values()), same["kl"]  # exactly, in every bucket
    assert same["top1"] == 1.0
    assert same["perplexity"] == out["rows"][0]["perplexity"] > 1


def test_hand_made_pair(tmp_path):
    """top=3, V=5, one position written out: base lists ids 0,1,2 with p = .5,.3,.1 (base rest P = .1); the run
    lists 1,0,3 with q = .4,.3,.2, so its floor is (1 - .9) / (5 - 3) = .05 for the ids it did not list (2 and 4),
    and its mass outside the base's ids {0,1,2} is Q = 1 - (.3 + .4 + .05) = .25."""
    ln = math.log
    meta = {"vocab": 5}
    base = tmp_path / "base.logpos"
    run = tmp_path / "run.logpos"
    head = json.dumps({"format": "strata-logpos", "version": 1, "top": 3, "meta": meta})
    same = {"pos": 11, "target": 2, "target_logp": ln(0.1), "ids": [0, 1, 2], "logp": [ln(0.5), ln(0.3), ln(0.1)]}
    base.write_text("\n".join([
        head,
        json.dumps({"pos": 10, "target": 0, "target_logp": ln(0.5), "ids": [0, 1, 2],
                    "logp": [ln(0.5), ln(0.3), ln(0.1)]}),
        json.dumps(same)]) + "\n")
    run.write_text("\n".join([
        head,
        json.dumps({"pos": 10, "target": 0, "target_logp": ln(0.3), "ids": [1, 0, 3],
                    "logp": [ln(0.4), ln(0.3), ln(0.2)]}),
        json.dumps(same)]) + "\n")
    kl_10 = (0.5 * ln(0.5 / 0.3)      # id 0: the run lists it at .3
             + 0.3 * ln(0.3 / 0.4)    # id 1: the run lists it at .4
             + 0.1 * ln(0.1 / 0.05)   # id 2: not listed by the run, its floor .05
             + 0.1 * ln(0.1 / 0.25))  # tail: base P = .1 against run Q = .25
    assert kl_10 == pytest.approx(0.1467938, abs=1e-7)
    out = kl_report.report(base, {"run": run})
    r = out["rows"][1]
    assert r["kl"]["0-7"] == pytest.approx(kl_10 / 2, rel=1e-12)  # pos 11 is identical: KL 0
    assert r["kl"]["all"] == r["kl"]["0-7"] and r["kl"]["8-63"] is None
    assert r["top1"] == 0.5
    assert r["perplexity"] == pytest.approx(math.exp(-(ln(0.3) + ln(0.1)) / 2), rel=1e-12)
    assert out["rows"][0]["perplexity"] == pytest.approx(math.exp(-(ln(0.5) + ln(0.1)) / 2), rel=1e-12)
    _, b = read_logpos(base)
    _, q = read_logpos(run)
    kl = kl_report.position_kl(b["ids"], b["logp"], q["ids"], q["logp"], 5)
    assert kl[0] == pytest.approx(kl_10, rel=1e-12) and kl[1] == 0.0


def test_full_support_is_exact_kl(tmp_path):
    """top == V: nothing is truncated, so the formula is the exact KL of the two softmax distributions."""
    rng = np.random.default_rng(3)
    n, v = 40, 30
    a, b = random_logits(rng, n, v), random_logits(rng, n, v)
    base = write(tmp_path / "a.logpos", a, top=v)
    run = write(tmp_path / "b.logpos", b, top=v)
    la, lb = log_softmax(a), log_softmax(b)
    exact = (np.exp(la) * (la - lb)).sum(1)
    _, ra = read_logpos(base)
    _, rb = read_logpos(run)
    np.testing.assert_allclose(kl_report.position_kl(ra["ids"], ra["logp"], rb["ids"], rb["logp"], v), exact,
                               rtol=1e-10, atol=1e-13)
    r = kl_report.report(base, {"b": run})["rows"][1]
    assert r["kl"]["0-7"] == pytest.approx(exact[:8].mean(), rel=1e-10)
    assert r["kl"]["8-63"] == pytest.approx(exact[8:].mean(), rel=1e-10)
    assert r["kl"]["all"] == pytest.approx(exact.mean(), rel=1e-10)


def test_differing_run_and_buckets(tmp_path):
    """Positions 100..800 (indices 0..700): the run differs from the base only at indices 8..63, and its best id
    only at indices 10, 20, 30; a second run scored only indices 0..99."""
    rng = np.random.default_rng(4)
    n, v = 701, 64
    base_logits = random_logits(rng, n, v, margin=5.0)
    run_logits = base_logits.copy()
    run_logits[8:64] += rng.standard_normal((56, v)).astype(np.float32) * 0.3
    for i in (10, 20, 30):
        other = (int(base_logits[i].argmax()) + 1) % v
        run_logits[i, other] = run_logits[i].max() + 5
    targets = rng.integers(0, v, n)
    base = write(tmp_path / "base.logpos", base_logits, 100, targets)
    run = write(tmp_path / "run.logpos", run_logits, 100, targets)
    part = write(tmp_path / "part.logpos", run_logits[:100], 100, targets[:100])
    out = kl_report.report(base, {"run": run, "part": part})
    base_row, r, p = out["rows"]
    assert r["bucket_positions"] == {"0-7": 8, "8-63": 56, "64-639": 576, "640+": 61, "all": 701}
    assert r["kl"]["8-63"] > 0.01
    assert r["kl"]["0-7"] == r["kl"]["64-639"] == r["kl"]["640+"] == 0.0
    assert r["kl"]["all"] == pytest.approx(r["kl"]["8-63"] * 56 / 701, rel=1e-12)
    assert r["top1"] == pytest.approx(1 - 3 / 701, abs=1e-15)
    assert r["perplexity"] != base_row["perplexity"]
    assert p["positions"] == 100 and p["positions_base"] == 701
    assert p["bucket_positions"] == {"0-7": 8, "8-63": 56, "64-639": 36, "640+": 0, "all": 100}
    assert p["kl"]["640+"] is None and p["kl"]["8-63"] == pytest.approx(r["kl"]["8-63"], rel=1e-12)
    assert "| part " in out["table"] and any("part: 100 positions in common" in n for n in out["notes"])
    assert out["table"].splitlines()[4].split("|")[6].strip() == "-"  # part's empty 640+ bucket


def test_report_errors(tmp_path):
    rng = np.random.default_rng(5)
    x = random_logits(rng, 4, 32)
    base = write(tmp_path / "base.logpos", x, 0, [1, 2, 3, 4])
    cases = {
        "no position in common": write(tmp_path / "far.logpos", x, 50),
        "vocab 40, the base's is 32": write(tmp_path / "v.logpos", random_logits(rng, 4, 40)),
        "not the same text": write(tmp_path / "text.logpos", x, 0, [1, 2, 0, 4]),
    }
    for what, path in cases.items():
        with pytest.raises(ValueError, match=what):
            kl_report.report(base, {"r": path})
    novocab = tmp_path / "novocab.logpos"
    novocab.write_text(HEADER.replace('{"vocab": 4}', "{}") + "\n" + GOOD + "\n")
    with pytest.raises(ValueError, match="no vocab"):
        kl_report.report(novocab, {})


# ---- the CLI ---------------------------------------------------------------------------------------------------


def cli(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.kl_report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli(tmp_path):
    rng = np.random.default_rng(6)
    x = random_logits(rng, 70, 48)
    targets = rng.integers(0, 48, 70)
    base = write(tmp_path / "base.logpos", x, 3, targets)
    again = write(tmp_path / "again.logpos", x + np.float32(1e-3) * rng.standard_normal(x.shape, np.float32), 3,
                  targets)
    noisy = write(tmp_path / "noisy.logpos", x + rng.standard_normal(x.shape, np.float32), 3, targets)
    res = cli(f"--base={base}", f"--runs=noisy:{noisy},self:{base}", f"--base_again={again}",
              f"--json={tmp_path / 'out.json'}", f"--markdown={tmp_path / 'out.md'}")
    assert res.returncode == 0, res.stderr
    table = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == kl_report.HEADERS
    assert [ln.split("|")[1].strip() for ln in table[2:]] == ["base", "base again", "noisy", "self"]
    saved = json.loads((tmp_path / "out.json").read_text())
    rows = {r["name"]: r for r in saved["rows"]}
    assert rows["self"]["kl"]["all"] == 0 and rows["base"]["top1"] == 1.0
    assert 0 < rows["base again"]["kl"]["all"] < rows["noisy"]["kl"]["all"]
    assert rows["noisy"]["kl"]["640+"] is None and rows["noisy"]["positions"] == 70
    assert saved["table"] in (tmp_path / "out.md").read_text()


def test_cli_errors(tmp_path):
    base = write(tmp_path / "base.logpos", np.zeros((2, 24), np.float32))
    missing = tmp_path / "missing.logpos"
    for args, what in (([f"--base={base}", f"--runs=x:{missing}"], f"{missing}: no such file"),
                       ([f"--base={missing}", f"--runs=x:{base}"], f"{missing}: no such file"),
                       ([f"--base={base}"], "nothing to compare")):
        res = cli(*args)
        assert res.returncode == 1, (args, res.stderr)
        assert "Traceback" not in res.stderr and res.stdout == ""
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and what in err[0], res.stderr
