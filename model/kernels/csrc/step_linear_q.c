/* A decode step's linear layers over weights kept in bfloat16 or int8 (REFORMER_DECODE_WEIGHTS): the products
 * of step_linear.c with each weight read in 2 or 1 bytes instead of 4 (model/decoding/steps/linear.py packs
 * them; step_layers.c's products call step_linear_panels_w with the step's weight kind).
 *
 * Why: a step of one row reads every weight of the model once and does two flops with it; on the shipped
 * machine (2 cores, AVX2) the float32 step of an enwik8-sized model is bound by reading ~550 MB a token.
 * Halving or quartering the bytes is what makes it faster; the arithmetic stays float32.
 *
 * Layout (WEIGHTS_* in step_kernels.h): panels of 32 columns of W^T as step_linear.c's, zero past N:
 *   WEIGHTS_BF16: a panel is (K, 32) uint16, each the top half of a float32 (round-to-nearest-even, as
 *                 torch's .to(bfloat16)); widened by a 16-bit shift, exactly.
 *   WEIGHTS_INT8: a panel is 32 float32 scales (one per column) then (K, 32) int8: w ~ q * scale, symmetric,
 *                 scale = max |w| of the column / 127.
 * The product of a row and a column is one chain of K fused multiply-adds of x[k] and the widened weight
 * from 0 in order of k, then (int8) times the column's scale, then + bias: its bits depend on its row of x and
 * its column of W alone, as in step_linear.c, so a row's result does not depend on the batch or the threads.
 *
 * The x86 variants (avx2, avx512) run the AVX2 loops below (an AVX-512 copy was not written: this project's
 * machine has no AVX-512 to time it on); the portable build runs the same chains in plain C.
 */
#include <stdint.h>
#include <string.h>

#include "step_kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROW_TILE 8

/* bytes of one packed panel of K rows */
static int64_t panel_bytes(int64_t wkind, int64_t k) {
    return wkind == WEIGHTS_BF16 ? k * PANEL * 2 : wkind == WEIGHTS_INT8 ? PANEL * 4 + k * PANEL : k * PANEL * 4;
}

/* y[i][0..width) = acc[i][..] (* scale) + bias, for the tile's rows */
static inline void finish(int rows, float acc[ROW_TILE][PANEL], const float *scale, const float *bias, float *y,
                          int64_t y_stride, int64_t width) {
    for (int i = 0; i < rows; i++)
        for (int64_t j = 0; j < width; j++) {
            const float v = scale ? acc[i][j] * scale[j] : acc[i][j];
            y[i * y_stride + j] = v + (bias ? bias[j] : 0.0f);
        }
}

#ifdef __AVX2__
/* `rows` rows of x times one bf16 panel: 16 weights a load, widened by interleaving zeros below them, which
 * puts columns 0-3 and 8-11 in one vector and 4-7 and 12-15 in the other (put back in order at the end) */
static inline __attribute__((always_inline)) void bf16_rows(const int rows, int64_t K, const float *x,
                                                            int64_t x_stride, const uint16_t *w,
                                                            float out[ROW_TILE][PANEL]) {
    __m256 a[ROW_TILE][4];
    for (int i = 0; i < rows; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + k * PANEL));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + k * PANEL + 16));
        _mm_prefetch((const char *)(w + (k + 64) * PANEL), _MM_HINT_T0); /* 4 KB ahead, as step_linear.c */
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0));
        const __m256 w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v1));
        const __m256 w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v1));
        FMA_ROWS4(a, rows, x, x_stride, k, w0, w1, w2, w3);
    }
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_ps(out[i], _mm256_permute2f128_ps(a[i][0], a[i][1], 0x20));
        _mm256_storeu_ps(out[i] + 8, _mm256_permute2f128_ps(a[i][0], a[i][1], 0x31));
        _mm256_storeu_ps(out[i] + 16, _mm256_permute2f128_ps(a[i][2], a[i][3], 0x20));
        _mm256_storeu_ps(out[i] + 24, _mm256_permute2f128_ps(a[i][2], a[i][3], 0x31));
    }
}

/* `rows` rows of x times one int8 panel's (K, 32) values: 8 weights sign-extended and converted a vector */
static inline __attribute__((always_inline)) void int8_rows(const int rows, int64_t K, const float *x,
                                                            int64_t x_stride, const int8_t *w,
                                                            float out[ROW_TILE][PANEL]) {
    __m256 a[ROW_TILE][4];
    for (int i = 0; i < rows; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const int8_t *p = w + k * PANEL;
        _mm_prefetch((const char *)(p + 128 * PANEL), _MM_HINT_T0); /* 4 KB ahead */
        __m256 wv[4];
        for (int q = 0; q < 4; q++)
            wv[q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * q))));
        for (int i = 0; i < rows; i++) {
            const __m256 xv = _mm256_set1_ps(x[i * x_stride + k]);
            for (int q = 0; q < 4; q++) a[i][q] = _mm256_fmadd_ps(xv, wv[q], a[i][q]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(out[i] + 8 * q, a[i][q]);
}

static void tile_bf16(int rows, int64_t K, const float *x, int64_t x_stride, const uint16_t *w,
                      float out[ROW_TILE][PANEL]) {
    DISPATCH(bf16_rows, rows, K, x, x_stride, w, out)
}

static void tile_int8(int rows, int64_t K, const float *x, int64_t x_stride, const int8_t *w,
                      float out[ROW_TILE][PANEL]) {
    DISPATCH(int8_rows, rows, K, x, x_stride, w, out)
}
#else
/* the same chains in plain C */
static void tile_bf16(int rows, int64_t K, const float *x, int64_t x_stride, const uint16_t *w,
                      float out[ROW_TILE][PANEL]) {
    memset(out, 0, sizeof(float) * ROW_TILE * PANEL);
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < rows; i++) {
            const float xv = x[i * x_stride + k];
            for (int j = 0; j < PANEL; j++) {
                const uint32_t bits = (uint32_t)w[k * PANEL + j] << 16;
                float wv;
                memcpy(&wv, &bits, sizeof wv);
                out[i][j] += xv * wv;
            }
        }
}

static void tile_int8(int rows, int64_t K, const float *x, int64_t x_stride, const int8_t *w,
                      float out[ROW_TILE][PANEL]) {
    memset(out, 0, sizeof(float) * ROW_TILE * PANEL);
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < rows; i++) {
            const float xv = x[i * x_stride + k];
            for (int j = 0; j < PANEL; j++) out[i][j] += xv * (float)w[k * PANEL + j];
        }
}
#endif

/* Panels p0 .. p1-1 of y (m, n) = x (m, k, rows x_stride apart) times W^T packed as `wkind` (the layout
 * above), plus bias (n,) unless NULL; WEIGHTS_F32 is step_linear_panels. An unknown kind computes nothing. */
void step_linear_panels_w(int64_t wkind, int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride,
                          const void *packed, const float *bias, float *y, int64_t p0, int64_t p1) {
    if (wkind == WEIGHTS_F32) {
        step_linear_panels(m, n, k, x, x_stride, (const float *)packed, bias, y, p0, p1);
        return;
    }
    if (wkind != WEIGHTS_BF16 && wkind != WEIGHTS_INT8) return;
    const int64_t bytes = panel_bytes(wkind, k);
    float acc[ROW_TILE][PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const int64_t col = p * PANEL, width = n - col < PANEL ? n - col : PANEL;
        const char *panel = (const char *)packed + p * bytes;
        for (int64_t r = 0; r < m; r += ROW_TILE) {
            const int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;
            const float *xr = x + r * x_stride, *scale = NULL;
            if (wkind == WEIGHTS_BF16) {
                tile_bf16(rows, k, xr, x_stride, (const uint16_t *)panel, acc);
            } else {
                scale = (const float *)panel;
                tile_int8(rows, k, xr, x_stride, (const int8_t *)(panel + PANEL * 4), acc);
            }
            finish(rows, acc, scale, bias ? bias + col : NULL, y + r * n + col, n, width);
        }
    }
}

/* y (m, n) = x (m, k, rows x_stride apart) times W^T packed as `wkind`, plus bias (n,) unless NULL. Returns
 * 0, or BAD_KIND for a kind this file does not know. */
int step_linear_w(int64_t wkind, int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride,
                  const void *packed, const float *bias, float *y) {
    if (wkind != WEIGHTS_F32 && wkind != WEIGHTS_BF16 && wkind != WEIGHTS_INT8) return BAD_KIND;
    step_linear_panels_w(wkind, m, n, k, x, x_stride, packed, bias, y, 0, (n + PANEL - 1) / PANEL);
    return 0;
}
