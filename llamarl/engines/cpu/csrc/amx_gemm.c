/* The linear layers of a bf16 decode step on Intel AMX tiles (llamarl/engines/cpu_kernels.py builds,
 * loads and calls this; compiled only with -DLLAMARL_AMX, i.e. where the CPU reports amx_bf16).
 *
 * llamarl_gemm_amx_bf16: y[i, r] = bf16( sum_c x[i, c] * w[r, c]  (+ bias[r]) ), the contract of
 * llamarl_gemm_bf16 (bf16_decode.c), over the same packed weights: panel p of the packed layout
 * [ceil(n/16)][ceil(k/2)][16][2] is, 32 input columns at a time, exactly an AMX "B" tile (16 rows of
 * one column pair's 16 x 2 weights, 64 bytes apart), so the weights need no second layout.
 *
 * Why not oneDNN, which also runs on the tiles here: at decode row counts a step is the weights'
 * bytes from memory, and oneDNN's matmul took 29-41 ms for SmolLM2's (270 MB at ~13 GB/s: ~21 ms)
 * at 8-64 rows on one core of an Intel Xeon with AMX, this loop 22.5-35 ms
 * (benchmarks/cpu_linears.py). The loop: 2 x 2 accumulator tiles (32 rows of x by two panels of 16
 * outputs), the two panels' B tiles streamed from memory for the first 32 rows and re-read from L2
 * for the next 32; each K step loads two A tiles (x's rows, 32 columns) and two B tiles and issues
 * four TDPBF16PS. Rows are padded to a multiple of 16 in a per-thread buffer (zeros: they add
 * nothing); columns past the last whole 32 (k % 32) are added after the tiles with AVX512-BF16
 * (VDPBF16PS over the same packed pairs); a partial last panel (n % 16) is stored masked.
 * Numerics: TDPBF16PS sums bf16 products in fp32 (inputs and outputs' denormals flushed to zero),
 * as oneDNN's AMX matmul (PyTorch's bf16 F.linear on this CPU) does; the bias is added in fp32 and
 * the result rounded once to bf16. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16_math.h"
#include "kernels.h"

#ifdef LLAMARL_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL. 0 when granted. */
int llamarl_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 1; }

int llamarl_has_amx(void) { return 1; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static __thread uint16_t *padded_rows; /* x's rows padded to a multiple of 16 (one per thread) */
static __thread int64_t padded_size;

/* y's 16 x 16 block at (row0, col0) from a stored accumulator tile: the k % 32 columns' products
 * added (VDPBF16PS over the packed pairs from `first_pair`), the bias, one rounding, masked stores. */
static void store_block(const float *acc, const uint16_t *x, const uint16_t *panel, const uint16_t *bias,
                        uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t row0, int64_t col0, int64_t first_pair) {
    const int64_t pairs = (k + 1) / 2, whole = k / 2, left = n - col0;
    const __mmask16 lanes = first_lanes(left);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + col0)), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < 16 && row0 + r < m; r++) {
        __m512 sum = _mm512_load_ps(acc + r * 16);
        const uint16_t *row = x + (row0 + r) * k;
        for (int64_t kk = first_pair; kk < pairs; kk++) {
            uint32_t pair;
            if (kk < whole) memcpy(&pair, row + 2 * kk, 4);
            else pair = row[k - 1]; /* odd k: the last column alone (its packed partner is 0) */
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512((const void *)(panel + kk * 32)),
                                   (__m512bh)_mm512_set1_epi32((int32_t)pair));
        }
        _mm256_mask_storeu_epi16(y + (row0 + r) * n + col0, lanes, to_bf16x16(_mm512_add_ps(sum, b)));
    }
}

static tile_config tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) { /* every tile 16 rows of 64 bytes: C 16 x 16 fp32, A 16 x 32 bf16, B 16 x 16 x 2 */
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    return config;
}

void amx_tiles_on(void) {
    const tile_config config = tiles();
    _tile_loadconfig(&config);
}

void amx_tiles_off(void) { _tile_release(); }

/* The body (kernels.h), between amx_tiles_on and amx_tiles_off on each thread of the team: pairs
 * of panels split across the team. */
void gemm_amx_panels(const uint16_t *a, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                     int64_t n, int64_t k) {
    const int64_t pairs = (k + 1) / 2, panels = (n + 15) / 16, blocks = k / 32, padded = (m + 15) / 16 * 16;
    const int64_t stride = k * (int64_t)sizeof(uint16_t), duos = (panels + 1) / 2;
    float acc[2][2][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t duo = 0; duo < duos; duo++) {
        const int64_t p = 2 * duo;
        const int both = p + 1 < panels;
        const uint16_t *b0 = packed + p * pairs * 32, *b1 = b0 + pairs * 32;
        for (int64_t i = 0; i < padded; i += 32) { /* the first pass streams b0/b1; later ones hit L2 */
            const int two = i + 16 < padded;
            const uint16_t *a0 = a + i * k, *a1 = a0 + 16 * k;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t blk = 0; blk < blocks; blk++) {
                _tile_loadd(4, a0 + blk * 32, stride);
                _tile_loadd(6, b0 + blk * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (both) {
                    _tile_loadd(7, b1 + blk * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, a1 + blk * 32, stride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (both) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, acc[0][0], 64);
            if (both) _tile_stored(1, acc[0][1], 64);
            if (two) {
                _tile_stored(2, acc[1][0], 64);
                if (both) _tile_stored(3, acc[1][1], 64);
            }
            for (int mi = 0; mi <= two; mi++)
                for (int ni = 0; ni <= both; ni++)
                    store_block(acc[mi][ni], a, ni ? b1 : b0, bias, y, m, n, k, i + 16 * mi, (p + ni) * 16,
                                blocks * 16);
        }
    }
}

/* Returns 0; 4 when the row padding could not be allocated (nothing written). */
int llamarl_gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                          int64_t n, int64_t k, int threads) {
    const int64_t panels = (n + 15) / 16, blocks = k / 32, padded = (m + 15) / 16 * 16;
    const uint16_t *a = x;
    if (padded != m && blocks > 0) { /* x's own rows only: copied into rows readable up to `padded` */
        if (padded_size < padded * k) {
            free(padded_rows);
            padded_rows = aligned_alloc(64, (size_t)((padded * k * 2 + 63) / 64 * 64));
            padded_size = padded_rows ? padded * k : 0;
            if (!padded_rows) return 4;
        }
        memcpy(padded_rows, x, (size_t)(m * k) * sizeof(uint16_t));
        memset(padded_rows + m * k, 0, (size_t)((padded - m) * k) * sizeof(uint16_t));
        a = padded_rows;
    }
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 2)
    {
        amx_tiles_on();
        gemm_amx_panels(a, packed, bias, y, m, n, k);
        amx_tiles_off();
    }
    return 0;
}
#else
int llamarl_amx_init(void) { return 1; }

int llamarl_has_amx(void) { return 0; }

int llamarl_gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                          int64_t n, int64_t k, int threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return 2;
}
#endif
