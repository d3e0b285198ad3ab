"""Past one device: the model split over several devices with JAX's own SPMD machinery (`devices` > 1).

Two splits (`parallel=`):

* `layers` (`LayerSplit`): device d holds a contiguous block of layers (`layer_blocks`): their weights, KV cache
  and, with offload, their slot caches and host copies of the experts (pinned in that device's host memory; the
  host pool is shared: the stages run one after the other, so each has all of it while it runs). The loaders make
  or read each layer on its device (`layer_device`, `weight_placer`): no device ever holds more than its block. A
  window runs stage by stage, one jitted graph per stage and window size: embed on the first stage, the block's
  layers (every expert resident: `transformer.scan_layers` over the block's stacked weights; offload: `transformer.run_layers`
  over its per-layer list, the single-device graphs' own layer bodies), the activations [T, H] `device_put` to the
  next stage's device, final norm + lm_head on the last. A block's last layer is never deferred
  (OffloadedExperts.no_defer): its rows must be in the activations that leave the device. The stages do not
  overlap: the split buys memory (each device holds 1/D of the model), not speed. draft=device's verify window
  (`LayerSplit.device_verify`): drafts proposed on the first device, the window through the stages, accepted back
  on the first device, all queued without the host.
* `experts` (`ExpertSplit`): a `Mesh` over the devices with one axis 'experts'; each MoE layer's experts [E, ...]
  (stacked: [L, E, ...]) sharded on the expert axis (`NamedSharding`), everything else (attention, norms, router,
  embeddings, KV cache) replicated. The whole window runs in `jax.shard_map`: each device routes every token (the
  router is replicated), runs its own experts for all T tokens with the other devices' combine weights masked to
  zero (`ShardedExperts`), and a `psum` over 'experts' adds the devices' rows. With the tokens replicated this is
  the dispatch/combine of an all-to-all (dispatch needs no traffic: every device has every token; the combine is
  the psum, [T, H] per layer), exact up to the order of the sum. Each device reads only 1/D of the experts a window
  needs; the checkpoint loader splits each expert stack as it reads it (`weight_placer`). draft=device's verify
  window runs in the same shard_map (`device_verify`). With offload (`ShardedOffloadedExperts`) each device keeps its E/D experts of every MoE layer in its host
  memory and its own slot cache of S/D slots over them ([D, ...] leaves split on 'experts'), fetches its misses over
  PCIe and adds its rows in the same psum: every miss fetched (pcie_frac=1), lru, the exact routing (the host pool,
  the static policy, the route switches and the deferral run with parallel=layers: one line).

Both return the engine's graph signatures (`window(t)`: (weights, cache, tokens, pos) -> (argmax, logits, cache);
`prefill(c)` and `prefill_logits(c)`), so `Engine` swaps them in for its own graphs (`attach`); the greedy tokens and
logits come back on the first device, where the engine's samplers run.

Several processes (hosts), parallel=experts only: call `jax.distributed.initialize(coordinator, num_processes,
process_id)` first (on the CPU the collectives are gloo's, jax 0.11's default `jax_cpu_collectives_implementation`),
then build the same engine in every process; devices=all then spans every process. Every process runs the same host loop
on the same tokens: each builds the same weights, places its own devices' part of them, and reads the replicated
greedy tokens and logits from its own first device (`local_replica`), so every process samples the same tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from strata_jax.pallas_kernels.expert_ffn import expert_ffn as expert_ffn_kernel
from strata_jax.engine import graphs
from strata_jax.model import transformer
from strata_jax.model.kv_cache import KVCache
from strata_jax.model.weights import LayerWeights, Weights, stack_layers
from strata_jax.model import moe
from strata_jax.errors import StrataError
from strata_jax.offload import slots as slots_mod

AXIS = "experts"


def devices_for(opts) -> list | None:
    """The devices of `opts.devices` (None: one device, the single-device engine). One line when more are asked
    for than JAX sees, when offload is asked for with parallel=experts, or when several processes (jax.distributed)
    are asked for anything but parallel=experts over every device."""
    if str(opts.devices) == "1":
        return None
    seen = jax.devices()
    n = len(seen) if opts.devices == "all" else int(opts.devices)
    if n > len(seen):
        raise StrataError(f"devices={opts.devices}: JAX sees {len(seen)} {jax.default_backend()} device(s)")
    if jax.process_count() > 1 and (opts.parallel != "experts" or n != len(seen)):
        raise StrataError(f"devices={opts.devices} parallel={opts.parallel} over {jax.process_count()} processes: "
                          f"several processes run parallel=experts over every device (devices=all)")
    if n == 1:
        return None
    if opts.parallel == "experts" and opts.expert_cache_slots != "all" and (opts.cache_policy == "static"
                                                                             or jax.process_count() > 1):
        raise StrataError(f"devices={n} parallel=experts with offload runs cache_policy=lru in one process "
                          "(the static policy and several processes: parallel=layers, or expert_cache_slots=all)")
    if opts.parallel == "experts" and opts.pcie_frac not in ("auto", "1", "1.0"):
        raise StrataError(f"devices={n} parallel=experts with pcie_frac={opts.pcie_frac}: the experts split fetches "
                          "every miss over PCIe (pcie_frac=1); the host pool runs with parallel=layers")
    return seen[:n]


def layer_blocks(n_layers: int, n_devices: int) -> list[tuple[int, int]]:
    """parallel=layers: the contiguous block [a, b) of layers each device holds (as even as the count allows)."""
    cuts = [round(i * n_layers / n_devices) for i in range(n_devices + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def layer_device(cfg, opts):
    """parallel=layers over several devices: layer i -> the device of its block (the loaders make or read each layer
    there, so no device holds more than its block); None otherwise."""
    devices = devices_for(opts)
    if devices is None or opts.parallel != "layers":
        return None
    if cfg.has_linear:
        raise StrataError("parallel=layers with DeltaNet layers (Qwen3-Next) is not implemented: use "
                          "parallel=experts for this model")
    if len(devices) > cfg.num_layers:
        raise StrataError(f"parallel=layers over {len(devices)} devices needs at least as many layers "
                          f"(this model: {cfg.num_layers})")
    owner = [d for (a, b), d in zip(layer_blocks(cfg.num_layers, len(devices)), devices) for _ in range(a, b)]
    return owner.__getitem__


def weight_placer(cfg, opts):
    """The checkpoint loader's `place(name, array)` with several devices (None: the default placement), so no
    device ever holds more than its share: parallel=layers: a layer's tensors onto its block's device, the
    embedding onto the first, the final norm and lm_head onto the last; parallel=experts, every expert resident:
    each layer's expert stacks [E, ...] (and their scales) split on the expert axis, the rest replicated."""
    devices = devices_for(opts)
    if (devices is not None and opts.parallel == "experts" and opts.expert_cache_slots == "all"
            and cfg.num_experts % len(devices) == 0):  # (not divisible: ExpertSplit's one line after loading)
        mesh = Mesh(np.array(devices), (AXIS,))
        split, rep = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
        return lambda name, x: to_global(x, split if ".experts." in name and "shared" not in name else rep)
    device_of = layer_device(cfg, opts)
    if device_of is None:
        return None

    def place(name: str, x):
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        device = device_of(int(m.group(1))) if m else device_of(0 if "embed" in name else cfg.num_layers - 1)
        return jax.device_put(x, device)
    return place


def block_ends(cfg, opts) -> tuple[int, ...]:
    """The last layer of every device's block but the last (parallel=layers; () otherwise): the offloaded expert
    path never defers them, so a block's activations leave its device whole."""
    devices = devices_for(opts)
    if devices is None or opts.parallel != "layers":
        return ()
    return tuple(b - 1 for _, b in layer_blocks(cfg.num_layers, len(devices))[:-1])


def attach(engine) -> "LayerSplit | ExpertSplit | None":
    """The engine's split over `devices` (None on one device); the engine's weights are placed by it."""
    devices = devices_for(engine.options)
    if devices is None:
        return None
    kw = dict(cfg=engine.cfg, devices=devices, decode_experts=engine.decode_expert_path,
              attention_kernel=engine.attention_kernel == "pallas", dense_kernel=engine.dense_kernel == "pallas",
              delta_kernel=engine.delta_kernel == "pallas")
    if engine.options.parallel == "layers":
        layer_device(engine.cfg, engine.options)  # the refusals (DeltaNet layers, more devices than layers)
        split = LayerSplit(**kw, prefill_experts=engine.expert_path, scanned=engine.scanned)
    else:
        if engine.placement is not None and (engine.approx.active or engine.defer.active):
            raise StrataError("parallel=experts with offload runs the exact routing: the route switches and the "
                              "deferral run with parallel=layers")
        split = ExpertSplit(**kw, expert_kernel=engine.expert_kernel == "pallas", prefill_experts=engine.expert_path)
    engine.weights = split.place_weights(engine.weights)
    return split


@struct.dataclass
class Stages:
    """Per-stage weights or caches of parallel=layers (stage s on devices[s])."""
    stages: tuple
    state_pos = None  # (not a field) the engine's prefix reuse reads it: no DeltaNet ring here


def _stage(weights: Weights, cache: KVCache, x: jax.Array, pos: jax.Array, n_valid: jax.Array, *,
           cfg, layer0: int, first: bool, last: bool, tail: str, experts, attention_kernel: bool, dense_kernel: bool):
    """One stage of a window: tokens (first) or hidden states [T, H] through the stage's layers (stacked: the
    scanned body; a list: transformer.run_layers, the model's layers layer0..); the last stage ends as
    graphs.decode_window ('window'), prefill_chunk ('prefill') or prefill_logits ('logits') do."""
    h = weights.embed[x] if first else x
    if weights.stacked:
        h, cache = transformer.scan_layers(weights.layers, cache, h, pos, n_valid, cfg, experts, attention_kernel,
                                     dense_kernel)
    else:
        h, cache = transformer.run_layers(weights.layers, cache, h, pos, n_valid, cfg, experts, attention_kernel,
                                    dense_kernel, layer0=layer0)
    if not last:
        return h, cache
    logits = transformer.head_logits(weights, h, cfg)
    if tail == "window":
        return graphs.window_outputs(logits), cache
    if tail == "prefill":
        return graphs.prefill_outputs(logits, n_valid), cache
    return (logits,), cache


class LayerSplit:
    """parallel=layers: contiguous blocks of layers, one device each (see the module docstring).

    Two forms of the model: stacked (every expert resident, the scanned body): `Stages` of per-device Weights and
    KVCache; per-layer lists (offload, or layer_loop=unroll): the engine's own `Weights` / `KVCache` whose
    layer i (weights, KV rows, slot cache, host experts) lives on its block's device, so the engine's slot-cache
    code (counters, static fill) reads them as on one device; a stage's graph takes its slice of the lists."""

    def __init__(self, cfg, devices, decode_experts=None, prefill_experts=None, attention_kernel=False,
                 dense_kernel=False, delta_kernel=False, scanned=True):
        n = cfg.num_layers
        if len(devices) > n:
            raise StrataError(f"parallel=layers over {len(devices)} devices needs at least as many layers "
                              f"(this model: {n})")
        self.cfg, self.devices, self.scanned = cfg, list(devices), scanned
        self.decode_experts, self.prefill_experts = decode_experts, prefill_experts
        self.attention_kernel, self.dense_kernel = attention_kernel, dense_kernel
        self.blocks = layer_blocks(n, len(devices))
        self.head_embed = None  # tied embeddings, per-layer form: the last device's copy of embed for the head
        self.line = (f"parallel=layers over {len(devices)} devices: layers "
                     + ", ".join(f"{a}..{b - 1} on {d}" for (a, b), d in zip(self.blocks, self.devices)))
        if prefill_experts is not None:  # offload: the experts' slot caches and host copies go with their layers
            self.line += "; each device keeps its layers' slot caches, a block's last layer is never deferred"

    def device_of(self, layer: int):
        return next(d for (a, b), d in zip(self.blocks, self.devices) if a <= layer < b)

    def place_weights(self, w: Weights) -> Stages | Weights:
        """The stacked model sliced into blocks; the per-layer list with scanned: each block stacked on its device
        (the loaders put each layer there already: no device holds more than its block); else the list itself."""
        last = len(self.blocks) - 1
        if not w.stacked and self.scanned:
            stages = []
            for s, ((a, b), dev) in enumerate(zip(self.blocks, self.devices)):
                block = Weights(embed=None, layers=[_put(layer, dev) for layer in w.layers[a:b]],
                                      final_norm=None, lm_head=None)
                stages.append(Weights(
                    embed=_put(w.embed, dev) if s == 0 or (s == last and w.lm_head is None) else None,
                    layers=stack_layers(block).layers,  # the list is freed with its last holder
                    final_norm=_put(w.final_norm, dev) if s == last else None,
                    lm_head=_put(w.lm_head, dev) if s == last else None))
            return Stages(stages=tuple(stages))
        if not w.stacked:  # per-layer form: each layer onto its block's device, host experts stay in host memory
            if w.lm_head is None:
                self.head_embed = _put(w.embed, self.devices[-1])
            return Weights(embed=_put(w.embed, self.devices[0]),
                                 layers=[_put(layer, self.device_of(i)) for i, layer in enumerate(w.layers)],
                                 final_norm=_put(w.final_norm, self.devices[-1]), lm_head=_put(w.lm_head, self.devices[-1]))
        stages = []
        for s, ((a, b), dev) in enumerate(zip(self.blocks, self.devices)):
            stage = Weights(embed=w.embed if s == 0 or (s == last and w.lm_head is None) else None,
                                  layers=jax.tree.map(lambda x, a=a, b=b: x[a:b], w.layers),
                                  final_norm=w.final_norm if s == last else None,
                                  lm_head=w.lm_head if s == last else None)
            stages.append(jax.device_put(stage, dev))
        return Stages(stages=tuple(stages))

    def gathered(self, w: Stages | Weights) -> Weights:
        """The whole model on the first device again (save_state): the stages' layer blocks concatenated."""
        dev = self.devices[0]
        if isinstance(w, Weights):
            return _put(w, dev)
        first, last = w.stages[0], w.stages[-1]
        layers = jax.tree.map(lambda *xs: jnp.concatenate([jax.device_put(x, dev) for x in xs]),
                              *[s.layers for s in w.stages])
        return jax.device_put(Weights(embed=first.embed, layers=layers, final_norm=last.final_norm,
                                            lm_head=last.lm_head), dev)

    def place_cache(self, cache: KVCache) -> Stages | KVCache:
        if isinstance(cache.k, list):
            per_layer = lambda xs: None if xs is None else [_put(x, self.device_of(i)) for i, x in enumerate(xs)]
            return cache.replace(k=per_layer(cache.k), v=per_layer(cache.v), experts=per_layer(cache.experts))
        return Stages(stages=tuple(jax.device_put(KVCache(k=jax.tree.map(lambda x: x[a:b], cache.k),
                                                                v=jax.tree.map(lambda x: x[a:b], cache.v)), dev)
                                   for (a, b), dev in zip(self.blocks, self.devices)))

    def _stage_view(self, weights, cache, s: int):
        """Stage s's weights and cache: its Stages entry, or its slice of the per-layer lists."""
        if isinstance(weights, Stages):
            return weights.stages[s], cache.stages[s]
        (a, b), last = self.blocks[s], len(self.blocks) - 1
        embed = weights.embed if s == 0 else (self.head_embed if s == last else None)
        w = Weights(embed=embed, layers=weights.layers[a:b], final_norm=weights.final_norm if s == last else None,
                          lm_head=weights.lm_head if s == last else None)
        piece = lambda xs: None if xs is None else xs[a:b]
        return w, KVCache(k=piece(cache.k), v=piece(cache.v), experts=piece(cache.experts))

    def _joined(self, cache, parts: list):
        """The stages' updated caches as the engine holds them (Stages, or the per-layer lists joined)."""
        if isinstance(cache, Stages):
            return Stages(stages=tuple(parts))
        join = lambda name: (None if getattr(parts[0], name) is None
                             else [x for p in parts for x in getattr(p, name)])
        return cache.replace(k=join("k"), v=join("v"), experts=join("experts"))

    def _pipeline(self, weights, cache, t: int, tail: str, experts, attention_kernel, dense_kernel):
        """The stages' graphs compiled for T = t, chained: (weights, cache, tokens, pos, n_valid) -> (outs, cache)."""
        last = len(self.devices) - 1
        compiled = []
        for s, dev in enumerate(self.devices):
            w, c = self._stage_view(weights, cache, s)
            fn = jax.jit(functools.partial(_stage, cfg=self.cfg, layer0=self.blocks[s][0], first=s == 0,
                                           last=s == last, tail=tail, experts=experts,
                                           attention_kernel=attention_kernel, dense_kernel=dense_kernel),
                         donate_argnums=(1,), compiler_options=graphs.MODEL_COMPILER_OPTIONS)
            one = jax.sharding.SingleDeviceSharding(dev)
            x = (jax.ShapeDtypeStruct((t,), jnp.int32, sharding=one) if s == 0 else
                 jax.ShapeDtypeStruct((t, self.cfg.hidden_size), w.layers[0].attn_norm.dtype
                                      if isinstance(w.layers, list) else w.layers.attn_norm.dtype, sharding=one))
            scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=one)
            compiled.append(graphs.compile_shared(fn.lower(w, c, x, scalar, scalar), graphs.MODEL_COMPILER_OPTIONS))
        first_device = self.devices[0]

        def run(weights, cache, tokens, pos, n_valid):
            x, new = tokens, []
            for s, (fn, dev) in enumerate(zip(compiled, self.devices)):
                w, c = self._stage_view(weights, cache, s)
                x, c = fn(w, c, *jax.device_put((x, pos, n_valid), dev))
                new.append(c)
            return jax.device_put(x, first_device), self._joined(cache, new)  # the samplers' device
        return run

    def window(self, t: int, weights, cache):
        run = self._pipeline(weights, cache, t, "window", self.decode_experts, self.attention_kernel,
                             self.dense_kernel)

        def window(weights, cache, tokens, pos):
            (token, logits), cache = run(weights, cache, tokens, pos, np.int32(t))
            return token, logits, cache
        return window

    def device_verify(self, t: int, form: str | None, weights, cache, context: int, sampling):
        """draft="device"'s verify window of T over the stages: the drafts proposed on the first device
        (graphs.draft_window), the window through the stages, the acceptance back on the first device
        (graphs.accept_window); nothing waits for the host. (weights, cache, hist, length, sampling) ->
        (hist, length, new, n_new, m, cache)."""
        run = self._pipeline(weights, cache, t, "logits", self.decode_experts, self.attention_kernel,
                             self.dense_kernel)
        first = self.devices[0]
        propose = jax.jit(functools.partial(graphs.draft_window, t=t))
        accept = jax.jit(functools.partial(graphs.accept_window, t=t, form=form))

        def device_verify(weights, cache, hist, length, sampling):
            hist, length, sampling = jax.device_put((hist, length, sampling), first)
            window, drafts, m, pos = propose(hist, length)
            (logits,), cache = run(weights, cache, window, pos, 1 + m)
            return accept(logits, hist, length, drafts, m, sampling) + (cache,)
        return device_verify

    def prefill(self, c: int, weights, cache):
        run = self._pipeline(weights, cache, c, "prefill", self.prefill_experts, self.attention_kernel, False)

        def prefill(weights, cache, tokens, pos, n_valid):
            (token, last), cache = run(weights, cache, tokens, pos, n_valid)
            return token, last, cache
        return prefill

    def prefill_logits(self, c: int, weights, cache):
        run = self._pipeline(weights, cache, c, "logits", self.prefill_experts, self.attention_kernel, False)

        def prefill_logits(weights, cache, tokens, pos, n_valid):
            (logits,), cache = run(weights, cache, tokens, pos, n_valid)
            return logits, cache
        return prefill_logits


def _put(tree, device):
    """tree onto `device`, each array in its own memory kind (host experts stay in the device's host memory)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(
        device, memory_kind=x.sharding.memory_kind)), tree)


class ShardedExperts:
    """The expert path inside shard_map over 'experts': this device's experts (E/D of every MoE layer) for every
    token of the window, the other devices' combine weights masked to zero, summed over the devices by psum.
    kernel: the Pallas expert FFN (masked entries are rows -1: never read); else XLA's gather + einsums."""

    def __init__(self, cfg, n_devices: int, kernel: bool = False):
        self.cfg, self.n, self.kernel = cfg, n_devices, kernel

    def __call__(self, layer, x, w: moe.MoEWeights, valid, state=None, offset=0):
        cfg = self.cfg
        e_local = cfg.num_experts // self.n
        with jax.named_scope("moe_route"):
            r = moe.route(x, w.router, cfg, valid)  # every token, every expert: the router is replicated
        local = r.expert_ids - jax.lax.axis_index(AXIS) * e_local
        mine = (r.expert_ids >= 0) & (local >= 0) & (local < e_local)
        base = (offset // cfg.num_experts) * e_local  # stacked layers: the local row of this layer's expert 0
        combine = jnp.where(mine[None, :], r.combine, 0.0)
        with jax.named_scope("moe_experts_local"):
            if self.kernel:
                rows = jnp.where(mine, local + base, -1)
                y = expert_ffn_kernel(x, w.gate, w.up, w.down, rows, combine, *w.scales,
                                      interpret=jax.default_backend() != "gpu").astype(jnp.float32)
            else:
                ids = jnp.where(mine, local, 0) + base
                y = moe.expert_ffn(x, w.gate[ids], w.up[ids], w.down[ids], combine, *(sc[ids] for sc in w.scales))
        with jax.named_scope("moe_combine"):
            return moe.ExpertsOut(jax.lax.psum(y, AXIS).astype(x.dtype), state)


class ShardedOffloadedExperts:
    """parallel=experts with offload, inside shard_map over 'experts': this device's E/D experts of each MoE layer
    in its host memory and its own slot cache of S/D slots (experts/slots.py's SlotCache over the local experts).
    The window's exact route, restricted to the local experts (the other devices' entries route nowhere here), runs
    the offloaded path's plan, fetches and expert blocks (`inner`: slots.OffloadedExperts, built without the host
    pool: every miss fetched over PCIe), then the psum adds the devices' rows. The slot cache leaves carry a leading
    device axis [D, ...] split on 'experts': this device sees [1, ...]."""

    def __init__(self, cfg, n_devices: int, inner):
        if inner.pool is not None:  # its CPU kind would leave rows out: the engine forces pcie_frac=1
            raise StrataError("parallel=experts with offload fetches every miss over PCIe: pcie_frac=1")
        self.cfg, self.n, self.inner = cfg, n_devices, inner
        self.join_now = False  # no deferral

    def __call__(self, layer, x, w: moe.MoEWeights, valid, state=None, offset=0):
        cfg = self.cfg
        e_local = cfg.num_experts // self.n
        with jax.named_scope("moe_route"):
            r = moe.route(x, w.router, cfg, valid)  # every token, every expert: the router is replicated
            base = jax.lax.axis_index(AXIS) * e_local
            mine = (r.expert_ids >= base) & (r.expert_ids < base + e_local)
            r = r.replace(expert_ids=jnp.where(mine, r.expert_ids - base, -1), combine=r.combine * mine[None, :],
                          entry_counts=jnp.where(mine, r.entry_counts, 0))
        state = jax.tree.map(lambda a: a[0], state)
        with jax.named_scope("moe_plan"):
            p = self.inner.plan_window(r, state)
        with jax.named_scope("moe_experts"):
            y, slots = self.inner.gpu_experts(x, w, r, p, state)
        with jax.named_scope("moe_slot_table"):
            state = slots_mod.update_slots(state, r, p, slots, {})
        with jax.named_scope("moe_combine"):
            y = jax.lax.psum(y, AXIS).astype(x.dtype)
        return moe.ExpertsOut(y, jax.tree.map(lambda a: a[None], state), None)


def to_global(x, sharding: NamedSharding) -> jax.Array:
    """`x` (host or this process's device; the same value in every process) as an array of `sharding`. Several
    processes: each fills only its own devices' shards (a device_put from a local device onto other processes'
    devices is a cross-host transfer, which the CPU backend refuses)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)  # a Python int: int32, as device_put
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


_meshes_connected = itertools.count()  # one barrier name per mesh: every process builds its engines in the same order


def connect_processes(mesh: Mesh) -> None:
    """Several processes: meet at a barrier of the coordination service (10 minutes), then run one psum over `mesh`,
    so that the CPU collectives (gloo) connect while every process is here. Gloo gives up connecting after 30 s
    ("Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out"), and a process that compiles
    its graphs slower than another would otherwise reach its first window too late (and the other waits for ever)."""
    from jax._src import distributed  # the coordination service's client: no public barrier without a collective
    distributed.global_state.client.wait_at_barrier(f"strata_experts_mesh_{next(_meshes_connected)}", 600_000)
    ones = to_global(np.ones(mesh.size, np.float32), NamedSharding(mesh, P(AXIS)))
    psum = jax.shard_map(lambda x: jax.lax.psum(x, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P())
    jax.block_until_ready(jax.jit(psum)(ones))


def local_replica(x: jax.Array, device) -> jax.Array:
    """The copy on `device` (one of this process's) of a replicated array: no transfer, and in several processes
    the only copy this process can read."""
    return next(shard.data for shard in x.addressable_shards if shard.device == device)


def expert_specs(weights: Weights):
    """The PartitionSpec tree of `weights`: the MoE layers' experts (and their scales) split on the expert axis
    (axis 1 of stacked [L, E, ...] leaves, else 0), everything else replicated."""
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)

    def layer_spec(layer: LayerWeights, axis: int):
        spec = rep(layer)
        if not isinstance(layer.ffn, moe.MoEWeights):
            return spec
        split = P(*([None] * axis), AXIS)
        names = [n for n in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")
                 if getattr(layer.ffn, n) is not None]
        return spec.replace(ffn=rep(layer.ffn).replace(**{n: split for n in names}))

    layers = (layer_spec(weights.layers, 1) if weights.stacked else
              [layer_spec(layer, 0) for layer in weights.layers])
    return rep(weights).replace(layers=layers)


class ExpertSplit:
    """parallel=experts: each MoE layer's experts split over a 'experts' mesh axis (see the module docstring)."""

    def __init__(self, cfg, devices, decode_experts=None, attention_kernel=False, dense_kernel=False,
                 delta_kernel=False, expert_kernel=False, prefill_experts=None):
        if not any(cfg.sparse_layers):
            raise StrataError("parallel=experts: this model has no MoE layer (use parallel=layers)")
        if cfg.num_experts % len(devices):
            raise StrataError(f"parallel=experts over {len(devices)} devices needs the experts ({cfg.num_experts}) "
                              "divisible by the device count")
        self.cfg, self.devices = cfg, list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        if jax.process_count() > 1:
            connect_processes(self.mesh)
        # the samplers' device: this process's first one (several processes: each samples on its own replica)
        self.first = next(d for d in self.devices if d.process_index == jax.process_index())
        self.kernels = dict(attention_kernel=attention_kernel, dense_kernel=dense_kernel, delta_kernel=delta_kernel)
        n = len(devices)
        self.offload = prefill_experts is not None  # the engine's offloaded expert paths (slots.OffloadedExperts)
        if self.offload:
            self.prefill_experts = ShardedOffloadedExperts(cfg, n, prefill_experts)
            self.decode_experts = ShardedOffloadedExperts(cfg, n, decode_experts)
        else:
            self.prefill_experts = ShardedExperts(cfg, n)
            self.decode_experts = ShardedExperts(cfg, n, kernel=expert_kernel)
        self.specs = self.cache_specs = None
        self.line = (f"parallel=experts over {n} devices: {cfg.num_experts // n} experts of each MoE layer per "
                     f"device{' (in its host memory, with its own slot cache)' if self.offload else ''}, attention "
                     "and KV cache replicated")

    def place_weights(self, w: Weights) -> Weights:
        self.specs = expert_specs(w)  # host experts stay in host memory, split like the resident ones
        return jax.tree.map(lambda x, s: to_global(x, NamedSharding(self.mesh, s, memory_kind=x.sharding.memory_kind)),
                            w, self.specs)

    def gathered(self, w: Weights) -> Weights:
        """The whole model on this process's first device again (save_state): the experts gathered, replicated."""
        kinds = jax.tree.map(lambda x: NamedSharding(self.mesh, P(), memory_kind=x.sharding.memory_kind), w)
        whole = jax.jit(lambda w: w, out_shardings=kinds)(w)  # host experts stay in host memory
        return jax.tree.map(lambda x: local_replica(x, self.first), whole)

    def place_cache(self, cache: KVCache) -> KVCache:
        """The KV cache replicated; with offload each device's slot caches (S/D slots over its E/D experts), fresh,
        as [D, ...] leaves split on 'experts'."""
        experts, split = cache.experts, NamedSharding(self.mesh, P(AXIS))
        cache = jax.tree.map(lambda x: to_global(x, self.replicated), cache.replace(experts=None))
        self.cache_specs = jax.tree.map(lambda _: P(), cache)
        if experts is not None:
            n = len(self.devices)
            local_cfg = dataclasses.replace(self.cfg, num_experts=self.cfg.num_experts // n)

            def local(state):
                storage = slots_mod.slot_storage_of(state, self.cfg)  # int2-q2k's uint8 says its width
                fresh = slots_mod.init_slot_cache(local_cfg, state.slots // n, storage,
                                                  "lru" if bool(state.lru) else "static", float(state.pcie_frac))
                return jax.tree.map(lambda a: to_global(np.stack([np.asarray(a)] * n), split), fresh)
            experts = [None if s is None else local(s) for s in experts]
            cache = cache.replace(experts=experts)
            self.cache_specs = self.cache_specs.replace(
                experts=[None if s is None else jax.tree.map(lambda _: P(AXIS), s) for s in experts])
        return cache

    def _compile(self, fn, n_out: int, weights, cache, t: int, *scalars):
        rep = self.replicated
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(self.specs, self.cache_specs, P()) + (P(),) * len(scalars),
                               out_specs=(P(),) * n_out + (self.cache_specs,), check_vma=False)
        compiled = graphs.compile_shared(jax.jit(
            mapped, donate_argnums=(1,), compiler_options=graphs.MODEL_COMPILER_OPTIONS).lower(
            weights, cache, jax.ShapeDtypeStruct((t,), jnp.int32, sharding=rep),
            *(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep) for _ in scalars)), graphs.MODEL_COMPILER_OPTIONS)
        first = self.first

        def run(weights, cache, *args):
            out = compiled(weights, cache, *(to_global(a, rep) for a in args))
            # the engine's samplers run on this process's first device: hand them its replica
            return tuple(local_replica(o, first) for o in out[:n_out]) + tuple(out[n_out:])
        return run

    def window(self, t: int, weights, cache):
        fn = functools.partial(graphs.decode_window, cfg=self.cfg, experts=self.decode_experts, **self.kernels)
        return self._compile(fn, 2, weights, cache, t, "pos")

    def device_verify(self, t: int, form: str | None, weights, cache, context: int, sampling):
        """draft="device"'s verify window of T (graphs.device_verify_window) in shard_map: (weights, cache, hist,
        length, sampling) -> (hist, length, new, n_new, m, cache). The history and its length stay replicated over
        the devices (fed back to the next window as they are); new, n_new and m come back on this process's first
        device, where the host loop reads them."""
        rep = self.replicated
        fn = functools.partial(graphs.device_verify_window, cfg=self.cfg, t=t, form=form,
                               experts=self.decode_experts, **self.kernels)
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(self.specs, self.cache_specs, P(), P(), P()),
                               out_specs=(P(),) * 5 + (self.cache_specs,), check_vma=False)
        abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype, sharding=rep)
        compiled = graphs.compile_shared(jax.jit(
            mapped, donate_argnums=(1, 2), compiler_options=graphs.MODEL_COMPILER_OPTIONS).lower(
            weights, cache, jax.ShapeDtypeStruct((context + t,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), jax.tree.map(abstract, sampling)),
            graphs.MODEL_COMPILER_OPTIONS)
        first = self.first

        def run(weights, cache, hist, length, sampling):
            hist, length, new, n_new, m, cache = compiled(
                weights, cache, to_global(hist, rep), to_global(length, rep),
                jax.tree.map(lambda x: to_global(x, rep), sampling))
            return (hist, length) + tuple(local_replica(o, first) for o in (new, n_new, m)) + (cache,)
        return run

    def prefill(self, c: int, weights, cache):
        fn = functools.partial(graphs.prefill_chunk, cfg=self.cfg, experts=self.prefill_experts,
                               attention_kernel=self.kernels["attention_kernel"])
        return self._compile(fn, 2, weights, cache, c, "pos", "n_valid")

    def prefill_logits(self, c: int, weights, cache):
        fn = functools.partial(graphs.prefill_logits, cfg=self.cfg, experts=self.prefill_experts,
                               attention_kernel=self.kernels["attention_kernel"])
        return self._compile(fn, 1, weights, cache, c, "pos", "n_valid")
