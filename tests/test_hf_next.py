"""Qwen3-Next: the hybrid model (Gated DeltaNet + gated attention, shared expert). Its logits and greedy output
against transformers' Qwen3NextForCausalLM are in tests/test_hf_reference.py (the fixtures tests/fixtures/hf/next_*
are among its folders); here: the config, the chunked delta rule, the recurrent state across verify windows and
requests, chunked prefill, and placement independence."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HF_FIXTURES, hf_fixture_names
from strata_jax import StrataError, config, deltanet
from strata_jax.config import config_from_dict

NEXT = sorted(p.name for p in HF_FIXTURES.glob("next_*") if (p / "reference.npz").is_file())
W = 4
EXACT = dict(dtype="float32", window=W, expert_cache_slots="all")
TOL = 1e-4  # float32 against torch eager, as tests/test_hf_reference.py


def reference(name):
    with np.load(HF_FIXTURES / name / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def test_next_fixtures_found():
    assert len(NEXT) >= 3, f"expected the Qwen3-Next fixtures in {HF_FIXTURES}, found {NEXT}"
    assert set(NEXT) <= set(hf_fixture_names())  # so test_hf_reference compares them with transformers


# ---- config -----------------------------------------------------------------------------------------------------

def test_the_80b_shape_reads_as_transformers_builds_it():
    cfg = config.preset("qwen3-next-80b-a3b")
    assert cfg.next and cfg.num_layers == 48
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)  # full_attention_interval 4
    assert cfg.num_full_layers == 12 and cfg.rotary_dim == 64 and cfg.linear_conv_dim == 8192
    assert cfg.shared_expert_intermediate_size == 512 and cfg.mtp_layers == 1


def _next_raw(**changes):
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 64,
           "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
           "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
           "linear_conv_kernel_dim": 4}
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize("changes, says", [
    (dict(layer_types=["linear_attention", "sliding_attention"]), "sliding_attention"),
    (dict(layer_types=["linear_attention"]), "one type per layer"),
    (dict(linear_num_value_heads=3, linear_num_key_heads=2), "not a multiple"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(linear_conv_kernel_dim=None), "linear_conv_kernel_dim"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
     "partial_rotary_factor"),
])
def test_bad_next_configs_are_one_line(changes, says):
    with pytest.raises(StrataError, match=says) as err:
        config_from_dict(_next_raw(**changes))
    assert "\n" not in str(err.value)


def test_a_minimal_next_config_reads():
    cfg = config_from_dict(_next_raw())
    assert cfg.is_linear(0) and not cfg.is_linear(1) and cfg.partial_rotary_factor == 1.0


# ---- the delta rule -----------------------------------------------------------------------------------------------

def test_chunked_rule_equals_the_recurrent_rule():
    """Prefill's chunked form (several blocks, padding rows) ends where the token-by-token rule does."""
    rng = np.random.default_rng()
    t, n_valid, nv, dk, dv = 150, 137, 3, 8, 16
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((t, nv, dk))).astype(np.float32) * dk ** -0.5
    k = unit(rng.standard_normal((t, nv, dk))).astype(np.float32)
    v = rng.standard_normal((t, nv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (t, nv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (t, nv)).astype(np.float32)
    s0 = rng.standard_normal((nv, dk, dv)).astype(np.float32)
    pad = (np.arange(t) < n_valid)[:, None]
    out_c, last = deltanet.chunked_rule(q, k, v, np.where(pad, g, 0), np.where(pad, beta, 0), s0)
    s, out_r = s0.astype(np.float64), []  # the recurrence token by token, in numpy
    for i in range(n_valid):
        s = s * np.exp(g[i])[:, None, None]
        s = s + k[i][:, :, None] * ((v[i] - np.einsum("hd,hde->he", k[i], s)) * beta[i][:, None])[:, None, :]
        out_r.append(np.einsum("hd,hde->he", q[i], s))
    assert rel(np.asarray(out_c)[:n_valid], np.stack(out_r)) < 1e-5
    assert rel(last, s) < 1e-5


# ---- against transformers ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=NEXT)
def fixture(request, engine_factory):
    name = request.param
    return name, engine_factory(HF_FIXTURES / name, **EXACT), reference(name)


def test_chunked_prefill(engine_factory):
    """Chunks of 3 (< the state ring: every position's state kept) against transformers."""
    name = NEXT[0]
    ref = reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, prefill_chunk=3)
    assert rel(engine.prefill_logits(ref["input_ids"]), ref["logits"]) < TOL
    assert engine.generate(ref["prompt_ids"].tolist(), len(ref["greedy_ids"]), stop_token_ids=[]) == \
        ref["greedy_ids"].tolist()


class OracleDrafter:
    """Proposes the known greedy continuation, wrong at every third draft: windows accept some drafts and reject
    the rest, so the recurrent state must roll back to the accepted position."""

    def __init__(self, prompt_len, greedy):
        self.prompt_len, self.greedy, self.calls = prompt_len, greedy, 0

    def propose(self, tokens, k):
        at = len(tokens) - self.prompt_len
        drafts = list(self.greedy[at:at + k])
        self.calls += 1
        for i in range(len(drafts)):
            if (self.calls + i) % 3 == 2:
                drafts[i] = (drafts[i] + 1) % 64
        return drafts

    def observe(self, accepted):
        pass


def test_verify_windows_roll_the_state_back(fixture):
    name, engine, ref = fixture
    prompt = ref["prompt_ids"].tolist()
    greedy = engine.generate(prompt, 24, spec=0, stop_token_ids=[])
    assert greedy[:12] == ref["greedy_ids"].tolist()
    for spec in ((1, W - 1) if name == NEXT[0] else (W - 1,)):
        assert engine.generate(prompt, 24, spec=spec, draft=OracleDrafter(len(prompt), greedy),
                               stop_token_ids=[]) == greedy, spec
        last = engine.stats.last
        assert 0 < last.drafts_accepted < last.drafts_proposed  # both paths ran
    if name == NEXT[0]:
        assert engine.generate(prompt, 24, spec=W - 1, draft="device", stop_token_ids=[]) == greedy


def test_the_delta_kernel_runs_the_same_rule(engine_factory):
    """delta_kernel=pallas (interpreted off the GPU) against transformers and the XLA rule's greedy output."""
    name = NEXT[0]
    ref = reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, delta_kernel="pallas")
    for window in (1, W):
        assert rel(engine.score(ref["input_ids"][:12], window=window), ref["logits"][:12]) < TOL, window
    prompt = ref["prompt_ids"].tolist()
    xla = engine_factory(HF_FIXTURES / name, **EXACT)
    assert engine.generate(prompt, 10, spec=W - 1, stop_token_ids=[]) == \
        xla.generate(prompt, 10, spec=W - 1, stop_token_ids=[])


def test_placement_does_not_change_the_logits(engine_factory):
    """3 slots of 8 experts, half the misses over PCIe and half in the host pool, against all-resident."""
    name = NEXT[0]
    ref = reference(name)
    resident = engine_factory(HF_FIXTURES / name, **EXACT)
    placed = engine_factory(HF_FIXTURES / name, dtype="float32", window=W, expert_cache_slots=3, pcie_frac=0.5,
                            cpu_threads=2)
    ids = ref["input_ids"]
    assert rel(placed.score(ids), resident.score(ids)) < 1e-5
    assert rel(placed.prefill_logits(ids), resident.prefill_logits(ids)) < 1e-5
    prompt = ref["prompt_ids"].tolist()
    out = placed.generate(prompt, 12, spec=W - 1, stop_token_ids=[])
    moved = placed.stats.last.decode_experts
    assert moved.entries_cpu > 0 and moved.entries_fetched > 0  # both miss paths ran
    assert out == resident.generate(prompt, 12, stop_token_ids=[])


def test_prefix_reuse_continues_from_the_kept_state(engine_factory):
    """Chunks of 5 (the chunked rule over several chunks); a second turn starts from the state the first kept."""
    name = NEXT[0]
    ref = reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, prefill_chunk=5)
    assert rel(engine.prefill_logits(ref["input_ids"]), ref["logits"]) < TOL
    prompt = ref["prompt_ids"].tolist()
    for spec in (0, W - 1):
        out = engine.generate(prompt, 9, spec=spec, stop_token_ids=[])
        turn = prompt + out + [5, 6, 7]
        second = engine.generate(turn, 8, spec=spec, stop_token_ids=[])
        assert engine.stats.last.cached_tokens > len(prompt)  # the reuse ran
        engine._kv_tokens = []  # forget the cache: the same turn from position 0
        assert engine.generate(turn, 8, spec=spec, stop_token_ids=[]) == second
        assert engine.stats.last.cached_tokens == 0


@pytest.mark.gpu
def test_the_gpu_kernels_on_next(engine_factory):
    """bfloat16 on the GPU with every kernel 'auto' (the Pallas expert FFN, attention products and, where
    head_dim allows, decode attention) and the Pallas delta rule, against the same model with XLA everywhere."""
    name = NEXT[0]
    ref = reference(name)
    common = dict(dtype="bfloat16", window=W, expert_cache_slots="all")
    fast = engine_factory(HF_FIXTURES / name, delta_kernel="pallas", **common)
    xla = engine_factory(HF_FIXTURES / name, expert_kernel="xla", attention_kernel="xla", dense_kernel="xla",
                         delta_kernel="xla", **common)
    assert fast.expert_kernel == "pallas" and fast.delta_kernel == "pallas"
    for window in (1, W):
        a, b = fast.score(ref["input_ids"], window=window), xla.score(ref["input_ids"], window=window)
        # Not against float32: this fixture amplifies bf16 rounding (transformers' own bf16 logits are 0.38 from its
        # float32 ones here, against 0.01 for the Qwen3-MoE fixtures), so only the two bf16 paths are compared.
        assert rel(a, b) < 5e-2, window
        assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8
    prompt = ref["prompt_ids"].tolist()
    assert fast.generate(prompt, 12, spec=W - 1, stop_token_ids=[]) == fast.generate(prompt, 12, stop_token_ids=[])


# ---- MTP drafts ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    """next_base with a random MTP module (`mtp.*` tensors as Qwen3-Next checkpoints hold them)."""
    import json
    import shutil
    from safetensors.numpy import save_file
    src = HF_FIXTURES / NEXT[0]
    dst = tmp_path_factory.mktemp("mtp") / NEXT[0]
    shutil.copytree(src, dst)
    raw = json.loads((src / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw))
    h, nq, nkv, d = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    e, f, fs = raw["num_experts"], raw["moe_intermediate_size"], raw["shared_expert_intermediate_size"]
    rng = np.random.default_rng()
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    p = "mtp.layers.0."
    tensors = {"mtp.fc.weight": w(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": w(h),
               "mtp.pre_fc_norm_hidden.weight": w(h), "mtp.norm.weight": w(h),
               p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
               p + "self_attn.q_proj.weight": w(2 * nq * d, h), p + "self_attn.k_proj.weight": w(nkv * d, h),
               p + "self_attn.v_proj.weight": w(nkv * d, h), p + "self_attn.o_proj.weight": w(h, nq * d),
               p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d),
               p + "mlp.gate.weight": w(e, h), p + "mlp.shared_expert_gate.weight": w(1, h),
               p + "mlp.shared_expert.gate_proj.weight": w(fs, h), p + "mlp.shared_expert.up_proj.weight": w(fs, h),
               p + "mlp.shared_expert.down_proj.weight": w(h, fs)}
    for j in range(e):
        q = p + f"mlp.experts.{j}."
        tensors.update({q + "gate_proj.weight": w(f, h), q + "up_proj.weight": w(f, h), q + "down_proj.weight": w(h, f)})
    save_file(tensors, dst / "mtp.safetensors")
    return dst


def test_mtp_drafts_keep_greedy_and_follow_the_module(engine_factory, mtp_folder):
    """draft=mtp: speculative greedy equals plain greedy, and every window's first draft is the module's argmax as a
    from-scratch pass over the whole sequence gives it (main hidden states, then the module over every pair):
    the catch-up keeps the module's KV cache in step across prefill chunks and accepted / rejected drafts, in the
    host loop's drafter (the first window) and inside the window graphs (the rest)."""
    import jax
    import jax.numpy as jnp
    from strata_jax import model, mtp as mtp_mod
    engine = engine_factory(mtp_folder, **EXACT, prefill_chunk=5)
    assert engine.mtp is not None
    firsts = []  # (the module's row that made a window's first draft, that draft)

    def spy(graph):
        def run(weights, cache, mtp, mtp_cache, window, pos):
            window_np = np.asarray(window)
            if window_np.size > 1:  # row pos-1 (hidden, token at pos) predicted the token at pos+1
                firsts.append((int(pos) - 1, int(window_np[1])))
            return graph(weights, cache, mtp, mtp_cache, window, pos)
        return run
    compiled = engine._mtp_graphs()
    for key in [key for key in compiled if key[0] == "fused"]:
        compiled[key] = spy(compiled[key])
    prompt = reference(NEXT[0])["prompt_ids"].tolist()
    plain = engine.generate(prompt, 20, spec=0, stop_token_ids=[])
    for spec in (1, W - 1):
        firsts.clear()
        assert engine.generate(prompt, 20, spec=spec, draft="mtp", stop_token_ids=[]) == plain, spec
        # every window drafted but the last (one token left to make: nothing to draft)
        assert engine.stats.last.drafts_proposed > 0 and len(firsts) == engine.stats.last.windows - 1
    # Sampled: the host loop's drafter (the window graphs return their hidden states); seeded, so reproducible.
    sampled = [engine.generate(prompt, 12, temperature=0.8, seed=3, draft="mtp", stop_token_ids=[])
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 12 and engine.stats.last.drafts_proposed > 0

    seq = np.asarray(prompt + plain, np.int32)
    cfg = engine.cfg
    with jax.default_matmul_precision("highest"):
        cache = model.init_cache(cfg, seq.size + 8, jnp.float32, ring=W + 1)
        _, _, hidden = model.forward(engine.weights, cache, jnp.asarray(seq), jnp.int32(0), jnp.int32(seq.size),
                                     cfg, return_hidden=True)
        n = seq.size - 1
        logits, _, _ = mtp_mod.mtp_layer(engine.weights, engine.mtp, mtp_mod.init_cache(cfg, seq.size + 8, jnp.float32),
                                         hidden[:n], jnp.asarray(seq[1:]), jnp.int32(0), jnp.ones((n,), bool), cfg)
    logits = np.asarray(logits)
    for at, draft in firsts:  # the last window's rows may pass the sequence
        if at < n:
            assert logits[at, draft] >= logits[at].max() - 1e-4 * np.abs(logits[at]).max(), (at, draft)


def test_mtp_without_the_module_is_a_line_and_ngram(engine_factory, capfd):
    name = NEXT[0]
    engine = engine_factory(HF_FIXTURES / name, **EXACT)
    prompt = reference(name)["prompt_ids"].tolist()
    ngram = engine.generate(prompt, 12, draft="ngram", stop_token_ids=[])
    ngram_stats = engine.stats.last
    capfd.readouterr()
    assert engine.generate(prompt, 12, draft="mtp", stop_token_ids=[]) == ngram
    assert "no MTP module" in capfd.readouterr().err
    assert engine.stats.last.drafts_proposed == ngram_stats.drafts_proposed
