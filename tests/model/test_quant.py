"""strata_jax/model/quant.py: the low-bit expert formats round-trip within half a step, pack int4 exactly, and order by
error as their bits and groups say."""
from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.offload.slots import layer_states

from helpers import block_writer_round_trip, engine_with_gpu_paths, rel_fro
from strata_jax.model import quant


@pytest.mark.parametrize("name", [n for n in quant.FORMATS if n not in quant.BLOCK_FORMATS])  # test_q4k/q2k_format
def test_dequantized_within_half_a_step(name):
    rng = np.random.default_rng()
    fmt = quant.FORMATS[name]
    w = (rng.standard_normal((3, 8, 128)) * rng.uniform(0.01, 1.0, (3, 8, 1))).astype(np.float32)
    w[1, 2] = 0.0  # an all-zero channel: scale 0, no NaN
    qa = quant.quantize(w, name)
    back = quant.dequantize(qa)
    assert back.shape == w.shape and np.isfinite(back).all()
    assert qa.scale.dtype == (np.float32 if fmt.scale_bits == 32 else quant.BF16)  # GGUF's kept: float32
    assert qa.scale.shape == (3, 8, fmt.groups(128))
    step = np.repeat(qa.scale.astype(np.float32), 128 // fmt.groups(128), axis=-1)
    # half a step, plus the bf16 rounding of the minimum (asymmetric) and float32 slack
    slack = 0 if fmt.symmetric else np.repeat(np.abs(qa.minimum.astype(np.float32)), 128 // fmt.groups(128),
                                              axis=-1) * 2 ** -8
    assert np.all(np.abs(back - w) <= 0.5 * step + slack + 1e-6)
    np.testing.assert_array_equal(back[1, 2], 0.0)
    want_q = {8: np.int8, 4: np.uint8}.get(fmt.bits, np.uint8)
    assert qa.q.dtype == want_q and qa.q.shape[-1] == (64 if fmt.bits == 4 else 128)
    assert qa.nbytes < w.nbytes / (2.5 if fmt.scale_bits == 32 else 3)  # int8-g16m: 12 bits a weight


def test_q4k_format():
    """int4-q4k (GGUF Q4_K's blocks): q4k_blocks writes bytes gguf.quants.dequantize reads; the engine's packed
    nibbles and codes dequantize (numpy, and on the device) to exactly those values; the device quantizer of random
    weights makes the same numbers; within a step (and the 6-bit minimum's) of the weights; 4.625 bits a weight."""
    import gguf
    import jax.numpy as jnp
    rng = np.random.default_rng()
    w = (rng.standard_normal((3, 8, 512)) * rng.uniform(0.01, 1.0, (3, 8, 1)) + 0.02).astype(np.float32)
    w[1, 2] = 0.0
    raw = quant.q4k_blocks(w)
    assert raw.shape == (3, 8, 2 * 144) and raw.dtype == np.uint8
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    qa = quant.quantize(w, quant.Q4K)
    assert qa.q.shape == (3, 8, 256) and qa.scale.dtype == np.uint16 and qa.scale.shape == (3, 8, 20)
    np.testing.assert_array_equal(quant.dequantize(qa), want)
    codes = quant.engine_scale(qa)  # group-major [..., 5G/4, O]
    np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_int4(jnp.asarray(qa.q), jnp.asarray(codes),
                                                                          jnp.float32)), want)
    q, c = quant.quantize_device(jnp.asarray(w), quant.Q4K)
    np.testing.assert_array_equal(np.asarray(q), qa.q)
    np.testing.assert_array_equal(np.asarray(c), codes)
    np.testing.assert_array_equal(want[1, 2], 0.0)
    s, mn = quant.q4k_scales(qa.scale)
    step = np.repeat(s, 32, axis=-1)
    assert np.all(np.abs(want - w) <= step + np.repeat(mn, 32, axis=-1) / 63 + 1e-6)
    assert quant.get_format(quant.Q4K).bits_per_weight(512) == 4.625
    assert quant.engine_format(quant.Q4K, (512, 256)) == quant.Q4K
    with pytest.raises(ValueError, match="super-blocks of 256"):
        quant.engine_format(quant.Q4K, (512, 96))



@pytest.mark.parametrize("qtype", list(quant.IQ_KEPT))
def test_iq_types_kept_exactly(qtype):
    """The IQ types kept as read (issue 36): random valid blocks (their fp16 d from subnormal to large, of both
    signs) -> gguf_kept's int8 q and float32 group scales, whose product (numpy, and on the device in the engine's
    group-major layout) is gguf.quants.dequantize's float32 value bit for bit, in several shapes."""
    import gguf
    t = getattr(gguf.GGMLQuantizationType, qtype)
    fmt = quant.get_format(quant.GGUF_KEPT[qtype])
    assert quant.GGUF_BLOCKS[qtype] == gguf.GGML_QUANT_SIZES[t]
    for k, (shape, d_scale) in enumerate([((3, 256), 1e-6), ((2, 5, 512), 1e-3), ((4, 1024), 3e3)]):
        raw = quant.gguf_blocks_random(qtype, shape, seed=k, d_scale=d_scale)
        if k == 1:  # negative d too: flip the sign bit of half the blocks' fp16 d
            at = 48 + 7 if qtype == "IQ1_M" else 1  # the byte holding d's sign bit
            b = raw.reshape(*shape[:-1], -1, quant.GGUF_BLOCKS[qtype][1])
            b[..., ::2, at] ^= 0x80
        want = gguf.quants.dequantize(raw, t)
        assert want.shape == shape and np.isfinite(want).all() and np.count_nonzero(want) > want.size // 2
        q, s = quant.gguf_kept(raw, qtype)
        assert q.dtype == np.int8 and q.shape == shape and s.dtype == np.float32
        assert s.shape == (*shape[:-1], shape[-1] // fmt.group) and fmt.bits == 8 and fmt.symmetric
        np.testing.assert_array_equal(quant.kept_dequantize(q, s).view(np.uint32), want.view(np.uint32))
        if k == 1:
            dev = quant.dequantize_engine_grouped(jnp.asarray(q), jnp.asarray(np.swapaxes(s, -1, -2)), jnp.float32)
            np.testing.assert_array_equal(np.asarray(dev).view(np.uint32), want.view(np.uint32))
def test_q2k_format():
    """int2-q2k (GGUF Q2_K's blocks): random valid Q2_K blocks read into packed crumbs and uint8 codes dequantize
    (numpy, and on the device) to gguf.quants.dequantize's float32 values exactly, in the file's bytes; q2k_blocks
    writes bytes gguf reads, quantize and the device quantizer make the same numbers, within a step (and the 4-bit
    minimum's) of the weights; 2.625 bits a weight."""
    import gguf
    import jax.numpy as jnp
    raw = quant.gguf_blocks_random("Q2_K", (3, 8, 512), seed=5)  # every sc, m and q bit random
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q2_K)
    packed, codes = quant.q2k_from_blocks(raw)
    assert packed.shape == (3, 8, 128) and packed.dtype == np.uint8
    assert codes.shape == (3, 8, 40) and codes.dtype == np.uint8
    assert packed.nbytes + codes.nbytes == raw.nbytes  # the file's bytes, moved
    np.testing.assert_array_equal(quant.q2k_dequantize(packed, codes), want)
    device_codes = jnp.asarray(np.swapaxes(codes, -1, -2))  # group-major [..., 5G/4, O]
    np.testing.assert_array_equal(np.asarray(quant.dequantize_engine_int4(jnp.asarray(packed), device_codes,
                                                                          jnp.float32)), want)
    rng = np.random.default_rng(6)
    q = rng.integers(0, 4, (5, 256), dtype=np.uint8)
    np.testing.assert_array_equal(quant.unpack_int2(quant.pack_int2(q)), q)

    w, want, qa = block_writer_round_trip(rng, quant.Q2K, quant.q2k_blocks, "Q2_K")
    s, mn = quant.q2k_scales(qa.scale)
    assert np.any(mn > 0)
    assert np.all(np.abs(want - w) <= np.repeat(s + mn / 15, 16, axis=-1) + 1e-6)
    assert quant.get_format(quant.Q2K).bits_per_weight(512) == 2.625


def test_error_follows_bits_and_groups():
    rng = np.random.default_rng()
    w = rng.standard_normal((4, 64, 256)).astype(np.float32)
    err = {name: rel_fro(quant.dequantize(quant.quantize(w, name)), w) for name in quant.FORMATS}
    assert err["int8"] < 0.01
    assert err["int8"] < err["int4-g32"] < err["int4"] < err["int4-g128"] < 0.15
    assert err["int4-asym"] < err["int3"] < err["int2"]


@pytest.mark.parametrize("signed", [True, False])
def test_int4_packing_round_trips(signed):
    rng = np.random.default_rng()
    q = rng.integers(-8, 8, (5, 6, 64)).astype(np.int8) if signed else rng.integers(0, 16, (5, 6, 64)).astype(np.uint8)
    packed = quant.pack_int4(q, 32)
    assert packed.shape == (5, 6, 32) and packed.dtype == np.uint8
    # Q4_0's layout: in each group of 32, byte j holds input j (low nibble) and input j + 16 (high), q + 8 if signed
    stored = q.astype(np.int16) + (8 if signed else 0)
    np.testing.assert_array_equal(packed[..., 16:32] & 0xF, stored[..., 32:48])
    np.testing.assert_array_equal(packed[..., 16:32] >> 4, stored[..., 48:64])
    np.testing.assert_array_equal(quant.unpack_int4(packed, 32, signed), q)


def test_int4_device_quantizer_matches_numpy():
    w = np.random.default_rng().standard_normal((3, 8, 256)).astype(np.float32)
    packed, scale = quant.quantize_int4_device(jnp.asarray(w))
    ref = quant.quantize(w, "int4")
    np.testing.assert_array_equal(np.asarray(packed), ref.q)
    np.testing.assert_array_equal(np.asarray(scale.astype(jnp.float32)), ref.scale.astype(np.float32))
    back = quant.dequantize_int4_device(packed, scale, jnp.float32)
    np.testing.assert_array_equal(np.asarray(back), quant.dequantize(ref))


def test_bits_per_weight_and_bad_input():
    assert quant.FORMATS["int8"].bits_per_weight(256) == pytest.approx(8 + 16 / 256)
    assert quant.FORMATS["int4"].bits_per_weight(256) == pytest.approx(4.25)
    assert quant.FORMATS["int4-asym"].bits_per_weight(256) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="multiple of the group"):
        quant.quantize(np.ones((2, 96), np.float32), "int4")
    with pytest.raises(ValueError, match="unknown expert format"):
        quant.get_format("fp4")


def test_quality_study_on_the_embedded_model(tmp_path, capsys, cache_dir):
    """benchmarks/quant_quality end to end: a row per format, KL growing as bits fall, a format whose group does not
    divide the experts' width marked n/a."""
    import json
    from benchmarks import quant_quality
    out = tmp_path / "q.json"
    quant_quality.main(["quant_quality", "--models=embedded", "--formats=int8,int4-g32,int4-g128,int2",
                        "--positions=64", f"--cache_dir={cache_dir}", f"--json={out}"])
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert not rows["int4-g128"]["applicable"]  # the embedded experts are 64 wide
    assert 0 <= rows["int8"]["kl_mean"] < rows["int4-g32"]["kl_mean"] < rows["int2"]["kl_mean"]
    assert rows["int8"]["top1"] >= rows["int2"]["top1"] and 0 <= rows["int2"]["top1"] <= 1
    assert rows["int4-g32"]["bits_per_weight"] == pytest.approx(4.5)
    assert "| embedded" in capsys.readouterr().out


# ---- int8 experts: one arithmetic on the device's XLA path, the Pallas kernel's reference and the host pool -------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_experts_same_rows_on_the_device_and_the_host_pool(dtype):
    """The same int8 experts give the same rows through moe.expert_ffn (the device's XLA path) and the host pool
    (float32: 1e-5 relative, the exact path's bound; bfloat16: within an ulp's worth, as for bf16 experts), and the
    Pallas kernel's reference is that XLA path."""
    import jax
    import jax.numpy as jnp
    from strata_jax.host_pool import HostExpertStore, HostPool
    from strata_jax.pallas_kernels.expert_ffn import expert_ffn_reference
    from strata_jax.model import moe
    rng = np.random.default_rng()
    e, h, i, t = 6, 64, 32, 3
    mats = [rng.standard_normal((e, i, h)) / 8, rng.standard_normal((e, i, h)) / 8, rng.standard_normal((e, h, i)) / 6]
    qs = [quant.quantize(m.astype(np.float32), "int8") for m in mats]
    q = [qa.q for qa in qs]
    scales = [qa.scale[..., 0].astype(np.float32) for qa in qs]  # [E, O]
    ids = np.array([4, -1, 0, 2], np.int32)
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = (rng.random((t, ids.size)) * (ids >= 0)).astype(np.float32)
    jdt = jnp.dtype(dtype)
    with jax.default_matmul_precision("highest"):
        xd = jnp.asarray(x, jdt)
        sel = np.maximum(ids, 0)
        device = np.asarray(moe.expert_ffn(xd, *(jnp.asarray(a[sel]) for a in q), jnp.asarray(w),
                                           *(jnp.asarray(sc[sel]) for sc in scales)))
        reference = np.asarray(expert_ffn_reference(xd, *(jnp.asarray(a) for a in q), jnp.asarray(ids),
                                                    jnp.asarray(w), *(jnp.asarray(sc) for sc in scales)))
    np.testing.assert_array_equal(device, reference)
    store = HostExpertStore([(*q, *scales)], compute_dtype=np.dtype(jdt))
    assert store.compute_dtype == np.dtype(jdt) and store.total_nbytes < sum(m.nbytes for m in mats) / 6
    with HostPool(store, threads=2) as pool:
        host = pool.compute(0, np.asarray(xd, np.float32), ids, w)
    assert rel_fro(host, device) < (1e-5 if dtype == "float32" else 2e-2)
    # and close to the float experts they came from
    float_rows = np.asarray(moe.expert_ffn(jnp.asarray(x), *(jnp.asarray(m[sel], jnp.float32) for m in mats),
                                           jnp.asarray(w)))
    assert rel_fro(host, float_rows) < 3e-2


def test_the_store_wants_scales_with_int8():
    from strata_jax.host_pool import HostExpertStore
    q = np.zeros((2, 4, 8), np.int8)
    with pytest.raises(TypeError, match="three scale arrays"):
        HostExpertStore([(q, q, np.zeros((2, 8, 4), np.int8))])


# ---- expert_dtype=int8 in the engine -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_engine_is_placement_independent(engine_factory, cache_dir, capfd, fmt):
    """expert_dtype=int8 / int4 (float32 compute): every placement of the quantized experts (all resident; 4 slots
    with half the misses fetched over PCIe and half on the host pool; every expert on the pool) gives the same
    logits, 1e-5 relative; they differ from the unquantized model's by about the quantization error; speculative
    greedy equals plain greedy."""
    ids = list(b"def fetch(self, key):\n    return self.table[key]\n")
    want = engine_factory(None, dtype="float32", expert_cache_slots="all").prefill_logits(ids)
    capfd.readouterr()
    from strata_jax import Engine
    base = Engine.from_pretrained(None, verbose=True, cache_dir=str(cache_dir), dtype="float32",
                                  expert_cache_slots="all", expert_dtype=fmt)
    assert f"experts: {fmt}" in capfd.readouterr().err
    assert base.weights.stacked  # all resident: the scanned body, scales stacked with their q
    ref = base.prefill_logits(ids)
    assert 0 < rel_fro(ref, want) < {"int8": 5e-2, "int4": 0.3}[fmt]
    assert rel_fro(base.score(ids), ref) < 1e-5
    stored = quant.storage_dtype(fmt)
    for slots, frac in ((4, "0.5"), (0, "0")):  # fetches and the pool in one engine; then the pool alone
        eng = engine_factory(None, dtype="float32", expert_cache_slots=str(slots), pcie_frac=frac,
                             expert_dtype=fmt)
        assert layer_states(eng.cache.experts)[0].gate.dtype == stored  # the slots hold q
        assert eng.placement.pool.store.dtype == stored
        assert rel_fro(eng.prefill_logits(ids), ref) < 1e-5, (slots, frac)
        assert rel_fro(eng.score(ids), ref) < 1e-5, (slots, frac)
        plain = eng.generate(ids, 12, spec=0, stop_token_ids=[])
        assert eng.generate(ids, 12, spec=3, stop_token_ids=[]) == plain


def test_quantized_state_saves_and_restores(engine_factory, tmp_path):
    """--save_state of int4 experts saves q and the scales; the state restores with expert_dtype=int4 (offloaded:
    the pool gets the scales too) to the same logits, and with auto (the saved form); with another expert_dtype it
    is refused with one line."""
    from strata_jax import Engine, StrataError
    ids = list(b"for key in table:\n    print(key)\n")
    src = engine_factory(None, dtype="float32", expert_cache_slots="all", expert_dtype="int4")
    state = tmp_path / "state"
    src.save_state(state)
    back = Engine.from_pretrained(state, verbose=False, dtype="float32", expert_cache_slots="4", pcie_frac="0.5",
                                  expert_dtype="int4")
    assert back.placement.pool.store.dtype == np.uint8
    assert rel_fro(back.prefill_logits(ids), src.prefill_logits(ids)) < 1e-5
    # expert_dtype=auto restores the form the state was saved in; another is refused with one line
    assert Engine.from_pretrained(state, verbose=False, dtype="float32").options.expert_dtype == "int4"
    with pytest.raises(StrataError, match="expert_dtype=int4 experts, but expert_dtype=int8"):
        Engine.from_pretrained(state, verbose=False, dtype="float32", expert_dtype="int8")


def test_a_vram_budget_holds_about_four_times_the_int4_slots(monkeypatch):
    """expert_cache_slots=auto at the Qwen3-30B-A3B shape with 16 GiB free: int4 experts (scales counted on the
    device) get about 4x the bf16 slots, int8 about 2x."""
    from strata_jax.offload import placement
    from strata_jax.model.config import preset
    from strata_jax.options import EngineOptions, build
    monkeypatch.setattr(placement, "device_free_bytes", lambda: 16 * 2**30)
    cfg = preset("qwen3-30b-a3b")
    slots = {fmt: placement.decide_slots(cfg, build(EngineOptions, dict(dtype="bfloat16", expert_dtype=fmt)), 2**30)[0]
             for fmt in ("auto", "int8", "int4")}
    assert 8 < slots["auto"] < 32, slots
    assert 1.9 < slots["int8"] / slots["auto"] < 2.1 and 3.6 < slots["int4"] / slots["auto"] < 4.1, slots


def test_int4_takes_the_largest_group_that_divides():
    """expert_dtype=int4 is groups of 64 where both widths allow it, else of 32 (the reference model's I=96); a model
    whose experts are not a whole number of 32-input groups is refused with one line, before loading."""
    from strata_jax import Engine, StrataError
    from strata_jax.model.config import preset
    assert quant.engine_format("int4", (2048, 768)) == "int4" and quant.engine_format("int4", (256, 96)) == "int4-g32"
    assert quant.engine_format("int8", (256, 48)) == "int8" and quant.engine_format("auto", (256, 48)) is None
    cfg = preset("tiny").replace(moe_intermediate_size=48)
    with pytest.raises(StrataError, match="groups of 64 or 32"):
        Engine.from_random(cfg, verbose=False, expert_dtype="int4", dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("slots", ["all", "16"])
def test_quantized_kernel_in_the_engine_on_the_gpu(engine_factory, slots, fmt):
    """On the GPU in bf16, int8 / int4 experts through the Pallas expert FFN (q read in place from the experts or
    the slots; the scales beside the resident experts, by window position offloaded) give the XLA path's logits
    (bf16 roundings apart), resident and offloaded; offloaded, the decode windows run the scanned body."""
    ids = list(b"class Stack:\n    def __init__(self):\n        self.items = []\n")
    opts = dict(dtype="bfloat16", expert_cache_slots=slots, pcie_frac="1", expert_dtype=fmt)
    kernel = engine_factory("reference", expert_kernel="pallas", **opts)
    xla = engine_factory("reference", expert_kernel="xla", **opts)
    assert kernel.expert_kernel == "pallas" and xla.expert_kernel == "xla"
    assert kernel.scanned_offload == (slots != "all") == xla.scanned_offload
    assert rel_fro(kernel.score(ids), xla.score(ids)) < 2e-2
    out = kernel.generate(ids, 16, stop_token_ids=[])
    assert len(out) == 16


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_under_the_kernel_scan_offloaded(engine_factory, cache_dir, monkeypatch, fmt):
    """int8 / int4 experts offloaded to 4 slots with expert_kernel=pallas (bf16) run the scanned offload graph: the
    kernel reads the window's scales by position, whatever slot row of the stacked cache (base l*(S+1)) or staging
    row holds the expert. Its decode windows' logits are all resident's (the XLA path) within bf16 rounding, with
    fetches and the pool in the windows. On the CPU the kernel runs in interpret mode; the engine refuses
    expert_kernel=pallas off a GPU (for speed, not arithmetic), so that check is passed here for this engine."""
    ids = list(b"class Stack:\n    def __init__(self):\n        self.items = []\n")
    common = dict(dtype="bfloat16", window=4, context=64, expert_dtype=fmt)
    resident = engine_factory(None, expert_cache_slots="all", expert_kernel="xla", **common)
    want = resident.score(ids)
    eng = engine_with_gpu_paths(monkeypatch, None, cache_dir, expert_cache_slots="4",
                                pcie_frac="0.5", cpu_threads=2, expert_kernel="pallas", **common)
    assert eng.expert_kernel == "pallas" and eng.decode_expert_path.kernel
    assert eng.scanned_offload and eng.placement.native
    assert layer_states(eng.cache.experts)[0].gate.dtype == quant.storage_dtype(fmt)  # the slots hold q
    assert rel_fro(eng.score(ids), want) < 2e-2
    d = eng.stats.last.decode_experts
    assert d.distinct_fetched > 0 and d.distinct_cpu > 0 and d.distinct_resident > 0
    begins = eng.compiled.decode[4].as_text().count('custom_call_target="strata_offload_begin')
    assert begins == 1, begins  # one scanned body, not a call a layer
    assert len(eng.generate(ids[:20], 8, stop_token_ids=[])) == 8


def test_lru_windows_without_staging_under_the_kernel(engine_factory, cache_dir, monkeypatch):
    """Under lru the decode windows of at most S distinct experts leave the staging rows' expert-kernel call out
    (OffloadedExperts.can_stage: every fetch has a victim slot), wider windows keep it, and the static policy (a
    rebuild by reconfigure) stages again: each gives all resident's logits within bf16 rounding, fetching."""
    ids = list(b"def push(self, item):\n    self.items.append(item)\n    return item\n")
    common = dict(dtype="bfloat16", window=4, context=96)
    want = engine_factory(None, expert_cache_slots="all", expert_kernel="xla", **common).score(ids)
    eng = engine_with_gpu_paths(monkeypatch, None, cache_dir, expert_cache_slots="8", pcie_frac="1",
                                expert_kernel="pallas", **common)
    path, k = eng.decode_expert_path, eng.cfg.num_experts_per_tok
    assert path.kernel and path.lru and eng.scanned_offload
    window = lambda t: SimpleNamespace(expert_ids=np.zeros(t * k))  # noqa: E731  (a window's distinct-expert bound)
    stages = [path.can_stage(window(t), SimpleNamespace(slots=8)) for t in (1, 2, 4)]
    assert stages == [False, False, True]  # T=4: 16 experts > 8 slots
    for w in (1, 4):
        assert rel_fro(eng.score(ids, window=w), want) < 2e-2
        assert eng.stats.last.decode_experts.distinct_fetched > 0
    eng.reconfigure(cache_policy="static")
    assert not eng.decode_expert_path.lru
    assert rel_fro(eng.score(ids, window=1), want) < 2e-2


def test_device_int8_is_the_same_numbers():
    """quantize_int8_device (random weights for benchmarks) gives quantize(w, "int8")'s q and scales."""
    import jax.numpy as jnp
    rng = np.random.default_rng()
    w = (rng.standard_normal((3, 16, 64)) * 0.05).astype(np.float32)
    w[0, 3] = 0.0
    q, scale = quant.quantize_int8_device(jnp.asarray(w))
    ref = quant.quantize(w, "int8")
    np.testing.assert_array_equal(np.asarray(q), ref.q)
    np.testing.assert_array_equal(np.asarray(scale.astype(jnp.float32)), ref.scale[..., 0].astype(np.float32))


def test_int8_random_weights_for_benchmarks(cache_dir):
    """Engine.from_random(expert_dtype=int8) (what the benchmarks build): quantized as made, all resident in the
    scanned body, placement-independent."""
    from strata_jax import Engine
    from strata_jax.model.config import preset
    cfg = preset("tiny")
    opts = dict(verbose=False, cache_dir=str(cache_dir), dtype="float32", expert_dtype="int8", window=2, context=64)
    resident = Engine.from_random(cfg, seed=3, expert_cache_slots="all", **opts)
    offloaded = Engine.from_random(cfg, seed=3, expert_cache_slots="4", pcie_frac="0.5", **opts)
    assert resident.scanned and resident.weights.layers.ffn.gate.dtype == np.int8  # made per layer, then stacked
    ids = list(range(5, 40))
    assert rel_fro(offloaded.prefill_logits(ids), resident.prefill_logits(ids)) < 1e-5
