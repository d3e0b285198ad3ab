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
    and halving (down to FIRST_PAUSE) with each window that accepts a draft: a drafter that keeps being right keeps
    drafting. Placement of tokens only: greedy output is the same (the same tokens); a sampled request's seed
    reproduces its run.

    A sampled request's gate watches first (watch=True): a rejected window there costs several T=1 windows of time
    (the queue drained, a synced T > 1 window, the queue started again: ~3-6 ms a window on an H100, issue 39) and
    a match of the context is one candidate among top_k, so it opens only on evidence that costs no window. While
    closed for want of it (not within a pause), the loops still ask the drafter after each token read (host work,
    the next window already queued: `shadow`) and check its first draft against the token that then came: a hit
    has probability p(draft), the first draft's chance of acceptance. SHADOW_HITS hits in a row open the gate
    (text that quotes its context); a window that accepts nothing closes it again, behind its pause. Sampled text
    that quotes nothing then runs no verify window: spec=0's windows and tokens."""
    FIRST_PAUSE = 4
    LONGEST_PAUSE = 128
    SHADOW_HITS = 2

    def __init__(self, watch: bool = False) -> None:
        self.pause = self.FIRST_PAUSE
        self.quiet_until = 0  # no drafts until the request has made this many tokens
        self.pauses = 0  # rejected windows that started a pause
        self.watch = watch
        self.trusted = not watch  # watching: whether the shadow drafts earned the drafter its windows
        self.pending: tuple[int, int] | None = None  # (context length, first draft) of the shadow draft unresolved
        self.hits_in_row = 0
        self.shadow_drafts = 0  # shadow drafts resolved, and how many of them the next token matched
        self.shadow_hits = 0

    def open(self, made: int) -> bool:
        """Whether to ask the drafter for a window, the request having made `made` tokens."""
        return made >= self.quiet_until and self.trusted

    def shadow(self, context: Sequence[int], drafter: "Drafter", made: int) -> None:
        """After a token read (`context`: everything so far): settle the last shadow draft against the token that
        followed it, then, still watching and not within a pause, ask the drafter for the next one."""
        if not self.watch:
            return
        if self.pending is not None and len(context) > self.pending[0]:
            hit = context[self.pending[0]] == self.pending[1]
            self.pending = None
            self.shadow_drafts += 1
            self.shadow_hits += hit
            self.hits_in_row = self.hits_in_row + 1 if hit else 0
            self.trusted = self.hits_in_row >= self.SHADOW_HITS
        if self.trusted or made < self.quiet_until:
            return
        drafts = drafter.propose(context, 1)
        if drafts:
            self.pending = (len(context), int(drafts[0]))

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
        if self.watch:  # after the pause: evidence again before the next window
            self.trusted, self.hits_in_row, self.pending = False, 0, None


def make_drafter(name: str) -> Drafter:
    # device: the host loop's tail; mtp without an MTP module: the n-gram drafter
    return NgramDrafter() if name in ("ngram", "device", "mtp") else NoDrafter()
