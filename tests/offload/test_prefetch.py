"""prefetch=N (issue 34 item 3): layer l+1's likely experts copied into its slots while layer l computes. Exact by
construction: a prefetched expert is an ordinary resident one under the slot table, so the logits and greedy tokens
equal all resident's (float32, 1e-5) under lru at several slot counts and window sizes, and under static nothing is
prefetched. The counters: prefetched >= used, and used > 0."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import rel_fro

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng()
    return rng.integers(0, 256, size=23).tolist()


@pytest.fixture(scope="module")
def reference(engine_factory, tokens):
    eng = engine_factory(None, dtype="float32", window=3, context=64, expert_cache_slots="all")
    return {w: eng.score(tokens, window=w) for w in (1, 3)}, eng.generate(tokens[:7], 10, stop_token_ids=[])


# (3, 2) runs every split and policy; (8, 4), another slot count and prefetch depth, the lru split that fetches
# everything (a policy or split change rebuilds the graphs, ~15 s each here; the split and the static policy are
# (3, 2)'s: the prefetch code is the same at every slot count)
@pytest.mark.parametrize("slots,prefetch,variants", [(3, 2, ((1.0, "lru"), (0.5, "lru"), (1.0, "static"))),
                                                     (8, 4, ((1.0, "lru"),))], ids=["3-2", "8-4"])
def test_prefetch_gives_all_residents_logits_and_tokens(engine_factory, reference, tokens, slots, prefetch,
                                                        variants):
    ref_scores, ref_greedy = reference
    eng = engine_factory(None, dtype="float32", window=3, context=64, expert_cache_slots=slots, pcie_frac=1.0,
                         cpu_threads=2, prefetch=prefetch)
    assert eng.scanned_offload and eng.decode_expert_path.prefetch == prefetch
    # one prefetch call in the scanned body (the decode windows), none in the prefill
    assert eng.compiled.decode[1].as_text().count('custom_call_target="strata_offload_prefetch"') == 1
    for frac, policy in variants:
        eng.reconfigure(pcie_frac=frac, cache_policy=policy)
        for w in (1, 3):
            assert rel_fro(eng.score(tokens, window=w), ref_scores[w]) <= REL_TOL, (frac, policy, w)
        assert eng.generate(tokens[:7], 10, stop_token_ids=[]) == ref_greedy, (frac, policy)
        d = eng.stats.last.decode_experts
        assert d.entries == d.entries_resident + d.entries_fetched + d.entries_cpu > 0
        if policy == "static":
            assert d.prefetched == 0 == d.prefetch_used
        else:
            assert d.prefetched >= d.prefetch_used > 0, (frac, d)


def test_prefetch_is_ignored_outside_the_scanned_offload_graph_with_one_line():
    from types import SimpleNamespace
    from strata_jax.offload.placement import prefetch_setting
    opts = SimpleNamespace(prefetch=2)
    placement = SimpleNamespace(policy="lru")
    assert prefetch_setting(SimpleNamespace(prefetch=0), placement, True, False) == (0, [])
    n, lines = prefetch_setting(opts, placement, False, False)
    assert n == 0 and len(lines) == 1 and "ignored" in lines[0]
    n, lines = prefetch_setting(opts, None, False, False)
    assert n == 0 and "ignored" in lines[0]
    n, lines = prefetch_setting(opts, placement, True, True)
    assert n == 2 and "not exact" in lines[0]


def test_the_unrolled_offload_graph_runs_without_prefetch(engine_factory, reference, tokens):
    ref_scores, ref_greedy = reference
    eng = engine_factory(None, dtype="float32", window=3, context=64, expert_cache_slots=3, pcie_frac=1.0,
                         cpu_threads=2, prefetch=2, layer_loop="unrolled")
    assert not eng.scanned_offload and eng.prefetch == 0 and eng.decode_expert_path.prefetch == 0
    assert rel_fro(eng.score(tokens, window=1), ref_scores[1]) <= REL_TOL
    assert eng.stats.last.decode_experts.prefetched == 0
