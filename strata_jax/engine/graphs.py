"""The pure functions a window runs, for researchers who hold their own weights and caches.

    from strata_jax.engine import graphs
    step = graphs.jit_decode_window(cfg)                  # one compiled graph per window size T (by shape)
    greedy_tokens, logits, cache = step(weights, cache, tokens_T, pos)
    tokens = graphs.jit_sample()(logits, positions, SamplingParams.make(temperature=0.7))   # when sampling
    new, n_new, cache = graphs.jit_sampled_window(cfg, "top_k")(weights, cache, tokens_T, pos, sampling)  # in one
    new, logits, batch_cache = graphs.jit_batch_window(cfg, None)(weights, batch_cache, tokens_B, pos_B, slots_B,
                                                                  n_active, sampling_B)   # B sequences, T=1 each

`decode_window` runs T tokens at positions pos..pos+T-1 and returns each row's argmax beside the logits;
`prefill_chunk` runs a chunk of C prompt tokens of which the first n_valid are real. Both donate the cache (updated
in place) when jitted with the helpers below. A sampled request's windows draw their tokens inside the window
graph (`sampled_window`, one graph per filter form); the samplers alone (`jit_sample`, `jit_verify`) serve the rest.
No graph branches on data (lax.cond): that would make the GPU stream wait for the host in every window.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import threading
import time
import weakref

import jax
import jax.numpy as jnp

from strata_jax.speculative import device_drafts, mtp
from strata_jax.model.batch import forward_batch
from strata_jax.model.config import ModelConfig
from strata_jax.model.transformer import ExpertPath, forward
from strata_jax.model.kv_cache import KVCache
from strata_jax.model.weights import Weights
from strata_jax.sampling import SamplingParams, greedy, sample, verify


def decode_window(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array,
                  *, cfg: ModelConfig, experts: ExpertPath | None = None, attention_kernel: bool = False,
                  dense_kernel: bool = False, delta_kernel: bool = False, return_hidden: bool = False):
    """tokens [T] at positions pos.. -> (argmax tokens [T], logits [T, V] float32, cache[, the final hidden states
    [T, H] with return_hidden: the MTP drafter's input, strata_jax/speculative/mtp.py]). attention_kernel: the
    Pallas decode-attention kernel instead of XLA's einsums; dense_kernel: the attention products through
    pallas_kernels/stacked_linear.py (stacked weights read in place); delta_kernel: Qwen3-Next's delta rule through
    pallas_kernels/gated_delta.py."""
    t = tokens.shape[0]
    out = forward(weights, cache, tokens, pos, jnp.int32(t), cfg, experts, attention_kernel, dense_kernel,
                  delta_kernel, return_hidden)
    return window_outputs(out[0]) + tuple(out[1:])


def window_outputs(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A window's logits [T, V] -> (argmax [T], logits): NON_FINITE (-1) for a row whose logits are not all
    finite (also the last stage of strata_jax/engine/parallel.py's split windows)."""
    return greedy(logits), logits


def prefill_outputs(logits: jax.Array, n_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A prefill chunk's logits [C, V] -> (argmax after the last real row, its logits [1, V]): only that row leaves
    the graph (a chunk's [C, V] would be a large copy for nothing)."""
    last = jax.lax.dynamic_slice_in_dim(logits, n_valid - 1, 1, axis=0)  # [1, V]
    return greedy(last[0]), last


def mtp_window(weights: Weights, cache: KVCache, mtp_weights: mtp.MTPWeights, mtp_cache: mtp.MTPCache,
               tokens: jax.Array, pos: jax.Array, *, cfg: ModelConfig, k: int, experts: ExpertPath | None = None,
               attention_kernel: bool = False, dense_kernel: bool = False, delta_kernel: bool = False):
    """A greedy verify window and the MTP module's drafts for the next one, in one graph (one dispatch and one
    read-back a window instead of two): tokens [T] (the last accepted token, then T-1 drafts) at positions pos..
    -> (argmax [T], logits [T, V] float32, cache, mtp_cache, drafts [k] int32).

    The window accepts its leading drafts that equal the argmax before them, then one token more: rows 0..a, whose
    next tokens are their argmax. The module catches up on those rows and chains k drafts from the last
    (mtp.catch_up_and_draft), as the host loop's drafter would after reading the window."""
    target, logits, cache, hidden = decode_window(weights, cache, tokens, pos, cfg=cfg, experts=experts,
                                                  attention_kernel=attention_kernel, dense_kernel=dense_kernel,
                                                  delta_kernel=delta_kernel, return_hidden=True)
    with jax.named_scope("mtp_drafts"):
        match = (tokens[1:] == target[:-1]).astype(jnp.int32)  # [T-1]
        accepted = jnp.sum(jnp.cumprod(match))  # leading matches
        drafts, mtp_cache = mtp.catch_up_and_draft(weights, mtp_weights, mtp_cache, hidden, target, accepted + 1,
                                                   pos, cfg=cfg, k=k)
    return target, logits, cache, mtp_cache, drafts


def prefill_chunk(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, n_valid: jax.Array,
                  *, cfg: ModelConfig, experts: ExpertPath | None = None, return_hidden: bool = False,
                  attention_kernel: bool = False):
    """tokens [C] (first n_valid real) -> (argmax after the last real one, its logits [1, V], cache[, hidden
    [C, H] with return_hidden]). attention_kernel: the Pallas attention kernel (row blocks of 64 query rows, each
    reading the cache in place up to its own last position) instead of XLA's einsums over the whole static cache.

    Only the last real row's logits leave the graph: a chunk's [C, V] would be a large copy for nothing."""
    logits, cache, *hidden = forward(weights, cache, tokens, pos, n_valid, cfg, experts, attention_kernel,
                                     return_hidden=return_hidden)
    return (*prefill_outputs(logits, n_valid), cache, *hidden)


def prefill_logits(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, n_valid: jax.Array,
                   *, cfg: ModelConfig, experts: ExpertPath | None = None, attention_kernel: bool = False):
    """As prefill_chunk, returning every row's logits [C, V] (teacher-forced prompt scoring)."""
    logits, cache = forward(weights, cache, tokens, pos, n_valid, cfg, experts, attention_kernel)
    return logits, cache


def device_verify_window(weights: Weights, cache: KVCache, hist: jax.Array, length: jax.Array,
                         sampling: SamplingParams, *, cfg: ModelConfig, t: int, form: str | None,
                         experts: ExpertPath | None = None, attention_kernel: bool = False,
                         dense_kernel: bool = False, delta_kernel: bool = False):
    """A verify window that needs nothing from the host (strata_jax.speculative.device_drafts): hist [C] int32 holds the tokens
    so far, the first `length` of them (the last not yet in the KV cache). Proposes up to t-1 n-gram drafts, runs
    the window at position length-1 (padding rows route nowhere), accepts as the host loop would, and appends the
    new tokens. -> (hist, length, new [t] (the first n_new real), n_new, drafts proposed m, cache)."""
    window, drafts, m, pos = draft_window(hist, length, t=t)
    logits, cache = forward(weights, cache, window, pos, 1 + m, cfg, experts, attention_kernel, dense_kernel,
                            delta_kernel)
    return accept_window(logits, hist, length, drafts, m, sampling, t=t, form=form) + (cache,)


def draft_window(hist: jax.Array, length: jax.Array, *, t: int):
    """device_verify_window's first half: up to t-1 n-gram drafts from the history -> (window [t]: the last token
    then the drafts, drafts [t-1], m drafts proposed, the window's position length-1)."""
    drafts, m = device_drafts.ngram_propose(hist, length, t - 1)  # [t-1]
    pos = length - 1
    window = jnp.concatenate([jax.lax.dynamic_slice_in_dim(hist, pos, 1), drafts])  # [t]
    return window, drafts, m, pos


def accept_window(logits: jax.Array, hist: jax.Array, length: jax.Array, drafts: jax.Array, m: jax.Array,
                  sampling: SamplingParams, *, t: int, form: str | None):
    """device_verify_window's second half: the window's logits [t, V] -> (hist, length, new [t], n_new, m), as the
    host loop accepts."""
    positions = length + jnp.arange(t, dtype=jnp.int32)  # pos + 1 + i
    new, n_new = device_drafts.accept(logits, drafts, m, positions, sampling, form)
    hist = jax.lax.dynamic_update_slice_in_dim(hist, new, length, axis=0)  # past length + n_new: overwritten later
    return hist, length + n_new, new, n_new, m


def sampled_window(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, sampling: SamplingParams,
                   *, cfg: ModelConfig, form: str, experts: ExpertPath | None = None, attention_kernel: bool = False,
                   dense_kernel: bool = False, delta_kernel: bool = False):
    """A sampled request's window with its tokens chosen in the same graph: tokens [T] (the last accepted token,
    then T-1 drafts) at positions pos.. -> (new [T]: the accepted drafts then one drawn token, zeros after; n_new =
    accepted + 1; cache). T=1: new[0] is the token at pos + 1, fed to the next window on the device. The draws are
    the separate samplers' (sampling.verify: the same key per position), in the request's filter form
    (sampling.FORMS): one dispatch and no host round trip a window, as a greedy window."""
    t = tokens.shape[0]
    logits, cache = forward(weights, cache, tokens, pos, jnp.int32(t), cfg, experts, attention_kernel, dense_kernel,
                            delta_kernel)
    with jax.named_scope("sample"):
        positions = pos + 1 + jnp.arange(t, dtype=jnp.int32)
        new, n_new = device_drafts.accept(logits, tokens[1:], jnp.int32(t - 1), positions, sampling, form)
    return new, n_new, cache


def batch_window(weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array, slots: jax.Array,
                 n_active: jax.Array, sampling: SamplingParams, *, cfg: ModelConfig, form: str | None,
                 experts: ExpertPath | None = None, attention_kernel: bool = False, dense_kernel: bool = False):
    """B sequences' T=1 windows in one graph (model/batch.py): tokens [B], row b at position pos[b] of the batch
    cache's slot slots[b], the first n_active rows real; sampling: each row's SamplingParams ([B] leaves) ->
    (the next token of each row [B], logits [B, V] float32, cache). form None: greedy rows only (argmax); else the
    rows' filter form (sampling.FORMS), each row drawn as its sequence's sampled_window draws it alone (the same
    key per seed and position; a greedy row among them takes its argmax)."""
    logits, cache = forward_batch(weights, cache, tokens, pos, slots, n_active, cfg, experts, attention_kernel,
                                  dense_kernel)
    with jax.named_scope("sample"):
        if form is None:
            new = greedy(logits)
        else:
            one = lambda row, p, params: sample(row[None], p[None], params, form)[0]
            new = jax.vmap(one)(logits, pos + 1, sampling)
    return new, logits, cache


def sample_window(logits: jax.Array, positions: jax.Array, sampling: SamplingParams, form: str = "sorted"):
    """logits [T, V] float32, positions [T] (of the tokens being chosen) -> tokens [T], in the request's filter
    form (sampling.FORMS)."""
    return sample(logits, positions, sampling, form)


def verify_window(logits: jax.Array, drafts: jax.Array, positions: jax.Array, sampling: SamplingParams,
                  form: str = "sorted"):
    """Speculative sampling of a verify window: logits [T, V], drafts [T-1], positions [T] -> (accept [T-1],
    tokens [T]); see sampling.verify."""
    return verify(logits, drafts, positions, sampling, form)


# XLA may keep a bf16 intermediate in float32 inside a fusion ("excess precision", on by default). Which values it
# keeps then depends on how the graph fuses, so the scanned and unrolled graphs, and the device and the host pool,
# would round in different places (7e-3 relative apart in bf16). Off: every graph rounds where the model code says.
MODEL_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}

# Executables by (module text, shardings, compiler options), shared by the process's engines (compile_shared)
# while one of them holds it: weak references, so a dropped engine's executables are freed. (Each XLA CPU
# executable maps its kernels' code, ~400 memory maps a window graph of the tiny model: a process that kept every
# executable it compiled ran past the kernel's vm.max_map_count of 65530 and crashed inside XLA; NOTES.md item 7.)
_COMPILED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COMPILED_LOCK = threading.Lock()


def compile_shared(lowered: jax.stages.Lowered, compiler_options: dict | None = None) -> jax.stages.Compiled:
    """`lowered.compile()`, once per process for each program: two engines (or one engine reconfigured back and
    forth) whose graph lowers to the same module for the same shardings get one executable, without a compile or
    a read of the persistent cache. Weights and caches are arguments, so an executable serves any engine of the
    same shapes. A graph with a host callback (the host pool's io_callback) is bound to its engine's pool: compiled
    for itself, never shared. `compiler_options`: those the function was jitted with (part of the key)."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if not isinstance(args, dict) or args.get("host_callbacks") or "in_shardings" not in args:
        return lowered.compile()
    text = lowered.as_text()
    key = (hashlib.sha256(text.encode()).hexdigest(), repr(args["in_shardings"]), repr(args.get("out_shardings")),
           repr(args.get("in_layouts")), repr(args.get("out_layouts")), repr(sorted((compiler_options or {}).items())))
    with _COMPILED_LOCK:
        compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    compiled = lowered.compile()
    with _COMPILED_LOCK:
        _COMPILED[key] = compiled
    return compiled


def jit_decode_window(cfg: ModelConfig, experts: ExpertPath | None = None, attention_kernel: bool = False,
                      dense_kernel: bool = False, delta_kernel: bool = False, return_hidden: bool = False):
    return jax.jit(functools.partial(decode_window, cfg=cfg, experts=experts, attention_kernel=attention_kernel,
                                     dense_kernel=dense_kernel, delta_kernel=delta_kernel,
                                     return_hidden=return_hidden), donate_argnums=(1,),
                   compiler_options=MODEL_COMPILER_OPTIONS)


def jit_mtp_window(cfg: ModelConfig, k: int, experts: ExpertPath | None = None, attention_kernel: bool = False,
                   dense_kernel: bool = False, delta_kernel: bool = False):
    return jax.jit(functools.partial(mtp_window, cfg=cfg, k=k, experts=experts, attention_kernel=attention_kernel,
                                     dense_kernel=dense_kernel, delta_kernel=delta_kernel), donate_argnums=(1, 3),
                   compiler_options=MODEL_COMPILER_OPTIONS)


def jit_prefill_chunk(cfg: ModelConfig, experts: ExpertPath | None = None, return_hidden: bool = False,
                      attention_kernel: bool = False):
    return jax.jit(functools.partial(prefill_chunk, cfg=cfg, experts=experts, return_hidden=return_hidden,
                                     attention_kernel=attention_kernel),
                   donate_argnums=(1,),
                   compiler_options=MODEL_COMPILER_OPTIONS)


def jit_prefill_logits(cfg: ModelConfig, experts: ExpertPath | None = None, attention_kernel: bool = False):
    return jax.jit(functools.partial(prefill_logits, cfg=cfg, experts=experts, attention_kernel=attention_kernel),
                   donate_argnums=(1,), compiler_options=MODEL_COMPILER_OPTIONS)


def jit_device_verify_window(cfg: ModelConfig, t: int, form: str | None, experts: ExpertPath | None = None,
                             attention_kernel: bool = False, dense_kernel: bool = False, delta_kernel: bool = False):
    return jax.jit(functools.partial(device_verify_window, cfg=cfg, t=t, form=form, experts=experts,
                                     attention_kernel=attention_kernel, dense_kernel=dense_kernel,
                                     delta_kernel=delta_kernel),
                   donate_argnums=(1, 2), compiler_options=MODEL_COMPILER_OPTIONS)


def jit_sampled_window(cfg: ModelConfig, form: str, experts: ExpertPath | None = None,
                       attention_kernel: bool = False, dense_kernel: bool = False, delta_kernel: bool = False):
    return jax.jit(functools.partial(sampled_window, cfg=cfg, form=form, experts=experts,
                                     attention_kernel=attention_kernel, dense_kernel=dense_kernel,
                                     delta_kernel=delta_kernel), donate_argnums=(1,),
                   compiler_options=MODEL_COMPILER_OPTIONS)


def jit_batch_window(cfg: ModelConfig, form: str | None, experts: ExpertPath | None = None,
                     attention_kernel: bool = False, dense_kernel: bool = False, delta_kernel: bool = False):
    del delta_kernel  # batched windows run the scanned body of full-attention layers
    return jax.jit(functools.partial(batch_window, cfg=cfg, form=form, experts=experts,
                                     attention_kernel=attention_kernel, dense_kernel=dense_kernel),
                   donate_argnums=(1,), compiler_options=MODEL_COMPILER_OPTIONS)


def jit_sample(form: str = "sorted"):
    return jax.jit(functools.partial(sample_window, form=form))


def jit_verify(form: str = "sorted"):
    return jax.jit(functools.partial(verify_window, form=form))


def compile_all(build, sizes) -> list:
    """[build(size) for size in sizes], the sizes in threads: tracing holds the GIL, XLA's compile does not, so the
    compiles of a window table run side by side on the host's cores (start-up: the slowest graph, not their sum)."""
    sizes = tuple(sizes)
    from strata_jax.host_pool.pool import usable_cores
    workers = min(len(sizes), usable_cores())
    if workers <= 1:
        return [build(size) for size in sizes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="strata-compile") as pool:
        return list(pool.map(build, sizes))


class GraphTable(dict):
    """An engine's graphs of one kind by size (window T, prefill chunk C): every size compiled now (`ahead`), or
    each the first time it is looked up (compile_graphs=lazy). `build(size)` compiles one."""

    def __init__(self, sizes, build, ahead: bool, threads: bool = True):
        super().__init__()
        self.sizes, self._build = tuple(sizes), build
        if ahead:
            self.update(zip(self.sizes, compile_all(build, self.sizes) if threads else map(build, self.sizes)))

    def __missing__(self, size):
        if size not in self.sizes:
            raise KeyError(size)
        graph = self[size] = self._build(size)
        return graph


class WindowSamplers:
    """One filter form of the samplers (sampling.FORMS) for every window size T = 1..W over a vocabulary of V:
    `sample[t](logits [T, V], positions [T], params)` and `verify[t](logits, drafts [T-1], positions, params)`:
    the tokens of requests whose window graphs do not draw them (a prompt's first token, draft=mtp, several
    devices). They hold no weights, so every engine of a process with the same (form, W, V) shares one set
    (`window_samplers`). Each graph is compiled the first time it is looked up, or all of them by `compile` (a
    request that will need them, before its timed part): a greedy request never runs them."""

    def __init__(self, form: str, window: int, vocab: int):
        self.form, self.window, self.vocab = form, window, vocab
        sampling = SamplingParams.make()

        def sampler(t: int):
            logits, positions = jnp.zeros((t, vocab), jnp.float32), jnp.zeros((t,), jnp.int32)
            return jit_sample(form).lower(logits, positions, sampling).compile()

        def verifier(t: int):
            logits, positions = jnp.zeros((t, vocab), jnp.float32), jnp.zeros((t,), jnp.int32)
            return jit_verify(form).lower(logits, jnp.zeros((t - 1,), jnp.int32), positions, sampling).compile()
        self.sample = GraphTable(range(1, window + 1), sampler, ahead=False)
        self.verify = GraphTable(range(2, window + 1), verifier, ahead=False)

    @property
    def compiled(self) -> bool:
        return len(self.sample) == self.window and len(self.verify) == self.window - 1

    def compile(self) -> float:
        """Compile every window size not compiled yet; returns the seconds it took (0 when none was left)."""
        t0 = time.perf_counter()
        if self.compiled:
            return 0.0
        for t in range(1, self.window + 1):
            self.sample[t]
            if t > 1:
                self.verify[t]
        return time.perf_counter() - t0


_SAMPLERS: dict[tuple[str, int, int, str], WindowSamplers] = {}
_SAMPLERS_LOCK = threading.Lock()


def window_samplers(form: str, window: int, vocab: int) -> WindowSamplers:
    """The process's samplers of one filter form for windows 1..W over V tokens, on the default device (not yet
    compiled: WindowSamplers.compile)."""
    key = (form, window, vocab, str(jax.config.jax_default_device or jax.local_devices()[0]))
    with _SAMPLERS_LOCK:
        if key not in _SAMPLERS:
            _SAMPLERS[key] = WindowSamplers(form, window, vocab)
        return _SAMPLERS[key]
