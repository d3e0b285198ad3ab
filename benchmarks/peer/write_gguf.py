"""A GGUF (arch qwen3moe, F16) of one of our model presets, for llama-bench: the same shape our benchmarks decode.

    python3 benchmarks/peer/write_gguf.py --out=/tmp/m24.gguf --model=qwen3-30b-a3b --layers=24 --gguf_py=/tmp/llama.cpp/gguf-py

Weights: a random router per layer (routing spreads like random JAX weights), every other matrix tiled from one
random block (the peer reads every byte either way; tiling only saves the writing time). Tokenizer: a byte-level
stand-in of the preset's vocabulary size (llama-bench feeds token ids, it never tokenizes text).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def qwen3moe_writer(gguf, path, c: dict, layers: int):
    """A GGUFWriter (arch qwen3moe) with the model metadata of config `c` cut to `layers` layers; gguf: the module
    (llama.cpp's gguf-py here, the installed package in benchmarks.gguf_load_bench)."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="cut to the first N layers (0 = all)")
    ap.add_argument("--gguf_py", default="/tmp/llama.cpp/gguf-py", help="gguf-py of the peer's source tree")
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf

    c = json.loads((REPO / "configs" / f"{a.model}.json").read_text())
    n_layers = a.layers or c["num_hidden_layers"]
    h, nh, nkv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    e, k, inter, vocab = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["vocab_size"]
    w = qwen3moe_writer(gguf, a.out, c, n_layers)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # GPT-2 byte-level vocabulary: 256 byte tokens, one merge, the rest special tokens.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    byte_order = printable[:]
    for b in range(256):
        if b not in printable:
            byte_order.append(b)
            codes.append(256 + extra)
            extra += 1
    byte_tokens = [chr(cp) for _, cp in sorted(zip(byte_order, codes))]
    tokens = byte_tokens + ["Ġt"] + [f"<|x{i}|>" for i in range(vocab - 257)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 2)

    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 20) * 0.02).astype(np.float16)
    tiled = lambda *shape: np.resize(block, shape)
    ones = lambda n: np.ones(n, np.float32)
    names, T = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    w.add_tensor(names[T.TOKEN_EMBD] + ".weight", tiled(vocab, h))
    w.add_tensor(names[T.OUTPUT_NORM] + ".weight", ones(h))
    w.add_tensor(names[T.OUTPUT] + ".weight", tiled(vocab, h))
    for i in range(n_layers):
        name = lambda t: names[t].format(bid=i) + ".weight"
        w.add_tensor(name(T.ATTN_NORM), ones(h))
        w.add_tensor(name(T.FFN_NORM), ones(h))
        w.add_tensor(name(T.ATTN_Q), tiled(nh * d, h))
        w.add_tensor(name(T.ATTN_K), tiled(nkv * d, h))
        w.add_tensor(name(T.ATTN_V), tiled(nkv * d, h))
        w.add_tensor(name(T.ATTN_OUT), tiled(h, nh * d))
        w.add_tensor(name(T.ATTN_Q_NORM), ones(d))
        w.add_tensor(name(T.ATTN_K_NORM), ones(d))
        w.add_tensor(name(T.FFN_GATE_INP), (rng.standard_normal((e, h)) * 0.02).astype(np.float32))
        w.add_tensor(name(T.FFN_GATE_EXP), tiled(e, inter, h))
        w.add_tensor(name(T.FFN_UP_EXP), tiled(e, inter, h))
        w.add_tensor(name(T.FFN_DOWN_EXP), tiled(e, h, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {a.out}: {a.model} cut to {n_layers} layers, F16", flush=True)


if __name__ == "__main__":
    main()
