"""API inputs are taken as given or refused with one line, never changed silently (issue 18 items 1, 4, 9): token ids
that are floats, bools, strings, None, nested or 2-D; stop_token_ids and draft of the wrong kind; decode() of
out-of-range ids, encode() of non-text. And requests from several threads on one Engine run one after the other:
each thread gets exactly the tokens a sequential run gives."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from helpers import one_line_refusal


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def prompt(seed: int, n: int = 9) -> list[int]:
    return np.random.default_rng(seed).integers(0, 255, n).tolist()


@pytest.mark.parametrize("ids,match", [
    ([1.7, 2.2], "integer token ids"),  # would have been truncated to [1, 2]
    ([[1, 2], [3]], "integer token ids"),  # would have been flattened
    (np.array([[1, 2], [3, 4]]), "1-D"),  # a 2-D array: no batching
    (np.array([1.0, 2.0]), "integer token ids"),
    ([True, 3], "integer token ids"),
    ("text", "encode text first"),
    (None, "list of integer token ids"),
    (5, "list of integer token ids"),
    ([2**40], r"0\.\."),  # beyond the int range: refused, not wrapped
    ({1: "a", 2: "b"}, "got dict"),  # its keys would have been taken
    ({4, 5}, "got set"),  # no order
    (bytearray(b"ab"), "encode text first"),  # its bytes would have been taken
    (memoryview(b"ab"), "got memoryview"),
])
def test_bad_prompt_ids_are_refused(engine, ids, match):
    requests = engine.stats.requests
    one_line_refusal(engine.generate, ids, 4, match=match)
    one_line_refusal(engine.score, ids, match=match)
    assert engine.stats.requests == requests  # nothing ran


def test_numpy_integer_ids_are_taken(engine):
    ids = prompt(3)
    assert engine.generate(np.asarray(ids, np.int64), 5) == engine.generate(ids, 5)
    assert engine.generate([np.int32(i) for i in ids], 5) == engine.generate(ids, 5)


@pytest.mark.parametrize("stops", [5, "7", [1.5], [[3]]])
def test_bad_stop_token_ids_are_refused(engine, stops):
    one_line_refusal(engine.generate, prompt(4), 4, stop_token_ids=stops, match="stop_token_ids")


def test_bad_draft_is_refused(engine):
    one_line_refusal(engine.generate, prompt(5), 4, draft=object(), match="draft must be")


def test_decode_and_encode_refuse_bad_input(engine):
    one_line_refusal(engine.decode, [engine.cfg.vocab_size + 3], match="decode")
    one_line_refusal(engine.decode, [-1], match="decode")
    one_line_refusal(engine.encode, None, match="expected text")
    assert engine.decode(engine.encode("héllo")) == "héllo"


def test_threads_share_one_engine_safely(engine):
    """4 threads x 3 requests of their own, greedy and sampled: every answer equals the sequential one, no raw
    'Array has been deleted' and no wrong tokens."""
    jobs = [(prompt(100 + i), dict(temperature=0.8 if i % 2 else 0.0, seed=i)) for i in range(12)]
    want = [engine.generate(ids, 10, stop_token_ids=[], **kw) for ids, kw in jobs]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(k, len(jobs), 4):
                ids, kw = jobs[j]
                got[j] = engine.generate(ids, 10, stop_token_ids=[], **kw)
        except BaseException as e:  # noqa: BLE001 - the test reports any failure of a thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [got[j] for j in range(len(jobs))] == want


def test_values_past_the_int32_range_are_refused(engine):
    one_line_refusal(engine.generate, prompt(6), 4, top_k=2**31, match="top_k")
    one_line_refusal(engine.generate, prompt(6), 2**31, match="max_new_tokens")


def test_invalid_utf8_text_is_one_line(engine):
    bad = b"def f(\xff\xfe):".decode("utf-8", "surrogateescape")  # how invalid bytes on a command line arrive
    one_line_refusal(engine.encode, bad, match="UTF-8")


def test_cache_dir_that_is_a_file_is_one_line(tmp_path):
    from strata_jax import Engine
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("x")
    one_line_refusal(Engine.from_pretrained, None, verbose=False, cache_dir=str(a_file),
                     match="not a writable folder")


def test_a_huge_tail_skip_is_capped_to_int32():
    from strata_jax.offload.approx import route_approx
    from strata_jax.options import EngineOptions, build
    approx, lines = route_approx(build(EngineOptions, dict(route_tail_skip=str(2**40))), 8, True, environ={})
    assert approx.tail_skip == 2**31 - 1 and "skips nothing" in lines[0]


def test_ctrl_c_inside_the_host_pool_is_a_keyboard_interrupt(engine_factory):
    """Ctrl-C while an io_callback runs the host pool reaches the API as KeyboardInterrupt (JAX wraps it in its
    runtime error), and the engine still answers the next request the same as before."""
    eng = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots=0, pcie_frac=0.0,
                         pool_calls="callback")  # the Python pool, whose compute is replaced below
    ids = prompt(8)
    want = eng.generate(ids, 6, stop_token_ids=[])
    pool = eng.placement.pool
    original = pool.compute

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    pool.compute = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.generate(ids, 6, stop_token_ids=[])
    finally:
        pool.compute = original
    assert eng.generate(ids, 6, stop_token_ids=[]) == want


@pytest.mark.parametrize("raw,match", [([1, 2], "JSON object"), ("zero_heads", "num_attention_heads must be positive"),
                                       ("zero_kv", "num_key_value_heads must be positive"),
                                       ("text_int", "hidden_size must be an integer, got '128'"),
                                       ("float_int", "num_experts_per_tok must be an integer, got 2.5")])
def test_malformed_configs_are_one_line(raw, match):
    import json
    from conftest import HF_FIXTURES
    from strata_jax.model.config import config_from_dict
    base = json.loads((HF_FIXTURES / "base" / "config.json").read_text())
    if raw == "zero_heads":
        raw = dict(base, num_attention_heads=0)
    elif raw == "zero_kv":
        raw = dict(base, num_key_value_heads=0)
    elif raw == "text_int":  # "128" is not converted silently
        raw = dict(base, hidden_size="128")
    elif raw == "float_int":
        raw = dict(base, num_experts_per_tok=2.5)
    one_line_refusal(config_from_dict, raw, match=match)


def test_cli_refuses_early_and_in_one_line(tmp_path, cache_dir):
    """A file as --model, an empty prompt, a text prompt without tokenizer.json: one line, before any loading."""
    import shutil
    from conftest import HF_FIXTURES, run_cli
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(HF_FIXTURES / "base", no_tok)
    (no_tok / "tokenizer.json").unlink(missing_ok=True)
    for args, match in ([[f"--model={a_file}", "--prompt=hi"], "not a folder"],
                        [["--model=embedded", "--prompt="], "the prompt is empty"],
                        [[f"--model={no_tok}", "--prompt=hi"], "no tokenizer.json"]):
        proc = run_cli(args, cache_dir, timeout=120)
        err = proc.stderr.decode("utf-8", "replace")
        lines = err.strip().splitlines()
        assert proc.returncode == 1 and lines and match in lines[-1] and "Traceback" not in err, err
    # The CLI with a file as --cache_dir: checked before the embedded model is written there.
    proc = run_cli(["--model=embedded", "--prompt=hi"], a_file, timeout=120)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1 and "Traceback" not in err and "not a writable folder" in err.splitlines()[-1], err


def test_a_pool_timeout_ends_the_cli_in_one_line(cache_dir):
    """A --callback_timeout_s below one expert's product: during start-up's cost measurement (pcie_frac=auto) and
    during decoding (pcie_frac=0, every miss on the pool, reached by io_callback: the FFI calls have no timeout). One
    error line naming the layer, exit 1, no traceback and no hang (subprocess.run's timeout fails the test if the
    process does not exit)."""
    from conftest import run_cli
    for args, match in ((["--pcie_frac=auto"], "while measuring start-up costs"),
                        (["--pcie_frac=0", "--pool_calls=callback"], "layer")):
        proc = run_cli(["--dtype=float32", "--window=4", "--context=64", "--expert_cache_slots=8", "--prompt=hello",
                        "--max_new_tokens=8", "--callback_timeout_s=0.000001", *args], cache_dir, timeout=180)
        err = proc.stderr.decode("utf-8", "replace")
        lines = err.strip().splitlines()
        assert proc.returncode == 1 and "Traceback" not in err, err
        assert lines[-1].startswith("error: host pool: layer") and "did not answer" in lines[-1], err
        assert match in lines[-1], err


def test_a_kv_cache_too_large_to_allocate_is_one_line(cache_dir):
    from strata_jax import Engine
    msg = one_line_refusal(Engine.from_pretrained, None, verbose=False, cache_dir=str(cache_dir),
                           context=2_000_000_000, match="cannot be allocated")
    assert "GiB" in msg and "--context" in msg


def test_non_finite_logits_end_the_request_in_one_line(cache_dir):
    """Weights that turn the logits into NaN (a final norm of NaN, set after loading): every decode loop (plain,
    verify windows greedy and sampled, device drafts) ends the request with one line instead of emitting the
    argmax of NaN; the prefill's first token too."""
    import jax.numpy as jnp
    from strata_jax import Engine
    eng = Engine.from_pretrained(None, verbose=False, cache_dir=str(cache_dir), dtype="float32", window=2,
                                 context=64, expert_cache_slots="all")
    eng.weights = eng.weights.replace(final_norm=jnp.full_like(eng.weights.final_norm, jnp.nan))
    one_line_refusal(eng.generate, prompt(9), 6, stop_token_ids=[], match="non-finite logits at|position 9")
    # The decode loops: a finite first token from the prefill, NaN logits in every decode window after it.
    finite_prefill = lambda ids, first=0, mtp=None: (jnp.int32(5), jnp.zeros((1, eng.cfg.vocab_size), jnp.float32))  # noqa: E731
    eng._prefill_all = finite_prefill
    for kw in (dict(spec=0), dict(), dict(temperature=0.7), dict(draft="device")):
        one_line_refusal(eng.generate, prompt(9), 6, stop_token_ids=[], match="non-finite logits", **kw)


def test_request_options_and_drafters_that_would_fail_deep_are_one_line(engine):
    """A float window, an unknown option (generate, chat), a Drafter returning a string, too many drafts or
    ids outside the vocabulary: one StrataError line each; a numpy array of ids is taken as a list."""
    ids = prompt(41)
    assert "window must be an integer" in one_line_refusal(engine.score, ids, window=2.0)
    assert "unknown option(s) foo" in one_line_refusal(engine.generate, ids, 4, foo=1)
    assert "unknown option(s) foo" in one_line_refusal(engine.chat, [{"role": "user", "content": "hi"}], foo=1)

    class Returns:
        def __init__(self, value):
            self.value = value

        def propose(self, tokens, k):
            return self.value(k)

        def observe(self, accepted):
            pass
    for value, match in ((lambda k: "abc", "propose"), (lambda k: [1] * (k + 2), "at most k"),
                         (lambda k: [engine.cfg.vocab_size + 5], "token ids must be in"),
                         (lambda k: {1: 2}, "got dict")):
        one_line_refusal(engine.generate, ids, 6, draft=Returns(value), match=match)
    plain = engine.generate(ids, 6, draft="none", stop_token_ids=[])
    assert engine.generate(ids, 6, draft=Returns(lambda k: np.asarray([3, 4][:k])), stop_token_ids=[]) == plain


def test_a_chat_template_that_fails_while_rendering_is_one_line():
    from strata_jax.io.chat import ChatTemplate
    for source, kind in (("{{ messages[0]['content'] + 1 }}", "TypeError"), ("{{ range(10**20) | list }}", "Overflow")):
        msg = one_line_refusal(ChatTemplate(source=source, special_tokens={}).render,
                               [{"role": "user", "content": "hi"}])
        assert "failed while rendering" in msg and kind in msg, msg
