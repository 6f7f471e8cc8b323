/* The sampler's softmax over a decode step's bf16 logits, and its whole draw (llamarl/engines/
 * sampling.py calls them through cpu_kernels.softmax and cpu_kernels.sample; the draw at the end).
 *
 * llamarl_softmax_bf16: probs[r, :] = exp(x - max) / sum(exp(x - max)) with x = fp32(logits[r, :]),
 * written into a caller's fp32 buffer. Three passes over a row (its max, the exponentials stored
 * and summed, the scaling by the sum's reciprocal), 16 lanes at a time where the library is built
 * with AVX512-BF16.
 *
 * Why: torch.softmax(bf16 logits, dtype=float32) took 5-10 ms for 64 rows of a 49k vocabulary on
 * one thread (Intel Xeon), most of it first-touch page faults of the fresh 12.6 MB it allocates
 * for its result every step, against ~1 ms here into a buffer that is reused.
 * Numerics: exp_approx (bf16_math.h, ~1 ulp of fp32) instead of PyTorch's exp, and the sums in
 * another order: the probabilities agree with torch.softmax's within ~2e-6 relative, not bitwise (and
 * a logit more than 87 below the row's max gets e^-87 relative, not less; a -inf one exactly 0). A
 * NaN logit makes its row NaN, as PyTorch's; so do a row of -inf (0 / 0) and a +inf logit (inf - inf). */
#include <math.h>
#include <stdint.h>
#include "bf16_math.h"

/* The largest of a row's logits (fp32), and in *nan whether any is NaN. */
static float row_top(const uint16_t *x, int64_t vocab, int *nan) {
    float top = -INFINITY;
    int found = 0;
    int64_t c = 0;
#ifdef LLAMARL_AVX512_BF16
    __m512 tops = _mm512_set1_ps(-INFINITY);
    __mmask16 nans = 0;
    for (; c + 16 <= vocab; c += 16) {
        const __m512 v = load_bf16x16(x + c);
        nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        tops = _mm512_max_ps(tops, v);
    }
    top = _mm512_reduce_max_ps(tops);
    found = nans != 0;
#endif
    for (; c < vocab; c++) {
        const float v = bf16_to_f32(x[c]);
        found |= v != v;
        top = v > top ? v : top;
    }
    *nan = found;
    return top;
}

void llamarl_softmax_bf16(const uint16_t *logits, float *probs, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * vocab;
        float *p = probs + r * vocab, total = 0.0f;
        int nan;
        const float top = row_top(x, vocab, &nan);
        if (nan || top == -INFINITY || top == INFINITY) { /* PyTorch's result: NaN throughout (inf - inf) */
            for (int64_t c = 0; c < vocab; c++) p[c] = NAN;
            continue;
        }
        int64_t c = 0;
#ifdef LLAMARL_AVX512_BF16
        __m512 sums = _mm512_setzero_ps();
        for (; c + 16 <= vocab; c += 16) {
            const __m512 v = load_bf16x16(x + c); /* a -inf logit (masked) gets exactly 0, never drawn */
            const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                                 exp_approx16(_mm512_sub_ps(v, _mm512_set1_ps(top))));
            _mm512_storeu_ps(p + c, e);
            sums = _mm512_add_ps(sums, e);
        }
        total = _mm512_reduce_add_ps(sums);
#endif
        for (; c < vocab; c++) {
            const float v = bf16_to_f32(x[c]);
            p[c] = v == -INFINITY ? 0.0f : exp_approx(v - top);
            total += p[c];
        }
        const float scale = 1.0f / total;
        c = 0;
#ifdef LLAMARL_AVX512_BF16
        for (; c + 16 <= vocab; c += 16) _mm512_storeu_ps(p + c, _mm512_mul_ps(_mm512_loadu_ps(p + c), _mm512_set1_ps(scale)));
#endif
        for (; c < vocab; c++) p[c] *= scale;
    }
}

/* llamarl_sample_bf16: one token per row of bf16 `logits` [rows, vocab], drawn from softmax(logits)
 * by inverse CDF with the row's uniform u in [0, 1), and its log-probability: the draw of
 * sampling._draw (blocks of SAMPLE_BLOCK probabilities summed in fp32, their cumulative sum in
 * fp64; the token whose interval holds u x total, the target kept strictly below each cumulative
 * total it is searched in, so a zero-probability token is never drawn), without writing the
 * probabilities: the exponentials are summed per block in one pass, and only the chosen block's
 * are computed again (the same vector code: the same values). log-prob = log(e_token / total).
 * A row with a NaN or +inf logit, or only -inf ones, gets token -1 and a NaN log-prob (PyTorch's
 * softmax is NaN there). Returns 0; 2 when the vocabulary has more than SAMPLE_MAX_BLOCKS blocks
 * (nothing written: the caller keeps PyTorch's path). Rows are split across `threads`. */
#define SAMPLE_BLOCK 256
#define SAMPLE_MAX_BLOCKS 8192

#ifdef LLAMARL_AVX512_BF16
/* exp(x - top) of the 16 logits from p (the first `left`); lanes past them and -inf logits: 0. */
static inline __m512 exps16(const uint16_t *p, int64_t left, float top) {
    const __mmask16 lanes = first_lanes(left);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
    const __mmask16 live = lanes & _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(live, exp_approx16(_mm512_sub_ps(v, _mm512_set1_ps(top))));
}
#endif

/* The exponentials of logits [start, start + count) of a row into e (count <= SAMPLE_BLOCK), and
 * their fp32 sum: lane sums then one reduction where built with AVX512-BF16. */
static float block_exps(const uint16_t *x, int64_t count, float top, float *e) {
#ifdef LLAMARL_AVX512_BF16
    __m512 sums = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; c += 16) {
        const __m512 v = exps16(x + c, count - c, top);
        _mm512_mask_storeu_ps(e + c, first_lanes(count - c), v);
        sums = _mm512_add_ps(sums, v);
    }
    return _mm512_reduce_add_ps(sums);
#else
    float sum = 0.0f;
    for (int64_t c = 0; c < count; c++) {
        const float v = bf16_to_f32(x[c]);
        e[c] = v == -INFINITY ? 0.0f : exp_approx(v - top);
        sum += e[c];
    }
    return sum;
#endif
}

int llamarl_sample_bf16(const uint16_t *logits, const double *uniforms, int64_t *tokens, float *logprobs,
                        int64_t rows, int64_t vocab, int threads) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    if (blocks > SAMPLE_MAX_BLOCKS || vocab < 1) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * vocab;
        int nan;
        const float top = row_top(x, vocab, &nan); /* a NaN or +inf logit makes the row NaN, as PyTorch's softmax */
        if (nan || top == -INFINITY || top == INFINITY) {
            tokens[r] = -1;
            logprobs[r] = NAN;
            continue;
        }
        double cdf[SAMPLE_MAX_BLOCKS];
        float e[SAMPLE_BLOCK];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * SAMPLE_BLOCK;
            total += (double)block_exps(x + start, vocab - start < SAMPLE_BLOCK ? vocab - start : SAMPLE_BLOCK, top, e);
            cdf[b] = total;
        }
        const double target = fmin(uniforms[r] * total, nextafter(total, 0.0));
        int64_t block = 0;
        while (block + 1 < blocks && cdf[block] <= target) block++; /* the first cumulative sum > target */
        const double before = block > 0 ? cdf[block - 1] : 0.0;
        const int64_t start = block * SAMPLE_BLOCK, count = vocab - start < SAMPLE_BLOCK ? vocab - start : SAMPLE_BLOCK;
        block_exps(x + start, count, top, e); /* the same code as above: the same values */
        double inner = 0.0;
        for (int64_t j = 0; j < count; j++) inner += (double)e[j];
        const double offset = fmin(target - before, nextafter(inner, 0.0));
        double running = 0.0;
        int64_t j = 0;
        for (; j + 1 < count; j++) { /* the first token whose running sum passes offset (e[j] > 0) */
            running += (double)e[j];
            if (running > offset) break;
        }
        /* reassociated sums (-fassociative-math) may leave inner and running a rounding apart:
         * never end on a zero-probability token */
        while (j > 0 && e[j] == 0.0f) j--;
        tokens[r] = start + j;
        logprobs[r] = (float)log((double)e[j] / total);
    }
    return 0;
}
