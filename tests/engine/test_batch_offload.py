"""Batched windows with offload (issue 38): the rows of a batch run as one window's rows through the scanned offload
body, so the union of their experts is planned once, each expert fetched once and the pool's job runs over all the
rows; each prompt still gives the tokens and logits it gives alone (float32: logits within 1e-5, greedy and seeded
sampled tokens identical to generate(spec=0)), under lru at pcie_frac 1 and 0.5, and past one pair of native calls
(B * K > 32 distinct experts: the window's expert list in blocks of 32)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import one_line_refusal, rel_fro
from strata_jax import Engine
from strata_jax.model.config import preset

MAX_BATCH = 4  # buckets 1, 2, 4: three prompts run a padded bucket of 4


def offload_engine(engine_factory, pcie_frac, slots=5, **extra):
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=slots, pcie_frac=pcie_frac,
                          cache_policy="lru", cpu_threads=2, max_batch=MAX_BATCH, **extra)


def random_prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in lengths]


def assert_each_alone(engine, prompts, new, **per):
    """generate_batch's tokens are each prompt's generate(spec=0) tokens, its logits within 1e-5 of the prompt's
    teacher-forced T=1 windows alone."""
    alone = [engine.generate(p, new, stop_token_ids=[], spec=0) for p in prompts]
    outs, logits = engine.generate_batch(prompts, max_new_tokens=new, stop_token_ids=[], return_logits=True, **per)
    assert outs == alone
    for prompt, out, rows in zip(prompts, outs, logits):
        alone_rows = engine.score(prompt + out[:-1], window=1)[len(prompt) - 1:]
        assert rows.shape == (len(out), engine.cfg.vocab_size) and rel_fro(rows, alone_rows) <= 1e-5
    return outs


@pytest.mark.parametrize("pcie_frac", [1.0, 0.5])
def test_offloaded_greedy_batch_equals_alone(engine_factory, pcie_frac):
    engine = offload_engine(engine_factory, pcie_frac)
    assert engine.scanned_offload and engine._batch_refusal() is None
    prompts = random_prompts(engine.cfg.vocab_size, (6, 13, 9), seed=3)
    outs = assert_each_alone(engine, prompts, 8)
    d, cfg = engine.stats.batch[0].decode_experts, preset("tiny")  # the batch's decode windows
    rows = sum(len(o) - 1 for o in outs)  # each prompt's first token came from its prefill
    assert d.entries == rows * cfg.num_experts_per_tok * cfg.num_sparse_layers
    assert d.entries == d.entries_resident + d.entries_fetched + d.entries_cpu
    assert d.distinct_fetched > 0 and d.distinct < d.entries  # experts fetched, rows sharing them
    assert (d.distinct_cpu > 0) == (pcie_frac < 1)


def test_a_batch_wider_than_half_the_slots_is_said(engine_factory):
    """max_batch x K routed experts a layer past half the slots: the start-up says the windows may thrash the
    slots (measured slower than one sequence on a GPU); within them, nothing is said."""
    engine = offload_engine(engine_factory, 1.0)  # 5 slots, K = 4: any batch of 2 rows passes half of them
    (line,) = engine._batch_slots_lines()
    assert f"max_batch={MAX_BATCH}" in line and "against 5 slots" in line
    roomy = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=16, pcie_frac=1.0,
                           cpu_threads=2, max_batch=2)  # 2 rows x 4 experts: half of 16 slots
    assert roomy._batch_slots_lines() == []


def test_offloaded_sampled_batch_equals_alone(engine_factory):
    engine = offload_engine(engine_factory, 0.5)
    prompts = random_prompts(engine.cfg.vocab_size, (7, 12, 4), seed=5)
    settings = [dict(temperature=0.9, seed=11), dict(temperature=0.7, top_k=20, seed=12), dict(temperature=0.0)]
    alone = [engine.generate(p, 9, stop_token_ids=[], spec=0, **o) for p, o in zip(prompts, settings)]
    assert engine.generate_batch(prompts, max_new_tokens=9, stop_token_ids=[], per_prompt=settings) == alone


def test_a_batch_window_fetches_the_union_of_its_experts_once(engine_factory):
    """No slots, pcie_frac 1: every expert a window routes to is fetched. Four copies of one prompt route alike, so
    each window's union is K experts a layer: fetched once (distinct), though four rows use each (entries); the
    native calls copied exactly those experts (the pool's fetch counters), whole."""
    engine = offload_engine(engine_factory, 1.0, slots=0)
    cfg, pool = preset("tiny"), engine.placement.pool
    prompt = random_prompts(engine.cfg.vocab_size, (9,), seed=8)[0]
    new = 6
    alone = engine.generate(prompt, new, stop_token_ids=[], spec=0)
    windows, before = engine.stats.batch_windows, pool.fetch_counters()
    outs = engine.generate_batch([prompt] * 4, max_new_tokens=new, stop_token_ids=[])
    assert outs == [alone] * 4
    d = engine.stats.batch[0].decode_experts
    per_window = cfg.num_experts_per_tok * cfg.num_sparse_layers
    assert engine.stats.batch_windows - windows == new - 1  # every window held the four rows
    assert d.entries == d.entries_fetched == 4 * (new - 1) * per_window
    assert d.distinct == d.distinct_fetched == (new - 1) * per_window  # each expert once a window, not once a row
    if engine.placement.native:
        calls, experts, nbytes = (b - a for a, b in zip(before, pool.fetch_counters()))
        prefills = sum(s.prefill_experts.distinct_fetched for s in engine.stats.batch)
        assert experts == prefills + d.distinct_fetched and nbytes == experts * cfg.expert_bytes(4)


def test_offloaded_session_with_a_request_alone_between_windows(engine_factory):
    """Continuous batching with offload: a request joins the running batch, and a request run alone by generate
    (the server's grammar requests) between two windows uses the same slot caches; every request gets its tokens
    alone."""
    engine = offload_engine(engine_factory, 0.5)
    prompts = random_prompts(engine.cfg.vocab_size, (5, 11, 8), seed=21)
    alone = [engine.generate(p, 7, stop_token_ids=[], spec=0) for p in prompts]
    session = engine.batch_session()
    requests = [session.request(p, max_new_tokens=7, stop_token_ids=[]) for p in prompts[:2]]
    session.admit(requests[0])
    session.step()
    session.admit(requests[1])
    session.step()
    between = engine.generate(prompts[2], 7, stop_token_ids=[], spec=0)
    while session.active:
        session.step()
    assert [r.out for r in requests] == alone[:2] and between == alone[2]


def test_blocks_of_experts_past_one_pair_of_native_calls(engine_factory):
    """The reference model (64 experts top-8), max_batch 8: a window of 8 rows routes up to 64 distinct experts,
    more than one pair of native calls takes (32), so its expert list runs in two blocks under the window's one
    plan (OffloadedExperts.native_window, as a prefill chunk's): tokens and logits each prompt's alone."""
    engine = engine_factory("reference", dtype="float32", window=4, context=128, prefill_chunk=64,
                            expert_cache_slots=12, pcie_frac=0.5, cpu_threads=2, max_batch=8)
    prompts = random_prompts(engine.cfg.vocab_size, (6, 13, 9, 7, 11, 5, 8, 10), seed=3)
    assert_each_alone(engine, prompts, 4)
    if engine.placement.native:
        text = engine.compiled.batch_windows[None][8].as_text()
        assert text.count('custom_call_target="strata_offload_begin') == 2  # one scanned body, two blocks


@pytest.mark.parametrize("variant", [dict(cache_policy="static", pcie_frac=0.5), dict(prefetch=2, pcie_frac=1.0),
                                     dict(verify_defer_cpu="check", pcie_frac=0.5)],
                         ids=["static", "prefetch", "defer-check"])
def test_offload_variants_batch_equals_alone(engine_factory, variant):
    """The static policy (slots filled from each prompt's prefill), prefetch=N (layer l+1's experts predicted on the
    window's rows) and the deferral's bookkeeping mode (the late job over the window's rows, joined in its layer):
    each prompt's tokens and logits alone."""
    engine = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=5, cpu_threads=2,
                            max_batch=MAX_BATCH, **variant)
    assert engine.scanned_offload and engine._batch_refusal() is None
    assert_each_alone(engine, random_prompts(engine.cfg.vocab_size, (6, 13, 9), seed=13), 6)
    d = engine.stats.batch[0].decode_experts
    assert (d.prefetched > 0) == ("prefetch" in variant) and (d.distinct_cpu > 0) == (variant["pcie_frac"] < 1)


def test_what_still_is_not_batched_is_refused_in_one_line():
    one_line_refusal(Engine.from_pretrained, None, verbose=False, dtype="float32", context=64, max_batch=2,
                     expert_cache_slots=4, layer_loop="unrolled", match="max_batch=2: .*layer_loop=unrolled")
    one_line_refusal(Engine.from_pretrained, None, verbose=False, dtype="float32", context=64, max_batch=2,
                     expert_cache_slots=4, pool_calls="layer", match="max_batch=2: .*without the native offload calls")
    # the reference model's top-8: a window of 8 rows may route 64 distinct experts, more than the deferral's one
    # pair of native calls takes
    one_line_refusal(Engine.from_pretrained, "reference", verbose=False, dtype="float32", context=64, window=4,
                     max_batch=8, expert_cache_slots=12, pcie_frac=0.5, verify_defer_cpu="1",
                     match="max_batch=8: the deferral .* one pair of native offload calls")
