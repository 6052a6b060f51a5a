/* Cached decoding on the CPU: a step's attention windows, fused into one pass per (row, head)
 * (window_attend; lsh_attend.c first works out an LSH layer's window positions from its index and then
 * calls attend_slots here; the cache's writes are in decode_cache.c, the row reads and SIMD loops in
 * window_rows.h). model/kernels/bindings.py builds and calls them.
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
#include <pthread.h>
#include <stdlib.h>

#include "window_rows.h"

/* Which kinds this build reads and writes: bit k for kind k. */
int64_t window_kinds(void) { return kinds_built(); }

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

/* The attention of one (row, head) over its n = R * W window slots: flat pool indices, positions (or NULL:
 * no self mask) and padding flags; keys and values hold pool_len rows of dim elements of `kind`, `stride`
 * elements apart (the cache keeps a row's key and value side by side: model/decoding/cache.py); score holds n
 * floats, lse 2 * R, row dim. */
int attend_slots(const float *q, int64_t dim, int64_t rounds, int64_t width, const int64_t *flat,
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
    round_weights(score, R, W, dead, lse);
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
void run_parallel(void *(*fn)(void *), char *jobs, size_t job_size, int64_t threads) {
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
 * other cores (bench/decode/generate.py --batch-all-threads, batch 1 on two threads: 11.46 ms a step with a thread
 * per item, 5.25 ms with this rule, in two runs of that benchmark). */
#define ITEMS_PER_THREAD 32

int64_t clamp_threads(int64_t threads, int64_t items) {
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
