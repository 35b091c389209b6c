/* The greedy choice over a step's fp32 logits: each row's argmax (the first
 * index of its largest value, as torch.argmax breaks ties) and whether the
 * row holds only finite values, in one pass over the row plus a search for
 * the first index of the maximum.  torch's own argmax and isfinite().all()
 * took 0.8 ms and 1.5 ms for 16 rows of 49,152 on one thread (a 2-vCPU AMD
 * EPYC): a tenth of a 16-stream decode step.
 *
 * AVX2 intrinsics, so both variants (cpu_kernels.c, cpu_kernels_avx2.c)
 * include it.  A row with a NaN or an infinity is reported not finite; its
 * argmax is then whatever the maximum pass saw (callers drop it). */
#ifndef PD_LOGITS_ARGMAX_H
#define PD_LOGITS_ARGMAX_H

static int64_t argmax_row_f32(const float *x, int64_t n, int32_t *finite) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 top = _mm256_set1_ps(-INFINITY), bad = zero;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        top = _mm256_max_ps(top, v);
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v, zero));  /* 0 * (NaN or +-inf) is NaN, and NaN stays */
    }
    float lanes_top[8], lanes_bad[8];
    _mm256_storeu_ps(lanes_top, top);
    _mm256_storeu_ps(lanes_bad, bad);
    float m = -INFINITY, b = 0.f;
    for (int l = 0; l < 8; l++) {
        m = lanes_top[l] > m ? lanes_top[l] : m;
        b += lanes_bad[l];
    }
    for (; j < n; j++) {
        m = x[j] > m ? x[j] : m;
        b += x[j] * 0.f;
    }
    *finite = b == 0.f;  /* false for NaN */
    const __m256 want = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= n; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), want, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < n; j++)
        if (x[j] == m) return j;
    return 0;  /* no value equals the maximum: a row of NaNs (not finite) */
}

typedef struct {
    const float *x;
    int64_t n, *index;
    int32_t *finite;
} argmax_job;

static void argmax_chunk(void *arg, int64_t begin, int64_t end) {
    const argmax_job *a = (const argmax_job *)arg;
    for (int64_t r = begin; r < end; r++) a->index[r] = argmax_row_f32(a->x + r * a->n, a->n, a->finite + r);
}

/* x [rows, n] fp32, contiguous: index[r] = argmax of row r, finite[r] = 1 when
 * every value of row r is finite, else 0. */
void pd_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *index, int32_t *finite, int nthreads) {
    argmax_job job = {x, n, index, finite};
    pool_run(argmax_chunk, &job, rows, 1, nthreads);
}

#endif
