"""The OpenAI-compatible server (strata_jax/serve.py) on a loopback port, driven by the official `openai` client:
streamed chat, a second turn that reuses the first, plain completion, stop strings, bad requests, a client that
disconnects mid-stream, two clients at once; the chat page; continuous batching (--max_batch > 1): concurrent
streams as one batch, each its solo answer, n > 1 choices, a grammar request beside the batch."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")  # a test dependency (requirements.txt)
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def serving(engine):
    """The app over `engine` on a free loopback port, in a thread: yields (base url, the Server object)."""
    from strata_jax.serve import create_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines: list[str] = []  # the server's log (queue notes, one access line per request)
    app = create_app(engine, "tiny", log=lines.append, aliases=("embedded", "/models/tiny-folder"))
    app.state.server.lines = lines
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", app.state.server
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def server(engine):
    yield from serving(engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def reply_of(engine, messages, n):
    """What the engine itself answers (greedy), its end-of-turn token left out."""
    return engine.chat(messages, max_new_tokens=n)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    assert any(line.endswith(" s") and '"GET /health" 200 ' in line for line in server[1].lines), server[1].lines[-3:]
    # the model answers to its other names (strata-serve: the --model value as given, its folder's name)
    for name in ("tiny", "embedded", "/models/tiny-folder"):
        assert client.models.retrieve(name).id == "tiny"
        got = client.completions.create(model=name, prompt="def f(x):", max_tokens=2, temperature=0)
        assert got.model == "tiny" and got.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"


def test_streamed_chat_is_the_engines_answer(engine, client):
    messages = [{"role": "user", "content": "reverse a list"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == reply_of(engine, messages, 6) and finish in (["length"], ["stop"])
    assert chunks[-1].usage.completion_tokens == 6 or finish == ["stop"]
    assert chunks[-1].usage.prompt_tokens == len(engine.chat_ids(messages))


def test_a_second_turn_reuses_the_first(engine, client):
    first = [{"role": "user", "content": "sort a dict"}]
    r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=5)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "by value"}]
    r2 = client.chat.completions.create(model="tiny", messages=second, max_tokens=5)
    assert r2.usage.prompt_tokens == len(engine.chat_ids(second))
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(engine.chat_ids(first))
    assert r2.choices[0].message.content == reply_of(engine, second, 5)


def test_completion_and_stop_strings(engine, client):
    prompt = "def f(x):"
    want = engine.decode([t for t in engine.generate(engine.encode(prompt), 12) if t != 256])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12)
    assert r.choices[0].text == want and r.object == "text_completion"
    stop = next(want[i:i + 2] for i in range(2, len(want) - 1) if want[i:i + 2] not in want[:i + 1]
                and "\ufffd" not in want[i:i + 2])
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=[stop, "never-seen"])
    assert cut.choices[0].text == want[:want.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want[:want.index(stop)]


def test_bad_requests_are_4xx_and_the_server_stays_up(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="x" * 100)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    # What the server cannot honour yet is refused, never a 200 that ignored it
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for extra, field in ((dict(tool_choice="required"), "tool_choice"),  # a call forced without tools
                         (dict(tools=[tool], tool_choice="required", response_format={"type": "json_object"}),
                          "tool_choice"),  # two constraints at once
                         (dict(tools=[tool], tool_choice="any"), "tool_choice"),
                         (dict(response_format={"type": "xml"}), "response_format"),
                         (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
                          "response_format"), (dict(top_logprobs=2), "top_logprobs")):
        with pytest.raises(openai.BadRequestError, match="not supported") as e:
            client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, **extra)
        assert e.value.body["param"] == field, extra
    with pytest.raises(openai.BadRequestError, match="does not render tools") as e:  # the code model's template
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, tools=[tool])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="not among the tools") as e:
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert e.value.body["param"] == "tool_choice"
    plain = client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, response_format={"type": "text"},
                                           tool_choice="none")
    assert plain.usage.completion_tokens == 2
    bad_json = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    # Nothing converted silently: bools and floats are not token ids, "7" is not a seed, logprobs=0 is not served.
    for field, body in (("prompt", {"prompt": [True, False]}), ("prompt", {"prompt": [1.0, 2.0]}),
                        ("seed", {"prompt": "x", "seed": "7"}), ("max_tokens", {"prompt": "x", "max_tokens": 2.0}),
                        ("logprobs", {"prompt": "x", "logprobs": 21})):
        r = httpx.post(server[0] + "/v1/completions", json={"model": "tiny", **body})
        assert r.status_code == 400 and field in r.text and "error" in r.json(), (body, r.text)
    # Bodies FastAPI cannot parse, and unknown paths: OpenAI's error object, never {"detail": ...}
    url = server[0] + "/v1/completions"
    for content, ctype in ((b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json"),
                           ('{"model": "tiny", "prompt": "caf\u00e9"}'.encode("latin-1"),
                            "application/json; charset=latin-1"),
                           (b'{"a":' * 100000 + b"1" + b"}" * 100000, "application/json")):
        r = httpx.post(url, content=content, headers={"content-type": ctype})
        assert r.status_code in (200, 400) and "detail" not in r.json(), r.text[:300]
        assert r.status_code == 200 or r.json()["error"]["message"], r.text[:300]
    for r in (httpx.get(server[0] + "/v1/nowhere"), httpx.get(server[0] + "/v1/models/gpt-9")):
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "detail" not in r.json()
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None


def test_response_format_json_is_constrained_decoding(engine, client):
    """response_format json_schema and json_object (JSON mode): the reply follows the schema / is a JSON object,
    streamed or not, and ends with finish_reason stop; a schema the grammar engine refuses is a 400."""
    hi = [{"role": "user", "content": "json"}]  # the embedded engine's context is 64 tokens (bytes)
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["c", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model="tiny", messages=hi, max_tokens=60, temperature=temperature, seed=3,
                                           response_format=fmt)
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"c", "ok"} and value["c"] in ("red", "green", "blue"), value
        assert isinstance(value["ok"], bool) and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=hi, max_tokens=60, temperature=0, response_format=fmt, stream=True))
    assert json.loads(streamed) == json.loads(client.chat.completions.create(
        model="tiny", messages=hi, max_tokens=60, temperature=0, response_format=fmt).choices[0].message.content)
    # JSON mode: an object, or (cut by max_tokens) text that the JSON grammar still accepts
    r = client.chat.completions.create(model="tiny", messages=hi, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "response_format" and "\n" not in e.value.body["message"]


def test_a_client_that_disconnects_stops_its_generation(server, client):
    srv = server[1]
    stream = client.completions.create(model="tiny", prompt="def", max_tokens=50, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()  # the client goes away
    deadline = time.time() + 60
    while time.time() < deadline and not (srv.history and srv.history[-1]["disconnected"]):
        time.sleep(0.05)
    last = srv.history[-1]
    assert last["disconnected"] and last["tokens"] < 50, last
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_non_streaming_client_that_disconnects_stops_its_generation(server, client, monkeypatch):
    from strata_jax import serve
    push = serve.TextStream.push

    def slow_push(self, token):  # 30 ms a token: the request outlives the client's 0.5 s
        time.sleep(0.03)
        return push(self, token)
    monkeypatch.setattr(serve.TextStream, "push", slow_push)
    srv, served = server[1], server[1].served
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v1/completions", timeout=0.5,
                   json={"model": "tiny", "prompt": "def", "max_tokens": 55, "ignore_eos": True})
    deadline = time.time() + 60
    while time.time() < deadline and srv.served == served:
        time.sleep(0.05)
    last = srv.history[-1]
    assert last["disconnected"] and last["tokens"] < 55, last
    monkeypatch.undo()
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_two_clients_at_once_get_their_own_answers(engine, client):
    prompts = ["import os", "class A:"]
    want = [engine.decode([t for t in engine.generate(engine.encode(p), 8) if t != 256]) for p in prompts]
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8).choices[0].text,
                          prompts))
    assert got == want


def test_metrics_and_the_chat_page(server):
    metrics = httpx.get(server[0] + "/metrics").text
    assert "strata_requests_total" in metrics and "strata_generated_tokens_total" in metrics
    page = httpx.get(server[0] + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "tiny" in page.text


def chromium_path() -> str | None:
    """Debian's chromium (apt-get install chromium; .ci/run installs it), or playwright's own download."""
    import shutil
    return os.environ.get("TESTS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def roomy_server(engine_factory):
    """The server over the embedded model with a 1024-token context (a conversation of several turns, and a reply
    long enough to stop), T=1 windows."""
    yield from serving(engine_factory(None, dtype="float32", window=1, context=1024, expert_cache_slots="all"))


def test_the_chat_page_in_a_headless_browser(roomy_server, tmp_path):
    """The page in a real headless Chromium (playwright): labelled input, settings (system prompt, max tokens), a
    streamed reply with its tok/s, markdown rendered with highlighted code (the vendored marked and highlight.js, no
    network), Stop ends a long reply and the next message still works, New chat clears the conversation. A
    screenshot lands in the test's tmp_path (TESTS_SCREENSHOT=FILE copies it there)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.txt "
                                     "has it): the page is checked without a browser in test_metrics_and_the_chat_page")
    executable = chromium_path()
    with playwright.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"no headless chromium ({executable or 'none on PATH'}): {str(e).splitlines()[0]}")
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(roomy_server[0] + "/")
        assert page.get_attribute("label[for=text]", "for") == "text" and "Message" in page.inner_text("label[for=text]")
        assert page.evaluate("typeof marked.parse === 'function' && typeof hljs.highlightElement === 'function'")
        html = page.evaluate("render('# Title\\n\\n```python\\ndef f(x):\\n    return x\\n```\\n<b>raw</b>')")
        assert "<h1" in html and "hljs" in html and "&lt;b&gt;raw" in html, html
        page.click("#settings-toggle")
        page.fill("#system", "You are terse.")
        page.fill("#max", "6")
        page.fill("#text", "reverse a list")
        page.press("#text", "Enter")
        page.wait_for_function("document.querySelectorAll('.meta').length === 1 && "
                               "document.querySelector('.meta').textContent.includes('tok/s')")
        meta = page.inner_text(".meta")
        assert "finish: length" in meta and "6 generated" in meta, meta
        assert page.inner_text(".user") == "reverse a list" and page.is_enabled("#send") and not page.is_enabled("#stop")
        # Stop: a long reply cut by the button; the conversation goes on
        page.fill("#max", "2000")
        page.fill("#text", "tell me everything")
        page.press("#text", "Enter")
        page.wait_for_function("document.querySelectorAll('.assistant')[1].textContent.length > 0")
        page.click("#stop")
        page.wait_for_function("document.querySelectorAll('.meta')[1].textContent.startsWith('stopped')")
        page.fill("#max", "4")
        page.fill("#text", "again")
        page.press("#text", "Enter")
        page.wait_for_function("document.querySelectorAll('.meta').length === 3 && "
                               "document.querySelectorAll('.meta')[2].textContent.includes('generated')")
        assert page.inner_text("#counters").startswith("strata_requests_total")
        shot = tmp_path / "chat_page.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("TESTS_SCREENSHOT"):
            import shutil
            shutil.copy(shot, os.environ["TESTS_SCREENSHOT"])
        page.click("#new-chat")
        assert page.evaluate("document.getElementById('log').children.length") == 0
        assert not errors, errors
        browser.close()


def test_the_server_command_exits_130_on_ctrl_c(cache_dir):
    import os
    import signal
    import subprocess
    import sys
    from conftest import REPO, stderr_until
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}, PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "strata_jax.serve", "--model=embedded", f"--port={port}",
                             "--dtype=float32", "--expert_cache_slots=all", "--window=2", "--context=64",
                             f"--cache_dir={cache_dir}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # The port answers before the model is loaded: /health says 503 (OpenAI's error object) until it is.
    err = stderr_until(proc, b"listening on")
    loading = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading", loading.text
    err += stderr_until(proc, b"serving")
    for _ in range(100):  # until it answers
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130, (err + rest).decode(errors="replace")[-2000:]
    assert b"Traceback" not in err + rest


def test_the_server_command_lists_its_flags_and_names_a_mistyped_one():
    """`strata-serve --help` prints this command's flags (its own and the engine options) and exits 0; a mistyped
    flag is one line naming the nearest one, exit 2."""
    import subprocess
    import sys

    from conftest import REPO
    run = lambda *args: subprocess.run([sys.executable, "-m", "strata_jax.serve", *args], cwd=REPO,
                                       capture_output=True, text=True, timeout=120)
    shown = run("--help")
    assert shown.returncode == 0, shown.stderr
    for flag in ("--port", "--host", "--served_name", "--expert_cache_slots", "--pcie_frac"):
        assert flag in shown.stdout, flag
    typo = run("--prot=8001")
    assert typo.returncode == 2 and typo.stderr.strip().count("\n") == 0
    assert "Did you mean: port" in typo.stderr


def test_a_port_in_use_is_one_line_before_anything_loads(cache_dir):
    import subprocess
    import sys

    from conftest import REPO
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "strata_jax.serve", "--model=embedded", f"--port={port}",
                               f"--cache_dir={cache_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", proc.stderr
    assert seconds < 30  # imports only: no weights read, nothing compiled


def test_an_api_key_guards_the_api_and_cors_lets_a_page_call_it(engine):
    """--api_key: /v1 wants `Authorization: Bearer <key>` (the openai client's api_key), else 401 in OpenAI's error
    object; /health stays open. --cors_origins: the browser's preflight and the response name the origin."""
    from starlette.testclient import TestClient

    from strata_jax.serve import create_app
    lines: list[str] = []
    app = create_app(engine, "tiny", log=lines.append, api_key="s3cret", cors_origins=("http://page.example",))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        ok = http.post("/v1/completions", headers={"Authorization": "Bearer s3cret", "Origin": "http://page.example"},
                       json={"model": "tiny", "prompt": "def", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert ok.headers["access-control-allow-origin"] == "http://page.example"
        pre = http.options("/v1/chat/completions", headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://page.example"
        other = http.options("/v1/chat/completions", headers={"Origin": "http://elsewhere.example",
                                                               "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
    assert sum('"GET /v1/models" 401' in line for line in lines) == 3  # refused requests are logged too


# A template that shows tools, calls and results as Qwen3's does (its own markup), for the tool tests.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<tools>' }}{%- for t in tools %}{{ t | tojson }}{%- endfor %}{{ '</tools>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}"
    "{%- for c in m.tool_calls %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>\n' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{ '<tool_response>' + m.content + '</tool_response>\n' }}"
    "{%- else %}{{ m.role + ': ' + m.content + '\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}")


def test_tools_go_through_the_template_and_calls_come_back_parsed(engine_factory, monkeypatch):
    """tools= renders through the model's chat template (as transformers' apply_chat_template(tools=)); a reply
    holding `<tool_call>{json}</tool_call>` comes back as OpenAI's tool_calls (finish_reason tool_calls), streamed
    too, and the calls and the tool's answer render in the next turn. The model's reply is scripted (the test
    models never call tools); the parsing and the streaming are the server's own."""
    import json

    from starlette.testclient import TestClient

    from strata_jax.io.chat import ChatTemplate
    from strata_jax.serve import create_app
    # a context that holds a tool's JSON schema in bytes; its graphs never run (the reply is scripted)
    engine = engine_factory(None, dtype="float32", window=1, context=1024, expert_cache_slots="all")
    monkeypatch.setattr(engine, "chat_template", ChatTemplate(TOOLS_TEMPLATE, engine.chat_template.special_tokens))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                           http_client=TestClient(create_app(engine, "tiny", log=lambda line: None)))
    prompts = []
    reply = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def scripted(ids, on_token=None, **kw):
        prompts.append(engine.decode(ids))
        out = engine.encode(reply, add_special_tokens=False) + [sorted(engine.end_of_turn_ids)[0]]
        for t in out:
            on_token(t)
        return out
    monkeypatch.setattr(engine, "generate", scripted)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    got = client.chat.completions.create(model="tiny", messages=ask, tools=[tool])
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in prompts[-1]
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the content as it comes, never the start of the call; the call whole at the end
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[tool], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Let me look." and "<tool" not in content
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the next turn: the assistant's call and the tool's answer, through the template
    turn = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    client.chat.completions.create(model="tiny", messages=turn, tools=[tool])
    rendered = prompts[-1].split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(rendered) == {"name": "get_weather", "arguments": {"city": "Paris"}}  # a mapping, not a string
    assert "<tool_response>18 C</tool_response>" in prompts[-1]
    # tool_choice none: no tools in the prompt, the text comes back as it is
    plain = client.chat.completions.create(model="tiny", messages=ask, tools=[tool], tool_choice="none")
    assert "<tools>" not in prompts[-1] and plain.choices[0].finish_reason == "stop"
    assert "<tool_call>" in plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def test_tool_choice_required_and_named_force_one_call(engine_factory, monkeypatch):
    """tool_choice required / a named function: the reply is one call of the tools, its arguments following the
    function's parameters schema (constrained decoding: grammar.tool_call_grammar), parsed into tool_calls with
    finish_reason tool_calls, streamed too. The model's own tokens (random weights) within what the grammar allows."""
    import json

    from starlette.testclient import TestClient

    from strata_jax.io.chat import ChatTemplate
    from strata_jax.serve import create_app
    engine = engine_factory(None, dtype="float32", window=1, context=1024, expert_cache_slots="all")
    monkeypatch.setattr(engine, "chat_template", ChatTemplate(TOOLS_TEMPLATE, engine.chat_template.special_tokens))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                           http_client=TestClient(create_app(engine, "tiny", log=lambda line: None)))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                  "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                  "additionalProperties": False}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                  "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                  "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for temperature in (0, 1.0):
            got = client.chat.completions.create(model="tiny", messages=ask, tools=tools, tool_choice=choice,
                                                 max_tokens=80, temperature=temperature, seed=1)
            assert got.choices[0].finish_reason == "tool_calls", got.choices[0]
            (call,) = got.choices[0].message.tool_calls
            args = json.loads(call.function.arguments)
            assert call.function.name in names
            assert args in ({"city": "Paris"}, {"city": "Rome"}) if call.function.name == "get_weather" else (
                set(args) == {"utc"} and isinstance(args["utc"], bool)), (call.function.name, args)
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=tools, tool_choice="required",
                                                 max_tokens=80, temperature=0, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name in {"get_weather", "get_time"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_are_the_models_own(engine, client):
    """logprobs (completions: the k most likely beside each chosen token; chat: logprobs + top_logprobs): the
    log-softmax of the model's logits, checked against the decode-window graphs' teacher-forced logits
    (Engine.score, another graph than the one the server reads), greedy tokens the most likely."""
    import numpy as np
    prompt = "def add(a, b):"
    ids = engine.encode(prompt)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    out = engine.generate(ids, 5, temperature=0, ignore_eos=True)
    logits = engine.score(ids + out, window=1)[len(ids) - 1:len(ids) - 1 + len(out)].astype(np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(out)), out], atol=1e-4)
    assert len(lp.tokens) == 5 and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and abs(max(top.values()) - chosen) < 1e-9  # greedy: the chosen is the most likely
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-9 for c in content)
    # streamed: the text as it comes, then every token's logprobs in one chunk before the finish; the same values
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    text_chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                                 logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    lp_stream = next(ch.choices[0].logprobs for ch in text_chunks if ch.choices and ch.choices[0].logprobs)
    assert lp_stream.token_logprobs == lp.token_logprobs and lp_stream.tokens == lp.tokens


# ---- continuous batching (--max_batch > 1) --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch_engine(engine_factory):
    """The embedded model as `embedded_engine`, with 4 KV slots for batched windows (test_batch's options)."""
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all", max_batch=4)


@pytest.fixture(scope="module")
def batch_server(batch_engine):
    yield from serving(batch_engine)


def solo_text(engine, prompt, stop=None, **options):
    """What one completion request alone gives: generate(spec=0), the end-of-turn token dropped, cut before the
    stop string."""
    out = engine.generate(engine.encode(prompt), spec=0, **options)
    text = engine.decode([t for t in out if t not in engine.end_of_turn_ids])
    return text[:text.index(stop)] if stop and stop in text else text


def test_concurrent_streams_run_as_one_batch(batch_engine, batch_server):
    """Four streaming completions at once, each its own length, seed, sampling, max_tokens and stop string, one
    joining while the others run: every stream completes as the same request alone, and the windows were shared."""
    engine, (url, srv) = batch_engine, batch_server
    assert any(line.startswith("batching: up to 4 sequences") for line in srv.lines), srv.lines[:3]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    requests = [dict(prompt="def f(x):", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}),
                dict(prompt="import numpy as np", max_tokens=14, temperature=0.8, seed=5),
                dict(prompt="class A:", max_tokens=18, temperature=0.7, seed=9, extra_body={"ignore_eos": True}),
                dict(prompt="for i in", max_tokens=20, temperature=0)]
    want = []
    for r in requests:
        options = dict(max_new_tokens=r["max_tokens"], temperature=r["temperature"], seed=r.get("seed", 0),
                       ignore_eos=bool(r.get("extra_body")))
        want.append(solo_text(engine, r["prompt"], **options))
    # request 3 cuts at a stop string from the middle of its text
    text3 = want[3]
    stop = next((text3[i:i + 2] for i in range(3, len(text3) - 1) if text3[i:i + 2] not in text3[:i + 1]), None)
    if stop is not None:
        requests[3]["stop"] = stop
        want[3] = text3[:text3.index(stop)]
    first_chunks = threading.Event()

    def run(i):
        if i == 3:
            assert first_chunks.wait(60)  # joins while the others stream
        pieces = []
        for chunk in client.completions.create(model="tiny", stream=True, **requests[i]):
            pieces.append(chunk.choices[0].text)
            if i == 0 and len(pieces) == 3:
                first_chunks.set()
        return pieces
    windows = engine.stats.batch_windows
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(run, range(4)))
    assert ["".join(p) for p in got] == want
    assert all(len([p for p in pieces if p]) > 1 for pieces in got[:3])  # tokens as they were made
    assert engine.stats.batch_rows_max >= 3 and engine.stats.batch_windows > windows
    metrics = httpx.get(url + "/metrics").text
    assert "strata_batch_rows_max " in metrics and "strata_batch_size 4" in metrics
    assert "strata_batch_reused_tokens_total " in metrics


def test_n_choices_are_seeded_solo_runs(batch_engine, batch_server):
    """n=2: two choices, choice i the request alone with seed + i; streamed the same, by index."""
    engine, client = batch_engine, openai.OpenAI(base_url=batch_server[0] + "/v1", api_key="unused",
                                                 max_retries=0, timeout=120)
    prompt = "def g(a, b):"
    want = [solo_text(engine, prompt, max_new_tokens=12, temperature=0.9, seed=7 + i, ignore_eos=True)
            for i in range(2)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.9, seed=7, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want and want[0] != want[1]
    assert r.usage.completion_tokens == 24
    streamed = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.9, seed=7,
                                           n=2, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_a_grammar_request_runs_alone_beside_the_batch(batch_engine, batch_server, monkeypatch):
    """A JSON response_format (T=1 masked windows: generate alone, between the batch's windows) while a stream
    runs in the batch: both complete, the grammar's first (the batch waits for it), the stream as it runs alone."""
    from strata_jax import serve
    engine, client = batch_engine, openai.OpenAI(base_url=batch_server[0] + "/v1", api_key="unused",
                                                 max_retries=0, timeout=120)
    want = solo_text(engine, "x = [", max_new_tokens=40, temperature=0, ignore_eos=True)
    push = serve.TextStream.push

    def slow_push(self, token):  # 20 ms a token: the stream outlives the grammar request's arrival
        time.sleep(0.02)
        return push(self, token)
    monkeypatch.setattr(serve.TextStream, "push", slow_push)
    started = threading.Event()

    def long_stream():
        pieces = []
        for chunk in client.completions.create(model="tiny", prompt="x = [", max_tokens=40, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            pieces.append(chunk.choices[0].text)
            started.set()
        return "".join(pieces), time.perf_counter()

    def constrained():
        assert started.wait(60)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                               max_tokens=30, temperature=0, response_format={"type": "json_object"})
        return reply, time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        streamed, answered = ex.submit(long_stream), ex.submit(constrained)
        (text, stream_end), (reply, reply_end) = streamed.result(), answered.result()
    assert text == want and reply.choices[0].message.content.startswith("{")
    assert reply_end < stream_end  # it ran while the batch was running
