"""Batched windows (Engine.generate_batch, issue 38): each prompt of a batch gives the tokens and logits it gives
alone (float32: logits within 1e-5, greedy and seeded sampled tokens identical to generate(spec=0)), prompts of
different lengths, prompts leaving early, a padded bucket; bad input in one line."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import one_line_refusal, rel_fro
from strata_jax import Engine
from strata_jax.engine.api import StopRequest

MAX_BATCH = 4  # buckets 1, 2, 4: three prompts run a padded bucket of 4


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all",
                          max_batch=MAX_BATCH)


def random_prompts(engine, lengths, seed):
    # ids below the last one (<|endoftext|>, the embedded model's eos)
    rng = np.random.default_rng(seed)
    return [rng.integers(0, engine.cfg.vocab_size - 1, n).tolist() for n in lengths]


def alone_logits(engine, prompt, out):
    """The logits each of `out`'s tokens was chosen from when the prompt runs alone (teacher-forced T=1 windows)."""
    return engine.score(prompt + out[:-1], window=1)[len(prompt) - 1:]


@pytest.mark.parametrize("lengths", [(6, 13), (5, 17, 9)], ids=["B2", "B3-padded"])
def test_greedy_batch_equals_alone(engine, lengths):
    prompts = random_prompts(engine, lengths, seed=len(lengths))
    full = [engine.generate(p, 10, stop_token_ids=[], spec=0) for p in prompts]
    # prompt 0 leaves at a stop token (its 4th token), prompt 1 at its own max_new_tokens; the others run on
    stop = full[0][3]
    per_prompt = [{"stop_token_ids": [stop]}, {"max_new_tokens": 3}] + [{}] * (len(prompts) - 2)
    alone = [engine.generate(p, o.get("max_new_tokens", 10), stop_token_ids=o.get("stop_token_ids", []), spec=0)
             for p, o in zip(prompts, per_prompt)]
    assert alone[0][-1] == stop and len(alone[0]) <= 4 and len(alone[1]) == 3
    outs, logits = engine.generate_batch(prompts, max_new_tokens=10, stop_token_ids=[], per_prompt=per_prompt,
                                         return_logits=True)
    assert outs == alone
    assert [s.generated_tokens for s in engine.stats.batch] == [len(o) for o in outs]
    assert engine.stats.last.generated_tokens == sum(map(len, outs))
    for prompt, out, rows in zip(prompts, outs, logits):
        assert rows.shape == (len(out), engine.cfg.vocab_size) and rows.dtype == np.float32
        assert rel_fro(rows, alone_logits(engine, prompt, out)) <= 1e-5


def test_sampled_batch_equals_alone(engine):
    prompts = random_prompts(engine, (7, 12, 4), seed=5)
    settings = [dict(temperature=0.9, seed=11), dict(temperature=0.7, top_k=20, seed=12), dict(temperature=0.0)]
    alone = [engine.generate(p, 9, stop_token_ids=[], spec=0, **o) for p, o in zip(prompts, settings)]
    outs = engine.generate_batch(prompts, max_new_tokens=9, stop_token_ids=[], per_prompt=settings)
    assert outs == alone
    # the same request again: the same tokens (a key per seed and position)
    assert engine.generate_batch(prompts[:2], max_new_tokens=9, stop_token_ids=[], per_prompt=settings[:2]) == alone[:2]


def test_on_token_and_stop_request(engine):
    prompts = random_prompts(engine, (8, 10), seed=7)
    alone = [engine.generate(p, 8, stop_token_ids=[], spec=0) for p in prompts]
    seen = {0: [], 1: []}

    def on_token(i, token):
        seen[i].append(token)
        if i == 0 and len(seen[0]) == 2:
            raise StopRequest  # prompt 0 ends here, prompt 1 goes on
    outs = engine.generate_batch(prompts, max_new_tokens=8, stop_token_ids=[], on_token=on_token)
    assert outs == [alone[0][:2], alone[1]] and seen == {0: outs[0], 1: outs[1]}


def test_bad_input_one_line(engine, embedded_engine):
    prompts = random_prompts(engine, (3, 4, 5, 6, 7), seed=9)
    one_line_refusal(engine.generate_batch, prompts, match="5 prompts but max_batch=4")
    one_line_refusal(engine.generate_batch, [], match="non-empty list")
    one_line_refusal(engine.generate_batch, prompts[0], match="prompt 0")  # one prompt, not a list of them
    one_line_refusal(engine.generate_batch, prompts[:2], spec=2, match="unknown option.*spec")
    one_line_refusal(engine.generate_batch, [prompts[0], []], match="prompt 1 has 0 tokens")
    one_line_refusal(engine.generate_batch, [prompts[0], [1.5]], match="prompt 1")
    one_line_refusal(engine.generate_batch, prompts[:2], per_prompt=[{}], match="per_prompt")
    one_line_refusal(engine.generate_batch, prompts[:2], per_prompt=[{}, {"grammar": "x"}], match="unknown option")
    one_line_refusal(engine.generate_batch, prompts[:2], temperature=-1, match="temperature")
    one_line_refusal(engine.generate_batch, prompts[:2], max_new_tokens=-1, match="max_new_tokens")
    assert engine.generate_batch(prompts[:2], max_new_tokens=0) == [[], []]  # as generate: nothing to run
    one_line_refusal(embedded_engine.generate_batch, prompts[:2], match="2 prompts but max_batch=1")
    one_line_refusal(Engine.from_pretrained, None, verbose=False, max_batch=0, match="max_batch")
    one_line_refusal(Engine.from_pretrained, None, verbose=False, dtype="float32", context=64, max_batch=2,
                     expert_cache_slots=4, layer_loop="unrolled", match="max_batch=2: .*layer_loop=unrolled")
    # the engine still serves a batch after the refusals
    assert engine.generate_batch(prompts[:1], max_new_tokens=2, stop_token_ids=[]) == \
        [engine.generate(prompts[0], 2, stop_token_ids=[], spec=0)]


def test_session_requests_join_and_leave_between_windows(engine):
    """Engine.batch_session (the server's continuous batching): requests admitted while others decode, mixed
    greedy and seeded sampled settings, each its own budget; a StopRequest ends one alone; each request's tokens
    are its tokens alone, and the windows were shared."""
    prompts = random_prompts(engine, (5, 9, 13, 7), seed=21)
    settings = [dict(max_new_tokens=12), dict(max_new_tokens=8, temperature=0.9, seed=3),
                dict(max_new_tokens=10, temperature=0.7, top_k=20, seed=5), dict(max_new_tokens=6)]
    alone = [engine.generate(p, spec=0, stop_token_ids=[], **o) for p, o in zip(prompts, settings)]
    session = engine.batch_session()
    seen: dict[int, list] = {i: [] for i in range(4)}

    def on_token(i):
        def see(token):
            seen[i].append(token)
            if i == 0 and len(seen[0]) == 9:
                raise StopRequest  # request 0 ends here, the others go on
        return see
    requests = []

    def admit(i):
        requests.append(session.request(prompts[i], on_token=on_token(i), stop_token_ids=[], **settings[i]))
        session.admit(requests[-1])
    admit(0), admit(1)
    steps, rows = 0, 0
    while session.active or len(requests) < 4:
        if len(requests) < 4 and steps in (3, 6):
            admit(len(requests))  # joins the running batch
        session.step()
        rows = max(rows, len(session.live))
        steps += 1
    assert [r.out for r in requests] == [alone[0][:9]] + alone[1:]
    assert [seen[i] for i in range(4)] == [r.out for r in requests]
    assert rows >= 3 and engine.stats.batch_rows_max >= 3 and session.free == MAX_BATCH


def test_session_admits_a_long_prompt_chunk_by_chunk(engine_factory):
    """A newcomer's prefill runs one chunk a window (begin / advance), the live request's windows going on between
    its chunks; both get their tokens alone."""
    engine = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all", max_batch=2,
                            prefill_chunk=8)
    prompts = random_prompts(engine, (6, 21), seed=31)  # the second: chunks of 8, 8 and 5 (padded)
    alone = [engine.generate(p, 16, stop_token_ids=[], spec=0) for p in prompts]
    session = engine.batch_session()
    first, second = (session.request(p, max_new_tokens=16, stop_token_ids=[]) for p in prompts)
    assert session.admit(first)
    for _ in range(3):
        session.step()
    assert session.begin(second) and session.admitting is second and session.free == 0
    during = []
    while (live := session.advance()) is None:
        before = len(first.out)
        session.step()
        during.append(len(first.out) - before)
    assert live and len(during) == 2 and sum(during) >= 1  # the first request's tokens kept coming
    while session.active:
        session.step()
    assert [first.out, second.out] == alone and second.stats.cached_tokens == 0


@pytest.mark.parametrize("variant", [dict(attention_kernel="pallas"), dict(kv_dtype="int8")],
                         ids=["pallas", "kv-int8"])
def test_batch_attention_forms_equal_alone(engine_factory, variant):
    """The batched attention's other forms: the Pallas kernel's batched form (interpret mode here: one kernel for
    every row, each over its own slot up to its own position) and int8 KV slots (the rows' K/V quantized as written
    by the one scatter): each prompt of a padded batch gives its tokens alone, and its logits (1e-5; int8 K/V 5e-3:
    the batch's q/k/v product is another kernel than one row's, its K an ulp apart on some CPUs, and a value at an
    int8 rounding boundary then takes the next code, a 1/127 step of its row's scale: 8e-4 measured on an AVX2-only
    host, where the float32 forms still agree to 1e-5; a row read from the wrong slot or position is O(1))."""
    engine = engine_factory(None, dtype="float32", window=4, context=64, expert_cache_slots="all", max_batch=4,
                            **variant)
    prompts = random_prompts(engine, (5, 17, 9), seed=43)
    alone = [engine.generate(p, 6, stop_token_ids=[], spec=0) for p in prompts]
    outs, logits = engine.generate_batch(prompts, max_new_tokens=6, stop_token_ids=[], return_logits=True)
    assert outs == alone
    bound = 5e-3 if variant.get("kv_dtype") == "int8" else 1e-5
    for prompt, out, rows in zip(prompts, outs, logits):
        assert rel_fro(rows, alone_logits(engine, prompt, out)) <= bound


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_batch_window_lowers_for_cuda(monkeypatch, kv_dtype):
    """The batched window's graph (forward_batch, the Qwen3-30B-A3B shape cut to 2 layers, B = 8 over a batch cache
    of 8 slots, bf16, the Pallas kernels) lowers for CUDA with one batch_decode_attention in the scanned layer body
    and the rows' K/V written by one scatter a cache (int8: rows and scales), no loop over the rows."""
    import re

    import jax
    import jax.numpy as jnp
    from strata_jax.model.batch import forward_batch
    from strata_jax.model.config import preset
    from strata_jax.model.kv_cache import init_batch_cache
    from strata_jax.model.weights import random_weights
    from strata_jax.pallas_kernels.cuda_lowering import lower_for_cuda
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the model's dispatch: compiled kernels, not interpret
    cfg, b = preset("qwen3-30b-a3b", layers=2), 8
    weights = jax.eval_shape(lambda: random_weights(cfg, 0, jnp.bfloat16, stacked=True))
    cache = jax.eval_shape(lambda: init_batch_cache(cfg, b, 2112, jnp.bfloat16, kv_dtype))
    ints = jax.ShapeDtypeStruct((b,), jnp.int32)
    text = lower_for_cuda(lambda w, c, t, p, s: forward_batch(w, c, t, p, s, jnp.int32(b), cfg, None, True, True),
                          weights, cache, ints, ints, ints, axis_type=jax.sharding.AxisType.Auto)
    kernels = re.findall(r'name = "(\w+)"', text)
    assert kernels.count("batch_decode_attention") == 1 and "decode_attention" not in kernels
    # the rows' K/V writes: scatters into the cache carried by the scan, indexed by (cache row, position)
    writes = re.findall(r'"stablehlo.scatter"\(%iterArg[^\n]*scatter_dims_to_operand_dims = \[0, 1\]', text)
    assert len(writes) == (4 if kv_dtype == "int8" else 2)  # k, v (int8: their rows and their scales)
    assert "dynamic_update_slice" not in text.split("stablehlo.while")[1]  # no per-row writes in the layer body
