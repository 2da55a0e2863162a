/* bf16 linear layers for decode-sized batches, y[M, N] = x[M, K] . W[N, K]^T with float32 sums
 * rounded once to bf16 (round to nearest even), over one packed copy of the weight that every
 * kernel kind reads:
 *
 *   kind 1, AMX (amx_linear.c): tile multiplies, Sapphire Rapids and later;
 *   kind 2, AVX512-BF16 (bf16_linear below): vdpbf16ps on zmm registers, for CPUs with
 *           AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper Lake).
 *
 * decode_linear runs the best kind the process can use; llama_forward.c calls it, so the
 * one-call decoder stack runs wherever either kind does.
 *
 * Packed layout (decode_pack_weight): for n-block nb (16 output features starting at weight row
 * block_row(nb)) and k-block kb (32 input features), the 1 KiB tile (nb, kb) sits at element
 * (nb * KB + kb) * 512 and holds tile[p][n][j] = W[block_row(nb) + n][32 kb + 2 p + j] for
 * p < 16, n < 16, j < 2: AMX's pairs-of-rows ("VNNI") layout for its second operand, and also
 * exactly what vdpbf16ps wants: the 64 bytes of pair p are one zmm of 16 features x 2 inputs, so
 * within an n-block input pair q lies at element 32 q. Features past N or K are zero; the
 * kernels read n-blocks two at a time (a pair), so NB is even. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16x16.h"
#include "work_share.h"

#if defined(HAVE_BF16X16) || defined(HAVE_AMX)
#include <omp.h>
#endif

/* First weight row of n-block b: consecutive blocks, or for a gated weight ([gate; up], n = 2 *
 * inter) gate block b / 2 and up block b / 2 alternating, so that each pair the kernels read
 * holds the gate and the up features of the same 16 outputs. */
static inline int64_t block_row(int64_t b, int64_t n, int gated) {
    return gated ? (b & 1 ? n / 2 : 0) + 16 * (b >> 1) : 16 * b;
}

void decode_pack_weight(const uint16_t *w, int64_t n, int64_t k, int gated, uint16_t *out) {
    const int64_t NB = 2 * (gated ? (n / 2 + 15) / 16 : (n + 31) / 32), KB = (k + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++) {
        const int64_t first = block_row(nb, n, gated);
        /* Rows of this block's half (all of W when not gated). */
        const int64_t end = gated ? (nb & 1 ? n : n / 2) : n;
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *tile = out + (nb * KB + kb) * 512;
            for (int p = 0; p < 16; p++)
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < 2; j++) {
                        const int64_t row = first + c, col = 32 * kb + 2 * p + j;
                        tile[(p * 16 + c) * 2 + j] = row < end && col < k ? w[row * k + col] : 0;
                    }
        }
    }
}

int amx_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
               int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads);

#if defined(HAVE_BF16X16)

int bf16_linear_available(void) { return 1; }

/* Rows per register block: 2 x BF16_ROWS float32 sums (the pair's two 16-feature blocks) plus
 * the pair's two weight registers fit the 32 zmm registers. Both constants can be set with -D
 * for experiments; on Zen 4 10 and 14 rows, and no prefetch, measured no better (prefetch off:
 * ~10% slower at 1-64 rows). */
#ifndef BF16_ROWS
#define BF16_ROWS 12
#endif
/* The weight pair this many pairs ahead is requested into L2 while the first row block runs. */
#ifndef BF16_PREFETCH_PAIRS
#define BF16_PREFETCH_PAIRS 4
#endif

/* R rows of x (xt: their input pairs interleaved, xt[q * R + r] = pair q of row r, as uint32)
 * against one pair of n-blocks (w0, w1: the blocks' tiles, input pair q at element 32 q), sums
 * into s0 (block 0) and s1 (block 1). pf: the weight pair to prefetch alongside, or NULL.
 * Inlined with a constant R so the sums stay in registers. */
static inline __attribute__((always_inline)) void rows_pass(const uint32_t *xt, const int R,
                                                            int64_t kq, const uint16_t *w0,
                                                            const uint16_t *w1,
                                                            const char *pf0, const char *pf1,
                                                            __m512 *s0, __m512 *s1) {
    __m512 c0[BF16_ROWS], c1[BF16_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t q = 0; q < kq; q++) {
        if (pf0 != NULL) {
            /* One 64-byte line per block per input pair: the whole pair over the K loop. */
            _mm_prefetch(pf0 + 64 * q, _MM_HINT_T1);
            _mm_prefetch(pf1 + 64 * q, _MM_HINT_T1);
        }
        const __m512bh b0 = (__m512bh)_mm512_load_si512((const void *)(w0 + 32 * q));
        const __m512bh b1 = (__m512bh)_mm512_load_si512((const void *)(w1 + 32 * q));
        const uint32_t *xq = xt + q * R;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xq[r]);
            c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
            c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        s0[r] = c0[r];
        s1[r] = c1[r];
    }
}

/* A block of R rows: constant R, never more than BF16_ROWS (the cases past it do not occur). */
#define ROWS_CASE(R)                                                                          \
    case R:                                                                                   \
        rows_pass(xt_b, (R) < BF16_ROWS ? (R) : BF16_ROWS, kq, w0, w1, pf0, pf1, s0, s1);     \
        break;

/* x: [m, k] with row stride x_stride (elements); wp: decode_pack_weight's output for [n, k];
 * y: [m, n] with row stride y_stride, or when gated [m, n / 2] = silu(gate) * up, rounded as
 * the eager bf16 ops round (silu_mul16), as amx_linear computes it. Returns 0, or -1 without
 * memory.
 *
 * The threads claim runs of n-block pairs from both ends of the weight (work_share.h), so a
 * thread on a faster CPU takes more, and multiply each pair with every block of up to BF16_ROWS
 * rows while the pair is in cache (from memory for the first row block, from L1/L2 after). The
 * rows of x are first copied with their input pairs interleaved (all threads, one share each),
 * so a row's pair is one broadcast at a constant offset. */
int bf16_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
                int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads) {
    const int64_t KB = (k + 31) / 32, kq = (k + 1) / 2;
    const int64_t NP = gated ? (n / 2 + 15) / 16 : (n + 31) / 32; /* n-block pairs */
    /* Row blocks of nearly equal size, at most BF16_ROWS each: 64 rows -> 6 of 11 or 10. */
    const int64_t nblk = (m + BF16_ROWS - 1) / BF16_ROWS;
    uint32_t *xt = (uint32_t *)aligned_alloc(64, (size_t)((m * kq * 4 + 63) / 64 * 64 + 64));
    if (xt == NULL) return -1;
    if (num_threads < 1) num_threads = 1;
    work_share ws;
    work_share_init(&ws, NP, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            /* Block b holds rows [m b / nblk, m (b + 1) / nblk), its pairs at xt + r0 * kq. */
            int64_t b = r * nblk / m;
            while (m * (b + 1) / nblk <= r) b++;
            while (m * b / nblk > r) b--;
            const int64_t r0 = m * b / nblk, R = m * (b + 1) / nblk - r0;
            uint32_t *dst = xt + r0 * kq + (r - r0);
            const uint16_t *src = x + r * x_stride;
            for (int64_t q = 0; q < k / 2; q++) {
                uint32_t v;
                memcpy(&v, src + 2 * q, 4);
                dst[q * R] = v;
            }
            if (k & 1) dst[(kq - 1) * R] = src[k - 1]; /* the missing half is zero */
        }
        const int tid = omp_get_thread_num(), down = tid & 1;
        __m512 s0[BF16_ROWS], s1[BF16_ROWS];
        int64_t p0, p1;
        /* The back claimer walks its runs downwards: each thread streams the weight in one
         * direction, and its requests ahead run on into its next run. */
        while (work_share_claim(&ws, tid, &p0, &p1)) {
            for (int64_t i = 0; i < p1 - p0; i++) {
                const int64_t pair = down ? p1 - 1 - i : p0 + i;
                const int64_t ahead =
                    down ? pair - BF16_PREFETCH_PAIRS : pair + BF16_PREFETCH_PAIRS;
                const uint16_t *w0 = wp + 2 * pair * KB * 512, *w1 = w0 + KB * 512;
                for (int64_t b = 0; b < nblk; b++) {
                    const int64_t r0 = m * b / nblk;
                    const int R = (int)(m * (b + 1) / nblk - r0);
                    const uint32_t *xt_b = xt + r0 * kq;
                    const char *pf0 = NULL, *pf1 = NULL;
                    if (b == 0 && ahead >= 0 && ahead < NP) {
                        pf0 = (const char *)(wp + 2 * ahead * KB * 512);
                        pf1 = pf0 + KB * 1024;
                    }
                    switch (R) {
                        ROWS_CASE(1)
                        ROWS_CASE(2)
                        ROWS_CASE(3)
                        ROWS_CASE(4)
                        ROWS_CASE(5)
                        ROWS_CASE(6)
                        ROWS_CASE(7)
                        ROWS_CASE(8)
                        ROWS_CASE(9)
                        ROWS_CASE(10)
                        ROWS_CASE(11)
                        ROWS_CASE(12)
                        ROWS_CASE(13)
                        ROWS_CASE(14)
                        default: rows_pass(xt_b, BF16_ROWS, kq, w0, w1, pf0, pf1, s0, s1); break;
                    }
                    if (gated) {
                        /* s0: gate, s1: up of outputs [16 pair, 16 pair + 16). */
                        const int64_t col0 = 16 * pair;
                        const __mmask16 mask = tail(n / 2 - col0);
                        for (int r = 0; r < R; r++)
                            st_bf(y + (r0 + r) * y_stride + col0, mask,
                                  silu_mul16(rnd_bf(s0[r]), rnd_bf(s1[r])));
                    } else {
                        const int64_t col0 = 32 * pair;
                        const __mmask16 m0 = tail(n - col0);
                        const __mmask16 m1 = n - col0 > 16 ? tail(n - col0 - 16) : 0;
                        for (int r = 0; r < R; r++) {
                            uint16_t *dst = y + (r0 + r) * y_stride + col0;
                            st_bf(dst, m0, s0[r]);
                            if (m1) st_bf(dst + 16, m1, s1[r]);
                        }
                    }
                }
            }
        }
    }
    free(xt);
    return 0;
}

#else

int bf16_linear_available(void) { return 0; }

int bf16_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
                int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads) {
    (void)x; (void)m; (void)k; (void)x_stride; (void)wp; (void)n; (void)gated; (void)y;
    (void)y_stride; (void)num_threads;
    return -1;
}

#endif

/* 1 AMX, 2 AVX512-BF16, 0 neither (the callers take oneDNN and the Python loop). */
int decode_linear_kind(void) {
    if (amx_linear_available()) return 1;
    return bf16_linear_available() ? 2 : 0;
}

/* The same product and epilogue as amx_linear / bf16_linear, on the best kind this process can
 * use. Returns 0, or -1 when neither runs or memory fails. */
int decode_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
                  int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads) {
    if (amx_linear_available())
        return amx_linear(x, m, k, x_stride, wp, n, gated, y, y_stride, num_threads);
    return bf16_linear(x, m, k, x_stride, wp, n, gated, y, y_stride, num_threads);
}
