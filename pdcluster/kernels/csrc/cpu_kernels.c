/* CPU kernels for the engine's bf16 hot paths (AVX-512 BF16, threads from work_pool.h).
 *
 * Built on first use by kernels/cpu_native.py with the system C compiler and
 * called through ctypes; every function has a torch reference in kernels/
 * that the tests compare it against.  All tensors are bf16 stored as
 * uint16_t, accumulation is fp32, and rounding back to bf16 is
 * round-to-nearest-even, as torch does.
 *
 * KV pool layout (block-major, see pdcluster/services/engine/kv_cache.py):
 *     kv[num_blocks, num_layers, 2 (K|V), block_size, kv_heads, head_dim]
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "work_pool.h"

#include "bf16_scalar.h"
#include "prefetch_rows.h"

#define PREFETCH_BYTES 4096 /* how far ahead of the current weight rows to prefetch */


/* 16 bf16 -> 16 fp32 */
static inline __m512 load16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512bh load32bh(const bf16 *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __m512bh load32bh_masked(const bf16 *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* Linear layers use weights packed once at load time so that one 64-byte
 * load holds 16 output columns x 2 consecutive k, the pair layout of
 * VDPBF16PS:
 *
 *     W[N, K]  ->  wp[N / 32][K / 2][32][2],  wp[j][p][c][e] = W[32 j + c][2 p + e]
 *
 * A tile of 32 output columns is one contiguous stream of K / 2 * 128 bytes;
 * each x row contributes a broadcast k-pair per step, so no horizontal sums
 * are needed and the weights are read once per block of x rows. */
#define TILE_N 32
#define MR_MAX 8      /* x rows per micro-kernel: 8 x 2 accumulators */
#define M_BLOCK 256   /* x rows sharing one pass over the weights */

/* MR rows of x (row stride ldx, K columns) times one packed 32-column tile:
 * y rows (stride ldy) in bf16, or in fp32 when yf is given. */

/* One 32-column output row (two 16-lane halves) at y + at (bf16) or yf + at (fp32). */
static inline void store_row32(bf16 *y, float *yf, int64_t at, __m512 lo, __m512 hi) {
    if (yf) {
        _mm512_storeu_ps(yf + at, lo);
        _mm512_storeu_ps(yf + at + 16, hi);
    } else {
        _mm256_storeu_si256((__m256i *)(y + at), (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_storeu_si256((__m256i *)(y + at + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    }
}

static inline __attribute__((always_inline)) void linear_tile(
    const int MR, const bf16 *x, int64_t ldx, int64_t K, const bf16 *wt, const bf16 *bias,
    bf16 *y, float *yf, int64_t ldy, int prefetch, const bf16 *next) {
    __m512 acc[MR_MAX][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t kp = K / 2;
    for (int64_t p = 0; p < kp; p++) {
        const bf16 *w = wt + p * 2 * TILE_N;
        if (prefetch) _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0),
                      _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        if (next) _mm_prefetch((const char *)(next + p * 2 * TILE_N), _MM_HINT_T1);
        const __m512bh w0 = load32bh(w), w1 = load32bh(w + 32);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
        }
    }
    /* wp's column c of the tile sits in lane c % 16 of acc[.][c / 16] */
    const __m512 b0 = bias ? load16(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load16(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
        store_row32(y, yf, r * ldy, _mm512_add_ps(acc[r][0], b0), _mm512_add_ps(acc[r][1], b1));
}

/* Up to MR_MAX rows (rows >= 1) through linear_tile with MR a constant. */
static void rows_times_tile(int rows, const bf16 *x, int64_t ldx, int64_t K, const bf16 *wt, const bf16 *bias,
                            bf16 *y, float *yf, int64_t ldy, int prefetch, const bf16 *next) {
    switch (rows < MR_MAX ? rows : MR_MAX) {
    case 1: linear_tile(1, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 2: linear_tile(2, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 3: linear_tile(3, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 4: linear_tile(4, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 5: linear_tile(5, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 6: linear_tile(6, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    case 7: linear_tile(7, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    default: linear_tile(8, x, ldx, K, wt, bias, y, yf, ldy, prefetch, next); break;
    }
}

typedef struct {
    const bf16 *x, *wp, *bias;
    bf16 *y;
    int64_t M, N, K, tiles;
} linear_job;

/* items: (block of M_BLOCK rows, 32-column tile), tile-major within a block */
static void linear_chunk(void *arg, int64_t begin, int64_t end) {
    const linear_job *a = (const linear_job *)arg;
    const int64_t tile_elems = (a->K / 2) * 2 * TILE_N;
    for (int64_t item = begin; item < end; item++) {
        const int64_t mb = item / a->tiles, j = item % a->tiles;
        const bf16 *wt = a->wp + j * tile_elems;
        const bf16 *bj = a->bias ? a->bias + j * TILE_N : NULL;
        const int64_t m_end = (mb + 1) * M_BLOCK < a->M ? (mb + 1) * M_BLOCK : a->M;
        /* With more than one pass of MR_MAX rows over this tile, its passes pull this worker's
         * next tile into L2, each k-pair's first line on the first pass and its second on the
         * second, so the next tile's first pass reads L2 instead of waiting on memory for a
         * whole tile while the passes after it wait on nothing (2-vCPU AMD EPYC avx512_bf16 class,
         * 2 threads, alternating in one process: the 120 decoder projections at 16 rows 0.963x,
         * 32 rows 0.980x, 256 and 1,024 rows 1.007x and 0.995x; a 16-stream decode step 0.963x and
         * 0.983x in two runs, 8 streams 0.991x). */
        const bf16 *next = item + 1 < end && m_end - mb * M_BLOCK > MR_MAX
                               ? a->wp + ((item + 1) % a->tiles) * tile_elems : NULL;
        for (int64_t m = mb * M_BLOCK, pass = 0; m < m_end; m += MR_MAX, pass++)
            rows_times_tile((int)(m_end - m), a->x + m * a->K, a->K, a->K, wt, bj, a->y + m * a->N + j * TILE_N,
                            NULL, a->N, m == mb * M_BLOCK, next && pass < 2 ? next + pass * TILE_N : NULL);
    }
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with W packed as above;
 * bf16 in and out, fp32 accumulation.  Needs N % 32 == 0 and K even. */
#ifdef PD_AMX
#include "amx_linear.h"
#endif

void pd_linear_packed_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y,
                           int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_job job = {x, wp, bias, y, M, N, K, N / TILE_N};
    const int64_t items = (M + M_BLOCK - 1) / M_BLOCK * job.tiles;
#ifdef PD_AMX
    if (pd_linear_uses_amx(M, N, K)) {
        amx_linear(&job, nthreads);
        return;
    }
#endif
    pool_run(linear_chunk, &job, items, pool_chunk(items, nthreads, 8), nthreads);
}

/* exp(x) for the softmax's x <= 0: 2^n * e^r with |r| <= ln2/2 and e^r by its Taylor polynomial
 * of `degree` (a constant, so the loop unrolls): 6 gives a relative error ~1e-7; 4 under 5e-5,
 * enough where the result is rounded to bf16 (2e-3). */
static inline __m512 exp512_taylor(__m512 x, const int degree) {
    static const float inv_factorial[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
    __m512 p = _mm512_set1_ps(inv_factorial[degree]);
    for (int k = degree - 1; k >= 0; k--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_factorial[k]));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 exp512(__m512 x) { return exp512_taylor(x, 6); }
static inline __m512 exp512_bf16(__m512 x) { return exp512_taylor(x, 4); }  /* rounded to bf16 after */

/* s[0:n] <- softmax(s[0:n]) */
static void softmax_inplace(float *s, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    float mx = _mm512_reduce_max_ps(mv);
    for (int64_t j = i; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sv = _mm512_setzero_ps();
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m));
        _mm512_mask_storeu_ps(s + i, k, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
    }
}

/* Paged decode attention: one query token per sequence.  A work item is one
 * sequence and a range of its kv heads (all of them once there are enough
 * sequences to keep every thread busy, so each block's rows stream whole).
 * Two passes over the sequence's blocks: fp32 scores (bf16 dot products),
 * softmax, then the probability-weighted sum of V in fp32.  decode_chunk is
 * the general path; decode_chunk_fast below serves head_dim 64 and 128. */
typedef struct {
    const bf16 *q, *kv;
    bf16 *out;
    const int32_t *block_tables, *context_lens;
    int64_t q_row_stride, H, KVH, D, max_blocks, block_size, G, per_item, splits, tok_stride, half, block_stride,
        layer_off;
    float scale;
} decode_job;

static void decode_chunk(void *arg, int64_t begin, int64_t end) {
    const decode_job *a = (const decode_job *)arg;
    const int64_t G = a->G, D = a->D, per_item = a->per_item, HG = per_item * G, block_size = a->block_size;
    const int64_t tok_stride = a->tok_stride, half = a->half, block_stride = a->block_stride;
    const bf16 *kv = a->kv;
    for (int64_t item = begin; item < end; item++) {
        const int64_t b = item / a->splits, h0 = item % a->splits * per_item;
        const int64_t ctx = a->context_lens[b];
        const int32_t *table = a->block_tables + b * a->max_blocks;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(HG * ctx + HG * D + D));
        float *acc = scores + HG * ctx;
        float *vf = acc + HG * D;
        const bf16 *qh = a->q + b * a->q_row_stride + h0 * G * D;
        const int64_t col0 = a->layer_off + h0 * D, cols = per_item * D;
        for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
            const bf16 *kb = kv + (int64_t)table[blk] * block_stride + col0;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx)
                prefetch_rows(kv + (int64_t)table[blk + 1] * block_stride + col0, block_size, tok_stride, cols);
            for (int64_t o = 0; o < n; o++)
                for (int64_t hg = 0; hg < HG; hg++) {
                    const bf16 *k = kb + o * tok_stride + hg / G * D;
                    __m512 acc_k = _mm512_setzero_ps();
                    for (int64_t d = 0; d < D; d += 32)
                        acc_k = _mm512_dpbf16_ps(acc_k, load32bh(qh + hg * D + d), load32bh(k + d));
                    scores[hg * ctx + t0 + o] = _mm512_reduce_add_ps(acc_k) * a->scale;
                }
        }
        for (int64_t hg = 0; hg < HG; hg++) softmax_inplace(scores + hg * ctx, ctx);
        memset(acc, 0, sizeof(float) * (size_t)(HG * D));
        for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
            const bf16 *vb = kv + (int64_t)table[blk] * block_stride + half + col0;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx)
                prefetch_rows(kv + (int64_t)table[blk + 1] * block_stride + half + col0, block_size, tok_stride, cols);
            for (int64_t o = 0; o < n; o++)
                for (int64_t hh = 0; hh < per_item; hh++) {
                    const bf16 *v = vb + o * tok_stride + hh * D;
                    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vf + d, load16(v + d));
                    for (int64_t hg = hh * G; hg < (hh + 1) * G; hg++) {
                        const __m512 p = _mm512_set1_ps(scores[hg * ctx + t0 + o]);
                        float *ag = acc + hg * D;
                        for (int64_t d = 0; d < D; d += 16)
                            _mm512_storeu_ps(ag + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(vf + d), _mm512_loadu_ps(ag + d)));
                    }
                }
        }
        bf16 *o = a->out + (b * a->H + h0 * G) * D;
        for (int64_t i = 0; i < HG * D; i++) o[i] = to_bf16(acc[i]);
        free(scores);
    }
}

/* Sixteen vectors to one: lane t holds the sum of v[t]'s 16 lanes (a
 * transpose-add tree: 15 adds and 30 shuffles for 16 dot products, where
 * reducing each vector alone takes 16 x 4 shuffle-add pairs). */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 s2[8], s4[4];
    for (int i = 0; i < 8; i++)
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
        s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A pass over a sequence's blocks (its K rows, then its V rows) prefetches
 * the next block's rows into L1 and the one after into L2, row by row as this
 * block's are read, and the first two before it starts.  Every row's loads
 * wait on DRAM: one layer's slab of a block is 6 KiB (the default model) and
 * the next sits a block (368 KiB) away, too short a run for the hardware
 * prefetchers, and L1 alone keeps too few lines in flight.  2-vCPU AMD EPYC
 * (avx512_bf16), 2 threads, 30 layers' calls over blocks scattered in a
 * 750 MB pool: 16 sequences x 320 tokens 7.7 -> 5.6 ms, x 1,024 tokens
 * 23.3 -> 16.2 ms, 1 x 2,048 3.7 -> 2.7 ms (the same reads from cache: 3.3 ms
 * at 320); two blocks ahead into L1 instead was slower (9.1 ms at 320), and
 * without the next block's prefetch 2.1x slower. */
static inline const bf16 *block_slab(const decode_job *a, const int32_t *table, int64_t blk, int64_t nblocks,
                                     int64_t col) {
    return blk < nblocks ? a->kv + (int64_t)table[blk] * a->block_stride + col : NULL;
}

static inline void prefetch_pass_start(const decode_job *a, const int32_t *table, int64_t nblocks, int64_t col,
                                       int64_t cols) {
    const bf16 *first = block_slab(a, table, 0, nblocks, col), *second = block_slab(a, table, 1, nblocks, col);
    if (first) prefetch_rows(first, a->block_size, a->tok_stride, cols);
    if (second) prefetch_rows_l2(second, a->block_size, a->tok_stride, cols);
}

/* The decode fast path for head_dim D = 64 or 128.  A kv head's G query
 * heads go in GS sub-groups of GC <= 4 (GC and D compile-time constants, so
 * the accumulators live in registers): per block of 16 tokens and kv head,
 * the scores of 16 tokens come out of one hsum16, and each 64-wide slice of
 * a sub-group's fp32 output rows is loaded once and stored once per block. */
static inline __attribute__((always_inline)) void decode_item_fast(
    const decode_job *a, const bf16 *qh, const int32_t *table, int64_t ctx, float *scores, float *acc, int64_t h0,
    const int GC, const int D) {
    const int64_t G = a->G, GS = G / GC, per_item = a->per_item, tok_stride = a->tok_stride, block_size = a->block_size;
    const int64_t col0 = a->layer_off + h0 * D;
    const int64_t nblocks = (ctx + block_size - 1) / block_size, cols = per_item * D;
    prefetch_pass_start(a, table, nblocks, col0, cols);
    for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
        const bf16 *kb = block_slab(a, table, blk, nblocks, col0);
        const bf16 *kn = block_slab(a, table, blk + 1, nblocks, col0), *kf = block_slab(a, table, blk + 2, nblocks, col0);
        for (int64_t s0 = 0; s0 < block_size && t0 + s0 < ctx; s0 += 16) {
            const int64_t n = ctx - t0 - s0 < 16 ? ctx - t0 - s0 : 16;
            for (int64_t hh = 0; hh < per_item; hh++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t hg = hh * G + g;
                    __m512bh qv[4];
                    for (int d = 0; d < D / 32; d++) qv[d] = load32bh(qh + hg * D + 32 * d);
                    __m512 v[16];
                    for (int o = 0; o < 16; o++) {
                        const int64_t row = (s0 + o) * tok_stride + hh * D;
                        if (g == 0 && kn)
                            for (int d = 0; d < D / 32; d++) _mm_prefetch((const char *)(kn + row + 32 * d), _MM_HINT_T0);
                        if (g == 0 && kf)
                            for (int d = 0; d < D / 32; d++) _mm_prefetch((const char *)(kf + row + 32 * d), _MM_HINT_T1);
                        v[o] = _mm512_setzero_ps();
                        if (o < n)
                            for (int d = 0; d < D / 32; d++) v[o] = _mm512_dpbf16_ps(v[o], qv[d], load32bh(kb + row + 32 * d));
                    }
                    _mm512_mask_storeu_ps(scores + hg * ctx + t0 + s0, (__mmask16)((1u << n) - 1u),
                                          _mm512_mul_ps(hsum16(v), _mm512_set1_ps(a->scale)));
                }
        }
    }
    prefetch_pass_start(a, table, nblocks, a->half + col0, cols);
    for (int64_t hg = 0; hg < per_item * G; hg++) softmax_inplace(scores + hg * ctx, ctx);
    memset(acc, 0, sizeof(float) * (size_t)(per_item * G * D));
    for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
        const int64_t vcol = a->half + col0;
        const bf16 *vb = block_slab(a, table, blk, nblocks, vcol);
        const bf16 *vn = block_slab(a, table, blk + 1, nblocks, vcol), *vf = block_slab(a, table, blk + 2, nblocks, vcol);
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t hs = 0; hs < per_item * GS; hs++)  /* (kv head, sub-group) */
            for (int c = 0; c < D; c += 64) {
                const int64_t hh = hs / GS, hg0 = hs * GC;
                float *out = acc + hg0 * D + c;
                __m512 r[4][4];
                for (int g = 0; g < GC; g++)
                    for (int j = 0; j < 4; j++) r[g][j] = _mm512_loadu_ps(out + g * D + 16 * j);
                for (int64_t o = 0; o < n; o++) {
                    const int64_t row = o * tok_stride + hh * D + c;
                    if (vn) {
                        _mm_prefetch((const char *)(vn + row), _MM_HINT_T0);
                        _mm_prefetch((const char *)(vn + row + 32), _MM_HINT_T0);
                    }
                    if (vf) {
                        _mm_prefetch((const char *)(vf + row), _MM_HINT_T1);
                        _mm_prefetch((const char *)(vf + row + 32), _MM_HINT_T1);
                    }
                    const __m512 v0 = load16(vb + row), v1 = load16(vb + row + 16), v2 = load16(vb + row + 32),
                                 v3 = load16(vb + row + 48);
                    for (int g = 0; g < GC; g++) {
                        const __m512 p = _mm512_set1_ps(scores[(hg0 + g) * ctx + t0 + o]);
                        r[g][0] = _mm512_fmadd_ps(p, v0, r[g][0]);
                        r[g][1] = _mm512_fmadd_ps(p, v1, r[g][1]);
                        r[g][2] = _mm512_fmadd_ps(p, v2, r[g][2]);
                        r[g][3] = _mm512_fmadd_ps(p, v3, r[g][3]);
                    }
                }
                for (int g = 0; g < GC; g++)
                    for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + g * D + 16 * j, r[g][j]);
            }
    }
}

#define DECODE_ITEM_G(D)                                                                    \
    switch (a->G % 4 == 0 ? 4 : a->G % 3 == 0 ? 3 : a->G % 2 == 0 ? 2 : 1) {                \
    case 1: decode_item_fast(a, qh, table, ctx, scores, acc, h0, 1, D); break;              \
    case 2: decode_item_fast(a, qh, table, ctx, scores, acc, h0, 2, D); break;              \
    case 3: decode_item_fast(a, qh, table, ctx, scores, acc, h0, 3, D); break;              \
    default: decode_item_fast(a, qh, table, ctx, scores, acc, h0, 4, D); break;             \
    }

static void decode_chunk_fast(void *arg, int64_t begin, int64_t end) {
    const decode_job *a = (const decode_job *)arg;
    const int64_t D = a->D, HG = a->per_item * a->G;
    for (int64_t item = begin; item < end; item++) {
        const int64_t b = item / a->splits, h0 = item % a->splits * a->per_item;
        const int64_t ctx = a->context_lens[b];
        float *scores = (float *)malloc(sizeof(float) * (size_t)(HG * ctx + HG * D));
        float *acc = scores + HG * ctx;
        const bf16 *qh = a->q + b * a->q_row_stride + h0 * a->G * D;
        const int32_t *table = a->block_tables + b * a->max_blocks;
        if (D == 64) {
            DECODE_ITEM_G(64)
        } else {
            DECODE_ITEM_G(128)
        }
        bf16 *o = a->out + (b * a->H + h0 * a->G) * D;
        for (int64_t i = 0; i < HG * D; i++) o[i] = to_bf16(acc[i]);
        free(scores);
    }
}

void pd_paged_decode_attention_bf16(const bf16 *q, int64_t q_row_stride, const bf16 *kv, bf16 *out,
                                    const int32_t *block_tables, const int32_t *context_lens,
                                    int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                                    int64_t block_size, int64_t num_layers, int64_t layer, float scale,
                                    int nthreads) {
    const int64_t per_item = B >= 2 * nthreads ? KVH : 1;  /* kv heads per work item */
    const int64_t half = block_size * KVH * D;             /* K -> V of one (block, layer) */
    decode_job job = {q, kv, out, block_tables, context_lens, q_row_stride, H, KVH, D, max_blocks, block_size,
                      H / KVH, per_item, KVH / per_item, KVH * D, half, num_layers * 2 * half, layer * 2 * half, scale};
    const int fast = (D == 64 || D == 128) && block_size % 16 == 0;
    pool_run(fast ? decode_chunk_fast : decode_chunk, &job, B * job.splits, 1, nthreads);
}

/* fp32 rounded to bf16 and back (round-to-nearest-even), 16 lanes */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline __m512 load16_masked(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store16_masked(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

typedef struct {
    const bf16 *gate_up;
    bf16 *out;
    int64_t I;
} silu_job;

static void silu_chunk(void *arg, int64_t begin, int64_t end) {
    const silu_job *a = (const silu_job *)arg;
    const int64_t I = a->I;
    for (int64_t t = begin; t < end; t++) {
        const bf16 *g = a->gate_up + t * 2 * I, *u = g + I;
        bf16 *o = a->out + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 m = lanes(I - i);
            const __m512 x = load16_masked(g + i, m);
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.f)));
            const __m512 silu = round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            store16_masked(o + i, m, _mm512_mul_ps(silu, load16_masked(u + i, m)));
        }
    }
}

/* out[t, i] = bf16(bf16(silu(gate)) * up) with gate_up[t] = [gate | up], as
 * torch's F.silu(gate) * up rounds. */
void pd_silu_mul_bf16(const bf16 *gate_up, bf16 *out, int64_t T, int64_t I, int nthreads) {
    silu_job job = {gate_up, out, I};
    pool_run(silu_chunk, &job, T, T > 4 ? pool_chunk(T, nthreads, 2) : T, nthreads);
}

typedef struct {
    const bf16 *x, *weight;
    bf16 *residual, *out;
    int64_t Hd;
    float eps;
} norm_job;

static void norm_chunk(void *arg, int64_t begin, int64_t end) {
    const norm_job *a = (const norm_job *)arg;
    const int64_t Hd = a->Hd;
    for (int64_t t = begin; t < end; t++) {
        bf16 *r = a->residual + t * Hd;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < Hd; i += 16) {
            const __mmask16 m = lanes(Hd - i);
            __m512 v = load16_masked(r + i, m);
            if (a->x) {
                v = round_bf16(_mm512_add_ps(v, load16_masked(a->x + t * Hd + i, m)));
                store16_masked(r + i, m, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)Hd + a->eps));
        bf16 *o = a->out + t * Hd;
        for (int64_t i = 0; i < Hd; i += 16) {
            const __mmask16 m = lanes(Hd - i);
            const __m512 n = round_bf16(_mm512_mul_ps(load16_masked(r + i, m), inv));
            store16_masked(o + i, m, _mm512_mul_ps(n, load16_masked(a->weight + i, m)));
        }
    }
}

/* residual <- bf16(x + residual); out <- bf16(bf16(residual * rsqrt(mean(residual^2) + eps)) * weight).
 * x == NULL means plain RMSNorm of residual (left unchanged). */
void pd_add_rmsnorm_bf16(const bf16 *x, bf16 *residual, const bf16 *weight, bf16 *out,
                         int64_t T, int64_t Hd, float eps, int nthreads) {
    norm_job job = {x, weight, residual, out, Hd, eps};
    pool_run(norm_chunk, &job, T, T > 16 ? pool_chunk(T, nthreads, 2) : T, nthreads);
}

/* Prefill attention over paged KV: each sequence's chunk of q_len new
 * queries attends causally to its ctx keys (query i sees keys 0 ..
 * ctx - q_len + i).  Both products run through the packed-tile kernel of the
 * linear layers: per (sequence, kv head), K is packed as the "weight" of
 * S = q K^T and V^T as that of O = P V; then per (sequence, query head,
 * block of QB queries): fp32 scores, causal softmax, P rounded to bf16, O. */
#define QB 64

/* Keys [t0, t1) of one kv head (t0, t1 multiples of TILE_N; keys from ctx on, up to ctx_pad, are
 * written as zeros, so the ranges of one head write every element of its packs once):
 *     kp: K[t][d] as W[n=t][k=d], token t's d-pairs, 32 tokens apart
 *     vp: V[t][d] as W[n=d][k=t], tokens t, t+1 interleaved, 32 d per 64-byte row
 * The pool's blocks lie a whole block of layers apart, which the hardware prefetcher does not
 * follow: each block's rows are prefetched while the block before it is packed. */
static void pack_kv_head(const bf16 *kv, const int32_t *table, int64_t t0, int64_t t1, int64_t ctx, int64_t ctx_pad,
                         int64_t D, int64_t block_size, int64_t block_stride, int64_t off, int64_t tok_stride,
                         int64_t half, bf16 *kp, bf16 *vp) {
    uint32_t *kp2 = (uint32_t *)kp, *vp2 = (uint32_t *)vp;  /* bf16 pairs */
    __m512i interleave;  /* a0 b0 a1 b1 ... a15 b15; interleave_hi: a16 b16 ... a31 b31 */
    {
        int16_t idx[32];
        for (int i = 0; i < 16; i++) idx[2 * i] = (int16_t)i, idx[2 * i + 1] = (int16_t)(32 + i);
        interleave = _mm512_loadu_si512(idx);
    }
    const __m512i interleave_hi = _mm512_add_epi16(interleave, _mm512_set1_epi16(16));
    const int64_t last_block = (ctx - 1) / block_size;
    for (int64_t t = t0; t < t1; t += 2) {
        if (t % block_size < 2 && t < ctx) {  /* entering a block: fetch the next one's K and V rows */
            const int64_t next = t / block_size + 1;
            if (next <= last_block) {
                const bf16 *nb = kv + (int64_t)table[next] * block_stride + off;
                prefetch_rows(nb, block_size, tok_stride, D);
                prefetch_rows(nb + half, block_size, tok_stride, D);
            }
        }
        const bf16 *rows[2];  /* tokens t and t + 1 (NULL from ctx on): their K rows */
        for (int64_t e = 0; e < 2; e++)
            rows[e] = t + e < ctx ? kv + (int64_t)table[(t + e) / block_size] * block_stride + off +
                                        ((t + e) % block_size) * tok_stride : NULL;
        for (int64_t e = 0; e < 2; e++) {
            const int64_t j = (t + e) / TILE_N, c = (t + e) % TILE_N;
            const uint32_t *src = (const uint32_t *)rows[e];
            uint32_t *dst = kp2 + j * (D / 2) * TILE_N + c;
            if (src)
                for (int64_t p = 0; p < D / 2; p++) dst[p * TILE_N] = src[p];
            else
                for (int64_t p = 0; p < D / 2; p++) dst[p * TILE_N] = 0;
        }
        for (int64_t dj = 0; dj < D / TILE_N; dj++) {
            const __m512i a = rows[0] ? _mm512_loadu_si512(rows[0] + half + dj * TILE_N) : _mm512_setzero_si512();
            const __m512i b = rows[1] ? _mm512_loadu_si512(rows[1] + half + dj * TILE_N) : _mm512_setzero_si512();
            uint32_t *dst = vp2 + (dj * (ctx_pad / 2) + t / 2) * TILE_N;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, interleave, b));
            _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(a, interleave_hi, b));
        }
    }
}

/* The largest (sign > 0) or smallest (sign < 0) of s[0:n], n >= 1: four accumulators in flight,
 * where one made the pass wait on its own latency (4 cycles per 16 scores). */
static inline float row_extreme(const float *s, int64_t n, int sign) {
    const __m512 flip = _mm512_set1_ps(sign < 0 ? -1.f : 1.f);  /* the smallest is minus the largest of -s */
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        m0 = _mm512_max_ps(m0, _mm512_mul_ps(_mm512_loadu_ps(s + i), flip));
        m1 = _mm512_max_ps(m1, _mm512_mul_ps(_mm512_loadu_ps(s + i + 16), flip));
        m2 = _mm512_max_ps(m2, _mm512_mul_ps(_mm512_loadu_ps(s + i + 32), flip));
        m3 = _mm512_max_ps(m3, _mm512_mul_ps(_mm512_loadu_ps(s + i + 48), flip));
    }
    for (; i < n; i += 16)
        m0 = _mm512_mask_max_ps(m0, lanes(n - i), m0, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(n - i), s + i), flip));
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3))) * (sign < 0 ? -1.f : 1.f);
}

/* p[0:n] <- bf16(exp(scale * s[0:n] - max)), unnormalised; returns 1 / the sum of the exps (fp32,
 * before rounding), by which the caller scales P V's rows.  Two passes over s: the raw score whose
 * scaled value is the largest (the largest raw one, or the smallest where scale < 0), then exp,
 * sum and rounding, two sums in flight.  Normalising after P V instead of before saves a pass and
 * a store per score. */
static float softmax_unnormalised(const float *s, int64_t n, float scale, bf16 *p) {
    const float top = row_extreme(s, n, scale < 0.f ? -1 : 1);
    const __m512 sc = _mm512_set1_ps(scale), m = _mm512_set1_ps(top * scale);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 e0 = exp512_bf16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i), sc), m));
        const __m512 e1 = exp512_bf16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i + 16), sc), m));
        _mm256_storeu_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(e0));
        _mm256_storeu_si256((__m256i *)(p + i + 16), (__m256i)_mm512_cvtneps_pbh(e1));
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = lanes(n - i);
        const __m512 e = _mm512_maskz_mov_ps(k, exp512_bf16(_mm512_sub_ps(_mm512_mul_ps(
            _mm512_maskz_loadu_ps(k, s + i), sc), m)));
        store16_masked(p + i, k, e);
        s0 = _mm512_add_ps(s0, e);
    }
    return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

#include "prefill_driver.h"

/* items: (sequence, query head, block of QB queries), numbered by item_off */
static void prefill_attend_chunk(void *arg, int64_t begin, int64_t end) {
    const prefill_job *a = (const prefill_job *)arg;
    const int64_t H = a->H, D = a->D, G = a->G, stride = a->q_row_stride;
#ifdef PD_AMX
    /* both products on the tiles: q K^T has K = D, P V has K = the keys padded to 32 */
    const int amx = D % AMX_K == 0 && pd_amx_ready();
    int cfg[2] = {-1, -1};
#endif
    float *sc = NULL, inv[QB];
    float *of = (float *)malloc(sizeof(float) * (size_t)(QB * D));  /* P V's rows in fp32, before 1 / sum */
    bf16 *pb = NULL;
    int64_t cap = 0;
    for (int64_t claimed = begin; claimed < end; claimed++) {
        /* claimed last item first: later query blocks see more keys, so the largest items go first and
         * the threads finish together */
        const int64_t item = a->item_off[a->S] - 1 - claimed;
        int64_t s = 0;
        while (a->item_off[s + 1] <= item) s++;
        const int64_t local = item - a->item_off[s], hq = local % H, qb = local / H;
        const int64_t ctx = a->context_lens[s], ctx_pad = (ctx + TILE_N - 1) / TILE_N * TILE_N;
        const int64_t q0 = a->query_start_loc[s], q_len = a->query_start_loc[s + 1] - q0;
        const int64_t i0 = qb * QB, i1 = i0 + QB < q_len ? i0 + QB : q_len, m = i1 - i0;
        const int64_t first = ctx - q_len;  /* keys every query of the chunk sees */
        const int64_t key_end = first + i1, tiles = (key_end + TILE_N - 1) / TILE_N, kpad = tiles * TILE_N;
        const bf16 *kp = a->packs + a->pack_off[s] + 2 * (hq / G) * ctx_pad * D, *vp = kp + ctx_pad * D;
        if (m * kpad > cap) {  /* scores and probabilities, grown once per chunk, not allocated per item */
            free(sc);
            free(pb);
            cap = m * kpad;
            sc = (float *)malloc(sizeof(float) * (size_t)cap);
            pb = (bf16 *)malloc(sizeof(bf16) * (size_t)cap);
        }
        const bf16 *qi = a->q + (q0 + i0) * stride + hq * D;
#ifdef PD_AMX
        if (amx) amx_rows_times_tiles(m, qi, stride, D, kp, (D / 2) * 2 * TILE_N, tiles, NULL, NULL, sc, kpad, cfg);
        else
#endif
        for (int64_t j = 0; j < tiles; j++)
            for (int64_t r = 0; r < m; r += MR_MAX)
                rows_times_tile((int)(m - r), qi + r * stride, stride, D, kp + j * (D / 2) * 2 * TILE_N,
                                NULL, NULL, sc + r * kpad + j * TILE_N, kpad, 0, NULL);
        for (int64_t r = 0; r < m; r++) {
            const int64_t valid = first + i0 + r + 1;
            inv[r] = softmax_unnormalised(sc + r * kpad, valid, a->scale, pb + r * kpad);
            memset(pb + r * kpad + valid, 0, sizeof(bf16) * (size_t)(kpad - valid));
        }
#ifdef PD_AMX
        if (amx) amx_rows_times_tiles(m, pb, kpad, kpad, vp, (ctx_pad / 2) * 2 * TILE_N, D / TILE_N, NULL, NULL, of,
                                      D, cfg);
        else
#endif
        for (int64_t dj = 0; dj < D / TILE_N; dj++)
            for (int64_t r = 0; r < m; r += MR_MAX)
                rows_times_tile((int)(m - r), pb + r * kpad, kpad, kpad, vp + dj * (ctx_pad / 2) * 2 * TILE_N,
                                NULL, NULL, of + r * D + dj * TILE_N, D, 0, NULL);
        bf16 *oi = a->out + (q0 + i0) * H * D + hq * D;
        for (int64_t r = 0; r < m; r++) {
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int64_t d = 0; d < D; d += 16)
                store16_masked(oi + r * H * D + d, (__mmask16)0xffff, _mm512_mul_ps(_mm512_loadu_ps(of + r * D + d), w));
        }
    }
    free(sc);
    free(pb);
    free(of);
#ifdef PD_AMX
    if (amx) _tile_release();
#endif
}


/* Rotate-half RoPE in place on the heads of rows [t0, t1) of one row-strided
 * tensor, with HF's bf16 rounding steps (the portable kernel's, 16 lanes at a
 * time): out1 = bf16(bf16(x1*c) + bf16(-x2*s)), out2 = bf16(bf16(x2*c) + bf16(x1*s)),
 * c and s rounded to bf16 first (once per token, shared by its heads).  The
 * portable, scalar one took 7% of a 1,024-token prefill step. */
#define PD_VARIANT_ROPE
static void rope_rows(bf16 *x, int64_t row_stride, int64_t t0, int64_t t1, int64_t heads, int64_t D,
                      const int64_t *positions, const float *cos_cache, const float *sin_cache) {
    const int64_t hd = D / 2;
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos_cache + positions[t] * D, *s = sin_cache + positions[t] * D;
        for (int64_t i = 0; i < hd; i += 16) {
            const __mmask16 m = lanes(hd - i);
            const __m512 c1 = round_bf16(_mm512_maskz_loadu_ps(m, c + i)), c2 = round_bf16(_mm512_maskz_loadu_ps(m, c + hd + i));
            const __m512 s1 = round_bf16(_mm512_maskz_loadu_ps(m, s + i)), s2 = round_bf16(_mm512_maskz_loadu_ps(m, s + hd + i));
            for (int64_t h = 0; h < heads; h++) {
                bf16 *p = x + t * row_stride + h * D;
                const __m512 x1 = load16_masked(p + i, m), x2 = load16_masked(p + hd + i, m);
                const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign));
                const __m512 o1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(neg_x2, s1)));
                const __m512 o2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2)));
                store16_masked(p + i, m, o1);
                store16_masked(p + hd + i, m, o2);
            }
        }
    }
}

#include "portable_kernels.h"
#include "logits_argmax.h"
#include "greedy_head.h"
