/* Prefill attention in bf16 on AMX: a run of query tiles (16 tokens each) of one sequence, for
 * every query head of one KV head, against the keys each token sees in the paged cache.
 *
 * The keys the run's last tile sees are packed once per call, in the layouts AMX wants for its
 * second operand (each 16 keys x 32 dims transposed as 16 x 16 pairs of dims; values with the
 * rows of two keys interleaved), and every tile of the run reads them from there: a tile of
 * position p would otherwise repack p keys, which cost more than its tile multiplies. Per tile, the
 * keys go in passes of up to KEYS_PER_PASS:
 *   scores   S[16 tokens x 16 keys] += Q[16 x 32 dims] . K^T, one tile multiply per head and
 *            32 dims, the query rows loaded in place from a padded copy;
 *   softmax  exact over the pass per row (running maximum and sum across passes, the
 *            accumulator rescaled once per pass), in base 2 with the scale folded into one
 *            multiply-subtract, probabilities rounded to bf16 as SDPA's bf16 GEMMs round them,
 *            the sum kept in float32;
 *   values   O[16 x 16 dims] += P[16 x 32 keys] . V.
 * Each tile multiply does 16 x 16 x 32 products; what bounds a tile is the softmax's
 * exponentials (one per score), hence the short polynomial of exp2_16.
 *
 * Scratch lives per thread and is kept between calls (one buffer per OpenMP worker: the packed
 * keys of the run, 4 bytes per key and head dimension, and a few hundred KiB for SmolLM2's
 * shapes), so a step's items do not page-fault fresh allocations.
 */
#include "attention_amx.h"

#include "amx.h"

#if defined(HAVE_AMX)
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KEYS_PER_PASS 256
#define NEG_BIG -1e30f /* no infinities under -ffast-math */

int amx_prefill_available(void) { return amx_linear_available(); }


static _Thread_local char *scratch = NULL;
static _Thread_local size_t scratch_size = 0;

static char *get_scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch);
        scratch = (char *)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        scratch_size = scratch != NULL ? bytes : 0;
    }
    return scratch;
}

/* r[i][p] -> r[p][i] for a 16 x 16 matrix of 32-bit elements. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + k], 128-bit lane L: column 4L + k of rows 4g .. 4g + 3. */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

/* Element 2i of the result is a[i], 2i + 1 is b[i]: dims 0-15 (lo) or 16-31 (hi) of two rows. */
static const uint16_t pair_lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t pair_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

static inline __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
}

/* 2^x for x <= 0 (lanes far below the range flush to 0 through scalef): x = n + f, |f| <= 1/2,
 * 2^f by a degree-5 polynomial fitted for relative error (3.5e-7 in float32, under a
 * thousandth of a bf16 probability's rounding step). */
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.0012915669940412045f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009668530896306038f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055516887456178665f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022264778614044f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931464672088623f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Keys [k0, k1) of KV head kvh (k0 % 16 == 0) in the tile layouts: kt [chunk of 16 keys][DC]
 * [16 pairs of dims][16 keys] as 32-bit pairs, vv [pair of chunks][DB][16 pairs of keys]
 * [16 dims][2]. Slots past k1, up to the next multiple of 32 keys, are zeros: a stale slot
 * could hold anything, and 0 * NaN is NaN. A chunk of 16 keys lies in one block. */
static void pack_keys(const bf16_tile_args *a, int kvh, int64_t k0, int64_t k1, uint32_t *kt,
                      uint16_t *vv) {
    const int D = a->head_dim, bs = a->block_size, DC = D / 32, DB = D / 16;
    const int64_t row = a->row, head_off = (int64_t)kvh * D, nk = k1 - k0;
    const int64_t nch = (nk + 15) / 16, npair = (nk + 31) / 32;
    const __m512i lo_idx = _mm512_loadu_si512(pair_lo), hi_idx = _mm512_loadu_si512(pair_hi);
    for (int64_t j = 0; j < nch; j++) {
        const int64_t pos = k0 + 16 * j;
        const int n = nk - 16 * j < 16 ? (int)(nk - 16 * j) : 16;
        const uint16_t *kb = a->k_cache + (a->table[pos / bs] * bs + pos % bs) * row + head_off;
        for (int c = 0; c < DC; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < n ? _mm512_loadu_si512(kb + i * row + 32 * c) : _mm512_setzero_si512();
            transpose16(r);
            uint32_t *dst = kt + (size_t)(j * DC + c) * 256;
            for (int p = 0; p < 16; p++) _mm512_store_si512(dst + 16 * p, r[p]);
        }
    }
    for (int64_t jj = 0; jj < npair; jj++)
        for (int kp = 0; kp < 16; kp++) {
            const uint16_t *vr[2];
            for (int e = 0; e < 2; e++) {
                const int64_t k = 32 * jj + 2 * kp + e, pos = k0 + k;
                vr[e] = k < nk ? a->v_cache + (a->table[pos / bs] * bs + pos % bs) * row + head_off
                               : NULL;
            }
            for (int c = 0; c < DC; c++) {
                const __m512i v0 = vr[0] ? _mm512_loadu_si512(vr[0] + 32 * c) : _mm512_setzero_si512();
                const __m512i v1 = vr[1] ? _mm512_loadu_si512(vr[1] + 32 * c) : _mm512_setzero_si512();
                uint16_t *dst = vv + ((size_t)(jj * DB + 2 * c) * 16 + kp) * 32;
                _mm512_store_si512(dst, _mm512_permutex2var_epi16(v0, lo_idx, v1));
                _mm512_store_si512(dst + 16 * 32, _mm512_permutex2var_epi16(v0, hi_idx, v1));
            }
        }
}

/* One tile: query tokens [qtok, qtok + ntok) at positions first_pos.., keys [kv_start, first_pos
 * + ntok) read from kt / vv packed from kv_start on. */
static void attend_tile(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int ntok,
                        int kvh, int64_t kv_start, const uint32_t *kt, const uint16_t *vv,
                        uint16_t *qb, float *S, uint16_t *P, float *O, float *M, float *L) {
    const int G = a->group, D = a->head_dim, DC = D / 32, DB = D / 16, KB = KEYS_PER_PASS;
    const int64_t kv_end = first_pos + ntok;
    const size_t rows = (size_t)G * 16;
    /* Rows of 2 * D bytes, D % 32 == 0: whole vectors, no library call per row. */
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 16; r++) {
            uint16_t *dst = qb + ((size_t)g * 16 + r) * D;
            const uint16_t *src = a->q + (qtok + r) * a->q_stride + (int64_t)(kvh * G + g) * D;
            for (int d = 0; d < D; d += 32)
                _mm512_store_si512(dst + d, r < ntok ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
        }
    for (size_t i = 0; i < rows * D; i += 16) _mm512_store_ps(O + i, _mm512_setzero_ps());
    for (size_t i = 0; i < rows; i++) M[i] = NEG_BIG, L[i] = 0.0f;
    /* Scores in base 2: p = 2^(s * scale * log2(e) - m), m the running maximum so scaled. */
    const float scale2 = a->scale * 1.44269504088896341f;
    const __m512 sv = _mm512_set1_ps(scale2);

    for (int64_t p0 = kv_start; p0 < kv_end; p0 += KB) {
        const int nk = kv_end - p0 < KB ? (int)(kv_end - p0) : KB;
        const int nch = (nk + 15) / 16, npair = (nk + 31) / 32;
        const uint32_t *ktp = kt + (size_t)((p0 - kv_start) / 16) * DC * 256;
        const uint16_t *vvp = vv + (size_t)((p0 - kv_start) / 32) * DB * 16 * 32;

        /* Scores of up to four heads at a time: sums in tiles 0-3, queries 4-5, keys 7. */
        for (int j = 0; j < nch; j++)
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int hn = G - g0 < 4 ? G - g0 : 4;
                const uint16_t *qg = qb + (size_t)g0 * 16 * D;
                _tile_zero(0);
                if (hn > 1) _tile_zero(1);
                if (hn > 2) _tile_zero(2);
                if (hn > 3) _tile_zero(3);
                for (int c = 0; c < DC; c++) {
                    _tile_loadd(7, ktp + (size_t)(j * DC + c) * 256, 64);
                    _tile_loadd(4, qg + 32 * c, D * 2);
                    _tile_dpbf16ps(0, 4, 7);
                    if (hn > 1) {
                        _tile_loadd(5, qg + (size_t)16 * D + 32 * c, D * 2);
                        _tile_dpbf16ps(1, 5, 7);
                    }
                    if (hn > 2) {
                        _tile_loadd(4, qg + (size_t)32 * D + 32 * c, D * 2);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (hn > 3) {
                        _tile_loadd(5, qg + (size_t)48 * D + 32 * c, D * 2);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                float *sg = S + (size_t)g0 * 16 * KB + 16 * j;
                _tile_stored(0, sg, KB * 4);
                if (hn > 1) _tile_stored(1, sg + (size_t)16 * KB, KB * 4);
                if (hn > 2) _tile_stored(2, sg + (size_t)32 * KB, KB * 4);
                if (hn > 3) _tile_stored(3, sg + (size_t)48 * KB, KB * 4);
            }

        /* Softmax over the pass, causal: row r (position first_pos + r) sees vis keys of it. */
        const int npad = 32 * npair;
        for (int g = 0; g < G; g++)
            for (int r = 0; r < 16; r++) {
                const size_t i = (size_t)g * 16 + r;
                float *sr = S + i * KB;
                uint16_t *pr = P + i * KB;
                const int64_t seen = first_pos + r - p0 + 1;
                const int vis = r >= ntok || seen <= 0 ? 0 : (seen < nk ? (int)seen : nk);
                if (vis == 0) {
                    memset(pr, 0, 2 * (size_t)npad);
                    continue;
                }
                __m512 mx = _mm512_set1_ps(NEG_BIG);
                for (int k = 0; k < vis; k += 16)
                    mx = _mm512_mask_max_ps(mx, first_lanes(vis - k), mx, _mm512_loadu_ps(sr + k));
                const float mnew = fmaxf(M[i], _mm512_reduce_max_ps(mx) * scale2);
                const float alpha = L[i] > 0.0f ? exp2f(M[i] - mnew) : 1.0f;
                const __m512 mv = _mm512_set1_ps(mnew);
                __m512 sum = _mm512_setzero_ps();
                int k = 0;
                for (; k + 16 <= vis; k += 16) {
                    const __m512 p = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + k), sv, mv));
                    sum = _mm512_add_ps(sum, p);
                    _mm256_storeu_si256((__m256i *)(pr + k), (__m256i)_mm512_cvtneps_pbh(p));
                }
                if (k < vis) {
                    const __mmask16 m = first_lanes(vis - k);
                    const __m512 p = _mm512_maskz_mov_ps(
                        m, exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, sr + k), sv, mv)));
                    sum = _mm512_add_ps(sum, p);
                    _mm256_storeu_si256((__m256i *)(pr + k), (__m256i)_mm512_cvtneps_pbh(p));
                    k += 16;
                }
                for (; k < npad; k += 16) _mm256_storeu_si256((__m256i *)(pr + k), _mm256_setzero_si256());
                L[i] = L[i] * alpha + _mm512_reduce_add_ps(sum);
                M[i] = mnew;
                if (alpha != 1.0f) {
                    float *orow = O + i * D;
                    const __m512 av = _mm512_set1_ps(alpha);
                    for (int d = 0; d < D; d += 16)
                        _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), av));
                }
            }

        /* Values: per head, up to four blocks of 16 output dims in tiles 0-3, probabilities 4,
         * value pairs 5-6. */
        for (int g = 0; g < G; g++) {
            float *og = O + (size_t)g * 16 * D;
            const uint16_t *pg = P + (size_t)g * 16 * KB;
            for (int b0 = 0; b0 < DB; b0 += 4) {
                const int nb = DB - b0 < 4 ? DB - b0 : 4; /* 2 or 4: D % 32 == 0 */
                _tile_loadd(0, og + 16 * b0, D * 4);
                _tile_loadd(1, og + 16 * (b0 + 1), D * 4);
                if (nb > 2) {
                    _tile_loadd(2, og + 16 * (b0 + 2), D * 4);
                    _tile_loadd(3, og + 16 * (b0 + 3), D * 4);
                }
                for (int jj = 0; jj < npair; jj++) {
                    const uint16_t *vj = vvp + (size_t)(jj * DB + b0) * 16 * 32;
                    _tile_loadd(4, pg + 32 * jj, KB * 2);
                    _tile_loadd(5, vj, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, vj + 16 * 32, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    if (nb > 2) {
                        _tile_loadd(5, vj + 2 * 16 * 32, 64);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(6, vj + 3 * 16 * 32, 64);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                }
                _tile_stored(0, og + 16 * b0, D * 4);
                _tile_stored(1, og + 16 * (b0 + 1), D * 4);
                if (nb > 2) {
                    _tile_stored(2, og + 16 * (b0 + 2), D * 4);
                    _tile_stored(3, og + 16 * (b0 + 3), D * 4);
                }
            }
        }
    }

    const float ln2 = 0.69314718055994531f;
    for (int g = 0; g < G; g++)
        for (int r = 0; r < ntok; r++) {
            const size_t i = (size_t)g * 16 + r;
            const int h = kvh * G + g;
            const int64_t tok = qtok + r;
            uint16_t *o = a->out + tok * a->out_stride + (int64_t)h * D;
            const __m512 inv = _mm512_set1_ps(L[i] > 0.0f ? 1.0f / L[i] : 0.0f);
            for (int d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(o + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + i * D + d), inv)));
            if (a->lse != NULL)
                a->lse[tok * a->num_heads + h] = L[i] > 0.0f ? (M[i] + log2f(L[i])) * ln2 : -INFINITY;
        }
}

int amx_attend_tiles(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int64_t t_begin,
                     int64_t t_end, int kvh, int64_t kv_start) {
    if (!amx_linear_available()) return -1;
    const int G = a->group, D = a->head_dim, KB = KEYS_PER_PASS;
    /* The last tile's keys end at first_pos + t_end; none when every query lies before
     * kv_start (its rows then get out = 0 and lse = -inf from attend_tile). */
    const int64_t k1 = first_pos + t_end > kv_start ? first_pos + t_end : kv_start;
    const size_t keys = (size_t)((k1 - kv_start + 31) / 32) * 32;
    const size_t rows = (size_t)G * 16;
    const size_t b_qb = rows * D * 2, b_kt = keys * D * 2, b_vv = keys * D * 2;
    const size_t b_s = rows * KB * 4, b_p = rows * KB * 2, b_o = rows * D * 4, b_ml = rows * 4;
    char *buf = get_scratch(b_qb + b_kt + b_vv + b_s + b_p + b_o + 2 * b_ml);
    if (buf == NULL) return -1;
    uint16_t *qb = (uint16_t *)buf;                  /* [G][16][D] */
    uint32_t *kt = (uint32_t *)(buf + b_qb);         /* see pack_keys */
    uint16_t *vv = (uint16_t *)(buf + b_qb + b_kt);
    float *S = (float *)(buf + b_qb + b_kt + b_vv);  /* [G][16][KB] */
    uint16_t *P = (uint16_t *)((char *)S + b_s);     /* [G][16][KB] */
    float *O = (float *)((char *)P + b_p);           /* [G][16][D] */
    float *M = (float *)((char *)O + b_o);           /* [G][16], base-2 scaled */
    float *L = M + rows;                             /* [G][16] */

    pack_keys(a, kvh, kv_start, k1, kt, vv);
    amx_configure_16x64();
    for (int64_t t = t_begin; t < t_end; t += AMX_TILE_TOKENS) {
        const int ntok = t_end - t < AMX_TILE_TOKENS ? (int)(t_end - t) : AMX_TILE_TOKENS;
        attend_tile(a, qtok + t, first_pos + t, ntok, kvh, kv_start, kt, vv, qb, S, P, O, M, L);
    }
    _tile_release();
    return 0;
}

#else

int amx_prefill_available(void) { return 0; }

int amx_attend_tiles(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int64_t t_begin,
                     int64_t t_end, int kvh, int64_t kv_start) {
    (void)a, (void)qtok, (void)first_pos, (void)t_begin, (void)t_end, (void)kvh, (void)kv_start;
    return -1;
}

#endif
