/* float32 linear layers for decode-sized batches, y[M, N] = x[M, K] . W[N, K]^T with float32
 * sums in k order (one fused multiply-add per input, so a row's result does not depend on the
 * other rows of the batch), over a packed copy of the weight. Written for CPUs whose float32
 * path is AVX2 + FMA (AMD Zen 2/3, Intel before AVX-512), where oneDNN's packed kernel reaches
 * ~45% of the memory bandwidth at 1-8 rows and ~65% of the FMA peak at 32-64 rows; also taken on
 * AMD's AVX-512 (Zen 4), where the same blocking in zmm registers beats oneDNN too (more rows
 * per block did not help there). It streams each weight once per call with a prefetch ahead of
 * it and keeps 6 rows x 16 features of sums in registers (docs/performance.md has the
 * measurements).
 *
 * Packed layout (f32_pack_weight): panel b (16 output features starting at weight row
 * f32_block_row(b)) sits at element b * K * 16 and holds panel[k][c] = W[row(b) + c][k]: one
 * 64-byte line per input, features past N zero. A gated weight ([gate; up], n = 2 * inter) has
 * gate panel j at block 2 j and up panel j at block 2 j + 1, so one thread holds both halves of
 * the same 16 outputs for the SiLU epilogue. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#if defined(HAVE_VEC16)
#include <omp.h>
#endif

static inline int64_t f32_block_row(int64_t b, int64_t n, int gated) {
    return gated ? (b & 1 ? n / 2 : 0) + 16 * (b >> 1) : 16 * b;
}

int64_t f32_packed_blocks(int64_t n, int gated) {
    return gated ? 2 * ((n / 2 + 15) / 16) : (n + 15) / 16;
}

void f32_pack_weight(const float *w, int64_t n, int64_t k, int gated, float *out) {
    const int64_t NB = f32_packed_blocks(n, gated);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < NB; b++) {
        const int64_t first = f32_block_row(b, n, gated);
        const int64_t end = gated ? (b & 1 ? n : n / 2) : n;
        float *panel = out + b * k * 16;
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++)
                panel[kk * 16 + c] = first + c < end ? w[(first + c) * k + kk] : 0.0f;
    }
}

#if defined(HAVE_VEC16)

int f32_linear_available(void) { return 1; }

/* Rows per register block: 6 rows x 16 features of sums are 12 ymm registers, which leaves the
 * panel line (2) and the broadcast input (1) of AVX2's 16. Settable with -D for experiments. */
#ifndef F32_ROWS
#define F32_ROWS 6
#endif
/* The panel this many panels ahead is requested while the first row block runs: by then the
 * one being read is in flight, and at 1-6 rows (one row block) the kernel is bound by memory. */
#ifndef F32_PREFETCH_PANELS
#define F32_PREFETCH_PANELS 2
#endif

/* R rows of x (row stride xs) against one panel; sums into s. pf: a panel to prefetch, or NULL.
 * Inlined with a constant R so the sums stay in registers. */
static inline __attribute__((always_inline)) void f32_rows_pass(const float *x, int64_t xs,
                                                                const int R, int64_t k,
                                                                const float *panel,
                                                                const char *pf, vf16 *s) {
    vf16 c[F32_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) c[r] = v16_zero();
    for (int64_t kk = 0; kk < k; kk++) {
        if (pf != NULL) _mm_prefetch(pf + 64 * kk, _MM_HINT_T0);
        const vf16 b = v16_loadu(panel + 16 * kk);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) c[r] = v16_fmadd(v16_set1(x[r * xs + kk]), b, c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) s[r] = c[r];
}

#define F32_ROWS_CASE(R)                                                                      \
    case R:                                                                                   \
        f32_rows_pass(xb, x_stride, (R) < F32_ROWS ? (R) : F32_ROWS, k, panel, pf, s);        \
        break;

static inline void f32_block(const float *xb, int64_t x_stride, int R, int64_t k,
                             const float *panel, const char *pf, vf16 *s) {
    switch (R) {
        F32_ROWS_CASE(1)
        F32_ROWS_CASE(2)
        F32_ROWS_CASE(3)
        F32_ROWS_CASE(4)
        F32_ROWS_CASE(5)
        default: f32_rows_pass(xb, x_stride, F32_ROWS, k, panel, pf, s); break;
    }
}

/* The first n (1..16) lanes of v to p. */
static inline void f32_store_first(float *p, vf16 v, int64_t n) {
    if (n >= 16) {
        v16_storeu(p, v);
    } else {
        float tmp[16];
        v16_storeu(tmp, v);
        memcpy(p, tmp, (size_t)n * sizeof(float));
    }
}

/* x: [m, k] with row stride x_stride (elements); wp: f32_pack_weight's output for [n, k];
 * y: [m, n] with row stride y_stride, or when gated [m, n / 2] = silu(gate) * up (the formula
 * of silu_mul_f32). Each thread takes one contiguous run of panels (gate/up pairs when gated)
 * and multiplies each with every block of up to F32_ROWS rows while it is in cache (from memory
 * for the first row block, from L1/L2 after). Returns 0. */
int f32_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *wp, int64_t n,
               int gated, float *y, int64_t y_stride, int num_threads) {
    const int64_t units = gated ? f32_packed_blocks(n, 1) / 2 : f32_packed_blocks(n, 0);
    const int64_t per_unit = gated ? 2 : 1, panel_elems = k * 16;
    /* Row blocks of nearly equal size, at most F32_ROWS each: 32 rows -> 6 of 5 or 6. */
    const int64_t nblk = (m + F32_ROWS - 1) / F32_ROWS;
    if (num_threads < 1) num_threads = 1;
    if (units < num_threads) num_threads = (int)units;
#pragma omp parallel num_threads(num_threads)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t u0 = units * tid / nt, u1 = units * (tid + 1) / nt;
        const float *end = wp + u1 * per_unit * panel_elems;
        vf16 s[F32_ROWS], g[F32_ROWS];
        for (int64_t u = u0; u < u1; u++) {
            const float *p0 = wp + u * per_unit * panel_elems;
            for (int64_t blk = 0; blk < nblk; blk++) {
                const int64_t r0 = m * blk / nblk;
                const int R = (int)(m * (blk + 1) / nblk - r0);
                const float *xb = x + r0 * x_stride;
                for (int64_t h = 0; h < per_unit; h++) {
                    const float *panel = p0 + h * panel_elems;
                    const float *ahead = panel + F32_PREFETCH_PANELS * panel_elems;
                    const char *pf = blk == 0 && ahead < end ? (const char *)ahead : NULL;
                    f32_block(xb, x_stride, R, k, panel, pf, gated && h == 0 ? g : s);
                }
                if (gated) {
                    /* g: gate, s: up of outputs [16 u, 16 u + 16). */
                    const int64_t col0 = 16 * u, cols = n / 2 - col0;
                    for (int r = 0; r < R; r++) {
                        const vf16 den = v16_add(v16_set1(1.0f), exp16(v16_sub(v16_zero(), g[r])));
                        f32_store_first(y + (r0 + r) * y_stride + col0,
                                        v16_mul(v16_div(g[r], den), s[r]), cols);
                    }
                } else {
                    const int64_t col0 = 16 * u, cols = n - col0;
                    for (int r = 0; r < R; r++)
                        f32_store_first(y + (r0 + r) * y_stride + col0, s[r], cols);
                }
            }
        }
    }
    return 0;
}

#else

int f32_linear_available(void) { return 0; }

int f32_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *wp, int64_t n,
               int gated, float *y, int64_t y_stride, int num_threads) {
    (void)x, (void)m, (void)k, (void)x_stride, (void)wp, (void)n, (void)gated, (void)y;
    (void)y_stride, (void)num_threads;
    return -1;
}

#endif
