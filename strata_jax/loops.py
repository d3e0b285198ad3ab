"""One request's decode, as flat functions read top to bottom (gpt-fast's generate.py shape):

    run(engine, request)        prefill, the first token, then the loop the request asks for
      prefill                   the prompt through the prefill chunks; the first new token
      decode                    picks and times one of the three loops:
        decode_pipelined        spec 0: one token a window, read one window late (the next window already queued)
        decode_verify           verify windows: out[-1] + up to `spec` drafts, accept what the target agrees with;
          queued_windows        while the drafter proposes nothing: T=1 windows queued ahead, as decode_pipelined
        decode_device           draft="device": drafting and acceptance in the window graph, one window queued
                                ahead of the one read; the host loop finishes near the context's end

A `Request` holds the per-request things (the prompt, budget, stop ids, sampling, drafter, on_token, the stats and
the tokens made so far); the engine holds the compiled graphs, the weights and the KV cache, which every window
donates and returns (`engine.cache` is replaced at each call). `Engine.generate` builds the request and runs it
through `run` under its failure recovery (`Engine._guarded`)."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import grammar as grammar_mod
from strata_jax import mtp as mtp_mod
from strata_jax.drafts import DraftGate, NgramDrafter
from strata_jax.sampling import SamplingParams, form_of
from strata_jax.stats import RequestStats

if TYPE_CHECKING:
    from strata_jax.drafts import Drafter
    from strata_jax.grammar import JsonConstraint
    from strata_jax.engine import Engine


@dataclasses.dataclass
class Request:
    """One generate() call: what it asks for, and what it has made so far (`out`, `stats`)."""
    ids: np.ndarray  # the prompt, int32
    budget: int  # the most new tokens (max_new_tokens, within the context)
    stops: set[int]  # a token in these ends the request (it is the last one out)
    sampling: SamplingParams
    spec: int  # the most drafts a verify window (0: the pipelined T=1 loop)
    drafter: Drafter  # the host loop's drafts (ngram, none, an MTPDrafter or the API's object)
    stats: RequestStats
    on_token: Callable[[int], None] | None = None  # sees each accepted token; StopRequest from it ends the request
    device_drafts: bool = False  # draft="device": drafts and acceptance on the device (decode_device)
    reuse: int = 0  # leading prompt tokens whose KV rows the cache holds (prefix reuse): not prefilled
    out: list[int] = dataclasses.field(default_factory=list)  # the accepted new tokens
    form: str | None = None  # a sampled request's filter form (sampling.FORMS; from its settings when None)
    # The window graphs that draw this request's tokens (graphs.sampled_window, by T), or None: the window graphs
    # give logits and the samplers alone draw (several devices, draft=mtp)
    sampled_windows: Mapping[int, Callable] | None = None
    sampled: bool = dataclasses.field(init=False)  # temperature > 0
    # The built-in n-gram drafter's pauses after rejected windows (drafts.DraftGate); None for other drafters (an
    # API Drafter object is asked at every window, as its author expects; MTP drafts come from the window graph)
    gate: DraftGate | None = dataclasses.field(init=False)
    # The output's grammar (strata_jax/grammar.py: JSON, a schema), or None: each token drawn among the ones it allows
    grammar: JsonConstraint | None = None

    def __post_init__(self) -> None:
        self.sampled = float(self.sampling.temperature) > 0
        self.gate = DraftGate() if isinstance(self.drafter, NgramDrafter) else None
        if not self.sampled:
            self.form, self.sampled_windows = None, None
        elif self.form is None:
            self.form = form_of(int(self.sampling.top_k), float(self.sampling.top_p))
        if self.mtp is not None:  # the module's drafts follow the window's hidden rows (verify_window)
            self.sampled_windows = None

    def drafting(self) -> bool:
        """Whether the drafter is asked now (not within a pause of the gate)."""
        return self.gate is None or self.gate.open(len(self.out))

    @property
    def mtp(self) -> mtp_mod.MTPDrafter | None:
        """The MTP drafter (draft="mtp" with the module), else None."""
        return self.drafter if isinstance(self.drafter, mtp_mod.MTPDrafter) else None

    def emit(self, token: int) -> bool:
        """An accepted token: into `out`, then to on_token. True when it is a stop token."""
        self.out.append(token)
        if self.on_token:
            self.on_token(token)
        return token in self.stops


def run(engine: Engine, r: Request) -> None:
    """The whole request: the prompt's prefill and first token, then the decode loop (unless it stopped)."""
    first = prefill(engine, r)
    if r.on_token:
        r.on_token(first)
    if first not in r.stops:
        decode(engine, r)
    r.stats.decode_experts = engine._take_expert_stats()
    engine._adapt_pcie_frac(r.stats.decode_experts)  # pcie_frac=auto: from the misses this request met


def prefill(engine: Engine, r: Request) -> int:
    """The prompt from position r.reuse through the prefill chunks; returns the first new token (in r.out, not yet
    shown to on_token). Static cache policy: the slots then take the prefill's most used experts."""
    t0 = time.perf_counter()
    mtp = r.mtp
    token, last = engine._prefill_all(r.ids, first=r.reuse, mtp=mtp)
    if r.grammar is not None:
        first = constrained_token(engine, r, last, r.ids.size)
    else:
        if r.sampled:
            token = engine._sample[1](last, jnp.asarray([r.ids.size], jnp.int32), r.sampling)[0]
        first = engine._checked(int(token), r.ids.size)
    r.out.append(first)
    if mtp is not None:
        mtp.observe([first])
    r.stats.prefill_s = time.perf_counter() - t0
    r.stats.prefill_experts = engine._take_expert_stats()
    if engine.placement and engine.placement.policy == "static" and not r.reuse:
        # A reused prefix keeps the slots its first request chose (this prefill saw only the new tokens).
        engine._fill_static_slots()
    return first


def decode(engine: Engine, r: Request) -> None:
    """The decode loop the request asks for, timed as stats.decode_s (a graph compiled on first use is not)."""
    on_device = r.spec > 0 and r.device_drafts
    if on_device:
        engine._device_verify_graph(r.spec + 1, r.form)  # compiled on first use, outside the decode's time
    t0 = time.perf_counter()
    if r.grammar is not None:
        decode_constrained(engine, r)
    elif on_device:
        decode_device(engine, r)
    elif r.spec > 0:
        decode_verify(engine, r)
    else:
        decode_pipelined(engine, r)
    r.stats.decode_s = time.perf_counter() - t0


def constrained_token(engine: Engine, r: Request, logits, position: int) -> int:
    """The token at `position` from one row of logits, among the tokens r.grammar allows: their logits kept, the
    others at -inf, then the request's sampler (greedy: the argmax); the grammar takes the token."""
    allowed = jnp.asarray(r.grammar.allowed())
    if r.sampled:
        token = engine._sample[1](grammar_mod.masked_logits(logits, allowed), jnp.asarray([position], jnp.int32),
                                  r.sampling)[0]
    else:
        token = grammar_mod.masked_argmax(logits, allowed)
    token = engine._checked(int(token), position)
    r.grammar.advance(token)
    return token


def decode_constrained(engine: Engine, r: Request) -> None:
    """A request held to a grammar: T=1 windows one at a time (a token's mask follows from the tokens before it, so
    nothing is queued ahead), until a stop token, the budget, or the end-of-sequence token that follows a complete
    output (with ignore_eos too: the grammar allows nothing after it)."""
    pos = r.ids.size + len(r.out) - 1  # position of out[-1], not yet in the KV cache
    while len(r.out) < r.budget and not r.grammar.finished:
        _, logits, engine.cache = engine._decode[1](engine.weights, engine.cache, jnp.asarray(r.out[-1:], jnp.int32),
                                                    jnp.int32(pos))
        token = constrained_token(engine, r, logits, pos + 1)
        pos += 1
        r.stats.windows += 1
        r.stats.window_tokens += 1
        if r.emit(token):
            return


def decode_pipelined(engine: Engine, r: Request) -> None:
    """spec 0: one token a window, every window queued one ahead (queued_windows with no drafter)."""
    queued_windows(engine, r, None)


def decode_verify(engine: Engine, r: Request) -> None:
    """Verify windows: the last accepted token + up to `spec` drafts, the graph of that size; accept the drafts
    the target agrees with, then one more token from the target. Rejected drafts leave K/V rows past the
    accepted position: the next window writes those positions before any query reads them, and the causal
    mask hides the rest, so no stale entry is read (the expert slots keep what they fetched: placement only)."""
    context = list(r.ids) + r.out  # what the drafter drafts from
    pos = r.ids.size + len(r.out) - 1  # position of out[-1], the last accepted token, not yet in the KV cache
    ready = None  # when the host had the last window's result: the device waits from then to the next dispatch
    next_drafts = None  # greedy draft=mtp: the drafts the last window's graph made for this one
    while len(r.out) < r.budget:
        k = min(r.spec, r.budget - len(r.out) - 1)
        if next_drafts is not None:
            drafts = next_drafts[:k]
        else:  # the first window after the prefill (or any window of another drafter)
            drafts = r.drafter.propose(context, k) if k > 0 and r.drafting() else []
        if not drafts and r.mtp is None:
            # Nothing to verify: T=1 windows queued ahead (as decode_pipelined) until the drafter proposes again
            ready = queued_windows(engine, r, context)
            if ready is None:
                return
            pos = r.ids.size + len(r.out) - 1
            continue
        if r.sampled_windows is not None:  # the window's graph draws the acceptance and the next token
            drawn, n_new, engine.cache = r.sampled_windows[len(drafts) + 1](
                engine.weights, engine.cache, np.asarray(r.out[-1:] + drafts, np.int32), jnp.int32(pos), r.sampling)
            made = None
        else:
            greedy, logits, made = verify_window(engine, r, drafts, pos)
        if ready is not None:  # drafting, bookkeeping and this dispatch: host time between two windows
            r.stats.host_gap_s += time.perf_counter() - ready
            r.stats.host_gaps += 1
        if r.sampled_windows is not None:
            n = int(n_new)
            accepted, new = n - 1, np.asarray(drawn)[:n].tolist()
        else:
            accepted, new = accept(engine, r, drafts, greedy, logits, pos)
        engine._checked(new[-1], pos + 1 + accepted)
        ready = time.perf_counter()
        r.stats.windows += 1
        r.stats.window_tokens += len(drafts) + 1
        r.stats.drafts_proposed += len(drafts)
        r.stats.drafts_accepted += accepted
        if r.gate is not None:
            pauses = r.gate.pauses
            r.gate.after_window(len(r.out) + len(new), len(drafts), accepted)
            r.stats.draft_pauses += r.gate.pauses - pauses
        if made is not None:
            next_drafts = mtp_mod.draft_tokens(made, engine.cfg.vocab_size)
        else:
            r.drafter.observe(new)
        pos += len(new)
        for token in new:
            context.append(token)
            if r.emit(token):
                return


def queued_windows(engine: Engine, r: Request, context: list[int] | None) -> float | None:
    """One token a window. Each window's token feeds the next window on the device and Python reads it one window
    late: the next window is already queued when the host waits, so dispatch hides behind the device's work. After
    a stop token, the one window in flight is discarded.

    With a `context` (decode_verify's stretches without drafts), the drafter looks at each token read; once it
    proposes, no new window is queued: the one in flight is read and the verify windows go on from it. A synced
    T=1 window makes the same token (the same graph; sampled: the same key per position). Returns when its last
    token was read (the verify windows' host gap starts there), or None when a stop token ended the request."""
    cur = jnp.asarray(r.out[-1:], jnp.int32)
    pos = r.ids.size + len(r.out) - 1  # position of out[-1], not yet in the KV cache
    in_flight: list[jax.Array] = []
    proposes = False
    while True:
        if not proposes and len(r.out) + len(in_flight) < r.budget:
            if r.sampled_windows is not None:  # the token at position pos + 1, drawn in the window's graph
                cur, _, engine.cache = r.sampled_windows[1](engine.weights, engine.cache, cur, jnp.int32(pos),
                                                            r.sampling)
            else:
                cur, logits, engine.cache = engine._decode[1](engine.weights, engine.cache, cur, jnp.int32(pos))
                if r.sampled:  # the token at position pos + 1
                    cur = engine._sample[1](logits, jnp.asarray([pos + 1], jnp.int32), r.sampling)
            pos += 1
            r.stats.windows += 1
            r.stats.window_tokens += 1
            in_flight.append(cur)
        if not in_flight:
            return time.perf_counter()
        if len(in_flight) >= 2 or proposes or len(r.out) + len(in_flight) >= r.budget:
            # np.asarray(x)[0], not x[0]: indexing the device array dispatches a slice op, which serializes the loop
            token = engine._checked(int(np.asarray(in_flight.pop(0))[0]), r.ids.size + len(r.out))
            read = time.perf_counter()
            if context is not None:
                context.append(token)
                r.drafter.observe([token])
            if r.emit(token):
                return None
            if context is not None:
                k = min(r.spec, r.budget - len(r.out) - len(in_flight) - 1)
                proposes = proposes or (k > 0 and r.drafting() and bool(r.drafter.propose(context, k)))
                if proposes and not in_flight:
                    return read


def verify_window(engine: Engine, r: Request, drafts: list[int], pos: int):
    """Dispatch one verify window, out[-1] and the drafts at positions pos..: (its greedy tokens [T], its logits
    [T, V], and for greedy draft=mtp the module's drafts for the next window, else None)."""
    t = len(drafts) + 1
    window = np.asarray(r.out[-1:] + drafts, np.int32)
    mtp = r.mtp
    if mtp is not None and not r.sampled:  # the window's graph drafts the next window too
        greedy, logits, engine.cache, mtp.cache, made = engine._mtp_compiled[("fused", t)](
            engine.weights, engine.cache, engine.mtp, mtp.cache, window, jnp.int32(pos))
        return greedy, logits, made
    if mtp is not None:  # the window's hidden rows feed the module's next drafts
        greedy, logits, engine.cache, hidden = engine._mtp_hidden_window(t)(engine.weights, engine.cache, window,
                                                                           jnp.int32(pos))
        mtp.feed(hidden, pos)
        return greedy, logits, None
    greedy, logits, engine.cache = engine._decode[t](engine.weights, engine.cache, window, jnp.int32(pos))
    return greedy, logits, None


def accept(engine: Engine, r: Request, drafts: list[int], greedy, logits, pos: int) -> tuple[int, list[int]]:
    """A window's acceptance: (drafts accepted, the new tokens: those drafts and one token from the target).
    Greedy: the drafts equal to the target's argmax; sampled: speculative rejection sampling (sampling.verify)."""
    t = len(drafts) + 1
    positions = jnp.asarray(np.arange(pos + 1, pos + 1 + t), jnp.int32)
    if not r.sampled:
        target = np.asarray(greedy)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return accepted, drafts[:accepted] + [int(target[accepted])]
    if drafts:
        ok, drawn = engine._verify[t](logits, jnp.asarray(drafts, jnp.int32), positions, r.sampling)
        ok, drawn = np.asarray(ok), np.asarray(drawn)
        accepted = int(np.argmin(ok)) if not ok.all() else len(drafts)
        return accepted, drafts[:accepted] + [int(drawn[accepted])]
    return 0, [int(engine._sample[1](logits, positions, r.sampling)[0])]


def decode_device(engine: Engine, r: Request) -> None:
    """Verify windows dispatched back to back: drafting and acceptance run on the device
    (strata_jax.device_drafts, the host loop's rules), each window's tokens are read one window late, so the
    device never waits for the host. Windows of spec+1 tokens (padding rows route to no expert), one queued
    ahead of the one being read. A window that might pass the context is not dispatched: the last tokens go
    through the host loop (decode_verify)."""
    t = r.spec + 1
    step = engine._device_verify_graph(t, r.form)
    hist = np.zeros((engine.context + t,), np.int32)
    hist[:r.ids.size] = r.ids
    hist[r.ids.size:r.ids.size + len(r.out)] = r.out
    hist, length = jnp.asarray(hist), jnp.int32(r.ids.size + len(r.out))
    exact = r.ids.size + len(r.out)  # tokens in the history as the host knows it
    in_flight: list[tuple[jax.Array, jax.Array, jax.Array]] = []
    while True:
        upper = exact + t * len(in_flight)  # the most tokens the history can hold once those windows end
        if len(in_flight) < 2 and len(r.out) + len(in_flight) < r.budget and upper - 1 + t <= engine.context:
            hist, length, new, n_new, m, engine.cache = step(engine.weights, engine.cache, hist, length, r.sampling)
            in_flight.append((new, n_new, m))
            continue
        if not in_flight:
            break
        new, n_new, m = in_flight.pop(0)
        n, m = int(n_new), int(m)
        if len(r.out) >= r.budget:
            return  # a window dispatched ahead whose tokens are not needed
        r.stats.windows += 1
        r.stats.window_tokens += 1 + m
        r.stats.drafts_proposed += m
        r.stats.drafts_accepted += n - 1
        exact += n
        for token in np.asarray(new)[:n].tolist():
            engine._checked(token, r.ids.size + len(r.out))
            if len(r.out) >= r.budget:
                return
            if r.emit(token):
                return  # the windows still in flight are discarded (their K/V rows are never read)
    if len(r.out) < r.budget:  # the context's end is nearer than a whole window: the host loop finishes
        decode_verify(engine, r)
