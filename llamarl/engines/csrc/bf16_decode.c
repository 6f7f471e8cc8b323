/* bf16 pieces of a decode step for small batches on CPU (llamarl/engines/cpu_kernels.py builds,
 * loads and calls this; see its docstring for why and for when each piece runs).
 *
 * All tensors are bf16 (uint16 bit patterns), row-major and contiguous unless said otherwise. Each
 * function rounds to bf16 where HF's eager bf16 modules round, and computes in fp32 in between, so
 * its outputs equal theirs up to the order of fp32 sums (the last bf16 bit, now and then).
 *
 * llamarl_gemv_bf16 (compiled only with AVX512-BF16, -DLLAMARL_GEMV):
 * y[i, r] = bf16( sum_c x[i, c] * w[r, c]  (+ bias[r]) )  for i < m, r < n, c < k
 * x: [m, k], w: [n, k], bias: [n] or NULL, y: [m, n]. Products and sums in fp32 (VDPBF16PS: each
 * instruction adds pairs of exact bf16 products to 16 fp32 lanes), bias added in fp32, one
 * round-to-nearest-even to bf16 at the end. Each weight row is read once and dotted with every row
 * of x (m <= LLAMARL_GEMV_MAX_ROWS), so the weights stream from memory once. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef LLAMARL_GEMV
#include <immintrin.h>
#endif

#define LLAMARL_GEMV_MAX_ROWS 4

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

#ifdef LLAMARL_GEMV
/* 32 bf16 from p, zeros past the first `left` (a row's tail when k is not a multiple of 32). */
static inline __m512bh load32(const uint16_t *p, int64_t left) {
    if (left >= 32) return (__m512bh)_mm512_loadu_si512((const void *)p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), (const void *)p);
}

static inline __attribute__((always_inline)) void rows_of(const int M, const uint16_t *x, const uint16_t *w,
                                                          const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *wr = w + r * k;
        __m512 even[LLAMARL_GEMV_MAX_ROWS], odd[LLAMARL_GEMV_MAX_ROWS];
        for (int i = 0; i < M; i++) even[i] = odd[i] = _mm512_setzero_ps();
        int64_t c = 0;
        /* two accumulators per row of x: consecutive VDPBF16PS do not wait on each other */
        for (; c + 64 <= k; c += 64) {
            __m512bh w0 = load32(wr + c, 32), w1 = load32(wr + c + 32, 32);
            for (int i = 0; i < M; i++) {
                even[i] = _mm512_dpbf16_ps(even[i], w0, load32(x + i * k + c, 32));
                odd[i] = _mm512_dpbf16_ps(odd[i], w1, load32(x + i * k + c + 32, 32));
            }
        }
        for (; c < k; c += 32) {
            __m512bh w0 = load32(wr + c, k - c);
            for (int i = 0; i < M; i++) even[i] = _mm512_dpbf16_ps(even[i], w0, load32(x + i * k + c, k - c));
        }
        float b = bias ? bf16_to_f32(bias[r]) : 0.0f;
        for (int i = 0; i < M; i++) y[i * n + r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])) + b);
    }
}

/* Returns 0, or 1 when m is outside 1 .. LLAMARL_GEMV_MAX_ROWS (nothing written). */
int llamarl_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k) {
    switch (m) { /* a constant row count per case: the accumulators stay in registers */
    case 1: rows_of(1, x, w, bias, y, n, k); return 0;
    case 2: rows_of(2, x, w, bias, y, n, k); return 0;
    case 3: rows_of(3, x, w, bias, y, n, k); return 0;
    case 4: rows_of(4, x, w, bias, y, n, k); return 0;
    default: return 1;
    }
}

#else
int llamarl_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k) {
    (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return 2; /* built without AVX512-BF16 */
}
#endif

/* The rows llamarl_gemv_bf16 takes at most; 0 when built without it. */
int llamarl_gemv_max_rows(void) {
#ifdef LLAMARL_GEMV
    return LLAMARL_GEMV_MAX_ROWS;
#else
    return 0;
#endif
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* HF's RMSNorm in bf16: h = fp32(x); n = bf16(h * rsqrt(mean(h^2) + eps)); y = bf16(w * n). */
static void rmsnorm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t c = 0; c < dim; c++) {
        float h = bf16_to_f32(x[c]);
        sum += h * h;
    }
    float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t c = 0; c < dim; c++)
        y[c] = f32_to_bf16(bf16_to_f32(w[c]) * bf16_round(bf16_to_f32(x[c]) * scale));
}

/* y[rows, dim] = RMSNorm(x) with weight w [dim]. */
void llamarl_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) rmsnorm_row(x + r * dim, w, y + r * dim, dim, eps);
}

/* The residual add and the next norm: hidden = bf16(hidden + delta) in place, then y = RMSNorm(hidden). */
void llamarl_add_rmsnorm_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *y, int64_t rows,
                              int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * dim;
        const uint16_t *d = delta + r * dim;
        for (int64_t c = 0; c < dim; c++) h[c] = f32_to_bf16(bf16_to_f32(h[c]) + bf16_to_f32(d[c]));
        rmsnorm_row(h, w, y + r * dim, dim, eps);
    }
}

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

#ifdef LLAMARL_GEMV
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

/* Lane m of the result = the sum of v[m]'s 16 lanes (a transpose-and-add tree: 16 sums for the
 * price of about one reduction each of 16). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}
#endif

/* SwiGLU: gate_up [rows, 2 * inter] = [gate | up]; y [rows, inter] = bf16(bf16(silu(gate)) * up). */
void llamarl_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        int64_t c = 0;
#ifdef LLAMARL_GEMV
        for (; c + 16 <= inter; c += 16) {
            __m512 x = load_bf16x16(g + c);
            __m512 act = round_bf16x16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                      exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
            _mm256_storeu_si256((__m256i *)(y + r * inter + c), to_bf16x16(_mm512_mul_ps(act, load_bf16x16(u + c))));
        }
#endif
        for (; c < inter; c++) {
            float x = bf16_to_f32(g[c]);
            y[r * inter + c] = f32_to_bf16(bf16_round(x / (1.0f + exp_approx(-x))) * bf16_to_f32(u[c]));
        }
    }
}

/* RoPE on one head, HF's rotate-half form in bf16: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). */
static void rope_head(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, float *out, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        float rotated = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
        out[i] = bf16_round(bf16_round(bf16_to_f32(x[i]) * bf16_to_f32(cos[i]))
                            + bf16_round(rotated * bf16_to_f32(sin[i])));
    }
}

/* One decode token per row through a layer's attention, after its q/k/v projection.
 * qkv: [rows, (heads + 2 * kv_heads) * d] (q heads, k heads, v heads); cos, sin: [rows, d] (the
 * rows' rotary embedding at their positions); keys, values: the layer's cache [capacity, kv_heads,
 * width, d], row r's positions left-aligned in its slot r; positions: [rows] (int64; row r's token
 * sits at column positions[r] < width, and columns 0 .. positions[r] are its context).
 * Writes the token's roped key and its value into the cache, then out [rows, heads * d] =
 * softmax(bf16(scaling * q . k)) @ v per query head against its KV head (grouped-query), the
 * weights rounded to bf16 after an fp32 softmax, as HF's eager attention does. The query heads of
 * one KV head are done together, so each cached key and value is read and converted once.
 * scratch: at least (heads / kv_heads) * (width + 2 * d) + d floats. Returns 0, 1 on a position
 * outside the cache (rows before it are done), 2 on a head dimension over 512. */
int llamarl_attention_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                           uint16_t *values, const int64_t *positions, uint16_t *out, float *scratch, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t d, int64_t width, float scaling) {
    int64_t groups = heads / kv_heads, stride = (heads + 2 * kv_heads) * d;
    if (d > 512) return 2;
    float *scores = scratch, *q = scratch + groups * width, *acc = q + groups * d, *row_f = acc + groups * d;
    for (int64_t r = 0; r < rows; r++) {
        int64_t pos = positions[r];
        if (pos < 0 || pos >= width) return 1;
        const uint16_t *row = qkv + r * stride, *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < kv_heads; h++) {
            uint16_t *kh = keys + (r * kv_heads + h) * width * d, *vh = values + (r * kv_heads + h) * width * d;
            /* the new token's key (roped) and value */
            rope_head(row + (heads + h) * d, c, s, row_f, d);
            for (int64_t i = 0; i < d; i++) kh[pos * d + i] = f32_to_bf16(row_f[i]);
            memcpy(vh + pos * d, row + (heads + kv_heads + h) * d, (size_t)d * sizeof(uint16_t));
            for (int64_t g = 0; g < groups; g++) rope_head(row + (h * groups + g) * d, c, s, q + g * d, d);
#ifdef LLAMARL_GEMV
            /* q is bf16-valued (rope_head rounds): q . k as VDPBF16PS over bf16 pairs, fp32 sums */
            uint16_t *q_bf16 = (uint16_t *)acc;
            for (int64_t i = 0; i < groups * d; i++) q_bf16[i] = f32_to_bf16(q[i]);
            int64_t j0 = 0;
            for (; j0 + 16 <= pos + 1; j0 += 16) /* 16 keys at a time: one reduction for 16 scores */
                for (int64_t g = 0; g < groups; g++) {
                    __m512 sums[16];
                    for (int m = 0; m < 16; m++) {
                        const uint16_t *k = kh + (j0 + m) * d;
                        sums[m] = _mm512_setzero_ps();
                        for (int64_t i = 0; i < d; i += 32)
                            sums[m] = _mm512_dpbf16_ps(sums[m], load32(q_bf16 + g * d + i, d - i), load32(k + i, d - i));
                    }
                    _mm512_storeu_ps(scores + g * width + j0,
                                     round_bf16x16(_mm512_mul_ps(sum16(sums), _mm512_set1_ps(scaling))));
                }
            for (int64_t j = j0; j <= pos; j++) {
                const uint16_t *k = kh + j * d;
                for (int64_t g = 0; g < groups; g++) {
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t i = 0; i < d; i += 32)
                        sum = _mm512_dpbf16_ps(sum, load32(q_bf16 + g * d + i, d - i), load32(k + i, d - i));
                    scores[g * width + j] = bf16_round(_mm512_reduce_add_ps(sum) * scaling);
                }
            }
#else
            for (int64_t j = 0; j <= pos; j++) {
                for (int64_t i = 0; i < d; i++) row_f[i] = bf16_to_f32(kh[j * d + i]);
                for (int64_t g = 0; g < groups; g++) {
                    float dot = 0.0f;
                    for (int64_t i = 0; i < d; i++) dot += q[g * d + i] * row_f[i];
                    scores[g * width + j] = bf16_round(dot * scaling);
                }
            }
#endif
            for (int64_t g = 0; g < groups; g++) {
                float *sg = scores + g * width, top = -INFINITY, total = 0.0f;
                for (int64_t j = 0; j <= pos; j++) top = sg[j] > top ? sg[j] : top;
                int64_t j = 0;
#ifdef LLAMARL_GEMV
                __m512 sums = _mm512_setzero_ps();
                for (; j + 16 <= pos + 1; j += 16) {
                    __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), _mm512_set1_ps(top)));
                    _mm512_storeu_ps(sg + j, e);
                    sums = _mm512_add_ps(sums, e);
                }
                total = _mm512_reduce_add_ps(sums);
#endif
                for (; j <= pos; j++) {
                    sg[j] = exp_approx(sg[j] - top);
                    total += sg[j];
                }
                j = 0;
#ifdef LLAMARL_GEMV
                for (; j + 16 <= pos + 1; j += 16)
                    _mm512_storeu_ps(sg + j, round_bf16x16(_mm512_div_ps(_mm512_loadu_ps(sg + j), _mm512_set1_ps(total))));
#endif
                for (; j <= pos; j++) sg[j] = bf16_round(sg[j] / total);
            }
            for (int64_t i = 0; i < groups * d; i++) acc[i] = 0.0f;
#ifdef LLAMARL_GEMV
            if (d % 16 == 0 && groups <= 8) {
                /* 16 lanes of d at a time, each query head's sums held in a register over all keys */
                for (int64_t i = 0; i < d; i += 16) {
                    __m512 sums[8];
                    for (int64_t g = 0; g < groups; g++) sums[g] = _mm512_setzero_ps();
                    for (int64_t j = 0; j <= pos; j++) {
                        __m512 v = load_bf16x16(vh + j * d + i);
                        for (int64_t g = 0; g < groups; g++)
                            sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * width + j]), v, sums[g]);
                    }
                    for (int64_t g = 0; g < groups; g++) _mm512_storeu_ps(acc + g * d + i, sums[g]);
                }
            } else
#endif
            for (int64_t j = 0; j <= pos; j++) {
                for (int64_t i = 0; i < d; i++) row_f[i] = bf16_to_f32(vh[j * d + i]);
                for (int64_t g = 0; g < groups; g++) {
                    float weight = scores[g * width + j];
                    for (int64_t i = 0; i < d; i++) acc[g * d + i] += weight * row_f[i];
                }
            }
            for (int64_t g = 0; g < groups; g++) {
                uint16_t *o = out + (r * heads + h * groups + g) * d;
                for (int64_t i = 0; i < d; i++) o[i] = f32_to_bf16(acc[g * d + i]);
            }
        }
    }
    return 0;
}
