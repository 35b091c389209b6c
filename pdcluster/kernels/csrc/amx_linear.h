/* The packed linear on AMX tiles (Sapphire Rapids and later), for the
 * amx_bf16 variant: cpu_kernels.c compiled with -DPD_AMX.
 *
 * The packed weight layout of pd_linear_packed_bf16 is already what
 * TDPBF16PS reads as its B operand: a tile row is one k pair of 16 output
 * columns, 64 bytes, and consecutive k pairs of a 32-column tile sit 128
 * bytes apart, so B tiles load straight from wp (no second copy of the
 * weights).  x rows load as A tiles (16 rows x 32 k), stride K:
 *
 *     wp[j][p][c][e]     B tile (j, half h, k0):  rows p = k0/2 .. k0/2+15,
 *       128 B per p       64 B from wp[j][p][16 h], stride 128 B
 *
 *     one 32 x 32 block of y:  C0 C1   += A0 x (B0 B1)       A0: x rows m .. m+15
 *                              C2 C3      A1                  A1: x rows m+16 .. m+31
 *
 * Tile state is per thread and other code in the process (oneDNN) configures
 * it too, so every chunk loads its own configuration and releases the tiles
 * when done.  Linux hands out the tile state only after
 * arch_prctl(ARCH_REQ_XCOMP_PERM); where that fails the AVX-512 path runs.
 *
 * Which rows take this path: M >= AMX_MIN_ROWS (and K % 32 == 0), measured
 * on a 2-core Sapphire Rapids (kernels/cpu_native.py has the figures;
 * kernels.cpu_native.linear_path mirrors the rule).  The prefill attention
 * (cpu_kernels.c, prefill_attend_chunk) runs its q K^T and P V on
 * amx_rows_times_tiles over the same packed K / V layout. */
#ifndef PD_AMX_LINEAR_H
#define PD_AMX_LINEAR_H

#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_K 32          /* bf16 k per A tile row */
#define AMX_ROWS 16       /* rows per A / C tile */
#ifndef AMX_M_BLOCK
#define AMX_M_BLOCK 256   /* x rows per work item, as M_BLOCK (measured: 512 and 1024 no faster) */
#endif
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 1    /* every row count: a row's sum must not depend on the batch it came in (exact
                           * resume replays decode steps one row at a time), and one row is faster on the
                           * tiles too (measured; kernels/cpu_native.py) */
#endif

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

/* 1 once this process may use the tiles, -1 if the kernel refused, 0 not asked yet. */
static _Atomic int amx_state = 0;

int pd_amx_ready(void) {
    int s = atomic_load(&amx_state);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&amx_state, s);
    }
    return s > 0;
}

/* 1 when pd_linear_packed_bf16 runs M x K -> N on the tiles, else 0. */
int pd_linear_uses_amx(int64_t M, int64_t N, int64_t K) {
    return M >= AMX_MIN_ROWS && K % AMX_K == 0 && N % TILE_N == 0 && pd_amx_ready();
}

/* C0..C3 = tmm0..3, A0 A1 = tmm4 5, B0 B1 = tmm6 7; r0, r1: rows of A0 and A1 (r1 may be 0). */
static void amx_configure(int r0, int r1) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, AMX_ROWS, AMX_ROWS};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* y rows [0, r0 + r1) of the 32-column tile wt from x rows [0, r0 + r1)
 * (row stride ldx, K columns; r0 = 16 when r1 > 0), in bf16 (y) or, when
 * yf is given, fp32 (yf), row stride ldy.  Needs amx_configure(r0, r1). */
static inline void amx_block(const bf16 *x, int64_t ldx, int64_t K, const bf16 *wt, const bf16 *bias, bf16 *y,
                             float *yf, int64_t ldy, int r0, int r1) {
    float c[2 * AMX_ROWS][TILE_N] __attribute__((aligned(64)));
    const int64_t x_bytes = ldx * (int64_t)sizeof(bf16), w_bytes = 2 * TILE_N * (int64_t)sizeof(bf16);
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < K; k0 += AMX_K) {
        const bf16 *b = wt + (k0 / 2) * 2 * TILE_N;
        _tile_loadd(6, b, w_bytes);
        _tile_loadd(7, b + TILE_N, w_bytes);
        _tile_loadd(4, x + k0, x_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (r1) {
            _tile_loadd(5, x + AMX_ROWS * ldx + k0, x_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (yf && !bias) {  /* fp32 out: the tiles store straight into y (attention scores) */
        const int64_t y_bytes = ldy * (int64_t)sizeof(float);
        _tile_stored(0, yf, y_bytes);
        _tile_stored(1, yf + 16, y_bytes);
        if (r1) {
            _tile_stored(2, yf + AMX_ROWS * ldy, y_bytes);
            _tile_stored(3, yf + AMX_ROWS * ldy + 16, y_bytes);
        }
        return;
    }
    _tile_stored(0, &c[0][0], TILE_N * sizeof(float));
    _tile_stored(1, &c[0][16], TILE_N * sizeof(float));
    if (r1) {
        _tile_stored(2, &c[AMX_ROWS][0], TILE_N * sizeof(float));
        _tile_stored(3, &c[AMX_ROWS][16], TILE_N * sizeof(float));
    }
    const __m512 b0 = bias ? load16(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load16(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < r0 + r1; r++)
        store_row32(y, yf, r * ldy, _mm512_add_ps(_mm512_load_ps(c[r]), b0),
                    _mm512_add_ps(_mm512_load_ps(c[r] + 16), b1));
}

/* Rows [0, M) of x times `tiles` packed 32-column tiles, `tile_elems` bf16
 * apart from wp: y (bf16) or yf (fp32), row stride ldy, tile j at column 32 j.
 * Configures the tiles itself; the caller releases them. */
static void amx_rows_times_tiles(int64_t M, const bf16 *x, int64_t ldx, int64_t K, const bf16 *wp,
                                 int64_t tile_elems, int64_t tiles, const bf16 *bias, bf16 *y, float *yf,
                                 int64_t ldy, int *cfg) {
    for (int64_t m = 0; m < M; m += 2 * AMX_ROWS) {
        const int64_t left = M - m;
        const int r0 = left < AMX_ROWS ? (int)left : AMX_ROWS;
        const int r1 = left - r0 < AMX_ROWS ? (int)(left - r0) : AMX_ROWS;
        if (r0 != cfg[0] || r1 != cfg[1]) amx_configure(cfg[0] = r0, cfg[1] = r1);
        for (int64_t j = 0; j < tiles; j++)
            amx_block(x + m * ldx, ldx, K, wp + j * tile_elems, bias ? bias + j * TILE_N : NULL,
                      y ? y + m * ldy + j * TILE_N : NULL, yf ? yf + m * ldy + j * TILE_N : NULL, ldy, r0, r1);
    }
}

/* How many 32-column tiles share one work item: as many as keep their
 * packed weights within AMX_GROUP_BYTES (so they stay in the core's L2 while
 * the item's x rows pass over them), halved until each thread has about
 * AMX_ITEMS_PER_THREAD items to balance.  One tile an item read gate_up's
 * 3.5 MB of weights from L3 once per 256-row block.  Measured in the engine
 * on a 2-core Sapphire Rapids VM (8 prompts of 1,024 tokens in 1,024-token
 * steps, 2 threads, three alternations with the one-tile items): the
 * projections took 2.94-3.03 s of three runs against 3.59-3.72, the whole
 * prefill 5.4-5.6 s against 6.1-6.3; a lone 3,072-token prompt 0.95 s
 * against 1.10.  256 KB groups, or 8 items a thread at 4 or 16, or 128- or
 * 512-row blocks: no better (1 MB the same). */
#ifndef AMX_GROUP_BYTES
#define AMX_GROUP_BYTES (1 << 19)
#endif
#define AMX_ITEMS_PER_THREAD 8
#define AMX_GROUP_MIN_ROWS 128  /* fewer rows (decode steps) read each weight once anyway: one tile an item */

static int64_t amx_tiles_per_item(int64_t M, int64_t K, int64_t tiles, int nthreads) {
    if (M < AMX_GROUP_MIN_ROWS) return 1;
    int64_t group = AMX_GROUP_BYTES / (K * TILE_N * (int64_t)sizeof(bf16));  /* a packed tile: K x 32 bf16 */
    if (group < 1) group = 1;
    if (group > tiles) group = tiles;
    const int64_t row_blocks = (M + AMX_M_BLOCK - 1) / AMX_M_BLOCK;
    const int64_t wanted = (int64_t)AMX_ITEMS_PER_THREAD * (nthreads > 0 ? nthreads : 1);
    while (group > 1 && row_blocks * ((tiles + group - 1) / group) < wanted) group = (group + 1) / 2;
    return group;
}

typedef struct {
    const linear_job *job;
    int64_t group;  /* tiles per item */
} amx_linear_job;

/* items: (group of tiles, block of AMX_M_BLOCK rows), group-major; inside an
 * item each 32-row step runs across the group's tiles.  A y block is the same
 * amx_block over the whole K whatever the grouping, so a row's sums do not
 * depend on it. */
static void amx_linear_chunk(void *arg, int64_t begin, int64_t end) {
    const amx_linear_job *g = (const amx_linear_job *)arg;
    const linear_job *a = g->job;
    int cfg[2] = {-1, -1};
    const int64_t tile_elems = (a->K / 2) * 2 * TILE_N, row_blocks = (a->M + AMX_M_BLOCK - 1) / AMX_M_BLOCK;
    for (int64_t item = begin; item < end; item++) {
        const int64_t j0 = item / row_blocks * g->group, mb = item % row_blocks;
        const int64_t j1 = j0 + g->group < a->tiles ? j0 + g->group : a->tiles;
        const int64_t m0 = mb * AMX_M_BLOCK, m_end = m0 + AMX_M_BLOCK < a->M ? m0 + AMX_M_BLOCK : a->M;
        amx_rows_times_tiles(m_end - m0, a->x + m0 * a->K, a->K, a->K, a->wp + j0 * tile_elems, tile_elems, j1 - j0,
                             a->bias ? a->bias + j0 * TILE_N : NULL, a->y + m0 * a->N + j0 * TILE_N, NULL, a->N, cfg);
    }
    _tile_release();
}

/* Runs x [M, K] times the packed weight on the tiles (pd_linear_uses_amx said yes). */
static void amx_linear(const linear_job *job, int nthreads) {
    const amx_linear_job g = {job, amx_tiles_per_item(job->M, job->K, job->tiles, nthreads)};
    const int64_t items = (job->M + AMX_M_BLOCK - 1) / AMX_M_BLOCK * ((job->tiles + g.group - 1) / g.group);
    pool_run(amx_linear_chunk, (void *)&g, items, pool_chunk(items, nthreads, 8), nthreads);
}

#endif
