/* Sixteen float32 lanes for the native kernels: one AVX-512 register, or a pair of AVX2
 * registers on CPUs without AVX-512 (most laptops, AMD before Zen 4). The kernels are written
 * once against these helpers; on AVX-512 each helper is the single intrinsic the kernels used
 * before, so that build is unchanged. HAVE_VEC16 is defined when either is available; without
 * it the kernels keep their plain C loops.
 *
 * exp16 is e^x for |x| <= 87 (clamped beyond): Cody-Waite range reduction and a degree-7
 * polynomial, ~1e-7 relative error, no libm call. */
#ifndef PREFIXSERVE_VEC16_H
#define PREFIXSERVE_VEC16_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VEC16 1

typedef __m512 vf16;

static inline vf16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline vf16 v16_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_storeu(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 v16_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 v16_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 v16_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 v16_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 v16_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v16_reduce_add(vf16 v) { return _mm512_reduce_add_ps(v); }

/* 16 bf16 values widened to float32. */
static inline vf16 v16_load_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The largest of the first n lanes (1 <= n <= 16). */
static inline float v16_max_first(vf16 v, int n) {
    return _mm512_mask_reduce_max_ps((__mmask16)((1u << n) - 1u), v);
}

/* v with the lanes from n on set to 0. */
static inline vf16 v16_keep_first(vf16 v, int n) {
    return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u), v);
}

/* Lane j of the result is the sum of the 16 lanes of v[j]. */
static inline vf16 v16_hsum16(const vf16 *v) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++) {
        const __m512 x = v[2 * i], y = v[2 * i + 1];
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++) {
        const __m512 x = w[2 * i], y = w[2 * i + 1];
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    for (int i = 0; i < 2; i++) {
        const __m512 x = u[2 * i], y = u[2 * i + 1];
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* Lane 4k + e of s holds the sum of v[k + 4e]. */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, s);
}

static inline vf16 v16_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf16 v16_clamp(vf16 x, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
static inline vf16 v16_round(vf16 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for integral n in [-126, 127]. */
static inline vf16 v16_scale_pow2(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); }

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_VEC16 1

typedef struct {
    __m256 lo, hi;
} vf16;

static inline vf16 v16_zero(void) { return (vf16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf16 v16_set1(float x) { return (vf16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf16 v16_loadu(const float *p) {
    return (vf16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline void v16_storeu(float *p, vf16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline vf16 v16_add(vf16 a, vf16 b) {
    return (vf16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline vf16 v16_sub(vf16 a, vf16 b) {
    return (vf16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
static inline vf16 v16_mul(vf16 a, vf16 b) {
    return (vf16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
static inline vf16 v16_div(vf16 a, vf16 b) {
    return (vf16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
static inline vf16 v16_fmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
static inline float v16_reduce_add(vf16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }

static inline __m256 widen_bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf16 v16_load_bf16(const uint16_t *p) {
    return (vf16){widen_bf16x8(p), widen_bf16x8(p + 8)};
}

/* All-ones in lanes [0, n) of the pair, zero elsewhere. */
static inline void first_lanes(int n, __m256 *lo, __m256 *hi) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i nn = _mm256_set1_epi32(n);
    *lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nn, idx));
    *hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_sub_epi32(nn, _mm256_set1_epi32(8)), idx));
}

static inline float v16_max_first(vf16 v, int n) {
    __m256 ml, mh;
    first_lanes(n, &ml, &mh);
    const __m256 lowest = _mm256_set1_ps(-3.402823466e38f);
    __m256 m = _mm256_max_ps(_mm256_blendv_ps(lowest, v.lo, ml), _mm256_blendv_ps(lowest, v.hi, mh));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline vf16 v16_keep_first(vf16 v, int n) {
    __m256 ml, mh;
    first_lanes(n, &ml, &mh);
    return (vf16){_mm256_and_ps(v.lo, ml), _mm256_and_ps(v.hi, mh)};
}

/* Lane j of the result is the sum of the 8 lanes of s[j], for 8 vectors. */
static inline __m256 hsum8x8(const __m256 *s) {
    const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
    /* u0 lanes: s0..s3 summed over their low 128 bits, then over their high 128 bits. */
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline vf16 v16_hsum16(const vf16 *v) {
    __m256 s[16];
    for (int j = 0; j < 16; j++) s[j] = _mm256_add_ps(v[j].lo, v[j].hi);
    return (vf16){hsum8x8(s), hsum8x8(s + 8)};
}

static inline vf16 v16_fnmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline __m256 clamp8(__m256 x, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
static inline vf16 v16_clamp(vf16 x, float lo, float hi) {
    return (vf16){clamp8(x.lo, lo, hi), clamp8(x.hi, lo, hi)};
}
static inline vf16 v16_round(vf16 x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (vf16){_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
/* p * 2^n for integral n in [-126, 127], through the exponent field. */
static inline __m256 scale_pow2_8(__m256 p, __m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
static inline vf16 v16_scale_pow2(vf16 p, vf16 n) {
    return (vf16){scale_pow2_8(p.lo, n.lo), scale_pow2_8(p.hi, n.hi)};
}

#endif

#if defined(HAVE_VEC16)
static inline vf16 exp16(vf16 x) {
    x = v16_clamp(x, -87.0f, 88.0f);
    const vf16 n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f)));
    vf16 r = v16_fnmadd(n, v16_set1(0.693145751953125f), x);
    r = v16_fnmadd(n, v16_set1(1.428606765330187045e-06f), r);
    vf16 p = v16_set1(1.0f / 5040.0f);
    p = v16_fmadd(p, r, v16_set1(1.0f / 720.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f / 120.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f / 24.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f / 6.0f));
    p = v16_fmadd(p, r, v16_set1(0.5f));
    p = v16_fmadd(p, r, v16_set1(1.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f));
    return v16_scale_pow2(p, n);
}
#endif

#endif
