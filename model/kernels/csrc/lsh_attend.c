/* Cached decoding on the CPU, LSH layers: an LSH layer's decode window for every (row, head), its positions
 * worked out from the layer's bucket index (the main order in the rows its order table gives, the recent
 * order per slot), then attended by window_attend.c's attend_slots. model/kernels/bindings.py and
 * step_layers.c call lsh_attend and lsh_attend_items. */
#include <stdlib.h>

#include "window_rows.h"

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
    const int64_t *order_table; /* where each slot's main order lives (model/decoding/cache.py order_table) */
    int64_t order_rows;         /* the main order's rows: recent_offset / (heads * rounds) */
    int64_t table_width, block_size;
    int64_t block_shift; /* log2(block_size) when a power of two, else -1 */
    int64_t skip_slot; /* rows on this slot (the scratch slot: padding) are not computed */
    float self_mask, mask;
    int64_t successor; /* heads 0..successor-1: successor-value heads (model/lsh/successor.py) */
    float *out;
    int64_t begin, end;
    int status;
} LshJob;

/* where a slot's position's block is in the block table, or -1 outside its row (for the prefetch below) */
static inline int64_t table_at(const LshJob *job, int64_t slot, int64_t position) {
    if (position < 0 || position >= job->table_width * job->block_size) return -1;
    const int64_t block = job->block_shift >= 0 ? position >> job->block_shift : position / job->block_size;
    return slot * job->table_width + block;
}

/* the pool row of a slot's position, or -1 outside its block table or the pools (step_kernels.h) */
static inline int64_t pool_row(const LshJob *job, int64_t slot, int64_t position) {
    return block_pool_row_shift(job->block_table, job->table_width, job->block_size, job->block_shift, slot, position,
                                job->pool_rows);
}

/* the items row of sorted index j of a slot's main order (through its order table row, which has the block
 * table's width and block size), or -1 outside the table or the order's rows */
static inline int64_t order_row(const LshJob *job, int64_t slot, int64_t j) {
    return block_pool_row_shift(job->order_table, job->table_width, job->block_size, job->block_shift, slot, j,
                                job->order_rows);
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
                    const int64_t row = order_row(job, slot, j);
                    if (row < 0) return BAD_INDEX;
                    at = row * (H * R) + h * R + r2;
                } else {
                    int64_t q = p - mend;
                    q = q < 0 ? 0 : (q >= job->recent_size ? job->recent_size - 1 : q);
                    at = job->recent_offset + (row_base + r2) * job->recent_size + q;
                }
                if (at < 0 || at >= job->items_len) return BAD_INDEX;
                __builtin_prefetch((const char *)job->items + at * job->item_bytes, 0, LOCALITY);
                absent[i] = 0;
                pos[i] = at; /* the item's place for now: its position once every slot's read is under way */
            }
        }
    }
    /* The slots' positions in stages, each stage's reads prefetched by the one before: a slot's key row is
     * at the end of a chain of dependent reads (its item, then its position's block), and one slot chased
     * at a time waited on each link in turn; after a long prompt the items, the block table and the pools
     * are larger than the caches (at 500K positions of crime-and-punishment's configuration: 4 MB of items
     * per layer, a 512 KB block table row, 0.5 GB of keys and values per layer). */
    const int64_t n = R * W;
    for (int64_t i = 0; i < n; i++) {
        if (absent[i]) continue;
        pos[i] = read_item(job, pos[i]);
        const int64_t at = table_at(job, slot, pos[i]);
        if (at < 0) return BAD_INDEX;
        __builtin_prefetch(job->block_table + at, 0, LOCALITY);
    }
    for (int64_t i = 0; i < n; i++) {
        if (absent[i]) continue;
        const int64_t row = pool_row(job, slot, pos[i]);
        if (row < 0) return BAD_INDEX;
        flat[i] = row * H + h;
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
        /* a successor-value head never attends its own position (its value slot is the next position's) */
        const int successor = h < job->successor;
        if (!job->status)
            job->status = attend_slots(job->q + item * job->dim, job->dim, R, W, flat, pos, job->meta[b * META_COLUMNS + META_POSITION],
                                       absent, dead, job->keys, job->norms, job->values, job->kind,
                                       job->pool_rows * job->heads, job->stride,
                                       successor ? job->mask : job->self_mask, job->mask, out, score, lse, row);
        if (!job->status && successor && !saw_key(lse, R, job->mask))
            memset(out, 0, (size_t)job->dim * sizeof(float)); /* nothing but itself to attend: exactly 0 */
    }
    free(buffer);
    return NULL;
}

/* One LSH layer's decode attention for every (row, head): the windows' positions from the index (the
 * main order in the items rows of the row's order table row, the recent order per slot, the counts after the step's
 * insert), then attend_slots. Returns as window_attend does. */
static LshJob lsh_job(int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before,
                      int64_t after, int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
                      const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
                      const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
                      const void *items, int64_t items_len, int64_t item_bytes, int64_t shift, int64_t recent_offset,
                      const int64_t *block_table, const int64_t *order_table, int64_t table_width,
                      int64_t block_size, int64_t skip_slot, float self_mask, float mask, int64_t successor, float *out,
                      int64_t begin, int64_t end) {
    int64_t block_shift = -1;
    if (block_size > 0 && !(block_size & (block_size - 1)))
        for (block_shift = 0; (INT64_C(1) << block_shift) < block_size; block_shift++) {
        }
    return (LshJob){heads, rounds, buckets, chunk, before, after, dim, recent_size, (int)kind, q, norms, keys, values,
                    pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len, item_bytes,
                    shift, recent_offset, block_table, order_table,
                    heads * rounds > 0 ? recent_offset / (heads * rounds) : 0, table_width, block_size, block_shift,
                    skip_slot, self_mask, mask, successor, out, begin, end, 1};
}

int lsh_attend(int64_t rows, int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before,
               int64_t after, int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
               const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
               const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
               const void *items, int64_t items_len, int64_t item_bytes,
               int64_t shift, int64_t recent_offset, const int64_t *block_table, const int64_t *order_table,
               int64_t table_width, int64_t block_size, int64_t skip_slot, float self_mask, float mask, int64_t successor, float *out,
               int64_t threads) {
    if (!kind_ok(kind)) return BAD_KIND;
    const int64_t items_n = rows * heads;
    threads = clamp_threads(threads, items_n);
    LshJob jobs[MAX_THREADS];
    for (int64_t k = 0; k < threads; k++)
        jobs[k] = lsh_job(heads, rounds, buckets, chunk, before, after, dim, recent_size, kind, q, keys, norms, values,
                          pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len,
                          item_bytes, shift, recent_offset, block_table, order_table, table_width, block_size, skip_slot,
                          self_mask, mask, successor, out, items_n * k / threads, items_n * (k + 1) / threads);
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
                     const int64_t *block_table, const int64_t *order_table, int64_t table_width,
                     int64_t block_size, int64_t skip_slot, float self_mask, float mask, int64_t successor, float *out,
                     int64_t begin, int64_t end) {
    if (!kind_ok(kind)) return BAD_KIND;
    if (begin >= end) return 0;
    LshJob job = lsh_job(heads, rounds, buckets, chunk, before, after, dim, recent_size, kind, q, keys, norms, values,
                         pool_rows, stride, meta, bucket_of, main_counts, recent_counts, items, items_len,
                         item_bytes, shift, recent_offset, block_table, order_table, table_width, block_size, skip_slot,
                         self_mask, mask, successor, out, begin, end);
    run_lsh_job(&job);
    return job.status;
}
