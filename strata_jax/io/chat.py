"""Chat: a model folder's chat template rendered the way transformers' `apply_chat_template` renders it, and its
`generation_config.json` (end-of-turn ids, sampling defaults).

The template is `chat_template` in `tokenizer_config.json` (a string, or a list of named templates: "default"), or
the file `chat_template.jinja`. Rendering follows transformers (utils/chat_template_utils.py): a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter that keeps non-ASCII
text, `raise_exception` and `strftime_now`, and the tokenizer's special tokens (bos_token, eos_token, ...) as
variables. The text is then tokenized without adding special tokens (the template writes them)."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata_jax.errors import StrataError

# The chat template of the committed reference model and the embedded tiny one (byte-level models of Python code):
# the system's and user's turns as comment lines, the assistant's as a function: the generation prompt is "def ".
CODE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{ 'def ' + message['content'] + eos_token }}\n"
    "{%- else -%}\n"
    "{{ '# ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{ 'def ' }}\n"
    "{%- endif -%}\n"
)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja text
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    where: str = "chat template"

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation as the model's prompt text; one StrataError line for bad messages or a template
        error (including the template's own raise_exception)."""
        check_messages(messages)
        try:
            template = _environment().from_string(self.source)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise StrataError(f"{self.where}: {e}".replace("\n", " ")) from None
        except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                RecursionError) as e:  # the template's own code failed on these messages
            raise StrataError(f"{self.where}: the template failed while rendering: {type(e).__name__}: {e}"
                              .replace("\n", " ")) from None


def check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise StrataError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise StrataError(f"messages[{i}] must be a dict with a string 'role' and a string 'content'")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StrataError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path}: a JSON object is expected, not a {type(data).__name__}")
    return data


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    source, where = config.get("chat_template"), str(config_path)
    if isinstance(source, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_path = folder / "chat_template.jinja"
    if source is None and jinja_path.is_file():
        source, where = jinja_path.read_text(), str(jinja_path)
    if source is None:
        return None
    if not isinstance(source, str):
        raise StrataError(f"{where}: chat_template must be a string or a list of named templates")
    special = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    try:
        _environment().from_string(source)  # a syntax error is found at load, not at the first request
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise StrataError(f"{where}: the chat template does not parse: {e}".replace("\n", " ")) from None
    return ChatTemplate(source=source, special_tokens=special, where=where)


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: the ids that end a turn, and the sampling defaults a request starts from."""
    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def request_defaults(self) -> dict:
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def load_generation_config(folder: str | Path) -> GenerationDefaults:
    """transformers' semantics: do_sample false (the default) means greedy whatever temperature says."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    raw = _read_json(path)
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
        raise StrataError(f"{path}: eos_token_id must be a token id or a list of them, not {eos!r}")
    sample = bool(raw.get("do_sample", False))
    try:
        temperature = float(raw.get("temperature", 1.0)) if sample else 0.0
        top_p = float(1.0 if raw.get("top_p") is None else raw["top_p"]) if sample else 1.0
        top_k = int(raw.get("top_k", 0) or 0) if sample else 0
    except (TypeError, ValueError) as e:
        raise StrataError(f"{path}: malformed sampling value: {e}") from None
    if not (0.0 <= top_p <= 1.0) or temperature < 0 or top_k < 0 or temperature != temperature:
        raise StrataError(f"{path}: sampling values out of range (temperature {temperature} >= 0, top_p {top_p} "
                          f"in 0..1, top_k {top_k} >= 0)")
    if top_p == 0.0:  # transformers keeps at least one token: top_p 0 is the most likely token, greedy
        temperature, top_p, top_k = 0.0, 1.0, 0
    return GenerationDefaults(eos_token_ids=tuple(eos_ids), temperature=temperature, top_p=top_p, top_k=top_k)


# ---- tool calls ----------------------------------------------------------------------------------------------------
# Qwen3 (and Hermes-style templates) write a call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
# in the assistant's text; the server hands them back as OpenAI's `tool_calls`.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside the calls, [{"name", "arguments" (a JSON string)}]) of an assistant's reply. A block that
    is not a JSON object with a string "name", or one left open (the reply was cut), stays text."""
    calls, content, rest = [], [], text
    while (start := rest.find(TOOL_CALL_OPEN)) >= 0:
        end = rest.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            break
        body = rest[start + len(TOOL_CALL_OPEN):end].strip()
        after = end + len(TOOL_CALL_CLOSE)
        try:
            call = json.loads(body)
            ok = isinstance(call, dict) and isinstance(call.get("name"), str)
        except ValueError:
            ok = False
        if not ok:
            content.append(rest[:after])
        else:
            args = call.get("arguments", {})
            content.append(rest[:start])
            calls.append({"name": call["name"],
                          "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
        rest = rest[after:]
    content.append(rest)
    return "".join(content), calls


class ToolCallHold:
    """A stream's text with tool calls held back: `add(piece)` returns what may go out as content now (everything
    before a `<tool_call>`, never the start of one), `rest()` what was held."""

    def __init__(self):
        self.text, self.sent, self.held = "", 0, False

    def add(self, piece: str) -> str:
        self.text += piece
        if self.held:
            return ""
        at = self.text.find(TOOL_CALL_OPEN, max(0, self.sent - len(TOOL_CALL_OPEN)))
        if at >= 0:
            self.held = True
            end = at
        else:  # keep back a tail that may be the start of one
            keep = next((n for n in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text)), 0, -1)
                         if TOOL_CALL_OPEN.startswith(self.text[-n:])), 0)
            end = max(self.sent, len(self.text) - keep)
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
