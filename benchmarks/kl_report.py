"""How far approximate runs drift from the exact engine: KL, top-1 agreement and perplexity from logpos files
(strata_jax/io/logpos.py), all teacher-forced over the same text.

    python -m benchmarks.kl_report --base=out/exact.logpos --runs=w4:out/w4.logpos,spec:out/spec.logpos \\
        --base_again=out/exact_2.logpos --json=out/kl.json --markdown=out/kl.md

Each run is compared with the base (the exact engine) at the positions both files scored, matched by `pos`; the
table gives how many. --base_again is a second run of the base setting: its row is the noise floor (what
nondeterminism alone gives), below which a run's drift means nothing. The base's own row is KL 0 / top-1 1.

KL(base || run) at one position, from the top-K lists. Base: ids b_1..b_K with log-probs a_i (p_i = exp a_i);
run: ids r_1..r_K' with log-probs c_j; V = meta["vocab"] (the same in every file).

    run floor     f   = max((1 - sum_j exp c_j) / (V - K'), 1e-12)       the run's unlisted mass, spread evenly
                                                                           over the V - K' ids it did not list
    run log-prob  l_i = c_j if b_i == r_j, else log f                      of each base top-K id
    tail masses   P   = max(1 - sum_i p_i, 0)                              the base outside its top-K
                  Q   = max(1 - sum_i exp l_i, 1e-12)                      the run outside the base's top-K
    KL            = max(0, sum_i p_i (a_i - l_i) + P (log P - log Q))      (tail term 0 when P = 0 or K = V)

This is the KL over K + 1 outcomes: each of the base's top-K ids, and "any other id". Written per id as in a full
sum, the tail term is P (log tail_p - log tail_q) with tail_p = P / (V - K) and tail_q = Q / (V - K): the V - K
cancels. Properties: exactly 0 when run == base (the same numbers make every term 0); >= 0 (the KL of two
distributions over K + 1 outcomes; rounding below 0 is clipped); with K = V (nothing truncated) the exact full KL;
otherwise, when the run listed every base top-K id, a lower bound of the full KL (grouping outcomes only loses
KL); a base id the run did not list gets the run's floor, an estimate.

Position buckets (columns 0-7, 8-63, 64-639, 640+): the index of a position in the text, pos - the base's first
pos; an empty bucket is "-". top-1: the share of positions where the run's best id is the base's. Perplexity:
exp(-mean target_logp) over the row's positions with a known target (the base: all its positions).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from absl import flags

from benchmarks import common, runner
from strata_jax.io.logpos import read_logpos

FLAGS = flags.FlagValues()  # our own flag set, so this module can be imported beside the others
flags.DEFINE_string("base", "", "logpos file of the exact engine (required).", flag_values=FLAGS)
flags.DEFINE_string("runs", "", "Runs to compare, comma-separated name:path (name: the table row).", flag_values=FLAGS)
flags.DEFINE_string("base_again", "", "logpos file of a second run of the base setting (the noise floor row).",
                    flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
flags.DEFINE_string("markdown", "", "Write the table (and its notes) to this Markdown file.", flag_values=FLAGS)

FLOOR = 1e-12  # smallest run probability used inside a log (a run may list no mass for the base's ids)
BUCKETS = (("0-7", 0, 8), ("8-63", 8, 64), ("64-639", 64, 640), ("640+", 640, None))
HEADERS = ["run", "positions", "KL 0-7", "8-63", "64-639", "640+", "all", "top-1", "perplexity"]
FORMULA = ("KL = max(0, sum_i p_i (a_i - l_i) + P (log P - log Q)) over the base's top-K ids i (a_i = base logp, "
           "p_i = exp a_i); l_i = run logp of id i, else log max((1 - run top-K mass) / (V - K_run), 1e-12); "
           "P = max(1 - sum p_i, 0), Q = max(1 - sum exp l_i, 1e-12); tail term 0 when P = 0 or K = V")


def position_kl(b_ids: np.ndarray, b_logp: np.ndarray, r_ids: np.ndarray, r_logp: np.ndarray,
                vocab: int) -> np.ndarray:
    """KL(base || run) per position [P] from aligned top-K rows (see the module docstring for the formula)."""
    b_logp = np.asarray(b_logp, np.float64)
    r_logp = np.asarray(r_logp, np.float64)
    n, k = b_logp.shape
    k_run = r_logp.shape[1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # 0 * log 0 terms are masked below
        if vocab > k_run:
            floor = np.maximum(1.0 - np.exp(r_logp).sum(1), 0.0) / (vocab - k_run)
        else:
            floor = np.zeros(n)
        log_floor = np.log(np.maximum(floor, FLOOR))
        match = b_ids[:, :, None] == r_ids[:, None, :]  # [P, K, K']: where the run lists each base id
        listed = match.any(2)
        l = np.where(listed, np.take_along_axis(r_logp, match.argmax(2), 1), log_floor[:, None])
        p = np.exp(b_logp)
        kl = np.where(p > 0, p * (b_logp - l), 0.0).sum(1)
        if vocab > k:
            p_rest = np.maximum(1.0 - p.sum(1), 0.0)
            q_rest = np.maximum(1.0 - np.exp(l).sum(1), FLOOR)
            kl = kl + np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return np.maximum(kl, 0.0)


def bucket_masks(index: np.ndarray) -> dict[str, np.ndarray]:
    """Bucket label -> mask over `index` (a position's index in the text), plus "all"."""
    out = {label: (index >= lo) & (index < hi if hi is not None else True) for label, lo, hi in BUCKETS}
    out["all"] = np.ones(index.shape, bool)
    return out


def perplexity(target_logp: np.ndarray) -> float | None:
    known = target_logp[~np.isnan(target_logp)]
    return float(math.exp(-known.mean())) if known.size else None


def _load(path: str | Path, role: str) -> tuple[dict, dict, int]:
    header, rec = read_logpos(path)
    vocab = header["meta"].get("vocab")
    if vocab is None:
        raise ValueError(f"{path}: the header meta has no vocab (V is needed for the KL floor) [{role}]")
    return header, rec, vocab


def _row(name: str, kind: str, path, base: dict, run: dict, vocab: int, first_pos: int) -> dict:
    """One table row: `run` against `base` at the positions both scored."""
    common_pos, bi, ri = np.intersect1d(base["pos"], run["pos"], assume_unique=True, return_indices=True)
    if common_pos.size == 0:
        raise ValueError(f"{name} ({path}): no position in common with the base")
    bt, rt = base["target"][bi], run["target"][ri]
    differ = (bt >= 0) & (rt >= 0) & (bt != rt)
    if differ.any():
        raise ValueError(f"{name} ({path}): target differs from the base at {int(differ.sum())} of "
                         f"{common_pos.size} positions (first at pos {int(common_pos[differ][0])}): not the same text")
    kl = position_kl(base["ids"][bi], base["logp"][bi], run["ids"][ri], run["logp"][ri], vocab)
    masks = bucket_masks(common_pos - first_pos)
    return dict(name=name, kind=kind, path=str(path), positions=int(common_pos.size),
                positions_run=int(run["pos"].size), positions_base=int(base["pos"].size),
                kl={label: float(kl[m].mean()) if m.any() else None for label, m in masks.items()},
                bucket_positions={label: int(m.sum()) for label, m in masks.items()},
                top1=float((run["ids"][ri, 0] == base["ids"][bi, 0]).mean()),
                perplexity=perplexity(run["target_logp"][ri]),
                perplexity_base_same_positions=perplexity(base["target_logp"][bi]))


def report(base_path: str | Path, runs: dict[str, str | Path], base_again: str | Path | None = None) -> dict:
    """Compare each run (name -> logpos path) and `base_again` with the base; returns the rows, the Markdown
    table and notes. Bad input (missing or malformed file, different vocab, nothing in common) raises ValueError
    with one line."""
    header, base, vocab = _load(base_path, "base")
    if base["pos"].size == 0:
        raise ValueError(f"{base_path}: no scored position")
    first_pos = int(base["pos"].min())
    masks = bucket_masks(base["pos"] - first_pos)
    rows = [dict(name="base", kind="base", path=str(base_path), positions=int(base["pos"].size),
                 positions_run=int(base["pos"].size), positions_base=int(base["pos"].size),
                 kl={label: 0.0 if m.any() else None for label, m in masks.items()},
                 bucket_positions={label: int(m.sum()) for label, m in masks.items()},
                 top1=1.0, perplexity=perplexity(base["target_logp"]),
                 perplexity_base_same_positions=perplexity(base["target_logp"]))]
    named = ([("base again", "base_again", base_again)] if base_again else []) + \
        [(name, "run", path) for name, path in runs.items()]
    metas = {}
    for name, kind, path in named:
        run_header, run, run_vocab = _load(path, name)
        if run_vocab != vocab:
            raise ValueError(f"{name} ({path}): vocab {run_vocab}, the base's is {vocab}")
        rows.append(_row(name, kind, path, base, run, vocab, first_pos))
        metas[name] = run_header["meta"]
    table = common.format_table(HEADERS, [_table_row(r) for r in rows])
    notes = [f"base: {base_path} ({base['pos'].size} positions from pos {first_pos}, V={vocab}, "
             f"top-{header['top']}); KL(base || run) in nats, mean over the positions of each bucket "
             f"(index in the text = pos - {first_pos})"]
    for r in rows[1:]:
        if r["positions"] != r["positions_base"] or r["positions"] != r["positions_run"]:
            notes.append(f"{r['name']}: {r['positions']} positions in common (base {r['positions_base']}, "
                         f"run {r['positions_run']})")
    notes.append(f"KL formula: {FORMULA}")
    return dict(benchmark="kl_report", base=str(base_path), vocab=vocab, top=header["top"], first_pos=first_pos,
                base_meta=header["meta"], run_meta=metas, formula=FORMULA,
                buckets=[label for label, _, _ in BUCKETS] + ["all"], rows=rows, table=table, notes=notes)


def _table_row(r: dict) -> list:
    def num(v):
        return "-" if v is None else v
    kl = [num(r["kl"][label]) for label, _, _ in BUCKETS] + [num(r["kl"]["all"])]
    return [r["name"], r["positions"], *kl, r["top1"], num(r["perplexity"])]


def parse_runs(text: str) -> dict[str, str]:
    """'a:x.logpos,b:y.logpos' -> {'a': 'x.logpos', 'b': 'y.logpos'} (a path may itself hold ':')."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, path = part.partition(":")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--runs: {part!r} is not name:path")
        if name.strip() in out:
            raise ValueError(f"--runs: the name {name.strip()!r} twice")
        out[name.strip()] = path.strip()
    return out


def run(s) -> dict:
    """The report for settings `s` (the parsed FLAGS or any object with the same attributes)."""
    if not s.base:
        raise ValueError("--base is required")
    runs = parse_runs(s.runs)
    if not runs and not s.base_again:
        raise ValueError("nothing to compare: give --runs=name:path,... and/or --base_again")
    result = report(s.base, runs, s.base_again or None)
    runner.emit(runner.rows_from_table("kl_report", HEADERS, [_table_row(r) for r in result["rows"]],
                                       params=HEADERS[:1], timing="no timing: KL / top-1 / perplexity of logpos files",
                                       units={h: "nats" for h in HEADERS[2:7]}),
                getattr(s, "output", "md"), table=result["table"], result=result)
    common.say()
    for line in result["notes"]:
        common.say(line)
    try:
        if s.json:
            common.write_json(s.json, result)
            common.say(f"json: {s.json}")
        if s.markdown:
            Path(s.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(s.markdown).write_text(result["table"] + "\n\n" + "\n".join(f"- {n}" for n in result["notes"])
                                        + "\n")
            common.say(f"markdown: {s.markdown}")
    except OSError as e:
        raise ValueError(f"cannot write the output: {e}") from None
    return result


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.kl_report", run)


if __name__ == "__main__":
    main(sys.argv)
