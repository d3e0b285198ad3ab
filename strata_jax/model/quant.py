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

"int4-q4k" (issue 36): GGUF Q4_K's blocks held as they are, values unchanged. A Q4_K super-block of 256 inputs has
8 groups of 32, each a 6-bit scale sc and 6-bit minimum m, and fp16 d and dmin: w = (d sc) q - (dmin m), q in 0..15.
Its nibbles are kept packed as the other int4 formats pack groups of 32 (byte j of a group: inputs j and j + 16;
Q4_K's own order pairs j and j + 32 of each 64, so the load moves nibbles, never values), and its scales as uint16
"codes", group-major like int4's scales: [..., 5G/4, O] (G = I/32 groups): rows 0..G-1 the code sc | m << 6 of
each group, rows G..G + G/8 - 1 each super-block's d and the last G/8 its dmin (fp16 bits). s = d * sc and
mn = dmin * m are exact in float32 (11 bits times 6), and so is s * q (+4 bits): dequantizing gives
gguf.quants.dequantize's float32 values bit for bit. 4 + 20/32 = 4.625 bits a weight (Q4_K's file: 4.5). Kernels
compute it as int4: sum_g s_g (x_g . (q - 8)) + (8 s_g - mn_g) sum(x_g). `q4k_from_blocks` reads a GGUF tensor's
bytes; `q4k_blocks` writes Q4_K bytes (tests write GGUFs with it: gguf.quants cannot quantize Q4_K).

"int2-q2k" (issue 36): GGUF Q2_K's blocks held as they are, as int4-q4k holds Q4_K's. A Q2_K super-block of 256
inputs has 16 groups of 16, each a 4-bit scale sc and 4-bit minimum m, and fp16 d and dmin: w = (d sc) q - (dmin m),
q in 0..3. q is packed four to a byte in chunks of 64 inputs: byte j of a chunk holds inputs j, j + 16, j + 32 and
j + 48 in its bits 0-1, 2-3, 4-5, 6-7 (`pack_int2`), so a shift of 2s gives the chunk's group s whole, 16 contiguous
inputs (Q2_K's own order puts inputs j and j + 32 of each 128 in one byte: the load moves crumbs, never values). Its
codes are uint8, group-major [..., 5G/4, O] (G = I/16 groups): rows 0..G-1 each group's Q2_K scale byte
sc | m << 4 as read, then the super-blocks' d (fp16, two rows a super-block: low byte, high byte), then their dmin
likewise: the file's own bytes, 2 + 20/16 = 2.625 bits a weight, as Q2_K's. s = d sc, mn = dmin m and s q are exact
in float32, so dequantizing gives gguf.quants.dequantize's float32 values bit for bit. The two share their code where
they do the same thing (`_block_scales`, `_block_fields`); the codes' dtype says which (uint16: int4-q4k, uint8:
int2-q2k). `q2k_from_blocks` reads a GGUF tensor's bytes, `q2k_blocks` writes Q2_K bytes (gguf.quants cannot
quantize Q2_K).

"int6-q6k" (issue 36): GGUF Q6_K's blocks held as they are: w = (d sc) (q - 32), sc an int8 scale per 16 inputs, fp16
d per super-block, q in 0..63 packed per 64 inputs as 32 bytes of low nibbles (int4's packing of groups of 32) and 16
of high 2-bit pairs (int2-q2k's), so each group of 16 is shifts of contiguous bytes (`pack_int6`); uint8 codes
[..., 9G/8, O]: each group's scale byte, then each super-block's d as two rows. 6.5625 bits a weight, the file's
own. Q3_K's blocks are held in it too, values unchanged (`q6k_from_q3k_blocks`: q + 32, sc - 32 as the scale).

"int6-q6km": int6-q6k with minima, for a family whose layers mix K types (a Q4_K_M file's down experts: Q4_K and
Q6_K; Q3_K_M's: Q3_K, Q4_K, Q5_K): w = (d sc) (q - 32) - (dmin m) per group of 16, q packed as int6-q6k's; uint8
codes [..., 9G/4, O]: each group's int8 sc, then each group's uint8 m, then each super-block's fp16 d as two rows,
then its dmin likewise. 6 + 16/16 + 32/256 = 7.125 bits a weight. Every K type converts into it with its values
unchanged (`q6km_from_blocks`): Q6_K as read (m = dmin = 0), Q3_K as int6-q6k holds it, Q4_K / Q5_K / Q2_K with q + 32
(q >= 0, so s (q + 32 - 32) is gguf's s q) and their sc and m (Q4_K / Q5_K's per 32 inputs on both 16-halves), d and
dmin as read; s = d sc and mn = dmin m are computed first in float32 as gguf.quants does and s q is exact.

GGUF types kept as read with float32 group scales (issue 36; `GGUF_KEPT`, `gguf_kept`): every type whose values are
a small integer q times a group scale s, minus a group minimum mn for some, w = s q (- mn), with s and mn exact in
float32 (fp16 d times a small integer) and s q exact too, so dequantizing gives gguf.quants.dequantize's float32
values bit for bit (one rounding for the minimum, as gguf's):
  "int4-g32f": Q4_0 (s = d, q = nibble - 8): int4's packing is Q4_0's, so the nibbles are copied as they are;
  "int4-g32m": Q4_1 (s = d, mn = -m, q the nibble);
  "int8-g32": Q8_0 (s = d), Q5_0 (s = d, q in -16..15); "int8-g32m": Q5_1 too (s = d, mn = -m); "int8-g16": Q6_K (s = d sc, q in -32..31), Q3_K (s = d (sc - 32), q in -4..3) by name only (expert_dtype=int8-g16:
  GGUF_KEPT holds both packed as int6-q6k, Q3_K through `q6k_from_q3k_blocks`);
  "int8-g32m": Q5_K (s = d sc, mn = dmin m, q in 0..31); "int8-g16m": Q2_K (s = d sc, mn = dmin m, q in 0..3) by
  name only (expert_dtype=int8-g16m, `keeps`): GGUF_KEPT holds Q2_K packed as int2-q2k; and a family whose layers
  mix types not all K types (Q8_0 beside Q6_K; all K types: int6-q6km), each type's values widened into it (`WIDE`,
  `widen`).
int8-g holds q one a byte (int8, [..., O, I]). Their scales on the device are float32, group-major [..., G, O] (no
minima) or [..., 2, G, O] (scales, then minima; the extra axis says minima are held); the host pool keeps
[..., O, G] / [..., O, 2, G] (`pool_scale`). Kernels compute sum_g s_g (x_g . q_g) - mn_g sum(x_g).

The IQ types kept as read in int8-g (`IQ_KEPT`; `_gguf_iq`): q the integer each weight is, s gguf's own float32
group scale. "int8-g16": IQ2_XS, IQ2_S (s = d (0.5 + sc) / 4, q = grid x sign in +-{8, 25, 43}), IQ1_M
(s = d (2 sc + 1) / 8, q = 8 (grid + delta) in +-{1, 7, 9}); "int8-g32": IQ2_XXS (as IQ2_XS), IQ3_XXS
(s = d (0.5 + sc) / 2, q = grid x sign up to +-62), IQ3_S (s = d (1 + 2 sc), q odd up to +-15), IQ4_NL (s = d) and
IQ4_XS (s = d (sc - 32)) with q the non-linear table's value in -127..113, IQ1_S (as IQ1_M). Every s and s q is exact
in float32 (at most 11 + 5 + 7 bits), so s q is gguf.quants.dequantize's product of the same factors bit for bit.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
Q4K = "int4-q4k"
QK_K = 256  # inputs per Q4_K super-block
Q4K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minima, 128 bytes of nibbles
Q2K = "int2-q2k"
Q2K_BLOCK_BYTES = 84  # 16 bytes of 4-bit scales and minima, 64 bytes of 2-bit q, fp16 d, fp16 dmin
Q6K = "int6-q6k"
Q6K_BLOCK_BYTES = 210  # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
Q6KM = "int6-q6km"
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # the K types int6-q6km holds, values unchanged
BLOCK_FORMATS = (Q4K, Q2K, Q6K, Q6KM)  # GGUF K-quant blocks held as they are: packed q and codes


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group: int  # inputs per scale; 0 = the whole input row (per output channel)
    symmetric: bool
    scale_bits: int = 16  # bf16 scales (and minima); 32: float32 ones (the GGUF types kept as read)

    def groups(self, in_dim: int) -> int:
        return 1 if self.group == 0 else in_dim // self.group

    def bits_per_weight(self, in_dim: int) -> float:
        """Stored bits per weight, scales (and minima) included."""
        if self.name in BLOCK_FORMATS:  # codes: 5G/4 of 16 (int4-q4k) or 8 (int2-q2k) bits; int6-q6k(m): 9G/8 (9G/4)
            return self.bits + self.scale_bits * {Q6K: 9 / 8, Q6KM: 9 / 4}.get(self.name, 5 / 4) / self.group
        per_group = self.scale_bits * (1 if self.symmetric else 2)
        return self.bits + per_group * self.groups(in_dim) / in_dim


FORMATS = {f.name: f for f in (
    Format("int8", 8, 0, True),  # per output channel
    Format("int4", 4, 64, True),
    Format("int4-g32", 4, 32, True),
    Format("int4-g128", 4, 128, True),
    Format("int4-asym", 4, 32, False),
    Format("int4-q4k", 4, 32, False),  # GGUF Q4_K's blocks (module docstring)
    Format("int2-q2k", 2, 16, False, 8),  # GGUF Q2_K's blocks: uint8 codes
    Format("int6-q6k", 6, 16, True, 8),  # GGUF Q6_K's blocks: uint8 codes (int8 scales, fp16 d)
    Format("int6-q6km", 6, 16, False, 8),  # the K types' blocks: uint8 codes (int8 sc, uint8 m, fp16 d, dmin)
    Format("int4-g32f", 4, 32, True, 32),  # GGUF Q4_0 as read (module docstring)
    Format("int4-g32m", 4, 32, False, 32),  # GGUF Q4_1
    Format("int8-g32", 8, 32, True, 32),  # GGUF Q8_0
    Format("int8-g16", 8, 16, True, 32),  # GGUF Q6_K, Q3_K
    Format("int8-g32m", 8, 32, False, 32),  # GGUF Q5_K
    Format("int8-g16m", 8, 16, False, 32),  # GGUF Q2_K
    Format("int3", 3, 32, False),  # stretch formats: quality studies only
    Format("int2", 2, 32, False),
)}


@dataclasses.dataclass
class Quantized:
    fmt: Format
    q: np.ndarray  # [..., O, I] int8 / uint8, or int4 packed [..., O, I/2] uint8 (int2-q2k: [..., O, I/4])
    scale: np.ndarray  # [..., O, G] bfloat16 (int4-q4k / int2-q2k: codes [..., O, 5G/4])
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
    if fmt.name in BLOCK_FORMATS:
        from_blocks, blocks = {Q4K: (q4k_from_blocks, q4k_blocks), Q2K: (q2k_from_blocks, q2k_blocks),
                               Q6K: (q6k_from_blocks, q6k_blocks),
                               Q6KM: (lambda raw: q6km_from_blocks(raw, "Q6_K"), q6k_blocks)}[fmt.name]
        packed, codes = from_blocks(blocks(w))
        return Quantized(fmt, packed, codes, None, w.shape[-1])
    x = _grouped(w, fmt)  # [..., O, G, n]
    sdt = np.float32 if fmt.scale_bits == 32 else BF16
    if fmt.symmetric:
        top = 2 ** (fmt.bits - 1) - 1
        scale = (np.max(np.abs(x), axis=-1) / top).astype(sdt)  # [..., O, G]
        s = scale.astype(np.float32)[..., None]
        q = np.clip(np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0)), -top, top).astype(np.int8)
        minimum = None
    else:
        top = 2 ** fmt.bits - 1 if fmt.bits < 8 else 127  # int8-g's q is int8: 0..127
        lo, hi = np.min(x, axis=-1), np.max(x, axis=-1)
        minimum = lo.astype(sdt)
        scale = ((hi - minimum.astype(np.float32)) / top).astype(sdt)
        s, m = scale.astype(np.float32)[..., None], minimum.astype(np.float32)[..., None]
        q = np.clip(np.rint(np.divide(x - m, s, out=np.zeros_like(x), where=s > 0)), 0, top)
        q = q.astype(np.int8 if fmt.bits == 8 else np.uint8)
    q = q.reshape(w.shape)
    if fmt.bits == 4:
        q = pack_int4(q, fmt.group)
    return Quantized(fmt, q, scale, minimum, w.shape[-1])


def dequantize(qa: Quantized) -> np.ndarray:
    """The reference: Quantized -> float32 [..., O, I]."""
    fmt = qa.fmt
    if fmt.name in BLOCK_FORMATS:
        return blocks_dequantize(qa.q, qa.scale)
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


def pack_int2(q: np.ndarray) -> np.ndarray:
    """2-bit values [..., I] (uint8 in [0, 3], I a multiple of 64) -> [..., I/4] uint8: in each chunk of 64 inputs,
    byte j holds inputs j, j + 16, j + 32, j + 48 in bits 0-1, 2-3, 4-5, 6-7 (a shift of 2s: the chunk's s-th 16)."""
    if q.shape[-1] % 64:
        raise ValueError(f"int2 packing needs an input dimension of a multiple of 64 (got {q.shape[-1]})")
    u = q.astype(np.uint8).reshape(*q.shape[:-1], q.shape[-1] // 64, 4, 16)  # [..., chunks, shift, 16]
    return (u[..., 0, :] | (u[..., 1, :] << 2) | (u[..., 2, :] << 4) | (u[..., 3, :] << 6)).reshape(
        *q.shape[:-1], q.shape[-1] // 4)


def unpack_int2(packed: np.ndarray) -> np.ndarray:
    """pack_int2's inverse: [..., I/4] uint8 -> [..., I] uint8 in [0, 3]."""
    p = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 16, 1, 16)  # [..., chunks, 1, 16]
    out = (p >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [..., chunks, 4, 16]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def _block_fields(x: np.ndarray, q_max: int, code_max: int):
    """A K-quant's codes of float weights x [..., nb, groups, n] (tests and random weights; llama.cpp's quantizers
    search their scales, this does not): per group the scale (max - min) / q_max and minimum -min (0 if min > 0), per
    super-block d = max scale / code_max and dmin = max minimum / code_max (fp16), sc and m the nearest multiples of
    them, q the nearest of 0..q_max -> (d, dmin [..., nb] float16, sc, m [..., nb, groups] uint8, q [..., nb,
    groups, n] uint8)."""
    lo, hi = x.min(-1), x.max(-1)
    scale = (hi - np.minimum(lo, 0)) / q_max  # [..., nb, groups]
    mins = np.maximum(-lo, 0)
    d = (scale.max(-1) / code_max).astype(np.float16)
    dmin = (mins.max(-1) / code_max).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    near = lambda a, b, top: np.clip(np.rint(np.divide(a, b, out=np.zeros_like(a), where=b > 0)), 0, top)
    sc, m = near(scale, df, code_max).astype(np.uint8), near(mins, dmf, code_max).astype(np.uint8)
    s, mn = df * sc, dmf * m  # [..., nb, groups]
    q = near(x + mn[..., None], s[..., None], q_max).astype(np.uint8)
    return d, dmin, sc, m, q


def _superblocks(w: np.ndarray, qtype: str) -> tuple[np.ndarray, tuple, int]:
    """float weights [..., O, I] -> (float32 [..., O, I/256, 256], lead [..., O], super-blocks a row)."""
    w = np.asarray(w, np.float32)
    lead, n = w.shape[:-1], w.shape[-1]
    if n % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} inputs (got {n})")
    return w.reshape(*lead, n // QK_K, QK_K), lead, n // QK_K


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    """float16 [...] -> its bytes [..., 2] (little-endian, as GGUF stores them)."""
    return np.ascontiguousarray(h)[..., None].view(np.uint8).reshape(*h.shape, 2)


# ---- int4-q4k: GGUF Q4_K's blocks --------------------------------------------------------------------------------

def _q4k_scale_min(raw12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes [..., 12] -> the 8 groups' 6-bit scales and minima [..., 8] uint16 (gguf's
    get_scale_min, llama.cpp's get_scale_min_k4)."""
    b = raw12.astype(np.uint16)
    d, m, md = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _row_blocks(raw: np.ndarray, size: int, qtype: str) -> tuple[np.ndarray, tuple, int]:
    """A tensor's bytes [..., O, nb * size] -> (its blocks [..., O, nb, size] uint8, lead [..., O], nb)."""
    raw = np.asarray(raw, np.uint8)
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    if nbytes % size:
        raise ValueError(f"{qtype} rows of {nbytes} bytes are not whole {size}-byte blocks")
    return raw.reshape(*lead, nbytes // size, size), lead, nbytes // size


def q4k_from_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K tensor's bytes [..., O, I/256 * 144] uint8 -> (packed [..., O, I/2] uint8 in the int4 groups' order
    (groups of 32), codes [..., O, 5G/4] uint16: per row the G groups' sc | m << 6, then the super-blocks' d, then
    their dmin, as fp16 bits). Moves bits only."""
    b, lead, nb = _row_blocks(raw, Q4K_BLOCK_BYTES, "Q4_K")
    d, dmin = b[..., 0:2].copy().view(np.uint16)[..., 0], b[..., 2:4].copy().view(np.uint16)[..., 0]  # [..., nb]
    sc, mn = _q4k_scale_min(b[..., 4:16])  # [..., nb, 8]
    qs = b[..., 16:].reshape(*lead, nb, 4, 32)  # 4 chunks of 64 inputs: byte j = input j (low) and j + 32 (high)
    q = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*lead, nb * QK_K)  # [..., I] 0..15 in input order
    packed = pack_int4(q, 32)  # uint8 in: nibbles as they are
    codes = np.concatenate([(sc | (mn << 6)).reshape(*lead, nb * 8), d, dmin], axis=-1)
    return packed, np.ascontiguousarray(codes)


def _code_fields(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per-row codes [..., 5G/4] (uint16: int4-q4k, uint8: int2-q2k) -> (group codes [..., G] uint16, d and dmin
    [..., B] float32 per super-block, the group code's scale bits)."""
    g = codes.shape[-1] * 4 // 5
    halves = np.ascontiguousarray(codes[..., g:]).view(np.float16).astype(np.float32)  # [..., 2B]: d, then dmin
    nb = halves.shape[-1] // 2
    return codes[..., :g].astype(np.uint16), halves[..., :nb], halves[..., nb:], 6 if codes.dtype == np.uint16 else 4


def block_scales(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes [..., 5G/4] (numpy, per row; int4-q4k's uint16 or int2-q2k's uint8) -> (s, mn) float32 [..., G]:
    s = d * sc, mn = dmin * m (exact)."""
    c, d, dmin, bits = _code_fields(np.asarray(codes))
    d, dmin = (np.repeat(x, c.shape[-1] // d.shape[-1], axis=-1) for x in (d, dmin))
    return d * (c & ((1 << bits) - 1)).astype(np.float32), dmin * (c >> bits).astype(np.float32)


def block_format(codes_dtype, packed_width: int, codes_width: int) -> str:
    """Which block format a (packed, codes) pair is, from the codes' dtype and the last widths (per row; on the device
    the codes' group-major rows): uint16 codes int4-q4k; uint8 int2-q2k (packed I/4, codes 5I/64: 5 P = 16 C),
    int6-q6k (packed 3I/4, codes 9I/128: 3 P = 32 C) or int6-q6km (packed 3I/4, codes 9I/64: 3 P = 16 C)."""
    if np.dtype(codes_dtype) == np.uint16:
        return Q4K
    if 5 * packed_width == 16 * codes_width:
        return Q2K
    if 3 * packed_width == 32 * codes_width:
        return Q6K
    if 3 * packed_width == 16 * codes_width:
        return Q6KM
    raise ValueError(f"packed rows of {packed_width} bytes and {codes_width} uint8 codes are no block format's")


def codes_halves(codes: np.ndarray, expert_format: str) -> np.ndarray:
    """A block format's per-row codes (int4-q4k's uint16 [..., 5G/4]; uint8: int2-q2k's [..., 5G/4], int6-q6k's
    [..., 9G/8], int6-q6km's [..., 9G/4]) -> their fp16 d (and dmin) [..., B] ([..., 2B])."""
    c = codes.shape[-1]
    start = c * 8 // 9 if expert_format in (Q6K, Q6KM) else c * 4 // 5  # after the G (q6km: 2G) group bytes
    return np.ascontiguousarray(codes[..., start:]).view(np.float16)


def blocks_dequantize(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """int4-q4k's and int2-q2k's reference: packed [..., O, I/2] (int4) or [..., O, I/4] (int2), codes
    [..., O, 5G/4] -> float32 [..., O, I] = s q - mn, in the order gguf.quants computes it (the same float32 values).
    int6-q6k's (packed [..., O, 3I/4], codes [..., O, 9G/8]) and int6-q6km's ([..., O, 9G/4]): q6k_dequantize."""
    if block_format(codes.dtype, packed.shape[-1], codes.shape[-1]) in (Q6K, Q6KM):
        return q6k_dequantize(packed, codes)
    s, mn = block_scales(codes)  # [..., O, G]
    g = s.shape[-1]
    q = (unpack_int4(packed, 32, signed=False) if codes.dtype == np.uint16 else unpack_int2(packed))
    x = q.astype(np.float32).reshape(*q.shape[:-1], g, -1) * s[..., None] - mn[..., None]
    return x.reshape(q.shape)


q4k_scales = q2k_scales = block_scales
q4k_dequantize = q2k_dequantize = blocks_dequantize


def q4k_blocks(w: np.ndarray) -> np.ndarray:
    """Q4_K bytes [..., O, I/256 * 144] of float weights [..., O, I] (I a multiple of 256), for tests and random
    weights (gguf.quants cannot quantize Q4_K; llama.cpp's quantizer searches its scales, this one does not): per
    group of 32 the scale (max - min) / 15 and minimum -min (0 if min > 0), per super-block d = max scale / 63 and
    dmin = max minimum / 63 (fp16), sc and m the nearest 6-bit multiples, q the nearest of 0..15. The packing is
    llama.cpp's (block_q4_K; get_scale_min_k4's 12 bytes)."""
    x, lead, nb = _superblocks(w, "Q4_K")
    d, dmin, sc, m, q = _block_fields(x.reshape(*lead, nb, 8, 32), 15, 63)
    scales = np.empty((*lead, nb, 12), np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    q = q.reshape(*lead, nb, 4, 2, 32)  # chunk c: groups 2c (low nibbles) and 2c + 1 (high)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*lead, nb, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=-1)
    return out.reshape(*lead, nb * Q4K_BLOCK_BYTES)


# ---- int2-q2k: GGUF Q2_K's blocks --------------------------------------------------------------------------------

def q2k_from_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q2_K tensor's bytes [..., O, I/256 * 84] uint8 -> (packed [..., O, I/4] uint8 in pack_int2's order, codes
    [..., O, 5G/4] uint8 (G = I/16): per row the G groups' scale bytes sc | m << 4, then the super-blocks' d, then
    their dmin, two bytes each (fp16, little-endian)). Moves bits only."""
    b, lead, nb = _row_blocks(raw, Q2K_BLOCK_BYTES, "Q2_K")
    # qs: 2 chunks of 32 bytes, byte j at shift 2s = input 128 c + 32 s + j (gguf's dequantize_blocks)
    qs = b[..., 16:80].reshape(*lead, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    packed = pack_int2((qs & 3).reshape(*lead, nb * QK_K))  # [..., I] in input order, repacked
    codes = np.concatenate([b[..., :16].reshape(*lead, nb * 16), b[..., 80:82].reshape(*lead, nb * 2),
                            b[..., 82:84].reshape(*lead, nb * 2)], axis=-1)
    return packed, np.ascontiguousarray(codes)


def q2k_blocks(w: np.ndarray) -> np.ndarray:
    """Q2_K bytes [..., O, I/256 * 84] of float weights [..., O, I] (I a multiple of 256), for tests and random
    weights (gguf.quants cannot quantize Q2_K): _block_fields' rules with q in 0..3 and 4-bit sc and m; the packing
    is llama.cpp's block_q2_K (scales[16] sc | m << 4, qs[64], d, dmin)."""
    x, lead, nb = _superblocks(w, "Q2_K")
    d, dmin, sc, m, q = _block_fields(x.reshape(*lead, nb, 16, 16), 3, 15)
    q = q.reshape(*lead, nb, 2, 4, 32)  # chunk c of 128 inputs, shift s: its s-th 32
    qs = (q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)).reshape(*lead, nb, 64)
    out = np.concatenate([sc | (m << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=-1)
    return out.reshape(*lead, nb * Q2K_BLOCK_BYTES)


# ---- int6-q6k: GGUF Q6_K's blocks --------------------------------------------------------------------------------

def pack_int6(q: np.ndarray) -> np.ndarray:
    """6-bit values [..., I] (uint8 in [0, 63], I a multiple of 64) -> [..., 3I/4] uint8: per chunk of 64 inputs 48
    bytes, the 64 low nibbles in int4's packing of groups of 32 (byte j < 16: inputs j and j + 16, byte 16 + j:
    inputs 32 + j and 48 + j, low nibble first), then the 64 high 2-bit pairs in pack_int2's (byte 32 + j: inputs
    j, j + 16, j + 32, j + 48 at shifts 0, 2, 4, 6). The chunk's group s of 16 inputs is then
    (lo[16 (s >> 1) + j] >> 4 (s & 1)) & 15 | ((hi[j] >> 2 s) & 3) << 4: shifts of contiguous bytes."""
    if q.shape[-1] % 64:
        raise ValueError(f"int6 packing needs an input dimension of a multiple of 64 (got {q.shape[-1]})")
    lead, n = q.shape[:-1], q.shape[-1]
    u = q.astype(np.uint8).reshape(*lead, n // 64, 64)
    lo, hi = pack_int4(u & 0xF, 32), pack_int2(u >> 4)  # [..., chunks, 32], [..., chunks, 16]
    return np.concatenate([lo, hi], axis=-1).reshape(*lead, n * 3 // 4)


def unpack_int6(packed: np.ndarray) -> np.ndarray:
    """pack_int6's inverse: [..., 3I/4] uint8 -> [..., I] uint8 in [0, 63]."""
    lead, n = packed.shape[:-1], packed.shape[-1] * 4 // 3
    p = packed.reshape(*lead, n // 64, 48)
    q = unpack_int4(p[..., :32], 32, signed=False) | (unpack_int2(p[..., 32:]) << 4)
    return q.reshape(*lead, n)


def q6k_from_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K tensor's bytes [..., O, I/256 * 210] uint8 -> (packed [..., O, 3I/4] uint8 in pack_int6's order, codes
    [..., O, 9G/8] uint8 (G = I/16): per row the G groups' int8 scale bytes as read, then the super-blocks' d, two
    bytes each (fp16, little-endian)). Moves bits only."""
    b, lead, nb = _row_blocks(raw, Q6K_BLOCK_BYTES, "Q6_K")
    # gguf's dequantize_blocks: per half of 128 inputs, ql's 64 bytes at shift 0 / 4 give inputs 0..63 / 64..127,
    # qh's 32 bytes at shift 2 s give inputs 32 s .. 32 s + 31
    ql = (b[..., :128].reshape(*lead, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0xF
    qh = (b[..., 128:192].reshape(*lead, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = ql.reshape(*lead, nb * QK_K) | (qh.reshape(*lead, nb * QK_K) << 4)  # [..., I] 0..63 in input order
    codes = np.concatenate([b[..., 192:208].reshape(*lead, nb * 16), b[..., 208:210].reshape(*lead, nb * 2)], axis=-1)
    return pack_int6(q), np.ascontiguousarray(codes)


def _int6_scales(codes: np.ndarray, minima: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """int6-q6k's codes [..., 9G/8] or int6-q6km's [..., 9G/4] (minima) uint8 (numpy, per row) -> (s = d sc,
    mn = dmin m or None) float32 [..., G] (exact: 11 bits times 8)."""
    codes = np.asarray(codes, np.uint8)
    g = codes.shape[-1] * (4 if minima else 8) // 9
    halves = np.ascontiguousarray(codes[..., (2 if minima else 1) * g:]).view(np.float16).astype(np.float32)
    halves = np.repeat(halves, 16, axis=-1)  # [..., G] d, then (minima) [..., G] dmin
    s = halves[..., :g] * codes[..., :g].view(np.int8).astype(np.float32)
    return s, (halves[..., g:] * codes[..., g:2 * g].astype(np.float32) if minima else None)


def q6k_scales(codes: np.ndarray) -> np.ndarray:
    """int6-q6k codes [..., 9G/8] uint8 (numpy, per row) -> s = d * sc float32 [..., G]."""
    return _int6_scales(codes, False)[0]


def q6km_scales(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int6-q6km codes [..., 9G/4] uint8 (numpy, per row) -> (s = d sc, mn = dmin m) float32 [..., G] (exact)."""
    return _int6_scales(codes, True)


def q6k_dequantize(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """int6-q6k's reference: packed [..., O, 3I/4], codes [..., O, 9G/8] -> float32 [..., O, I] = s (q - 32), s
    = d sc first, as gguf.quants computes it (its float32 values bit for bit); int6-q6km's (codes [..., O, 9G/4]):
    s (q - 32) - mn."""
    minima = block_format(codes.dtype, packed.shape[-1], codes.shape[-1]) == Q6KM
    s, mn = _int6_scales(codes, minima)  # [..., O, G]
    q = unpack_int6(packed).astype(np.int8) - np.int8(32)
    x = q.astype(np.float32).reshape(*q.shape[:-1], s.shape[-1], 16) * s[..., None]
    if minima:
        x = x - mn[..., None]  # one rounding, as gguf's
    return x.reshape(q.shape)


def q6k_blocks(w: np.ndarray) -> np.ndarray:
    """Q6_K bytes [..., O, I/256 * 210] of float weights [..., O, I] (I a multiple of 256), for tests and random
    weights (gguf.quants cannot quantize Q6_K; llama.cpp's quantizer searches its scales, this one does not): per
    group of 16 the scale absmax / 31, per super-block d = max scale / 127 (fp16), sc the nearest multiple (0..127),
    q the nearest of -32..31 (stored + 32). The packing is llama.cpp's block_q6_K (ql[128], qh[64], scales[16], d)."""
    x, lead, nb = _superblocks(w, "Q6_K")
    x = x.reshape(*lead, nb, 16, 16)
    scale = np.abs(x).max(-1) / 31  # [..., nb, 16]
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    near = lambda a, b: np.rint(np.divide(a, b, out=np.zeros_like(a), where=b > 0))
    sc = np.clip(near(scale, df), 0, 127).astype(np.int8)
    s = df * sc.astype(np.float32)
    q = (np.clip(near(x, s[..., None]), -32, 31) + 32).astype(np.uint8).reshape(*lead, nb, 2, 4, 32)
    # half h of 128 inputs, its s-th 32: low nibble at ql[64 h + 32 (s & 1) + j] >> 4 (s >> 1), high at qh[32 h + j]
    lo, hi = q & 0xF, q >> 4
    ql = (lo[..., 0:2, :] | (lo[..., 2:4, :] << 4)).reshape(*lead, nb, 128)
    qh = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)).reshape(*lead, nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return out.reshape(*lead, nb * Q6K_BLOCK_BYTES)


# ---- GGUF types kept as read: int4 / int8 groups with float32 scales (and minima) ----------------------------------

GGUF_KEPT = {"Q4_0": "int4-g32f", "Q4_1": "int4-g32m", "Q8_0": "int8-g32", "Q6_K": Q6K, "Q3_K": Q6K,
             "Q5_K": "int8-g32m", "Q2_K": Q2K, "Q4_K": Q4K,  # GGUF type -> the engine format keeping it
             "Q5_0": "int8-g32", "Q5_1": "int8-g32m"}  # llama-quantize's fallbacks for rows no super-block divides
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q6_K": (QK_K, 210), "Q3_K": (QK_K, 110),
               "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q5_K": (QK_K, 176), "Q2_K": (QK_K, 84), "Q4_K": (QK_K, Q4K_BLOCK_BYTES)}  # (inputs, bytes) a block
# The IQ types (issue 36): q the integer each weight is (a grid value times its sign, IQ4's table value, IQ1's
# 8 (grid + delta)), s the group scale in gguf.quants' own float32 steps (`_gguf_iq`)
IQ_KEPT = {"IQ2_XXS": "int8-g32", "IQ2_XS": "int8-g16", "IQ2_S": "int8-g16", "IQ3_XXS": "int8-g32",
           "IQ3_S": "int8-g32", "IQ4_NL": "int8-g32", "IQ4_XS": "int8-g32", "IQ1_S": "int8-g32", "IQ1_M": "int8-g16"}
GGUF_KEPT.update(IQ_KEPT)
GGUF_BLOCKS.update({"IQ2_XXS": (QK_K, 66), "IQ2_XS": (QK_K, 74), "IQ2_S": (QK_K, 82), "IQ3_XXS": (QK_K, 98),
                    "IQ3_S": (QK_K, 110), "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136), "IQ1_S": (QK_K, 50),
                    "IQ1_M": (QK_K, 56)})


def keeps(expert_format: str, qtype: str) -> bool:
    """Whether `expert_format` holds GGUF type `qtype` as read: GGUF_KEPT's format, or the one byte a weight forms
    GGUF_KEPT held before the packed ones, kept for expert_dtype by name: int8-g16m for Q2_K (before int2-q2k),
    int8-g16 for Q6_K and Q3_K (before int6-q6k); int6-q6km holds every K type's blocks (q6km_from_blocks)."""
    return (GGUF_KEPT.get(qtype) == expert_format or (expert_format, qtype) in BYTE_KEPT
            or (expert_format == Q6KM and qtype in K_TYPES))


BYTE_KEPT = {("int8-g16m", "Q2_K"), ("int8-g16", "Q6_K"), ("int8-g16", "Q3_K")}


# A family of stacks of several types (a Q4_K_M file's down experts: Q6_K, some layers Q4_K; Q3_K_M's: Q3_K, Q4_K,
# Q5_K) is held in the one format that holds each of them exactly: int6-q6km where all are K types, else int8 q with a
# scale and a minimum per 16 inputs.
WIDE = "int8-g16m"
WIDENED = ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", *IQ_KEPT)  # int8 q, groups of 16 or 32: `widen`


def holds(expert_format: str, qtype: str) -> bool:
    """Whether `expert_format` holds GGUF type `qtype`'s values exactly: as read (`keeps`), or widened into
    int8-g16m (`widen`)."""
    return keeps(expert_format, qtype) or (expert_format == WIDE and qtype in WIDENED)


def widen(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gguf_kept's int8 (q [..., O, I], scale [..., O, G] or [..., O, 2, G]) -> int8-g16m's (q, scale [..., O, 2,
    I/16]): each group's scale and minimum (0 where none: s q - 0 is s q) over each of its 16-input parts. Values
    unchanged."""
    if scale.ndim == q.ndim:
        scale = np.stack([scale, np.zeros_like(scale)], axis=-2)
    parts = q.shape[-1] // 16 // scale.shape[-1]
    return q, np.ascontiguousarray(np.repeat(scale, parts, axis=-1))


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (fp16 bits: exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _split_blocks(raw: np.ndarray, qtype: str) -> tuple[tuple, int, np.ndarray]:
    """[..., O, bytes] -> (lead [..., O], blocks a row, [N, block bytes])."""
    raw = np.asarray(raw, np.uint8)
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    _, size = GGUF_BLOCKS[qtype]
    if nbytes % size:
        raise ValueError(f"{qtype} rows of {nbytes} bytes are not whole {size}-byte blocks")
    return lead, nbytes // size, raw.reshape(-1, size)


def _q3k_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K blocks [N, 110] -> (sc int8 [N, 16] in -32..31, q int8 [N, 16, 16] in -4..3), gguf.quants' steps: the
    value is fp16 d (bytes 108..110) times sc times q."""
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 3) << 4)).astype(np.int8) - np.int8(32)
    ql = ((qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = (qh.reshape(n, 16, 16) & 1) ^ np.uint8(1)  # the offset 4 applies where the mask bit is 0
    return sc, ql.astype(np.int8) - (qh << 2).astype(np.int8)


def _qk_parts(b: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks [N, 144 / 176] or Q2_K's [N, 84] -> (sc, m uint8 [N, 8] per 32 inputs (Q2_K: [N, 16] per
    16), q int8 [N, 256] in input order: 0..15 / 0..31 / 0..3), gguf.quants' steps: the value is fp16 d times sc
    times q, minus fp16 dmin times m."""
    n = b.shape[0]
    if qtype == "Q2_K":
        scales, qs = b[:, :16], b[:, 16:80]
        q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        return scales & 0xF, scales >> 4, q.reshape(n, QK_K).astype(np.int8)
    sc, m = _q4k_scale_min(b[:, 4:16])  # [N, 8]
    qs = b[:, 48:] if qtype == "Q5_K" else b[:, 16:]
    q = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [N, 4, 2, 32]
    if qtype == "Q5_K":  # the high bit of input 32 k + j: bit k of qh[j]
        qh = (b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = q.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)
    return sc.astype(np.uint8), m.astype(np.uint8), q.reshape(n, QK_K).astype(np.int8)


def q6km_from_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A K type's tensor bytes [..., O, I/256 * block bytes] (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) -> int6-q6km's (packed
    [..., O, 3I/4] uint8 in pack_int6's order, codes [..., O, 9G/4] uint8, G = I/16: per row the G groups' int8 sc,
    then their uint8 m, then the super-blocks' d, then their dmin, two bytes each), the same float32 values: Q6_K
    and Q3_K as int6-q6k holds them with m = 0 and dmin = 0 (s (q - 32) - 0 is s (q - 32)); Q4_K, Q5_K and Q2_K
    with q + 32 (their q >= 0: s (q + 32 - 32) is their s q) and sc, m (Q4_K / Q5_K's per 32 inputs on both halves),
    d and dmin as read."""
    if qtype in ("Q6_K", "Q3_K"):
        packed, codes = (q6k_from_blocks if qtype == "Q6_K" else q6k_from_q3k_blocks)(raw)
        g = codes.shape[-1] * 8 // 9
        zeros = np.zeros_like(codes[..., :g])  # m, and dmin's bytes (fp16 +0)
        return packed, np.concatenate([codes[..., :g], zeros, codes[..., g:], zeros[..., :g // 8]], axis=-1)
    if qtype not in K_TYPES:
        raise ValueError(f"int6-q6km holds the K types {', '.join(K_TYPES)}, not {qtype}")
    lead, nb, b = _split_blocks(raw, qtype)
    sc, m, q = _qk_parts(b, qtype)
    if qtype != "Q2_K":  # each 32-group's sc and m on both of its 16-halves
        sc, m = np.repeat(sc, 2, axis=-1), np.repeat(m, 2, axis=-1)
    at = 80 if qtype == "Q2_K" else 0  # d, then dmin
    q6 = (q + np.int8(32)).view(np.uint8).reshape(*lead, nb * QK_K)
    codes = np.concatenate([sc.reshape(*lead, nb * 16), m.reshape(*lead, nb * 16),
                            b[:, at:at + 2].reshape(*lead, nb * 2), b[:, at + 2:at + 4].reshape(*lead, nb * 2)], -1)
    return pack_int6(q6), np.ascontiguousarray(codes)


def q6k_from_q3k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q3_K tensor's bytes [..., O, I/256 * 110] -> int6-q6k's (packed, codes), the same float32 values: Q3_K is
    d (sc - 32) q with q in -4..3 and sc - 32 in -32..31, which Q6_K's d sc (q - 32) holds with q + 32 in 28..35
    and sc - 32 as its int8 scale (s = d sc computed first in both, as gguf.quants does). 6.5625 bits a weight
    where Q3_K's file has 3.4375: one form, one kernel, for the down families llama-quantize writes in Q3_K
    beside Q6_K (Q2_K, Q3_K_M files), against int8-g16's 10 bits."""
    lead, nb, b = _split_blocks(raw, "Q3_K")
    sc, q = _q3k_parts(b)  # [N, 16], [N, 16, 16]
    q6 = (q.astype(np.int16) + 32).astype(np.uint8).reshape(*lead, nb * QK_K)
    codes = np.concatenate([sc.view(np.uint8).reshape(*lead, nb * 16),
                            b[:, 108:110].reshape(*lead, nb * 2)], axis=-1)
    return pack_int6(q6), np.ascontiguousarray(codes)


def gguf_kept(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes [..., O, bytes] of a type in GGUF_KEPT (Q4_K here for `widen`; kept as read:
    q4k_from_blocks) -> (q, scale): q
    int8 [..., O, I] (int8-g) or int4 packed uint8 [..., O, I/2]; scale float32 [..., O, G] (no minima) or
    [..., O, 2, G] (s, then mn), the pool's layout. Moves bits and multiplies fp16 d by small integers (exact); the
    steps are gguf.quants' dequantize_blocks' own."""
    lead, nb, b = _split_blocks(raw, qtype)
    n = b.shape[0]
    minima = None
    if qtype in ("Q4_0", "Q4_1"):  # int4's packing is Q4_0's: byte j holds inputs j and j + 16 of the block
        s = _f16(b[:, 0:2])[:, None]  # [N, 1]
        at = 2 if qtype == "Q4_0" else 4
        if qtype == "Q4_1":
            minima = -_f16(b[:, 2:4])[:, None]  # w = d q + m = s q - (-m)
        q = b[:, at:]  # [N, 16] packed as they are
    elif qtype == "Q8_0":
        s, q = _f16(b[:, 0:2])[:, None], b[:, 2:].view(np.int8)
    elif qtype in ("Q5_0", "Q5_1"):  # q = low nibble (byte j: inputs j and j + 16) | bit i of qh << 4
        s, at = _f16(b[:, 0:2])[:, None], 2 if qtype == "Q5_0" else 4
        if qtype == "Q5_1":
            minima = -_f16(b[:, 2:4])[:, None]  # w = d q + m = s q - (-m)
        qh = np.ascontiguousarray(b[:, at:at + 4]).view("<u4")  # [N, 1]
        qh = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, 32]
        ql = (b[:, at + 4:, None] >> np.array([0, 4], np.uint8)) & 0x0F  # [N, 16, 2]
        q = (np.swapaxes(ql, 1, 2).reshape(n, 32) | (qh << 4)).astype(np.int8)
        if qtype == "Q5_0":
            q = q - np.int8(16)
    elif qtype == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        s = d[:, None] * sc.astype(np.float32)  # [N, 16]
        ql = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
        qh = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
        q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    elif qtype == "Q3_K":
        sc, q = _q3k_parts(b)
        s = _f16(b[:, 108:110])[:, None] * sc.astype(np.float32)  # [N, 16]
    elif qtype in ("Q5_K", "Q4_K", "Q2_K"):
        sc, m, q = _qk_parts(b, qtype)  # [N, 8] (Q2_K: 16), q [N, 256] in input order
        at = 80 if qtype == "Q2_K" else 0
        d, dmin = _f16(b[:, at:at + 2]), _f16(b[:, at + 2:at + 4])
        s, minima = d[:, None] * sc.astype(np.float32), dmin[:, None] * m.astype(np.float32)
    elif qtype in IQ_KEPT:
        s, q = _gguf_iq(b, qtype)
    else:
        raise ValueError(f"gguf_kept: GGUF type {qtype} is not kept as read (kept: {', '.join(GGUF_KEPT)})")
    q = np.ascontiguousarray(q).reshape(*lead, -1)
    s = s.reshape(*lead, -1)
    if minima is not None:
        s = np.stack([s, minima.reshape(*lead, -1)], axis=-2)  # [..., O, 2, G]
    return q, np.ascontiguousarray(s, np.float32)


_IQ_TABLES: dict = {}


def _iq_tables(qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(gguf.quants' grid of an IQ type as int8 [N, 8 or 4] (IQ4: its 16 values [16, 1]), the ±1 signs [128, 8] of
    IQ2_XXS.ksigns' bytes, bit k the sign of value k)."""
    if qtype not in _IQ_TABLES:
        import gguf
        cls = getattr(gguf.quants, qtype if qtype != "IQ4_XS" else "IQ4_NL")
        if hasattr(cls, "init_grid") and qtype not in ("IQ4_NL", "IQ4_XS"):
            cls.init_grid()
            grid = np.asarray(cls.grid, np.float32).reshape(-1, cls.grid.shape[-1])
        else:
            grid = np.asarray(cls.kvalues, np.float32).reshape(-1, 1)
        assert np.array_equal(grid, np.rint(grid)) and np.abs(grid).max() <= 127, qtype
        ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8)
        signs = np.where((ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1, -1, 1).astype(np.int8)
        _IQ_TABLES[qtype] = (grid.astype(np.int8), signs)
    return _IQ_TABLES[qtype]


def _bits_signs(b: np.ndarray) -> np.ndarray:
    """Sign bytes [N, k] -> ±1 int8 [N, 8k]: bit j of byte i the sign of value 8i + j (1: negative)."""
    bits = (b[..., None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)
    return (np.int8(1) - (bits << np.uint8(1)).view(np.int8)).reshape(b.shape[0], -1)


def _gguf_iq(b: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """An IQ type's blocks [N, bytes] -> (s float32 [N, G], q int8 [N, 256 or 32]): gguf.quants' dequantize_blocks
    (0.19) with its w = s x q split off. s is gguf's own float32 expression (fp16 d times (0.5 + sc) / 4 or / 2,
    (1 + 2 sc), (sc - 32); IQ1: d (2 sc + 1) / 8, a power of two more), q an integer of at most 7 bits, so s q
    is exact in float32 and equals gguf's product of the same factors (each exact too) bit for bit."""
    n = b.shape[0]
    grid, ksigns = _iq_tables(qtype)
    f32 = np.float32
    if qtype in ("IQ4_NL", "IQ4_XS"):  # byte j of 16: values j (low nibble) and j + 16 (high) of a group of 32
        if qtype == "IQ4_NL":
            s, qs = _f16(b[:, 0:2])[:, None], b[:, 2:].reshape(n, 1, 16)
        else:
            d, sh, sl, qs = _f16(b[:, 0:2]), b[:, 2:4].copy().view(np.uint16), b[:, 4:8], b[:, 8:].reshape(n, 8, 16)
            lo = ((sl.reshape(n, 4, 1) >> np.array([0, 4], np.uint8)) & 0x0F).reshape(n, 8)
            hi = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)  # [N, 8]
            s = d[:, None] * ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(f32)
        nib = (qs[:, :, None, :] >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        return s, grid[nib.reshape(n, -1), 0]
    d = _f16(b[:, 0:2])[:, None] if qtype != "IQ1_M" else None
    if qtype == "IQ2_XXS":  # per 32: 4 grid bytes, then a uint32 of 4 x 7-bit sign indices and the 4-bit scale
        qs = b[:, 2:].copy().view(np.uint32).reshape(n, 8, 2)
        s = d * (f32(0.5) + (qs[..., 1] >> 28).astype(f32)) * f32(0.25)
        idx = qs[..., 0].copy().view(np.uint8).reshape(n, 32)
        sg = (qs[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F  # [N, 8, 4]
        return s, (grid[idx] * ksigns[sg.reshape(n, 32)]).reshape(n, -1)
    if qtype == "IQ2_XS":  # per 8: a uint16 (9-bit grid index, 7-bit sign index); 4-bit scales per 16
        qs, sc = b[:, 2:66].copy().view(np.uint16), b[:, 66:74]
        sc = ((sc.reshape(n, 8, 1) >> np.array([0, 4], np.uint8)) & 0x0F).reshape(n, 16)
        s = d * (f32(0.5) + sc.astype(f32)) * f32(0.25)
        return s, (grid[qs & 511] * ksigns[qs >> 9]).reshape(n, -1)
    if qtype == "IQ2_S":  # per 8: a grid byte with 2 high bits in qh, a sign byte; 4-bit scales per 16
        qs, signs, qh, sc = b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:82]
        sc = ((sc.reshape(n, 8, 1) >> np.array([0, 4], np.uint8)) & 0x0F).reshape(n, 16)
        s = d * (f32(0.5) + sc.astype(f32)) * f32(0.25)
        hi = ((qh.reshape(n, 8, 1) >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(n, 32)
        return s, grid[qs.astype(np.uint16) | (hi.astype(np.uint16) << 8)].reshape(n, -1) * _bits_signs(signs)
    if qtype == "IQ3_XXS":  # grid bytes of 4 values; per 32 a uint32 of 4 x 7-bit sign indices and the scale
        qs, aux = b[:, 2:66], b[:, 66:98].copy().view(np.uint32)  # [N, 64], [N, 8]
        s = d * (f32(0.5) + (aux >> 28).astype(f32)) * f32(0.5)
        sg = (aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F  # [N, 8, 4]
        return s, grid[qs].reshape(n, -1) * ksigns[sg.reshape(n, 32)].reshape(n, -1)
    if qtype == "IQ3_S":  # grid bytes of 4 values with a high bit in qh, sign bits; 4-bit scales per 32
        qs, qh, signs, sc = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
        sc = ((sc.reshape(n, 4, 1) >> np.array([0, 4], np.uint8)) & 0x0F).reshape(n, 8)
        s = d * (1 + 2 * sc)  # gguf's: uint8 (1 + 2 sc) times float32 d
        hi = ((qh.reshape(n, 8, 1) >> np.arange(8, dtype=np.uint8)) & 1).reshape(n, 64).astype(np.uint16)
        return s, grid[qs.astype(np.uint16) | (hi << 8)].reshape(n, -1) * _bits_signs(signs)
    # IQ1: w = dl (grid + delta), grid in {-1, 0, 1}, delta ±1/8: q = 8 (grid + delta), s = dl / 8 (exact)
    if qtype == "IQ1_S":  # per 32: a uint16 of 4 x 3 high index bits, the 3-bit scale and the delta's sign
        qs, qh = b[:, 2:34], b[:, 34:50].copy().view(np.uint16)  # [N, 32], [N, 8]
        s = d * (2 * ((qh >> 12) & 7) + 1) * f32(0.125)
        neg = np.repeat((qh & 0x8000) != 0, 4, axis=1)  # [N, 32]: per 8 values
        hi = ((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, 32)
    else:  # IQ1_M: per 8 a nibble (3 high index bits, the delta's sign); 3-bit scales per 16; d in the top nibbles
        qs, qh, sc = b[:, :32], b[:, 32:48], b[:, 48:56].copy().view(np.uint16)
        dbits = (sc & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
        d = (dbits[:, 0] | dbits[:, 1] | dbits[:, 2] | dbits[:, 3]).view(np.float16).astype(f32)[:, None]
        scales = ((sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, 16)
        s = d * (2 * scales + 1) * f32(0.125)
        nib = (qh.reshape(n, 16, 1) >> np.array([0, 4], np.uint8)).reshape(n, 32)
        neg, hi = (nib & 0x08) != 0, nib & 7
    q = 8 * grid[qs.astype(np.uint16) | (hi.astype(np.uint16) << 8)] + np.where(neg, -1, 1).astype(np.int8)[..., None]
    return s, q.astype(np.int8).reshape(n, -1)


def kept_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The reference of the float32-scaled grouped formats (numpy, pool layout): q int8 [..., O, I] or int4 packed
    uint8 [..., O, I/2], scale [..., O, G] or [..., O, 2, G] -> float32 [..., O, I] = s q (- mn), gguf.quants' values."""
    minima = scale.ndim == q.ndim + 1
    s = scale[..., 0, :] if minima else scale  # [..., O, G]
    g = s.shape[-1]
    if q.dtype == np.uint8:
        q = unpack_int4(q, 2 * q.shape[-1] // g, signed=not minima)
    x = q.astype(np.float32).reshape(*q.shape[:-1], g, -1) * s[..., None]
    if minima:
        x = x - scale[..., 1, :, None]
    return x.reshape(q.shape)


def gguf_blocks_random(qtype: str, shape: tuple[int, ...], seed: int = 0, d_scale: float = 1e-3) -> np.ndarray:
    """Valid bytes [..., O, I / inputs * bytes] of a GGUF block type for tests: random bits, each block's fp16 d (and
    dmin / m) drawn finite, about d_scale (gguf.quants cannot quantize the K types; their values need not be
    close to any weights to test that they are read exactly)."""
    rng = np.random.default_rng(seed)
    inputs, size = GGUF_BLOCKS[qtype]
    *lead, n = shape
    if n % inputs:
        raise ValueError(f"{qtype} needs rows of a multiple of {inputs} inputs (got {n})")
    b = rng.integers(0, 256, (*lead, n // inputs, size), dtype=np.uint8)
    half = lambda: (rng.uniform(0.5, 1.5, (*lead, n // inputs)) * d_scale).astype(np.float16)[..., None].view(np.uint8)
    fields = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q6_K": (208,), "Q3_K": (108,), "Q5_K": (0, 2),
              "Q2_K": (80, 82), "Q4_K": (0, 2), "IQ1_M": ()}.get(qtype, (0,))  # the IQ types: d first
    for at in fields:
        b[..., at:at + 2] = half()
    if qtype == "IQ1_M":  # d's fp16 bits in the top nibbles of the 4 uint16 scales
        d = half().view(np.uint16)  # [..., 1]
        sc = b[..., 48:56].copy().view(np.uint16)
        sc = (sc & np.uint16(0x0FFF)) | (((d >> np.array([0, 4, 8, 12], np.uint16)) & 0xF) << 12)
        b[..., 48:56] = sc.view(np.uint8)
    return b.reshape(*lead, -1)


def _fp16_rows(rows):
    """Byte rows [..., 2B, O] uint8 (each fp16 two rows, low byte first: the uint8 codes' d and dmin) -> float32
    [..., B, O] (jnp)."""
    import jax
    import jax.numpy as jnp
    r = rows.astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(r[..., 0::2, :] | (r[..., 1::2, :] << 8), jnp.float16).astype(jnp.float32)


def block_scales_device(codes, groups: int):
    """block_scales on the device (jnp): codes [..., 5G/4, O] group-major (the engine's; uint16: int4-q4k, uint8:
    int2-q2k, its fp16 d and dmin two rows each, low byte first) -> (s, mn) float32 [..., G, O]."""
    import jax
    import jax.numpy as jnp
    c = codes[..., :groups, :].astype(jnp.int32)
    rows = codes[..., groups:, :]
    bits = 6 if codes.dtype == jnp.uint16 else 4
    halves = (_fp16_rows(rows) if codes.dtype == jnp.uint8  # [..., 2B, O]: d, then dmin
              else jax.lax.bitcast_convert_type(rows, jnp.float16).astype(jnp.float32))
    nb = halves.shape[-2] // 2
    d, dmin = (jnp.repeat(h, groups // nb, axis=-2) for h in (halves[..., :nb, :], halves[..., nb:, :]))
    return d * (c & ((1 << bits) - 1)).astype(jnp.float32), dmin * (c >> bits).astype(jnp.float32)


def dequantize_engine_blocks(packed, codes, dtype):
    """int4-q4k / int2-q2k on the device: packed [..., O, I/2] / [..., O, I/4], engine codes [..., 5G/4, O] ->
    [..., O, I] (float32: exact)."""
    import jax.numpy as jnp
    if block_format(codes.dtype, packed.shape[-1], codes.shape[-2]) in (Q6K, Q6KM):
        return dequantize_engine_q6k(packed, codes, dtype)
    g = codes.shape[-2] * 4 // 5
    s, mn = block_scales_device(codes, g)  # [..., G, O]
    lead = packed.shape[:-1]
    if codes.dtype == jnp.uint16:
        p = packed.reshape(*lead, g, 16).astype(jnp.int32)  # [..., O, G, 16]
        q = jnp.concatenate([p & 0xF, p >> 4], axis=-1)  # [..., O, G, 32]
    else:
        p = packed.reshape(*lead, g // 4, 1, 16).astype(jnp.int32)  # [..., O, chunks, 1, 16]
        q = ((p >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(*lead, g, 16)  # [..., O, G, 16]
    w = q.astype(jnp.float32) * jnp.swapaxes(s, -1, -2)[..., None] - jnp.swapaxes(mn, -1, -2)[..., None]
    return w.reshape(*lead, -1).astype(dtype)


q4k_scales_device = block_scales_device


def int6_scales_device(codes, minima: bool):
    """_int6_scales on the device (jnp): int6-q6k's engine codes [..., 9G/8, O] or int6-q6km's [..., 9G/4, O]
    (minima) uint8, group-major (G rows of int8 sc, with minima G of uint8 m, then d (and dmin) two rows a
    super-block) -> (s = d sc, mn = dmin m or None) float32 [..., G, O]."""
    import jax
    import jax.numpy as jnp
    g = codes.shape[-2] * (4 if minima else 8) // 9
    sc = jax.lax.bitcast_convert_type(codes[..., :g, :], jnp.int8).astype(jnp.float32)
    halves = jnp.repeat(_fp16_rows(codes[..., (2 if minima else 1) * g:, :]), 16, axis=-2)  # d, then dmin
    s = halves[..., :g, :] * sc
    return s, (halves[..., g:, :] * codes[..., g:2 * g, :].astype(jnp.float32) if minima else None)


def dequantize_engine_q6k(packed, codes, dtype):
    """int6-q6k on the device: packed [..., O, 3I/4], engine codes [..., 9G/8, O] -> [..., O, I] = s (q - 32)
    (float32: gguf's values); int6-q6km (codes [..., 9G/4, O]): s (q - 32) - mn."""
    import jax.numpy as jnp
    minima = block_format(codes.dtype, packed.shape[-1], codes.shape[-2]) == Q6KM
    s, mn = int6_scales_device(codes, minima)
    s = jnp.swapaxes(s, -1, -2)  # [..., O, G]
    lead = packed.shape[:-1]
    p = packed.reshape(*lead, -1, 48).astype(jnp.int32)  # [..., O, chunks, 48]
    lo = jnp.concatenate([p[..., 0:16] & 0xF, p[..., 0:16] >> 4, p[..., 16:32] & 0xF, p[..., 16:32] >> 4], -1)
    hi = ((p[..., None, 32:] >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(*p.shape[:-1], 64)
    q = (lo | (hi << 4)) - 32  # [..., O, chunks, 64]
    w = q.reshape(*lead, s.shape[-1], 16).astype(jnp.float32) * s[..., None]
    if minima:
        w = w - jnp.swapaxes(mn, -1, -2)[..., None]
    return w.reshape(*lead, -1).astype(dtype)


dequantize_engine_q4k = dequantize_engine_q2k = dequantize_engine_blocks


def quantize_blocks_device(w, expert_format: str):
    """int4-q4k / int2-q2k on the device (jax; random weights for benchmarks): w [..., O, I] -> (packed, engine
    codes [..., 5G/4, O]), the numbers of q4k_from_blocks(q4k_blocks(w)) / q2k_from_blocks(q2k_blocks(w)) (the same
    rules, in jnp)."""
    import jax
    import jax.numpy as jnp
    if expert_format in (Q6K, Q6KM):
        return quantize_q6k_device(w, minima=expert_format == Q6KM)
    q4k = expert_format == Q4K
    group, q_max, code_bits = (32, 15, 6) if q4k else (16, 3, 4)
    lead, n = w.shape[:-1], w.shape[-1]
    nb = n // QK_K
    x = w.astype(jnp.float32).reshape(*lead, nb, QK_K // group, group)
    lo, hi = x.min(-1), x.max(-1)
    scale, mins = (hi - jnp.minimum(lo, 0)) / q_max, jnp.maximum(-lo, 0)
    code_max = (1 << code_bits) - 1
    d, dmin = (scale.max(-1) / code_max).astype(jnp.float16), (mins.max(-1) / code_max).astype(jnp.float16)
    df, dmf = d.astype(jnp.float32)[..., None], dmin.astype(jnp.float32)[..., None]
    div = lambda a, b: jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)
    sc = jnp.clip(jnp.round(div(scale, df)), 0, code_max).astype(jnp.int32)
    m = jnp.clip(jnp.round(div(mins, dmf)), 0, code_max).astype(jnp.int32)
    s, mn = df * sc, dmf * m
    q = jnp.clip(jnp.round(div(x + mn[..., None], s[..., None])), 0, q_max).astype(jnp.int32)  # [..., nb, G/nb, g]
    bits = lambda h: jax.lax.bitcast_convert_type(h, jnp.uint16)
    group_codes = (sc | (m << code_bits)).reshape(*lead, n // group)
    if q4k:
        packed = (q[..., :16] | (q[..., 16:] << 4)).astype(jnp.uint8).reshape(*lead, n // 2)
        codes = jnp.concatenate([group_codes.astype(jnp.uint16), bits(d), bits(dmin)], -1)
    else:
        c = q.reshape(*lead, n // 64, 4, 16)  # chunks of 64: a shift of 2s holds the chunk's s-th 16
        packed = (c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6))
        packed = packed.astype(jnp.uint8).reshape(*lead, n // 4)
        le_bytes = lambda h: jnp.stack([bits(h) & 0xFF, bits(h) >> 8], -1).reshape(*lead, nb * 2)  # low byte first
        codes = jnp.concatenate([group_codes, le_bytes(d), le_bytes(dmin)], -1).astype(jnp.uint8)
    return packed, jnp.swapaxes(codes, -1, -2)


def quantize_q6k_device(w, minima: bool = False):
    """int6-q6k on the device (jax; random weights for benchmarks): w [..., O, I] -> (packed [..., O, 3I/4], engine
    codes [..., 9G/8, O]), the numbers of q6k_from_blocks(q6k_blocks(w)) (the same rules, in jnp); minima:
    int6-q6km's codes [..., 9G/4, O] of the same numbers (m = 0, dmin = 0: q6km_from_blocks of Q6_K)."""
    import jax
    import jax.numpy as jnp
    lead, n = w.shape[:-1], w.shape[-1]
    nb = n // QK_K
    x = w.astype(jnp.float32).reshape(*lead, nb, 16, 16)
    scale = jnp.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(jnp.float16)
    df = d.astype(jnp.float32)[..., None]
    div = lambda a, b: jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)
    sc = jnp.clip(jnp.round(div(scale, df)), 0, 127).astype(jnp.int32)
    s = df * sc.astype(jnp.float32)
    q = (jnp.clip(jnp.round(div(x, s[..., None])), -32, 31) + 32).astype(jnp.int32)
    c = q.reshape(*lead, n // 64, 4, 16)  # chunks of 64, their 4 groups of 16
    lo, hi = c & 0xF, c >> 4
    lo = jnp.concatenate([lo[..., 0, :] | (lo[..., 1, :] << 4), lo[..., 2, :] | (lo[..., 3, :] << 4)], -1)
    hi = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    packed = jnp.concatenate([lo, hi], -1).astype(jnp.uint8).reshape(*lead, n * 3 // 4)
    dbits = jax.lax.bitcast_convert_type(d, jnp.uint16)
    le_bytes = jnp.stack([dbits & 0xFF, dbits >> 8], -1).reshape(*lead, nb * 2)  # low byte first
    sc_bytes, d_bytes = (sc & 0xFF).reshape(*lead, n // 16), le_bytes.astype(jnp.int32)
    parts = [sc_bytes, jnp.zeros_like(sc_bytes), d_bytes, jnp.zeros_like(d_bytes)] if minima else [sc_bytes, d_bytes]
    return packed, jnp.swapaxes(jnp.concatenate(parts, -1).astype(jnp.uint8), -1, -2)


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


def quantize_grouped_device(w, fmt: "Format"):
    """The float32-scaled grouped formats on the device (random weights; saved states' shapes): w [..., O, I] ->
    (q int8 [..., O, I] or int4 packed [..., O, I/2], engine scale float32 [..., G, O] or [..., 2, G, O]): absmax
    (or min / max) per group, q nearest."""
    import jax.numpy as jnp
    g = fmt.group
    x = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // g, g)  # [..., O, G, g]
    div = lambda a, b: jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)
    if fmt.symmetric:
        top = 2 ** (fmt.bits - 1) - 1
        s = jnp.max(jnp.abs(x), axis=-1) / top  # [..., O, G]
        q = jnp.clip(jnp.round(div(x, s[..., None])), -top, top).astype(jnp.int32)
        scale = jnp.swapaxes(s, -1, -2)
    else:
        top = 15 if fmt.bits == 4 else 127
        lo, hi = x.min(-1), x.max(-1)
        s = (hi - lo) / top
        q = jnp.clip(jnp.round(div(x - lo[..., None], s[..., None])), 0, top).astype(jnp.int32)
        scale = jnp.stack([jnp.swapaxes(s, -1, -2), -jnp.swapaxes(lo, -1, -2)], axis=-3)  # mn = -min
    if fmt.bits == 8:
        return q.astype(jnp.int8).reshape(w.shape), scale
    q = q + (8 if fmt.symmetric else 0)
    packed = (q[..., : g // 2] | (q[..., g // 2:] << 4)).astype(jnp.uint8)
    return packed.reshape(*w.shape[:-1], w.shape[-1] // 2), scale


def dequantize_engine_grouped(q, scale, dtype):
    """The float32-scaled grouped formats on the device: q int8 [..., O, I] or int4 packed [..., O, I/2], engine
    scale [..., G, O] or [..., 2, G, O] -> [..., O, I] = s q (- mn) (float32: exact)."""
    import jax.numpy as jnp
    minima = scale.ndim == q.ndim + 1
    s = jnp.swapaxes(scale[..., 0, :, :] if minima else scale, -1, -2).astype(jnp.float32)  # [..., O, G]
    g = s.shape[-1]
    if q.dtype == jnp.uint8:
        p = q.reshape(*q.shape[:-1], g, -1).astype(jnp.int32)  # [..., O, G, group/2]
        v = jnp.concatenate([p & 0xF, p >> 4], axis=-1) - (0 if minima else 8)
    else:
        v = q.reshape(*q.shape[:-1], g, -1)
    w = v.astype(jnp.float32) * s[..., None]
    if minima:
        w = w - jnp.swapaxes(scale[..., 1, :, :], -1, -2).astype(jnp.float32)[..., None]
    return w.reshape(*q.shape[:-2], q.shape[-2], -1).astype(dtype)


# The engine's expert formats, and how their experts are stored: int8 q one a byte, int4 packed two a byte (uint8,
# the input dimension halved), with scales on the device: [E, O] (int8), or group-major [E, I/group, O] for int4 (a
# group's scales of consecutive rows are then one contiguous load in the kernel; the host pool keeps [E, O, G]).
ENGINE_FORMATS = ("int8", "int4", "int4-g32", Q4K, Q2K, Q6K, Q6KM, "int4-g32f", "int4-g32m", "int8-g32", "int8-g16",
                  "int8-g32m", "int8-g16m")
KEPT_FORMATS = tuple(f for f in ENGINE_FORMATS if f not in BLOCK_FORMATS  # GGUF as read, float32 scales
                     and (f.endswith(("f", "m")) or f.startswith("int8-g")))


def engine_format(expert_dtype: str, widths: tuple[int, ...]) -> str | None:
    """The format of the engine option expert_dtype (auto: None) for experts of these input widths (hidden,
    intermediate): int4 takes groups of 64 where both are multiples of 64, else of 32; ValueError if neither. A pair
    "gate_up/down" (per-family formats): each family's for its own input width (gate / up read hidden inputs, down
    intermediate ones), the pair's name back."""
    if FAMILY_SEP in expert_dtype:
        return pair_format(*(engine_format(f, (w,)) for f, w in zip(family_formats(expert_dtype), widths)))
    if expert_dtype in BLOCK_FORMATS:
        if any(w % QK_K for w in widths):
            held = {Q4K: 'Q4_K', Q2K: 'Q2_K', Q6K: 'Q6_K', Q6KM: 'the K types\''}[expert_dtype]
            raise ValueError(f"expert_dtype={expert_dtype} holds {held} "
                             f"super-blocks of {QK_K} inputs: the experts' widths "
                             f"{' and '.join(map(str, widths))} are not multiples of {QK_K}")
        return expert_dtype
    if expert_dtype in KEPT_FORMATS:
        group = get_format(expert_dtype).group
        if any(w % group for w in widths):
            raise ValueError(f"expert_dtype={expert_dtype} holds groups of {group} inputs: the experts' widths "
                             f"{' and '.join(map(str, widths))} are not multiples of {group}")
        return expert_dtype
    if expert_dtype not in ("int8", "int4"):
        return None
    if expert_dtype == "int8" or not any(w % 64 for w in widths):
        return expert_dtype
    if not any(w % 32 for w in widths):
        return "int4-g32"
    raise ValueError(f"expert_dtype=int4 quantizes in groups of 64 or 32 inputs: the experts' widths "
                     f"{' and '.join(map(str, widths))} are not multiples of 32")


def storage_dtype(expert_format: str) -> np.dtype:
    return np.dtype(np.int8) if expert_format.startswith("int8") else np.dtype(np.uint8)


# Per-family expert formats (issue 36, Q4_K_M's mix): the gate/up family and the down family may be held in two
# formats, written "gate_up/down" (e.g. "int4-q4k/int8-g16"); one name means both. Every consumer asks per matrix.
FAMILY_SEP = "/"
MATRICES = ("gate", "up", "down")


def family_formats(expert_format: str | None) -> tuple[str | None, str | None]:
    """(gate/up format, down format) of an engine format or a pair "gate_up/down"; (None, None) for None."""
    if not expert_format:
        return None, None
    gate_up, _, down = expert_format.partition(FAMILY_SEP)
    return gate_up, down or gate_up


def pair_format(gate_up: str | None, down: str | None) -> str | None:
    """The engine format name of two families' formats: one name where they agree, else "gate_up/down"."""
    if gate_up is None and down is None:
        return None
    if gate_up is None or down is None:
        raise ValueError("expert formats: both families quantized, or neither")
    return gate_up if gate_up == down else f"{gate_up}{FAMILY_SEP}{down}"


def matrix_format(expert_format: str | None, which: str) -> str | None:
    """The format of matrix `which` ("gate", "up", "down", or a Hub / leaf name holding one of them)."""
    gate_up, down = family_formats(expert_format)
    return down if "down" in which else gate_up


def is_engine_format(expert_dtype: str) -> bool:
    """Whether an expert_dtype value names engine formats: one of ENGINE_FORMATS' option names, or a pair of them."""
    names = ("int8", "int4", *(f for f in ENGINE_FORMATS if f not in ("int4-g32",)))
    parts = expert_dtype.split(FAMILY_SEP)
    return len(parts) in (1, 2) and all(p in names for p in parts)


def formats_bits(expert_format: str, in_dim: int = QK_K) -> float:
    """Stored bits per weight of an expert of this format (a pair: gate and up at theirs, down at its own)."""
    gate_up, down = family_formats(expert_format)
    return (2 * get_format(gate_up).bits_per_weight(in_dim) + get_format(down).bits_per_weight(in_dim)) / 3


def stored_in_dim(in_dim: int, storage) -> int:
    """The last dimension of a stored expert matrix of `in_dim` inputs: halved for int4 (uint8) storage, quartered
    for int2-q2k's, 3/4 for int6-q6k's and int6-q6km's (storage: a dtype, or Q2K / Q6K where the dtype alone (uint8)
    would say int4: `slot_storage`)."""
    if isinstance(storage, str):  # Q2K, Q6K
        return in_dim * 3 // 4 if storage == Q6K else in_dim // 4
    return in_dim // 2 if np.dtype(storage) == np.uint8 else in_dim


def slot_storage(expert_format: str) -> "np.dtype | str":
    """How one family's experts sit in host memory and the slots: its storage dtype, or Q2K (uint8, four a byte) /
    Q6K (uint8, 48 bytes per 64 inputs: pack_int6; int6-q6km's q too, its minima sit with the codes)."""
    if expert_format == Q6KM:
        return Q6K
    return expert_format if expert_format in (Q2K, Q6K) else np.dtype(storage_dtype(expert_format))


def engine_scale(qa: Quantized) -> np.ndarray:
    """The scales the engine keeps on the device: [..., O] for per-row int8, group-major [..., G, O] for grouped
    formats; [..., 2, G, O] (scales, then minima mn = -minimum) for the float32-scaled formats with minima."""
    if qa.fmt.group == 0:
        return qa.scale[..., 0]
    if qa.minimum is not None and qa.fmt.scale_bits == 32:
        return engine_scale_of(np.stack([qa.scale, -qa.minimum], axis=-2))
    return np.ascontiguousarray(np.swapaxes(qa.scale, -1, -2))


def engine_scale_of(pool: np.ndarray) -> np.ndarray:
    """A grouped pool-layout scale array [E, O, G] / [E, O, 2, G] as the device keeps it: [E, G, O] / [E, 2, G, O]."""
    if pool.ndim == 4:
        return np.ascontiguousarray(np.transpose(pool, (0, 2, 3, 1)))
    return np.ascontiguousarray(np.swapaxes(pool, -1, -2))


def pool_scale(scale: np.ndarray) -> np.ndarray:
    """A device scale array as the host pool keeps it: int4's group-major [E, G, O] back to [E, O, G]; with minima
    [E, 2, G, O] -> [E, O, 2, G]."""
    if scale.ndim == 4:
        return np.ascontiguousarray(np.transpose(scale, (0, 3, 1, 2)))
    return np.ascontiguousarray(np.swapaxes(scale, -1, -2)) if scale.ndim == 3 else scale


def dequantize_engine_int4(packed, scale, dtype):
    """dequantize_int4_device for the engine's group-major scales [..., G, O] (int4-q4k: uint16 codes; int2-q2k's
    packed q [..., O, I/4] with its uint8 codes too, and int6-q6k's / int6-q6km's [..., O, 3I/4]: block_format)."""
    import jax.numpy as jnp
    if scale.dtype in (jnp.uint16, jnp.uint8):
        return dequantize_engine_blocks(packed, scale, dtype)
    if scale.dtype == jnp.float32 and scale.ndim == packed.ndim + 1:  # int4-g32m: minima
        return dequantize_engine_grouped(packed, scale, dtype)
    return dequantize_int4_device(packed, jnp.swapaxes(scale, -1, -2), dtype)


def quantize_device(w, expert_format: str):
    """The engine formats on the device (random weights): w [..., O, I] -> (q, engine scale). One format (a pair's
    family: matrix_format)."""
    if expert_format == "int8":
        return quantize_int8_device(w)
    if expert_format in BLOCK_FORMATS:
        return quantize_blocks_device(w, expert_format)
    if expert_format in KEPT_FORMATS:
        return quantize_grouped_device(w, get_format(expert_format))
    q, scale = quantize_int4_device(w, get_format(expert_format).group)
    return q, scale.swapaxes(-1, -2)  # group-major, as engine_scale
