/* Paged decode attention for CPUs: one query token per sequence, keys and values read straight
 * from the paged cache through the block table (no gathered copy, no padding).
 *
 * Layouts (element strides; heads and head_dim are contiguous in every tensor):
 *   q, out        [num_seqs, num_heads, head_dim]          row stride q_stride / out_stride
 *   k_cache/v     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, bt_stride] int64; seq_lens [num_seqs] int64 (each >= 1)
 * Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 * dtype: 0 = float32, 1 = bfloat16; scores, softmax and accumulation are float32.
 * Work items are (sequence, KV head) pairs, shared out with OpenMP. The query rows of one KV
 * head are processed together so each cached K/V row is read once per step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

#define MAX_GROUP 16


/* Load head_dim elements at base[offset] as float32 into dst. */
static inline void load_row(const void *base, int64_t offset, int dtype, int dim, float *dst) {
    if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)dim);
    }
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == 1) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}
#endif

/* scores[g * ctx + t] = q_g . k_t for every token t of the sequence. */
static void qk_scores(const float *qf, const void *k_cache, const int64_t *table, int64_t ctx,
                      int group, int head_dim, int block_size, int64_t row, int64_t head_off,
                      int dtype, float *scores, float *tmp) {
    int64_t t = 0;
    for (int64_t b = 0; t < ctx; b++) {
        const int64_t base = table[b] * block_size * row + head_off;
        const int64_t n = ctx - t < block_size ? ctx - t : block_size;
        for (int64_t j = 0; j < n; j++, t++) {
            const int64_t off = base + j * row;
#if defined(__AVX512F__)
            if (head_dim == 64) {
                __m512 k0 = load16(k_cache, off, dtype), k1 = load16(k_cache, off + 16, dtype);
                __m512 k2 = load16(k_cache, off + 32, dtype), k3 = load16(k_cache, off + 48, dtype);
                for (int g = 0; g < group; g++) {
                    const float *qg = qf + (size_t)g * 64;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
                    __m512 c = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), k1);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, a);
                    c = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, c);
                    scores[(size_t)g * ctx + t] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
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

/* acc[g] = sum_t p[g, t] * v_t. */
static void pv_accumulate(const float *probs, const void *v_cache, const int64_t *table,
                          int64_t ctx, int group, int head_dim, int block_size, int64_t row,
                          int64_t head_off, int dtype, float *acc, float *tmp) {
#if defined(__AVX512F__)
    if (head_dim == 64 && group <= 4) {
        __m512 a[4][4];
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
        int64_t t = 0;
        for (int64_t b = 0; t < ctx; b++) {
            const int64_t base = table[b] * block_size * row + head_off;
            const int64_t n = ctx - t < block_size ? ctx - t : block_size;
            for (int64_t j = 0; j < n; j++, t++) {
                const int64_t off = base + j * row;
                __m512 v0 = load16(v_cache, off, dtype), v1 = load16(v_cache, off + 16, dtype);
                __m512 v2 = load16(v_cache, off + 32, dtype), v3 = load16(v_cache, off + 48, dtype);
                for (int g = 0; g < group; g++) {
                    __m512 p = _mm512_set1_ps(probs[(size_t)g * ctx + t]);
                    a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
                    a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
                    a[g][2] = _mm512_fmadd_ps(p, v2, a[g][2]);
                    a[g][3] = _mm512_fmadd_ps(p, v3, a[g][3]);
                }
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)g * 64 + 16 * c, a[g][c]);
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

int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int64_t bt_stride, int64_t q_stride,
                           int64_t out_stride, float scale, int dtype, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* elements per cache slot */
    int failed = 0;
    if (group > MAX_GROUP) return -2;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int s = (int)(item / num_kv_heads);
        const int kvh = (int)(item % num_kv_heads);
        const int64_t ctx = seq_lens[s];
        const int64_t *table = block_tables + (int64_t)s * bt_stride;
        const int64_t head_off = (int64_t)kvh * head_dim;
        float *buf = (float *)malloc(sizeof(float) * ((size_t)group * (size_t)ctx +
                                                      (size_t)(2 * group + 1) * head_dim));
        if (buf == NULL) {
            failed = 1;
            continue;
        }
        float *scores = buf;                              /* [group, ctx] */
        float *qf = scores + (size_t)group * (size_t)ctx; /* [group, head_dim] */
        float *acc = qf + (size_t)group * head_dim;       /* [group, head_dim] */
        float *tmp = acc + (size_t)group * head_dim;      /* [head_dim] */

        for (int g = 0; g < group; g++) {
            const int64_t off = (int64_t)s * q_stride + (int64_t)(kvh * group + g) * head_dim;
            float *qg = qf + (size_t)g * head_dim;
            load_row(q, off, dtype, head_dim, qg);
            for (int d = 0; d < head_dim; d++) qg[d] *= scale;
        }

        qk_scores(qf, k_cache, table, ctx, group, head_dim, block_size, row, head_off, dtype,
                  scores, tmp);

        for (int g = 0; g < group; g++) {
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
        }

        pv_accumulate(scores, v_cache, table, ctx, group, head_dim, block_size, row, head_off,
                      dtype, acc, tmp);

        for (int g = 0; g < group; g++) {
            const int64_t off = (int64_t)s * out_stride + (int64_t)(kvh * group + g) * head_dim;
            const float *ag = acc + (size_t)g * head_dim;
            if (dtype == 1) {
                uint16_t *o = (uint16_t *)out + off;
                for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(ag[d]);
            } else {
                memcpy((float *)out + off, ag, sizeof(float) * (size_t)head_dim);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* out[r] = index of the first maximum of row r of x [rows, cols >= 1] (row stride `stride`),
 * like torch.argmax for rows without NaN (this file is built with -ffast-math, so NaN rows are
 * not defined here; callers keep torch.argmax where NaN matters). dtype as above. */
void argmax_rows(const void *x, int64_t rows, int64_t cols, int64_t stride, int dtype,
                 int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = 0;
        if (dtype == 1) {
            const uint16_t *p = (const uint16_t *)x + r * stride;
            float mx = bf16_to_f32(p[0]);
            for (int64_t c = 1; c < cols; c++) {
                const float v = bf16_to_f32(p[c]);
                mx = v > mx ? v : mx;
            }
            for (int64_t c = 0; c < cols; c++) {
                if (bf16_to_f32(p[c]) == mx) {
                    best = c;
                    break;
                }
            }
        } else {
            const float *p = (const float *)x + r * stride;
            float mx = p[0];
            for (int64_t c = 1; c < cols; c++) mx = p[c] > mx ? p[c] : mx;
            for (int64_t c = 0; c < cols; c++) {
                if (p[c] == mx) {
                    best = c;
                    break;
                }
            }
        }
        out[r] = best;
    }
}
