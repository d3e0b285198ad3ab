"""Add the host pool's expert rows into the window's output: y[t] += sum_k w[t, k] * mapped[t, k] over CPU entries.

`mapped` [T, K, H] holds one unweighted expert output row per (token, routing choice); only the rows of entries the
plan gave to the CPU are defined, the others are garbage (possibly NaN), so entries are chosen with a select on the
mask, never by multiplying with a zero weight. Both kernels sum k in increasing order (a fixed order, so a run is
reproducible) and add the sum to y, which is aliased to the output (updated in place when the caller donates it).

`copy_rows_by_weight` restricts the sum to the heavy (w >= threshold) or the light (w < threshold) CPU entries, so
the two halves can be added at different times (e.g. the heavy rows first, the light rows once the pool has them);
heavy then light equals `copy_rows_from_mapped` up to float summation order.

Grid (T, H / block_h): each program reads K weights, K mask bits and K row blocks of one token and writes one row
block. K is unrolled (a few experts per token), so only [block_h] vectors are loaded, a power of 2 as Triton needs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_BLOCK_H = 256  # columns per program: K loads of 256 elements keep a program's registers small


# ----------------------------------------------------------------------------------------------------------- kernels

def _sum_selected(mapped_ref, w_ref, sel):
    """sum_k where(sel(k, w_k), w_k * mapped[k], 0) in increasing k; mapped_ref [K, BH], w_ref [K]."""
    num_k, block_h = mapped_ref.shape
    acc = jnp.zeros((block_h,), jnp.float32)  # [BH]
    for k in range(num_k):  # static unroll: fixed summation order
        w = w_ref[k]  # scalar f32
        row = mapped_ref[k, :].astype(jnp.float32)  # [BH]
        acc = acc + jnp.where(sel(k, w), w * row, 0.0)  # select, not multiply: NaN garbage rows stay out
    return acc


def _copy_rows_from_mapped_kernel(y_ref, mapped_ref, w_ref, mask_ref, o_ref):
    # y_ref, o_ref [BH]; mapped_ref [K, BH]; w_ref, mask_ref [K]
    acc = _sum_selected(mapped_ref, w_ref, lambda k, w: mask_ref[k] != 0)
    o_ref[:] = y_ref[:] + acc


def _copy_rows_by_weight_kernel(y_ref, mapped_ref, w_ref, mask_ref, thr_ref, o_ref, *, heavy: bool):
    # y_ref, o_ref [BH]; mapped_ref [K, BH]; w_ref, mask_ref [K]; thr_ref [1]
    thr = thr_ref[0]

    def sel(k, w):
        by_weight = (w >= thr) if heavy else (w < thr)
        return jnp.logical_and(mask_ref[k] != 0, by_weight)

    acc = _sum_selected(mapped_ref, w_ref, sel)
    o_ref[:] = y_ref[:] + acc


# ---------------------------------------------------------------------------------------------------------- wrappers

def _block_h(h: int) -> int:
    """A power of 2: the next one above h for small h, else MAX_BLOCK_H."""
    return min(MAX_BLOCK_H, pl.next_power_of_2(h))


def _call(kernel, y, mapped, weights, cpu_mask, extra, interpret: bool):
    """Shared pallas_call of both kernels; extra: more whole-array inputs after the mask (the threshold)."""
    T, K, H = mapped.shape
    if y.shape != (T, H) or y.dtype != jnp.float32:
        raise ValueError(f"y must be float32 [{T}, {H}], got {y.dtype} {y.shape}")
    if weights.shape != (T, K) or cpu_mask.shape != (T, K):
        raise ValueError(f"weights and cpu_mask must be [{T}, {K}], got {weights.shape} and {cpu_mask.shape}")
    bh = _block_h(H)
    hp = pl.cdiv(H, bh) * bh
    if hp != H:  # pad H to whole blocks; the usual H (a multiple of 128) skips this and stays in place
        y = jnp.pad(y, ((0, 0), (0, hp - H)))  # [T, Hp]
        mapped = jnp.pad(mapped, ((0, 0), (0, 0), (0, hp - H)))  # [T, K, Hp]
    weights = weights.astype(jnp.float32)  # [T, K]
    mask = cpu_mask.astype(jnp.int32)  # [T, K]: int32, not bool, in Triton's loads
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, hp), jnp.float32),
        grid=(T, hp // bh),
        in_specs=[
            pl.BlockSpec((None, bh), lambda t, j: (t, j)),  # y [BH]
            pl.BlockSpec((None, K, bh), lambda t, j: (t, 0, j)),  # mapped [K, BH]
            pl.BlockSpec((None, K), lambda t, j: (t, 0)),  # weights [K] (scalar loads: K need not be a power of 2)
            pl.BlockSpec((None, K), lambda t, j: (t, 0)),  # mask [K]
            *[pl.BlockSpec(e.shape, lambda t, j, n=e.ndim: (0,) * n) for e in extra],
        ],
        out_specs=pl.BlockSpec((None, bh), lambda t, j: (t, j)),  # [BH]
        input_output_aliases={0: 0},  # y -> out: in place when y is donated
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name=getattr(kernel, "__name__", "copy_rows").strip("_"),
    )(y, mapped, weights, mask, *extra)
    return out[:, :H] if hp != H else out  # [T, H]


@functools.partial(jax.jit, static_argnames=("interpret",))
def copy_rows_from_mapped(y, mapped, weights, cpu_mask, *, interpret: bool = False):
    """y [T, H] f32, mapped [T, K, H] (f32 or bf16), weights [T, K] f32, cpu_mask [T, K] bool -> [T, H] f32:
    y + sum_k where(cpu_mask, weights * mapped, 0), k in increasing order."""
    return _call(_copy_rows_from_mapped_kernel, y, mapped, weights, cpu_mask, (), interpret)


@functools.partial(jax.jit, static_argnames=("heavy", "interpret"))
def copy_rows_by_weight(y, mapped, weights, cpu_mask, threshold, *, heavy: bool, interpret: bool = False):
    """copy_rows_from_mapped over the CPU entries with weights >= threshold (heavy) or < threshold (light);
    threshold: a float32 scalar (traced: changing it does not recompile)."""
    thr = jnp.reshape(jnp.asarray(threshold, jnp.float32), (1,))  # [1]
    kernel = functools.partial(_copy_rows_by_weight_kernel, heavy=heavy)
    kernel.__name__ = f"copy_rows_{'heavy' if heavy else 'light'}_kernel"
    return _call(kernel, y, mapped, weights, cpu_mask, (thr,), interpret)


# -------------------------------------------------------------------------------------------------------- references

def _reference(y, mapped, weights, sel):
    """y + sum_k where(sel[:, k], weights[:, k] * mapped[:, k], 0), k in increasing order, in plain jnp."""
    acc = jnp.zeros(y.shape, jnp.float32)  # [T, H]
    for k in range(mapped.shape[1]):
        term = weights[:, k, None].astype(jnp.float32) * mapped[:, k].astype(jnp.float32)  # [T, H]
        acc = acc + jnp.where(sel[:, k, None], term, 0.0)
    return y + acc


def copy_rows_from_mapped_reference(y, mapped, weights, cpu_mask):
    """Plain-jnp copy_rows_from_mapped: [T, H] f32."""
    return _reference(y, mapped, weights, cpu_mask)


def copy_rows_by_weight_reference(y, mapped, weights, cpu_mask, threshold, *, heavy: bool):
    """Plain-jnp copy_rows_by_weight: [T, H] f32."""
    thr = jnp.asarray(threshold, jnp.float32)
    by_weight = weights >= thr if heavy else weights < thr  # [T, K]
    return _reference(y, mapped, weights, jnp.logical_and(cpu_mask, by_weight))
