"""GGUF files written as llama.cpp's convert_hf_to_gguf lays them out, in numpy with the `gguf` package: a Qwen3-MoE
(`write_gguf`: its metadata keys, TensorNameMap's names, experts stacked [E, O, I]; any tensor type gguf.quants
writes) and a Qwen3-Next (`qwen3next_gguf`: Qwen3NextModel's tensor transforms, F32), a tokenizer.json folder's
vocabulary as _set_vocab_gpt2 writes it (`hf_tokenizer_metadata`).

Used by the GGUF tests and `benchmarks.quant_quality --gguf_types` (the reference models as F32 GGUFs for
llama-quantize); not by the engine, which only reads GGUFs (strata_jax/io/gguf_file.py)."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer


def stacked(tensors: dict[str, np.ndarray], layers: int, experts: int) -> dict[str, np.ndarray]:
    """Hub tensors with each layer's experts stacked under the converter's merged name
    (model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight: [E, O, I])."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(layers):
        for w in ("gate_proj", "up_proj", "down_proj"):
            p = f"model.layers.{i}.mlp.experts."
            out[f"{p}{w}.weight"] = np.stack([tensors[f"{p}{j}.{w}.weight"] for j in range(experts)])
    return out


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x in a GGUF type: F32 / F16 as numpy arrays, the rest as gguf.quants' bytes."""
    if qtype == Q.F32:
        return x.astype(np.float32)
    if qtype == Q.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x.astype(np.float32), qtype)


def write_gguf(path: Path, raw: dict, hub: dict[str, np.ndarray], types=None, arch: str = "qwen3moe",
               metadata=None, drop=(), replace=None, split_max_tensors: int = 0,
               encoder=None) -> dict[str, np.ndarray]:
    """A GGUF of a Hub config + (stacked) tensors; types(gguf name) -> its GGUF type (default F32; 1-D tensors
    stay F32, as llama.cpp keeps them); metadata(writer): more keys (a tokenizer); drop: GGUF names left out;
    replace: {GGUF name: array written instead, or added}; encoder(x, type): a tensor's bytes (default `encode`;
    the K types' tests write random valid blocks). Returns the dequantized values written, by Hub name."""
    n_layers = raw["num_hidden_layers"]
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(n_layers)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_feed_forward_length(raw.get("intermediate_size", 0))
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_rope_freq_base((raw.get("rope_parameters") or raw)["rope_theta"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_expert_count(raw.get("num_experts", raw.get("num_local_experts")))
    w.add_expert_used_count(raw["num_experts_per_tok"])
    w.add_expert_feed_forward_length(raw["moe_intermediate_size"])
    if metadata is not None:
        metadata(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, n_layers)
    written = {}
    for name, x in hub.items():
        g = names.get_name(name, try_suffixes=(".weight",))
        if g in drop or g in (replace or {}):
            continue
        qtype = (types or (lambda _: Q.F32))(g) if x.ndim > 1 else Q.F32
        data = (encoder or encode)(x, qtype)
        w.add_tensor(g, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        written[name] = gguf.quants.dequantize(data, qtype).reshape(x.shape)
    for g, x in (replace or {}).items():  # in place of a tensor, or beside them
        w.add_tensor(g, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def tensor_name(kind: str, block: int, suffix: str = ".weight") -> str:
    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].format(bid=block) + suffix


def qwen3next_gguf(path: Path, raw: dict, hub: dict[str, np.ndarray], *, legacy_ssm_in=False, fuse_qkv=False,
                   fuse_gate_up_exps=False, recurrent_layers=True, shexp_gate_1d=False, mtp_declared=None,
                   drop=(), replace=None, metadata=None) -> None:
    """A Hub checkpoint (per-expert tensors, `mtp.*` when it has the MTP module) written as llama.cpp's
    convert_hf_to_gguf writes a Qwen3NextForCausalLM (llama.cpp conversion/qwen.py: Qwen3NextModel, its
    _QwenMtpMixin and Qwen2MoeModel; conversion/base.py: TextModel.set_gguf_parameters, modify_tensors'
    --fuse-gate-up-exps / --fuse-qkv), in numpy:
    - metadata: TextModel's keys, expert_(shared_)feed_forward_length, ssm.conv_kernel / state_size (Dk) /
      group_count (Nk) / time_step_rank (Nv) / inner_size (Nv*Dv), attention.recurrent_layers (from layer_types,
      False for the MTP block; recurrent_layers=False: only full_attention_interval, as files without it),
      full_attention_interval (config's or 4), rope.dimension_count (head_dim * partial_rotary_factor),
      nextn_predict_layers and block_count = layers + MTP layers;
    - tensors (modify_tensors): A_log -> -exp(A_log), dt_bias renamed dt_proj.bias, conv1d squeezed, every
      `norm.weight` but linear_attn.norm's + 1, in_proj_qkvz regrouped into attn_qkv [q*Nk | k*Nk | v*Nk] and
      attn_gate [z*Nk] (legacy_ssm_in: the older converter's ssm_in, the Hub's rows), experts stacked [E, O, I];
      mtp.* renamed to the block after the model's (fc -> eh_proj, pre_fc_norm_* -> enorm / hnorm, norm ->
      shared_head.norm); names by gguf's TensorNameMap (the nextn.* names by TENSOR_NAMES: gguf 0.19's table for
      qwen3next lacks them, llama.cpp's newer gguf-py has them).
    shexp_gate_1d: the shared expert gate stored [H] (as llama.cpp reads it) instead of the converter's [1, H].
    mtp_declared: nextn_predict_layers when the file holds no MTP tensors (a file cut of them). drop: GGUF names (or
    their prefixes) left out; replace: {GGUF name: array written instead, or added}; metadata(writer): more keys (a
    tokenizer). F32 throughout."""
    n = raw["num_hidden_layers"]
    h, nk, nv = raw["hidden_size"], raw["linear_num_key_heads"], raw["linear_num_value_heads"]
    dk, dv = raw["linear_key_head_dim"], raw["linear_value_head_dim"]
    rope = raw.get("rope_parameters") or raw
    n_mtp = 1 if "mtp.fc.weight" in hub else 0
    blocks = n + n_mtp
    declared = n_mtp or mtp_declared or 0  # nextn_predict_layers, counted into block_count

    # _QwenMtpMixin.filter_tensors: mtp.* -> the blocks after the model's
    renamed = {}
    for name, x in hub.items():
        if name.startswith("mtp."):
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[1] == "layers":
                name = f"model.layers.{n + int(parts[2])}.{parts[3]}"
            else:
                short = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                         "norm": "shared_head.norm"}[parts[1]]
                name = f"model.layers.{n}.{short}.{parts[2]}"
        renamed[name] = x

    # Qwen3NextModel.modify_tensors
    out = {}
    for name, x in renamed.items():
        if name.endswith(".A_log"):
            x = -np.exp(x)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        if "in_proj_qkvz.weight" in name and not legacy_ssm_in:
            split = [dk, dk, nv // nk * dv, nv // nk * dv]
            t = x.T.reshape(-1, nk, sum(split))  # permute(1, 0).view(-1, num_k_heads, sum(split))
            q, k, v, z = np.split(t, np.cumsum(split)[:-1], axis=-1)
            q, k, v, z = (a.reshape(h, -1) for a in (q, k, v, z))
            bid = int(name.split(".")[2])
            out[tensor_name("ATTN_QKV", bid)] = np.concatenate([q, k, v], axis=-1).T
            out[tensor_name("ATTN_GATE", bid)] = z.T
        else:
            out[name] = x

    # Qwen2MoeModel.modify_tensors: each layer's experts stacked [E, O, I]; then the names (TextModel.modify_tensors)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, blocks)
    nextn = {"eh_proj": "NEXTN_EH_PROJ", "enorm": "NEXTN_ENORM", "hnorm": "NEXTN_HNORM",
             "shared_head.norm": "NEXTN_SHARED_HEAD_NORM"}
    experts: dict[str, dict[int, np.ndarray]] = {}
    tensors = {}
    for name, x in out.items():
        m = re.match(r"(model\.layers\.(\d+)\.mlp\.experts\.)(\d+)\.(\w+\.weight)$", name)
        if m:
            experts.setdefault(m.group(1) + m.group(4), {})[int(m.group(3))] = x
            continue
        m = re.match(r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm)\.weight$", name)
        g = tensor_name(nextn[m.group(2)], int(m.group(1))) if m else \
            name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        tensors[g] = x
    for name, per in experts.items():
        tensors[names.get_name(name, try_suffixes=(".weight",))] = np.stack([per[j] for j in sorted(per)])
    for i in range(blocks):
        if fuse_gate_up_exps:  # TextModel.modify_tensors: cat([gate, up], dim=1)
            tensors[tensor_name("FFN_GATE_UP_EXP", i)] = np.concatenate(
                [tensors.pop(tensor_name("FFN_GATE_EXP", i)), tensors.pop(tensor_name("FFN_UP_EXP", i))], axis=1)
        if fuse_qkv and tensor_name("ATTN_Q", i) in tensors:  # the full-attention layers: cat([q, k, v], dim=0)
            tensors[tensor_name("ATTN_QKV", i)] = np.concatenate(
                [tensors.pop(tensor_name(k, i)) for k in ("ATTN_Q", "ATTN_K", "ATTN_V")])
        if shexp_gate_1d:
            g = tensor_name("FFN_GATE_INP_SHEXP", i)
            tensors[g] = tensors[g].reshape(-1)

    w = gguf.GGUFWriter(path, "qwen3next")
    w.add_block_count(n + declared)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_expert_count(raw["num_experts"])
    w.add_expert_used_count(raw["num_experts_per_tok"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_expert_feed_forward_length(raw["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(raw["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(raw["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    if recurrent_layers:  # add_recurrent_layers (llama.cpp's newer gguf-py)
        w.add_array("qwen3next.attention.recurrent_layers",
                    [t == "linear_attention" for t in raw["layer_types"]] + [False] * declared)
        w.add_full_attention_interval(raw.get("full_attention_interval", 4))
    else:
        w.add_full_attention_interval(next(i + 1 for i, t in enumerate(raw["layer_types"]) if t == "full_attention"))
    w.add_rope_dimension_count(int(raw["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    if declared:
        w.add_nextn_predict_layers(declared)
    if metadata is not None:
        metadata(w)
    for g, x in tensors.items():
        if not g.startswith(tuple(drop)) and g not in (replace or {}):
            w.add_tensor(g, np.ascontiguousarray(x, np.float32))
    for g, x in (replace or {}).items():
        w.add_tensor(g, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_tokenizer_metadata(hf_folder: Path, vocab_size: int):
    """convert_hf_to_gguf's _set_vocab_gpt2 over a tokenizer.json folder: tokens and types as get_vocab_base makes
    them (added tokens CONTROL when special or <|...|>, else USER_DEFINED; [PAD{i}] up to vocab_size), merges,
    special ids and the chat template through gguf's own SpecialVocab."""
    tok = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            t = reverse[i]
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if added[i].special or (t.startswith("<|") and t.endswith("|>"))
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)

    def add(w: gguf.GGUFWriter):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        gguf.SpecialVocab(hf_folder, load_merges=True).add_to_gguf(w, quiet=True)
    return add
