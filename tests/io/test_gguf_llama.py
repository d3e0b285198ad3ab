"""The GGUF files users have, made by llama.cpp itself: tiny Qwen3-MoE GGUFs quantized by `llama-quantize` to
Q4_K_M (Q4_K with Q6_K where llama.cpp wants more bits: one layer's down experts, the output), Q2_K (Q2_K with Q3_K
down experts) and IQ2_XS (fitted with an importance matrix), and llama.cpp's own greedy tokens on each
(`tests/fixtures/make_gguf_fixtures.py`; committed in `tests/fixtures/gguf/`). The engine reads each file's
weights as gguf.quants.dequantize gives them (float32, exactly), its logits equal those of a safetensors checkpoint
of those values with the experts kept as read, all resident and offloaded, its tokenizer gives llama.cpp's prompt ids,
and its greedy tokens are llama.cpp's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

import test_gguf
from helpers import rel_fro
from strata_jax.io import checkpoint, gguf_file
from strata_jax.io.embedded import random_checkpoint
from strata_jax.model.config import load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECORD = json.loads((FIXTURES / "gguf" / "llama_tokens.json").read_text())
sys.path.insert(0, str(FIXTURES))
from make_gguf_fixtures import config  # noqa: E402 (the fixtures' model, as written)

EXACT = dict(dtype="float32", expert_cache_slots="all")
# llama.cpp rounds its activations to 8 bits before each quantized product (block_q8_K), which moves a logit by a
# few hundredths here (logits' spread ~3.7): our top two closer than this may come in either order there.
NEAR_TIE = 0.1
HELD = {"Q4_K_M.gguf": "int4-q4k/int6-q6km", "Q2_K.gguf": "int2-q2k/int6-q6k", "IQ2_XS.gguf": "int8-g16"}


@pytest.fixture(scope="module", params=sorted(RECORD["files"]))
def llama_file(request, tmp_path_factory):
    """(the fixture's path, its record, a safetensors folder of its values by gguf.quants.dequantize)."""
    path = FIXTURES / "gguf" / request.param
    raw = config()
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, raw["num_hidden_layers"])
    want = {}
    for hub, x in test_gguf.stacked(random_checkpoint(raw, seed=0), raw["num_hidden_layers"],
                                    raw["num_local_experts"]).items():
        t = tensors[names.get_name(hub, try_suffixes=(".weight",))]
        want[hub] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
    return path, RECORD["files"][request.param], test_gguf.dequantized_folder(tmp_path_factory.mktemp("deq"), raw,
                                                                               want)


def test_weights_are_gguf_dequantize(llama_file, cache_dir):
    path, _, dequantized = llama_file
    folder = gguf_file.gguf_model_folder(path, cache_dir)
    cfg = load_config(folder)
    test_gguf.assert_same_weights(checkpoint.load_weights(folder, cfg, jnp.float32),
                                  checkpoint.load_weights(dequantized, cfg, jnp.float32))


@pytest.mark.parametrize("placement", [EXACT, dict(dtype="float32", expert_cache_slots="2", pcie_frac="0.5",
                                                   cpu_threads=2)], ids=["resident", "offloaded"])
def test_logits_equal_the_dequantized_model(llama_file, engine_factory, placement):
    """The experts kept as read (expert_dtype=auto, by family: Q4_K_M's Q4_K gate/up int4-q4k, its down of Q4_K and
    Q6_K layers int6-q6km; Q2_K's int2-q2k and Q3_K down int6-q6k; IQ2_XS's int8-g16), all on the device or in 2
    slots of 4 with half the misses in the host pool: the dequantized model's logits."""
    path, record, dequantized = llama_file
    ids = record["prompt_ids"] + record["tokens"]
    ref = engine_factory(dequantized, **EXACT).prefill_logits(ids)
    engine = engine_factory(path, **placement)
    assert engine.options.expert_dtype == HELD[path.name]  # kept, not dequantized
    assert rel_fro(engine.prefill_logits(ids), ref) < 1e-5


def test_tokens_are_llama_cpp_s(llama_file, engine_factory):
    """The prompt's ids are llama.cpp's; with llama.cpp's tokens fed back, each of them is our argmax or within a near
    tie of it, and our own greedy tokens are llama.cpp's up to the first fork, which such a tie explains."""
    path, record, _ = llama_file
    engine = engine_factory(path, **EXACT)
    prompt, theirs = engine.encode(RECORD["prompt"]), record["tokens"]
    assert prompt == record["prompt_ids"]
    logits = engine.prefill_logits(prompt + theirs)[len(prompt) - 1:-1]  # [N, V]: the logits of each of their tokens
    deficit = logits.max(-1) - logits[np.arange(len(theirs)), theirs]
    assert np.all(deficit < NEAR_TIE), deficit
    ours = engine.generate(prompt, max_new_tokens=len(theirs), stop_token_ids=[])
    fork = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
    assert ours[:fork] == theirs[:fork] and (fork == len(theirs) or deficit[fork] > 0), (ours, theirs)
    assert fork >= 4 and int(np.sum(deficit == 0)) >= len(theirs) - 2, (fork, deficit)
