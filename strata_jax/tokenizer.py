"""Tokenizers: a model folder's `tokenizer.json` through the `tokenizers` library, and the embedded byte-level one."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from strata_jax.errors import StrataError

EOS_TOKEN = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer() -> Tokenizer:
    """Token id = byte value (0..255), then <|endoftext|> = 256: every text encodes, nothing is unknown."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOS_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return tok


def load_tokenizer(folder: str | Path) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise StrataError(f"no tokenizer.json in {folder} (text prompts need one; the API also takes token ids)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise StrataError(f"{path}: cannot load tokenizer: {e}") from None
