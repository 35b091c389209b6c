/* int8_linear.h's micro-kernels on AVX2 (cpu_kernels_avx2.c): x in int16 per (row, group of 32), the codes
 * widened to int16, exact VPMADDWD group sums.  Included by int8_linear.h only. */
#ifndef PD_INT8_LINEAR_AVX2_H
#define PD_INT8_LINEAR_AVX2_H

#define G32_MR 5  /* rows per pass over 16 columns: 5 x 2 group sums in registers, the accumulators in L1 */

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
    float acc[G32_MR][32] __attribute__((aligned(32)));  /* fp32 through memory: exact, and registers for t */
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NQ; q++) _mm256_store_ps(acc[r] + 8 * q, _mm256_setzero_ps());
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
                _mm256_store_ps(acc[r] + 8 * b, _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * G + g]),
                                                                 _mm256_fmadd_ps(dot, d, _mm256_load_ps(acc[r] + 8 * b))));
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NQ; b++) {
            const int64_t col = col0 + 8 * b;
            const __m256 a = _mm256_load_ps(acc[r] + 8 * b), v = bias ? _mm256_add_ps(a, load8(bias + col)) : a;
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
        switch (rows) {
        case 1: G32_HALF(1) break;
        case 2: G32_HALF(2) break;
        case 3: G32_HALF(3) break;
        case 4: G32_HALF(4) break;
        default: G32_HALF(5)
        }
#undef G32_HALF
    }
}
#endif
