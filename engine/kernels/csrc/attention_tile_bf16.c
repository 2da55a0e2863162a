/* Prefill attention of one tile of query rows on CPUs with AVX512-BF16: the rows of one KV head
 * (a few query tokens times the group) against the cached keys, causal, with an online softmax.
 *
 * The tile's rows are the sixteen lanes of every vector ("row lanes"), so nothing in the inner
 * loops is reduced across lanes:
 *   scores   s[t] (lane r = q_r . k_t): one vdpbf16ps per pair of head dims, the query pairs
 *            transposed once per tile, each key pair broadcast straight from the paged cache;
 *   softmax  running max and sum per lane, element-wise over the chunk's sixteen keys;
 *   values   acc[c] (lane r = output dim c of row r) += p[2i, 2i+1] . v[2i, 2i+1][c]: the
 *            probabilities of two keys paired per lane (rounded to bf16, as the bf16 GEMMs of
 *            SDPA round them), the two keys' values interleaved once per chunk and broadcast.
 * Scores, softmax and sums are float32; the output is rounded once to bf16.
 *
 * The value pairs are interleaved within 128-bit lanes (unpacklo/hi), so output dim d sits in
 * accumulator acc_of(d); the tile's store transposes each row's dims out of them.
 */
#include "attention_tile_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "vec16.h"

#define KEYS 16 /* keys per chunk */
#define NEG_BIG -1e30f /* no infinities under -ffast-math */

int bf16_tile_available(void) { return 1; }

/* The accumulator that holds output dim d (see the file comment): within each 32 dims,
 * accumulators 0-15 come from unpacklo (dims 8L + 0..3 of 128-bit lane L) and 16-31 from
 * unpackhi (8L + 4..7). */
static inline int acc_of(int d) {
    const int base = d & ~31, e = d & 31;
    return base + 16 * ((e >> 2) & 1) + 4 * (e >> 3) + (e & 3);
}

/* v[i] lane j -> v[j] lane i: a 16 x 16 transpose of 32-bit elements in registers (bit moves
 * only, so it carries packed bf16 pairs as well as floats). */
static inline void transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++) {
            t[8 * i + k] = _mm512_shuffle_f32x4(v[8 * i + k], v[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4(v[8 * i + k], v[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        v[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        v[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    }
}

static inline __m512i bf16_bits(__m512 p) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
}

void bf16_attend_tile(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int ntok, int kvh,
                      int64_t kv_start) {
    const int G = a->group, D = a->head_dim, bs = a->block_size, P = D / 2;
    const int R = ntok * G; /* <= 16 */
    const int64_t kv_end = first_pos + ntok; /* keys [kv_start, kv_end) */
    const int64_t head_off = (int64_t)kvh * D;
    _Alignas(64) uint32_t qt[BF16_TILE_MAX_DIM / 2][16];
    _Alignas(64) float acc[BF16_TILE_MAX_DIM][16];
    _Alignas(64) uint32_t vs[KEYS / 2][BF16_TILE_MAX_DIM];
    _Alignas(64) int32_t lim[16];

    for (int r = 0; r < 16; r++) lim[r] = r < R ? (int32_t)(first_pos + r / G) : -1;
    /* The query pairs transposed 16 at a time: qt[j] lane r = pair j of row r (padding rows,
     * lanes R..15, are zeros and see nothing). */
    for (int j0 = 0; j0 < P; j0 += 16) {
        __m512 v[16];
        for (int r = 0; r < 16; r++)
            v[r] = r < R ? _mm512_loadu_ps(a->q + (qtok + r / G) * a->q_stride +
                                           (int64_t)(kvh * G + r % G) * D + 2 * j0)
                         : _mm512_setzero_ps();
        transpose16(v);
        for (int j = 0; j < 16; j++) _mm512_store_ps(qt[j0 + j], v[j]);
    }
    memset(acc, 0, sizeof(float) * 16 * (size_t)D);
    const __m512i limv = _mm512_load_si512(lim);
    const int32_t min_lim = (int32_t)first_pos;
    const __m512 scale = _mm512_set1_ps(a->scale);
    __m512 m = _mm512_set1_ps(NEG_BIG), l = _mm512_setzero_ps();

    for (int64_t p0 = kv_start; p0 < kv_end;) {
        /* A chunk stays inside one block. */
        const int64_t left_in_block = bs - p0 % bs;
        int n = (int)(left_in_block < KEYS ? left_in_block : KEYS);
        if (kv_end - p0 < n) n = (int)(kv_end - p0);
        const int64_t base = (a->table[p0 / bs] * bs + p0 % bs) * a->row + head_off;
        const uint32_t *kb = (const uint32_t *)(a->k_cache + base);
        const uint16_t *vb = a->v_cache + base;
        const int64_t krow = a->row / 2; /* in pairs */

        /* Scores, keys past n read the last key again (masked below). */
        __m512 s[KEYS];
        for (int half = 0; half < KEYS; half += 8) {
            const uint32_t *kp[8];
            for (int t = 0; t < 8; t++) {
                const int tt = half + t < n ? half + t : n - 1;
                kp[t] = kb + tt * krow;
            }
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0,
                   s6 = s0, s7 = s0;
            for (int j = 0; j < P; j++) {
                const __m512bh qj = (__m512bh)_mm512_load_si512(qt[j]);
#define DP(acc, t) acc = _mm512_dpbf16_ps(acc, qj, (__m512bh)_mm512_set1_epi32((int)kp[t][j]))
                DP(s0, 0); DP(s1, 1); DP(s2, 2); DP(s3, 3);
                DP(s4, 4); DP(s5, 5); DP(s6, 6); DP(s7, 7);
#undef DP
            }
            s[half + 0] = s0; s[half + 1] = s1; s[half + 2] = s2; s[half + 3] = s3;
            s[half + 4] = s4; s[half + 5] = s5; s[half + 6] = s6; s[half + 7] = s7;
        }

        /* Online softmax, per lane. Key t (position p0 + t) is visible to row r when
         * p0 + t <= lim[r]; every row sees the whole chunk when p0 + n - 1 <= min_lim. */
        __mmask16 vis[KEYS];
        const int all_visible = p0 + n - 1 <= min_lim;
        __m512 cmax = _mm512_set1_ps(NEG_BIG);
        for (int t = 0; t < KEYS; t++) {
            if (t >= n)
                vis[t] = 0;
            else if (all_visible)
                vis[t] = (__mmask16)((1u << R) - 1u);
            else
                vis[t] = _mm512_cmpge_epi32_mask(limv, _mm512_set1_epi32((int)(p0 + t)));
            cmax = _mm512_mask_max_ps(cmax, vis[t], cmax, s[t]);
        }
        const __m512 mnew = _mm512_max_ps(m, cmax);
        const __m512 alpha = exp16(_mm512_mul_ps(_mm512_sub_ps(m, mnew), scale));
        const __m512 msc = _mm512_mul_ps(mnew, scale);
        l = _mm512_mul_ps(l, alpha);
        __m512i pp[KEYS / 2];
        for (int i = 0; i < KEYS / 2; i++) {
            const __m512 pa = _mm512_maskz_mov_ps(vis[2 * i], exp16(_mm512_fmsub_ps(s[2 * i], scale, msc)));
            const __m512 pb =
                _mm512_maskz_mov_ps(vis[2 * i + 1], exp16(_mm512_fmsub_ps(s[2 * i + 1], scale, msc)));
            l = _mm512_add_ps(l, _mm512_add_ps(pa, pb));
            pp[i] = _mm512_or_si512(bf16_bits(pa), _mm512_slli_epi32(bf16_bits(pb), 16));
        }
        m = mnew;

        /* Values of key pairs interleaved; keys past n are zeros (their probability is 0, and a
         * stale slot could hold anything). */
        for (int i = 0; i < KEYS / 2; i++) {
            for (int h = 0; h < D; h += 32) {
                const __m512i va = 2 * i < n ? _mm512_loadu_si512(vb + (2 * i) * a->row + h)
                                             : _mm512_setzero_si512();
                const __m512i vbb = 2 * i + 1 < n ? _mm512_loadu_si512(vb + (2 * i + 1) * a->row + h)
                                                  : _mm512_setzero_si512();
                _mm512_store_si512(&vs[i][h], _mm512_unpacklo_epi16(va, vbb));
                _mm512_store_si512(&vs[i][h + 16], _mm512_unpackhi_epi16(va, vbb));
            }
        }
        const int pairs = (n + 1) / 2;
        for (int c0 = 0; c0 < D; c0 += 16) {
            __m512 o[16];
            for (int c = 0; c < 16; c++) o[c] = _mm512_mul_ps(_mm512_load_ps(acc[c0 + c]), alpha);
            for (int i = 0; i < pairs; i++) {
                const __m512bh pi = (__m512bh)pp[i];
                for (int c = 0; c < 16; c++)
                    o[c] = _mm512_dpbf16_ps(o[c], pi, (__m512bh)_mm512_set1_epi32((int)vs[i][c0 + c]));
            }
            for (int c = 0; c < 16; c++) _mm512_store_ps(acc[c0 + c], o[c]);
        }
        p0 += n;
    }

    _Alignas(64) float lsum[16], mx[16];
    _mm512_store_ps(lsum, l);
    _mm512_store_ps(mx, m);
    /* Each lane (row) scaled by its 1 / sum, then the rows' dims transposed out of the lanes
     * 16 at a time: dim d comes from accumulator acc_of(d). */
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(1.0f), l);
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_mul_ps(_mm512_load_ps(acc[acc_of(d0 + i)]), inv);
        transpose16(v);
        for (int r = 0; r < R; r++) {
            uint16_t *o = a->out + (qtok + r / G) * a->out_stride + (int64_t)(kvh * G + r % G) * D;
            _mm256_storeu_si256((__m256i *)(o + d0), (__m256i)_mm512_cvtneps_pbh(v[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t tok = qtok + r / G;
        const int h = kvh * G + r % G;
        if (a->lse != NULL)
            a->lse[tok * a->num_heads + h] = lsum[r] > 0.0f ? mx[r] * a->scale + logf(lsum[r]) : -INFINITY;
    }
}

#else

int bf16_tile_available(void) { return 0; }

void bf16_attend_tile(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int ntok, int kvh,
                      int64_t kv_start) {
    (void)a, (void)qtok, (void)first_pos, (void)ntok, (void)kvh, (void)kv_start;
}

#endif
