"""Deferred CPU rows (`STRATA_VERIFY_DEFER_CPU=1|check`, `STRATA_VERIFY_DEFER_CPU_BELOW=w`): layer l's CPU expert
rows may join the residual late, so the GPU does not wait for the host pool.

In a decode window, for a sparse layer l that is not the model's last layer and that has CPU entries:

    route(l)  -> submit: one io_callback hands the pool the CPU entries (x, expert ids, weights) and returns a
                 ticket at once; the pool computes the entries of weight >= w first, signals, then the rest
    gpu(l)    -> the resident and fetched experts run meanwhile
    post(l)   -> split (0 < w < 1): wait for the heavy phase (an io_callback that returns when it is done) and add
                 the heavy rows, weighted (Pallas `copy_rows_by_weight`); w >= 1: nothing waits here
    pre(l+1)  -> after layer l+1's mixer: collect the rest (an io_callback) and add the light rows (w >= 1: every
                 CPU row, Pallas `copy_rows_from_mapped`) to the residual, right before layer l+1's FFN half
    check     -> bookkeeping only: the heavy rows join in post(l) and the light ones right after, in the same layer
                 (the exact sums in another order)

This module is the unrolled graph's form (io_callbacks). The scanned graph defers through the native offload
calls instead (slots.OffloadedExperts.native_deferred, where every decode window fits one pair of calls): the heavy
rows are one pool job collected at post(l), the light rows a second job collected at pre(l+1); same rule.

A window with no CPU entry in a layer makes no callback there (lax.cond). The last layer is never deferred. The
pool returns each entry's unweighted row [T, K, H]; the GPU applies the routing weights, as the exact path's
combine does. A wait longer than the callback timeout ends the request with one error naming the layer and phase.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.host_pool import collect_cpu_rows, submit_cpu_rows, wait_heavy_rows
from strata_jax.pallas_kernels.copy_rows import copy_rows_by_weight, copy_rows_from_mapped
from strata_jax.options import DEFER_SWITCHES, EngineOptions, env_name, parse_number, switch_values

DEFAULT_BELOW = 0.1


@dataclasses.dataclass(frozen=True)
class DeferCPU:
    """The deferral of the decode graphs (static: one compiled graph per setting)."""
    mode: str = "off"  # off | defer | check
    below: float = DEFAULT_BELOW  # w: rows of weight < w are deferred; >= 1: every row, no split

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def split(self) -> bool:
        return self.below < 1.0


OFF = DeferCPU()


@struct.dataclass
class Pending:
    """Layer l's CPU rows still owed to the residual at pre(l+1)."""
    layer: int = struct.field(pytree_node=False)
    ticket: jax.Array  # [] int32; -1 when the window had no CPU entry in the layer (nothing submitted)
    weights: jax.Array  # [T, K] float32 routing weights of the entries
    cpu: jax.Array  # [T, K] bool: the entries the pool computes


def cpu_entries(route, kind: jax.Array, cpu_kind: int) -> jax.Array:
    """[T, K] bool: entries whose expert the plan gave to the host pool."""
    match = route.topk_ids[:, :, None] == route.expert_ids[None, None, :]  # [T, K, N]
    return jnp.any(match & (kind == cpu_kind)[None, None, :], axis=-1)


def submit(pool, layer: int, x: jax.Array, route, cpu: jax.Array, below: float) -> jax.Array:
    """Hand the CPU entries to the pool (returns at once); the ticket, or -1 when there are none."""
    ids = jnp.where(cpu, route.topk_ids, -1)
    # Weights of exactly 1.0 are deferred too when every row is (w >= 1): the pool sees no heavy entry.
    threshold = below if below < 1.0 else float("inf")
    return jax.lax.cond(jnp.any(cpu), lambda: submit_cpu_rows(pool, layer, x, ids, route.topk_weights, threshold),
                        lambda: jnp.int32(-1))


def _rows(pool, fetch, p: Pending, shape, after) -> jax.Array:
    """Unweighted entry rows [T, K, H] from the pool (zeros when nothing was submitted)."""
    return jax.lax.cond(p.ticket >= 0, lambda: fetch(pool, p.ticket, *shape, after=after),
                        lambda: jnp.zeros(shape, jnp.float32))


def join_heavy(pool, y: jax.Array, p: Pending, below: float, after: jax.Array) -> jax.Array:
    """post(l): wait for the heavy phase and add the heavy rows (weight >= below) to y [T, H] float32."""
    t, k = p.weights.shape
    rows = _rows(pool, wait_heavy_rows, p, (t, k, y.shape[-1]), after)
    return copy_rows_by_weight(y, rows, p.weights, p.cpu, jnp.float32(below), heavy=True, interpret=_interpret())


def join_light(pool, h: jax.Array, p: Pending, below: float) -> jax.Array:
    """pre(l+1) (or right after post(l) in check mode): collect the job and add the rows not yet added to the
    residual h [T, H] (every CPU row when below >= 1)."""
    t, k = p.weights.shape
    # `after`: one element of h, so the collect cannot be scheduled before layer l+1's mixer has run.
    rows = _rows(pool, collect_cpu_rows, p, (t, k, h.shape[-1]), after=h[0, :1])
    zero = jnp.zeros(h.shape, jnp.float32)
    if below < 1.0:
        late = copy_rows_by_weight(zero, rows, p.weights, p.cpu, jnp.float32(below), heavy=False,
                                   interpret=_interpret())
    else:
        late = copy_rows_from_mapped(zero, rows, p.weights, p.cpu, interpret=_interpret())
    return (h.astype(jnp.float32) + late).astype(h.dtype)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


# ---- the switches (STRATA_VERIFY_DEFER_CPU* or the options of the same names) ----------------------------------

def defer_cpu(opts: EngineOptions, makes_cpu_rows: bool, environ=None):
    """(DeferCPU, start-up lines) from the options and the environment; makes_cpu_rows: the placement sends misses
    to the host pool (offload on and pcie_frac < 1)."""
    raw = switch_values(opts, DEFER_SWITCHES, environ)
    mode_text, below_text = raw["verify_defer_cpu"], raw["verify_defer_cpu_below"]
    name, below_name = env_name("verify_defer_cpu"), env_name("verify_defer_cpu_below")
    mode = {"": "off", "0": "off", "1": "defer", "check": "check"}.get(mode_text)
    lines = []
    if mode is None:
        lines.append(f"{name}={mode_text}: not 0, 1 or check; the deferral is off")
        mode = "off"
    if mode == "off":
        if below_text:
            lines.append(f"{below_name}={below_text}: ignored ({name} is off)")
        return OFF, lines
    below, default = DEFAULT_BELOW, True
    if below_text:
        v = parse_number(below_text)
        if v is None or v <= 0:
            lines.append(f"{below_name}={below_text}: not a number above 0; {DEFAULT_BELOW:g}")
        else:
            below, default = v, False
    if mode == "check":
        lines.append(f"{name}=check: bookkeeping only: a layer's CPU rows of routing weight >= {below:g} join in "
                     "post(l), the lighter ones right after, in the same layer (the exact sums in another order)")
    else:
        lines.append(f"{name}=1: layer l's deferred CPU expert rows join before layer l+1's FFN half (layer l+1's "
                     "mixer runs without them); the model's last layer is never deferred")
    if below >= 1.0:
        lines.append(f"{below_name}={below:g}: every CPU row joins late (no split, no partial wait)")
    else:
        lines.append(f"{below_name}={below:g}{' (the default)' if default else ''}: a deferred layer waits for its "
                     f"CPU rows of routing weight >= {below:g} in post(l) and defers the lighter ones")
    if not makes_cpu_rows:
        lines.append(f"{name}: the placement makes no CPU rows (every miss fetched over PCIe, or every expert "
                     "resident): nothing to defer")
        return OFF, lines
    return DeferCPU(mode=mode, below=below), lines
