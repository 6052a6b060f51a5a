/* Cached decoding on the CPU: a step's attention windows, fused into one pass per (row, head)
 * (window_attend, and lsh_attend which first works out an LSH layer's window positions from its index), the
 * step's cache writes (decode_write), the insert into and the merge of an LSH index's recent order
 * (lsh_append, lsh_merge). model/kernels/bindings.py builds and calls them.
 *
 * The attention is what model/decoding/steps/torch_step.py computes for a decode step's windows, without
 * materialising the gathered keys: for every (row b, head h), over R rounds of W window slots each (flat indices into the
 * pools, one pool row per (position, head)),
 *   score = q . keys[flat] (times norms[flat] when given); the row's own position (pos == t[b]) gets
 *   self_mask and a padding slot (absent) gets mask, padding winning, as masked_fill does in that order;
 *   per round: top = max, e = exp(score - top), total = sum e, lse = top + log(total) (-inf for a dead
 *   round); weight = exp(lse - logsumexp over rounds of lse);
 *   out = sum over every round's slots of e * (weight / total) * values[flat].
 * A slot whose probability is exactly 0 adds exactly nothing, so its value row is not read.
 * The pools hold float32, bfloat16 or (where the compiler targets F16C) binary16 rows; q, the scores and out
 * are float32, and a half-precision row is widened exactly as it is read.
 *
 * Why: on this project's CPU a gather of random 256-byte pool rows through PyTorch's index_select runs
 * at about 1.2 GB/s; a loop that prefetches a few rows ahead reads them at about 7.7 GB/s (timed by hand,
 * torch 2.13, one thread, 65,536 rows of a 270 MB pool). The windows of an LSH layer are such rows.
 *
 * Every (row, head) is computed alone, in a fixed order: a row's result does not depend on the rest of
 * the batch, nor on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_kernels.h"
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* rows prefetched ahead: in this kernel 8 and 16 timed the same by hand and 32 slower; in a plain gather
 * loop 4 was slower than 8 */
#define AHEAD 16
/* prefetch into L2 and up (prefetcht1), not non-temporally: a (row, head)'s value rows are fetched with its
 * keys in the score pass and read again in the weighted sum, after every slot's score; a non-temporal line
 * (prefetchnta, locality 0) is gone from the caches by then. In-process A/B on this project's AMD EPYC
 * (bench config, 8 rows after 4K, 48 steps each): the kernel's time per step fell by 18-22% against
 * locality 0; locality 3 was no better than 0. */
#define LOCALITY 2
#define LANES 16
#define MAX_THREADS 64
#define MAX_ROUNDS 64 /* the Python side uses the PyTorch path past it */
#define OUT_REGS 8 /* float32 outputs of up to 8 * 16 elements are summed in registers */

/* The element kinds of the key and value pools (model/kernels/bindings.py's KIND): a step's queries, scores and
 * outputs are float32 whatever the pools hold; a half-precision row is widened to float32 as it is read. */
#define KIND_F32 0
#define KIND_F16 1  /* IEEE binary16: only where the compiler targets F16C (window_kinds says) */
#define KIND_BF16 2

static inline int64_t kind_bytes(int kind) { return kind == KIND_F32 ? 4 : 2; }

/* Which kinds this build reads and writes: bit k for kind k. */
int64_t window_kinds(void) {
#ifdef __F16C__
    return (1 << KIND_F32) | (1 << KIND_F16) | (1 << KIND_BF16);
#else
    return (1 << KIND_F32) | (1 << KIND_BF16);
#endif
}

static inline int kind_ok(int64_t kind) { return kind >= 0 && kind < 3 && ((window_kinds() >> kind) & 1); }

/* d elements of pool row `at` (rows `stride` elements apart) as float32: a float32 row is used in place, a
 * half one is widened into buf (exactly: every binary16 and bfloat16 value is a float32 value) */
static inline const float *row_f32(const void *pool, int kind, int64_t at, int64_t stride, int64_t d, float *buf) {
    if (kind == KIND_F32) return (const float *)pool + at * stride;
    const uint16_t *h = (const uint16_t *)pool + at * stride;
    if (kind == KIND_BF16) {
        for (int64_t j = 0; j < d; j++) {
            const uint32_t u = (uint32_t)h[j] << 16;
            memcpy(buf + j, &u, sizeof u);
        }
        return buf;
    }
#ifdef __F16C__
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < d; j++) buf[j] = _cvtsh_ss(h[j]);
#endif
    return buf;
}

/* float32 -> the pool's kind, rounding to nearest even as PyTorch's casts do (bfloat16: NaN stays a NaN) */
static inline void store_row(void *pool, int kind, int64_t at, int64_t stride, const float *x, int64_t d) {
    if (kind == KIND_F32) {
        memcpy((float *)pool + at * stride, x, (size_t)d * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)pool + at * stride;
    if (kind == KIND_BF16) {
        for (int64_t j = 0; j < d; j++) {
            uint32_t u;
            memcpy(&u, x + j, sizeof u);
            h[j] = isnan(x[j]) ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        return;
    }
#ifdef __F16C__
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        _mm_storeu_si128((__m128i *)(h + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < d; j++) h[j] = _cvtss_sh(x[j], _MM_FROUND_TO_NEAREST_INT);
#endif
}

typedef struct {
    int64_t heads, rounds, width, dim;
    int kind;
    const float *q, *norms;
    const void *keys, *values;
    int64_t pool_len, stride; /* rows of dim elements in keys and values, stride elements apart */
    const int64_t *flat, *pos, *t;
    const uint8_t *absent, *dead;
    int64_t absent_row_stride, absent_head_stride;
    float self_mask, mask;
    float *out;
    int64_t begin, end; /* items b * heads + h */
    int status;
} Job;

/* row_bytes from pool row `at`, rows stride_bytes apart */
static inline void prefetch_row(const void *pool, int64_t row_bytes, int64_t stride_bytes, int64_t at) {
    const char *p = (const char *)pool + at * stride_bytes;
    for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(p + c, 0, LOCALITY);
}

/* a window slot's key row, value row (by the weighted sum it is in cache, fetched alongside the key) and key
 * norm, if any */
static inline void prefetch_slot(const void *keys, const void *values, const float *norms, int64_t row_bytes,
                                 int64_t stride_bytes, int64_t at) {
    prefetch_row(keys, row_bytes, stride_bytes, at);
    prefetch_row(values, row_bytes, stride_bytes, at);
    if (norms) __builtin_prefetch(norms + at, 0, LOCALITY);
}

/* independent lanes, so the compiler vectorises it without reassociating one sum; the lanes are added
 * pairwise (a few shuffles), not in one chain of LANES dependent adds (in-process A/B, 8 rows after 4K:
 * 12-19% less kernel time per step) */
static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += a[j + l] * b[j + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    float s = lane[0];
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

/* q . row and out += p * row for a pool row of `kind` (buf: d floats of scratch). With AVX-512 a half row
 * is widened 16 elements at a time in registers; elsewhere it is widened into buf first (the round trip
 * through buf cost about 10 ns a slot with the pools in L2, timed by hand). */
#ifdef __AVX512F__
/* 16 half elements (binary16 or bfloat16) widened to float32 in a register */
static inline __m512 widen16(const uint16_t *h, int kind) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)h);
    return kind == KIND_F16 ? _mm512_cvtph_ps(raw)
                            : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

/* exp16's and exp8's shared part: with n = round(x / ln 2), p = exp(x - n ln 2) by Cephes' single-precision
 * polynomial (ln 2 in two parts, so r is exact enough), at the vector width of the intrinsics' prefix PFX
 * (_mm512_ or _mm256_) and type T; the caller scales p by 2**n */
#define EXP_POLY(PFX, T, x, n, p)                                                                                \
    do {                                                                                                          \
        T r_ = PFX##fnmadd_ps(n, PFX##set1_ps(0.693359375f), x);                                                  \
        r_ = PFX##fnmadd_ps(n, PFX##set1_ps(-2.12194440e-4f), r_);                                                \
        p = PFX##set1_ps(1.9875691500e-4f);                                                                       \
        p = PFX##fmadd_ps(p, r_, PFX##set1_ps(1.3981999507e-3f));                                                 \
        p = PFX##fmadd_ps(p, r_, PFX##set1_ps(8.3334519073e-3f));                                                 \
        p = PFX##fmadd_ps(p, r_, PFX##set1_ps(4.1665795894e-2f));                                                 \
        p = PFX##fmadd_ps(p, r_, PFX##set1_ps(1.6666665459e-1f));                                                 \
        p = PFX##fmadd_ps(p, r_, PFX##set1_ps(5.0000001201e-1f));                                                 \
        p = PFX##fmadd_ps(p, PFX##mul_ps(r_, r_), PFX##add_ps(r_, PFX##set1_ps(1.0f)));                           \
    } while (0)

/* The AVX2 build (no AVX-512): the same loops 8 lanes wide, half rows widened in registers. Before them this
 * build scored a slot through the generic loops (a half row widened into buf, scalar expf): after 1K tokens
 * of the enwik8-shaped model, attend_slots was a quarter of an int8 step's perf samples
 * (bench/results/decode_step_perf_int8_1k.txt). */
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define AVX2_PATH 1
/* 8 half elements (binary16 or bfloat16) widened to float32 in a register */
static inline __m256 widen8(const uint16_t *h, int kind) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)h);
    return kind == KIND_F16 ? _mm256_cvtph_ps(raw)
                            : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* whether dot_lanes8 reads a pool row of `kind` and d elements */
static inline int lanes_fit8(int kind, int64_t d) { return kind == KIND_F32 ? d % 16 == 0 : d % 8 == 0; }

/* q . pool row `at` as 8 lanes before their sum: a float32 row in two chains, added; a half row in one */
static inline __m256 dot_lanes8(const float *q, const void *pool, int kind, int64_t at, int64_t stride, int64_t d) {
    if (kind == KIND_F32) {
        const float *k = (const float *)pool + at * stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8), a1);
        }
        return _mm256_add_ps(a0, a1);
    }
    const uint16_t *h = (const uint16_t *)pool + at * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), widen8(h + j, kind), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), widen8(h + j + 8, kind), a1);
    }
    if (j < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), widen8(h + j, kind), a0);
    return _mm256_add_ps(a0, a1);
}

/* the sum of 8 lanes as a tree: lane i + lane i+4, then i + i+2, then i + i+1 */
static inline float sum_lanes8(__m256 v) {
    const __m128 t4 = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 t6 = _mm_add_ps(t4, _mm_shuffle_ps(t4, t4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* exp of 8 floats of at most 0: exp16's polynomial, 2**n put in the exponent field (n >= -126 above the
 * cut, so the power is a normal float); exactly 1 at 0 and exactly 0 below -87.3 */
static inline __m256 exp8(__m256 x) {
    const __m256 cut = _mm256_set1_ps(-87.33654f);
    const __m256 tiny = _mm256_cmp_ps(x, cut, _CMP_LT_OQ);
    x = _mm256_max_ps(x, cut);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    EXP_POLY(_mm256_, __m256, x, n, p);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#ifdef __AVX512F__
/* whether dot_lanes reads a pool row of `kind` and d elements: float32 rows of a multiple of 32 elements,
 * half rows of a multiple of 16 */
static inline int lanes_fit(int kind, int64_t d) { return kind == KIND_F32 ? d % 32 == 0 : d % 16 == 0; }

/* q . pool row `at` as 16 lanes before their sum: a float32 row in two chains of 16 lanes, added; a half
 * row in one chain, widened as it is read */
static inline __m512 dot_lanes(const float *q, const void *pool, int kind, int64_t at, int64_t stride, int64_t d) {
    if (kind == KIND_F32) {
        const float *k = (const float *)pool + at * stride;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(k + j), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j + 16), _mm512_loadu_ps(k + j + 16), a1);
        }
        return _mm512_add_ps(a0, a1);
    }
    const uint16_t *h = (const uint16_t *)pool + at * stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), widen16(h + j, kind), acc);
    return acc;
}

/* the sum of 16 lanes as a tree: lane i + lane i+8, then i + i+4, i + i+2, i + i+1 (the order GCC's
 * _mm512_reduce_add_ps adds them in, written out so that dots16 below adds in the same order whatever the
 * compiler) */
static inline float sum_lanes(__m512 v) {
    const __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                    _mm512_castps512_ps256(v));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* q . keys[at[s]] for 16 pool rows at once, each summed as sum_lanes(dot_lanes(...)) sums it (the same
 * additions of the same values: the same bits), but the 16 sums are done together: pairs of rows'
 * lanes are interleaved and added level by level, 15 adds for the 16 rows instead of 4 each */
static inline void dots16(const float *q, const void *keys, int kind, int64_t stride, int64_t d, const int64_t *at,
                          float *out) {
    __m512 v[16], u[8], w[4], z[2];
    for (int s = 0; s < 16; s++) v[s] = dot_lanes(q, keys, kind, at[s], stride, d);
    for (int p = 0; p < 8; p++) /* each row's lane i + lane i+8: rows 2p, 2p+1 in 8 lanes each */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 4; p++) /* + lane i+4: rows 4p .. 4p+3, one per 128-bit quarter */
        w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++) /* + lane i+2: quarter L holds rows 8p+L and 8p+4+L, two lanes each */
        z[p] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* + lane i+1: element 4L + m holds row 4m + L */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    static const int32_t order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)order), r));
}
#endif

#ifdef __AVX512F__
/* exp of 16 floats of at most 0 (a score less the window's top): Cephes' single-precision polynomial,
 * scaled by 2**n: within 1 ulp of glibc's expf at 6.25M points of [-90, 0] (checked by hand), exactly 1 at 0,
 * and exactly 0 below -87.3, where expf is 0 or subnormal, so a masked slot still weighs exactly nothing.
 * Scalar expf per slot was about a sixth of the attention's perf samples in a shipped-model step of 8 rows;
 * in-process A/B of the step: shipped model 8 rows 0.752 -> 0.662 ms, 1 row 0.146 -> 0.135; bench config 8
 * rows after 1K 5.44 -> 5.00 (same greedy tokens, logits within 2.1e-5). */
static inline __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    EXP_POLY(_mm512_, __m512, x, n, p);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}
#endif

static inline float dot_row(const float *q, const void *pool, int kind, int64_t at, int64_t stride, int64_t d,
                            float *buf) {
#ifdef __AVX512F__
    /* reduced in registers (the generic loop's lanes went through the stack) */
    if (lanes_fit(kind, d)) return sum_lanes(dot_lanes(q, pool, kind, at, stride, d));
#elif defined(AVX2_PATH)
    if (lanes_fit8(kind, d)) return sum_lanes8(dot_lanes8(q, pool, kind, at, stride, d));
#endif
    return dot(q, row_f32(pool, kind, at, stride, d, buf), d);
}

static inline void add_row(float *out, float p, const void *pool, int kind, int64_t at, int64_t stride, int64_t d,
                           float *buf) {
#ifdef __AVX512F__
    if (kind != KIND_F32 && d % 16 == 0) {
        const uint16_t *h = (const uint16_t *)pool + at * stride;
        const __m512 pp = _mm512_set1_ps(p);
        for (int64_t j = 0; j < d; j += 16) {
            _mm512_storeu_ps(out + j, _mm512_fmadd_ps(pp, widen16(h + j, kind), _mm512_loadu_ps(out + j)));
        }
        return;
    }
#elif defined(AVX2_PATH)
    if (kind != KIND_F32 && d % 8 == 0) {
        const uint16_t *h = (const uint16_t *)pool + at * stride;
        const __m256 pp = _mm256_set1_ps(p);
        for (int64_t j = 0; j < d; j += 8)
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(pp, widen8(h + j, kind), _mm256_loadu_ps(out + j)));
        return;
    }
#endif
    const float *v = row_f32(pool, kind, at, stride, d, buf);
    for (int64_t j = 0; j < d; j++) out[j] += p * v[j];
}

/* The attention of one (row, head) over its n = R * W window slots: flat pool indices, positions (or NULL:
 * no self mask) and padding flags; keys and values hold pool_len rows of dim elements of `kind`, `stride`
 * elements apart (the cache keeps a row's key and value side by side: model/decoding/cache.py); score holds n
 * floats, lse 2 * R, row dim. */
static int attend_slots(const float *q, int64_t dim, int64_t rounds, int64_t width, const int64_t *flat,
                         const int64_t *pos, int64_t self, const uint8_t *absent, const uint8_t *dead,
                         const void *keys, const float *norms, const void *values, int kind, int64_t pool_len,
                         int64_t stride, float self_mask, float mask, float *out, float *score, float *lse,
                         float *row) {
    const int64_t R = rounds, W = width, D = dim, n = R * W, row_bytes = D * kind_bytes(kind);
    const int64_t stride_bytes = stride * kind_bytes(kind);
    for (int64_t i = 0; i < n; i++)
        if (!absent[i] && (flat[i] < 0 || flat[i] >= pool_len)) return BAD_INDEX;
    /* the first AHEAD slots, which the loop's look-ahead never reaches */
    for (int64_t i = 0; i < AHEAD && i < n; i++)
        if (!absent[i]) prefetch_slot(keys, values, norms, row_bytes, stride_bytes, flat[i]);
    int64_t i = 0;
#ifdef __AVX512F__
    if (lanes_fit(kind, D)) {
        /* 16 slots at a time (dots16): the same scores as the loop below, with fewer instructions. In-process
         * A/B against the loop alone (three runs; scratch script, load not recorded): bench config, 8 rows
         * after 1K, 8.38 / 7.06 / 8.15 -> 7.95 / 6.32 / 7.08 ms a step; shipped model, 8 rows, 1.32 / 0.96 /
         * 1.13 -> 1.25 / 0.93 / 1.09 ms; bit-identical logits over every step. With a float16 cache the
         * same A/B showed no gain (bench config, 8 rows: 5.13 / 5.22 -> 5.03 / 5.21 ms), same bits too */
        for (; i + 16 <= n; i += 16) {
            int64_t at[16];
            float dots[16];
            for (int s = 0; s < 16; s++) {
                const int64_t k = i + s;
                if (k + AHEAD < n && !absent[k + AHEAD]) prefetch_slot(keys, values, norms, row_bytes, stride_bytes,
                                                                       flat[k + AHEAD]);
                at[s] = absent[k] ? 0 : flat[k]; /* a padding slot's score is the mask: any row will do */
            }
            dots16(q, keys, kind, stride, D, at, dots);
            for (int s = 0; s < 16; s++) {
                const int64_t k = i + s;
                float v = dots[s];
                if (absent[k]) {
                    v = mask;
                } else if (pos && pos[k] == self) {
                    v = self_mask;
                } else if (norms) {
                    v *= norms[flat[k]];
                }
                score[k] = v;
            }
        }
    }
#endif
    for (; i < n; i++) {
        if (i + AHEAD < n && !absent[i + AHEAD])
            prefetch_slot(keys, values, norms, row_bytes, stride_bytes, flat[i + AHEAD]);
        float s;
        if (absent[i]) {
            s = mask;
        } else if (pos && pos[i] == self) {
            s = self_mask;
        } else {
            s = dot_row(q, keys, kind, flat[i], stride, D, row);
            if (norms) s *= norms[flat[i]];
        }
        score[i] = s;
    }
    float top_lse = -INFINITY;
    for (int64_t r = 0; r < R; r++) {
        float *e = score + r * W;
        float top = e[0];
        for (int64_t w = 1; w < W; w++) top = e[w] > top ? e[w] : top;
        float total = 0.0f;
        int64_t w = 0;
#ifdef __AVX512F__
        if (W % 16 == 0) { /* 16 slots at a time; their sum in 16 lanes, added as sum_lanes adds */
            const __m512 at_top = _mm512_set1_ps(top);
            __m512 lanes = _mm512_setzero_ps();
            for (; w < W; w += 16) {
                const __m512 v = exp16(_mm512_sub_ps(_mm512_loadu_ps(e + w), at_top));
                _mm512_storeu_ps(e + w, v);
                lanes = _mm512_add_ps(lanes, v);
            }
            total = sum_lanes(lanes);
        }
#elif defined(AVX2_PATH)
        if (W % 8 == 0) { /* 8 slots at a time; their sum in 8 lanes, added as sum_lanes8 adds */
            const __m256 at_top = _mm256_set1_ps(top);
            __m256 lanes = _mm256_setzero_ps();
            for (; w < W; w += 8) {
                const __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + w), at_top));
                _mm256_storeu_ps(e + w, v);
                lanes = _mm256_add_ps(lanes, v);
            }
            total = sum_lanes8(lanes);
        }
#endif
        for (; w < W; w++) {
            e[w] = expf(e[w] - top);
            total += e[w];
        }
        lse[R + r] = total;
        lse[r] = (dead && dead[r]) ? -INFINITY : top + logf(total);
        top_lse = lse[r] > top_lse ? lse[r] : top_lse;
    }
    float sum = 0.0f;
    for (int64_t r = 0; r < R; r++) sum += expf(lse[r] - top_lse);
    const float all = top_lse + logf(sum);
    for (int64_t r = 0; r < R; r++) {
        const float scale = expf(lse[r] - all) / lse[R + r];
        for (int64_t w = 0; w < W; w++) score[r * W + w] *= scale;
    }
#ifdef __AVX512F__
    if (kind == KIND_F32 && D % 16 == 0 && D <= 16 * OUT_REGS) {
        /* the same multiply-adds as add_row, with the output row held in registers across the slots */
        __m512 acc[OUT_REGS];
        const int64_t parts = D / 16;
        for (int64_t c = 0; c < parts; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            if (i + AHEAD < n && score[i + AHEAD] != 0.0f)
                prefetch_row(values, row_bytes, stride_bytes, flat[i + AHEAD]);
            const float p = score[i];
            if (p == 0.0f) continue;
            const float *v = (const float *)values + flat[i] * stride;
            const __m512 pp = _mm512_set1_ps(p);
            for (int64_t c = 0; c < parts; c++) acc[c] = _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < parts; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
        return 0;
    }
#elif defined(AVX2_PATH)
    if (D % 8 == 0 && D <= 64) { /* add_row's multiply-adds, the output in at most 8 of the 16 registers */
        __m256 acc[8];
        const int64_t parts = D / 8;
        for (int64_t c = 0; c < parts; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            if (i + AHEAD < n && score[i + AHEAD] != 0.0f)
                prefetch_row(values, row_bytes, stride_bytes, flat[i + AHEAD]);
            const float p = score[i];
            if (p == 0.0f) continue;
            const __m256 pp = _mm256_set1_ps(p);
            if (kind == KIND_F32) {
                const float *v = (const float *)values + flat[i] * stride;
                for (int64_t c = 0; c < parts; c++) acc[c] = _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + 8 * c), acc[c]);
            } else {
                const uint16_t *h = (const uint16_t *)values + flat[i] * stride;
                for (int64_t c = 0; c < parts; c++) acc[c] = _mm256_fmadd_ps(pp, widen8(h + 8 * c, kind), acc[c]);
            }
        }
        for (int64_t c = 0; c < parts; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
        return 0;
    }
#endif
    memset(out, 0, (size_t)D * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && score[i + AHEAD] != 0.0f)
            prefetch_row(values, row_bytes, stride_bytes, flat[i + AHEAD]);
        const float p = score[i];
        if (p == 0.0f) continue;
        add_row(out, p, values, kind, flat[i], stride, D, row);
    }
    return 0;
}

static int attend_item(const Job *job, int64_t item, float *score, float *lse, float *row) {
    const int64_t H = job->heads, n = job->rounds * job->width, D = job->dim;
    const int64_t b = item / H, h = item % H;
    uint8_t dead[MAX_ROUNDS];
    if (job->dead)
        for (int64_t r = 0; r < job->rounds; r++) dead[r] = job->dead[b * job->rounds + r];
    return attend_slots(job->q + item * D, D, job->rounds, job->width, job->flat + item * n,
                 job->pos ? job->pos + item * n : NULL, job->t ? job->t[b] : -1,
                 job->absent + b * job->absent_row_stride + h * job->absent_head_stride, job->dead ? dead : NULL,
                 job->keys, job->norms, job->values, job->kind, job->pool_len, job->stride, job->self_mask, job->mask,
                 job->out + item * D, score, lse, row);
}

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    const int64_t n = job->rounds * job->width;
    float *buffer = malloc((size_t)(n + 2 * job->rounds + job->dim) * sizeof(float));
    if (!buffer) {
        job->status = NO_MEMORY;
        return NULL;
    }
    job->status = 0;
    for (int64_t item = job->begin; item < job->end && !job->status; item++)
        job->status = attend_item(job, item, buffer, buffer + n, buffer + n + 2 * job->rounds);
    free(buffer);
    return NULL;
}

/* Runs fn on jobs[0..threads), jobs[k] on thread k (jobs[0] on the caller's); each job sets its own status. */
static void run_parallel(void *(*fn)(void *), char *jobs, size_t job_size, int64_t threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t k = 1; k < threads; k++) started[k] = pthread_create(&ids[k], NULL, fn, jobs + k * job_size) == 0;
    fn(jobs);
    for (int64_t k = 1; k < threads; k++) {
        if (started[k]) pthread_join(ids[k], NULL);
        else fn(jobs + k * job_size); /* no thread: this one does its share */
    }
}

/* A thread per ITEMS_PER_THREAD (row, head) items at most: a step of a few rows is over in a few hundred
 * microseconds, less than starting threads costs when PyTorch's own intra-op threads are spinning on the
 * other cores (bench/generate.py --batch-all-threads, batch 1 on two threads: 11.46 ms a step with a thread
 * per item, 5.25 ms with this rule, in two runs of that benchmark). */
#define ITEMS_PER_THREAD 32

static int64_t clamp_threads(int64_t threads, int64_t items) {
    if (threads > items / ITEMS_PER_THREAD) threads = items / ITEMS_PER_THREAD;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return threads < 1 ? 1 : threads;
}

/* Returns 0; NO_MEMORY, BAD_INDEX (a window index outside the pools) or BAD_KIND leave out undefined. */
int window_attend(int64_t rows, int64_t heads, int64_t rounds, int64_t width, int64_t dim, int64_t kind,
                  const float *q, const void *keys, const float *norms, const void *values, int64_t pool_len,
                  int64_t stride, const int64_t *flat,
                  const uint8_t *absent, int64_t absent_row_stride, int64_t absent_head_stride,
                  const int64_t *pos, const int64_t *t, const uint8_t *dead, float self_mask, float mask,
                  float *out, int64_t threads) {
    if (!kind_ok(kind)) return BAD_KIND;
    const int64_t items = rows * heads;
    threads = clamp_threads(threads, items);
    Job jobs[MAX_THREADS];
    for (int64_t k = 0; k < threads; k++) {
        jobs[k] = (Job){heads, rounds, width, dim, (int)kind, q, norms, keys, values, pool_len, stride, flat, pos, t,
                        absent, dead,
                        absent_row_stride, absent_head_stride, self_mask, mask, out,
                        items * k / threads, items * (k + 1) / threads, 1};
    }
    run_parallel(run_job, (char *)jobs, sizeof(Job), threads);
    int status = 0;
    for (int64_t k = 0; k < threads; k++) status |= jobs[k].status;
    return status;
}

/* window_attend for the (row, head) items begin .. end-1 only, on the calling thread (step_layers.c splits a
 * step's items between its threads). */
int window_attend_items(int64_t heads, int64_t rounds, int64_t width, int64_t dim, int64_t kind, const float *q,
                        const void *keys, const float *norms, const void *values, int64_t pool_len, int64_t stride,
                        const int64_t *flat, const uint8_t *absent, int64_t absent_row_stride,
                        int64_t absent_head_stride, const int64_t *pos, const int64_t *t, const uint8_t *dead,
                        float self_mask, float mask, float *out, int64_t begin, int64_t end) {
    if (!kind_ok(kind)) return BAD_KIND;
    Job job = {heads, rounds, width, dim, (int)kind, q, norms, keys, values, pool_len, stride, flat, pos, t, absent,
               dead,
               absent_row_stride, absent_head_stride, self_mask, mask, out, begin, end, 1};
    if (begin < end) run_job(&job);
    return begin < end ? job.status : 0;
}

/* ---- LSH layers: the window's positions from the bucket order, then the attention ------------------- */

typedef struct {
    int64_t heads, rounds, buckets, chunk, before, after, dim, recent_size;
    int kind;
    const float *q, *norms;
    const void *keys, *values;
    int64_t pool_rows;         /* positions in the pools (keys and values hold pool_rows * heads rows) */
    int64_t stride;            /* elements from one pool row to the next */
    const int64_t *meta;       /* (B, META_COLUMNS): the rows' facts (META_* in step_kernels.h) */
    const int64_t *bucket_of;  /* (B, H, R): the new position's bucket in each round */
    const int32_t *main_counts;
    const int16_t *recent_counts; /* (slots, H, R, NB), after the step's insert */
    const void *items;
    int64_t items_len, item_bytes, shift, recent_offset;
    const int64_t *block_table;
    int64_t table_width, block_size;
    int64_t skip_slot; /* rows on this slot (the scratch slot: padding) are not computed */
    float self_mask, mask;
    float *out;
    int64_t begin, end;
    int status;
} LshJob;

/* the pool row of a slot's position, or -1 outside its block table or the pools */
static inline int64_t pool_row(const LshJob *job, int64_t slot, int64_t position) {
    return block_pool_row(job->block_table, job->table_width, job->block_size, slot, position, job->pool_rows);
}

/* the position stored at `at` in the index's items, or -1 outside them */
static inline int64_t read_item(const LshJob *job, int64_t at) {
    if (at < 0 || at >= job->items_len) return -1;
    const int64_t v = job->item_bytes == 2 ? ((const int16_t *)job->items)[at] : ((const int32_t *)job->items)[at];
    return v - job->shift;
}

/* A place in one round's bucket order: bucket bb and the main and recent items of the buckets before it,
 * so the bucket's merged items start at pm + pr. */
typedef struct {
    int64_t bb, pm, pr;
} Cursor;

static inline int64_t sum_i32(const int32_t *x, int64_t n) {
    int64_t s = 0;
    for (int64_t k = 0; k < n; k++) s += x[k];
    return s;
}

static inline int64_t sum_i16(const int16_t *x, int64_t n) {
    int64_t s = 0;
    for (int64_t k = 0; k < n; k++) s += x[k];
    return s;
}

/* Moves c to the last bucket starting at or before p (what searchsorted(right=True) - 1 finds over the
 * bucket starts), walking from wherever it is: a window covers a few chunks, so from a cursor near it the
 * walk is a few buckets, where prefix sums over every bucket would cost the bucket count (2 * L / chunk
 * with an automatic count) per head, round and layer at every step. */
static inline void seek(Cursor *c, int64_t p, const int32_t *mc, const int16_t *rc, int64_t nb) {
    while (c->bb > 0 && c->pm + c->pr > p) {
        c->bb--;
        c->pm -= mc[c->bb];
        c->pr -= rc[c->bb];
    }
    while (c->bb + 1 < nb && c->pm + mc[c->bb] + c->pr + rc[c->bb] <= p) {
        c->pm += mc[c->bb];
        c->pr += rc[c->bb];
        c->bb++;
    }
}

/* positions (and pool indices) of one (row, head)'s windows, as LSHIndex.window computes them */
static int lsh_slots(const LshJob *job, int64_t b, int64_t h, int64_t *flat, int64_t *pos, uint8_t *absent,
                     uint8_t *dead) {
    const int64_t H = job->heads, R = job->rounds, NB = job->buckets, C = job->chunk;
    const int64_t wc = job->before + 1 + job->after, W = wc * C;
    const int64_t *m = job->meta + b * META_COLUMNS;
    const int64_t slot = m[META_SLOT], t = m[META_POSITION], hashed = m[META_HASHED], nch = m[META_LSH_CHUNKS];
    const int64_t islot = m[META_INDEX_SLOT];
    if (!hashed) { /* shorter than a chunk: every position so far, in round 0; the other rounds are dead */
        for (int64_t r = 0; r < R; r++) {
            dead[r] = r != 0;
            for (int64_t w = 0; w < W; w++) {
                const int64_t i = r * W + w;
                const int live = r == 0 && w <= t;
                const int64_t row = live ? pool_row(job, slot, w) : 0;
                if (row < 0) return BAD_INDEX;
                absent[i] = !live;
                pos[i] = live ? w : 0;
                flat[i] = row * H + h;
            }
        }
        return 0;
    }
    const int64_t total = nch * R;
    for (int64_t r = 0; r < R; r++) {
        dead[r] = 0;
        const int64_t row_base = (islot * H + h) * R;
        const int32_t *mc_r = job->main_counts + (row_base + r) * NB;
        const int16_t *rc_r = job->recent_counts + (row_base + r) * NB;
        const int64_t bk = job->bucket_of[(b * H + h) * R + r];
        if (bk < 0 || bk >= NB) return BAD_INDEX;
        /* the newest position is the last item of its bucket: its slot in round r's sorted order */
        const Cursor at_new = {bk, sum_i32(mc_r, bk), sum_i16(rc_r, bk)};
        const int64_t s = at_new.pm + mc_r[bk] + at_new.pr + rc_r[bk] - 1;
        const int64_t s_chunk = s >= 0 ? s / C : -((-s + C - 1) / C);
        for (int64_t o = 0; o < wc; o++) {
            int64_t g = (r * nch + s_chunk + o - job->before) % total;
            if (g < 0) g += total;
            const int64_t r2 = g / nch, first = (g - r2 * nch) * C;
            const int32_t *mc = job->main_counts + (row_base + r2) * NB;
            const int16_t *rc = job->recent_counts + (row_base + r2) * NB;
            Cursor c = at_new;
            if (r2 != r) { /* a window wrapping into another round: from that round's nearer end */
                if (2 * first < nch * C) {
                    c = (Cursor){0, 0, 0};
                } else {
                    c = (Cursor){NB - 1, sum_i32(mc, NB - 1), sum_i16(rc, NB - 1)};
                }
            }
            for (int64_t k = 0; k < C; k++) {
                const int64_t p = first + k, i = r * W + o * C + k;
                if (p > t) {
                    absent[i] = 1;
                    pos[i] = 0;
                    flat[i] = 0;
                    continue;
                }
                seek(&c, p, mc, rc, NB);
                const int64_t j = p - c.pr, mend = c.pm + mc[c.bb];
                int64_t at;
                if (j < mend) {
                    const int64_t row = pool_row(job, slot, j);
                    if (row < 0) return BAD_INDEX;
                    at = row * (H * R) + h * R + r2;
                } else {
                    int64_t q = p - mend;
                    q = q < 0 ? 0 : (q >= job->recent_size ? job->recent_size - 1 : q);
                    at = job->recent_offset + (row_base + r2) * job->recent_size + q;
                }
                const int64_t position = read_item(job, at);
                const int64_t row = position < 0 ? -1 : pool_row(job, slot, position);
                if (row < 0) return BAD_INDEX;
                absent[i] = 0;
                pos[i] = position;
                flat[i] = row * H + h;
            }
        }
    }
    return 0;
}

static void *run_lsh_job(void *arg) {
    LshJob *job = (LshJob *)arg;
    const int64_t R = job->rounds, W = (job->before + 1 + job->after) * job->chunk, n = R * W;
    char *buffer = malloc((size_t)n * (2 * sizeof(int64_t) + sizeof(float) + 1)
                          + (size_t)(R * 2 + job->dim) * sizeof(float) + 64);
    if (!buffer) {
        job->status = NO_MEMORY;
        return NULL;
    }
    int64_t *flat = (int64_t *)buffer, *pos = flat + n;
    float *score = (float *)(pos + n), *lse = score + n, *row = lse + 2 * R;
    uint8_t *absent = (uint8_t *)(row + job->dim), dead[MAX_ROUNDS];
    job->status = 0;
    for (int64_t item = job->begin; item < job->end && !job->status; item++) {
        const int64_t b = item / job->heads, h = item % job->heads;
        float *out = job->out + item * job->dim;
        if (job->meta[b * META_COLUMNS + META_SLOT] == job->skip_slot) { /* a padding row: its result is dropped */
            memset(out, 0, (size_t)job->dim * sizeof(float));
            continue;
        }
        job->status = lsh_slots(job, b, h, flat, pos, absent, dead);
        if (!job->status)
            job->status = attend_slots(job->q + item * job->dim, job->dim, R, W, flat, pos, job->meta[b * META_COLUMNS + META_POSITION],
                                       absent, dead, job->keys, job->norms, job->values, job->kind,
                                       job->pool_rows * job->heads, job->stride, job->self_mask, job->mask, out, score,
                                       lse, row);
    }
    free(buffer);
    return NULL;
}

/* One LSH layer's decode attention for every (row, head): the windows' positions from the index (the
 * main order in the pool rows of the row's blocks, the recent order per slot, the counts after the step's
 * insert), then attend_slots. Returns as window_attend does. */
static LshJob lsh_job(int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before,
                      int64_t after, int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
                      const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
                      const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
                      const void *items, int64_t items_len, int64_t item_bytes, int64_t shift, int64_t recent_offset,
                      const int64_t *block_table, int64_t table_width, int64_t block_size, int64_t skip_slot,
                      float self_mask, float mask, float *out, int64_t begin, int64_t end) {
    return (LshJob){heads, rounds, buckets, chunk, before, after, dim, recent_size, (int)kind, q, norms, keys, values,
                    pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len, item_bytes,
                    shift, recent_offset, block_table, table_width, block_size, skip_slot, self_mask, mask, out, begin,
                    end, 1};
}

int lsh_attend(int64_t rows, int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before,
               int64_t after, int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
               const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
               const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
               const void *items, int64_t items_len, int64_t item_bytes,
               int64_t shift, int64_t recent_offset, const int64_t *block_table, int64_t table_width,
               int64_t block_size, int64_t skip_slot, float self_mask, float mask, float *out, int64_t threads) {
    if (!kind_ok(kind)) return BAD_KIND;
    const int64_t items_n = rows * heads;
    threads = clamp_threads(threads, items_n);
    LshJob jobs[MAX_THREADS];
    for (int64_t k = 0; k < threads; k++)
        jobs[k] = lsh_job(heads, rounds, buckets, chunk, before, after, dim, recent_size, kind, q, keys, norms, values,
                          pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len,
                          item_bytes, shift, recent_offset, block_table, table_width, block_size, skip_slot,
                          self_mask, mask, out, items_n * k / threads, items_n * (k + 1) / threads);
    run_parallel(run_lsh_job, (char *)jobs, sizeof(LshJob), threads);
    int status = 0;
    for (int64_t k = 0; k < threads; k++) status |= jobs[k].status;
    return status;
}

/* lsh_attend for the (row, head) items begin .. end-1 only, on the calling thread (step_layers.c). */
int lsh_attend_items(int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before, int64_t after,
                     int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
                     const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
                     const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
                     const void *items, int64_t items_len, int64_t item_bytes, int64_t shift, int64_t recent_offset,
                     const int64_t *block_table, int64_t table_width, int64_t block_size, int64_t skip_slot,
                     float self_mask, float mask, float *out, int64_t begin, int64_t end) {
    if (!kind_ok(kind)) return BAD_KIND;
    if (begin >= end) return 0;
    LshJob job = lsh_job(heads, rounds, buckets, chunk, before, after, dim, recent_size, kind, q, keys, norms, values,
                         pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len,
                         item_bytes, shift, recent_offset, block_table, table_width, block_size, skip_slot,
                         self_mask, mask, out, begin, end);
    run_lsh_job(&job);
    return job.status;
}

/* ---- merging a slot's recent order into its main order ------------------------------------------------ */

static inline int64_t load_item(const void *items, int64_t item_bytes, int64_t at) {
    return item_bytes == 2 ? ((const int16_t *)items)[at] : ((const int32_t *)items)[at];
}

static inline void store_item(void *items, int64_t item_bytes, int64_t at, int64_t v) {
    if (item_bytes == 2) ((int16_t *)items)[at] = (int16_t)v;
    else ((int32_t *)items)[at] = (int32_t)v;
}

/* For each of `columns` (head, round) columns of one slot: the main order (sorted index j at items[rows[j]
 * * columns + c], j < main_len) and the recent order (recent[c * recent_size + k], k < recent_len), both
 * sorted by (bucket, position) with bucket counts main_counts and recent_counts (columns, buckets), become
 * one main order of main_len + recent_len items: bucket by bucket, the bucket's main items then its recent
 * ones (every recent position is later than every main one). In place, from the last bucket down: an item
 * only ever moves to a later sorted index, so none is overwritten before it is read. rows holds the pool
 * rows of sorted indices 0 .. main_len + recent_len - 1. Returns 0, or BAD_INDEX when a row is outside the
 * pool or the counts do not add up to the lengths (the order is then undefined). */
int lsh_merge(int64_t columns, int64_t buckets, int64_t main_len, int64_t recent_len, int64_t recent_size,
              void *items, int64_t item_bytes, int64_t pool_rows, const int64_t *rows, const int32_t *main_counts,
              const int16_t *recent_counts, const void *recent) {
    const int64_t n = main_len + recent_len;
    if (recent_len > recent_size) return BAD_INDEX;
    for (int64_t j = 0; j < n; j++)
        if (rows[j] < 0 || rows[j] >= pool_rows) return BAD_INDEX;
    for (int64_t c = 0; c < columns; c++) {
        const int32_t *mc = main_counts + c * buckets;
        const int16_t *rc = recent_counts + c * buckets;
        int64_t total_main = 0, total_recent = 0;
        for (int64_t bb = 0; bb < buckets; bb++) {
            total_main += mc[bb];
            total_recent += rc[bb];
        }
        if (total_main != main_len || total_recent != recent_len) return BAD_INDEX;
        int64_t dst = n, src_main = main_len, src_recent = recent_len;
        for (int64_t bb = buckets - 1; bb >= 0; bb--) {
            for (int64_t k = 0; k < rc[bb]; k++) {
                dst--;
                src_recent--;
                store_item(items, item_bytes, rows[dst] * columns + c,
                           load_item(recent, item_bytes, c * recent_size + src_recent));
            }
            for (int64_t k = 0; k < mc[bb]; k++) {
                dst--;
                src_main--;
                if (dst != src_main) /* a bucket before which no recent item lands stays where it is */
                    store_item(items, item_bytes, rows[dst] * columns + c,
                               load_item(items, item_bytes, rows[src_main] * columns + c));
            }
            if (dst == src_main) break; /* every earlier item is already in place */
        }
    }
    return 0;
}

/* ---- a decode step's writes: the new keys and values, and each LSH index's recent order --------------- */

/* rows (B,) positions' pool rows; key and value (B, heads, dim) float32, stored as the pools' kind at the
 * (position, head) rows at * heads + h, `stride` elements apart; norms (pool, heads) or NULL: the float32
 * key's length-normalisation factor rsqrt(mean(k * k) + eps) / sqrt(dim), as model/decoding/cache.py key_norm
 * computes it. Returns 0, or BAD_INDEX for a row outside the pool. */
int decode_write(int64_t rows, int64_t heads, int64_t dim, int64_t kind, int64_t pool_rows, int64_t stride,
                 const int64_t *at, const float *key, const float *value, void *keys, void *values, float *norms,
                 float eps, float sqrt_dim) {
    if (!kind_ok(kind)) return BAD_KIND;
    for (int64_t b = 0; b < rows; b++)
        if (at[b] < 0 || at[b] >= pool_rows) return BAD_INDEX;
    const int64_t row = heads * dim;
    for (int64_t b = 0; b < rows; b++) {
        for (int64_t h = 0; h < heads; h++) {
            store_row(keys, (int)kind, at[b] * heads + h, stride, key + b * row + h * dim, dim);
            store_row(values, (int)kind, at[b] * heads + h, stride, value + b * row + h * dim, dim);
        }
        if (!norms) continue;
        for (int64_t h = 0; h < heads; h++) {
            const float *k = key + b * row + h * dim;
            norms[at[b] * heads + h] = (1.0f / sqrtf(dot(k, k, dim) / (float)dim + eps)) / sqrt_dim;
        }
    }
    return 0;
}

/* LSHIndex.append for the rows that append (meta[b, META_KEEPS_INDEX]): position t = meta[b, META_POSITION] goes after the recent items
 * of every bucket up to its own in the recent order of (slot meta[b, META_INDEX_SLOT], head, round); later items move one
 * place up and the bucket's count grows by one. Rows that do not append touch nothing. Returns 0, or
 * BAD_INDEX for a bucket outside the counts or a recent order already full (the caller merges first). */
int lsh_append(int64_t rows, int64_t heads, int64_t rounds, int64_t buckets, int64_t recent_size,
               const int64_t *meta, const int64_t *bucket_of, int16_t *recent_counts, void *items,
               int64_t item_bytes, int64_t shift, int64_t recent_offset) {
    for (int64_t b = 0; b < rows; b++) {
        const int64_t *m = meta + b * META_COLUMNS;
        if (!m[META_KEEPS_INDEX]) continue;
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t r = 0; r < rounds; r++) {
                const int64_t column = (m[META_INDEX_SLOT] * heads + h) * rounds + r;
                const int64_t bk = bucket_of[(b * heads + h) * rounds + r];
                if (bk < 0 || bk >= buckets) return BAD_INDEX;
                int16_t *rc = recent_counts + column * buckets;
                const int64_t at = sum_i16(rc, bk + 1), n = at + sum_i16(rc + bk + 1, buckets - bk - 1);
                if (n >= recent_size) return BAD_INDEX;
                const int64_t base = recent_offset + column * recent_size;
                for (int64_t j = n; j > at; j--)
                    store_item(items, item_bytes, base + j, load_item(items, item_bytes, base + j - 1));
                store_item(items, item_bytes, base + at, m[META_POSITION] + shift);
                rc[bk]++;
            }
        }
    }
    return 0;
}
