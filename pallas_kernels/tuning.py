"""The decode kernels' knobs from a file: `STRATA_KERNEL_TUNING=FILE` (the JSON of `python -m benchmarks
kernel-sweep --json=FILE`) puts the sweep's picks in place of the expert FFN's and the stacked attention products'
`TUNING` rows in this process, so that whole runs can be compared before a row changes in the code.

The file's "picks": {"expert_ffn:decode": {knob: value}, "expert_ffn:wide": ..., "qkv:decode", "qkv:wide",
"o:decode", "o:wide", "qkv_rope:decode" ({"fuse": 1}: the q/k/v product's split sum, q/k norms, RoPE and cache
writes in one kernel, qkv_rope.py), "fold:decode" ({"row": 1, "norm": 1}: stacked_linear's folds)}; a row may be absent (the default stays) or name only some knobs (the others
stay)."""
from __future__ import annotations

import json

from . import expert_ffn, qkv_rope, stacked_linear
from .blocks import REDUCE

# pick name -> (the TUNING table, its key): the rows kernel-sweep sweeps (SWEPT), then switches a file may set by hand
SWEPT = {"expert_ffn:decode": (expert_ffn.TUNING, "decode"), "expert_ffn:wide": (expert_ffn.TUNING, "wide"),
         "qkv:decode": (stacked_linear.TUNING, ("qkv", "decode")), "qkv:wide": (stacked_linear.TUNING, ("qkv", "wide")),
         "o:decode": (stacked_linear.TUNING, ("o", "decode")), "o:wide": (stacked_linear.TUNING, ("o", "wide"))}
ROWS = {**SWEPT, "qkv_rope:decode": (qkv_rope.TUNING, "decode"), "fold:decode": (stacked_linear.FOLD, "decode")}


def check(picks: dict) -> dict[str, dict]:
    """The picks as {row: knobs}, or a ValueError of one line naming what is wrong."""
    if not isinstance(picks, dict):
        raise ValueError("its \"picks\" must be an object of rows")
    out = {}
    for row, knobs in picks.items():
        if row not in ROWS:
            raise ValueError(f"unknown row {row!r} (rows: {', '.join(ROWS)})")
        table, key = ROWS[row]
        if not isinstance(knobs, dict):
            raise ValueError(f"row {row}: must be an object of knobs")
        for name, value in knobs.items():
            if name not in table[key]:
                raise ValueError(f"row {row}: unknown knob {name!r} (knobs: {', '.join(table[key])})")
            if name == "reduce":
                if value not in REDUCE:
                    raise ValueError(f"row {row}: reduce must be one of {REDUCE} (got {value!r})")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"row {row}: {name} must be a positive integer (got {value!r})")
            elif name.startswith("block") and value & (value - 1):
                raise ValueError(f"row {row}: {name} must be a power of 2 (got {value!r})")
        out[row] = dict(knobs)
    return out


def read(path: str) -> dict[str, dict]:
    """A sweep file's checked picks; ValueError (one line) for a missing or malformed file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or "picks" not in data:
        raise ValueError("no \"picks\" in it (a kernel-sweep --json file has them)")
    return check(data["picks"])


def apply(picks: dict[str, dict]) -> dict:
    """Put the picks in the TUNING tables (a new dict per row: the shared default dict is never changed in place);
    returns what they replaced, for `restore`."""
    before = {}
    for row, knobs in picks.items():
        table, key = ROWS[row]
        before[row] = table[key]
        table[key] = {**table[key], **knobs}
    return before


def restore(before: dict) -> None:
    for row, knobs in before.items():
        table, key = ROWS[row]
        table[key] = knobs


def from_environment(environ=None) -> list[str]:
    """STRATA_KERNEL_TUNING: apply its file's picks; one start-up line saying so (none when unset). A bad file: a
    ValueError of one line."""
    import os
    path = (os.environ if environ is None else environ).get("STRATA_KERNEL_TUNING", "").strip()
    if not path:
        return []
    try:
        picks = read(path)
    except ValueError as e:
        raise ValueError(f"STRATA_KERNEL_TUNING={path}: {e}") from None
    apply(picks)
    said = "; ".join(f"{row} {', '.join(f'{k}={v}' for k, v in knobs.items())}" for row, knobs in picks.items())
    return [f"kernel tuning from {path}: {said or 'no rows'}"]
