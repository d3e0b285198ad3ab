"""Tokenizers: a model folder's `tokenizer.json` through the `tokenizers` library, and the embedded byte-level one."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

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


class TextStream:
    """Token ids in, text out as soon as it is whole: a byte-level token can end inside a UTF-8 character, and a
    tokenizer may decode a token differently after its neighbours, so each new piece is the text of the tokens since
    the last cut, decoded with the piece before it as context, minus that context (as vLLM's incremental
    detokenizer). Cost per token: the tokens since the last cut, not the whole output."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # context starts here
        self._read = 0  # text up to here has been handed out

    def push(self, token: int) -> str:
        """Add one token; the text that became whole (maybe '')."""
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """The rest, whole or not (at the end of a request)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


_UNICODE_TO_BYTE = {ch: b for b, ch in bytes_to_unicode().items()}


def token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    """The bytes one token stands for (OpenAI's logprobs `bytes`): a byte-level BPE token's characters mapped back
    through GPT-2's table; other tokenizers: the UTF-8 of its decoded text."""
    piece = tokenizer.id_to_token(int(token))
    if piece is not None and isinstance(tokenizer.decoder, decoders.ByteLevel) and all(
            ch in _UNICODE_TO_BYTE for ch in piece):
        return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
    return tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")
