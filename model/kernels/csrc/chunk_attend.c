/* A forward's (and a prefill's) chunked window attention on the CPU, masks worked out from positions:
 * what model/fused_attention.py's fused path computes with PyTorch's flash kernel and an additive bias it builds
 * first. model/kernels/bindings.py builds it with the other kernels; model/fused_attention.py calls it.
 *
 * For every block (b, h, n) of `c` queries and `w` window keys (rows of `d` float32 elements, the last
 * dimension contiguous; the other dimensions by strides, so overlapping window views need no copy):
 *   a key j is allowed for query i by the call's rule: k_pos[j] != q_pos[i] (RULE_OTHER: LSH attention,
 *   not causal), k_pos[j] < q_pos[i] (RULE_EARLIER: LSH, causal), k_pos[j] <= q_pos[i] (RULE_UP_TO: local
 *   attention, causal) or always (RULE_ANY: local, not causal); and when k_valid[j] (when given);
 *   score = q . k over the allowed keys; top = max, e = exp(score - top), total = sum e;
 *   out = sum e * v / total, lse = top + log(total).
 * A query with no allowed key gets what the additive-bias formulation gives it (every score then rounds to
 * `mask`): the mean of the window's values, lse = mask + log(w). The caller rebuilds such rows (a query
 * that may only see itself) as the reference computes them.
 *
 * Why: the bias the flash kernel needs is a float per (query, key), written and then read once per block;
 * at a prompt's 64-query chunks and 128-key windows the kernel's own blocking is overhead too.
 *
 * Every block is computed alone, in a fixed order, so the bits do not depend on the thread count or on how
 * the caller groups blocks into calls.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif
/* the AVX-512 paths where the CPU has them; CHUNK_PLAIN_LOOPS builds the plain loops anyway (the tests
 * compare the two) */
#if defined(__AVX512F__) && !defined(CHUNK_PLAIN_LOOPS)
#define CHUNK_AVX512 1
#include <immintrin.h>
#endif


/* strides in elements: [0] b, [1] h, [2] n, [3] the row (query or key) within the block */
typedef struct {
    int64_t s[4];
} Strides;

static inline int64_t at(const Strides *st, int64_t b, int64_t h, int64_t n, int64_t j) {
    return b * st->s[0] + h * st->s[1] + n * st->s[2] + j * st->s[3];
}

#define NOT_ALLOWED INT32_MIN /* a key position no query may see (invalid, or padding to LANES) */
#define LANES 16 /* keys per register-sized group: the loops below are written per lane so they vectorize */

/* Cephes' single-precision exp: x = n ln 2 + r (ln 2 in two parts), e^r by a degree-6 polynomial */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* exp(x) for x <= 0 (a score minus its row's maximum): Cephes' single-precision range reduction and
 * polynomial, about 1 ulp from expf on [-87, 0], 0 below (and for -inf); plain arithmetic, a select and bit
 * casts, so the compiler vectorizes a loop of it (a call to expf per key was most of a block's time). */
static inline float exp_nonpositive(float x) {
    const float keep = x >= -87.0f ? 1.0f : 0.0f;
    x = x >= -87.0f ? x : -87.0f;
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * keep;
}

#ifdef CHUNK_AVX512
/* dst (16 rows, ds apart) = the transpose of src (16 rows of 16 floats, ss apart) */
static inline void transpose16(const float *src, int64_t ss, float *dst, int64_t ds) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ss);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ds, r[i]);
}
#endif

/* Whether key j may be seen from position qp: kpos holds the keys' positions, NOT_ALLOWED for a key that is
 * invalid or padding. */
#define RULE_OTHER 0 /* model/kernels/bindings.py's CHUNK_RULES */
#define RULE_EARLIER 1
#define RULE_UP_TO 2
#define RULE_ANY 3

static inline int allowed_key(int32_t kp, int32_t qp, int64_t rule) {
    if (kp == NOT_ALLOWED) return 0;
    switch (rule) {
    case RULE_OTHER: return kp != qp;
    case RULE_EARLIER: return kp < qp;
    case RULE_UP_TO: return kp <= qp;
    default: return 1;
    }
}

#ifdef CHUNK_AVX512
/* The raw scores q . k of one query (into sa) or two (sa, sb) against every key of kt (d x wp): each
 * score's multiply-adds run over the dimensions in order, so a query's scores are the same bits alone or
 * paired. Two queries share each load of kt (a window's transposed keys fill L1 at head size 64); 8
 * independent accumulator chains hide each FMA's latency. */
static void raw_scores(const float *qa, const float *qb, const float *kt, int64_t wp, int64_t d, float *sa,
                       float *sb) {
    const __m512 zero = _mm512_setzero_ps();
    if (qb == NULL) {
        for (int64_t g0 = 0; g0 < wp; g0 += 8 * LANES) {
            const int ng = (int)((wp - g0) / LANES < 8 ? (wp - g0) / LANES : 8);
            __m512 acc[8] = {zero, zero, zero, zero, zero, zero, zero, zero};
            for (int64_t e = 0; e < d; e++) {
                const __m512 qe = _mm512_set1_ps(qa[e]);
                const float *row = kt + e * wp + g0;
                if (ng == 8) {
                    for (int u = 0; u < 8; u++) acc[u] = _mm512_fmadd_ps(qe, _mm512_loadu_ps(row + u * LANES), acc[u]);
                } else {
                    for (int u = 0; u < ng; u++) acc[u] = _mm512_fmadd_ps(qe, _mm512_loadu_ps(row + u * LANES), acc[u]);
                }
            }
            for (int u = 0; u < ng; u++) _mm512_storeu_ps(sa + g0 + u * LANES, acc[u]);
        }
        return;
    }
    for (int64_t g0 = 0; g0 < wp; g0 += 4 * LANES) {
        const int ng = (int)((wp - g0) / LANES < 4 ? (wp - g0) / LANES : 4);
        __m512 a[4] = {zero, zero, zero, zero}, c[4] = {zero, zero, zero, zero};
        for (int64_t e = 0; e < d; e++) {
            const __m512 ea = _mm512_set1_ps(qa[e]), eb = _mm512_set1_ps(qb[e]);
            const float *row = kt + e * wp + g0;
            for (int u = 0; u < ng; u++) {
                const __m512 kr = _mm512_loadu_ps(row + u * LANES);
                a[u] = _mm512_fmadd_ps(ea, kr, a[u]);
                c[u] = _mm512_fmadd_ps(eb, kr, c[u]);
            }
        }
        for (int u = 0; u < ng; u++) {
            _mm512_storeu_ps(sa + g0 + u * LANES, a[u]);
            _mm512_storeu_ps(sb + g0 + u * LANES, c[u]);
        }
    }
}
#endif

/* One query's softmax over a block's keys: kt the keys transposed (d x wp, wp a multiple of LANES), kpos
 * their positions (wp of them: the padding keys NOT_ALLOWED); with AVX-512, score holds the query's raw
 * scores already (raw_scores), else they are computed here. Writes out (d) and *lse and returns 1, or
 * returns 0 (nothing written) when the query may see no key. */
static int one_query(const float *qr, int32_t qp, int64_t rule, const float *kt, const int32_t *kpos, int64_t w,
                     int64_t wp, int64_t d, const float *v, const Strides *vs, int64_t b, int64_t h, int64_t n,
                     float *score, float *o, float *lse) {
    float top = -INFINITY, total = 0.0f;
#ifdef CHUNK_AVX512
    (void)qr, (void)kt; /* the raw scores are in score */
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    const __m512i vq = _mm512_set1_epi32(qp), none = _mm512_set1_epi32(NOT_ALLOWED);
    __m512 tops = neg_inf;
    __mmask16 any = 0;
    /* score holds the raw scores (raw_scores): masked here, in place */
    for (int64_t j0 = 0; j0 < wp; j0 += LANES) {
        const __m512i kp = _mm512_loadu_si512((const void *)(kpos + j0));
        const __mmask16 valid = _mm512_cmpneq_epi32_mask(kp, none);
        const __mmask16 ok = rule == RULE_EARLIER ? _mm512_mask_cmplt_epi32_mask(valid, kp, vq)
                             : rule == RULE_OTHER ? _mm512_mask_cmpneq_epi32_mask(valid, kp, vq)
                             : rule == RULE_UP_TO ? _mm512_mask_cmple_epi32_mask(valid, kp, vq)
                                                  : valid;
        any |= ok;
        const __m512 sc = _mm512_mask_blend_ps(ok, neg_inf, _mm512_loadu_ps(score + j0));
        _mm512_storeu_ps(score + j0, sc);
        tops = _mm512_max_ps(tops, sc);
    }
    if (!any) return 0;
    top = _mm512_reduce_max_ps(tops);
    const __m512 vtop = _mm512_set1_ps(top), low = _mm512_set1_ps(-87.0f);
    __m512 sums = zero;
    for (int64_t j0 = 0; j0 < wp; j0 += LANES) {
        __m512 x = _mm512_sub_ps(_mm512_loadu_ps(score + j0), vtop);
        const __mmask16 keep = _mm512_cmp_ps_mask(x, low, _CMP_GE_OQ); /* -inf (not allowed) and below: 0 */
        x = _mm512_max_ps(x, low);
        const __m512 nn = _mm512_roundscale_ps(
            _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(EXP_LN2_HI), x);
        r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(EXP_LN2_LO), r);
        __m512 p = _mm512_set1_ps(EXP_P0);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
        p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
        const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nn), _mm512_set1_epi32(127)), 23);
        const __m512 e = _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
        _mm512_storeu_ps(score + j0, e);
        sums = _mm512_add_ps(sums, e);
    }
    total = _mm512_reduce_add_ps(sums);
    if (d <= 4 * LANES && d % LANES == 0) { /* the output in registers; a key not allowed has e = 0 */
        const int64_t parts = d / LANES;
        /* 4 keys at a time into 4 sets of accumulators (independent chains), summed in a fixed order */
        __m512 acc[4][4];
        for (int u = 0; u < 4; u++)
            for (int r4 = 0; r4 < 4; r4++) acc[u][r4] = zero;
        int64_t j = 0;
        for (; j + 4 <= w; j += 4)
            for (int r4 = 0; r4 < 4; r4++) {
                const __m512 pj = _mm512_set1_ps(score[j + r4]);
                const float *vr = v + at(vs, b, h, n, j + r4);
                for (int64_t u = 0; u < parts; u++)
                    acc[u][r4] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + u * LANES), acc[u][r4]);
            }
        for (; j < w; j++) {
            const __m512 pj = _mm512_set1_ps(score[j]);
            const float *vr = v + at(vs, b, h, n, j);
            for (int64_t u = 0; u < parts; u++) acc[u][0] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + u * LANES), acc[u][0]);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        for (int64_t u = 0; u < parts; u++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[u][0], acc[u][1]), _mm512_add_ps(acc[u][2], acc[u][3]));
            _mm512_storeu_ps(o + u * LANES, _mm512_mul_ps(sum, inv));
        }
        *lse = top + logf(total);
        return 1;
    }
#else
    int any = 0;
    for (int64_t j = 0; j < wp; j++) {
        float acc = 0.0f;
        for (int64_t e = 0; e < d; e++) acc += qr[e] * kt[e * wp + j];
        const int ok = allowed_key(kpos[j], qp, rule);
        any |= ok;
        score[j] = ok ? acc : -INFINITY;
        top = score[j] > top ? score[j] : top;
    }
    if (!any) return 0;
    for (int64_t j = 0; j < wp; j++) {
        score[j] = exp_nonpositive(score[j] - top);
        total += score[j];
    }
#endif
    for (int64_t e = 0; e < d; e++) o[e] = 0.0f;
    for (int64_t j = 0; j < w; j++) {
        if (score[j] == 0.0f) continue; /* adds exactly nothing */
        const float p = score[j];
        const float *vr = v + at(vs, b, h, n, j);
        for (int64_t e = 0; e < d; e++) o[e] += p * vr[e];
    }
    const float inv = 1.0f / total;
    for (int64_t e = 0; e < d; e++) o[e] *= inv;
    *lse = top + logf(total);
    return 1;
}

static void block(int64_t b, int64_t h, int64_t n, int64_t c, int64_t w, int64_t d, const float *q,
                  const Strides *qs, const float *k, const Strides *ks, const float *v, const Strides *vs,
                  const int64_t *q_pos, const Strides *qps, const int64_t *k_pos, const Strides *kps,
                  const uint8_t *k_valid, const Strides *kvs, int64_t rule, float mask, float *out,
                  const Strides *os, float *lse, const Strides *ls, float *kt, float *score, int32_t *kpos) {
    const int64_t wp = (w + LANES - 1) / LANES * LANES;
    /* the window's keys transposed (d x wp), so a query's scores are one pass over keys per dimension */
    const float *k0 = k + at(ks, b, h, n, 0);
    const int64_t row = ks->s[3];
#ifdef CHUNK_AVX512
    if (w % LANES == 0 && d % LANES == 0) {
        /* 16 x 16 tiles in registers: a store per element 4*wp bytes apart, or a gather of 16 keys' element,
         * was most of a block's time */
        for (int64_t j0 = 0; j0 < w; j0 += LANES)
            for (int64_t e0 = 0; e0 < d; e0 += LANES) transpose16(k0 + j0 * row + e0, row, kt + e0 * wp + j0, wp);
    } else
#endif
        for (int64_t e = 0; e < d; e++) {
            float *dst = kt + e * wp;
            for (int64_t j = 0; j < w; j++) dst[j] = k0[j * row + e];
            for (int64_t j = w; j < wp; j++) dst[j] = 0.0f;
        }
    /* the keys' positions, shared by the block's queries (int32: the contract is positions below 2**31) */
    for (int64_t j = 0; j < wp; j++) {
        const int valid = j < w && (k_valid == NULL || k_valid[at(kvs, b, h, n, j)]);
        kpos[j] = valid ? (int32_t)k_pos[at(kps, b, h, n, j)] : NOT_ALLOWED;
    }
#ifdef CHUNK_AVX512
    float *score_b = score + wp;
#endif
    for (int64_t i = 0; i < c; i++) {
#ifdef CHUNK_AVX512
        if (i % 2 == 0) /* this query's raw scores and, when there is one, the next query's */
            raw_scores(q + at(qs, b, h, n, i), i + 1 < c ? q + at(qs, b, h, n, i + 1) : NULL, kt, wp, d, score,
                       score_b);
        float *mine = i % 2 == 0 ? score : score_b;
#else
        float *mine = score;
#endif
        float *o = out + at(os, b, h, n, i);
        float *l = lse + at(ls, b, h, n, i);
        const int32_t qp = (int32_t)q_pos[at(qps, b, h, n, i)];
        if (one_query(q + at(qs, b, h, n, i), qp, rule, kt, kpos, w, wp, d, v, vs, b, h, n, mine, o, l)) continue;
        for (int64_t e = 0; e < d; e++) o[e] = 0.0f;
        for (int64_t j = 0; j < w; j++) {
            const float *vr = v + at(vs, b, h, n, j);
            for (int64_t e = 0; e < d; e++) o[e] += vr[e];
        }
        for (int64_t e = 0; e < d; e++) o[e] /= (float)w;
        *l = mask + logf((float)w);
    }
}

/* Every (b, h, n) block of a (B, H, N) grid; strides as Strides' (4 per tensor, k_valid's ignored when it
 * is NULL). Returns 0, or NO_MEMORY. */
int chunk_attend(int64_t nb, int64_t nh, int64_t nn, int64_t c, int64_t w, int64_t d, const float *q,
                 const int64_t *q_strides, const float *k, const int64_t *k_strides, const float *v,
                 const int64_t *v_strides, const int64_t *q_pos, const int64_t *q_pos_strides, const int64_t *k_pos,
                 const int64_t *k_pos_strides, const uint8_t *k_valid, const int64_t *k_valid_strides,
                 int64_t rule, float mask, float *out, const int64_t *out_strides, float *lse,
                 const int64_t *lse_strides, int64_t threads) {
    Strides qs, ks, vs, qps, kps, kvs, os, ls;
    for (int a = 0; a < 4; a++) {
        qs.s[a] = q_strides[a], ks.s[a] = k_strides[a], vs.s[a] = v_strides[a];
        qps.s[a] = q_pos_strides[a], kps.s[a] = k_pos_strides[a], os.s[a] = out_strides[a];
        ls.s[a] = lse_strides[a], kvs.s[a] = k_valid != NULL ? k_valid_strides[a] : 0;
    }
    const int64_t blocks = nb * nh * nn;
    int status = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        const int64_t wp = (w + LANES - 1) / LANES * LANES;
        /* the keys transposed, then two queries' scores */
        float *kt = malloc(sizeof(float) * (size_t)(d * wp + 2 * wp));
        int32_t *kpos = malloc(sizeof(int32_t) * (size_t)wp);
        if (kt == NULL || kpos == NULL) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
        /* every thread reaches the loop (a worksharing loop must be met by all); one without buffers skips
         * its blocks, and the status tells the caller the result is incomplete */
#pragma omp for schedule(static)
        for (int64_t x = 0; x < blocks; x++) {
            if (kt == NULL || kpos == NULL) continue;
            const int64_t b = x / (nh * nn), h = (x / nn) % nh, n = x % nn;
            block(b, h, n, c, w, d, q, &qs, k, &ks, v, &vs, q_pos, &qps, k_pos, &kps, k_valid, &kvs, rule, mask,
                  out, &os, lse, &ls, kt, kt + d * wp, kpos);
        }
        free(kt);
        free(kpos);
    }
    return status;
}
