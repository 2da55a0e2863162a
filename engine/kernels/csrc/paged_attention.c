/* Paged attention for CPUs over one flat batch: decodes (one query token) and prefill chunks
 * (query tokens after cached context) alike, keys and values read straight from the paged cache
 * through the block table (no gathered copy, no padding).
 *
 * Layouts (element strides; heads and head_dim are contiguous in every tensor):
 *   q, out        [num_tokens, num_heads, head_dim]         row stride q_stride / out_stride
 *   k_cache/v     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, bt_stride] int64
 *   seq_lens      [num_seqs] int64: context length, the sequence's query tokens included
 *   query_start, query_len  [num_seqs] int64: sequence s owns the query_len[s] tokens from
 *                 query_start[s] on (any subset of a batch), the last at position seq_lens[s] - 1
 *   lse           NULL, or float32 [num_tokens, num_heads]: log-sum-exp of each row's scores
 * Query token i of a sequence with qlen query tokens (position p = seq_len - qlen + i) attends
 * to the keys at positions kv_start .. p: causal, aligned to the bottom right. kv_start is a
 * multiple of block_size; a caller that attended to a shared prefix separately passes its length
 * and merges the two partial results through lse. A row that sees no key gets out = 0 and
 * lse = -inf. Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 * dtype: 0 = float32, 1 = bfloat16; scores, softmax and accumulation are float32.
 *
 * Work items are (sequence, tile of query tokens, range of KV heads), shared out with OpenMP.
 * Chunks of several tokens: the query rows of one KV head (the tile's tokens times the group) go
 * through the keys together in one pass with an online softmax: each cached K/V row is read
 * once per tile, no buffer grows with the context, and keys are scored 16 at a time with one
 * transposing horizontal sum; in bf16 with AVX512-BF16 the rows are vector lanes instead
 * (attention_tile_bf16.c), and with AMX an item is 16 tokens of every query head of one KV
 * head, scored and summed by tile multiplies (attention_amx.c). Decodes (one token): scores of
 * all keys first (AMX tile multiplies for bf16 where the CPU and kernel allow, else a vector
 * loop), one softmax, then the weighted sum of values; for a single query token that measured
 * faster than the online pass. In bf16 a decode step's sequences read their cache rows once for
 * all KV heads: on AMX here, on AVX512-BF16 without AMX in attention_decode_bf16.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "attention_amx.h"
#include "attention_decode_bf16.h"
#include "attention_tile_bf16.h"
#include "bf16.h"
#include "vec16.h"

#define MAX_ROWS 16 /* query rows of one KV head per pass */
#define MAX_HEAD_DIM 256
#define CHUNK 16 /* keys scored together */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens, *query_start, *query_len;
    void *out;
    float *lse;
    int num_heads, group, head_dim, block_size, dtype;
    int64_t bt_stride, q_stride, out_stride, row; /* row: elements per cache slot */
    int64_t kv_start;
    float scale;
    int amx_scores; /* bf16 decode scores on AMX: usable here, head_dim % 32, block_size % 16 */
    int amx_prefill; /* bf16 prefill tiles on AMX (attention_amx.c): amx_scores and head_dim fit */
    int bf16_decode; /* bf16 decodes of all KV heads in one pass, without AMX (attention_decode_bf16.c) */
} attn_args;

static inline float load_elem(const void *base, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Load head_dim elements at base[offset] as float32 into dst. */
static inline void load_row(const void *base, int64_t offset, int dtype, int dim, float *dst) {
    if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)dim);
    }
}

#if defined(HAVE_VEC16)
static inline vf16 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == 1) return v16_load_bf16((const uint16_t *)base + offset);
    return v16_loadu((const float *)base + offset);
}
#endif

/* Decode rows (one query token, the group's rows of one KV head) score every key first, then
 * take one softmax and one weighted sum: at a single query token this two-pass loop over the
 * keys beats the online tiled pass (fewer operations per key), and the scores of one sequence
 * fit in a small buffer.
 * scores[g * ctx + t] = q_g . k_t for the ctx keys from the start of block table[0]. */
static void qk_scores(const float *qf, const void *k_cache, const int64_t *table, int64_t ctx,
                      int group, int head_dim, int block_size, int64_t row, int64_t head_off,
                      int dtype, float *scores, float *tmp) {
    int64_t t = 0;
    for (int64_t b = 0; t < ctx; b++) {
        const int64_t base = table[b] * block_size * row + head_off;
        const int64_t n = ctx - t < block_size ? ctx - t : block_size;
#if defined(HAVE_VEC16)
        if (head_dim == 64 && n == 16) {
            /* A whole block: the 16 keys' partial products per row go through one transposing
             * sum (lane j = key j) instead of a horizontal sum per key and row, which on AVX2
             * is a chain of shuffles each. The block's keys stay in L1 across the rows. */
            for (int g = 0; g < group; g++) {
                const float *qg = qf + (size_t)g * 64;
                const vf16 q0 = v16_loadu(qg), q1 = v16_loadu(qg + 16);
                const vf16 q2 = v16_loadu(qg + 32), q3 = v16_loadu(qg + 48);
                vf16 part[16];
                for (int j = 0; j < 16; j++) {
                    const int64_t off = base + j * row;
                    vf16 a = v16_mul(q0, load16(k_cache, off, dtype));
                    vf16 c = v16_mul(q1, load16(k_cache, off + 16, dtype));
                    a = v16_fmadd(q2, load16(k_cache, off + 32, dtype), a);
                    c = v16_fmadd(q3, load16(k_cache, off + 48, dtype), c);
                    part[j] = v16_add(a, c);
                }
                v16_storeu(scores + (size_t)g * ctx + t, v16_hsum16(part));
            }
            t += 16;
            continue;
        }
#endif
        for (int64_t j = 0; j < n; j++, t++) {
            const int64_t off = base + j * row;
#if defined(HAVE_VEC16)
            if (head_dim == 64) {
                const vf16 k0 = load16(k_cache, off, dtype), k1 = load16(k_cache, off + 16, dtype);
                const vf16 k2 = load16(k_cache, off + 32, dtype), k3 = load16(k_cache, off + 48, dtype);
                for (int g = 0; g < group; g++) {
                    const float *qg = qf + (size_t)g * 64;
                    vf16 a = v16_mul(v16_loadu(qg), k0);
                    vf16 c = v16_mul(v16_loadu(qg + 16), k1);
                    a = v16_fmadd(v16_loadu(qg + 32), k2, a);
                    c = v16_fmadd(v16_loadu(qg + 48), k3, c);
                    scores[(size_t)g * ctx + t] = v16_reduce_add(v16_add(a, c));
                }
                continue;
            }
#endif
            load_row(k_cache, off, dtype, head_dim, tmp);
            for (int g = 0; g < group; g++) {
                const float *qg = qf + (size_t)g * head_dim;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++) dot += qg[d] * tmp[d];
                scores[(size_t)g * ctx + t] = dot;
            }
        }
    }
}

/* Values this many tokens ahead of the one being summed are requested into L1: the value rows
 * of a decode are read once, a head's slice (128 bytes in bf16) of each, far apart, which the
 * hardware prefetchers do not follow. */
#define PV_PREFETCH_AHEAD 32

/* Requests into L1 the bytes of value row t (one KV head's slice, head_dim elements of elem
 * bytes at element head_off of the row). */
static inline void prefetch_value(const void *v_cache, const int64_t *table, int64_t t,
                                  int block_size, int64_t row, int64_t head_off, int head_dim,
                                  int elem) {
    const char *p = (const char *)v_cache +
                    (size_t)elem * (size_t)((table[t / block_size] * block_size + t % block_size) *
                                                row + head_off);
    for (int l = 0; l < head_dim * elem; l += 64) __builtin_prefetch(p + l, 0, 3);
}

/* acc[g] = sum_t p[g, t] * v_t over the same keys. */
static void pv_accumulate(const float *probs, const void *v_cache, const int64_t *table,
                          int64_t ctx, int group, int head_dim, int block_size, int64_t row,
                          int64_t head_off, int dtype, float *acc, float *tmp) {
#if defined(HAVE_VEC16)
    if (head_dim == 64 && group <= 4) {
        const int elem = dtype == 1 ? 2 : 4;
        vf16 a[4][4];
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 4; c++) a[g][c] = v16_zero();
        for (int64_t tp = 0; tp < PV_PREFETCH_AHEAD && tp < ctx; tp++)
            prefetch_value(v_cache, table, tp, block_size, row, head_off, head_dim, elem);
        int64_t t = 0;
        for (int64_t b = 0; t < ctx; b++) {
            const int64_t base = table[b] * block_size * row + head_off;
            const int64_t n = ctx - t < block_size ? ctx - t : block_size;
            for (int64_t j = 0; j < n; j++, t++) {
                const int64_t off = base + j * row;
                if (t + PV_PREFETCH_AHEAD < ctx)
                    prefetch_value(v_cache, table, t + PV_PREFETCH_AHEAD, block_size, row,
                                   head_off, head_dim, elem);
                const vf16 v0 = load16(v_cache, off, dtype), v1 = load16(v_cache, off + 16, dtype);
                const vf16 v2 = load16(v_cache, off + 32, dtype), v3 = load16(v_cache, off + 48, dtype);
                for (int g = 0; g < group; g++) {
                    const vf16 p = v16_set1(probs[(size_t)g * ctx + t]);
                    a[g][0] = v16_fmadd(p, v0, a[g][0]);
                    a[g][1] = v16_fmadd(p, v1, a[g][1]);
                    a[g][2] = v16_fmadd(p, v2, a[g][2]);
                    a[g][3] = v16_fmadd(p, v3, a[g][3]);
                }
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) v16_storeu(acc + (size_t)g * 64 + 16 * c, a[g][c]);
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * (size_t)group * head_dim);
    int64_t t = 0;
    for (int64_t b = 0; t < ctx; b++) {
        const int64_t base = table[b] * block_size * row + head_off;
        const int64_t n = ctx - t < block_size ? ctx - t : block_size;
        for (int64_t j = 0; j < n; j++, t++) {
            load_row(v_cache, base + j * row, dtype, head_dim, tmp);
            for (int g = 0; g < group; g++) {
                const float p = probs[(size_t)g * ctx + t];
                float *ag = acc + (size_t)g * head_dim;
                for (int d = 0; d < head_dim; d++) ag[d] += p * tmp[d];
            }
        }
    }
}

#if defined(HAVE_AMX)
/* AMX for decode scores. A tile multiply computes C[16 x N] += A[16 x 32] . B[32 x N] in bf16
 * with float32 sums, B laid out in pairs of its rows ("VNNI"). With A = 16 cached keys (read in
 * place: a key row is contiguous, rows are a cache slot apart) and B = the group's query rows
 * transposed into pairs of dims (built once per item), one multiply per 32 dims scores 16 keys
 * against the whole group, where the vector loop needs a horizontal sum per key and row.
 * Without the tile state (amx_linear_available, amx.h) the vector loop runs. (The value side
 * stays on vector FMAs: AMX there needs the values paired up by key, a permute per pair of
 * rows, and measured slower.) */

/* Tiles of the decode scores (per thread): 0 holds 16 keys x 32 dims, 1 the group's queries as
 * 16 dim pairs x G, 2 the scores of 16 keys x G rows. */
static void configure_score_tiles(int G) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = 64;
    cfg.rows[1] = 16; cfg.colsb[1] = (uint16_t)(G * 4);
    cfg.rows[2] = 16; cfg.colsb[2] = (uint16_t)(G * 4);
    _tile_loadconfig(&cfg);
}

/* scores[g * ctx + t] = scale * q_g . k_t, as qk_scores, for bf16, head_dim % 32 == 0 and
 * block_size % 16 == 0. qb: the group's query rows [G, D] (bf16). */
static void qk_scores_amx(const uint16_t *qb, const uint16_t *k_cache, const int64_t *table,
                          int64_t ctx, int G, int D, int block_size, int64_t row,
                          int64_t head_off, float scale, float *scores) {
    configure_score_tiles(G);
    /* qv[c][p][g][2] = q_g[32c + 2p + {0, 1}] */
    uint16_t qv[(MAX_HEAD_DIM / 32) * 16 * MAX_ROWS * 2];
    for (int c = 0; c < D / 32; c++)
        for (int p = 0; p < 16; p++)
            for (int g = 0; g < G; g++) {
                uint16_t *dst = qv + ((size_t)(c * 16 + p) * G + g) * 2;
                dst[0] = qb[(size_t)g * D + 32 * c + 2 * p];
                dst[1] = qb[(size_t)g * D + 32 * c + 2 * p + 1];
            }
    float st[16 * MAX_ROWS];
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t slot = table[t0 / block_size] * block_size + t0 % block_size;
        const uint16_t *kb = k_cache + slot * row + head_off;
        _tile_zero(2);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(0, kb + 32 * c, row * 2);
            _tile_loadd(1, qv + (size_t)c * 16 * G * 2, G * 4);
            _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, st, G * 4);
        const int n = ctx - t0 < 16 ? (int)(ctx - t0) : 16;
        for (int g = 0; g < G; g++)
            for (int j = 0; j < n; j++) scores[(size_t)g * ctx + t0 + j] = st[j * G + g] * scale;
    }
    _tile_release();
}

#endif

/* sc[r][j] = scale * q_r . k_j for the n keys of a chunk starting at element kbase. */
static void score_chunk(const attn_args *a, const float *qf, const uint16_t *qb, int R,
                        int64_t kbase, int n, float sc[][CHUNK]) {
    const int D = a->head_dim, dtype = a->dtype;
    const int64_t row = a->row;
#if defined(HAVE_VEC16)
    if (D % 16 == 0) {
        vf16 part[CHUNK];
        for (int r = 0; r < R; r++) {
#if defined(__AVX512BF16__)
            if (qb != NULL) {
                /* bf16 query and key: exact products, float32 sums. */
                const uint16_t *qr = qb + (size_t)r * D;
                for (int j = 0; j < n; j++) {
                    const uint16_t *kr = (const uint16_t *)a->k_cache + kbase + j * row;
                    __m512 s = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 32)
                        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qr + d),
                                             (__m512bh)_mm512_loadu_si512(kr + d));
                    part[j] = s;
                }
                for (int j = n; j < CHUNK; j++) part[j] = _mm512_setzero_ps();
                v16_storeu(sc[r], v16_mul(v16_hsum16(part), v16_set1(a->scale)));
                continue;
            }
#endif
            const float *qr = qf + (size_t)r * D;
            for (int j = 0; j < n; j++) {
                const int64_t off = kbase + j * row;
                vf16 s = v16_mul(v16_loadu(qr), load16(a->k_cache, off, dtype));
                for (int d = 16; d < D; d += 16)
                    s = v16_fmadd(v16_loadu(qr + d), load16(a->k_cache, off + d, dtype), s);
                part[j] = s;
            }
            for (int j = n; j < CHUNK; j++) part[j] = v16_zero();
            v16_storeu(sc[r], v16_mul(v16_hsum16(part), v16_set1(a->scale)));
        }
        return;
    }
#endif
    (void)qb;
    for (int r = 0; r < R; r++) {
        const float *qr = qf + (size_t)r * D;
        for (int j = 0; j < n; j++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += qr[d] * load_elem(a->k_cache, kbase + j * row + d, dtype);
            sc[r][j] = dot * a->scale;
        }
    }
}

/* Online softmax: fold the chunk's scores of one row (its first nv >= 1 keys visible) into the
 * running maximum m and sum l (l == 0: nothing seen yet, m unset), rescale the row's
 * accumulator when the maximum grows, and leave the chunk's probabilities in sc (0 if unseen).
 * No infinities: the library is built with -ffast-math. */
static void softmax_chunk(float *sc, int nv, float *m, float *l, float *acc, int D) {
#if defined(HAVE_VEC16)
    const vf16 s = v16_loadu(sc);
    const float mx = v16_max_first(s, nv);
#else
    float mx = sc[0];
    for (int j = 1; j < nv; j++) mx = sc[j] > mx ? sc[j] : mx;
#endif
    if (*l > 0.0f && mx > *m) {
        const float alpha = expf(*m - mx);
        *l *= alpha;
        for (int d = 0; d < D; d++) acc[d] *= alpha;
    }
    if (*l == 0.0f || mx > *m) *m = mx;
    const float mn = *m;
#if defined(HAVE_VEC16)
    const vf16 p = v16_keep_first(exp16(v16_sub(s, v16_set1(mn))), nv);
    v16_storeu(sc, p);
    *l += v16_reduce_add(p);
#else
    float sum = 0.0f;
    for (int j = 0; j < CHUNK; j++) {
        sc[j] = j < nv ? expf(sc[j] - mn) : 0.0f;
        sum += sc[j];
    }
    *l += sum;
#endif
}

/* acc[r] += sum_j prob[r][j] * v_j over the n values of a chunk starting at element vbase. */
static void pv_chunk(const attn_args *a, float prob[][CHUNK], int R, int64_t vbase, int n,
                     float *acc) {
    const int D = a->head_dim, dtype = a->dtype;
    const int64_t row = a->row;
#if defined(HAVE_VEC16)
    if (D % 16 == 0) {
        /* Registers hold 4 rows x 64 dims of the accumulator at a time. */
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int nc = D - d0 < 64 ? (D - d0) / 16 : 4;
            for (int r0 = 0; r0 < R; r0 += 4) {
                const int nr = R - r0 < 4 ? R - r0 : 4;
                vf16 c[4][4];
                for (int i = 0; i < nr; i++)
                    for (int k = 0; k < nc; k++)
                        c[i][k] = v16_loadu(acc + (size_t)(r0 + i) * D + d0 + 16 * k);
                for (int j = 0; j < n; j++) {
                    const int64_t off = vbase + j * row + d0;
                    vf16 v[4];
                    for (int k = 0; k < nc; k++) v[k] = load16(a->v_cache, off + 16 * k, dtype);
                    for (int i = 0; i < nr; i++) {
                        const vf16 p = v16_set1(prob[r0 + i][j]);
                        for (int k = 0; k < nc; k++) c[i][k] = v16_fmadd(p, v[k], c[i][k]);
                    }
                }
                for (int i = 0; i < nr; i++)
                    for (int k = 0; k < nc; k++)
                        v16_storeu(acc + (size_t)(r0 + i) * D + d0 + 16 * k, c[i][k]);
            }
        }
        return;
    }
#endif
    for (int j = 0; j < n; j++)
        for (int r = 0; r < R; r++) {
            const float p = prob[r][j];
            float *ar = acc + (size_t)r * D;
            for (int d = 0; d < D; d++) ar[d] += p * load_elem(a->v_cache, vbase + j * row + d, dtype);
        }
}

/* Attention of query tokens [t0, t1) of sequence s for KV heads [h0, h1). */
static void attend_tile(const attn_args *a, int s, int64_t t0, int64_t t1, int h0, int h1) {
    const int G = a->group, D = a->head_dim, bs = a->block_size, dtype = a->dtype;
    const int64_t qbase = a->query_start[s];
    const int64_t qlen = a->query_len[s];
    const int64_t first_pos = a->seq_lens[s] - qlen;
    const int64_t kv_end = first_pos + t1; /* keys [kv_start, kv_end) */
    const int64_t *table = a->block_tables + (int64_t)s * a->bt_stride;
    const int R = (int)(t1 - t0) * G;
    if (dtype == 1 && D % 32 == 0 && D <= BF16_TILE_MAX_DIM && bf16_tile_available()) {
        /* Row lanes and vdpbf16ps (attention_tile_bf16.c): several times the rate of the loop
         * below, which stays for float32 and CPUs without AVX512-BF16. */
        const bf16_tile_args b = {(const uint16_t *)a->q, (const uint16_t *)a->k_cache,
                                  (const uint16_t *)a->v_cache, table, (uint16_t *)a->out, a->lse,
                                  a->num_heads, G, D, bs, a->q_stride, a->out_stride, a->row,
                                  a->scale};
        for (int kvh = h0; kvh < h1; kvh++)
            bf16_attend_tile(&b, qbase + t0, first_pos + t0, (int)(t1 - t0), kvh, a->kv_start);
        return;
    }
    float qf[MAX_ROWS * MAX_HEAD_DIM], acc[MAX_ROWS * MAX_HEAD_DIM];
    float m[MAX_ROWS], l[MAX_ROWS], sc[MAX_ROWS][CHUNK];
    int64_t limit[MAX_ROWS];
    const uint16_t *qb = NULL;
#if defined(__AVX512BF16__)
    uint16_t qbuf[MAX_ROWS * MAX_HEAD_DIM];
    if (dtype == 1 && D % 32 == 0) qb = qbuf;
#endif

    for (int kvh = h0; kvh < h1; kvh++) {
        const int64_t head_off = (int64_t)kvh * D;
        for (int r = 0; r < R; r++) {
            const int64_t off = (qbase + t0 + r / G) * a->q_stride + (int64_t)(kvh * G + r % G) * D;
            for (int d = 0; d < D; d++) qf[r * D + d] = load_elem(a->q, off + d, dtype);
            if (qb != NULL) memcpy((uint16_t *)qb + r * D, (const uint16_t *)a->q + off, 2 * (size_t)D);
            limit[r] = first_pos + t0 + r / G;
            m[r] = 0.0f;
            l[r] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)R * D);

        for (int64_t p0 = a->kv_start; p0 < kv_end;) {
            /* A chunk stays inside one block. */
            const int64_t left_in_block = bs - p0 % bs;
            int n = (int)(left_in_block < CHUNK ? left_in_block : CHUNK);
            if (kv_end - p0 < n) n = (int)(kv_end - p0);
            const int64_t base = (table[p0 / bs] * bs + p0 % bs) * a->row + head_off;
            score_chunk(a, qf, qb, R, base, n, sc);
            for (int r = 0; r < R; r++) {
                const int64_t vis = limit[r] - p0 + 1;
                const int nv = vis < n ? (int)(vis > 0 ? vis : 0) : n;
                if (nv == 0) {
                    memset(sc[r], 0, sizeof(sc[r]));
                    continue;
                }
                softmax_chunk(sc[r], nv, &m[r], &l[r], acc + (size_t)r * D, D);
            }
            pv_chunk(a, sc, R, base, n, acc);
            p0 += n;
        }

        for (int r = 0; r < R; r++) {
            const int64_t tok = qbase + t0 + r / G;
            const int h = kvh * G + r % G;
            const int64_t off = tok * a->out_stride + (int64_t)h * D;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int d = 0; d < D; d++) {
                const float v = acc[r * D + d] * inv;
                if (dtype == 1)
                    ((uint16_t *)a->out)[off + d] = f32_to_bf16(v);
                else
                    ((float *)a->out)[off + d] = v;
            }
            if (a->lse != NULL)
                a->lse[tok * a->num_heads + h] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
        }
    }
}

/* Each of the G rows of scores [G, ctx] becomes its softmax in place; lse[g] its log-sum-exp. */
static void softmax_rows(float *scores, int G, int64_t ctx, float *lse) {
    for (int g = 0; g < G; g++) {
        float *sg = scores + (size_t)g * ctx;
        float mx = sg[0];
        for (int64_t t = 1; t < ctx; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; t++) {
            sg[t] = expf(sg[t] - mx);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; t++) sg[t] *= inv;
        lse[g] = mx + logf(sum);
    }
}

/* The decode token's output rows of KV head kvh's query heads from acc [G, head_dim], and their
 * log-sum-exp where asked for. */
static void store_decode_rows(const attn_args *a, int64_t tok, int kvh, const float *acc,
                              const float *lse) {
    const int G = a->group, D = a->head_dim;
    for (int g = 0; g < G; g++) {
        const int h = kvh * G + g;
        const int64_t off = tok * a->out_stride + (int64_t)h * D;
        const float *ag = acc + (size_t)g * D;
        if (a->dtype == 1) {
            uint16_t *o = (uint16_t *)a->out + off;
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(ag[d]);
        } else {
            memcpy((float *)a->out + off, ag, sizeof(float) * (size_t)D);
        }
        if (a->lse != NULL) a->lse[tok * a->num_heads + h] = lse[g];
    }
}

/* Attention of the single query token of sequence s for KV head kvh. Returns 0, or -1 when the
 * score buffer cannot be allocated. */
static int attend_decode(const attn_args *a, int s, int kvh) {
    const int G = a->group, D = a->head_dim, bs = a->block_size, dtype = a->dtype;
    const int64_t tok = a->query_start[s];
    const int64_t ctx = a->seq_lens[s] - a->kv_start;
    const int64_t *table = a->block_tables + (int64_t)s * a->bt_stride + a->kv_start / bs;
    const int64_t head_off = (int64_t)kvh * D;
    if (ctx <= 0) {
        for (int g = 0; g < G; g++) {
            const int h = kvh * G + g;
            const int64_t off = tok * a->out_stride + (int64_t)h * D;
            for (int d = 0; d < D; d++) {
                if (dtype == 1) ((uint16_t *)a->out)[off + d] = 0;
                else ((float *)a->out)[off + d] = 0.0f;
            }
            if (a->lse != NULL) a->lse[tok * a->num_heads + h] = -INFINITY;
        }
        return 0;
    }
    float *buf = (float *)malloc(sizeof(float) * ((size_t)G * (size_t)ctx + (size_t)(2 * G + 1) * D));
    if (buf == NULL) return -1;
    float *scores = buf;                          /* [G, ctx] */
    float *qf = scores + (size_t)G * (size_t)ctx; /* [G, D] */
    float *acc = qf + (size_t)G * D;              /* [G, D] */
    float *tmp = acc + (size_t)G * D;             /* [D] */
    for (int g = 0; g < G; g++) {
        const int64_t off = tok * a->q_stride + (int64_t)(kvh * G + g) * D;
        load_row(a->q, off, dtype, D, qf + (size_t)g * D);
        for (int d = 0; d < D; d++) qf[(size_t)g * D + d] *= a->scale;
    }
#if defined(HAVE_AMX)
    if (a->amx_scores) {
        /* The group's heads are adjacent in the query row: read them in place. */
        const uint16_t *qb = (const uint16_t *)a->q + tok * a->q_stride + (int64_t)kvh * G * D;
        qk_scores_amx(qb, (const uint16_t *)a->k_cache, table, ctx, G, D, bs, a->row, head_off,
                      a->scale, scores);
    } else
#endif
        qk_scores(qf, a->k_cache, table, ctx, G, D, bs, a->row, head_off, dtype, scores, tmp);
    float lse[MAX_ROWS];
    softmax_rows(scores, G, ctx, lse);
    pv_accumulate(scores, a->v_cache, table, ctx, G, D, bs, a->row, head_off, dtype, acc, tmp);
    store_decode_rows(a, tok, kvh, acc, lse);
    free(buf);
    return 0;
}

#if defined(HAVE_AMX)
/* Keys or values of 16 tokens ahead of the one being scored: far enough that the lines arrive
 * before they are read, near enough to stay in L2. */
#define PREFETCH_AHEAD 32

/* Requests the cache rows of tokens [t0, t0 + 16) (clipped to ctx; inside one block, as
 * block_size % 16 == 0) into L1 (to_l1) or L2. */
static inline void prefetch_16_rows(const uint16_t *cache, const int64_t *table, int64_t t0,
                                    int64_t ctx, int bs, int64_t row, int to_l1) {
    const int64_t n = ctx - t0 < 16 ? ctx - t0 : 16;
    const char *p = (const char *)(cache + (table[t0 / bs] * bs + t0 % bs) * row);
    for (size_t l = 0; l < (size_t)(n * row * 2); l += 64) {
        if (to_l1)
            _mm_prefetch(p + l, _MM_HINT_T0);
        else
            _mm_prefetch(p + l, _MM_HINT_T1);
    }
}

/* Attention of the single query token of sequence s for all KV heads, bf16 on AMX: one pass over
 * the keys, 16 tokens at a time, scores every head from whole cache rows (a slot's heads are
 * adjacent), so each key row is read once and in order, while the rows PREFETCH_AHEAD tokens on
 * are requested ahead; then a softmax per row and each head's weighted sum, which requests its
 * values PV_PREFETCH_AHEAD tokens ahead (asking for the values during the key pass, to L2, left
 * most of them out of cache by the time they were summed, and slowed the key pass). Walking the
 * heads one by one instead read a third of every key row per pass with the prefetchers idle, at
 * ~8 GB/s of K/V in a decode step against ~20 here. Needs head_dim % 32 == 0 and block_size % 16
 * == 0. Returns 0, or -1 when the buffer cannot be allocated. */
static int attend_decode_heads_amx(const attn_args *a, int s) {
    const int G = a->group, D = a->head_dim, bs = a->block_size;
    const int64_t row = a->row;
    const int HK = (int)(row / D);
    const int64_t tok = a->query_start[s];
    const int64_t ctx = a->seq_lens[s] - a->kv_start;
    if (ctx <= 0) {
        for (int h = 0; h < HK; h++) attend_decode(a, s, h);
        return 0;
    }
    const int64_t *table = a->block_tables + (int64_t)s * a->bt_stride + a->kv_start / bs;
    const size_t nq = (size_t)HK * (D / 32) * 16 * G * 2;
    float *buf = (float *)malloc(sizeof(float) * ((size_t)HK * G * (size_t)ctx + (size_t)(G + 1) * D) +
                                 sizeof(uint16_t) * nq);
    if (buf == NULL) return -1;
    float *scores = buf;                                  /* [HK, G, ctx] */
    float *acc = scores + (size_t)HK * G * (size_t)ctx;   /* [G, D] */
    float *tmp = acc + (size_t)G * D;                     /* [D] */
    uint16_t *qv = (uint16_t *)(tmp + D);                 /* [HK][D / 32][16][G][2] */
    const uint16_t *q = (const uint16_t *)a->q + tok * a->q_stride;
    for (int h = 0; h < HK; h++)
        for (int c = 0; c < D / 32; c++)
            for (int p = 0; p < 16; p++)
                for (int g = 0; g < G; g++) {
                    uint16_t *dst = qv + ((((size_t)h * (D / 32) + c) * 16 + p) * G + g) * 2;
                    const uint16_t *src = q + (size_t)(h * G + g) * D + 32 * c + 2 * p;
                    dst[0] = src[0];
                    dst[1] = src[1];
                }

    configure_score_tiles(G);
    const uint16_t *kc = (const uint16_t *)a->k_cache, *vc = (const uint16_t *)a->v_cache;
    float st[16 * MAX_ROWS];
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t slot = table[t0 / bs] * bs + t0 % bs;
        const int64_t n16 = ctx - t0 < 16 ? ctx - t0 : 16;
        if (t0 == 0) /* the first tokens' keys, which no earlier step asked for */
            for (int64_t tp = 0; tp < PREFETCH_AHEAD && tp < ctx; tp += 16)
                prefetch_16_rows(kc, table, tp, ctx, bs, row, 1);
        if (t0 + PREFETCH_AHEAD < ctx) prefetch_16_rows(kc, table, t0 + PREFETCH_AHEAD, ctx, bs, row, 1);
        const uint16_t *kb = kc + slot * row;
        for (int h = 0; h < HK; h++) {
            _tile_zero(2);
            for (int c = 0; c < D / 32; c++) {
                _tile_loadd(0, kb + (size_t)h * D + 32 * c, row * 2);
                _tile_loadd(1, qv + ((size_t)h * (D / 32) + c) * 16 * G * 2, G * 4);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, st, G * 4);
            for (int g = 0; g < G; g++) {
                float *dst = scores + ((size_t)h * G + g) * (size_t)ctx + t0;
                for (int j = 0; j < n16; j++) dst[j] = st[j * G + g] * a->scale;
            }
        }
    }
    _tile_release();

    for (int h = 0; h < HK; h++) {
        float lse[MAX_ROWS];
        float *sh = scores + (size_t)h * G * (size_t)ctx;
        softmax_rows(sh, G, ctx, lse);
        pv_accumulate(sh, a->v_cache, table, ctx, G, D, bs, row, (int64_t)h * D, 1, acc, tmp);
        store_decode_rows(a, tok, h, acc, lse);
    }
    free(buf);
    return 0;
}
#endif

/* A share of paged_attention's work: query tokens [t0, t1) of sequence seq for KV heads
 * [h0, h1), and an estimate of its cost (query tokens times keys) for ordering. */
typedef struct {
    int seq;
    int64_t t0, t1;
    int h0, h1;
    int64_t work;
} work_item;

static int by_work_desc(const void *x, const void *y) {
    const int64_t a = ((const work_item *)x)->work, b = ((const work_item *)y)->work;
    return (a < b) - (a > b);
}

/* The most runs one sequence's AMX prefill is cut into (per KV head). */
#define AMX_MAX_RUNS 16

/* Keys the AMX tiles of query tokens [t0, t1) read, summed over tiles (what they cost), for a
 * sequence whose query token 0 sits at first_pos. */
static int64_t amx_run_work(int64_t first_pos, int64_t t0, int64_t t1, int64_t kv_start) {
    int64_t w = 0;
    for (int64_t t = t0; t < t1; t += AMX_TILE_TOKENS) {
        const int64_t n = t1 - t < AMX_TILE_TOKENS ? t1 - t : AMX_TILE_TOKENS;
        const int64_t keys = first_pos + t + n - kv_start;
        w += (keys > 0 ? keys : 0) * AMX_TILE_TOKENS;
    }
    return w;
}

/* Cuts a sequence's qlen query tokens into runs of whole tiles holding about equal work, each at
 * most cap where whole tiles allow (at most AMX_MAX_RUNS runs); writes the runs' bounds to cuts
 * (runs + 1 entries) and returns how many runs. */
static int amx_runs(int64_t first_pos, int64_t qlen, int64_t kv_start, int64_t cap, int64_t *cuts) {
    const int64_t total = amx_run_work(first_pos, 0, qlen, kv_start);
    const int64_t tiles = (qlen + AMX_TILE_TOKENS - 1) / AMX_TILE_TOKENS;
    int64_t runs = (total + cap - 1) / cap;
    if (runs > tiles) runs = tiles;
    if (runs > AMX_MAX_RUNS) runs = AMX_MAX_RUNS;
    if (runs < 1) runs = 1;
    cuts[0] = 0;
    int r = 1;
    int64_t done = 0;
    for (int64_t t = 0; t < qlen && r < runs; t += AMX_TILE_TOKENS) {
        const int64_t t1 = t + AMX_TILE_TOKENS < qlen ? t + AMX_TILE_TOKENS : qlen;
        done += amx_run_work(first_pos, t, t1, kv_start);
        /* Cut after this tile once the runs so far hold their share of the work. */
        if (done * runs >= total * r && t1 < qlen) cuts[r++] = t1;
    }
    runs = r;
    cuts[runs] = qlen;
    return (int)runs;
}

int paged_attention(const void *q, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, const int64_t *seq_lens,
                    const int64_t *query_start, const int64_t *query_len, void *out,
                    float *lse, int num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int block_size,
                    int64_t bt_stride, int64_t q_stride, int64_t out_stride, int64_t kv_start,
                    float scale, int dtype, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_ROWS || head_dim > MAX_HEAD_DIM) return -2;
    if (kv_start % block_size) return -3;
    attn_args a = {q, k_cache, v_cache, block_tables, seq_lens, query_start, query_len, out, lse,
                         num_heads, group, head_dim, block_size, dtype, bt_stride, q_stride,
                         out_stride, (int64_t)num_kv_heads * head_dim, kv_start, scale,
#if defined(HAVE_AMX)
                         /* Settled here, before any parallel region asks. */
                         dtype == 1 && head_dim % 32 == 0 && block_size % 16 == 0 &&
                             amx_linear_available()
#else
                         0
#endif
    };
    a.amx_prefill = a.amx_scores && head_dim <= BF16_TILE_MAX_DIM;
    a.bf16_decode = dtype == 1 && !a.amx_scores && bf16_decode_supported(head_dim, block_size);
    const int tile = MAX_ROWS / group; /* query tokens per item */

    /* Items: every sequence's query tiles, split by KV head when there are too few to keep the
     * threads busy (a batch of one) and always for decodes (one tile of one token). On AMX a
     * prefill item is a run of 16-token tiles of every query head of one KV head, which packs
     * the keys it reads once (attention_amx.c): a sequence is one run per KV head unless its
     * work per KV head exceeds a (4 * num_threads)'th of the step's, and is then cut where the
     * work (keys per tile, growing along a causal prompt) splits evenly; finer cuts pack more
     * keys again but measured faster on one long prompt than a cut per (4 * num_threads)'th of
     * all KV heads' work. Items then go longest first. */
    int64_t num_tiles = 0, num_items = 0, amx_work = 0;
    for (int s = 0; s < num_seqs; s++) {
        num_tiles += (query_len[s] + tile - 1) / tile;
        if (query_len[s] > 1 && a.amx_prefill)
            amx_work += amx_run_work(seq_lens[s] - query_len[s], 0, query_len[s], kv_start);
    }
    const int splits = num_tiles < 4 * (int64_t)num_threads ? num_kv_heads : 1;
    /* The most work one AMX run should hold, over all KV heads. */
    const int64_t amx_cap = amx_work / (4 * (int64_t)num_threads) + 1;
    for (int s = 0; s < num_seqs; s++) {
        if (query_len[s] > 1 && a.amx_prefill) {
            /* At most, not exactly: amx_runs may need fewer. */
            const int64_t tiles = (query_len[s] + AMX_TILE_TOKENS - 1) / AMX_TILE_TOKENS;
            num_items += (tiles < AMX_MAX_RUNS ? tiles : AMX_MAX_RUNS) * num_kv_heads;
        } else
            num_items += (query_len[s] + tile - 1) / tile * splits;
    }
    work_item *items = (work_item *)malloc(sizeof(work_item) * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL) return -1;
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t qlen = query_len[s], first_pos = seq_lens[s] - qlen;
        if (qlen > 1 && a.amx_prefill) {
            int64_t cuts[AMX_MAX_RUNS + 1];
            const int runs = amx_runs(first_pos, qlen, kv_start, amx_cap, cuts);
            for (int r = 0; r < runs; r++) {
                const int64_t work = amx_run_work(first_pos, cuts[r], cuts[r + 1], kv_start);
                for (int h = 0; h < num_kv_heads; h++)
                    items[k++] = (work_item){s, cuts[r], cuts[r + 1], h, h + 1, work};
            }
            continue;
        }
        for (int64_t t = 0; t < qlen; t += tile)
            for (int p = 0; p < splits; p++) {
                const int64_t t1 = t + tile < qlen ? t + tile : qlen;
                items[k++] = (work_item){s, t, t1, splits == 1 ? 0 : p,
                                         splits == 1 ? num_kv_heads : p + 1,
                                         (t1 - t) * (first_pos + t1 - kv_start)};
            }
    }
    num_items = k;
    if (amx_work > 0) qsort(items, (size_t)num_items, sizeof(work_item), by_work_desc);
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t it = 0; it < num_items; it++) {
        const work_item *item = items + it;
        const int s = item->seq;
        const int64_t t0 = item->t0, t1 = item->t1;
        const int h0 = item->h0, h1 = item->h1;
        const int64_t qlen = query_len[s];
        if (qlen == 1) {
#if defined(HAVE_AMX)
            if (splits == 1 && a.amx_scores) {
                if (attend_decode_heads_amx(&a, s) != 0) failed = 1;
                continue;
            }
#endif
            const int64_t ctx = seq_lens[s] - kv_start;
            if (splits == 1 && a.bf16_decode && ctx > 0) {
                const bf16_tile_args b = {(const uint16_t *)q, (const uint16_t *)k_cache,
                                          (const uint16_t *)v_cache,
                                          block_tables + (int64_t)s * bt_stride + kv_start / block_size,
                                          (uint16_t *)out, lse, num_heads, group, head_dim, block_size,
                                          q_stride, out_stride, a.row, scale};
                if (bf16_attend_decode(&b, query_start[s], ctx) != 0) failed = 1;
                continue;
            }
            for (int h = h0; h < h1; h++)
                if (attend_decode(&a, s, h) != 0) failed = 1;
            continue;
        }
        if (a.amx_prefill) {
            const bf16_tile_args b = {(const uint16_t *)q, (const uint16_t *)k_cache,
                                      (const uint16_t *)v_cache, block_tables + (int64_t)s * bt_stride,
                                      (uint16_t *)out, lse, num_heads, group, head_dim, block_size,
                                      q_stride, out_stride, a.row, scale};
            if (amx_attend_tiles(&b, query_start[s], seq_lens[s] - qlen, t0, t1, h0, kv_start) != 0)
                failed = 1;
            continue;
        }
        attend_tile(&a, s, t0, t1, h0, h1);
    }
    free(items);
    return failed ? -1 : 0;
}

/* Merge two partial attentions of the same query rows over disjoint key sets:
 * out[t, h] = (a * e^(lse_a - m) + b * e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)),
 * m = max(lse_a, lse_b). a is laid out [num_kv_heads, num_tokens * group, head_dim] (a prefix
 * attention computed per KV head with the group's rows stacked), its lse
 * [num_kv_heads, num_tokens * group]; b and out are [num_tokens, num_heads, head_dim] (row
 * strides b_stride / out_stride) with lse_b [num_tokens, num_heads]. Every row of b has lse_b
 * finite (each query sees at least itself). */
void merge_attention(const void *a, const float *lse_a, const void *b, const float *lse_b,
                     void *out, int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                     int64_t b_stride, int64_t out_stride, int dtype, int num_threads) {
    const int G = num_heads / num_kv_heads, D = head_dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) if(num_tokens * num_heads * head_dim >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int h = 0; h < num_heads; h++) {
            const int kvh = h / G, g = h % G;
            const int64_t arow = (int64_t)kvh * num_tokens * G + t * G + g;
            const float la = lse_a[arow], lb = lse_b[t * num_heads + h];
            const float mx = la > lb ? la : lb;
            const float wa = expf(la - mx), wb = expf(lb - mx);
            const float inv = 1.0f / (wa + wb);
            const float ca = wa * inv, cb = wb * inv;
            const int64_t aoff = arow * D, boff = t * b_stride + (int64_t)h * D;
            const int64_t ooff = t * out_stride + (int64_t)h * D;
            if (dtype == 1) {
                const uint16_t *ap = (const uint16_t *)a + aoff, *bp = (const uint16_t *)b + boff;
                uint16_t *op = (uint16_t *)out + ooff;
#pragma omp simd
                for (int d = 0; d < D; d++)
                    op[d] = f32_to_bf16(ca * bf16_to_f32(ap[d]) + cb * bf16_to_f32(bp[d]));
            } else {
                const float *ap = (const float *)a + aoff, *bp = (const float *)b + boff;
                float *op = (float *)out + ooff;
#pragma omp simd
                for (int d = 0; d < D; d++) op[d] = ca * ap[d] + cb * bp[d];
            }
        }
    }
}

/* Cache slot slots[t] of k_cache and v_cache (row_elems elements each) <- row t of k and v (row
 * strides k_stride / v_stride, in elements of elem_size bytes), for every t < num_tokens. */
void write_kv_cache(const void *k, const void *v, void *k_cache, void *v_cache,
                    const int64_t *slots, int64_t num_tokens, int64_t row_elems, int64_t k_stride,
                    int64_t v_stride, int elem_size, int num_threads) {
    const size_t bytes = (size_t)row_elems * (size_t)elem_size;
#pragma omp parallel for schedule(static) num_threads(num_threads) if(num_tokens * row_elems >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t dst = slots[t] * row_elems * elem_size;
        memcpy((char *)k_cache + dst, (const char *)k + t * k_stride * elem_size, bytes);
        memcpy((char *)v_cache + dst, (const char *)v + t * v_stride * elem_size, bytes);
    }
}
