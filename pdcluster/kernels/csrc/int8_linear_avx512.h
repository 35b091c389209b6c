/* int8_linear.h's micro-kernels on AVX-512 BF16 (cpu_kernels.c): the codes widened to bf16, VDPBF16PS on the
 * bf16 x pairs.  Included by int8_linear.h only. */
#ifndef PD_INT8_LINEAR_AVX512_H
#define PD_INT8_LINEAR_AVX512_H

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
#endif
