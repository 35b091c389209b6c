/* Linears over int8 weights (weight_dtype: int8): per-output-channel
 * symmetric int8 weights, and either dynamic per-token int8 activations with
 * exact int32 accumulation (W8A8), or the activations kept in fp32 and the
 * weights widened in registers (weight-only, W8A16).  Included by
 * portable_kernels.h, so both variants' sources carry it; the product runs on
 *
 *     AMX-int8 tiles (TDPBSSD)   amx_bf16 build (-DPD_AMX -mamx-int8), K % 64 == 0: UNTESTED on hardware
 *     AVX-512 VNNI (VPDPBUSD)    cpu_kernels.c (avx512_bf16 and amx_bf16 builds)
 *     AVX2 (VPMADDUBSW + VPMADDWD, |x| against sign(x) w)    cpu_kernels_avx2.c
 *
 * All three sum the same integers exactly, so their results are bit for bit
 * the same and the same as the torch reference (kernels/int8_linear.py),
 * whatever the batch a row came in (exact resume needs that).
 *
 * Packed weight, one 32-column tile after another (kernels/int8_linear.py
 * pack_int8_weight writes it):
 *
 *     tile j:  int8   w[K / 4][32][4]   w[p][c][e] = Wq[32 j + c][4 p + e]    K / 4 x 128 bytes
 *              float  scale[32]         Wq * scale = W (per output column)    128 bytes
 *              int32  wsum[32]          sum_k Wq[32 j + c][k]                  128 bytes
 *
 * A 64-byte row of w is 16 columns x 4 consecutive k: one VPDPBUSD operand,
 * one AMX B-tile row (TDPBSSD's k quads), two AVX2 registers.
 *
 * Activations (W8A8): per row, amax = max |x|, s = amax / 127, q = rne(x *
 * (127 / amax)) (0 when amax is 0); y = bf16(float(sum q Wq) * (s * scale) +
 * bias), the product and the bias added as two roundings (fp-contract off). */
#ifndef PD_INT8_LINEAR_H
#define PD_INT8_LINEAR_H

#define I8_TILE_BYTES(K) (((K) / 4 + 2) * 128)

enum { PD_I8_W8A8 = 0, PD_I8_WEIGHT_ONLY = 1 };
enum { PD_I8_PATH_DOT = 0, PD_I8_PATH_AMX = 1, PD_I8_PATH_WEIGHT_ONLY = 2 };

/* Per-thread scratch kept between calls (a fresh malloc of a prefill's rows is an mmap and page faults on every
 * call): slot 0 the quantized rows, 1 their scales, 2 fp32 rows (weight-only). Pool helpers only read it. */
static void *i8_scratch(int slot, size_t bytes) {
    static __thread void *buf[3];
    static __thread size_t cap[3];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (bytes + bytes / 4 + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, cap[slot]);
    }
    return buf[slot];
}

typedef struct {
    const bf16 *x, *bias;
    const int8_t *wq, *xq;
    const float *xs, *xf;
    int8_t *xq_out;
    float *xs_out, *xf_out;
    bf16 *y;
    float *yf;
    int64_t M, N, K, tiles;
    int flip;  /* 0x80: rows stored as q + 128 (unsigned bytes, VPDPBUSD's x), else as q */
} i8_job;

/* items: rows of x to quantize (W8A8) or widen to fp32 (weight-only, xq_out NULL) */
static void i8_quantize_chunk(void *arg, int64_t begin, int64_t end) {
    const i8_job *a = (const i8_job *)arg;
    const int64_t K = a->K;
    for (int64_t m = begin; m < end; m++) {
        const bf16 *x = a->x + m * K;
        if (!a->xq_out) {
            for (int64_t k = 0; k < K; k++) a->xf_out[m * K + k] = to_f32(x[k]);
            continue;
        }
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) {
            const float v = fabsf(to_f32(x[k]));
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        a->xs_out[m] = amax / 127.f;
        int8_t *q = a->xq_out + m * K;
        for (int64_t k = 0; k < K; k++) {
            float r = nearbyintf(to_f32(x[k]) * inv);  /* round half to even, as torch.round */
            r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
            q[k] = (int8_t)((uint8_t)(int8_t)r ^ (uint8_t)a->flip);
        }
    }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
/* rows x 32 int32 sums (row stride 32) -> y (bf16) or yf (fp32): float(acc) * (row scale * column scale) + bias.
 * row_scale NULL: acc are already fp32 sums (weight-only), times the column scale. */
static void i8_epilogue(int rows, const int32_t *acc, const float *facc, const float *row_scale,
                        const float *col_scale, const bf16 *bias, bf16 *y, float *yf, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < TILE_N; c++) {
            const float s = row_scale ? row_scale[r] * col_scale[c] : col_scale[c];
            float v = (facc ? facc[r * TILE_N + c] : (float)acc[r * TILE_N + c]) * s;
            if (bias) v = v + to_f32(bias[c]);
            if (yf) yf[r * ldy + c] = v;
            else y[r * ldy + c] = to_bf16(v);
        }
}
#pragma GCC pop_options

#if defined(__AVX512VNNI__)
#define I8_MR 8   /* x rows per micro-kernel pass: 8 x 2 accumulators */
#else
#define I8_MR 2   /* 2 x 4 accumulators of the 16 AVX2 registers */
#endif

#if defined(__AVX512VNNI__)
/* MR quantized rows times one tile: VPDPBUSD takes unsigned x, so q + 128 goes in (stored so: job.flip) and
 * 128 * wsum comes out again: sum (q + 128) w - 128 sum w = sum q w, exactly. */
static inline __attribute__((always_inline)) void i8_rows_dot(const int MR, const int8_t *xq, int64_t ldx,
                                                               int64_t K, const int8_t *wt, int32_t *acc_out) {
    __m512i acc[I8_MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t p = 0; p < K / 4; p++) {
        const int8_t *w = wt + p * 128;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        for (int r = 0; r < MR; r++) {
            int32_t quad;
            memcpy(&quad, xq + r * ldx + 4 * p, 4);
            const __m512i xb = _mm512_set1_epi32(quad);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
        }
    }
    const int32_t *wsum = (const int32_t *)(wt + K / 4 * 128 + 128);
    const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7), c1 = _mm512_slli_epi32(_mm512_loadu_si512(wsum + 16), 7);
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_si512(acc_out + r * TILE_N, _mm512_sub_epi32(acc[r][0], c0));
        _mm512_storeu_si512(acc_out + r * TILE_N + 16, _mm512_sub_epi32(acc[r][1], c1));
    }
}

/* Weight-only: MR fp32 rows times one tile, the int8 weights widened in registers (k quad e of each 32-bit lane:
 * shift it to the top byte, arithmetic shift back down), fp32 sums in k order. */
static inline __attribute__((always_inline)) void i8_rows_wo(const int MR, const float *xf, int64_t ldx, int64_t K,
                                                              const int8_t *wt, float *acc_out) {
    __m512 acc[I8_MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 4; p++) {
        const int8_t *w = wt + p * 128;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w0, 24 - 8 * e), 24));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w1, 24 - 8 * e), 24));
            for (int r = 0; r < MR; r++) {
                const __m512 xb = _mm512_set1_ps(xf[r * ldx + 4 * p + e]);
                acc[r][0] = _mm512_fmadd_ps(xb, f0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xb, f1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(acc_out + r * TILE_N, acc[r][0]);
        _mm512_storeu_ps(acc_out + r * TILE_N + 16, acc[r][1]);
    }
}
#else
/* AVX2: VPMADDUBSW multiplies unsigned by signed bytes into saturating int16 pairs; |q| against sign(q) w keeps
 * every pair within 2 x 127 x 127 = 32258 (q and w both in [-127, 127]), so nothing saturates and VPMADDWD
 * widens the pairs to exact int32 sums. */
static inline __attribute__((always_inline)) void i8_rows_dot(const int MR, const int8_t *xq, int64_t ldx,
                                                               int64_t K, const int8_t *wt, int32_t *acc_out) {
    __m256i acc[I8_MR][4];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++) acc[r][g] = _mm256_setzero_si256();
    for (int64_t p = 0; p < K / 4; p++) {
        const int8_t *w = wt + p * 128;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m256i wv[4];
        for (int g = 0; g < 4; g++) wv[g] = _mm256_loadu_si256((const __m256i *)(w + 32 * g));
        for (int r = 0; r < MR; r++) {
            int32_t quad;
            memcpy(&quad, xq + r * ldx + 4 * p, 4);
            const __m256i xb = _mm256_set1_epi32(quad), ax = _mm256_sign_epi8(xb, xb);
            for (int g = 0; g < 4; g++)
                acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[g], xb)), ones));
        }
    }
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++) _mm256_storeu_si256((__m256i *)(acc_out + r * TILE_N + 8 * g), acc[r][g]);
}

static inline __attribute__((always_inline)) void i8_rows_wo(const int MR, const float *xf, int64_t ldx, int64_t K,
                                                              const int8_t *wt, float *acc_out) {
    __m256 acc[I8_MR][4];
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t p = 0; p < K / 4; p++) {
        const int8_t *w = wt + p * 128;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        for (int g = 0; g < 4; g++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * g));
#pragma GCC unroll 4
            for (int e = 0; e < 4; e++) {
                const __m256 f = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(wv, 24 - 8 * e), 24));
                for (int r = 0; r < MR; r++)
                    acc[r][g] = _mm256_fmadd_ps(_mm256_set1_ps(xf[r * ldx + 4 * p + e]), f, acc[r][g]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(acc_out + r * TILE_N + 8 * g, acc[r][g]);
}
#endif

/* Up to I8_MR rows with MR a compile-time constant */
static void i8_rows_dispatch(int rows, int weight_only, const int8_t *xq, const float *xf, int64_t K,
                             const int8_t *wt, int32_t *acc, float *facc) {
    switch (rows) {
#define I8_CASE(n) case n: if (weight_only) i8_rows_wo(n, xf, K, K, wt, facc); else i8_rows_dot(n, xq, K, K, wt, acc); break;
    I8_CASE(1)
#if I8_MR > 2
    I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7)
#endif
    default: if (weight_only) i8_rows_wo(I8_MR, xf, K, K, wt, facc); else i8_rows_dot(I8_MR, xq, K, K, wt, acc);
#undef I8_CASE
    }
}

/* items: (block of M_BLOCK rows, 32-column tile), tile-major within a block, as the bf16 linear */
static void i8_linear_chunk(void *arg, int64_t begin, int64_t end) {
    const i8_job *a = (const i8_job *)arg;
    const int weight_only = a->xq == NULL;
    int32_t acc[I8_MR * TILE_N] __attribute__((aligned(64)));
    float facc[I8_MR * TILE_N] __attribute__((aligned(64)));
    for (int64_t item = begin; item < end; item++) {
        const int64_t mb = item / a->tiles, j = item % a->tiles;
        const int8_t *wt = a->wq + j * I8_TILE_BYTES(a->K);
        const float *col_scale = (const float *)(wt + a->K / 4 * 128);
        const bf16 *bj = a->bias ? a->bias + j * TILE_N : NULL;
        const int64_t m_end = (mb + 1) * M_BLOCK < a->M ? (mb + 1) * M_BLOCK : a->M;
        for (int64_t m = mb * M_BLOCK; m < m_end; m += I8_MR) {
            const int rows = m_end - m < I8_MR ? (int)(m_end - m) : I8_MR;
            i8_rows_dispatch(rows, weight_only, weight_only ? NULL : a->xq + m * a->K,
                             weight_only ? a->xf + m * a->K : NULL, a->K, wt, acc, facc);
            const int64_t at = m * a->N + j * TILE_N;
            i8_epilogue(rows, acc, weight_only ? facc : NULL, weight_only ? NULL : a->xs + m, col_scale, bj,
                        a->y ? a->y + at : NULL, a->yf ? a->yf + at : NULL, a->N);
        }
    }
}

#if defined(PD_AMX) && defined(__AMX_INT8__)
/* W8A8 on AMX-int8 tiles (TDPBSSD: signed x signed bytes, exact int32 sums), the tile geometry of the bf16
 * path (amx_linear.h: C0..C3 = tmm0..3, A0 A1 = tmm4 5, B0 B1 = tmm6 7, every row 64 bytes) with 64 k per
 * A row.  Written to the ISA reference and the bf16 path beside it; NOT yet run on an AMX machine. */
#define I8_AMX_K 64

static void i8_amx_block(const int8_t *xq, int64_t ldx, int64_t K, const int8_t *wt, int32_t *c, int r0, int r1) {
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < K; k0 += I8_AMX_K) {
        const int8_t *b = wt + (k0 / 4) * 128;  /* 16 k quads x 16 columns, rows 128 bytes apart */
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 64, 128);
        _tile_loadd(4, xq + k0, ldx);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (r1) {
            _tile_loadd(5, xq + AMX_ROWS * ldx + k0, ldx);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
    }
    const int64_t stride = TILE_N * (int64_t)sizeof(int32_t);
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    if (r1) {
        _tile_stored(2, c + AMX_ROWS * TILE_N, stride);
        _tile_stored(3, c + AMX_ROWS * TILE_N + 16, stride);
    }
}

static void i8_amx_chunk(void *arg, int64_t begin, int64_t end) {
    const i8_job *a = (const i8_job *)arg;
    int32_t c[2 * AMX_ROWS * TILE_N] __attribute__((aligned(64)));
    int cfg[2] = {-1, -1};
    for (int64_t item = begin; item < end; item++) {
        const int64_t mb = item / a->tiles, j = item % a->tiles;
        const int8_t *wt = a->wq + j * I8_TILE_BYTES(a->K);
        const float *col_scale = (const float *)(wt + a->K / 4 * 128);
        const bf16 *bj = a->bias ? a->bias + j * TILE_N : NULL;
        const int64_t m_end = (mb + 1) * AMX_M_BLOCK < a->M ? (mb + 1) * AMX_M_BLOCK : a->M;
        for (int64_t m = mb * AMX_M_BLOCK; m < m_end; m += 2 * AMX_ROWS) {
            const int64_t left = m_end - m;
            const int r0 = left < AMX_ROWS ? (int)left : AMX_ROWS;
            const int r1 = left - r0 < AMX_ROWS ? (int)(left - r0) : AMX_ROWS;
            if (r0 != cfg[0] || r1 != cfg[1]) amx_configure(cfg[0] = r0, cfg[1] = r1);
            i8_amx_block(a->xq + m * a->K, a->K, a->K, wt, c, r0, r1);
            const int64_t at = m * a->N + j * TILE_N;
            i8_epilogue(r0 + r1, c, NULL, a->xs + m, col_scale, bj, a->y ? a->y + at : NULL,
                        a->yf ? a->yf + at : NULL, a->N);
        }
    }
    _tile_release();
}
#endif

/* Which product pd_linear_int8 runs for M x K -> N in ``mode`` (PD_I8_PATH_*); kernels/int8_linear.py
 * int8_linear_path mirrors it. */
int pd_linear_int8_path(int64_t M, int64_t N, int64_t K, int mode) {
    (void)M;
    (void)N;
    if (mode == PD_I8_WEIGHT_ONLY) return PD_I8_PATH_WEIGHT_ONLY;
#if defined(PD_AMX) && defined(__AMX_INT8__)
    if (K % I8_AMX_K == 0 && pd_amx_ready()) return PD_I8_PATH_AMX;
#endif
    return PD_I8_PATH_DOT;
}

/* y[m, n] (bf16; or yf, fp32, when given) = x[m, :] . W[n, :] + bias[n] with W packed as drawn above.
 * Needs N % 32 == 0 and K % 4 == 0. */
void pd_linear_int8(const bf16 *x, const int8_t *wq, const bf16 *bias, bf16 *y, float *yf, int64_t M, int64_t N,
                    int64_t K, int mode, int nthreads) {
    const int path = pd_linear_int8_path(M, N, K, mode);
    i8_job job = {x, bias, wq, NULL, NULL, NULL, NULL, NULL, NULL, y, yf, M, N, K, N / TILE_N, 0};
#if defined(__AVX512VNNI__)
    job.flip = path == PD_I8_PATH_DOT ? 0x80 : 0;
#endif
    if (path == PD_I8_PATH_WEIGHT_ONLY) {
        job.xf = job.xf_out = (float *)i8_scratch(2, sizeof(float) * (size_t)(M * K));
    } else {
        job.xq = job.xq_out = (int8_t *)i8_scratch(0, (size_t)(M * K));
        job.xs = job.xs_out = (float *)i8_scratch(1, sizeof(float) * (size_t)M);
    }
    if (M * K >= 65536) pool_run(i8_quantize_chunk, &job, M, pool_chunk(M, nthreads, 2), nthreads);
    else i8_quantize_chunk(&job, 0, M);
#if defined(PD_AMX) && defined(__AMX_INT8__)
    if (path == PD_I8_PATH_AMX) {
        const int64_t items = (M + AMX_M_BLOCK - 1) / AMX_M_BLOCK * job.tiles;
        pool_run(i8_amx_chunk, &job, items, pool_chunk(items, nthreads, 8), nthreads);
        return;
    }
#endif
    const int64_t items = (M + M_BLOCK - 1) / M_BLOCK * job.tiles;
    pool_run(i8_linear_chunk, &job, items, pool_chunk(items, nthreads, 8), nthreads);
}

#endif
