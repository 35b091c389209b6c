/* The greedy choice without reading the whole bf16 LM head: an int8 screen
 * with a proven error bound, then the exact bf16 logits of the few columns
 * the screen could not rule out (pd_greedy_head_pick, below: through the
 * packed bf16 kernel the full head runs, so the chosen token is the full
 * head's argmax, ties included).
 *
 * The screen's weights: per 16-column block and group g of 32 k, codes
 * q = round(W / d) in -127..127 stored as u8 (q + 128), d fp16 per (column,
 * group), and two bf16 figures per (column, group) measured when the head
 * is packed: E = max_k |W - d q| and L = d * sum_k |q| (both rounded up).
 * The activations: per (row, group) s = max |x| / 127 and xq = round(x / s),
 * so |x - s xq| <= s / 2.  VPDPBUSD takes u8 x s8, so sum (q + 128) xq is
 * corrected by 128 * sum xq per group.
 *
 *     a[r, n] = sum_g d[n, g] s[r, g] sum_k q[n, k] xq[r, k]
 *     |W x - a| <= sum_g E[n, g] |x_g|_1 + L[n, g] s[r, g] / 2     (+ fp32 rounding, below)
 *
 * Each row has its own bound (a row with a large activation does not widen
 * another's).  The fp32 rounding of the exact kernel (a sum of K products in
 * fp32: under (K - 1) 2^-24 of sum_k |W x|) and of a (under 2^-20 of it) is
 * under (K + 64) 2^-23 of sum_k |W x|, itself under sum_g (L + 32 E) 127 s:
 * the coefficients below fold that in, with 0.1% to spare and 1e-30 for the
 * denormals the bf16 dot products flush.  A column n is ruled out for row r
 * when bf16(a + B) < bf16(t_r), t_r = max_m (a[r, m] - B[r, m]): bf16
 * rounding is monotone, so its exact logit rounds strictly below the logit
 * of the column that reached t_r. */
#ifndef PD_GREEDY_HEAD_H
#define PD_GREEDY_HEAD_H

#define GH_COLS 16                    /* columns of a block: one zmm of int32 sums */
#define GH_K 32                       /* k per group */
#define GH_CODES (GH_COLS * GH_K)     /* 512 bytes: [8 quads][16 columns][4 k] */
#define GH_GROUP_BYTES (GH_CODES + 3 * GH_COLS * 2)  /* codes, d fp16, L bf16, E bf16 */
#define GH_MAX_ROWS 64
#ifndef GH_PREFETCH
#define GH_PREFETCH 8192              /* bytes ahead of the block being read */
#endif
#define GH_MAX_K 8192

typedef struct {
    const uint8_t *packed;
    int64_t M, G, V;
    const int8_t *xq;         /* [M][K] */
    const float *s;           /* [M][G] */
    const int32_t *corr;      /* [M][G]: 128 * sum of the group's xq */
    const float *c_e, *c_l;   /* [M][G]: the bound's coefficients of E and L, per row and group */
    float *hi;                /* [M][V]: a + bound, each logit's upper bound */
    float *low;               /* [M][V / 16]: each block's max of a - bound, per row */
    uint8_t *marks;           /* [M][V / 32] */
} gh_job;

static inline __m512 gh_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i gh_quad(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, 4);
    return _mm512_set1_epi32(quad);
}

/* ROWS rows (a constant, 1 to 4) of x against one 16-column block, every group: their logits' upper
 * bounds into hi and each row's best lower bound of the block into low.  The rows' sums and bounds stay
 * in registers across the groups; the block's codes (10 KB) come from L1 after the first rows. */
__attribute__((target("avx512vnni"), always_inline))
static inline void gh_rows(const int ROWS, const gh_job *j, int64_t nb, int64_t r0) {
    const int64_t K = j->G * GH_K, blocks = j->V / GH_COLS;
    const uint8_t *blk = j->packed + nb * j->G * GH_GROUP_BYTES;
    __m512 f[4], bnd[4];
    for (int i = 0; i < ROWS; i++) f[i] = bnd[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < j->G; g++) {
        const uint8_t *grp = blk + g * GH_GROUP_BYTES;
        __m512i acc[4];
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_set1_epi32(-j->corr[(r0 + i) * j->G + g]);
        for (int q = 0; q < 8; q++) {
            const __m512i w = _mm512_loadu_si512(grp + 64 * q);
            for (int i = 0; i < ROWS; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], w, gh_quad(j->xq + (r0 + i) * K + g * GH_K + 4 * q));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + GH_CODES)));
        const __m512 L = gh_load_bf16((const uint16_t *)(grp + GH_CODES + 32));
        const __m512 E = gh_load_bf16((const uint16_t *)(grp + GH_CODES + 64));
        for (int i = 0; i < ROWS; i++) {
            const int64_t rg = (r0 + i) * j->G + g;
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(d, _mm512_set1_ps(j->s[rg])), f[i]);
            bnd[i] = _mm512_fmadd_ps(E, _mm512_set1_ps(j->c_e[rg]), _mm512_fmadd_ps(L, _mm512_set1_ps(j->c_l[rg]), bnd[i]));
        }
    }
    for (int i = 0; i < ROWS; i++) {
        const __m512 b = _mm512_fmadd_ps(bnd[i], _mm512_set1_ps(1.001f), _mm512_set1_ps(1e-30f));
        _mm512_storeu_ps(j->hi + (r0 + i) * j->V + nb * GH_COLS, _mm512_add_ps(f[i], b));
        j->low[(r0 + i) * blocks + nb] = _mm512_reduce_max_ps(_mm512_sub_ps(f[i], b));
    }
}

__attribute__((target("avx512vnni")))
static void gh_screen_chunk(void *arg, int64_t begin, int64_t end) {
    const gh_job *j = (const gh_job *)arg;
    for (int64_t nb = begin; nb < end; nb++) {
        const uint8_t *blk = j->packed + nb * j->G * GH_GROUP_BYTES;
        for (int64_t c = 0; c < j->G * GH_GROUP_BYTES; c += 64) _mm_prefetch((const char *)blk + GH_PREFETCH + c, _MM_HINT_T0);
        int64_t r = 0;
        for (; r + 4 <= j->M; r += 4) gh_rows(4, j, nb, r);
        switch (j->M - r) {
        case 3: gh_rows(3, j, nb, r); break;
        case 2: gh_rows(2, j, nb, r); break;
        case 1: gh_rows(1, j, nb, r); break;
        default: break;
        }
    }
}

/* 16 fp32 -> their bf16 roundings as fp32: the instruction the kernels store logits with (nearest even,
 * denormals flushed), so the comparison below sees what the full head would hold; monotone */
__attribute__((target("avx512bf16,avx512vl")))
static inline __m512 gh_bf16_round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* per row: t = its best lower bound; marks the tiles holding a column whose upper bound rounds to >= t's */
__attribute__((target("avx512bf16,avx512vl")))
static void gh_mark_chunk(void *arg, int64_t begin, int64_t end) {
    const gh_job *j = (const gh_job *)arg;
    const int64_t blocks = j->V / GH_COLS;
    for (int64_t r = begin; r < end; r++) {
        float t = -INFINITY;
        for (int64_t nb = 0; nb < blocks; nb++) t = j->low[r * blocks + nb] > t ? j->low[r * blocks + nb] : t;
        const __m512 floor_ = gh_bf16_round16(_mm512_set1_ps(t));
        uint8_t *marks = j->marks + r * (j->V / 32);
        const float *hr = j->hi + r * j->V;
        for (int64_t n = 0; n < j->V; n += 32) {
            const __m512 hi0 = _mm512_loadu_ps(hr + n), hi1 = _mm512_loadu_ps(hr + n + 16);
            /* NLT_UQ: true for >= and for NaN, so a NaN marks its tile and the exact logits say it */
            const __mmask16 m0 = _mm512_cmp_ps_mask(gh_bf16_round16(hi0), floor_, _CMP_NLT_UQ);
            const __mmask16 m1 = _mm512_cmp_ps_mask(gh_bf16_round16(hi1), floor_, _CMP_NLT_UQ);
            marks[n / 32] = (m0 | m1) != 0 || isnan(t);
        }
    }
}

/* x [M, K] bf16 (M <= GH_MAX_ROWS, K = 32 G <= GH_MAX_K), the screen's packed head [V / 16][G][GH_GROUP_BYTES]:
 * writes to tiles[] the ascending indices of the 32-column tiles holding a column that may be some row's
 * argmax and returns how many; -1 when x holds a value that is not finite (or the shapes are outside the
 * limits), so the caller runs the full head.  scratch: at least M * V * 4 + M * V / 16 * 4 + M * V / 32 bytes,
 * 64-byte aligned. */
__attribute__((target("avx512vnni")))
int64_t pd_greedy_head_screen(const bf16 *x, int64_t M, int64_t K, const uint8_t *packed, int64_t V, void *scratch,
                              int32_t *tiles, int nthreads) {
    if (M < 1 || M > GH_MAX_ROWS || K % GH_K || K > GH_MAX_K || V % 32) return -1;
    const int64_t G = K / GH_K;
    int8_t *xqp = (int8_t *)malloc((size_t)(M * K));
    float *s = (float *)malloc(sizeof(float) * (size_t)(3 * M * G));
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * G));
    int64_t result = 0;
    if (!xqp || !s || !corr) result = -1;
    const float rel = (float)(K + 64) * 1.1920929e-7f;  /* (K + 64) 2^-23: both sides' fp32 rounding */
    float *c_e = s ? s + M * G : NULL, *c_l = c_e ? c_e + M * G : NULL;
    for (int64_t r = 0; r < M && result == 0; r++) {
        for (int64_t g = 0; g < G; g++) {
            const bf16 *xg = x + r * K + g * GH_K;
            float v[GH_K], amax = 0.f, l1 = 0.f;
            for (int k = 0; k < GH_K; k++) {
                v[k] = to_f32(xg[k]);
                if (!isfinite(v[k])) result = -1;
                amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
                l1 += fabsf(v[k]);
            }
            const float scale = amax / 127.f;
            int32_t sum = 0;
            for (int k = 0; k < GH_K; k++) {
                float t = scale > 0.f ? nearbyintf(v[k] / scale) : 0.f;
                t = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
                xqp[r * K + g * GH_K + k] = (int8_t)t;
                sum += (int32_t)t;
            }
            s[r * G + g] = scale;
            corr[r * G + g] = 128 * sum;
            /* |x - s xq| <= s / 2 (0.1% for the rounding of x / s); the fp32 slack: rel * 127 s (L + 32 E) */
            c_e[r * G + g] = l1 * 1.001f + scale * (rel * 127.f * 32.f);
            c_l[r * G + g] = scale * (0.5005f + rel * 127.f);
        }
    }
    if (result == 0) {
        float *hi = (float *)scratch, *low = hi + M * V;
        uint8_t *marks = (uint8_t *)(low + M * (V / GH_COLS));
        gh_job job = {packed, M, G, V, xqp, s, corr, c_e, c_l, hi, low, marks};
        const int64_t blocks = V / GH_COLS;
        pool_run(gh_screen_chunk, &job, blocks, pool_chunk(blocks, nthreads, 8), nthreads);
        pool_run(gh_mark_chunk, &job, M, 1, nthreads);
        for (int64_t i = 0; i < V / 32; i++) {
            uint8_t any = 0;
            for (int64_t r = 0; r < M; r++) any |= marks[r * (V / 32) + i];
            if (any) tiles[result++] = (int32_t)i;
        }
    }
    free(xqp), free(s), free(corr);
    return result;
}

/* The exact part: each candidate tile (ascending) through pd_linear_packed_bf16, the kernel the full head
 * runs, with the same rows (so the same path and the same bits per logit), into y [M][32] (caller's
 * scratch); out[r] = the first column of row r's largest logit, as torch.argmax breaks ties.  Returns 0,
 * or -1 when a logit is not finite (the caller runs the full head, whose sampler reports it). */
int64_t pd_greedy_head_pick(const bf16 *x, int64_t M, int64_t K, const bf16 *wp, const int32_t *tiles,
                            int64_t ntiles, bf16 *y, int64_t *out, int nthreads) {
    float best[GH_MAX_ROWS];
    if (M < 1 || M > GH_MAX_ROWS || ntiles < 1) return -1;
    for (int64_t r = 0; r < M; r++) best[r] = -INFINITY, out[r] = -1;
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t tile = tiles[t];
        pd_linear_packed_bf16(x, wp + tile * K * TILE_N, NULL, y, M, TILE_N, K, nthreads);
        for (int64_t r = 0; r < M; r++)
            for (int c = 0; c < TILE_N; c++) {
                const float v = to_f32(y[r * TILE_N + c]);
                if (!isfinite(v)) return -1;
                if (v > best[r] || out[r] < 0) best[r] = v, out[r] = tile * TILE_N + c;
            }
    }
    return 0;
}

#endif
