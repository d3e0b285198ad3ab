"""Prefix reuse across batched requests (issue 38): the batch cache's KV slots are an LRU of prefixes. A freed slot
keeps its last request's rows (its prompt and every generated token but the last); a prompt that starts with them is
admitted into that slot and prefills only the rest. Each prompt still gives the tokens and logits it gives alone
(float32: logits within 1e-5, greedy tokens identical to generate(spec=0)); the counters show the shared tokens
were not prefilled again; more distinct prefixes than slots evict the least recently freed one."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.engine.api import StopRequest

MAX_BATCH = 4  # test_batch.py's engine (shared): buckets 1, 2, 4


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all",
                          max_batch=MAX_BATCH)


def distinct_prefixes(engine, rng, n, length):
    """n random prefixes whose first tokens differ (no two share even one token of prefix), ids below the eos."""
    firsts = rng.choice(engine.cfg.vocab_size - 1, n, replace=False)
    return [[int(f)] + rng.integers(0, engine.cfg.vocab_size - 1, length - 1).tolist() for f in firsts]


def tail(engine, rng, n, not_first=None):
    """n random tokens, the first one other than `not_first` (so a prompt shares exactly its prefix)."""
    out = rng.integers(0, engine.cfg.vocab_size - 1, n).tolist()
    while out[0] == not_first:
        out[0] = int(rng.integers(0, engine.cfg.vocab_size - 1))
    return out


def batch_equals_alone(engine, prompts, new):
    """generate_batch's tokens and logits against each prompt alone; returns the tokens and the per-prompt stats."""
    alone = [engine.generate(p, new, stop_token_ids=[], spec=0) for p in prompts]
    before = engine.stats.batch_reused_tokens
    outs, logits = engine.generate_batch(prompts, max_new_tokens=new, stop_token_ids=[], return_logits=True)
    cached = [s.cached_tokens for s in engine.stats.batch]
    assert engine.stats.batch_reused_tokens - before == sum(cached) == engine.stats.last.cached_tokens
    assert outs == alone
    for prompt, out, rows in zip(prompts, outs, logits):
        alone_rows = engine.score(prompt + out[:-1], window=1)[len(prompt) - 1:]
        assert rows.shape == (len(out), engine.cfg.vocab_size) and rel_fro(rows, alone_rows) <= 1e-5
    return outs, cached


def test_two_rounds_reuse_the_slots_prefixes(engine):
    """Round 1: four prompts with long distinct prefixes (every slot then holds one). Round 2: conversations go on
    (the prompt, its reply, a new turn: every row kept but the reply's last token), and a prompt shares only round
    1's prompt 1; generate_batch admits them in order, each into the free slot holding its longest prefix."""
    rng = np.random.default_rng(3801)
    prefixes = distinct_prefixes(engine, rng, 4, 20)
    first = [p + tail(engine, rng, 4) for p in prefixes]
    outs, _ = batch_equals_alone(engine, first, 6)
    conversation = [p + o + tail(engine, rng, 5) for p, o in zip(first, outs)]
    # round 1's prompt 1 and a tail other than its reply: only the prompt's rows are shared
    second = [conversation[0], first[1] + tail(engine, rng, 3, not_first=outs[1][0]), conversation[2],
              conversation[1]]
    outs2, cached = batch_equals_alone(engine, second, 6)
    # the last one's slot was taken by the second: it shares nothing with the one left (prompt 3's, evicted)
    assert cached == [len(first[0]) + 5, len(first[1]), len(first[2]) + 5, 0]
    # a third turn of conversation 0: its slot now holds round 2's rows
    third = [second[0] + outs2[0] + tail(engine, rng, 2)]
    _, cached = batch_equals_alone(engine, third, 4)
    assert cached == [len(second[0]) + 5]


def test_more_prefixes_than_slots_evict_the_least_recently_freed(engine):
    """Five distinct prefixes through four slots: the fifth evicts the first (the least recently freed); the first
    then prefills whole (into the next victim, the second's slot) while the third and the fifth are still reused,
    every prompt's tokens those it gives alone."""
    rng = np.random.default_rng(3802)
    prefixes = distinct_prefixes(engine, rng, 5, 16)
    prompts = [p + tail(engine, rng, 3) for p in prefixes]
    batch_equals_alone(engine, prompts[:4], 5)  # every slot rewritten, freed in order 0, 1, 2, 3
    _, cached = batch_equals_alone(engine, prompts[4:], 5)
    assert cached == [0]  # into slot of prefix 0 (the least recently freed): evicted
    again = [prefixes[i] + tail(engine, rng, 4, not_first=prompts[i][len(prefixes[i])]) for i in (0, 2, 4)]
    _, cached = batch_equals_alone(engine, again, 5)
    assert cached == [0, len(prefixes[2]), len(prefixes[4])]  # prefix 0 was evicted (and now prefix 1 too)
    _, cached = batch_equals_alone(engine, [prefixes[1] + tail(engine, rng, 2)], 3)
    assert cached == [0]


def test_session_reuses_a_slot_written_around_by_padding(engine):
    """A BatchSession: three live requests run a padded bucket of 4, the padding row writing the free fourth slot
    (past the prefix it keeps, never into it); a request that stops (StopRequest) frees its slot while its next
    window is still in flight. Newcomers admitted then reuse both slots' prefixes, every request's tokens those it
    gives alone."""
    rng = np.random.default_rng(3803)
    prefixes = distinct_prefixes(engine, rng, 5, 18)
    prompts = [p + tail(engine, rng, 3) for p in prefixes]
    batch_equals_alone(engine, prompts[:4], 4)  # every slot holds one of prompts 0..3, freed in that order
    fresh = [prompts[4], prompts[1], prefixes[0] + tail(engine, rng, 2, not_first=prompts[0][18])]
    alone = [engine.generate(p, n, stop_token_ids=[], spec=0) for p, n in zip(fresh, (12, 3, 12))]
    later = [prefixes[3] + tail(engine, rng, 3, not_first=prompts[3][18]),
             prompts[1] + alone[1] + tail(engine, rng, 2)]  # prompt 1's conversation goes on
    alone += [engine.generate(p, 8, stop_token_ids=[], spec=0) for p in later]
    session = engine.batch_session()
    seen = []

    def stop_at_three(token):
        seen.append(token)
        if len(seen) == 3:
            raise StopRequest  # read one window late: its next window is in flight when it leaves
    requests = [session.request(fresh[0], max_new_tokens=12, stop_token_ids=[]),
                session.request(fresh[1], max_new_tokens=12, stop_token_ids=[], on_token=stop_at_three),
                session.request(fresh[2], max_new_tokens=12, stop_token_ids=[])]
    for r in requests:
        assert session.admit(r)
    # prompt 4 shares nothing (into the least recently freed slot, prompt 0's), prompt 1 all of its prompt but the
    # last token (run again for its logits); the third shares nothing with the free slots left (prompt 2's taken)
    assert [r.stats.cached_tokens for r in requests] == [0, len(prompts[1]) - 1, 0]
    steps = 0
    while any(r is requests[1] for r in session.live):  # three rows: the padding row writes prompt 3's free slot
        session.step()
        steps += 1
    assert steps >= 2 and len(session.live) == 2
    for p in later:  # request 1 just left, its next window in flight
        requests.append(session.request(p, max_new_tokens=8, stop_token_ids=[]))
        assert session.admit(requests[-1])
        session.step()
    while session.active:
        session.step()
    assert [r.out for r in requests] == alone
    assert [r.stats.cached_tokens for r in requests[3:]] == [len(prefixes[3]), len(prompts[1]) + len(alone[1]) - 1]


def test_prefix_reuse_off_keeps_nothing(engine_factory):
    """prefix_reuse=False: a freed slot keeps nothing, every prompt prefills whole, the same tokens."""
    engine = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all", max_batch=2,
                            prefix_reuse=False)
    rng = np.random.default_rng(3804)
    prompts = [p + tail(engine, rng, 3) for p in distinct_prefixes(engine, rng, 2, 16)]
    outs, cached = batch_equals_alone(engine, prompts, 4)
    _, cached2 = batch_equals_alone(engine, [p + o for p, o in zip(prompts, outs)], 4)
    assert cached == cached2 == [0, 0] and engine.stats.batch_reused_tokens == 0
