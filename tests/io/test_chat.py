"""Chat templates rendered as transformers' apply_chat_template renders them (text and token ids, against committed
references: tests/fixtures/make_chat_fixtures.py), generation_config.json, Engine.chat and the CLI's --chat."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, tests_compile_graphs
from strata_jax import StrataError
from strata_jax.io.chat import load_chat_template, load_generation_config
from strata_jax.io.tokenizer import load_tokenizer

CHAT = REPO / "tests" / "fixtures" / "chat"
FOLDERS = {"reference": REPO / "strata_jax" / "assets" / "moe-stdlib", "chatml": CHAT / "chatml",
           "json_lines": CHAT / "json_lines"}
REFERENCES = json.loads((CHAT / "cases.json").read_text())


@pytest.mark.parametrize("case", REFERENCES["cases"],
                         ids=lambda c: f"{c['template']}-{c['conversation']}-{c['add_generation_prompt']}")
def test_rendering_matches_transformers(case):
    folder = FOLDERS[case["template"]]
    template, tok = load_chat_template(folder), load_tokenizer(folder)
    messages = REFERENCES["conversations"][case["conversation"]]
    text = template.render(messages, add_generation_prompt=case["add_generation_prompt"])
    assert text == case["text"]
    assert tok.encode(text, add_special_tokens=False).ids == case["ids"]


def test_template_errors_and_bad_messages_are_one_line(tmp_path):
    template = load_chat_template(FOLDERS["chatml"])
    for messages, match in (([{"role": "tool", "content": "x"}], "roles must be"), ([], "non-empty list"),
                            ([{"role": "user"}], "messages\\[0\\]"), ("hello", "non-empty list")):
        with pytest.raises(StrataError, match=match) as e:
            template.render(messages)
        assert "\n" not in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(StrataError, match="does not parse"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "hi!"


def test_generation_config(tmp_path):
    assert load_generation_config(tmp_path).eos_token_ids == ()
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [5, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                "top_k": 20}))
    g = load_generation_config(tmp_path)
    assert g.eos_token_ids == (5, 7) and (g.temperature, g.top_p, g.top_k) == (0.6, 0.95, 20)
    path.write_text(json.dumps({"eos_token_id": 3, "temperature": 0.6}))  # do_sample false: greedy
    g = load_generation_config(tmp_path)
    assert g.eos_token_ids == (3,) and g.temperature == 0.0
    path.write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(StrataError, match="eos_token_id"):
        load_generation_config(tmp_path)
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0}))  # transformers keeps one token
    g = load_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.top_k) == (0.0, 1.0, 0)  # greedy, not top_p 1.0 (every token)
    for bad in ({"top_p": 1.5}, {"top_p": -0.1}, {"temperature": -1}, {"top_k": -2}):
        path.write_text(json.dumps({"do_sample": True, **bad}))
        with pytest.raises(StrataError, match="out of range"):
            load_generation_config(tmp_path)


def test_generation_config_eos_outside_the_vocabulary_is_one_line(tmp_path, cache_dir):
    from conftest import copy_fixture
    from helpers import one_line_refusal
    from strata_jax import Engine
    folder = copy_fixture(tmp_path, "base")
    for eos in (10**12, -1):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
        msg = one_line_refusal(Engine.from_pretrained, folder, verbose=False, dtype="float32",
                               cache_dir=str(cache_dir), expert_cache_slots="all", window=1)
        assert "generation_config.json" in msg and "eos_token_id" in msg


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def test_engine_chat_renders_generates_and_stops(engine, monkeypatch):
    """chat() = generate() over the rendered ids; the reply leaves its end-of-turn token out; generation_config's
    eos ids stop a request beside the model's."""
    import dataclasses
    messages = [{"role": "user", "content": "reverse a list"}]
    ids = engine.chat_ids(messages)
    assert engine.decode(ids) == "# reverse a list\ndef "
    out = engine.generate(ids, 10)
    assert engine.chat(messages, max_new_tokens=10) == engine.decode([t for t in out if t != 256])
    stop = out[3]
    monkeypatch.setattr(engine, "generation_defaults",
                        dataclasses.replace(engine.generation_defaults, eos_token_ids=(stop,)))
    assert engine.generate(ids, 10) == out[:out.index(stop) + 1]
    assert engine.chat(messages, max_new_tokens=10) == engine.decode(out[:out.index(stop)])


def test_generation_config_sampling_defaults_apply_when_not_given(engine, monkeypatch):
    import dataclasses
    ids = np.random.default_rng(3).integers(0, 255, 9).tolist()
    sampled = engine.generate(ids, 8, temperature=0.9, top_k=20, seed=5, stop_token_ids=[])
    monkeypatch.setattr(engine, "generation_defaults",
                        dataclasses.replace(engine.generation_defaults, temperature=0.9, top_k=20))
    assert engine.generate(ids, 8, seed=5, stop_token_ids=[]) == sampled
    assert engine.generate(ids, 8, temperature=0.0, stop_token_ids=[]) == engine.generate(
        ids, 8, temperature=0.0, top_k=0, stop_token_ids=[])


def test_no_chat_template_is_one_line(engine, monkeypatch):
    monkeypatch.setattr(engine, "chat_template", None)
    with pytest.raises(StrataError, match="no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])


def test_cli_chat_repl_streams_replies_and_reuses_the_conversation(cache_dir):
    """--chat without a prompt: a REPL on stdin; the second turn reuses the first turn's KV rows."""
    proc = subprocess.run([sys.executable, "-m", "strata_jax.decode", "--model=embedded", "--chat", "--dtype=float32",
                           "--window=4", "--context=256", "--max_new_tokens=6", f"--cache_dir={cache_dir}",
                           f"--compile_graphs={tests_compile_graphs()}"],  # as run_cli: lazy on a CPU
                          input=b"reverse a list\nand sort it\n", cwd=REPO, capture_output=True, timeout=300)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err
    summaries = [line for line in err.splitlines() if line.startswith("prompt tokens:")]
    assert len(summaries) == 2, err
    assert "reused" not in summaries[0] and "reused)" in summaries[1], summaries


def test_tool_calls_are_parsed_out_of_a_reply_and_held_back_while_streaming():
    from strata_jax.io.chat import ToolCallHold, parse_tool_calls
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "é"}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content.strip() == "Sure." and calls == [{"name": "f", "arguments": '{"x": 1, "s": "é"}'},
                                                     {"name": "g", "arguments": '{"y": 2}'}]
    for not_a_call in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                       '<tool_call>{"name": "f"', "plain text"):  # stays text: malformed, nameless, cut short
        assert parse_tool_calls(not_a_call) == (not_a_call, [])
    # streaming: every piece of content before the call goes out, the call's markup never does
    rng = np.random.default_rng(5)
    for _ in range(20):
        cuts = sorted(rng.choice(np.arange(1, len(text)), size=6, replace=False))
        hold, out = ToolCallHold(), []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            out.append(hold.add(text[a:b]))
        assert "".join(out) == "Sure.\n" and hold.rest() == text[len("Sure.\n"):]
    hold = ToolCallHold()
    assert hold.add("a <tool") == "a " and hold.add("box>") == "<toolbox>" and hold.rest() == ""  # not a call
