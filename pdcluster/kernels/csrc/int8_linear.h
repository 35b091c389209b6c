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
 * over the group (k order), once per row, shared by every column.  The
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

/* items: rows; each row's group sums in k order (and, for AVX2, its int16 groups and their scales) */
static void g32_rows_prepare(void *arg, int64_t begin, int64_t end) {
    const g32_job *a = (const g32_job *)arg;
    for (int64_t r = begin; r < end; r++) {
        const bf16 *x = a->x + r * a->K;
        for (int64_t g = 0; g < a->G; g++) {
            float s = 0.f;
            for (int k = 0; k < G32_K; k++) s += to_f32(x[g * G32_K + k]);
            a->xsum[r * a->G + g] = s;
        }
        for (int64_t g = 0; a->xq && g < a->G; g++) {
            float amax = 0.f;
            for (int k = 0; k < G32_K; k++) {
                const float v = fabsf(to_f32(x[g * G32_K + k]));
                amax = v > amax ? v : amax;
            }
            const float inv = amax > 0.f ? 32767.f / amax : 0.f;
            a->xs[r * a->G + g] = amax / 32767.f;
            for (int k = 0; k < G32_K; k++) {
                float q = nearbyintf(to_f32(x[g * G32_K + k]) * inv);
                q = q > 32767.f ? 32767.f : q < -32767.f ? -32767.f : q;
                a->xq[r * a->K + g * G32_K + k] = (int16_t)q;
            }
        }
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
#define G32_MR 6  /* rows per micro-kernel pass: 6 x 2 group sums + 6 x 2 accumulators */

/* 32 codes (16 columns x 2 k) -> 32 bf16, exactly; signed 8-bit or (from nibbles) unsigned */
static inline __m512bh g32_widen(__m256i c, int is_unsigned) {
    const __m128i c0 = _mm256_castsi256_si128(c), c1 = _mm256_extracti128_si256(c, 1);
    const __m512 lo = _mm512_cvtepi32_ps(is_unsigned ? _mm512_cvtepu8_epi32(c0) : _mm512_cvtepi8_epi32(c0));
    const __m512 hi = _mm512_cvtepi32_ps(is_unsigned ? _mm512_cvtepu8_epi32(c1) : _mm512_cvtepi8_epi32(c1));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* k pair p of a group's codes as two bf16 vectors: w0 columns 0..15, w1 columns 16..31 */
static inline __attribute__((always_inline)) void g32_pair(const int src, const int8_t *grp, const bf16 *wide_g,
                                                           int p, __m512bh *w0, __m512bh *w1) {
    if (src == G32_FROM_WIDE) {
        *w0 = (__m512bh)_mm512_loadu_si512(wide_g + p * 64);
        *w1 = (__m512bh)_mm512_loadu_si512(wide_g + p * 64 + 32);
    } else if (src == G32_FROM_CODES8) {
        *w0 = g32_widen(_mm256_loadu_si256((const __m256i *)(grp + p * 64)), 0);
        *w1 = g32_widen(_mm256_loadu_si256((const __m256i *)(grp + p * 64 + 32)), 0);
    } else {
        __m256i lo, hi;
        g32_nibbles(grp + p * 32, &lo, &hi);
        *w0 = g32_widen(lo, 1);
        *w1 = g32_widen(hi, 1);
    }
}

/* One tile widened: wide[g][p][32 columns x 2] bf16, K * 64 bytes */
static void g32_widen_tile(const int8_t *wt, int64_t G, int bits, bf16 *wide) {
    const int64_t gb = g32_group_bytes(bits);
    for (int64_t g = 0; g < G; g++)
        for (int p = 0; p < 16; p++) {
            __m512bh w0, w1;
            if (bits == 4) g32_pair(G32_FROM_NIBBLES, wt + g * gb, NULL, p, &w0, &w1);
            else g32_pair(G32_FROM_CODES8, wt + g * gb, NULL, p, &w0, &w1);
            _mm512_storeu_si512(wide + g * G32_CODES + p * 64, (__m512i)w0);
            _mm512_storeu_si512(wide + g * G32_CODES + p * 64 + 32, (__m512i)w1);
        }
}

/* MR rows times one tile, the codes from ``src`` */
static inline __attribute__((always_inline)) void g32_tile(
    const int MR, const int src, const bf16 *x, int64_t ldx, const float *xsum, int64_t G, int64_t gb,
    const int8_t *wt, const bf16 *wide, const bf16 *bias, bf16 *y, float *yf, int64_t ldy) {
    __m512 acc[G32_MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *grp = wt + g * gb;
        if (src != G32_FROM_WIDE) {
            _mm_prefetch((const char *)grp + PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)grp + PREFETCH_BYTES + 64 * 5, _MM_HINT_T0);
        }
        __m512 t[G32_MR][2];
        for (int r = 0; r < MR; r++) t[r][0] = t[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            __m512bh w0, w1;
            g32_pair(src, grp, wide ? wide + g * G32_CODES : NULL, p, &w0, &w1);
            for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + g * G32_K + 2 * p, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                t[r][0] = _mm512_dpbf16_ps(t[r][0], w0, xb);
                t[r][1] = _mm512_dpbf16_ps(t[r][1], w1, xb);
            }
        }
        const uint16_t *h = (const uint16_t *)(grp + gb - G32_SCALE_BYTES);
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16)));
        const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 32)));
        const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 48)));
        for (int r = 0; r < MR; r++) {
            const __m512 s = _mm512_set1_ps(xsum[r * G + g]);
            acc[r][0] = _mm512_fmadd_ps(m0, s, _mm512_fmadd_ps(t[r][0], d0, acc[r][0]));
            acc[r][1] = _mm512_fmadd_ps(m1, s, _mm512_fmadd_ps(t[r][1], d1, acc[r][1]));
        }
    }
    const __m512 b0 = bias ? load16(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load16(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; r++)
        store_row32(y, yf, r * ldy, _mm512_add_ps(acc[r][0], b0), _mm512_add_ps(acc[r][1], b1));
}

/* rows (1..G32_MR) of one tile through g32_tile with MR and the source constants */
static void g32_rows(int rows, int src, const bf16 *x, int64_t ldx, const float *xsum, int64_t G, int64_t gb,
                     const int8_t *wt, const bf16 *wide, const bf16 *bias, bf16 *y, float *yf, int64_t ldy) {
#define G32_CASE(n) case n:                                                                                    \
    if (src == G32_FROM_WIDE) g32_tile(n, G32_FROM_WIDE, x, ldx, xsum, G, gb, wt, wide, bias, y, yf, ldy);   \
    else if (src == G32_FROM_CODES8) g32_tile(n, G32_FROM_CODES8, x, ldx, xsum, G, gb, wt, NULL, bias, y, yf, ldy); \
    else g32_tile(n, G32_FROM_NIBBLES, x, ldx, xsum, G, gb, wt, NULL, bias, y, yf, ldy);                      \
    break;
    switch (rows) {
    G32_CASE(1) G32_CASE(2) G32_CASE(3) G32_CASE(4) G32_CASE(5)
    default: G32_CASE(6)
    }
#undef G32_CASE
}
#else
#define G32_MR 3  /* rows per pass over 16 columns: 3 x 2 group sums + 3 x 2 accumulators of 16 registers */

/* 16 codes at c (8 columns x (k0, k1) of one k pair) -> int16 */
static inline __m256i g32_widen8(const int8_t *c) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
}

/* k pair p of a group's codes, the 16-code chunks at offsets o = 2 col0 + 16 q (q < NQ) as int16 */
static inline __attribute__((always_inline)) void g32_pair(const int src, const int NQ, const int8_t *grp,
                                                           const int16_t *wide_g, int p, int col0, __m256i *w) {
    if (src == G32_FROM_NIBBLES) {
        __m256i lo, hi;
        g32_nibbles(grp + p * 32, &lo, &hi);
        for (int q = 0; q < NQ; q++) {
            const int o = (2 * col0 + 16 * q) / 16;  /* 0, 1: lo's halves; 2, 3: hi's */
            const __m256i v = o < 2 ? lo : hi;
            w[q] = _mm256_cvtepu8_epi16(o & 1 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
        }
        return;
    }
    for (int q = 0; q < NQ; q++) {
        const int at = p * 64 + 2 * col0 + 16 * q;
        w[q] = src == G32_FROM_WIDE ? _mm256_loadu_si256((const __m256i *)(wide_g + at)) : g32_widen8(grp + at);
    }
}

/* One tile widened: wide[g][p][32 columns x 2] int16 (the 8-bit codes' order), K * 64 bytes */
static void g32_widen_tile(const int8_t *wt, int64_t G, int bits, int16_t *wide) {
    const int64_t gb = g32_group_bytes(bits);
    for (int64_t g = 0; g < G; g++)
        for (int p = 0; p < 16; p++) {
            __m256i w[4];
            if (bits == 4) g32_pair(G32_FROM_NIBBLES, 4, wt + g * gb, NULL, p, 0, w);
            else g32_pair(G32_FROM_CODES8, 4, wt + g * gb, NULL, p, 0, w);
            for (int q = 0; q < 4; q++) _mm256_storeu_si256((__m256i *)(wide + g * G32_CODES + p * 64 + 16 * q), w[q]);
        }
}

/* MR rows (int16 xq, their group scales xs and sums xsum) times NQ x 8 columns from col0 of one tile */
static inline __attribute__((always_inline)) void g32_half(
    const int MR, const int NQ, const int src, const int16_t *xq, int64_t ldx, const float *xs, const float *xsum,
    int64_t G, int64_t gb, const int8_t *wt, const int16_t *wide, int col0, const bf16 *bias, bf16 *y, float *yf,
    int64_t ldy) {
    __m256 acc[G32_MR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NQ; q++) acc[r][q] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *grp = wt + g * gb;
        if (src != G32_FROM_WIDE) _mm_prefetch((const char *)grp + PREFETCH_BYTES, _MM_HINT_T0),
                                  _mm_prefetch((const char *)grp + PREFETCH_BYTES + 64 * 5, _MM_HINT_T0);
        __m256i t[G32_MR][4];
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < NQ; q++) t[r][q] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            if (src != G32_FROM_WIDE && (p & 3) == 0)
                _mm_prefetch((const char *)grp + PREFETCH_BYTES + 64 * (p / 4 + 1), _MM_HINT_T0);
            __m256i w[4];
            g32_pair(src, NQ, grp, wide ? wide + g * G32_CODES : NULL, p, col0, w);
            for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * ldx + g * G32_K + 2 * p, 4);
                const __m256i xb = _mm256_set1_epi32(pair);
                for (int q = 0; q < NQ; q++) t[r][q] = _mm256_add_epi32(t[r][q], _mm256_madd_epi16(w[q], xb));
            }
        }
        const uint16_t *h = (const uint16_t *)(grp + gb - G32_SCALE_BYTES) + col0;
        for (int b = 0; b < NQ; b++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8 * b)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 32 + 8 * b)));
            for (int r = 0; r < MR; r++) {
                const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(t[r][b]), _mm256_set1_ps(xs[r * G + g]));
                acc[r][b] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * G + g]), _mm256_fmadd_ps(dot, d, acc[r][b]));
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NQ; b++) {
            const int64_t col = col0 + 8 * b;
            const __m256 v = bias ? _mm256_add_ps(acc[r][b], load8(bias + col)) : acc[r][b];
            if (yf) _mm256_storeu_ps(yf + r * ldy + col, v);
            else store8(y + r * ldy + col, v);
        }
}

/* rows (1..G32_MR) of one tile: one row from its codes takes the whole tile in one pass; otherwise 16 columns
 * at a time */
static void g32_rows(int rows, int src, const int16_t *xq, int64_t ldx, const float *xs, const float *xsum,
                     int64_t G, int64_t gb, const int8_t *wt, const int16_t *wide, const bf16 *bias, bf16 *y,
                     float *yf, int64_t ldy) {
    if (rows == 1 && src == G32_FROM_CODES8) {
        g32_half(1, 4, G32_FROM_CODES8, xq, ldx, xs, xsum, G, gb, wt, NULL, 0, bias, y, yf, ldy);
        return;
    }
    if (rows == 1 && src == G32_FROM_NIBBLES) {
        g32_half(1, 4, G32_FROM_NIBBLES, xq, ldx, xs, xsum, G, gb, wt, NULL, 0, bias, y, yf, ldy);
        return;
    }
    for (int col0 = 0; col0 < 32; col0 += 16) {
#define G32_HALF(n)                                                                                                  \
        if (src == G32_FROM_WIDE) g32_half(n, 2, G32_FROM_WIDE, xq, ldx, xs, xsum, G, gb, wt, wide, col0, bias, y, yf, ldy); \
        else if (src == G32_FROM_CODES8) g32_half(n, 2, G32_FROM_CODES8, xq, ldx, xs, xsum, G, gb, wt, NULL, col0, bias, y, yf, ldy); \
        else g32_half(n, 2, G32_FROM_NIBBLES, xq, ldx, xs, xsum, G, gb, wt, NULL, col0, bias, y, yf, ldy);
        if (rows == 1) { G32_HALF(1) }
        else if (rows == 2) { G32_HALF(2) }
        else { G32_HALF(3) }
#undef G32_HALF
    }
}
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
