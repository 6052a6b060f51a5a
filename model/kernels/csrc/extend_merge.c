/* An extend's writes into an LSH layer (extend_layers.c): every row's merge when due, key/value write and insert
 * into the recent order, as a decode step at its position makes them, for the heads a thread owns.
 *
 * lsh_store_rows writes every row before any attends (extend_windows.c reads windows from the final state;
 * the last layer attends its last row only, once all its rows are in). So the main order is read by no row in
 * between, and its merges are put off: at each merge a step makes (the same rows: the recent order full), the
 * recent items are set aside and the recent counts cleared, as a merge leaves them, the main counts and items
 * untouched; after the last row, one merge of everything set aside (sorted by bucket, then position) into the
 * main order gives the items and counts the merges one by one give: the main order is the positions before
 * its length sorted by (bucket, position), however it was merged. One merge moves the main items once, where
 * a merge every recent_size rows moved them rows / recent_size times. Nor are the recent arrays kept sorted
 * insert by insert (lsh_append moves the later items up one place each time): each recent order is a list in
 * the order its items came, sorted by bucket when a merge takes it and at the end, and the arrays and counts
 * are then written as the inserts one by one leave them, stale items past the count included (Aside). */
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
                                     L->item_bytes, L->recent_offset / columns, L->order_table + slot * table_width,
                                     block_size, mc, rc, recent);
    if (st) return st;
    for (int64_t j = c0 * L->buckets; j < c1 * L->buckets; j++) {
        mc[j] += rc[j];
        rc[j] = 0;
    }
    *len = t;
    return 0;
}

/* The recent orders of columns [c0, c1) while the rows are written, and the items put-off merges set aside.
 * A recent order's items are kept as a list in the order they came (those the call found first: by bucket,
 * then position; then the rows', by position), sorted by bucket (stably: by bucket, then position) only when
 * a merge takes them and at the end, where lsh_append kept them sorted with every insert: its array after n
 * inserts holds the n items sorted, then, untouched, what it held before (after a merge: the items that merge
 * took, sorted), which is what finish_recent writes. */
typedef struct {
    int64_t c0, c1, cap, *n; /* set aside: per column n (bucket, stored item), cap a column */
    int32_t *bucket, *item;
    int32_t *cyc_b, *cyc_i;  /* per column, recent_size: its recent order's (bucket, stored item) in order */
    int64_t *held;           /* per column, their count */
    int32_t *full;           /* per column, recent_size: the items the last put-off merge took, sorted */
    int merged;              /* whether a put-off merge happened */
    int32_t *tally, *sb, *si; /* buckets + 1; recent_size twice: one order sorted */
} Aside;

static inline int64_t item_at(const StepLayer *L, int64_t at) {
    return L->item_bytes == 2 ? ((const int16_t *)L->items)[at] : ((const int32_t *)L->items)[at];
}

/* column k's recent items into a->sb, a->si by bucket (stably); a->tally[bb + 1] - a->tally[bb]: the counts */
static void sort_recent(const StepLayer *L, Aside *a, int64_t k) {
    const int64_t NB = L->buckets, rs = L->recent_size, n = a->held[k];
    const int32_t *cb = a->cyc_b + k * rs, *ci = a->cyc_i + k * rs;
    memset(a->tally, 0, (size_t)(NB + 1) * sizeof(int32_t));
    for (int64_t j = 0; j < n; j++) a->tally[cb[j] + 1]++;
    for (int64_t bb = 0; bb < NB; bb++) a->tally[bb + 1] += a->tally[bb];
    for (int64_t j = 0; j < n; j++) {
        const int32_t to = a->tally[cb[j]]++;
        a->sb[to] = cb[j];
        a->si[to] = ci[j];
    }
    for (int64_t bb = NB; bb > 0; bb--) a->tally[bb] = a->tally[bb - 1]; /* back to the starts */
    a->tally[0] = 0;
}

/* lsh_append of position t (bucket bk) into column c's recent order */
static int insert_recent(const StepLayer *L, int64_t c, int64_t bk, int64_t t, Aside *a) {
    const int64_t k = c - a->c0, rs = L->recent_size;
    if (bk < 0 || bk >= L->buckets || a->held[k] >= rs) return BAD_INDEX;
    a->cyc_b[k * rs + a->held[k]] = (int32_t)bk;
    a->cyc_i[k * rs + a->held[k]++] = (int32_t)(t + L->shift);
    return 0;
}

/* merge_if_full, put off: the recent items of columns [c0, c1) set aside (sorted), the recent orders emptied */
static int set_aside(const StepLayer *L, int64_t t, int64_t *len, Aside *a) {
    const int64_t recent_len = t - *len, rs = L->recent_size;
    if (recent_len < rs) return 0;
    for (int64_t k = 0; k < a->c1 - a->c0; k++) {
        if (a->held[k] != recent_len || a->n[k] + recent_len > a->cap) return BAD_INDEX;
        sort_recent(L, a, k);
        memcpy(a->bucket + k * a->cap + a->n[k], a->sb, (size_t)recent_len * sizeof(int32_t));
        memcpy(a->item + k * a->cap + a->n[k], a->si, (size_t)recent_len * sizeof(int32_t));
        memcpy(a->full + k * rs, a->si, (size_t)rs * sizeof(int32_t));
        a->n[k] += recent_len;
        a->held[k] = 0;
    }
    a->merged = 1;
    *len = t;
    return 0;
}

/* The recent arrays and counts of columns [c0, c1) as lsh_append leaves them (see Aside) */
static void finish_recent(const StepLayer *L, int64_t slot, Aside *a) {
    const int64_t NB = L->buckets, rs = L->recent_size, columns = L->heads * L->rounds;
    for (int64_t k = 0; k < a->c1 - a->c0; k++) {
        const int64_t column = slot * columns + a->c0 + k, base = L->recent_offset + column * rs, n = a->held[k];
        sort_recent(L, a, k);
        for (int64_t j = 0; j < rs; j++) {
            if (j >= n && !a->merged) break; /* past the items: as the call found it */
            const int32_t v = j < n ? a->si[j] : a->full[k * rs + j];
            if (L->item_bytes == 2) ((int16_t *)L->items)[base + j] = (int16_t)v;
            else ((int32_t *)L->items)[base + j] = v;
        }
        for (int64_t bb = 0; bb < NB; bb++)
            L->recent_counts[column * NB + bb] = (int16_t)((bb + 1 < NB ? a->tally[bb + 1] : n) - a->tally[bb]);
    }
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
                               L->recent_offset / columns, L->order_table + slot * table_width, block_size, mc, count, sorted);
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
    int st = aside ? set_aside(L, mb[META_POSITION], len, (Aside *)aside)
                   : merge_if_full(L, mb[META_SLOT], mb[META_POSITION], h0 * R, h1 * R, len, table, table_width,
                                   block_size);
    for (int64_t h = h0; h < h1 && !st; h++) {
        const int64_t at = new_rows[b] * H + h, before = prev_rows[b] * H + h;
        st = decode_write(1, 1, L->dim, L->kind, L->pool_rows * H, L->stride, &at, key + b * att + h * L->dim,
                          value + b * att + h * L->dim, L->keys, L->values, L->norms, KEY_NORM_EPS, scale,
                          h < L->successor, &before);
        if (aside) { /* the inserts through the columns' Fenwick trees */
            for (int64_t r = 0; r < R && !st; r++)
                st = insert_recent(L, h * R + r, bucket_of[(b * H + h) * R + r], mb[META_POSITION], (Aside *)aside);
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
    const int64_t NB = L->buckets, rs = L->recent_size, columns = L->heads * R;
    Aside a = {h0 * R, h1 * R, cap, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL};
    int st = 0;
    if (cap < INT16_MAX) {
        a.n = calloc((size_t)cols, sizeof(int64_t));
        a.bucket = malloc((size_t)(cols * cap) * sizeof(int32_t));
        a.item = malloc((size_t)(cols * cap) * sizeof(int32_t));
        a.cyc_b = malloc((size_t)(cols * rs) * sizeof(int32_t));
        a.cyc_i = malloc((size_t)(cols * rs) * sizeof(int32_t));
        a.held = calloc((size_t)cols, sizeof(int64_t));
        a.full = malloc((size_t)(cols * rs) * sizeof(int32_t));
        a.tally = malloc((size_t)(NB + 1 + 2 * rs) * sizeof(int32_t));
    }
    int defer = a.n && a.bucket && a.item && a.cyc_b && a.cyc_i && a.held && a.full && a.tally;
    if (defer) {
        a.sb = a.tally + NB + 1;
        a.si = a.sb + rs;
    }
    for (int64_t k = 0; defer && k < cols; k++) { /* the recent orders as the call finds them */
        const int64_t column = slot * columns + a.c0 + k, base = L->recent_offset + column * rs;
        const int16_t *rc = L->recent_counts + column * NB;
        for (int64_t bb = 0; bb < NB && defer; bb++)
            for (int64_t j = 0; j < rc[bb]; j++) {
                if (a.held[k] >= rs) {
                    defer = 0; /* counts past the order's size: row by row, lsh_append says what is wrong */
                    break;
                }
                a.cyc_b[k * rs + a.held[k]] = (int32_t)bb;
                a.cyc_i[k * rs + a.held[k]] = (int32_t)item_at(L, base + a.held[k]);
                a.held[k]++;
            }
    }
    for (int64_t b = 0; b < m && !st; b++)
        st = lsh_store_row(L, b, h0, h1, meta, key, value, new_rows, prev_rows, bucket_of, len, table, table_width,
                           block_size, defer ? &a : NULL);
    if (!st && defer) {
        finish_recent(L, slot, &a);
        st = merge_aside(L, slot, main_len, &a, table, table_width, block_size);
    }
    free(a.n);
    free(a.bucket);
    free(a.item);
    free(a.cyc_b);
    free(a.cyc_i);
    free(a.held);
    free(a.full);
    free(a.tally);
    return st;
}
