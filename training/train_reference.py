"""Train a small Qwen3-MoE with fine-grained experts on the Python standard library's own sources (bytes as tokens)
and save it as a Hugging Face checkpoint that the engine loads like any other.

    python -m training.train_reference --out=out/moe-stdlib --json=out/moe-stdlib.json      # H200
    python -m training.train_reference --arch=qwen3_next --out=out/next-stdlib              # reference-next
    python -m training.train_reference --out=/tmp/moe --hidden=64 --layers=2 --experts=8 --top_k=2 \\
        --moe_intermediate=32 --heads=2 --kv_heads=1 --head_dim=32 --seq_len=32 --batch=4 --steps=5 --max_files=20

Why: random weights route near-uniformly, so the offload benchmarks need a checkpoint whose experts are really
specialised. This one is small (defaults: ~19.7M parameters, 39.5 MB as bf16), trained offline on text every machine
has, and decodes through the same code paths as Qwen3-30B-A3B (64 experts top-8 here, 128 top-8 there).

Data: every *.py under sysconfig's stdlib folder (site-packages left out), sorted by relative path, capped by
--max_files then --max_bytes; the last --heldout_frac of the files (at least one) are held out. Each file's bytes are
followed by <|endoftext|> (id 256) and the files are concatenated into one token stream per split. A training batch
is --batch random windows of --seq_len + 1 tokens, drawn on the device from --seed and the step number.

Model: the engine's own pieces on a [B, L] batch without a KV cache: transformer.rms_norm, transformer.attention (vmapped over
the batch, over a zero cache of the sequence's length at position 0), moe.route and moe.expert_ffn. The experts run
dense: every expert on every row, the combine matrix zero where a row did not pick it (E/K times the expert FLOPs of
a sparse dispatch, but one plain matmul per projection, nothing to tune at this size, and exactly the engine's
arithmetic: the engine loads the saved weights and gives the same logits, which tests/training/test_train_reference.py checks
in float32). Master weights float32; the forward runs in --compute_dtype (the engine's semantics at that dtype).

Loss: next-byte cross-entropy + --aux_loss_coef * the load-balancing loss as transformers' Qwen3-MoE computes it
(`load_balancing_loss_func`, router_aux_loss_coef 0.001 there). AdamW (optax), linear warmup then cosine decay to
--min_lr_frac * --lr, gradient clipping, weight decay on matrices only.

Report: held-out loss in bits per byte (bytes only: predicting <|endoftext|> is left out) and, per layer, the routing
skew on held-out data: the share of the routed entries (token x top-K slot) that go to that layer's --skew_top most
used experts (uniform routing: skew_top / E). Printed as a table, written to <out>/training_report.json and --json.

--arch=qwen3_next trains the Qwen3-Next shape instead (strata_jax/assets/next-stdlib, the model 'reference-next';
smaller shape defaults: NEXT_DEFAULTS): Gated DeltaNet layers (deltanet.deltanet's chunked rule, as the engine's
prefill) with a gated full-attention layer every --full_attention_interval, zero-centred norms, a shared expert
beside the routed ones, and the MTP module (strata_jax/speculative/mtp.py) over (hidden_i, token i+1) trained on token i+2 with
weight --mtp_loss_coef. Its held-out report adds the module's bits per byte and the share of positions where its
greedy draft equals the main model's argmax (the teacher-forced acceptance of a window's first draft).

Output (--out): config.json (Qwen3MoeForCausalLM), model.safetensors (the Hub tensor names strata_jax/io/checkpoint.py
reads, --save_dtype; or, with --max_shard_mb, Hub-style shards and model.safetensors.index.json, for transfers that
cap a file's size), tokenizer.json (the byte-level tokenizer), training_report.json. Reproducible: the same flags on
the same machine give the same weight files (their sha256 is in the report); on a GPU, --deterministic sets XLA's
deterministic ops (scatter-add in the embedding gradient, autotuning) before JAX starts its backend.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Sequence

from absl import flags

from strata_jax.errors import StrataError

FLAGS = flags.FlagValues()
flags.DEFINE_string("out", "", "Checkpoint folder to write (config.json, model.safetensors, tokenizer.json, "
                    "training_report.json); required.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Also write the report to this JSON file.", flag_values=FLAGS)
# ---- model shape ----
flags.DEFINE_integer("hidden", 256, "Hidden size H.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("layers", 4, "Decoder layers (all MoE).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("heads", 8, "Query heads.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("kv_heads", 2, "Key/value heads (grouped-query attention).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 32, "Head dimension (even: RoPE).", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_integer("experts", 64, "Experts per layer E.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("top_k", 8, "Experts per token K.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("moe_intermediate", 96, "Expert width I (96 = 0.375 H, Qwen3-30B-A3B's ratio; 128 would make "
                     "the default model 52 MB as bf16).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_bool("norm_topk_prob", True, "Renormalise the top-K routing weights to sum to 1.", flag_values=FLAGS)
flags.DEFINE_float("rope_theta", 10000.0, "RoPE base.", lower_bound=1.0, flag_values=FLAGS)
flags.DEFINE_enum("arch", "qwen3_moe", ["qwen3_moe", "qwen3_next"], "qwen3_moe: every layer full attention + MoE. "
                  "qwen3_next: Gated DeltaNet layers with a full-attention layer every --full_attention_interval, "
                  "gated attention with partial RoPE, zero-centred norms, a shared expert (--shared_intermediate) "
                  "and, with --mtp, the multi-token-prediction module trained on the token after next.",
                  flag_values=FLAGS)
flags.DEFINE_integer("full_attention_interval", 4, "qwen3_next: layer i is full attention when (i + 1) is a "
                     "multiple of this, else Gated DeltaNet.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("linear_key_heads", 2, "qwen3_next: DeltaNet key heads.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("linear_value_heads", 4, "qwen3_next: DeltaNet value heads (a multiple of the key heads).",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("linear_head_dim", 32, "qwen3_next: DeltaNet key and value head dimension.", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("conv_kernel", 4, "qwen3_next: DeltaNet causal conv taps.", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_float("partial_rotary", 0.25, "qwen3_next: share of the head dimension RoPE rotates.", lower_bound=0.0,
                   upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_integer("shared_intermediate", 64, "qwen3_next: the shared expert's width (0 = none).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_bool("mtp", True, "qwen3_next: train the MTP module (mtp.* tensors; the engine's draft=mtp).",
                  flag_values=FLAGS)
flags.DEFINE_float("mtp_loss_coef", 0.3, "qwen3_next: weight of the MTP module's cross-entropy on the token after "
                   "next (its gradient reaches the main model too, as DeepSeek-V3's MTP).", lower_bound=0.0,
                   flag_values=FLAGS)
flags.DEFINE_integer("max_position_embeddings", 2048, "Written to config.json (the engine's default context is "
                     "min(this, 4096)); positions past --seq_len were never trained.", lower_bound=1,
                     flag_values=FLAGS)
# ---- training ----
flags.DEFINE_integer("seq_len", 256, "Tokens (bytes) per training sequence L.", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_integer("batch", 64, "Sequences per step B.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("steps", 3000, "Optimizer steps.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("time_limit_s", 0.0, "Stop training at the first progress line past this many seconds of "
                   "training (0 = no limit) and save what was trained; the report records the steps done. With a "
                   "limit the checkpoint depends on the machine's speed: reproducible only without it.",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_float("lr", 3e-3, "Peak learning rate.", lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("warmup_steps", 100, "Linear warm-up steps (at most half of --steps).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_float("min_lr_frac", 0.1, "The cosine decays to this fraction of --lr at the last step.",
                   lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only; norms are not decayed).",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_float("beta1", 0.9, "AdamW beta1.", lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_float("beta2", 0.95, "AdamW beta2.", lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_float("grad_clip", 1.0, "Clip the global gradient norm to this (0 = off).", lower_bound=0.0,
                   flag_values=FLAGS)
flags.DEFINE_float("aux_loss_coef", 0.001, "Weight of the load-balancing loss (transformers' router_aux_loss_coef).",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_float("init_std", 0.02, "Standard deviation of the initial matrices (norms start at 1).",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_enum("compute_dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of the forward/backward pass "
                  "(master weights and optimizer state stay float32; float32 matmuls may use TF32 on a GPU).",
                  flag_values=FLAGS)
flags.DEFINE_enum("save_dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of model.safetensors.",
                  flag_values=FLAGS)
flags.DEFINE_float("max_shard_mb", 0.0, "Split the weights into safetensors shards of at most this many MiB, with "
                   "model.safetensors.index.json (0 = one model.safetensors).", lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the initial weights and of the batches.", flag_values=FLAGS)
flags.DEFINE_bool("deterministic", True, "Append --xla_gpu_deterministic_ops=true to XLA_FLAGS (GPU run-to-run "
                  "determinism; no effect on a CPU, nor once JAX has started its backend in this process).",
                  flag_values=FLAGS)
# ---- data and report ----
flags.DEFINE_integer("max_files", 0, "Use the first N stdlib files in sorted order (0 = all).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_bytes", 0, "Stop reading files at this many bytes in all (0 = no cap).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_float("heldout_frac", 0.02, "Share of the files, the last in sorted order, held out.", lower_bound=0.0,
                   upper_bound=0.5, flag_values=FLAGS)
flags.DEFINE_integer("eval_tokens", 0, "Evaluate at most this many held-out tokens (0 = all).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("eval_batch", 0, "Held-out sequences per evaluation call (0 = --batch).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("skew_top", 8, "Routing skew: the share of routed entries that go to this many most used "
                     "experts of a layer.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("log_every", 50, "A progress line every N steps.", lower_bound=1, flag_values=FLAGS)

EOT = 256  # <|endoftext|> of the byte-level tokenizer (strata_jax.io.tokenizer)
VOCAB = 257
SIZE_TARGET_BYTES = 40e6  # the reference model should stay at most ~40 MB as bf16
# --arch=qwen3_next's defaults for the shape flags left unset: the committed reference-next model
# (strata_jax/assets/next-stdlib, ~9 MB as bf16: it travels with the repository beside the 40 MB reference).
NEXT_DEFAULTS = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, moe_intermediate=32)


# ---- output: the benchmarks' (benchmarks/tables.py, benchmarks/common.py) --------------------------------------
# The start-up block, the table and the summary go to stdout; progress lines to stderr, stamped with the seconds since
# the program started. Every number printed is also in the report (training_report.json, --json).
from benchmarks.common import device_info, fmt_bytes, parse_flags as common_parse_flags  # noqa: E402
from benchmarks.tables import format_table, progress, say, write_json  # noqa: E402


# ---- data ------------------------------------------------------------------------------------------------------


def stdlib_files(max_files: int = 0) -> tuple[Path, list[Path]]:
    """The standard library's *.py files, sorted by path relative to the stdlib folder (site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if p.is_file() and not skip & set(p.relative_to(root).parts)]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files[:max_files] if max_files else files


def load_corpus(max_files: int = 0, max_bytes: int = 0, heldout_frac: float = 0.02) -> dict:
    """Train and held-out token streams (numpy int32: each file's bytes, then EOT), and what they were made of."""
    import numpy as np
    root, files = stdlib_files(max_files)
    texts, total = [], 0
    digest = hashlib.sha256()
    for path in files:
        if max_bytes and total >= max_bytes:
            break
        data = path.read_bytes()
        if max_bytes:
            data = data[:max_bytes - total]
        rel = path.relative_to(root).as_posix()
        texts.append((rel, data))
        total += len(data)
        digest.update(rel.encode() + b"\0" + data + b"\0")
    if len(texts) < 2:
        raise ValueError(f"the corpus has {len(texts)} file(s) under {root}: need 2 or more (one held out; "
                         f"see --max_files, --max_bytes)")
    n_held = min(max(1, round(len(texts) * heldout_frac)), len(texts) - 1)

    def stream(part):
        out = np.empty(sum(len(d) + 1 for _, d in part), np.int32)
        i = 0
        for _, data in part:
            out[i:i + len(data)] = np.frombuffer(data, np.uint8)
            out[i + len(data)] = EOT
            i += len(data) + 1
        return out

    train, held = texts[:-n_held], texts[-n_held:]
    return dict(root=str(root), train=stream(train), heldout=stream(held), train_files=len(train),
                heldout_files=[rel for rel, _ in held], train_bytes=sum(len(d) for _, d in train),
                heldout_bytes=sum(len(d) for _, d in held), sha256=digest.hexdigest())


# ---- model -----------------------------------------------------------------------------------------------------


def hf_config(s) -> dict:
    """The checkpoint's config.json from the settings (flags or any object with the same attributes): Qwen3-MoE, or
    Qwen3-Next as transformers 5.x writes Qwen3NextConfig (--arch)."""
    shared = {
        "vocab_size": VOCAB,
        "hidden_size": s.hidden,
        "intermediate_size": s.top_k * s.moe_intermediate,  # dense layers' width (none here), as Qwen3-30B-A3B: K*I
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": s.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.moe_intermediate,
        "norm_topk_prob": bool(s.norm_topk_prob),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": s.aux_loss_coef,
        "initializer_range": s.init_std,
        "use_cache": True,
        "bos_token_id": EOT,
        "eos_token_id": EOT,
    }
    if s.arch == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **shared,
                "rope_theta": float(s.rope_theta), "rope_scaling": None, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": s.layers, "torch_dtype": s.save_dtype}
    types = ["full_attention" if (i + 1) % s.full_attention_interval == 0 else "linear_attention"
             for i in range(s.layers)]
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **shared,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(s.rope_theta),
                                "partial_rotary_factor": s.partial_rotary},
            "layer_types": types, "full_attention_interval": s.full_attention_interval,
            "linear_conv_kernel_dim": s.conv_kernel, "linear_key_head_dim": s.linear_head_dim,
            "linear_value_head_dim": s.linear_head_dim, "linear_num_key_heads": s.linear_key_heads,
            "linear_num_value_heads": s.linear_value_heads,
            "shared_expert_intermediate_size": s.shared_intermediate, "mtp_num_hidden_layers": 1 if s.mtp else 0,
            "dtype": s.save_dtype}


def attention_batch(x, w, cfg):
    """transformer.attention on every sequence of x [B, L, H]: a zero cache of length L at position 0 (so the causal mask
    over the cache is the sequence's own), the engine's arithmetic."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model import transformer
    zeros = jnp.zeros((x.shape[1], cfg.num_kv_heads, cfg.head_dim), x.dtype)
    return jax.vmap(lambda seq: transformer.attention(seq, w, zeros, zeros, jnp.int32(0), cfg)[0])(x)


def deltanet_batch(x, w, cfg):
    """deltanet.deltanet on every sequence of x [B, L, H] from a zero state at position 0: the chunked rule (a ring
    of one slot, so the window is longer than the ring), the engine's prefill arithmetic."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model import deltanet
    state = deltanet.init_state(cfg, 1, x.dtype)
    state_pos = jnp.full((1,), -1, jnp.int32)
    n = jnp.int32(x.shape[1])
    return jax.vmap(lambda seq: deltanet.deltanet(seq, w, state, state_pos, jnp.int32(0), n, cfg)[0])(x)


def moe_all_experts(x, w, cfg):
    """The sparse block on x [T, H] with every expert run on every row -> (y [T, H], router logits [T, E] f32).

    moe.route lists every expert in order once T*K >= E (expert_ids[n] = n, or -1 with a zero combine column when no
    row picked it), so the stacked expert weights line up with the combine matrix without a gather."""
    import jax.numpy as jnp
    from strata_jax.model import moe
    t = x.shape[0]
    if t * cfg.num_experts_per_tok < cfg.num_experts:
        raise ValueError(f"{t} rows x top-{cfg.num_experts_per_tok} < {cfg.num_experts} experts: batch more rows")
    r = moe.route(x, w.router, cfg, jnp.ones((t,), bool))
    y = moe.expert_ffn(x, w.gate, w.up, w.down, r.combine).astype(x.dtype)  # as moe.moe_block
    return y, moe.router_logits(x, w.router)


def decoder_layer(h, layer, cfg):
    """One decoder layer on h [B, L, H] -> (h, router logits [B*L, E] or None for a dense layer)."""
    from strata_jax.model import transformer
    from strata_jax.model.weights import MLPWeights
    from strata_jax.model.deltanet import DeltaNetWeights
    b, l, _ = h.shape
    mixer = deltanet_batch if isinstance(layer.attn, DeltaNetWeights) else attention_batch
    h = h + mixer(transformer.norm(h, layer.attn_norm, cfg), layer.attn, cfg)
    x = transformer.norm(h, layer.ffn_norm, cfg).reshape(b * l, -1)  # the FFN half is per token: flatten
    logits = None
    if isinstance(layer.ffn, MLPWeights):
        y = transformer.dense_mlp(x, layer.ffn)
    else:
        y, logits = moe_all_experts(x, layer.ffn, cfg)
    if layer.shared is not None:
        y = y + transformer.shared_expert(x, layer)  # as transformer.forward: the shared expert's sum first
    return h + y.reshape(b, l, -1), logits


def forward(weights, tokens, cfg, return_hidden: bool = False):
    """Training forward over tokens [B, L] at positions 0..L-1 (weights in the compute dtype).

    Returns float32 logits [B, L, V] and each MoE layer's float32 router logits [B*L, E] (a list); return_hidden:
    and the final hidden states [B, L, H] after the final norm (what the MTP module reads)."""
    import jax.numpy as jnp
    from strata_jax.model import transformer
    h = weights.embed[tokens]  # [B, L, H]
    router_logits = []
    for layer in weights.layers:
        h, logits = decoder_layer(h, layer, cfg)
        if logits is not None:
            router_logits.append(logits)
    h = transformer.norm(h, weights.final_norm, cfg)
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    logits = jnp.einsum("blh,hv->blv", h, head, preferred_element_type=jnp.float32)
    return (logits, router_logits, h) if return_hidden else (logits, router_logits)


def mtp_forward(weights, mtp, hidden, next_tokens, cfg):
    """The MTP module (strata_jax/speculative/mtp.py) on hidden [B, L, H] (the main model's, after its final norm) and the token
    after each row, next_tokens [B, L] -> (float32 logits [B, L, V] of the token after next, router logits)."""
    import jax.numpy as jnp
    from strata_jax.model import transformer
    e = transformer.norm(weights.embed[next_tokens], mtp.norm_embedding, cfg)
    x = jnp.concatenate([e, transformer.norm(hidden, mtp.norm_hidden, cfg)], axis=-1) @ mtp.fc  # [B, L, H]
    x, router_logits = decoder_layer(x, mtp.layer, cfg)
    x = transformer.norm(x, mtp.norm, cfg)
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    return jnp.einsum("blh,hv->blv", x, head, preferred_element_type=jnp.float32), router_logits


def random_mtp(cfg, seed: int, dtype, scale: float):
    """A random MTP module for cfg (mtp.weight_specs; zero-centred norms start at 0: scale 1): its layer drawn as
    random_weights' first layer of seed + 1000, fc from seed + 1001."""
    import jax
    import jax.numpy as jnp
    from strata_jax.model.weights import Draw, build_layer
    from strata_jax.speculative.mtp import weight_specs
    specs = weight_specs(cfg)
    draw = Draw(cfg, jax.random.PRNGKey(seed + 1000), dtype, scale)
    layer = build_layer(specs.layer, draw)
    fc = (jax.random.normal(jax.random.PRNGKey(seed + 1001), specs.fc.shape, jnp.float32) * scale).astype(dtype)
    # three buffers (draw makes each anew): the training step donates each leaf
    return specs.replace(fc=fc, norm_embedding=draw(specs.norm_embedding), norm_hidden=draw(specs.norm_hidden),
                         layer=layer, norm=draw(specs.norm))


def token_nll(logits, targets):
    """Cross-entropy in nats of each position: logits [..., V] float32, targets [...]."""
    import jax
    import jax.numpy as jnp
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def load_balancing_loss(router_logits, top_k: int):
    """transformers' `load_balancing_loss_func` (Switch Transformer eqs. 4-6, top-K), without an attention mask.

    router_logits: each MoE layer's [T, E]. As transformers, the layers' rows are concatenated first (one pool of
    layers * T rows, not a mean of per-layer losses), then
        E * sum_e f_e * P_e,  f_e = (top-K slots that picked e) / rows,  P_e = mean softmax probability of e,
    so uniform routing gives K and every row sending its top-K to the same K experts gives up to E. f_e has no
    gradient (one-hot of the top-K ids); P_e carries it."""
    import jax
    import jax.numpy as jnp
    logits = jnp.concatenate([x.astype(jnp.float32) for x in router_logits], axis=0)  # [layers * T, E]
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = jax.lax.top_k(probs, top_k)
    tokens_per_expert = jnp.mean(jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32), axis=1), axis=0)  # [E], sums to K
    return e * jnp.sum(tokens_per_expert * jnp.mean(probs, axis=0))


def loss_fn(master, batch, cfg, aux_loss_coef: float, compute_dtype, mtp_loss_coef: float = 0.3):
    """batch [B, L+1] -> (loss, (cross-entropy, load-balancing loss, MTP cross-entropy)). master: Weights, or
    (Weights, MTPWeights or None). The MTP module reads hidden_i and token i+1 and predicts token i+2 (L-1 rows)."""
    import jax
    import jax.numpy as jnp
    weights, mtp = master if isinstance(master, tuple) else (master, None)
    weights, mtp = jax.tree.map(lambda p: p.astype(compute_dtype), (weights, mtp))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits, router_logits, hidden = forward(weights, inputs, cfg, return_hidden=True)
    ce = jnp.mean(token_nll(logits, targets))
    mtp_ce = jnp.float32(0)
    if mtp is not None:
        mtp_logits, mtp_router = mtp_forward(weights, mtp, hidden[:, :-1], inputs[:, 1:], cfg)
        mtp_ce = jnp.mean(token_nll(mtp_logits, targets[:, 1:]))
        router_logits = router_logits + [mtp_router]
    aux = load_balancing_loss(router_logits, cfg.num_experts_per_tok) if router_logits else jnp.float32(0)
    return ce + aux_loss_coef * aux + mtp_loss_coef * mtp_ce, (ce, aux, mtp_ce)


def make_optimizer(lr: float, steps: int, warmup_steps: int = 0, min_lr_frac: float = 0.1,
                   weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.95, grad_clip: float = 1.0):
    """AdamW with linear warm-up and cosine decay; weight decay on matrices only (the norms' gains stay free).
    Returns (optimizer, schedule)."""
    import jax
    import optax
    warmup = min(warmup_steps, steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0 if warmup else lr, lr, warmup, decay_steps=max(steps, 1),
                                                  end_value=lr * min_lr_frac)
    adamw = optax.adamw(schedule, b1=beta1, b2=beta2, weight_decay=weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    return optax.chain(*chain, adamw), schedule


def make_update(cfg, optimizer, aux_loss_coef: float, compute_dtype, mtp_loss_coef: float = 0.3):
    """(master weights, optimizer state, batch [B, L+1]) -> (weights, state, metrics): one optimizer step."""
    import jax
    import jax.numpy as jnp
    import optax
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, cfg=cfg, aux_loss_coef=aux_loss_coef,
                                                   compute_dtype=compute_dtype, mtp_loss_coef=mtp_loss_coef),
                                 has_aux=True)

    def update(master, opt_state, batch):
        (loss, (ce, aux, mtp_ce)), grads = grad_fn(master, batch)
        updates, opt_state = optimizer.update(grads, opt_state, master)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))  # before clipping
        return optax.apply_updates(master, updates), opt_state, dict(loss=loss, ce=ce, aux=aux, mtp_ce=mtp_ce,
                                                                     grad_norm=grad_norm)
    return update


def sample_batch(stream, key, step, batch: int, seq_len: int):
    """`batch` windows of seq_len + 1 tokens at random offsets of the device stream, from (key, step)."""
    import jax
    starts = jax.random.randint(jax.random.fold_in(key, step), (batch,), 0, stream.shape[0] - seq_len)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (seq_len + 1,)))(starts)


# ---- evaluation ------------------------------------------------------------------------------------------------


def eval_windows(stream, seq_len: int, batch: int):
    """The held-out stream cut into consecutive windows of seq_len + 1 tokens (overlapping by one), padded to whole
    batches. Yields (tokens [B, L+1], loss mask [B, L]: real targets other than EOT, route mask [B, L]: real
    inputs)."""
    import numpy as np
    n = stream.size
    windows = max(1, math.ceil((n - 1) / seq_len))
    padded_windows = math.ceil(windows / batch) * batch
    total = padded_windows * seq_len + 1
    tokens = np.full(total, EOT, np.int32)
    tokens[:n] = stream
    real = np.arange(total) < n
    idx = np.arange(padded_windows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [W, L+1]
    win, ok = tokens[idx], real[idx]
    loss_mask = ok[:, 1:] & (win[:, 1:] != EOT)
    route_mask = ok[:, :-1] & ok[:, 1:]  # inputs whose target exists: each real position counted once
    for i in range(0, padded_windows, batch):
        yield win[i:i + batch], loss_mask[i:i + batch], route_mask[i:i + batch]


def make_eval_step(cfg, compute_dtype):
    """(master, tokens, loss mask, route mask) -> (sum of nats, targets counted, routed entries per expert
    [MoE layers, E], MTP sums: nats, targets, drafts equal to the main model's argmax, rows)."""
    import jax
    import jax.numpy as jnp

    def step(master, tokens, loss_mask, route_mask):
        weights, mtp = master if isinstance(master, tuple) else (master, None)
        weights, mtp = jax.tree.map(lambda p: p.astype(compute_dtype), (weights, mtp))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, router_logits, hidden = forward(weights, inputs, cfg, return_hidden=True)
        nll = jnp.sum(token_nll(logits, targets) * loss_mask)
        rows = route_mask.reshape(-1).astype(jnp.float32)
        counts = []
        for x in router_logits:  # the same top-K the layer routed with (softmax, then top-K, as moe.route)
            _, ids = jax.lax.top_k(jax.nn.softmax(x, axis=-1), cfg.num_experts_per_tok)
            counts.append(jnp.einsum("t,tke->e", rows, jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32)))
        counts = jnp.stack(counts) if counts else jnp.zeros((0, cfg.num_experts), jnp.float32)
        mtp_sums = jnp.zeros((4,), jnp.float32)
        if mtp is not None:
            # Row i reads hidden_i and token i+1 and predicts token i+2: its greedy draft is accepted when it is
            # the main model's argmax at row i+1 (teacher-forced: the first draft of a verify window).
            mtp_logits, _ = mtp_forward(weights, mtp, hidden[:, :-1], inputs[:, 1:], cfg)
            mask = loss_mask[:, 1:].astype(jnp.float32)
            real = route_mask[:, 1:].astype(jnp.float32)
            agree = jnp.argmax(mtp_logits, -1) == jnp.argmax(logits[:, 1:], -1)
            mtp_sums = jnp.stack([jnp.sum(token_nll(mtp_logits, targets[:, 1:]) * mask), jnp.sum(mask),
                                  jnp.sum(agree * real), jnp.sum(real)])
        return nll, jnp.sum(loss_mask), counts, mtp_sums
    return jax.jit(step)


def evaluate(master, stream, cfg, seq_len: int, batch: int, compute_dtype, skew_top: int) -> dict:
    """Held-out bits per byte and per-layer routing skew (and the MTP module's bits per byte and the share of its
    greedy drafts that equal the main model's argmax, when it has one)."""
    import numpy as np
    step = make_eval_step(cfg, compute_dtype)
    nats, count = 0.0, 0
    has_mtp = isinstance(master, tuple) and master[1] is not None
    counts = np.zeros((cfg.num_sparse_layers + has_mtp, cfg.num_experts), np.int64)
    mtp_sums = np.zeros(4)
    for tokens, loss_mask, route_mask in eval_windows(stream, seq_len, batch):
        n, c, per_expert, m = step(master, tokens, loss_mask, route_mask)
        nats += float(n)
        count += int(c)
        counts[:cfg.num_sparse_layers] += np.rint(np.asarray(per_expert)).astype(np.int64)
        mtp_sums += np.asarray(m, np.float64)
    top = min(skew_top, cfg.num_experts)
    layers = []
    for i, row in enumerate(counts[:cfg.num_sparse_layers]):
        total = int(row.sum())
        ranked = np.sort(row)[::-1]
        layers.append(dict(layer=i, routed_entries=total, top_share=float(ranked[:top].sum() / max(total, 1)),
                           uniform_share=top / cfg.num_experts, max_expert_share=float(ranked[0] / max(total, 1)),
                           unused_experts=int((row == 0).sum()), counts=row.tolist()))
    loss = nats / max(count, 1)
    out = dict(loss_nats=loss, bits_per_byte=loss / math.log(2), bytes=count, skew_top=top, layers=layers)
    if has_mtp:
        mtp_loss = mtp_sums[0] / max(mtp_sums[1], 1)
        out["mtp"] = dict(loss_nats=mtp_loss, bits_per_byte=mtp_loss / math.log(2), bytes=int(mtp_sums[1]),
                          agreement=mtp_sums[2] / max(mtp_sums[3], 1), rows=int(mtp_sums[3]))
    return out


# ---- checkpoint ------------------------------------------------------------------------------------------------


def hf_tensors(weights, cfg, dtype: str, mtp=None) -> dict:
    """Weights (and the MTPWeights) -> the Hub's tensor names and layouts (the inverse of
    checkpoint.load_weights and load_mtp: both walk weight_specs), numpy, in the Hub files' order."""
    import numpy as np
    import jax.numpy as jnp
    from strata_jax.model.weights import hub_walk, weight_specs
    from strata_jax.speculative.mtp import weight_specs as mtp_specs
    np_dtype = jnp.dtype(dtype)
    out = {}
    walks = [hub_walk(weight_specs(cfg), weights)]
    if mtp is not None:
        walks.append(hub_walk(mtp_specs(cfg), mtp))
    stacks = {}  # the layer's expert stacks as float32, read once each (not once per expert)
    for walk in walks:
        for name, leaf, j, x in walk:
            if j is None:
                stacks.clear()
                a = leaf.to_hf(np.asarray(x, np.float32))
            else:  # experts are kept in the Hub's [out, in] layout already
                if id(x) not in stacks:
                    stacks[id(x)] = np.asarray(x, np.float32)
                a = stacks[id(x)][j]
            out[name] = np.ascontiguousarray(a).astype(np_dtype)
    return out


def shard(tensors: dict, max_bytes: int) -> list[dict]:
    """Split name -> array into consecutive groups of at most max_bytes each (0 = one group; a larger tensor alone)."""
    groups, size = [{}], 0
    for name, x in tensors.items():
        if max_bytes and groups[-1] and size + x.nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = x
        size += x.nbytes
    return groups


def save_checkpoint(folder: Path, weights, cfg, raw_config: dict, dtype: str, max_shard_bytes: int = 0,
                    mtp=None) -> dict:
    """config.json, the safetensors file(s) and tokenizer.json into folder: model.safetensors, or with
    max_shard_bytes the Hub's shards model-0000i-of-0000n.safetensors and model.safetensors.index.json (the engine
    reads both). Returns the weight files' names and sizes, and the sha256 of their bytes in that order (one file:
    what `sha256sum model.safetensors` prints)."""
    from safetensors.numpy import save_file
    from strata_jax.io.tokenizer import byte_level_tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    # A previous run's weight files would be read beside (or instead of) this run's: remove only those names.
    for old in [folder / "model.safetensors", folder / "model.safetensors.index.json",
                *folder.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(raw_config, indent=1) + "\n")
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    tensors = hf_tensors(weights, cfg, dtype, mtp)
    groups = shard(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    digest, files = hashlib.sha256(), []
    for name, group in zip(names, groups):
        tmp = folder / (name + ".tmp")
        save_file(group, str(tmp), metadata={"format": "pt"})  # "pt": transformers reads it
        os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; the other files are readable by all
        os.replace(tmp, folder / name)
        data = (folder / name).read_bytes()
        digest.update(data)
        files.append(dict(name=name, bytes=len(data)))
    if len(groups) > 1:
        index = dict(metadata=dict(total_size=sum(x.nbytes for x in tensors.values())),
                     weight_map={t: name for name, group in zip(names, groups) for t in group})
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return dict(folder=str(folder), files=files, bytes=sum(f["bytes"] for f in files), sha256=digest.hexdigest())


# ---- the run ---------------------------------------------------------------------------------------------------


def run(s) -> dict:
    """Train with settings `s` (the parsed FLAGS or any object with the same attributes), save the checkpoint and
    the report. Returns the report, plus "weights": the trained float32 Weights (not written to JSON)."""
    if not s.out:
        raise ValueError("--out=FOLDER is required (the checkpoint folder to write)")
    if s.deterministic and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        # Read when JAX starts its backend: set before the first jax call below.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.model.weights import MLPWeights, random_weights
    from strata_jax.model.config import config_from_dict

    raw = hf_config(s)
    cfg = config_from_dict(raw, where="the flags")  # the engine's own checks (heads, top-K, ...)
    if s.head_dim % 2:
        raise ValueError(f"--head_dim={s.head_dim} must be even (RoPE rotates halves)")
    if s.batch * s.seq_len * s.top_k < s.experts:
        raise ValueError("--batch x --seq_len x --top_k must be at least --experts (the dense expert path)")
    compute_dtype = jnp.dtype(s.compute_dtype)
    eval_batch = s.eval_batch or s.batch
    out = Path(s.out)
    dev = device_info()

    # ---- corpus ----
    t0 = time.perf_counter()
    corpus = load_corpus(s.max_files, s.max_bytes, s.heldout_frac)
    train_np, held_np = corpus.pop("train"), corpus.pop("heldout")
    if s.eval_tokens:
        held_np = held_np[:s.eval_tokens + 1]
    if train_np.size < s.seq_len + 1:
        raise ValueError(f"the training stream has {train_np.size} tokens, fewer than --seq_len + 1 = {s.seq_len + 1}")
    corpus["load_s"] = time.perf_counter() - t0

    # ---- sizes ----
    with_mtp = cfg.next and s.mtp
    if cfg.next and cfg.rotary_dim < 2:
        raise ValueError(f"--partial_rotary={s.partial_rotary} leaves no rotary dimension of --head_dim={s.head_dim}")

    def init():
        return (random_weights(cfg, s.seed, jnp.float32, scale=s.init_std),
                random_mtp(cfg, s.seed, jnp.float32, s.init_std) if with_mtp else None)
    abstract = jax.eval_shape(init)
    n_params = sum(x.size for x in jax.tree.leaves(abstract))
    sparse = [layer for layer in abstract[0].layers if not isinstance(layer.ffn, MLPWeights)]
    sparse += [abstract[1].layer] if with_mtp else []
    n_expert = sum(x.size for layer in sparse for x in (layer.ffn.gate, layer.ffn.up, layer.ffn.down))
    bf16_bytes = 2 * n_params
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    active = n_params - n_expert + n_expert * k // e
    tokens_per_step = s.batch * s.seq_len

    kind = "Qwen3-MoE" if not cfg.next else (
        f"Qwen3-Next ({sum(map(cfg.is_linear, range(cfg.num_layers)))} DeltaNet + {cfg.num_full_layers} gated "
        f"attention layers, shared expert I={cfg.shared_expert_intermediate_size}, "
        f"{'an MTP module x ' + format(s.mtp_loss_coef, 'g') if with_mtp else 'no MTP module'})")
    say(f"train_reference: {kind}, {cfg.num_layers} layers, H={cfg.hidden_size}, {cfg.num_heads}/"
        f"{cfg.num_kv_heads} heads x {cfg.head_dim}, {e} experts top-{k} (I={cfg.moe_intermediate_size}, "
        f"norm_topk_prob={cfg.norm_topk_prob}), V={cfg.vocab_size} (bytes + <|endoftext|>)")
    over = "" if bf16_bytes <= SIZE_TARGET_BYTES else f"  [over the ~{fmt_bytes(SIZE_TARGET_BYTES)} target]"
    say(f"parameters: {n_params:,} ({n_expert:,} in experts, {100 * n_expert / n_params:.0f}%; {active:,} active per "
        f"token); {fmt_bytes(bf16_bytes)} as bfloat16, {fmt_bytes(4 * n_params)} as float32; saved "
        f"as {s.save_dtype}{over}")
    say(f"corpus: {corpus['root']}: {corpus['train_files']} files ({fmt_bytes(corpus['train_bytes'])}) to "
        f"train, {len(corpus['heldout_files'])} held out ({fmt_bytes(corpus['heldout_bytes'])}: "
        f"{corpus['heldout_files'][0]} .. {corpus['heldout_files'][-1]}); sha256 {corpus['sha256'][:16]}")
    say(f"training: {s.steps} steps x {s.batch} x {s.seq_len} tokens = {s.steps * tokens_per_step / 1e6:.1f}M tokens "
        f"({s.steps * tokens_per_step / train_np.size:.2f} passes over the training bytes); AdamW lr {s.lr:g} "
        f"(warm-up {min(s.warmup_steps, s.steps // 2)}, cosine to {s.min_lr_frac:g}x), wd {s.weight_decay:g}, "
        f"clip {s.grad_clip:g}, aux_loss_coef {s.aux_loss_coef:g}; compute {s.compute_dtype}, master float32; "
        f"seed {s.seed}")
    say(f"device: {dev['device_kind']} ({dev['platform']}); jax {dev['jax']}; XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}")
    say()

    report = dict(benchmark="train_reference", settings={name: getattr(s, name) for name in FLAGS},
                  device=dev, config=raw, corpus=corpus, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  params=dict(total=n_params, experts=n_expert, active_per_token=active, bf16_bytes=bf16_bytes),
                  curve=[], complete=False)

    # ---- train ----
    master = init()  # (Weights, MTPWeights or None)
    optimizer, schedule = make_optimizer(s.lr, s.steps, s.warmup_steps, s.min_lr_frac, s.weight_decay, s.beta1,
                                         s.beta2, s.grad_clip)
    opt_state = optimizer.init(master)
    update = make_update(cfg, optimizer, s.aux_loss_coef, compute_dtype, s.mtp_loss_coef)
    train_step = jax.jit(lambda w, o, stream, key, i: update(w, o, sample_batch(stream, key, i, s.batch, s.seq_len)),
                         donate_argnums=(0, 1))
    stream = jax.device_put(train_np)
    key = jax.random.PRNGKey(s.seed + 1)  # the batches' key; the weights use PRNGKey(seed)

    progress(f"compiling the training step ({cfg.num_layers} layers, {tokens_per_step:,} tokens a step)")
    t0 = time.perf_counter()
    compiled = train_step.lower(master, opt_state, stream, key, jnp.int32(0)).compile()
    report["compile_s"] = time.perf_counter() - t0
    progress(f"compiled in {report['compile_s']:.1f} s")

    t_start = t_last = time.perf_counter()
    pending = []  # the metrics of the steps since the last line, read together (one sync per line)
    for i in range(s.steps):
        master, opt_state, metrics = compiled(master, opt_state, stream, key, jnp.int32(i))
        pending.append(metrics)
        if (i + 1) % s.log_every and i + 1 != s.steps:
            continue
        got = jax.device_get(pending)
        now = time.perf_counter()
        elapsed = now - t_start
        row = dict(step=i + 1, loss=float(np.mean([m["ce"] for m in got])),
                   aux=float(np.mean([m["aux"] for m in got])), mtp_loss=float(np.mean([m["mtp_ce"] for m in got])),
                   grad_norm=float(np.mean([m["grad_norm"] for m in got])), lr=float(schedule(i)),
                   tok_s=len(got) * tokens_per_step / (now - t_last), elapsed_s=elapsed)
        report["curve"].append(row)
        eta = elapsed / (i + 1) * (s.steps - i - 1)
        mtp_part = f"  mtp {row['mtp_loss'] / math.log(2):.3f} bits" if with_mtp else ""
        progress(f"step {i + 1:>{len(str(s.steps))}}/{s.steps}  loss {row['loss']:.4f} "
                        f"({row['loss'] / math.log(2):.3f} bits){mtp_part}  aux {row['aux']:.3f}  lr {row['lr']:.2e}  "
                        f"{row['tok_s']:,.0f} tok/s  elapsed {elapsed:.0f}s  eta {eta:.0f}s")
        pending, t_last = [], now
        if s.time_limit_s and elapsed > s.time_limit_s and i + 1 < s.steps:
            progress(f"time limit {s.time_limit_s:g} s reached after {i + 1} of {s.steps} steps: stopping")
            break
    jax.block_until_ready(master)
    train_s = time.perf_counter() - t_start
    steps_done = report["curve"][-1]["step"]
    report.update(train_s=train_s, steps_done=steps_done, tokens_trained=steps_done * tokens_per_step,
                  tok_s=steps_done * tokens_per_step / train_s, final_train_loss=report["curve"][-1]["loss"])

    # ---- held-out ----
    progress(f"held-out: {held_np.size - 1:,} targets in windows of {s.seq_len}, {eval_batch} a call")
    t0 = time.perf_counter()
    heldout = evaluate(master, held_np, cfg, s.seq_len, eval_batch, compute_dtype, s.skew_top)
    heldout["eval_s"] = time.perf_counter() - t0
    report["heldout"] = heldout

    # ---- checkpoint ----
    report["checkpoint"] = save_checkpoint(out, master[0], cfg, raw, s.save_dtype, int(s.max_shard_mb * 2**20),
                                           mtp=master[1])
    report["complete"] = True

    top = heldout["skew_top"]
    headers = ["layer", f"top-{top} share", "uniform", "max expert share", "unused experts"]
    rows = [[r["layer"], r["top_share"], r["uniform_share"], r["max_expert_share"], r["unused_experts"]]
            for r in heldout["layers"]]
    report["table"] = format_table(headers, rows)
    say(report["table"])
    say()
    where = (f"the first {s.eval_tokens:,} tokens of the held-out files (--eval_tokens)" if s.eval_tokens else
             f"{len(corpus['heldout_files'])} held-out file(s)")
    say(f"held-out: {heldout['bits_per_byte']:.4f} bits per byte ({heldout['loss_nats']:.4f} nats) over "
        f"{heldout['bytes']:,} bytes of {where}; last training loss "
        f"{report['final_train_loss'] / math.log(2):.4f} bits per token")
    if "mtp" in heldout:
        m = heldout["mtp"]
        say(f"MTP module: {m['bits_per_byte']:.4f} bits per byte on the token after next; its greedy draft equals "
            f"the main model's argmax at {100 * m['agreement']:.1f}% of {m['rows']:,} held-out positions "
            f"(teacher-forced first-draft acceptance)")
    say(f"routing skew: share of the routed entries (token x top-{k} slot) going to each layer's {top} most used of "
        f"{e} experts, on held-out data (uniform: {top / e:.3f})")
    say(f"trained {report['tokens_trained'] / 1e6:.1f}M tokens in {train_s:.1f} s ({report['tok_s']:,.0f} tok/s; "
        f"compile {report['compile_s']:.1f} s)")
    ckpt = report["checkpoint"]
    say(f"checkpoint: {out} ({len(ckpt['files'])} safetensors file(s), {fmt_bytes(ckpt['bytes'])}, sha256 "
        f"{ckpt['sha256'][:16]})")
    write_json(out / "training_report.json", report)
    if s.json:
        write_json(s.json, report)
        say(f"json: {s.json}")
    return dict(report, weights=master[0], mtp=master[1])


def arch_defaults(values: flags.FlagValues) -> flags.FlagValues:
    """--arch=qwen3_next: NEXT_DEFAULTS for the shape flags the command line did not set."""
    if values.arch == "qwen3_next":
        for name, value in NEXT_DEFAULTS.items():
            if not values[name].present:
                values[name].value = value
    return values


def parse_flags(argv: Sequence[str]) -> flags.FlagValues:
    """Parse argv (argv[0] is the program) into FLAGS, from the defaults every time (so a test can call main() twice):
    the benchmarks' parser (`--help` prints the flags and exits 0; a bad flag is one line and exit status 2)."""
    common_parse_flags(FLAGS, argv, "training.train_reference")
    return FLAGS


def main(argv: Sequence[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the report. A bad value or a refused setting
    is one `error:` line and exit status 1, Ctrl-C exit 130."""
    parse_flags(argv)
    try:
        return run(arch_defaults(FLAGS))
    except (StrataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv)
