"""Low-bit expert formats: quantize a weight matrix at load, and the reference dequantization.

A format quantizes each output channel's input row, either whole (`group` 0: one scale per output channel) or in
groups of `group` inputs. Symmetric formats store q in [-(2^(b-1)-1), 2^(b-1)-1] and a scale (w ~ q * scale);
asymmetric ones (k-quant style) store q in [0, 2^b - 1], a scale and a minimum (w ~ q * scale + min). Scales and
minima are bfloat16, as the GPU kernels read them; q is computed against the bf16-rounded scale so that dequantizing
what is stored gives back the nearest grid point. int4 is packed two to a byte within each group, as GGUF's Q4_0
block is: byte j of a group of G inputs holds input j in its low nibble and input j + G/2 in its high nibble, and a
symmetric q is stored as q + 8 (0..15). A kernel then dots the low nibbles with the group's first half of x and the
high ones with its second half, with no interleaving shuffle. 2 and 3 bits are kept one to a byte here (quality
studies: their packing is not built yet).

Shapes: a weight [..., O, I] (the experts' Hub layout [E, O, I]) -> q [..., O, I] int8 (int4: [..., O, I/2] uint8),
scale / min [..., O, G] with G = I / group (1 for group 0).

The engine's `expert_dtype` stores "int8" (per output row) or int4 (symmetric: "int4", groups of 64, or
"int4-g32" for experts whose widths are multiples of 32 only: `engine_format`).
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group: int  # inputs per scale; 0 = the whole input row (per output channel)
    symmetric: bool

    def groups(self, in_dim: int) -> int:
        return 1 if self.group == 0 else in_dim // self.group

    def bits_per_weight(self, in_dim: int) -> float:
        """Stored bits per weight, scales (and minima) included."""
        per_group = 16 * (1 if self.symmetric else 2)
        return self.bits + per_group * self.groups(in_dim) / in_dim


FORMATS = {f.name: f for f in (
    Format("int8", 8, 0, True),  # per output channel
    Format("int4", 4, 64, True),
    Format("int4-g32", 4, 32, True),
    Format("int4-g128", 4, 128, True),
    Format("int4-asym", 4, 32, False),
    Format("int3", 3, 32, False),  # stretch formats: quality studies only
    Format("int2", 2, 32, False),
)}


@dataclasses.dataclass
class Quantized:
    fmt: Format
    q: np.ndarray  # [..., O, I] int8 / uint8, or int4 packed [..., O, I/2] uint8
    scale: np.ndarray  # [..., O, G] bfloat16
    minimum: np.ndarray | None  # [..., O, G] bfloat16 (asymmetric formats)
    in_dim: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.minimum is None else self.minimum.nbytes)


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown expert format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def _grouped(w: np.ndarray, fmt: Format) -> np.ndarray:
    """[..., O, I] -> [..., O, G, I/G] float32."""
    in_dim = w.shape[-1]
    g = fmt.groups(in_dim)
    if fmt.group and in_dim % fmt.group:
        raise ValueError(f"{fmt.name}: the input dimension {in_dim} is not a multiple of the group {fmt.group}")
    return np.asarray(w, np.float32).reshape(*w.shape[:-1], g, in_dim // g)


def quantize(w: np.ndarray, fmt: Format | str) -> Quantized:
    """w [..., O, I] (any float dtype) -> Quantized."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    x = _grouped(w, fmt)  # [..., O, G, n]
    if fmt.symmetric:
        top = 2 ** (fmt.bits - 1) - 1
        scale = (np.max(np.abs(x), axis=-1) / top).astype(BF16)  # [..., O, G]
        s = scale.astype(np.float32)[..., None]
        q = np.clip(np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0)), -top, top).astype(np.int8)
        minimum = None
    else:
        top = 2 ** fmt.bits - 1
        lo, hi = np.min(x, axis=-1), np.max(x, axis=-1)
        minimum = lo.astype(BF16)
        scale = ((hi - minimum.astype(np.float32)) / top).astype(BF16)
        s, m = scale.astype(np.float32)[..., None], minimum.astype(np.float32)[..., None]
        q = np.clip(np.rint(np.divide(x - m, s, out=np.zeros_like(x), where=s > 0)), 0, top).astype(np.uint8)
    q = q.reshape(w.shape)
    if fmt.bits == 4:
        q = pack_int4(q, fmt.group)
    return Quantized(fmt, q, scale, minimum, w.shape[-1])


def dequantize(qa: Quantized) -> np.ndarray:
    """The reference: Quantized -> float32 [..., O, I]."""
    fmt = qa.fmt
    q = unpack_int4(qa.q, fmt.group, fmt.symmetric) if fmt.bits == 4 else qa.q
    x = _grouped(q.astype(np.float32), fmt) * qa.scale.astype(np.float32)[..., None]
    if qa.minimum is not None:
        x = x + qa.minimum.astype(np.float32)[..., None]
    return x.reshape(q.shape)


def pack_int4(q: np.ndarray, group: int) -> np.ndarray:
    """int4 values [..., I] (int8 in [-8, 7]: stored + 8; or uint8 in [0, 15]) -> [..., I/2] uint8: in each group
    of `group` inputs, byte j holds input j (low nibble) and input j + group/2 (high nibble)."""
    if group % 2 or q.shape[-1] % group:
        raise ValueError(f"int4 packing needs an even group dividing the input dimension ({q.shape[-1]}, {group})")
    u = (q.astype(np.int16) + (8 if q.dtype == np.int8 else 0)).astype(np.uint8)
    u = u.reshape(*q.shape[:-1], q.shape[-1] // group, 2, group // 2)  # [..., G, half, group/2]
    return (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(*q.shape[:-1], q.shape[-1] // 2)


def unpack_int4(packed: np.ndarray, group: int, signed: bool) -> np.ndarray:
    """pack_int4's inverse: [..., I/2] uint8 -> [..., I] int8 (signed: nibble - 8) or uint8."""
    lead, half = packed.shape[:-1], packed.shape[-1]
    p = packed.reshape(*lead, 2 * half // group, group // 2)
    out = np.stack([p & 0xF, p >> 4], axis=-2).reshape(*lead, 2 * half)  # [..., G, 2, group/2] -> [..., I]
    return (out.astype(np.int16) - 8).astype(np.int8) if signed else out


def quantize_int8_device(w):
    """"int8" on the device (jax; random weights for benchmarks): w [..., O, I] -> (q int8 [..., O, I], scale bf16
    [..., O]), the same numbers as `quantize(w, "int8")`."""
    import jax.numpy as jnp
    x = w.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / 127.0).astype(jnp.bfloat16)  # [..., O]
    s = scale.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round(jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)), -127, 127).astype(jnp.int8)
    return q, scale


def quantize_int4_device(w, group: int = 64):
    """"int4" on the device (jax; random weights for benchmarks): w [..., O, I] -> (packed uint8 [..., O, I/2],
    scale bf16 [..., O, I/group]), the same numbers as `quantize(w, "int4")` (group 64) or "int4-g32"."""
    import jax.numpy as jnp
    x = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // group, group)  # [..., O, G, group]
    scale = (jnp.max(jnp.abs(x), axis=-1) / 7.0).astype(jnp.bfloat16)  # [..., O, G]
    s = scale.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round(jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)), -7, 7).astype(jnp.int32) + 8
    lo, hi = q[..., : group // 2], q[..., group // 2:]
    packed = (lo | (hi << 4)).astype(jnp.uint8)  # [..., O, G, group/2]
    return packed.reshape(*w.shape[:-1], w.shape[-1] // 2), scale


def dequantize_int4_device(packed, scale, dtype):
    """The int4 reference on the device: packed [..., O, I/2] uint8, scale [..., O, G] -> [..., O, I] in dtype
    (float32 holds q * scale exactly; bf16 does not, so the compute paths scale per group in float32 instead)."""
    import jax.numpy as jnp
    g = scale.shape[-1]
    p = packed.reshape(*packed.shape[:-1], g, -1).astype(jnp.int32)  # [..., O, G, group/2]
    q = jnp.concatenate([p & 0xF, p >> 4], axis=-1) - 8  # [..., O, G, group]
    w = q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    return w.reshape(*packed.shape[:-1], -1).astype(dtype)


# The engine's expert formats, and how their experts are stored: int8 q one a byte, int4 packed two a byte (uint8,
# the input dimension halved), with scales on the device: [E, O] (int8), or group-major [E, I/group, O] for int4 (a
# group's scales of consecutive rows are then one contiguous load in the kernel; the host pool keeps [E, O, G]).
ENGINE_FORMATS = ("int8", "int4", "int4-g32")


def engine_format(expert_dtype: str, widths: tuple[int, ...]) -> str | None:
    """The format of the engine option expert_dtype (auto: None) for experts of these input widths (hidden,
    intermediate): int4 takes groups of 64 where both are multiples of 64, else of 32; ValueError if neither."""
    if expert_dtype not in ("int8", "int4"):
        return None
    if expert_dtype == "int8" or not any(w % 64 for w in widths):
        return expert_dtype
    if not any(w % 32 for w in widths):
        return "int4-g32"
    raise ValueError(f"expert_dtype=int4 quantizes in groups of 64 or 32 inputs: the experts' widths "
                     f"{' and '.join(map(str, widths))} are not multiples of 32")


def storage_dtype(expert_format: str) -> np.dtype:
    return np.dtype(np.int8) if expert_format == "int8" else np.dtype(np.uint8)


def stored_in_dim(in_dim: int, dtype) -> int:
    """The last dimension of a stored expert matrix of `in_dim` inputs: halved for int4 (uint8) storage."""
    return in_dim // 2 if np.dtype(dtype) == np.uint8 else in_dim


def engine_scale(qa: Quantized) -> np.ndarray:
    """The scales the engine keeps on the device: [..., O] for per-row int8, group-major [..., G, O] for grouped
    formats."""
    return qa.scale[..., 0] if qa.fmt.group == 0 else np.ascontiguousarray(np.swapaxes(qa.scale, -1, -2))


def pool_scale(scale: np.ndarray) -> np.ndarray:
    """A device scale array as the host pool keeps it: int4's group-major [E, G, O] back to [E, O, G]."""
    return np.ascontiguousarray(np.swapaxes(scale, -1, -2)) if scale.ndim == 3 else scale


def dequantize_engine_int4(packed, scale, dtype):
    """dequantize_int4_device for the engine's group-major scales [..., G, O]."""
    import jax.numpy as jnp
    return dequantize_int4_device(packed, jnp.swapaxes(scale, -1, -2), dtype)


def quantize_device(w, expert_format: str):
    """The engine formats on the device (random weights): w [..., O, I] -> (q, engine scale)."""
    if expert_format == "int8":
        return quantize_int8_device(w)
    q, scale = quantize_int4_device(w, get_format(expert_format).group)
    return q, scale.swapaxes(-1, -2)  # group-major, as engine_scale
