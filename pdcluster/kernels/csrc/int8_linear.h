/* Linears over int8 weights in groups of 32 (weight_dtype: int8), weight
 * only: int8 codes with an fp16 scale d and offset m per (output column, 32
 * consecutive k), the layout of GGUF's Q4_1 (codes 0..15) and Q8_0 (codes
 * -127..127, m = 0) blocks, so a GGUF's weights arrive exactly
 * (kernels/int8_linear.py):
 *
 *     W[n, k] = d[n, g] * q[n, k] + m[n, g]                      g = k / 32
 *     y[r, n] = sum_g ( d[n, g] * dot_g(x[r], q[n]) + m[n, g] * xsum[r, g] ) + bias[n]
 *
 * dot_g: the group's 32 products summed; xsum[r, g]: the fp32 sum of x[r]
 * over the group (in one fixed order), once per row, shared by every column.  The
 * groups add up in g order into one fp32 accumulator per (row, column), so
 * a row's output is the same bits in whatever batch it came and however the
 * threads split the columns (exact resume needs that):
 *
 *     AVX-512 BF16 (cpu_kernels.c)   codes widened to bf16 (exact: |q| <= 128), dot_g by VDPBF16PS on the
 *                                    bf16 x pairs; acc = m * xsum + (dot_g * d + acc)
 *     AVX2 (cpu_kernels_avx2.c)      each row's group of x scaled to int16 (s = max |x| / 32767: steps of
 *                                    2^-15 of the group's largest value, far under bf16's own 2^-8 per
 *                                    value), codes widened to int16, dot_g exact in int32 by VPMADDWD
 *                                    (|x q| <= 32767 * 128, 32 of them < 2^31: no order to keep);
 *                                    acc = m * xsum + ((float(dot_g) * s) * d + acc)
 *
 * Rows of a tile few enough for one micro-kernel pass widen the codes in
 * registers; more rows widen the tile once into a per-thread buffer and read
 * it from there: the same values, the same instructions per row.
 *
 * Packed weight (kernels/int8_linear.py pack_int8_weight writes it), per
 * 32-column tile j, per group g:
 *
 *     8-bit codes (1152 bytes a group)
 *     int8     q[16][32][2]     q[p][c][e] = Q[32 j + c][32 g + 2 p + e]     1024 bytes (VDPBF16PS's pair layout)
 *     4-bit codes (640 bytes a group; every code in 0..15, as Q4_1's)
 *     uint8    n[16][32]        n[p][i] = q[p][i / 2][i % 2] | q[p][16 + i / 2][i % 2] << 4    512 bytes
 *     then, either way
 *     fp16     d[32]            per column c                                  64 bytes
 *     fp16     m[32]                                                          64 bytes
 *
 * Included by portable_kernels.h, so both variants' sources carry it. */
#ifndef PD_INT8_LINEAR_H
#define PD_INT8_LINEAR_H

#define G32_K 32                /* k per group */
#define G32_CODES 1024          /* codes in one group of one tile: 32 columns x 32 k */
#define G32_SCALE_BYTES 128     /* d[32] and m[32] in fp16 */

/* bytes of one group of one tile with ``bits``-bit codes (8 or 4) */
static inline int64_t g32_group_bytes(int bits) { return G32_CODES * bits / 8 + G32_SCALE_BYTES; }

/* Per-thread scratch kept between calls (a fresh malloc of a prefill's rows is an mmap and page faults on every
 * call): slot 0 the rows' group sums, 1 and 3 int16 rows and their scales (AVX2), 2 a widened tile. */
static void *g32_scratch(int slot, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t cap[4];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (bytes + bytes / 4 + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, cap[slot]);
    }
    return buf[slot];
}

typedef struct {
    const bf16 *x, *bias;
    const int8_t *w;
    float *xsum;  /* [M, G] */
    int16_t *xq;  /* AVX2 only: [M, K] rows in int16 per group, and [M, G] their scales */
    float *xs;
    bf16 *y;
    float *yf;
    int64_t M, N, K, G, tiles, group_bytes;
    int bits;
} g32_job;

/* 8 bf16 -> 8 fp32 (AVX2: both builds) */
static inline __m256 g32_load8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the 8 lanes of v added in a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs */
static inline float g32_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* items: rows; each row's group sums (a fixed order: the four 8-wide quarters added pairwise, then across the
 * lanes) and, for AVX2, its int16 groups and their scales */
static void g32_rows_prepare(void *arg, int64_t begin, int64_t end) {
    const g32_job *a = (const g32_job *)arg;
    const __m256 sign = _mm256_set1_ps(-0.f), top = _mm256_set1_ps(32767.f), bottom = _mm256_set1_ps(-32767.f);
    for (int64_t r = begin; r < end; r++)
        for (int64_t g = 0; g < a->G; g++) {
            const bf16 *x = a->x + r * a->K + g * G32_K;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = g32_load8(x + 8 * i);
            a->xsum[r * a->G + g] = g32_hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
            if (!a->xq) continue;
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float inv = amax > 0.f ? 32767.f / amax : 0.f;
            a->xs[r * a->G + g] = amax / 32767.f;
            __m256i q[4];
            for (int i = 0; i < 4; i++) {  /* round half to even, as nearbyintf */
                const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, bottom), top));
            }
            /* packs interleaves 128-bit lanes: put them back in k order */
            const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(a->xq + r * a->K + g * G32_K), p01);
            _mm256_storeu_si256((__m256i *)(a->xq + r * a->K + g * G32_K + 16), p23);
        }
}

/* Where a micro-kernel's codes come from (a compile-time constant in each instance) */
enum { G32_FROM_WIDE = 0, G32_FROM_CODES8 = 1, G32_FROM_NIBBLES = 2 };

/* 32 bytes of a group's 4-bit codes (one k pair p) -> the 64 8-bit codes of that pair: lo holds q[p] bytes
 * 0..31 (columns 0..15), hi bytes 32..63 (columns 16..31) */
static inline void g32_nibbles(const int8_t *n, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)n), low4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

#if defined(__AVX512BF16__)
#include "int8_linear_avx512.h"
#else
#include "int8_linear_avx2.h"
#endif

/* items: (block of M_BLOCK rows, 32-column tile), tile-major within a block, as the bf16 linear */
static void g32_linear_chunk(void *arg, int64_t begin, int64_t end) {
    const g32_job *a = (const g32_job *)arg;
    const int64_t K = a->K, G = a->G, gb = a->group_bytes;
    for (int64_t item = begin; item < end; item++) {
        const int64_t mb = item / a->tiles, j = item % a->tiles;
        const int8_t *wt = a->w + j * G * gb;
        const bf16 *bias = a->bias ? a->bias + j * 32 : NULL;
        const int64_t m0 = mb * M_BLOCK, m_end = m0 + M_BLOCK < a->M ? m0 + M_BLOCK : a->M;
#if defined(__AVX512BF16__)
        bf16 *wide = NULL;
#define G32_WIDE_AFTER G32_MR
#else
        int16_t *wide = NULL;
#define G32_WIDE_AFTER 2
#endif
        int src = a->bits == 4 ? G32_FROM_NIBBLES : G32_FROM_CODES8;
        if (m_end - m0 > G32_WIDE_AFTER) {
            wide = g32_scratch(2, (size_t)K * 64);
            g32_widen_tile(wt, G, a->bits, wide);
            src = G32_FROM_WIDE;
        }
#undef G32_WIDE_AFTER
        for (int64_t m = m0; m < m_end; m += G32_MR) {
            const int rows = m_end - m < G32_MR ? (int)(m_end - m) : G32_MR;
            const int64_t at = m * a->N + j * 32;
            bf16 *y = a->y ? a->y + at : NULL;
            float *yf = a->yf ? a->yf + at : NULL;
#if defined(__AVX512BF16__)
            g32_rows(rows, src, a->x + m * K, K, a->xsum + m * G, G, gb, wt, wide, bias, y, yf, a->N);
#else
            g32_rows(rows, src, a->xq + m * K, K, a->xs + m * G, a->xsum + m * G, G, gb, wt, wide, bias, y, yf, a->N);
#endif
        }
    }
}

/* y[m, n] (bf16; or yf, fp32, when given) = x[m, :] . W[n, :] + bias[n] with W packed as drawn above, its
 * codes ``bits`` (8 or 4) wide.  Needs N % 32 == 0 and K % 32 == 0. */
void pd_linear_int8(const bf16 *x, const int8_t *w, const bf16 *bias, bf16 *y, float *yf, int64_t M, int64_t N,
                    int64_t K, int bits, int nthreads) {
    g32_job job = {x, bias, w, NULL, NULL, NULL, y, yf, M, N, K, K / G32_K, N / 32, g32_group_bytes(bits), bits};
    job.xsum = (float *)g32_scratch(0, sizeof(float) * (size_t)(M * job.G));
#if !defined(__AVX512BF16__)
    job.xq = (int16_t *)g32_scratch(1, sizeof(int16_t) * (size_t)(M * K));
    job.xs = (float *)g32_scratch(3, sizeof(float) * (size_t)(M * job.G));
#endif
    if (M * K >= 65536) pool_run(g32_rows_prepare, &job, M, pool_chunk(M, nthreads, 2), nthreads);
    else g32_rows_prepare(&job, 0, M);
    const int64_t items = (M + M_BLOCK - 1) / M_BLOCK * job.tiles;
    pool_run(g32_linear_chunk, &job, items, pool_chunk(items, nthreads, 8), nthreads);
}

#endif
