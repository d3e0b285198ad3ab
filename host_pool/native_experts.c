/* One host pool layer job in native code: every CPU expert of a window, for its tokens, in one call.
   host_pool/native.py compiles it (-O3 -march=native -fopenmp where the compiler takes them) and host_pool/pool.py
   calls `experts_job` from its driver thread; ctypes releases the GIL for the call. The threads: a team kept between
   jobs (see "the team" below; -DTEAM_OMP: an OpenMP region per job, as before), phase 1 and phase 2 rows in blocks
   sized to the job (see cut_blocks).

   Work: units u = (expert e_u, its entries j in [unit_start[u], unit_start[u+1])); entry j is one token row of x,
   an output row and a weight:
     phase 1, threads over blocks of (unit, I) rows: h[j, i] = r(silu(g) * u),  g = r(s_g * gate[e, i] . x[tok_j]),
                                                      u = r(s_u * up[e, i] . x[tok_j])
     phase 2, threads over blocks of H rows:         out[out_j, r] += w_j * r(s_d * down[e, r] . h[j])
   r() rounds to bf16 (round to nearest even) when `round_bf16`, as the device's graphs round; s_* are int8's row
   scales (1 otherwise); int4 weights are (nibble - 8) * group scale, exact in float32, as store.py dequantizes.
   int4-q4k (FMT_INT4KR, GGUF Q4_K's blocks: w = s * nibble - mn per group of 32): int4's loops with the scales s,
   plus sum_g (8 s_g - mn_g) * sum(x over group g), the group sums of x (and of h) taken once per job: the dot with
   s * nibble - mn up to float32 rounding (q4k_bias: each row and token's sum in the order of g, several rows or
   tokens a vector). s = d sc and mn = dmin m are decoded from the store's super-block records (fp16 d, dmin and
   12-bit codes, the file's 4.5 bits a weight) once per row and chunk of tokens into the float32 scale row the
   former store held (scale_row, q4k_record), so the loops are those of held scales, the bits too. Q4_1 (FMT_INT4K,
   "int4-m") runs the same on its held float32 scale rows: G scales, then G minima.
   int8-g (FMT_INT8G, GGUF types kept as read, strata_jax/model/quant.py: Q8_0, Q6_K, Q3_K; FMT_INT8GM with minima:
   Q5_K, Q2_K): int8 q with a float32 scale per group of `group` inputs (and a minimum: a scale row holds the G
   scales, then the G minima); each weight is dequantized in registers, fma(q, s, -mn) = s q - mn rounded once
   (s q is exact), gguf's float32 value, then dotted as float32 weights are.
   int2-q2k (FMT_INT2K, GGUF Q2_K's blocks, quant.py "int2-q2k": q in 0..3 four a byte, in each chunk of 64 inputs
   byte b holds inputs b, b + 16, b + 32, b + 48 at shifts 0, 2, 4, 6; a scale and minimum per group of 16 decoded
   from the store's records a row at a time, q2k_record, 2.625 bits a weight): int8-g's way, each weight fma(q, s, -mn) in
   registers (gguf's value), the crumbs widened from bytes by a shift and a mask (dot_rows_kq_nt).
   int6-q6k (FMT_INT6K, GGUF Q6_K's blocks, quant.py "int6-q6k" pack_int6: q in 0..63, per chunk of 64 inputs 48
   bytes, 32 of low nibbles in int4's order of groups of 32, then 16 of high 2-bit pairs in int2-q2k's; a scale
   s = d sc per group of 16 decoded from the store's 18-byte records, q6k_record, 6.5625 bits a weight): each weight
   (q - 32) * s in registers (gguf's value: one rounding, as gguf's), group s of a chunk a shift of contiguous bytes
   (dot_rows_kq_nt).
   int6-q6km (FMT_INT6KM, quant.py "int6-q6km": a family of mixed GGUF K types, values unchanged): int6-q6k's q
   with a minimum per group of 16, s = d sc and mn = dmin m decoded from the store's 36-byte records (q6km_record,
   7.125 bits a weight); each weight fma(q - 32, s, -mn) in registers, as int2-q2k's (the same dot loop).
   Per-family formats (issue 36: a Q4_K_M GGUF's Q4_K gate/up beside Q6_K down, each kept as read): a job's phase 1
   reads gate/up in `fmt` with groups of `group`, phase 2 reads down in `fmt_down` with `group_down`; each phase's
   minima, group sums and bf16 path follow its own format.
   Each output element is written by one thread, units in order: a fixed summation order, no locks. Plain layer
   jobs give every entry of a token the same output row (the weighted sum), split jobs one row per entry, weight 1.

   The products are float32 dot products over the build's vector lanes (AVX-512 or AVX2 intrinsics, else GNU vector
   types), weights widened in registers: bf16 by a 16-bit shift, int8 by a sign extension, int4 nibble pairs in GGUF
   Q4_0's order (in each group of `group` inputs, byte b holds input b in its low nibble and input b + group/2 in its
   high one, stored q + 8) looked up in a per-group table of the 16 dequantized values (AVX-512: one permute per 16
   weights; the product is then that of the dequantized weight, as numpy's path). The lanes are summed at the end
   of a row: a fixed order for a build. The weights are prefetched PREFETCH_BYTES ahead of the reads (see
   prefetch_ahead): with it one thread's bf16 reads reached its read bandwidth here.

   Measured (benchmarks/results/cpu-2026-12-04-pool-kernel.md, a 2-core AVX-512 VM): per 16 weights and token every
   format costs about 3 vector ops (widen, convert or look up, FMA), so int8 and int4 gain by reading fewer bytes
   only while their arithmetic stays under the memory's time; the int4 loop before the table had a 64-bit division
   per group and its accumulators in memory, and took 1.6x its present time on weights in cache.

   The bf16 path (AVX-512 BF16 builds; see dot16_rows_nt, dot16_int4_nt): where x's values are all exactly bf16 (a
   bf16 model's device sends them so) phase 1, and where h is rounded to bf16 phase 2, multiply bf16 pairs with
   vdpbf16ps instead: 32 products an instruction, each exact as the float path's (the weights are exact in bf16 too),
   summed in float32 in another order. int4 then decodes 128 weights per 64-byte load (3 shifts, or on Intel cores
   a shift and 2 byte shuffles; 4 permutes) and scales per block (quant.py's groups: a constant half group, the
   block's scales by broadcasts; int4-q4k's minima term summed inside the loop); 2 to 4 rows share each read of x
   (bf16's phase 2: one row a call, BF16_ROWS, as a single stream read fastest from DRAM), prefetched a call ahead
   (PREFETCH_CALLS). int8 with one token keeps the float path (dot16_pays), 2 to 4 rows a call
   (int8_matrix_rows): widening int8 to bf16 costs what the bf16 products save. Measured on the 2-core EPYC (Zen 4),
   one thread, one expert (H 2048, I 768) recomputed from cache: int4 T=1 31-32 G weights/s (float path ~21), T=4
   12-13 (6.5-7.8); bf16 T=4 12-13 (6-7); int8 T=4 11.4 (7-8). benchmarks/results/cpu-2026-12-05-pool-kernels.md.
   2026-12-07 (host_pool/measure.py's hot cache, the same VM, against -DFORMER_LOOPS in one run): int4 T=1 59 (49),
   T=4 23 (18.6); int4-q4k T=1 38 (33), T=4 16.5 (13.2); int8 T=1 32.5 (31). On Sapphire Rapids LLVM's model gives
   vdpbf16ps zmm 4 uops (2 on port 0, 2 on port 5), vpermw 2: the int4 loop is port-bound near 15-17 cycles per 128
   weights and token there, and the float path's FMAs may pay (-DINT_FLOAT_PATH, dot16_pays). */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE  /* pthread_setname_np, syscall (the team's futex) */
#endif
#include <math.h>
#include <sched.h>
#include <stdint.h>
#ifdef __linux__  /* the kept team (pthreads, futexes) */
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* FMT_INT4K: int4 with float32 scales and minima (Q4_1, "int4-m"); FMT_INT4KR: int4-q4k, the same loops with the
   scales and minima decoded from the store's super-block records (scale_row); FMT_INT2K: int2-q2k's records */
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3, FMT_INT4K = 4, FMT_INT8G = 5, FMT_INT8GM = 6,
       FMT_INT2K = 7, FMT_INT4KR = 8, FMT_INT6K = 9, FMT_INT6KM = 10 };
enum { TOKENS = 4 };      /* token rows read per pass over a weight row */
/* weight rows per work item of phase 1 / phase 2 (-D to try others: host_pool/measure.py --variants) */
#ifndef ROWS_UP
#define ROWS_UP 32
#endif
#ifndef ROWS_DOWN
#define ROWS_DOWN 16
#endif

/* The vector of the build: AVX-512 (16 lanes) or AVX2 + FMA (8 lanes) intrinsics where -march gives them, else GNU
   vector types of 8 lanes (the compiler maps them to what the target has, SSE2, NEON or scalar code). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define ISA "AVX-512"
enum { VL = 16 };
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf v_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf v_int8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* int2: VL packed bytes -> their crumbs at `shift` (0, 2, 4, 6) as floats */
static inline vf v_int2(const uint8_t *p, int shift)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i crumbs = _mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32(shift)), _mm512_set1_epi32(3));
    return _mm512_cvtepi32_ps(crumbs);
}
/* int6: VL low-nibble bytes at lo (nibble at shift 0 or 4) and VL high-pair bytes at hi (pair at shift 0..6) ->
   q - 32 as floats */
static inline vf v_int6(const uint8_t *lo, int lo_shift, const uint8_t *hi, int hi_shift)
{
    const __m512i l = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)lo)),
                                                         _mm512_set1_epi32(lo_shift)), _mm512_set1_epi32(15));
    const __m512i h = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)hi)),
                                                         _mm512_set1_epi32(hi_shift)), _mm512_set1_epi32(3));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32)));
}
/* int4: a group's 16 weights (k - 8) * scale, k = 0..15, in the lanes of one register; a nibble is then one
   permute (its index, which reads the low 4 bits of each lane: no mask for the low nibble) */
typedef vf int4_table;
static inline int4_table v_int4_table(float scale)
{
    const vf nibble_values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_mul_ps(nibble_values, _mm512_set1_ps(scale));
}
/* VL bytes of packed int4 -> the weights of their low nibbles and of their high ones */
static inline void v_int4(const uint8_t *p, int4_table table, vf *low, vf *high)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = _mm512_permutexvar_ps(bytes, table);
    *high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "AVX2"
enum { VL = 8 };
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float a) { return _mm256_set1_ps(a); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline float v_sum(vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf v_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf v_int8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf v_int2(const uint8_t *p, int shift)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i crumbs = _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_set1_epi32(shift)), _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(crumbs);
}
static inline vf v_int6(const uint8_t *lo, int lo_shift, const uint8_t *hi, int hi_shift)
{
    const __m256i l = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)lo)),
                                                         _mm256_set1_epi32(lo_shift)), _mm256_set1_epi32(15));
    const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)hi)),
                                                         _mm256_set1_epi32(hi_shift)), _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(h, 4)), _mm256_set1_epi32(32)));
}
/* int4: 8 lanes hold half a 16-entry table, so the nibble is converted and times the scale (exact) instead */
typedef vf int4_table;
static inline int4_table v_int4_table(float scale) { return _mm256_set1_ps(scale); }
static inline void v_int4(const uint8_t *p, int4_table scale, vf *low, vf *high)
{
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    const __m256i low_q = _mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), eight);
    *low = _mm256_mul_ps(_mm256_cvtepi32_ps(low_q), scale);
    *high = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight)), scale);
}
#else
#if defined(__SSE2__)
#define ISA "SSE2"
#elif defined(__ARM_NEON)
#define ISA "NEON"
#else
#define ISA "scalar"
#endif
enum { VL = 8 };
typedef float vf __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline vf v_zero(void) { return (vf){0}; }
static inline vf v_set1(float a) { return (vf){a, a, a, a, a, a, a, a}; }
static inline vf v_load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline float v_sum(vf a)
{
    float s = 0.0f;
    for (int k = 0; k < VL; k++) s += a[k];
    return s;
}
static inline vf v_bf16(const uint16_t *p)
{
    v8u bits;
    for (int k = 0; k < VL; k++) bits[k] = (uint32_t)p[k] << 16;
    vf f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline vf v_int8(const int8_t *p)
{
    vf f;
    for (int k = 0; k < VL; k++) f[k] = (float)p[k];
    return f;
}
static inline vf v_int2(const uint8_t *p, int shift)
{
    vf f;
    for (int k = 0; k < VL; k++) f[k] = (float)((p[k] >> shift) & 3);
    return f;
}
static inline vf v_int6(const uint8_t *lo, int lo_shift, const uint8_t *hi, int hi_shift)
{
    vf f;
    for (int k = 0; k < VL; k++) f[k] = (float)((int)(((lo[k] >> lo_shift) & 15) | ((hi[k] >> hi_shift) & 3) << 4) - 32);
    return f;
}
typedef float int4_table;
static inline int4_table v_int4_table(float scale) { return scale; }
static inline void v_int4(const uint8_t *p, int4_table scale, vf *low, vf *high)
{
    for (int k = 0; k < VL; k++) {
        (*low)[k] = (float)((p[k] & 15) - 8) * scale;
        (*high)[k] = (float)((p[k] >> 4) - 8) * scale;
    }
}
#endif

static inline float scalar_weight(int fmt, const void *row, long k)
{
    switch (fmt) {
    case FMT_F32: return ((const float *)row)[k];
    case FMT_BF16: {
        uint32_t bits = (uint32_t)((const uint16_t *)row)[k] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    default: return (float)((const int8_t *)row)[k];
    }
}

/* fp16 bits at p (little-endian) -> float32, exactly (F16C where the build has it) */
static inline float half_at(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 31) {  /* inf, NaN */
        const uint32_t bits = sign | 0x7f800000u | m << 13;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    f = e ? ldexpf((float)(m | 1024), (int)e - 25) : ldexpf((float)m, -24);  /* exact: 11 bits */
    return sign ? -f : f;
#endif
}

/* int4-q4k's and int2-q2k's codes as the store keeps them (store.py block_records): per output row one record a
   super-block of 256 inputs, fp16 d, fp16 dmin, then its groups' codes (q4k: 8 of 12 bits sc | m << 6, groups 2k
   and 2k + 1 in bytes 3k .. 3k + 2; q2k: 16 bytes sc | m << 4). A row's records are decoded once per row and chunk
   of tokens (scale_row) into the float32 scale row int4-m and the former store held, G scales s = d sc then G minima
   mn = dmin m: the float32 products store.py's block_scale_min gives (fp16 times a small integer: exact); the loops
   then run as on held float32 scales. */
enum { Q4K_RECORD = 16, Q2K_RECORD = 20, Q6K_RECORD = 18, Q6KM_RECORD = 36 };
/* one q4k record's 8 groups -> s[0..8), mn[0..8) (x86 builds: the 12-bit codes gathered as 16-bit words by one
   byte shuffle, group k's from byte 4 + 3 (k >> 1) + (k & 1), shifted 4 (k & 1)) */
static inline void q4k_record(const uint8_t *record, float *s, float *mn)
{
    const float d = half_at(record), dmin = half_at(record + 2);
#if defined(__AVX2__) && (defined(__AVX512F__) || defined(__FMA__))  /* immintrin.h included above */
    const __m128i words = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)record),
                                           _mm_setr_epi8(4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11, 12, 13, 14, 14, 15));
    const __m256i code = _mm256_srlv_epi32(_mm256_cvtepu16_epi32(words), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256i bits6 = _mm256_set1_epi32(63);
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_and_si256(code, bits6))));
    _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(dmin),
                                       _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(code, 6), bits6))));
#else
    for (int k = 0; k < 8; k++) {
        const uint8_t *pair = record + 4 + 3 * (k >> 1);
        const uint32_t code = ((uint32_t)pair[0] | (uint32_t)pair[1] << 8 | (uint32_t)pair[2] << 16) >> (12 * (k & 1));
        s[k] = d * (float)(code & 63);
        mn[k] = dmin * (float)((code >> 6) & 63);
    }
#endif
}
/* one q2k record's 16 groups -> s[0..16), mn[0..16) */
static inline void q2k_record(const uint8_t *record, float *s, float *mn)
{
    const float d = half_at(record), dmin = half_at(record + 2);
#if defined(__AVX2__) && (defined(__AVX512F__) || defined(__FMA__))
    for (int k = 0; k < 16; k += 8) {  /* (gcc 12 leaves the plain loop scalar) */
        const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(record + 4 + k)));
        _mm256_storeu_ps(s + k, _mm256_mul_ps(_mm256_set1_ps(d),
                                              _mm256_cvtepi32_ps(_mm256_and_si256(code, _mm256_set1_epi32(15)))));
        _mm256_storeu_ps(mn + k, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_srli_epi32(code, 4))));
    }
#else
    for (int k = 0; k < 16; k++) {
        s[k] = d * (float)(record[4 + k] & 15);
        mn[k] = dmin * (float)(record[4 + k] >> 4);
    }
#endif
}
/* one q6k record (fp16 d, then the 16 groups' int8 sc) -> s[0..16) = d * sc (exact: 11 bits times 8) */
static inline void q6k_record(const uint8_t *record, float *s)
{
    const float d = half_at(record);
    for (int k = 0; k < 16; k++) s[k] = d * (float)(int8_t)record[2 + k];
}
/* one q6km record (fp16 d, fp16 dmin, the 16 groups' int8 sc, then their uint8 m) -> s[0..16) = d * sc,
   mn[0..16) = dmin * m (exact) */
static inline void q6km_record(const uint8_t *record, float *s, float *mn)
{
    const float d = half_at(record), dmin = half_at(record + 2);
    for (int k = 0; k < 16; k++) {
        s[k] = d * (float)(int8_t)record[4 + k];
        mn[k] = dmin * (float)record[20 + k];
    }
}
/* a row's records (`record` bytes each) -> its scale row [2G]: the G scales, then the G minima (q6k: [G], no
   minima) */
static void records_scale_row(const uint8_t *records, long record, long G, float *row)
{
    if (record == Q4K_RECORD) {
        long g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* two records a step, q4k_record's way in 16 lanes: each 128-bit lane's shuffle gathers its record's codes;
           d and dmin of both converted at once (the other words too, unused) and spread to their record's lanes */
        const __m256i gather = _mm256_broadcastsi128_si256(_mm_setr_epi8(4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11, 12, 13,
                                                                         14, 14, 15));
        const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4), bits6 = _mm512_set1_epi32(63);
        const __m512i d_of = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
        const __m512i dmin_of = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9, 9);
        for (; g + 16 <= G; g += 16, records += 2 * record) {
            const __m256i two = _mm256_loadu_si256((const __m256i *)records);
            const __m512 halves = _mm512_cvtph_ps(two);
            const __m512i code = _mm512_srlv_epi32(_mm512_cvtepu16_epi32(_mm256_shuffle_epi8(two, gather)), shifts);
            _mm512_storeu_ps(row + g, _mm512_mul_ps(_mm512_permutexvar_ps(d_of, halves),
                                                    _mm512_cvtepi32_ps(_mm512_and_si512(code, bits6))));
            _mm512_storeu_ps(row + G + g, _mm512_mul_ps(_mm512_permutexvar_ps(dmin_of, halves),
                                                        _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(code, 6), bits6))));
        }
#endif
        for (; g < G; g += 8, records += record) q4k_record(records, row + g, row + G + g);
    }
    else if (record == Q6K_RECORD)
        for (long g = 0; g < G; g += 16, records += record) q6k_record(records, row + g);
    else if (record == Q6KM_RECORD)
        for (long g = 0; g < G; g += 16, records += record) q6km_record(records, row + g, row + G + g);
    else
        for (long g = 0; g < G; g += 16, records += record) q2k_record(records, row + g, row + G + g);
}

/* Software prefetch of the weights PREFETCH_BYTES ahead of those being read, one cache line per 64 bytes read: the
   rows of a work item lie one after the other, so this reaches into the item's next row too. With several tokens a
   row takes longer than the memory's latency to compute, and the hardware prefetcher alone left the reads and the
   arithmetic one after the other (bf16, 1 thread: T = 4 took the time of T = 1 plus that of the same job from cache).
   0: none. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 3
#endif
/* The bf16 path's: `bytes` at `at` + `distance` * PREFETCH_CALLS (its rows are read side by side, so
   PREFETCH_BYTES ahead of one lies in another being read; the caller passes the distance to the same place a call
   ahead). */
#ifndef PREFETCH_CALLS
#define PREFETCH_CALLS 2
#endif
static inline __attribute__((always_inline)) void prefetch_at(const char *at, const long distance, const long bytes)
{
    if (PREFETCH_BYTES > 0)
        for (long b = 0; b < bytes; b += 64) __builtin_prefetch(at + distance * PREFETCH_CALLS + b, 0, PREFETCH_LOCALITY);
}
static inline __attribute__((always_inline)) void prefetch_ahead(const char *at, const long bytes)
{
    if (PREFETCH_BYTES > 0)
        for (long b = 0; b < bytes; b += 64) __builtin_prefetch(at + PREFETCH_BYTES + b, 0, PREFETCH_LOCALITY);
}

/* out[t] = row . xs[t] for t < NT: float32, bf16 or int8 weights (int8 unscaled). NT is a constant where this is
   inlined (dot_rows below), so the accumulators stay in registers; one loop per format, so the widening is not a
   branch inside it. Few tokens get several accumulators each (U steps of VL inputs per iteration): one FMA chain
   would wait on its own latency. The U partial sums and the lanes are added at the end, then the tail of n % VL
   inputs in order. */
#define UNROLL(NT) ((NT) == 1 ? 4 : (NT) == 2 ? 2 : 1)
#define DOT_LOOP(WIDEN, ITEMSIZE)                                                                                 \
    for (; k + U * VL <= n; k += U * VL) {                                                                      \
        prefetch_ahead((const char *)row + k * (ITEMSIZE), U * VL * (ITEMSIZE));                               \
        _Pragma("GCC unroll 16")                                                                                \
        for (int u = 0; u < U; u++) {                                                                           \
            const long at = k + u * VL;                                                                         \
            const vf w = WIDEN(at);                                                                             \
            _Pragma("GCC unroll 16")                                                                            \
            for (int t = 0; t < NT; t++) acc[u * NT + t] = v_fma(w, v_load(xs[t] + at), acc[u * NT + t]);       \
        }                                                                                                       \
    }                                                                                                           \
    for (; k + VL <= n; k += VL) {                                                                              \
        const vf w = WIDEN(k);                                                                                  \
        _Pragma("GCC unroll 16")                                                                                \
        for (int t = 0; t < NT; t++) acc[t] = v_fma(w, v_load(xs[t] + k), acc[t]);                              \
    }
#define W_F32(at) v_load((const float *)row + (at))
#define W_BF16(at) v_bf16((const uint16_t *)row + (at))
#define W_INT8(at) v_int8((const int8_t *)row + (at))
static inline __attribute__((always_inline)) void dot_rows_nt(int fmt, const void *row, long n,
                                                              const float *const *xs, float *out, const int NT)
{
    const int U = UNROLL(NT);
    vf acc[4 * TOKENS];
    _Pragma("GCC unroll 16")
    for (int a = 0; a < U * NT; a++) acc[a] = v_zero();
    long k = 0;
    if (fmt == FMT_F32) {
        DOT_LOOP(W_F32, 4)
    } else if (fmt == FMT_BF16) {
        DOT_LOOP(W_BF16, 2)
    } else {
        DOT_LOOP(W_INT8, 1)
    }
    _Pragma("GCC unroll 16")
    for (int t = 0; t < NT; t++) {
        vf total = acc[t];
        _Pragma("GCC unroll 16")
        for (int u = 1; u < U; u++) total += acc[u * NT + t];
        float s = v_sum(total);
        for (long m = k; m < n; m++) s += scalar_weight(fmt, row, m) * xs[t][m];
        out[t] = s;
    }
}

/* out[t] = dequantized int4 row . xs[t]: packed [n/2] bytes, scales [n/group]. The products are those of the
   dequantized weights (q - 8) * scale, exact in float32 as store.py's, so this is dot_rows_nt's sum over the
   dequantized row in another order: per token four chains (low and high nibbles of even and odd VL-byte steps in a
   group), added at the end. HALF (group / 2) is a constant where dot_rows_int4 dispatches the usual groups, so the
   chains stay in registers; half groups not of VL bytes go through a scalar loop. */
static inline __attribute__((always_inline)) void dot_rows_int4_nt(const uint8_t *packed, const float *scales, long n,
                                                                   const long HALF, const float *const *xs,
                                                                   float *out, const int NT)
{
    vf acc[4 * TOKENS];
    _Pragma("GCC unroll 16")
    for (int a = 0; a < 4 * NT; a++) acc[a] = v_zero();
    float tail[TOKENS] = {0};
    for (long g0 = 0; g0 < n; g0 += 2 * HALF, packed += HALF, scales++) {
        if (HALF % VL == 0) {
            prefetch_ahead((const char *)packed, HALF);
            const int4_table table = v_int4_table(*scales);
            for (long b = 0; b < HALF; b += VL) {
                const int chain = (int)(b / VL % 2) * 2;
                vf low, high;
                v_int4(packed + b, table, &low, &high);  /* inputs g0 + b + lane and g0 + HALF + b + lane */
                _Pragma("GCC unroll 16")
                for (int t = 0; t < NT; t++) {
                    acc[chain * NT + t] = v_fma(low, v_load(xs[t] + g0 + b), acc[chain * NT + t]);
                    acc[(chain + 1) * NT + t] = v_fma(high, v_load(xs[t] + g0 + HALF + b), acc[(chain + 1) * NT + t]);
                }
            }
        } else {
            for (long b = 0; b < HALF; b++)
                _Pragma("GCC unroll 16")
                for (int t = 0; t < NT; t++)
                    tail[t] += (float)((packed[b] & 15) - 8) * *scales * xs[t][g0 + b]
                             + (float)((packed[b] >> 4) - 8) * *scales * xs[t][g0 + HALF + b];
        }
    }
    _Pragma("GCC unroll 16")
    for (int t = 0; t < NT; t++)
        out[t] = v_sum((acc[t] + acc[NT + t]) + (acc[2 * NT + t] + acc[3 * NT + t])) + tail[t];
}

/* out[t] = dequantized int8-g row . xs[t]: q [n] int8, scales [G] (minima: [2G], the scales then the minima);
   each weight fma(q, s, -mn), exactly gguf's value; groups of a multiple of VL inputs go by vectors, others by a
   scalar loop (the same values). Two chains per token. */
static inline __attribute__((always_inline)) void dot_rows_int8g_nt(const int8_t *q, const float *scales, long n,
                                                                    long group, int minima, const float *const *xs,
                                                                    float *out, const int NT)
{
    vf acc[2 * TOKENS];
    _Pragma("GCC unroll 16")
    for (int a = 0; a < 2 * NT; a++) acc[a] = v_zero();
    float tail[TOKENS] = {0};
    const long G = n / group;
    for (long g = 0; g < G; g++) {
        const float s = scales[g], mn = minima ? scales[G + g] : 0.0f;
        const long g0 = g * group;
        if (group % VL == 0) {
            prefetch_ahead((const char *)(q + g0), group);
            const vf vs = v_set1(s), vmn = v_set1(-mn);
            for (long b = 0; b < group; b += VL) {
                const int chain = (int)(b / VL % 2);
                const vf w = v_fma(v_int8(q + g0 + b), vs, vmn);
                _Pragma("GCC unroll 16")
                for (int t = 0; t < NT; t++) acc[chain * NT + t] = v_fma(w, v_load(xs[t] + g0 + b), acc[chain * NT + t]);
            }
        } else {
            for (long b = 0; b < group; b++) {
                const float w = fmaf((float)q[g0 + b], s, -mn);
                for (int t = 0; t < NT; t++) tail[t] += w * xs[t][g0 + b];
            }
        }
    }
    _Pragma("GCC unroll 16")
    for (int t = 0; t < NT; t++) out[t] = v_sum(acc[t] + acc[NT + t]) + tail[t];
}

/* out[t] = dequantized int2-q2k (KIND 0), int6-q6k (KIND 1) or int6-q6km (KIND 2) row . xs[t], n a multiple of 64.
   int2-q2k: packed [n/4] bytes, scales [2G] (G = n/16: the scales, then the minima); each weight fma(q, s, -mn). A
   chunk's VL bytes are read once for its four groups (shift 2s: group 4c + s).
   int6-q6k: packed [3n/4] bytes (pack_int6: per chunk of 64 inputs 32 bytes of low nibbles, then 16 of high pairs),
   scales [G]; each weight (q - 32) * s. Group s of chunk c: the low nibbles at bytes 16 (s >> 1) of the chunk, shift
   4 (s & 1), the high pairs at byte 32, shift 2 s. int6-q6km: int6-q6k's q with scales [2G] as int2-q2k's; each
   weight fma(q - 32, s, -mn).
   Either way exactly gguf's value; two chains per token (even and odd groups). */
static inline __attribute__((always_inline)) void dot_rows_kq_nt(const uint8_t *packed, const float *scales, long n,
                                                                 const float *const *xs, float *out, const int NT,
                                                                 const int KIND)
{
    const int INT6 = KIND != 0, MINIMA = KIND != 1;
    vf acc[2 * TOKENS];
    _Pragma("GCC unroll 16")
    for (int a = 0; a < 2 * NT; a++) acc[a] = v_zero();
    const long G = n / 16, chunk = INT6 ? 48 : 16;
    for (long c = 0; c < n / 64; c++, packed += chunk) {
        prefetch_ahead((const char *)packed, chunk);
        for (long b = 0; b < 16; b += VL)
            _Pragma("GCC unroll 4")
            for (int s = 0; s < 4; s++) {
                const long g = 4 * c + s, at = 64 * c + 16 * s + b;
                const vf q = INT6 ? v_int6(packed + 16 * (s >> 1) + b, 4 * (s & 1), packed + 32 + b, 2 * s)
                                  : v_int2(packed + b, 2 * s);
                const vf w = MINIMA ? v_fma(q, v_set1(scales[g]), v_set1(-scales[G + g])) : v_mul(q, v_set1(scales[g]));
                _Pragma("GCC unroll 16")
                for (int t = 0; t < NT; t++) {
                    vf *chain = &acc[(s % 2) * NT + t];
                    *chain = v_fma(w, v_load(xs[t] + at), *chain);
                }
            }
    }
    _Pragma("GCC unroll 16")
    for (int t = 0; t < NT; t++) out[t] = v_sum(acc[t] + acc[NT + t]);
}

/* dot_rows_kq_nt for nt tokens (1..4), kind (0 int2-q2k, 1 int6-q6k, 2 int6-q6km) a compile-time constant in each
   call. */
static void dot_rows_kq(const uint8_t *packed, const float *scales, long n, const float *const *xs, int nt,
                        float *out, int kind)
{
    switch (nt + 4 * kind) {
    case 1: dot_rows_kq_nt(packed, scales, n, xs, out, 1, 0); break;
    case 2: dot_rows_kq_nt(packed, scales, n, xs, out, 2, 0); break;
    case 3: dot_rows_kq_nt(packed, scales, n, xs, out, 3, 0); break;
    case 4: dot_rows_kq_nt(packed, scales, n, xs, out, 4, 0); break;
    case 5: dot_rows_kq_nt(packed, scales, n, xs, out, 1, 1); break;
    case 6: dot_rows_kq_nt(packed, scales, n, xs, out, 2, 1); break;
    case 7: dot_rows_kq_nt(packed, scales, n, xs, out, 3, 1); break;
    case 8: dot_rows_kq_nt(packed, scales, n, xs, out, 4, 1); break;
    case 9: dot_rows_kq_nt(packed, scales, n, xs, out, 1, 2); break;
    case 10: dot_rows_kq_nt(packed, scales, n, xs, out, 2, 2); break;
    case 11: dot_rows_kq_nt(packed, scales, n, xs, out, 3, 2); break;
    default: dot_rows_kq_nt(packed, scales, n, xs, out, 4, 2); break;
    }
}

static void dot_rows_int8g(const int8_t *q, const float *scales, long n, long group, int minima,
                           const float *const *xs, int nt, float *out)
{
    switch (nt) {
    case 1: dot_rows_int8g_nt(q, scales, n, group, minima, xs, out, 1); break;
    case 2: dot_rows_int8g_nt(q, scales, n, group, minima, xs, out, 2); break;
    case 3: dot_rows_int8g_nt(q, scales, n, group, minima, xs, out, 3); break;
    default: dot_rows_int8g_nt(q, scales, n, group, minima, xs, out, 4); break;
    }
}

static void dot_rows(int fmt, const void *row, long n, const float *const *xs, int nt, float *out)
{
    switch (nt) {
    case 1: dot_rows_nt(fmt, row, n, xs, out, 1); break;
    case 2: dot_rows_nt(fmt, row, n, xs, out, 2); break;
    case 3: dot_rows_nt(fmt, row, n, xs, out, 3); break;
    default: dot_rows_nt(fmt, row, n, xs, out, 4); break;
    }
}

/* out[r * TOKENS] = rows[r] . x for R (1, 2 or 4) int8 rows (unscaled) and one token: each row's sum is
   dot_rows_nt's for one token (U = 4 chains over the same steps, added and summed in the same order: the same bits),
   the R rows sharing each load of x and the call's overhead (the row's sum, its scale and the next row's call: a
   fifth of the time at I = 768); prefetched as dot16_rows_nt (`ahead` rows of its matrix a call ahead). */
static inline __attribute__((always_inline)) void dot_rows_int8_r(const int8_t *const *rows, long n, long ahead,
                                                                  const float *x, float *out, const int R)
{
    enum { U = 4 };
    vf acc[4][U];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int u = 0; u < U; u++) acc[r][u] = v_zero();
    long k = 0;
    for (; k + U * VL <= n; k += U * VL) {
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) prefetch_at((const char *)(rows[r] + k), ahead, U * VL);
        _Pragma("GCC unroll 4")
        for (int u = 0; u < U; u++) {
            const vf xv = v_load(x + k + u * VL);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) acc[r][u] = v_fma(v_int8(rows[r] + k + u * VL), xv, acc[r][u]);
        }
    }
    for (; k + VL <= n; k += VL) {
        const vf xv = v_load(x + k);
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) acc[r][0] = v_fma(v_int8(rows[r] + k), xv, acc[r][0]);
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        vf total = acc[r][0];
        _Pragma("GCC unroll 4")
        for (int u = 1; u < U; u++) total += acc[r][u];
        float s = v_sum(total);
        for (long m = k; m < n; m++) s += scalar_weight(FMT_INT8, rows[r], m) * x[m];
        out[r * TOKENS] = s;
    }
}

#define INT4_TOKENS(HALF)                                                                                         \
    switch (nt) {                                                                                                 \
    case 1: dot_rows_int4_nt(packed, scales, n, HALF, xs, out, 1); break;                                        \
    case 2: dot_rows_int4_nt(packed, scales, n, HALF, xs, out, 2); break;                                        \
    case 3: dot_rows_int4_nt(packed, scales, n, HALF, xs, out, 3); break;                                        \
    default: dot_rows_int4_nt(packed, scales, n, HALF, xs, out, 4); break;                                       \
    }
/* quant.py's int4 groups (64; 32 and 128) with a constant half group, others with a variable one */
static void dot_rows_int4(const uint8_t *packed, const float *scales, long n, long group, const float *const *xs,
                          int nt, float *out)
{
    if (group == 64) {
        INT4_TOKENS(32)
    } else if (group == 32) {
        INT4_TOKENS(16)
    } else if (group == 128) {
        INT4_TOKENS(64)
    } else {
        INT4_TOKENS(group / 2)
    }
}

static inline float round_bf16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return value; /* NaN stays NaN */
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    float rounded;
    memcpy(&rounded, &bits, sizeof rounded);
    return rounded;
}

/* One weight matrix of a layer: [E, rows, n] stored (int4: [E, rows, n/2] bytes), its scales (int8 [E, rows], int4
   [E, rows, n/group]) or NULL. */
typedef struct {
    const void *weights;
    const float *scales;
    long rows, n;
    int minima;  /* int4-m, int8-g with minima: a scale row is [2 n/group]: the scales, then the minima */
    const uint8_t *records;  /* int4-q4k / int2-q2k: [E, rows, n/256 * record] super-block records, else NULL */
    long record;             /* bytes a record (Q4K_RECORD, Q2K_RECORD), 0 without */
} matrix;

/* row `row`'s scale row where its format has one per group (int4, int4-m, int2-q2k: [n/group], [2 n/group] with
   minima): held in m->scales, or (int4-q4k, int2-q2k) decoded from the row's records into buf [2 n/group] */
static inline const float *scale_row(const matrix *m, long group, long row, float *buf)
{
    const long G = m->n / group;
    if (!m->records) return m->scales + row * G * (1 + m->minima);
    records_scale_row(m->records + row * (m->n / 256) * m->record, m->record, G, buf);
    return buf;
}

/* int4-q4k / int4-m: the minima's term, bias[r * TOKENS + t] = sum_g (8 s_g - mn_g) * sums[g][t] for R rows' scale
   rows srows[r] (G scales, then G minima) and TOKENS tokens' group sums, transposed ([G] of TOKENS lanes, unused
   tokens' zero: bias_sums). Each (row, token) is one chain of float32 sums, in the order of g, of rounded products
   (the empty asm keeps the compiler from fusing them into FMAs): the bits of the former loop, one row and token at
   a time, which gcc vectorized that way; the tokens (and rows) share each step, so the chains are not one after
   another. */
typedef float tokens_f __attribute__((vector_size(TOKENS * sizeof(float))));
#if defined(__SSE__)
#include <xmmintrin.h>  /* q4k_bias's one-token loop (the portable x86 build has SSE, not immintrin.h's others) */
#endif
#if defined(__x86_64__) || defined(__i386__)
#define NO_FMA(v) __asm__("" : "+x"(v))
#define NO_FMA16(v) __asm__("" : "+v"(v))  /* a 512-bit one (any of the 32 registers) */
#else
#define NO_FMA(v) __asm__("" : "+m"(v))
#endif
/* w[r][g] = 8 s_g - mn_g of R rows' scale rows (a vector loop) */
static inline void q4k_bias_weights(const float *const *srows, int R, long G, float *w)
{
    for (int r = 0; r < R; r++)
        for (long g = 0; g < G; g++) w[r * G + g] = 8.0f * srows[r][g] - srows[r][G + g];
}
static inline void q4k_bias(const float *const *srows, int R, int nt, long G, const tokens_f *sums, float *bias)
{
    _Static_assert(TOKENS == 4, "q4k_bias's lanes are 4 tokens");
    tokens_f acc[4];  /* R <= MAX_ROWS, 4 */
    for (int r = 0; r < R; r++) acc[r] = (tokens_f){0};
    float w[R][G];  /* 8 s_g - mn_g of each row */
    q4k_bias_weights(srows, R, G, &w[0][0]);
#if defined(__SSE__)
    if (nt == 1 && R > 1) {  /* one token: the rows in the lanes instead, w transposed 4 groups at a time */
        __m128 a = _mm_setzero_ps();
        long g = 0;
        for (; g + 4 <= G; g += 4) {
            __m128 w0 = _mm_loadu_ps(w[0] + g), w1 = _mm_loadu_ps(w[1] + g);  /* rows past R: lanes unused */
            __m128 w2 = _mm_loadu_ps(w[R > 2 ? 2 : 0] + g), w3 = _mm_loadu_ps(w[R > 3 ? 3 : 0] + g);
            _MM_TRANSPOSE4_PS(w0, w1, w2, w3);
            const __m128 rows_w[4] = {w0, w1, w2, w3};
            for (int k = 0; k < 4; k++) {
                __m128 product = _mm_mul_ps(rows_w[k], _mm_set1_ps(sums[g + k][0]));
                NO_FMA(product);
                a = _mm_add_ps(a, product);
            }
        }
        for (; g < G; g++) {
            __m128 product = _mm_mul_ps(_mm_setr_ps(w[0][g], w[1][g], w[R > 2 ? 2 : 0][g], w[R > 3 ? 3 : 0][g]),
                                        _mm_set1_ps(sums[g][0]));
            NO_FMA(product);
            a = _mm_add_ps(a, product);
        }
        float lanes[4];
        _mm_storeu_ps(lanes, a);
        for (int r = 0; r < R; r++) bias[r * TOKENS] = lanes[r];
        return;
    }
#endif
    (void)nt;
    for (long g = 0; g < G; g++)
        for (int r = 0; r < R; r++) {
            tokens_f product = w[r][g] * sums[g];
            NO_FMA(product);
            acc[r] += product;
        }
    for (int r = 0; r < R; r++) memcpy(bias + r * TOKENS, &acc[r], sizeof acc[r]);
}
/* out[g][t] = rows[t][g] of the nt rows of G group sums, rows past nt zero */
static inline void bias_sums(const float *const *rows, int nt, long G, tokens_f *out)
{
    for (long g = 0; g < G; g++)
        for (int t = 0; t < TOKENS; t++) out[g][t] = t < nt ? rows[t][g] : 0.0f;
}

/* sums[k * G + g] = the sum of rows[k]'s inputs g*group .. (g+1)*group - 1, k < count. Eight lanes a step where
   the group is a multiple of 8 (a fixed order; one scalar chain took ~3 us for x's 2048 inputs, and h's sums run on
   one thread between the phases) */
static void group_sums(const float *rows, long count, long n, long group, float *sums)
{
    typedef float v8 __attribute__((vector_size(32)));
    for (long k = 0; k < count; k++)
        for (long g = 0; g < n / group; g++) {
            const float *p = rows + k * n + g * group;
            float acc = 0.0f;
            if (group % 8 == 0) {
                v8 a = {0};
                for (long i = 0; i < group; i += 8) {
                    v8 v;
                    memcpy(&v, p + i, sizeof v);
                    a += v;
                }
                acc = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            } else {
                for (long i = 0; i < group; i++) acc += p[i];
            }
            sums[k * (n / group) + g] = acc;
        }
}

/* int8 rows of (matrix ms[r], expert es[r], row rs[r]) . x for R = 1, 2 or 4 rows and one token, scaled: out[r *
   TOKENS] (dot16_matrix_rows' way, on the float path) */
static void int8_matrix_rows(int R, long ahead, const matrix *const *ms, const long *es, const long *rs,
                             const float *x, float *out)
{
    const int8_t *rows[4];
    long row[4];
    const long n = ms[0]->n;
    for (int r = 0; r < R; r++) {
        row[r] = es[r] * ms[r]->rows + rs[r];
        rows[r] = (const int8_t *)ms[r]->weights + row[r] * n;
    }
    if (R == 4) dot_rows_int8_r(rows, n, ahead * n, x, out, 4);
    else if (R == 2) dot_rows_int8_r(rows, n, ahead * n, x, out, 2);
    else dot_rows_int8_r(rows, n, ahead * n, x, out, 1);
    for (int r = 0; r < R; r++) out[r * TOKENS] *= ms[r]->scales[row[r]];
}

/* Whether int8 rows with one token go int8_matrix_rows' way (several rows a call) */
static inline int int8_rows_one(int fmt, int nt)
{
#ifdef FORMER_LOOPS
    (void)fmt, (void)nt;
    return 0;
#else
    return fmt == FMT_INT8 && nt == 1;
#endif
}

/* srow: the row's scale row (scale_row) for int4 and int2-q2k, else unused */
static void dot_matrix_row(int fmt, long group, const matrix *m, long expert, long r, const float *srow,
                           const float *const *xs, int nt, float *out)
{
    const long row = expert * m->rows + r;
    if (fmt == FMT_INT8G) {
        dot_rows_int8g((const int8_t *)m->weights + row * m->n, m->scales + row * (m->n / group) * (1 + m->minima),
                       m->n, group, m->minima, xs, nt, out);
        return;
    }
    if (fmt == FMT_INT2K) {  /* groups of 16, minima always */
        dot_rows_kq((const uint8_t *)m->weights + row * (m->n / 4), srow, m->n, xs, nt, out, 0);
        return;
    }
    if (fmt == FMT_INT6K || fmt == FMT_INT6KM) {  /* groups of 16, minima with FMT_INT6KM */
        dot_rows_kq((const uint8_t *)m->weights + row * (m->n / 4 * 3), srow, m->n, xs, nt, out,
                    fmt == FMT_INT6KM ? 2 : 1);
        return;
    }
    if (fmt == FMT_INT4) {
        dot_rows_int4((const uint8_t *)m->weights + row * (m->n / 2), srow, m->n, group, xs, nt, out);
        return;
    }
    const long itemsize = fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
    dot_rows(fmt, (const char *)m->weights + row * m->n * itemsize, m->n, xs, nt, out);
    if (fmt == FMT_INT8) {
        const float scale = m->scales[row];
        for (int t = 0; t < nt; t++) out[t] *= scale;
    }
}

/* bf16 dot products (AVX-512 BF16's vdpbf16ps: 32 products of bf16 pairs, exact in float32, added into 16 float32
   lanes), where x (phase 1) or h (phase 2) is exactly bf16: a bf16 model's device sends x as bf16 values, and bf16
   compute rounds h to bf16. The products are then those of the float path (the weights are exact in bf16 too: bf16
   itself, int8 q, int4 q - 8), only the float32 summation order differs; per 16 weights and token one instruction
   does what took two FMAs, and the weights need fewer widening steps:
     bf16: none (the stored pairs are the operand);
     int8: sign extension and conversion as before, then two float32 vectors to one bf16 one (exact: |q| <= 128 has
           8 significant bits), the row scale after the row as before;
     int4: 64 packed bytes (128 weights) are one load; word w of it holds bytes 2w, 2w + 1, and its four nibbles are
           shifted down (0, 4, 8, 12 bits) and looked up (vpermw reads the low 5 bits of each word: a 32-entry table
           of bf16(k % 16 - 8), so no mask) to four registers of 32 bf16 weights. x is stored in the same order once
           per job (dot16_positions), so each register meets its 32 inputs in one load. Each dword (2 words) holds
           4 bytes of one group (groups are multiples of 16 inputs), so the block's products per token go into one
           vector and are scaled once per block by a vector of the groups' scales (lanes of a group share it).
   Rows are padded to a multiple of 128 inputs (zero x, masked weight loads), so a row needs no scalar tail. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) \
    && !defined(NO_BF16_DOT)
#define BF16_DOT 1
#endif
/* the width of a row's bf16 copy */
/* MAX_ROWS rows per call (dot16_rows_for); at most ACCUMULATORS sums of (row, token, chain) per call: an array
   of 8 vectors stays in registers, a larger one (gcc 12) was stored to the stack on every iteration */
enum { PAD = 128, MAX_ROWS = 4, ACCUMULATORS = 8 };
static inline long padded(long n) { return (n + PAD - 1) / PAD * PAD; }
#ifdef BF16_DOT

/* position[k]: where input k of a row of n lies in a bf16 copy. int4: the order its weights come out of
   dot16_int4_nt's registers (64-byte block of byte c, then the register: which nibble of which byte of the word,
   then the word); other formats: k. */
static void dot16_positions(int fmt, long n, long half, int32_t *position)
{
    if (fmt != FMT_INT4) {
        for (long k = 0; k < n; k++) position[k] = (int32_t)k;
        return;
    }
    for (long g0 = 0, c = 0; g0 < n; g0 += 2 * half)
        for (long b = 0; b < half; b++, c++) {
            const long low = (c >> 6) * 128 + (c & 1) * 64 + ((c & 63) >> 1);
            position[g0 + b] = (int32_t)low;             /* the byte's low nibble: input b of its group */
            position[g0 + half + b] = (int32_t)(low + 32); /* the high one: input b + half */
        }
}

/* int4 groups the bf16 path takes: a 64-byte block holds whole groups or lies in one (half 8, 16, 32, 64k). */
static inline int int4_dot16_ok(long half) { return half > 0 && (64 % half == 0 || half % 64 == 0); }

static inline __m512bh as_bh(__m512i a) { return (__m512bh)a; }
static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* 32 weights of a bf16 or int8 row from input k, those outside `live` zero */
static inline __attribute__((always_inline)) __m512bh dot16_weights(int fmt, const void *row, long k, __mmask32 live)
{
    if (fmt == FMT_BF16) return as_bh(_mm512_maskz_loadu_epi16(live, (const uint16_t *)row + k));
    const __m256i bytes = _mm256_maskz_loadu_epi8(live, (const int8_t *)row + k);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return _mm512_cvtne2ps_pbh(high, low);  /* words 0-15 from low, 16-31 from high */
}

/* out[r * TOKENS + t] = rows[r] . xs[t] for R rows of n (bf16 x, natural order, padded): bf16 or int8 weights
   (int8 unscaled). R rows at once share each load of x and the loop's overhead. */
#define UNROLL16(NT) ((NT) == 1 ? 2 : 1)
static inline __attribute__((always_inline)) void dot16_rows_nt(int fmt, const void *const *rows, long n, long ahead,
                                                                const uint16_t *const *xs, float *out, const int NT,
                                                                const int R)
{
    const int U = UNROLL16(NT);
    __m512 acc[ACCUMULATORS];  /* [u][r][t] */
    _Pragma("GCC unroll 16")
    for (int a = 0; a < U * R * NT; a++) acc[a] = _mm512_setzero_ps();
    const long itemsize = fmt == FMT_BF16 ? 2 : 1;
    long k = 0;
    for (; k + U * 32 <= n; k += U * 32) {
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) prefetch_at((const char *)rows[r] + k * itemsize, ahead, U * 32 * itemsize);
        _Pragma("GCC unroll 16")
        for (int u = 0; u < U; u++) {
            __m512bh w[MAX_ROWS];
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) w[r] = dot16_weights(fmt, rows[r], k + u * 32, ~(__mmask32)0);
            _Pragma("GCC unroll 16")
            for (int t = 0; t < NT; t++) {
                const __m512bh xv = load_bh(xs[t] + k + u * 32);
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++)
                    acc[(u * R + r) * NT + t] = _mm512_dpbf16_ps(acc[(u * R + r) * NT + t], w[r], xv);
            }
        }
    }
    for (; k < n; k += 32) {  /* lanes past n: zero weights (and zero x, the padding) */
        const __mmask32 live = n - k >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (n - k)) - 1;
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            const __m512bh w = dot16_weights(fmt, rows[r], k, live);
            _Pragma("GCC unroll 16")
            for (int t = 0; t < NT; t++) acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], w, load_bh(xs[t] + k));
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16")
        for (int t = 0; t < NT; t++) {
            __m512 total = acc[r * NT + t];
            _Pragma("GCC unroll 16")
            for (int u = 1; u < U; u++) total = _mm512_add_ps(total, acc[(u * R + r) * NT + t]);
            out[r * TOKENS + t] = _mm512_reduce_add_ps(total);
        }
}

/* int4-q4k's (and int4-m's) minima term, q4k_bias's sums taken inside the int4 loop (groups of 32: a block's four
   groups after its rows' products): the chains of sums then run beside the products instead of before them (a chain
   of G dependent adds held the loop's start ~G add latencies). The same products and sums per (row, token) in the
   order of g, so the same bits; lane r * TOKENS + t of a vector holds row r's and token t's sum. w: the rows'
   8 s_g - mn_g ([R][G], q4k_bias_weights), sums: the tokens' group sums (bias_sums), out: bias[r * TOKENS + t]. */
typedef struct {
    const float *w;
    long G;
    const tokens_f *sums;
    const float *sums1;  /* one token: its G group sums (sums' first lanes), else NULL */
    float *out;
} q4k_terms;
/* acc + the products of groups g .. g + 3 (in order; rows past R repeat row 0, their lanes unused). One token
   (NT 1): the four groups' products in one multiply (lane 4 r + k: w[r][g + k] sums1[g + k]), each added into lane
   4 r in turn (lanes 4 r + 1 .. 3 then hold partial sums no one reads). */
static inline __attribute__((always_inline)) __m512 q4k_terms_block(const q4k_terms *b, const int R, const int NT,
                                                                    long g, __m512 acc)
{
    const float *w = b->w + g;
    __m512 W = _mm512_castps128_ps512(_mm_loadu_ps(w));  /* lane 4 r + k: w[r][g + k] */
    W = _mm512_insertf32x4(W, _mm_loadu_ps(w + (R > 1 ? 1 : 0) * b->G), 1);
    W = _mm512_insertf32x4(W, _mm_loadu_ps(w + (R > 2 ? 2 : 0) * b->G), 2);
    W = _mm512_insertf32x4(W, _mm_loadu_ps(w + (R > 3 ? 3 : 0) * b->G), 3);
    if (NT == 1) {
        __m512 product = _mm512_mul_ps(W, _mm512_broadcast_f32x4(_mm_loadu_ps(b->sums1 + g)));
        NO_FMA16(product);
        acc = _mm512_add_ps(acc, product);
        acc = _mm512_add_ps(acc, _mm512_permute_ps(product, 1));
        acc = _mm512_add_ps(acc, _mm512_permute_ps(product, 2));
        return _mm512_add_ps(acc, _mm512_permute_ps(product, 3));
    }
    _Pragma("GCC unroll 4")
    for (int k = 0; k < 4; k++) {
        const __m512i spread = _mm512_setr_epi32(k, k, k, k, 4 + k, 4 + k, 4 + k, 4 + k, 8 + k, 8 + k, 8 + k, 8 + k,
                                                 12 + k, 12 + k, 12 + k, 12 + k);
        __m512 product = _mm512_mul_ps(_mm512_permutexvar_ps(spread, W),
                                       _mm512_broadcast_f32x4(_mm_loadu_ps((const float *)&b->sums[g + k])));
        NO_FMA16(product);
        acc = _mm512_add_ps(acc, product);
    }
    return acc;
}
/* acc + the products of group g */
static inline __attribute__((always_inline)) __m512 q4k_terms_group(const q4k_terms *b, const int R, long g,
                                                                    __m512 acc)
{
    const float *w = b->w + g;
    const __m512 W = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                           _mm512_castps128_ps512(_mm_setr_ps(w[0], w[(R > 1 ? 1 : 0) * b->G],
                                                                              w[(R > 2 ? 2 : 0) * b->G],
                                                                              w[(R > 3 ? 3 : 0) * b->G])));
    __m512 product = _mm512_mul_ps(W, _mm512_broadcast_f32x4(_mm_loadu_ps((const float *)&b->sums[g])));
    NO_FMA16(product);
    return _mm512_add_ps(acc, product);
}

/* w >> 8 in each 16-bit word: a byte shuffle (port 5 on Intel cores) where vdpbf16ps and vpermw load port 0 (LLVM's
   Sapphire Rapids model: vdpbf16ps zmm 2 uops on port 0 and 2 on port 5, vpermw zmm one on each, a 512-bit shift one
   on port 0; the int4 loop's 4 rows x 128 weights 67 cycles with three shifts a block, 60 with one and two
   shuffles), a shift on AMD cores (Zen 4 ran the shuffles slower: hot int4 T=4 20 against 22 G weights/s) and with
   -DINT4_SHIFTS (-DINT4_SHUFFLES: the shuffle anywhere). The same value either way. */
#if defined(INT4_SHUFFLES)
#define INT4_HIGH_BYTE_SHIFT 0
#elif defined(INT4_SHIFTS) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define INT4_HIGH_BYTE_SHIFT 1
#else
#define INT4_HIGH_BYTE_SHIFT 0
#endif
static inline __attribute__((always_inline)) __m512i int4_high_byte(__m512i w, __m512i high_byte)
{
    if (INT4_HIGH_BYTE_SHIFT) return _mm512_srli_epi16(w, 8);
    return _mm512_shuffle_epi8(w, high_byte);
}

/* The scales of a 64-byte int4 block's 16 dwords (dword d: bytes 4d .. 4d + 3, of group (64 blk + 4d) / HALF), for
   a constant half group HALF of 16 (4 groups a block: one 16-byte load, one permute), 32 (2 groups: a broadcast and a
   masked one, no permute) or a multiple of 64 (one group: a broadcast), for a block whose groups all lie in the row:
   the vector int4_scales_masked gives (the lanes' values are the same). */
static inline __attribute__((always_inline)) __m512 int4_block_scales(const float *s, long blk, const long HALF)
{
    if (HALF == 16)
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                     _mm512_castps128_ps512(_mm_loadu_ps(s + 4 * blk)));
    if (HALF == 32)
        return _mm512_mask_broadcastss_ps(_mm512_set1_ps(s[2 * blk]), (__mmask16)0xff00, _mm_load_ss(s + 2 * blk + 1));
    return _mm512_set1_ps(s[blk * 64 / HALF]);
}
/* the same for any half group (int4_dot16_ok) and a block that may pass the row's last group (those lanes' scales
   zero): the former loop's per-block scales */
static inline __attribute__((always_inline)) __m512 int4_scales_masked(const float *s, long at, long half,
                                                                       long groups, __m512i group_of_dword)
{
    const long first_group = at / half;
    if (half < 64) {
        const long left = groups - first_group;
        const __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        return _mm512_permutexvar_ps(group_of_dword, _mm512_maskz_loadu_ps(live, s + first_group));
    }
    return _mm512_set1_ps(s[first_group]);
}

/* out[r * TOKENS + t] = dequantized int4 rows[r] . xs[t] (xs in dot16_positions order, padded); packed [n/2] bytes,
   scales [n/(2 half)] per row. Per block and token the four products go in two chains (vdpbf16ps waits 8 cycles on
   its accumulator here), added, then scaled into the row's sum. HALF: half a group as a constant (16, 32, 64: the
   whole blocks' loop takes int4_block_scales, the block's x vectors loaded once for its R rows), or 0 (any half
   group, each block's scales as int4_scales_masked); either way the same operations on the same values, so the
   same bits. A last block of fewer than 64 bytes goes with masks. */
static inline __attribute__((always_inline)) void dot16_int4_nt(const uint8_t *const *packed,
                                                                const float *const *scales, long n, long ahead,
                                                                long half,
                                                                const uint16_t *const *xs, float *out, const int NT,
                                                                const int R, const long HALF, const q4k_terms *bias)
{
    /* bf16(k % 16 - 8) for k < 32 */
    const __m512i table = _mm512_setr_epi32(
        0xC0E0C100, 0xC0A0C0C0, 0xC040C080, 0xBF80C000, 0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0,
        0xC0E0C100, 0xC0A0C0C0, 0xC040C080, 0xBF80C000, 0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0);
    if (HALF) half = HALF;
    /* each word's high byte to its low one, the high one zero (w >> 8 a word) */
    const __m512i high_byte = _mm512_broadcast_i32x4(_mm_setr_epi8(1, -128, 3, -128, 5, -128, 7, -128, 9, -128, 11,
                                                                   -128, 13, -128, 15, -128));
    /* the group of each dword of a block (half <= 64: 64 / half groups a block; else one) */
    const __m512i group_of_dword = half < 64 ? _mm512_srli_epi32(_mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32,
        36, 40, 44, 48, 52, 56, 60), __builtin_ctzl(half)) : _mm512_setzero_si512();
    const long bytes = n / 2, groups = n / (2 * half);
    __m512 tot[ACCUMULATORS];  /* [r][t] */
    _Pragma("GCC unroll 16")
    for (int a = 0; a < R * NT; a++) tot[a] = _mm512_setzero_ps();
    long at = 0, blk = 0;
    __m512 terms = _mm512_setzero_ps();  /* bias: lane r * TOKENS + t, row r's and token t's sum */
    long whole_groups = 0;             /* bias: the groups of the whole blocks, taken in their loop */
    if (HALF) {  /* whole blocks whose groups all lie in the row */
        for (; at + 64 <= bytes; at += 64, blk++) {
            __m512bh x[TOKENS][4];  /* up to 2 tokens: loaded once for the R rows (more stay memory operands) */
            _Pragma("GCC unroll 16")
            for (int t = 0; t < NT && NT <= 2; t++)
                _Pragma("GCC unroll 4")
                for (int k = 0; k < 4; k++) x[t][k] = load_bh(xs[t] + blk * 128 + 32 * k);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                prefetch_at((const char *)packed[r] + at, ahead, 64);
                const __m512i w = _mm512_loadu_si512(packed[r] + at);
                const __m512 scale = int4_block_scales(scales[r], blk, HALF);
                const __m512bh q0 = as_bh(_mm512_permutexvar_epi16(w, table));
                const __m512i w4 = _mm512_srli_epi16(w, 4);
                const __m512bh q1 = as_bh(_mm512_permutexvar_epi16(w4, table));
                const __m512bh q2 = as_bh(_mm512_permutexvar_epi16(int4_high_byte(w, high_byte), table));
                const __m512bh q3 = as_bh(_mm512_permutexvar_epi16(int4_high_byte(w4, high_byte), table));
                _Pragma("GCC unroll 16")
                for (int t = 0; t < NT; t++) {
                    if (NT > 2)
                        _Pragma("GCC unroll 4")
                        for (int k = 0; k < 4; k++) x[t][k] = load_bh(xs[t] + blk * 128 + 32 * k);
                    const __m512 a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, x[t][0]), q1, x[t][1]);
                    const __m512 b = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q2, x[t][2]), q3, x[t][3]);
                    tot[r * NT + t] = _mm512_fmadd_ps(_mm512_add_ps(a, b), scale, tot[r * NT + t]);
                }
            }
            if (HALF == 16 && bias) terms = q4k_terms_block(bias, R, NT, 4 * blk, terms);
        }
        whole_groups = 4 * blk;
    }
    for (; at < bytes; at += 64, blk++) {
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {  /* row by row: its four weight registers are used up before the next row's */
            prefetch_at((const char *)packed[r] + at, ahead, 64);
            const __m512i w = bytes - at >= 64 ? _mm512_loadu_si512(packed[r] + at)
                                               : _mm512_maskz_loadu_epi8(((__mmask64)1 << (bytes - at)) - 1,
                                                                         packed[r] + at);
            const __m512 scale = int4_scales_masked(scales[r], at, half, groups, group_of_dword);
            const __m512bh q0 = as_bh(_mm512_permutexvar_epi16(w, table));
            const __m512bh q1 = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
            const __m512bh q2 = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table));
            const __m512bh q3 = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table));
            _Pragma("GCC unroll 16")
            for (int t = 0; t < NT; t++) {
                const uint16_t *x = xs[t] + blk * 128;
                const __m512 a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, load_bh(x)), q1,
                                                  load_bh(x + 32));
                const __m512 b = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q2, load_bh(x + 64)), q3,
                                                  load_bh(x + 96));
                tot[r * NT + t] = _mm512_fmadd_ps(_mm512_add_ps(a, b), scale, tot[r * NT + t]);
            }
        }
    }
    if (HALF == 16 && bias) {  /* the groups past the whole blocks, in order */
        for (long g = whole_groups; g < bias->G; g++) terms = q4k_terms_group(bias, R, g, terms);
        _mm512_storeu_ps(bias->out, terms);
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16")
        for (int t = 0; t < NT; t++) out[r * TOKENS + t] = _mm512_reduce_add_ps(tot[r * NT + t]);
}

#define DOT16_ROWS(CALL)                                                                                          \
    if (R == 4) { /* only for nt <= 2 */                                                                          \
        if (nt == 1) CALL(1, 4); else CALL(2, 4);                                                                 \
    } else if (R == 2) {                                                                                          \
        DOT16_TOKENS(CALL, 2)                                                                                     \
    } else {                                                                                                      \
        DOT16_TOKENS(CALL, 1)                                                                                     \
    }
#define DOT16_TOKENS(CALL, R)                                                                                     \
    switch (nt) {                                                                                                 \
    case 1: CALL(1, R); break;                                                                                    \
    case 2: CALL(2, R); break;                                                                                    \
    case 3: CALL(3, R); break;                                                                                    \
    default: CALL(4, R); break;                                                                                   \
    }
/* out[r * TOKENS + t] = row r of (matrix ms[r], expert es[r], row rs[r]) . xs[t] for R = 1, 2 or 4 rows, scaled.
   `ahead`: how many rows of its matrix the next call starts ahead of each row (the rows prefetched meanwhile). */
static void dot16_matrix_rows(int fmt, long group, int R, long ahead, const matrix *const *ms, const long *es,
                              const long *rs, const float *const *srows, const uint16_t *const *xs, int nt,
                              float *out, const q4k_terms *bias)
{
    long row[MAX_ROWS];
    const long n = ms[0]->n;
    for (int r = 0; r < R; r++) row[r] = es[r] * ms[r]->rows + rs[r];
    if (fmt == FMT_INT4) {  /* srows: the rows' scale rows (scale_row) */
        const uint8_t *packed[MAX_ROWS];
        for (int r = 0; r < R; r++) packed[r] = (const uint8_t *)ms[r]->weights + row[r] * (n / 2);
        /* quant.py's int4 groups (64; int4-q4k's 32; 128) with a constant half group, others with a variable one */
#define INT4_CALL(NT, R) dot16_int4_nt(packed, srows, n, ahead * (n / 2), group / 2, xs, out, NT, R, HALF, bias)
#ifndef FORMER_LOOPS
        if (group == 64) {
            enum { HALF = 32 };
            DOT16_ROWS(INT4_CALL)
        } else if (group == 32) {
            enum { HALF = 16 };
            DOT16_ROWS(INT4_CALL)
        } else if (group == 128) {
            enum { HALF = 64 };
            DOT16_ROWS(INT4_CALL)
        } else
#endif
        {
            enum { HALF = 0 };
            DOT16_ROWS(INT4_CALL)
        }
        return;
    }
    const void *weights[MAX_ROWS];
    for (int r = 0; r < R; r++) weights[r] = (const char *)ms[r]->weights + row[r] * n * (fmt == FMT_BF16 ? 2 : 1);
#define BF16_CALL(NT, R) dot16_rows_nt(FMT_BF16, weights, n, ahead * n * 2, xs, out, NT, R)
#define INT8_CALL(NT, R) dot16_rows_nt(FMT_INT8, weights, n, ahead * n, xs, out, NT, R)
    if (fmt == FMT_BF16) {
        DOT16_ROWS(BF16_CALL)
    } else {
        DOT16_ROWS(INT8_CALL)
        for (int r = 0; r < R; r++)
            for (int t = 0; t < nt; t++) out[r * TOKENS + t] *= ms[r]->scales[row[r]];
    }
}

/* Whether the bf16 path is the faster one: not for int8 and one token, where the widening (sign extension, two
   conversions) costs as much as the float path's FMAs (2-core EPYC: 4.5-6 weights a cycle against 6-7).
   -DINT_FLOAT_PATH: int8 and int4 (int4-q4k, int4-m) always on the float path (bf16 weights keep vdpbf16ps), to
   measure on Sapphire Rapids, where LLVM's scheduling model gives vdpbf16ps zmm 4 uops (2 on port 0, 2 on port 5)
   against an FMA's one: there the float path's FMAs may pay once the widening is shared by 2 tokens or more. The
   float path sums in another order (results within the tests' tolerance, not the same bits). */
static inline int dot16_pays(int fmt, int nt)
{
#ifdef INT_FLOAT_PATH
    if (fmt == FMT_INT8 || fmt == FMT_INT4) return 0;
#endif
    return !(fmt == FMT_INT8 && nt == 1);
}

/* Whether dot16_matrix_rows takes the minima's term (q4k_terms) inside its int4 loop: groups of 32 */
static inline int dot16_terms_inside(int fmt, long group)
{
#ifdef FORMER_LOOPS
    (void)fmt, (void)group;
    return 0;
#else
    return fmt == FMT_INT4 && group == 32;
#endif
}

/* Rows per dot16 call: 4 for up to 2 tokens, else 2 (the accumulators and a row's weights stay in registers) */
#ifndef BF16_ROWS
#define BF16_ROWS 1
#endif
static inline int dot16_rows_for(int fmt, int nt, long rows_left)
{
    const int most = fmt == FMT_BF16 ? BF16_ROWS : 4;
    return nt <= 2 && rows_left >= 4 && most >= 4 ? 4 : rows_left >= 2 && most >= 2 ? 2 : 1;
}

/* rows [count, n] float32 -> bf16 [count, padded(n)] at `position` (NULL: in order), zero padding; 0 if a value is
   not exactly bf16 (then `out` is partly written). 16 values a step (T = 16, H = 2048: 18 us one value a step). */
static int bf16_copy(const float *rows, long count, long n, const int32_t *position, uint16_t *out)
{
    const long width = padded(n);
    memset(out, 0, (size_t)(count * width) * sizeof *out);
    const __m512i low_bits = _mm512_set1_epi32(0xffff);
    for (long r = 0; r < count; r++) {
        const float *row = rows + r * n;
        uint16_t *to = out + r * width;
        for (long k = 0; k < n; k += 16) {
            const __mmask16 live = n - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - k)) - 1);
            const __m512i bits = _mm512_maskz_loadu_epi32(live, row + k);
            if (_mm512_test_epi32_mask(bits, low_bits)) return 0;
            const __m256i high = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
            if (!position) {
                _mm256_mask_storeu_epi16(to + k, live, high);
            } else {
                uint16_t values[16];
                _mm256_storeu_si256((__m256i *)values, high);
                for (long j = 0; j < 16 && k + j < n; j++) to[position[k + j]] = values[j];
            }
        }
    }
    return 1;
}
#endif

/* The job's timeline (host_pool/measure.py --timeline; off unless experts_timeline turns it on): each job adds, in
   ns, its setup (x's bf16 copy, the scratch) before the job is posted to the threads, the first and the last
   thread's first phase-1 block after that (the team's wake-up; threads with no phase-1 block are not counted),
   phase 1 to its last block's end and phase 2 to the job's end, all from the posting except setup; and the threads
   that took phase-1 blocks. What a small job (one or two experts) spends beside its bytes. */
static int timeline_on;
static long long timeline_sums[7];  /* setup, first in, last in, phase 1 end, job end, jobs, threads in phase 1 */
#define TIMELINE_THREADS 1024

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* on: whether later jobs keep the timeline; out [7] (or NULL): the sums since the last call (then zeroed) */
void experts_timeline(int on, long long *out)
{
    for (int k = 0; k < 7; k++) {
        const long long v = __atomic_exchange_n(&timeline_sums[k], 0, __ATOMIC_SEQ_CST);
        if (out) out[k] = v;
    }
    timeline_on = on;
}

/* ---- a layer job: its arguments, how its rows are cut into blocks, what each thread does ---------------------- */

/* The job as every thread of it sees it; the counters it shares live on cache lines of their own. */
typedef struct {
    int fmt, round_bf16_out, minima;     /* phase 1's (gate/up) format, and whether it is int4-q4k's */
    int fmt_down, minima_down;           /* phase 2's (down) */
    long H, I, group, group_down;        /* inputs per scale: gate/up's (of H), down's (of I) */
    matrix mg, mu, md;
    const float *x;
    long units;
    const int64_t *unit_expert, *unit_start, *entry_token, *entry_out;
    const float *entry_weight;
    float *h, *out, *x_sums, *h_sums;
    const uint16_t *x16;
    uint16_t *h16;
    const int32_t *h_position;
    int threads;                    /* the threads taking part */
    long rows1, blocks1, fixed1;    /* phase 1: the flat rows (unit, row of I), units * I, cut in blocks1 blocks */
    long rows2, blocks2, fixed2;    /* phase 2: the rows of H */
    long long *entered;             /* timeline: each thread's entry (ns), or NULL */
    long long t_phase1;             /* timeline: when the last thread finished phase 1 */
    long long patience_ns;          /* how long a thread spins on a wait of the job before it sleeps */
    long next1 __attribute__((aligned(64)));  /* blocks handed out, per phase */
    long next2 __attribute__((aligned(64)));
    int done1 __attribute__((aligned(64)));   /* phase 1's blocks done; phase 2 opens at blocks1 */
    int open;
    int open_sleepers;
    int done2 __attribute__((aligned(64)));   /* phase 2's blocks done: the job's end at blocks2 */
    int done2_sleepers;
} job_t;

/* Blocks sized to the job: a phase's n rows cut into a multiple of the thread count of blocks of about `target`
   rows (n / (threads * rounds), rounds = n / (threads * target) rounded up), their bounds on multiples of QUANTUM
   rows (the row loops take 2 or 4 rows a step; sizes then differ by QUANTUM at most). So a small job spreads evenly
   over all threads: one expert's 768 phase-1 rows on 16 threads are 32 blocks of 24, where the former fixed blocks
   of 32 rows made 24 (a second round of 8 with half the team idle). -DBLOCKS_FIXED: the former cut (blocks of
   `target` rows, host_pool/measure.py --variants compares them). Returns the count; *fixed: 0, or that size. */
enum { QUANTUM = 4 };
static long cut_blocks(long n, int threads, long target, long *fixed)
{
#ifdef BLOCKS_FIXED
    (void)threads;
    *fixed = target;
    return (n + target - 1) / target;
#else
    *fixed = 0;
    const long rounds = (n + threads * target - 1) / (threads * target), quanta = n / QUANTUM;
    const long blocks = threads * rounds;
    return blocks < quanta ? blocks : quanta > 0 ? quanta : 1;
#endif
}

/* block k's first row (k == blocks: n) */
static inline long block_start(long n, long blocks, long fixed, long k)
{
    if (fixed) return k * fixed < n ? k * fixed : n;
    return k >= blocks ? n : k * (n / QUANTUM) / blocks * QUANTUM;
}

/* The cut of n rows for `threads` threads (phase 1: target ROWS_UP, n = experts * I; phase 2: ROWS_DOWN, n = H, given
   as phase 0 and 1): the block count, and the first `most` blocks' first rows into starts (host_pool/measure.py
   prints the cut; tests check it). */
long experts_blocks(long n, int threads, int phase, long *starts, long most)
{
    long fixed;
    const long blocks = cut_blocks(n, threads < 1 ? 1 : threads, phase ? ROWS_DOWN : ROWS_UP, &fixed);
    for (long k = 0; k < most && k <= blocks; k++) starts[k] = block_start(n, blocks, fixed, k);
    return blocks;
}

/* Phase 1 of unit u's rows i0 .. i1 - 1 (all its entries): h = silu(gate . x) * (up . x). */
static void phase1_rows(const job_t *J, long u, long i0, long i1)
{
    const int fmt = J->fmt, round_bf16_out = J->round_bf16_out, minima = J->minima;
    const long H = J->H, I = J->I, group = J->group, e = J->unit_expert[u];
    const int64_t *unit_start = J->unit_start, *entry_token = J->entry_token;
    const float *x = J->x, *x_sums = J->x_sums;
    const uint16_t *x16 = J->x16;
    uint16_t *h16 = J->h16;
    float *h = J->h;
    (void)x16;
    /* gate's and up's scale rows (scale_row) where the format has them; decoded ones (int4-q4k, int2-q2k) into
       buf, once per row and chunk of tokens */
    const int scaled = fmt == FMT_INT4 || fmt == FMT_INT2K || fmt == FMT_INT6K || fmt == FMT_INT6KM;
    const long G = group ? H / group : 0;  /* groups a row (0: no groups) */
    const long slot = J->mg.records ? 2 * G : 0;  /* a decoded scale row's floats */
    float buf[MAX_ROWS * slot + 1];
    for (long j0 = unit_start[u]; j0 < unit_start[u + 1]; j0 += TOKENS) {
        const int nt = unit_start[u + 1] - j0 < TOKENS ? (int)(unit_start[u + 1] - j0) : TOKENS;
        const float *xs[TOKENS];
        const uint16_t *x16s[TOKENS];  /* NULL without BF16_DOT */
        for (int t = 0; t < nt; t++) {
            xs[t] = x + entry_token[j0 + t] * H;
            x16s[t] = x16 ? x16 + entry_token[j0 + t] * padded(H) : NULL;
        }
        (void)x16s;  /* unused without BF16_DOT */
        tokens_f sums[minima ? G : 1];  /* the chunk's group sums of x, transposed (q4k_bias) */
        if (minima) {
            const float *rows[TOKENS];
            for (int t = 0; t < nt; t++) rows[t] = x_sums + entry_token[j0 + t] * G;
            bias_sums(rows, nt, G, sums);
        }
        for (long i = i0; i < i1;) {
            /* gate and up of `count` rows: gu[(2 c) * TOKENS + t] gate, gu[(2 c + 1) * TOKENS + t] up */
            float gu[MAX_ROWS * TOKENS];
            long count = 1;
            int dot16 = 0;
#ifdef BF16_DOT
            dot16 = x16 && dot16_pays(fmt, nt);  /* gate and up rows together: one read of x for all */
            if (dot16) count = dot16_rows_for(fmt, nt, 2 * (i1 - i)) >= 4 ? 2 : 1;
#endif
            const float *srows[MAX_ROWS] = {NULL};  /* gate i, up i, gate i + 1, up i + 1 */
            for (long c = 0; scaled && c < count; c++) {
                srows[2 * c] = scale_row(&J->mg, group, e * I + i + c, buf + 2 * c * slot);
                srows[2 * c + 1] = scale_row(&J->mu, group, e * I + i + c, buf + (2 * c + 1) * slot);
            }
            /* the minima's term before the dot products, which do not wait for its chains of sums (or inside the
               bf16 int4 loop: dot16_terms_inside) */
            float bias[MAX_ROWS * TOKENS];
#ifdef BF16_DOT
            const int inside = minima && dot16 && dot16_terms_inside(fmt, group);
            float terms_w[inside ? 2 * count * G : 1];
#else
            const int inside = 0;
#endif
            if (minima && !inside) q4k_bias(srows, (int)(2 * count), nt, G, sums, bias);
            if (dot16) {
#ifdef BF16_DOT
                const matrix *const ms[MAX_ROWS] = {&J->mg, &J->mu, &J->mg, &J->mu};
                const long es[MAX_ROWS] = {e, e, e, e}, rs[MAX_ROWS] = {i, i, i + 1, i + 1};
                q4k_terms terms = {terms_w, G, sums, nt == 1 ? x_sums + entry_token[j0] * G : NULL, bias};
                if (inside) q4k_bias_weights(srows, (int)(2 * count), G, terms_w);
                dot16_matrix_rows(fmt, group, (int)(2 * count), count, ms, es, rs, srows, x16s, nt, gu,
                                  inside ? &terms : NULL);
#endif
            } else if (int8_rows_one(fmt, nt)) {  /* gate and up of 2 rows at once where 2 are left */
                count = i1 - i >= 2 ? 2 : 1;
                const matrix *const ms[4] = {&J->mg, &J->mu, &J->mg, &J->mu};
                const long es[4] = {e, e, e, e}, rs[4] = {i, i, i + 1, i + 1};
                int8_matrix_rows((int)(2 * count), count, ms, es, rs, xs[0], gu);
            } else {
                dot_matrix_row(fmt, group, &J->mg, e, i, srows[0], xs, nt, gu);
                dot_matrix_row(fmt, group, &J->mu, e, i, srows[1], xs, nt, gu + TOKENS);
            }
            if (minima)
                for (long k = 0; k < 2 * count; k++)
                    for (int t = 0; t < nt; t++) gu[k * TOKENS + t] += bias[k * TOKENS + t];
            for (long c = 0; c < count; c++, i++)
                for (int t = 0; t < nt; t++) {
                    float gt = gu[2 * c * TOKENS + t], ut = gu[(2 * c + 1) * TOKENS + t];
                    if (round_bf16_out) { gt = round_bf16(gt); ut = round_bf16(ut); }
                    /* silu(g) = g * sigmoid(g) in the tanh form, as pool.py: it does not overflow */
                    float ht = gt * (0.5f + 0.5f * tanhf(0.5f * gt)) * ut;
                    h[(j0 + t) * I + i] = round_bf16_out ? round_bf16(ht) : ht;
                    if (h16) {  /* exact: ht is rounded to bf16 */
                        uint32_t bits;
                        memcpy(&bits, &h[(j0 + t) * I + i], sizeof bits);
                        h16[(j0 + t) * padded(I) + J->h_position[i]] = (uint16_t)(bits >> 16);
                    }
                }
        }
    }
}

/* Phase 2 of the output rows r0 .. r1 - 1: out[out_j, r] += w_j * (down[e_j, r] . h[j]) over every unit. */
static void phase2_rows(const job_t *J, long r0, long r1)
{
    const int fmt = J->fmt_down, round_bf16_out = J->round_bf16_out, minima = J->minima_down;
    const long H = J->H, I = J->I, group = J->group_down;
    const int64_t *unit_start = J->unit_start, *unit_expert = J->unit_expert, *entry_out = J->entry_out;
    const float *h = J->h, *entry_weight = J->entry_weight;
    const uint16_t *h16 = J->h16;
    float *out = J->out;
    (void)fmt;
    /* down's scale rows, as phase1_rows' */
    const int scaled = fmt == FMT_INT4 || fmt == FMT_INT2K || fmt == FMT_INT6K || fmt == FMT_INT6KM;
    const long G = group ? I / group : 0, slot = J->md.records ? 2 * G : 0;
    float buf[MAX_ROWS * slot + 1];
    /* unit by unit over the block's rows: the unit's h rows stay in the core's L1 meanwhile; each output element
       still sums the units in order */
    for (long u = 0; u < J->units; u++)
        for (long j0 = unit_start[u]; j0 < unit_start[u + 1]; j0 += TOKENS) {
            const int nt = unit_start[u + 1] - j0 < TOKENS ? (int)(unit_start[u + 1] - j0) : TOKENS;
            const float *hs[TOKENS];
            const uint16_t *h16s[TOKENS];
            for (int t = 0; t < nt; t++) {
                hs[t] = h + (j0 + t) * I;
                h16s[t] = h16 ? h16 + (j0 + t) * padded(I) : NULL;
            }
            (void)h16s;
            tokens_f sums[minima ? G : 1];  /* the chunk's group sums of h, transposed (q4k_bias) */
            if (minima) {
                const float *rows[TOKENS];
                for (int t = 0; t < nt; t++) rows[t] = J->h_sums + (j0 + t) * G;
                bias_sums(rows, nt, G, sums);
            }
            for (long r = r0; r < r1; r++) {
                float y[MAX_ROWS * TOKENS];
                int R = 1, dot16 = 0;
#ifdef BF16_DOT
                dot16 = h16 && dot16_pays(fmt, nt);  /* several rows at once: one read of h for all */
                if (dot16) R = dot16_rows_for(fmt, nt, r1 - r);
#endif
                const float *srows[MAX_ROWS] = {NULL};
                for (int k = 0; scaled && k < R; k++)
                    srows[k] = scale_row(&J->md, group, unit_expert[u] * H + r + k, buf + k * slot);
                float bias[MAX_ROWS * TOKENS];  /* as phase1_rows: before the dot products, or inside them */
#ifdef BF16_DOT
                const int inside = minima && dot16 && dot16_terms_inside(fmt, group);
                float terms_w[inside ? R * G : 1];
#else
                const int inside = 0;
#endif
                if (minima && !inside) q4k_bias(srows, R, nt, G, sums, bias);
                if (dot16) {
#ifdef BF16_DOT
                    const matrix *const ms[MAX_ROWS] = {&J->md, &J->md, &J->md, &J->md};
                    const long e = unit_expert[u], es[MAX_ROWS] = {e, e, e, e};
                    const long rs[MAX_ROWS] = {r, r + 1, r + 2, r + 3};
                    q4k_terms terms = {terms_w, G, sums, nt == 1 ? J->h_sums + j0 * G : NULL, bias};
                    if (inside) q4k_bias_weights(srows, R, G, terms_w);
                    dot16_matrix_rows(fmt, group, R, R, ms, es, rs, srows, h16s, nt, y, inside ? &terms : NULL);
#endif
                } else if (int8_rows_one(fmt, nt)) {  /* up to 4 rows at once */
                    R = r1 - r >= 4 ? 4 : r1 - r >= 2 ? 2 : 1;
                    const matrix *const ms[4] = {&J->md, &J->md, &J->md, &J->md};
                    const long e = unit_expert[u], es[4] = {e, e, e, e}, rs[4] = {r, r + 1, r + 2, r + 3};
                    int8_matrix_rows(R, R, ms, es, rs, hs[0], y);
                } else {
                    dot_matrix_row(fmt, group, &J->md, unit_expert[u], r, srows[0], hs, nt, y);
                }
                if (minima)
                    for (int k = 0; k < R; k++)
                        for (int t = 0; t < nt; t++) y[k * TOKENS + t] += bias[k * TOKENS + t];
                for (int k = 0; k < R; k++)
                    for (int t = 0; t < nt; t++) {
                        const float yt = round_bf16_out ? round_bf16(y[k * TOKENS + t]) : y[k * TOKENS + t];
                        out[entry_out[j0 + t] * H + r + k] += entry_weight[j0 + t] * yt;
                    }
                r += R - 1;
            }
        }
}

/* Between the phases, on one thread (the one finishing phase 1's last block): int4-q4k's group sums of h (h is
   complete then), the timeline. */
static void between_phases(job_t *J)
{
    if (J->minima_down) group_sums(J->h, J->unit_start[J->units], J->I, J->group_down, J->h_sums);
    if (J->entered) J->t_phase1 = now_ns();
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wait until *word >= want (at_most: <= want) (acquire): spin `patience_ns` (a short wait is the usual one), then sleep on a futex,
   counted in *sleepers (the waker's change of the word before its look at sleepers, the sleeper's count before its
   look at the word, all seq_cst: either the waker sees the sleeper and wakes the futex, or the sleeper sees the
   word). Not sched_yield: on Linux 6.x (EEVDF) a yielding thread gave its core to another process for ~0.3 ms. */
static void wait_for(int *word, int want, int at_most, int *sleepers, long long patience_ns)
{
#define WAIT_NOT_YET(v) (at_most ? (v) > want : (v) < want)
    const long long start = now_ns();
    for (unsigned spins = 1; WAIT_NOT_YET(__atomic_load_n(word, __ATOMIC_ACQUIRE)); spins++) {
        cpu_relax();
        if (spins % 64 == 0 && now_ns() - start >= patience_ns) {
            __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
            for (int seen; WAIT_NOT_YET(seen = __atomic_load_n(word, __ATOMIC_SEQ_CST));) {
#ifdef __linux__
                syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
                sched_yield();
#endif
            }
            __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
            return;
        }
    }
#undef WAIT_NOT_YET
}

/* after a seq_cst change of *word: wake its sleepers, if any */
static void wake_sleepers(int *word, int *sleepers)
{
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST)) {
#ifdef __linux__
        syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#else
        (void)word;
#endif
    }
}

/* A thread's part of a phase: the next unclaimed block from the phase's counter until none is left, each counted
   done after; every block is one thread's, in any order (the rows are independent). No block waits for a given
   thread, and the phases' ends count blocks, not threads: a thread woken late (or descheduled before its first
   claim) takes fewer blocks or none, and the job does not wait for it (the caller alone finishes a job whose
   workers share its core). The thread finishing phase 1's last block runs between_phases, then opens phase 2: the
   job's one barrier. */
static void phase1_share(job_t *J, int me)
{
    for (long b; (b = __atomic_fetch_add(&J->next1, 1, __ATOMIC_RELAXED)) < J->blocks1;) {
        if (J->entered && me < TIMELINE_THREADS && !J->entered[me]) J->entered[me] = now_ns();  /* its first block */
        long f = block_start(J->rows1, J->blocks1, J->fixed1, b);
        const long f1 = block_start(J->rows1, J->blocks1, J->fixed1, b + 1);
        while (f < f1) {  /* a block may run over from one unit into the next */
            const long u = f / J->I, i0 = f % J->I, i1 = i0 + (f1 - f) < J->I ? i0 + (f1 - f) : J->I;
            phase1_rows(J, u, i0, i1);
            f += i1 - i0;
        }
        if (__atomic_add_fetch(&J->done1, 1, __ATOMIC_ACQ_REL) == J->blocks1) {  /* acquires every h row */
            between_phases(J);
            __atomic_store_n(&J->open, 1, __ATOMIC_SEQ_CST);
            wake_sleepers(&J->open, &J->open_sleepers);
        }
    }
}

static void phase2_share(job_t *J)
{
    for (long b; (b = __atomic_fetch_add(&J->next2, 1, __ATOMIC_RELAXED)) < J->blocks2;) {
        phase2_rows(J, block_start(J->rows2, J->blocks2, J->fixed2, b),
                    block_start(J->rows2, J->blocks2, J->fixed2, b + 1));
        if (__atomic_add_fetch(&J->done2, 1, __ATOMIC_SEQ_CST) == J->blocks2)
            wake_sleepers(&J->done2, &J->done2_sleepers);
    }
}

static __attribute__((unused)) void job_share(job_t *J, int me)
{
    phase1_share(J, me);
    wait_for(&J->open, 1, 0, &J->open_sleepers, J->patience_ns);
    phase2_share(J);
}

/* ---- the team: threads kept between jobs ------------------------------------------------------------------------
   An OpenMP parallel region per job paid, on a 16-core host, 0.14-0.26 ms a small job beside its bytes: the team's
   wake-up, the loops' barriers (two, three with int4-q4k), each waiting for every thread. The team here is started
   once and kept: the caller posts a job by bumping a word (the job's number and its thread count), the workers spin
   on that word for TEAM_SPIN_US (200) after their last job (the next layer's job within a decode step finds them
   awake), then sleep on it (a futex: no core kept busy between steps; the XLA runtime's threads share the host).
   The caller is a thread of the job too; it waits for phase 2's last block, then closes the job and waits only for
   the workers still inside it (a worker enters by counting itself inside, then looking whether the job is still
   open; so one that wakes after the close never touches it). One barrier a job (phase 1's blocks done), and no
   wait for a thread that has not started. Linux OpenMP builds (-fopenmp links the threads); -DTEAM_OMP, non-Linux
   builds: the OpenMP region per job as before. Callers at once (pools, the FFI's worker threads) each take a free
   team, a new one if none is; a team grows to the threads asked for. */
#if defined(_OPENMP) && defined(__linux__) && !defined(TEAM_OMP)
#define OWN_TEAM 1
#ifndef TEAM_SPIN_US
#define TEAM_SPIN_US 200
#endif
#ifndef JOB_SPIN_US
#define JOB_SPIN_US 50
#endif
#define TEAM_SPIN_STR(v) #v
#define TEAM_SPIN_XSTR(v) TEAM_SPIN_STR(v)
#define TEAM_SPIN_TEXT TEAM_SPIN_XSTR(TEAM_SPIN_US)
enum { TEAM_MAX = 1023 };  /* workers a team (the word keeps 16 bits for the thread count) */

/* STRATA_POOL_SPIN_US (read once): the idle spin in microseconds instead of TEAM_SPIN_US, for A/Bs in the engine
   (the gap between a decode step's layer jobs is the GPU's share of a layer: ~0.1-0.4 ms) */
static long long team_spin_us(void)
{
    static long long us = -1;
    if (us < 0) {
        const char *e = getenv("STRATA_POOL_SPIN_US");
        char *end = NULL;
        long long v = e && *e ? strtoll(e, &end, 10) : -1;
        us = e && *e && end && !*end && v >= 0 ? v : TEAM_SPIN_US;
    }
    return us;
}

typedef struct team {
    struct team *next_team;
    int busy;    /* a caller holds it (teams_lock) */
    int size;    /* workers started (ids 1 .. size) */
    job_t *job;  /* the posted job: written before the word, read by the workers taking part */
    uint32_t word __attribute__((aligned(64)));  /* job number << 16 | threads taking part (the caller too) */
    int sleepers __attribute__((aligned(64)));   /* workers in (or going into) the futex wait */
    int inside __attribute__((aligned(64)));    /* workers inside the posted job */
    int inside_sleepers;                          /* the caller asleep on it */
    uint32_t closed;                              /* the word of the last job closed */
    long long spin_ns;  /* how long an idle worker spins: 0 once the team outnumbers the cores it may run on */
} team_t;

typedef struct {
    team_t *team;
    int id;
    uint32_t seen;
} worker_start;

static pthread_mutex_t teams_lock = PTHREAD_MUTEX_INITIALIZER;
static team_t *teams;  /* the list, oldest first: a lone caller keeps taking the first, whose workers spin */
static pthread_once_t teams_once = PTHREAD_ONCE_INIT;

static void teams_forget(void)  /* a forked child has none of the threads: fresh teams there */
{
    teams = NULL;
    pthread_mutex_init(&teams_lock, NULL);
}
static void teams_init(void) { pthread_atfork(NULL, NULL, teams_forget); }

/* -DTEAM_SPIN_YIELD=1 (for A/Bs in the engine, STRATA_POOL_DEFINES): an idle worker yields its core every 64 spins,
   so a longer spin (the gap between a decode step's layer jobs) need not take the cores of XLA's launching thread
   and the offload worker, which cost the engine 18-20% with TEAM_SPIN_US=1000 on 16 threads */
#ifndef TEAM_SPIN_YIELD
#define TEAM_SPIN_YIELD 0
#endif

/* the word once it differs from `seen`: spin TEAM_SPIN_US, then sleep on the futex */
static uint32_t wait_word(team_t *T, uint32_t seen)
{
    uint32_t word;
    const long long start = now_ns();
    for (unsigned spins = 1;; spins++) {
        if ((word = __atomic_load_n(&T->word, __ATOMIC_ACQUIRE)) != seen) return word;
        cpu_relax();
        if (spins % 64 == 0 && now_ns() - start >= __atomic_load_n(&T->spin_ns, __ATOMIC_RELAXED)) break;
        if (TEAM_SPIN_YIELD && spins % 64 == 0) sched_yield();
    }
    /* sleepers before the look at the word, the caller's word before its look at sleepers (both seq_cst): either
       the caller sees a sleeper and wakes the futex, or this look sees its word; the futex wait itself returns at
       once if the word moved since */
    __atomic_add_fetch(&T->sleepers, 1, __ATOMIC_SEQ_CST);
    while ((word = __atomic_load_n(&T->word, __ATOMIC_SEQ_CST)) == seen)
        syscall(SYS_futex, &T->word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    __atomic_sub_fetch(&T->sleepers, 1, __ATOMIC_SEQ_CST);
    return word;
}

static void *team_worker(void *arg)
{
    const worker_start start = *(worker_start *)arg;
    free(arg);
    team_t *T = start.team;
    for (uint32_t word = start.seen;;) {
        word = wait_word(T, word);
        const int n = (int)(word & 0xffff);
        if (start.id < n) {
            /* inside, then the look (seq_cst, against the caller's close, then its look at inside): the job still
               posted and not closed, the caller waits for this thread, so T->job is its job until it leaves */
            __atomic_add_fetch(&T->inside, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&T->word, __ATOMIC_SEQ_CST) == word && __atomic_load_n(&T->closed, __ATOMIC_SEQ_CST) != word)
                job_share(T->job, start.id);
            if (__atomic_sub_fetch(&T->inside, 1, __ATOMIC_SEQ_CST) == 0) wake_sleepers(&T->inside, &T->inside_sleepers);
        }
    }
    return NULL;
}

/* a free team with up to `workers` workers (fewer if threads cannot be started), held until team_give */
static team_t *team_take(int workers)
{
    pthread_once(&teams_once, teams_init);
    pthread_mutex_lock(&teams_lock);
    team_t **at = &teams;
    while (*at && (*at)->busy) at = &(*at)->next_team;
    if (!*at) {
        team_t *T = NULL;
        if (posix_memalign((void **)&T, 64, sizeof *T) == 0) {
            memset(T, 0, sizeof *T);
            *at = T;
        }
    }
    team_t *T = *at;
    if (T) {
        T->busy = 1;
        workers = workers < TEAM_MAX ? workers : TEAM_MAX;
        if (T->size < workers) {
            sigset_t all, old;  /* the workers take no signals: the process's handlers run where they did */
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old);
            while (T->size < workers) {
                worker_start *s = malloc(sizeof *s);
                pthread_t thread;
                pthread_attr_t attr;
                if (!s) break;
                *s = (worker_start){T, T->size + 1, T->word};
                pthread_attr_init(&attr);
                pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
                pthread_attr_setstacksize(&attr, 1 << 20);
                const int failed = pthread_create(&thread, &attr, team_worker, s);
                pthread_attr_destroy(&attr);
                if (failed) {
                    free(s);
                    break;
                }
                pthread_setname_np(thread, "strata-experts");
                T->size++;
            }
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            /* more threads than cores (libgomp drops its spin then too): a spinning thread would take the core of
               one with work; so no idle spin, and the job's waits sleep after 5 us. Looked at as the team grows (a
               syscall: not each job) */
            cpu_set_t cores;
            const int count = sched_getaffinity(0, sizeof cores, &cores) == 0 ? CPU_COUNT(&cores) : 1;
            __atomic_store_n(&T->spin_ns, T->size + 1 > count ? 0 : team_spin_us() * 1000LL, __ATOMIC_RELAXED);
        }
    }
    pthread_mutex_unlock(&teams_lock);
    return T;
}

static void team_give(team_t *T)
{
    pthread_mutex_lock(&teams_lock);
    T->busy = 0;
    pthread_mutex_unlock(&teams_lock);
}

/* J on the caller and up to J->threads - 1 workers of T */
static void team_run(team_t *T, job_t *J)
{
    /* the job's own waits (phase 1's last block, phase 2's, the workers inside) are for blocks being computed:
       short, unless the thread computing one lost its core, maybe to the waiter itself; so JOB_SPIN_US (5 us with
       more threads than cores), then sleep. Set before the word: the workers read it after. */
    J->patience_ns = T->spin_ns ? JOB_SPIN_US * 1000LL : 5000;
    T->job = J;
    const uint32_t word = ((T->word >> 16) + 1) << 16 | (uint32_t)J->threads;
    __atomic_store_n(&T->word, word, __ATOMIC_SEQ_CST);
    wake_sleepers((int *)&T->word, &T->sleepers);  /* all: any may take part */
    job_share(J, 0);
    wait_for(&J->done2, (int)J->blocks2, 0, &J->done2_sleepers, J->patience_ns);
    __atomic_store_n(&T->closed, word, __ATOMIC_SEQ_CST);
    wait_for(&T->inside, 0, 1, &T->inside_sleepers, J->patience_ns);
}
#endif

/* See the comment at the top. gate, up: [E, I, H] (int4 [E, I, H/2]); down: [E, H, I] (int4 [E, H, I/2]);
   x [T, H]; h scratch [J, I]; out [*, H], added to. Returns the threads that ran (1 without OpenMP). */
int experts_job(int fmt, int fmt_down, int round_bf16_out, long H, long I, long group, long group_down,
                const void *gate, const void *up, const void *down,
                const float *gate_scale, const float *up_scale, const float *down_scale,
                const float *x, long units, const int64_t *unit_expert, const int64_t *unit_start,
                const int64_t *entry_token, const int64_t *entry_out, const float *entry_weight,
                float *h, float *out, int threads)
{
    const int timed = timeline_on;
    const long long t_entry = timed ? now_ns() : 0;
    long long t_region = 0;
    long long *entered = timed ? calloc(TIMELINE_THREADS, sizeof *entered) : NULL;  /* each thread's entry */
    /* int4-q4k, int4-m: int4's loops, and the minima's term */
    const int minima = fmt == FMT_INT4K || fmt == FMT_INT4KR, minima_down = fmt_down == FMT_INT4K
                                                                            || fmt_down == FMT_INT4KR;
    /* bytes of a super-block record (int4-q4k, int2-q2k: the scale pointers are their records), else 0 */
#define RECORD_OF(f) ((f) == FMT_INT4KR ? Q4K_RECORD : (f) == FMT_INT2K ? Q2K_RECORD : (f) == FMT_INT6K ? Q6K_RECORD \
                      : (f) == FMT_INT6KM ? Q6KM_RECORD : 0)
    const long record = RECORD_OF(fmt), record_down = RECORD_OF(fmt_down);
#undef RECORD_OF
    if (minima) fmt = FMT_INT4;
    if (minima_down) fmt_down = FMT_INT4;
    /* scale rows of 2G: the scales, then the minima */
    const int held_minima = minima || fmt == FMT_INT8GM, held_minima_down = minima_down || fmt_down == FMT_INT8GM;
    if (fmt == FMT_INT8GM) fmt = FMT_INT8G;  /* int8-g dequantizes with its minima in registers */
    if (fmt_down == FMT_INT8GM) fmt_down = FMT_INT8G;
#ifndef _OPENMP
    threads = 1;
#endif
    threads = threads < 1 ? 1 : threads;
    /* int4-q4k: the group sums of x's token rows (phase 1) and of h's rows (phase 2, after phase 1) */
    float *x_sums = NULL, *h_sums = NULL;
    if (minima || minima_down) {
        long tokens = 0;
        for (long j = 0; j < unit_start[units]; j++) tokens = entry_token[j] + 1 > tokens ? entry_token[j] + 1 : tokens;
        x_sums = minima ? malloc((size_t)(tokens * (H / group) + 1) * sizeof *x_sums) : NULL;
        h_sums = minima_down ? malloc((size_t)(unit_start[units] * (I / group_down) + 1) * sizeof *h_sums) : NULL;
        if ((minima && !x_sums) || (minima_down && !h_sums)) {  /* a few KB: the process is out of memory */
            fprintf(stderr, "host pool: out of memory for int4-q4k's group sums\n");
            abort();
        }
        if (minima) group_sums(x, tokens, H, group, x_sums);
    }
    /* the bf16 path (see dot16_rows_nt): bf16 copies of x (phase 1) if its values are all bf16, and of h (phase 2)
       if h is rounded to bf16; NULL: the float path */
    uint16_t *x16 = NULL, *h16 = NULL;
    int32_t *h_position = NULL;
#ifdef BF16_DOT
    const long entries = unit_start[units];
#define DOT16_OK(f, g) ((f) == FMT_BF16 || (f) == FMT_INT8 || ((f) == FMT_INT4 && int4_dot16_ok((g) / 2)))
    if (DOT16_OK(fmt, group) && entries > 0) {
        long tokens = 0;
        for (long j = 0; j < entries; j++) tokens = entry_token[j] + 1 > tokens ? entry_token[j] + 1 : tokens;
        int32_t *x_position = malloc((size_t)H * sizeof *x_position);
        x16 = malloc((size_t)(tokens * padded(H)) * sizeof *x16);
        if (x_position && x16) {
            dot16_positions(fmt, H, group / 2, x_position);
            if (!bf16_copy(x, tokens, H, fmt == FMT_INT4 ? x_position : NULL, x16)) { free(x16); x16 = NULL; }
        } else {
            free(x16);
            x16 = NULL;
        }
        free(x_position);
    }
    if (DOT16_OK(fmt_down, group_down) && entries > 0 && round_bf16_out) {  /* phase 2's own format decides */
        h_position = malloc((size_t)I * sizeof *h_position);
        h16 = calloc((size_t)(entries * padded(I)), sizeof *h16);  /* the padding stays zero */
        if (h_position && h16) {
            dot16_positions(fmt_down, I, group_down / 2, h_position);
        } else {
            free(h_position);
            free(h16);
            h_position = NULL, h16 = NULL;
        }
    }
#undef DOT16_OK
#endif
    job_t J;
    memset(&J, 0, sizeof J);
    J.fmt = fmt, J.round_bf16_out = round_bf16_out, J.minima = minima;
    J.fmt_down = fmt_down, J.minima_down = minima_down;
    J.H = H, J.I = I, J.group = group, J.group_down = group_down;
    J.mg = (matrix){gate, gate_scale, I, H, held_minima, record ? (const uint8_t *)gate_scale : NULL, record};
    J.mu = (matrix){up, up_scale, I, H, held_minima, record ? (const uint8_t *)up_scale : NULL, record};
    J.md = (matrix){down, down_scale, H, I, held_minima_down, record_down ? (const uint8_t *)down_scale : NULL,
                    record_down};
    J.x = x, J.units = units, J.unit_expert = unit_expert, J.unit_start = unit_start;
    J.entry_token = entry_token, J.entry_out = entry_out, J.entry_weight = entry_weight;
    J.h = h, J.out = out, J.x_sums = x_sums, J.h_sums = h_sums, J.x16 = x16, J.h16 = h16, J.h_position = h_position;
    J.entered = entered;
    int ran = 1;
#ifdef OWN_TEAM
    team_t *team = threads > 1 ? team_take(threads - 1) : NULL;
    ran = team ? 1 + (team->size < threads - 1 ? team->size : threads - 1) : 1;
#elif defined(_OPENMP)
    ran = threads;  /* what the blocks are cut for; the region may give fewer (OMP_THREAD_LIMIT), then says so */
#endif
    J.threads = ran;
    J.rows1 = units * I, J.blocks1 = cut_blocks(J.rows1, ran, ROWS_UP, &J.fixed1);
    J.rows2 = H, J.blocks2 = cut_blocks(H, ran, ROWS_DOWN, &J.fixed2);
    if (timed) t_region = now_ns();
#ifdef OWN_TEAM
    if (team) {
        team_run(team, &J);
        team_give(team);
    } else {
        job_share(&J, 0);
    }
#elif defined(_OPENMP)
    /* the OpenMP region per job (-DTEAM_OMP: the former team, for comparison; non-Linux builds) */
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single nowait
        ran = n;
        if (entered && me < TIMELINE_THREADS) entered[me] = now_ns();
        phase1_share(&J, me);  /* its last block's thread runs between_phases */
#pragma omp barrier
        phase2_share(&J);
    }
#else
    job_share(&J, 0);
#endif
    if (timed) {
        const long long t_end = now_ns();
        long long first = 0, last = 0, in = 0;
        for (int k = 0; entered && k < ran && k < TIMELINE_THREADS; k++)
            if (entered[k]) {
                first = !first || entered[k] < first ? entered[k] : first;
                last = entered[k] > last ? entered[k] : last;
                in++;
            }
        const long long add[7] = {t_region - t_entry, first ? first - t_region : 0, last ? last - t_region : 0,
                                  J.t_phase1 - t_region, t_end - t_region, 1, in};
        for (int k = 0; k < 7; k++) __atomic_fetch_add(&timeline_sums[k], add[k], __ATOMIC_SEQ_CST);
    }
    free(entered);
    free(x16);
    free(h16);
    free(h_position);
    free(x_sums);
    free(h_sums);
    return ran;
}

/* The sum of `words` 64-bit words of buf, read by `threads` threads (each a contiguous share): the machine's read
   bandwidth when timed (host_pool/measure.py); the sum keeps the reads from being optimised away. */
uint64_t read_words(const uint64_t *buf, long words, int threads)
{
    typedef uint64_t v8w __attribute__((vector_size(64)));
    uint64_t total = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : total)
#endif
    {
        long share = words / 8, first = 0;
#ifdef _OPENMP
        const long count = omp_get_num_threads(), me = omp_get_thread_num();
        first = share * me / count;
        share = share * (me + 1) / count - first;
#endif
        v8w acc = {0};
        for (long block = first; block < first + share; block++) {
            v8w v;
            memcpy(&v, buf + block * 8, sizeof v);
            acc += v;
        }
        for (int k = 0; k < 8; k++) total += acc[k];
    }
    return total;
}

/* Which registers the vector types map to in this build, and whether it has OpenMP threads. */
#ifdef BF16_DOT
#define DOTS ISA " + BF16 dot products"
#else
#define DOTS ISA
#endif
const char *experts_build(void)
{
#if defined(OWN_TEAM)
    return DOTS ", OpenMP, a kept team (spin " TEAM_SPIN_TEXT " us, then sleep)";
#elif defined(_OPENMP)
    return DOTS ", OpenMP";
#else
    return DOTS ", one thread (no OpenMP)";
#endif
}
