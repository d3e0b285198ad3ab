/* One host pool layer job in native code: every CPU expert of a window, for its tokens, in one call.
   host_pool/native.py compiles it (-O3 -march=native -fopenmp where the compiler takes them) and host_pool/pool.py
   calls `experts_job` from its driver thread; ctypes releases the GIL for the call, OpenMP runs the threads.

   Work: units u = (expert e_u, its entries j in [unit_start[u], unit_start[u+1])); entry j is one token row of x,
   an output row and a weight:
     phase 1, threads over (unit, block of I rows):  h[j, i] = r(silu(g) * u),  g = r(s_g * gate[e, i] . x[tok_j]),
                                                      u = r(s_u * up[e, i] . x[tok_j])
     phase 2, threads over blocks of H rows:         out[out_j, r] += w_j * r(s_d * down[e, r] . h[j])
   r() rounds to bf16 (round to nearest even) when `round_bf16`, as the device's graphs round; s_* are int8's row
   scales (1 otherwise); int4 weights are (nibble - 8) * group scale, exact in float32, as store.py dequantizes.
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
   per group and its accumulators in memory, and took 1.6x its present time on weights in cache. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3 };
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
        for (int u = 0; u < U; u++) {                                                                           \
            const long at = k + u * VL;                                                                         \
            const vf w = WIDEN(at);                                                                             \
            for (int t = 0; t < NT; t++) acc[u * NT + t] = v_fma(w, v_load(xs[t] + at), acc[u * NT + t]);       \
        }                                                                                                       \
    }                                                                                                           \
    for (; k + VL <= n; k += VL) {                                                                              \
        const vf w = WIDEN(k);                                                                                  \
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
    for (int a = 0; a < U * NT; a++) acc[a] = v_zero();
    long k = 0;
    if (fmt == FMT_F32) {
        DOT_LOOP(W_F32, 4)
    } else if (fmt == FMT_BF16) {
        DOT_LOOP(W_BF16, 2)
    } else {
        DOT_LOOP(W_INT8, 1)
    }
    for (int t = 0; t < NT; t++) {
        vf total = acc[t];
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
                for (int t = 0; t < NT; t++) {
                    acc[chain * NT + t] = v_fma(low, v_load(xs[t] + g0 + b), acc[chain * NT + t]);
                    acc[(chain + 1) * NT + t] = v_fma(high, v_load(xs[t] + g0 + HALF + b), acc[(chain + 1) * NT + t]);
                }
            }
        } else {
            for (long b = 0; b < HALF; b++)
                for (int t = 0; t < NT; t++)
                    tail[t] += (float)((packed[b] & 15) - 8) * *scales * xs[t][g0 + b]
                             + (float)((packed[b] >> 4) - 8) * *scales * xs[t][g0 + HALF + b];
        }
    }
    for (int t = 0; t < NT; t++)
        out[t] = v_sum((acc[t] + acc[NT + t]) + (acc[2 * NT + t] + acc[3 * NT + t])) + tail[t];
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
} matrix;

static void dot_matrix_row(int fmt, long group, const matrix *m, long expert, long r, const float *const *xs, int nt,
                           float *out)
{
    const long row = expert * m->rows + r;
    if (fmt == FMT_INT4) {
        dot_rows_int4((const uint8_t *)m->weights + row * (m->n / 2), m->scales + row * (m->n / group), m->n, group,
                      xs, nt, out);
        return;
    }
    const long itemsize = fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
    dot_rows(fmt, (const char *)m->weights + row * m->n * itemsize, m->n, xs, nt, out);
    if (fmt == FMT_INT8) {
        const float scale = m->scales[row];
        for (int t = 0; t < nt; t++) out[t] *= scale;
    }
}

/* See the comment at the top. gate, up: [E, I, H] (int4 [E, I, H/2]); down: [E, H, I] (int4 [E, H, I/2]);
   x [T, H]; h scratch [J, I]; out [*, H], added to. Returns the threads that ran (1 without OpenMP). */
int experts_job(int fmt, int round_bf16_out, long H, long I, long group,
                const void *gate, const void *up, const void *down,
                const float *gate_scale, const float *up_scale, const float *down_scale,
                const float *x, long units, const int64_t *unit_expert, const int64_t *unit_start,
                const int64_t *entry_token, const int64_t *entry_out, const float *entry_weight,
                float *h, float *out, int threads)
{
    const matrix mg = {gate, gate_scale, I, H}, mu = {up, up_scale, I, H}, md = {down, down_scale, H, I};
    const long blocks_up = (I + ROWS_UP - 1) / ROWS_UP, blocks_down = (H + ROWS_DOWN - 1) / ROWS_DOWN;
    int ran = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
#pragma omp single nowait
        ran = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
#endif
        for (long item = 0; item < units * blocks_up; item++) {
            const long u = item / blocks_up, i0 = item % blocks_up * ROWS_UP;
            const long i1 = i0 + ROWS_UP < I ? i0 + ROWS_UP : I, e = unit_expert[u];
            for (long j0 = unit_start[u]; j0 < unit_start[u + 1]; j0 += TOKENS) {
                const int nt = unit_start[u + 1] - j0 < TOKENS ? (int)(unit_start[u + 1] - j0) : TOKENS;
                const float *xs[TOKENS];
                for (int t = 0; t < nt; t++) xs[t] = x + entry_token[j0 + t] * H;
                for (long i = i0; i < i1; i++) {
                    float g[TOKENS], v[TOKENS];
                    dot_matrix_row(fmt, group, &mg, e, i, xs, nt, g);
                    dot_matrix_row(fmt, group, &mu, e, i, xs, nt, v);
                    for (int t = 0; t < nt; t++) {
                        float gt = g[t], ut = v[t];
                        if (round_bf16_out) { gt = round_bf16(gt); ut = round_bf16(ut); }
                        /* silu(g) = g * sigmoid(g) in the tanh form, as pool.py: it does not overflow */
                        float ht = gt * (0.5f + 0.5f * tanhf(0.5f * gt)) * ut;
                        h[(j0 + t) * I + i] = round_bf16_out ? round_bf16(ht) : ht;
                    }
                }
            }
        }
        /* the implicit barrier of the loop above: every h row is written before phase 2 reads it */
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (long item = 0; item < blocks_down; item++) {
            const long r0 = item * ROWS_DOWN, r1 = r0 + ROWS_DOWN < H ? r0 + ROWS_DOWN : H;
            /* unit by unit over the block's rows: the unit's h rows stay in the core's L1 meanwhile; each output
               element still sums the units in order */
            for (long u = 0; u < units; u++)
                for (long j0 = unit_start[u]; j0 < unit_start[u + 1]; j0 += TOKENS) {
                    const int nt = unit_start[u + 1] - j0 < TOKENS ? (int)(unit_start[u + 1] - j0) : TOKENS;
                    const float *hs[TOKENS];
                    for (int t = 0; t < nt; t++) hs[t] = h + (j0 + t) * I;
                    for (long r = r0; r < r1; r++) {
                        float y[TOKENS];
                        dot_matrix_row(fmt, group, &md, unit_expert[u], r, hs, nt, y);
                        for (int t = 0; t < nt; t++) {
                            const float yt = round_bf16_out ? round_bf16(y[t]) : y[t];
                            out[entry_out[j0 + t] * H + r] += entry_weight[j0 + t] * yt;
                        }
                    }
                }
        }
    }
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
const char *experts_build(void)
{
#ifdef _OPENMP
    return ISA ", OpenMP";
#else
    return ISA ", one thread (no OpenMP)";
#endif
}
