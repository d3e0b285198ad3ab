"""Verify windows: drafts change how many windows a request takes, never what it says.

Greedy: the output is identical with speculation on and off (any window size, offload on or off). Sampling: a
fixed seed reproduces the output, and speculative rejection sampling draws from the same distribution as plain
sampling (checked on the sampler itself with 40,000 draws, and end to end on the tiny model).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_cli
from strata_jax import StrataError
from strata_jax.speculative.drafters import DraftGate, NgramDrafter
from strata_jax.sampling import SamplingParams, filtered_logits, verify

W = 5


@pytest.fixture(scope="module")
def prompt():
    # Repeats give the n-gram drafter something to find; the random tail keeps it from being trivial.
    rng = np.random.default_rng(4)
    motif = rng.integers(0, 256, 6).tolist()
    return motif * 4 + rng.integers(0, 256, 5).tolist() + motif[:3]


def resident(engine_factory):
    return engine_factory(None, dtype="float32", window=W, context=128, expert_cache_slots="all")


def offloaded(engine_factory):
    return engine_factory(None, dtype="float32", window=W, context=128, expert_cache_slots=5, pcie_frac=0.5,
                          cpu_threads=2)


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_greedy_output_is_the_same_with_and_without_drafts(engine_factory, prompt, placement):
    eng = resident(engine_factory) if placement == "resident" else offloaded(engine_factory)
    plain = eng.generate(prompt, 40, spec=0, stop_token_ids=[])
    assert eng.stats.last.drafts_proposed == 0 and eng.stats.last.mean_window == 1.0
    accepted = 0
    for spec in range(1, W):  # windows of 2..5 tokens (spec 0 above: windows of 1)
        assert eng.generate(prompt, 40, spec=spec, stop_token_ids=[]) == plain, spec
        last = eng.stats.last
        assert last.drafts_accepted <= last.drafts_proposed
        assert last.window_tokens == last.windows + last.drafts_proposed
        assert 1.0 <= last.mean_window <= spec + 1
        assert last.generated_tokens == 40
        accepted += last.drafts_accepted
    assert accepted > 0  # the drafts were right some of the time, so the accept path ran
    assert eng.generate(prompt, 40, draft="none", stop_token_ids=[]) == plain


def test_window_one_engine_never_drafts(engine_factory, prompt):
    eng = engine_factory(None, dtype="float32", window=1, context=128, expert_cache_slots="all")
    ref = resident(engine_factory).generate(prompt, 20, spec=0, stop_token_ids=[])
    assert eng.generate(prompt, 20, stop_token_ids=[]) == ref
    assert eng.stats.last.drafts_proposed == 0
    with pytest.raises(StrataError, match="spec 2 needs window >= 3"):
        eng.generate(prompt, 4, spec=2)


def test_sampled_output_is_reproducible(engine_factory, prompt):
    """A seed reproduces its run, with the default drafter (its gate watches before it drafts) and with an n-gram
    drafter asked at every window (an API object: verify windows whose drafts are accepted and rejected)."""
    eng = resident(engine_factory)
    for draft in ("auto", NgramDrafter()):
        a = eng.generate(prompt, 30, temperature=0.9, top_p=0.95, seed=11, draft=draft, stop_token_ids=[])
        if draft != "auto":
            assert eng.stats.last.drafts_proposed > 0
        assert eng.generate(prompt, 30, temperature=0.9, top_p=0.95, seed=11, draft=draft, stop_token_ids=[]) == a
        assert eng.generate(prompt, 30, temperature=0.9, top_p=0.95, seed=12, draft=draft, stop_token_ids=[]) != a


def test_rollback_leaves_the_cache_of_a_run_without_the_rejected_drafts(engine_factory, prompt):
    eng = resident(engine_factory)
    out = eng.generate(prompt, 30, spec=4, stop_token_ids=[])
    assert eng.stats.last.drafts_proposed > eng.stats.last.drafts_accepted  # some drafts were rejected
    valid = len(prompt) + len(out) - 1  # the last token is not in the cache yet
    spec_k = [np.asarray(k[:valid]) for k in eng.cache.k]
    spec_v = [np.asarray(v[:valid]) for v in eng.cache.v]
    assert eng.generate(prompt, 30, spec=0, stop_token_ids=[]) == out
    for k0, k1 in zip(spec_k, eng.cache.k):
        np.testing.assert_allclose(k0, np.asarray(k1[:valid]), rtol=1e-5, atol=1e-5)
    for v0, v1 in zip(spec_v, eng.cache.v):
        np.testing.assert_allclose(v0, np.asarray(v1[:valid]), rtol=1e-5, atol=1e-5)


def emitted_distribution(logits, drafts, params, n, form="sorted"):
    """Empirical distribution of the first token a verify window emits (draft 0 if accepted, else the residual
    draw), and of the second given the first draft was accepted, over n seeds, with the filter in `form`."""
    positions = jnp.arange(1, logits.shape[0] + 1, dtype=jnp.int32)

    def one(seed):
        p = params.replace(seed=seed)
        accept, drawn = verify(logits, drafts, positions, p, form)
        first = jnp.where(accept[0], drafts[0], drawn[0])
        second = jnp.where(accept[1], drafts[1], drawn[1])
        return first, accept[0], second

    first, acc0, second = jax.jit(jax.vmap(one))(jnp.arange(n, dtype=jnp.uint32))
    v = logits.shape[1]
    f = np.bincount(np.asarray(first), minlength=v) / n
    acc0 = np.asarray(acc0)
    s = np.bincount(np.asarray(second)[acc0], minlength=v) / max(acc0.sum(), 1)
    return f, s, acc0.mean()


@pytest.mark.parametrize("temperature,top_k,top_p,form", [(1.0, 0, 1.0, "plain"), (0.7, 5, 1.0, "top_k"),
                                                          (0.7, 5, 0.7, "top_k"), (1.3, 0, 0.8, "top_p"),
                                                          (1.3, 80, 0.8, "sorted")])
def test_speculative_sampling_draws_from_the_target_distribution(temperature, top_k, top_p, form):
    """Each filter form a request can get (sampling.form_of) draws from the exact distribution of its settings."""
    from strata_jax.sampling import form_of
    assert form_of(top_k, top_p) == form
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    v = 12
    logits = jnp.asarray(rng.standard_normal((3, v)) * 1.5, jnp.float32)
    params = SamplingParams.make(temperature, top_p, top_k, 0)
    p = [np.asarray(jax.nn.softmax(filtered_logits(logits[i], params))) for i in range(3)]
    # One draft the target likes, one it does not: both the accept and the reject branches carry weight.
    drafts = jnp.asarray([int(np.argmax(p[0])), int(np.argsort(p[1])[-2])], jnp.int32)
    f, s, acc = emitted_distribution(logits, drafts, params, 40_000, form)
    assert 0.05 < acc < 0.95
    # Total variation distance; with 40,000 draws over 12 outcomes the sampling noise is ~0.01.
    assert 0.5 * np.abs(f - p[0]).sum() < 0.02
    assert 0.5 * np.abs(s - p[1]).sum() < 0.03
    assert f[np.asarray(p[0]) == 0].sum() == 0  # filtered tokens never come out


class TopTokenDrafter:
    """Proposes the target's greedy continuation (precomputed): likely under sampling, so accepted often."""

    def __init__(self, continuation):
        self.continuation = continuation

    def propose(self, tokens, k):
        return self.continuation[:k]

    def observe(self, accepted):
        pass


def test_speculative_sampling_matches_plain_sampling_end_to_end(engine_factory, prompt):
    """The second generated token (the first one a verify window chooses) has the same distribution with a draft
    as without, on the tiny model. Compared given the most common first token (the prefill's draw, the same for
    both runs of a seed), so both are samples of one top-4 distribution."""
    eng = resident(engine_factory)
    kwargs = dict(temperature=1.0, top_k=4, stop_token_ids=[])
    n = 600
    firsts = np.array([eng.generate(prompt, 1, seed=s, **kwargs)[0] for s in range(n)])
    mode = np.bincount(firsts).argmax()
    seeds = np.nonzero(firsts == mode)[0]
    likely = eng.generate(prompt + [int(mode)], 1, spec=0, stop_token_ids=[])  # the target's favourite next token
    drafter = TopTokenDrafter(likely)
    plain = np.array([eng.generate(prompt, 2, spec=0, seed=int(s), **kwargs)[1] for s in seeds])
    spec, accepted = [], 0
    for s in seeds:
        spec.append(eng.generate(prompt, 3, spec=1, seed=int(s), draft=drafter, **kwargs)[1])
        assert eng.stats.last.drafts_proposed == 1
        accepted += eng.stats.last.drafts_accepted
    spec = np.array(spec)
    assert 0 < accepted < len(seeds)  # the draft was accepted sometimes and rejected sometimes
    support = np.union1d(plain, spec)
    assert len(support) <= 4  # top_k=4: nothing outside the filtered set, with or without the draft
    hp = np.array([(plain == t).mean() for t in support])
    hs = np.array([(spec == t).mean() for t in support])
    # Two samples of ~200 draws over 4 outcomes: total variation noise ~0.07; an accept rule that favoured the
    # draft (e.g. always accepting it) would move ~0.5 of the mass.
    assert 0.5 * np.abs(hp - hs).sum() < 0.2


def test_ngram_drafter():
    d = NgramDrafter(max_n=3)
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert d.propose([1, 2, 3, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # the longest suffix, most recent occurrence
    assert d.propose([5, 6, 7, 8], 3) == []
    assert d.propose([1, 2, 1, 2], 0) == []


def test_bad_draft_options_are_refused(engine_factory, prompt):
    eng = resident(engine_factory)
    with pytest.raises(StrataError, match="draft"):
        eng.generate(prompt, 4, draft="medusa")
    with pytest.raises(StrataError, match="spec"):
        eng.generate(prompt, 4, spec=W)


def test_cli_prints_the_draft_counters(cache_dir):
    out = run_cli(["--dtype=float32", "--window=5", "--context=128", "--expert_cache_slots=all",
                   "--prompt=abcabcabcabcabc", "--max_new_tokens=12"], cache_dir, timeout=600)
    assert out.returncode == 0, out.stderr.decode("utf-8", "replace")
    lines = out.stderr.decode("utf-8", "replace").splitlines()  # the statistics go to stderr
    assert any(line.startswith("drafts: proposed ") and "mean window size" in line for line in lines)


def test_host_time_between_verify_windows_is_measured(engine_factory, prompt):
    eng = resident(engine_factory)
    eng.generate(prompt, 10, stop_token_ids=[], draft="ngram")  # the host loop's verify windows (drafts on)
    r = eng.stats.last
    # gaps are counted between verify windows; windows without drafts run queued ahead (no gap)
    assert r.windows >= 2 and 1 <= r.host_gaps <= r.windows - 1 and r.host_gap_s > 0
    assert "host time between windows" in r.draft_summary()
    eng.generate(prompt, 10, stop_token_ids=[], spec=0)  # the pipelined T=1 loop: the next window is queued first
    assert eng.stats.last.host_gaps == 0 and "host time" not in eng.stats.last.draft_summary()


# ---- draft="device": drafting and acceptance on the device, windows back to back ------------------------------


def test_device_ngram_proposes_what_the_host_drafter_proposes():
    """strata_jax.speculative.device_drafts.ngram_propose against drafts.NgramDrafter on random histories (small vocabularies,
    so suffixes of 1..3 tokens recur), a short look-back window included. Jitted (as the engine runs it) on
    histories padded to one length with more tokens past the history: one compile per (k, window), not an eager
    op-by-op trace per history length (~1000 compiles)."""
    from strata_jax.speculative.device_drafts import ngram_propose
    propose = jax.jit(ngram_propose, static_argnums=2, static_argnames="window")
    rng, pad_rng = np.random.default_rng(9), np.random.default_rng(10)
    padded = 64  # > the longest history array drawn below (39 + 5 + 7)
    checked = 0
    for window in (4096, 7):
        host = NgramDrafter(window=window)
        for _ in range(150):
            n = int(rng.integers(1, 40))
            tokens = rng.integers(0, int(rng.choice([2, 3, 5, 50])), n).tolist()
            k = int(rng.integers(1, 6))
            hist = np.zeros(n + k + int(rng.integers(0, 8)), np.int32)
            hist[:n] = tokens
            hist[n:] = rng.integers(0, 50, hist.size - n)  # past the history: must never be read as context
            hist = np.concatenate([hist, pad_rng.integers(0, 50, padded - hist.size).astype(np.int32)])
            drafts, m = propose(jnp.asarray(hist), jnp.int32(n), k, window=window)
            assert np.asarray(drafts)[:int(m)].tolist() == host.propose(tokens, k), (tokens, k, window)
            checked += int(m) > 0
    assert checked > 100  # most cases found a draft


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_device_drafts_give_the_host_loops_tokens(engine_factory, prompt, placement):
    """Greedy: the same tokens as without drafts and as the host verify loop, at every spec. Sampled: a seed
    reproduces the tokens, another seed changes them."""
    eng = resident(engine_factory) if placement == "resident" else offloaded(engine_factory)
    plain = eng.generate(prompt, 40, spec=0, stop_token_ids=[])
    for spec in (1, W - 1):
        host = eng.generate(prompt, 40, spec=spec, stop_token_ids=[])
        host_stats = eng.stats.last
        assert eng.generate(prompt, 40, spec=spec, draft="device", stop_token_ids=[]) == host == plain
        dev = eng.stats.last
        # The device drafts at every window; the host loop queues T=1 windows while its drafter finds nothing,
        # and the window in flight when it finds one again runs without drafts, so it takes as many or more.
        assert dev.drafts_accepted >= host_stats.drafts_accepted > 0
        assert dev.windows <= host_stats.windows
        assert dev.window_tokens == dev.windows + dev.drafts_proposed and dev.generated_tokens == 40
    # Sampled: the host loop's drafts differ from the device's where it queues windows without drafts, and
    # rejection sampling draws from other uniforms, so the tokens are compared run to run (the distribution is
    # the target's: test_speculative_sampling_*)
    kw = dict(temperature=0.9, top_p=0.95, seed=5, stop_token_ids=[])
    sampled = eng.generate(prompt, 30, spec=W - 1, draft="device", **kw)
    assert eng.stats.last.drafts_proposed > 0 and len(sampled) == 30
    assert eng.generate(prompt, 30, spec=W - 1, draft="device", **kw) == sampled
    assert eng.generate(prompt, 30, spec=W - 1, draft="device", **dict(kw, seed=6)) != sampled


def test_device_drafts_stop_tokens_budget_and_the_context_end(engine_factory, prompt):
    eng = resident(engine_factory)
    ref = eng.generate(prompt, 40, spec=W - 1, stop_token_ids=[])
    stop = ref[17]
    first = ref.index(stop)
    got = eng.generate(prompt, 40, spec=W - 1, draft="device", stop_token_ids=[stop])
    assert got == ref[:first + 1]  # ends at the stop token; the windows in flight are dropped
    assert eng.generate(prompt, 7, spec=W - 1, draft="device", stop_token_ids=[]) == ref[:7]
    # 128-token context: the last tokens cannot take a whole window; the host loop finishes them.
    long_prompt = (prompt * 4)[:120]
    want = eng.generate(long_prompt, 50, spec=W - 1, stop_token_ids=[])
    assert len(want) == 128 - 120
    assert eng.generate(long_prompt, 50, spec=W - 1, draft="device", stop_token_ids=[]) == want
    # The engine is unchanged for the next request.
    assert eng.generate(prompt, 40, spec=W - 1, stop_token_ids=[]) == ref


def test_windows_without_drafts_run_queued_ahead_with_the_same_tokens(engine_factory, prompt):
    """spec > 0 while the drafter proposes nothing: T=1 windows queued ahead (no host gap), the same tokens as the
    pipelined spec=0 loop, greedy and sampled (one key per position); then drafts again where the context repeats."""
    eng = resident(engine_factory)
    for sampling in (dict(), dict(temperature=0.8, seed=5)):
        plain = eng.generate(prompt, 25, spec=0, stop_token_ids=[], **sampling)
        assert eng.generate(prompt, 25, spec=3, draft="none", stop_token_ids=[], **sampling) == plain
        last = eng.stats.last
        assert last.windows == 24 and last.window_tokens == 24 and last.host_gaps == 0
        assert last.drafts_proposed == 0
    # the n-gram drafter on a prompt with no repeat: stretches, then verify windows once the output repeats
    rng = np.random.default_rng(9)
    fresh = rng.permutation(256)[:20].tolist()
    plain = eng.generate(fresh, 40, spec=0, stop_token_ids=[])
    assert eng.generate(fresh, 40, spec=3, stop_token_ids=[]) == plain
    last = eng.stats.last
    assert last.window_tokens == last.windows + last.drafts_proposed and last.generated_tokens == 40
    for budget in (1, 2, 3):  # the budget ends inside a stretch
        assert eng.generate(fresh, budget, spec=3, draft="none", stop_token_ids=[]) == plain[:budget]
    stop = plain[7]
    cut = plain[:plain.index(stop) + 1]
    assert eng.generate(fresh, 40, spec=3, draft="none", stop_token_ids=[stop]) == cut


def test_the_draft_gate_pauses_after_rejected_windows():
    gate = DraftGate()
    assert gate.open(0)
    gate.after_window(10, 0, 0)  # a window without drafts says nothing
    assert gate.open(10) and gate.pauses == 0
    made, pauses = 10, []
    for _ in range(8):  # rejected windows in a row: pauses of 4, 8, ... up to the longest
        gate.after_window(made, 3, 0)
        assert not gate.open(made) and not gate.open(gate.quiet_until - 1) and gate.open(gate.quiet_until)
        pauses.append(gate.quiet_until - made)
        made = gate.quiet_until + 1
    assert pauses == [4, 8, 16, 32, 64, 128, 128, 128] and gate.pauses == 8
    gate.after_window(made, 3, 1)  # an accepted draft: open, and the next pause half as long
    assert gate.open(made)
    gate.after_window(made + 2, 3, 0)
    assert gate.quiet_until == made + 2 + 64
    made = gate.quiet_until
    for _ in range(6):  # a run of accepting windows brings it down to the shortest pause
        gate.after_window(made, 3, 2)
        assert gate.open(made)
    gate.after_window(made, 3, 0)
    assert gate.quiet_until == made + DraftGate.FIRST_PAUSE and gate.pauses == 10


def test_a_sampled_requests_gate_opens_on_shadow_hits():
    """watch=True (a sampled request): closed until SHADOW_HITS shadow drafts in a row matched the next token; a
    rejected window closes it again behind its pause; a greedy request's gate never watches."""
    drafter = NgramDrafter()
    gate = DraftGate(watch=True)
    context = [1, 2, 3, 1, 2]  # the drafter proposes 3 after "1 2"
    assert not gate.open(0)
    gate.shadow(context, drafter, 0)
    assert gate.pending == (5, 3)
    gate.shadow(context + [9], drafter, 1)  # missed
    assert not gate.open(1) and gate.hits_in_row == 0 and gate.shadow_drafts == 1
    context = [5, 6, 7, 5, 6, 7, 5, 6]  # quoting: every shadow draft right
    gate.shadow(context, drafter, 2)
    for made, token in ((3, 7), (4, 5)):
        context = context + [token]
        gate.shadow(context, drafter, made)
    assert gate.open(4) and gate.shadow_hits == 2 and gate.shadow_drafts == 3
    gate.after_window(8, 3, 2)  # accepted: stays open
    assert gate.open(8)
    gate.after_window(12, 3, 0)  # rejected: paused, then watching again
    assert not gate.open(12 + DraftGate.FIRST_PAUSE) and gate.pauses == 1
    gate.shadow(context, drafter, 13)  # within the pause: nothing asked
    assert gate.pending is None
    greedy = DraftGate()
    greedy.shadow(context, drafter, 0)
    assert greedy.open(0) and greedy.pending is None and greedy.shadow_drafts == 0


def test_the_ngram_drafter_pauses_after_rejected_windows_with_the_same_tokens(engine_factory, prompt):
    """Sampled text that quotes nothing: the built-in drafter's gate watches (its drafts checked against the
    tokens that came, no window) and pauses after rejected windows (T=1 windows queued ahead meanwhile), so the
    request runs fewer verify windows than one that asks the same drafter at every window (an API Drafter object is
    never paused). Greedy: every run gives the spec=0 loop's tokens; sampled: a seed reproduces its run (a rejected
    draft's residual draw is a draw of its own, so runs with other windows differ), and a run whose gate never
    opened is the spec=0 loop's."""
    eng = resident(engine_factory)
    rng = np.random.default_rng(21)
    fresh = rng.permutation(256)[:24].tolist()
    fewer = 0
    for sampling in (dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=20, top_p=0.8, seed=4), dict()):
        plain = eng.generate(fresh + prompt, 48, spec=0, stop_token_ids=[], **sampling)
        gated = eng.generate(fresh + prompt, 48, spec=3, stop_token_ids=[], **sampling)
        g = eng.stats.last
        asked = eng.generate(fresh + prompt, 48, spec=3, draft=NgramDrafter(), stop_token_ids=[], **sampling)
        a = eng.stats.last
        if sampling:
            assert eng.generate(fresh + prompt, 48, spec=3, stop_token_ids=[], **sampling) == gated, sampling
            assert len(gated) == len(plain) == 48
        else:
            assert gated == plain and asked == plain
        assert a.draft_pauses == 0 and g.window_tokens == g.windows + g.drafts_proposed
        if sampling:  # drafts of the prompt's motif on sampled text: mostly rejected
            assert a.drafts_proposed - a.drafts_accepted > 3 * a.drafts_accepted, (sampling, a)
            assert g.shadow_drafts > 0 and "shadow drafts" in g.draft_summary()
            assert g.drafts_proposed <= a.drafts_proposed and g.host_gaps <= a.host_gaps, (sampling, g, a)
            if g.drafts_proposed == 0:
                assert gated == plain, sampling
            fewer += a.drafts_proposed - g.drafts_proposed
        else:
            assert g.drafts_accepted > 0  # the motif repeats under greedy: the drafts keep working
    assert fewer > 0  # the pauses saved drafts (windows of T > 1)


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_sampled_windows_draw_in_the_window_graph_the_samplers_tokens(engine_factory, prompt, placement):
    """A sampled request's windows draw their tokens in the window's own graph (graphs.sampled_window: one
    dispatch and no host round trip a window), the same tokens as the window graph followed by the samplers alone,
    in every filter form, in queued T=1 stretches and in verify windows whose drafts are accepted and rejected."""
    from strata_jax.engine import graphs
    eng = resident(engine_factory) if placement == "resident" else offloaded(engine_factory)
    greedy = eng.generate(prompt, 32, stop_token_ids=[])
    settings = [dict(temperature=0.05, top_k=20, top_p=0.8)]  # offloaded: one form (its graphs compile slowly)
    if placement == "resident":
        settings += [dict(temperature=0.05, top_p=0.9), dict(temperature=0.05)]
    for sampling in settings:
        form = __import__("strata_jax.sampling", fromlist=["form_of"]).form_of(sampling.get("top_k", 0),
                                                                            sampling.get("top_p", 1.0))
        runs = {}
        for in_graph in (True, False):
            if not in_graph:
                eng.compiled.sampled_windows_for = lambda form: None  # the window graph's logits, then the samplers
            try:
                for spec in (0, 2):  # windows of 1..3
                    # drafts: the same seed's plain samples (near the argmax at this temperature: accepted), every
                    # second one changed (rejected: its residual draw goes on)
                    drafter = TopTokenDrafterAt(prompt, runs[in_graph, 0]) if spec else "none"
                    runs[in_graph, spec] = eng.generate(prompt, 30, seed=7, spec=spec, draft=drafter,
                                                        stop_token_ids=[], **sampling)
                    if in_graph and spec:
                        last = eng.stats.last
                        assert 0 < last.drafts_accepted < last.drafts_proposed, (sampling, last)
            finally:
                eng.compiled.__dict__.pop("sampled_windows_for", None)
        assert isinstance(eng.compiled.sampled_windows[form], graphs.GraphTable)
        assert runs[True, 0] == runs[False, 0], sampling
        assert runs[True, 2] == runs[False, 2], sampling
        assert runs[True, 0] != greedy[:30]  # sampled, not the argmax


class TopTokenDrafterAt:
    """Proposes a given continuation at the context's length, its second draft changed to another token."""

    def __init__(self, prompt, continuation):
        self.n, self.continuation = len(prompt), continuation

    def propose(self, tokens, k):
        i = len(tokens) - self.n
        drafts = list(self.continuation[i:i + k])
        if len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 256
        return drafts

    def observe(self, accepted):
        pass
