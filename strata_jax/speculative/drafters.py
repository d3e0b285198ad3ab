"""Draft proposers for verify windows: given the tokens so far, propose up to k next tokens.

A verify window runs the last accepted token plus the drafts through the model at once; the drafts the target
agrees with are accepted (greedy: equal to its argmax; sampling: speculative rejection sampling), so the window
shares each expert's fetch between several tokens. A drafter only proposes; it never changes the output, only how
many windows it takes.

The interface is one method, so a model's own multi-token-prediction head can plug in later: it would keep the
hidden state it needs from `observe` and propose from it.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

NGRAM_MAX_N = 3  # longest suffix the n-gram drafter matches (device_drafts uses the same)
NGRAM_WINDOW = 4096  # tokens it looks back over
DRAFTERS = ("auto", "ngram", "none", "device", "mtp")  # auto: Engine.generate picks device or ngram; device: strata_jax.speculative.device_drafts; mtp: strata_jax.speculative.mtp


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the prompt and everything accepted so far)."""

    def observe(self, accepted: Sequence[int]) -> None:
        """Called with the tokens each window accepted (a stateful drafter may use it)."""


class NoDrafter:
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return []

    def observe(self, accepted: Sequence[int]) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: the longest suffix of the context (max_n down to min_n tokens) that occurred earlier proposes
    the tokens that followed its most recent earlier occurrence. Strong where the output quotes the context (code,
    agent turns that echo files)."""

    def __init__(self, max_n: int = NGRAM_MAX_N, min_n: int = 1, window: int = NGRAM_WINDOW):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        ctx = np.asarray(tokens[-self.window:], np.int64)
        size = ctx.size
        # Ends j of earlier occurrences of the last token; each n keeps those whose n-1 tokens before match too.
        ends = np.nonzero(ctx[:-1] == ctx[-1])[0]
        best = None
        for n in range(1, min(self.max_n, size - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[ctx[ends - (n - 1)] == ctx[size - n]]
            if ends.size == 0:
                break
            if n >= self.min_n:
                best = int(ends[-1])  # the most recent occurrence of the longest matching suffix so far
        if best is None:
            return []
        return ctx[best + 1:best + 1 + k].tolist()

    def observe(self, accepted: Sequence[int]) -> None:
        pass


class DraftGate:
    """When the built-in drafter keeps missing, stop asking it for a while: a verify window whose drafts were all
    rejected costs a window of T > 1 and breaks the queue of T=1 windows (the host reads every verify window before
    the next one goes), for no token more. After such a window the loops run `pause` tokens without drafts (T=1
    windows queued ahead), the pause doubling from FIRST_PAUSE up to LONGEST_PAUSE with each further rejected window
    and halving (down to FIRST_PAUSE) with each window that accepts a draft: a drafter right once in many windows
    (sampled text, where a match of the context is one candidate among top_k) stays mostly paused, one that keeps
    being right keeps drafting. Sampled text that quotes nothing (most chat) then decodes as spec=0 does, and greedy
    text that repeats itself keeps its drafts. Placement of tokens only: the output is the
    same (greedy: the same tokens; sampled: the same key per position)."""
    FIRST_PAUSE = 4
    LONGEST_PAUSE = 128

    def __init__(self) -> None:
        self.pause = self.FIRST_PAUSE
        self.quiet_until = 0  # no drafts until the request has made this many tokens
        self.pauses = 0  # rejected windows that started a pause

    def open(self, made: int) -> bool:
        """Whether to ask the drafter, the request having made `made` tokens."""
        return made >= self.quiet_until

    def after_window(self, made: int, proposed: int, accepted: int) -> None:
        """A verify window of `proposed` drafts accepted `accepted`; the request has now made `made` tokens."""
        if proposed == 0:
            return
        if accepted:
            self.pause = max(self.pause // 2, self.FIRST_PAUSE)
            return
        self.quiet_until = made + self.pause
        self.pause = min(2 * self.pause, self.LONGEST_PAUSE)
        self.pauses += 1


def make_drafter(name: str) -> Drafter:
    # device: the host loop's tail; mtp without an MTP module: the n-gram drafter
    return NgramDrafter() if name in ("ngram", "device", "mtp") else NoDrafter()
