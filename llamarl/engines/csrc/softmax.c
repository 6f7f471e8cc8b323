/* The sampler's softmax over a decode step's bf16 logits (llamarl/engines/sampling.py calls it
 * through cpu_kernels.softmax).
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

void llamarl_softmax_bf16(const uint16_t *logits, float *probs, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * vocab;
        float *p = probs + r * vocab, top = -INFINITY, total = 0.0f;
        int nan = 0;
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
        nan = nans != 0;
#endif
        for (; c < vocab; c++) {
            const float v = bf16_to_f32(x[c]);
            nan |= v != v;
            top = v > top ? v : top;
        }
        if (nan || top == -INFINITY || top == INFINITY) { /* PyTorch's result: NaN throughout (inf - inf) */
            for (c = 0; c < vocab; c++) p[c] = NAN;
            continue;
        }
        c = 0;
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
