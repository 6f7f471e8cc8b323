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

/* SwiGLU: gate_up [rows, 2 * inter] = [gate | up]; y [rows, inter] = bf16(bf16(silu(gate)) * up). */
void llamarl_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        for (int64_t c = 0; c < inter; c++) {
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
 * weights rounded to bf16 after an fp32 softmax, as HF's eager attention does.
 * scratch: at least width + d floats. Returns 0, or 1 on a position outside the cache. */
int llamarl_attention_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                           uint16_t *values, const int64_t *positions, uint16_t *out, float *scratch, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t d, int64_t width, float scaling) {
    int64_t groups = heads / kv_heads, stride = (heads + 2 * kv_heads) * d;
    float *scores = scratch, *acc = scratch + width;
    for (int64_t r = 0; r < rows; r++) {
        int64_t pos = positions[r];
        if (pos < 0 || pos >= width) return 1;
        const uint16_t *row = qkv + r * stride, *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < kv_heads; h++) {  /* the new token's key (roped) and value */
            uint16_t *kc = keys + ((r * kv_heads + h) * width + pos) * d;
            uint16_t *vc = values + ((r * kv_heads + h) * width + pos) * d;
            rope_head(row + (heads + h) * d, c, s, acc, d);
            for (int64_t i = 0; i < d; i++) kc[i] = f32_to_bf16(acc[i]);
            memcpy(vc, row + (heads + kv_heads + h) * d, (size_t)d * sizeof(uint16_t));
        }
        for (int64_t qh = 0; qh < heads; qh++) {
            int64_t h = qh / groups;
            float q[512];
            if (d > 512) return 2;
            rope_head(row + qh * d, c, s, q, d);
            const uint16_t *kh = keys + (r * kv_heads + h) * width * d, *vh = values + (r * kv_heads + h) * width * d;
            float top = -INFINITY;
            for (int64_t j = 0; j <= pos; j++) {
                const uint16_t *k = kh + j * d;
                float dot = 0.0f;
                for (int64_t i = 0; i < d; i++) dot += q[i] * bf16_to_f32(k[i]);
                scores[j] = bf16_round(dot * scaling);
                if (scores[j] > top) top = scores[j];
            }
            float total = 0.0f;
            for (int64_t j = 0; j <= pos; j++) {
                scores[j] = expf(scores[j] - top);
                total += scores[j];
            }
            for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j <= pos; j++) {
                float weight = bf16_round(scores[j] / total);
                const uint16_t *v = vh + j * d;
                for (int64_t i = 0; i < d; i++) acc[i] += weight * bf16_to_f32(v[i]);
            }
            uint16_t *o = out + (r * heads + qh) * d;
            for (int64_t i = 0; i < d; i++) o[i] = f32_to_bf16(acc[i]);
        }
    }
    return 0;
}
