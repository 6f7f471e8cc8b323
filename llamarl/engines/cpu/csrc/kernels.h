/* The kernels' bodies, shared between their own entry points (bf16_decode.c, amx_gemm.c) and the
 * whole-step one (decode_step.c). Each body splits its loop with an orphaned `omp for`, so it runs
 * on whichever OpenMP team calls it (and whole on a thread outside any) and ends at the team's
 * barrier: what one body writes, the next reads complete. */
#ifndef LLAMARL_KERNELS_H
#define LLAMARL_KERNELS_H

#include <stdint.h>

void rmsnorm_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps);
void add_rmsnorm_rows(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *y, int64_t rows,
                      int64_t dim, float eps);
void silu_mul_rows(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter);

/* 0 when every position is inside the cache's width and d <= 512; else llamarl_attention_bf16's
 * status (1 or 2), before anything is written. */
int attention_check(const int64_t *positions, int64_t rows, int64_t d, int64_t width);
void attention_units(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *keys, uint16_t *values,
                     const int64_t *positions, uint16_t *out, float *scratch, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t width, float scaling, const uint16_t *q_norm,
                     const uint16_t *k_norm, float norm_eps);

/* Floats of attention scratch each thread needs. */
static inline int64_t attention_scratch(int64_t heads, int64_t kv_heads, int64_t d, int64_t width) {
    return (heads / kv_heads) * (width + 2 * d) + d;
}

/* Only where built with -DLLAMARL_AVX512_BF16. */
void gemm_avx512_panels(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                        int64_t n, int64_t k);

/* Only where built with -DLLAMARL_AMX: the calling thread's tile configuration on / released, and
 * the GEMM's body between them; `a` is x with rows readable up to m rounded up to 16 (the padding
 * rows' contents only reach output rows that are never stored). */
void amx_tiles_on(void);
void amx_tiles_off(void);
void gemm_amx_panels(const uint16_t *a, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                     int64_t n, int64_t k);

#endif
