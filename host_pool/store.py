"""Host copy of every layer's expert weights, read by the host pool.

Format choice: weights stay in the dtype they are given, without a copy.
  * float32 is used as is by BLAS.
  * bfloat16 stays bfloat16 (2 bytes / weight). Pool jobs convert it to float32
    in row chunks (~1 MB of float32, so the converted copy stays in the core's
    cache) right before the matmul. Converting the whole store once would
    double host memory (a Qwen3-30B-A3B has ~58 GB of bf16 experts -> ~116 GB,
    more than the 128 GB host can spare) for little speed: measured on a
    2-core EPYC (`python -m host_pool.measure`, 8 experts H=2048 I=768), a
    layer job takes 7.7 ms (T=1) / 8.2 ms (T=4) from bf16 converted per
    chunk vs 5.5 / 9.7 ms from bf16 converted once to float32. With more
    cores sharing DRAM, reading half the bytes should matter more.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)

# Floats converted at a time: 1 MB of float32 scratch, about one core's L2.
# Measured (2-core EPYC, 1 MB L2): 256 KB chunks -> 5.9 GB/s, 512 KB -> 7.9,
# 1 MB -> 9.7, 2 MB -> 9.3 (per-call overhead vs. falling out of L2).
CHUNK_FLOATS = 256 * 1024


class HostExpertStore:
    """Per-layer stacked expert weights in HF layout.

    gate, up: [E, I, H] (out, in); down: [E, H, I]. One dtype for the store.
    `bf16_as_f32=True` converts bf16 weights to float32 once (doubles memory;
    kept only to measure against the default).

    int8 experts (strata_jax/quant.py "int8"): a layer is (gate, up, down,
    gate_scale [E, I], up_scale [E, I], down_scale [E, H]) with int8 q and one
    float scale per output row; `compute_dtype` (float32 or bfloat16) says how
    the pool rounds, as the device's graphs do.
    """

    def __init__(self, layers: list[tuple[np.ndarray, ...]], bf16_as_f32: bool = False,
                 compute_dtype: np.dtype | None = None):
        self.gate: list[np.ndarray] = []  # per layer [E, I, H]
        self.up: list[np.ndarray] = []    # per layer [E, I, H]
        self.down: list[np.ndarray] = []  # per layer [E, H, I]
        # int8: per layer the rows' scales as float32 [E, I], [E, I], [E, H]; None for float experts
        self.gate_scale: list[np.ndarray | None] = []
        self.up_scale: list[np.ndarray | None] = []
        self.down_scale: list[np.ndarray | None] = []
        dtypes = set()
        for index, (gate, up, down, *scales) in enumerate(layers):
            if gate.dtype not in (F32, BF16, I8):
                raise TypeError(f"layer {index}: expert dtype {gate.dtype}, want float32, bfloat16 or int8")
            if (gate.dtype == I8) != (len(scales) == 3):
                raise TypeError(f"layer {index}: int8 experts come with three scale arrays (and float ones with none)")
            if scales:
                E, I, H = gate.shape
                if scales[0].shape != (E, I) or scales[1].shape != (E, I) or scales[2].shape != (E, H):
                    raise ValueError(f"layer {index}: scale shapes {[x.shape for x in scales]}")
                scales = [np.ascontiguousarray(x, F32) for x in scales]
            for lst, x in zip((self.gate_scale, self.up_scale, self.down_scale), scales or (None,) * 3):
                lst.append(x)
            if not gate.dtype == up.dtype == down.dtype:
                raise TypeError(f"layer {index}: gate/up/down dtypes differ")
            E, I, H = gate.shape
            if up.shape != (E, I, H) or down.shape != (E, H, I):
                raise ValueError(f"layer {index}: shapes gate {gate.shape} up {up.shape} down {down.shape}")
            if bf16_as_f32 and gate.dtype == BF16:
                gate, up, down = (a.astype(F32) for a in (gate, up, down))
            # Contiguous rows let jobs slice without copies; no copy if already so.
            self.gate.append(np.ascontiguousarray(gate))
            self.up.append(np.ascontiguousarray(up))
            self.down.append(np.ascontiguousarray(down))
            dtypes.add(self.gate[-1].dtype)
        if len(dtypes) > 1:
            raise TypeError(f"layers mix dtypes {sorted(map(str, dtypes))}")
        self.dtype: np.dtype = dtypes.pop() if dtypes else F32
        self.compute_dtype = np.dtype(compute_dtype) if compute_dtype is not None else (
            BF16 if self.dtype == I8 else self.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.gate)

    def num_experts(self, layer: int) -> int:
        return self.gate[layer].shape[0]

    def hidden_size(self, layer: int) -> int:
        return self.gate[layer].shape[2]

    def intermediate_size(self, layer: int) -> int:
        return self.gate[layer].shape[1]

    def nbytes(self, layer: int, expert: int) -> int:
        """Bytes of weights one expert's FFN reads (gate + up + down; int8: q, the scales are float32 here)."""
        return self.gate[layer][expert].nbytes * 3

    @property
    def total_nbytes(self) -> int:
        scales = sum(x.nbytes for lst in (self.gate_scale, self.up_scale, self.down_scale) for x in lst
                     if x is not None)
        return scales + sum(g.nbytes + u.nbytes + d.nbytes for g, u, d in zip(self.gate, self.up, self.down))


def row_chunks_f32(rows: np.ndarray):
    """Yield (row_offset, float32 block) over a [R, C] weight slice.

    float32 slices come back whole (BLAS reads them in place); bf16 (and int8)
    is converted chunk by chunk into one reused cache-sized scratch buffer, so
    the caller must use each block before taking the next.
    """
    if rows.dtype == F32:
        yield 0, rows
        return
    R, C = rows.shape
    step = max(1, CHUNK_FLOATS // C)
    scratch = np.empty((min(step, R), C), F32)
    for r0 in range(0, R, step):
        block = scratch[: min(step, R - r0)]
        np.copyto(block, rows[r0 : r0 + step], casting="unsafe")  # bf16 -> f32, exact
        yield r0, block
