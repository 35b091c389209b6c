/* The prefill-attention driver both native variants share (included by
 * cpu_kernels.c and cpu_kernels_avx2.c after their own pack_kv_head and
 * before their own prefill_attend_chunk): the job, the packing pass over
 * (sequence, kv head, PACK_TOKENS keys) items, and pd_prefill_attention_bf16,
 * which sizes the packs and the (sequence, query head, block of QB queries)
 * items and runs both passes on the work pool.  Needs bf16, TILE_N, QB,
 * pack_kv_head and pool_run.
 *
 * The packing pass reads every key of the context from the paged pool, one
 * block table entry at a time: split by key range, not only by kv head, so
 * that both threads pack (3 kv heads on 2 threads left one idle a third of
 * the pass), and each range prefetches its next block (pack_kv_head). */
#ifndef PD_PREFILL_DRIVER_H
#define PD_PREFILL_DRIVER_H

typedef struct {
    const bf16 *q, *kv;
    bf16 *out, *packs;
    const int32_t *block_tables, *query_start_loc, *context_lens;
    const int64_t *pack_off, *item_off, *pack_item_off;
    int64_t S, q_row_stride, H, KVH, D, max_blocks, block_size, G, tok_stride, half, block_stride, layer_off;
    float scale;
} prefill_job;

#define PACK_TOKENS 256  /* keys per packing item: a multiple of TILE_N (whole tiles, whole key pairs) */

/* items: (sequence, kv head, range of PACK_TOKENS keys), numbered by pack_item_off */
static void prefill_pack_chunk(void *arg, int64_t begin, int64_t end) {
    const prefill_job *a = (const prefill_job *)arg;
    int64_t s = 0;
    for (int64_t item = begin; item < end; item++) {
        while (a->pack_item_off[s + 1] <= item) s++;
        const int64_t ctx = a->context_lens[s], ctx_pad = (ctx + TILE_N - 1) / TILE_N * TILE_N;
        const int64_t ranges = (ctx_pad + PACK_TOKENS - 1) / PACK_TOKENS, local = item - a->pack_item_off[s];
        const int64_t h = local / ranges, t0 = (local % ranges) * PACK_TOKENS;
        const int64_t t1 = t0 + PACK_TOKENS < ctx_pad ? t0 + PACK_TOKENS : ctx_pad;
        bf16 *kp = a->packs + a->pack_off[s] + 2 * h * ctx_pad * a->D;
        pack_kv_head(a->kv, a->block_tables + s * a->max_blocks, t0, t1, ctx, ctx_pad, a->D, a->block_size,
                     a->block_stride, a->layer_off + h * a->D, a->tok_stride, a->half, kp, kp + ctx_pad * a->D);
    }
}

static void prefill_attend_chunk(void *arg, int64_t begin, int64_t end);

void pd_prefill_attention_bf16(const bf16 *q, int64_t q_row_stride, const bf16 *kv, bf16 *out,
                               const int32_t *block_tables, const int32_t *query_start_loc,
                               const int32_t *context_lens, int64_t S, int64_t H, int64_t KVH, int64_t D,
                               int64_t max_blocks, int64_t block_size, int64_t num_layers, int64_t layer,
                               float scale, int nthreads) {
    const int64_t half = block_size * KVH * D;
    int64_t *pack_off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * S + 3));
    int64_t *item_off = pack_off + S + 1, *pack_item_off = item_off + S + 1;
    pack_off[0] = item_off[0] = pack_item_off[0] = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t ctx_pad = (context_lens[s] + TILE_N - 1) / TILE_N * TILE_N;
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        pack_off[s + 1] = pack_off[s] + 2 * KVH * ctx_pad * D;
        item_off[s + 1] = item_off[s] + H * ((q_len + QB - 1) / QB);
        pack_item_off[s + 1] = pack_item_off[s] + KVH * ((ctx_pad + PACK_TOKENS - 1) / PACK_TOKENS);
    }
    bf16 *packs = (bf16 *)malloc(sizeof(bf16) * (size_t)(pack_off[S] > 0 ? pack_off[S] : 1));
    prefill_job job = {q, kv, out, packs, block_tables, query_start_loc, context_lens, pack_off, item_off,
                       pack_item_off, S,
                       q_row_stride, H, KVH, D, max_blocks, block_size, H / KVH, KVH * D, half,
                       num_layers * 2 * half, layer * 2 * half, scale};
    pool_run(prefill_pack_chunk, &job, pack_item_off[S], 1, nthreads);
    pool_run(prefill_attend_chunk, &job, item_off[S], 1, nthreads);
    free(packs);
    free(pack_off);
}

#endif
