"""`--model=file.gguf`: a llama.cpp GGUF file (or the parts `name-00001-of-0000N.gguf` of a split one) of a
Qwen3-MoE model (arch `qwen3moe`) or a Qwen3-Next model (arch `qwen3next`), read through gguf's `GGUFReader`
(memory-mapped).

resolve_model turns the file into a model folder under the cache (`gguf_model_folder`): config.json,
tokenizer.json, tokenizer_config.json (chat template, special tokens) and generation_config.json made from the
GGUF's metadata, and gguf.json naming the file(s), the tensor types per family and where each tensor lies (the
metadata is parsed once: Qwen's 151k tokens and merges take GGUFReader seconds). generation_config.json holds the
file's sampling defaults where it has them (general.sampling.temp / top_k / top_p as temperature / top_k / top_p,
do_sample where temp > 0: requests default to them as to a Hugging Face folder's; min_p, the repeat penalty,
mirostat and XTC no request option takes: one start-up line when the file sets them). From there the engine loads it
as any folder: checkpoint.open_reader gives `GGUFTensors`, which maps the files and serves the Hub tensor names that
model.weight_specs declares, each mapped to llama.cpp's name by gguf's own TensorNameMap (the table
convert_hf_to_gguf writes with), so no second list of names or shapes lives here.

qwen3next: convert_hf_to_gguf's Qwen3NextModel (llama.cpp conversion/qwen.py) changes some tensors on the way, and
each tensor's `recipe` undoes it (`undo`): in_proj_qkvz is regrouped into attn_qkv ([q of every key head | k | v])
and attn_gate (z) (older files: ssm_in, the Hub's rows as they are), A_log is stored as ssm_a = -exp(A_log) (read
back as log(-ssm_a) in float64: within a float32 rounding of the Hub's value, and the engine's -exp of it is
ssm_a to that rounding), the zero-centred RMSNorm weights (every `*norm.weight` but the DeltaNet's gated norm) are
stored + 1 (read back - 1 in float32: for a stored value in [0.5, 2] exact, so the engine's 1 + w is the stored
value), conv1d is squeezed to [C, K], dt_bias is named ssm_dt.bias; in_proj_ba, the gated norm and every other
matrix are the Hub's. The converter's options
--fuse-qkv (the full-attention layers' attn_qkv) and --fuse-gate-up-exps (ffn_gate_up_exps) are split back. The
multi-token-prediction layer (the converter's block L = num_hidden_layers, `nextn.*`) is read as the `mtp.*`
tensors when the file holds it; a file that declares it (nextn_predict_layers) without its tensors (--no-mtp
leaves both out) runs without MTP, said in one start-up line. The layer types come from
`attention.recurrent_layers` or else `full_attention_interval` (llama.cpp's default 4).

Tensors: F32, F16 and BF16 are read as they are; every type `gguf.quants.dequantize` reads (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, the K types Q2_K..Q6_K, the IQ types, ...) is dequantized to float32 at load and cast to the engine's
dtype, but routed experts of a type strata_jax/model/quant.py's GGUF_KEPT holds (Q4_0, Q4_1, Q8_0, the K types, the
IQ types IQ1_S..IQ4_XS: int8-g16 / int8-g32; Q4_K, Q2_K, Q6_K and Q3_K packed) are kept as read (`GGUFTensors.kept_experts`, expert_dtype=auto: one
start-up line per family names the type read, the format held and its bits per weight), their values gguf's bit for
bit. The dequantization runs in LOAD_THREADS threads (default:
the cores this process may use; numpy lets go of the GIL in its loops): a tensor's rows are cut in jobs of about
CHUNK_VALUES values, and the experts of a stack after the one the loader reads are dequantized (and checked) ahead,
one job each, while the loader converts and places the last (at most 2 x threads ahead and READ_AHEAD_BYTES / 3 of
float32 per stack); the values are gguf.quants.dequantize's of the whole tensor, bit for bit. The loader's lines say
each layer with the time spent and to go (engine/build.py's _progress). Other architectures, other tokenizers, other
tensor types and tensors no recipe reads (a dense MLP layer in a qwen3next file, the MTP layer's own embeddings or head)
are refused with one line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from strata_jax.errors import StrataError, make_writable_folder

# gguf (its import takes ~0.2 s) is imported where a GGUF is read, so the engine's import does not pay for it.

ARCHS = ("qwen3moe", "qwen3next")  # the GGUF architectures read here
# Dequantizing at load: LOAD_THREADS threads (None: the cores this process may use), jobs of about CHUNK_VALUES
# values; the experts after the one the loader reads are dequantized ahead, up to READ_AHEAD_BYTES of float32.
LOAD_THREADS: int | None = None
CHUNK_VALUES = 1 << 19
READ_AHEAD_BYTES = 256 << 20
FOLDER_VERSION = 3  # of what gguf_model_folder writes: a change makes new folders (3: general.sampling.*)
SOURCE_FILE = "gguf.json"  # in a GGUF's model folder: the files and their tensor types
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
EXACT_TYPES = ("F32", "F16", "BF16")  # read as they are
# Qwen2's pre-tokenizer (tokenizer.ggml.pre = qwen2), as its tokenizer.json writes it: NFC, this split, byte level.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("qwen2",)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # gguf.TokenType


def split_parts(path: Path) -> list[Path]:
    """The file, or every part of a split GGUF given any of its parts (`name-0000k-of-0000N.gguf`)."""
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('stem')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise StrataError(f"{path}: part {missing[0]} of the {count}-part GGUF is missing (beside it)")
    return parts


class GGUFFiles:
    """The GGUF's parts opened (memory-mapped): metadata from the first, tensors by name from all."""

    def __init__(self, path: str | Path):
        import gguf
        self.path = Path(path).absolute()
        if not self.path.is_file():
            raise StrataError(f"GGUF file {self.path} does not exist" if not self.path.exists() else
                              f"{self.path} is not a file")
        self.parts = split_parts(self.path)
        self.readers = []
        for p in self.parts:
            try:
                self.readers.append(gguf.GGUFReader(p))
            except (ValueError, OSError, IndexError, KeyError) as e:  # bad magic, a cut file, an unknown type
                raise StrataError(f"cannot read GGUF file {p} (cut short, damaged or not a GGUF file): {e}") from None
        self.fields = self.readers[0].fields
        count = self.value("split.count", 1)
        if count != len(self.parts):
            raise StrataError(f"{self.path}: the GGUF says it has {count} parts (split.count), found "
                              f"{len(self.parts)}: give the first of its parts, named name-00001-of-0000N.gguf")
        self.tensors = {}
        for p, r in zip(self.parts, self.readers):
            for t in r.tensors:
                self.tensors[t.name] = (t, p)
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHS:
            raise StrataError(f"{self.path}: GGUF architecture {self.arch!r} is not supported (supported: "
                              f"{', '.join(map(repr, ARCHS))})")

    def value(self, key: str, default=None, required: bool = False):
        field = self.fields.get(key)
        if field is None:
            if required:
                raise StrataError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch_value(self, key: str, default=None, required: bool = True):
        return self.value(f"{self.arch}.{key}", default, required and default is None)

    def one_value(self, key: str, default=None, required: bool = True):
        """An `{arch}.` key that llama.cpp reads as one value or one per layer (get_key_or_arr): a list of equal
        values is that value; different values per layer are refused (the engine's layers share one shape)."""
        x = self.arch_value(key, default, required)
        if isinstance(x, list):
            if len(set(x)) != 1:
                raise StrataError(f"{self.path}: {self.arch}.{key} differs between layers ({sorted(set(x))}): "
                                  "this engine's layers share one shape")
            x = x[0]
        return x


def decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not 9.99999997e-07): the
    number config.json held before the converter stored it."""
    return float(str(np.float32(x)))


def block_layout(files: GGUFFiles) -> dict:
    """The GGUF's blocks: {"layers": the model's decoder layers, "mtp_declared": nextn_predict_layers, "mtp_block":
    the block index of the MTP layer when the file holds its tensors, else None}. convert_hf_to_gguf counts the MTP
    layers into block_count and writes them as the blocks after the model's (_QwenMtpMixin)."""
    a = files.arch_value
    count = a("block_count")
    declared = a("nextn_predict_layers", 0) if files.arch == "qwen3next" else 0
    layers = count - declared
    if declared < 0 or layers <= 0:
        raise StrataError(f"{files.path}: block_count {count} with nextn_predict_layers {declared} leaves no "
                          "decoder layer")
    blocks = {int(m.group(1)) for name in files.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    trunk, mtp = set(range(layers)), set(range(layers, count))
    if mtp and blocks and blocks <= mtp:
        raise StrataError(f"{files.path}: the GGUF holds only the MTP layer (blk.{min(blocks)}; a file of "
                          "convert_hf_to_gguf --mtp): give the model's GGUF")
    if blocks not in (trunk, trunk | mtp):  # before anything is sized from block_count
        raise StrataError(f"{files.path}: block_count is {count}, but the GGUF holds tensors of {len(blocks)} "
                          f"blocks" + (f" (blk.{min(blocks)}..blk.{max(blocks)})" if blocks else ""))
    present = bool(mtp) and blocks == trunk | mtp
    if present and declared > 1:
        raise StrataError(f"{files.path}: nextn_predict_layers is {declared}: this engine's MTP drafter reads one "
                          "MTP layer (Qwen3-Next has one)")
    return {"layers": layers, "mtp_declared": declared, "mtp_block": layers if present else None}


def raw_config(files: GGUFFiles, layout: dict | None = None) -> dict:
    """The GGUF's hyperparameters as a Hugging Face config.json (config_from_dict reads it): Qwen3MoeForCausalLM
    from qwen3moe, Qwen3NextForCausalLM from qwen3next (`next_config`). llama.cpp makes every layer of both MoE."""
    a = files.arch_value
    layout = layout or block_layout(files)
    scaling = a("rope.scaling.type", "none", required=False)
    if scaling not in ("none", None):
        raise StrataError(f"{files.path}: rope scaling {scaling!r} (rope.scaling.type) is not supported (only the "
                          "default RoPE)")
    head_dim = a("attention.key_length", a("embedding_length") // a("attention.head_count"))
    if a("attention.value_length", head_dim) != head_dim:
        raise StrataError(f"{files.path}: attention.value_length {a('attention.value_length')} differs from "
                          f"key_length {head_dim}: not a Qwen3-MoE / Qwen3-Next shape")
    embed = files.tensors.get("token_embd.weight")
    if embed is None:
        raise StrataError(f"{files.path}: GGUF tensor 'token_embd.weight' is missing")
    tokens = files.value("tokenizer.ggml.tokens")
    vocab = a("vocab_size", len(tokens) if tokens else int(embed[0].shape[1]))
    eos = files.value("tokenizer.ggml.eos_token_id")
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_hidden_layers": layout["layers"], "hidden_size": a("embedding_length"),
        "num_attention_heads": files.one_value("attention.head_count"),
        "num_key_value_heads": files.one_value("attention.head_count_kv", a("attention.head_count")),
        "head_dim": head_dim,
        "num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
        "moe_intermediate_size": files.one_value("expert_feed_forward_length"),
        "intermediate_size": files.one_value("feed_forward_length", 0), "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": bool(a("expert_weights_norm", True)),
        "rms_norm_eps": decimal(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": decimal(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": a("context_length"), "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in files.tensors,  # llama.cpp then reads token_embd
        "eos_token_id": eos, "hidden_act": "silu",
    }
    if files.arch == "qwen3next":
        return next_config(files, raw, layout)
    if a("rope.dimension_count", head_dim) != head_dim:
        raise StrataError(f"{files.path}: rope.dimension_count {a('rope.dimension_count')} is not the head "
                          f"dimension {head_dim}: partial RoPE is not a Qwen3-MoE shape")
    return raw


def next_config(files: GGUFFiles, raw: dict, layout: dict) -> dict:
    """qwen3next's keys as Qwen3NextConfig's (what Qwen3NextModel.set_gguf_parameters wrote from them): the layer
    types, the DeltaNet's shape (ssm.*: conv_kernel, state_size = linear_key_head_dim, group_count =
    linear_num_key_heads, time_step_rank = linear_num_value_heads, inner_size = their product with
    linear_value_head_dim), partial RoPE (rope.dimension_count of the head), the shared expert, the MTP layers."""
    a = files.arch_value
    n, count = layout["layers"], files.arch_value("block_count")
    recurrent = files.value("qwen3next.attention.recurrent_layers")
    if recurrent is not None:  # an array over every block (the MTP layer's False), or one value for all
        flags = [bool(x) for x in recurrent] if isinstance(recurrent, list) else [bool(recurrent)] * count
        if len(flags) != count:
            raise StrataError(f"{files.path}: qwen3next.attention.recurrent_layers has {len(flags)} entries for "
                              f"{count} blocks")
        if any(flags[n:]):
            raise StrataError(f"{files.path}: qwen3next.attention.recurrent_layers marks the MTP layer recurrent "
                              "(it is a full-attention layer)")
    else:  # llama.cpp's rule: every interval-th layer full attention, the default interval 4
        interval = a("full_attention_interval", 4)
        if interval <= 0:
            raise StrataError(f"{files.path}: qwen3next.full_attention_interval must be positive (got {interval})")
        flags = [(i + 1) % interval != 0 for i in range(n)]
    types = ["linear_attention" if r else "full_attention" for r in flags[:n]]
    head_dim = raw["head_dim"]
    rotary = a("rope.dimension_count", head_dim)
    factor = rotary / head_dim
    if not 0 < rotary <= head_dim or int(head_dim * factor) != rotary:
        raise StrataError(f"{files.path}: rope.dimension_count {rotary} is not a rotary part of the head dimension "
                          f"{head_dim}")
    shared = a("expert_shared_feed_forward_length", 0)
    if not shared and any(name.endswith(".ffn_up_shexp.weight") for name in files.tensors):
        shared = raw["intermediate_size"]  # llama.cpp's fallback: n_ff
    out = dict(raw, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", layer_types=types,
               partial_rotary_factor=factor, shared_expert_intermediate_size=shared,
               mtp_num_hidden_layers=layout["mtp_declared"] if layout["mtp_block"] is not None else 0)
    if "linear_attention" in types:
        value_heads, inner = a("ssm.time_step_rank"), a("ssm.inner_size")
        if value_heads <= 0 or inner % value_heads:
            raise StrataError(f"{files.path}: qwen3next.ssm.inner_size {inner} is not a multiple of "
                              f"ssm.time_step_rank {value_heads} (the value heads)")
        out.update(linear_conv_kernel_dim=a("ssm.conv_kernel"), linear_key_head_dim=a("ssm.state_size"),
                   linear_num_key_heads=a("ssm.group_count"), linear_num_value_heads=value_heads,
                   linear_value_head_dim=inner // value_heads)
    return out


# ---- the tokenizer ------------------------------------------------------------------------------------------------

def tokenizer_json(files: GGUFFiles) -> dict | None:
    """tokenizer.ggml.* as the Hugging Face tokenizer.json of a Qwen2-style byte-level BPE (what convert_hf_to_gguf
    read): NORMAL tokens in the BPE vocabulary, CONTROL (special) and USER_DEFINED (not special) tokens as added
    tokens, UNUSED ones (the converter's [PAD{i}] fill up to vocab_size) left out. None without a tokenizer.
    The ids are the Hugging Face tokenizer's (checked on Qwen3's own tokenizer.json); one difference stays: the
    converter marks every <|...|> token CONTROL, so Qwen's non-special <|fim_*|> tokens are special here and a
    decode that skips special tokens drops them."""
    model = files.value("tokenizer.ggml.model")
    if model is None:
        return None
    pre = files.value("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise StrataError(f"{files.path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported (only "
                          f"'gpt2' with {', '.join(map(repr, PRE_TOKENIZERS))}: Qwen's byte-level BPE)")
    tokens = files.value("tokenizer.ggml.tokens", required=True)
    types = files.value("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = files.value("tokenizer.ggml.merges") or []
    if len(types) != len(tokens):
        raise StrataError(f"{files.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab, added = {}, []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_NORMAL:
            vocab[tok] = i
        elif kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == TOKEN_CONTROL})
        elif kind != TOKEN_UNUSED:
            raise StrataError(f"{files.path}: token {i} {tok!r} has type {kind} (a byte-level BPE has normal, "
                              "control, user-defined and unused tokens)")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]},
    }


def tokenizer_config(files: GGUFFiles) -> dict:
    """tokenizer_config.json: the chat template and the special tokens' texts (the template's bos_token, ...)."""
    tokens = files.value("tokenizer.ggml.tokens") or []
    out = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos", "eos", "padding", "unknown"):
        i = files.value(f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            out[{"padding": "pad_token", "unknown": "unk_token"}.get(name, f"{name}_token")] = tokens[i]
    template = files.value("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # Qwen's control tokens that llama.cpp's vocabulary ends generation on


def generation_config(files: GGUFFiles) -> dict:
    """generation_config.json: the ids that end a turn (eos, end-of-turn / end-of-message where set, and Qwen's
    <|im_end|> / <|endoftext|> control tokens, as Qwen3's own generation_config lists both), and the file's
    sampling defaults (`sampling_config`; greedy without them)."""
    ids = [files.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = files.value("tokenizer.ggml.tokens") or []
    types = files.value("tokenizer.ggml.token_type") or []
    ids += [i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_CONTROL and tok in END_TOKENS]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return {"eos_token_id": ids, "do_sample": False, **sampling_config(files)}


# general.sampling.* (llama.cpp's defaults for the file; convert_hf_to_gguf writes them from the Hub's
# generation_config.json) that a request option here takes, by generation_config.json's name.
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p"}
# The others no request option here takes, with the value at which llama.cpp's sampler leaves them off: a file that
# sets one otherwise is said in a start-up line (`sampling_line`). Their companions (penalty_last_n, mirostat_tau /
# _eta, xtc_threshold, the sampler sequence) act only through them.
UNUSED_SAMPLING = {"min_p": 0.0, "penalty_repeat": 1.0, "mirostat": 0, "xtc_probability": 0.0}


def sampling_config(files: GGUFFiles) -> dict:
    """general.sampling.temp / top_k / top_p as generation_config.json's temperature / top_k / top_p, with
    do_sample true where temp > 0, so the engine's requests default to them as to a Hugging Face folder's (strata_jax/
    io/chat.py: load_generation_config). llama.cpp's values as its sampler reads them: temp <= 0 greedy (do_sample
    false), top_k <= 0 off (0), top_p >= 1 off (1; below 0 it keeps one token, as top_p 0 does). Without temp the
    requests stay greedy (llama.cpp would sample at its own default temperature, 0.8); keys that are absent are not
    written."""
    out = {}
    got = {key: files.value(f"general.sampling.{key}") for key in SAMPLING_KEYS}
    for key, x in got.items():
        if x is None:
            continue
        if isinstance(x, (list, str)) or not np.isfinite(x):
            raise StrataError(f"{files.path}: GGUF metadata general.sampling.{key} is {x!r}, not a number")
        if key == "top_k":
            out["top_k"] = max(0, int(x))
        elif key == "top_p":
            out["top_p"] = min(1.0, max(0.0, decimal(x)))
        else:
            out["temperature"] = max(0.0, decimal(x))
            out["do_sample"] = x > 0
    return out


def unused_sampling(files: GGUFFiles) -> dict:
    """{key: value} of the general.sampling.* keys no request option takes, where the file turns them on."""
    out = {}
    for key, off in UNUSED_SAMPLING.items():
        x = files.value(f"general.sampling.{key}")
        if isinstance(x, (int, float)) and x != off:
            out[key] = decimal(x) if isinstance(x, float) else x
    return out


# ---- tensor types per family --------------------------------------------------------------------------------------

def family_of(name: str, mtp_block: int | None = None) -> str:
    """A llama.cpp tensor's family for the start-up line (the MTP layer's block: "mtp")."""
    if mtp_block is not None and name.startswith(f"blk.{mtp_block}."):
        return "mtp"
    if "_exps." in name:
        return "experts"
    if ".ffn_gate_inp." in name:
        return "router"
    if name.startswith(("token_embd.", "output.")):
        return "embeddings"
    if name.endswith("_norm.weight"):
        return "norms"
    if ".attn_" in name or ".ssm_" in name:  # a DeltaNet layer's tensors: its attention
        return "attention"
    return "dense"


def readable(qtype) -> bool:
    """F32/F16/BF16, or a type gguf.quants can dequantize (asked with one block of zeros)."""
    import gguf
    if qtype.name in EXACT_TYPES:
        return True
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(size, np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def type_table(files: GGUFFiles, mtp_block: int | None = None) -> dict:
    """{family: {type name: [weights, bytes]}}; one line for a tensor of a type that cannot be read."""
    from gguf import GGMLQuantizationType
    table: dict = {}
    told: dict = {}
    for name, (t, _) in files.tensors.items():
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in told:
            told[qtype] = readable(qtype)
        if not told[qtype]:
            raise StrataError(f"{files.path}: GGUF tensor {name!r} has type {qtype.name}, which this engine does "
                              f"not read (F32, F16, BF16 and the types gguf.quants dequantizes)")
        family = family_of(name, mtp_block)
        n, b = table.setdefault(family, {}).setdefault(qtype.name, [0, 0])
        table[family][qtype.name] = [n + int(t.n_elements), b + int(t.n_bytes)]
    return table


def tensor_table(files: GGUFFiles) -> dict:
    """{name: [part, type, numpy shape, data offset, bytes]}, what GGUFReader found: the loads map the tensors from
    it, since a parse of the metadata (Qwen's 151k tokens and merges) takes seconds."""
    from gguf import GGMLQuantizationType
    return {name: [files.parts.index(part), GGMLQuantizationType(t.tensor_type).name,
                   [int(d) for d in reversed(t.shape.tolist())], int(t.data_offset), int(t.n_bytes)]
            for name, (t, part) in files.tensors.items()}


EXPERT_FAMILIES = ("gate_up", "down")  # the expert families a format is picked for: gate and up share one


def expert_family_types(source: dict) -> dict[str, dict[str, list[int]]]:
    """{"gate_up": {type: [weights, bytes]}, "down": {...}}: the routed experts' tensor types per family (the MTP
    block's experts left out: they stay unquantized)."""
    table: dict = {family: {} for family in EXPERT_FAMILIES}
    for name, (_, qtype, shape, _, nbytes) in source.get("tensors", {}).items():
        if family_of(name, source.get("mtp_block")) != "experts":
            continue
        family = table["down" if "down_exps" in name else "gate_up"]
        n, b = family.setdefault(qtype, [0, 0])
        family[qtype] = [n + int(np.prod(shape)), b + int(nbytes)]
    return table


def family_format(types: dict[str, list[int]]) -> str | None:
    """The engine format one expert family is held in under expert_dtype=auto (strata_jax/model/quant.py GGUF_KEPT):
    the one format that holds every type of the family, as read; where the family mixes types of several formats:
    all K types (a Q4_K_M file's down stacks: Q6_K, some layers Q4_K; Q3_K_M's: Q3_K, Q4_K, Q5_K), int6-q6km, which
    holds each K type's values packed (quant.q6km_from_blocks); else int8-g16m, which holds each of them exactly (a
    scale and a minimum per 16 inputs: quant.widen), or where one does not fit it (Q4_0 beside Q6_K), the format of the
    type holding most of its weights (ties: the more bits), the other stacks requantized into it at load; None where
    a type is not kept (F16, Q5_0, ...): the experts are dequantized. (Q3_K beside Q6_K: int6-q6k holds both.)"""
    from strata_jax.model.quant import GGUF_KEPT, K_TYPES, Q6KM, QK_K, WIDE, get_format, holds
    if not types or any(t not in GGUF_KEPT for t in types):
        return None
    weights: dict = {}
    for t, (n, _) in types.items():
        weights[GGUF_KEPT[t]] = weights.get(GGUF_KEPT[t], 0) + n
    if len(weights) > 1 and all(t in K_TYPES for t in types):
        return Q6KM
    if len(weights) > 1 and all(holds(WIDE, t) for t in types):
        return WIDE
    return max(weights, key=lambda f: (weights[f], get_format(f).bits_per_weight(QK_K)))


def kept_expert_format(folder: str | Path) -> str | None:
    """The engine format a GGUF's routed experts are kept in as read (expert_dtype=auto; strata_jax/model/quant.py
    GGUF_KEPT), per family (`family_format`): one name where gate/up and down agree (int4-q4k for Q4_K, int2-q2k for
    Q2_K, int8-g32 for Q8_0, int6-q6k for Q6_K and Q3_K, ...), else the pair "gate_up/down" (a Q2_K file:
    "int2-q2k/int6-q6k"); None where a family holds a type no format keeps (its experts dequantized at load) and for
    other folders."""
    from strata_jax.model.quant import pair_format
    path = Path(folder) / SOURCE_FILE
    if not path.is_file():
        return None
    families = expert_family_types(json.loads(path.read_text()))
    formats = [family_format(families[f]) for f in EXPERT_FAMILIES]
    return None if None in formats else pair_format(*formats)


def _experts_held(types: dict, expert_format: str, quantized: bool) -> str:
    """What the engine holds of experts of `types` in `expert_format`: the types kept as read, the others
    requantized."""
    from strata_jax.model.quant import Q6K, Q6KM, QK_K, get_format, holds, keeps
    kept = sorted(t for t in types if keeps(expert_format, t))
    if expert_format == Q6K and "Q3_K" in kept and len(kept) == len(types):  # Q3_K re-laid-out, not as stored
        return (f"{expert_format} ({get_format(Q6K).bits_per_weight(QK_K):.2f} bpw: {'+'.join(kept)}'s values as "
                "read, in Q6_K's blocks: Q3_K's q + 32, its scale sc - 32)")
    if expert_format == Q6KM and len(kept) == len(types):
        return (f"{expert_format} ({get_format(Q6KM).bits_per_weight(QK_K):.2f} bpw: {'+'.join(kept)}'s values as "
                "read, q + 32 in 6 bits, a scale and a minimum per 16 inputs)")
    widened = sorted(t for t in types if holds(expert_format, t) and not keeps(expert_format, t))
    bits = get_format(expert_format).bits_per_weight(QK_K)
    if widened and len(kept) + len(widened) == len(types):
        return (f"{expert_format} ({bits:.2f} bpw: {'+'.join(sorted(types))}'s values as read, a scale and a "
                "minimum per 16 inputs)")
    if kept:
        others = "" if len(kept) == len(types) else ", the other types requantized at load from their values"
        return f"{expert_format} ({bits:.2f} bpw: {'+'.join(kept)}'s blocks as stored{others})"
    return f"{expert_format} (requantized at load from the {'dequantized' if quantized else 'read'} values)"


def _bpw(types: dict) -> float:
    return 8 * sum(b for _, b in types.values()) / sum(n for n, _ in types.values())


def formats_line(source: dict, dtype: str, expert_format: str | None) -> str:
    """One line: per family the GGUF types read (bits per weight) and what the engine holds (the experts: the
    format keeping their type as read, with its bits per weight; per-family formats: gate/up's and down's, each)."""
    from strata_jax.model.quant import BLOCK_FORMATS, FAMILY_SEP, GGUF_KEPT, KEPT_FORMATS, family_formats
    short = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
    held = short.get(dtype, dtype)
    parts = []
    for family in ("attention", "dense", "router", "experts", "embeddings", "norms", "mtp"):
        types = source["types"].get(family)
        if not types:
            continue
        quantized = any(t not in EXACT_TYPES for t in types)
        if family == "experts" and expert_format and FAMILY_SEP in expert_format:  # a format per family
            by_family = expert_family_types(source)
            for label, sub, fmt in zip(("gate/up", "down"), EXPERT_FAMILIES, family_formats(expert_format)):
                sub_types = by_family[sub]
                sub_quantized = any(t not in EXACT_TYPES for t in sub_types)
                parts.append(f"experts {label} {'+'.join(sorted(sub_types))} ({_bpw(sub_types):.2f} bpw) -> "
                             + _experts_held(sub_types, fmt, sub_quantized))
            continue
        if family == "experts" and expert_format:
            to = _experts_held(types, expert_format, quantized)
        else:
            to = held + (" (dequantized at load)" if quantized else "")
        parts.append(f"{family} {'+'.join(sorted(types))} ({_bpw(types):.2f} bpw) -> {to}")
    n = len(source["files"])
    kept = expert_format and all(f in KEPT_FORMATS + BLOCK_FORMATS for f in family_formats(expert_format))
    packed = (f"the experts ({expert_format})" if kept else
              f"experts of {', '.join(GGUF_KEPT)} (expert_dtype=auto: a format per family, gate/up and down, "
              "where one holds each family's types), other types not yet")
    return (f"gguf: {source['files'][0]} ({source['arch']}, {n} file{'s' if n > 1 else ''}): {', '.join(parts)}; "
            f"packed on the device: {packed}")


def mtp_line(source: dict) -> str | None:
    """One line when the GGUF declares MTP layers (nextn_predict_layers) but holds none of their tensors."""
    declared, block = source.get("mtp_declared", 0), source.get("mtp_block")
    if not declared or block is not None:
        return None
    return (f"gguf: {source['files'][0]} declares {declared} MTP layer(s) (nextn_predict_layers) but holds none of "
            "their tensors: the engine runs without MTP (draft=mtp drafts with ngram)")


def sampling_line(source: dict) -> str | None:
    """One line when the GGUF sets sampling defaults (general.sampling.*) that no request option here takes."""
    unused = source.get("sampling_unused") or {}
    if not unused:
        return None
    return (f"gguf: {source['files'][0]} sets general.sampling." + ", ".join(f"{k} {v}" for k, v in unused.items())
            + ", which no request option here takes: requests sample without "
            + ("it" if len(unused) == 1 else "them") + " (temperature, top_k and top_p take the file's defaults)")


def say_formats(folder: Path, dtype: str, expert_format: str | None, say) -> None:
    """The start-up line(s) of a GGUF's model folder (nothing for any other folder)."""
    path = Path(folder) / SOURCE_FILE
    if path.is_file():
        source = json.loads(path.read_text())
        say(formats_line(source, dtype, expert_format))
        for line in (mtp_line(source), sampling_line(source)):
            if line:
                say(line)


# ---- the model folder ---------------------------------------------------------------------------------------------

def gguf_model_folder(path: str | Path, cache_dir: Path) -> Path:
    """The model folder of a GGUF under cache_dir (written on first use, atomically): its metadata as config.json,
    tokenizer.json, tokenizer_config.json and generation_config.json, and gguf.json (the files, the tensor types
    and offsets). Its name holds the files' paths, sizes and times, so a changed file gets a new folder."""
    from strata_jax.model.config import config_from_dict
    path = Path(path).absolute()
    if not path.is_file():
        raise StrataError(f"GGUF file {path} does not exist" if not path.exists() else f"{path} is not a file")
    parts = split_parts(path)
    key = hashlib.sha256(json.dumps([FOLDER_VERSION] + [
        [str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in parts]).encode()).hexdigest()[:12]
    folder = Path(cache_dir) / "gguf" / f"{parts[0].name}-{key}"
    if (folder / SOURCE_FILE).is_file():
        return folder
    files = GGUFFiles(parts[0])
    layout = block_layout(files)
    raw = raw_config(files, layout)
    config_from_dict(raw, where=str(files.path))  # a bad shape is refused here, naming the GGUF
    source = {"files": [str(p) for p in files.parts], "arch": files.arch,
              "types": type_table(files, layout["mtp_block"]), "tensors": tensor_table(files),
              "mtp_declared": layout["mtp_declared"], "mtp_block": layout["mtp_block"],
              "sampling_unused": unused_sampling(files)}
    tok = tokenizer_json(files)
    generation = generation_config(files)  # a bad value is refused before anything is written
    make_writable_folder(folder.parent, f"cache_dir {cache_dir}: not a writable folder for the GGUF's model folder")
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(raw, indent=1))
    if tok is not None:
        (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(files), indent=1, ensure_ascii=False))
    (tmp / "generation_config.json").write_text(json.dumps(generation))
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1))  # last: its presence marks a complete folder
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / SOURCE_FILE).is_file():
            raise
    return folder


# ---- the tensors --------------------------------------------------------------------------------------------------

def reader_for(folder: str | Path, check) -> "GGUFTensors | None":
    """The tensors of a GGUF's model folder, or None for any other folder; check(name, array): the loader's check
    of each tensor read (non-finite values)."""
    path = Path(folder) / SOURCE_FILE
    return GGUFTensors(folder, check) if path.is_file() else None


EXPERT_NAME = re.compile(r"\.experts\.\{j\}\.")
# The MTP module's own tensors: the names _QwenMtpMixin.filter_tensors gives them (model.layers.{L}.eh_proj, ...)
# as llama.cpp names them (gguf's MODEL_TENSOR.NEXTN_*; gguf 0.19's TensorNameMap has no NEXTN for qwen3next).
NEXTN = {"mtp.fc.weight": "NEXTN_EH_PROJ", "mtp.pre_fc_norm_embedding.weight": "NEXTN_ENORM",
         "mtp.pre_fc_norm_hidden.weight": "NEXTN_HNORM", "mtp.norm.weight": "NEXTN_SHARED_HEAD_NORM"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one Hub tensor comes from the GGUF: `undo(op, ...)` over the tensors `names` (numpy shapes `shapes`;
    `expert`: the index in their [E, ...] stack)."""
    op: str  # plain, norm, a_log, conv, reshape, qkvz, rows
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    expert: int | None = None
    arg: tuple = ()  # rows: (start, stop); qkvz: (Nk, Dk, Nv/Nk * Dv)


def gguf_name(kind: str, block: int | None = None, suffix: str = ".weight") -> str:
    """llama.cpp's name of a MODEL_TENSOR kind ("ATTN_QKV", block 3 -> blk.3.attn_qkv.weight)."""
    import gguf
    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].format(bid=block) + suffix


def recipe(hub: str, leaf, j: int | None, cfg, names, tensors: dict, mtp_block: int | None) -> Recipe:
    """The recipe of Hub tensor `hub` (its declaration `leaf`; expert j of a stack): the name convert_hf_to_gguf
    gave it, and for qwen3next (`cfg.next`) the inverse of what Qwen3NextModel.modify_tensors did to it. Where the
    converter has two forms (the options --fuse-qkv and --fuse-gate-up-exps; ssm_in before attn_qkv/attn_gate),
    the form the file holds is read."""
    fused = EXPERT_NAME.sub(".experts.", leaf.hf)  # the converter's name for the stacked experts
    shape = tuple(leaf.shape if leaf.expert else leaf.hf_shape)
    if fused in NEXTN:  # the converter's names enorm / hnorm / shared_head.norm end in norm.weight: + 1
        return Recipe("plain" if fused == "mtp.fc.weight" else "norm", (gguf_name(NEXTN[fused], mtp_block),),
                      (shape,))
    name = fused
    if name.startswith("mtp.layers.0."):  # _QwenMtpMixin: the MTP layer is the block after the model's
        name = f"model.layers.{mtp_block}." + name[len("mtp.layers.0."):]
    if name.endswith(".dt_bias"):  # Qwen3NextModel renames it before the table
        name = name[:-len(".dt_bias")] + ".dt_proj.bias"
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise StrataError(f"no GGUF name for the Hub tensor {fused!r}")
    m = re.match(r"blk\.(\d+)\.", mapped)
    block = int(m.group(1)) if m else None
    plain = Recipe("plain", (mapped,), (shape,), j)
    if leaf.expert:
        gate_up = gguf_name("FFN_GATE_UP_EXP", block)
        if mapped in tensors or gate_up not in tensors or leaf.expert == "down":
            return plain
        e, f, h = leaf.shape  # --fuse-gate-up-exps: [E, 2F, H] = gate | up
        return Recipe("rows", (gate_up,), ((e, 2 * f, h),), j, (0, f) if leaf.expert == "gate" else (f, 2 * f))
    if re.search(r"\.self_attn\.[qkv]_proj\.weight$", leaf.hf):
        qkv = gguf_name("ATTN_QKV", block)
        if mapped in tensors or qkv not in tensors:
            return plain
        q, kv = cfg.num_heads * cfg.head_dim * (2 if cfg.next else 1), cfg.num_kv_heads * cfg.head_dim
        start = {"q": 0, "k": q, "v": q + kv}[leaf.hf.split(".self_attn.")[1][0]]  # --fuse-qkv: q | k | v rows
        return Recipe("rows", (qkv,), ((q + 2 * kv, shape[1]),), None, (start, start + shape[0]))
    if not cfg.next:
        return plain
    if fused.endswith(".A_log"):
        return Recipe("a_log", (mapped,), (shape,))
    if fused.endswith(".conv1d.weight"):  # [C, 1, K] squeezed
        return Recipe("conv", (mapped,), ((shape[0], shape[2]),))
    if fused.endswith("norm.weight") and not fused.endswith("linear_attn.norm.weight"):
        return Recipe("norm", (mapped,), (shape,))
    if fused.endswith(".in_proj_qkvz.weight"):
        qkv, z = gguf_name("ATTN_QKV", block), gguf_name("ATTN_GATE", block)
        if mapped in tensors and qkv not in tensors:  # the older files' ssm_in: the Hub's rows
            return plain
        nk, dk, nv, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, \
            cfg.linear_value_head_dim
        return Recipe("qkvz", (qkv, z), ((2 * nk * dk + nv * dv, shape[1]), (nv * dv, shape[1])), None,
                      (nk, dk, nv // nk * dv))
    if fused.endswith(".shared_expert_gate.weight"):  # [1, H]; llama.cpp reads it as [H]: either is taken
        got = tensors.get(mapped)
        return Recipe("reshape", (mapped,), (shape[1:] if got and len(got[2]) == 1 else shape,))
    return plain


def undo(r: Recipe, xs: list[np.ndarray], shape: tuple[int, ...], path: str) -> np.ndarray:
    """The Hub tensor from the GGUF tensors of its recipe (the inverse of convert_hf_to_gguf's change)."""
    x = xs[0]
    if r.op == "norm":  # stored 1 + w
        return np.subtract(x, 1, dtype=np.float32)
    if r.op == "a_log":  # stored -exp(A_log)
        if not np.all(x < 0):
            raise StrataError(f"GGUF tensor {r.names[0]!r} in {path} holds values >= 0: convert_hf_to_gguf stores "
                              "-exp(A_log) there, which is negative")
        return np.log(-x.astype(np.float64)).astype(np.float32)
    if r.op == "conv":
        return x[:, None, :]
    if r.op == "reshape":
        return x.reshape(shape)
    if r.op == "rows":
        return np.ascontiguousarray(x[r.arg[0]:r.arg[1]])
    if r.op == "qkvz":  # attn_qkv [q of every key head | k | v] + attn_gate z -> per key head [q_i, k_i, v_i, z_i]
        nk, dk, vz = r.arg
        h = x.shape[-1]
        q, k = x[:nk * dk].reshape(nk, dk, h), x[nk * dk:2 * nk * dk].reshape(nk, dk, h)
        v, z = x[2 * nk * dk:].reshape(nk, vz, h), xs[1].reshape(nk, vz, h)
        return np.concatenate([q, k, v, z], axis=1).reshape(-1, h)
    return x


class GGUFTensors:
    """Hub tensor name -> array, as SafetensorsReader serves them, read from the GGUF's memory-mapped files at the
    offsets gguf.json keeps: each name model.weight_specs (and, where the file holds the MTP layer,
    mtp.weight_specs) declares has a `recipe`: its GGUF name(s) by gguf's TensorNameMap (an expert stack: its
    fused name, one expert a slice of llama.cpp's [E, O, I] stack) and, for qwen3next, the inverse of the
    converter's change. GGUF lists dimensions fastest first; in numpy's order (GGUFReader's, kept in gguf.json) a
    matrix is the Hub's [out, in]: convert_hf_to_gguf transposes nothing (Qwen2MoeModel only stacks the experts)."""

    def __init__(self, folder: str | Path, check):
        import gguf
        from strata_jax.model.config import load_config
        from strata_jax.model.weights import hub_walk, weight_specs
        from strata_jax.speculative.mtp import weight_specs as mtp_specs
        self.folder, self.check = Path(folder), check
        source = json.loads((self.folder / SOURCE_FILE).read_text())
        self.path, self.tensors, self.arch = source["files"][0], source["tensors"], source["arch"]
        try:
            # plain ndarray views of the maps: gguf.quants slices a tensor in many row groups, and every slice of an
            # np.memmap pays its subclass's bookkeeping (a fifth of a load's time)
            self.maps = [np.memmap(f, mode="r").view(np.ndarray) for f in source["files"]]
        except OSError as e:
            raise StrataError(f"cannot read GGUF file {e.filename or source['files'][0]}: {e.strerror or e}") from None
        cfg = load_config(self.folder)
        mtp_block = source.get("mtp_block")
        blocks = cfg.num_layers + (source.get("mtp_declared", 0) if mtp_block is not None else 0)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[self.arch.upper()], blocks)
        walk = list(hub_walk(weight_specs(cfg)))
        if mtp_block is not None:
            walk += list(hub_walk(mtp_specs(cfg)))
        self.recipes: dict[str, Recipe] = {}
        for hub, leaf, j, _ in walk:
            try:
                self.recipes[hub] = recipe(hub, leaf, j, cfg, names, self.tensors, mtp_block)
            except StrataError as e:
                raise StrataError(f"{self.path}: {e}") from None
        read = {g for r in self.recipes.values() for g in r.names}
        unread = sorted(set(self.tensors) - read)
        if unread:  # a weight the declaration does not know (a dense MLP, a bias) would be dropped silently
            raise StrataError(f"{self.path}: GGUF tensor {unread[0]!r} is not part of a {self.arch} model as this "
                              f"engine reads it ({len(unread)} such tensor(s))")
        # What check_layer_count reads: the Hub names whose GGUF tensors are there.
        self.file_of = {hub: source["files"][self.tensors[r.names[0]][0]] for hub, r in self.recipes.items()
                        if all(g in self.tensors for g in r.names)}
        self._kept = (None, None)  # the last tensor a "rows" recipe read (q, k, v of one attn_qkv; gate, up)
        self.threads = load_threads()
        self._pool: ThreadPoolExecutor | None = None  # made on the first quantized tensor read
        self._ahead: dict[tuple[str, int], Future] = {}  # (stack, expert) -> its values, dequantized ahead
        self._stacks: list[str] = []  # the stacks read ahead lately (a layer's gate, up, down)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def read(self, gname: str, want: tuple, j: int | None, hub: str, keep: bool) -> np.ndarray:
        if gname not in self.tensors:
            raise StrataError(f"GGUF tensor {gname!r} (the Hub's {hub!r}) is missing from {self.path}")
        if keep and self._kept[0] == (gname, j):
            return self._kept[1]
        part, qtype, got, offset, size = self.tensors[gname]
        if tuple(got) != want:
            raise StrataError(f"GGUF tensor {gname!r} has shape {list(got)} (numpy order), expected {list(want)}")
        quantized = qtype not in EXACT_TYPES
        ahead = self._ahead.pop((gname, j), None)
        if quantized and j is not None and self.pool():
            self.read_ahead(gname, j, tuple(got))
        x = ahead.result() if ahead is not None else self.dequantized(gname, j, self.pool() if quantized else None)
        self._kept = ((gname, j), x) if keep else (None, None)
        return x

    def dequantized(self, gname: str, j: int | None, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
        """Tensor gname's values (expert j of a stack), checked (the loader's check: non-finite values)."""
        part, qtype, got, offset, size = self.tensors[gname]
        x = values(self.maps[part][offset:offset + size], qtype, tuple(got), j, pool)
        self.check(gname if j is None else f"{gname}[{j}]", x)
        return x

    def pool(self) -> ThreadPoolExecutor | None:
        """The dequantizing threads (None for one), shut down with the reader."""
        if self._pool is None and self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gguf-dequant")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def read_ahead(self, gname: str, j: int, shape: tuple[int, ...]) -> None:
        """The loader reads a layer's experts in order, expert by expert (checkpoint.load_weights' expert_stacks):
        queue the experts after j of stack gname, each one job (its values and check), at most 2 x threads ahead
        and READ_AHEAD_BYTES / 3 of float32 per stack (a layer reads three); what was queued for experts before j
        or for older stacks is dropped."""
        if gname not in self._stacks:
            self._stacks.append(gname)
            for old in self._stacks[:-3]:
                for key in [k for k in self._ahead if k[0] == old]:
                    self._ahead.pop(key).cancel()
            del self._stacks[:-3]
        for key in [k for k in self._ahead if k[0] == gname and k[1] < j]:
            self._ahead.pop(key).cancel()
        per = 4 * int(np.prod(shape[1:]))
        depth = max(1, min(2 * self.threads, READ_AHEAD_BYTES // (3 * per)))
        for i in range(j + 1, min(j + 1 + depth, shape[0])):
            if (gname, i) not in self._ahead:
                self._ahead[(gname, i)] = self._pool.submit(self.dequantized, gname, i)

    def kept_experts(self, hub: str, expert_format: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The expert stack that Hub tensor `hub` (an expert of it) is read from, kept in `expert_format` as read
        from its bytes where its type is one that format holds (strata_jax/model/quant.py GGUF_KEPT), not
        dequantized: int4-q4k (packed [E, O, I/2] uint8, codes [E, O, 5G/4] uint16; q4k_from_blocks), int2-q2k
        (packed [E, O, I/4] uint8, codes [E, O, 5G/4] uint8; q2k_from_blocks), int6-q6k / int6-q6km (packed
        [E, O, 3I/4], codes [E, O, 9G/8] / [E, O, 9G/4] uint8; q6k_from_blocks, q6km_from_blocks), the others
        (q, float32 scales [E, O, G] or [E, O, 2, G]; gguf_kept). None where the stack is of another type (the
        loader then reads values). Its fp16 d (and dmin, m) are checked (the loader's check: a non-finite one makes
        non-finite weights)."""
        from strata_jax.model import quant
        r = self.recipes.get(hub)
        if r is None or r.expert is None or r.op not in ("plain", "rows"):
            return None
        gname = r.names[0]
        if gname not in self.tensors:
            raise StrataError(f"GGUF tensor {gname!r} (the Hub's {hub!r}) is missing from {self.path}")
        part, qtype, got, offset, size = self.tensors[gname]
        if not quant.holds(expert_format, qtype):
            return None
        if tuple(got) != r.shapes[0]:
            raise StrataError(f"GGUF tensor {gname!r} has shape {list(got)} (numpy order), expected {list(r.shapes[0])}")
        raw = self.maps[part][offset:offset + size].reshape(got[0], got[1], -1)
        if r.op == "rows":  # --fuse-gate-up-exps: gate's or up's rows
            raw = raw[:, r.arg[0]:r.arg[1]]
        if expert_format in quant.BLOCK_FORMATS:  # packed q and codes (Q2_K's d and dmin: byte pairs)
            if expert_format == quant.Q6KM:
                q, codes = quant.q6km_from_blocks(raw, qtype)
            else:
                q, codes = {"Q4_K": quant.q4k_from_blocks, "Q2_K": quant.q2k_from_blocks,
                            "Q6_K": quant.q6k_from_blocks, "Q3_K": quant.q6k_from_q3k_blocks}[qtype](raw)
            self.check(gname, quant.codes_halves(codes, expert_format))  # fp16 d (and dmin)
            return q, codes
        q, scale = quant.gguf_kept(raw, qtype)
        if not quant.keeps(expert_format, qtype):  # a family of mixed types held in int8-g16m
            q, scale = quant.widen(q, scale)
        self.check(gname, scale)
        return q, scale

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.recipes:
            raise StrataError(f"checkpoint tensor {name!r} has no GGUF counterpart in {self.path}")
        r = self.recipes[name]
        xs = [self.read(g, want, r.expert, name, r.op == "rows") for g, want in zip(r.names, r.shapes)]
        x = undo(r, xs, tuple(shape), self.path)
        if tuple(x.shape) != tuple(shape):
            raise StrataError(f"GGUF tensor {r.names[0]!r} gives shape {list(x.shape)}, expected {list(shape)}")
        return x


def load_threads() -> int:
    """The dequantizing threads of a load: LOAD_THREADS, else the cores this process may use."""
    if LOAD_THREADS:
        return LOAD_THREADS
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def row_dequantizer(kind):
    """rows of bytes -> their float32 values: gguf.quants' dequantizer of type `kind` over all the rows given at
    once. gguf.quants.dequantize cuts a tensor into groups of 16 rows, each a few dozen numpy calls on small arrays
    that hold the GIL for most of their time, so threads would wait on each other; the class's dequantize_rows is
    the same arithmetic per block over the rows given, so the same values. gguf.quants.dequantize itself where
    gguf's internals are not as in 0.19."""
    import gguf
    cls = getattr(gguf.quants, "_type_traits", {}).get(kind)
    if cls is None or not all(hasattr(cls, f) for f in ("dequantize_rows", "init_grid")):
        return lambda rows: gguf.quants.dequantize(rows, kind)
    cls.init_grid()  # the IQ types' lookup tables (what dequantize does first)
    return cls.dequantize_rows


def values(raw: np.ndarray, qtype: str, shape: tuple[int, ...], index: int | None = None,
           pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """A tensor's values from its bytes (or expert `index` of a stack): F32 / F16 / BF16 as stored (a copy: no
    array the engine keeps points into the file), other types dequantized by gguf.quants to float32, in jobs of
    rows (about CHUNK_VALUES values each) written into the result: on `pool`'s threads with the caller taking the
    first, or one after the other. Every quantized type is made of blocks along a row, each dequantized alone, so
    the values are gguf.quants.dequantize's of the whole tensor, bit for bit, however the rows are cut."""
    import gguf
    import ml_dtypes
    exact = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    if qtype in exact:
        x = raw.view(exact[qtype]).reshape(shape)
        return np.array(x if index is None else x[index])
    kind = gguf.GGMLQuantizationType[qtype]
    x = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))
    x = x if index is None else x[index]
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), np.float32)
    step = max(1, CHUNK_VALUES // shape[-1])
    dequantize = row_dequantizer(kind)

    def job(a: int) -> None:
        out[a:a + step] = dequantize(rows[a:a + step])
    starts = range(0, rows.shape[0], step)
    if pool is None or len(starts) <= 1:
        for a in starts:
            job(a)
    else:
        jobs = [pool.submit(job, a) for a in starts[1:]]
        try:
            job(starts[0])
        finally:
            wait(jobs)  # none writes into `out` after this returns or raises
        for j in jobs:
            j.result()  # a job's error
    return out.reshape(*x.shape[:-1], shape[-1])
