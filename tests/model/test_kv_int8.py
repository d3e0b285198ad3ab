"""kv_dtype=int8: the KV cache as int8 rows with one float32 scale per (position, kv head), for K and for V.

Bounds, and why they have the size they have:
- Round trip: |dequantize(quantize(x)) - x| <= scale / 2 per element (round to nearest; scale = absmax / 127), the
  largest element of each row exact.
- Logits of the reference model, float32, int8 KV against the float32 cache, 96 positions of a text it did not
  train on: measured ||int8 - auto||_F / ||auto||_F = 4.7e-3 (KL 1.9e-4 nats/position, top-1 100%, windows of 1 and
  2 and the prefill path alike). That is the size of one int8 half step relative to a row's absmax (1/254 = 3.9e-3)
  carried through four layers. The bound, 1.5e-2, is three times that: a wrong scale (another head's, another
  position's, or none) moves the logits by O(1), far past it. The greedy tokens are the same (measured 24 of 24).
- Placement independence with int8 KV: the quantized rows are the same whatever computes the experts, so all
  resident against offloaded (slots, PCIe and host pool) stays within float summation order: 1e-5, as the default.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax import StrataError
from strata_jax.model import transformer
from strata_jax.model.kv_cache import QuantKV, _write_rows, dequantize_kv, kv_zeros, quantize_kv
from conftest import run_cli

COMMON = dict(dtype="float32", window=2, context=128, prefill_chunk=32)


@pytest.fixture(scope="module")
def prompt(engine_factory):
    eng = engine_factory("reference", expert_cache_slots="all", **COMMON)
    text = Path(transformer.__file__).parent.parent.joinpath("sampling.py").read_text()  # not in the reference's training data
    return eng.encode(text[:2000])[:96]


def test_quantize_round_trips_within_half_a_step():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 4, 32)).astype(np.float32) * rng.uniform(1e-3, 30, (40, 4, 1)).astype(np.float32)
    x[5, 1] = 0.0  # an all-zero row: scale 0, values 0
    x[6, 2, 7] = -1e4  # one outlier: the row's other values get a coarse step, still within half of it
    c = quantize_kv(jnp.asarray(x))
    assert c.q.dtype == jnp.int8 and c.scale.dtype == jnp.float32 and c.scale.shape == (40, 4)
    assert int(jnp.abs(c.q.astype(jnp.int32)).max()) <= 127
    scale = np.asarray(c.scale)
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(dequantize_kv(c)) - x)
    assert (err <= scale[..., None] * (0.5 + 1e-5)).all()
    assert scale[5, 1] == 0 and (np.asarray(c.q)[5, 1] == 0).all()
    # The write path: transformer.attention quantizes a window's rows into the cache at pos, rows and scales together.
    cache = kv_zeros((16, 4, 32), jnp.float32, "int8")
    written = _write_rows(cache, jnp.asarray(x[:3]), (jnp.int32(5), 0, 0))
    np.testing.assert_array_equal(np.asarray(written.q[5:8]), np.asarray(c.q[:3]))
    np.testing.assert_array_equal(np.asarray(written.scale[5:8]), scale[:3])
    assert not np.asarray(written.q[:5]).any() and not np.asarray(written.scale[8:]).any()


def test_xla_attention_reads_int8_as_the_kernel_reference_does():
    """transformer._xla_attention on an int8 cache equals decode_attention_reference's int8 arithmetic, and both are the
    attention over the dequantized cache within f32 rounding (the scales applied to scores and probabilities)."""
    from strata_jax.pallas_kernels.decode_attention import decode_attention_reference
    rng = np.random.default_rng(5)
    t, nq, nkv, d, s, pos = 3, 8, 2, 32, 64, 40
    q = jnp.asarray(rng.standard_normal((t, nq, d)), jnp.float32)
    kc = quantize_kv(jnp.asarray(rng.standard_normal((s, nkv, d)) * 2, jnp.float32))
    vc = quantize_kv(jnp.asarray(rng.standard_normal((s, nkv, d)), jnp.float32))
    p = jnp.int32(pos)
    with jax.default_matmul_precision("highest"):
        got = transformer._xla_attention(q, kc, vc, p + jnp.arange(t, dtype=jnp.int32))
        ref = decode_attention_reference(q, kc.q, vc.q, p, kc.scale, vc.scale).reshape(t, nq * d)
        deq = decode_attention_reference(q, dequantize_kv(kc), dequantize_kv(vc), p).reshape(t, nq * d)
    assert rel_fro(got, ref) < 1e-6
    assert rel_fro(got, deq) < 1e-5


def test_logits_close_to_the_unquantized_cache(engine_factory, prompt):
    auto = engine_factory("reference", expert_cache_slots="all", **COMMON)
    int8 = engine_factory("reference", expert_cache_slots="all", kv_dtype="int8", **COMMON)
    assert isinstance(int8.cache.k, QuantKV) and int8.cache.k.q.dtype == jnp.int8  # scanned: stacked
    assert "int8" in int8.kv_cache_line() and "MiB" in int8.kv_cache_line()
    a, b = auto.score(prompt, window=2), int8.score(prompt, window=2)
    assert rel_fro(b, a) < 1.5e-2
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.97
    assert rel_fro(int8.prefill_logits(prompt), auto.prefill_logits(prompt)) < 1.5e-2
    want = auto.generate(prompt[:40], 24, stop_token_ids=[], draft="none")
    assert int8.generate(prompt[:40], 24, stop_token_ids=[], draft="none") == want


def test_placement_independence_with_int8_kv(engine_factory, prompt):
    """All resident (scanned, stacked QuantKV) against offloaded (unrolled, per-layer QuantKV; slots, PCIe fetches
    and the host pool; and the default scanned offload graph over the stacked QuantKV): the same logits, windows of 1 and 2; then the same greedy tokens, the second request reusing
    the first one's int8 rows and scales (prefix reuse).

    Bound: on the CPU, slots and PCIe only (pcie_frac=1) give the resident logits bit for bit (measured 0.0),
    within 1e-5. Where the placements sum in another order (the host pool's numpy: 2.3e-7 apart with the float32
    cache; the GPU's scanned and unrolled graphs), a K or V element on a rounding boundary may land one int8 step
    away (absmax/127 of its row), which the logits carry: measured 2.4e-5 with the host pool (pcie_frac=0.5), so
    off the CPU the bound is 1e-4 (a wrong scale or row moves the logits by O(1))."""
    bound = 1e-5 if jax.default_backend() == "cpu" else 1e-4
    resident = engine_factory("reference", expert_cache_slots="all", kv_dtype="int8", **COMMON)
    offloaded = engine_factory("reference", expert_cache_slots=16, pcie_frac=1.0, kv_dtype="int8",
                               layer_loop="unrolled", **COMMON)
    assert offloaded.placement is not None and isinstance(offloaded.cache.k[0], QuantKV)
    # the default offload graph: decode windows scanned over the stacked QuantKV and slot caches
    scanned = engine_factory("reference", expert_cache_slots=16, pcie_frac=1.0, kv_dtype="int8", **COMMON)
    assert scanned.scanned_offload and isinstance(scanned.cache.k, QuantKV)
    for w in (1, 2):
        offloaded.reconfigure(pcie_frac=1.0)
        want = resident.score(prompt, window=w)
        err = rel_fro(offloaded.score(prompt, window=w), want)
        assert err <= bound, (w, err)
        assert rel_fro(scanned.score(prompt, window=w), want) <= bound, w
    first = resident.generate(prompt[:30], 8, stop_token_ids=[])
    assert offloaded.generate(prompt[:30], 8, stop_token_ids=[]) == first
    d = offloaded.stats.last.decode_experts
    assert d.entries_fetched > 0
    longer = prompt[:30] + first + prompt[30:36]
    again = offloaded.generate(longer, 8, stop_token_ids=[])
    assert offloaded.stats.last.cached_tokens > 30  # the int8 rows of the last request were reused
    assert again == resident.generate(longer, 8, stop_token_ids=[])


def test_speculative_greedy_equals_plain_greedy_with_int8_kv(engine_factory, prompt):
    """Verify windows write int8 rows for drafts that may be rejected; the next window rewrites those positions
    (rows and scales) before any query reads them: the same tokens as one token a window."""
    eng = engine_factory("reference", expert_cache_slots="all", kv_dtype="int8", **COMMON)
    plain = eng.generate(prompt[:40], 32, stop_token_ids=[], draft="none")
    spec = eng.generate(prompt[:40], 32, stop_token_ids=[], draft="ngram")
    assert eng.stats.last.drafts_proposed > 0
    assert spec == plain
    assert eng.generate(prompt[:40], 32, stop_token_ids=[], draft="device") == plain


def test_bad_values_are_refused_with_one_line(cache_dir):
    with pytest.raises(StrataError, match=r"bad value for kv_dtype: 'int4' \(must be one of auto, int8\)"):
        from strata_jax import Engine
        Engine.from_pretrained(None, verbose=False, kv_dtype="int4", cache_dir=str(cache_dir))
    result = run_cli(["--kv_dtype=fp8", "--prompt=x"], cache_dir)
    err = result.stderr.decode("utf-8", "replace").splitlines()
    assert result.returncode != 0 and len(err) == 1 and err[0].startswith("error:") and "kv_dtype" in err[0], err


@pytest.mark.gpu
def test_the_pallas_attention_kernel_reads_the_int8_cache(engine_factory):
    """attention_kernel=pallas, compiled, bf16, kv_dtype=int8: every decode window's logits against the XLA path's
    over the same int8 cache, within bf16 rounding (the bound of test_gpu's attention-kernel test)."""
    tokens = np.random.default_rng(7).integers(0, 256, size=27).tolist()
    common = dict(dtype="bfloat16", window=4, context=64, expert_cache_slots="all", kv_dtype="int8")
    xla = engine_factory(None, attention_kernel="xla", **common).score(tokens, window=4)
    pallas = engine_factory(None, attention_kernel="pallas", **common).score(tokens, window=4)
    assert rel_fro(pallas, xla) < 3e-2
    assert (pallas.argmax(-1) == xla.argmax(-1)).mean() > 0.8
