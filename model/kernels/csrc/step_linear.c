/* The linear layers of a decode step on the CPU: y = x W^T + b for a few rows (a step's batch), with W
 * packed once into column panels (model/decoding/steps/linear.py packs and calls it; model/kernels/bindings.py builds it
 * into the same library as window_attend.c).
 *
 * Why: a step's projections, feed-forward and LM head are matrix products of 1-64 rows by the model's
 * weights. PyTorch's CPU matmul (torch 2.13) runs them at a fraction of the core's speed at these shapes: a
 * 256 -> 1024 product of 1 row took 32-38 us and of 8 rows 97-101 us on this project's AMD EPYC (one
 * thread, timed by hand), where this loop takes 14 and 40 us. The product of a few rows is bound by reading
 * the weights; a panel layout reads each weight once per step, in order.
 *
 * Layout: W (N, K) is packed into P = ceil(N / 32) panels of (K, 32) floats, panel p holding columns
 * 32p .. 32p+31 of W^T, zero past N. For 8 rows at a time and one panel, 16 accumulators of 16 lanes each
 * run over k = 0 .. K-1 in order, one fused multiply-add per (row, column, k), then add the bias.
 *
 * Every output element is one chain of K fused multiply-adds from 0 in order of k, then + bias: its bits
 * depend on its row of x and its column of W alone, never on the other rows, their number, or where the
 * row sits in the batch.
 *
 * lsh_hash is an LSH layer's hash of a step's new queries on the same loop: each head's query times that
 * head's rotations (packed as a linear layer of R * rot/2 outputs), then per round and bucket factor f the
 * argmax over [x, -x] of its f/2 rotated values, as model/attention.py's `hash` computes it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_kernels.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROW_TILE 8

#ifdef __AVX512F__
/* `rows` (1..ROW_TILE, a constant after inlining) rows of x times one panel */
static inline __attribute__((always_inline)) void panel_rows(const int rows, int64_t K, const float *x,
                                                             int64_t x_stride, const float *w, const float *bias,
                                                             float *y, int64_t y_stride, int64_t width) {
    __m512 lo[ROW_TILE], hi[ROW_TILE];
    for (int i = 0; i < rows; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16);
        /* the panel is read in order: fetch 32 of its k-lines (4 KB) ahead. In-process A/B of whole steps
         * (bench config, 1 row, a scratch script, load not recorded): 3.35 / 3.70 ms after 4K / 32K
         * against 3.73 / 4.03 ms 16 lines ahead; 64 lines ahead timed between the two */
        _mm_prefetch((const char *)(w + (k + 32) * PANEL), _MM_HINT_T0);
        for (int i = 0; i < rows; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
            lo[i] = _mm512_fmadd_ps(xv, w0, lo[i]);
            hi[i] = _mm512_fmadd_ps(xv, w1, hi[i]);
        }
    }
    const __mmask16 m0 = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : (__mmask16)((1u << (width - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++) {
        _mm512_mask_storeu_ps(y + i * y_stride, m0, _mm512_add_ps(lo[i], b0));
        _mm512_mask_storeu_ps(y + i * y_stride + 16, m1, _mm512_add_ps(hi[i], b1));
    }
}

static void tile(int rows, int64_t K, const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                 int64_t y_stride, int64_t width) {
    DISPATCH(panel_rows, rows, K, x, x_stride, w, bias, y, y_stride, width)
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: the same chains, the accumulators in registers (the plain loop below kept them in memory: a load and
 * a store per multiply-add) */
static inline __attribute__((always_inline)) void panel_rows8(const int rows, int64_t K, const float *x,
                                                              int64_t x_stride, const float *w, const float *bias,
                                                              float *y, int64_t y_stride, int64_t width) {
    __m256 a[ROW_TILE][4];
    for (int i = 0; i < rows; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *p = w + k * PANEL;
        _mm_prefetch((const char *)(p + 32 * PANEL), _MM_HINT_T0); /* 4 KB ahead, as the AVX-512 loop */
        const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8), w2 = _mm256_loadu_ps(p + 16),
                     w3 = _mm256_loadu_ps(p + 24);
        FMA_ROWS4(a, rows, x, x_stride, k, w0, w1, w2, w3);
    }
    for (int i = 0; i < rows; i++) {
        float acc[PANEL];
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc + 8 * q, a[i][q]);
        for (int64_t j = 0; j < width; j++) y[i * y_stride + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}

static void tile(int rows, int64_t K, const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                 int64_t y_stride, int64_t width) {
    DISPATCH(panel_rows8, rows, K, x, x_stride, w, bias, y, y_stride, width)
}
#else
/* the same chains of multiply-adds in plain C, for CPUs without AVX-512 (the compiler vectorises the lanes) */
static void tile(int rows, int64_t K, const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                 int64_t y_stride, int64_t width) {
    float acc[ROW_TILE][PANEL];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < rows; i++) {
            const float xv = x[i * x_stride + k];
            for (int j = 0; j < PANEL; j++) acc[i][j] += xv * w[k * PANEL + j];
        }
    for (int i = 0; i < rows; i++)
        for (int64_t j = 0; j < width; j++) y[i * y_stride + j] = acc[i][j] + (bias ? bias[j] : 0.0f);
}
#endif

/* W (n, k) row-major into `packed` (ceil(n / 32) * k * 32 floats), as the layout above. */
void step_linear_pack(int64_t n, int64_t k, const float *weight, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * k * PANEL) * sizeof(float));
    for (int64_t col = 0; col < n; col++)
        for (int64_t kk = 0; kk < k; kk++)
            packed[(col / PANEL) * k * PANEL + kk * PANEL + col % PANEL] = weight[col * k + kk];
}

/* Panels p0 .. p1-1 of y (m, n) = x (m, k, rows x_stride apart) times the packed W^T, plus bias (n,) unless
 * NULL: columns 32 p0 .. 32 p1 - 1 (a thread's share of a product split by panels; step_layers.c). */
void step_linear_panels(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                        const float *bias, float *y, int64_t p0, int64_t p1) {
    /* panels outside, row tiles inside: a panel (k * 128 bytes) is read from memory once for all m rows */
    for (int64_t p = p0; p < p1; p++) {
        const int64_t col = p * PANEL, width = n - col < PANEL ? n - col : PANEL;
        for (int64_t r = 0; r < m; r += ROW_TILE) {
            const int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;
            tile(rows, k, x + r * x_stride, x_stride, packed + p * k * PANEL, bias ? bias + col : NULL,
                 y + r * n + col, n, width);
        }
    }
}

/* y (m, n) = x (m, k, rows x_stride apart) times the packed W^T, plus bias (n,) unless NULL; returns 0. */
int step_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                const float *bias, float *y) {
    step_linear_panels(m, n, k, x, x_stride, packed, bias, y, 0, (n + PANEL - 1) / PANEL);
    return 0;
}

/* first index of the max (hi) and of the min (lo) of x[0..n), NaN winning both, as torch.max and torch.min */
static void extremes(const float *x, int64_t n, float *hi, int64_t *hi_at, float *lo, int64_t *lo_at) {
    *hi = *lo = x[0];
    *hi_at = *lo_at = 0;
    for (int64_t j = 1; j < n; j++) {
        const float v = x[j];
        if (isnan(*hi)) break;
        if (isnan(v)) {
            *hi = *lo = v;
            *hi_at = *lo_at = j;
            break;
        }
        if (v > *hi) { *hi = v; *hi_at = j; }
        if (v < *lo) { *lo = v; *lo_at = j; }
    }
}

#ifdef __AVX512F__
/* extremes() of n (a multiple of 16) values without NaNs, 16 lanes at a time: the largest and smallest values
 * and the first index of each (an equality test finds it, so -0 and +0 give the index scalar code gives);
 * returns 0 when a value is NaN (the caller then runs extremes(), whose NaN rule is PyTorch's). */
static int extremes16(const float *x, int64_t n, float *hi, int64_t *hi_at, float *lo, int64_t *lo_at) {
    __m512 mx = _mm512_loadu_ps(x), mn = mx;
    __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
    for (int64_t j = 16; j < n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
        mn = _mm512_min_ps(mn, v);
    }
    if (nan) return 0;
    *hi = _mm512_reduce_max_ps(mx);
    *lo = _mm512_reduce_min_ps(mn);
    const __m512 h = _mm512_set1_ps(*hi), l = _mm512_set1_ps(*lo);
    *hi_at = *lo_at = -1;
    for (int64_t j = 0; j < n && (*hi_at < 0 || *lo_at < 0); j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 eh = _mm512_cmp_ps_mask(v, h, _CMP_EQ_OQ), el = _mm512_cmp_ps_mask(v, l, _CMP_EQ_OQ);
        if (*hi_at < 0 && eh) *hi_at = j + __builtin_ctz(eh);
        if (*lo_at < 0 && el) *lo_at = j + __builtin_ctz(el);
    }
    return 1;
}
#endif

/* buckets (m, heads, rounds) int64 of queries q (m, heads, dim): per head, q times `packed` (heads copies of
 * a packed (rounds * half, dim) weight: the head's rotations (dim, rounds, half) transposed), then per round
 * the bucket of factors[0..nfactors) (their halves sum to half) combined as sum of b_i * prod f_<i. Returns
 * 0, or 1 when its buffer could not be allocated. */
int lsh_hash(int64_t m, int64_t heads, int64_t rounds, int64_t dim, int64_t half, int64_t nfactors,
             const int64_t *factors, const float *q, const float *packed, int64_t *buckets) {
    const int64_t n = rounds * half, panels = (n + PANEL - 1) / PANEL;
    float *rotated = malloc((size_t)(m * n) * sizeof(float));
    if (!rotated) return 1;
    for (int64_t h = 0; h < heads; h++) {
        step_linear(m, n, dim, q + h * dim, heads * dim, packed + h * panels * dim * PANEL, NULL, rotated);
        for (int64_t b = 0; b < m; b++)
            for (int64_t r = 0; r < rounds; r++) {
                const float *x = rotated + b * n + r * half;
                int64_t bucket = 0, scale = 1, start = 0;
                for (int64_t i = 0; i < nfactors; i++) {
                    const int64_t f = factors[i];
                    float hi, lo;
                    int64_t hi_at, lo_at;
#ifdef __AVX512F__
                    if (!((f / 2) % 16 == 0 && extremes16(x + start, f / 2, &hi, &hi_at, &lo, &lo_at)))
#endif
                        extremes(x + start, f / 2, &hi, &hi_at, &lo, &lo_at);
                    bucket += scale * (hi >= -lo ? hi_at : lo_at + f / 2);
                    start += f / 2;
                    scale *= f;
                }
                buckets[(b * heads + h) * rounds + r] = bucket;
            }
    }
    free(rotated);
    return 0;
}


/* buckets (m, rounds) int64 of rotated rows (m, rounds, half) float32, as lsh_hash's second half: a forward's
 * hash (model/attention.py) after its rotation matmul. PyTorch's max and min over the factors' short slices,
 * a `where` and the sums, ~70% of a 64K prompt's hash, become one pass over the rows; the bits are comparisons,
 * the same on any number of threads. */
void lsh_buckets(int64_t m, int64_t rounds, int64_t half, int64_t nfactors, const int64_t *factors,
                 const float *rotated, int64_t *buckets) {
#pragma omp parallel for schedule(static) if (m * rounds * half > (1 << 16))
    for (int64_t row = 0; row < m * rounds; row++) {
        const float *x = rotated + row * half;
        int64_t bucket = 0, scale = 1, start = 0;
        for (int64_t i = 0; i < nfactors; i++) {
            const int64_t f = factors[i];
            float hi, lo;
            int64_t hi_at, lo_at;
#ifdef __AVX512F__
            if (!((f / 2) % 16 == 0 && extremes16(x + start, f / 2, &hi, &hi_at, &lo, &lo_at)))
#endif
                extremes(x + start, f / 2, &hi, &hi_at, &lo, &lo_at);
            bucket += scale * (hi >= -lo ? hi_at : lo_at + f / 2);
            start += f / 2;
            scale *= f;
        }
        buckets[row] = bucket;
    }
}

/* order (series, length) int64: for each series of buckets (series, length) int64 in [0, buckets), its positions
 * sorted by (bucket, position), a counting sort: what argsort of bucket * length + position gives (the keys are
 * distinct), in O(length + buckets) per series instead of a comparison sort (an LSH index's build,
 * model/decoding/lsh_index.py). Returns 0, NO_MEMORY, or BAD_INDEX for a bucket outside [0, buckets) (the order is
 * then undefined). */
int lsh_order(int64_t series, int64_t length, int64_t buckets, const int64_t *b, int64_t *order) {
    int status = 0;
#pragma omp parallel for schedule(static) if (series * length > (1 << 16))
    for (int64_t s = 0; s < series; s++) {
        int64_t *next = calloc((size_t)buckets, sizeof(int64_t));
        if (!next) {
#pragma omp atomic write
            status = NO_MEMORY;
            continue;
        }
        const int64_t *bs = b + s * length;
        int64_t *out = order + s * length, bad = 0;
        for (int64_t i = 0; i < length; i++) {
            const int64_t k = bs[i];
            if (k < 0 || k >= buckets) { bad = 1; break; }
            next[k]++;
        }
        if (!bad) {
            int64_t at = 0;
            for (int64_t k = 0; k < buckets; k++) {
                const int64_t c = next[k];
                next[k] = at;
                at += c;
            }
            for (int64_t i = 0; i < length; i++) out[next[bs[i]]++] = i;
        } else {
#pragma omp atomic write
            status = BAD_INDEX;
        }
        free(next);
    }
    return status;
}

/* ---- a layer's tail's pieces (the tail itself: step_layers.c's step_tail) ---- */

#define ACT_RELU 0
#define ACT_GELU 1      /* erf form */
#define ACT_GELU_TANH 2 /* tanh approximation */
#define ACT_SILU 3
#define ACT_TANH 4

static inline float activate(float x, int64_t act) {
    switch (act) {
    case ACT_RELU: return x > 0.0f || x != x ? x : 0.0f; /* NaN stays NaN, as torch.relu */
    case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    case ACT_SILU: return x / (1.0f + expf(-x));
    default: return tanhf(x);
    }
}

/* u[0..n) = act(u[0..n)) in place (a loop per activation, so each one's arithmetic is inlined; step_layers.c
 * calls it on a thread's share of a feed-forward) */
void step_activate(float *u, int64_t n, int64_t act) {
    switch (act) {
    case ACT_RELU: for (int64_t i = 0; i < n; i++) u[i] = activate(u[i], ACT_RELU); break;
    case ACT_GELU: for (int64_t i = 0; i < n; i++) u[i] = activate(u[i], ACT_GELU); break;
    case ACT_GELU_TANH: for (int64_t i = 0; i < n; i++) u[i] = activate(u[i], ACT_GELU_TANH); break;
    case ACT_SILU: for (int64_t i = 0; i < n; i++) u[i] = activate(u[i], ACT_SILU); break;
    default: for (int64_t i = 0; i < n; i++) u[i] = activate(u[i], ACT_TANH); break;
    }
}

/* y = (x - mean) / sqrt(var + eps) * w + b over each of m rows of n, var the biased variance */
void layer_norm_rows(int64_t m, int64_t n, const float *x, const float *w, const float *b, float eps, float *y) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) sum += xr[j];
        const float mean = sum / (float)n;
        float sq = 0.0f;
        for (int64_t j = 0; j < n; j++) sq += (xr[j] - mean) * (xr[j] - mean);
        const float rstd = 1.0f / sqrtf(sq / (float)n + eps);
        for (int64_t j = 0; j < n; j++) yr[j] = (xr[j] - mean) * rstd * (w ? w[j] : 1.0f) + (b ? b[j] : 0.0f);
    }
}
