"""Qwen3-Next: the hybrid model (Gated DeltaNet + gated attention, shared expert). Its logits and greedy output
against transformers' Qwen3NextForCausalLM are in tests/model/test_hf_reference.py (the fixtures tests/fixtures/hf/next_*
are among its folders); here: the config, the chunked delta rule, the recurrent state across verify windows and
requests, chunked prefill, and placement independence."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HF_FIXTURES, hf_fixture_names
from helpers import hf_reference, random_mtp_tensors, rel_fro, split_experts
from strata_jax import StrataError
from strata_jax.model import config, deltanet
from strata_jax.model.config import config_from_dict

NEXT = sorted(p.name for p in HF_FIXTURES.glob("next_*") if (p / "reference.npz").is_file())
W = 4
EXACT = dict(dtype="float32", window=W, expert_cache_slots="all")
TOL = 1e-4  # float32 against torch eager, as tests/model/test_hf_reference.py


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
    # transformers' Qwen3NextConfig default: RoPE on a quarter of the head dimension
    assert cfg.is_linear(0) and not cfg.is_linear(1) and cfg.partial_rotary_factor == 0.25


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
    assert rel_fro(np.asarray(out_c)[:n_valid], np.stack(out_r)) < 1e-5
    assert rel_fro(last, s) < 1e-5


# ---- against transformers ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=NEXT)
def fixture(request, engine_factory):
    name = request.param
    return name, engine_factory(HF_FIXTURES / name, **EXACT), hf_reference(name)


def test_chunked_prefill(engine_factory):
    """Chunks of 3 (< the state ring: every position's state kept) against transformers."""
    name = NEXT[0]
    ref = hf_reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, prefill_chunk=3)
    assert rel_fro(engine.prefill_logits(ref["input_ids"]), ref["logits"]) < TOL
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
    ref = hf_reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, delta_kernel="pallas")
    for window in (1, W):
        assert rel_fro(engine.score(ref["input_ids"][:12], window=window), ref["logits"][:12]) < TOL, window
    prompt = ref["prompt_ids"].tolist()
    xla = engine_factory(HF_FIXTURES / name, **EXACT)
    assert engine.generate(prompt, 10, spec=W - 1, stop_token_ids=[]) == \
        xla.generate(prompt, 10, spec=W - 1, stop_token_ids=[])


def test_placement_does_not_change_the_logits(engine_factory):
    """3 slots of 8 experts, half the misses over PCIe and half in the host pool, against all-resident."""
    name = NEXT[0]
    ref = hf_reference(name)
    resident = engine_factory(HF_FIXTURES / name, **EXACT)
    placed = engine_factory(HF_FIXTURES / name, dtype="float32", window=W, expert_cache_slots=3, pcie_frac=0.5,
                            cpu_threads=2)
    ids = ref["input_ids"]
    assert rel_fro(placed.score(ids), resident.score(ids)) < 1e-5
    assert rel_fro(placed.prefill_logits(ids), resident.prefill_logits(ids)) < 1e-5
    prompt = ref["prompt_ids"].tolist()
    out = placed.generate(prompt, 12, spec=W - 1, stop_token_ids=[])
    moved = placed.stats.last.decode_experts
    assert moved.entries_cpu > 0 and moved.entries_fetched > 0  # both miss paths ran
    assert out == resident.generate(prompt, 12, stop_token_ids=[])


def test_prefix_reuse_continues_from_the_kept_state(engine_factory):
    """Chunks of 5 (the chunked rule over several chunks); a second turn starts from the state the first kept."""
    name = NEXT[0]
    ref = hf_reference(name)
    engine = engine_factory(HF_FIXTURES / name, **EXACT, prefill_chunk=5)
    assert rel_fro(engine.prefill_logits(ref["input_ids"]), ref["logits"]) < TOL
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
    ref = hf_reference(name)
    common = dict(dtype="bfloat16", window=W, expert_cache_slots="all")
    fast = engine_factory(HF_FIXTURES / name, delta_kernel="pallas", **common)
    xla = engine_factory(HF_FIXTURES / name, expert_kernel="xla", attention_kernel="xla", dense_kernel="xla",
                         delta_kernel="xla", **common)
    assert fast.expert_kernel == "pallas" and fast.delta_kernel == "pallas"
    for window in (1, W):
        a, b = fast.score(ref["input_ids"], window=window), xla.score(ref["input_ids"], window=window)
        # Not against float32: this fixture amplifies bf16 rounding (transformers' own bf16 logits are 0.38 from its
        # float32 ones here, against 0.01 for the Qwen3-MoE fixtures), so only the two bf16 paths are compared.
        assert rel_fro(a, b) < 5e-2, window
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
    tensors = random_mtp_tensors(raw, np.random.default_rng(), fused=False)  # per expert, as Next's Hub files
    save_file(tensors, dst / "mtp.safetensors")
    return dst


def test_mtp_drafts_keep_greedy_and_follow_the_module(engine_factory, mtp_folder):
    """draft=mtp: speculative greedy equals plain greedy, and every window's first draft is the module's argmax as a
    from-scratch pass over the whole sequence gives it (main hidden states, then the module over every pair):
    the catch-up keeps the module's KV cache in step across prefill chunks and accepted / rejected drafts, in the
    host loop's drafter (the first window) and inside the window graphs (the rest)."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model import transformer
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.speculative import mtp as mtp_mod
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
    compiled = engine.compiled.mtp_graphs()
    for key in [key for key in compiled if key[0] == "fused"]:
        compiled[key] = spy(compiled[key])
    prompt = hf_reference(NEXT[0])["prompt_ids"].tolist()
    plain = engine.generate(prompt, 20, spec=0, stop_token_ids=[])
    for spec in (1, W - 1):
        firsts.clear()
        assert engine.generate(prompt, 20, spec=spec, draft="mtp", stop_token_ids=[]) == plain, spec
        # every window drafted but a last one with one token left to make (nothing to draft); whether the request
        # ends on such a window depends on the drafts accepted before it (the MTP module's weights are drawn fresh)
        assert engine.stats.last.drafts_proposed > 0 and engine.stats.last.windows - len(firsts) in (0, 1)
    # Sampled: the host loop's drafter (the window graphs return their hidden states); seeded, so reproducible.
    sampled = [engine.generate(prompt, 12, temperature=0.8, seed=3, draft="mtp", stop_token_ids=[])
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 12 and engine.stats.last.drafts_proposed > 0
    # ... and the same whatever the engine served before (prefix reuse would hand the module other KV rows)
    longer = prompt + plain[:6]
    after = []
    for before in (prompt, longer[::-1]):  # a request this one extends; an unrelated one
        engine.generate(before, 4, stop_token_ids=[])
        after.append(engine.generate(longer, 12, temperature=0.8, seed=4, draft="mtp", stop_token_ids=[]))
        assert engine.stats.last.cached_tokens == 0
    assert after[0] == after[1]

    seq = np.asarray(prompt + plain, np.int32)
    cfg = engine.cfg
    with jax.default_matmul_precision("highest"):  # each pass one jitted graph (op by op: ~350 compiles)
        cache = init_cache(cfg, seq.size + 8, jnp.float32, ring=W + 1)
        forward = jax.jit(transformer.forward, static_argnums=5, static_argnames="return_hidden")
        _, _, hidden = forward(engine.weights, cache, jnp.asarray(seq), jnp.int32(0), jnp.int32(seq.size), cfg,
                               return_hidden=True)
        n = seq.size - 1
        logits, _, _ = jax.jit(mtp_mod.mtp_layer, static_argnums=7)(
            engine.weights, engine.mtp, mtp_mod.init_cache(cfg, seq.size + 8, jnp.float32), hidden[:n],
            jnp.asarray(seq[1:]), jnp.int32(0), jnp.ones((n,), bool), cfg)
    logits = np.asarray(logits)
    for at, draft in firsts:  # the last window's rows may pass the sequence
        if at < n:
            assert logits[at, draft] >= logits[at].max() - 1e-4 * np.abs(logits[at]).max(), (at, draft)


def test_mtp_without_the_module_is_a_line_and_ngram(engine_factory, capfd):
    name = NEXT[0]
    engine = engine_factory(HF_FIXTURES / name, **EXACT)
    prompt = hf_reference(name)["prompt_ids"].tolist()
    ngram = engine.generate(prompt, 12, draft="ngram", stop_token_ids=[])
    ngram_stats = engine.stats.last
    capfd.readouterr()
    assert engine.generate(prompt, 12, draft="mtp", stop_token_ids=[]) == ngram
    assert "no MTP module" in capfd.readouterr().err
    assert engine.stats.last.drafts_proposed == ngram_stats.drafts_proposed


# ---- Qwen3.5-MoE's text model ------------------------------------------------------------------------------------
# The fixture (tests/fixtures/make_hf_next_fixtures.py: Qwen3_5MoeForConditionalGeneration, saved as the Hub files are)
# is among test_hf_reference's folders: prefill logits, score at T=1..4, greedy and its step logits against
# transformers. Here: its config, its tensor layouts, and the state rollback on it.

QWEN35 = "qwen35_moe_base"


def _qwen35_raw():
    import json
    return json.loads((HF_FIXTURES / QWEN35 / "config.json").read_text())


def _text_only(raw):
    """The same model as Qwen3_5MoeForCausalLM saves it: the text config at the top level."""
    return dict(raw["text_config"], architectures=["Qwen3_5MoeForCausalLM"],
                tie_word_embeddings=raw["tie_word_embeddings"])


def test_qwen35_fixture_is_compared_with_transformers():
    assert QWEN35 in hf_fixture_names()  # so test_hf_reference compares it with transformers


def test_qwen35_config_reads_its_text_model(capsys):
    raw = _qwen35_raw()
    where = "q35/config.json"
    cfg = config_from_dict(raw, where=where)
    assert cfg.next and cfg.qwen35 and cfg.num_layers == 4 and cfg.rotary_dim == 4
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert all(cfg.sparse_layers) and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    assert cfg.shared_expert_intermediate_size == 48 and cfg.linear_num_value_heads == 4
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "vision_config ignored" in lines[0]
    config_from_dict(raw, where=where)
    assert capsys.readouterr().err == ""  # one line per config file, not per read
    assert config_from_dict(_text_only(raw)) == cfg  # the text-only save: no vision line
    assert capsys.readouterr().err == ""
    # transformers' default partial_rotary_factor for Qwen3.5 is 0.25 (not 1)
    text = dict(raw["text_config"], rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert config_from_dict(dict(raw, text_config=text), where=where).rotary_dim == 4


@pytest.mark.parametrize("changes, says", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(attn_output_gate=False), "attn_output_gate"),
    (dict(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings"),
    (dict(model_type="qwen3_5_text"), "qwen3_5_text"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(linear_num_key_heads=None), "linear_num_key_heads"),
])
def test_bad_qwen35_configs_are_one_line(changes, says):
    raw = _qwen35_raw()
    text = {k: v for k, v in dict(raw["text_config"], **changes).items() if v is not None}
    for bad in (dict(raw, text_config=text), dict(_text_only(dict(raw, text_config=text)))):
        with pytest.raises(StrataError, match=says) as err:
            config_from_dict(bad)
        assert "\n" not in str(err.value)


def _tensors(folder):
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_weights(a, b):
    import jax
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


def test_qwen35_layouts_load_alike(tmp_path):
    """The Hub files (model.language_model.*, fused experts, model.visual.*) and the same model saved text-only
    (model.*, experts per expert) load into the same weights; the MTP module's experts likewise."""
    import json
    from safetensors.numpy import save_file
    from strata_jax.io import checkpoint
    raw = _qwen35_raw()
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    rng = np.random.default_rng(0)
    hub, text = tmp_path / "hub", tmp_path / "text"
    hub.mkdir(), text.mkdir()
    tensors = _tensors(HF_FIXTURES / QWEN35)
    assert any(k.startswith("model.visual.") for k in tensors)
    mtp = random_mtp_tensors(raw["text_config"], rng, fused=True)
    save_file(dict(tensors, **mtp), hub / "model.safetensors")
    (hub / "config.json").write_text(json.dumps(raw))
    flat = {k.replace("model.language_model.", "model."): v for k, v in split_experts(tensors).items()
            if not k.startswith("model.visual.")}
    save_file(dict(flat, **split_experts(mtp)), text / "model.safetensors")
    (text / "config.json").write_text(json.dumps(_text_only(raw)))
    cfg = config.load_config(hub)
    assert config.load_config(text) == cfg and cfg.mtp_layers == 1
    _same_weights(checkpoint.load_weights(hub, cfg), checkpoint.load_weights(text, cfg))
    assert checkpoint.has_mtp(hub, cfg) and checkpoint.has_mtp(text, cfg)
    _same_weights(checkpoint.load_mtp(hub, cfg), checkpoint.load_mtp(text, cfg))


def _next_to_qwen35(tensors, raw):
    """next_base's tensors in Qwen3.5's names: in_proj_qkvz / in_proj_ba (grouped per key head) split into
    in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (head order), under model.language_model."""
    nk, nv, dk, dv = (raw[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    r = nv // nk
    out = {}
    for name, x in tensors.items():
        new = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if name.endswith("in_proj_qkvz.weight"):
            g = x.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            h = x.shape[-1]
            out[new.replace("in_proj_qkvz", "in_proj_qkv")] = np.concatenate(
                [q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
            out[new.replace("in_proj_qkvz", "in_proj_z")] = z.reshape(-1, h)
        elif name.endswith("in_proj_ba.weight"):
            b, a = np.split(x.reshape(nk, 2 * r, -1), 2, axis=1)
            out[new.replace("in_proj_ba", "in_proj_b")] = b.reshape(nv, -1)
            out[new.replace("in_proj_ba", "in_proj_a")] = a.reshape(nv, -1)
        else:
            out[new] = x
    return out


def test_next_weights_in_the_qwen35_layout_load_unchanged(tmp_path):
    """Independent of the fixture: next_base's tensors rewritten as a Qwen3.5-MoE checkpoint (split projections,
    model.language_model., every layer MoE as next_base) load into exactly next_base's weights and config (the same
    arithmetic), so its logits are next_base's, which test_hf_reference holds against transformers."""
    import json
    from safetensors.numpy import save_file
    from strata_jax.io import checkpoint
    name = NEXT[0]  # next_base: every layer MoE, norm_topk_prob, as Qwen3.5 requires
    src = json.loads((HF_FIXTURES / name / "config.json").read_text())
    assert src["norm_topk_prob"] and not src["mlp_only_layers"] and src["decoder_sparse_step"] == 1
    text = {k: v for k, v in src.items() if k not in ("architectures", "norm_topk_prob", "mlp_only_layers",
                                                       "decoder_sparse_step", "intermediate_size")}
    text["model_type"] = "qwen3_5_moe_text"
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": src["tie_word_embeddings"]}
    dst = tmp_path / "as_qwen35"
    dst.mkdir()
    save_file(_next_to_qwen35(_tensors(HF_FIXTURES / name), src), dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(raw))
    cfg = config.load_config(dst)
    # intermediate_size: only dense layers read it (Qwen3.5 has none)
    assert cfg.replace(variant="", intermediate_size=src["intermediate_size"]) == config.load_config(HF_FIXTURES / name)
    _same_weights(checkpoint.load_weights(dst, cfg), checkpoint.load_weights(HF_FIXTURES / name, cfg.replace(variant="")))


def test_qwen35_missing_tensor_is_one_line(tmp_path):
    import json
    from safetensors.numpy import save_file
    from strata_jax.io import checkpoint
    dst = tmp_path / "broken"
    dst.mkdir()
    tensors = _tensors(HF_FIXTURES / QWEN35)
    del tensors["model.language_model.layers.1.linear_attn.in_proj_z.weight"]
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(_qwen35_raw()))
    with pytest.raises(StrataError, match="layers.1.linear_attn.in_proj_z.weight") as err:
        checkpoint.load_weights(dst, config.load_config(dst))
    assert "\n" not in str(err.value)


def test_qwen35_verify_windows_roll_the_state_back(engine_factory):
    """Drafts accepted and rejected on the Qwen3.5 fixture: speculative greedy equals transformers' greedy."""
    ref = hf_reference(QWEN35)
    engine = engine_factory(HF_FIXTURES / QWEN35, **EXACT)
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    assert engine.generate(prompt, len(greedy), spec=W - 1, draft=OracleDrafter(len(prompt), greedy),
                           stop_token_ids=[]) == greedy
    last = engine.stats.last
    assert 0 < last.drafts_accepted < last.drafts_proposed
