/* Software prefetch of a block's rows (``cols`` bf16 elements of each, ``stride``
 * apart) for the paged attention kernels: the hardware prefetcher does not
 * follow a block table.  Into L1 for the block read next, into L2 for the one
 * after (L1 alone keeps too few lines in flight to cover DRAM's latency). */
#ifndef PD_PREFETCH_ROWS_H
#define PD_PREFETCH_ROWS_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16_scalar.h"

static inline void prefetch_rows(const bf16 *p, int64_t rows, int64_t stride, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += 32) _mm_prefetch((const char *)(p + r * stride + c), _MM_HINT_T0);
}

static inline void prefetch_rows_l2(const bf16 *p, int64_t rows, int64_t stride, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += 32) _mm_prefetch((const char *)(p + r * stride + c), _MM_HINT_T1);
}

#endif
