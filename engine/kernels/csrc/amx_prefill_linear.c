/* bf16 linear layers on AMX for prefill-sized batches: y[M, N] = x[M, K] . W[N, K]^T over the
 * decode kernels' packed weight (decode_linear.c's layout), float32 sums rounded once to bf16;
 * for an MLP's gated [gate; up] weight, y = silu(gate) * up written from the sum tiles, so the
 * [M, 2 x inter] product is never stored and read back.
 *
 * amx_linear (amx_linear.c) keeps every row of x in L2 per weight pair and splits the weights
 * between threads, which suits a few dozen rows. At hundreds of rows x no longer fits: here each
 * thread takes its own run of rows, in chunks of up to CHUNK_BYTES of x that stay in L2 while
 * the weight pairs stream past them once per chunk; a pair is multiplied with every 32-row
 * block of the chunk before the next one is read. x's tiles are loaded straight from its rows
 * (K must be a multiple of 32); only a last block of fewer than 32 rows is copied, zero-padded,
 * first.
 *
 * Tile registers: 0-3 sums (2 x 2: rows 0-15 / 16-31 x the pair's two 16-feature blocks),
 * 4-5 rows of x, 6-7 weights. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"

#if defined(HAVE_AMX)
#include <omp.h>

#include "bf16x16.h"

/* Bytes of x per chunk (32-row blocks of k inputs, at least one): about a third of a 2 MiB L2,
 * leaving room for the pairs in use and the one being fetched. 256 KiB to 1.25 MiB measured
 * within noise of each other for this model's shapes at 1,172 and 2,000 rows. */
#define CHUNK_BYTES (640 * 1024)
/* x's tiles are streamed where a pair's weights (2 KiB per k-block) fit a 48 KiB L1 with room:
 * 10-13% faster at 576 inputs (18 k-blocks, 36 KiB); at 1,536 inputs (96 KiB) nothing stays in
 * L1 and streaming measured a few percent slower. */
#define STREAM_MAX_KB 20

/* A block's four sum tiles, stored, waiting for their epilogue: tiles 0 / 1 (rows 0-15) in
 * t[0] / t[1], tiles 2 / 3 (rows 16-31) in t[2] / t[3]. The epilogue of one block runs a few
 * rows at a time between the tile multiplies of the next (drain), so the vector units' SiLU and
 * rounding overlap the AMX unit's work instead of following it. */
typedef struct {
    float t[4][256] __attribute__((aligned(64)));
    int64_t row0, p;
    int rows, done; /* rows written so far */
} pending_block;

/* Writes rows [pb->done, pb->done + count) of the pending block (clamped to its rows). */
static inline void drain(pending_block *pb, int count, uint16_t *y, int64_t y_stride, int64_t n,
                         int gated) {
    const int end = pb->done + count < pb->rows ? pb->done + count : pb->rows;
    for (int r = pb->done; r < end; r++) {
        const float *a = pb->t[(r >> 4) * 2] + 16 * (r & 15);
        const float *b = pb->t[(r >> 4) * 2 + 1] + 16 * (r & 15);
        uint16_t *out = y + (pb->row0 + r) * y_stride;
        if (gated) {
            /* a: gate, b: up of outputs [16 p, 16 p + 16). */
            const int64_t col0 = 16 * pb->p;
            const __m512 g = rnd_bf(_mm512_load_ps(a)), u = rnd_bf(_mm512_load_ps(b));
            st_bf(out + col0, tail(n / 2 - col0), silu_mul16(g, u));
        } else {
            const int64_t col0 = 32 * pb->p;
            st_bf(out + col0, tail(n - col0), _mm512_load_ps(a));
            if (n - col0 > 16) st_bf(out + col0 + 16, tail(n - col0 - 16), _mm512_load_ps(b));
        }
    }
    pb->done = end;
}

/* Sums of rows [0, 32) of xa (row stride xs bytes) with pair (w0, w1) over KB k-blocks, stored
 * into out; `per_kb` rows of the previous block (prev, may be NULL) are written per k-block.
 * When next is set, the pair after is asked into L2 as this one is read. With stream, x's tiles
 * are loaded with the hint that they will not be reused soon (tileloaddt1): they pass through
 * without evicting the pair, which then stays in L1 for the chunk's next block (STREAM_MAX_KB). */
static inline void pair_block(const uint16_t *xa, int64_t xs, int64_t KB, int stream,
                              const uint16_t *w0, const uint16_t *w1, const char *next,
                              pending_block *out, pending_block *prev, int per_kb, uint16_t *y,
                              int64_t y_stride, int64_t n, int gated) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *xb = (const uint16_t *)((const char *)xa + 16 * xs);
    for (int64_t kb = 0; kb < KB; kb++) {
        if (next != NULL) {
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch(next + kb * 1024 + l, _MM_HINT_T1);
                _mm_prefetch(next + (KB + kb) * 1024 + l, _MM_HINT_T1);
            }
        }
        if (stream)
            _tile_stream_loadd(4, xa + 32 * kb, xs);
        else
            _tile_loadd(4, xa + 32 * kb, xs);
        _tile_loadd(6, w0 + 512 * kb, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + 512 * kb, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (stream)
            _tile_stream_loadd(5, xb + 32 * kb, xs);
        else
            _tile_loadd(5, xb + 32 * kb, xs);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (prev != NULL) drain(prev, per_kb, y, y_stride, n, gated);
    }
    _tile_stored(0, out->t[0], 64);
    _tile_stored(1, out->t[1], 64);
    _tile_stored(2, out->t[2], 64);
    _tile_stored(3, out->t[3], 64);
}

/* x: [m, k] with row stride x_stride (elements), k a multiple of 32; wp, n, gated, y, y_stride
 * as amx_linear takes them. Returns 0, or -1 without AMX, for another k, or without memory for
 * the padded last block. */
int amx_prefill_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                       const uint16_t *wp, int64_t n, int gated, uint16_t *y, int64_t y_stride,
                       int num_threads) {
    if (!amx_linear_available() || k % 32 != 0 || m <= 0) return -1;
    const int64_t KB = k / 32, xs = x_stride * 2;
    const int64_t NP = gated ? (n / 2 + 15) / 16 : (n + 31) / 32; /* n-block pairs */
    const int64_t blocks = (m + 31) / 32, full = m / 32;
    /* The last block when it has fewer than 32 rows, zero-padded (stride k). */
    uint16_t *pad = NULL;
    if (full < blocks) {
        pad = (uint16_t *)aligned_alloc(64, (size_t)(32 * k * 2));
        if (pad == NULL) return -1;
        memset(pad, 0, (size_t)(32 * k * 2));
        for (int64_t r = 32 * full; r < m; r++)
            memcpy(pad + (r - 32 * full) * k, x + r * x_stride, (size_t)k * 2);
    }
    if (num_threads < 1) num_threads = 1;
    /* Threads form a grid: row groups (tm) x pair groups (tn). Rows are split first, so each
     * thread streams the weights past rows of its own; pairs are split too only where there are
     * fewer than two 32-row blocks per thread. */
    int tn = 1;
    while (2 * tn <= num_threads && blocks * tn < 2 * num_threads && NP >= 2 * tn) tn *= 2;
    const int tm = num_threads / tn < blocks ? num_threads / tn : (int)blocks;
#pragma omp parallel num_threads(tm * tn)
    {
        amx_configure_16x64();
        pending_block pb[2]; /* 8 KiB on the thread's stack, alternating blocks */
        const int tid = omp_get_thread_num(), gm = tid / tn, gn = tid % tn;
        const int64_t b0 = blocks * gm / tm, b1 = blocks * (gm + 1) / tm;
        const int64_t p0 = NP * gn / tn, p1 = NP * (gn + 1) / tn;
        /* The thread's blocks in equal chunks of at most CHUNK_BYTES: a short last chunk would
         * stream every weight past a block or two. */
        const int64_t most = CHUNK_BYTES / (64 * k) > 0 ? CHUNK_BYTES / (64 * k) : 1;
        const int64_t chunks = (b1 - b0 + most - 1) / most;
        const int64_t chunk = chunks > 0 ? (b1 - b0 + chunks - 1) / chunks : 1;
        const int per_kb = (int)((32 + KB - 1) / KB);
        pending_block *prev = NULL;
        int cur = 0;
        for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < b1 ? c0 + chunk : b1;
            for (int64_t p = p0; p < p1; p++) {
                const uint16_t *w0 = wp + 2 * p * KB * 512, *w1 = w0 + KB * 512;
                const char *next = p + 1 < p1 ? (const char *)(w1 + KB * 512) : NULL;
                for (int64_t b = c0; b < c1; b++) {
                    const int last = b >= full;
                    const uint16_t *xa = last ? pad : x + 32 * b * x_stride;
                    pending_block *out = pb + cur;
                    pair_block(xa, last ? k * 2 : xs, KB, KB <= STREAM_MAX_KB, w0, w1,
                               b == c0 ? next : NULL, out, prev, per_kb, y, y_stride, n, gated);
                    /* prev is written: per_kb rows in each of KB k-blocks cover its 32. */
                    out->row0 = 32 * b;
                    out->p = p;
                    out->rows = m - 32 * b < 32 ? (int)(m - 32 * b) : 32;
                    out->done = 0;
                    prev = out;
                    cur ^= 1;
                }
            }
        }
        if (prev != NULL) drain(prev, 32, y, y_stride, n, gated);
        _tile_release();
    }
    free(pad);
    return 0;
}

#else

int amx_prefill_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                       const uint16_t *wp, int64_t n, int gated, uint16_t *y, int64_t y_stride,
                       int num_threads) {
    (void)x; (void)m; (void)k; (void)x_stride; (void)wp; (void)n; (void)gated; (void)y;
    (void)y_stride; (void)num_threads;
    return -1;
}

#endif
