"""What every benchmark prints: progress lines on stderr, the report through say() (stdout for md; stderr when the
rows go to stdout as json or csv), Markdown tables in llama-bench's style, and JSON files of results. Imported by
runner.py and common.py; imports nothing of the benchmarks."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def progress(line: str) -> None:
    """A progress line on stderr, stamped with the seconds since the program started."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {line}", file=sys.stderr, flush=True)


def say(line: str = "") -> None:
    """A line of the report on stdout; on stderr when --output is json or csv (stdout is then only the rows)."""
    print(line, file=sys.stdout if _OUTPUT == "md" else sys.stderr, flush=True)


def set_output(fmt: str) -> None:
    """Where say() writes: stdout for md, stderr for json and csv (benchmarks.runner.emit writes the rows)."""
    global _OUTPUT
    _OUTPUT = fmt


_OUTPUT = "md"


_T0 = time.perf_counter()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (llama-bench style): text left-aligned, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows) if rows
               else False for i in range(len(headers))]
    widths = [max([3, len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) if numeric[i] else v.ljust(w)
                                 for i, (v, w) in enumerate(zip(vals, widths))) + " |"
    sep = "| " + " | ".join(("-" * (w - 1) + ":") if numeric[i] else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(headers), sep] + [line(c) for c in cells])


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 0.001:
            return f"{v:.4f}"
        return f"{v:.3g}"
    return str(v)


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy / jax scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` (dicts, lists, dataclasses, numpy/jax scalars and arrays) as indented JSON; makes parents."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=2) + "\n")
    os.replace(tmp, path)
    return path
