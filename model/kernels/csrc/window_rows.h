/* Pool rows for the decode kernels (window_attend.c, lsh_attend.c, decode_cache.c): the element kinds of the
 * key and value pools, a row read as float32 (widened) and written from it (rounded), prefetching, and the
 * dot products, exp and weighted sums of attend_slots at each vector width. All static inline: each CPU
 * variant's build (model/kernels/build.py) compiles them with its own -march. The last lines declare what
 * window_attend.c shares with lsh_attend.c (hidden: not exported from the library). */
#ifndef WINDOW_ROWS_H
#define WINDOW_ROWS_H

#include <math.h>
#include <stdint.h>
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

/* Which kinds this build reads and writes: bit k for kind k (window_kinds exports it). */
static inline int64_t kinds_built(void) {
#ifdef __F16C__
    return (1 << KIND_F32) | (1 << KIND_F16) | (1 << KIND_BF16);
#else
    return (1 << KIND_F32) | (1 << KIND_BF16);
#endif
}

static inline int kind_ok(int64_t kind) { return kind >= 0 && kind < 3 && ((kinds_built() >> kind) & 1); }

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

/* attend_slots' weights from its n = R * W scores, in place: per round r, top = max, e = exp(score - top),
 * total = sum e (lse[R + r]), lse[r] = top + log(total) (-inf for a dead round); then every slot's
 * e * (weight / total), weight = exp(lse[r] - logsumexp over the rounds of lse). extend_windows.c runs it on
 * each of its rows' scores, so its probabilities are attend_slots' bits. */
static inline void round_weights(float *score, int64_t R, int64_t W, const uint8_t *dead, float *lse) {
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
}

/* whether any round's log-sum-exp (attend_slots' lse[0..R)) came from a key that was not masked: a round of
 * masked slots only sums to about `mask` (model/lsh/successor.py no_key_threshold: half of it) */
static inline int saw_key(const float *lse, int64_t rounds, float mask) {
    for (int64_t r = 0; r < rounds; r++)
        if (lse[r] >= 0.5f * mask) return 1;
    return 0;
}

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

/* sums of bucket counts (the LSH index's main and recent counts) */
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

#define HIDDEN __attribute__((visibility("hidden")))

/* window_attend.c: one (row, head)'s attention over its window slots; run fn on `threads` jobs; the thread
 * count for `items` (row, head) items */
HIDDEN int attend_slots(const float *q, int64_t dim, int64_t rounds, int64_t width, const int64_t *flat,
                        const int64_t *pos, int64_t self, const uint8_t *absent, const uint8_t *dead,
                        const void *keys, const float *norms, const void *values, int kind, int64_t pool_len,
                        int64_t stride, float self_mask, float mask, float *out, float *score, float *lse,
                        float *row);
HIDDEN void run_parallel(void *(*fn)(void *), char *jobs, size_t job_size, int64_t threads);
HIDDEN int64_t clamp_threads(int64_t threads, int64_t items);

#endif
