"""The engine against transformers' Qwen3MoeForCausalLM (and Qwen3NextForCausalLM, Qwen3_5MoeForConditionalGeneration:
make_hf_next_fixtures.py): the committed fixtures in tests/fixtures/hf/ hold float32 reference logits, a greedy
continuation and its per-step logits (see tests/fixtures/make_hf_fixtures.py)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HF_FIXTURES, hf_fixture_names
from helpers import hf_reference, rel_fro

NAMES = hf_fixture_names()
W = 4
# Chunked prefill: 5-token chunks split the 24-token input into 5+5+5+5+4 and the 8-token prompt into 5+3, so the
# last chunk is padded. context = 512 + 64 - 5 keeps the KV cache the same length (context + chunk) as the default
# engine's, so its decode graphs come from the persistent compilation cache.
# The exact engine: float32, every expert resident on the device (offload has its own tests).
EXACT = dict(dtype="float32", window=W, expert_cache_slots="all")
CHUNKED = "base"
CHUNK_OPTIONS = dict(prefill_chunk=5, context=512 + 64 - 5)

# float32 against float32 (the engine's XLA CPU arithmetic vs torch eager): measured ~5e-7 on every fixture.
REL_FRO_TOL = 1e-4  # ||got - ref||_F / ||ref||_F over the whole [N, V] array
ROW_MAX_TOL = 1e-4  # per row i: max_j |got_ij - ref_ij| / max_j |ref_ij|


def test_fixtures_found():
    assert len(NAMES) >= 5, f"expected the committed HF fixtures in {HF_FIXTURES}, found {NAMES}"


def assert_logits_close(got, ref, what):
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite logits"
    rel = rel_fro(got, ref)
    assert rel <= REL_FRO_TOL, f"{what}: relative Frobenius error {rel:.3g} > {REL_FRO_TOL}"
    row_err = np.max(np.abs(got - ref), axis=1) / np.max(np.abs(ref), axis=1)
    worst = int(np.argmax(row_err))
    assert row_err[worst] <= ROW_MAX_TOL, (f"{what}: row {worst} max-abs error {row_err[worst]:.3g} of the row's "
                                           f"max |logit| > {ROW_MAX_TOL}")


@pytest.fixture(scope="module", params=NAMES)
def fixture(request, engine_factory):
    name = request.param
    return name, engine_factory(HF_FIXTURES / name, **EXACT), hf_reference(name)


@pytest.fixture(scope="module")
def chunked(engine_factory):
    return engine_factory(HF_FIXTURES / CHUNKED, **EXACT, **CHUNK_OPTIONS), hf_reference(CHUNKED)


def test_prefill_logits(fixture):
    name, engine, ref = fixture
    assert_logits_close(engine.prefill_logits(ref["input_ids"]), ref["logits"], f"{name} prefill")


@pytest.mark.parametrize("window", range(1, W + 1))
def test_score(fixture, window):
    name, engine, ref = fixture
    assert_logits_close(engine.score(ref["input_ids"], window=window), ref["logits"], f"{name} score w={window}")


def test_greedy(fixture):
    name, engine, ref = fixture
    n = len(ref["greedy_ids"])
    got = engine.generate(ref["prompt_ids"].tolist(), n, stop_token_ids=[])
    assert got == ref["greedy_ids"].tolist()


def test_greedy_step_logits(fixture):
    """The logits of each generation step, teacher-forced: row P-1+t of score(prompt + greedy[:-1]) scores step t."""
    name, engine, ref = fixture
    if "greedy_logits" not in ref:
        pytest.skip(f"{name} has no greedy_logits")
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    rows = engine.score(prompt + greedy[:-1])[len(prompt) - 1:]
    assert_logits_close(rows, ref["greedy_logits"], f"{name} greedy step logits")


def test_chunked_prefill_logits(chunked):
    engine, ref = chunked
    assert engine.chunk == CHUNK_OPTIONS["prefill_chunk"]
    assert_logits_close(engine.prefill_logits(ref["input_ids"]), ref["logits"], f"{CHUNKED} prefill chunk 5")


def test_chunked_prefill_greedy(chunked):
    engine, ref = chunked
    got = engine.generate(ref["prompt_ids"].tolist(), len(ref["greedy_ids"]), stop_token_ids=[])
    assert got == ref["greedy_ids"].tolist()
