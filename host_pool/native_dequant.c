/* int4 row chunks -> float32 for host_pool/store.py's `row_chunks_f32`; host_pool/native.py compiles and loads it.

   packed [rows, in_dim/2] uint8 in GGUF Q4_0's order (strata_jax/quant.py "int4"): in each group of `group` inputs,
   byte j holds input j in its low nibble and input j + group/2 in its high one, both stored q + 8.
   scales [rows, in_dim/group] float32; out [rows, in_dim] float32 = (nibble - 8) * scale. One float32 product of
   exact operands, as the numpy path computes it: the two paths agree bit for bit.

   group/2 is a multiple of 8 (the store checks groups are multiples of 16): the fixed inner 8 lets gcc -O3 emit
   straight vector code, with no alias checks or scalar tails per group. */
#include <stdint.h>

void int4_rows_f32(const uint8_t *restrict packed, const float *restrict scales, float *restrict out,
                   long rows, long in_dim, long group)
{
    const long half = group / 2, groups = rows * (in_dim / group);
    for (long g = 0; g < groups; g++, packed += half, out += group) {
        const float scale = scales[g];
        for (long b = 0; b < half; b += 8)
            for (int j = 0; j < 8; j++) {
                out[b + j] = (float)((packed[b + j] & 15) - 8) * scale;
                out[half + b + j] = (float)((packed[b + j] >> 4) - 8) * scale;
            }
    }
}
