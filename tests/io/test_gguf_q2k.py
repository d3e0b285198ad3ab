"""GGUF Q2_K experts kept packed (issue 36: the engine format "int2-q2k", strata_jax/model/quant.py): the tests Q2_K
shares with Q4_K run in tests/io/test_gguf_q4k.py (its `block_model`: weights = gguf.quants.dequantize's values,
logits = the dequantized checkpoint's resident and offloaded, the kernel under the scanned offload graph, random
weights, saved states). Here: a Q2_K mix's families, each in its own block format."""
from __future__ import annotations

import json

import numpy as np
from gguf import GGMLQuantizationType as Q

import test_gguf
from helpers import rel_fro
from strata_jax import Engine
from strata_jax.io import gguf_file
from strata_jax.io.embedded import random_checkpoint
from strata_jax.offload.slots import layer_states
from test_gguf_q4k import EXACT, IDS, encode


def test_q2k_gate_up_beside_q4k_down(tmp_path, engine_factory, cache_dir):
    """A Q2_K-mix-like file (gate/up Q2_K, down Q4_K: llama.cpp's Q2_K mixes keep down in more bits): each family
    kept in its own block format ("int2-q2k/int4-q4k": a uint8-code family beside a uint16-code one in the slots, the
    pool and the graphs), logits those of the dequantized checkpoint resident and offloaded."""
    raw = dict(json.loads((test_gguf.BASE / "config.json").read_text()), hidden_size=256, head_dim=64,
               moe_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
    hub = test_gguf.stacked(random_checkpoint(raw, seed=33), 1, 4)
    rng = np.random.default_rng(34)
    for name in hub:
        if ".mlp.experts." in name:
            hub[name] = (rng.standard_normal(hub[name].shape) * 0.05 + 0.01).astype(np.float32)
    path = tmp_path / "q2k_mix.gguf"
    written = test_gguf.write_gguf(path, raw, hub, types=lambda g: (Q.Q4_K if "down_exps" in g else Q.Q2_K)
                                   if "_exps" in g else Q.F32, encoder=encode)
    dequantized = test_gguf.dequantized_folder(tmp_path, raw, written)
    assert gguf_file.kept_expert_format(gguf_file.gguf_model_folder(path, cache_dir)) == "int2-q2k/int4-q4k"
    ref = engine_factory(dequantized, **EXACT).prefill_logits(IDS)
    for placement in (dict(expert_cache_slots="all"), dict(expert_cache_slots="2", pcie_frac="0.5", cpu_threads=2)):
        engine = Engine.from_pretrained(path, verbose=False, cache_dir=str(cache_dir), dtype="float32", **placement)
        assert engine.options.expert_dtype == "int2-q2k/int4-q4k"
        assert rel_fro(engine.prefill_logits(IDS), ref) < 1e-5
    state = layer_states(engine.cache.experts)[0]
    assert state.gate.shape[-1] == 64 and state.down.shape[-1] == 128  # H/4 and I/2
    assert engine.placement.pool.store.format == "int2-q2k/int4-q4k"
