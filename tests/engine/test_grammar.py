"""Constrained decoding (strata_jax/grammar.py): generate(json_schema=) holds the output to JSON / a JSON schema.

The embedded model has random weights, so what it writes is arbitrary; the grammar decides what it may write: the
output parses and follows the schema, each token is the model's own choice among the allowed ones (greedy: the
argmax of its logits over them), and a schema the grammar engine refuses is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import one_line_refusal
from strata_jax import StrataError

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.encode("Answer as JSON: ")


def text_of(engine, tokens):
    eos = engine.end_of_turn_ids
    return engine.decode([t for t in tokens if t not in eos])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_output_follows_the_schema_and_ends_with_eos(engine, prompt, temperature):
    for seed in range(3 if temperature else 1):
        out = engine.generate(prompt, 80, temperature=temperature, seed=seed, json_schema=SCHEMA)
        value = json.loads(text_of(engine, out))
        assert set(value) == {"colour", "ok", "n"} and value["colour"] in ("red", "green", "blue"), value
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99, value
        assert out[-1] in engine.end_of_turn_ids and sum(t in engine.end_of_turn_ids for t in out) == 1
    # seeded: the same request again gives the same tokens
    again = engine.generate(prompt, 80, temperature=temperature, seed=seed, json_schema=json.dumps(SCHEMA))
    assert again == out


def test_each_greedy_token_is_the_argmax_over_the_allowed_ones(engine, prompt):
    """The first tokens, checked one by one against the model's own logits (score over prompt + tokens so far) and
    llguidance's mask of the same prefix: the engine picks the argmax among the allowed tokens."""
    from strata_jax.grammar import JsonConstraint
    out = engine.generate(prompt, 80, temperature=0, json_schema=SCHEMA)
    constraint = JsonConstraint(engine.tokenizer, engine.cfg.vocab_size, engine.end_of_turn_ids, SCHEMA)
    logits = engine.score(list(prompt) + out[:-1], window=1)  # row i: the logits of the token at position i + 1
    free = 0
    for i, token in enumerate(out):
        allowed = constraint.allowed()
        row = np.where(allowed, logits[len(prompt) - 1 + i], -np.inf)
        assert token == int(np.argmax(row)), (i, token, int(np.argmax(row)))
        free += int(allowed.sum()) > 1 and int(np.argmax(logits[len(prompt) - 1 + i])) != token
        constraint.advance(token)
    assert constraint.finished
    assert free > 0  # the mask changed the model's choice somewhere (else the check shows nothing)


def test_json_mode_gives_an_object_or_a_prefix_of_one(engine, prompt):
    out = engine.generate(prompt, 48, temperature=0, json_schema=True)
    text = text_of(engine, out)
    assert text.startswith("{")
    if out[-1] in engine.end_of_turn_ids:
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_new_tokens: every token was one the grammar allowed
        from strata_jax.grammar import JsonConstraint
        constraint = JsonConstraint(engine.tokenizer, engine.cfg.vocab_size, engine.end_of_turn_ids, True)
        for token in out:
            assert constraint.allowed()[token]
            constraint.advance(token)


def test_a_schema_it_cannot_take_is_one_line(engine, prompt):
    for bad in ({"type": "no-such-type"}, "{not json", 5):
        message = one_line_refusal(engine.generate, prompt, 4, json_schema=bad)
        assert message.startswith("json_schema"), message
    with pytest.raises(StrataError):
        engine.generate(prompt, 4, json_schema=[1, 2])
    # the engine is fine afterwards, and json_schema=False / None are plain requests
    assert engine.generate(prompt, 4, json_schema=False) == engine.generate(prompt, 4)


def test_a_grammar_of_ones_own(engine, prompt):
    """grammar=: any llguidance grammar (here a regular expression), drawn greedy and sampled; json_schema and
    grammar together are one line."""
    import llguidance
    g = llguidance.grammar_from("regex", "(yes|no|maybe)!")
    for temperature in (0.0, 1.0):
        out = engine.generate(prompt, 12, temperature=temperature, seed=4, grammar=g)
        assert text_of(engine, out) in ("yes!", "no!", "maybe!") and out[-1] in engine.end_of_turn_ids
    assert "give one" in one_line_refusal(engine.generate, prompt, 4, grammar=g, json_schema=True)
    from strata_jax.grammar import tool_call_grammar
    assert "not among the tools" in one_line_refusal(
        tool_call_grammar, [{"type": "function", "function": {"name": "f"}}], "g")
