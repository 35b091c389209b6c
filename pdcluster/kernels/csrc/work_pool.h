/* A work pool that never waits on a thread that is not working.
 *
 * The serving process shares its cores with the gateway, the Serve proxy and
 * the replica's own event loop.  With an OpenMP team every parallel loop ends
 * in a barrier that waits for all threads, so one preempted thread stalls the
 * whole step (measured: a 16-sequence decode step ran 2.3x slower inside a
 * replica than alone).  Here the calling thread claims chunks of the work
 * itself, helpers claim chunks when they happen to be running, and the caller
 * waits only for chunks that a helper has actually claimed:
 *
 *     cursor = job << 40 | next item       (claims are CAS on both, so a late
 *                                            helper cannot claim a newer job's work)
 *     caller: publish job, wake helpers, claim until done, wait for claimed chunks
 *     helper: spin briefly for a job, else sleep on a futex
 */
#ifndef PD_WORK_POOL_H
#define PD_WORK_POOL_H

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*pd_chunk_fn)(void *ctx, int64_t begin, int64_t end);

#define POOL_MAX_HELPERS 15
#define POOL_SPIN 20000             /* pause loops a helper waits for the next job before sleeping */
#define POOL_YIELD_EVERY 64         /* a spinning helper yields its core this often to any runnable thread
                                       (event loop, gateway): c16 served 544 -> 586 tok/s */
#define ITEM_BITS 40
#define ITEM_MASK ((1ull << ITEM_BITS) - 1)
#define JOB_MASK 0xffffffu /* job ids live in the cursor's top 24 bits */

static struct {
    pthread_mutex_t start_lock;
    pthread_mutex_t run_lock;       /* one job at a time; other callers run alone */
    int helpers;                    /* started so far */
    _Atomic uint32_t job;           /* futex word: the current job's id */
    _Atomic int64_t sleepers;
    _Atomic uint64_t cursor;        /* job << ITEM_BITS | next unclaimed item */
    _Atomic int64_t done;           /* items finished in the current job */
    _Atomic int wanted;             /* helpers invited to the current job */
    pd_chunk_fn fn;
    void *ctx;
    int64_t n, chunk;
} pool = {.start_lock = PTHREAD_MUTEX_INITIALIZER, .run_lock = PTHREAD_MUTEX_INITIALIZER};

/* Claims and runs chunks of job ``job`` until none is left; returns items run. */
static int64_t pool_work(uint32_t job, pd_chunk_fn fn, void *ctx, int64_t n, int64_t chunk) {
    int64_t ran = 0;
    uint64_t cur = atomic_load_explicit(&pool.cursor, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(cur >> ITEM_BITS) != job) return ran;
        const int64_t begin = (int64_t)(cur & ITEM_MASK);
        if (begin >= n) return ran;
        const int64_t end = begin + chunk < n ? begin + chunk : n;
        if (!atomic_compare_exchange_weak_explicit(&pool.cursor, &cur, ((uint64_t)job << ITEM_BITS) | (uint64_t)end,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        fn(ctx, begin, end);
        atomic_fetch_add_explicit(&pool.done, end - begin, memory_order_release);
        ran += end - begin;
        cur = atomic_load_explicit(&pool.cursor, memory_order_acquire);
    }
}

static void *pool_helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.job);
    for (;;) {
        uint32_t job = atomic_load_explicit(&pool.job, memory_order_acquire);
        for (int spin = 0; job == seen && spin < POOL_SPIN; spin++) {
            if (spin % POOL_YIELD_EVERY == POOL_YIELD_EVERY - 1) sched_yield();
            _mm_pause();
            job = atomic_load_explicit(&pool.job, memory_order_acquire);
        }
        if (job == seen) {
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.job, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            continue;
        }
        seen = job;
        if (index >= atomic_load_explicit(&pool.wanted, memory_order_acquire)) continue;
        /* fields read before the claim; a successful claim on ``job`` proves they were job's */
        pool_work(job, pool.fn, pool.ctx, pool.n, pool.chunk);
    }
    return NULL;
}

static void pool_start_helpers(int count) {
    pthread_mutex_lock(&pool.start_lock);
    while (pool.helpers < count && pool.helpers < POOL_MAX_HELPERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, pool_helper, (void *)(intptr_t)pool.helpers) != 0) break;
        pool.helpers++;
    }
    pthread_mutex_unlock(&pool.start_lock);
}

/* fn over [0, n) in chunks of ``chunk`` items on up to ``nthreads`` threads
 * (the caller included).  While one caller's job runs, any other caller
 * (a second engine in the process) runs its work on its own thread. */
static void pool_run(pd_chunk_fn fn, void *ctx, int64_t n, int64_t chunk, int nthreads) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if (nthreads <= 1 || n <= chunk || pthread_mutex_trylock(&pool.run_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (pool.helpers < nthreads - 1) pool_start_helpers(nthreads - 1);
    const uint32_t job = (atomic_load(&pool.job) + 1) & JOB_MASK;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.wanted, nthreads - 1, memory_order_relaxed);
    atomic_store_explicit(&pool.cursor, (uint64_t)job << ITEM_BITS, memory_order_release);
    atomic_store_explicit(&pool.job, job, memory_order_release);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.job, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    pool_work(job, fn, ctx, n, chunk);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n) _mm_pause();
    pthread_mutex_unlock(&pool.run_lock);
}

/* Chunk size giving each of nthreads threads about ``per_thread`` chunks. */
static inline int64_t pool_chunk(int64_t n, int nthreads, int per_thread) {
    const int64_t c = n / ((int64_t)(nthreads > 0 ? nthreads : 1) * per_thread);
    return c > 0 ? c : 1;
}

#endif
