"""Slot plan: a decode window's offload plan and the slot-cache update of one layer in one kernel.

The offloaded layer body (strata_jax/offload/slots.py: plan, OffloadedExperts.plan_window, update_slots) decides, for
the window's distinct experts, which are resident, fetched over PCIe or computed on the host, picks each fetched
expert's victim slot (least recently used, never one this window reads), and updates the slot table, the slot ->
expert map, the LRU clock stamps, the routing usage and the counters. As XLA ops that is ~10 small kernels a layer
on a GPU; here it is one program. The semantics are exactly those of the XLA forms (tests/offload/test_slot_plan.py
holds them against sorts and scatters; tests/kernels/test_slot_plan_kernel.py this kernel against them):

- ids [N] int32 distinct experts (-1 = padding); combine [T, N] f32 routing weights; entry_counts [N] int32.
- table [E] int32 expert -> slot or -1; expert_of [S+1] int32 slot -> expert or -1 (row S: the trash row);
  last_use [S+1] int32; usage [E] int32; clock, pcie_frac (f32), lru (0/1), cpu (0/1: the graph has the pool).
- resident: table[id] >= 0; miss: used and not resident; n_fetch = floor(frac * misses + 0.5) with frac = pcie_frac
  if cpu else 1; the misses of most routing mass (summed over T) are fetched, ties to the lower position; the other
  misses go to the host (CPU).
- victims: the slots not read by this window, by last_use ascending, ties to the lower slot, the trash row never;
  n_victims = S - (slots read) under lru, else 0; the j-th fetch (by position) takes the j-th victim while
  j < n_victims, else the trash row S (staged, not kept).
- updates: evicted experts leave the table, inserted ones enter it at their victim slot; expert_of and last_use
  (= clock) at the inserted slots; last_use (= clock) at the resident slots read; usage += entry_counts.
- sums [8]: entries, then distinct experts, of RESIDENT, FETCH, CPU and SKIP (none here).

No sort, gather, scatter or transpose inside the kernel: each step is a comparison matrix and a reduction, and the
wrapper hands each vector in the orientation (row [1, X] or column [X, 1]) its step wants, every axis padded to a
power of 2 (padded ids -1, padded slots read and empty, padded tokens' weights 0).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NONE, RESIDENT, FETCH, CPU = 0, 1, 2, 3  # as strata_jax/offload/slots.py
INT_MAX = 2 ** 31 - 1


def plan_warps(sp: int) -> int:
    """Warps of the one program: its largest operands are the [Sp, Sp] victim comparisons, which with 4 warps held
    512 int32 a thread at S = 128 (Sp = 256) and spilled (0.12 ms a layer on an H100, against the XLA fusions' 0.05);
    about 128 a thread here. STRATA_PLAN_WARPS overrides (a power of 2 up to 32), for timing."""
    env = os.environ.get("STRATA_PLAN_WARPS", "")
    if env:
        return int(env)
    return int(min(32, max(4, sp * sp // (32 * 128))))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _i32(x):
    return x.astype(jnp.int32)


def _plan(ids_r, ids_c, combine, combine_t, counts_c, table_r, table_c, expert_of_c, last_use_r, last_use_c,
          usage_c, frac, clock, lru, *, slots: int):
    """The plan and the update. Rows [1, X] end in _r, columns [X, 1] in _c; combine [T, N] and combine_t [N, T];
    frac [1, 1] f32 (already 1 without the pool); clock, lru [1, 1] int32.
    Returns kind, slot, insert, dest [N, 1]; table, usage [E, 1]; expert_of, last_use [Sp, 1]; sums [8, 1]."""
    n, e, sp = ids_r.shape[1], table_c.shape[0], expert_of_c.shape[0]
    iota_n_r = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    iota_n_c = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    iota_e_r = jax.lax.broadcasted_iota(jnp.int32, (1, e), 1)
    iota_e_c = jax.lax.broadcasted_iota(jnp.int32, (e, 1), 0)
    iota_s_r = jax.lax.broadcasted_iota(jnp.int32, (1, sp), 1)
    iota_s_c = jax.lax.broadcasted_iota(jnp.int32, (sp, 1), 0)

    def plan_side(ids, hit, table, axis, mass):  # the plan of each id, as a row (axis 0) or a column (axis 1)
        found = jnp.max(_i32(hit), axis=axis, keepdims=True) > 0
        slot = jnp.where((ids >= 0) & found, jnp.sum(jnp.where(hit, table, 0), axis=axis, keepdims=True), -1)
        miss = (ids >= 0) & (slot < 0)
        return slot, miss, jnp.where(miss, -mass, jnp.inf)

    slot_r, miss_r, key_r = plan_side(ids_r, ids_r == iota_e_c, table_c, 0, jnp.sum(combine, axis=0, keepdims=True))
    slot_c, miss_c, key_c = plan_side(ids_c, ids_c == iota_e_r, table_r, 1, jnp.sum(combine_t, axis=1,
                                                                                     keepdims=True))
    n_fetch = jnp.floor(frac * jnp.sum(_i32(miss_r), axis=1, keepdims=True).astype(jnp.float32) + 0.5)
    # stable ranks of the misses by mass, descending: position j before i
    before = (key_r < key_c) | ((key_r == key_c) & (iota_n_r < iota_n_c))  # [N, N]
    miss_rank_c = jnp.sum(_i32(before), axis=1, keepdims=True)  # [N, 1]
    fetch_c = miss_c & (miss_rank_c.astype(jnp.float32) < n_fetch)
    kind_c = jnp.where(slot_c >= 0, RESIDENT, jnp.where(fetch_c, FETCH, jnp.where(miss_c, CPU, NONE)))
    # the same kinds as a row, for the slot-side matrices
    before_t = (key_c < key_r) | ((key_c == key_r) & (iota_n_c < iota_n_r))  # [N, N]: j (row index) before i
    miss_rank_r = jnp.sum(_i32(before_t), axis=0, keepdims=True)  # [1, N]
    fetch_r = miss_r & (miss_rank_r.astype(jnp.float32) < n_fetch)
    resident_r = slot_r >= 0

    # victims: ranks of the slots by (read, last_use), stable
    read_c = (iota_s_c >= slots) | (jnp.max(_i32(resident_r & (slot_r == iota_s_c)), axis=1, keepdims=True) > 0)
    read_r = (iota_s_r >= slots) | (jnp.max(_i32((slot_c >= 0) & (slot_c == iota_s_r)), axis=0, keepdims=True) > 0)
    vkey_c = jnp.where(read_c, INT_MAX, last_use_c)  # [Sp, 1]
    vkey_r = jnp.where(read_r, INT_MAX, last_use_r)  # [1, Sp]
    vbefore = (vkey_r < vkey_c) | ((vkey_r == vkey_c) & (iota_s_r < iota_s_c))  # [Sp, Sp]
    vrank_c = jnp.sum(_i32(vbefore), axis=1, keepdims=True)  # [Sp, 1]
    vbefore_t = (vkey_c < vkey_r) | ((vkey_c == vkey_r) & (iota_s_c < iota_s_r))
    vrank_r = jnp.sum(_i32(vbefore_t), axis=0, keepdims=True)  # [1, Sp]
    n_read = jnp.sum(_i32(read_c & (iota_s_c < slots)), axis=0, keepdims=True)  # [1, 1]
    n_victims = jnp.where(lru != 0, slots - n_read, 0)
    fetch_rank_c = jnp.sum(_i32((iota_n_r <= iota_n_c) & fetch_r), axis=1, keepdims=True) - 1  # [N, 1]
    fetch_rank_r = jnp.sum(_i32((iota_n_c <= iota_n_r) & fetch_c), axis=0, keepdims=True) - 1  # [1, N]
    insert_c = fetch_c & (fetch_rank_c < n_victims)
    insert_r = fetch_r & (fetch_rank_r < n_victims)
    dest_c = jnp.where(insert_c, jnp.sum(jnp.where(vrank_r == fetch_rank_c, iota_s_r, 0), axis=1, keepdims=True),
                       slots)  # [N, 1]
    dest_r = jnp.where(insert_r, jnp.sum(jnp.where(vrank_c == fetch_rank_r, iota_s_c, 0), axis=0, keepdims=True),
                       slots)  # [1, N]

    # the updates, each element against the window's entries
    evicted_r = jnp.sum(jnp.where(dest_r == iota_s_c, expert_of_c, 0), axis=0, keepdims=True)  # expert_of[dest]
    ins_en = insert_r & (ids_r == iota_e_c)  # [E, N]
    ev_en = insert_r & (evicted_r >= 0) & (evicted_r == iota_e_c)
    table_out = jnp.where(jnp.max(_i32(ins_en), axis=1, keepdims=True) > 0,
                          jnp.sum(jnp.where(ins_en, dest_r, 0), axis=1, keepdims=True),
                          jnp.where(jnp.max(_i32(ev_en), axis=1, keepdims=True) > 0, -1, table_c))
    at_sn = insert_r & (dest_r == iota_s_c)  # [Sp, N]
    expert_of_out = jnp.where(jnp.max(_i32(at_sn), axis=1, keepdims=True) > 0,
                              jnp.sum(jnp.where(at_sn, ids_r, 0), axis=1, keepdims=True), expert_of_c)
    read_sn = resident_r & (slot_r == iota_s_c)
    last_use_out = jnp.where(jnp.max(_i32(at_sn | read_sn), axis=1, keepdims=True) > 0, clock, last_use_c)
    usage_out = usage_c + jnp.sum(jnp.where(ids_r == iota_e_c, jnp.sum(jnp.where(iota_n_c == iota_n_r, counts_c, 0),
                                                                        axis=0, keepdims=True), 0),
                                  axis=1, keepdims=True)
    # counters: [8, 1] = entries then distinct experts of RESIDENT, FETCH, CPU, SKIP (none)
    iota_8 = jax.lax.broadcasted_iota(jnp.int32, (8, 1), 0)
    want = jnp.where(iota_8 % 4 == 3, -1, iota_8 % 4 + 1)  # 1, 2, 3, -1, 1, 2, 3, -1
    kind_r = jnp.where(resident_r, RESIDENT, jnp.where(fetch_r, FETCH, jnp.where(miss_r, CPU, NONE)))
    counts_r = jnp.sum(jnp.where(iota_n_c == iota_n_r, counts_c, 0), axis=0, keepdims=True)  # [1, N]
    per = jnp.where(iota_8 < 4, counts_r, 1)  # [8, N]
    sums = jnp.sum(jnp.where(kind_r == want, per, 0), axis=1, keepdims=True)  # [8, 1]
    return (kind_c, slot_c, _i32(insert_c), dest_c, table_out, expert_of_out, last_use_out, usage_out, sums)


def slot_plan_kernel(ids_r_ref, ids_c_ref, comb_ref, comb_t_ref, counts_ref, table_r_ref, table_c_ref, eo_ref,
                     lu_r_ref, lu_c_ref, usage_ref, frac_ref, scal_ref, *out_refs, slots: int):
    """One program: every ref whole (see slot_plan)."""
    scal = scal_ref[...]  # [1, 2]: clock, lru
    outs = _plan(ids_r_ref[...], ids_c_ref[...], comb_ref[...], comb_t_ref[...], counts_ref[...], table_r_ref[...],
                 table_c_ref[...], eo_ref[...], lu_r_ref[...], lu_c_ref[...], usage_ref[...], frac_ref[...],
                 jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0, scal, 0), axis=1,
                         keepdims=True),
                 jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 1, scal, 0), axis=1,
                         keepdims=True), slots=slots)
    for ref, value in zip(out_refs, outs):
        ref[...] = value


def _inputs(ids, combine, counts, table, expert_of, last_use, usage, pcie_frac, clock, lru, cpu: bool):
    """The padded operands, each in the orientations the kernel reads."""
    n, e, s1 = ids.shape[0], table.shape[0], expert_of.shape[0]
    t = combine.shape[0]
    np_, ep, sp, tp = _next_pow2(max(n, 2)), _next_pow2(max(e, 2)), _next_pow2(max(s1, 2)), _next_pow2(max(t, 2))
    ids_p = jnp.pad(ids.astype(jnp.int32), (0, np_ - n), constant_values=-1)
    comb = jnp.pad(combine.astype(jnp.float32), ((0, tp - t), (0, np_ - n)))
    col = lambda v: v.reshape(-1, 1)  # noqa: E731
    row = lambda v: v.reshape(1, -1)  # noqa: E731
    table_p = jnp.pad(table.astype(jnp.int32), (0, ep - e), constant_values=-1)
    eo_p = jnp.pad(expert_of.astype(jnp.int32), (0, sp - s1), constant_values=-1)
    lu_p = jnp.pad(last_use.astype(jnp.int32), (0, sp - s1), constant_values=-1)
    frac = jnp.where(cpu, jnp.asarray(pcie_frac, jnp.float32), jnp.float32(1.0)).reshape(1, 1)
    scal = jnp.stack([jnp.asarray(clock, jnp.int32), jnp.asarray(lru, jnp.int32)]).reshape(1, 2)
    return (row(ids_p), col(ids_p), comb, comb.T, col(jnp.pad(counts.astype(jnp.int32), (0, np_ - n))),
            row(table_p), col(table_p), col(eo_p), row(lu_p), col(lu_p),
            col(jnp.pad(usage.astype(jnp.int32), (0, ep - e))), frac, scal), (n, e, s1)


def _outputs(outs, sizes):
    n, e, s1 = sizes
    kind, slot, insert, dest, table, expert_of, last_use, usage, sums = (o.reshape(-1) for o in outs)
    return dict(kind=kind[:n], slot=slot[:n], insert=insert[:n] != 0, dest=dest[:n], table=table[:e],
                expert_of=expert_of[:s1], last_use=last_use[:s1], usage=usage[:e], sums=sums)


@functools.partial(jax.jit, static_argnames=("cpu", "interpret"))
def slot_plan(ids, combine, counts, table, expert_of, last_use, usage, pcie_frac, clock, lru, *, cpu: bool,
              interpret: bool = False) -> dict:
    """The window's plan and the updated small leaves of one layer's slot cache (module docstring): a dict of kind,
    slot, insert (bool), dest [N]; table, usage [E]; expert_of, last_use [S+1]; sums [8] int32."""
    args, sizes = _inputs(ids, combine, counts, table, expert_of, last_use, usage, pcie_frac, clock, lru, cpu)
    npad, ep, sp = args[1].shape[0], args[6].shape[0], args[7].shape[0]
    shapes = [(npad, 1)] * 4 + [(ep, 1), (sp, 1), (sp, 1), (ep, 1), (8, 1)]
    outs = pl.pallas_call(
        functools.partial(slot_plan_kernel, slots=sizes[2] - 1),
        out_shape=[jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes],
        compiler_params=plgpu.CompilerParams(num_warps=plan_warps(sp)),
        interpret=interpret,
        name="slot_plan",
    )(*args)
    return _outputs(outs, sizes)


def slot_plan_reference(ids, combine, counts, table, expert_of, last_use, usage, pcie_frac, clock, lru, *,
                        cpu: bool) -> dict:
    """The same in plain jnp (the kernel's math on the same padded operands, outside Pallas)."""
    args, sizes = _inputs(ids, combine, counts, table, expert_of, last_use, usage, pcie_frac, clock, lru, cpu)
    scal = args[-1]
    outs = _plan(*args[:-1], scal[:, 0:1], scal[:, 1:2], slots=sizes[2] - 1)
    return _outputs(outs, sizes)
