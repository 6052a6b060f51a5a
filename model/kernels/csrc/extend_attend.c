/* extend_windows.c's attention passes over a block of rows, one (head, round) at a time, rows in the order of
 * their windows: the scores (attend_slots' dots16 or dot_row, then its masks) and the values (attend_slots'
 * multiply-adds, slots in order, zero-probability slots left out). See extend_windows.c. */
#include "extend_windows.h"

/* out += p * (value row `at`, or the zero row), with the operations attend_slots sums a slot with */
static inline void add_slot(float *out, float p, const void *values, int kind, int64_t at, int64_t stride, int64_t D,
                            const float *zero, float *buf) {
#ifdef __AVX512F__
    if (kind == KIND_F32 && D % 16 == 0 && D <= 16 * OUT_REGS) {
        const float *v = zero ? zero : (const float *)values + at * stride;
        const __m512 pp = _mm512_set1_ps(p);
        for (int64_t c = 0; c < D / 16; c++)
            _mm512_storeu_ps(out + 16 * c, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + 16 * c), _mm512_loadu_ps(out + 16 * c)));
        return;
    }
#elif defined(AVX2_PATH)
    if (D % 8 == 0 && D <= 64) {
        const __m256 pp = _mm256_set1_ps(p);
        if (kind == KIND_F32) {
            const float *v = zero ? zero : (const float *)values + at * stride;
            for (int64_t c = 0; c < D / 8; c++)
                _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + 8 * c), _mm256_loadu_ps(out + 8 * c)));
        } else {
            const uint16_t *hv = zero ? (const uint16_t *)zero : (const uint16_t *)values + at * stride;
            for (int64_t c = 0; c < D / 8; c++)
                _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(pp, widen8(hv + 8 * c, kind), _mm256_loadu_ps(out + 8 * c)));
        }
        return;
    }
#endif
    if (zero) add_row(out, p, zero, kind, 0, stride, D, buf);
    else add_row(out, p, values, kind, at, stride, D, buf);
}

/* The scores of a block's rows (b0 + lr for lr < rows) in round r, rows in s->order's order: attend_slots'
 * dots16 blocks of 16 slots from the row's slot 0 (or dot_row), then the masks. */
void block_scores(const Walk *w, int64_t b0, int64_t rows, int64_t r,
                                                   const float *q, float self_mask, float mask, Scratch *s) {
    const StepLayer *L = w->L;
    const int64_t W = w->W, n = w->n, D = L->dim, att = w->H * D;
    const int kind = (int)L->kind;
    const int64_t row_bytes = D * kind_bytes(kind), stride_bytes = L->stride * kind_bytes(kind);
    (void)row_bytes, (void)stride_bytes; /* the AVX-512 loop's prefetches */
    for (int64_t k = 0; k < rows; k++) {
        const int64_t lr = s->order[r * rows + k];
        const float *qq = q + (b0 + lr) * att + w->h * D;
        if (k + 2 < rows) { /* a later row's query (rows in window order are far apart in q) */
            const float *next = q + (b0 + s->order[r * rows + k + 2]) * att + w->h * D;
            for (int64_t c = 0; c < D; c += 16) __builtin_prefetch(next + c, 0, 3);
        }
        const int32_t *flat = s->flat + lr * n + r * W;
        const uint8_t *flag = s->flag + lr * n + r * W;
        float *score = s->score + lr * n + r * W;
        int64_t i = 0;
#ifdef __AVX512F__
        if (lanes_fit(kind, D) && W % 16 == 0) {
            if (k + 1 < rows) /* the next row's first keys: most of its window is this row's, in cache */
                for (int j = 0; j < AHEAD; j++) {
                    const int64_t nx = s->order[r * rows + k + 1] * n + r * W + j;
                    if (!(s->flag[nx] & SLOT_ABSENT)) prefetch_row(L->keys, row_bytes, stride_bytes, s->flat[nx]);
                }
            for (; i < W; i += 16) {
                int64_t at[16];
                float dots[16];
                for (int j = 0; j < 16; j++) {
                    at[j] = flag[i + j] & SLOT_ABSENT ? 0 : flat[i + j];
                }
                if (kind == KIND_F32 && D == 32) /* the same function, its loops unrolled for 32 elements */
                    dots16(qq, L->keys, KIND_F32, L->stride, 32, at, dots);
                else
                    dots16(qq, L->keys, kind, L->stride, D, at, dots);
                /* the masks as the scalar loop below sets them (a padding slot wins over its own position), 16
                 * at a time; dots * norms is the same rounded product lane by lane */
                const __m512i fg = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(flag + i)));
                const __mmask16 absent = _mm512_test_epi32_mask(fg, _mm512_set1_epi32(SLOT_ABSENT));
                const __mmask16 self = _mm512_test_epi32_mask(fg, _mm512_set1_epi32(SLOT_SELF));
                __m512 v = _mm512_loadu_ps(dots);
                if (L->norms) {
                    v = _mm512_mul_ps(v, _mm512_i32gather_ps(_mm512_loadu_si512((const void *)(flat + i)), L->norms, 4));
                }
                v = _mm512_mask_mov_ps(v, self, _mm512_set1_ps(self_mask));
                v = _mm512_mask_mov_ps(v, absent, _mm512_set1_ps(mask));
                _mm512_storeu_ps(score + i, v);
            }
        }
#endif
        for (; i < W; i++) {
            float v;
            if (flag[i] & SLOT_ABSENT) {
                v = mask;
            } else if (flag[i] & SLOT_SELF) {
                v = self_mask;
            } else {
                v = dot_row(qq, L->keys, kind, flat[i], L->stride, D, s->row);
                if (L->norms) v *= L->norms[flat[i]];
            }
            score[i] = v;
        }
    }
}

#ifdef __AVX512F__
#define GROUP 4 /* rows whose sums of 2 x 16 floats run side by side: 8 chains of multiply-adds */
/* block_values for float32 rows of 32 elements, GROUP rows at a time: each row's sum in two registers, its
 * slots in order, a slot of probability 0 left out (a masked multiply-add keeps the sum as it is). */
static void values_f32_32(const Walk *w, int64_t b0, int64_t r, const int64_t *list, int64_t count, float *out,
                          const Scratch *s) {
    const StepLayer *L = w->L;
    const int64_t W = w->W, n = w->n, att = w->H * 32, stride = L->stride;
    const int successor = w->h < L->successor;
    const float *values = (const float *)L->values;
    for (int64_t k = 0; k < count; k += GROUP) {
        const int64_t g_n = count - k < GROUP ? count - k : GROUP;
        for (int64_t g = k + GROUP; g < count && g < k + 2 * GROUP; g++) { /* the next group's sums */
            __builtin_prefetch(out + (b0 + list[g]) * att + w->h * 32, 1, 3);
            __builtin_prefetch(out + (b0 + list[g]) * att + w->h * 32 + 16, 1, 3);
        }
        __m512 acc[GROUP][2];
        const int32_t *flat[GROUP];
        const uint8_t *flag[GROUP];
        const float *score[GROUP];
        float *o[GROUP];
        for (int g = 0; g < GROUP; g++) {
            const int64_t lr = list[k + (g < g_n ? g : 0)]; /* a short group repeats its first row, unstored */
            flat[g] = s->flat + lr * n + r * W;
            flag[g] = s->flag + lr * n + r * W;
            score[g] = s->score + lr * n + r * W;
            o[g] = out + (b0 + lr) * att + w->h * 32;
            acc[g][0] = _mm512_loadu_ps(o[g]);
            acc[g][1] = _mm512_loadu_ps(o[g] + 16);
        }
        for (int64_t i = 0; i < W; i++)
            for (int g = 0; g < GROUP; g++) {
                if (i + AHEAD < W) prefetch_row(values, 128, stride * 4, flat[g][i + AHEAD]);
                const float p = score[g][i];
                const __mmask16 live = p != 0.0f ? (__mmask16)0xffff : (__mmask16)0;
                const float *v = successor && (flag[g][i] & SLOT_SELF) ? s->zero : values + flat[g][i] * stride;
                const __m512 pp = _mm512_set1_ps(p);
                acc[g][0] = _mm512_mask3_fmadd_ps(pp, _mm512_loadu_ps(v), acc[g][0], live);
                acc[g][1] = _mm512_mask3_fmadd_ps(pp, _mm512_loadu_ps(v + 16), acc[g][1], live);
            }
        for (int g = 0; g < g_n; g++) {
            _mm512_storeu_ps(o[g], acc[g][0]);
            _mm512_storeu_ps(o[g] + 16, acc[g][1]);
        }
    }
}
#endif

/* The values of a block's rows in round r, rows in s->order's order, each row's sum in `out` */
void block_values(const Walk *w, int64_t b0, int64_t rows, int64_t r, float *out,
                                                   Scratch *s) {
    const StepLayer *L = w->L;
    const int64_t W = w->W, n = w->n, D = L->dim, att = w->H * D;
    const int kind = (int)L->kind, successor = w->h < L->successor;
    const int64_t row_bytes = D * kind_bytes(kind), stride_bytes = L->stride * kind_bytes(kind);
#ifdef __AVX512F__
    if (kind == KIND_F32 && D == 32) {
        int64_t *list = s->first; /* the rows not quiet, in order (first is free once the order is made) */
        int64_t count = 0;
        for (int64_t k = 0; k < rows; k++)
            if (!s->quiet[s->order[r * rows + k]]) list[count++] = s->order[r * rows + k];
        values_f32_32(w, b0, r, list, count, out, s);
        return;
    }
#endif
    for (int64_t k = 0; k < rows; k++) {
        const int64_t lr = s->order[r * rows + k];
        if (s->quiet[lr]) continue;
        float *o = out + (b0 + lr) * att + w->h * D;
        const int32_t *flat = s->flat + lr * n + r * W;
        const uint8_t *flag = s->flag + lr * n + r * W;
        const float *score = s->score + lr * n + r * W;
        for (int64_t i = 0; i < W; i++) {
            if (i + AHEAD < W && score[i + AHEAD] != 0.0f)
                prefetch_row(L->values, row_bytes, stride_bytes, flat[i + AHEAD]);
            const float p = score[i];
            if (p == 0.0f) continue;
            add_slot(o, p, L->values, kind, flat[i], L->stride, D,
                     successor && (flag[i] & SLOT_SELF) ? s->zero : NULL, s->row);
        }
    }
}

