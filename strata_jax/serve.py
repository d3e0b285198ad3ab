"""An OpenAI-compatible server over one engine:

    python -m strata_jax.serve --model=... --host=127.0.0.1 --port=8000    (engine options as flags)

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true`: server-sent events in OpenAI's
chunk format), GET /health, GET /metrics (the engine's counters, Prometheus text), GET / (a chat page).

One engine. With --max_batch=1 (the default) one request at a time: requests queue (the `x-strata-queue-position`
header says how many were ahead, and the log says so). With --max_batch=N > 1, continuous batching: up to N
sequences decode together, one batched T=1 window for all (loops.BatchDecoder); a request joins the running batch
between two windows (its prompt prefilled alone, a chunk between two windows) and leaves at its stop, each with its own sampling, seed,
stop strings, stop tokens and max_tokens, its tokens those of the same request alone through generate(spec=0);
`n` > 1 choices run as n sequences of the batch, choice i with seed + i. Requests with a grammar (a JSON
response_format, tool_choice required or named) run alone through generate between the batch's windows; an engine
that cannot batch (several devices, Qwen3-Next, layer_loop=unrolled, offload without the native offload calls or
with the deferral) is loaded with max_batch=1 (the start-up line says so); offloaded engines batch too, a window's
rows sharing its fetches and pool job.

A request that starts with the previous one's tokens (a chat's next turn) prefills only the
new part: `usage.prompt_tokens_details.cached_tokens` counts the rest. A bad request gets a 4xx with OpenAI's error
object and the server stays up; a client that disconnects mid-stream stops its generation at the next token.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt
from sse_starlette.sse import EventSourceResponse

from strata_jax import grammar
from strata_jax.io.chat import ToolCallHold, parse_tool_calls
from strata_jax.engine.api import Engine, StopRequest
from strata_jax.errors import StrataError
from strata_jax.io.tokenizer import TextStream, token_bytes

PAGE = Path(__file__).resolve().parent / "chat_page.html"
STATIC = Path(__file__).resolve().parent / "static"  # the page's vendored scripts (static/README.md)


# ---- requests ------------------------------------------------------------------------------------------------------

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, metadata, ...)
    model: str | None = None
    # Integers strict: "7", 7.0 and true are not token counts, seeds or ids (pydantic's lax mode converts them).
    max_tokens: StrictInt | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)  # an extension (vLLM has it too)
    seed: StrictInt | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = Field(1, ge=1, le=16)  # choices: choice i draws with seed + i (Server.choices)
    ignore_eos: StrictBool = False  # an extension: run to max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)  # the k most likely tokens at each step, and the chosen


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None  # None: an assistant turn that only called tools
    tool_calls: list[dict] | None = None  # an assistant turn's calls, as this server returned them
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise StrataError(f"a {self.role} message needs its content")
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise StrataError("only text content parts are supported")
        return "".join(parts)


def _json_schema(response_format: dict | None):
    """What generate(json_schema=) takes for an OpenAI response_format: True for json_object, the schema of a
    json_schema one; None for text, an unknown type or a json_schema without a schema object."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "json_object":
        return True
    spec = response_format.get("json_schema")
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return spec["schema"]
    return None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # Not served yet: named here so that a request using them is refused (400), not answered as if they were absent.
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None  # text, json_object (JSON mode) or json_schema: constrained decoding
    _grammar: str | None = PrivateAttr(default=None)  # a forced tool call's grammar (chat() makes it)

    def json_schema(self):
        return _json_schema(self.response_format)

    def forced_call(self) -> tuple[bool, str | None]:
        """(whether tool_choice forces a call, the function it names or None): required, or
        {"type": "function", "function": {"name": ...}}; served by constrained decoding (grammar.tool_call_grammar)."""
        choice = self.tool_choice
        if choice == "required":
            return True, None
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
                (choice.get("function") or {}).get("name"), str):
            return True, choice["function"]["name"]
        return False, None

    def unserved(self) -> str | None:
        """The first field this server cannot honour, or None. Tools are served with tool_choice auto or none: a
        required or named call would need constrained decoding."""
        if self.functions or self.function_call not in (None, "none"):
            return "functions"
        forced = self.forced_call()[0]
        if (self.tool_choice not in (None, "auto", "none") and not forced) or (
                self.tool_choice not in (None, "none") and not self.tools) or (forced and self.json_schema() is not None):
            return "tool_choice"
        if self.response_format is not None and self.json_schema() is None and (
                self.response_format.get("type", "text") != "text"):
            return "response_format"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs"
        return None


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": code}})


# ---- one request ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    text: str = ""
    tokens: int = 0
    finish_reason: str = "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tool_calls: list | None = None  # OpenAI's tool_calls, parsed from the text (requests with tools)
    ids: list = dataclasses.field(default_factory=list)  # the generated tokens behind the text
    logprobs: Any = None  # (token_logprobs [N], top ids [N, K], top logprobs [N, K]) when asked


class StopStrings:
    """Text as it arrives, cut before the first stop string; text that may still become one is held back."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything received
        self.sent = 0  # characters handed out
        self.hit = False

    def add(self, piece: str) -> str:
        """The text that is safe to hand out now."""
        self.text += piece
        for s in self.stops:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text, self.hit = self.text[:at], True
        end = len(self.text) if self.hit else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def token_logprobs(engine: Engine, prompt: list[int], generated: list[int], k: int):
    """The model's log-probabilities of the generated tokens (log-softmax of the logits, before temperature and
    top-k / top-p, as vLLM and OpenAI report them) and the k most likely at each step: one teacher-forced pass over
    prompt + generated (Engine.prefill_logits; it drops the KV rows kept for prefix reuse).
    Returns (chosen [N], top ids [N, k], top logprobs [N, k])."""
    logits = engine.prefill_logits(list(prompt) + list(generated))[len(prompt) - 1:len(prompt) - 1 + len(generated)]
    logits = logits.astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    chosen = lp[np.arange(len(generated)), np.asarray(generated)]
    top = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return chosen, top, np.take_along_axis(lp, top, -1)


class Reply:
    """One choice's text as its tokens come: the stop strings, the end-of-turn token dropped, each safe piece to
    emit; `on_token` raises StopRequest at a stop string or once the client is gone."""

    def __init__(self, server: "Server", ids: list[int], kw: dict, stops: list[str], emit=None,
                 cancelled: threading.Event | None = None, drop_eos: bool = False):
        self.server, self.kw, self.emit, self.cancelled, self.drop_eos = server, kw, emit, cancelled, drop_eos
        self.text, self.stop = TextStream(server.engine.decode), StopStrings(stops)
        self.eos = server.engine.end_of_turn_ids
        self.outcome = Outcome(prompt_tokens=len(ids))

    def _emit(self, piece: str) -> None:
        if piece and self.emit:
            try:
                self.emit(piece)
            except Exception:  # noqa: BLE001 (the client's loop is gone: the request ends)
                raise StopRequest from None

    def on_token(self, token: int) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise StopRequest
        self.outcome.tokens += 1
        if self.drop_eos and token in self.eos and not self.kw.get("ignore_eos"):
            return
        self.outcome.ids.append(int(token))
        self._emit(self.stop.add(self.text.push(token)))
        if self.stop.hit:
            raise StopRequest

    def finish(self, out: list[int], cached_tokens: int) -> Outcome:
        """The outcome once the request has ended (`out`: the tokens it made); counted in the server's history."""
        stop, outcome = self.stop, self.outcome
        if not stop.hit:
            self._emit_last(stop.add(self.text.flush()) + stop.rest())
        outcome.text = stop.text
        outcome.cached_tokens = cached_tokens
        stopped_by_eos = bool(out) and out[-1] in self.eos and not self.kw.get("ignore_eos")
        outcome.finish_reason = "stop" if stop.hit or stopped_by_eos else "length"
        self.server.record(outcome, self.kw["max_new_tokens"],
                           self.cancelled is not None and self.cancelled.is_set())
        return outcome

    def _emit_last(self, piece: str) -> None:
        try:
            self._emit(piece)
        except StopRequest:
            pass


@dataclasses.dataclass
class Job:
    """A request for the batch worker: its reply, what it needs to run, and its result once done."""
    ids: list[int]
    kw: dict
    reply: Reply
    top_logprobs: int | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Any = None  # an Outcome, or the exception that ended it
    request: Any = None  # its loops.Request, once admitted

    @property
    def alone(self) -> bool:
        """Whether it runs through generate alone (between the batch's windows): a grammar (json_schema,
        tool_choice required / named) needs T=1 masked windows one at a time."""
        return "json_schema" in self.kw or "grammar" in self.kw

    def end(self, result) -> None:
        self.result = result
        self.done.set()


class Batcher:
    """Continuous batching (--max_batch > 1): one worker thread owns the engine and its BatchSession. Between two
    windows it takes the next request: a batchable one is prefilled into a free KV slot and joins the running batch
    (one newcomer at a time, one prefill chunk of it a window, so running streams keep flowing), one that needs the
    engine alone (a grammar) runs through generate there, whole, while the batch waits (never during an admission,
    whose rows the engine's cache holds); then one window of every live request. A request leaves
    the batch at its stop (a stop token, a stop string, max_tokens, a client gone) and its slot takes the next."""

    def __init__(self, server: "Server"):
        self.server, self.engine = server, server.engine
        self.session = self.engine.batch_session()
        self.cond = threading.Condition()
        self.pending: list[Job] = []
        self.running: dict[int, Job] = {}  # id(its loops.Request) -> the job
        self.finishing: list[Job] = []  # left the batch, their logprobs pass waiting for the engine's cache
        self.closed = False
        self.thread = threading.Thread(target=self.loop, name="strata-batch", daemon=True)
        self.thread.start()

    def run(self, job: Job) -> Outcome:
        """Queue the job and wait for its outcome (in the caller's thread)."""
        with self.cond:
            self.pending.append(job)
            self.cond.notify()
        job.done.wait()
        if isinstance(job.result, BaseException):
            raise job.result
        return job.result

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker once nothing is queued or running (a server shut down in-process: benchmarks, tests)."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout)

    def loop(self) -> None:
        while True:
            try:
                if not self.turn():
                    return
            except BaseException as e:  # noqa: BLE001 (a bug here: the requests in the batch end, the worker goes on)
                self.server.log(f"batch worker: {type(e).__name__}: {e}".splitlines()[0])
                jobs, self.running, self.finishing = list(self.running.values()) + self.finishing, {}, []
                for job in jobs:
                    job.end(e)
                try:
                    self.session = self.engine.batch_session()
                except BaseException as again:  # noqa: BLE001
                    self.server.log(f"batch worker stopped: {again}")
                    with self.cond:
                        for job in self.pending:
                            job.end(again)
                        self.pending = []
                    return

    def turn(self) -> bool:
        """Between two windows: the next request in, a prefill chunk, one window, the outcomes of those that left.
        False once closed with nothing left to do."""
        with self.cond:
            while not self.pending and not self.session.active and self.session.admitting is None:
                if self.closed:
                    return False
                self.cond.wait()
            job = None
            if self.session.admitting is None and self.pending and (self.pending[0].alone or self.session.free):
                job = self.pending.pop(0)
        if job is not None and job.alone:
            self.alone(job)
        elif job is not None:
            self.begin(job)
        if self.session.admitting is not None:
            self.advance()  # one prefill chunk of the newcomer, then a window of the others
        if self.session.active:
            self.step()
        if self.session.admitting is None:  # the engine's cache is free again: the logprobs passes
            finishing, self.finishing = self.finishing, []
            for job in finishing:
                self.complete(job)
        return True

    def alone(self, job: Job) -> None:
        try:
            job.end(self.server.run_alone(job.ids, job.kw, job.reply, job.top_logprobs))
        except BaseException as e:  # noqa: BLE001 (handed to the request's thread)
            job.end(e)

    def begin(self, job: Job) -> None:
        try:
            job.request = self.session.request(job.ids, on_token=job.reply.on_token, **job.kw)
            self.running[id(job.request)] = job
            if not self.session.begin(job.request):
                self.left(self.running.pop(id(job.request)))
        except BaseException as e:  # noqa: BLE001
            self.running.pop(id(job.request), None)
            job.end(e)
            self.recover()

    def advance(self) -> None:
        request = self.session.admitting
        try:
            live = self.session.advance()
        except BaseException as e:  # noqa: BLE001
            job = self.running.pop(id(request), None)
            if job is not None:
                job.end(e)
            self.recover()
            return
        if live is False:
            self.left(self.running.pop(id(request)))

    def step(self) -> None:
        try:
            left = self.session.step()
        except BaseException as e:  # noqa: BLE001 (every live request ends with it)
            jobs, self.running = list(self.running.values()), {}
            for job in jobs:
                job.end(e)
            self.recover()
            return
        for r in left:
            self.left(self.running.pop(id(r)))

    def left(self, job: Job) -> None:
        """A request that left the batch: its outcome now, or (a logprobs pass, which writes the engine's cache)
        once no admission holds the engine's cache."""
        if job.top_logprobs is not None and self.session.admitting is not None:
            self.finishing.append(job)
        else:
            self.complete(job)

    def recover(self) -> None:
        """A broken session (a failed window, or caches reset by a failed request): a fresh one."""
        if self.session.broken is not None or self.engine._resets != self.session.resets:
            for job in self.running.values():
                job.end(StrataError("the batch failed: the request ended"))
            self.running = {}
            self.session = self.engine.batch_session()

    def complete(self, job: Job) -> None:
        try:
            r = job.request
            if job.top_logprobs is not None and job.reply.outcome.ids:
                job.reply.outcome.logprobs = token_logprobs(self.engine, job.ids, job.reply.outcome.ids,
                                                            job.top_logprobs)
            job.end(job.reply.finish(r.out, r.stats.cached_tokens))
        except BaseException as e:  # noqa: BLE001
            job.end(e)


class Server:
    """The engine, its queue and its counters; with max_batch > 1 the Batcher."""

    def __init__(self, engine: Engine, model_name: str, log=print):
        self.engine, self.model_name, self.log = engine, model_name, log
        self.created = int(time.time())
        self._count = threading.Lock()
        self.waiting = 0  # requests admitted and not finished
        self.served = 0
        self.history: list[dict] = []  # the last requests: tokens, finish reason, disconnected (tests, metrics)
        self.batch_size = engine.options.max_batch if engine.options.max_batch > 1 and \
            engine._batch_refusal() is None else 1
        self.batcher = Batcher(self) if self.batch_size > 1 else None

    def close(self, timeout: float | None = None) -> None:
        """Stop the batch worker (its thread ends once the running requests have); the engine stays."""
        if self.batcher is not None:
            self.batcher.close(timeout)

    def batching_line(self) -> str:
        """The start-up line: how concurrent requests run."""
        if self.batcher is None:
            why = (f"max_batch={self.engine.options.max_batch}" if self.engine.options.max_batch <= 1
                   else self.engine._batch_refusal())
            return f"batching: off ({why}): one request at a time, the others queue (--max_batch > 1 batches them)"
        reuse = (f", and each freed KV slot keeps its last request's rows for the next prompt that starts with them "
                 f"(an LRU of {self.batch_size} prefixes)" if self.engine.options.prefix_reuse else "")
        return (f"batching: up to {self.batch_size} sequences a window (continuous: requests join and leave between "
                "windows, n > 1 choices as sequences of one batch, no drafts); requests with a grammar (json "
                f"response_format, tool_choice required / named) run alone between the batch's windows{reuse}")

    def admit(self) -> int:
        with self._count:
            ahead = self.waiting
            self.waiting += 1
        if ahead >= self.batch_size:
            self.log(f"request queued behind {ahead} (" + ("one engine: requests run one at a time)"
                                                          if self.batch_size == 1 else
                                                          f"max_batch={self.batch_size} sequences at once)"))
        return ahead

    def release(self) -> None:
        with self._count:
            self.waiting -= 1

    def record(self, outcome: Outcome, max_tokens: int, disconnected: bool) -> None:
        with self._count:
            self.served += 1
            self.history = (self.history + [dict(tokens=outcome.tokens, max_tokens=max_tokens,
                                                 finish_reason=outcome.finish_reason, disconnected=disconnected,
                                                 cached_tokens=outcome.cached_tokens)])[-100:]

    def sampling(self, req: _Sampling, prompt_tokens: int) -> dict:
        eng = self.engine
        budget = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            budget = req.max_completion_tokens
        if budget is None:  # OpenAI: 16 for completions; a chat runs to the end of the context
            budget = 16 if isinstance(req, CompletionRequest) else eng.context - prompt_tokens
        kw: dict[str, Any] = dict(max_new_tokens=budget, ignore_eos=req.ignore_eos)
        if isinstance(req, ChatRequest) and (schema := req.json_schema()) is not None:
            kw["json_schema"] = schema
        if isinstance(req, ChatRequest) and req._grammar is not None:  # tool_choice required / named
            kw["grammar"] = req._grammar
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        return kw

    @staticmethod
    def choices(kw: dict, n: int) -> list[dict]:
        """The generate options of each of n choices: choice i draws with seed (the request's seed, or 0) + i
        (mod 2**32), so each choice is the same request alone with that seed."""
        if n == 1:
            return [kw]
        base = kw.get("seed", 0)
        return [{**kw, "seed": (base + i) % 2**32} for i in range(n)]

    def run(self, ids: list[int], kw: dict, stops: list[str], emit=None, cancelled: threading.Event | None = None,
            drop_eos: bool = False, top_logprobs: int | None = None) -> Outcome:
        """Generate (the caller's thread waits); emit(text) gets each safe piece as it is accepted. With the
        Batcher the request joins the batch (or runs alone between its windows), else generate here."""
        reply = Reply(self, ids, kw, stops, emit, cancelled, drop_eos)
        if self.batcher is not None:
            return self.batcher.run(Job(ids, kw, reply, top_logprobs))
        return self.run_alone(ids, kw, reply, top_logprobs)

    def run_alone(self, ids: list[int], kw: dict, reply: Reply, top_logprobs: int | None = None) -> Outcome:
        """The request through generate, the engine's other callers waiting."""
        eng = self.engine
        with eng._lock:  # this request's stats are read before the next request starts
            out = eng.generate(ids, on_token=reply.on_token, **kw)
            stats = eng.stats.last
            if top_logprobs is not None and reply.outcome.ids:
                reply.outcome.logprobs = token_logprobs(eng, ids, reply.outcome.ids, top_logprobs)
        return reply.finish(out, stats.cached_tokens)


# ---- the app -------------------------------------------------------------------------------------------------------

class AccessLog:
    """ASGI middleware: one line per request once its response has been sent (streams: when the last event went),
    `client "METHOD path" status seconds`."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                client = scope.get("client") or ("-", 0)
                self.log(f'{client[0]}:{client[1]} "{scope["method"]} {scope["path"]}" {status[0]} '
                         f"{time.perf_counter() - t0:.3f} s")
        await self.app(scope, receive, sending)


class BearerKey:
    """ASGI middleware: with an API key set, every /v1 request must carry `Authorization: Bearer <key>` (as OpenAI's
    API and its clients do); else a 401 in OpenAI's error object. /health, /metrics, the page and its /static files stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                await error_response(401, "missing or incorrect API key (Authorization: Bearer <key>)",
                                     code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, model_name: str, log=print, aliases: tuple = (), api_key: str = "",
               cors_origins: tuple = ()) -> FastAPI:
    """The server's app. model_name: the name /v1/models lists and responses carry; aliases: other names requests
    may use (strata-serve: the --model value as given, and its folder's name); api_key: required of /v1 requests
    as a Bearer token ('' = none); cors_origins: origins a browser page may call the API from ('*': any)."""
    app = FastAPI(title="strata_jax", docs_url=None, redoc_url=None)
    names = {model_name, *(a for a in aliases if a)}
    if api_key:
        app.add_middleware(BearerKey, key=api_key)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(AccessLog, log=log)  # added last: outermost, so refused requests are logged too
    server = Server(engine, model_name, log)
    app.state.server = server
    log(server.batching_line())

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(StrataError)
    async def strata_error(request: Request, exc: StrataError):
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """FastAPI's own refusals (an unknown path, a body it cannot parse, a wrong method) in OpenAI's error
        object, not {"detail": ...}: clients read error.message."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            detail = f"{request.method} {request.url.path}: not found ({detail})"
        return error_response(exc.status_code, detail, kind=kind)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        """Anything else (a bug): a 500 in OpenAI's error object, not a plain-text page."""
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}".splitlines()[0], kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": server.waiting}

    def model_object() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "strata_jax"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id not in names:
            return error_response(404, f"model {model_id!r} is not served here (this server has {model_name!r})",
                                  kind="not_found_error", param="model", code="model_not_found")
        return model_object()

    @app.get("/metrics")
    async def metrics():
        total = engine.stats.total
        lines = {"strata_requests_total": server.served, "strata_requests_waiting": server.waiting,
                 "strata_prompt_tokens_total": total.prompt_tokens, "strata_cached_tokens_total": total.cached_tokens,
                 "strata_generated_tokens_total": total.generated_tokens,
                 "strata_decode_tokens_per_second": round(total.decode_tok_s, 3),
                 "strata_prefill_tokens_per_second": round(total.prefill_tok_s, 3),
                 "strata_batch_size": server.batch_size, "strata_batch_windows_total": engine.stats.batch_windows,
                 "strata_batch_rows_max": engine.stats.batch_rows_max,
                 "strata_batch_reused_tokens_total": engine.stats.batch_reused_tokens}
        if engine.placement:
            lines["strata_expert_hit_rate"] = round(total.decode_experts.hit_rate, 4)
            lines["strata_expert_pcie_bytes_total"] = total.decode_experts.pcie_bytes
            lines["strata_expert_cpu_entries_total"] = total.decode_experts.entries_cpu
        return PlainTextResponse("".join(f"{k} {v}\n" for k, v in lines.items()))

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text().replace("{{MODEL}}", model_name))

    @app.get("/static/{name}")
    async def static(name: str):
        """The page's vendored scripts and style (strata_jax/static: marked, highlight.js), no network needed."""
        kinds = {".js": "text/javascript", ".css": "text/css"}
        path = STATIC / name
        if "/" in name or path.suffix not in kinds or not path.is_file():
            return error_response(404, f"no static file {name!r}", kind="not_found_error")
        return Response(path.read_bytes(), media_type=kinds[path.suffix],
                        headers={"cache-control": "public, max-age=86400"})

    def check_model(req: _Sampling):
        if req.model not in (None, "") and req.model not in names:
            return error_response(404, f"model {req.model!r} is not served here (this server has {model_name!r})",
                                  code="model_not_found")
        return None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (bad := check_model(req)) is not None:
            return bad
        if req.echo:
            return error_response(400, "echo is not supported", param="echo")
        if isinstance(req.prompt, str):
            ids = engine.encode(req.prompt)
        else:
            ids = list(req.prompt)
        return await respond(req, request, ids, "text_completion", drop_eos=True)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        if (bad := check_model(req)) is not None:
            return bad
        if (field := req.unserved()) is not None:  # never a 200 that ignored what was asked
            what = {"tool_choice": f"tool_choice {req.tool_choice!r} (auto, none, required and a named function "
                                   f"are served, with tools, and without a JSON response_format)",
                    "functions": "function calls (functions, function_call; use tools)",
                    "response_format": f"response_format {req.response_format.get('type')!r} (text, json_object "
                                       f"and json_schema with a schema object are served)" if req.response_format
                                       else "",
                    "top_logprobs": "top_logprobs without logprobs: true"}[field]
            return error_response(400, f"{what} are not supported by this server", param=field)
        if (schema := req.json_schema()) is not None:  # a schema the grammar engine refuses: 400 before queueing
            try:
                grammar.grammar_for(schema)
            except StrataError as e:
                return error_response(400, str(e), param="response_format")
        forced, name = req.forced_call()
        if forced:  # one call of the tools, the arguments following its schema (constrained decoding)
            try:
                req._grammar = grammar.tool_call_grammar(req.tools, name)
            except StrataError as e:
                return error_response(400, str(e), param="tool_choice")
        messages = [template_message(m) for m in req.messages]
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        ids = engine.chat_ids(messages)
        if tools:  # rendered through the template as transformers' apply_chat_template(tools=) does
            with_tools = engine.chat_ids(messages, tools=tools)
            if with_tools == ids:
                return error_response(400, f"the chat template of {model_name!r} does not render tools (its "
                                      "prompt would not show them to the model)", param="tools")
            ids = with_tools
        return await respond(req, request, ids, "chat.completion", drop_eos=True, tools=bool(tools))

    def template_message(m: ChatMessage) -> dict:
        out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:  # arguments as the templates take them: a mapping (a JSON string is parsed back)
            calls = []
            for c in m.tool_calls:
                f = dict(c.get("function") or {})
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": f})
            out["tool_calls"] = calls
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out

    def with_tool_calls(outcome: Outcome) -> Outcome:
        """The reply's tool calls (chat.parse_tool_calls) moved out of its text into outcome.tool_calls."""
        content, calls = parse_tool_calls(outcome.text)
        if calls:
            outcome.text = content.strip()
            outcome.tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": c}
                                  for c in calls]
            outcome.finish_reason = "tool_calls"
        return outcome

    async def respond(req: _Sampling, request: Request, ids: list[int], kind: str, drop_eos: bool,
                      tools: bool = False):
        kw = server.sampling(req, len(ids))
        engine._check_prompt(ids)  # a prompt too long for the context: 400 before queueing
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        ahead = server.admit()
        headers = {"x-strata-queue-position": str(ahead)}
        if not req.stream:
            # A client that goes away stops its generation at the next token, as a stream's does (the watcher
            # polls the connection while the worker thread decodes).
            cancelled = threading.Event()

            async def watch() -> None:  # until the worker is done: its cancel scope ends this loop
                while not await request.is_disconnected():
                    await anyio.sleep(0.1)
                cancelled.set()
            outcomes: list = [None] * req.n
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    try:
                        async with anyio.create_task_group() as runs:  # n > 1: the choices run at once
                            for i, choice_kw in enumerate(server.choices(kw, req.n)):
                                async def one(i=i, choice_kw=choice_kw):
                                    try:
                                        outcomes[i] = await anyio.to_thread.run_sync(
                                            lambda: server.run(ids, choice_kw, stops, cancelled=cancelled,
                                                               drop_eos=drop_eos, top_logprobs=wanted_logprobs(req)))
                                    except Exception as e:  # noqa: BLE001 (raised below, as it is)
                                        outcomes[i] = e
                                runs.start_soon(one)
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                server.release()
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            if tools:
                outcomes = [with_tool_calls(o) for o in outcomes]
            return JSONResponse(headers=headers, content=body(kind, rid, created, outcomes))
        return EventSourceResponse(stream(kind, rid, created, ids, kw, stops, drop_eos, req, tools), headers=headers,
                                   ping=15)

    def usage(outcomes: list[Outcome]) -> dict:
        """One request's usage: its prompt once, the tokens of every choice."""
        first, made = outcomes[0], sum(o.tokens for o in outcomes)
        return {"prompt_tokens": first.prompt_tokens, "completion_tokens": made,
                "total_tokens": first.prompt_tokens + made,
                "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}

    def wanted_logprobs(req: _Sampling) -> int | None:
        """How many most likely tokens a request wants beside each chosen one (None: no logprobs)."""
        if isinstance(req, ChatRequest):
            return (req.top_logprobs or 0) if req.logprobs else None
        return req.logprobs if isinstance(req, CompletionRequest) else None

    def piece(token: int) -> tuple[str, bytes]:
        """A token's text and bytes; a token that ends inside a UTF-8 character reads `bytes:\\xNN...` (as vLLM
        writes it), so that two such tokens never share a name."""
        raw = token_bytes(engine.tokenizer, token) if engine.tokenizer is not None else engine.decode([token]).encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def logprobs_of(kind: str, outcome: Outcome):
        if outcome.logprobs is None:
            return None
        chosen, top, top_lp = outcome.logprobs
        if kind == "chat.completion":  # {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}
            content = []
            for t, lp, ids, lps in zip(outcome.ids, chosen, top, top_lp):
                text, raw = piece(t)
                top = [(piece(i), v) for i, v in zip(ids, lps)]
                content.append({"token": text, "logprob": float(lp), "bytes": list(raw), "top_logprobs": [
                    {"token": t_text, "logprob": float(v), "bytes": list(t_raw)} for (t_text, t_raw), v in top]})
            return {"content": content, "refusal": None}
        tokens = [piece(t)[0] for t in outcome.ids]  # completions: the legacy form
        offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()
        return {"tokens": tokens, "token_logprobs": [float(v) for v in chosen], "text_offset": offsets,
                "top_logprobs": [{piece(i)[0]: float(v) for i, v in zip(ids, lps)} for ids, lps in zip(top, top_lp)]}

    def body(kind: str, rid: str, created: int, outcomes: list[Outcome]) -> dict:
        choices = []
        for index, outcome in enumerate(outcomes):
            if kind == "chat.completion":
                message = {"role": "assistant", "content": outcome.text}
                if outcome.tool_calls:
                    message.update(content=outcome.text or None, tool_calls=outcome.tool_calls)
                choices.append({"index": index, "message": message, "finish_reason": outcome.finish_reason,
                                "logprobs": logprobs_of(kind, outcome)})
            else:
                choices.append({"index": index, "text": outcome.text, "finish_reason": outcome.finish_reason,
                                "logprobs": logprobs_of(kind, outcome)})
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                "usage": usage(outcomes)}

    def chunk(kind: str, rid: str, created: int, piece: str | None, finish: str | None, role: bool = False,
              index: int = 0) -> dict:
        if kind == "chat.completion":
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}

    async def stream(kind, rid, created, ids, kw, stops, drop_eos, req, tools=False):
        """Server-sent events: each choice's pieces as its tokens come (n > 1: interleaved, by index), each
        choice's end when it ends, then the usage and [DONE]."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        done = object()
        choice_kws = server.choices(kw, req.n)
        holds = [ToolCallHold() if tools else None for _ in choice_kws]  # content as it comes; a call once whole
        left = [len(choice_kws)]

        def work(index: int, choice_kw: dict):
            hold = holds[index]

            def put(piece: str) -> None:
                if hold is not None:
                    piece = hold.add(piece)
                if piece:
                    loop.call_soon_threadsafe(pieces.put_nowait, (index, piece))
            try:
                outcome = server.run(ids, choice_kw, stops, emit=put, cancelled=cancelled, drop_eos=drop_eos,
                                     top_logprobs=wanted_logprobs(req))
                loop.call_soon_threadsafe(pieces.put_nowait, (done, index, outcome))
            except BaseException as e:  # noqa: BLE001 (sent to the client as an error event)
                loop.call_soon_threadsafe(pieces.put_nowait, (done, index, e))
            finally:
                with server._count:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    server.release()

        for index, choice_kw in enumerate(choice_kws):
            threading.Thread(target=work, args=(index, choice_kw), name="strata-serve", daemon=True).start()
        try:
            if kind == "chat.completion":
                for index in range(len(choice_kws)):
                    yield json.dumps(chunk(kind, rid, created, None, None, role=True, index=index))
            results: dict[int, Any] = {}
            while len(results) < len(choice_kws):
                item = await pieces.get()
                if item[0] is not done:
                    yield json.dumps(chunk(kind, rid, created, item[1], None, index=item[0]))
                    continue
                _, index, result = item
                results[index] = result
                if isinstance(result, BaseException):
                    message = str(result) if isinstance(result, StrataError) else f"internal error: {result!r}"
                    yield json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                "code": None}})
                    return
                hold = holds[index]
                if hold is not None:
                    sent = hold.text[:hold.sent]
                    result = results[index] = with_tool_calls(result)
                    if result.tool_calls:
                        after = (result.text[len(sent.strip()):].strip() if result.text.startswith(sent.strip())
                                 else "")
                        if after:
                            yield json.dumps(chunk(kind, rid, created, after, None, index=index))
                        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(result.tool_calls)]}
                        yield json.dumps({**chunk(kind, rid, created, None, None, index=index),
                                          "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                       "logprobs": None}]})
                    elif (held := hold.rest()):
                        yield json.dumps(chunk(kind, rid, created, held, None, index=index))
                if result.logprobs is not None:  # every token's, in one chunk after the text (one teacher-forced
                    # pass after the request, as without stream)
                    last = chunk(kind, rid, created, None, None, index=index)
                    last["choices"][0]["logprobs"] = logprobs_of(kind, result)
                    yield json.dumps(last)
                yield json.dumps(chunk(kind, rid, created, None, result.finish_reason, index=index))
            if (req.stream_options or {}).get("include_usage"):
                outcomes = [results[i] for i in range(len(choice_kws))]
                yield json.dumps({"id": rid, "object": chunk(kind, rid, created, None, None)["object"],
                                  "created": created, "model": model_name, "choices": [],
                                  "usage": usage(outcomes)})
            yield "[DONE]"
        finally:
            cancelled.set()  # a client gone (the generator closed early): the request ends at its next token

    return app


# ---- command line --------------------------------------------------------------------------------------------------

class Loading:
    """The ASGI app while the engine loads and compiles: the port answers at once, /health and every other path
    with a 503 in OpenAI's error object (clients and load balancers wait for 200), then each request goes to the
    real app (`ready`)."""

    def __init__(self):
        self.app = None

    def ready(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        response = error_response(503, "the model is loading", kind="unavailable", code="loading")
        response.headers["retry-after"] = "5"
        await response(scope, receive, send)


def listen(host: str, port: int):
    """The server's socket, bound before anything loads: a port in use is one line at once, not after a minute."""
    import socket
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
        sock.set_inheritable(True)
        return sock
    except OSError as e:
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(argv: list[str]) -> None:
    import sys

    import uvicorn
    from absl import logging

    from strata_jax import options
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]} (flags look like --name=value)", file=sys.stderr)
        sys.exit(2)
    try:
        opts = options.from_flags(options.EngineOptions, FLAGS)
        sock = listen(FLAGS.host, FLAGS.port)
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    port = sock.getsockname()[1]
    api_key = FLAGS.api_key or os.environ.get("STRATA_API_KEY", "")
    print(f"listening on http://{FLAGS.host}:{port} (/health answers 503 until the model is loaded)",
          file=sys.stderr, flush=True)
    loading = Loading()
    failed: list[str] = []

    class SignalledServer(uvicorn.Server):
        """uvicorn shuts down gracefully on SIGINT / SIGTERM and returns: remember which, for the exit status."""
        signalled: int | None = None

        def handle_exit(self, sig, frame):
            self.signalled = sig
            super().handle_exit(sig, frame)
    server = SignalledServer(uvicorn.Config(loading, host=FLAGS.host, port=port, log_level="warning",
                                            lifespan="off"))

    def load() -> None:  # the engine in a thread: the server answers (503) while it loads and compiles
        options = {k: getattr(opts, k) for k in opts.__dataclass_fields__}
        try:
            try:
                engine = Engine.from_pretrained(FLAGS.model, **options)
            except StrataError as e:
                if options["max_batch"] <= 1 or not str(e).startswith(f"max_batch={options['max_batch']}:"):
                    raise
                # an engine that cannot batch (offload, several devices, Qwen3-Next): served one at a time
                print(f"batching: off ({str(e).split(': ', 1)[1]}); loading again with max_batch=1",
                      file=sys.stderr, flush=True)
                engine = Engine.from_pretrained(FLAGS.model, **{**options, "max_batch": 1})
        except StrataError as e:
            failed.append(str(e))
            server.should_exit = True
            return
        except BaseException as e:  # a bug: one line, and the server goes down rather than answer 503 forever
            failed.append(f"internal error while loading: {type(e).__name__}: {e}".splitlines()[0])
            server.should_exit = True
            return
        folder = Path(str(engine.model_dir)).name
        name = FLAGS.served_name or folder
        loading.ready(create_app(engine, name, log=lambda line: print(line, file=sys.stderr, flush=True),
                                 aliases=(FLAGS.model, Path(FLAGS.model).name, folder), api_key=api_key,
                                 cors_origins=tuple(o.strip() for o in FLAGS.cors_origins.split(",") if o.strip())))
        print(f"serving {name} on http://{FLAGS.host}:{port} (chat page at /, OpenAI API under /v1)",
              file=sys.stderr, flush=True)
    threading.Thread(target=load, name="strata-load", daemon=True).start()
    server.run(sockets=[sock])
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    if server.signalled is not None:  # Ctrl-C: 130, as the CLI; SIGTERM: 143 (the shell's 128 + signal)
        if loading.app is None:  # still loading: the loader thread may sit in a compile; leave now
            sys.stderr.flush()
            os._exit(128 + int(server.signalled))
        sys.exit(128 + int(server.signalled))


def _define_flags():
    from absl import flags

    from strata_jax import options
    values = flags.FlagValues()
    flags.DEFINE_string("model", "reference", "Model folder, 'reference', 'reference-next' or 'embedded' (as "
                        "strata_jax.decode).", flag_values=values)
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.", flag_values=values)
    flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535, flag_values=values)
    flags.DEFINE_string("served_name", "", "The model's name in the API (default: the folder's name).",
                        flag_values=values)
    flags.DEFINE_string("api_key", "", "Require this key of every /v1 request (Authorization: Bearer <key>, as "
                        "OpenAI clients send their api_key); '' = none, or the STRATA_API_KEY environment variable.",
                        flag_values=values)
    flags.DEFINE_string("cors_origins", "", "Comma-separated origins a web page may call the API from (CORS; '*' = "
                        "any); '' = none (same-origin only).", flag_values=values)
    options.define_flags(values, classes=(options.EngineOptions,))
    return values


FLAGS = _define_flags()


def cli() -> None:
    """The `strata-serve` console script (pyproject.toml)."""
    import sys

    from absl import flags
    from strata_jax.options import HELP_FLAGS
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print((__doc__ or "").strip() + "\n\nflags:\n" + FLAGS.get_help())  # this command's flags, grouped
        sys.exit(0)
    try:
        argv = FLAGS(sys.argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        main(argv)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
