"""`--model=file.gguf`: a llama.cpp GGUF file (or the parts `name-00001-of-0000N.gguf` of a split one) of a
Qwen3-MoE model (arch `qwen3moe`), read through gguf's `GGUFReader` (memory-mapped).

resolve_model turns the file into a model folder under the cache (`gguf_model_folder`): config.json,
tokenizer.json, tokenizer_config.json (chat template, special tokens) and generation_config.json made from the
GGUF's metadata, and gguf.json naming the file(s), the tensor types per family and where each tensor lies (the
metadata is parsed once: Qwen's 151k tokens and merges take GGUFReader seconds). From there the engine loads it
as any folder: checkpoint.open_reader gives `GGUFTensors`, which maps the files and serves the Hub tensor names that
model.weight_specs declares, each mapped to llama.cpp's name by gguf's own TensorNameMap (the table
convert_hf_to_gguf writes with), so no second list of names or shapes lives here.

Tensors: F32, F16 and BF16 are read as they are; every type `gguf.quants.dequantize` reads (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, the K types Q2_K..Q6_K, the IQ types, ...) is dequantized to float32 at load and cast to the engine's
dtype (keeping them packed on the device is a later step). Other architectures (qwen3next included: llama.cpp's
converter regroups its DeltaNet projections and rewrites A_log and the norms), other tokenizers and other tensor
types are refused with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from strata_jax.errors import StrataError, make_writable_folder

# gguf (its import takes ~0.2 s) is imported where a GGUF is read, so the engine's import does not pay for it.

ARCH = "qwen3moe"  # the one GGUF architecture read here
FOLDER_VERSION = 1  # of what gguf_model_folder writes: a change makes new folders
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
        if self.arch != ARCH:
            why = (" (llama.cpp's converter regroups its DeltaNet projections and rewrites A_log and the norms: "
                   "load the Hugging Face safetensors checkpoint instead)" if self.arch == "qwen3next" else "")
            raise StrataError(f"{self.path}: GGUF architecture {self.arch!r} is not supported (supported: "
                              f"{ARCH!r}){why}")

    def value(self, key: str, default=None, required: bool = False):
        field = self.fields.get(key)
        if field is None:
            if required:
                raise StrataError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch_value(self, key: str, default=None, required: bool = True):
        return self.value(f"{self.arch}.{key}", default, required and default is None)


def decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not 9.99999997e-07): the
    number config.json held before the converter stored it."""
    return float(str(np.float32(x)))


def raw_config(files: GGUFFiles) -> dict:
    """The GGUF's hyperparameters as a Hugging Face config.json of Qwen3MoeForCausalLM (config_from_dict reads it).
    llama.cpp's qwen3moe makes every layer MoE and always renormalises the top-K weights."""
    a = files.arch_value
    scaling = a("rope.scaling.type", "none", required=False)
    if scaling not in ("none", None):
        raise StrataError(f"{files.path}: rope scaling {scaling!r} (rope.scaling.type) is not supported (only the "
                          "default RoPE)")
    head_dim = a("attention.key_length", a("embedding_length") // a("attention.head_count"))
    if a("attention.value_length", head_dim) != head_dim:
        raise StrataError(f"{files.path}: attention.value_length {a('attention.value_length')} differs from "
                          f"key_length {head_dim}: not a Qwen3-MoE shape")
    if a("rope.dimension_count", head_dim) != head_dim:
        raise StrataError(f"{files.path}: rope.dimension_count {a('rope.dimension_count')} is not the head "
                          f"dimension {head_dim}: partial RoPE is not a Qwen3-MoE shape")
    blocks = {int(m.group(1)) for name in files.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if blocks != set(range(a("block_count"))):  # before anything is sized from block_count
        raise StrataError(f"{files.path}: block_count is {a('block_count')}, but the GGUF holds tensors of "
                          f"{len(blocks)} blocks" + (f" (blk.{min(blocks)}..blk.{max(blocks)})" if blocks else ""))
    embed = files.tensors.get("token_embd.weight")
    if embed is None:
        raise StrataError(f"{files.path}: GGUF tensor 'token_embd.weight' is missing")
    tokens = files.value("tokenizer.ggml.tokens")
    vocab = a("vocab_size", len(tokens) if tokens else int(embed[0].shape[1]))
    eos = files.value("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_hidden_layers": a("block_count"), "hidden_size": a("embedding_length"),
        "num_attention_heads": a("attention.head_count"),
        "num_key_value_heads": a("attention.head_count_kv", a("attention.head_count")), "head_dim": head_dim,
        "num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
        "moe_intermediate_size": a("expert_feed_forward_length"),
        "intermediate_size": a("feed_forward_length", 0), "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": bool(a("expert_weights_norm", True)),
        "rms_norm_eps": decimal(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": decimal(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": a("context_length"), "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in files.tensors,  # llama.cpp then reads token_embd
        "eos_token_id": eos, "hidden_act": "silu",
    }


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
    <|im_end|> / <|endoftext|> control tokens, as Qwen3's own generation_config lists both); greedy."""
    ids = [files.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = files.value("tokenizer.ggml.tokens") or []
    types = files.value("tokenizer.ggml.token_type") or []
    ids += [i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_CONTROL and tok in END_TOKENS]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return {"eos_token_id": ids, "do_sample": False}


# ---- tensor types per family --------------------------------------------------------------------------------------

def family_of(name: str) -> str:
    """A llama.cpp tensor's family for the start-up line."""
    if "_exps." in name:
        return "experts"
    if ".ffn_gate_inp." in name:
        return "router"
    if name.startswith(("token_embd.", "output.")):
        return "embeddings"
    if name.endswith("_norm.weight"):
        return "norms"
    if ".attn_" in name:
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


def type_table(files: GGUFFiles) -> dict:
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
        n, b = table.setdefault(family_of(name), {}).setdefault(qtype.name, [0, 0])
        table[family_of(name)][qtype.name] = [n + int(t.n_elements), b + int(t.n_bytes)]
    return table


def tensor_table(files: GGUFFiles) -> dict:
    """{name: [part, type, numpy shape, data offset, bytes]}, what GGUFReader found: the loads map the tensors from
    it, since a parse of the metadata (Qwen's 151k tokens and merges) takes seconds."""
    from gguf import GGMLQuantizationType
    return {name: [files.parts.index(part), GGMLQuantizationType(t.tensor_type).name,
                   [int(d) for d in reversed(t.shape.tolist())], int(t.data_offset), int(t.n_bytes)]
            for name, (t, part) in files.tensors.items()}


def formats_line(source: dict, dtype: str, expert_format: str | None) -> str:
    """One line: per family the GGUF types read (bits per weight) and what the engine holds."""
    short = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
    held = short.get(dtype, dtype)
    parts = []
    for family in ("attention", "dense", "router", "experts", "embeddings", "norms"):
        types = source["types"].get(family)
        if not types:
            continue
        weights = sum(n for n, _ in types.values())
        bpw = 8 * sum(b for _, b in types.values()) / weights
        quantized = any(t not in EXACT_TYPES for t in types)
        if family == "experts" and expert_format:
            to = f"{expert_format} (requantized at load from the {'dequantized' if quantized else 'read'} values)"
        else:
            to = held + (" (dequantized at load)" if quantized else "")
        parts.append(f"{family} {'+'.join(sorted(types))} ({bpw:.2f} bpw) -> {to}")
    n = len(source["files"])
    return (f"gguf: {source['files'][0]} ({source['arch']}, {n} file{'s' if n > 1 else ''}): {', '.join(parts)}; "
            "packed formats on the device: not yet")


def say_formats(folder: Path, dtype: str, expert_format: str | None, say) -> None:
    """The start-up line of a GGUF's model folder (nothing for any other folder)."""
    path = Path(folder) / SOURCE_FILE
    if path.is_file():
        say(formats_line(json.loads(path.read_text()), dtype, expert_format))


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
    raw = raw_config(files)
    config_from_dict(raw, where=str(files.path))  # a bad shape is refused here, naming the GGUF
    source = {"files": [str(p) for p in files.parts], "arch": files.arch, "types": type_table(files),
              "tensors": tensor_table(files)}
    tok = tokenizer_json(files)
    make_writable_folder(folder.parent, f"cache_dir {cache_dir}: not a writable folder for the GGUF's model folder")
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(raw, indent=1))
    if tok is not None:
        (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(files), indent=1, ensure_ascii=False))
    (tmp / "generation_config.json").write_text(json.dumps(generation_config(files)))
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


class GGUFTensors:
    """Hub tensor name -> array, as SafetensorsReader serves them, read from the GGUF's memory-mapped files at the
    offsets gguf.json keeps: each name model.weight_specs declares is mapped through gguf's TensorNameMap (an expert
    stack: its fused name, one expert a slice of llama.cpp's [E, O, I] stack). GGUF lists dimensions fastest first;
    in numpy's order (GGUFReader's, kept in gguf.json) a matrix is the Hub's [out, in]: convert_hf_to_gguf permutes
    nothing for qwen3moe (Qwen2MoeModel only stacks the experts)."""

    def __init__(self, folder: str | Path, check):
        import gguf
        from strata_jax.model.config import load_config
        from strata_jax.model.weights import hub_walk, weight_specs
        self.folder, self.check = Path(folder), check
        source = json.loads((self.folder / SOURCE_FILE).read_text())
        self.path, self.tensors = source["files"][0], source["tensors"]
        try:
            # plain ndarray views of the maps: gguf.quants slices a tensor in many row groups, and every slice of an
            # np.memmap pays its subclass's bookkeeping (a fifth of a load's time)
            self.maps = [np.memmap(f, mode="r").view(np.ndarray) for f in source["files"]]
        except OSError as e:
            raise StrataError(f"cannot read GGUF file {e.filename or source['files'][0]}: {e.strerror or e}") from None
        cfg = load_config(self.folder)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg.num_layers)
        self.gguf_of: dict[str, tuple[str, int | None, tuple]] = {}  # Hub name -> (GGUF name, expert, GGUF shape)
        for hub, leaf, j, _ in hub_walk(weight_specs(cfg)):
            fused = EXPERT_NAME.sub(".experts.", leaf.hf)  # the converter's name for the stacked experts
            mapped = names.get_name(fused, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise StrataError(f"{self.path}: no GGUF name for the Hub tensor {fused!r}")
            shape = leaf.shape if leaf.expert else leaf.hf_shape
            self.gguf_of[hub] = (mapped, j, tuple(shape))
        read = {g for g, _, _ in self.gguf_of.values()}
        unread = sorted(set(self.tensors) - read)
        if unread:  # a weight the declaration does not know (a shared expert, a bias) would be dropped silently
            raise StrataError(f"{self.path}: GGUF tensor {unread[0]!r} is not part of a {ARCH} model as this "
                              f"engine reads it ({len(unread)} such tensor(s))")
        # What check_layer_count reads: the Hub names whose GGUF tensor is there.
        self.file_of = {hub: source["files"][self.tensors[g][0]] for hub, (g, _, _) in self.gguf_of.items()
                        if g in self.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.gguf_of:
            raise StrataError(f"checkpoint tensor {name!r} has no GGUF counterpart in {self.path}")
        gname, j, want = self.gguf_of[name]
        if gname not in self.tensors:
            raise StrataError(f"GGUF tensor {gname!r} (the Hub's {name!r}) is missing from {self.path}")
        part, qtype, got, offset, size = self.tensors[gname]
        if tuple(got) != want:
            raise StrataError(f"GGUF tensor {gname!r} has shape {list(got)} (numpy order), expected {list(want)}")
        x = values(self.maps[part][offset:offset + size], qtype, tuple(got), j)
        if tuple(x.shape) != tuple(shape):
            raise StrataError(f"GGUF tensor {gname!r} gives shape {list(x.shape)}, expected {list(shape)}")
        self.check(name if j is None else f"{gname}[{j}]", x)
        return x


def values(raw: np.ndarray, qtype: str, shape: tuple[int, ...], index: int | None = None) -> np.ndarray:
    """A tensor's values from its bytes (or expert `index` of a stack): F32 / F16 / BF16 as stored (a copy: no
    array the engine keeps points into the file), other types dequantized by gguf.quants to float32."""
    import gguf
    import ml_dtypes
    exact = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    if qtype in exact:
        x = raw.view(exact[qtype]).reshape(shape)
        return np.array(x if index is None else x[index])
    kind = gguf.GGMLQuantizationType[qtype]
    x = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))
    return gguf.quants.dequantize(x if index is None else x[index], kind)
