"""An engine's compiled graphs, by kind and size: the decode windows T=1..W and the prefill chunks (ahead of time,
in threads, or each on first use), the samplers of each filter form, the sampled windows (compiled by the first
request of a form), the prefill-logits graphs, draft=device's windows, the MTP drafter's graphs and the batched windows (on first use).
Each graph is lowered against the engine's state (loops.State: its weights and cache give the shapes) and compiled
at its matmul precision (float32 means float32 matmuls). The Engine holds one (`engine.compiled`); the loops read
its tables through loops.Graphs.
"""
from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp

from strata_jax.engine import graphs
from strata_jax.engine.build import log
from strata_jax.engine.loops import State
from strata_jax.engine.plan import Plan
from strata_jax.model.config import ModelConfig
from strata_jax.model.kv_cache import get_slot, put_slot, with_slot_caches
from strata_jax.offload import slots as slots_mod
from strata_jax.options import EngineOptions
from strata_jax.sampling import FORMS, SamplingParams
from strata_jax.speculative import mtp as mtp_mod


class CompiledGraphs:
    """The graph tables of one engine (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, options: EngineOptions, plan: Plan, state: State, parallel=None,
                 verbose: bool = True):
        self.cfg, self.options, self.plan, self.state, self.parallel = cfg, options, plan, state, parallel
        self.verbose = verbose
        self.dtype = jnp.dtype(options.dtype)
        self.expert_path = self.decode_expert_path = None
        self.mtp_compiled = self.mtp_cache = None

    def build(self, expert_path, decode_expert_path, default_form: str | None = None) -> float:
        """Every window size 1..W and the prefill chunks with these expert paths (the prefill's, the decode
        windows'): ahead of time, or (compile_graphs=lazy) each on its first use (the samplers: on the first sampled
        request, pick_samplers). default_form: the model samples by default (generation_config), in that filter
        form: its sampled windows compiled ahead too. Returns the seconds it took."""
        self.expert_path, self.decode_expert_path = expert_path, decode_expert_path
        t0 = time.perf_counter()
        ahead = self.options.compile_graphs == "ahead"
        self.mtp_compiled = None  # built with the old expert path: recompiled on the next draft="mtp" request
        if self.verbose and ahead:
            log(f"compiling: window T=1..{self.options.window}, prefill {self.chunks_text()} ...")
        pos = jnp.int32(0)
        decode = self.jit_decode_window()
        prefill = graphs.jit_prefill_chunk(self.cfg, self.expert_path, attention_kernel=self.prefill_kernel)

        weights, cache = self.state.weights, self.state.cache  # their shapes: what the graphs are lowered for

        def window(t: int):
            if self.parallel:
                with self.full_f32():
                    return self.parallel.window(t, weights, cache)
            return self.aot(decode, weights, cache, jnp.zeros((t,), jnp.int32), pos)

        def chunk(c: int):
            if self.parallel:
                with self.full_f32():
                    return self.parallel.prefill(c, weights, cache)
            return self.aot(prefill, weights, cache, jnp.zeros((c,), jnp.int32), pos, jnp.int32(1))
        # Several devices: their stages' graphs compile one after the other (parallel.py keeps per-stage state).
        self.decode = graphs.GraphTable(range(1, self.options.window + 1), window, ahead, threads=not self.parallel)
        self.prefill = graphs.GraphTable(self.plan.chunks, chunk, ahead, threads=not self.parallel)
        # Sampled requests: window graphs that draw their tokens (graphs.sampled_window), one table per filter form
        # (sampling.FORMS), compiled for the first request of that form (sampled_windows_for); and the samplers
        # alone per window size and form, for what those graphs do not draw (the prompt's first token, draft=mtp,
        # several devices), compiled once per process (graphs.window_samplers: engines share them).
        self.samplers = {f: graphs.window_samplers(f, self.options.window, self.cfg.vocab_size) for f in FORMS}
        self.pick_samplers("sorted", sampled=False)
        self.sampled_windows: dict[str, graphs.GraphTable] = {}
        if ahead and default_form is not None and not self.parallel:  # the model samples by default
            self.sampled_windows_for(default_form)
        self.prefill_logits = {}  # chunk size -> graph, compiled on first use (teacher-forced prompt scoring)
        self.device_verify = {}  # (T, filter form or None: greedy) -> graph, on first use (draft="device" only)
        self.batch_windows: dict[str | None, graphs.GraphTable] = {}  # filter form -> bucket B -> graph
        self.put_slot = jax.jit(put_slot, donate_argnums=(0,))  # a prefilled sequence into its batch KV slot
        self.get_slot = jax.jit(get_slot, donate_argnums=(1,))  # a slot's kept prefix into the engine's cache
        self.fill = jax.jit(slots_mod.refill_slots, donate_argnums=(0,))
        self.fill_layer = jax.jit(slots_mod.refill_layer_slots, donate_argnums=(0,))
        seconds = time.perf_counter() - t0
        if self.verbose:
            when = (f"compiled in {seconds:.1f} s" if ahead else
                    "compiled each on its first use (compile_graphs=lazy)")
            log(f"graphs: window T=1..{self.options.window} and prefill {self.chunks_text()} {when} "
                f"(persistent cache: {jax.config.jax_compilation_cache_dir}); "
                f"context {self.plan.context} tokens ({self.plan.context_why})")
        return seconds

    def pick_samplers(self, form: str, sampled: bool = True, every_size: bool = False) -> None:
        """This request's samplers and verifiers of its filter form (requests run one at a time). every_size: the
        request draws its windows' tokens through them (draft=mtp, several devices): every size compiled here,
        before the request's timed part, the first time a request needs them; else only the first token's."""
        samplers = self.samplers[form]
        if sampled and every_size and not samplers.compiled:
            seconds = samplers.compile()
            if self.verbose:
                log(f"samplers: window T=1..{self.options.window} ({form}) compiled in {seconds:.1f} s (first "
                    f"request that draws through them; shared by this process's engines)")
        elif sampled:
            samplers.sample[1]  # the prompt's first token
        self.sample, self.verify = samplers.sample, samplers.verify

    def sampled_windows_for(self, form: str) -> graphs.GraphTable | None:
        """The window graphs of T=1..W that draw a sampled request's tokens in filter form `form`
        (graphs.sampled_window): compiled (ahead: every size now, in threads) by the first request of that form;
        None with several devices (their windows are chained or sharded graphs: the samplers draw apart)."""
        if self.parallel:
            return None
        if form not in self.sampled_windows:
            t0 = time.perf_counter()
            fn = graphs.jit_sampled_window(self.cfg, form, self.decode_expert_path, **self.plan.window_kernels())

            def window(t: int):
                return self.aot(fn, self.state.weights, self.state.cache, jnp.zeros((t,), jnp.int32), jnp.int32(0),
                                SamplingParams.make())
            ahead = self.options.compile_graphs == "ahead"
            self.sampled_windows[form] = graphs.GraphTable(range(1, self.options.window + 1), window, ahead)
            if self.verbose and ahead:
                log(f"graphs: sampled windows T=1..{self.options.window} ({form}) compiled in "
                    f"{time.perf_counter() - t0:.1f} s (the first request of that filter form)")
        return self.sampled_windows[form]

    def batch_buckets(self) -> tuple[int, ...]:
        """The batched windows' row counts: powers of 2 below max_batch, and max_batch (a batch of n rows runs the
        smallest bucket >= n, its other rows padding)."""
        m = self.options.max_batch
        return tuple(sorted({min(2 ** k, m) for k in range(m.bit_length() + 1)}))

    def batch_windows_for(self, form: str | None) -> graphs.GraphTable:
        """The batched T=1 windows (graphs.batch_window) of every bucket for filter form `form` (None: greedy
        rows only), compiled by the first batch of that form (ahead: every bucket then, in threads; lazy: each
        bucket on first use). Lowered against the batch cache (state.batch; with offload carrying the engine's slot
        caches, kv_cache.with_slot_caches)."""
        if form not in self.batch_windows:
            t0 = time.perf_counter()
            fn = graphs.jit_batch_window(self.cfg, form, self.decode_expert_path, **self.plan.window_kernels())

            def window(b: int):
                rows = jnp.zeros((b,), jnp.int32)
                sampling = SamplingParams(temperature=jnp.zeros((b,), jnp.float32), top_p=jnp.ones((b,), jnp.float32),
                                          top_k=rows, seed=jnp.zeros((b,), jnp.uint32))
                batch = with_slot_caches(self.state.batch, self.state.cache)  # offload: the slot caches ride along
                return self.aot(fn, self.state.weights, batch, rows, rows, rows, jnp.int32(b), sampling)
            ahead = self.options.compile_graphs == "ahead"
            self.batch_windows[form] = graphs.GraphTable(self.batch_buckets(), window, ahead)
            if self.verbose and ahead:
                log(f"graphs: batched windows B={','.join(map(str, self.batch_buckets()))} "
                    f"({form or 'greedy'}) compiled in {time.perf_counter() - t0:.1f} s (the first batch of that form)")
        return self.batch_windows[form]

    @property
    def prefill_kernel(self) -> bool:
        """The prefill chunks' attention: the Pallas kernel (row blocks, each reading the cache only up to its
        own position) wherever the decode windows use it."""
        return self.plan.attention_kernel == "pallas"

    def chunks_text(self) -> str:
        auto = " (auto)" if not self.options.prefill_chunk else ""
        if len(self.plan.chunks) == 1:
            return f"chunk {self.plan.chunk}{auto}"
        return (f"chunks {' and '.join(map(str, self.plan.chunks))}{auto}: {self.plan.chunks[0]} while "
                f"{self.plan.chunks[0] // 4}+ prompt tokens remain")

    def full_f32(self):
        """float32 means float32 matmuls (not TF32 on a GPU): the exactness checks and the host pool rely on it."""
        return jax.default_matmul_precision("highest") if self.dtype == jnp.float32 else contextlib.nullcontext()

    def jit_decode_window(self, return_hidden: bool = False):
        """The window graph with this engine's expert path and kernels (return_hidden: for the MTP drafter)."""
        return graphs.jit_decode_window(self.cfg, self.decode_expert_path, return_hidden=return_hidden,
                                        **self.plan.window_kernels())

    def aot(self, fn, *args):
        """A graph compiled on first use: `fn` (jitted) lowered for `args` and compiled at the engine's matmul
        precision (full_f32), as build does for the graphs compiled at start-up."""
        with self.full_f32():
            return graphs.compile_shared(fn.lower(*args), graphs.MODEL_COMPILER_OPTIONS)

    def prefill_logits_graph(self, size: int):
        if size in self.prefill_logits:
            pass
        elif self.parallel:
            with self.full_f32():
                self.prefill_logits[size] = self.parallel.prefill_logits(size, self.state.weights, self.state.cache)
        else:
            self.prefill_logits[size] = self.aot(
                graphs.jit_prefill_logits(self.cfg, self.expert_path, attention_kernel=self.prefill_kernel),
                self.state.weights, self.state.cache, jnp.zeros((size,), jnp.int32), jnp.int32(0), jnp.int32(1))
        return self.prefill_logits[size]

    def mtp_graphs(self) -> dict:
        """The MTP drafter's graphs, compiled on the first draft="mtp" request: the prefill chunk that also returns
        the final hidden states (the module's input), and the greedy windows T=1..W that draft the next window in
        the same graph (graphs.mtp_window); and the module's KV cache. Sampled requests' windows ("hidden", T ->
        a window returning its hidden states for the host loop's drafter) compile on the first such request."""
        if self.mtp_compiled is None:
            t0 = time.perf_counter()
            prefill = graphs.jit_prefill_chunk(self.cfg, self.expert_path, return_hidden=True,
                                               attention_kernel=self.prefill_kernel)
            fused = graphs.jit_mtp_window(self.cfg, self.options.window - 1, self.decode_expert_path,
                                          **self.plan.window_kernels())
            pos = jnp.int32(0)
            # rows up to the context's end, plus a padded chunk or window and the chained drafts past it
            rows = self.plan.context + self.plan.chunk + self.options.window
            new_cache = lambda: mtp_mod.init_cache(self.cfg, rows, self.dtype, self.options.kv_dtype)
            self.mtp_cache = new_cache()
            weights, cache = self.state.weights, self.state.cache
            compiled = {("fused", t): self.aot(fused, weights, cache, self.state.mtp, self.mtp_cache,
                                               jnp.zeros((t,), jnp.int32), pos)
                        for t in range(1, self.options.window + 1)}
            for c in self.plan.chunks:
                compiled[("prefill", c)] = self.aot(prefill, weights, cache, jnp.zeros((c,), jnp.int32), pos,
                                                    jnp.int32(1))
            self.mtp_compiled = compiled
            # The drafter's graphs, one per row count (a window's T rows or a prefill chunk's), shared by every
            # request's drafter: compiled here by a call on zeros, so that no request compiles (a new drafter's own
            # graphs cost a compile per request: 60 against 820 tok/s on the H200). Then a clean cache.
            drafter = mtp_mod.MTPDrafter(weights, self.state.mtp, self.mtp_cache, self.cfg, self.options.window - 1)
            for t in sorted({*range(1, self.options.window + 1), *self.plan.chunks}):
                drafter.catch_up(jnp.zeros((t, self.cfg.hidden_size), self.dtype), [], 0, self.options.window - 1)
            del drafter
            self.mtp_cache = new_cache()
            if self.verbose:
                log(f"graphs: MTP drafting (windows that draft the next one, the prefill chunk returning hidden "
                    f"states) compiled in {time.perf_counter() - t0:.1f} s")
        return self.mtp_compiled

    def mtp_hidden_window(self, t: int):
        """A window of T returning its hidden states (sampled draft=mtp requests: the host draws the acceptance)."""
        key = ("hidden", t)
        if key not in self.mtp_compiled:
            self.mtp_compiled[key] = self.aot(self.jit_decode_window(return_hidden=True), self.state.weights,
                                              self.state.cache, jnp.zeros((t,), jnp.int32), jnp.int32(0))
        return self.mtp_compiled[key]

    def device_verify_graph(self, t: int, form: str | None):
        """draft="device"'s window of T (loops.decode_device), compiled on first use."""
        key = (t, form)
        if key not in self.device_verify:
            t0 = time.perf_counter()
            if self.parallel:  # the window in shard_map (experts), or chained over the stages (layers)
                with self.full_f32():
                    self.device_verify[key] = self.parallel.device_verify(
                        t, form, self.state.weights, self.state.cache, self.plan.context, SamplingParams.make())
            else:
                fn = graphs.jit_device_verify_window(self.cfg, t, form, self.decode_expert_path,
                                                     **self.plan.window_kernels())
                hist = jnp.zeros((self.plan.context + t,), jnp.int32)
                self.device_verify[key] = self.aot(fn, self.state.weights, self.state.cache, hist, jnp.int32(1),
                                                   SamplingParams.make())
            if self.verbose:
                log(f"graphs: device verify window T={t} ({'greedy' if form is None else 'sampled, ' + form}) compiled in "
                    f"{time.perf_counter() - t0:.1f} s")
        return self.device_verify[key]
