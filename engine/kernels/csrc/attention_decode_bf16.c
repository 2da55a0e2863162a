/* Decode attention (one query token) of a sequence on CPUs with AVX512-BF16 and no AMX: every KV
 * head in one pass over whole cache rows.
 *
 * A slot's KV heads are adjacent in the cache, so a block of 16 tokens is one contiguous run of
 * 16 rows. Walking the heads one at a time (paged_attention.c's attend_decode) reads a third of
 * each row per pass and widens every key to float32 first. Here two passes go through the keys
 * in order, 16 tokens at a time, with the rows 32 tokens on requested into L1:
 *   scores  every query head's scores of the 16 keys: one vdpbf16ps per 32 head dims (exact
 *           bf16 products, float32 sums), the 16 keys' partial sums reduced by one transposing
 *           sum (lane j = key j), times the scale;
 *   softmax per query head over all its scores (float32);
 *   values  every query head's weighted sum of the 16 values, float32 accumulators of G rows x
 *           64 dims held in registers per (KV head, 64 dims) and kept in a buffer between blocks.
 * The output is rounded once to bf16. With the K/V in cache (a shared prefix) this does the same
 * work in three quarters of the time; with every block read from memory, in the order a decode
 * step allocates them, both are bound by how fast the memory system returns the blocks
 * (docs/performance.md, item 29).
 */
#include "attention_decode_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec16.h"

/* Rows this many tokens on are requested while a block of 16 is computed: far enough that they
 * arrive in time, near enough to stay in L1. */
#define AHEAD 32

int bf16_decode_available(void) { return 1; }

int bf16_decode_supported(int head_dim, int block_size) {
    return head_dim % 64 == 0 && head_dim <= BF16_TILE_MAX_DIM && block_size % 16 == 0;
}

/* The bytes of rows [t0, t0 + 16) of cache (clipped to ctx, inside one block), or NULL past ctx. */
static inline const char *rows_at(const uint16_t *cache, const int64_t *table, int64_t t0,
                                  int64_t ctx, int bs, int64_t row, size_t *bytes) {
    if (t0 >= ctx) {
        *bytes = 0;
        return NULL;
    }
    const int64_t n = ctx - t0 < 16 ? ctx - t0 : 16;
    *bytes = (size_t)(n * row * 2);
    return (const char *)(cache + (table[t0 / bs] * bs + t0 % bs) * row);
}

/* Requests part i of `parts` of the lines of [p, p + bytes) into L1: a block's prefetches are
 * spread over the work on the block before (one burst per block measured the same). */
static inline void prefetch_part(const char *p, size_t bytes, int i, int parts) {
    if (p == NULL) return;
    const size_t lines = (bytes + 63) / 64;
    const size_t l0 = lines * (size_t)i / (size_t)parts, l1 = lines * (size_t)(i + 1) / (size_t)parts;
    for (size_t l = l0; l < l1; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

/* s[r * ctxp + t0 + j] = scale * q_r . k_j for the 16 keys of block row kb (all query heads).
 * D is a constant at each call, so the query's D / 32 vectors stay in registers. */
static inline __attribute__((always_inline)) void score_block(
    const uint16_t *q, const uint16_t *kb, int HK, int G, const int D, int64_t row, float scale,
    int n, float *s, int64_t ctxp, int64_t t0, const char *ahead, size_t ahead_bytes) {
    const __mmask16 keep = (__mmask16)((1u << n) - 1u);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h = 0; h < HK; h++) {
        const uint16_t *kh = kb + (size_t)h * D;
        for (int g = 0; g < G; g++) {
            const int r = h * G + g;
            prefetch_part(ahead, ahead_bytes, r, HK * G);
            __m512bh qv[BF16_TILE_MAX_DIM / 32];
            for (int c = 0; c < D / 32; c++)
                qv[c] = (__m512bh)_mm512_loadu_si512(q + (size_t)r * D + 32 * c);
            __m512 part[16];
            /* Rows past ctx lie inside the block (16 | block_size): read, never stored. */
            for (int j = 0; j < 16; j++) {
                const uint16_t *kr = kh + j * row;
                __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                              (__m512bh)_mm512_loadu_si512(kr));
                for (int c = 1; c < D / 32; c++)
                    acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
                part[j] = acc;
            }
            _mm512_mask_storeu_ps(s + (size_t)r * ctxp + t0, keep,
                                  _mm512_mul_ps(v16_hsum16(part), vscale));
        }
    }
}

/* acc[r] += sum_j p[r, t0 + j] * v_j over the n values of block row vb, for the G rows of KV
 * head h and dims [d0, d0 + 64). */
static inline void value_block(const uint16_t *vb, const float *p, int64_t ctxp, int64_t t0,
                               int n, int h, int G, int D, int d0, int64_t row, float *acc,
                               const char *ahead, size_t ahead_bytes, int part, int parts) {
    prefetch_part(ahead, ahead_bytes, part, parts);
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        __m512 a[4][4];
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < 4; c++)
                a[g][c] = _mm512_loadu_ps(acc + (size_t)(h * G + g0 + g) * D + d0 + 16 * c);
        for (int j = 0; j < n; j++) {
            const uint16_t *vr = vb + j * row + (size_t)h * D + d0;
            const __m512 v0 = v16_load_bf16(vr), v1 = v16_load_bf16(vr + 16);
            const __m512 v2 = v16_load_bf16(vr + 32), v3 = v16_load_bf16(vr + 48);
            for (int g = 0; g < gn; g++) {
                const __m512 pr = _mm512_set1_ps(p[(size_t)(h * G + g0 + g) * ctxp + t0 + j]);
                a[g][0] = _mm512_fmadd_ps(pr, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pr, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(pr, v2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(pr, v3, a[g][3]);
            }
        }
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(acc + (size_t)(h * G + g0 + g) * D + d0 + 16 * c, a[g][c]);
    }
}

/* Row r of s [R, ctxp] (its first ctx entries) becomes its softmax; lse[r] its log-sum-exp. */
static void softmax_rows(float *s, int R, int64_t ctx, int64_t ctxp, float *lse) {
    for (int r = 0; r < R; r++) {
        float *sr = s + (size_t)r * ctxp;
        __m512 mx = _mm512_set1_ps(-3.0e38f);
        int64_t t = 0;
        for (; t + 16 <= ctx; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + t));
        float m = _mm512_reduce_max_ps(mx);
        for (; t < ctx; t++) m = sr[t] > m ? sr[t] : m;
        const __m512 vm = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t < ctx; t += 16) {
            const int n = ctx - t < 16 ? (int)(ctx - t) : 16;
            const __mmask16 keep = (__mmask16)((1u << n) - 1u);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sr + t), vm));
            _mm512_mask_storeu_ps(sr + t, keep, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(keep, e));
        }
        const float total = _mm512_reduce_add_ps(sum);
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        for (t = 0; t < ctx; t += 16) {
            const int n = ctx - t < 16 ? (int)(ctx - t) : 16;
            const __mmask16 keep = (__mmask16)((1u << n) - 1u);
            _mm512_mask_storeu_ps(sr + t, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, sr + t), inv));
        }
        lse[r] = m + logf(total);
    }
}

int bf16_attend_decode(const bf16_tile_args *a, int64_t tok, int64_t ctx) {
    const int G = a->group, D = a->head_dim, bs = a->block_size;
    const int64_t row = a->row;
    const int HK = (int)(row / D), R = HK * G;
    const int64_t ctxp = (ctx + 15) / 16 * 16;
    float *buf = (float *)malloc(sizeof(float) * ((size_t)R * (size_t)ctxp + (size_t)R * D + R));
    if (buf == NULL) return -1;
    float *s = buf;                           /* [R, ctxp] scores, then probabilities */
    float *acc = s + (size_t)R * ctxp;        /* [R, D] */
    float *lse = acc + (size_t)R * D;         /* [R] */
    const uint16_t *q = a->q + tok * a->q_stride;
    const int64_t *table = a->table;

    size_t nb;
    for (int64_t t = 0; t < AHEAD && t < ctx; t += 16) {
        const char *p = rows_at(a->k_cache, table, t, ctx, bs, row, &nb);
        prefetch_part(p, nb, 0, 1);
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        /* The keys AHEAD tokens on; past the last key, the first values. */
        const int64_t ta = t0 + AHEAD;
        const char *ahead = ta < ctx ? rows_at(a->k_cache, table, ta, ctx, bs, row, &nb)
                                     : rows_at(a->v_cache, table, ta - ctxp, ctx, bs, row, &nb);
        const uint16_t *kb = a->k_cache + (table[t0 / bs] * bs + t0 % bs) * row;
        const int n = ctx - t0 < 16 ? (int)(ctx - t0) : 16;
        if (D == 64)
            score_block(q, kb, HK, G, 64, row, a->scale, n, s, ctxp, t0, ahead, nb);
        else if (D == 128)
            score_block(q, kb, HK, G, 128, row, a->scale, n, s, ctxp, t0, ahead, nb);
        else
            score_block(q, kb, HK, G, D, row, a->scale, n, s, ctxp, t0, ahead, nb);
    }
    softmax_rows(s, R, ctx, ctxp, lse);

    memset(acc, 0, sizeof(float) * (size_t)R * D);
    const int parts = HK * (D / 64);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const char *ahead = rows_at(a->v_cache, table, t0 + AHEAD, ctx, bs, row, &nb);
        const uint16_t *vb = a->v_cache + (table[t0 / bs] * bs + t0 % bs) * row;
        const int n = ctx - t0 < 16 ? (int)(ctx - t0) : 16;
        for (int h = 0; h < HK; h++)
            for (int d0 = 0; d0 < D; d0 += 64)
                value_block(vb, s, ctxp, t0, n, h, G, D, d0, row, acc, ahead, nb,
                            h * (D / 64) + d0 / 64, parts);
    }

    uint16_t *o = a->out + tok * a->out_stride;
    for (int r = 0; r < R; r++) {
        for (int d = 0; d < D; d++) o[(size_t)r * D + d] = f32_to_bf16(acc[(size_t)r * D + d]);
        if (a->lse != NULL) a->lse[tok * a->num_heads + r] = lse[r];
    }
    free(buf);
    return 0;
}

#else

int bf16_decode_available(void) { return 0; }

int bf16_decode_supported(int head_dim, int block_size) {
    (void)head_dim;
    (void)block_size;
    return 0;
}

int bf16_attend_decode(const bf16_tile_args *a, int64_t tok, int64_t ctx) {
    (void)a;
    (void)tok;
    (void)ctx;
    return -1;
}

#endif
