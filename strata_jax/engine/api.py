"""The public face: `Engine`, a loaded model with its plan (plan.py), its compiled graph tables (graphs.py) and the
loops' state (loops.State), behind generate() / stream() / chat() / score(); built by build.py."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.engine import build as build_mod, loops, parallel as parallel_mod, plan as plan_mod
from strata_jax.engine.compiled import CompiledGraphs
from strata_jax.engine.build import log
from strata_jax.engine.plan import make_plan
from strata_jax.engine.stats import ExpertStats, RequestStats, Stats
from strata_jax.errors import StrataError
from strata_jax.host_pool import unwrap_pool_error
from strata_jax.io import checkpoint
from strata_jax.io.chat import ChatTemplate, GenerationDefaults
from strata_jax.model import moe
from strata_jax.model.config import ModelConfig
from strata_jax.model.kv_cache import cache_bytes, init_batch_cache, init_cache
from strata_jax.model.weights import Weights, can_stack, stack_layers, unstack_layers
from strata_jax.offload import placement as placement_mod
from strata_jax.offload import slots as slots_mod
from strata_jax.offload.approx import route_approx
from strata_jax.offload.defer import defer_cpu
from strata_jax.options import EngineOptions, RequestOptions, build, unknown_switches
from strata_jax.pallas_kernels import tuning as kernel_tuning
from strata_jax.sampling import NON_FINITE, SamplingParams, form_of
from strata_jax.speculative import mtp as mtp_mod
from strata_jax.speculative.drafters import make_drafter


def _serialized(method):
    """One request at a time per engine: the requests of several threads queue on the engine's lock (the KV cache
    is donated to every graph and the expert counters are per engine, so interleaved requests would corrupt both).
    A call from the user code a running request calls (its on_token, its Drafter) is refused: it would run inside
    that request, on its KV cache (the lock is re-entrant, for the engine's own nested calls)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        self._refuse_reentry(method.__name__)
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class _UserDrafter:
    """A Drafter object given to generate(), its calls marked as the request's user code (Engine._refuse_reentry)."""

    def __init__(self, drafter, engine: "Engine"):
        self._drafter, self._engine = drafter, engine

    def propose(self, context, k):
        with self._engine._user_code():
            drafts = self._drafter.propose(context, k)
        # What the windows get must be at most k token ids: a string, a dict, too many or out of the vocabulary
        # would be a wrong window (or a crash deep in the loop), so one line here.
        drafts = check_token_ids(drafts, self._engine.cfg.vocab_size, "the drafter's propose()").tolist()
        if len(drafts) > k:
            raise StrataError(f"the drafter's propose() returned {len(drafts)} drafts; it may return at most k={k}")
        return drafts

    def observe(self, tokens):
        with self._engine._user_code():
            return self._drafter.observe(tokens)


def kernel_tuning_lines() -> list[str]:
    """STRATA_KERNEL_TUNING (a kernel-sweep file): the kernels' knobs from it, its start-up line; a bad file one line
    (a StrataError). The engine's start and the window benchmarks (decode_bench, profile_window) call it."""
    try:
        return kernel_tuning.from_environment()
    except ValueError as e:
        raise StrataError(str(e)) from None


class Engine:
    """A model ready to decode. Build it with `Engine.from_pretrained(path, **options)`."""

    def __init__(self, cfg: ModelConfig, weights: Weights, options: EngineOptions, tokenizer=None,
                 model_dir: Path | None = None, raw_config: dict | None = None, verbose: bool = True,
                 placement: placement_mod.Placement | None = None, generation: GenerationDefaults | None = None):
        self.state = loops.State(weights=None, cache=None)  # what every window donates and gets back
        self._lock = threading.RLock()  # requests of several threads run one after the other (_serialized)
        self._user_code_thread: int | None = None  # the thread running a request's on_token / Drafter, meanwhile
        self.cfg, self.weights, self.options, self.tokenizer = cfg, weights, options, tokenizer
        self.model_dir, self.raw_config, self.verbose = model_dir, raw_config, verbose
        # From the model folder (from_pretrained): its chat template and generation_config.json's defaults.
        self.chat_template: ChatTemplate | None = None
        self.generation_defaults = generation or GenerationDefaults()
        self.placement = placement
        self.mtp = None  # Qwen3-Next's MTP module (mtp_mod.MTPWeights, attach_mtp)
        self._said_no_mtp = False
        self.dtype = jnp.dtype(options.dtype)
        self.expert_storage = placement_mod.expert_storage(options)  # the host copies' and the slots' dtype
        self.approx, approx_lines = route_approx(options, cfg.num_experts_per_tok, placement is not None)
        self.defer, defer_lines = defer_cpu(options, bool(placement) and placement.cpu_path)
        approx_lines += defer_lines + unknown_switches() + kernel_tuning_lines()
        # Context, chunks, kernels, the layer loop, the KV cache's length: decided once (engine/plan.py).
        self.plan = make_plan(cfg, options, placement, self.defer)
        self._check_attention_kernel()
        self.prefetch, prefetch_lines = placement_mod.prefetch_setting(options, placement, self.scanned_offload,
                                                                       self.approx.active)
        approx_lines += prefetch_lines + placement_mod.slot_refresh_lines(options, placement)
        if self.scanned_offload:  # the host experts stay per layer (tuples), the rest is stacked
            self.weights = weights = stack_layers(unstack_layers(weights), keep_experts=True)
        elif self.scanned and parallel_mod.layer_device(cfg, options) is None:  # parallel=layers stacks per device
            self.weights = weights = stack_layers(weights)
        elif weights.stacked:
            self.weights = weights = unstack_layers(weights)
        self.expert_path, self.decode_expert_path = self._expert_paths()
        self.parallel = parallel_mod.attach(self)  # devices > 1: the weights split over them (strata_jax/engine/parallel.py)
        if options.max_batch > 1 and self._batch_refusal():
            raise StrataError(f"max_batch={options.max_batch}: {self._batch_refusal()}")
        self.compiled = CompiledGraphs(cfg, options, self.plan, self.state, self.parallel, verbose)
        # pcie_frac=auto: the graph tables of the path not in use (with the host pool or without), kept once built
        self._graph_paths: dict[bool, tuple] = {}
        self.stats = Stats()
        self._reset_state()
        if placement and verbose:
            for line in placement.lines + self._batch_slots_lines():
                log(line)
        if verbose:
            for line in approx_lines + ([self.parallel.line] if self.parallel else []):
                log(line)
            log(f"kernels: expert FFN {self.expert_kernel}, attention {self.attention_kernel}"
                + f", attention products {self.dense_kernel}, route {self.plan.route_kernel}"
                + (f", DeltaNet rule {self.delta_kernel}" if cfg.has_linear else "")
                + (" (auto)" if "auto" in (options.expert_kernel, options.attention_kernel, options.dense_kernel,
                                           options.delta_kernel)
                   else "")
                + "; layers " + ("scanned (one body over the stacked slot caches; prefill chunks in "
                                 "blocks of 32 experts)" if self.scanned_offload else
                                 "scanned (one body over stacked weights)" if self.scanned else "unrolled"))
            log(self.kv_cache_line())
        self._build_graphs()

    def _build_graphs(self) -> None:
        """The graph tables for the current expert paths (again after a reconfigure that changes them)."""
        defaults = self.generation_defaults.request_defaults()
        default_form = form_of(defaults["top_k"], defaults["top_p"]) if defaults["temperature"] > 0 else None
        self.stats.compile_s = self.compiled.build(self.expert_path, self.decode_expert_path, default_form)

    # The loops' state (loops.State), under the names the engine's users read: every graph call replaces cache.
    weights = property(lambda self: self.state.weights, lambda self, v: setattr(self.state, "weights", v))
    cache = property(lambda self: self.state.cache, lambda self, v: setattr(self.state, "cache", v))
    mtp = property(lambda self: self.state.mtp, lambda self, v: setattr(self.state, "mtp", v))

    # The plan's decisions, under the names the engine's users read.
    context = property(lambda self: self.plan.context)
    chunks = property(lambda self: self.plan.chunks)
    chunk = property(lambda self: self.plan.chunk)
    ring = property(lambda self: self.plan.ring)
    kv_length = property(lambda self: self.plan.kv_length)
    expert_kernel = property(lambda self: self.plan.expert_kernel)
    attention_kernel = property(lambda self: self.plan.attention_kernel)
    dense_kernel = property(lambda self: self.plan.dense_kernel)
    delta_kernel = property(lambda self: self.plan.delta_kernel)
    scanned = property(lambda self: self.plan.scanned)
    scanned_offload = property(lambda self: self.plan.scanned_offload)

    def _check_attention_kernel(self) -> None:
        d = self.cfg.head_dim
        if self.attention_kernel == "pallas" and (d < 16 or d & (d - 1)):
            raise StrataError(f"attention_kernel=pallas needs head_dim a power of 2 >= 16 (this model: {d})")

    def _expert_paths(self):
        """The expert paths of the prefill and of the decode graphs (with offload: placement_mod.expert_paths)."""
        kernel = self.expert_kernel == "pallas"
        if kernel and (jax.default_backend() != "gpu" or self.dtype != jnp.bfloat16):
            raise StrataError("expert_kernel=pallas needs a GPU and dtype=bfloat16")
        route_kernel = self.plan.route_kernel == "pallas"
        if not self.placement:
            return None, (moe.ResidentExperts(self.cfg, route_kernel=route_kernel) if kernel else None)
        return placement_mod.expert_paths(self.cfg, self.placement, self.approx, self.defer, kernel,
                                          route_kernel=route_kernel,
                                          block_ends=parallel_mod.block_ends(self.cfg, self.options),
                                          native_defer=self.scanned_offload,
                                          plan_kernel=self.options.plan_kernel == "pallas",
                                          prefetch=self.prefetch)

    def _reset_state(self) -> None:
        """Fresh caches (also after a failed request, whose donated buffers are gone)."""
        self._resets = getattr(self, "_resets", -1) + 1  # a BatchSession's slots are gone after a reset
        length = self.plan.kv_length
        copies = plan_mod.kv_copies(self.options)  # the engine's cache and the batch's slots
        self.state.batch = None  # (a failed batch donated it)
        self.state.slot_tokens = []  # its slots keep nothing
        try:
            kv = init_cache(self.cfg, length, self.dtype, stacked=self.scanned, ring=self.ring,
                                  kv_dtype=self.options.kv_dtype)
            if self.options.max_batch > 1:
                self.state.batch = self._init_batch_cache()
        except (MemoryError, ValueError, RuntimeError) as e:  # jax's allocation failure is a RuntimeError
            if "RESOURCE_EXHAUSTED" not in str(e) and not isinstance(e, MemoryError) and "memory" not in str(e).lower():
                raise
            need = copies * cache_bytes(self.cfg, length, self.dtype.itemsize, self.ring, self.options.kv_dtype)
            per_token = need / length
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            fits = f"; about {int(free // per_token):,} positions fit in the {free / 2**30:.1f} GiB free" if free > 0 else ""
            raise StrataError(f"the KV cache for context {self.context} needs {need / 2**30:.1f} GiB "
                              f"({per_token / 2**10:.1f} KiB a position"
                              + (f", {copies} copies: the engine's and max_batch={self.options.max_batch} slots"
                                 if copies > 1 else "")
                              + f") and cannot be allocated{fits}: lower --context"
                              + (" or --max_batch" if copies > 1 else "")) from None
        experts = None
        if self.scanned_offload:
            experts = self.placement.init_stacked_state(self.cfg, self.expert_storage)
        elif self.placement:
            experts = self.placement.init_state(self.cfg, self.expert_storage)
        self.cache = kv.replace(experts=experts)
        if self.parallel:
            self.cache = self.parallel.place_cache(self.cache)
        self._kv_tokens: list[int] = []  # the tokens whose KV rows 0.. the cache holds (prefix reuse)

    def _init_batch_cache(self):
        """The batched windows' KV cache: max_batch slots of the engine's KV length (kv_cache.init_batch_cache)."""
        return init_batch_cache(self.cfg, self.options.max_batch, self.plan.kv_length, self.dtype,
                                self.options.kv_dtype)

    def _batch_slots_lines(self) -> list[str]:
        """With offload and max_batch > 1: one line where a full batch's routed experts (max_batch x K a layer) pass
        half the slots: its windows then evict what the next window's rows read again (measured on an H100, 12
        layers of the 30B shape, 32 of 128 slots, PCIe only: 8 rows at once 0.37x one alone, 2 rows 1.09x)."""
        m, k = self.options.max_batch, self.cfg.num_experts_per_tok
        if m <= 1 or not self.placement or 2 * m * k <= self.placement.slots:
            return []
        return [f"max_batch={m}: a full batch routes up to {min(m * k, self.cfg.num_experts)} experts a layer against "
                f"{self.placement.slots} slots, so its windows may evict what the next one reads (32 slots, 8 experts "
                "a token: 4 and 8 rows at once ran 0.47x / 0.37x one sequence alone, PCIe only; "
                "benchmarks/results/h200-2026-12-06c-offload)"]

    def _batch_refusal(self) -> str | None:
        """Why this engine cannot run batched windows, or None. They run a scanned layer body on one device: the
        all-resident one, or with offload the scanned offload body through the native offload calls (the rows of a
        window share its plan, its fetches and its pool job). One line each for what is not served."""
        if self.parallel is not None:
            return f"devices={self.options.devices}: batched windows run on one device"
        if not self.scanned:
            return f"batched windows run the scanned layer loop; this engine runs unrolled: {self._unrolled_why()}"
        if self.defer.active and not slots_mod.native_defer_fits(self.cfg, self.options.max_batch):
            # the scanned body carries a layer's late job to the next layer: one pair of native calls a window
            return (f"the deferral (STRATA_VERIFY_DEFER_CPU) is on and a window of max_batch="
                    f"{self.options.max_batch} rows may route more distinct experts than one pair of native offload "
                    "calls takes (32): lower max_batch, or unset the deferral")
        return None

    def _unrolled_why(self) -> str:
        """Why this engine's layers run unrolled (_batch_refusal's line)."""
        if not can_stack(self.cfg):
            return "its layers are of mixed kinds (Qwen3-Next's DeltaNet layers keep one sequence's state)"
        if self.options.layer_loop == "unrolled":
            return "layer_loop=unrolled"
        if self.placement is not None and not self.placement.native:
            return (f"offload without the native offload calls (pool_calls={self.options.pool_calls}, or their FFI "
                    "handler did not build)")
        return "the deferral (STRATA_VERIFY_DEFER_CPU) of windows this wide"

    def kv_cache_line(self) -> str:
        """The start-up line: how the KV cache is stored and its size."""
        kv = cache_bytes(self.cfg, self.kv_length, self.dtype.itemsize, 0, self.options.kv_dtype)
        how = ("int8, float32 scales per (position, kv head)" if self.options.kv_dtype == "int8"
               else f"{self.options.dtype}")
        return (f"KV cache: {how}, {kv / 2**20:.1f} MiB ({self.kv_length} positions x {self.cfg.num_full_layers} "
                f"attention layers, kv_dtype={self.options.kv_dtype})")

    # ---- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, verbose: bool = True, **options) -> "Engine":
        """Load a Hugging Face Qwen3-MoE folder (config.json, *.safetensors, tokenizer.json), a folder saved by
        `save_state`, 'reference' (the committed trained model), or (path None / 'embedded') the embedded tiny
        random model. Options are the CLI flags' names."""
        return build_mod.load(cls, path, verbose, **options)

    @classmethod
    def from_random(cls, cfg: ModelConfig, seed: int = 0, verbose: bool = True, embed_scale: float = 1.0,
                    **options) -> "Engine":
        """An engine over random weights of a model shape (benchmarks): non-expert weights made on the device,
        experts made on the device layer by layer and moved to host memory when offload is on. embed_scale: the
        random embedding multiplied by it (random weights route most tokens to a few experts; 50 spreads the
        routing over ~80% of them, as a trained model's does: benchmarks/offload_bench.py --embed_scale)."""
        return build_mod.random_engine(cls, cfg, seed, verbose, embed_scale, **options)

    # The model folder's files that a restored state needs to behave as the model: its sampling defaults and extra
    # eos ids, its chat template and special tokens.
    STATE_MODEL_FILES = ("generation_config.json", "tokenizer_config.json", "chat_template.jinja",
                         "special_tokens_map.json")

    @_serialized
    def save_state(self, path: str | Path, overwrite: bool = False) -> None:
        """Save the converted weights with orbax, with the tokenizer and the model folder's generation and chat
        files; `from_pretrained(path)` restores them without conversion. A folder that is not empty (a model,
        another state) is refused unless `overwrite`; the state appears there only once complete."""
        weights = self.parallel.gathered(self.weights) if self.parallel is not None else self.weights

        def write_files(folder: Path) -> None:
            if self.tokenizer is not None:
                self.tokenizer.save(str(folder / "tokenizer.json"))
            for name in self.STATE_MODEL_FILES:
                src = None if self.model_dir is None else Path(self.model_dir) / name
                if src is not None and src.is_file():
                    (folder / name).write_bytes(src.read_bytes())
        checkpoint.save_state(path, unstack_layers(weights), self.raw_config or {}, self.options.dtype,
                              self.options.expert_dtype, write_files=write_files, overwrite=overwrite)

    @contextlib.contextmanager
    def _user_code(self):
        """Mark the caller's code a running request calls (on_token, a Drafter): engine calls from it are refused."""
        outer, self._user_code_thread = self._user_code_thread, threading.get_ident()
        try:
            yield
        finally:
            self._user_code_thread = outer

    def _refuse_reentry(self, name: str) -> None:
        if self._user_code_thread == threading.get_ident():
            raise StrataError(f"engine.{name}() called from inside a running request (its on_token or drafter): "
                              f"the engine runs one request at a time; call it after generate() returns")

    @_serialized
    def reconfigure(self, pcie_frac: float | None = None, cache_policy: str | None = None) -> None:
        """Change the PCIe/CPU split or the cache policy; the expert cache starts empty. Both are data in the graphs:
        the graphs are recompiled only when the split moves to or from 1 (placement_mod.needs_cpu_path: the host
        pool's callback comes or goes) or the policy changes (lru's decode windows leave the staging out)."""
        if not self.placement:
            raise StrataError("offload is off (expert_cache_slots=all): nothing to reconfigure")
        opts = build(EngineOptions, dict(pcie_frac=self.placement.pcie_frac if pcie_frac is None else pcie_frac,
                                         cache_policy=self.placement.policy if cache_policy is None else cache_policy))
        if opts.pcie_frac == "auto":
            raise StrataError("reconfigure takes a number for pcie_frac")
        if isinstance(self.parallel, parallel_mod.ExpertSplit) and (float(opts.pcie_frac) < 1
                                                                     or opts.cache_policy == "static"):
            raise StrataError("parallel=experts with offload runs pcie_frac=1 and cache_policy=lru")
        if placement_mod.needs_cpu_path(float(opts.pcie_frac)) and not self._pool_graphs_fit():
            raise StrataError("the deferral (STRATA_VERIFY_DEFER_CPU) of windows this wide runs in the unrolled "
                              "graph: start the engine with layer_loop=unrolled to reconfigure it to pcie_frac < 1")
        rebuild = self.placement.reconfigure(float(opts.pcie_frac), opts.cache_policy)
        if pcie_frac is not None:
            self.placement.auto = False  # a split asked for by number stays
        self._reset_state()
        if rebuild:
            self._graph_paths.clear()  # auto's kept tables were built for the old policy or split
            self.defer, _ = defer_cpu(self.options, self.placement.cpu_path)
            self.expert_path, self.decode_expert_path = self._expert_paths()
            self._build_graphs()

    # ---- expert counters -------------------------------------------------------------------------------------

    def _take_expert_stats(self, new_request: bool = False) -> ExpertStats:
        """Read and zero the in-graph counters (and the pool's time) of the windows run since the last call; at the
        start of a request also zero the routing usage (the static policy fills from this request's prefill)."""
        if not self.placement:
            return ExpertStats()
        stacked = isinstance(self.cache.experts, slots_mod.SlotCache)
        states = self._slot_caches()
        # parallel=experts: [D, C] counters, one row per device's slot cache
        total = np.sum([np.asarray(s.counters).reshape(-1, len(slots_mod.COUNTERS)) for s in states], axis=(0, 1))
        out = ExpertStats(**{name: int(v) for name, v in zip(slots_mod.COUNTERS, total)})
        out.pcie_bytes = ((out.distinct_fetched + out.prefetched)
                          * self.cfg.expert_bytes(placement_mod.expert_itemsize(self.options)))
        out.pool_s = self.placement.pool.stats.wall_seconds
        self.placement.pool.stats.reset()
        # A buffer per layer: the graphs donate the cache, and one buffer must not be donated twice.
        def zeroed(s):  # on the slot cache's own device (parallel=layers: its layer's)
            zero = lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding)
            s = s.replace(counters=zero(s.counters))
            return s.replace(usage=zero(s.usage)) if new_request else s
        self.cache = self.cache.replace(experts=zeroed(self.cache.experts) if stacked else
                                        [None if s is None else zeroed(s) for s in self.cache.experts])
        return out

    def _slot_caches(self) -> list:
        """The slot caches as stored: the stacked one (scans_offload: every layer's in one), or each sparse layer's."""
        experts = self.cache.experts
        return [experts] if isinstance(experts, slots_mod.SlotCache) else [s for s in experts if s is not None]

    def _adapt_pcie_frac(self, stats: ExpertStats) -> None:
        """pcie_frac=auto: the split re-chosen from a request's misses (placement_mod.adapt_pcie_frac) and set as
        data in the slot caches (the cached experts stay); where it crosses 1, the other path's graphs
        (_switch_graphs); one line when it moves."""
        if not self.placement:
            return
        following = None
        if self.placement.auto and self.placement.frozen_lru:  # the decode's usage since the slots' fill
            usage = np.concatenate([np.asarray(s.usage).reshape(-1, self.cfg.num_experts)
                                    for s in self._slot_caches()])
            following = placement_mod.following_misses(usage, self.placement.slots, self.cfg.num_experts_per_tok)
        new = placement_mod.adapt_pcie_frac(self.cfg, self.placement, placement_mod.expert_itemsize(self.options),
                                            stats, following)
        if new is None:
            return
        (frac, misses), old = new, self.placement.pcie_frac
        crossed = placement_mod.needs_cpu_path(frac) != self.placement.cpu_path
        to_pool = crossed and placement_mod.needs_cpu_path(frac)
        if to_pool and (self.parallel is not None or not self._pool_graphs_fit()):
            return  # the pool's graphs are not built here: it stays at 1
        if crossed and self.parallel is not None:
            crossed = False  # several devices: each stage keeps the expert paths it was built with; 1 set as data
        self.placement.pcie_frac = frac
        self.cache = self.cache.replace(experts=slots_mod.with_pcie_frac(self.cache.experts, frac))
        took = self._switch_graphs() if crossed else None
        if self.verbose:
            log(f"pcie_frac: {old:g} -> {frac:g} (auto: the last request met {misses:.2f} misses a layer a window"
                + ("" if took is None else
                   f"; the graphs {'with' if self.placement.cpu_path else 'without'} the host pool"
                   + (f" compiled in {took:.1f} s" if took else " kept from before")) + ")")

    def _pool_graphs_fit(self) -> bool:
        """Whether graphs with the host pool may be built for this engine (as reconfigure refuses them: the deferral
        of windows too wide for the scanned body's native split)."""
        return not (self.scanned_offload and not slots_mod.native_defer_fits(self.cfg, self.options.window)
                    and defer_cpu(self.options, True)[0].active)

    def _switch_graphs(self) -> float:
        """pcie_frac=auto's split crossed 1 (placement.cpu_path changed): the decode and prefill graphs of the other
        path, built without the host pool at 1 (every miss fetched: no pool call a layer, as pcie_frac=1's graphs)
        and with it below. Each path's graphs are compiled on its first use and kept, with the sampled windows and
        the MTP graphs the other path had compiled, so no request compiles; the slot caches and their experts stay.
        Returns the seconds it compiled (0 where kept)."""
        old = self.compiled
        self._graph_paths[not self.placement.cpu_path] = (old, self.defer, self.expert_path, self.decode_expert_path)
        kept = self._graph_paths.get(self.placement.cpu_path)
        if kept is not None:
            self.compiled, self.defer, self.expert_path, self.decode_expert_path = kept
            return 0.0
        self.defer, _ = defer_cpu(self.options, self.placement.cpu_path)
        self.expert_path, self.decode_expert_path = self._expert_paths()
        self.compiled = CompiledGraphs(self.cfg, self.options, self.plan, self.state, self.parallel, verbose=False)
        t0, start_up = time.perf_counter(), self.stats.compile_s
        self._build_graphs()
        self.stats.compile_s = start_up  # the start-up's figure; this compile is in the line above
        for form in old.sampled_windows:
            self.compiled.sampled_windows_for(form)
        if old.mtp_compiled is not None:
            self.compiled.mtp_graphs()
        return time.perf_counter() - t0

    def _fill_static_slots(self, keep_usage: bool = False) -> int:
        """Static policy (and lru with pcie_frac 0: placement.fills_from_prefill): after the prompt's prefill, the
        slots take each layer's most used experts (those already in a slot stay, uncopied); nothing else changes
        them but slot_refresh (keep_usage: by the usage counted so far). Returns the experts copied, once they are
        on the device."""
        if isinstance(self.cache.experts, slots_mod.SlotCache):
            new, copied = slots_mod.fill_static_stacked(self.cache.experts, self.weights.layers,
                                                        self.compiled.fill_layer, keep_usage)
        else:
            new, copied = slots_mod.fill_static_slots(self.cache.experts, self.weights.layers, self.compiled.fill,
                                                      keep_usage)
        self.cache = self.cache.replace(experts=jax.block_until_ready(new))
        return copied

    def _guarded(self, fn, *args):
        """Run a request step; a host pool failure becomes one StrataError and fresh caches (the engine stays
        usable for the next request)."""
        try:
            return fn(*args)
        except (StrataError, StopRequest):
            raise
        except KeyboardInterrupt:
            self._reset_state()  # the donated caches of the interrupted window may be gone
            raise
        except Exception as e:
            if _interrupted(e):  # Ctrl-C landed inside an io_callback: JAX hands it back wrapped in its error
                self._reset_state()
                raise KeyboardInterrupt from None
            pool_error = unwrap_pool_error(e) if self.placement else None
            self._reset_state()
            if self.placement:
                self.placement.pool.stats.reset()
                self.placement.pool.drop_split_jobs()  # a failed window leaves its deferred jobs uncollected
            if pool_error is not None:
                raise StrataError(str(pool_error)) from None
            raise

    # ---- requests --------------------------------------------------------------------------------------------

    def _check_prompt(self, ids: Sequence[int]) -> np.ndarray:
        arr = check_token_ids(ids, self.cfg.vocab_size, "the prompt")
        if arr.size == 0:
            raise StrataError("the prompt is empty")
        if arr.size >= self.context:
            raise StrataError(f"the prompt has {arr.size} tokens but the context holds {self.context} "
                              f"(at least one must be left to generate; see --context)")
        return arr.astype(np.int32)

    def _prefill_all(self, ids: np.ndarray, want_logits: bool = False, first: int = 0, mtp=None):
        """The prompt through the prefill graph chunk by chunk, from position `first` (the rows before it are in
        the cache already). Returns (argmax token after the prompt, its logits [1, V]) as device arrays, or with
        want_logits the logits [P, V] of every prompt position (numpy). mtp: an MTPDrafter, fed every chunk's
        hidden rows (the last chunk's wait for the first new token: `observe`)."""
        chunks = []
        token = last = None
        start = first
        for size in plan_mod.chunk_sizes_for(ids.size - first, self.chunks):
            part = ids[start:start + size]
            tokens = np.zeros((size,), np.int32)
            tokens[:part.size] = part
            if want_logits:
                logits, self.cache = self.compiled.prefill_logits_graph(size)(self.weights, self.cache, tokens,
                                                                      np.int32(start), np.int32(part.size))
                chunks.append(logits[:part.size])
            elif mtp is not None:
                token, last, self.cache, hidden = self.compiled.mtp_graphs()[("prefill", size)](
                    self.weights, self.cache, tokens, np.int32(start), np.int32(part.size))
                known = ids[start + 1:start + part.size + 1].tolist()
                if start + part.size < ids.size:
                    mtp.catch_up(hidden, known, start)
                else:
                    mtp.feed(hidden, start, known)
            else:
                token, last, self.cache = self.compiled.prefill[size](self.weights, self.cache, tokens, np.int32(start),
                                                              np.int32(part.size))
            start += size
        if want_logits:
            return np.concatenate([np.asarray(c) for c in chunks]).astype(np.float32)
        return token, last

    @_serialized
    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [P, V] float32 of every prompt position through the prefill path (chunked)."""
        ids = self._check_prompt(token_ids)
        self._take_expert_stats()
        self._kv_tokens = []  # these rows will hold other tokens
        return self._guarded(lambda: self._prefill_all(ids, want_logits=True))

    def _sampling_settings(self, temperature, top_p, top_k) -> tuple:
        """A request's temperature, top_p and top_k, those left None from the model's generation_config.json."""
        defaults = self.generation_defaults.request_defaults()
        return (defaults["temperature"] if temperature is None else temperature,
                defaults["top_p"] if top_p is None else top_p, defaults["top_k"] if top_k is None else top_k)

    @_serialized
    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 64, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int = 0, draft: str = "auto",
                 spec: int = -1,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 on_token: Callable[[int], None] | None = None, json_schema=None, grammar: str | None = None,
                 **unknown) -> list[int]:
        """Continue `token_ids`; returns the new tokens (a stop token, if met, is the last). Seeded: reproducible.

        Verify windows: up to `spec` drafts (default W-1) from `draft` ('auto': 'device' for a greedy request when every
        expert is on one device and there is no MTP module, else 'ngram'; 'ngram', 'none', 'device', 'mtp' (Qwen3-Next's
        multi-token-prediction module, strata_jax/speculative/mtp.py; ngram without one), or a drafts.Drafter object) run with
        the last accepted token; greedy output is the same with or without them,
        sampled output follows the same distribution. 'device': the n-gram drafts and their acceptance run on the
        device and windows of spec+1 tokens go back to back, read one window late (strata_jax.speculative.device_drafts).
        temperature / top_p / top_k left None take the model's generation_config.json (greedy without one); the
        model's eos ids and generation_config's end a request unless stop_token_ids replace them. on_token sees
        each new token as it is accepted; raising StopRequest there ends the request at that token.
        json_schema: True (the output is a JSON object) or a JSON schema (a dict or its text) the output follows:
        each token is drawn among those the grammar allows (strata_jax/grammar.py; T=1 windows, no drafts), and
        the request ends with an end-of-sequence token after the complete JSON (or at max_new_tokens, cut).
        grammar: instead of json_schema, an llguidance grammar (grammar.tool_call_grammar, or llguidance's
        grammar_from: lark, regex, GBNF)."""
        if unknown:
            known = [p for p in inspect.signature(Engine.generate).parameters if p not in ("self", "unknown")]
            raise StrataError(f"generate() got unknown option(s) {', '.join(sorted(unknown))} "
                              f"(its options: {', '.join(known[1:])})")
        temperature, top_p, top_k = self._sampling_settings(temperature, top_p, top_k)
        if not isinstance(draft, str) and not (callable(getattr(draft, "propose", None))
                                                and callable(getattr(draft, "observe", None))):
            raise StrataError(f"draft must be 'auto', 'ngram', 'none', 'device', 'mtp' or an object with propose() and observe() "
                              f"(drafts.Drafter), not {type(draft).__name__}")
        if stop_token_ids is not None:
            stop_token_ids = check_token_ids(stop_token_ids, self.cfg.vocab_size, "stop_token_ids").tolist()
        drafter = None if isinstance(draft, str) else _UserDrafter(draft, self)  # a Drafter object (API)
        req = build(RequestOptions, dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                         top_k=top_k, seed=seed, draft=draft if drafter is None else "ngram",
                                         spec=spec, ignore_eos=ignore_eos))
        if req.draft == "auto":  # device drafts where they never cost a sync: greedy, every expert on one device
            # (sampled requests accept few drafts, and a device window is spec+1 tokens whatever it accepts)
            device = req.temperature == 0 and self.placement is None and not self.parallel and self.mtp is None
            req = dataclasses.replace(req, draft="device" if device else "ngram")
        spec = self.options.window - 1 if req.spec < 0 else req.spec
        if spec > self.options.window - 1:
            raise StrataError(f"spec {spec} needs window >= {spec + 1} (this engine compiled T=1..{self.options.window})")
        if req.draft == "none":
            spec = 0
        if self.parallel and spec > 0:
            if req.draft == "mtp" and self.mtp is not None:
                raise StrataError("draft=mtp is not wired for devices > 1 yet: use draft=ngram, device or none")
        if req.draft == "mtp" and drafter is None:
            if self.mtp is None:
                if not self._said_no_mtp:
                    log("draft=mtp: this checkpoint has no MTP module (mtp.* tensors); drafting with ngram")
                    self._said_no_mtp = True
            elif spec > 0:
                self.compiled.mtp_graphs()
                drafter = mtp_mod.MTPDrafter(self.weights, self.mtp, self.compiled.mtp_cache, self.cfg, self.options.window - 1)
        ids = self._check_prompt(token_ids)
        # stop_token_ids replace the model's eos ids; ignore_eos drops those (given stop ids still stop).
        eos = frozenset() if req.ignore_eos else self.end_of_turn_ids
        stops = set(eos if stop_token_ids is None else stop_token_ids)
        constraint = None
        wants_json = json_schema is not None and json_schema is not False
        if wants_json or grammar is not None:
            from strata_jax import grammar as grammar_mod
            if wants_json and grammar is not None:
                raise StrataError("json_schema and grammar: give one of them")
            constraint = grammar_mod.JsonConstraint(self.tokenizer, self.cfg.vocab_size,
                                                    stops or self.end_of_turn_ids, json_schema, grammar=grammar)
            spec, drafter = 0, None  # a token's mask follows from the tokens before it: no drafts
        budget = min(req.max_new_tokens, self.context - ids.size)
        sampling = SamplingParams.make(req.temperature, req.top_p, req.top_k, req.seed)
        form = form_of(req.top_k, req.top_p) if req.temperature > 0 else None
        # A sampled request's tokens follow its drafts (the accept / resample draws), and the MTP module's drafts
        # follow its KV rows: reused rows (written by another request's windows) round differently from a fresh
        # prefill's, so the same seed would give other tokens. Such a request prefills its whole prompt.
        mtp_sampled = req.draft == "mtp" and self.mtp is not None and spec > 0 and req.temperature > 0
        reuse = self._reusable(ids) if budget > 0 and not mtp_sampled else 0
        stats = RequestStats(prompt_tokens=int(ids.size), cached_tokens=reuse)
        out: list[int] = []
        self._take_expert_stats(new_request=True)
        if budget > 0:
            def on_token_guarded(token: int) -> None:
                with self._user_code():
                    on_token(token)
            # draw in the window graphs, except where the device verify graph draws (draft=device) or the MTP
            # module's drafts need the window's hidden rows
            in_graph = form is not None and constraint is None and not isinstance(drafter, mtp_mod.MTPDrafter) and not (
                drafter is None and req.draft == "device" and spec > 0)
            windows = self.compiled.sampled_windows_for(form) if in_graph else None
            self.compiled.pick_samplers(form or "sorted", sampled=form is not None, every_size=windows is None)
            request = loops.Request(ids=ids, budget=budget, stops=stops, sampling=sampling, form=form,
                                    sampled_windows=windows,
                                    spec=spec,
                                    drafter=drafter or make_drafter(req.draft), stats=stats,
                                    on_token=None if on_token is None else on_token_guarded,
                                    device_drafts=drafter is None and req.draft == "device" and constraint is None,
                                    reuse=reuse, out=out, grammar=constraint)
            self._kv_tokens = []  # until this request has finished
            try:
                self._guarded(loops.run, self._graphs(), self.state, request)
            except StopRequest:  # on_token asked to stop (a stop string, a client gone): a clean end
                pass
            finally:
                if isinstance(drafter, mtp_mod.MTPDrafter):
                    self.compiled.mtp_cache = drafter.cache  # donated along the request: keep the live one
            # Rows 0.. now hold the prompt and every generated token but the last (never fed back); rejected
            # drafts wrote only rows past those. With an approximation on, the generated tokens' rows came from
            # approximate decode windows: only the prompt's (prefilled exactly) are reused.
            approximate = self.approx.active or self.defer.active
            self._kv_tokens = ids.tolist() + ([] if approximate else out[:-1])
        stats.generated_tokens = len(out)
        self.stats.add(stats)
        return out

    # The options a batched request takes (generate's, less drafts and grammars: batched windows run spec=0)
    BATCH_OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")

    @_serialized
    def generate_batch(self, prompts: Sequence[Sequence[int]], per_prompt: Sequence[dict] | None = None,
                       on_token: Callable[[int, int], None] | None = None, return_logits: bool = False,
                       **request) -> list[list[int]]:
        """Continue several prompts at once: returns each prompt's new tokens, as `generate(prompt, **request)`
        alone returns them (greedy: the same tokens; sampled: the same tokens for the same seed; the logits equal
        to float32 rounding). Up to `max_batch` prompts (the engine's option). Each prompt is prefilled alone into
        its own KV slot, then T=1 windows run every unfinished prompt as one row of one graph (no drafts: spec=0);
        a prompt that stops (a stop token, its max_new_tokens, StopRequest from on_token) leaves the batch.

        request: generate's max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, for every
        prompt; per_prompt: a dict of those per prompt, overriding them (e.g. [{"seed": 1}, {"seed": 2}]).
        on_token(i, token): each new token of prompt i as it is read. return_logits: returns (tokens, logits) with
        logits[i] the float32 [len(tokens[i]), V] each of prompt i's tokens was chosen from.
        Statistics: engine.stats.last (the batch: its prompts' tokens, the prefills' time, the batched decode's
        wall time) and engine.stats.batch (a RequestStats per prompt)."""
        refusal = self._batch_refusal()
        if refusal:
            raise StrataError(f"generate_batch: {refusal}")
        if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__len__") or not len(prompts):
            raise StrataError("generate_batch: expected a non-empty list of prompts (each a list of token ids)")
        if len(prompts) > self.options.max_batch:
            raise StrataError(f"generate_batch: {len(prompts)} prompts but max_batch={self.options.max_batch} (the "
                              "engine's option: Engine.from_pretrained(..., max_batch=N), --max_batch)")
        if per_prompt is not None and (isinstance(per_prompt, (str, dict)) or not hasattr(per_prompt, "__len__")
                                       or len(per_prompt) != len(prompts)
                                       or not all(isinstance(p, dict) for p in per_prompt)):
            raise StrataError(f"generate_batch: per_prompt must be a list of {len(prompts)} dicts, one per prompt")
        for given in [request] + list(per_prompt or []):
            check_batch_options("generate_batch()", given)
        rows = []
        for i, prompt in enumerate(prompts):
            options = {**request, **(per_prompt[i] if per_prompt else {})}
            rows.append(self._batch_request(prompt, i, on_token, return_logits, **options))
        if self.state.batch is None:  # max_batch 1: its one slot made on first use
            self.state.batch = self._init_batch_cache()
        self._take_expert_stats(new_request=True)
        self._kv_tokens = []  # the engine's cache will hold the last prompt's rows
        try:
            decoder = self._guarded(loops.run_batch, self._graphs(), self.state, rows)
            self.stats.batch_windows += decoder.windows_run
            self.stats.batch_reused_tokens += decoder.reused_tokens
            self.stats.batch_rows_max = max(self.stats.batch_rows_max, decoder.most_rows)
        finally:
            for r in rows:
                r.stats.generated_tokens = len(r.out)
        prefilled = [r for r in rows if r.out]
        self._kv_tokens = prefilled[-1].ids.tolist() if prefilled else []  # the last prefill's rows, not its output
        total = RequestStats(prompt_tokens=sum(r.stats.prompt_tokens for r in rows),
                             cached_tokens=sum(r.stats.cached_tokens for r in rows),
                             prefill_s=sum(r.stats.prefill_s for r in rows),
                             generated_tokens=sum(len(r.out) for r in rows),
                             decode_s=max(r.stats.decode_s for r in rows),
                             windows=max(r.stats.windows for r in rows),
                             window_tokens=sum(r.stats.window_tokens for r in rows))
        self.stats.add(total)
        self.stats.batch = [r.stats for r in rows]
        outs = [r.out for r in rows]
        if return_logits:
            vocab = self.cfg.vocab_size
            return outs, [np.stack(r.logits) if r.logits else np.zeros((0, vocab), np.float32) for r in rows]
        return outs

    def _batch_request(self, prompt, index: int, on_token, return_logits: bool, max_new_tokens: int = 64,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       seed: int = 0, stop_token_ids: Sequence[int] | None = None,
                       ignore_eos: bool = False) -> loops.Request:
        """One prompt of generate_batch as a loops.Request (spec 0), its options checked and defaulted as generate
        does."""
        temperature, top_p, top_k = self._sampling_settings(temperature, top_p, top_k)
        req = build(RequestOptions, dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                         top_k=top_k, seed=seed, ignore_eos=ignore_eos))
        ids = check_token_ids(prompt, self.cfg.vocab_size, f"prompt {index}")
        if ids.size == 0 or ids.size >= self.context:
            raise StrataError(f"prompt {index} has {ids.size} tokens: it needs 1..{self.context - 1} (the context "
                              f"holds {self.context}; at least one must be left to generate)")
        if stop_token_ids is not None:
            stops = set(check_token_ids(stop_token_ids, self.cfg.vocab_size, "stop_token_ids").tolist())
        else:
            stops = set() if req.ignore_eos else set(self.end_of_turn_ids)
        budget = min(req.max_new_tokens, self.context - ids.size)  # 0: nothing to run (as generate)
        stats = RequestStats(prompt_tokens=int(ids.size))
        box = []  # the request, for the callback below (made after it)

        def emitted(token: int) -> None:
            try:
                with self._user_code():
                    on_token(index, token)
            except StopRequest:  # this prompt ends here; the others go on
                box[0].budget = len(box[0].out)
        form = form_of(req.top_k, req.top_p) if req.temperature > 0 else None
        request = loops.Request(ids=ids, budget=budget, stops=stops, form=form,
                                sampling=SamplingParams.make(req.temperature, req.top_p, req.top_k, req.seed),
                                spec=0, drafter=make_drafter("none"), stats=stats,
                                on_token=None if on_token is None else emitted,
                                logits=[] if return_logits else None)
        box.append(request)
        return request

    def batch_session(self) -> "BatchSession":
        """Continuous batching (the server's, --max_batch > 1): a BatchSession, whose requests join and leave a
        running batch between windows. Refused in one line where batched windows cannot run (_batch_refusal)."""
        refusal = self._batch_refusal()
        if refusal:
            raise StrataError(f"batching: {refusal}")
        return BatchSession(self)

    def stream(self, token_ids: Sequence[int], **request) -> Iterator[int]:
        """`generate` as a generator: each new token id as soon as it is accepted (same options, same tokens).
        Closing the generator early (break, or a client gone) stops the request at its next token."""
        self._refuse_reentry("stream")  # its worker thread would wait for the running request for good
        tokens: queue.Queue = queue.Queue()
        closed = threading.Event()
        done = object()

        def on_token(token: int) -> None:
            if closed.is_set():
                raise StopRequest
            tokens.put(token)

        def run() -> None:
            try:
                self.generate(token_ids, on_token=on_token, **request)
                tokens.put(done)
            except BaseException as e:  # noqa: BLE001 (handed to the consumer)
                tokens.put(e)

        worker = threading.Thread(target=run, name="strata-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = tokens.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            closed.set()
            worker.join()

    def _reusable(self, ids: np.ndarray) -> int:
        """How many leading prompt tokens already have their KV rows in the cache (the last request's prompt and
        output): the common prefix, less one (the last prompt token is always run, for its logits)."""
        if not self.options.prefix_reuse or not self._kv_tokens:
            return 0
        cached = np.asarray(self._kv_tokens[:ids.size - 1], np.int32)
        differ = np.flatnonzero(cached != ids[:cached.size])
        common = int(differ[0]) if differ.size else int(cached.size)
        if self.cache.state_pos is not None:
            # DeltaNet layers: the run may start at `first` only where the state after first-1 is kept.
            kept = [int(p) + 1 for p in np.asarray(self.cache.state_pos) if 0 <= p < common]
            common = max(kept, default=0)
        return common

    def _checked(self, token: int, position: int) -> int:
        """A token read from a graph; NON_FINITE (the graph saw NaN or inf in the logits) ends the request."""
        if token == NON_FINITE:
            hint = ("; bfloat16 may overflow where float32 does not: try --dtype=float32"
                    if self.dtype != jnp.float32 else "")
            raise StrataError(f"non-finite logits (NaN or inf) for the token at position {position}: the request "
                              f"ends{hint}")
        return token

    def attach_mtp(self, weights) -> None:
        """Qwen3-Next's MTP module (checkpoint.load_mtp): `generate(draft="mtp")` drafts with it."""
        self.mtp = weights

    def _graphs(self) -> loops.Graphs:
        """What this request's loops may call: the window tables, the samplers compiled.pick_samplers chose for it,
        the graphs compiled on first use, and the engine's steps between windows."""
        c = self.compiled
        fills = bool(self.placement and self.placement.fills_from_prefill)  # the slots taken from each prefill
        return loops.Graphs(
            decode=c.decode, sample=c.sample, verify=c.verify, device_verify=c.device_verify_graph,
            mtp_fused=lambda t: c.mtp_graphs()[("fused", t)], mtp_hidden=c.mtp_hidden_window,
            prefill=self._prefill_all, checked=self._checked, take_expert_stats=self._take_expert_stats,
            after_request=self._adapt_pcie_frac,
            fill_static_slots=self._fill_static_slots if fills else None,
            refresh_slots=functools.partial(self._fill_static_slots, keep_usage=True)
            if fills and self.options.slot_refresh else None,
            refresh_every=self.options.slot_refresh,
            context=self.context, vocab_size=self.cfg.vocab_size,
            batch_windows=c.batch_windows_for, put_slot=c.put_slot,
            form_samplers=lambda form: c.samplers[form].sample, batch_slots=self.options.max_batch,
            prefill_sizes=lambda n: plan_mod.chunk_sizes_for(n, self.chunks),
            get_slot=c.get_slot, prefix_reuse=self.options.prefix_reuse,
            exact_windows=not (self.approx.active or self.defer.active))

    @_serialized
    def score(self, token_ids: Sequence[int], window: int | None = None) -> np.ndarray:
        """Teacher-forced logits [N, V] float32 of every position, through the decode-window graphs of size
        `window` (default: the engine's W); row i is the distribution of token i+1."""
        ids = self._check_prompt(token_ids)
        w = self.options.window if window is None else window
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise StrataError(f"window must be an integer (1..{self.options.window}), not {w!r}")
        if not 1 <= w <= self.options.window:
            raise StrataError(f"window {w} is not compiled (1..{self.options.window})")
        self._take_expert_stats()
        self._kv_tokens = []

        def run():
            rows = []
            for start in range(0, ids.size, w):
                part = ids[start:start + w]
                _, logits, self.cache = self.compiled.decode[part.size](self.weights, self.cache, part, np.int32(start))
                rows.append(logits)  # read after the loop, so windows queue back to back
            return np.concatenate([np.asarray(r) for r in rows]).astype(np.float32)
        logits = self._guarded(run)
        self.stats.last = RequestStats(prompt_tokens=int(ids.size), decode_experts=self._take_expert_stats())
        return logits

    @_serialized
    def write_logpos(self, token_ids: Sequence[int], path: str | Path, read: str = "windows",
                     window: int | None = None, top: int = 20, meta: dict | None = None) -> int:
        """Teacher-forced log-probs of a known text to a logpos file (strata_jax.io.logpos): for every position, the
        top-`top` next-token log-probs and the known next token's. read='windows': every position takes the decode
        path (verify windows of `window` tokens, default W, with this engine's placement and approximations);
        'prefill': the prompt path. Returns the positions written."""
        from strata_jax.io.logpos import LogposWriter
        if read not in ("windows", "prefill"):
            raise StrataError(f"logpos read must be windows or prefill, not {read!r}")
        ids = self._check_prompt(token_ids)
        w = self.options.window if window is None else window
        logits = self.score(ids, window=w) if read == "windows" else self.prefill_logits(ids)
        info = dict(model=str(self.model_dir or "random"), vocab=self.cfg.vocab_size, read=read,
                    window=w if read == "windows" else None, dtype=self.options.dtype,
                    expert_cache_slots=self.placement.slots if self.placement else "all",
                    pcie_frac=self.placement.pcie_frac if self.placement else None,
                    route=dataclasses.asdict(self.approx), defer_cpu=dataclasses.asdict(self.defer), **(meta or {}))
        try:
            with LogposWriter(path, top=top, meta=info) as writer:
                writer.write_many(0, logits[:-1], ids[1:])
        except OSError as e:  # a full disk: no truncated file left to be read as a whole one
            Path(path).unlink(missing_ok=True)
            raise StrataError(f"cannot write the logpos file {path}: {e.strerror or e} (nothing was kept)") from None
        return int(ids.size - 1)

    # ---- text helpers ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise StrataError(f"no tokenizer.json in {self.model_dir}: give token ids instead of text")
        if not isinstance(text, str):
            raise StrataError(f"encode: expected text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # e.g. invalid UTF-8 bytes on the command line, kept as surrogates
            raise StrataError("the text is not valid UTF-8") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end a request by default: config.json's eos ids and generation_config.json's."""
        return frozenset(self.cfg.eos_token_ids + self.generation_defaults.eos_token_ids)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """The conversation through the model's chat template, tokenized as transformers' apply_chat_template
        does (no special tokens added: the template writes them)."""
        if self.chat_template is None:
            raise StrataError(f"{self.model_dir} has no chat template (chat_template in tokenizer_config.json, or "
                              "chat_template.jinja): give a prompt instead")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def chat(self, messages: list[dict], **request) -> str:
        """The assistant's reply to `messages` ([{'role': 'user', 'content': ...}, ...]) as text (its end-of-turn
        token left out); request options as generate's."""
        out = self.generate(self.chat_ids(messages), **request)
        stops = set(request.get("stop_token_ids") or ()) or self.end_of_turn_ids
        return self.decode(out[:-1] if out and out[-1] in stops else out)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise StrataError(f"no tokenizer.json in {self.model_dir}")
        return self.tokenizer.decode(check_token_ids(ids, self.cfg.vocab_size, "decode").tolist())


def check_batch_options(what: str, given: dict) -> None:
    """One line naming the options a batched request does not take (Engine.BATCH_OPTIONS are those it takes)."""
    unknown = sorted(set(given) - set(Engine.BATCH_OPTIONS))
    if unknown:
        raise StrataError(f"{what} got unknown option(s) {', '.join(unknown)} (its options: "
                          f"{', '.join(Engine.BATCH_OPTIONS)}; batched windows run without drafts or grammars)")


class BatchSession:
    """Requests that join and leave a running batch between windows (loops.BatchDecoder over an engine's batch
    cache, `Engine.batch_session()`): `request` makes one (generate_batch's options, checked and defaulted as
    there; its on_token(token) sees each token, StopRequest from it ends that request alone), `admit` prefills it
    alone into a free KV slot (prefix reuse as generate: the engine's cache keeps the last prompt's rows, and each
    freed slot its last request's: the one sharing the longest prefix is taken, loops.BatchDecoder) and hands
    its first token to on_token, `step` runs one window of every live request and returns those that left. Each
    request's tokens are those of generate(spec=0) alone, whoever runs beside it and whenever it joined.

    Each call holds the engine's lock only for itself (and `begin` until the admission's last `advance`): between
    two calls the engine serves its other calls (generate, score, ...), which use the engine's own cache, never
    the batch's slots. One thread drives a session. A failed window, or a reset of the engine's caches by another call's failure, ends every live
    request: the call raises and the session is `broken` (start another)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        with engine._lock:
            if engine.state.batch is None:
                engine.state.batch = engine._init_batch_cache()
            self.decoder = loops.BatchDecoder(engine._graphs(), engine.state)
            self.resets = engine._resets
        self.broken: str | None = None
        self._counted = 0  # the decoder's windows already added to engine.stats.batch_windows
        self._reused = 0  # the decoder's reused prompt tokens already added to engine.stats.batch_reused_tokens

    @property
    def free(self) -> int:
        """KV slots no live request owns: how many more requests admit takes now."""
        return len(self.decoder.free)

    @property
    def active(self) -> bool:
        """Whether step has work (a live request, or a window in flight)."""
        return self.decoder.active

    @property
    def live(self) -> list[loops.Request]:
        return list(self.decoder.live.values())

    def request(self, prompt, on_token: Callable[[int], None] | None = None, **options) -> loops.Request:
        check_batch_options("a batched request", options)
        return self.engine._batch_request(prompt, 0, None if on_token is None else (lambda i, t: on_token(t)),
                                          False, **options)

    def _check(self) -> None:
        if self.broken is None and self.engine._resets != self.resets:
            self.broken = "the engine's caches were reset (another call failed): the batch's requests are lost"
        if self.broken is not None:
            raise StrataError(f"batch session: {self.broken}")

    def _call(self, fn, *args, keeps: tuple = ()):
        """fn under the engine's lock and failure recovery; a failure breaks the session, except those of `keeps`
        (a request's own failure before it touched the batch cache)."""
        e = self.engine
        with e._lock:
            self._check()
            try:
                return e._guarded(fn, *args)
            except keeps:
                raise
            except BaseException as exc:
                self.broken = f"{type(exc).__name__}: {exc}".splitlines()[0]
                if self.decoder.admitting is not None:  # a window failed during an admission: begin's lock goes
                    self.decoder.admitting = None
                    e._lock.release()
                if e.state.batch is None and e._resets == self.resets:  # the donated batch cache is gone
                    e._reset_state()
                raise
            finally:
                e.stats.batch_windows += self.decoder.windows_run - self._counted
                self._counted = self.decoder.windows_run
                e.stats.batch_reused_tokens += self.decoder.reused_tokens - self._reused
                self._reused = self.decoder.reused_tokens
                e.stats.batch_rows_max = max(e.stats.batch_rows_max, self.decoder.most_rows)

    def admit(self, request: loops.Request) -> bool:
        """Prefill `request` into a free KV slot (every chunk now), its first token to its on_token: True when it
        decodes on in the batch, False when it has ended (its first token stopped it, or max_new_tokens is 0; its
        stats counted)."""
        if not self.begin(request):
            return False
        while (live := self.advance()) is None:
            pass
        return live

    @property
    def admitting(self) -> loops.Request | None:
        """The request being admitted chunk by chunk (begin / advance), or None."""
        return None if self.decoder.admitting is None else self.decoder.admitting[0]

    def begin(self, request: loops.Request) -> bool:
        """Start admitting `request` into a free KV slot: its prefill chunks then run one an `advance`, between
        windows. The engine's lock stays held by this thread until the admission ends (the engine's cache holds its
        rows meanwhile; this thread must not call the engine otherwise until then). False: nothing to run
        (max_new_tokens 0; its stats counted)."""
        e = self.engine
        with e._lock:
            self._check()
            if self.decoder.admitting is not None:
                raise StrataError("batch session: an admission is running (advance it first)")
            if not self.decoder.free:
                raise StrataError(f"batch session: every KV slot is taken (max_batch={e.options.max_batch})")
            reuse = e._reusable(request.ids) if request.budget > 0 else 0
            request.reuse = request.stats.cached_tokens = reuse
            # (a freed slot's kept prefix, longer than the engine's cache holds, is copied into that cache here)
            if not e._guarded(self.decoder.begin, request):
                self._done(request)
                return False
            e._kv_tokens = []  # the engine's cache will hold this prompt's rows
            e._lock.acquire()  # held until the admission ends (advance)
        return True

    def advance(self):
        """The admission's next prefill chunk; after the last: True when the request decodes on in the batch,
        False when it has ended at its first token; None while chunks remain."""
        e = self.engine
        request = self.admitting
        if request is None:
            raise StrataError("batch session: no admission is running (begin one)")
        ended = True
        try:
            # non-finite logits in its prefill: this request's failure (the batch cache is touched after)
            live = self._call(self.decoder.advance, keeps=(StrataError,))
            ended = live is not None
        finally:
            if ended:
                e._lock.release()  # begin's
        if live is None:
            return None
        e._kv_tokens = request.ids.tolist() if request.out else []  # the prefill's rows, not the output's
        if not live:
            self._done(request)
        return live

    def step(self) -> list[loops.Request]:
        """One window of every live request (and the read of the oldest one in flight): the requests that left."""
        left = self._call(self.decoder.step)
        for r in left:
            self._done(r)
        return left

    def drop(self, request: loops.Request) -> None:
        """End a live request now (a consumer gone); its tokens in flight are dropped."""
        with self.engine._lock:
            self.decoder.drop(request)
        self._done(request)

    def _done(self, r: loops.Request) -> None:
        r.stats.generated_tokens = len(r.out)
        self.engine.stats.add(r.stats)


class StopRequest(Exception):
    """Raise it in generate's on_token to end the request there, cleanly: the tokens so far are returned and
    counted, and their KV rows stay for prefix reuse (a stop string met, a consumer gone)."""


def _interrupted(exc: BaseException) -> bool:
    """A KeyboardInterrupt behind `exc`: chained, or named in the text of the JAX runtime error that wraps a
    callback's exception."""
    seen = []
    while exc is not None and all(exc is not s for s in seen):
        if isinstance(exc, KeyboardInterrupt) or "KeyboardInterrupt" in str(exc):
            return True
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return False


def check_token_ids(ids, vocab_size: int, what: str = "token ids") -> np.ndarray:
    """A 1-D sequence of integer token ids in 0..vocab_size-1 -> int32 array, or one StrataError line. Nothing is
    converted silently: floats (1.7), bools, strings, None, nested lists and 2-D arrays are refused, not truncated
    or flattened."""
    # A dict (its keys), a set (no order), bytes-like (its bytes) iterate as ints: not token ids either.
    if ids is None or isinstance(ids, (str, bytes, bytearray, memoryview, dict, set, frozenset)) or \
            not hasattr(ids, "__len__"):
        raise StrataError(f"{what}: expected a list of integer token ids, got {type(ids).__name__}"
                          + (" (encode text first: engine.encode(text))" if isinstance(ids, (str, bytes, bytearray))
                             else ""))
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise StrataError(f"{what}: expected a 1-D sequence of token ids, got an array of shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise StrataError(f"{what}: expected integer token ids, got an array of {ids.dtype}")
        values = [int(v) for v in ids.tolist()]
    else:
        values = []
        for v in ids:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise StrataError(f"{what}: expected integer token ids, got {v!r} ({type(v).__name__})")
            values.append(int(v))
    bad = [v for v in values if not 0 <= v < vocab_size]
    if bad:
        raise StrataError(f"{what}: token ids must be in 0..{vocab_size - 1} (got {bad[0]})")
    return np.asarray(values, np.int32).reshape(-1)


