"""Host copy of every layer's expert weights, read by the host pool.

Format choice: weights stay in the dtype they are given, without a copy.
  * float32 is used as is by BLAS.
  * bfloat16 stays bfloat16 (2 bytes / weight). Pool jobs convert it to float32
    in row chunks (~1 MB of float32, so the converted copy stays in the core's
    cache) right before the matmul. Converting the whole store once would
    double host memory (a Qwen3-30B-A3B has ~58 GB of bf16 experts -> ~116 GB,
    more than the 128 GB host can spare) for little speed: measured on a
    2-core EPYC (`python -m strata_jax.host_pool.measure`, 8 experts H=2048 I=768), a
    layer job takes 7.7 ms (T=1) / 8.2 ms (T=4) from bf16 converted per
    chunk vs 5.5 / 9.7 ms from bf16 converted once to float32. With more
    cores sharing DRAM, reading half the bytes should matter more.
  * int8 (one scale per output row) and int4 (strata_jax/model/quant.py "int4": two
    to a byte, a scale per group of inputs) stay packed; jobs widen the same
    row chunks to float32 (int4: dequantized exactly, nibble - 8 times its
    group's scale) and BLAS reads them. int4 chunks go through a small C
    kernel (host_pool/native.py, built on first use; numpy's five passes in
    `_dequantize_int4` where no compiler is found, or STRATA_POOL_NATIVE=0).
    Measured on the same 2-core VM (other jobs running; best of 6 interleaved
    rounds, 8 experts H=2048 I=768): ms per expert at T=1 / 4: bf16 1.99 /
    2.61, int8 1.93 / 2.55, int4 C 2.12 / 2.67, int4 numpy 7.63 / 7.92. The
    C loop converts faster than numpy's bf16 cast (51 vs ~57 us per 1 MB
    chunk); what int4 still loses is Python per weight slice (~30 us: the
    switch, three array pointers, ctypes calls).
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

from . import native

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)
U8 = np.dtype(np.uint8)  # int4: two packed to a byte

# Floats converted at a time: 1 MB of float32 scratch, about one core's L2.
# Measured (2-core EPYC, 1 MB L2): 256 KB chunks -> 5.9 GB/s, 512 KB -> 7.9,
# 1 MB -> 9.7, 2 MB -> 9.3 (per-call overhead vs. falling out of L2).
CHUNK_FLOATS = 256 * 1024


class HostExpertStore:
    """Per-layer stacked expert weights in HF layout.

    gate, up: [E, I, H] (out, in); down: [E, H, I]. One dtype for the store.
    `bf16_as_f32=True` converts bf16 weights to float32 once (doubles memory;
    kept only to measure against the default).

    Quantized experts (strata_jax/model/quant.py) come as (gate, up, down,
    gate_scale, up_scale, down_scale), the scales float32 or bfloat16 (kept
    as float32 here):
      * int8: int8 q as above, one scale per output row: [E, I], [E, I], [E, H].
      * int4: uint8 packed two to a byte within each group of inputs (GGUF
        Q4_0's order, q + 8 in a nibble): gate, up [E, I, H/2], down
        [E, H, I/2]; a scale per (output row, group): [E, I, H/g], [E, I, H/g],
        [E, H, I/g] (g = 64 for "int4"; the group is read off the scales).
      * int4-q4k (GGUF Q4_K's blocks, quant.py "int4-q4k"): int4's packed
        groups of 32 with their uint16 codes as the device keeps them (pool
        layout [E, O, 5G/4]: per group sc | m << 6, then the super-blocks' fp16
        d and dmin), kept as Q4_K's file holds them: per output row one
        16-byte record a super-block (`block_records`: fp16 d, fp16 dmin, the
        8 groups' 12-bit codes two to 3 bytes), uint8 [E, O, 16 B], 4.5 bits a
        weight with q. The pool decodes s = d sc and mn = dmin m per group
        where it reads them (exact); w = s q - mn with q the nibble (0..15).
        `format` "int4-q4k", `minima` True.
      * GGUF types kept as read with float32 group scales (quant.py "int8-g32",
        ...): int8 q [E, O, in] with scales [E, O, G] (w = s q), or [E, O, 2, G]
        (w = s q - mn: scales, then minima), kept as [E, O, G] / [E, O, 2G];
        `format` "int8-g", `minima` for the second. int4 packed with float32
        scales and minima [E, O, 2, G] (Q4_1): as int4-q4k's decoded form,
        `format` "int4-m". (Q4_0's float32 scales are plain int4.)
      * int2-q2k (GGUF Q2_K's blocks, quant.py "int2-q2k"): uint8 packed four
        to a byte (in each chunk of 64 inputs byte b holds inputs b, b + 16,
        b + 32, b + 48 at shifts 0, 2, 4, 6): gate, up [E, I, H/4], down
        [E, H, I/4], with uint8 codes (pool layout [E, O, 5G/4], G = in/16:
        per group sc | m << 4, then the super-blocks' fp16 d and dmin as byte
        pairs), kept as int4-q4k's: a 20-byte record a super-block (d, dmin,
        the 16 code bytes), uint8 [E, O, 20 B], 2.625 bits a weight with q,
        Q2_K's; w = s q - mn. `format` "int2-q2k", `minima` True.
      * int6-q6k (GGUF Q6_K's blocks, quant.py "int6-q6k"): uint8 packed
        48 bytes per 64 inputs (quant.pack_int6: 32 bytes of low nibbles in
        int4's order of groups of 32, then 16 of high 2-bit pairs in
        int2-q2k's): gate, up [E, I, 3H/4], down [E, H, 3I/4], with uint8
        codes (pool layout [E, O, 9G/8], G = in/16: per group its int8 scale
        sc as a byte, then the super-blocks' fp16 d as byte pairs), kept as an
        18-byte record a super-block (d, the 16 sc), uint8 [E, O, 18 B],
        6.5625 bits a weight with q, Q6_K's; w = d sc (q - 32). `format`
        "int6-q6k", `minima` False.
      * int6-q6km (quant.py "int6-q6km": a family of mixed GGUF K types,
        values unchanged): int6-q6k's packed q with uint8 codes (pool layout
        [E, O, 9G/4]: per group its int8 sc, then its uint8 m, then the
        super-blocks' fp16 d, then their dmin, as byte pairs), kept as a
        36-byte record a super-block (d, dmin, the 16 sc, the 16 m), uint8
        [E, O, 36 B], 7.125 bits a weight with q; w = d sc (q - 32) - dmin m.
        `format` "int6-q6km", `minima` True.
    Per-family formats (issue 36: a Q4_K_M GGUF's Q4_K gate/up and Q6_K down
    kept as read): gate and up share one format, down may hold another
    (both quantized); each matrix's is `format_of` / `dtype_of` /
    `minima_of` / `group(layer, which)`, and `format` is "gate_up/down"
    (e.g. "int4-q4k/int8-g") where they differ (`dtype`, `minima`, `grouped`:
    gate/up's).
    `compute_dtype` (float32 or bfloat16; default bf16 for quantized experts)
    says how the pool rounds, as the device's graphs do.
    """

    def __init__(self, layers: list[tuple[np.ndarray, ...]], bf16_as_f32: bool = False,
                 compute_dtype: np.dtype | None = None):
        self.gate: list[np.ndarray] = []  # per layer [E, I, H] (int4: [E, I, H/2])
        self.up: list[np.ndarray] = []    # per layer [E, I, H] (int4: [E, I, H/2])
        self.down: list[np.ndarray] = []  # per layer [E, H, I] (int4: [E, H, I/2])
        # Quantized experts: per layer their scales as float32, int8 [E, I], [E, I], [E, H]; int4 [E, I, H/g],
        # [E, I, H/g], [E, H, I/g]; int4-q4k / int2-q2k: uint8 super-block records [E, O, B * 16 / 20]
        # (`block_records`). None for float experts.
        self.gate_scale: list[np.ndarray | None] = []
        self.up_scale: list[np.ndarray | None] = []
        self.down_scale: list[np.ndarray | None] = []
        # Per family (gate/up, down: issue 36's per-family formats, Q4_K_M's Q4_K gate/up and Q6_K down), what
        # each layer's matrices are: (format name, dtype, minima, grouped), one value per family over the layers.
        seen: dict[str, set] = {"gate_up": set(), "down": set()}
        for index, (gate, up, down, *scales) in enumerate(layers):
            for a in (gate, up, down):
                if a.dtype not in (F32, BF16, I8, U8):
                    raise TypeError(f"layer {index}: expert dtype {a.dtype}, want float32, bfloat16, int8 or "
                                    "uint8 (packed int4)")
            quantized = gate.dtype in (I8, U8)
            if gate.dtype != up.dtype or (down.dtype != gate.dtype and not (quantized and down.dtype in (I8, U8))):
                raise TypeError(f"layer {index}: gate/up/down dtypes differ ({gate.dtype}, {up.dtype}, {down.dtype}; "
                                "only quantized families may differ: gate/up one format, down another)")
            if quantized != (len(scales) == 3):
                raise TypeError(f"layer {index}: int8 and int4 experts come with three scale arrays (and float "
                                "ones with none)")
            if gate.ndim != 3 or up.ndim != 3 or down.ndim != 3:
                raise ValueError(f"layer {index}: shapes gate {gate.shape} up {up.shape} down {down.shape}, "
                                 "want [E, out, in]")
            E, I, H = gate.shape[0], gate.shape[1], down.shape[1]
            # stored elements a row of `in` inputs: int2-q2k's (uint8 codes) in/4, int6-q6k's (uint8 codes of 9 in/128)
            # 3 in/4, int4's in/2
            width_gu, width_d = (_stored_width(a, s if quantized else None, n)
                                 for a, s, n in ((gate, scales[0] if scales else None, H),
                                                 (down, scales[-1] if scales else None, I)))
            if gate.shape[2] != width_gu or up.shape != gate.shape or down.shape != (E, H, width_d):
                raise ValueError(f"layer {index}: shapes gate {gate.shape} up {up.shape} down {down.shape}"
                                 + (" (int4: packed [E, out, in/2]; int2-q2k: [E, out, in/4]; int6-q6k: "
                                    "[E, out, 3 in/4])" if U8 in (gate.dtype, down.dtype) else ""))
            if quantized:
                gu_scales, gu_kind = _family_scales(index, gate.dtype, scales[:2], ("gate", "up"), E, (I, H))
                d_scales, d_kind = _family_scales(index, down.dtype, scales[2:], ("down",), E, (H, I))
                scales = [*gu_scales, *d_scales]
            else:
                gu_kind = d_kind = (_FLOAT_NAMES[gate.dtype], gate.dtype, False, False)
            seen["gate_up"].add(gu_kind)
            seen["down"].add(d_kind)
            for lst, x in zip((self.gate_scale, self.up_scale, self.down_scale), scales or (None,) * 3):
                lst.append(x)
            if bf16_as_f32 and gate.dtype == BF16:
                gate, up, down = (a.astype(F32) for a in (gate, up, down))
            # Contiguous rows let jobs slice without copies; no copy if already so.
            self.gate.append(np.ascontiguousarray(gate))
            self.up.append(np.ascontiguousarray(up))
            self.down.append(np.ascontiguousarray(down))
        for family, kinds in seen.items():
            if len({k[1] for k in kinds}) > 1:
                raise TypeError(f"layers mix dtypes {sorted(str(k[1]) for k in kinds)}")
            if len(kinds) > 1:
                raise TypeError("layers mix experts with and without minima, or int8 with group and row scales")
        empty = ("float32", F32, False, False)
        gu_kind, d_kind = (seen[f].pop() if seen[f] else empty for f in ("gate_up", "down"))
        if bf16_as_f32 and gu_kind[1] == BF16:
            gu_kind = d_kind = empty
        # (format, stored dtype, minima: scales [E, O, 2G] s then mn, grouped: int8-g's group scales) per matrix
        self._kinds = {"gate": gu_kind, "up": gu_kind, "down": d_kind}
        self.dtype: np.dtype = gu_kind[1]  # as stored: uint8 for int4 (gate/up's; `dtype_of` per matrix)
        self.minima = gu_kind[2]  # gate/up's (`minima_of` per matrix)
        self.grouped = gu_kind[3]  # gate/up's
        # one name where the families agree, else "gate_up/down" (e.g. "int4-q4k/int8-g")
        self.format = gu_kind[0] if gu_kind[0] == d_kind[0] else f"{gu_kind[0]}/{d_kind[0]}"
        quantized = self.dtype in (I8, U8)
        self.compute_dtype = np.dtype(compute_dtype) if compute_dtype is not None else (
            BF16 if quantized else self.dtype)

    def format_of(self, which: str) -> str:
        """Matrix `which`'s ("gate", "up", "down") format: "int4-q4k", "int8-g", "bfloat16", ..."""
        return self._kinds[which][0]

    def dtype_of(self, which: str) -> np.dtype:
        """Matrix `which`'s stored dtype (uint8: int4 packed)."""
        return self._kinds[which][1]

    def minima_of(self, which: str) -> bool:
        """Whether matrix `which`'s scales hold minima ([E, O, 2G]: s, then mn)."""
        return self._kinds[which][2]

    def int6(self, which: str) -> bool:
        """Whether matrix `which` is int6-q6k's or int6-q6km's (pack_int6: 48 bytes per 64 inputs)."""
        return self.format_of(which) in ("int6-q6k", "int6-q6km")

    def inputs_per_byte(self, which: str) -> int:
        """Inputs a stored element of matrix `which` holds: 4 (int2-q2k), 4/3 (int6-q6k), 2 (int4), else 1."""
        if self.int6(which):
            return 4 / 3
        return 4 if self.format_of(which) == "int2-q2k" else 2 if self.dtype_of(which) == U8 else 1

    def group(self, layer: int, which: str = "gate") -> int:
        """int4's and int8-g's inputs per scale of matrix `which` (int4-q4k: 32, int2-q2k: 16), 0 for other
        formats."""
        if self.dtype_of(which) != U8 and not self._kinds[which][3]:
            return 0
        if self.format_of(which) in RECORD_BYTES:
            return RECORD_GROUP[self.format_of(which)]
        width = self.hidden_size(layer) if which != "down" else self.intermediate_size(layer)
        return width // (getattr(self, which + "_scale")[layer].shape[2] // (2 if self.minima_of(which) else 1))

    def expert_rows(self, which: str, layer: int, expert: int, r0: int, r1: int):
        """Rows r0:r1 of one expert's "gate", "up" or "down" weight: (stored rows [R, in] (int4: [R, in/2]),
        their scales (int8 [R], int4 [R, G], int4-m [R, 2G]: scales then minima, int4-q4k / int2-q2k uint8 records
        [R, B * 16 / 20]) or None): what `row_chunks_f32` takes (with minima=store.minima)."""
        scales = getattr(self, which + "_scale")[layer]
        return getattr(self, which)[layer][expert, r0:r1], None if scales is None else scales[expert, r0:r1]

    @property
    def num_layers(self) -> int:
        return len(self.gate)

    def num_experts(self, layer: int) -> int:
        return self.gate[layer].shape[0]

    def hidden_size(self, layer: int) -> int:
        return self.down[layer].shape[1]  # not gate's last axis: int4 packs it

    def intermediate_size(self, layer: int) -> int:
        return self.gate[layer].shape[1]

    def nbytes(self, layer: int, expert: int) -> int:
        """Bytes of weights one expert's FFN reads (gate + up + down; quantized: q and the scales, float32 here;
        int4-q4k / int2-q2k: q and the super-block records, the GGUF file's 4.5 / 2.625 bits a weight)."""
        scales = sum(x[layer][expert].nbytes for x in (self.gate_scale, self.up_scale, self.down_scale)
                     if x[layer] is not None)
        return sum(x[layer][expert].nbytes for x in (self.gate, self.up, self.down)) + scales

    @property
    def total_nbytes(self) -> int:
        scales = sum(x.nbytes for lst in (self.gate_scale, self.up_scale, self.down_scale) for x in lst
                     if x is not None)
        return scales + sum(g.nbytes + u.nbytes + d.nbytes for g, u, d in zip(self.gate, self.up, self.down))


_FLOAT_NAMES = {F32: "float32", BF16: "bfloat16"}


def _uint8_block(codes, in_dim: int) -> str | None:
    """Which format uint8 codes [..., C] of rows of `in_dim` inputs are: "int6-q6k" (C = 9 in/128), "int6-q6km"
    (C = 9 in/64) or "int2-q2k" (else: its shape is checked later); None for other codes."""
    if np.asarray(codes).dtype != U8:
        return None
    width = np.shape(codes)[-1]
    return "int6-q6k" if width * 128 == 9 * in_dim else "int6-q6km" if width * 64 == 9 * in_dim else "int2-q2k"


def _stored_width(a: np.ndarray, codes, in_dim: int) -> int:
    """The stored last width of a quantized matrix of `in_dim` inputs (codes: its scale array, None for float)."""
    if a.dtype != U8:
        return in_dim
    if codes is not None and np.asarray(codes).dtype == U8:
        return in_dim // 4 if _uint8_block(codes, in_dim) == "int2-q2k" else in_dim * 3 // 4
    return in_dim // 2


def _family_scales(index: int, dtype, scales, names: tuple, E: int, dims: tuple) -> tuple[list, tuple]:
    """One family's (gate and up, or down) scales of layer `index` as the store keeps them (float32; int4-q4k's and
    int2-q2k's codes as super-block records [E, O, B * 16 / 20] uint8; [E, O, 2, G] minima -> [E, O, 2G]), checked,
    and the family's (format, dtype, minima, grouped). dims: the family's (out, in) widths."""
    codes = [np.asarray(x).dtype in (np.uint16, np.uint8) for x in scales]  # int4-q4k's, int2-q2k's
    if any(codes) and (not all(codes) or dtype != U8 or len({np.asarray(x).dtype for x in scales}) > 1):
        raise TypeError(f"layer {index}: int4-q4k / int2-q2k experts are uint8 with uint16 / uint8 code arrays")
    ranks = {np.ndim(x) for x in scales}
    if len(ranks) != 1 and (4 in ranks or (dtype == I8 and 3 in ranks)):  # else the shape check below says more
        raise ValueError(f"layer {index}: scale ranks {[np.ndim(x) for x in scales]} differ")
    rank = np.ndim(scales[0])
    if rank == 4 and any(np.shape(x)[2] != 2 for x in scales):
        raise ValueError(f"layer {index}: {'/'.join(names)} scales with minima are [E, O, 2, G] (got "
                         f"{[np.shape(x) for x in scales]})")
    grouped = dtype == I8 and rank > 2
    block = ((_uint8_block(scales[0], dims[1]) or "int4-q4k") if all(codes) else "int4-m")
    minima = (all(codes) and block != "int6-q6k") or rank == 4
    if rank == 4:  # [E, O, 2, G] float32: scales, then minima -> [E, O, 2G]
        scales = [np.ascontiguousarray(x, F32).reshape(*x.shape[:2], -1) for x in scales]
        half = [x[..., : x.shape[-1] // 2] for x in scales]
        _check_scales(index, U8 if dtype == U8 else "int8-g", half, E, names, dims)
    elif grouped:
        scales = [np.ascontiguousarray(x, F32) for x in scales]
        _check_scales(index, "int8-g", scales, E, names, dims)
    elif all(codes):
        _check_codes(index, block, scales, E, names, dims)
        scales = [block_records(np.asarray(x), fmt=block) for x in scales]  # [E, O, B * RECORD_BYTES] uint8
    else:
        scales = [np.ascontiguousarray(x, F32) for x in scales]
        _check_scales(index, dtype, scales, E, names, dims)
    name = ("int8-g" if grouped else block if minima or block == "int6-q6k" else
            {I8: "int8", U8: "int4"}[dtype])
    return scales, (name, dtype, minima, grouped)


def _check_scales(index: int, dtype, scales: list[np.ndarray], E: int, names: tuple, dims: tuple) -> None:
    """One family's scales (names: ("gate", "up") or ("down",); dims its (out, in) widths). int8: a scale per output
    row; int4: per (output row, group), groups of a multiple of 16 inputs (whole 8-byte words of packed nibbles per
    half group, see `_dequantize_int4`); "int8-g": per (output row, group)."""
    out_dim, in_dim = dims
    if dtype == I8:
        if any(x.shape != (E, out_dim) for x in scales):
            raise ValueError(f"layer {index}: int8 {'/'.join(names)} scale shapes {[x.shape for x in scales]}, want "
                             f"{(E, out_dim)}")
        return
    for name, scale in zip(names, scales):
        groups = scale.shape[2] if scale.ndim == 3 else 0
        if dtype == "int8-g":
            if scale.shape[:2] != (E, out_dim) or groups == 0 or in_dim % groups:
                raise ValueError(f"layer {index}: int8-g {name}_scale shape {scale.shape}, want [{E}, {out_dim}, G] "
                                 f"with G dividing the {in_dim} inputs")
        elif scale.shape[:2] != (E, out_dim) or groups == 0 or in_dim % groups or (in_dim // groups) % 16:
            raise ValueError(f"layer {index}: int4 {name}_scale shape {scale.shape}, want [{E}, {out_dim}, G] "
                             f"with G groups of a multiple of 16 of the {in_dim} inputs")


def _check_codes(index: int, fmt: str, codes: list, E: int, names: tuple, dims: tuple) -> None:
    """int4-q4k's / int2-q2k's codes in the pool layout [E, O, 5G/4] (G: the in width's groups of 32 / 16, in whole
    super-blocks of 256)."""
    out_dim, in_dim = dims
    G = in_dim // RECORD_GROUP[fmt]
    width = {"int6-q6k": 9 * G // 8, "int6-q6km": 9 * G // 4}.get(fmt, 5 * G // 4)
    for name, c in zip(names, codes):
        if in_dim % SUPER_BLOCK or np.shape(c) != (E, out_dim, width):
            raise ValueError(f"layer {index}: {fmt} {name}_scale shape {np.shape(c)}, want [{E}, {out_dim}, "
                             f"{width}] (codes of the {in_dim} inputs' groups, whole super-blocks of "
                             f"{SUPER_BLOCK})")


# int4-q4k's and int2-q2k's super-block records (`block_records`): bytes a record, inputs per group
SUPER_BLOCK = 256
RECORD_BYTES = {"int4-q4k": 16, "int2-q2k": 20, "int6-q6k": 18, "int6-q6km": 36}
RECORD_GROUP = {"int4-q4k": 32, "int2-q2k": 16, "int6-q6k": 16, "int6-q6km": 16}


def block_records(codes: np.ndarray, fmt: str | None = None) -> np.ndarray:
    """int4-q4k codes [..., 5G/4] uint16 (pool layout: G codes sc | m << 6, then the super-blocks' fp16 d, then
    their dmin) or int2-q2k's uint8 (sc | m << 4; d and dmin as byte pairs) -> the store's records [..., B * 16]
    (int2-q2k: [..., B * 20]) uint8, one a super-block in input order, so a row's groups decode reading forward:
    fp16 d and dmin (little-endian), then the groups' codes: int4-q4k's 8 of 12 bits, groups 2k and 2k + 1 in
    bytes 3k .. 3k + 2 (code 2k in bits 0-11, 2k + 1 in bits 12-23: Q4_K's 12 bytes of scales, another order);
    int2-q2k's 16 bytes as read. Moves bits only (native_experts.c's `q4k_record` / `q2k_record` decode
    them). fmt "int6-q6k": its uint8 codes [..., 9G/8] (G int8 sc bytes, then the super-blocks' d byte pairs) ->
    records [..., B * 18]: fp16 d, then the 16 sc bytes (native_experts.c's `q6k_record`); "int6-q6km": codes
    [..., 9G/4] (G sc, G m, then d and dmin byte pairs) -> [..., B * 36]: fp16 d, fp16 dmin, the 16 sc, the 16 m
    (`q6km_record`)."""
    lead = codes.shape[:-1]
    if fmt in ("int6-q6k", "int6-q6km"):
        minima = fmt == "int6-q6km"
        g = codes.shape[-1] * (4 if minima else 8) // 9
        nb = g // 16
        halves = codes[..., (2 if minima else 1) * g:].reshape(*lead, 2 if minima else 1, nb, 2)  # d (, dmin)
        groups = codes[..., :(2 if minima else 1) * g].reshape(*lead, 2 if minima else 1, nb, 16)  # sc (, m)
        records = np.concatenate([np.moveaxis(halves, -3, -2).reshape(*lead, nb, -1),
                                  np.moveaxis(groups, -3, -2).reshape(*lead, nb, -1)], -1)
        return np.ascontiguousarray(records.reshape(*lead, -1))
    q4k = codes.dtype == np.uint16
    g = codes.shape[-1] * 4 // 5
    halves = np.ascontiguousarray(codes[..., g:]).view(np.uint16)  # [..., 2B]: d, then dmin (fp16 bits)
    nb = halves.shape[-1] // 2
    d_dmin = np.stack([halves[..., :nb], halves[..., nb:]], -1).view(np.uint8).reshape(*lead, nb, 4)
    if q4k:
        pairs = codes[..., :g].reshape(*lead, nb, 4, 2).astype(np.uint32)  # [..., B, 4, 2] 12-bit codes
        word = pairs[..., 0] | pairs[..., 1] << 12  # [..., B, 4] 24 bits
        group_bytes = np.stack([word & 255, word >> 8 & 255, word >> 16], -1).astype(np.uint8).reshape(*lead, nb, 12)
    else:
        group_bytes = codes[..., :g].reshape(*lead, nb, 16)
    return np.ascontiguousarray(np.concatenate([d_dmin, group_bytes], -1).reshape(*lead, -1))


def records_scale_min(records: np.ndarray, int2: bool) -> np.ndarray:
    """The store's records [..., B * 16] (int2: [..., B * 20]) uint8 -> float32 [..., 2G]: the G scales d sc, then
    the G minima dmin m, the values block_scale_min gives from the codes they were made of (float32 products of
    fp16 d and a small integer: exact)."""
    lead = records.shape[:-1]
    size = 20 if int2 else 16
    rec = records.reshape(*lead, -1, size)  # [..., B, size]
    halves = np.ascontiguousarray(rec[..., :4]).view(np.float16).astype(F32)  # [..., B, 2]: d, dmin
    if int2:
        c, bits = rec[..., 4:].astype(np.uint16), 4  # [..., B, 16]
    else:
        b = rec[..., 4:].reshape(*lead, -1, 4, 3).astype(np.uint32)  # [..., B, 4, 3]
        word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
        c, bits = np.stack([word & 0xFFF, word >> 12], -1).reshape(*lead, -1, 8), 6  # [..., B, 8]
    scales = halves[..., :1] * (c & ((1 << bits) - 1)).astype(F32)
    minima = halves[..., 1:] * (c >> bits).astype(F32)
    return np.ascontiguousarray(np.concatenate([scales.reshape(*lead, -1), minima.reshape(*lead, -1)], -1))


def q6k_records_scales(records: np.ndarray, minima: bool = False) -> np.ndarray:
    """int6-q6k's records [..., B * 18] uint8 -> float32 [..., G]: the scales d sc (exact), q6k_scales' values;
    minima: int6-q6km's [..., B * 36] -> [..., 2G]: the scales d sc, then the minima dmin m (exact)."""
    lead = records.shape[:-1]
    rec = records.reshape(*lead, -1, 36 if minima else 18)
    at = 4 if minima else 2
    halves = np.ascontiguousarray(rec[..., :at]).view(np.float16).astype(F32)  # [..., B, 1 or 2]: d (, dmin)
    scales = (halves[..., :1] * rec[..., at:at + 16].view(np.int8).astype(F32)).reshape(*lead, -1)
    if not minima:
        return np.ascontiguousarray(scales)
    mins = (halves[..., 1:] * rec[..., at + 16:].astype(F32)).reshape(*lead, -1)
    return np.ascontiguousarray(np.concatenate([scales, mins], -1))


def q6k_codes_scales(codes: np.ndarray, minima: bool = False) -> np.ndarray:
    """int6-q6k codes [..., 9G/8] uint8 -> float32 [..., G]: d sc (exact; quant.py q6k_scales, which this package
    may not import); minima: int6-q6km's [..., 9G/4] -> [..., 2G]: d sc, then dmin m (quant.py q6km_scales)."""
    g = codes.shape[-1] * (4 if minima else 8) // 9
    at = 2 * g if minima else g
    halves = np.ascontiguousarray(codes[..., at:]).view(np.float16).astype(F32)  # [..., B (2B)]: d (, dmin)
    nb = g // 16
    scales = np.repeat(halves[..., :nb], 16, axis=-1) * codes[..., :g].view(np.int8).astype(F32)
    if not minima:
        return scales
    return np.concatenate([scales, np.repeat(halves[..., nb:], 16, axis=-1) * codes[..., g:at].astype(F32)], -1)


def block_scale_min(codes: np.ndarray) -> np.ndarray:
    """int4-q4k codes [..., 5G/4] uint16 (or int2-q2k's uint8: their fp16 d and dmin byte pairs) -> float32
    [..., 2G]: the G scales d sc, then the G minima dmin m (exact; strata_jax/model/quant.py block_scales, which this
    package may not import)."""
    g = codes.shape[-1] * 4 // 5
    bits = 6 if codes.dtype == np.uint16 else 4
    c = codes[..., :g].astype(np.uint16)
    halves = np.ascontiguousarray(codes[..., g:]).view(np.float16).astype(F32)  # [..., 2B]: d, then dmin
    nb = halves.shape[-1] // 2
    d, dmin = (np.repeat(h, g // nb, axis=-1) for h in (halves[..., :nb], halves[..., nb:]))
    scales, minima = d * (c & ((1 << bits) - 1)).astype(F32), dmin * (c >> bits).astype(F32)
    return np.ascontiguousarray(np.concatenate([scales, minima], -1))


def row_chunks_f32(rows: np.ndarray, scales: np.ndarray | None = None, minima: bool = False, int2: bool = False,
                   int6: bool = False):
    """Yield (row_offset, float32 block [c, in], row scales [c, 1] or None) over a [R, ...] weight slice.

    float32 slices come back whole (BLAS reads them in place); bf16, int8 and
    int4 are widened chunk by chunk into one cache-sized scratch buffer (the
    thread's own, reused), so the caller must use each block before taking
    the next. The block times x is the weights' product once scaled by the
    third item:
      * int8 (rows int8 [R, in], scales [R]): the block holds q; each row's
        scale comes back (the product is scaled, as the device's kernels do).
      * int4 (rows uint8 [R, in/2], scales [R, G]): the block holds the
        exactly dequantized weights (nibble - 8) * scale; None comes back.
      * int4-q4k (minima; scales [R, 2G]: s then mn, or the store's uint8
        records [R, B * 16], decoded a chunk at a time): the block holds
        s * nibble - mn, exactly gguf's values (((nibble - 8) s + 8 s) is
        s * nibble, exact; one rounding for the minimum, as gguf's).
      * int8-g (rows int8, scales [R, G], or [R, 2G] with minima): the block
        holds s q (- mn), gguf's values; None comes back.
      * int2-q2k (int2; rows uint8 [R, in/4], scales [R, 2G] or the store's
        records [R, B * 20]): the block holds s q - mn, gguf's values; None
        comes back.
      * int6-q6k (int6; rows uint8 [R, 3 in/4], scales [R, G] or the store's
        records [R, B * 18]): the block holds s (q - 32), gguf's values; None
        comes back. int6-q6km (int6 and minima; scales [R, 2G] or records
        [R, B * 36]): s (q - 32) - mn.
    """
    if rows.dtype == F32:
        yield 0, rows, None
        return
    if int6:
        yield from _grouped_chunks(rows, scales, minima, 6)
        return
    if int2 or (rows.dtype == I8 and scales is not None and scales.ndim == 2):
        yield from _grouped_chunks(rows, scales, minima or int2, 4 if int2 else 1)
        return
    R = rows.shape[0]
    int4 = rows.dtype == U8
    C = rows.shape[1] * (2 if int4 else 1)
    step = max(1, CHUNK_FLOATS // C)
    kernel = native.int4_kernel() if int4 else None  # the C loop (host_pool/native.py), else numpy's passes
    work = _ChunkWork.take(min(step, R), C, int4_steps=int4 and kernel is None)
    records = scales is not None and scales.dtype == U8  # int4-q4k's records: decoded a chunk at a time
    mins = None
    if minima and not records:
        G = scales.shape[1] // 2
        scales, mins = np.ascontiguousarray(scales[:, :G]), scales[:, G:]
    try:
        fill = native.int4_filler(kernel, rows, scales, work.block) if kernel and not records else None
        for r0 in range(0, R, step):
            block = work.block[: min(step, R - r0)]
            if int4:
                c = len(block)
                if records:  # this chunk's s [c, G] and mn [c, G], and a filler over its rows
                    s_mn = records_scale_min(scales[r0 : r0 + c], int2=False)
                    G = s_mn.shape[1] // 2
                    chunk_s, chunk_mn = np.ascontiguousarray(s_mn[:, :G]), s_mn[:, G:]
                    if kernel:
                        native.int4_filler(kernel, rows[r0 : r0 + c], chunk_s, block)(0, c)
                    else:
                        _dequantize_int4(rows[r0 : r0 + c], chunk_s, block, work)
                else:
                    chunk_s, chunk_mn = scales[r0 : r0 + c], None if mins is None else mins[r0 : r0 + c]
                    if fill:
                        fill(r0, c)
                    else:
                        _dequantize_int4(rows[r0 : r0 + step], scales[r0 : r0 + step], block, work)
                if chunk_mn is not None:  # (q - 8) s + 8 s - mn
                    grouped = block.reshape(c, chunk_mn.shape[1], -1)
                    grouped += 8 * chunk_s[:, :, None]
                    grouped -= chunk_mn[:, :, None]
                yield r0, block, None
            else:
                np.copyto(block, rows[r0 : r0 + step], casting="unsafe")  # bf16 / int8 -> f32, exact
                yield r0, block, None if scales is None else scales[r0 : r0 + len(block), None]
    finally:  # also when the caller drops the generator early (zip stops at the shorter one)
        work.give_back()


def _grouped_chunks(rows: np.ndarray, scales: np.ndarray, minima: bool, per_byte: int):
    """row_chunks_f32 of int8-g rows [R, in] (per_byte 1) or int2-q2k's [R, in/4] (4) with scales [R, G]
    ([R, 2G]: s, then mn; int2-q2k: or the store's records [R, B * 20], decoded a chunk at a time): blocks of
    s q (- mn)."""
    R, C = rows.shape[0], rows.shape[1] * 4 // 3 if per_byte == 6 else rows.shape[1] * per_byte
    records = scales.dtype == U8
    G = C // 16 if records else scales.shape[1] // (2 if minima else 1)
    step = max(1, CHUNK_FLOATS // C)
    work = _ChunkWork.take(min(step, R), C, int4_steps=False)
    try:
        for r0 in range(0, R, step):
            block = work.block[: min(step, R - r0)]
            c = len(block)
            if per_byte == 6:  # int6-q6k (per_byte 6: 6 bits an input), chunk k of 64 inputs in 48 bytes (pack_int6)
                p = rows[r0:r0 + c].reshape(c, C // 64, 48)
                lo = np.stack([p[..., :16] & 15, p[..., :16] >> 4, p[..., 16:32] & 15, p[..., 16:32] >> 4], -2)
                hi = (p[..., None, 32:] >> np.array([0, 2, 4, 6], U8).reshape(4, 1)) & 3  # [c, chunks, 4, 16]
                q = (lo | (hi << 2 << 2)).view(np.int8) - np.int8(32)
                np.copyto(block.reshape(c, C // 64, 4, 16), q, casting="unsafe")
            elif per_byte == 4:  # chunk k of 64 inputs: byte b's shift 2s holds input 64 k + 16 s + b
                crumbs = rows[r0:r0 + c].reshape(c, C // 64, 1, 16) >> np.array([0, 2, 4, 6], U8).reshape(4, 1)
                np.copyto(block.reshape(c, C // 64, 4, 16), crumbs & 3, casting="unsafe")
            else:
                np.copyto(block, rows[r0:r0 + c], casting="unsafe")  # int8 -> f32, exact
            if per_byte == 6:  # [c, G] (int6-q6km: [c, 2G])
                s_mn = q6k_records_scales(scales[r0:r0 + c], minima) if records else scales[r0:r0 + c]
            else:
                s_mn = records_scale_min(scales[r0:r0 + c], int2=True) if records else scales[r0:r0 + c]  # [c, 2G]
            grouped = block.reshape(c, G, -1)
            grouped *= s_mn[:, :G, None]  # exact
            if minima:
                grouped -= s_mn[:, G:, None]  # one rounding, as gguf's
            yield r0, block, None
    finally:
        work.give_back()


LOW_NIBBLES = np.uint64(0x0F0F_0F0F_0F0F_0F0F)


class _ChunkWork:
    """The buffers of one chunk conversion, views into one byte buffer: the float32 block [rows, C] and, for int4 on
    the numpy path (int4_steps), the dequantization's steps. Each thread keeps the ones it gave back: fresh memory
    page-faults (measured on the 2-core VM: ~1 ms to allocate and fill 2.25 MB, 75 us to fill it again), as much as
    the conversion itself."""

    _local = threading.local()  # .free: this thread's buffers not in use
    KEEP = 4  # buffers a thread keeps (a gate/up job converts two weights at once)

    def __init__(self, memory: np.ndarray, rows: int, C: int, int4_steps: bool):
        self.memory = memory  # uint8, 64-byte aligned views at multiples of 8 bytes (C is even; int4: C % 16 == 0)
        sizes = {"block": rows * C * 4}
        if int4_steps:
            sizes.update(scale=rows * C * 4, q=rows * C, low=rows * C // 2, high=rows * C // 2)
        views, offset = {}, 0
        for name, size in sizes.items():
            views[name], offset = memory[offset:offset + size], offset + size
        self.block = views["block"].view(F32).reshape(rows, C)  # [rows, C] the converted rows
        if int4_steps:
            self.scale = views["scale"].view(F32).reshape(rows, C)  # [rows, C] each input's group scale
            self.q = views["q"].reshape(rows, C)                    # [rows, C] nibbles in input order, then q
            self.low = views["low"].reshape(rows, C // 2)           # [rows, C/2] low nibbles (input j of a group)
            self.high = views["high"].reshape(rows, C // 2)         # [rows, C/2] high nibbles (input j + group/2)

    @staticmethod
    def nbytes(rows: int, C: int, int4_steps: bool) -> int:
        return rows * C * (10 if int4_steps else 4)

    @classmethod
    def take(cls, rows: int, C: int, int4_steps: bool) -> "_ChunkWork":
        free = cls._free()
        need = cls.nbytes(rows, C, int4_steps)
        fits = [i for i, m in enumerate(free) if m.nbytes >= need]
        memory = free.pop(min(fits, key=lambda i: free[i].nbytes)) if fits else np.empty(need, U8)
        return cls(memory, rows, C, int4_steps)

    def give_back(self) -> None:
        free = self._free()
        free.append(self.memory)
        if len(free) > self.KEEP:  # drop the smallest
            free.pop(min(range(len(free)), key=lambda i: free[i].nbytes))

    @classmethod
    def _free(cls) -> list[np.ndarray]:
        return cls._local.__dict__.setdefault("free", [])


def _dequantize_int4(packed: np.ndarray, scales: np.ndarray, out: np.ndarray, work: _ChunkWork) -> None:
    """out [c, C] float32 = (nibble - 8) * scale of its (row, group), exactly (4 bits times a bf16 scale fit in
    float32's 24), from packed [c, C/2] uint8 and scales [c, G] float32.

    Plain numpy, so every step is a whole-chunk pass with long inner loops (numpy's per-inner-loop cost is what
    a per-group broadcast over 32 or 64 inputs would pay): nibbles split on 8-byte words, half groups moved as
    opaque items of group/2 bytes into input order, one int8 -> float32 cast, one multiply by the scales
    spread to every input. (A 256-entry table of float pairs through np.take measured 1.5x slower.)
    """
    c, half = packed.shape
    G = scales.shape[1]
    half_group = half // G  # bytes per group = inputs per half group
    low, high, q, spread = work.low[:c], work.high[:c], work.q[:c], work.scale[:c]  # [c, ...] views
    words = packed.view(np.uint64)  # [c, C/16]: rows of whole words (groups are multiples of 16 inputs)
    np.bitwise_and(words, LOW_NIBBLES, out=low.view(np.uint64))
    np.right_shift(words, 4, out=high.view(np.uint64))
    np.bitwise_and(high.view(np.uint64), LOW_NIBBLES, out=high.view(np.uint64))
    # A group's inputs are its low nibbles, then its high ones: [c, G, 2, group/2] as [c, G, 2] opaque items.
    item = np.dtype(f"V{half_group}")
    q_halves = q.reshape(c, G, 2, half_group).view(item)[..., 0]  # [c, G, 2]
    np.copyto(q_halves[:, :, 0], low.reshape(c, G, half_group).view(item)[..., 0])
    np.copyto(q_halves[:, :, 1], high.reshape(c, G, half_group).view(item)[..., 0])
    signed = q.view(np.int8)
    np.subtract(signed, 8, out=signed)  # stored q + 8 -> q
    np.copyto(out, signed, casting="unsafe")
    np.copyto(spread.reshape(c, G, 2 * half_group), scales[:, :, None])
    np.multiply(out, spread, out=out)
