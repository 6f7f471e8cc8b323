/* bf16 <-> fp32 conversions shared by the decode kernels (bf16_decode.c) and the AMX GEMM
 * (amx_gemm.c): round to nearest even, NaN kept a (quiet) NaN, as PyTorch's .to(torch.bfloat16). */
#ifndef LLAMARL_BF16_MATH_H
#define LLAMARL_BF16_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef LLAMARL_AVX512_BF16
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Built with -fopenmp the kernels split their rows / outputs across the `threads` the caller passes
 * (PyTorch's intra-op count: the same libgomp, so the same thread pool); without it the pragmas are
 * ignored and everything runs on the calling thread. */
static inline int omp_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int omp_threads(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef LLAMARL_AVX512_BF16
/* 32 bf16 from p, zeros past the first `left` (a row's tail when k is not a multiple of 32). */
static inline __m512bh load32(const uint16_t *p, int64_t left) {
    if (left >= 32) return (__m512bh)_mm512_loadu_si512((const void *)p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), (const void *)p);
}
#endif

#ifdef LLAMARL_AVX512_BF16
/* The first min(left, 16) of 16 lanes (a row's last partial vector; left >= 0). */
static inline __mmask16 first_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}
#endif

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef LLAMARL_AVX512_BF16
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* fp32 -> bf16 on 16 lanes, round to nearest even (the scalar f32_to_bf16's integer steps; NaN quieted). */
static inline __m256i to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
#endif

/* e^x for |x| <= 87 to ~1 ulp of fp32 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
 * 2^n by the exponent bits), saturating outside; branch-free so the compiler vectorizes the loops
 * that call it (libm's expf is a scalar call, 4 of the 5 ns per element of SwiGLU). */
static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, -87.0f), 87.0f);
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#ifdef LLAMARL_AVX512_BF16
/* exp_approx on 16 lanes (the same operations, so the same results). */
static inline __m512 exp_approx16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                             _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#endif
