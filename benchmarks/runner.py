"""One runner and one row schema for every benchmark (in the spirit of llama-bench: every parameter a list, the
cartesian product of the lists run in order, one row per point, printed as md, json or csv).

- parse_list: every comma list a benchmark takes ('1,2,4', '1,0.5,auto', 'xla,pallas'), one parser and one wording
  of its errors (a ValueError naming the flag: the entry prints it as one `error:` line);
- Row: the schema of a result row: the benchmark's name, the row's parameters, its measured values, each value's
  unit, and what the timing covers;
- grid / sweep: the points of the cartesian product of list parameters, and the rows of a function run at each;
- define_output_flag / emit / render: `--output=md|json|csv` (md, the benchmark's own table, by default), on stdout;
  with json or csv the start-up and note lines go to stderr, so stdout is only the rows. A benchmark's --json file
  keeps its own keys and adds `bench_rows` (the rows in this schema).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import itertools
import json
import math
import re
import signal
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from absl import flags

from benchmarks.tables import _jsonable, format_table

OUTPUTS = ("md", "json", "csv")


# ---- lists -------------------------------------------------------------------------------------------------------

_KIND_TEXT = {int: "an integer", float: "a number", str: "a name"}


def parse_list(text: str, kind: type | Callable[[str], Any] = int, name: str = "list", *, words: Sequence[str] = (),
               lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               choices: Sequence[str] | None = None, unique: bool = True, empty_ok: bool = False,
               what: str | None = None) -> list:
    """'1,2,4' -> [1, 2, 4]: a comma list of `kind` (int, float, str or any converter raising ValueError), blanks
    skipped, in the given order, deduplicated unless `unique=False`. `words` pass through as they are (e.g. 'auto',
    'all'); numbers must lie in [lo, hi] ((lo, hi] with lo_open); strings must be one of `choices` when given. A bad
    entry or an empty list is a ValueError naming --name (`what`: how its message names a good entry)."""
    what = what or _KIND_TEXT.get(kind, f"a {getattr(kind, '__name__', 'value')}")
    if words:
        what += " or " + " or ".join(words)
    out: list = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in words:
            v: Any = part
        else:
            try:
                v = kind(part)
            except (TypeError, ValueError):
                raise ValueError(f"--{name}: {part!r} is not {what}") from None
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"--{name}: {part!r} is not a finite number")
                low_bad = lo is not None and (v <= lo if lo_open else v < lo)
                if low_bad or (hi is not None and v > hi):
                    if hi is None and lo == (0 if lo_open else 1) and kind is int:
                        raise ValueError(f"--{name}: {v} must be positive")
                    lo_text = "-inf" if lo is None else f"{lo:g}"
                    hi_text = "inf" if hi is None else f"{hi:g}"
                    raise ValueError(f"--{name}: {v:g} must be in {'(' if lo_open else '['}{lo_text}, {hi_text}]"
                                     + (f" (or {', '.join(words)})" if words else ""))
            if choices is not None and v not in choices:
                raise ValueError(f"--{name}: {part!r} is not one of {', '.join(choices)}")
        if unique and v in out:
            continue
        out.append(v)
    if not out and not empty_ok:
        raise ValueError(f"--{name} is empty")
    return out


def int_list(text: str, name: str = "list") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (positive, deduplicated, in the given order)."""
    return parse_list(text, int, name, lo=1)


def name_list(text: str, name: str = "list", choices: Sequence[str] | None = None) -> list[str]:
    """'xla, pallas' -> ['xla', 'pallas']."""
    return parse_list(text, str, name, choices=choices)


# ---- rows --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One result row: `benchmark` (its module name), `params` (what the row was run with: the point of the grid and
    any fixed setting that tells rows apart), `values` (what was measured), `units` (value name -> unit, '' for a
    count or a ratio), `timing` (what the timing covers, e.g. 'synced: dispatch + device, median of 20 steps')."""
    benchmark: str
    params: dict[str, Any]
    values: dict[str, Any]
    units: dict[str, str] = dataclasses.field(default_factory=dict)
    timing: str = ""

    def to_dict(self) -> dict:
        return dict(benchmark=self.benchmark, params=dict(self.params), values=dict(self.values),
                    units={k: self.units.get(k, "") for k in self.values}, timing=self.timing)

    def flat(self) -> dict[str, Any]:
        """One level (md and csv): benchmark, the params, each value under 'name [unit]' (unit when it is not already
        in the name), timing."""
        out: dict[str, Any] = {"benchmark": self.benchmark, **self.params}
        for k, v in self.values.items():
            u = self.units.get(k, "")
            out[f"{k} [{u}]" if u and u not in k else k] = v
        out["timing"] = self.timing
        return out


def unit_of(header: str) -> str:
    """The unit a table header names: 'ms/step' -> 'ms', 'tok/s' -> 'tok/s', '% of roofline' -> '%', 'x vs HF' ->
    'x', 'GB/step' -> 'GB', 'hit rate' -> ''."""
    h = header.strip()
    if h.startswith("%") or "(%)" in h:
        return "%"
    if re.match(r"^x\b", h) or h.startswith("x "):
        return "x"
    for unit in ("tok/s", "GB/s", "GiB/s", "MB/s"):
        if unit in h:
            return unit
    m = re.search(r"\b(ms|us|s|GB|GiB|MB|MiB|kB|B)\b(?=/|\s|\)|$)", h)
    return m.group(1) if m else ""


def rows_from_table(benchmark: str, headers: Sequence[str], table_rows: Iterable[Sequence[Any]],
                    params: Sequence[str], timing: str = "", units: Mapping[str, str] | None = None,
                    fixed: Mapping[str, Any] | None = None) -> list[Row]:
    """A benchmark's table as Rows: the columns named in `params` are the row's parameters (after the settings in
    `fixed`, the same for every row: model, dtype, ...), the others its values (unit from `units`, else from the
    header: unit_of)."""
    units = dict(units or {})
    out = []
    for r in table_rows:
        cells = dict(zip(headers, r))
        out.append(Row(benchmark, {**dict(fixed or {}), **{k: cells[k] for k in params if k in cells}},
                       {k: v for k, v in cells.items() if k not in params},
                       {k: units.get(k, unit_of(k)) for k in cells if k not in params}, timing))
    return out


# ---- the runner --------------------------------------------------------------------------------------------------


def grid(params: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
    """The cartesian product of list parameters, the first parameter varying slowest: {'T': [1, 2], 'dtype': ['a']}
    -> {'T': 1, 'dtype': 'a'}, {'T': 2, 'dtype': 'a'}."""
    names = list(params)
    for values in itertools.product(*(list(params[n]) for n in names)):
        yield dict(zip(names, values))


def sweep(params: Mapping[str, Sequence[Any]], fn: Callable[..., Row | Iterable[Row] | None],
          on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """fn(**point) at every point of grid(params), in order; the rows it returns (one, several or None) collected.
    on_row (e.g. a progress line or a JSON rewrite) is called on each row as it comes."""
    rows: list[Row] = []
    for point in grid(params):
        got = fn(**point)
        for r in ([got] if isinstance(got, Row) else list(got or [])):
            rows.append(r)
            if on_row is not None:
                on_row(r)
    return rows


# ---- output ------------------------------------------------------------------------------------------------------


def define_output_flag(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_enum("output", "md", list(OUTPUTS), "The rows on stdout: md (the Markdown table), json (a list of "
                      "rows: benchmark, params, values, units, timing) or csv; with json or csv the other lines go "
                      "to stderr.", flag_values=flag_values)


def render(rows: Sequence[Row], fmt: str = "md", table: str | None = None) -> str:
    """The rows as md (`table` when the benchmark made its own, else one column per flat key), json or csv."""
    if fmt == "json":
        return json.dumps(_jsonable([r.to_dict() for r in rows]), indent=2)
    flat = [r.flat() for r in rows]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(keys)
        for f in flat:
            w.writerow(["" if f.get(k) is None else (json.dumps(f[k]) if isinstance(f[k], (dict, list)) else f[k])
                        for k in keys])
        return buf.getvalue().rstrip("\n")
    if fmt != "md":
        raise ValueError(f"--output={fmt}: must be one of {', '.join(OUTPUTS)}")
    if table is not None:
        return table
    return format_table(keys, [["-" if f.get(k) is None else f.get(k) for k in keys] for f in flat])


def emit(rows: Sequence[Row], fmt: str = "md", table: str | None = None, result: dict | None = None) -> str:
    """Print render(rows, fmt, table) on stdout; with `result`, also record the rows there (key `bench_rows`)."""
    text = render(rows, fmt, table)
    if result is not None:
        result["bench_rows"] = [r.to_dict() for r in rows]
    print(text, file=sys.__stdout__ if sys.stdout is None else sys.stdout, flush=True)
    return text


def table(s: Any, benchmark: str, headers: Sequence[str], table_rows: Sequence[Sequence[Any]],
          params: Sequence[str], timing: str = "", fixed: Mapping[str, Any] | None = None,
          units: Mapping[str, str] | None = None, result: dict | None = None) -> str:
    """A benchmark's table, printed in `s.output`'s format (md when `s` has no --output): its Markdown text (the md
    output, returned), its rows in this schema (rows_from_table) in result['bench_rows']."""
    md = format_table(headers, table_rows)
    rows = rows_from_table(benchmark, headers, table_rows, params, timing=timing, units=units, fixed=fixed)
    emit(rows, getattr(s, "output", "md"), table=md, result=result)
    return md


class Stopped(BaseException):
    """SIGTERM (a time limit): stop measuring, print what was measured."""


@contextlib.contextmanager
def sigterm_stops(result: dict, progress: Callable[[str], None]) -> Iterator[list]:
    """Measure inside: a SIGTERM (gpu_run.sh's time limit) ends the block, which records it in result["stopped"];
    result["complete"] says whether the block ran to its end. Yields a list that holds the SIGTERM's time once one
    came (the caller prints the rows so far, then exits 143). Outside the main thread no handler is installed."""
    stopped: list = []

    def on_term(signum, frame):
        stopped.append(signum)
        raise Stopped()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: a SIGTERM ends the process as usual
        previous = None
    try:
        yield stopped
    except Stopped:
        result["stopped"] = "SIGTERM (a time limit): the rows measured before it"
        progress("SIGTERM: printing the rows measured so far")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        result["complete"] = not stopped
