/* Sixteen bf16 lanes on AVX-512 with AVX512-BF16, shared by the fused elementwise ops and the
 * AMX linear kernel's SiLU epilogue. HAVE_BF16X16 is defined when they are available. */
#ifndef PREFIXSERVE_BF16X16_H
#define PREFIXSERVE_BF16X16_H

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "vec16.h"
#define HAVE_BF16X16 1

/* 16 bf16 lanes (fewer under mask) widened to float32, and back with round-to-nearest-even
 * (vcvtneps2bf16 rounds as f32_to_bf16 does). */
static inline __m512 ld_bf(const uint16_t *p, __mmask16 k) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void st_bf(uint16_t *p, __mmask16 k, __m512 v) {
    _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline __m512 rnd_bf(__m512 v) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* bf16(silu(x)) * u for bf16 values x (gate) and u (up), before the final rounding: rounds where
 * the eager bf16 ops ``F.silu(gate) * up`` do. */
static inline __m512 silu_mul16(__m512 x, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    /* 1 / (1 + e): reciprocal estimate and one Newton step (~1e-7 relative), far cheaper than a
     * division. */
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(rnd_bf(_mm512_mul_ps(x, inv)), u);
}
#endif

#endif
