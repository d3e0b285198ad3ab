"""What an engine's requests may use, decided once from the model shape, the options and the machine: the
context and the prefill chunks, the kernels, whether the layers scan, the slot count before the weights are read,
and the device bytes held back for the KV cache and the prefill's activations. `make_plan` gathers the decisions
into one `Plan`, which the engine, its graphs and the CLI read; nothing else resolves these options.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from strata_jax.engine import parallel as parallel_mod
from strata_jax.errors import StrataError
from strata_jax.model.config import ModelConfig
from strata_jax.model.kv_cache import cache_bytes
from strata_jax.model.weights import can_stack
from strata_jax.offload import placement as placement_mod
from strata_jax.offload import slots as slots_mod
from strata_jax.options import EngineOptions


@dataclasses.dataclass(frozen=True)
class Plan:
    """The engine's resources, resolved once (make_plan)."""
    context: int                 # positions a request may use (prompt + new tokens)
    context_why: str             # where the context came from (the start-up line)
    chunks: tuple[int, ...]      # prefill chunk sizes, largest first (one graph each)
    ring: int                    # DeltaNet states kept: more than a window (verify windows, prefix reuse)
    expert_kernel: str           # 'pallas' | 'xla'
    attention_kernel: str
    dense_kernel: str
    delta_kernel: str
    route_kernel: str            # the decode windows' exact route: 'pallas' | 'xla'
    scanned: bool                # one scanned layer body (all resident, or offload through the native calls)
    scanned_offload: bool        # ... over the stacked slot caches
    kv_length: int               # the KV cache's rows: the context, a padded chunk's slack, the kernel's blocks

    @property
    def chunk(self) -> int:
        return self.chunks[0]

    def window_kernels(self) -> dict:
        """The decode windows' kernel switches (keyword arguments of the graphs.jit_*_window builders)."""
        return dict(attention_kernel=self.attention_kernel == "pallas", dense_kernel=self.dense_kernel == "pallas",
                    delta_kernel=self.delta_kernel == "pallas")


def make_plan(cfg: ModelConfig, opts: EngineOptions, placement=None, defer=None) -> Plan:
    """Every resource decision of an engine, once. placement: the built offload placement (None: all resident);
    defer: the deferral's parsed switches (it keeps the unrolled graph)."""
    context, why = resolve_context(cfg, opts)
    _, chunks = context_and_chunks(cfg, opts)
    expert, attention, dense = resolve_kernels(opts, cfg)
    scanned_offload = placement is not None and scans_offload(cfg, opts, placement, defer)
    scanned = (placement is None and scans(cfg, opts)) or scanned_offload
    length = context + chunks[0]  # slack: a padded prefill chunk writes up to a chunk past the last real position
    if attention == "pallas":
        length = -(-length // 64) * 64  # the kernel's key blocks divide the cache length
    return Plan(context=context, context_why=why, chunks=chunks, ring=opts.window + 1, expert_kernel=expert,
                attention_kernel=attention, dense_kernel=dense, delta_kernel=resolve_delta_kernel(opts, cfg),
                route_kernel=opts.route_kernel,
                scanned=scanned, scanned_offload=scanned_offload, kv_length=length)


def resolve_kernels(opts: EngineOptions, cfg: ModelConfig) -> tuple[str, str, str]:
    """(expert kernel, attention kernel, dense kernel): 'auto' is pallas on a GPU in bfloat16 (the attention kernel
    also needs a power-of-2 head_dim >= 16), else xla. float32 keeps the XLA path: the exactness checks' dtype."""
    fast = jax.default_backend() == "gpu" and opts.dtype == "bfloat16"
    d = cfg.head_dim
    expert = ("pallas" if fast else "xla") if opts.expert_kernel == "auto" else opts.expert_kernel
    attention = opts.attention_kernel
    if attention == "auto":
        attention = "pallas" if fast and d >= 16 and not d & (d - 1) else "xla"
    dense = ("pallas" if fast else "xla") if opts.dense_kernel == "auto" else opts.dense_kernel
    return expert, attention, dense


def resolve_delta_kernel(opts: EngineOptions, cfg: ModelConfig) -> str:
    """The DeltaNet decode rule: 'auto' is pallas on a GPU in bfloat16 when both head dims are powers of 2, else xla
    (the H200, 2026-11-30: 20 us against 30-35 us at T=1, 32-35 against 108-119 us at T=4, for the 80B shape's 36
    layers; benchmarks/delta_bench.py)."""
    dims = (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    pow2 = not any(d & (d - 1) for d in dims)
    fast = jax.default_backend() == "gpu" and opts.dtype == "bfloat16" and pow2
    kernel = ("pallas" if fast else "xla") if opts.delta_kernel == "auto" else opts.delta_kernel
    if kernel == "pallas" and cfg.has_linear and not pow2:
        raise StrataError(f"delta_kernel=pallas needs linear_key_head_dim and linear_value_head_dim powers of 2 "
                          f"(this model: {dims[0]}, {dims[1]})")
    return kernel


def plan_slots(cfg: ModelConfig, opts: EngineOptions):
    """Before the weights are read: the slot count (None: every expert on the device), why, and where the host
    copies of the experts go (placement_mod.plan_placement); with several devices (`devices`) the slots count
    their memory together."""
    devices = parallel_mod.devices_for(opts)
    return placement_mod.plan_placement(cfg, opts, device_reserve_bytes(cfg, opts), len(devices) if devices else 1,
                                        parallel_mod.layer_device(cfg, opts))


def kv_copies(opts: EngineOptions) -> int:
    """KV caches of the context an engine holds: its own, and with max_batch > 1 a slot per batched sequence."""
    return 1 + opts.max_batch if opts.max_batch > 1 else 1


def device_reserve_bytes(cfg: ModelConfig, opts: EngineOptions) -> int:
    """Device bytes kept beside the weights before the expert slots are counted (placement_mod.plan_placement):
    the KV cache and the largest prefill chunk's transient activations."""
    context, chunk = context_and_chunk(cfg, opts)
    itemsize = jnp.dtype(opts.dtype).itemsize
    kv_bytes = kv_copies(opts) * cache_bytes(cfg, context + chunk, itemsize, opts.window + 1, opts.kv_dtype)
    # the largest prefill chunk's transient activations are reserved beside the KV cache
    return kv_bytes + prefill_activation_bytes(cfg, chunk, context + chunk,
                                               resolve_kernels(opts, cfg)[1] == "pallas")


def scans(cfg: ModelConfig, opts: EngineOptions) -> bool:
    """Whether the layers run as one scanned body over stacked weights when every expert is resident: layer_loop
    scan and one kind of layer (quantized experts' scales are stacked and read by layer like their q)."""
    return opts.layer_loop == "scan" and can_stack(cfg)


def scans_offload(cfg: ModelConfig, opts: EngineOptions, placement, defer) -> bool:
    """Whether an offloaded model runs its decode windows as one scanned body (transformer.offload_layers): layer_loop
    scan and one kind of layer, one device, the native offload calls (their plan names the layer, so a traced layer
    index serves); with the deferral, decode windows that fit one pair of calls (slots.native_defer_fits: the
    scanned body carries a layer's late job to the next layer), else the unrolled graph's io_callbacks. Quantized
    experts scan under either expert kernel: the Pallas kernel takes their scales by window position
    (pallas_kernels/expert_ffn.py's scale_ids), not by slot."""
    return (scans(cfg, opts) and placement.native
            and (not defer.active or slots_mod.native_defer_fits(cfg, opts.window))
            and parallel_mod.devices_for(opts) is None)


SMALL_CHUNK, LARGE_CHUNK = 64, 1024  # prefill_chunk=auto: the tail's chunk, and the largest on a GPU


def context_and_chunk(cfg: ModelConfig, opts: EngineOptions) -> tuple[int, int]:
    """The context and the largest prefill chunk (the KV cache's slack past the context)."""
    context, chunks = context_and_chunks(cfg, opts)
    return context, chunks[0]


def context_and_chunks(cfg: ModelConfig, opts: EngineOptions) -> tuple[int, tuple[int, ...]]:
    """The context and the prefill chunk sizes, largest first (one graph each). prefill_chunk=N: (N,). auto: on a
    GPU (LARGE, SMALL), LARGE halved until the chunk's transient activations fit an eighth of the device's memory
    (a chunk of 1024 runs the 30B shape's prefill 3.7x faster than one of 64 on the H200); elsewhere (SMALL,)."""
    context, _ = resolve_context(cfg, opts)
    if opts.prefill_chunk:
        return context, (min(opts.prefill_chunk, context),)
    small = min(SMALL_CHUNK, context)
    if jax.default_backend() != "gpu":
        return context, (small,)
    large = min(LARGE_CHUNK, 1 << (context.bit_length() - 1))  # a power of 2 <= context
    budget = _device_memory_bytes() // 8
    kernel = resolve_kernels(opts, cfg)[1] == "pallas"
    while large > small and prefill_activation_bytes(cfg, large, context + large, kernel) > budget:
        large //= 2
    return context, ((large, small) if large > small else (small,))


AUTO_CONTEXT_XLA = 4096  # context=0 where the attention reads the whole static cache every step (XLA's einsums)


def resolve_context(cfg: ModelConfig, opts: EngineOptions) -> tuple[int, str]:
    """The KV cache's context in tokens, and why. context=0 (auto): where the attention is the Pallas kernel (a GPU
    in bf16: prefill and decode read the cache only up to their position, so a long cache costs memory, not
    time), the model's max_position_embeddings, halved while its KV cache would take more than an eighth of the
    device's memory; elsewhere min(max_position_embeddings, 4096)."""
    if opts.context:
        return opts.context, "--context"
    if jax.default_backend() != "gpu" or resolve_kernels(opts, cfg)[1] != "pallas":
        context = min(cfg.max_position_embeddings, AUTO_CONTEXT_XLA)
        return context, (f"auto: max_position_embeddings {cfg.max_position_embeddings}, at most {AUTO_CONTEXT_XLA} "
                         f"where the attention reads the whole cache (XLA)")
    itemsize = jnp.dtype(opts.dtype).itemsize
    budget = _device_memory_bytes() // 8
    context = cfg.max_position_embeddings
    copies = kv_copies(opts)  # max_batch > 1: the batch's slots share the budget
    while context > AUTO_CONTEXT_XLA and copies * cache_bytes(cfg, context + LARGE_CHUNK, itemsize, opts.window + 1,
                                                                    opts.kv_dtype) > budget:
        context //= 2
    kv = copies * cache_bytes(cfg, context + LARGE_CHUNK, itemsize, opts.window + 1, opts.kv_dtype)
    halved = "" if context == cfg.max_position_embeddings else ", halved to fit"
    return context, (f"auto: max_position_embeddings {cfg.max_position_embeddings}{halved}; KV cache "
                     f"{kv / 2**30:.1f} GiB, at most an eighth of the device's {_device_memory_bytes() / 2**30:.0f} GiB")


def prefill_activation_bytes(cfg: ModelConfig, chunk: int, cache_len: int, kernel_attention: bool = False) -> int:
    """The largest transient arrays of a prefill chunk, float32: the XLA attention's scores and probabilities over
    the static cache [C, Nq, S] (the Pallas kernel keeps them in registers: its output [C, Nq, D] only), and the
    MoE's per-expert rows [N, C, 2I + H] (N distinct experts)."""
    attention = (chunk * cfg.num_heads * cfg.head_dim * 4 if kernel_attention
                 else 2 * chunk * cfg.num_heads * cache_len * 4)
    n = min(cfg.num_experts, chunk * cfg.num_experts_per_tok) if any(cfg.sparse_layers) else 0
    experts = n * chunk * (2 * cfg.moe_intermediate_size + cfg.hidden_size) * 4
    return attention + experts


def _device_memory_bytes() -> int:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # a backend without memory_stats: assume an H200's share is not known, stay modest
        return 16 * 2**30


def chunk_sizes_for(n: int, chunks: tuple[int, ...]) -> list[int]:
    """The chunk size of each prefill step for n prompt tokens: the largest size while at least a quarter of it
    remains (a padded large chunk is cheaper than many small ones), then the next size down; the smallest takes
    the rest."""
    sizes, left = [], n
    while left > 0:
        size = next((c for c in chunks if left >= c // 4), chunks[-1])
        sizes.append(size)
        left -= size
    return sizes
