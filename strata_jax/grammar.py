"""Constrained decoding: a request whose output must be JSON (any object, or one that follows a JSON schema).

llguidance (a well-kept grammar engine, the one llama.cpp and vLLM use) holds the parse state; each step it gives
the tokens that keep the output on the grammar as a bitmask over the vocabulary, the decode loop sets every other
token's logit to -1e30 before the request's own sampler draws (greedy: the argmax of what is left), and the chosen
token advances the state. The grammar ends the request: once the JSON is complete only the end-of-sequence tokens
are allowed (strata_jax/engine/loops.py decode_constrained).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.sampling import NON_FINITE


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:  # a package without its dependency
        raise StrataError(f"json_schema needs the llguidance package (pip install llguidance): {e}") from None
    return llguidance


_TOKENIZERS: dict = {}  # (id of the tokenizer, vocabulary size, eos ids) -> (the tokenizer, llguidance's view)


def _tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a tokenizer (its tokens' bytes): built once per tokenizer, vocabulary size and eos ids,
    not per request (a 151k-token tokenizer's JSON is megabytes)."""
    key = (id(tokenizer), vocab_size, eos_ids)
    if key not in _TOKENIZERS:  # the tokenizer is kept beside it, so its id stays its own
        ll = _llguidance()
        _TOKENIZERS[key] = (tokenizer, ll.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids)))
    return _TOKENIZERS[key][1]


# The JSON's layout: one space after a comma and a colon, no other whitespace between tokens. llguidance's default
# allows any run of whitespace there, and a model that likes a newline can spend its whole budget on them; a schema
# may say otherwise under its "x-guidance" key (llguidance's JSON options).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_for(schema) -> str:
    """The llguidance grammar of `schema`: True (JSON mode: any JSON object) or a JSON schema (a dict, or its JSON
    text). A schema it cannot compile is one StrataError line."""
    ll = _llguidance()
    if schema is True:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StrataError(f"json_schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise StrataError(f"json_schema must be True (any JSON object) or a JSON schema object, not "
                          f"{type(schema).__name__}")
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except Exception as e:  # noqa: BLE001 (llguidance's own error types)
        raise StrataError(f"json_schema: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    error = ll.LLMatcher.validate_grammar(grammar)  # an unknown type or an unsatisfiable schema shows here
    if error:
        raise StrataError(f"json_schema: {error.splitlines()[0]}")
    return grammar


def tool_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """The grammar of one call of `tools` (OpenAI's [{"type": "function", "function": {"name", "parameters"}}]) in
    the form Qwen3's chat templates teach: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, the
    arguments following the named function's parameters schema; `name`: only that function (tool_choice naming
    one), else any of them (tool_choice required). An unknown name is one StrataError line."""
    functions = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    names = [f.get("name") for f in functions]
    if name is not None and name not in names:
        raise StrataError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(map(str, names))})")
    calls = [{"type": "object", "properties": {"name": {"const": f.get("name")},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in functions if name is None or f.get("name") == name]
    if not calls:
        raise StrataError("tool_choice: no function among the tools")
    schema = {"x-guidance": JSON_STYLE, "anyOf": calls}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    grammar = _llguidance().grammar_from("lark", lark)
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise StrataError(f"tools: {error.splitlines()[0]}")
    return grammar


class JsonConstraint:
    """One request's parse state: `allowed()` the tokens that may come next ([V] bool), `advance(token)` after one
    is chosen, `done()` once the output is complete (only end-of-sequence tokens may follow), `finished` once one
    of those followed. `schema`: True or a JSON schema (grammar_for), or `grammar`: a grammar already made
    (tool_call_grammar, or llguidance's own grammar_from)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, schema=None, grammar: str | None = None):
        if tokenizer is None:
            raise StrataError("json_schema needs the model's tokenizer (this engine has none)")
        ll = _llguidance()
        eos = tuple(sorted(int(t) for t in eos_ids))
        if not eos:
            raise StrataError("json_schema needs an end-of-sequence token to end the output (the model has none)")
        self.vocab_size, self.eos = vocab_size, frozenset(eos)
        self.finished = False  # an end-of-sequence token taken after a complete output
        if grammar is None:
            grammar = grammar_for(schema)
        elif ll.LLMatcher.validate_grammar(grammar):
            raise StrataError(f"grammar: {ll.LLMatcher.validate_grammar(grammar).splitlines()[0]}")
        self.matcher = ll.LLMatcher(_tokenizer(tokenizer, vocab_size, eos), grammar)
        if self.matcher.is_error():
            raise StrataError(f"json_schema: {self.matcher.get_error()}")
        self._bitmask = ll.numpy.allocate_token_bitmask(1, vocab_size)
        self._fill = ll.numpy.fill_next_token_bitmask

    def allowed(self) -> np.ndarray:
        self._fill(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.vocab_size]
        return bits.astype(bool)

    def advance(self, token: int) -> None:
        complete = self.matcher.is_stopped()
        if not self.matcher.consume_token(int(token)) and not (complete and int(token) in self.eos):
            raise StrataError(f"json_schema: token {token} left the grammar ({self.matcher.get_error()})")
        self.finished = complete and int(token) in self.eos

    def done(self) -> bool:
        return self.matcher.is_stopped()


# A masked token's logit: far below any real one, so its probability is exactly 0 after the softmax (exp
# underflows) at any temperature, yet finite: the samplers take a non-finite logit for a broken model (NON_FINITE).
MASKED = -1e30


@jax.jit
def masked_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [..., V] (one row) -> [1, V] float32 with the tokens not allowed ([V] bool) at MASKED."""
    return jnp.where(allowed[None, :], logits.reshape(1, -1).astype(jnp.float32), MASKED)


@jax.jit
def masked_argmax(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """The greedy token among the allowed ones (int32 scalar); NON_FINITE where the row holds NaN or inf, as the
    window graphs' own greedy tokens say it."""
    row = logits.reshape(-1).astype(jnp.float32)
    token = jnp.argmax(masked_logits(row, allowed)[0]).astype(jnp.int32)
    return jnp.where(jnp.all(jnp.isfinite(row)), token, NON_FINITE)
