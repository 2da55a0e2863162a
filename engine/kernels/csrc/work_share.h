/* Work split between OpenMP threads by claiming, not by a fixed share.
 *
 * On a shared machine the CPUs of one process do not run at one speed: one vCPU of a VM can run
 * markedly slower than the other for seconds at a time, and a server's other processes take
 * time slices from one engine thread at a time (docs/performance.md, item 28). With a fixed share
 * each, a parallel region lasts as long as the slower thread's share while the faster one waits
 * at the barrier. Here the threads claim the items [0, n) as they go, so a faster one takes more.
 *
 * Claims come from both ends: even thread ids take items from the front, odd ones from the back,
 * so with two threads each one's items form one contiguous run (one stream of a packed weight,
 * which the prefetchers follow) and the two runs meet wherever the speeds put the boundary. A
 * claim takes a 2 * num_threads'th of what is left (guided): large first claims keep the runs
 * long, small last ones let the faster thread finish the rest.
 *
 * Invariant: every item is handed out exactly once. Both ends' counts live in one atomic word
 * (front in the low 32 bits, back in the high), advanced by compare-and-swap only while
 * front + back <= n, so the front's items [0, front) never meet the back's [n - back, n). The
 * word lives in the caller's frame, shared by the region's threads, and starts at zero for
 * every region. */
#ifndef PREFIXSERVE_WORK_SHARE_H
#define PREFIXSERVE_WORK_SHARE_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    _Atomic uint64_t ends; /* items taken from the front (low 32 bits) and from the back */
    int64_t n;
    int num_threads;
} work_share;

/* Items [0, n) (n < 2^31) for a region of num_threads threads. */
static inline void work_share_init(work_share *w, int64_t n, int num_threads) {
    atomic_init(&w->ends, 0);
    w->n = n;
    w->num_threads = num_threads > 0 ? num_threads : 1;
}

/* Claims the next chunk for thread tid: items [*begin, *end), a 2 * num_threads'th of what is
 * left (at least one item), from the front for an even tid, from the back for an odd one.
 * Returns 0 when nothing is left. */
static inline int work_share_claim(work_share *w, int tid, int64_t *begin, int64_t *end) {
    uint64_t old = atomic_load_explicit(&w->ends, memory_order_relaxed);
    for (;;) {
        const int64_t f = (int64_t)(old & 0xffffffffu), b = (int64_t)(old >> 32);
        const int64_t left = w->n - f - b;
        if (left <= 0) return 0;
        int64_t take = left / (2 * w->num_threads);
        if (take < 1) take = 1;
        const uint64_t next = (tid & 1) ? old + ((uint64_t)take << 32) : old + (uint64_t)take;
        if (atomic_compare_exchange_weak_explicit(&w->ends, &old, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *begin = (tid & 1) ? w->n - b - take : f;
            *end = *begin + take;
            return 1;
        }
    }
}

#endif
