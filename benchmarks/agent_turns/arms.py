"""agent_turns_bench's arms: the per-arm worker flags, the run order (interleaved and mirrored) and a run's
environment (only the arm's STRATA_* switches)."""
from __future__ import annotations

import os

from benchmarks.common import known_switches, parse_arms

__all__ = ["ARM_OPTIONS", "arm_flags", "run_order", "worker_env", "known_switches", "parse_arms"]

# Per-arm worker flags an arm may set besides STRATA_*: the draft proposer, and prefix reuse (1: a turn that
# extends the one before prefills only its new tokens; 0: every turn prefilled whole, a cold start each time).
ARM_OPTIONS = {"draft": ("ngram", "none", "device", "mtp"), "prefix_reuse": ("1", "0")}


def arm_flags(s, switches: dict[str, str]) -> dict[str, str]:
    """The worker flags of an arm: --draft's value unless the arm sets its own."""
    return {k: switches.get(k, _text(getattr(s, k))) for k in ARM_OPTIONS}


def _text(v) -> str:
    """A flag's value as the worker's flag text: a bool (--prefix_reuse) as 1 / 0."""
    return ("1" if v else "0") if isinstance(v, bool) else v


def run_order(names: list[str], rounds: int) -> list[str]:
    """Interleaved and mirrored: A B C C B A, `rounds` times."""
    return (names + names[::-1]) * rounds


def worker_env(switches: dict[str, str], base: dict | None = None) -> dict[str, str]:
    """A copy of the environment without any STRATA_* variable, plus the arm's switches."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith("STRATA_")}
    env.update({k: v for k, v in switches.items() if k not in ARM_OPTIONS})
    return env

