/* int4 row chunks -> float32 for host_pool/store.py's `row_chunks_f32`; host_pool/native.py compiles and loads it.

   packed [rows, in_dim/2] uint8 in GGUF Q4_0's order (strata_jax/model/quant.py "int4"): in each group of `group` inputs,
   byte j holds input j in its low nibble and input j + group/2 in its high one, both stored q + 8.
   scales [rows, in_dim/group] float32; out [rows, in_dim] float32 = (nibble - 8) * scale. One float32 product of
   exact operands, as the numpy path computes it: the two paths agree bit for bit.

   group/2 is a multiple of 8 (the store checks groups are multiples of 16). */
#include <stdint.h>
#include <string.h>
#ifdef __SSE4_1__
#include <smmintrin.h>
#endif

void int4_rows_f32(const uint8_t *restrict packed, const float *restrict scales, float *restrict out,
                   long rows, long in_dim, long group)
{
    const long half = group / 2, groups = rows * (in_dim / group);
    for (long g = 0; g < groups; g++, packed += half, out += group) {
#ifdef __SSE4_1__
        /* 4 bytes widened to 4 int32 lanes at once, then both nibbles: gcc does not find this from the loop below
           (it widens bytes in two steps), and it measured 17% faster (2-core EPYC: 51 vs 61 us per 1 MB out). */
        const __m128 scale = _mm_set1_ps(scales[g]);
        const __m128i low = _mm_set1_epi32(15), eight = _mm_set1_epi32(8);
        for (long b = 0; b < half; b += 4) {
            int32_t four;
            memcpy(&four, packed + b, 4);
            const __m128i bytes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
            const __m128i lo = _mm_sub_epi32(_mm_and_si128(bytes, low), eight);
            const __m128i hi = _mm_sub_epi32(_mm_srli_epi32(bytes, 4), eight);
            _mm_storeu_ps(out + b, _mm_mul_ps(_mm_cvtepi32_ps(lo), scale));
            _mm_storeu_ps(out + half + b, _mm_mul_ps(_mm_cvtepi32_ps(hi), scale));
        }
#else
        /* Plain C for gcc -O3 to vectorise: the fixed inner 8 gives straight vector code, no scalar tails. */
        const float scale = scales[g];
        for (long b = 0; b < half; b += 8)
            for (int j = 0; j < 8; j++) {
                out[b + j] = (float)((packed[b + j] & 15) - 8) * scale;
                out[half + b + j] = (float)((packed[b + j] >> 4) - 8) * scale;
            }
#endif
    }
}
