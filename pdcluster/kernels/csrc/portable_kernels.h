/* The ISA-independent kernels every variant shares, included at the end of
 * each variant's source (cpu_kernels.c, cpu_kernels_avx2.c) after its own
 * pd_linear_packed_bf16, attention, norm and activation kernels: weight
 * packing, RoPE, the KV write, and the decoder stack composed of them all.
 * Needs TILE_N (32) and bf16_scalar.h. */
#ifndef PD_PORTABLE_KERNELS_H
#define PD_PORTABLE_KERNELS_H

#include "kv8_kernels.h"
#include "int8_linear.h"

/* W[N, K] -> wp[N / 32][K / 2][32][2] (the layout drawn above pd_linear_packed_bf16) */
void pd_pack_weight_bf16(const bf16 *w, bf16 *wp, int64_t N, int64_t K) {
    const int64_t kp = K / 2;
    for (int64_t j = 0; j < N / TILE_N; j++)
        for (int64_t p = 0; p < kp; p++)
            for (int64_t c = 0; c < TILE_N; c++) {
                bf16 *dst = wp + ((j * kp + p) * TILE_N + c) * 2;
                const bf16 *src = w + (j * TILE_N + c) * K + 2 * p;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#ifndef PD_VARIANT_ROPE /* a variant may define its own rope_rows, vectorised, with the same rounding */
/* Rotate-half RoPE in place on the heads of rows [t0, t1) of one row-strided
 * tensor, with HF's bf16 rounding steps: out1 = bf16(bf16(x1*c) + bf16(-x2*s)),
 * out2 = bf16(bf16(x2*c) + bf16(x1*s)), c and s rounded to bf16 first. */
static void rope_rows(bf16 *x, int64_t row_stride, int64_t t0, int64_t t1, int64_t heads, int64_t D,
                      const int64_t *positions, const float *cos_cache, const float *sin_cache) {
    const int64_t hd = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos_cache + positions[t] * D, *s = sin_cache + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            bf16 *p = x + t * row_stride + h * D;
            for (int64_t i = 0; i < hd; i++) {
                const float x1 = to_f32(p[i]), x2 = to_f32(p[i + hd]);
                const float c1 = to_f32(to_bf16(c[i])), s1 = to_f32(to_bf16(s[i]));
                const float c2 = to_f32(to_bf16(c[i + hd])), s2 = to_f32(to_bf16(s[i + hd]));
                const float o1 = to_f32(to_bf16(x1 * c1)) + to_f32(to_bf16(-x2 * s1));
                const float o2 = to_f32(to_bf16(x2 * c2)) + to_f32(to_bf16(x1 * s2));
                p[i] = to_bf16(o1);
                p[i + hd] = to_bf16(o2);
            }
        }
    }
}
#endif

/* RoPE on every row, on the calling thread (the ctypes entry point). */
void pd_rope_bf16(bf16 *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D,
                  const int64_t *positions, const float *cos_cache, const float *sin_cache) {
    rope_rows(x, row_stride, 0, T, heads, D, positions, cos_cache, sin_cache);
}

typedef struct {
    bf16 *x;
    int64_t row_stride, heads, D;
    const int64_t *positions;
    const float *cos_cache, *sin_cache;
} rope_job;

static void rope_chunk(void *arg, int64_t begin, int64_t end) {
    const rope_job *a = (const rope_job *)arg;
    rope_rows(a->x, a->row_stride, begin, end, a->heads, a->D, a->positions, a->cos_cache, a->sin_cache);
}

/* RoPE on the work pool, rows split between the threads (a prefill step's
 * q and k heads of 1,024 tokens took 7% of its time on one thread). */
static void rope_threaded(bf16 *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D, const int64_t *positions,
                          const float *cos_cache, const float *sin_cache, int nthreads) {
    rope_job job = {x, row_stride, heads, D, positions, cos_cache, sin_cache};
    pool_run(rope_chunk, &job, T, T > 16 ? pool_chunk(T, nthreads, 2) : T, nthreads);
}

/* H x / sqrt(D) in place on each of the first ``heads`` heads of every row
 * (H: D x D Sylvester Hadamard, D a power of two): q and K of an 8-bit pool,
 * right after RoPE (kernels/kv_rotation.py).  Bit-exact with rotate_heads:
 * fp32 butterflies (a + b, a - b) in the same stage order, adds only (no
 * FMA to contract), then one multiply by 1.f / sqrtf(D), rounded once. */
void pd_hadamard_rows_bf16(bf16 *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D) {
    const float norm = 1.f / sqrtf((float)D);
    float y[D];
    for (int64_t t = 0; t < T; t++)
        for (int64_t hd = 0; hd < heads; hd++) {
            bf16 *p = x + t * row_stride + hd * D;
            for (int64_t i = 0; i < D; i++) y[i] = to_f32(p[i]);
            for (int64_t h = 1; h < D; h *= 2)
                for (int64_t i = 0; i < D; i += 2 * h)
                    for (int64_t j = i; j < i + h; j++) {
                        const float a = y[j], b = y[j + h];
                        y[j] = a + b;
                        y[j + h] = a - b;
                    }
            for (int64_t i = 0; i < D; i++) p[i] = to_bf16(y[i] * norm);
        }
}

/* K and V rows of the step's tokens (row-strided views) into their slots. */
void pd_write_kv_bf16(bf16 *kv, const bf16 *k, const bf16 *v, int64_t row_stride, const int64_t *slots,
                      int64_t T, int64_t KVH, int64_t D, int64_t block_size, int64_t num_layers, int64_t layer) {
    const int64_t half = block_size * KVH * D;
    const size_t row_bytes = sizeof(bf16) * (size_t)(KVH * D);
    for (int64_t t = 0; t < T; t++) {
        const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
        bf16 *dst = kv + (blk * num_layers + layer) * 2 * half + off * KVH * D;
        memcpy(dst, k + t * row_stride, row_bytes);
        memcpy(dst + half, v + t * row_stride, row_bytes);
    }
}

/* One whole Llama decoder layer on the step's tokens, composed of the kernels
 * above; pd_decoder_stack_bf16 runs every layer in one call from Python:
 *
 *     normed = rmsnorm(residual += prev)       (prev NULL: layer 0, no add)
 *     q, k, v = split(normed @ Wqkv + bias);  rope(q, k);  (8-bit pool, k_rotate: q, k = H q, H k)
 *     kv[slots] = k, v
 *     attn = decode attention (first n_decode tokens) | prefill attention (the rest;
 *            over an 8-bit pool a prompt chunk reads its own k, v from here, not the pool)
 *     normed = rmsnorm(residual += attn @ Wo)
 *     out = (silu(normed @ Wgate) * (normed @ Wup)) @ Wdown
 *
 * Weights packed by pd_pack_weight_bf16, or as int8 (int8_linear.h, s->weight_kind); buffers are the caller's scratch. */
typedef struct {
    const bf16 *ln1, *w_qkv, *b_qkv, *w_o, *ln2, *w_gate_up, *w_down;
} pd_layer_weights;

typedef struct {
    int64_t T, hidden, inter, H, KVH, D, num_layers, block_size;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    int64_t n_decode, decode_max_blocks;
    const int32_t *decode_tables, *decode_lens;
    int64_t n_prefill_seqs, prefill_max_blocks;
    const int32_t *prefill_tables, *prefill_starts, *prefill_lens;
    float scale, eps;
    int nthreads;
    bf16 *normed, *qkv, *attn, *proj, *gate_up, *act;  /* scratch */
    int64_t kv_kind;  /* PD_KV_BF16 | PD_KV_INT8 | PD_KV_FP8: the pool's format (kv8_kernels.h) */
    const float *k_shift;  /* NULL, or [num_layers, KVH, D] fp32: K smoothing of an 8-bit pool */
    const int32_t *prefill_fresh;  /* NULL, or [n_prefill_seqs]: 1 = a prompt chunk, attends to its own K/V as
                                    * computed over an 8-bit pool (kv8_kernels.h), 0 = reads the pool */
    int64_t k_rotate;  /* 1: an 8-bit pool's q and K turn by pd_hadamard_rows_bf16 after RoPE (k_shift is then H b) */
    int64_t weight_kind;  /* PD_WEIGHTS_*: how the projections are packed (int8: int8_linear.h) */
} pd_layer_step;

enum { PD_WEIGHTS_BF16 = 0, PD_WEIGHTS_INT8 = 1, PD_WEIGHTS_INT8_4BIT = 2 };  /* int8: groups of 32, int8_linear.h */

/* One projection of the stack, in the step's weight format. */
static void layer_linear(const pd_layer_step *s, const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y,
                         int64_t N, int64_t K) {
    if (s->weight_kind == PD_WEIGHTS_BF16)
        pd_linear_packed_bf16(x, w, bias, y, s->T, N, K, s->nthreads);
    else
        pd_linear_int8(x, (const int8_t *)w, bias, y, NULL, s->T, N, K, s->weight_kind == PD_WEIGHTS_INT8_4BIT ? 4 : 8,
                       s->nthreads);
}

static void decoder_layer(const pd_layer_weights *w, const pd_layer_step *s, bf16 *kv, int64_t layer,
                           const bf16 *prev, bf16 *residual, bf16 *out) {
    const int64_t T = s->T, qs = s->H * s->D, kvs = s->KVH * s->D, width = qs + 2 * kvs;
    pd_add_rmsnorm_bf16(prev, residual, w->ln1, s->normed, T, s->hidden, s->eps, s->nthreads);
    layer_linear(s, s->normed, w->w_qkv, w->b_qkv, s->qkv, width, s->hidden);
    /* q's heads and k's follow one another in a row: one pass over both */
    rope_threaded(s->qkv, width, T, s->H + s->KVH, s->D, s->positions, s->cos, s->sin, s->nthreads);
    const int q8 = (int)s->kv_kind;
    if (q8 && s->k_rotate) pd_hadamard_rows_bf16(s->qkv, width, T, s->H + s->KVH, s->D);  /* q | k heads */
    if (q8)
        pd_write_kv_q8((uint8_t *)kv, s->qkv + qs, s->qkv + qs + kvs, width, s->slots, T, s->KVH, s->D,
                       s->block_size, s->num_layers, layer, q8, s->k_shift ? s->k_shift + layer * kvs : NULL);
    else
        pd_write_kv_bf16(kv, s->qkv + qs, s->qkv + qs + kvs, width, s->slots, T, s->KVH, s->D, s->block_size,
                         s->num_layers, layer);
    if (s->n_decode && q8)
        pd_paged_decode_attention_q8(s->qkv, width, (const uint8_t *)kv, s->attn, s->decode_tables, s->decode_lens,
                                     s->n_decode, s->H, s->KVH, s->D, s->decode_max_blocks, s->block_size,
                                     s->num_layers, layer, s->scale, s->nthreads, q8);
    else if (s->n_decode)
        pd_paged_decode_attention_bf16(s->qkv, width, kv, s->attn, s->decode_tables, s->decode_lens, s->n_decode,
                                       s->H, s->KVH, s->D, s->decode_max_blocks, s->block_size, s->num_layers,
                                       layer, s->scale, s->nthreads);
    if (s->n_prefill_seqs && q8) {
        const bf16 *rows = s->qkv + s->n_decode * width;  /* the prefill part's q | k | v rows */
        pd_prefill_attention_q8(rows, width, (const uint8_t *)kv, s->attn + s->n_decode * qs,
                                s->prefill_tables, s->prefill_starts, s->prefill_lens, s->n_prefill_seqs, s->H,
                                s->KVH, s->D, s->prefill_max_blocks, s->block_size, s->num_layers, layer,
                                s->scale, s->nthreads, q8, rows + qs, rows + qs + kvs, width, s->prefill_fresh,
                                s->k_shift ? s->k_shift + layer * kvs : NULL);
    }
    else if (s->n_prefill_seqs)
        pd_prefill_attention_bf16(s->qkv + s->n_decode * width, width, kv, s->attn + s->n_decode * qs,
                                  s->prefill_tables, s->prefill_starts, s->prefill_lens, s->n_prefill_seqs, s->H,
                                  s->KVH, s->D, s->prefill_max_blocks, s->block_size, s->num_layers, layer,
                                  s->scale, s->nthreads);
    layer_linear(s, s->attn, w->w_o, NULL, s->proj, s->hidden, qs);
    pd_add_rmsnorm_bf16(s->proj, residual, w->ln2, s->normed, T, s->hidden, s->eps, s->nthreads);
    layer_linear(s, s->normed, w->w_gate_up, NULL, s->gate_up, 2 * s->inter, s->hidden);
    pd_silu_mul_bf16(s->gate_up, s->act, T, s->inter, s->nthreads);
    layer_linear(s, s->act, w->w_down, NULL, out, s->hidden, s->inter);
}

/* The whole stack in one call, so the engine thread releases Python's GIL
 * once per step instead of once per layer: layer i reads the previous
 * layer's output and writes out[i % 2]; the last output is out[(n - 1) % 2]. */
void pd_decoder_stack_bf16(const pd_layer_weights *layers, int64_t n_layers, const pd_layer_step *s, bf16 *kv,
                           bf16 *residual, bf16 *out0, bf16 *out1) {
    bf16 *outs[2] = {out0, out1};
    for (int64_t i = 0; i < n_layers; i++)
        decoder_layer(&layers[i], s, kv, i, i ? outs[(i - 1) % 2] : NULL, residual, outs[i % 2]);
}

#endif
