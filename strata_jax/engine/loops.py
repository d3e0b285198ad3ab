"""One request's decode, as flat functions read top to bottom (gpt-fast's generate.py shape):

    run(graphs, state, request) prefill, the first token, then the loop the request asks for
      prefill                   the prompt through the prefill chunks; the first new token
    run_batch(graphs, state, requests)  several requests at once: each prefilled alone into its KV slot, then
      BatchDecoder              continuous batching: requests admitted into free KV slots (prefilled alone) and
                                T=1 windows of every live one together (step), read one window late; a
                                request leaves at its stop and its slot is free for the next
      decode_tokens             picks and times one of the loops:
        decode_pipelined        spec 0: one token a window, read one window late (the next window already queued)
        decode_verify           verify windows: out[-1] + up to `spec` drafts, accept what the target agrees with;
          queued_windows        while the drafter proposes nothing: T=1 windows queued ahead, as decode_pipelined
        decode_device           draft="device": drafting and acceptance in the window graph, one window queued
                                ahead of the one read; the host loop finishes near the context's end

The loops know three things, never the Engine: a `Request` (the prompt, budget, stop ids, sampling, drafter,
on_token, the stats and the tokens made so far), the `Graphs` it may call (the compiled windows by size, the
samplers of its filter form, the graphs compiled on first use, the steps between windows), and the `State` that
every window donates and gets back (`state.cache` is replaced at each call). `Engine.generate` builds the three
and runs `run` under its failure recovery (`Engine._guarded`)."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import grammar as grammar_mod
from strata_jax.speculative import mtp as mtp_mod
from strata_jax.speculative.drafters import DraftGate, NgramDrafter
from strata_jax.model.kv_cache import split_slot_caches, with_slot_caches
from strata_jax.sampling import SamplingParams, form_of
from strata_jax.engine.stats import RequestStats

if TYPE_CHECKING:
    from strata_jax.speculative.drafters import Drafter
    from strata_jax.grammar import JsonConstraint
    from strata_jax.engine.stats import ExpertStats


@dataclasses.dataclass
class State:
    """What every window donates and gets back: the weights, the KV cache (with the slot caches), the MTP module's
    weights (or None). The engine holds one; the loops replace `cache` after each call."""
    weights: object
    cache: object
    mtp: object = None
    batch: object = None  # the batched windows' KV cache: a slot per sequence (kv_cache.init_batch_cache)
    # The batch cache's slots as an LRU of prefixes (BatchDecoder; emptied with the batch cache, Engine._reset_state):
    # per slot the token ids whose rows 0..n-1 it holds, trusted ([] while a request owns it), and when it was last
    # freed (-1: never)
    slot_tokens: list = dataclasses.field(default_factory=list)
    slot_freed: list = dataclasses.field(default_factory=list)
    slot_clock: int = 0


@dataclasses.dataclass
class Graphs:
    """What a request's loops may call (Engine._graphs makes it per request: the samplers follow its filter form)."""
    decode: Mapping[int, Callable]  # T -> (weights, cache, tokens [T], pos) -> (greedy [T], logits [T, V], cache)
    sample: Mapping[int, Callable]  # T -> (logits [T, V], positions [T], sampling) -> tokens [T]
    verify: Mapping[int, Callable]  # T -> (logits, drafts [T-1], positions, sampling) -> (ok [T-1], drawn [T])
    device_verify: Callable[[int, str | None], Callable]  # draft=device's window of (T, filter form), on first use
    mtp_fused: Callable[[int], Callable]  # greedy draft=mtp: the window that also drafts the next one
    mtp_hidden: Callable[[int], Callable]  # sampled draft=mtp: the window that returns its hidden rows
    prefill: Callable  # (ids, first, mtp) -> (first new token, its logits [1, V]): the prompt through the chunks
    checked: Callable[[int, int], int]  # a token read back at a position: refused when its logits were not finite
    take_expert_stats: Callable[[], ExpertStats]  # the windows' expert counters since the last call, zeroed
    after_request: Callable[[ExpertStats], None]  # pcie_frac=auto: the split from the misses a request met
    # static cache policy (and lru with pcie_frac 0): the slots take the prefill's experts; returns the experts
    # copied once they are on the device
    fill_static_slots: Callable[[], int] | None
    context: int
    vocab_size: int
    batch_windows: Callable[[str | None], Mapping[int, Callable]] | None = None  # filter form -> bucket B -> graph
    put_slot: Callable | None = None  # (batch cache, the engine's cache, slot) -> batch cache
    form_samplers: Callable[[str], Mapping[int, Callable]] | None = None  # a filter form's `sample` table
    batch_slots: int = 1  # the batch cache's KV slots (max_batch)
    prefill_sizes: Callable[[int], list[int]] | None = None  # n prompt tokens -> the prefill's chunk sizes
    get_slot: Callable | None = None  # (batch cache, the engine's cache, slot) -> the engine's cache (put_slot's reverse)
    prefix_reuse: bool = False  # a freed KV slot keeps its rows for a later prompt that starts with its tokens
    exact_windows: bool = True  # the batched windows' K/V rows are each row's alone (no approximation on)
    # slot_refresh: every `refresh_every` T=1 decode windows the slots re-take the request's most used experts so
    # far (fill_static_slots keeping the usage); returns the experts copied once they are on the device
    refresh_slots: Callable[[], int] | None = None
    refresh_every: int = 0


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
    # The built-in n-gram drafter's pauses after rejected windows (drafts.DraftGate; a sampled request's watches
    # before its first window); None for other drafters (an API Drafter object is asked at every window, as its
    # author expects; MTP drafts come from the window graph)
    gate: DraftGate | None = dataclasses.field(init=False)
    # The output's grammar (strata_jax/grammar.py: JSON, a schema), or None: each token drawn among the ones it allows
    grammar: JsonConstraint | None = None
    # Batched requests (run_batch) with return_logits: the float32 logits [V] each new token was chosen from
    logits: list | None = None

    def __post_init__(self) -> None:
        self.sampled = float(self.sampling.temperature) > 0
        self.gate = DraftGate(watch=self.sampled) if isinstance(self.drafter, NgramDrafter) else None
        if not self.sampled:
            self.form, self.sampled_windows = None, None
        elif self.form is None:
            self.form = form_of(int(self.sampling.top_k), float(self.sampling.top_p))
        if self.mtp is not None:  # the module's drafts follow the window's hidden rows (send_verify_window)
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


def run(g: Graphs, s: State, r: Request) -> None:
    """The whole request: the prompt's prefill and first token, then the decode loop (unless it stopped)."""
    first = prefill(g, s, r)
    if r.on_token:
        r.on_token(first)
    if first not in r.stops:
        decode_tokens(g, s, r)
    r.stats.decode_experts = g.take_expert_stats()
    g.after_request(r.stats.decode_experts)  # pcie_frac=auto: from the misses this request met


def prefill(g: Graphs, s: State, r: Request) -> int:
    """The prompt from position r.reuse through the prefill chunks; returns the first new token (in r.out, not yet
    shown to on_token). Static cache policy: the slots then take the prefill's most used experts."""
    t0 = time.perf_counter()
    mtp = r.mtp
    token, last = g.prefill(r.ids, first=r.reuse, mtp=mtp)
    if r.logits is not None:
        r.logits.append(np.asarray(last, np.float32)[0])
    if r.grammar is not None:
        first = constrained_token(g, s, r, last, r.ids.size)
    else:
        if r.sampled:
            token = g.sample[1](last, np.asarray([r.ids.size], np.int32), r.sampling)[0]
        first = g.checked(int(token), r.ids.size)
    r.out.append(first)
    if mtp is not None:
        mtp.observe([first])
    r.stats.prefill_s = time.perf_counter() - t0
    r.stats.prefill_experts = g.take_expert_stats()
    if g.fill_static_slots is not None and not r.reuse:
        # A reused prefix keeps the slots its first request chose (this prefill saw only the new tokens). Waited
        # for: its copies would otherwise stall the decode's first window and count as decode time.
        t0 = time.perf_counter()
        r.stats.slot_fill_experts += g.fill_static_slots()
        r.stats.slot_fill_s += time.perf_counter() - t0
    return first


def decode_tokens(g: Graphs, s: State, r: Request) -> None:
    """The decode loop the request asks for, timed as stats.decode_s (a graph compiled on first use is not)."""
    on_device = r.spec > 0 and r.device_drafts
    if on_device:
        g.device_verify(r.spec + 1, r.form)  # compiled on first use, outside the decode's time
    t0 = time.perf_counter()
    if r.grammar is not None:
        decode_constrained(g, s, r)
    elif on_device:
        decode_device(g, s, r)
    elif r.spec > 0:
        decode_verify(g, s, r)
    else:
        decode_pipelined(g, s, r)
    r.stats.decode_s = time.perf_counter() - t0
    if r.gate is not None:
        r.stats.shadow_drafts, r.stats.shadow_hits = r.gate.shadow_drafts, r.gate.shadow_hits


def constrained_token(g: Graphs, s: State, r: Request, logits, position: int) -> int:
    """The token at `position` from one row of logits, among the tokens r.grammar allows: their logits kept, the
    others at -inf, then the request's sampler (greedy: the argmax); the grammar takes the token."""
    allowed = jnp.asarray(r.grammar.allowed())
    if r.sampled:
        token = g.sample[1](grammar_mod.masked_logits(logits, allowed), np.asarray([position], np.int32),
                                  r.sampling)[0]
    else:
        token = grammar_mod.masked_argmax(logits, allowed)
    token = g.checked(int(token), position)
    r.grammar.advance(token)
    return token


def decode_constrained(g: Graphs, s: State, r: Request) -> None:
    """A request held to a grammar: T=1 windows one at a time (a token's mask follows from the tokens before it, so
    nothing is queued ahead), until a stop token, the budget, or the end-of-sequence token that follows a complete
    output (with ignore_eos too: the grammar allows nothing after it)."""
    pos = r.ids.size + len(r.out) - 1  # position of out[-1], not yet in the KV cache
    while len(r.out) < r.budget and not r.grammar.finished:
        _, logits, s.cache = g.decode[1](s.weights, s.cache, np.asarray(r.out[-1:], np.int32),
                                                    np.int32(pos))
        token = constrained_token(g, s, r, logits, pos + 1)
        pos += 1
        r.stats.windows += 1
        r.stats.window_tokens += 1
        if r.emit(token):
            return


def decode_pipelined(g: Graphs, s: State, r: Request) -> None:
    """spec 0: one token a window, every window queued one ahead (queued_windows with no drafter)."""
    queued_windows(g, s, r, None)


def decode_verify(g: Graphs, s: State, r: Request) -> None:
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
            ready = queued_windows(g, s, r, context)
            if ready is None:
                return
            pos = r.ids.size + len(r.out) - 1
            continue
        if r.sampled_windows is not None:  # the window's graph draws the acceptance and the next token
            drawn, n_new, s.cache = r.sampled_windows[len(drafts) + 1](
                s.weights, s.cache, np.asarray(r.out[-1:] + drafts, np.int32), np.int32(pos), r.sampling)
            made = None
        else:
            greedy, logits, made = send_verify_window(g, s, r, drafts, pos)
        if ready is not None:  # drafting, bookkeeping and this dispatch: host time between two windows
            r.stats.host_gap_s += time.perf_counter() - ready
            r.stats.host_gaps += 1
        if r.sampled_windows is not None:
            n = int(n_new)
            accepted, new = n - 1, np.asarray(drawn)[:n].tolist()
        else:
            accepted, new = accept_drafts(g, s, r, drafts, greedy, logits, pos)
        g.checked(new[-1], pos + 1 + accepted)
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
            next_drafts = mtp_mod.draft_tokens(made, g.vocab_size)
        else:
            r.drafter.observe(new)
        pos += len(new)
        for token in new:
            context.append(token)
            if r.emit(token):
                return


def queued_windows(g: Graphs, s: State, r: Request, context: list[int] | None) -> float | None:
    """One token a window. Each window's token feeds the next window on the device and Python reads it one window
    late: the next window is already queued when the host waits, so dispatch hides behind the device's work. After
    a stop token, the one window in flight is discarded.

    With a `context` (decode_verify's stretches without drafts), the drafter looks at each token read; once it
    proposes, no new window is queued: the one in flight is read and the verify windows go on from it. A synced
    T=1 window makes the same token (the same graph; sampled: the same key per position). Returns when its last
    token was read (the verify windows' host gap starts there), or None when a stop token ended the request."""
    cur = np.asarray(r.out[-1:], np.int32)
    pos = r.ids.size + len(r.out) - 1  # position of out[-1], not yet in the KV cache
    in_flight: list[jax.Array] = []
    proposes = False
    while True:
        if not proposes and len(r.out) + len(in_flight) < r.budget:
            if r.sampled_windows is not None:  # the token at position pos + 1, drawn in the window's graph
                cur, _, s.cache = r.sampled_windows[1](s.weights, s.cache, cur, np.int32(pos),
                                                            r.sampling)
            else:
                cur, logits, s.cache = g.decode[1](s.weights, s.cache, cur, np.int32(pos))
                if r.sampled:  # the token at position pos + 1
                    cur = g.sample[1](logits, np.asarray([pos + 1], np.int32), r.sampling)
            pos += 1
            r.stats.windows += 1
            r.stats.window_tokens += 1
            in_flight.append(cur)
            if g.refresh_slots is not None and r.stats.windows % g.refresh_every == 0:
                t0 = time.perf_counter()  # waits for the window just sent (its usage), then the copies
                r.stats.slot_refresh_experts += g.refresh_slots()
                r.stats.slot_refreshes += 1
                r.stats.slot_refresh_s += time.perf_counter() - t0
        if not in_flight:
            return time.perf_counter()
        if len(in_flight) >= 2 or proposes or len(r.out) + len(in_flight) >= r.budget:
            # np.asarray(x)[0], not x[0]: indexing the device array dispatches a slice op, which serializes the loop
            token = g.checked(int(np.asarray(in_flight.pop(0))[0]), r.ids.size + len(r.out))
            read = time.perf_counter()
            if context is not None:
                context.append(token)
                r.drafter.observe([token])
            if r.emit(token):
                return None
            if context is not None:
                k = min(r.spec, r.budget - len(r.out) - len(in_flight) - 1)
                if r.gate is not None:  # a watching gate's shadow draft: settled by this token, the next asked
                    r.gate.shadow(context, r.drafter, len(r.out))
                proposes = proposes or (k > 0 and r.drafting() and bool(r.drafter.propose(context, k)))
                if proposes and not in_flight:
                    return read


def send_verify_window(g: Graphs, s: State, r: Request, drafts: list[int], pos: int):
    """Dispatch one verify window, out[-1] and the drafts at positions pos..: (its greedy tokens [T], its logits
    [T, V], and for greedy draft=mtp the module's drafts for the next window, else None)."""
    t = len(drafts) + 1
    window = np.asarray(r.out[-1:] + drafts, np.int32)
    mtp = r.mtp
    if mtp is not None and not r.sampled:  # the window's graph drafts the next window too
        greedy, logits, s.cache, mtp.cache, made = g.mtp_fused(t)(
            s.weights, s.cache, s.mtp, mtp.cache, window, np.int32(pos))
        return greedy, logits, made
    if mtp is not None:  # the window's hidden rows feed the module's next drafts
        greedy, logits, s.cache, hidden = g.mtp_hidden(t)(s.weights, s.cache, window,
                                                                           np.int32(pos))
        mtp.feed(hidden, pos)
        return greedy, logits, None
    greedy, logits, s.cache = g.decode[t](s.weights, s.cache, window, np.int32(pos))
    return greedy, logits, None


def accept_drafts(g: Graphs, s: State, r: Request, drafts: list[int], greedy, logits, pos: int) -> tuple[int, list[int]]:
    """A window's acceptance: (drafts accepted, the new tokens: those drafts and one token from the target).
    Greedy: the drafts equal to the target's argmax; sampled: speculative rejection sampling (sampling.verify)."""
    t = len(drafts) + 1
    positions = np.arange(pos + 1, pos + 1 + t, dtype=np.int32)
    if not r.sampled:
        target = np.asarray(greedy)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return accepted, drafts[:accepted] + [int(target[accepted])]
    if drafts:
        ok, drawn = g.verify[t](logits, np.asarray(drafts, np.int32), positions, r.sampling)
        ok, drawn = np.asarray(ok), np.asarray(drawn)
        accepted = int(np.argmin(ok)) if not ok.all() else len(drafts)
        return accepted, drafts[:accepted] + [int(drawn[accepted])]
    return 0, [int(g.sample[1](logits, positions, r.sampling)[0])]


def decode_device(g: Graphs, s: State, r: Request) -> None:
    """Verify windows dispatched back to back: drafting and acceptance run on the device
    (strata_jax.speculative.device_drafts, the host loop's rules), each window's tokens are read one window late, so the
    device never waits for the host. Windows of spec+1 tokens (padding rows route to no expert), one queued
    ahead of the one being read. A window that might pass the context is not dispatched: the last tokens go
    through the host loop (decode_verify)."""
    t = r.spec + 1
    step = g.device_verify(t, r.form)
    hist = np.zeros((g.context + t,), np.int32)
    hist[:r.ids.size] = r.ids
    hist[r.ids.size:r.ids.size + len(r.out)] = r.out
    hist, length = jnp.asarray(hist), jnp.int32(r.ids.size + len(r.out))
    exact = r.ids.size + len(r.out)  # tokens in the history as the host knows it
    in_flight: list[tuple[jax.Array, jax.Array, jax.Array]] = []
    while True:
        upper = exact + t * len(in_flight)  # the most tokens the history can hold once those windows end
        if len(in_flight) < 2 and len(r.out) + len(in_flight) < r.budget and upper - 1 + t <= g.context:
            hist, length, new, n_new, m, s.cache = step(s.weights, s.cache, hist, length, r.sampling)
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
            g.checked(token, r.ids.size + len(r.out))
            if len(r.out) >= r.budget:
                return
            if r.emit(token):
                return  # the windows still in flight are discarded (their K/V rows are never read)
    if len(r.out) < r.budget:  # the context's end is nearer than a whole window: the host loop finishes
        decode_verify(g, s, r)


# ---- several requests at once -------------------------------------------------------------------------------------

def run_batch(g: Graphs, s: State, rows: list[Request]) -> BatchDecoder:
    """Requests decoded together (Engine.generate_batch: spec 0, no grammar): each prompt's prefill alone through
    the prefill chunks into the engine's cache (from the prefix a freed slot kept), copied into its KV slot, then T=1
    windows of every live request until all have stopped (a BatchDecoder with a fixed set of requests). A request
    whose first token ends it leaves before the first batched window. Returns the decoder (its counters)."""
    decoder = BatchDecoder(g, s)
    decoder.windows(batch_form(rows))  # compile_graphs=ahead: every bucket compiled here, before the timed part
    for r in rows:
        decoder.admit(r)
    while decoder.active:
        decoder.step()
    experts = g.take_expert_stats()
    for r in rows:
        r.stats.decode_experts = experts
    return decoder


def batch_form(rows: list[Request]) -> str | None:
    """The filter form of a window of these requests: None (greedy rows only), their one form, or "sorted" (right
    for any setting) when their forms differ."""
    forms = {r.form for r in rows if r.sampled}
    return None if not forms else forms.pop() if len(forms) == 1 else "sorted"


class BatchDecoder:
    """Continuous batching: requests join and leave a running batch between T=1 windows.

    It owns the batch cache's KV slots (`free`): `admit` prefills a request alone through the prefill chunks into
    the engine's cache, copies it into a free slot (put_slot) and hands its first token to on_token (or `begin`,
    then `advance` one chunk at a time between windows, so a long prompt does not stall the others); `step` runs
    one window of every live request that still needs tokens, as the rows of the smallest bucket that holds them
    (the rest padding: routed nowhere, written into a slot no live request owns), and reads the oldest window in
    flight; a request that stops (a stop token, its budget, StopRequest turned into budget = len(out) by its
    on_token) leaves there and its slot is free again (a window still in flight may write into it: the next
    owner's put_slot comes after it on the device, and rewrites the whole slot). Each window's tokens feed the next
    window on the device and are read one window late, as decode_pipelined; a request that joins gets its first
    token from the host. Each row is its request's T=1 window alone (its own slot, position, sampling and key per
    seed and position), so its tokens do not depend on who runs beside it or when it joined.

    Prefix reuse across requests (g.prefix_reuse): the slots are an LRU of prefixes. A freed slot keeps the token ids
    of its trusted rows (State.slot_tokens); `begin` takes the free slot whose kept tokens share the longest prefix
    with the new prompt (ties and no match: the least recently freed), copies that slot into the engine's cache
    (get_slot, put_slot's reverse) and prefills only the rest from there (the last prompt token always run, for its
    logits), then put_slot copies the whole back, as for a fresh prompt.

    One thread drives it (the engine's lock is the caller's business); `step` returns the requests that left."""

    def __init__(self, g: Graphs, s: State):
        self.g, self.s, self.slots = g, s, g.batch_slots
        self.free = list(range(self.slots))  # KV slots no live request owns
        self.live: dict[int, Request] = {}  # key -> a request still decoding (admission order)
        self.slot: dict[int, int] = {}  # key -> its KV slot
        self.queued: dict[int, int] = {}  # key -> its tokens in flight
        self.started: dict[int, float] = {}  # key -> when its first batched window was dispatched
        self.in_flight: list[tuple[list[int], jax.Array, jax.Array]] = []  # (the window's keys, tokens [B], logits)
        self.cur, self.cur_rows = None, []  # the last window's tokens [B] (on the device) and each row's key
        self.params, self.params_rows = None, None  # the rows' SamplingParams ([B] leaves), for params_rows
        self.admitting: tuple[Request, int, float] | None = None  # (the request, its slot, prefill seconds so far)
        self.next_key = 0
        self.windows_run = 0  # windows dispatched
        self.most_rows = 0  # the most live rows one window ran
        self.reused_tokens = 0  # prompt tokens whose rows a freed slot kept (prefix reuse): not prefilled
        if len(s.slot_tokens) != self.slots:  # a fresh batch cache: no slot holds anything yet
            s.slot_tokens, s.slot_freed = [[] for _ in range(self.slots)], [-1] * self.slots

    def windows(self, form: str | None):
        return self.g.batch_windows(form)

    @property
    def active(self) -> bool:
        """Whether a request is live or a window is in flight (step has work)."""
        return bool(self.live or self.in_flight)

    def admit(self, r: Request) -> bool:
        """Prefill `r` alone into a free KV slot (all its chunks now) and hand its first token to on_token; True
        when it then decodes in the batch (False: it ended at its first token, or has no budget). Needs a free
        slot."""
        if not self.begin(r):
            return False
        while (live := self.advance()) is None:
            pass
        return live

    def begin(self, r: Request) -> bool:
        """Start admitting `r` (one admission at a time): a free KV slot reserved for it, its prefill chunks then
        run one an `advance` (between windows, so the live requests' windows go on). False: nothing to run
        (max_new_tokens 0). The engine's cache holds the admission's rows until it ends: nothing else may write it
        meanwhile."""
        if r.budget < 1:
            return False  # max_new_tokens 0: not prefilled, no row
        if self.admitting is not None:
            raise ValueError("BatchDecoder.begin: an admission is running")
        if not self.free:
            raise ValueError("BatchDecoder.begin: no free KV slot")
        slot, kept = self.pick(r.ids)
        self.free.remove(slot)
        self.s.slot_tokens[slot] = []  # rewritten from here on (put_slot): trusted again when it is freed
        if kept > r.reuse:  # more than the engine's cache holds (its last prompt's rows): the slot's rows there
            try:
                self.s.cache = self.g.get_slot(self.s.batch, self.s.cache, np.int32(slot))
            except BaseException:
                self.release(slot)
                raise
            r.reuse = r.stats.cached_tokens = kept
            self.reused_tokens += kept
        self.admitting = (r, slot, 0.0)
        return True

    def pick(self, ids: np.ndarray) -> tuple[int, int]:
        """The free slot to admit prompt `ids` into, and how many leading prompt tokens its kept rows hold: the
        longest common prefix with a slot's kept tokens, less the last prompt token (always run, for its logits);
        ties and no match: the least recently freed slot (the LRU's victim)."""
        best = None
        for slot in self.free:
            kept = self.s.slot_tokens[slot][:ids.size - 1] if self.g.prefix_reuse else []
            differ = np.flatnonzero(np.asarray(kept, np.int32) != ids[:len(kept)])
            n = int(differ[0]) if differ.size else len(kept)
            if best is None or (-n, self.s.slot_freed[slot]) < best[0]:
                best = ((-n, self.s.slot_freed[slot]), slot, n)
        return best[1], best[2]

    def advance(self) -> bool | None:
        """The admission's next prefill chunk (dispatched, not waited for); after the last one its first token
        (read), its rows into the slot (put_slot) and on_token: True when it decodes on in the batch, False when it
        ended there; None while chunks remain. The chunks are those of its prefill alone (g.prefill_sizes of what
        remains: the same graphs on the same rows), so its tokens are too."""
        r, slot, spent = self.admitting
        try:
            sizes = self.g.prefill_sizes(r.ids.size - r.reuse) if self.g.prefill_sizes else [0]
            if len(sizes) > 1:
                t0 = time.perf_counter()
                end = r.reuse + sizes[0]
                self.g.prefill(r.ids[:end], first=r.reuse, mtp=None)  # its rows written; its token not needed
                r.reuse = end  # the rows the last chunk starts after
                self.admitting = (r, slot, spent + time.perf_counter() - t0)
                return None
            self.admitting = None
            g = dataclasses.replace(self.g, sample=self.g.form_samplers(r.form)) if r.sampled else self.g
            first = prefill(g, self.s, r)
            r.stats.prefill_s += spent
            self.s.batch = self.g.put_slot(self.s.batch, self.s.cache, np.int32(slot))
        except BaseException:
            self.admitting = None
            self.release(slot)  # nothing kept: its rows are not known to be the prompt's
            raise
        if r.on_token:
            r.on_token(first)
        if first in r.stops or len(r.out) >= r.budget:
            self.release(slot, r)
            return False
        self.join(r, slot)
        return True

    def join(self, r: Request, slot: int) -> int:
        """A request whose prompt is in KV slot `slot` (and r.out its first token) joins the batch: its key."""
        if slot in self.free:
            self.free.remove(slot)
        key, self.next_key = self.next_key, self.next_key + 1
        self.live[key], self.slot[key], self.queued[key] = r, slot, 0
        return key

    def release(self, slot: int, r: Request | None = None) -> None:
        """KV slot `slot` free again; with prefix reuse it keeps the rows of request `r` (its last owner, None:
        nothing kept) that can be trusted: those no window still in flight, nor a later one, can overwrite.

        Rows 0..n-1 kept, n = the prompt and every token of r.out but the last: the prompt's rows came from its
        prefill (put_slot), out[i]'s from the window that made out[i + 1], which was read. A window still in
        flight writes only past them: r's own rows at the positions of out[-1] and after (the next token's window
        queued ahead, tokens dropped by `drop`), and a padding row writes a free slot at its first untrusted row
        (`pad_position`). The next owner's put_slot comes after all of these on the device. With an approximation
        on (g.exact_windows False) a batched row's K/V follows the rows beside it: only the prompt's rows are kept.
        """
        if r is not None and self.g.prefix_reuse:
            tokens = r.ids.tolist() + (r.out[:-1] if self.g.exact_windows else [])
            self.s.slot_tokens[slot] = tokens[:self.g.context - 1]
        else:
            self.s.slot_tokens[slot] = []
        self.s.slot_freed[slot], self.s.slot_clock = self.s.slot_clock, self.s.slot_clock + 1
        self.free = sorted(self.free + [slot])

    def pad_position(self, slot: int) -> int:
        """The position a padding row writes in KV slot `slot`: past every row its kept prefix trusts, now and (a
        live request's slot) once its owner leaves: a free slot's first untrusted row (0 for a slot being
        admitted into: put_slot rewrites it after), a live request's first row past its whole budget (it has
        stopped queueing windows: only such a request's slot is padding's when every slot is owned)."""
        for key, owned in self.slot.items():
            if owned == slot:
                r = self.live[key]
                return min(r.ids.size + r.budget - 1, self.g.context - 1)
        return min(len(self.s.slot_tokens[slot]), self.g.context - 1)

    def leave(self, key: int) -> None:
        r = self.live.pop(key)
        self.queued.pop(key)
        self.release(self.slot.pop(key), r)
        if key in self.started:
            r.stats.decode_s = time.perf_counter() - self.started.pop(key)

    def drop(self, r: Request) -> None:
        """End a live request now (its tokens in flight are dropped)."""
        for key, other in list(self.live.items()):
            if other is r:
                self.leave(key)

    def step(self) -> list[Request]:
        """Dispatch one window of the live requests that need tokens; read the oldest window in flight once two
        are queued (or when none was dispatched). Returns the requests that left at the tokens read."""
        g, s = self.g, self.s
        members = [k for k, r in self.live.items() if len(r.out) + self.queued[k] < r.budget]
        if members:
            windows = self.windows(batch_form([self.live[k] for k in members]))
            b = next(size for size in sorted(windows.sizes) if size >= len(members))
            pad = b - len(members)
            if self.cur is not None and self.cur_rows == members and self.cur.shape[0] == b:
                tokens = self.cur  # the same rows as the last window: its tokens as they are, on the device
            elif self.cur is None or not any(k in self.cur_rows for k in members):
                tokens = np.asarray([self.live[k].out[-1] for k in members] + [0] * pad, np.int32)
            else:  # rows left or joined: the others' tokens gathered on the device, a newcomer's from the host
                at = [self.cur_rows.index(k) if k in self.cur_rows else 0 for k in members] + [0] * pad
                new = [k not in self.cur_rows for k in members] + [False] * pad
                host = [self.live[k].out[-1] if k not in self.cur_rows else 0 for k in members] + [0] * pad
                tokens = rows_from(self.cur, np.asarray(at, np.int32), np.asarray(new), np.asarray(host, np.int32))
            owned = {self.slot[k] for k in self.live}
            spare = sorted(set(range(self.slots)) - owned) or sorted(set(range(self.slots)) -
                                                                     {self.slot[k] for k in members})
            slots = [self.slot[k] for k in members] + [spare[0] if pad else 0] * pad
            pos = [self.live[k].ids.size + len(self.live[k].out) - 1 + self.queued[k] for k in members] + \
                [self.pad_position(spare[0]) if pad else 0] * pad
            if self.params_rows != (members, b):
                self.params = batch_sampling([self.live[k].sampling for k in members], pad)
                self.params_rows = (members, b)
            now = time.perf_counter()
            for k in members:
                self.started.setdefault(k, now)
            # offload: the window carries the engine's slot caches (the union of its rows' experts planned and
            # fetched there once) and hands them back
            self.cur, logits, batch = windows[b](s.weights, with_slot_caches(s.batch, s.cache), tokens,
                                                 np.asarray(pos, np.int32), np.asarray(slots, np.int32),
                                                 np.int32(len(members)), self.params)
            s.batch, s.cache = split_slot_caches(batch, s.cache)
            self.cur_rows = members
            self.in_flight.append((members, self.cur, logits))
            self.windows_run += 1
            self.most_rows = max(self.most_rows, len(members))
            for k in members:
                self.queued[k] += 1
                self.live[k].stats.windows += 1
                self.live[k].stats.window_tokens += 1
        left: list[Request] = []
        if self.in_flight and (len(self.in_flight) >= 2 or not members):
            done, tokens_w, logits_w = self.in_flight.pop(0)
            new_tokens = np.asarray(tokens_w)
            rows_logits = None
            if any(k in self.live and self.live[k].logits is not None for k in done):
                rows_logits = np.asarray(logits_w)
            for row, k in enumerate(done):
                if k not in self.live:
                    continue  # left after this window was queued
                self.queued[k] -= 1
                r = self.live[k]
                token = g.checked(int(new_tokens[row]), r.ids.size + len(r.out))
                if r.logits is not None:
                    r.logits.append(rows_logits[row].astype(np.float32))
                if r.emit(token) or len(r.out) >= r.budget:
                    self.leave(k)
                    left.append(r)
        return left


@jax.jit
def rows_from(cur: jax.Array, at: np.ndarray, new: np.ndarray, host: np.ndarray) -> jax.Array:
    """A window's tokens [B] when rows left or joined: row b the last window's row at[b] (on the device), or the
    host's token where new[b] (a newcomer's). One dispatch: the jnp calls it replaces each took one."""
    return jnp.where(new, host, jnp.take(cur, at))


def batch_sampling(params: list[SamplingParams], pad: int) -> SamplingParams:
    """The rows' SamplingParams stacked ([B] leaves), padding rows greedy."""
    rows = params + [SamplingParams.make()] * pad
    return jax.tree.map(lambda *leaves: np.stack(leaves), *rows)  # on the host: no JAX dispatch a leaf
