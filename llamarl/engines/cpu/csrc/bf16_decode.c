/* bf16 pieces of a decode step for small batches on CPU (llamarl/engines/cpu_kernels.py builds,
 * loads and calls this; see its docstring for why and for when each piece runs).
 *
 * All tensors are bf16 (uint16 bit patterns), row-major and contiguous unless said otherwise. Each
 * function rounds to bf16 where HF's eager bf16 modules round, and computes in fp32 in between, so
 * its outputs equal theirs up to the order of fp32 sums (the last bf16 bit, now and then).
 *
 * llamarl_pack_bf16 / llamarl_gemm_bf16 (the GEMM compiled only with AVX512-BF16, -DLLAMARL_AVX512_BF16):
 * y[i, r] = bf16( sum_c x[i, c] * w[r, c]  (+ bias[r]) )  for i < m, r < n, c < k
 * x: [m, k], w: [n, k] packed once by llamarl_pack_bf16, bias: [n] or NULL, y: [m, n]. Products and
 * sums in fp32 (VDPBF16PS: each instruction adds pairs of exact bf16 products to 16 fp32 lanes),
 * bias added in fp32, one round-to-nearest-even to bf16 at the end. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __unix__
#include <sys/mman.h>
#endif
#ifdef LLAMARL_AVX512_BF16
#include <immintrin.h>
#endif
#include "bf16_math.h"
#include "kernels.h"

/* Elementwise kernels split their rows across the threads from this many elements (below, a
 * fork and join of the pool costs more than the work). */
#define PARALLEL_ELEMENTS 4096

/* Ask the kernel to back [p, p + bytes) with transparent huge pages (2 MB) when it is first
 * touched: the GEMMs stream their packed weights once a step, and on 4 KB pages each 4 KB of a
 * stream is a TLB miss and the end of what the hardware prefetchers run ahead into. Returns 0 when
 * the advice was taken (the system may still decline: THP "never", no free huge page), else errno. */
int llamarl_advise_huge(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    return madvise(p, (size_t)bytes, MADV_HUGEPAGE) == 0 ? 0 : errno;
#else
    (void)p; (void)bytes;
    return ENOSYS;
#endif
}

/* 1 when built with OpenMP (the `threads` arguments are used), else 0. */
int llamarl_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* How many threads a kernel's parallel region asking for `threads` gets (1 without OpenMP). */
int llamarl_parallel_width(int threads) {
    int width = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp single
        width = omp_threads();
    }
    return width;
}

/* HF's RMSNorm in bf16: h = fp32(x); n = bf16(h * rsqrt(mean(h^2) + eps)); y = bf16(w * n).
 * 16 lanes at a time where built with AVX512-BF16 (the sum of squares in another order; the
 * scalar loop took 2.5 ms of a 64-row SmolLM2 step). */
static void rmsnorm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t dim, float eps) {
    float sum = 0.0f;
    int64_t c = 0;
#ifdef LLAMARL_AVX512_BF16
    __m512 sums = _mm512_setzero_ps();
    for (; c + 16 <= dim; c += 16) {
        const __m512 h = load_bf16x16(x + c);
        sums = _mm512_fmadd_ps(h, h, sums);
    }
    sum = _mm512_reduce_add_ps(sums);
#endif
    for (; c < dim; c++) {
        float h = bf16_to_f32(x[c]);
        sum += h * h;
    }
    float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    c = 0;
#ifdef LLAMARL_AVX512_BF16
    for (; c + 16 <= dim; c += 16)
        _mm256_storeu_si256((__m256i *)(y + c), to_bf16x16(_mm512_mul_ps(
            load_bf16x16(w + c), round_bf16x16(_mm512_mul_ps(load_bf16x16(x + c), _mm512_set1_ps(scale))))));
#endif
    for (; c < dim; c++)
        y[c] = f32_to_bf16(bf16_to_f32(w[c]) * bf16_round(bf16_to_f32(x[c]) * scale));
}

/* The kernels' bodies (kernels.h) split their loop with an orphaned `omp for`: called inside a
 * parallel region (the public functions' own, or llamarl_decode_layers_bf16's one for a whole step)
 * the team shares it and meets at its closing barrier; called outside one, it runs whole. */
/* y[rows, dim] = RMSNorm(x) with weight w [dim]. */
void rmsnorm_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) rmsnorm_row(x + r * dim, w, y + r * dim, dim, eps);
}

void llamarl_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps,
                          int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * dim >= PARALLEL_ELEMENTS)
    rmsnorm_rows(x, w, y, rows, dim, eps);
}

/* The residual add and the next norm: hidden = bf16(hidden + delta) in place, then y = RMSNorm(hidden). */
void add_rmsnorm_rows(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *y, int64_t rows,
                      int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * dim;
        const uint16_t *d = delta + r * dim;
        int64_t c = 0;
#ifdef LLAMARL_AVX512_BF16
        for (; c + 16 <= dim; c += 16)
            _mm256_storeu_si256((__m256i *)(h + c), to_bf16x16(_mm512_add_ps(load_bf16x16(h + c), load_bf16x16(d + c))));
#endif
        for (; c < dim; c++) h[c] = f32_to_bf16(bf16_to_f32(h[c]) + bf16_to_f32(d[c]));
        rmsnorm_row(h, w, y + r * dim, dim, eps);
    }
}

void llamarl_add_rmsnorm_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *y, int64_t rows,
                              int64_t dim, float eps, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * dim >= PARALLEL_ELEMENTS)
    add_rmsnorm_rows(hidden, delta, w, y, rows, dim, eps);
}

#ifdef LLAMARL_AVX512_BF16
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
void silu_mul_rows(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        int64_t c = 0;
#ifdef LLAMARL_AVX512_BF16
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

void llamarl_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * inter >= PARALLEL_ELEMENTS)
    silu_mul_rows(gate_up, y, rows, inter);
}

/* RoPE on one head, HF's rotate-half form in bf16: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). */
static void rope_head(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, float *out, int64_t d) {
    int64_t half = d / 2;
#ifdef LLAMARL_AVX512_BF16
    if (half % 16 == 0) { /* the same roundings on 16 lanes; the sign flipped exactly (xor), as -x */
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
        for (int64_t i = 0; i < half; i += 16) {
            __m512 lo = load_bf16x16(x + i), hi = load_bf16x16(x + half + i);
            __m512 minus_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), sign));
            _mm512_storeu_ps(out + i, round_bf16x16(_mm512_add_ps(
                round_bf16x16(_mm512_mul_ps(lo, load_bf16x16(cos + i))),
                round_bf16x16(_mm512_mul_ps(minus_hi, load_bf16x16(sin + i))))));
            _mm512_storeu_ps(out + half + i, round_bf16x16(_mm512_add_ps(
                round_bf16x16(_mm512_mul_ps(hi, load_bf16x16(cos + half + i))),
                round_bf16x16(_mm512_mul_ps(lo, load_bf16x16(sin + half + i))))));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) {
        float rotated = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
        out[i] = bf16_round(bf16_round(bf16_to_f32(x[i]) * bf16_to_f32(cos[i]))
                            + bf16_round(rotated * bf16_to_f32(sin[i])));
    }
}

/* The next (row, KV head)'s cached keys and values, fetched a few lines at a time while this one
 * computes: each is a block of a few KB, too short for the hardware prefetcher to ramp up on, and
 * prefetching all of it at once stalls the core until the lines arrive (the fill buffers are few),
 * so the fetch does not overlap the arithmetic. */
typedef struct {
    const char *keys, *values;
    int64_t next, end; /* byte offsets in both blocks */
    int to_l1;         /* 1: prefetch into L1 (T0), 0: into L2 only (T1) */
} prefetcher;

/* The next unit's keys and values, up to this many bytes together, are prefetched into L2 only:
 * brought into the 32 KB L1 beside the current unit's (and its scores and output rows), they
 * evicted the current unit's values before the weighted sum, which reads them last, got to them.
 * Larger units stream through L1 whatever is done, and there the next unit's first lines in L1
 * win. The crossover was measured between 100 and 170 positions of SmolLM2's heads (26 and 44 KB):
 * its attention, 30 layers x 64 rows, one thread, AMD EPYC (Zen 4), one run of the three hints:
 * ~56 positions, 12.0 ms into L1, 9.7 into L2 (none: 14.6); ~250 positions, 32.8 into L1, 36.2
 * into L2 (docs/benchmarks.md has another run, against this rule). */
#define PREFETCH_L2_BYTES (32 * 1024)

static inline void prefetch_lines(prefetcher *pf, int64_t lines) {
    for (; lines > 0 && pf->next < pf->end; lines--, pf->next += 64) {
        if (pf->to_l1) {
            __builtin_prefetch(pf->keys + pf->next, 0, 3);
            __builtin_prefetch(pf->values + pf->next, 0, 3);
        } else {
            __builtin_prefetch(pf->keys + pf->next, 0, 2);
            __builtin_prefetch(pf->values + pf->next, 0, 2);
        }
    }
}

#ifdef LLAMARL_AVX512_BF16
/* acc[g, :] = sum_j scores[g, j] * values[j, :] over j = 0 .. pos, for the G query heads of one KV
 * head (d % 16 == 0): 32 lanes of d at a time, so each key's two value chunks feed 2 x G independent
 * sums held in registers (the same fp32 fma order per lane as one chunk at a time). */
static inline __attribute__((always_inline)) void weigh_values(const int G, const float *scores, int64_t width,
                                                               const uint16_t *vh, int64_t d, int64_t pos,
                                                               float *acc, prefetcher *pf) {
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        __m512 lo[8], hi[8];
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j <= pos; j++) {
            prefetch_lines(pf, 2);
            const __m512 v0 = load_bf16x16(vh + j * d + i), v1 = load_bf16x16(vh + j * d + i + 16);
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(scores[g * width + j]);
                lo[g] = _mm512_fmadd_ps(w, v0, lo[g]);
                hi[g] = _mm512_fmadd_ps(w, v1, hi[g]);
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            _mm512_storeu_ps(acc + g * d + i, lo[g]);
            _mm512_storeu_ps(acc + g * d + i + 16, hi[g]);
        }
    }
    if (i < d) { /* d % 32 == 16: the last 16 lanes */
        __m512 sums[8];
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) sums[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j <= pos; j++) {
            const __m512 v = load_bf16x16(vh + j * d + i);
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * width + j]), v, sums[g]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + g * d + i, sums[g]);
    }
}
#endif

/* One (row, KV head) of llamarl_attention_bf16: the token's key and value into the cache, then
 * the attention of the KV head's query heads; `scratch` is this thread's own. */
static void attend_head(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                        uint16_t *values, const int64_t *positions, uint16_t *out, float *scratch, int64_t rows,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t width, float scaling,
                        const uint16_t *q_norm, const uint16_t *k_norm, float norm_eps, int64_t r, int64_t h) {
    const int64_t groups = heads / kv_heads, stride = (heads + 2 * kv_heads) * d, pos = positions[r];
    float *scores = scratch, *q = scratch + groups * width, *acc = q + groups * d, *row_f = acc + groups * d;
    const uint16_t *row = qkv + r * stride, *c = cos + r * d, *s = sin + r * d;
    uint16_t *kh = keys + (r * kv_heads + h) * width * d, *vh = values + (r * kv_heads + h) * width * d;
    prefetcher pf = {0};
    {
        const int64_t r2 = h + 1 < kv_heads ? r : r + 1, h2 = h + 1 < kv_heads ? h + 1 : 0;
        if (r2 < rows) { /* positions were checked before any unit ran */
            pf.keys = (const char *)(keys + (r2 * kv_heads + h2) * width * d);
            pf.values = (const char *)(values + (r2 * kv_heads + h2) * width * d);
            pf.end = (positions[r2] + 1) * d * (int64_t)sizeof(uint16_t);
            pf.to_l1 = 2 * pf.end > PREFETCH_L2_BYTES;
        }
    }
    /* the new token's key (roped) and value; with q / k norms (Qwen3) each head is RMS-normalized
     * over d before its RoPE, as HF's q_norm / k_norm do */
    uint16_t normed[512]; /* d <= 512: attention_check */
    const uint16_t *k_in = row + (heads + h) * d;
    if (k_norm) {
        rmsnorm_row(k_in, k_norm, normed, d, norm_eps);
        k_in = normed;
    }
    rope_head(k_in, c, s, row_f, d);
    int64_t i0 = 0;
#ifdef LLAMARL_AVX512_BF16
    for (; i0 + 16 <= d; i0 += 16)
        _mm256_storeu_si256((__m256i *)(kh + pos * d + i0), to_bf16x16(_mm512_loadu_ps(row_f + i0)));
#endif
    for (; i0 < d; i0++) kh[pos * d + i0] = f32_to_bf16(row_f[i0]);
    memcpy(vh + pos * d, row + (heads + kv_heads + h) * d, (size_t)d * sizeof(uint16_t));
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *q_in = row + (h * groups + g) * d;
        if (q_norm) {
            rmsnorm_row(q_in, q_norm, normed, d, norm_eps);
            q_in = normed;
        }
        rope_head(q_in, c, s, q + g * d, d);
    }
#ifdef LLAMARL_AVX512_BF16
    /* q is bf16-valued (rope_head rounds): q . k as VDPBF16PS over bf16 pairs, fp32 sums */
    uint16_t *q_bf16 = (uint16_t *)acc;
    int64_t i16 = 0;
    for (; i16 + 16 <= groups * d; i16 += 16)
        _mm256_storeu_si256((__m256i *)(q_bf16 + i16), to_bf16x16(_mm512_loadu_ps(q + i16)));
    for (; i16 < groups * d; i16++) q_bf16[i16] = f32_to_bf16(q[i16]);
    int64_t j0 = 0;
    for (; j0 <= pos; j0 += 16) { /* 16 keys at a time: one reduction for 16 scores */
        prefetch_lines(&pf, 8);
        /* the last block's missing keys are zeros, its scores stored masked (a per-key
         * reduction for the tail cost more than the whole blocks before it) */
        const int count = pos + 1 - j0 < 16 ? (int)(pos + 1 - j0) : 16;
        for (int64_t g = 0; g < groups; g++) {
            __m512 sums[16];
            const uint16_t *qg = q_bf16 + g * d;
            /* unrolled over the 16 keys, each key's sum built in a register of its own (a
             * loop over m left the array in memory: a store per product) */
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++) {
                __m512 sum = _mm512_setzero_ps();
                if (m < count) {
                    const uint16_t *k = kh + (j0 + m) * d;
                    int64_t i = 0;
                    for (; i + 32 <= d; i += 32)
                        sum = _mm512_dpbf16_ps(sum, load32(qg + i, 32), load32(k + i, 32));
                    if (i < d) sum = _mm512_dpbf16_ps(sum, load32(qg + i, d - i), load32(k + i, d - i));
                }
                sums[m] = sum;
            }
            _mm512_mask_storeu_ps(scores + g * width + j0, first_lanes(count),
                                  round_bf16x16(_mm512_mul_ps(sum16(sums), _mm512_set1_ps(scaling))));
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
        int64_t j = 0;
#ifdef LLAMARL_AVX512_BF16
        /* 16 scores at a time, the last partial block masked (its lanes past pos: -inf for
         * the max, 0 for the sum, not stored) */
        const int64_t n = pos + 1;
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (j = 0; j < n; j += 16) {
            const __mmask16 live = first_lanes(n - j);
            tops = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sg + j), tops); /* a NaN score skipped, as below */
        }
        top = _mm512_reduce_max_ps(tops);
        __m512 sums = _mm512_setzero_ps();
        for (j = 0; j < n; j += 16) {
            const __mmask16 live = first_lanes(n - j);
            __m512 e = _mm512_maskz_mov_ps(live, exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + j),
                                                                           _mm512_set1_ps(top))));
            _mm512_mask_storeu_ps(sg + j, live, e);
            sums = _mm512_add_ps(sums, e);
        }
        total = _mm512_reduce_add_ps(sums);
        for (j = 0; j < n; j += 16) {
            const __mmask16 live = first_lanes(n - j);
            _mm512_mask_storeu_ps(sg + j, live, round_bf16x16(_mm512_div_ps(_mm512_maskz_loadu_ps(live, sg + j),
                                                                            _mm512_set1_ps(total))));
        }
#else
        for (; j <= pos; j++) top = sg[j] > top ? sg[j] : top;
        for (j = 0; j <= pos; j++) {
            sg[j] = exp_approx(sg[j] - top);
            total += sg[j];
        }
        for (j = 0; j <= pos; j++) sg[j] = bf16_round(sg[j] / total);
#endif
    }
    for (int64_t i = 0; i < groups * d; i++) acc[i] = 0.0f;
#ifdef LLAMARL_AVX512_BF16
    if (d % 16 == 0 && groups <= 8) {
        switch (groups) { /* a constant head count per case: the sums stay in registers */
        case 1: weigh_values(1, scores, width, vh, d, pos, acc, &pf); break;
        case 2: weigh_values(2, scores, width, vh, d, pos, acc, &pf); break;
        case 3: weigh_values(3, scores, width, vh, d, pos, acc, &pf); break;
        case 4: weigh_values(4, scores, width, vh, d, pos, acc, &pf); break;
        case 5: weigh_values(5, scores, width, vh, d, pos, acc, &pf); break;
        case 6: weigh_values(6, scores, width, vh, d, pos, acc, &pf); break;
        case 7: weigh_values(7, scores, width, vh, d, pos, acc, &pf); break;
        default: weigh_values(8, scores, width, vh, d, pos, acc, &pf); break;
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
    prefetch_lines(&pf, pf.end); /* whatever the loops above did not reach */
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *o = out + (r * heads + h * groups + g) * d;
        int64_t i = 0;
#ifdef LLAMARL_AVX512_BF16
        for (; i + 16 <= d; i += 16) _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_loadu_ps(acc + g * d + i)));
#endif
        for (; i < d; i++) o[i] = f32_to_bf16(acc[g * d + i]);
    }
}

/* One decode token per row through a layer's attention, after its q/k/v projection.
 * qkv: [rows, (heads + 2 * kv_heads) * d] (q heads, k heads, v heads); cos, sin: [rows, d] (the
 * rows' rotary embedding at their positions); keys, values: the layer's cache [capacity, kv_heads,
 * width, d], row r's positions left-aligned in its slot r; positions: [rows] (int64; row r's token
 * sits at column positions[r] < width, and columns 0 .. positions[r] are its context).
 * Writes the token's roped key and its value into the cache, then out [rows, heads * d] =
 * softmax(bf16(scaling * q . k)) @ v per query head against its KV head (grouped-query), the
 * weights rounded to bf16 after an fp32 softmax, as HF's eager attention does. q_norm / k_norm
 * (bf16 [d], both or neither; NULL: none): each query and key head RMS-normalized over d with that
 * weight and norm_eps before its RoPE (Qwen3's q_norm / k_norm). The query heads of
 * one KV head are done together, so each cached key and value is read and converted once.
 * The (row, KV head) pairs are split across `threads` OpenMP threads (where built with OpenMP).
 * scratch: at least threads * ((heads / kv_heads) * (width + 2 * d) + d) floats. Returns 0, 1 on a
 * position outside the cache, 2 on a head dimension over 512 (both before anything is written). */
int attention_check(const int64_t *positions, int64_t rows, int64_t d, int64_t width) {
    if (d > 512) return 2;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= width) return 1;
    return 0;
}

/* The body, after attention_check: the (row, KV head) units split across the team, each writing
 * only its own cache slot and heads, with its thread's part of `scratch`. */
void attention_units(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys, uint16_t *values,
                     const int64_t *positions, uint16_t *out, float *scratch, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t width, float scaling, const uint16_t *q_norm,
                     const uint16_t *k_norm, float norm_eps) {
    float *own = scratch + (int64_t)omp_thread() * attention_scratch(heads, kv_heads, d, width);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < rows * kv_heads; u++)
        attend_head(qkv, cos, sin, keys, values, positions, out, own, rows, heads, kv_heads, d, width, scaling,
                    q_norm, k_norm, norm_eps, u / kv_heads, u % kv_heads);
}

int llamarl_attention_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                           uint16_t *values, const int64_t *positions, uint16_t *out, float *scratch, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t d, int64_t width, float scaling,
                           const uint16_t *q_norm, const uint16_t *k_norm, float norm_eps, int threads) {
    const int status = attention_check(positions, rows, d, width);
    if (status) return status;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * kv_heads > 1)
    attention_units(qkv, cos, sin, keys, values, positions, out, scratch, rows, heads, kv_heads, d, width, scaling,
                    q_norm, k_norm, norm_eps);
    return 0;
}

/* ---- the linear layers: a GEMM over weights packed for VDPBF16PS -------------------------------
 * Packed layout [ceil(n/16)][ceil(k/2)][16][2]: panel p holds output rows 16p .. 16p+15, and for each
 * pair of input columns (2kk, 2kk+1) the 16 rows' two weights side by side, so one 64-byte load is
 * the VDPBF16PS operand for 16 outputs and a pair of x's columns is one 32-bit broadcast: no
 * horizontal sums, and each panel streams from memory in order (zeros pad n and k). A tile of MT
 * rows of x by NB panels keeps MT x NB accumulators in registers; the weights of NB panels are read
 * from memory once for the first tile of rows and from cache for the others.
 * Measured (SmolLM2-135M, every linear of a step, one thread, weights from memory;
 * benchmarks/cpu_linears.py): 13.1 / 27.7 / 85.0 ms at 1 / 16 / 64 rows against PyTorch's 37.5 /
 * 33.4 / 92.9 (oneDNN pre-packed; F.linear at one row). */
void llamarl_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + 15) / 16, pairs = (k + 1) / 2, whole = k / 2;
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *source[16];
        for (int j = 0; j < 16; j++) source[j] = p * 16 + j < n ? w + (p * 16 + j) * k : NULL;
        uint32_t *out = (uint32_t *)(void *)(packed + p * pairs * 32);
        /* one 64-byte line of output per column pair: the 16 rows read in step, written in order */
        for (int64_t kk = 0; kk < whole; kk++, out += 16)
            for (int j = 0; j < 16; j++) {
                uint32_t pair = 0;
                if (source[j]) memcpy(&pair, source[j] + 2 * kk, 4);
                out[j] = pair;
            }
        if (pairs > whole) /* odd k: the last column, its partner zero */
            for (int j = 0; j < 16; j++) out[j] = source[j] ? source[j][k - 1] : 0;
    }
}

#ifdef LLAMARL_AVX512_BF16
#define GEMM_ROWS 6   /* MT: rows of x per tile */
#define GEMM_PANELS 4 /* NB: panels (of 16 outputs) per tile; 6 x 4 accumulators + 4 weights fit 32 zmm */
/* Up to this many rows of x, the GEMM takes the outputs one panel at a time (an MT x 1 tile)
 * instead of GEMM_PANELS side by side: the weights are then read as one sequential stream (the
 * panels lie one after another), where four panels at a time are four streams 18 KB apart (SmolLM2's
 * k = 576). Each output's sum is the same chain in the same order either way (bitwise the same
 * result), and at these rows the core is idle waiting on memory, so the fewer loads per broadcast
 * cost nothing. SmolLM2-135M, every linear of a step, AMD EPYC (Zen 4), packed weights on huge
 * pages (cpu_kernels.pack_all): 1 / 2 / 4 rows, one thread, 11.5 / 12.1 / 12.6 ms four panels at
 * a time, 9.7 / 9.8 / 10.9 one; two threads 6.6 / 7.1 / 7.3 against 5.9 / 6.1 / 6.5. At 6 rows the
 * four-panel tile is already 4 % faster (13.1 against 13.6 ms), and more beyond (compute counts). */
#define GEMM_STREAM_ROWS 4
_Static_assert(GEMM_STREAM_ROWS <= GEMM_ROWS, "one row tile per panel");

static inline __attribute__((always_inline)) void gemm_tile(const int MT, const int NB, const uint16_t *x,
                                                            const uint16_t *panel, const uint16_t *bias, uint16_t *y,
                                                            int64_t n, int64_t k, int64_t p, int64_t i0) {
    const int64_t pairs = (k + 1) / 2, whole = k / 2;
    __m512 acc[GEMM_ROWS][GEMM_PANELS];
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *rows = x + i0 * k;
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh w[GEMM_PANELS];
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(panel + (j * pairs + kk) * 32));
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            uint32_t pair;
            if (kk < whole) memcpy(&pair, rows + i * k + 2 * kk, 4);
            else pair = rows[i * k + k - 1]; /* odd k: the last column alone (its packed partner is 0) */
            const __m512bh xs = (__m512bh)_mm512_set1_epi32((int32_t)pair);
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xs);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const int64_t column = (p + j) * 16, left = n - column;
        const __mmask16 lanes = first_lanes(left);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + column)), 16))
                              : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++)
            _mm256_mask_storeu_epi16(y + (i0 + i) * n + column, lanes, to_bf16x16(_mm512_add_ps(acc[i][j], b)));
    }
}

#define GEMM_TILE_CASES(NB)                                                                                   \
    switch (mt) { /* constant tile sizes: the accumulators stay in registers */                           \
    case 1: gemm_tile(1, NB, x, panel, bias, y, n, k, p, i); break;                                         \
    case 2: gemm_tile(2, NB, x, panel, bias, y, n, k, p, i); break;                                         \
    case 3: gemm_tile(3, NB, x, panel, bias, y, n, k, p, i); break;                                         \
    case 4: gemm_tile(4, NB, x, panel, bias, y, n, k, p, i); break;                                         \
    case 5: gemm_tile(5, NB, x, panel, bias, y, n, k, p, i); break;                                         \
    default: gemm_tile(6, NB, x, panel, bias, y, n, k, p, i); break;                                        \
    }

/* The body: the outputs' panel groups (single panels up to GEMM_STREAM_ROWS rows) split across
 * the team (each thread reads its own share of the weights). */
void gemm_avx512_panels(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                        int64_t n, int64_t k) {
    const int64_t panels = (n + 15) / 16, pairs = (k + 1) / 2;
    if (m > 0 && m <= GEMM_STREAM_ROWS) { /* every thread takes this branch: the same m */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *panel = packed + p * pairs * 32;
            const int64_t i = 0, mt = m;
            GEMM_TILE_CASES(1)
        }
        return;
    }
    /* Each thread takes an equal run of panels, in groups of GEMM_PANELS from its run's start (the
     * last one shorter): split by whole groups, 36 panels (SmolLM2's o and down projections) were
     * 5 groups against 4 on two threads, an eighth of the work waiting on one core. */
    const int64_t team = omp_threads(), me = omp_thread();
    const int64_t first = panels * me / team, last = panels * (me + 1) / team;
    for (int64_t p = first; p < last; p += GEMM_PANELS) {
        const uint16_t *panel = packed + p * pairs * 32;
        const int64_t nb = last - p < GEMM_PANELS ? last - p : GEMM_PANELS;
        for (int64_t i = 0; i < m; i += GEMM_ROWS) {
            const int64_t mt = m - i < GEMM_ROWS ? m - i : GEMM_ROWS;
            switch (nb) {
            case 1: GEMM_TILE_CASES(1) break;
            case 2: GEMM_TILE_CASES(2) break;
            case 3: GEMM_TILE_CASES(3) break;
            default: GEMM_TILE_CASES(4) break;
            }
        }
    }
#pragma omp barrier /* what the team wrote, complete for the next body (an `omp for`'s own barrier) */
}

/* Returns 0 (2 when built without AVX512-BF16: nothing written). */
int llamarl_gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                      int64_t n, int64_t k, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16 * GEMM_PANELS)
    gemm_avx512_panels(x, packed, bias, y, m, n, k);
    return 0;
}
#else
int llamarl_gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                      int64_t n, int64_t k, int threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return 2;
}
#endif

/* 1 when llamarl_gemm_bf16 is built (AVX512-BF16), else 0. */
int llamarl_has_gemm(void) {
#ifdef LLAMARL_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
