/* An extend's writes into an LSH layer (extend_layers.c): every row's merge when due, key/value write and insert
 * into the recent order, as a decode step at its position makes them, for the heads a thread owns.
 *
 * lsh_store_rows writes every row before any attends (extend_windows.c reads windows from the final state;
 * the last layer attends its last row only, once all its rows are in). So the main order is read by no row in
 * between, and its merges are put off: at each merge a step makes (the same rows: the recent order full), the
 * recent items are set aside and the recent counts cleared, as a merge leaves them, the main counts and items
 * untouched; after the last row, one merge of everything set aside (sorted by bucket, then position) into the
 * main order gives the items and counts the merges one by one give: the main order is the positions before
 * its length sorted by (bucket, position), however it was merged. The recent arrays see the same inserts and
 * clears as the steps', so their items (stale ones past the count included) are the steps'. One merge moves
 * the main items once, where a merge every recent_size rows moved them rows / recent_size times. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "step_kernels.h"

/* Merges columns [c0, c1) of layer L's index of `slot` (the heads a thread owns) when its recent order is full at
 * position t (as model/decoding/index_upkeep.py maintain_indexes merges before a step): the items through
 * lsh_merge_columns, then those columns' counts (main += recent; recent = 0, LSHIndex._merge_counts). `len`:
 * the main order's length (each thread keeps its own copy: every thread merges at the same rows). */
static int merge_if_full(const StepLayer *L, int64_t slot, int64_t t, int64_t c0, int64_t c1, int64_t *len,
                         const int64_t *table, int64_t table_width, int64_t block_size) {
    const int64_t recent_len = t - *len;
    if (recent_len < L->recent_size) return 0;
    const int64_t columns = L->heads * L->rounds, per_slot = columns * L->buckets;
    int32_t *mc = (int32_t *)(intptr_t)L->main_counts + slot * per_slot; /* the index's own tensor */
    int16_t *rc = L->recent_counts + slot * per_slot;
    const void *recent = (const char *)L->items + (L->recent_offset + slot * columns * L->recent_size) * L->item_bytes;
    const int st = lsh_merge_columns(columns, c0, c1, L->buckets, *len, recent_len, L->recent_size, L->items,
                                     L->item_bytes, L->recent_offset / columns, table + slot * table_width,
                                     block_size, mc, rc, recent);
    if (st) return st;
    for (int64_t j = c0 * L->buckets; j < c1 * L->buckets; j++) {
        mc[j] += rc[j];
        rc[j] = 0;
    }
    *len = t;
    return 0;
}

/* The items set aside by put-off merges, per column of [c0, c1): (bucket, stored item), in the order set aside */
typedef struct {
    int64_t c0, c1, cap, *n;
    int32_t *bucket, *item;
    int32_t *fen; /* per column, a Fenwick tree (buckets + 1) over its recent counts: lsh_append's insert place */
    int64_t *held; /* per column, its recent order's item count */
} Aside;

static inline int64_t fen_sum(const int32_t *f, int64_t k) {
    int64_t s = 0;
    for (; k > 0; k -= k & -k) s += f[k];
    return s;
}

/* lsh_append of position t into column c's recent order (bucket bk), the items before it found through the
 * column's Fenwick tree instead of a sum over the buckets: the same items and counts */
static int insert_recent(const StepLayer *L, int64_t slot, int64_t c, int64_t bk, int64_t t, Aside *a) {
    const int64_t NB = L->buckets, column = slot * L->heads * L->rounds + c, k = c - a->c0;
    if (bk < 0 || bk >= NB) return BAD_INDEX;
    int32_t *f = a->fen + k * (NB + 1);
    const int64_t at = fen_sum(f, bk + 1), n = a->held[k];
    if (n >= L->recent_size) return BAD_INDEX;
    char *base = (char *)L->items + (L->recent_offset + column * L->recent_size) * L->item_bytes;
    memmove(base + (at + 1) * L->item_bytes, base + at * L->item_bytes, (size_t)((n - at) * L->item_bytes));
    if (L->item_bytes == 2) ((int16_t *)(void *)base)[at] = (int16_t)(t + L->shift);
    else ((int32_t *)(void *)base)[at] = (int32_t)(t + L->shift);
    L->recent_counts[column * NB + bk]++;
    for (int64_t x = bk + 1; x <= NB; x += x & -x) f[x]++;
    a->held[k] = n + 1;
    return 0;
}

static inline int64_t item_at(const StepLayer *L, int64_t at) {
    return L->item_bytes == 2 ? ((const int16_t *)L->items)[at] : ((const int32_t *)L->items)[at];
}

/* merge_if_full, put off: the recent items of columns [c0, c1) set aside, the recent counts cleared */
static int set_aside(const StepLayer *L, int64_t slot, int64_t t, int64_t *len, Aside *a) {
    const int64_t recent_len = t - *len;
    if (recent_len < L->recent_size) return 0;
    const int64_t columns = L->heads * L->rounds, NB = L->buckets;
    for (int64_t c = a->c0; c < a->c1; c++) {
        int16_t *rc = L->recent_counts + (slot * columns + c) * NB;
        const int64_t base = L->recent_offset + (slot * columns + c) * L->recent_size;
        int64_t *n = a->n + (c - a->c0), k = 0;
        for (int64_t bb = 0; bb < NB; bb++) {
            if (*n + rc[bb] > a->cap || k + rc[bb] > recent_len) return BAD_INDEX;
            for (int64_t j = 0; j < rc[bb]; j++, (*n)++) {
                a->bucket[(c - a->c0) * a->cap + *n] = (int32_t)bb;
                a->item[(c - a->c0) * a->cap + *n] = (int32_t)item_at(L, base + k++);
            }
            rc[bb] = 0;
        }
        if (k != recent_len) return BAD_INDEX;
        memset(a->fen + (c - a->c0) * (NB + 1), 0, (size_t)(NB + 1) * sizeof(int32_t));
        a->held[c - a->c0] = 0;
    }
    *len = t;
    return 0;
}

/* The one merge of everything set aside, main_len the main order's length before it: per column, the items
 * sorted by bucket (stably: set aside in position order), merged by lsh_merge_columns as a recent order of
 * that many items, then the main counts. */
static int merge_aside(const StepLayer *L, int64_t slot, int64_t main_len, const Aside *a, const int64_t *table,
                       int64_t table_width, int64_t block_size) {
    const int64_t columns = L->heads * L->rounds, NB = L->buckets, cap = a->cap;
    int16_t *count = calloc((size_t)(columns * NB), sizeof(int16_t));
    char *sorted = malloc((size_t)(columns * cap * L->item_bytes) + 1);
    int64_t *at = malloc((size_t)(NB + 1) * sizeof(int64_t));
    int st = count && sorted && at ? 0 : NO_MEMORY;
    int32_t *mc = (int32_t *)(intptr_t)L->main_counts + slot * columns * NB;
    for (int64_t c = a->c0; c < a->c1 && !st; c++) {
        const int64_t n = a->n[c - a->c0];
        const int32_t *bk = a->bucket + (c - a->c0) * cap, *item = a->item + (c - a->c0) * cap;
        int16_t *cc = count + c * NB;
        if (!n) continue;
        for (int64_t j = 0; j < n; j++) cc[bk[j]]++;
        at[0] = 0;
        for (int64_t bb = 0; bb < NB; bb++) at[bb + 1] = at[bb] + cc[bb];
        for (int64_t j = 0; j < n; j++) {
            const int64_t to = c * cap + at[bk[j]]++;
            if (L->item_bytes == 2) ((int16_t *)sorted)[to] = (int16_t)item[j];
            else ((int32_t *)sorted)[to] = item[j];
        }
        st = lsh_merge_columns(columns, c, c + 1, NB, main_len, n, cap, L->items, L->item_bytes,
                               L->recent_offset / columns, table + slot * table_width, block_size, mc, count, sorted);
        for (int64_t bb = 0; bb < NB && !st; bb++) mc[c * NB + bb] += cc[bb];
    }
    free(count);
    free(sorted);
    free(at);
    return st;
}

/* Row b's cache writes in LSH layer L for heads [h0, h1), as a decode step at its position makes them: the merge
 * when due (set aside when `aside` is given), the key/value write (successor values into the row before), the
 * insert into the recent order. */
int lsh_store_row(const StepLayer *L, int64_t b, int64_t h0, int64_t h1, const int64_t *meta, const float *key,
                  const float *value, const int64_t *new_rows, const int64_t *prev_rows, const int64_t *bucket_of,
                  int64_t *len, const int64_t *table, int64_t table_width, int64_t block_size, void *aside) {
    const int64_t H = L->heads, R = L->rounds, att = H * L->dim, *mb = meta + b * META_COLUMNS;
    const float scale = sqrtf((float)L->dim);
    int st = aside ? set_aside(L, mb[META_SLOT], mb[META_POSITION], len, (Aside *)aside)
                   : merge_if_full(L, mb[META_SLOT], mb[META_POSITION], h0 * R, h1 * R, len, table, table_width,
                                   block_size);
    for (int64_t h = h0; h < h1 && !st; h++) {
        const int64_t at = new_rows[b] * H + h, before = prev_rows[b] * H + h;
        st = decode_write(1, 1, L->dim, L->kind, L->pool_rows * H, L->stride, &at, key + b * att + h * L->dim,
                          value + b * att + h * L->dim, L->keys, L->values, L->norms, KEY_NORM_EPS, scale,
                          h < L->successor, &before);
        if (aside) { /* the inserts through the columns' Fenwick trees */
            for (int64_t r = 0; r < R && !st; r++)
                st = insert_recent(L, mb[META_INDEX_SLOT], h * R + r, bucket_of[(b * H + h) * R + r], mb[META_POSITION],
                                   (Aside *)aside);
            continue;
        }
        /* the head's index columns as a one-head index: its (slot, head) pair as the slot */
        int64_t one[META_COLUMNS];
        memcpy(one, mb, sizeof one);
        one[META_INDEX_SLOT] = mb[META_INDEX_SLOT] * H + h;
        if (!st)
            st = lsh_append(1, 1, R, L->buckets, L->recent_size, one, bucket_of + (b * H + h) * R, L->recent_counts,
                            L->items, L->item_bytes, L->shift, L->recent_offset);
    }
    return st;
}

/* Every row's writes (rows 0 .. m-1 in order) for heads [h0, h1), the merges put off to one after the last row
 * (see the top of the file); row by row merges where the set-aside items would not fit 16-bit counts. */
int lsh_store_rows(const StepLayer *L, int64_t m, int64_t h0, int64_t h1, const int64_t *meta, const float *key,
                   const float *value, const int64_t *new_rows, const int64_t *prev_rows, const int64_t *bucket_of,
                   int64_t *len, const int64_t *table, int64_t table_width, int64_t block_size) {
    const int64_t R = L->rounds, cap = m + L->recent_size, cols = (h1 - h0) * R, main_len = *len;
    const int64_t slot = meta[META_SLOT];
    const int64_t NB = L->buckets;
    Aside a = {h0 * R, h1 * R, cap, NULL, NULL, NULL, NULL, NULL};
    int st = 0;
    if (cap < INT16_MAX) {
        a.n = calloc((size_t)cols, sizeof(int64_t));
        a.bucket = malloc((size_t)(cols * cap) * sizeof(int32_t));
        a.item = malloc((size_t)(cols * cap) * sizeof(int32_t));
        a.fen = calloc((size_t)(cols * (NB + 1)), sizeof(int32_t));
        a.held = calloc((size_t)cols, sizeof(int64_t));
    }
    const int defer = a.n && a.bucket && a.item && a.fen && a.held;
    for (int64_t k = 0; defer && k < cols; k++) { /* the trees of the recent counts as the call finds them */
        const int16_t *rc = L->recent_counts + (slot * L->heads * R + a.c0 + k) * NB;
        int32_t *f = a.fen + k * (NB + 1);
        for (int64_t bb = 0; bb < NB; bb++) {
            f[bb + 1] = rc[bb];
            a.held[k] += rc[bb];
        }
        for (int64_t x = 1; x <= NB; x++)
            if (x + (x & -x) <= NB) f[x + (x & -x)] += f[x];
    }
    for (int64_t b = 0; b < m && !st; b++)
        st = lsh_store_row(L, b, h0, h1, meta, key, value, new_rows, prev_rows, bucket_of, len, table, table_width,
                           block_size, defer ? &a : NULL);
    if (!st && defer) st = merge_aside(L, slot, main_len, &a, table, table_width, block_size);
    free(a.n);
    free(a.bucket);
    free(a.item);
    free(a.fen);
    free(a.held);
    return st;
}
