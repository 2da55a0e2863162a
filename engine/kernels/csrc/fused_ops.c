/* Fused bfloat16 elementwise ops of a Llama layer, each one pass over its rows. Every step
 * rounds to bfloat16 where PyTorch's eager bf16 ops would (each op computes in float32 and
 * rounds its result), so results match the unfused ops up to float32 reduction order.
 * Rows are split across OpenMP threads only when there is enough work (PARALLEL_MIN elements):
 * below that (a few decode rows) a pass takes less than a parallel region's fork and barrier,
 * and on a shared machine a barrier can wait a whole time slice for a descheduled thread. At 64
 * decode rows the SiLU pass (98K elements) already takes ~100 us on one core.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "bf16.h"
#include "bf16x16.h"
#include "vec16.h"
#if defined(HAVE_BF16X16)
#define FUSED_AVX512 1
#endif

#define PARALLEL_MIN (1 << 15)


static inline float round_bf(float f) { return bf16_to_f32(f32_to_bf16(f)); }


/* If residual != NULL: x <- x + residual (in place, bf16). Then
 * out = weight * bf16(x * rsqrt(mean(x^2) + eps)), i.e. transformers' LlamaRMSNorm in bf16. */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, int64_t x_stride,
                       int64_t res_stride, int64_t out_stride, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * x_stride;
#if defined(FUSED_AVX512)
        {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d += 16) {
                const __mmask16 k = tail(dim - d);
                __m512 v = ld_bf(xr + d, k);
                if (residual != NULL) {
                    v = rnd_bf(_mm512_add_ps(v, ld_bf(residual + r * res_stride + d, k)));
                    st_bf(xr + d, k, v);
                }
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            const __m512 scale =
                _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
            uint16_t *o = out + r * out_stride;
            for (int64_t d = 0; d < dim; d += 16) {
                const __mmask16 k = tail(dim - d);
                const __m512 v = rnd_bf(_mm512_mul_ps(ld_bf(xr + d, k), scale));
                st_bf(o + d, k, _mm512_mul_ps(ld_bf(weight + d, k), v));
            }
            continue;
        }
#endif
        if (residual != NULL) {
            const uint16_t *rr = residual + r * res_stride;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) xr[d] = f32_to_bf16(bf16_to_f32(xr[d]) + bf16_to_f32(rr[d]));
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += bf16_to_f32(xr[d]) * bf16_to_f32(xr[d]);
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        uint16_t *o = out + r * out_stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * round_bf(bf16_to_f32(xr[d]) * scale));
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of x (row stride x_stride;
 * heads of head_dim contiguous). cos/sin are float32 tables [max_pos, head_dim / 2], rounded to
 * bf16 first as the model does: out1 = x1*c - x2*s, out2 = x2*c + x1*s, every op in bf16. */
void rope_bf16(uint16_t *x, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
               int64_t x_stride, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * heads * head_dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *ct = cos_table + positions[r] * half;
        const float *st = sin_table + positions[r] * half;
#if defined(FUSED_AVX512)
        if (half % 16 == 0) {
            /* The same roundings on 16 lanes; the row's cos / sin rounded once for its heads. */
            for (int64_t d = 0; d < half; d += 16) {
                const __m512 c = rnd_bf(_mm512_loadu_ps(ct + d));
                const __m512 s = rnd_bf(_mm512_loadu_ps(st + d));
                for (int64_t h = 0; h < heads; h++) {
                    uint16_t *x1 = x + r * x_stride + h * head_dim + d, *x2 = x1 + half;
                    const __m512 a = ld_bf(x1, 0xFFFF), b = ld_bf(x2, 0xFFFF);
                    const __m512 o1 = _mm512_sub_ps(rnd_bf(_mm512_mul_ps(a, c)),
                                                    rnd_bf(_mm512_mul_ps(b, s)));
                    const __m512 o2 = _mm512_add_ps(rnd_bf(_mm512_mul_ps(b, c)),
                                                    rnd_bf(_mm512_mul_ps(a, s)));
                    st_bf(x1, 0xFFFF, o1);
                    st_bf(x2, 0xFFFF, o2);
                }
            }
            continue;
        }
#endif
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x1 = x + r * x_stride + h * head_dim;
            uint16_t *x2 = x1 + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float c = round_bf(ct[d]), s = round_bf(st[d]);
                const float a = bf16_to_f32(x1[d]), b = bf16_to_f32(x2[d]);
                const float o1 = round_bf(round_bf(a * c) - round_bf(b * s));
                const float o2 = round_bf(round_bf(b * c) + round_bf(a * s));
                x1[d] = f32_to_bf16(o1);
                x2[d] = f32_to_bf16(o2);
            }
        }
    }
}

/* out = bf16(silu(gate)) * up, with gate_up rows [gate (inter) | up (inter)]. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int64_t in_stride, int64_t out_stride, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * in_stride;
        const uint16_t *u = g + inter;
        uint16_t *o = out + r * out_stride;
#if defined(FUSED_AVX512)
        for (int64_t d = 0; d < inter; d += 16) {
            const __mmask16 k = tail(inter - d);
            st_bf(o + d, k, silu_mul16(ld_bf(g + d, k), ld_bf(u + d, k)));
        }
        continue;
#endif
#pragma omp simd
        for (int64_t d = 0; d < inter; d++) {
            const float x = bf16_to_f32(g[d]);
            /* Clamped: with -ffast-math an infinite e^-x can turn x / (1 + e) into NaN. */
            const float s = round_bf(x / (1.0f + expf(fminf(-x, 88.0f))));
            o[d] = f32_to_bf16(s * bf16_to_f32(u[d]));
        }
    }
}

/* float32 versions of the three ops above, for models served in float32 (CPUs without native
 * bf16). Same arithmetic as the eager float32 ops, in one pass per row; results differ from
 * them only by float32 summation order (RMSNorm) and e^x's last bit (SiLU). */
void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out,
                      int64_t rows, int64_t dim, int64_t x_stride, int64_t res_stride,
                      int64_t out_stride, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride;
        if (residual != NULL) {
            const float *rr = residual + r * res_stride;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) xr[d] += rr[d];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += xr[d] * xr[d];
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (xr[d] * scale);
    }
}

void rope_f32(float *x, const int64_t *positions, const float *cos_table, const float *sin_table,
              int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * heads * head_dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *ct = cos_table + positions[r] * half;
        const float *st = sin_table + positions[r] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * x_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = x1[d], b = x2[d];
                x1[d] = a * ct[d] - b * st[d];
                x2[d] = b * ct[d] + a * st[d];
            }
        }
    }
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int64_t in_stride, int64_t out_stride, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride;
        const float *u = g + inter;
        float *o = out + r * out_stride;
        int64_t d = 0;
#if defined(HAVE_VEC16)
        for (; d + 16 <= inter; d += 16) {
            const vf16 x = v16_loadu(g + d);
            const vf16 den = v16_add(v16_set1(1.0f), exp16(v16_sub(v16_zero(), x)));
            v16_storeu(o + d, v16_mul(v16_div(x, den), v16_loadu(u + d)));
        }
#endif
        for (; d < inter; d++) {
            const float x = g[d];
            o[d] = x / (1.0f + expf(fminf(-x, 88.0f))) * u[d];
        }
    }
}
