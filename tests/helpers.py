"""Helpers shared by the test modules (`from helpers import ...`; tests/ is on sys.path). Fixtures stay in conftest.py.

- rel_fro: the relative Frobenius error every numeric bound in the tests is written in;
- one_line_refusal: a StrataError whose message is one line;
- the host-pool and expert-FFN references: random float experts, the float64 expert FFN with the device's bf16
  roundings (g, u, h and each expert's output), summed over a route or per (token, entry);
- with_garbage: cache rows past the valid ones replaced by huge values, NaN and +-inf (kernels must not read them);
- hf_reference: a committed HF fixture's reference arrays.
"""
from __future__ import annotations

import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import HF_FIXTURES
from strata_jax import StrataError

BF16 = np.dtype(ml_dtypes.bfloat16)  # strata_jax.host_pool.store.BF16


# ---- errors ------------------------------------------------------------------------------------------------------

def rel_fro(a, b) -> float:
    """||a - b||_F / ||b||_F, computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def one_line_refusal(fn, *args, match: str | None = None, **kwargs) -> str:
    """fn(*args, **kwargs) raises StrataError (its message matching the regex `match`, if given) in one line: the
    message."""
    with pytest.raises(StrataError, match=match) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    return msg


# ---- host pool / expert FFN references ---------------------------------------------------------------------------

def rng_for(name: str) -> np.random.Generator:
    """A fresh generator with a seed per test (and per parameter set)."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def random_layers(rng, dtype=np.float32, *, layers: int, e: int, h: int, i: int) -> list:
    """Per layer (gate [E, I, H], up [E, I, H], down [E, H, I]): 0.1 * standard normal, as `dtype`."""
    return [tuple((0.1 * rng.standard_normal(shape)).astype(dtype)
                  for shape in ((e, i, h), (e, i, h), (e, h, i)))
            for _ in range(layers)]


def no_round(a):
    return a


def bf16_round(a):
    """float64 -> the nearest bf16 value, as float64."""
    return a.astype(np.float32).astype(BF16).astype(np.float64)


def rounding(dtype):
    """Where the device rounds for weights / compute in `dtype`: bf16_round for bfloat16, nothing otherwise."""
    return bf16_round if np.dtype(dtype) == BF16 else no_round


def expert_rows(layer_weights, x, e, rnd=no_round):
    """float64 [T, H] = down_e @ (silu(gate_e @ x) * (up_e @ x)) for float64 weights (gate, up, down) and x [T, H];
    `rnd` applied where the device rounds (g, u, h and the expert's output)."""
    gate, up, down = layer_weights
    g, u = rnd(x @ gate[e].T), rnd(x @ up[e].T)  # [T, I]
    h = rnd(g / (1.0 + np.exp(-g)) * u)  # silu(g) * u
    return rnd(h @ down[e].T)  # [T, H]


def block_writer_round_trip(rng, fmt: str, writer, qtype: str):
    """A K-type block format's writer of float weights (quant.q2k_blocks, q6k_blocks) on random rows [3, 8, 512] with
    one row of zeros: its bytes are whole `qtype` blocks gguf reads (the zero row reads 0), and quant.quantize and the
    device quantizer make those same numbers. Returns (w, gguf's values, quant.quantize's result)."""
    import gguf
    from strata_jax.model import quant
    w = (rng.standard_normal((3, 8, 512)) * rng.uniform(0.01, 1.0, (3, 8, 1)) + 0.02).astype(np.float32)
    w[1, 2] = 0.0
    raw = writer(w)
    assert raw.shape == (3, 8, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    assert raw.dtype == np.uint8
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    qa = quant.quantize(w, fmt)
    np.testing.assert_array_equal(quant.dequantize(qa), want)
    q, c = quant.quantize_device(jnp.asarray(w), fmt)
    np.testing.assert_array_equal(np.asarray(q), qa.q)
    np.testing.assert_array_equal(np.asarray(c), quant.engine_scale(qa))
    np.testing.assert_array_equal(want[1, 2], 0.0)
    return w, want, qa


def assert_blocks_are(packed, codes, want, fmt: str) -> None:
    """A block format's packed q [..., O, stored] and codes [..., O, C] (a GGUF tensor read into `fmt`) are that
    format's by their shapes, and dequantize to `want` (gguf.quants' float32 values) bit for bit: in numpy and on the
    device (the codes group-major there, as the engine holds them)."""
    from strata_jax.model import quant
    assert packed.dtype == np.uint8 and quant.block_format(codes.dtype, packed.shape[-1], codes.shape[-1]) == fmt
    np.testing.assert_array_equal(quant.blocks_dequantize(packed, codes).view(np.uint32), want.view(np.uint32))
    device_codes = jnp.asarray(np.swapaxes(codes, -1, -2))
    for dequantize in (quant.dequantize_engine_blocks, quant.dequantize_engine_int4):
        dev = np.asarray(dequantize(jnp.asarray(packed), device_codes, jnp.float32))
        np.testing.assert_array_equal(dev.view(np.uint32), want.view(np.uint32))


# The C expert kernel's builds the packed formats' tests run in: the default one (the engine's), AVX2 and the last
# portable fallback (no -march, no OpenMP: GNU vectors, SSE2)
KERNEL_BUILDS = ("default", "avx2", "plain")


def use_kernel_build(build: str, monkeypatch, tmp_path):
    """The host pool's C kernel built here with `build`'s flags (KERNEL_BUILDS) and made the one the pool uses
    (native.experts_kernel patched, the native path on); skips where there is no compiler, or AVX2 on another ISA."""
    import platform

    from strata_jax.host_pool import native
    if native.experts_kernel() is None:
        pytest.skip(native.describe_experts())
    if build == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is x86's")
    kernel = native.experts_kernel()
    flags = {"avx2": ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"),
             "plain": native.EXPERTS_FLAGS[-1]}.get(build)
    if flags is not None:
        path = tmp_path / f"{build}.so"
        native._compile(native._find_compiler(), flags, path, native.EXPERTS_SOURCE)
        kernel = native.ExpertsKernel(path)
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setattr(native, "experts_kernel", lambda: kernel)
    return kernel


def pool_error_float32(pool, weights, rng, T: int) -> float:
    """One float32 pool job of T tokens (experts 2, 0, 1 and a padding entry, random weights a row) against the
    float64 reference FFN over `weights` (their values as float32): rel_fro of the pool's y."""
    ids = np.array([2, -1, 0, 1], np.int32)
    x = rng.standard_normal((T, weights[0].shape[-1])).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    return rel_fro(pool.compute(0, x, ids, w), reference_ffn(weights, x, ids, w, rounding("float32")))


def reference_ffn(layer_weights, x, ids, w, rnd=None):
    """float64 y [T, H] = sum_n w[:, n] * expert_rows(ids[n]) (ids[n] < 0: padding, skipped). rnd: by default the
    rounding of the weights' dtype (bf16 weights: rounded where the device rounds; the pool must round there too)."""
    rnd = rounding(layer_weights[0].dtype) if rnd is None else rnd
    weights = tuple(np.asarray(a, np.float64) for a in layer_weights)
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], weights[2].shape[1]))
    for n, e in enumerate(ids):
        if e >= 0:
            y += w[:, n:n + 1] * expert_rows(weights, x, e, rnd)
    return y


def reference_rows(layer_weights, x, ids, rnd=None):
    """float64 unweighted rows [T, K, H]: expert ids[t, k]'s rows for token t, 0 where ids == -1. rnd as in
    reference_ffn."""
    rnd = rounding(layer_weights[0].dtype) if rnd is None else rnd
    weights = tuple(np.asarray(a, np.float64) for a in layer_weights)
    T, K = ids.shape
    rows = np.zeros((T, K, x.shape[1]))
    for t, k in zip(*np.nonzero(ids >= 0)):
        rows[t, k] = expert_rows(weights, np.asarray(x[t:t + 1], np.float64), ids[t, k], rnd)[0]
    return rows


# ---- kernels -----------------------------------------------------------------------------------------------------

def with_garbage(x, first_bad: int, seed: int):
    """Rows >= first_bad (axis 0) replaced by huge random values with NaN and +-inf sprinkled in."""
    rng = np.random.default_rng(seed)
    bad = np.asarray(x, np.float32).copy()
    tail = rng.standard_normal(bad[first_bad:].shape) * 1e30
    tail[rng.random(tail.shape) < 0.3] = np.nan
    tail[rng.random(tail.shape) < 0.1] = np.inf
    tail[rng.random(tail.shape) < 0.1] = -np.inf
    bad[first_bad:] = tail
    return jnp.asarray(bad, x.dtype)


# ---- HF fixtures -------------------------------------------------------------------------------------------------

def hf_reference(name: str) -> dict:
    """tests/fixtures/hf/NAME/reference.npz as a dict of arrays."""
    with np.load(HF_FIXTURES / name / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def random_mtp_tensors(t: dict, rng, fused: bool = False) -> dict:
    """A random MTP module (`mtp.*`) for a Qwen3-Next-shaped text config `t`, its experts fused (as Qwen3.5's main
    layers on the Hub) or per expert (as Qwen3-Next's)."""
    h, nq, nkv, d = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    e, f, fs = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    p = "mtp.layers.0."
    out = {"mtp.fc.weight": w(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": w(h),
           "mtp.pre_fc_norm_hidden.weight": w(h), "mtp.norm.weight": w(h),
           p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
           p + "self_attn.q_proj.weight": w(2 * nq * d, h), p + "self_attn.k_proj.weight": w(nkv * d, h),
           p + "self_attn.v_proj.weight": w(nkv * d, h), p + "self_attn.o_proj.weight": w(h, nq * d),
           p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d),
           p + "mlp.gate.weight": w(e, h), p + "mlp.shared_expert_gate.weight": w(1, h),
           p + "mlp.shared_expert.gate_proj.weight": w(fs, h), p + "mlp.shared_expert.up_proj.weight": w(fs, h),
           p + "mlp.shared_expert.down_proj.weight": w(h, fs),
           p + "mlp.experts.gate_up_proj": w(e, 2 * f, h), p + "mlp.experts.down_proj": w(e, h, f)}
    if not fused:
        out = split_experts(out)
    return out


def split_experts(tensors):
    """Fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] -> per-expert tensors."""
    out = {}
    for name, x in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            f = x.shape[1] // 2
            for j in range(x.shape[0]):
                out[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = np.ascontiguousarray(x[j, :f])
                out[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = np.ascontiguousarray(x[j, f:])
        elif name.endswith("experts.down_proj"):
            for j in range(x.shape[0]):
                out[name.replace("down_proj", f"{j}.down_proj.weight")] = np.ascontiguousarray(x[j])
        else:
            out[name] = x
    return out


def engine_with_gpu_paths(monkeypatch, path, cache_dir, **options):
    """An engine whose expert paths are chosen as on a GPU (expert_kernel=pallas is a GPU-only choice, refused on the
    CPU for speed, not arithmetic), so the Pallas expert kernel runs here, interpreted, inside the engine's graphs."""
    from strata_jax.engine import api as engine_mod
    real_paths = engine_mod.Engine._expert_paths

    def paths_as_on_a_gpu(self):
        with monkeypatch.context() as m:
            m.setattr(engine_mod.jax, "default_backend", lambda: "gpu")
            return real_paths(self)
    monkeypatch.setattr(engine_mod.Engine, "_expert_paths", paths_as_on_a_gpu)
    return engine_mod.Engine.from_pretrained(path, verbose=False, cache_dir=str(cache_dir), **options)


def gguf_kernel_offload_check(engine_factory, monkeypatch, cache_dir, path, ids, gate_dtype, down_dtype, store_format):
    """A GGUF's kept experts offloaded to 3 slots with expert_kernel=pallas (bf16; interpreted on the CPU, the engine's
    GPU-only check passed as engine_with_gpu_paths does): the scanned offload graph, the kernel reading each
    family's scales by window position, fetches and the pool's C kernel in the windows (pcie_frac 0.5), its logits
    within bf16 rounding of all resident through the XLA path; the slots and the pool hold the kept form."""
    import numpy as np
    from strata_jax.offload.slots import layer_states
    common = dict(dtype="bfloat16", window=4, context=64)
    want = engine_factory(path, expert_cache_slots="all", expert_kernel="xla", **common).score(ids)
    eng = engine_with_gpu_paths(monkeypatch, path, cache_dir, expert_cache_slots="3",
                                pcie_frac="0.5", cpu_threads=2, expert_kernel="pallas", **common)
    assert eng.expert_kernel == "pallas" and eng.decode_expert_path.kernel and eng.scanned_offload
    first = layer_states(eng.cache.experts)[0]
    assert first.gate.dtype == gate_dtype and first.down.dtype == down_dtype
    assert eng.placement.pool.store.format == store_format
    assert rel_fro(eng.score(ids), want) < 2e-2
    d = eng.stats.last.decode_experts
    assert d.distinct_fetched > 0 and d.distinct_cpu > 0
    assert len(eng.generate(ids, 6, stop_token_ids=[])) == 6
