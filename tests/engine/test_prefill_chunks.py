"""Prefill chunk sizes (issue 21): prefill_chunk=auto's plan, and exactness: the prompt's logits and the greedy
tokens do not depend on the chunk sizes (float32), resident and offloaded."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strata_jax import Engine
from strata_jax.engine import plan as plan_mod
from strata_jax.model.kv_cache import cache_bytes
from strata_jax.model.config import config_from_dict
from strata_jax.io.embedded import CONFIGS_DIR
from strata_jax.options import EngineOptions, build


def test_chunk_sizes_for_plan():
    f = plan_mod.chunk_sizes_for
    assert f(0, (1024, 64)) == []
    assert f(100, (64,)) == [64, 64]
    assert f(3000, (1024, 64)) == [1024, 1024, 1024]  # 952 left >= 256: one padded large chunk
    assert f(2200, (1024, 64)) == [1024, 1024, 64, 64, 64]  # 152 left < 256: small chunks
    assert f(255, (1024, 64)) == [64] * 4
    assert f(256, (1024, 64)) == [1024]
    for n in range(1, 300, 7):
        sizes = f(n, (128, 32, 8))
        assert sum(sizes) >= n and sum(sizes[:-1]) < n  # covers the prompt, no empty step


def test_auto_is_one_small_chunk_off_gpu_and_a_number_is_kept():
    cfg = config_from_dict(json.loads((CONFIGS_DIR / "tiny.json").read_text()))
    ctx, chunks = plan_mod.context_and_chunks(cfg, build(EngineOptions, dict(context=512)))
    assert (ctx, chunks) == (512, (plan_mod.SMALL_CHUNK,))
    assert plan_mod.context_and_chunks(cfg, build(EngineOptions, dict(context=512, prefill_chunk=96)))[1] == (96,)
    assert plan_mod.context_and_chunks(cfg, build(EngineOptions, dict(context=40, prefill_chunk=96)))[1] == (40,)


def test_gpu_auto_plan_is_large_then_small(monkeypatch):
    """On a GPU, auto gives (large, small), the large one bounded by the context and by the device memory."""
    cfg = config_from_dict(json.loads((CONFIGS_DIR / "tiny.json").read_text()))
    monkeypatch.setattr(plan_mod.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(plan_mod, "_device_memory_bytes", lambda: 80 * 2**30)
    opts = lambda **o: build(EngineOptions, dict(context=4096, **o))  # noqa: E731
    assert plan_mod.context_and_chunks(cfg, opts())[1] == (1024, 64)
    assert plan_mod.context_and_chunks(cfg, build(EngineOptions, dict(context=300)))[1] == (256, 64)
    # a device whose eighth cannot hold a 1024-row chunk's activations gets a smaller large chunk
    need = plan_mod.prefill_activation_bytes(cfg, 1024, 4096 + 1024, kernel_attention=True)  # bf16 on a GPU
    monkeypatch.setattr(plan_mod, "_device_memory_bytes", lambda: 8 * need - 1)
    assert plan_mod.context_and_chunks(cfg, opts())[1] == (512, 64)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(21).integers(0, 255, 135).tolist()


def _engine(monkeypatch, chunks, **options):
    """An engine of the embedded model whose prefill runs `chunks` (the GPU plan's shape, forced on the CPU)."""
    real = plan_mod.context_and_chunks
    monkeypatch.setattr(plan_mod, "context_and_chunks", lambda cfg, opts: (real(cfg, opts)[0], chunks))
    try:
        return Engine.from_pretrained(None, verbose=False, dtype="float32", window=1, context=256, **options)
    finally:
        monkeypatch.setattr(plan_mod, "context_and_chunks", real)


@pytest.mark.parametrize("slots", ["all", "3"])
def test_prefill_logits_do_not_depend_on_chunk_sizes(monkeypatch, cache_dir, prompt, slots):
    opts = dict(expert_cache_slots=slots, cache_dir=str(cache_dir))
    if slots != "all":
        opts["pcie_frac"] = "1"
    base = _engine(monkeypatch, (64,), **opts)
    mixed = _engine(monkeypatch, (32, 8), **opts)  # 135 tokens: 32 x 4, then 8 (7 left < 32 / 4)
    assert plan_mod.chunk_sizes_for(len(prompt), mixed.chunks) == [32, 32, 32, 32, 8]
    want = base.prefill_logits(prompt)
    got = mixed.prefill_logits(prompt)
    assert got.shape == want.shape == (len(prompt), base.cfg.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert mixed.generate(prompt, 8, stop_token_ids=[]) == base.generate(prompt, 8, stop_token_ids=[])


def test_auto_context_follows_the_model_where_attention_reads_up_to_position(monkeypatch):
    """context=0: max_position_embeddings with the Pallas attention (GPU, bf16), halved while the KV cache would
    pass an eighth of the device memory; min(max_position_embeddings, 4096) with XLA's whole-cache attention."""
    raw = json.loads((CONFIGS_DIR / "tiny.json").read_text())
    cfg = config_from_dict({**raw, "max_position_embeddings": 32768})
    opts = lambda **o: build(EngineOptions, {"dtype": "bfloat16", **o})  # noqa: E731
    assert plan_mod.resolve_context(cfg, opts())[0] == 4096  # this CPU: XLA attention
    assert plan_mod.resolve_context(cfg, opts(context=777)) == (777, "--context")
    monkeypatch.setattr(plan_mod.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(plan_mod, "_device_memory_bytes", lambda: 80 * 2**30)
    ctx, why = plan_mod.resolve_context(cfg, opts())
    assert ctx == 32768 and "max_position_embeddings 32768" in why
    assert plan_mod.resolve_context(cfg, opts(dtype="float32"))[0] == 4096  # float32: the XLA attention
    kv = lambda c: cache_bytes(cfg, c + plan_mod.LARGE_CHUNK, 2, 5)  # noqa: E731
    monkeypatch.setattr(plan_mod, "_device_memory_bytes", lambda: 8 * kv(8192))  # fits 8192, not 16384
    ctx, why = plan_mod.resolve_context(cfg, opts())
    assert ctx == 8192 and "halved" in why
    assert plan_mod.context_and_chunks(cfg, opts())[0] == 8192
