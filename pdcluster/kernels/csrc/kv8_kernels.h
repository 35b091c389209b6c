/* 8-bit KV pools (int8, fp8 e4m3): the KV write, decode and prefill
 * attention every variant shares.  Included by portable_kernels.h, after the
 * variant's own bf16 attention kernels; AVX2 + FMA intrinsics (both
 * variants' flags include them).
 *
 * Row format (kernels/kv_quant.py), one per (token, kv head):
 *
 *     | q[0] ... q[D-1] (1 byte each) | scale (bf16) |      D + 2 bytes
 *     value[i] = q[i] * scale
 *
 * kind: PD_KV_BF16 0, PD_KV_INT8 1, PD_KV_FP8 2 (e4m3fn).
 * Quantizing is bit-exact with the torch reference: scale = bf16(amax / QMAX)
 * (QMAX 127 | 448), q = round-half-even(x / scale) clamped (int8) or
 * e4m3(clamp(x / scale)) rounded to nearest even; scale 0 gives q = 0. */
#ifndef PD_KV8_KERNELS_H
#define PD_KV8_KERNELS_H

#include <math.h>

#define PD_KV_BF16 0
#define PD_KV_INT8 1
#define PD_KV_FP8 2
#define KV8_SCALE_BYTES 2

static float fp8_value[256];  /* e4m3fn byte -> value (NaN codes 0x7f, 0xff) */
static int fp8_ready;

static void fp8_table_init(void) {
    if (__atomic_load_n(&fp8_ready, __ATOMIC_ACQUIRE)) return;
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf(m / 8.f, -6);
        if ((c & 0x7f) == 0x7f) v = NAN;
        fp8_value[c] = c & 0x80 ? -v : v;
    }
    __atomic_store_n(&fp8_ready, 1, __ATOMIC_RELEASE);
}

/* nearest e4m3fn code of a finite x in [-448, 448], ties to the even code */
static uint8_t fp8_encode(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    int lo = 0, hi = 0x7e;  /* positive codes 0..0x7e are increasing */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (fp8_value[mid] <= a) lo = mid; else hi = mid - 1;
    }
    int c = lo;
    if (c < 0x7e) {
        const float below = a - fp8_value[c], above = fp8_value[c + 1] - a;
        if (above < below || (above == below && (c & 1))) c++;
    }
    return (uint8_t)(sign | c);
}

static inline float kv8_scale(const uint8_t *row, int64_t D) {
    bf16 s;
    memcpy(&s, row + D, sizeof s);
    return to_f32(s);
}

/* shift: NULL, or D fp32 values subtracted first (K smoothing, kernels/kv_quant.py) */
static void quantize_row(const bf16 *x, const float *shift, uint8_t *row, int64_t D, int kind) {
    const float qmax = kind == PD_KV_INT8 ? 127.f : 448.f;
    float xs[D];
    for (int64_t i = 0; i < D; i++) xs[i] = shift ? to_f32(x[i]) - shift[i] : to_f32(x[i]);
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(xs[i]));
    const bf16 sb = to_bf16(amax / qmax);
    const float s = to_f32(sb);
    for (int64_t i = 0; i < D; i++) {
        float y = s > 0.f ? xs[i] / s : 0.f;
        y = fminf(fmaxf(y, -qmax), qmax);
        row[i] = kind == PD_KV_INT8 ? (uint8_t)(int8_t)nearbyintf(y) : fp8_encode(y);
    }
    memcpy(row + D, &sb, sizeof sb);
}

/* K and V rows of the step's tokens (row-strided bf16 views), quantized into
 * their slots; k_shift: NULL or this layer's [KVH, D] fp32 K smoothing shift. */
void pd_write_kv_q8(uint8_t *kv, const bf16 *k, const bf16 *v, int64_t row_stride, const int64_t *slots,
                    int64_t T, int64_t KVH, int64_t D, int64_t block_size, int64_t num_layers, int64_t layer,
                    int kind, const float *k_shift) {
    fp8_table_init();
    const int64_t W = D + KV8_SCALE_BYTES, half = block_size * KVH * W;
    for (int64_t t = 0; t < T; t++) {
        const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
        uint8_t *dst = kv + (blk * num_layers + layer) * 2 * half + off * KVH * W;
        for (int64_t h = 0; h < KVH; h++) {
            quantize_row(k + t * row_stride + h * D, k_shift ? k_shift + h * D : NULL, dst + h * W, D, kind);
            quantize_row(v + t * row_stride + h * D, NULL, dst + half + h * W, D, kind);
        }
    }
}

/* 8 payload bytes -> 8 fp32 (not yet scaled) */
static inline __m256 kv8_load8(const uint8_t *p, int kind) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (kind == PD_KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return _mm256_i32gather_ps(fp8_value, _mm256_cvtepu8_epi32(b), 4);
}

/* e^x, x <= 0 (scores minus their max), Cephes' polynomial: ~1 ulp */
static inline __m256 kv8_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* lane i = the sum of v[i]'s 8 lanes */
static inline __m256 kv8_hsum8(const __m256 v[8]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t, u, 0x20), _mm256_permute2f128_ps(t, u, 0x31));
}

/* acc[g][d0 .. d0+32) = sum_t p[g][t] * v_t[d0 .. d0+32) for GC query heads
 * (a compile-time constant: 4 x GC accumulators stay in registers), each V
 * slice widened once for all of them */
static inline __attribute__((always_inline)) void kv8_pv_slice(
    const int GC, const uint8_t *const *vrows, const float *probs, int64_t ctx, int64_t d0, float *acc, int64_t D,
    int kind) {
    __m256 r[3][4];
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < 4; j++) r[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < ctx; t++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = kv8_load8(vrows[t] + d0 + 8 * j, kind);
        for (int g = 0; g < GC; g++) {
            const __m256 p = _mm256_broadcast_ss(probs + g * ctx + t);
            for (int j = 0; j < 4; j++) r[g][j] = _mm256_fmadd_ps(p, v[j], r[g][j]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + g * D + d0 + 8 * j, r[g][j]);
}

typedef struct {
    const bf16 *q;
    const uint8_t *kv;
    bf16 *out;
    const int32_t *block_tables, *context_lens;
    int64_t q_row_stride, H, KVH, D, max_blocks, block_size, tok_stride, half, block_stride, layer_off;
    float scale;
    int kind;
} decode_q8_job;

/* one work item: (sequence, kv head).  Reads the 8-bit rows directly: scores
 * q.k * k_scale, softmax in fp32, then sum_t p_t * v_scale_t * v_t. */
static void decode_q8_chunk(void *arg, int64_t begin, int64_t end) {
    const decode_q8_job *a = (const decode_q8_job *)arg;
    const int64_t D = a->D, G = a->H / a->KVH, bs = a->block_size;
    for (int64_t item = begin; item < end; item++) {
        const int64_t b = item / a->KVH, h = item % a->KVH, ctx = a->context_lens[b];
        const int32_t *table = a->block_tables + b * a->max_blocks;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * ctx + 2 * G * D + 8 * D));
        float *acc = scores + G * ctx, *qf = acc + G * D, *kf = qf + G * D;
        const uint8_t **vrows = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)(ctx ? ctx : 1));
        const bf16 *qh = a->q + b * a->q_row_stride + h * G * D;
        for (int64_t i = 0; i < G * D; i++) qf[i] = to_f32(qh[i]);
        const int64_t col = a->layer_off + h * (D + KV8_SCALE_BYTES);
        for (int64_t t0 = 0; t0 < ctx; t0 += 8) {  /* 8 tokens a time: one transposed sum per query head */
            const int64_t n = ctx - t0 < 8 ? ctx - t0 : 8;
            const uint8_t *rows[8];
            float ks[8] = {0};
            for (int64_t o = 0; o < n; o++) {
                const int64_t t = t0 + o;
                rows[o] = a->kv + (int64_t)table[t / bs] * a->block_stride + col + (t % bs) * a->tok_stride;
                ks[o] = kv8_scale(rows[o], D) * a->scale;
            }
            for (int64_t o = 0; o < n; o++)  /* each K row widened once, read by every query head */
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kf + o * D + d, kv8_load8(rows[o] + d, a->kind));
            for (int64_t g = 0; g < G; g++) {
                __m256 v[8];
                for (int64_t o = 0; o < 8; o++) {
                    v[o] = _mm256_setzero_ps();
                    if (o < n)
                        for (int64_t d = 0; d < D; d += 8)
                            v[o] = _mm256_fmadd_ps(_mm256_loadu_ps(kf + o * D + d), _mm256_loadu_ps(qf + g * D + d),
                                                   v[o]);
                }
                float sums[8];
                _mm256_storeu_ps(sums, _mm256_mul_ps(kv8_hsum8(v), _mm256_loadu_ps(ks)));
                memcpy(scores + g * ctx + t0, sums, sizeof(float) * (size_t)n);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * ctx, m = -INFINITY, sum = 0.f;
            const int64_t whole = ctx / 8 * 8;
            for (int64_t t = 0; t < ctx; t++) m = fmaxf(m, sg[t]);
            __m256 sv = _mm256_setzero_ps();
            for (int64_t t = 0; t < whole; t += 8) {
                const __m256 e = kv8_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(m)));
                _mm256_storeu_ps(sg + t, e);
                sv = _mm256_add_ps(sv, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, sv);
            for (int i = 0; i < 8; i++) sum += lanes[i];
            for (int64_t t = whole; t < ctx; t++) sum += (sg[t] = expf(sg[t] - m));
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < ctx; t++) sg[t] *= inv;
        }
        /* p_t * v_scale_t folded into the probabilities, then per (query head,
         * 32 columns) the accumulators stay in registers over every token */
        for (int64_t t = 0; t < ctx; t++) {
            vrows[t] = a->kv + (int64_t)table[t / bs] * a->block_stride + a->half + col + (t % bs) * a->tok_stride;
            const float vs = kv8_scale(vrows[t], D);
            for (int64_t g = 0; g < G; g++) scores[g * ctx + t] *= vs;
        }
        for (int64_t g0 = 0; g0 < G; g0 += 3)
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                const int64_t gc = G - g0 < 3 ? G - g0 : 3;
                const float *pg = scores + g0 * ctx;
                if (gc == 3 && D - d0 >= 32) kv8_pv_slice(3, vrows, pg, ctx, d0, acc + g0 * D, D, a->kind);
                else if (gc == 2 && D - d0 >= 32) kv8_pv_slice(2, vrows, pg, ctx, d0, acc + g0 * D, D, a->kind);
                else  /* one query head left, or a last slice narrower than 32 columns */
                    for (int64_t g = g0; g < g0 + gc; g++)
                        for (int64_t d = d0; d < D && d < d0 + 32; d += 8) {
                            __m256 r = _mm256_setzero_ps();
                            for (int64_t t = 0; t < ctx; t++)
                                r = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * ctx + t]),
                                                    kv8_load8(vrows[t] + d, a->kind), r);
                            _mm256_storeu_ps(acc + g * D + d, r);
                        }
            }
        bf16 *out = a->out + (b * a->H + h * G) * D;
        for (int64_t i = 0; i < G * D; i++) out[i] = to_bf16(acc[i]);
        free(vrows);
        free(scores);
    }
}

/* Needs head_dim % 8 == 0. */
void pd_paged_decode_attention_q8(const bf16 *q, int64_t q_row_stride, const uint8_t *kv, bf16 *out,
                                  const int32_t *block_tables, const int32_t *context_lens,
                                  int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                                  int64_t block_size, int64_t num_layers, int64_t layer, float scale,
                                  int nthreads, int kind) {
    fp8_table_init();
    const int64_t W = D + KV8_SCALE_BYTES, half = block_size * KVH * W;
    decode_q8_job job = {q, kv, out, block_tables, context_lens, q_row_stride, H, KVH, D, max_blocks, block_size,
                         KVH * W, half, num_layers * 2 * half, layer * 2 * half, scale, kind};
    pool_run(decode_q8_chunk, &job, B * KVH, 1, nthreads);
}

/* Prefill over an 8-bit pool: the sequences' blocks of this layer are
 * dequantized (to bf16, as the torch reference does) into a one-layer bf16
 * scratch pool, then the variant's bf16 prefill kernel runs on it (it packs
 * K and V per head anyway, so this costs one more pass over the context).
 *
 * A prompt chunk (fresh[s] = 1; kernels/prefill_attention.py) takes its own
 * keys and values from the step's rows as computed (chunk_k / chunk_v, row
 * t beside query row t, chunk_stride apart) and only its cached prefix from
 * the pool, K with the shift added back, so every key it sees is unshifted:
 *
 *     scratch row of token p <  ctx - q_len   bf16(deq(pool row) (+ k_shift for K))
 *     scratch row of token p >= ctx - q_len   the chunk's own bf16 row, copied
 *
 * fresh NULL (or 0 for s): every key from the pool, shifted, as decode reads it. */
static void kv8_fill_scratch_block(bf16 *dst, const uint8_t *src, int64_t block_size, int64_t KVH, int64_t D,
                                   int kind, int64_t p0, int64_t chunk_from, int64_t chunk_end, int64_t chunk_row0,
                                   const bf16 *chunk_k, const bf16 *chunk_v, int64_t chunk_stride,
                                   const float *k_shift) {
    const int64_t W = D + KV8_SCALE_BYTES;
    for (int64_t r = 0; r < 2 * block_size * KVH; r++) {
        const int64_t is_v = r / (block_size * KVH), p = p0 + (r / KVH) % block_size, h = r % KVH;
        if (p >= chunk_from && p < chunk_end) {
            const bf16 *own = (is_v ? chunk_v : chunk_k) + (chunk_row0 + p - chunk_from) * chunk_stride + h * D;
            memcpy(dst + r * D, own, sizeof(bf16) * (size_t)D);
            continue;
        }
        const uint8_t *row = src + r * W;
        const float sc = kv8_scale(row, D);
        const float *add = is_v || !k_shift ? NULL : k_shift + h * D;
        for (int64_t d = 0; d < D; d++) {
            const float qv = kind == PD_KV_INT8 ? (float)(int8_t)row[d] : fp8_value[row[d]];
            dst[r * D + d] = to_bf16(add ? qv * sc + add[d] : qv * sc);
        }
    }
}

void pd_prefill_attention_q8(const bf16 *q, int64_t q_row_stride, const uint8_t *kv, bf16 *out,
                             const int32_t *block_tables, const int32_t *query_start_loc,
                             const int32_t *context_lens, int64_t S, int64_t H, int64_t KVH, int64_t D,
                             int64_t max_blocks, int64_t block_size, int64_t num_layers, int64_t layer,
                             float scale, int nthreads, int kind, const bf16 *chunk_k, const bf16 *chunk_v,
                             int64_t chunk_stride, const int32_t *fresh, const float *k_shift) {
    fp8_table_init();
    const int64_t W = D + KV8_SCALE_BYTES, half = block_size * KVH * W, rows = 2 * block_size * KVH;
    int64_t used = 0;
    for (int64_t s = 0; s < S; s++) used += (context_lens[s] + block_size - 1) / block_size;
    bf16 *scratch = (bf16 *)malloc(sizeof(bf16) * (size_t)((used ? used : 1) * rows * D));
    int32_t *tables = (int32_t *)calloc((size_t)(S * max_blocks > 0 ? S * max_blocks : 1), sizeof(int32_t));
    int64_t next = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t ctx = context_lens[s], nb = (ctx + block_size - 1) / block_size;
        const int own = fresh && fresh[s] && chunk_k && chunk_v;
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int64_t chunk_from = own ? ctx - q_len : ctx;  /* own chunk: tokens chunk_from .. ctx - 1 */
        for (int64_t j = 0; j < nb; j++, next++) {
            tables[s * max_blocks + j] = (int32_t)next;
            const uint8_t *src = kv + ((int64_t)block_tables[s * max_blocks + j] * num_layers + layer) * 2 * half;
            kv8_fill_scratch_block(scratch + next * rows * D, src, block_size, KVH, D, kind, j * block_size,
                                   chunk_from, ctx, query_start_loc[s], chunk_k, chunk_v,
                                   chunk_stride, own ? k_shift : NULL);
        }
    }
    pd_prefill_attention_bf16(q, q_row_stride, scratch, out, tables, query_start_loc, context_lens, S, H, KVH, D,
                              max_blocks, block_size, 1, 0, scale, nthreads);
    free(tables);
    free(scratch);
}

#endif
