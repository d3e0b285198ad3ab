"""Decoding on the embedded tiny model: window independence, greedy/teacher-forced consistency, sampling, stops,
limits and refusals, and the byte-level tokenizer."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import one_line_refusal, rel_fro
from strata_jax import Engine
from strata_jax.sampling import SamplingParams, filtered_logits, sample

W = 4


@pytest.fixture(scope="module")
def engine(embedded_engine):
    assert embedded_engine.options.window == W
    return embedded_engine


def random_ids(engine, n, seed):
    # The byte-level vocabulary's last id is <|endoftext|>, the embedded model's eos: keep it out of prompts.
    return np.random.default_rng(seed).integers(0, engine.cfg.vocab_size - 1, n).tolist()


# ---- exactness across window sizes and graphs ------------------------------------------------------------------

def test_score_window_independent(engine):
    ids = random_ids(engine, 31, seed=1)  # 31 tokens: several windows of every size, a partial last window
    ref = engine.score(ids, window=1)
    assert ref.shape == (31, engine.cfg.vocab_size)
    for w in range(2, W + 1):
        # float32, same math in a different window shape: 1e-5 relative Frobenius over the whole [31, V]
        assert rel_fro(engine.score(ids, window=w), ref) <= 1e-5, w
    # ... and the prefill graph (one padded chunk) agrees too
    assert rel_fro(engine.prefill_logits(ids), ref) <= 1e-5


def test_greedy_is_argmax_of_teacher_forced_scores(engine):
    prompt = random_ids(engine, 9, seed=2)
    out = engine.generate(prompt, 20, stop_token_ids=[])
    assert len(out) == 20
    rows = engine.score(prompt + out[:-1])[len(prompt) - 1:]  # row P-1+t predicts generated token t
    assert np.argmax(rows, axis=1).tolist() == out
    assert len(set(out)) > 1  # not a degenerate constant continuation


def test_on_token_streams_the_result(engine):
    prompt = random_ids(engine, 7, seed=3)
    seen = []
    out = engine.generate(prompt, 10, temperature=0.9, seed=4, stop_token_ids=[], on_token=seen.append)
    assert seen == out and len(out) == 10


# ---- sampling ------------------------------------------------------------------------------------------------------

def test_same_seed_same_tokens(engine):
    prompt = random_ids(engine, 8, seed=5)
    first = engine.generate(prompt, 16, temperature=1.0, seed=1234, stop_token_ids=[])
    engine.generate(random_ids(engine, 20, seed=6), 5, temperature=1.0, seed=99)  # other work in between
    assert engine.generate(prompt, 16, temperature=1.0, seed=1234, stop_token_ids=[]) == first


def test_different_seeds_differ(engine):
    prompt = random_ids(engine, 8, seed=5)
    greedy = engine.generate(prompt, 16, stop_token_ids=[])
    runs = [tuple(engine.generate(prompt, 16, temperature=1.0, seed=s, stop_token_ids=[])) for s in range(1, 5)]
    # 16 draws at temperature 1 from a ~257-way distribution: equal sequences across seeds would mean a fixed key
    assert len(set(runs)) == len(runs), runs
    assert any(list(r) != greedy for r in runs)


@pytest.mark.parametrize("options", [dict(temperature=0.8, top_k=1), dict(temperature=1.5, top_p=1e-6),
                                     dict(temperature=1.0, top_k=1, top_p=0.5)])
def test_degenerate_sampling_is_greedy(engine, options):
    prompt = random_ids(engine, 8, seed=7)
    greedy = engine.generate(prompt, 12, stop_token_ids=[])
    for seed in (0, 17):
        assert engine.generate(prompt, 12, seed=seed, stop_token_ids=[], **options) == greedy


def np_filtered(x, temperature, top_k, top_p):
    """Reference: temperature, top-k, then the smallest set of top tokens (renormalised after top-k) whose mass
    reaches top_p (transformers' TopK then TopP warpers). Returns (kept indices, scaled logits, the top-p margin)."""
    s = np.asarray(x, np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(s[order] - s[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    if top_p >= 1.0:  # off
        return set(order.tolist()), s, np.inf
    keep = before < top_p
    keep[0] = True
    margin = np.min(np.abs(before[1:] - top_p)) if len(before) > 1 else np.inf
    return set(order[keep].tolist()), s, margin


@pytest.mark.parametrize("v,seed", [(8, 20), (64, 21)])
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (1.0, 3, 1.0), (0.7, 1, 1.0), (1.0, 0, 0.5), (1.3, 0, 0.9), (0.5, 5, 0.8), (2.0, 100, 0.3),
])
def test_filtered_logits_matches_numpy(v, seed, temperature, top_k, top_p):
    x = np.random.default_rng(seed).standard_normal(v).astype(np.float32) * 2.0
    kept, scaled, margin = np_filtered(x, temperature, top_k, top_p)
    assert margin > 1e-4, "the random vector puts a cumulative mass next to top_p; pick another seed"
    got = np.asarray(filtered_logits(jnp.asarray(x), SamplingParams.make(temperature, top_p, top_k)))
    assert set(np.flatnonzero(np.isfinite(got)).tolist()) == kept
    assert np.all(np.isneginf(got[~np.isfinite(got)]))
    idx = sorted(kept)
    # kept logits are the temperature-scaled inputs: float32 division, 1e-6 relative per element
    np.testing.assert_allclose(got[idx], scaled[idx], rtol=1e-6)
    if top_k > 0:
        assert len(kept) <= top_k
        assert set(np.argsort(-x)[:len(kept)].tolist()) == kept  # the kept set is a top slice of x


@pytest.mark.parametrize("scale", [4.0, 0.2])  # a peaked vocabulary and a flat one
def test_every_filter_form_keeps_what_the_sort_keeps(scale):
    """filter_rows in the form a request's settings get (sampling.form_of) keeps the same tokens with the same
    values as a sort of the whole vocabulary, and the seeded draws are the same tokens: "top_k" (1 <= top_k <= 64:
    the top-k set by radix select, top-p over it, no sort), "top_p" (top-k off: a threshold by radix select, no
    sort), "plain" (top-k and top-p off: nothing filtered); tests/engine/test_sampling.py checks both radix selects
    on ties."""
    from strata_jax import sampling
    v, t = 3000, 3
    logits = jnp.asarray(np.random.default_rng(int(scale * 10)).standard_normal((t, v)).astype(np.float32) * scale)
    positions = jnp.arange(t, dtype=jnp.int32) + 11
    ref = jax.jit(jax.vmap(sampling._sorted_filter, in_axes=(0, None)))
    filt = {form: jax.jit(functools.partial(sampling.filter_rows, form=form)) for form in sampling.FORMS}
    forms = set()
    for temperature, top_k, top_p in ((0.7, 20, 0.8), (1.0, 64, 1.0), (1.0, 65, 0.95), (0.6, 0, 0.9), (1.0, 1, 0.5),
                                      (1.2, 0, 0.3), (0.8, 0, 1.0), (1.0, 300, 1.0)):
        params = SamplingParams.make(temperature, top_p, top_k, seed=3)
        form = sampling.form_of(top_k, top_p)
        forms.add(form)
        assert form == ("plain" if (top_k, top_p) == (0, 1.0) else "top_p" if top_k == 0 else
                        "top_k" if 0 < top_k <= 64 else "sorted")
        got, want = np.asarray(filt[form](logits, params)), np.asarray(ref(logits / temperature, params))
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), (temperature, top_k, top_p)
        np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
        assert np.array_equal(np.asarray(sampling.sample_filtered(logits, jnp.asarray(got), positions, params)),
                              np.asarray(sampling.sample_filtered(logits, jnp.asarray(want), positions, params)))
    assert forms == set(sampling.FORMS)
    with pytest.raises(ValueError, match="not one of"):
        sampling.filter_rows(logits, SamplingParams.make(1.0), form="fast")


@pytest.mark.parametrize("top_k", [0, 200])
def test_top_p_one_keeps_everything(top_k):
    """top_p=1 is off even when the tail's probabilities vanish in float32 (logits spread over ~40 units)."""
    x = np.random.default_rng(23).standard_normal(257).astype(np.float32) * 8.0
    got = np.asarray(filtered_logits(jnp.asarray(x), SamplingParams.make(1.0, 1.0, top_k)))
    assert np.isfinite(got).sum() == (top_k or 257)


def test_sample_distribution():
    """Draws (one key per position) follow softmax(filtered logits)."""
    rng = np.random.default_rng(22)
    x = jnp.asarray(rng.standard_normal(6).astype(np.float32))
    params = SamplingParams.make(temperature=0.8, top_p=0.9, top_k=4, seed=7)
    n = 6000
    draws = np.asarray(jax.jit(sample)(jnp.broadcast_to(x, (n, 6)), jnp.arange(n, dtype=jnp.int32), params))
    freq = np.bincount(draws, minlength=6) / n
    expected = np.asarray(jax.nn.softmax(filtered_logits(x, params)))
    # n = 6000 draws: a frequency's standard deviation is <= sqrt(0.25 / 6000) ~ 0.0065; 0.03 max-abs is > 4.5 sigma
    np.testing.assert_allclose(freq, expected, atol=0.03)
    assert np.all(freq[expected == 0] == 0)  # filtered tokens are never drawn


# ---- stopping and limits -------------------------------------------------------------------------------------------

def test_stop_token_ends_generation(engine):
    prompt = random_ids(engine, 10, seed=8)
    greedy = engine.generate(prompt, 20, stop_token_ids=[])
    # the first token at index >= 2 that greedy has not produced before: stopping on it ends there
    i = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    never = next(t for t in range(engine.cfg.vocab_size) if t not in greedy)
    out = engine.generate(prompt, 20, stop_token_ids=[never, greedy[i]])
    assert out == greedy[:i + 1]
    assert engine.stats.last.generated_tokens == i + 1


def test_eos_ends_generation_unless_ignored(engine, monkeypatch):
    """The model's eos ids stop a request (the eos is the last token); ignore_eos runs on to max_new_tokens with the
    same tokens; given stop_token_ids still stop with ignore_eos."""
    import dataclasses
    prompt = random_ids(engine, 10, seed=18)
    greedy = engine.generate(prompt, 16, stop_token_ids=[])
    i = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, eos_token_ids=(greedy[i],)))
    assert engine.generate(prompt, 16) == greedy[:i + 1]
    assert engine.generate(prompt, 16, ignore_eos=True) == greedy
    assert engine.generate(prompt, 16, ignore_eos=True, stop_token_ids=[greedy[i]]) == greedy[:i + 1]
    assert "ignore_eos" in one_line_refusal(engine.generate, prompt, 4, ignore_eos="yes")


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_max_new_tokens(engine, n):
    prompt = random_ids(engine, 6, seed=9)
    greedy = engine.generate(prompt, 12, stop_token_ids=[])
    assert engine.generate(prompt, n, stop_token_ids=[]) == greedy[:n]


def test_prompt_not_shorter_than_context_refused_before_any_work(engine, monkeypatch):
    before = engine.score(random_ids(engine, 12, seed=10))
    requests = engine.stats.requests

    def no_work(*args, **kwargs):
        raise AssertionError("a graph ran for a refused request")
    monkeypatch.setattr(engine.compiled, "prefill", {c: no_work for c in engine.chunks})
    monkeypatch.setattr(engine.compiled, "decode", {t: no_work for t in range(1, W + 1)})
    for n in (engine.context, engine.context + 9):
        ids = random_ids(engine, n, seed=11)
        for call in (lambda: engine.generate(ids, 4), lambda: engine.score(ids), lambda: engine.prefill_logits(ids)):
            msg = one_line_refusal(call)
            assert str(n) in msg and "context" in msg
    assert engine.stats.requests == requests
    monkeypatch.undo()
    assert np.array_equal(engine.score(random_ids(engine, 12, seed=10)), before)  # the engine still works


@pytest.mark.parametrize("ids", [[], [-1, 3], "vocab"])
def test_bad_token_ids_refused(engine, ids):
    if ids == "vocab":
        ids = [5, engine.cfg.vocab_size]
    one_line_refusal(engine.generate, ids, 4)


def test_context_exhausted_stops_at_context_end(engine):
    prompt = random_ids(engine, engine.context - 5, seed=12)
    out = engine.generate(prompt, 20, stop_token_ids=[])
    assert len(out) == 5 and len(prompt) + len(out) == engine.context
    # the last cache positions are written and read correctly: same tokens as the teacher-forced argmax
    rows = engine.score(prompt + out[:-1])[len(prompt) - 1:]
    assert np.argmax(rows, axis=1).tolist() == out
    # one slot left: exactly one token
    assert len(engine.generate(prompt + out[:4], 20, stop_token_ids=[])) == 1


@pytest.mark.parametrize("option,value", [
    ("top_p", 0.0), ("top_p", 1.5), ("temperature", -1.0), ("temperature", float("nan")), ("top_k", -1),
    ("top_k", 2.5), ("max_new_tokens", -1), ("seed", -1),
])
def test_bad_request_options_refused(engine, option, value):
    prompt = random_ids(engine, 5, seed=13)
    kwargs = {"max_new_tokens": 4, option: value}
    msg = one_line_refusal(engine.generate, prompt, **kwargs)
    assert option in msg


@pytest.mark.parametrize("window", [W + 1, -1, 0])
def test_score_uncompiled_window_refused(engine, window):
    msg = one_line_refusal(engine.score, random_ids(engine, 5, seed=14), window=window)
    assert "window" in msg


@pytest.mark.parametrize("options,name", [
    (dict(windw=4), "windw"), (dict(temperature=0.5), "temperature"), (dict(window=0), "window"),
    (dict(window=17), "window"), (dict(dtype="float16"), "dtype"), (dict(prefill_chunk=-1), "prefill_chunk"),
    (dict(context=-1), "context"),
])
def test_bad_engine_options_refused(cache_dir, options, name):
    msg = one_line_refusal(Engine.from_pretrained, None, verbose=False, cache_dir=str(cache_dir), **options)
    assert name in msg


# ---- tokenizer -----------------------------------------------------------------------------------------------------

def random_text(rng, n):
    ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(n):
        lo, hi = ranges[rng.integers(len(ranges))]
        chars.append(chr(int(rng.integers(lo, hi + 1))))
        if rng.random() < 0.05:
            chars.append("\n\t "[rng.integers(3)])
    return "".join(chars)


def test_byte_tokenizer_round_trips_unicode(engine):
    rng = np.random.default_rng(15)
    for n in (1, 40, 300):
        text = random_text(rng, n)
        ids = engine.encode(text)
        assert ids == list(text.encode("utf-8"))  # token id = byte value
        assert engine.decode(ids) == text
    assert engine.encode("<|endoftext|>") == list(engine.cfg.eos_token_ids)


def test_text_round_trip_through_generate(engine):
    text = random_text(np.random.default_rng(16), 6)  # <= 24 bytes: fits the 64-token context
    out = engine.generate(engine.encode(text), 6, stop_token_ids=[])
    assert engine.decode(engine.encode(text) + out).startswith(text)


def test_text_stream_hands_out_whole_characters(engine):
    """Byte tokens pushed one at a time: the pieces join to the whole text, and none ends inside a character (a
    4-byte emoji is held back until its last byte)."""
    from strata_jax.io.tokenizer import TextStream
    text = random_text(np.random.default_rng(17), 200)
    stream = TextStream(engine.decode)
    pieces = [stream.push(t) for t in engine.encode(text)]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) >= 200  # multi-byte characters wait for their last byte


def test_stream_yields_what_generate_returns_and_stops_when_closed(engine):
    prompt = random_ids(engine, 9, seed=19)
    want = engine.generate(prompt, 12, stop_token_ids=[])
    assert list(engine.stream(prompt, max_new_tokens=12, stop_token_ids=[])) == want
    it = engine.stream(prompt, max_new_tokens=12, stop_token_ids=[])
    assert [next(it) for _ in range(3)] == want[:3]
    it.close()  # the consumer has gone: the request ends at its next token, cleanly
    # the engine runs ahead of the consumer (its windows queue one ahead), so it may have made more than 4 by then
    assert 4 <= engine.stats.last.generated_tokens <= 12
    assert engine.generate(prompt, 12, stop_token_ids=[]) == want  # and the engine serves the next one
    assert engine.stats.last.cached_tokens == 8  # the stopped request's rows were kept


def test_stop_request_in_on_token_ends_the_request_cleanly(engine):
    from strata_jax import StopRequest
    prompt = random_ids(engine, 9, seed=22)
    want = engine.generate(prompt, 12, stop_token_ids=[])

    def stop_at_five(token):
        if len(seen) == 4:
            raise StopRequest
        seen.append(token)
    seen: list[int] = []
    out = engine.generate(prompt, 12, stop_token_ids=[], on_token=stop_at_five)
    assert out == want[:5] and seen == want[:4] and engine.stats.last.generated_tokens == 5
    assert "max_new_tokens" in one_line_refusal(lambda: list(engine.stream(prompt, max_new_tokens=-1)))


def test_engine_calls_from_inside_a_running_request_are_refused_and_leave_it_intact(engine):
    """generate / score / reconfigure / stream called from a request's on_token or its Drafter would run inside
    that request, on its KV cache: each is one StrataError line there (stream: no deadlock), the outer request's
    tokens are the plain ones, and the next requests are exact."""
    import threading
    from strata_jax import StrataError
    prompt = random_ids(engine, 9, seed=31)
    want = engine.generate(prompt, 10, stop_token_ids=[])
    calls = {"generate": lambda: engine.generate(prompt, 3), "score": lambda: engine.score(prompt),
             "reconfigure": lambda: engine.reconfigure(cache_policy="lru"),
             "stream": lambda: list(engine.stream(prompt, max_new_tokens=3))}
    for name, call in calls.items():
        refusals = []

        def on_token(token, call=call):
            try:
                call()
            except StrataError as e:
                refusals.append(str(e))
        done = []
        worker = threading.Thread(target=lambda: done.append(engine.generate(prompt, 10, stop_token_ids=[],
                                                                             on_token=on_token)), daemon=True)
        worker.start()
        worker.join(120)
        assert done, f"{name} from on_token hung the engine"
        assert done[0] == want and len(refusals) == 10, (name, refusals[:1])
        assert f"engine.{name}() called from inside a running request" in refusals[0] and "\n" not in refusals[0]

    class Reentrant:  # a Drafter that calls the engine: refused, and generate() raises it
        def propose(self, tokens, k):
            return engine.score(list(tokens))

        def observe(self, accepted):
            pass
    assert "from inside a running request" in one_line_refusal(lambda: engine.generate(prompt, 4, draft=Reentrant()))
    assert engine.generate(prompt, 10, stop_token_ids=[]) == want and engine.stats.last.cached_tokens == 0


# ---- prefix reuse ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("slots", ["all", 4])
def test_prefix_reuse_prefills_only_the_new_part_and_matches_a_cold_run(engine_factory, slots):
    """A second turn that extends the first (its prompt, its answer, new text) prefills only the new tokens; its
    first-token logits and its tokens equal a cold engine's (float32: summation order only), resident or offloaded."""
    opts = dict(dtype="float32", window=4, context=64, expert_cache_slots=slots)
    warm, cold = engine_factory(None, **opts), engine_factory(None, prefix_reuse=False, **opts)
    rng = np.random.default_rng(21)
    turn1 = rng.integers(0, 255, 11).tolist()
    out1 = warm.generate(turn1, 6, stop_token_ids=[])
    turn2 = turn1 + out1 + rng.integers(0, 255, 5).tolist()
    out2 = warm.generate(turn2, 6, stop_token_ids=[])
    assert warm.stats.last.cached_tokens == len(turn1) + len(out1) - 1  # the last answer token was never fed back
    assert out2 == cold.generate(turn2, 6, stop_token_ids=[]) and cold.stats.last.cached_tokens == 0
    # the logits themselves: the prefill of turn 2 from the reused rows against a cold prefill of all of it
    warm.generate(turn1 + out1, 1, stop_token_ids=[])
    ids = np.asarray(turn2, np.int32)
    reuse = warm._reusable(ids)
    assert reuse == len(turn1) + len(out1)
    _, warm_logits = warm._prefill_all(ids, first=reuse)
    _, cold_logits = cold._prefill_all(ids)
    assert rel_fro(np.asarray(warm_logits), np.asarray(cold_logits)) <= 1e-5
    # a prompt that differs early reuses only the common part; score() leaves nothing to reuse
    other = turn1[:3] + [(turn1[3] + 1) % 255] + turn1[4:]
    warm.generate(other, 2, stop_token_ids=[])
    assert warm.stats.last.cached_tokens == 3
    warm.score(other[:8], window=4)
    warm.generate(other, 2, stop_token_ids=[])
    assert warm.stats.last.cached_tokens == 0


def test_plain_sampler_draws_the_filtered_samplers_tokens_when_top_k_and_top_p_are_off():
    """The sampler without a filter (requests with top_k 0 and top_p 1) draws exactly the tokens of the sorted
    one, in sampling and in speculative verification; with a filter on, the two differ."""
    from strata_jax.engine import graphs
    from strata_jax.sampling import verify
    jit_verify = jax.jit(verify, static_argnums=4)  # as the engine's graphs run it (op by op: ~80 compiles)
    rng = np.random.default_rng(13)
    logits = jnp.asarray(rng.normal(size=(64, 257)) * 3, jnp.float32)  # [T, V]
    positions = jnp.arange(100, 164, dtype=jnp.int32)
    for temperature, seed in ((1.0, 3), (0.7, 11)):
        params = SamplingParams.make(temperature, 1.0, 0, seed)
        filtered = graphs.jit_sample("sorted")(logits, positions, params)
        assert np.array_equal(graphs.jit_sample("plain")(logits, positions, params), filtered)
        assert len(set(np.asarray(filtered).tolist())) > 10  # sampled, not argmax
        drafts = jnp.asarray(rng.integers(0, 257, 63), jnp.int32)
        a, b = jit_verify(logits, drafts, positions, params, "sorted"), jit_verify(logits, drafts, positions, params,
                                                                                 "plain")
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    top_k = SamplingParams.make(1.0, 1.0, 5, 3)
    assert not np.array_equal(graphs.jit_sample("sorted")(logits, positions, top_k),
                              graphs.jit_sample("plain")(logits, positions, top_k))


def test_samplers_compile_once_per_process_on_first_use_and_engines_share_them(engine):
    """graphs.window_samplers: one set per (form, W, V) in a process, each graph compiled on its first use (a
    greedy request never runs a sampler; a sampled one whose windows draw in their own graph needs only the first
    token's), the same tokens as the jitted function; the engine holds the shared set."""
    from strata_jax.engine import graphs
    from strata_jax.sampling import FORMS
    form = graphs.window_samplers("plain", 2, 37)  # a vocabulary no engine of the suite has: not compiled yet
    assert not form.compiled and dict(form.sample) == {} and dict(form.verify) == {}
    assert form.compile() > 0 and form.compiled and sorted(form.sample) == [1, 2] and sorted(form.verify) == [2]
    assert form.compile() == 0.0 and graphs.window_samplers("plain", 2, 37) is form
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(2, 37)) * 3, jnp.float32)
    positions, params = jnp.asarray([7, 8], jnp.int32), SamplingParams.make(1.0, 1.0, 0, 9)
    assert np.array_equal(form.sample[2](logits, positions, params),
                          graphs.jit_sample("plain")(logits, positions, params))
    for f in FORMS:
        assert engine.compiled.samplers[f] is graphs.window_samplers(f, W, engine.cfg.vocab_size)
    engine.generate(random_ids(engine, 5, seed=15), 3, temperature=1.0, top_k=3, seed=2, stop_token_ids=[])
    assert 1 in engine.compiled.samplers["top_k"].sample


def test_engines_of_the_same_shapes_share_executables_and_each_computes_its_own_weights(cache_dir):
    """graphs.compile_shared: a second engine whose graphs lower to the same modules builds without one backend
    compile (nor a read of the persistent cache), and its shared executables compute its own weights' logits, the
    same as the plain jitted graph over them; an engine of other shapes compiles its own."""
    from jax import monitoring
    from strata_jax.engine import graphs
    from strata_jax.model.config import preset
    compiles = []

    def count(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration") or "compilation_cache" in event:
            compiles.append((event.rsplit("/", 1)[-1], kwargs.get("fun_name")))
    opts = dict(dtype="float32", window=2, context=32, expert_cache_slots="all", prefill_chunk=8, verbose=False,
                cache_dir=str(cache_dir), compile_graphs="ahead")
    cfg = preset("tiny")
    first = Engine.from_random(cfg, seed=21, **opts)
    monitoring.register_event_duration_secs_listener(count)
    try:
        second = Engine.from_random(cfg, seed=22, **opts)
        assert compiles == []
        assert second.compiled.decode[2] is first.compiled.decode[2] and second.compiled.prefill[8] is first.compiled.prefill[8]
        ids = random_ids(second, 6, seed=23)
        got, other = second.score(ids, window=2), first.score(ids, window=2)
        assert rel_fro(got, other) > 0.1  # other weights, other logits
        step, cache, want = graphs.jit_decode_window(second.cfg), jax.tree.map(jnp.copy, second.cache), []
        with second.compiled.full_f32():  # the precision the engine compiles at
            for i in range(0, 6, 2):
                _, logits, cache = step(second.weights, cache, jnp.asarray(ids[i:i + 2], jnp.int32), jnp.int32(i))
                want.append(np.asarray(logits))
        assert rel_fro(got, np.concatenate(want)) <= 1e-5
        wider = Engine.from_random(cfg, seed=22, **{**opts, "context": 48})
        assert compiles and wider.compiled.decode[2] is not second.compiled.decode[2]
    finally:
        monitoring.unregister_event_duration_listener(count)


def test_lazy_graphs_compile_on_first_use_and_give_what_ahead_gives(cache_dir, capfd):
    """compile_graphs=lazy: nothing compiled at start-up (its line says so), each window size and prefill chunk
    compiled by the first request that runs it, once; the logits and tokens are ahead's, bit for bit."""
    from strata_jax.model.config import preset
    opts = dict(dtype="float32", window=3, context=48, expert_cache_slots="all", prefill_chunk=8,
                cache_dir=str(cache_dir))
    ahead = Engine.from_random(preset("tiny"), seed=24, verbose=False, compile_graphs="ahead", **opts)
    assert sorted(ahead.compiled.decode) == [1, 2, 3] and sorted(ahead.compiled.prefill) == [8]
    capfd.readouterr()
    lazy = Engine.from_random(preset("tiny"), seed=24, verbose=True, compile_graphs="lazy", **opts)
    assert "compiled each on its first use (compile_graphs=lazy)" in capfd.readouterr().err
    assert dict(lazy.compiled.decode) == {} and dict(lazy.compiled.prefill) == {}
    ids = random_ids(lazy, 7, seed=25)
    assert np.array_equal(lazy.score(ids, window=2), ahead.score(ids, window=2))
    assert sorted(lazy.compiled.decode) == [1, 2] and dict(lazy.compiled.prefill) == {}  # 7 = 2+2+2+1: sizes 2 and 1 only
    graph = lazy.compiled.decode[2]
    assert lazy.compiled.decode[2] is graph  # compiled once
    assert lazy.generate(ids, 6, stop_token_ids=[]) == ahead.generate(ids, 6, stop_token_ids=[])
    assert 8 in lazy.compiled.prefill
    with pytest.raises(KeyError):
        lazy.compiled.decode[4]  # beyond W: no graph of that size


def test_requests_pick_the_plain_sampler_only_without_top_k_and_top_p(engine):
    """Each request's samplers are those of its filter form (sampling.form_of): top_p alone the sort-free "top_p",
    a top_k beyond the candidates "sorted"."""
    prompt = random_ids(engine, 5, seed=14)
    engine.generate(prompt, 3, temperature=1.0, seed=1, stop_token_ids=[])
    assert engine.compiled.sample is engine.compiled.samplers["plain"].sample
    engine.generate(prompt, 3, temperature=1.0, top_k=4, seed=1, stop_token_ids=[])
    assert engine.compiled.sample is engine.compiled.samplers["top_k"].sample
    engine.generate(prompt, 3, temperature=1.0, top_p=0.9, seed=1, stop_token_ids=[])
    assert engine.compiled.sample is engine.compiled.samplers["top_p"].sample
    engine.generate(prompt, 3, temperature=1.0, top_k=100, top_p=0.9, seed=1, stop_token_ids=[])
    assert engine.compiled.sample is engine.compiled.samplers["sorted"].sample