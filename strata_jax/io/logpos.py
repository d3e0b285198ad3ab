"""The teacher-forced log-prob file ("logpos"): for every scored position, the top-K next-token log-probs of the
full distribution and the log-prob of the known next token. An engine writes one while a request runs;
benchmarks/kl_report.py reads two and measures how far an approximate run drifts from the exact one.

Format: JSON Lines, UTF-8.

    line 1  {"format": "strata-logpos", "version": 1, "top": K, "meta": {...}}
    then    {"pos": P, "target": T or null, "target_logp": L or null, "ids": [K ints], "logp": [K floats]}

`meta` is free (model, window, options and environment of the run), except that kl_report needs meta["vocab"] (V);
the writer fills it in from the first logits row when it is not given. One record per scored position: `pos` is
the absolute position whose NEXT token is predicted, `target` the known next token when the text is known (teacher
forcing) and `target_logp` its log-prob under the full distribution, `ids`/`logp` the K best ids, best first (ties:
the lower id first). Log-probs are log_softmax over all V logits computed in float64 and written with repr
precision, so a float64 round-trips exactly. Each write is flushed: a crashed run keeps every position it scored.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "strata-logpos"
VERSION = 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis in float64 (the logits are converted first: float32 sums lose ~1e-7)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries of a 1-D row, best first, ties broken by the lower id; O(V) plus a sort of the few
    entries at or above the k-th value (argpartition alone would pick among ties at the boundary arbitrarily)."""
    kth = np.partition(row, row.size - k)[row.size - k]
    cand = np.flatnonzero(row >= kth)
    return cand[np.lexsort((cand, -row[cand]))[:k]]


class LogposWriter:
    """Writes a logpos file as positions are scored. `meta` is stored in the header; without meta["vocab"] the
    header waits for the first row, whose length gives it (so a file always states its vocabulary)."""

    def __init__(self, path: str | Path, top: int = 20, meta: dict[str, Any] | None = None):
        if not isinstance(top, int) or top < 1:
            raise ValueError(f"logpos top must be a positive integer, not {top!r}")
        meta = dict(meta or {})
        if "vocab" in meta and (not isinstance(meta["vocab"], int) or meta["vocab"] < top):
            raise ValueError(f"logpos meta vocab must be an integer >= top ({top}), not {meta['vocab']!r}")
        self.path, self.top, self.meta = Path(path), top, meta
        self.vocab: int | None = meta.get("vocab")
        try:
            self._file = open(self.path, "w", encoding="utf-8")
        except OSError as e:
            from strata_jax.errors import StrataError
            raise StrataError(f"cannot write the logpos file {self.path}: {e.strerror or e}") from None
        self._header_written = False
        if self.vocab is not None:
            self._write_header()

    def _write_header(self) -> None:
        header = {"format": FORMAT, "version": VERSION, "top": self.top, "meta": self.meta}
        # default=str: meta is free-form (paths, option objects), the header must not refuse it.
        self._file.write(json.dumps(header, default=str) + "\n")
        self._file.flush()
        self._header_written = True

    def _record(self, pos: int, logits_row: np.ndarray, target: int | None) -> str:
        row = np.asarray(logits_row)
        if row.ndim != 1:
            raise ValueError(f"logpos write: logits row must be 1-D, got shape {row.shape}")
        if self.vocab is None:
            if row.size < self.top:
                raise ValueError(f"logpos write: {row.size} logits, fewer than top={self.top}")
            self.vocab = self.meta["vocab"] = int(row.size)
        if row.size != self.vocab:
            raise ValueError(f"logpos write: {row.size} logits, the file's vocab is {self.vocab}")
        if np.isnan(row).any() or np.isposinf(row).any() or np.isneginf(row).all():
            raise ValueError(f"logpos write: position {pos}: logits hold NaN or +inf, or are all -inf")
        logp = log_softmax(row)
        ids = top_ids(logp, self.top)
        rec: dict[str, Any] = {"pos": int(pos), "target": None, "target_logp": None}
        if target is not None:
            target = int(target)
            if not 0 <= target < self.vocab:
                raise ValueError(f"logpos write: position {pos}: target {target} outside the vocab [0, {self.vocab})")
            rec["target"], rec["target_logp"] = target, float(logp[target])
        rec["ids"] = ids.tolist()
        rec["logp"] = [float(v) for v in logp[ids]]
        return json.dumps(rec, separators=(",", ":")) + "\n"

    def write(self, pos: int, logits_row: np.ndarray, target: int | None = None) -> None:
        """One scored position: `logits_row` [V] are the logits predicting the token after `pos`."""
        line = self._record(pos, logits_row, target)
        if not self._header_written:
            self._write_header()
        self._file.write(line)
        self._file.flush()  # to the OS, not fsync: enough for a crashed process to leave its lines behind

    def write_many(self, start_pos: int, logits: np.ndarray, targets=None) -> None:
        """Rows of `logits` [N, V] for positions start_pos .. start_pos + N - 1; `targets` [N] or None. Row by row
        (a float64 copy of [N, V] at once could be gigabytes), flushed once."""
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logpos write_many: logits must be [N, V], got shape {logits.shape}")
        if targets is not None and len(targets) != logits.shape[0]:
            raise ValueError(f"logpos write_many: {len(targets)} targets for {logits.shape[0]} rows")
        lines = [self._record(start_pos + i, logits[i], None if targets is None else targets[i])
                 for i in range(logits.shape[0])]
        if not self._header_written:
            self._write_header()
        self._file.write("".join(lines))
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        if not self._header_written:  # no row came: still a valid (empty) file
            self._write_header()
        self._file.close()

    def __enter__(self) -> "LogposWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_logpos(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, records) of a logpos file; records in file order: pos [P] int64, target [P] int64 (-1 where
    null), target_logp [P] float64 (nan where null), ids [P, top] int64, logp [P, top] float64. Anything
    malformed raises ValueError with one line naming the file and line number."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {type(e).__name__}: {getattr(e, 'strerror', None) or e}") from None

    def bad(lineno: int, msg: str) -> ValueError:
        return ValueError(f"{path}:{lineno}: {msg}")

    lines = text.split("\n")
    header, top, vocab = None, 0, None
    pos, target, target_logp, ids, logp = [], [], [], [], []
    seen: dict[int, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(lineno, f"not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise bad(lineno, f"expected a JSON object, got {type(obj).__name__}")
        if header is None:
            if obj.get("format") != FORMAT:
                raise bad(lineno, f"not a logpos header (format {obj.get('format')!r}, expected {FORMAT!r})")
            if obj.get("version") != VERSION:
                raise bad(lineno, f"unsupported logpos version {obj.get('version')!r} (this reader: {VERSION})")
            top = obj.get("top")
            if not _is_int(top) or top < 1:
                raise bad(lineno, f"header top must be a positive integer, not {top!r}")
            if not isinstance(obj.get("meta"), dict):
                raise bad(lineno, "header meta must be an object")
            vocab = obj["meta"].get("vocab")
            if vocab is not None and (not _is_int(vocab) or vocab < top):
                raise bad(lineno, f"header meta vocab must be an integer >= top ({top}), not {vocab!r}")
            header = obj
            continue
        p, t, tl, i, lp = (obj.get(k) for k in ("pos", "target", "target_logp", "ids", "logp"))
        if not _is_int(p) or p < 0:
            raise bad(lineno, f"pos must be a non-negative integer, not {p!r}")
        if p in seen:
            raise bad(lineno, f"position {p} again (first on line {seen[p]})")
        seen[p] = lineno
        if (t is None) != (tl is None):
            raise bad(lineno, "target and target_logp must both be given or both null")
        if t is not None and (not _is_int(t) or t < 0 or (vocab is not None and t >= vocab)):
            raise bad(lineno, f"target must be a token id in the vocab, not {t!r}")
        if tl is not None and not _is_num(tl):
            raise bad(lineno, f"target_logp must be a number, not {tl!r}")
        if not isinstance(i, list) or len(i) != top or not all(_is_int(v) and v >= 0 for v in i):
            raise bad(lineno, f"ids must be a list of {top} token ids")
        if vocab is not None and max(i) >= vocab:
            raise bad(lineno, f"ids hold {max(i)}, outside the vocab [0, {vocab})")
        if len(set(i)) != top:
            raise bad(lineno, "ids repeat a token id")
        if not isinstance(lp, list) or len(lp) != top or not all(_is_num(v) for v in lp):
            raise bad(lineno, f"logp must be a list of {top} numbers")
        if any(math.isnan(v) or v > 1e-9 for v in lp) or any(a < b for a, b in zip(lp, lp[1:])):
            raise bad(lineno, "logp must be log-probs (<= 0), best first")
        pos.append(p)
        target.append(-1 if t is None else t)
        target_logp.append(math.nan if tl is None else float(tl))
        ids.append(i)
        logp.append(lp)
    if header is None:
        raise ValueError(f"{path}: empty file (no logpos header)")
    records = dict(pos=np.asarray(pos, np.int64), target=np.asarray(target, np.int64),
                   target_logp=np.asarray(target_logp, np.float64),
                   ids=np.asarray(ids, np.int64).reshape(len(ids), top),
                   logp=np.asarray(logp, np.float64).reshape(len(logp), top))
    return header, records
