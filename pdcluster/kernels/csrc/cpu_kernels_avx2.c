/* CPU kernels for the engine's bf16 hot paths on CPUs with AVX2 + FMA but no
 * AVX-512 (AMD Zen 2/3, older Intel): the same C ABI as cpu_kernels.c, which
 * kernels/cpu_native.py loads instead where the CPU has AVX-512 BF16.
 *
 * bf16 stays bf16 in memory and becomes fp32 in registers (a bf16 is the
 * top half of an fp32: a 16-bit shift, or a mask for the odd element of a
 * pair); products and sums are fp32 FMAs; rounding back to bf16 is
 * round-to-nearest-even, as torch does.  RMSNorm and SiLU-mul reproduce
 * the AVX-512 variant's operations in the same order (bit-exact with it and
 * with the torch references); the products may differ from it in the last
 * fp32 bits (summation order).
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

/* A 32-bit lane holding a bf16 pair (a, b) as b << 16 | a: a and b as fp32. */
static inline __m256 pair_lo(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 pair_hi(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 bf16 -> 8 fp32 */
static inline __m256 load8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 fp32 -> 8 bf16 as to_bf16 does (round to nearest even, NaN quieted) */
static inline __m128i cvt8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void store8(bf16 *p, __m256 v) { _mm_storeu_si128((__m128i *)p, cvt8(v)); }

/* fp32 rounded to bf16 and back, 8 lanes */
static inline __m256 round_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(cvt8(v)), 16));
}

/* The first n (< 8) elements through a zero-padded copy: the tails of rows. */
static inline __m256 load8_n(const bf16 *p, int64_t n) {
    bf16 tmp[8] = {0};
    memcpy(tmp, p, sizeof(bf16) * (size_t)n);
    return load8(tmp);
}

static inline void store8_n(bf16 *p, int64_t n, __m256 v) {
    bf16 tmp[8];
    store8(tmp, v);
    memcpy(p, tmp, sizeof(bf16) * (size_t)n);
}

static inline __m256 load8_any(const bf16 *p, int64_t left) { return left >= 8 ? load8(p) : load8_n(p, left); }

static inline void store8_any(bf16 *p, int64_t left, __m256 v) {
    if (left >= 8) store8(p, v);
    else store8_n(p, left, v);
}

/* lanes i < left set */
static inline __m256i mask8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The sum of 16 lanes held as lo (0-7) and hi (8-15), in the order of
 * AVX-512's _mm512_reduce_add_ps (halves, quarters, then pairs), so that the
 * norms here round exactly as the AVX-512 variant's. */
static inline float reduce_add16(__m256 lo, __m256 hi) {
    const __m256 h8 = _mm256_add_ps(hi, lo);
    const __m128 h4 = _mm_add_ps(_mm256_extractf128_ps(h8, 1), _mm256_castps256_ps128(h8));
    const __m128 h2 = _mm_add_ps(h4, _mm_shuffle_ps(h4, h4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(h2) + _mm_cvtss_f32(_mm_shuffle_ps(h2, h2, 1));
}

static inline float reduce_add8(__m256 v) {
    const __m128 h4 = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

static inline float reduce_max8(__m256 v) {
    const __m128 h4 = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 h2 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_max_ss(h2, _mm_movehdup_ps(h2)));
}

/* Eight vectors to one: lane t holds the sum of v[t]'s 8 lanes. */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* exp(x) for x <= 88: 2^n * e^r with |r| <= ln2/2 and the degree-6 Taylor
 * polynomial of the AVX-512 variant; 2^n built in the exponent field. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* bf16 rows -> fp32 rows (row strides ldx and ldf) */
static void rows_to_f32(const bf16 *x, int64_t ldx, int64_t rows, int64_t K, float *xf, int64_t ldf) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(xf + r * ldf + k, load8(x + r * ldx + k));
        for (; k < K; k++) xf[r * ldf + k] = to_f32(x[r * ldx + k]);
    }
}

/* Linear layers use the packed layout of the AVX-512 variant (one layout,
 * whichever variant packed it):
 *
 *     W[N, K]  ->  wp[N / 32][K / 2][32][2],  wp[j][p][c][e] = W[32 j + c][2 p + e]
 *
 * Read as 32-bit lanes, 32 bytes of a tile row are 8 output columns, each
 * lane the k-pair (2p, 2p + 1): pair_lo is W[., 2p] and pair_hi W[., 2p + 1]
 * in fp32.  x comes in as fp32 (converted once per call), so a k step is a
 * broadcast of x[r][k] and an FMA per 8 columns: the register block of an
 * AVX2 SGEMM (5 x 16), with the weights converted in registers (2 shifts or
 * masks per 10 FMAs). */
#define TILE_N 32
#define MR_MAX 5      /* x rows per micro-kernel: 5 x 2 accumulators (6 x 2 leaves the compiler too few
                         registers: 65 -> 92 GFLOP/s at M=256 x 576 x 3072 on 1 thread of this EPYC,
                         where torch fp32 does 81-89) */
#define M_BLOCK 256   /* x rows sharing one pass over the weights */

/* MR rows of fp32 x (row stride ldx) times NG groups of 8 columns of one
 * packed tile, from group g0: y rows (stride ldy, the tile's column 0) in
 * bf16, or in fp32 when yf is given. */
static inline __attribute__((always_inline)) void linear_block(
    const int MR, const int NG, const float *x, int64_t ldx, int64_t K, const bf16 *wt, int g0, const bf16 *bias,
    bf16 *y, float *yf, int64_t ldy, int prefetch) {
    __m256 acc[MR_MAX][4];
#pragma GCC unroll 5
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
    const int64_t kp = K / 2;
    for (int64_t p = 0; p < kp; p++) {
        const bf16 *w = wt + p * 2 * TILE_N + 16 * g0;
        if (prefetch) _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0),
                      _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m256 wv[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) wv[g] = pair_lo(_mm256_loadu_si256((const __m256i *)(w + 16 * g)));
#pragma GCC unroll 5
        for (int r = 0; r < MR; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + 2 * p);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[r][g] = _mm256_fmadd_ps(b, wv[g], acc[r][g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) wv[g] = pair_hi(_mm256_loadu_si256((const __m256i *)(w + 16 * g)));
#pragma GCC unroll 5
        for (int r = 0; r < MR; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[r][g] = _mm256_fmadd_ps(b, wv[g], acc[r][g]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        const int64_t col = 8 * (g0 + g);
        const __m256 b = bias ? load8(bias + col) : _mm256_setzero_ps();
#pragma GCC unroll 5
        for (int r = 0; r < MR; r++) {
            const __m256 v = _mm256_add_ps(acc[r][g], b);
            if (yf) _mm256_storeu_ps(yf + r * ldy + col, v);
            else store8(y + r * ldy + col, v);
        }
    }
}

/* One or two rows (decode) take the whole tile in one pass, streaming each
 * 128-byte tile row once; more rows go MR_MAX at a time over each half. */
static void rows_times_tile(int64_t rows, const float *x, int64_t ldx, int64_t K, const bf16 *wt, const bf16 *bias,
                            bf16 *y, float *yf, int64_t ldy, int prefetch) {
    if (rows == 1) {
        linear_block(1, 4, x, ldx, K, wt, 0, bias, y, yf, ldy, prefetch);
        return;
    }
    if (rows == 2) {
        linear_block(2, 4, x, ldx, K, wt, 0, bias, y, yf, ldy, prefetch);
        return;
    }
    for (int64_t r = 0; r < rows; r += MR_MAX) {
        const float *xr = x + r * ldx;
        bf16 *yr = y ? y + r * ldy : NULL;
        float *yfr = yf ? yf + r * ldy : NULL;
        for (int g0 = 0; g0 < 4; g0 += 2) {
            const int pf = prefetch && r == 0 && g0 == 0;
            switch (rows - r < MR_MAX ? rows - r : MR_MAX) {
            case 1: linear_block(1, 2, xr, ldx, K, wt, g0, bias, yr, yfr, ldy, pf); break;
            case 2: linear_block(2, 2, xr, ldx, K, wt, g0, bias, yr, yfr, ldy, pf); break;
            case 3: linear_block(3, 2, xr, ldx, K, wt, g0, bias, yr, yfr, ldy, pf); break;
            case 4: linear_block(4, 2, xr, ldx, K, wt, g0, bias, yr, yfr, ldy, pf); break;
            default: linear_block(5, 2, xr, ldx, K, wt, g0, bias, yr, yfr, ldy, pf); break;
            }
        }
    }
}

typedef struct {
    const float *xf;
    const bf16 *x, *wp, *bias;
    float *xf_out;
    bf16 *y;
    int64_t M, N, K, tiles;
} linear_job;

/* items: (block of M_BLOCK rows, 32-column tile), tile-major within a block */
static void linear_chunk(void *arg, int64_t begin, int64_t end) {
    const linear_job *a = (const linear_job *)arg;
    for (int64_t item = begin; item < end; item++) {
        const int64_t mb = item / a->tiles, j = item % a->tiles;
        const bf16 *wt = a->wp + j * (a->K / 2) * 2 * TILE_N;
        const bf16 *bj = a->bias ? a->bias + j * TILE_N : NULL;
        const int64_t m0 = mb * M_BLOCK, m_end = m0 + M_BLOCK < a->M ? m0 + M_BLOCK : a->M;
        rows_times_tile(m_end - m0, a->xf + m0 * a->K, a->K, a->K, wt, bj, a->y + m0 * a->N + j * TILE_N, NULL,
                        a->N, 1);
    }
}

/* items: rows of x to convert */
static void convert_chunk(void *arg, int64_t begin, int64_t end) {
    const linear_job *a = (const linear_job *)arg;
    rows_to_f32(a->x + begin * a->K, a->K, end - begin, a->K, a->xf_out + begin * a->K, a->K);
}

/* Per-thread fp32 scratch kept between calls: a fresh malloc of a few
 * hundred KiB is an mmap, and page faults on every call.  Slot 0: the
 * caller's fp32 copy of x in pd_linear_packed_bf16 (pool helpers only read
 * it); slot 1: a prefill attention item's scores. */
static float *scratch_f32(int slot, size_t n) {
    static __thread float *buf[2];
    static __thread size_t cap[2];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = n + n / 4;
        buf[slot] = (float *)aligned_alloc(64, (cap[slot] * sizeof(float) + 63) / 64 * 64);
    }
    return buf[slot];
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with W packed as above;
 * bf16 in and out, fp32 accumulation.  Needs N % 32 == 0 and K even. */
void pd_linear_packed_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y,
                           int64_t M, int64_t N, int64_t K, int nthreads) {
    float *xf = scratch_f32(0, (size_t)(M * K));
    linear_job job = {xf, x, wp, bias, xf, y, M, N, K, N / TILE_N};
    if (M * K >= 65536) pool_run(convert_chunk, &job, M, pool_chunk(M, nthreads, 2), nthreads);
    else convert_chunk(&job, 0, M);
    const int64_t items = (M + M_BLOCK - 1) / M_BLOCK * job.tiles;
    pool_run(linear_chunk, &job, items, pool_chunk(items, nthreads, 8), nthreads);
}

/* s[0:n] <- softmax(scale * s[0:n]) in fp32 (three passes: scaled max,
 * exp and sum, normalise).  Whole vectors are plain loads and stores; only
 * the tail is masked (a masked store is slow on AMD cores). */
static void softmax_scaled(float *s, int64_t n, float scale) {
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const int64_t whole = n / 8 * 8;
    const __m256i tail = mask8(n - whole);
    __m256 mv = ninf;
    for (int64_t i = 0; i < whole; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), sc);
        _mm256_storeu_ps(s + i, x);
        mv = _mm256_max_ps(mv, x);
    }
    if (whole < n) {
        const __m256 x = _mm256_mul_ps(_mm256_maskload_ps(s + whole, tail), sc);
        _mm256_maskstore_ps(s + whole, tail, x);
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(tail)));
    }
    const __m256 m = _mm256_set1_ps(reduce_max8(mv));
    __m256 sv = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    if (whole < n) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(s + whole, tail), m));
        _mm256_maskstore_ps(s + whole, tail, e);
        sv = _mm256_add_ps(sv, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
    }
    const __m256 inv = _mm256_set1_ps(1.f / reduce_add8(sv));
    for (int64_t i = 0; i < whole; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
    if (whole < n) _mm256_maskstore_ps(s + whole, tail, _mm256_mul_ps(_mm256_maskload_ps(s + whole, tail), inv));
}

/* Paged decode attention: one query token per sequence.  A work item is one
 * sequence and a range of its kv heads (all of them once there are enough
 * sequences to keep every thread busy, so each block's rows stream whole).
 * Two passes over the sequence's blocks: fp32 scores of 8 tokens at a time
 * (one hsum8 per query head), softmax, then the probability-weighted sum of
 * V.  q and the output accumulators are kept pair-split like the weights
 * (per 16 elements: the 8 even then the 8 odd ones), so a K or V row turns
 * into fp32 with one shift or mask per 8 elements and no shuffles. */
typedef struct {
    const bf16 *q, *kv;
    bf16 *out;
    const int32_t *block_tables, *context_lens;
    int64_t q_row_stride, H, KVH, D, max_blocks, block_size, G, per_item, splits, tok_stride, half, block_stride,
        layer_off;
    float scale;
} decode_job;

/* acc[g] += p[g] * V rows, for GC query heads of one kv head over 16 columns
 * (one pair-split slice); GC a compile-time constant so acc stays in registers. */
static inline __attribute__((always_inline)) void decode_pv_slice(
    const int GC, const bf16 *vb, int64_t tok_stride, int64_t n, const float *probs, int64_t ctx, float *acc,
    int64_t D) {
    __m256 r[4][2];
    for (int g = 0; g < GC; g++) r[g][0] = _mm256_loadu_ps(acc + g * D), r[g][1] = _mm256_loadu_ps(acc + g * D + 8);
    for (int64_t o = 0; o < n; o++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(vb + o * tok_stride));
        const __m256 ve = pair_lo(v), vo = pair_hi(v);
        for (int g = 0; g < GC; g++) {
            const __m256 p = _mm256_broadcast_ss(probs + g * ctx + o);
            r[g][0] = _mm256_fmadd_ps(p, ve, r[g][0]);
            r[g][1] = _mm256_fmadd_ps(p, vo, r[g][1]);
        }
    }
    for (int g = 0; g < GC; g++) _mm256_storeu_ps(acc + g * D, r[g][0]), _mm256_storeu_ps(acc + g * D + 8, r[g][1]);
}

static void decode_chunk(void *arg, int64_t begin, int64_t end) {
    const decode_job *a = (const decode_job *)arg;
    const int64_t G = a->G, D = a->D, per_item = a->per_item, HG = per_item * G, block_size = a->block_size;
    const int64_t tok_stride = a->tok_stride, half = a->half, block_stride = a->block_stride;
    const int GC = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1;
    const bf16 *kv = a->kv;
    for (int64_t item = begin; item < end; item++) {
        const int64_t b = item / a->splits, h0 = item % a->splits * per_item;
        const int64_t ctx = a->context_lens[b];
        const int32_t *table = a->block_tables + b * a->max_blocks;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(HG * ctx + 2 * HG * D));
        float *acc = scores + HG * ctx, *qf = acc + HG * D;  /* both pair-split */
        const bf16 *qh = a->q + b * a->q_row_stride + h0 * G * D;
        for (int64_t i = 0; i < HG * D; i += 16) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qh + i));
            _mm256_storeu_ps(qf + i, pair_lo(v));
            _mm256_storeu_ps(qf + i + 8, pair_hi(v));
        }
        const int64_t col0 = a->layer_off + h0 * D;
        for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
            const bf16 *kb = kv + (int64_t)table[blk] * block_stride + col0;
            const bf16 *kn = t0 + block_size < ctx ? kv + (int64_t)table[blk + 1] * block_stride + col0 : NULL;
            const bf16 *kf = t0 + 2 * block_size < ctx ? kv + (int64_t)table[blk + 2] * block_stride + col0 : NULL;
            const int64_t nb = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (blk == 0 && kn) prefetch_rows_l2(kn, block_size, tok_stride, per_item * D);
            for (int64_t s0 = 0; s0 < nb; s0 += 8) {
                const int64_t n = nb - s0 < 8 ? nb - s0 : 8;
                /* the next block's rows into L1 and the one after's into L2 as
                 * this block's are read: the hardware prefetcher does not follow
                 * a block table, and L1 alone keeps too few lines in flight
                 * (as in cpu_kernels.c's decode fast path) */
                for (int64_t o = s0; o < s0 + 8 && o < block_size; o++)
                    for (int64_t c = 0; c < per_item * D; c += 32) {
                        if (kn) _mm_prefetch((const char *)(kn + o * tok_stride + c), _MM_HINT_T0);
                        if (kf) _mm_prefetch((const char *)(kf + o * tok_stride + c), _MM_HINT_T1);
                    }
                for (int64_t hg = 0; hg < HG; hg++) {
                    const bf16 *k0 = kb + s0 * tok_stride + hg / G * D;
                    const float *qv = qf + hg * D;
                    __m256 v[8];
                    for (int o = 0; o < 8; o++) {
                        __m256 se = _mm256_setzero_ps(), so = _mm256_setzero_ps();
                        if (o < n)
                            for (int64_t d = 0; d < D; d += 16) {
                                const __m256i k = _mm256_loadu_si256((const __m256i *)(k0 + o * tok_stride + d));
                                se = _mm256_fmadd_ps(pair_lo(k), _mm256_loadu_ps(qv + d), se);
                                so = _mm256_fmadd_ps(pair_hi(k), _mm256_loadu_ps(qv + d + 8), so);
                            }
                        v[o] = _mm256_add_ps(se, so);
                    }
                    const __m256 s = _mm256_mul_ps(hsum8(v), _mm256_set1_ps(a->scale));
                    if (n == 8) _mm256_storeu_ps(scores + hg * ctx + t0 + s0, s);
                    else _mm256_maskstore_ps(scores + hg * ctx + t0 + s0, mask8(n), s);
                }
            }
        }
        for (int64_t hg = 0; hg < HG; hg++) softmax_scaled(scores + hg * ctx, ctx, 1.f);
        memset(acc, 0, sizeof(float) * (size_t)(HG * D));
        for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
            const bf16 *vb = kv + (int64_t)table[blk] * block_stride + half + col0;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx) {
                const bf16 *vn = kv + (int64_t)table[blk + 1] * block_stride + half + col0;
                for (int64_t o = 0; o < block_size; o++)
                    for (int64_t c = 0; c < per_item * D; c += 32)
                        _mm_prefetch((const char *)(vn + o * tok_stride + c), _MM_HINT_T0);
            }
            if (t0 + 2 * block_size < ctx)
                prefetch_rows_l2(kv + (int64_t)table[blk + 2] * block_stride + half + col0, block_size, tok_stride,
                                 per_item * D);
            for (int64_t hh = 0; hh < per_item; hh++)
                for (int64_t d = 0; d < D; d += 16)
                    for (int64_t g0 = hh * G; g0 < (hh + 1) * G; g0 += GC) {
                        const bf16 *v = vb + hh * D + d;
                        const float *probs = scores + g0 * ctx + t0;
                        float *ag = acc + g0 * D + d;
                        switch (GC) {
                        case 1: decode_pv_slice(1, v, tok_stride, n, probs, ctx, ag, D); break;
                        case 2: decode_pv_slice(2, v, tok_stride, n, probs, ctx, ag, D); break;
                        case 3: decode_pv_slice(3, v, tok_stride, n, probs, ctx, ag, D); break;
                        default: decode_pv_slice(4, v, tok_stride, n, probs, ctx, ag, D); break;
                        }
                    }
        }
        /* pair-split fp32 -> interleaved bf16 */
        bf16 *out = a->out + (b * a->H + h0 * G) * D;
        for (int64_t i = 0; i < HG * D; i += 16) {
            const __m256 e = _mm256_loadu_ps(acc + i), o = _mm256_loadu_ps(acc + i + 8);
            const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
            store8(out + i, _mm256_permute2f128_ps(lo, hi, 0x20));
            store8(out + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
        free(scores);
    }
}

/* Needs head_dim % 16 == 0 (kernels.ops sends head_dim % 32 == 0). */
void pd_paged_decode_attention_bf16(const bf16 *q, int64_t q_row_stride, const bf16 *kv, bf16 *out,
                                    const int32_t *block_tables, const int32_t *context_lens,
                                    int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                                    int64_t block_size, int64_t num_layers, int64_t layer, float scale,
                                    int nthreads) {
    const int64_t per_item = B >= 2 * nthreads ? KVH : 1;  /* kv heads per work item */
    const int64_t half = block_size * KVH * D;             /* K -> V of one (block, layer) */
    decode_job job = {q, kv, out, block_tables, context_lens, q_row_stride, H, KVH, D, max_blocks, block_size,
                      H / KVH, per_item, KVH / per_item, KVH * D, half, num_layers * 2 * half, layer * 2 * half, scale};
    pool_run(decode_chunk, &job, B * job.splits, 1, nthreads);
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
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 x = load8_any(g + i, I - i);
            const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.f)));
            const __m256 silu = round_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
            store8_any(o + i, I - i, _mm256_mul_ps(silu, load8_any(u + i, I - i)));
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

/* The sum of squares runs in 16 lanes (lo: 0-7, hi: 8-15) as the AVX-512
 * variant's does, so both variants round alike. */
static void norm_chunk(void *arg, int64_t begin, int64_t end) {
    const norm_job *a = (const norm_job *)arg;
    const int64_t Hd = a->Hd;
    for (int64_t t = begin; t < end; t++) {
        bf16 *r = a->residual + t * Hd;
        __m256 ss[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < Hd; i += 8) {
            const int64_t left = Hd - i;
            __m256 v = load8_any(r + i, left);
            if (a->x) {
                v = round_bf16(_mm256_add_ps(v, load8_any(a->x + t * Hd + i, left)));
                store8_any(r + i, left, v);
            }
            ss[(i >> 3) & 1] = _mm256_fmadd_ps(v, v, ss[(i >> 3) & 1]);
        }
        const float inv = 1.f / sqrtf(reduce_add16(ss[0], ss[1]) / (float)Hd + a->eps);
        const __m256 iv = _mm256_set1_ps(inv);
        bf16 *o = a->out + t * Hd;
        for (int64_t i = 0; i < Hd; i += 8) {
            const int64_t left = Hd - i;
            const __m256 n = round_bf16(_mm256_mul_ps(load8_any(r + i, left), iv));
            store8_any(o + i, left, _mm256_mul_ps(n, load8_any(a->weight + i, left)));
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
 * block of QB queries): fp32 scores, causal softmax (P stays fp32), O. */
#define QB 64

/* Keys [t0, t1) of one kv head (t0, t1 multiples of TILE_N; keys from ctx on, up to ctx_pad, are
 * written as zeros, so the ranges of one head write every element of its packs once). */
static void pack_kv_head(const bf16 *kv, const int32_t *table, int64_t t0, int64_t t1, int64_t ctx, int64_t ctx_pad,
                         int64_t D, int64_t block_size, int64_t block_stride, int64_t off, int64_t tok_stride,
                         int64_t half, bf16 *kp, bf16 *vp) {
    uint32_t *kp2 = (uint32_t *)kp;  /* bf16 pairs */
    for (int64_t t = t0; t < t1; t++) {
        const bf16 *row = t < ctx ? kv + (int64_t)table[t / block_size] * block_stride + off +
                                        (t % block_size) * tok_stride : NULL;
        /* K[t][d] as W[n=t][k=d]: token t's d-pairs, 32 tokens apart */
        const int64_t j = t / TILE_N, c = t % TILE_N;
        const uint32_t *src = (const uint32_t *)row;
        for (int64_t p = 0; p < D / 2; p++) kp2[(j * (D / 2) + p) * TILE_N + c] = src ? src[p] : 0;
        /* V[t][d] as W[n=d][k=t]: vp[d / 32][t / 2][d % 32][t % 2] */
        const bf16 *v = row ? row + half : NULL;
        for (int64_t d = 0; d < D; d++)
            vp[((d / TILE_N * (ctx_pad / 2) + t / 2) * TILE_N + d % TILE_N) * 2 + t % 2] = v ? v[d] : (bf16)0;
    }
}



#include "prefill_driver.h"

/* items: (sequence, query head, block of QB queries), numbered by item_off */
static void prefill_attend_chunk(void *arg, int64_t begin, int64_t end) {
    const prefill_job *a = (const prefill_job *)arg;
    const int64_t H = a->H, D = a->D, G = a->G, stride = a->q_row_stride;
    for (int64_t item = begin; item < end; item++) {
        int64_t s = 0;
        while (a->item_off[s + 1] <= item) s++;
        const int64_t local = item - a->item_off[s], hq = local % H, qb = local / H;
        const int64_t ctx = a->context_lens[s], ctx_pad = (ctx + TILE_N - 1) / TILE_N * TILE_N;
        const int64_t q0 = a->query_start_loc[s], q_len = a->query_start_loc[s + 1] - q0;
        const int64_t i0 = qb * QB, i1 = i0 + QB < q_len ? i0 + QB : q_len, m = i1 - i0;
        const int64_t first = ctx - q_len;  /* keys every query of the chunk sees */
        const int64_t key_end = first + i1, tiles = (key_end + TILE_N - 1) / TILE_N, kpad = tiles * TILE_N;
        const bf16 *kp = a->packs + a->pack_off[s] + 2 * (hq / G) * ctx_pad * D, *vp = kp + ctx_pad * D;
        float *sc = scratch_f32(1, (size_t)(m * kpad + m * D));
        float *qf = sc + m * kpad;
        rows_to_f32(a->q + (q0 + i0) * stride + hq * D, stride, m, D, qf, D);
        for (int64_t j = 0; j < tiles; j++)
            rows_times_tile(m, qf, D, D, kp + j * (D / 2) * 2 * TILE_N, NULL, NULL, sc + j * TILE_N, kpad, 0);
        for (int64_t r = 0; r < m; r++) {
            const int64_t valid = first + i0 + r + 1;
            softmax_scaled(sc + r * kpad, valid, a->scale);
            memset(sc + r * kpad + valid, 0, sizeof(float) * (size_t)(kpad - valid));
        }
        bf16 *oi = a->out + (q0 + i0) * H * D + hq * D;
        for (int64_t dj = 0; dj < D / TILE_N; dj++)
            rows_times_tile(m, sc, kpad, kpad, vp + dj * (ctx_pad / 2) * 2 * TILE_N, NULL, oi + dj * TILE_N, NULL,
                            H * D, 0);
    }
}


/* Rotate-half RoPE in place on the heads of rows [t0, t1) of one row-strided
 * tensor, with HF's bf16 rounding steps (the portable kernel's, 8 lanes at a
 * time): out1 = bf16(bf16(x1*c) + bf16(-x2*s)), out2 = bf16(bf16(x2*c) + bf16(x1*s)),
 * c and s rounded to bf16 first (once per token, shared by its heads). */
#define PD_VARIANT_ROPE
static void rope_rows(bf16 *x, int64_t row_stride, int64_t t0, int64_t t1, int64_t heads, int64_t D,
                      const int64_t *positions, const float *cos_cache, const float *sin_cache) {
    const int64_t hd = D / 2, whole = hd / 8 * 8;
    const __m256 sign = _mm256_set1_ps(-0.f);
    float *cs = (float *)malloc(sizeof(float) * (size_t)(2 * D));  /* bf16-rounded cos | sin */
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos_cache + positions[t] * D, *s = sin_cache + positions[t] * D;
        for (int64_t i = 0; i < D; i++) cs[i] = to_f32(to_bf16(c[i])), cs[D + i] = to_f32(to_bf16(s[i]));
        for (int64_t h = 0; h < heads; h++) {
            bf16 *p = x + t * row_stride + h * D;
            for (int64_t i = 0; i < whole; i += 8) {
                const __m256 x1 = load8(p + i), x2 = load8(p + i + hd);
                const __m256 c1 = _mm256_loadu_ps(cs + i), c2 = _mm256_loadu_ps(cs + i + hd);
                const __m256 s1 = _mm256_loadu_ps(cs + D + i), s2 = _mm256_loadu_ps(cs + D + i + hd);
                const __m256 o1 = _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, c1)),
                                                round_bf16(_mm256_mul_ps(_mm256_xor_ps(x2, sign), s1)));
                const __m256 o2 = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, c2)), round_bf16(_mm256_mul_ps(x1, s2)));
                store8(p + i, o1);
                store8(p + i + hd, o2);
            }
            for (int64_t i = whole; i < hd; i++) {
                const float x1 = to_f32(p[i]), x2 = to_f32(p[i + hd]);
                const float o1 = to_f32(to_bf16(x1 * cs[i])) + to_f32(to_bf16(-x2 * cs[D + i]));
                const float o2 = to_f32(to_bf16(x2 * cs[i + hd])) + to_f32(to_bf16(x1 * cs[D + i + hd]));
                p[i] = to_bf16(o1);
                p[i + hd] = to_bf16(o2);
            }
        }
    }
    free(cs);
}

#include "portable_kernels.h"
#include "logits_argmax.h"
