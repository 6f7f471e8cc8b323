/* All the decoder layers of one bf16 decode step in one call (llamarl/engines/native_step.py builds
 * the arguments and calls this; cpu_kernels.py builds and loads it with the other kernels).
 *
 * llamarl_decode_layers_bf16: for each layer l, with x = RMSNorm_0(hidden) before the first:
 *   qkv = x @ Wqkv[l].T (+ b);  attended = attention(qkv, the layer's cache, its q / k norms if any)
 *   (llamarl_attention_bf16)
 *   x = add_rmsnorm(hidden += attended @ Wo[l].T (+ b), post_norm[l])
 *   x = add_rmsnorm(hidden += silu_mul(x @ Wgate_up[l].T (+ b)) @ Wdown[l].T (+ b), next norm)
 * where the next norm is layer l + 1's input norm, or the final norm after the last layer: on
 * return x holds the final norm of the step's hidden state (the LM head's input) and hidden the
 * residual stream. The same bodies as the kernels' own entry points, in the same order, so the
 * result is bitwise theirs (tested).
 *
 * Why one call: called kernel by kernel from Python, a 30-layer step is ~240 calls, each a few
 * microseconds of interpreter, and slower than that from a cold cache, since every projection
 * streams megabytes of weights through L2 between two calls; with more than one thread each call
 * was also a fork and join of the OpenMP team. Here the team is forked once per step and meets at a
 * barrier between phases; on AMX each thread configures its tiles once per step.
 *
 * The GEMMs read x, attended and act in place: those buffers hold padded_rows >= rows rows (a
 * multiple of 16 for the AMX tiles; what the rows past `rows` hold only reaches output rows that
 * are never stored). Returns 0; 1 on a position outside the cache, 2 on a head dimension over 512,
 * 3 when the library has no GEMM (built without AVX512-BF16), each before anything is written. */
#include <stdint.h>
#include "bf16_math.h"
#include "kernels.h"

/* The projections' and norms' tensors of every layer: entry [what][layer] of `tables`. */
enum { QKV_W, QKV_B, O_W, O_B, GATE_UP_W, GATE_UP_B, DOWN_W, DOWN_B, INPUT_NORM, POST_NORM, KEYS, VALUES, Q_NORM, K_NORM,
       TABLES };

typedef struct {
    int64_t rows, layers, dim, heads, kv_heads, head_dim, width, inter, threads, amx;
    float eps, scaling;
    uint16_t *hidden, *x, *qkv, *attended, *delta, *gate_up, *act;
    const uint16_t *cos, *sin, *final_norm;
    const int64_t *positions;
    float *scratch;       /* threads * attention_scratch(...) floats */
    const int64_t *tables; /* [TABLES][layers] addresses (0: no bias) */
} decode_layers_args;

static void project(const decode_layers_args *s, const uint16_t *x, int64_t weight, int64_t bias, uint16_t *y,
                    int64_t n, int64_t k) {
#ifdef LLAMARL_AMX
    if (s->amx) {
        gemm_amx_panels(x, (const uint16_t *)weight, (const uint16_t *)bias, y, s->rows, n, k);
        return;
    }
#endif
#ifdef LLAMARL_AVX512_BF16
    gemm_avx512_panels(x, (const uint16_t *)weight, (const uint16_t *)bias, y, s->rows, n, k);
#else
    (void)s; (void)x; (void)weight; (void)bias; (void)y; (void)n; (void)k;
#endif
}

int llamarl_decode_layers_bf16(const decode_layers_args *s) {
#ifndef LLAMARL_AVX512_BF16
    (void)s;
    return 3;
#else
    const int status = attention_check(s->positions, s->rows, s->head_dim, s->width);
    if (status) return status;
    const int64_t L = s->layers, rows = s->rows, dim = s->dim, q_width = s->heads * s->head_dim;
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t *t = s->tables;
#define ENTRY(what, l) t[(what) * L + (l)]
#define TENSOR(what, l) ((uint16_t *)ENTRY(what, l))
#pragma omp parallel num_threads((int)s->threads) if (s->threads > 1)
    {
#ifdef LLAMARL_AMX
        if (s->amx) amx_tiles_on();
#endif
        rmsnorm_rows(s->hidden, TENSOR(INPUT_NORM, 0), s->x, rows, dim, s->eps);
        for (int64_t l = 0; l < L; l++) {
            project(s, s->x, ENTRY(QKV_W, l), ENTRY(QKV_B, l), s->qkv, qkv_width, dim);
            attention_units(s->qkv, s->cos, s->sin, TENSOR(KEYS, l), TENSOR(VALUES, l), s->positions, s->attended,
                            s->scratch, rows, s->heads, s->kv_heads, s->head_dim, s->width, s->scaling,
                            TENSOR(Q_NORM, l), TENSOR(K_NORM, l), s->eps);
            project(s, s->attended, ENTRY(O_W, l), ENTRY(O_B, l), s->delta, dim, q_width);
            add_rmsnorm_rows(s->hidden, s->delta, TENSOR(POST_NORM, l), s->x, rows, dim, s->eps);
            project(s, s->x, ENTRY(GATE_UP_W, l), ENTRY(GATE_UP_B, l), s->gate_up, 2 * s->inter, dim);
            silu_mul_rows(s->gate_up, s->act, rows, s->inter);
            project(s, s->act, ENTRY(DOWN_W, l), ENTRY(DOWN_B, l), s->delta, dim, s->inter);
            add_rmsnorm_rows(s->hidden, s->delta, l + 1 < L ? TENSOR(INPUT_NORM, l + 1) : s->final_norm, s->x, rows,
                             dim, s->eps);
        }
#ifdef LLAMARL_AMX
        if (s->amx) amx_tiles_off();
#endif
    }
#undef ENTRY
#undef TENSOR
    return 0;
#endif
}
