/* An extend's local-layer attention (extend_layers.c), for the heads a thread owns: the bits window_attend_items
 * gives each row right after its own ring write, with the rows' windows read from one contiguous copy.
 *
 * A row at position t attends positions start .. start + w - 1 (step_local_window: start = (t / chunk - before)
 * * chunk, or 0 for a dense row), those past t absent (their slot reads the ring row of position 0, which holds
 * the latest position p' = t - t % ring written to it). Every position the rows read is either before the
 * extend's first position (in the ring as the extend finds it: the ring holds the last `ring` positions) or one
 * of its rows (its key and value as the ring stores them: a float32 pool stores the row's bits). So, per head,
 * the positions from the first window's start to the last row are copied side by side, every row's window is
 * attended from the copy, and only then are the rows written into the ring in order (which leaves the ring the
 * steps leave). The attention is attend_slots' for one round: dots16 scores, the mask, round_weights, then each
 * row's sum of p * value over its slots in order in two registers, GROUP rows side by side (a slot of
 * probability 0 left out by a masked multiply-add). Only the AVX-512 build with float32 pools, heads of 32
 * elements and a ring of one window runs it; elsewhere extend_local_heads declines and the rows go one by one. */
#include <stdlib.h>

#include "window_rows.h"

#define GROUP 4

/* Returns -1 (nothing done: the caller attends row by row) where this does not apply, else 0 or a status. */
int extend_local_heads(const StepLayer *L, const float *fl, int64_t m, int64_t first, int64_t h0, int64_t h1,
                       const int64_t *meta, const float *q, const float *key, const float *value, float *out,
                       void **keep, size_t *kept) {
#ifdef __AVX512F__
    const int64_t H = L->heads, D = L->dim, att = H * D, C = L->chunk, w = (L->before + 1) * C;
    const int64_t slot = meta[META_SLOT], t0 = meta[META_POSITION], last = t0 + m - 1;
    if (L->kind != KIND_F32 || D != 32 || L->ring != w || w % 16 || first >= m) return -1;
    int64_t lo = last;
    for (int64_t b = first; b < m; b++) {
        const int64_t t = meta[b * META_COLUMNS + META_POSITION];
        int64_t start = meta[b * META_COLUMNS + META_LOCAL_DENSE] ? 0 : (t / C - L->before) * C;
        if (start < 0) start = 0;
        if (start < lo) lo = start;
    }
    if (lo < t0 - L->ring || ring_row(L, slot, last) < 0) return -1; /* not all in the ring (cannot happen) */
    const int64_t P = last - lo + 1;
    const size_t bytes = (size_t)(2 * P * D + GROUP * w + 2 + 16) * sizeof(float);
    if (*kept < bytes) {
        free(*keep);
        *kept = 0;
        if (!(*keep = malloc(bytes))) return NO_MEMORY;
        *kept = bytes;
    }
    float *pk = *keep, *pv = pk + P * D, *score = pv + P * D, *lse = score + GROUP * w;
    const float mask = fl[3];
    for (int64_t h = h0; h < h1; h++) {
        for (int64_t p = lo; p <= last; p++) { /* the positions' keys and values, side by side */
            const float *k, *v;
            if (p < t0) {
                const int64_t row = ring_row(L, slot, p) * H + h;
                k = (const float *)L->keys + row * L->stride;
                v = (const float *)L->values + row * L->stride;
            } else {
                k = key + (p - t0) * att + h * D;
                v = value + (p - t0) * att + h * D;
            }
            memcpy(pk + (p - lo) * D, k, (size_t)D * sizeof(float));
            memcpy(pv + (p - lo) * D, v, (size_t)D * sizeof(float));
        }
        for (int64_t b0 = first; b0 < m; b0 += GROUP) {
            const int64_t g_n = m - b0 < GROUP ? m - b0 : GROUP;
            int64_t start[GROUP], t[GROUP], gone[GROUP]; /* gone: the copy's index of position 0's ring row */
            for (int64_t g = 0; g < GROUP; g++) {
                const int64_t b = b0 + (g < g_n ? g : 0); /* a short group repeats its first row, unstored */
                t[g] = meta[b * META_COLUMNS + META_POSITION];
                start[g] = meta[b * META_COLUMNS + META_LOCAL_DENSE] ? 0 : (t[g] / C - L->before) * C;
                if (start[g] < 0) start[g] = 0;
                gone[g] = t[g] - t[g] % L->ring - lo;
                const float *qq = q + b * att + h * D;
                float *e = score + g * w;
                for (int64_t i = 0; i < w; i += 16) {
                    if (start[g] + i > t[g]) { /* 16 absent slots: their scores are the mask, whatever the dots */
                        for (int j = 0; j < 16; j++) e[i + j] = mask;
                        continue;
                    }
                    int64_t at[16];
                    for (int j = 0; j < 16; j++) at[j] = start[g] + i + j > t[g] ? 0 : start[g] + i + j - lo;
                    dots16(qq, pk, KIND_F32, D, D, at, e + i);
                    for (int j = 0; j < 16; j++)
                        if (start[g] + i + j > t[g]) e[i + j] = mask;
                }
                round_weights(e, 1, w, NULL, lse);
            }
            __m512 acc[GROUP][2];
            for (int g = 0; g < GROUP; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
            for (int64_t i = 0; i < w; i++)
                for (int g = 0; g < GROUP; g++) {
                    const float p = score[g * w + i];
                    const __mmask16 live = p != 0.0f ? (__mmask16)0xffff : (__mmask16)0;
                    const int64_t at = start[g] + i > t[g] ? gone[g] : start[g] + i - lo;
                    const __m512 pp = _mm512_set1_ps(p);
                    acc[g][0] = _mm512_mask3_fmadd_ps(pp, _mm512_loadu_ps(pv + at * D), acc[g][0], live);
                    acc[g][1] = _mm512_mask3_fmadd_ps(pp, _mm512_loadu_ps(pv + at * D + 16), acc[g][1], live);
                }
            for (int g = 0; g < g_n; g++) {
                _mm512_storeu_ps(out + (b0 + g) * att + h * D, acc[g][0]);
                _mm512_storeu_ps(out + (b0 + g) * att + h * D + 16, acc[g][1]);
            }
        }
    }
    /* the ring, row by row as the steps write it */
    const float scale = sqrtf((float)D);
    for (int64_t b = 0; b < m; b++) {
        const int64_t ring = ring_row(L, slot, t0 + b);
        for (int64_t h = h0; h < h1; h++) {
            const int64_t at = ring * H + h;
            const int st = decode_write(1, 1, D, L->kind, L->pool_rows * H, L->stride, &at, key + b * att + h * D,
                                        value + b * att + h * D, L->keys, L->values, NULL, KEY_NORM_EPS, scale, 0,
                                        NULL);
            if (st) return st;
        }
    }
    return 0;
#else
    (void)L, (void)fl, (void)m, (void)first, (void)h0, (void)h1, (void)meta, (void)q, (void)key, (void)value;
    (void)out, (void)keep, (void)kept;
    return -1;
#endif
}
