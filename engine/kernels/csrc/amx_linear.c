/* bf16 linear layers on AMX for decode-sized batches: y[M, N] = x[M, K] . W[N, K]^T, float32
 * sums rounded once to bf16 (round to nearest even, as oneDNN and torch round).
 *
 * At a few dozen rows a decode step's matmuls should be bound by streaming the weights from
 * memory, yet oneDNN's packed kernel read them at ~9 GB/s at 64 rows and ~15 GB/s at 1 row for
 * this model's shapes (K = 576 or 1536) on a machine that reads 25 GB/s. Here the weight is
 * repacked once into 1 KiB tiles that lie in the order the kernel reads them, so each thread
 * streams one contiguous run of memory, and each pair of weight tiles is multiplied with every
 * row tile of x while it is in cache (~15 GB/s at 64 rows, ~24 at 1 row).
 *
 * Packed layout: decode_pack_weight's (decode_linear.c), shared with the AVX512-BF16 kernel:
 * 1 KiB tiles, tile (nb, kb) at element (nb * KB + kb) * 512 holding 16 output features x 32
 * inputs in the pairs-of-rows ("VNNI") layout AMX wants for its second operand. The kernel
 * reads n-blocks two at a time (a pair).
 *
 * Tile registers: 0-3 sums (16 rows x 16 features, float32), 4-5 rows of x, 6-7 weights. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <string.h>

#include "amx.h"

#if defined(HAVE_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#include <stdlib.h>

#include "bf16x16.h"

static int amx_linear_state = 0; /* 0 unknown, 1 usable, -1 not */

int amx_linear_available(void) {
    if (amx_linear_state == 0) {
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): per process. */
        amx_linear_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return amx_linear_state == 1;
}


/* Up to this many rows (a decode step's batch) the weights are split between threads and stream
 * past every row; beyond, amx_prefill_linear (amx_prefill_linear.c) takes the batch (it beat
 * these loops from 128 rows on, with the weights in cache). linear.DECODE_MAX_ROWS["amx"]. */
#define DECODE_ROWS 96

/* The weight pair this many pairs ahead is requested into L2 during the first row pass. */
#define PREFETCH_PAIRS 4
/* 17 to 64 rows (two to four row tiles), the batches of a decode step: each 16-feature block of
 * weight tiles is loaded once per kb and multiplied with every row tile (one weight tile and up
 * to four row tiles per 32 inputs, sums in tiles 0-3). amx_linear_pairs reloads each weight
 * pair for every 32 rows, which costs as much as the multiplies where a tile load does
 * (docs/performance.md, item 25). Same operands and order of sums per output, so the same
 * results. For a gated weight the gate block's sums wait in gate_sums (float32,
 * [rows][16]) for the up block's, then the SiLU epilogue runs as in amx_linear. */
static void amx_linear_rows4(const uint16_t *xs, int64_t m, int64_t KB, int64_t mp,
                             const uint16_t *wp, int64_t n, int gated, uint16_t *y,
                             int64_t y_stride, int64_t p0, int64_t p1) {
    const int nr = (int)(mp / 16);
    float st[16 * 16] __attribute__((aligned(64)));
    float gate_sums[64 * 16] __attribute__((aligned(64)));
    for (int64_t nb = 2 * p0; nb < 2 * p1; nb++) {
        const uint16_t *w = wp + nb * KB * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; kb++) {
            if (nb + 2 * PREFETCH_PAIRS < 2 * p1) {
                /* The block PREFETCH_PAIRS pairs ahead into L2, as amx_linear asks. */
                const char *nx = (const char *)(w + 2 * PREFETCH_PAIRS * KB * 512 + kb * 512);
                for (int l = 0; l < 1024; l += 64) _mm_prefetch(nx + l, _MM_HINT_T1);
            }
            _tile_loadd(6, w + kb * 512, 64);
            _tile_loadd(4, xs + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, xs + (KB + kb) * 512, 64);
            _tile_dpbf16ps(1, 5, 6);
            if (nr > 2) {
                _tile_loadd(4, xs + (2 * KB + kb) * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (nr > 3) {
                _tile_loadd(5, xs + (3 * KB + kb) * 512, 64);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        for (int t = 0; t < nr; t++) {
            /* Tile indices must be constants. */
            float *dst = gated && !(nb & 1) ? gate_sums + 16 * 16 * t : st;
            switch (t) {
            case 0: _tile_stored(0, dst, 64); break;
            case 1: _tile_stored(1, dst, 64); break;
            case 2: _tile_stored(2, dst, 64); break;
            default: _tile_stored(3, dst, 64); break;
            }
            const int64_t row0 = 16 * t;
            const int rows = m - row0 < 16 ? (int)(m - row0) : 16;
            if (gated) {
                if (!(nb & 1)) continue; /* the gate block: its up block comes next */
                /* Outputs [16 (nb / 2), +16) of silu(gate) * up. */
                const int64_t col0 = 16 * (nb / 2), cols = n / 2 - col0 < 16 ? n / 2 - col0 : 16;
                for (int r = 0; r < rows; r++) {
                    const __m512 g = rnd_bf(_mm512_load_ps(gate_sums + 16 * (16 * t + r)));
                    const __m512 u = rnd_bf(_mm512_load_ps(st + 16 * r));
                    st_bf(y + (row0 + r) * y_stride + col0, tail(cols), silu_mul16(g, u));
                }
                continue;
            }
            const int64_t col0 = 16 * nb;
            if (col0 >= n) continue;
            const int64_t cols = n - col0 < 16 ? n - col0 : 16;
            for (int r = 0; r < rows; r++)
                st_bf(y + (row0 + r) * y_stride + col0, tail(cols), _mm512_load_ps(st + 16 * r));
        }
    }
}

/* 2 x 2 sum tiles per pass (see amx_linear) for this thread's n-block pairs [p0, p1). */
static void amx_linear_pairs(const uint16_t *xs, int64_t m, int64_t KB, int64_t mp,
                             const uint16_t *wp, int64_t n, int gated, uint16_t *y,
                             int64_t y_stride, int64_t p0, int64_t p1) {
    float st[16 * 16] __attribute__((aligned(64))), su[16 * 16] __attribute__((aligned(64)));
    for (int64_t pair = p0; pair < p1; pair++) {
        const uint16_t *w0 = wp + 2 * pair * KB * 512, *w1 = w0 + KB * 512;
        for (int64_t r0 = 0; r0 < mp; r0 += 32) {
            const int two_rows = mp - r0 > 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t *xa = xs + (r0 / 16) * KB * 512, *xb = xa + KB * 512;
            for (int64_t kb = 0; kb < KB; kb++) {
                if (r0 == 0 && pair + PREFETCH_PAIRS < p1) {
                    /* Weight tiles into L2 ahead of their pass (~5% at 64 rows). */
                    const char *nx = (const char *)(w0 + PREFETCH_PAIRS * 2 * KB * 512 + kb * 512);
                    for (int l = 0; l < 1024; l += 64) {
                        _mm_prefetch(nx + l, _MM_HINT_T1);
                        _mm_prefetch(nx + KB * 1024 + l, _MM_HINT_T1);
                    }
                }
                _tile_loadd(6, w0 + kb * 512, 64);
                _tile_loadd(7, w1 + kb * 512, 64);
                _tile_loadd(4, xa + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two_rows) {
                    _tile_loadd(5, xb + kb * 512, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            if (gated) {
                /* Tiles 0 / 2: gate, 1 / 3: up of outputs [16 pair, 16 pair + 16). */
                const int64_t col0 = 16 * pair, cols = n / 2 - col0 < 16 ? n / 2 - col0 : 16;
                for (int half = 0; half < (two_rows ? 2 : 1); half++) {
                    if (half == 0) {
                        _tile_stored(0, st, 64);
                        _tile_stored(1, su, 64);
                    } else {
                        _tile_stored(2, st, 64);
                        _tile_stored(3, su, 64);
                    }
                    const int64_t row0 = r0 + 16 * half;
                    const int rows = m - row0 < 16 ? (int)(m - row0) : 16;
                    for (int r = 0; r < rows; r++) {
                        const __m512 g = rnd_bf(_mm512_load_ps(st + 16 * r));
                        const __m512 u = rnd_bf(_mm512_load_ps(su + 16 * r));
                        st_bf(y + (row0 + r) * y_stride + col0, tail(cols), silu_mul16(g, u));
                    }
                }
                continue;
            }
            for (int t = 0; t < (two_rows ? 4 : 2); t++) {
                /* Tile indices must be constants. */
                switch (t) {
                case 0: _tile_stored(0, st, 64); break;
                case 1: _tile_stored(1, st, 64); break;
                case 2: _tile_stored(2, st, 64); break;
                default: _tile_stored(3, st, 64); break;
                }
                const int64_t row0 = r0 + 16 * (t / 2), col0 = 32 * pair + 16 * (t % 2);
                if (col0 >= n) continue;
                const int64_t cols = n - col0 < 16 ? n - col0 : 16;
                const int rows = m - row0 < 16 ? (int)(m - row0) : 16;
                for (int r = 0; r < rows; r++)
                    st_bf(y + (row0 + r) * y_stride + col0, tail(cols), _mm512_load_ps(st + 16 * r));
            }
        }
    }
}

/* x: [m, k] with row stride x_stride (elements); wp: decode_pack_weight's output for [n, k];
 * y: [m, n] with row stride y_stride, or when gated [m, n / 2] = silu(gate) * up, rounded as
 * the eager bf16 ops round (silu_mul16). Returns 0, or -1 without AMX or memory.
 *
 * Each pass computes 32 rows x 32 features as 2 x 2 sum tiles from two tiles of x and two of
 * weights per 32 inputs: four multiplies per four loads. Batches of 17 to 64 rows go to
 * amx_linear_rows4 instead, which loads each weight tile once for all of them; batches of more
 * than DECODE_ROWS rows to amx_prefill_linear, which splits rows instead of weights. */
int amx_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
               int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads) {
    if (!amx_linear_available()) return -1;
    if (m > DECODE_ROWS &&
        amx_prefill_linear(x, m, k, x_stride, wp, n, gated, y, y_stride, num_threads) == 0)
        return 0;
    const int64_t KB = (k + 31) / 32;
    const int64_t NP = gated ? (n / 2 + 15) / 16 : (n + 31) / 32; /* n-block pairs */
    const int64_t kp = KB * 32, mp = (m + 15) / 16 * 16;
    /* x in tiles of 16 rows x 32 inputs (1 KiB, contiguous), zeros past m and k:
     * xs[(rb * KB + kb) * 512 + r * 32 + c] = x[16 rb + r][32 kb + c]. */
    uint16_t *xs = (uint16_t *)aligned_alloc(64, (size_t)(mp * kp * 2 + 64));
    if (xs == NULL) return -1;
    for (int64_t r = 0; r < mp; r++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *dst = xs + ((r / 16) * KB + kb) * 512 + (r % 16) * 32;
            const int64_t c0 = 32 * kb, nc = k - c0 < 32 ? k - c0 : 32;
            if (r < m) {
                memcpy(dst, x + r * x_stride + c0, (size_t)nc * 2);
                if (nc < 32) memset(dst + nc, 0, (size_t)(32 - nc) * 2);
            } else {
                memset(dst, 0, 64);
            }
        }
    if (num_threads > NP) num_threads = (int)NP;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure_16x64();
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        /* Contiguous pairs per thread: each streams one run of the packed weight. */
        const int64_t p0 = NP * tid / nt, p1 = NP * (tid + 1) / nt;
        if (mp > 16 && mp <= 64)
            amx_linear_rows4(xs, m, KB, mp, wp, n, gated, y, y_stride, p0, p1);
        else
            amx_linear_pairs(xs, m, KB, mp, wp, n, gated, y, y_stride, p0, p1);
        _tile_release();
    }
    free(xs);
    return 0;
}

#else

int amx_linear_available(void) { return 0; }

int amx_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
               int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads) {
    (void)x; (void)m; (void)k; (void)x_stride; (void)wp; (void)n; (void)gated; (void)y;
    (void)y_stride; (void)num_threads;
    return -1;
}

#endif
