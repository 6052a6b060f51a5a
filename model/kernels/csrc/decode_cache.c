/* Cached decoding on the CPU, the cache's writes: a step's new keys and values into the pools (decode_write),
 * the insert of its positions into each LSH index's recent order (lsh_append) and the merge of a slot's recent
 * order into its main order (lsh_merge_blocks). model/kernels/bindings.py and step_layers.c call them. */
#include "window_rows.h"

/* ---- merging a slot's recent order into its main order ------------------------------------------------ */

static inline int64_t load_item(const void *items, int64_t item_bytes, int64_t at) {
    return item_bytes == 2 ? ((const int16_t *)items)[at] : ((const int32_t *)items)[at];
}

static inline void store_item(void *items, int64_t item_bytes, int64_t at, int64_t v) {
    if (item_bytes == 2) ((int16_t *)items)[at] = (int16_t)v;
    else ((int32_t *)items)[at] = (int32_t)v;
}

/* Where sorted index j of a slot's main order lives: the pool row of position j through the slot's block
 * table row `table` (blocks of block_size positions; block_shift its log2 when a power of two, else -1), so
 * the merge needs no array of the slot's n pool rows, which the caller would build (an O(n) gather) and the
 * merge would check (O(n) reads) at every merge. */
typedef struct {
    const int64_t *table;
    int64_t block_size, block_shift;
} RowMap;

static inline int64_t row_at(const RowMap *map, int64_t j) {
    if (map->block_shift >= 0)
        return (map->table[j >> map->block_shift] << map->block_shift) + (j & (map->block_size - 1));
    return map->table[j / map->block_size] * map->block_size + j % map->block_size;
}

/* whether every sorted index 0 .. n-1 maps to a pool row in [0, pool_rows): each block whole */
static int rows_ok(const RowMap *map, int64_t n, int64_t pool_rows) {
    for (int64_t k = 0; k < (n + map->block_size - 1) / map->block_size; k++)
        if (map->table[k] < 0 || map->table[k] > pool_rows / map->block_size - 1) return 0;
    return 1;
}

/* For columns c0 .. c1-1 of the `columns` (head, round) columns of one slot: the main order (sorted index j
 * at items[row j * columns + c], j < main_len, row j as `map` gives it) and the recent order (recent[c *
 * recent_size + k], k < recent_len), both sorted by (bucket, position) with bucket counts main_counts and recent_counts
 * (columns, buckets), become one main order of main_len + recent_len items: bucket by bucket, the bucket's
 * main items then its recent ones (every recent position is later than every main one). Main item j moves up
 * by the recent items of the buckets before its own. In place, in one pass over the sorted indices from the
 * last down for up to MERGE_GROUP columns at once: a row of the items holds every column's item of one sorted
 * index side by side, so a pass per column read each row once per column. Each column keeps its own bucket
 * cursor (the bucket its next main item is in, where that bucket's main items start, their move) and writes a
 * bucket's recent items once every main item after them has been read; an item only ever moves to a later
 * sorted index, so none is overwritten before it is read, and a column is done at the first bucket holding
 * recent items (the main items before it stay where they are). Returns 0, or BAD_INDEX when a row is outside
 * the pool or the counts do not add up to the lengths (the order is then undefined). */
#define MERGE_GROUP 16
static int merge_orders(int64_t columns, int64_t c0, int64_t c1, int64_t buckets, int64_t main_len,
                        int64_t recent_len, int64_t recent_size, void *items, int64_t item_bytes, int64_t pool_rows,
                        const RowMap *map, const int32_t *main_counts, const int16_t *recent_counts, const void *recent) {
    const int64_t n = main_len + recent_len;
    if (recent_len > recent_size || !rows_ok(map, n, pool_rows)) return BAD_INDEX;
    for (int64_t c = c0; c < c1; c++) {
        int64_t total_main = 0, total_recent = 0;
        for (int64_t bb = 0; bb < buckets; bb++) { /* a negative count would walk the cursor off the counts */
            if (main_counts[c * buckets + bb] < 0 || recent_counts[c * buckets + bb] < 0) return BAD_INDEX;
            total_main += main_counts[c * buckets + bb];
            total_recent += recent_counts[c * buckets + bb];
        }
        if (total_main != main_len || total_recent != recent_len) return BAD_INDEX;
    }
    if (!recent_len) return 0;
    for (int64_t g0 = c0; g0 < c1; g0 += MERGE_GROUP) {
        const int64_t g1 = c1 - g0 < MERGE_GROUP ? c1 : g0 + MERGE_GROUP;
        /* per column: bucket `bucket`'s main items start at `start` and move up by `up` (the recent items of the
         * buckets before it); above the last bucket at first, every recent item still to place */
        int64_t bucket[MERGE_GROUP], start[MERGE_GROUP], up[MERGE_GROUP], active = g1 - g0;
        for (int64_t x = 0; x < g1 - g0; x++) {
            bucket[x] = buckets;
            start[x] = main_len;
            up[x] = recent_len;
        }
        for (int64_t j = main_len - 1; active; j--) { /* j = -1: the buckets below every main item */
            const int64_t from = j >= 0 ? row_at(map, j) * columns : 0;
            for (int64_t c = g0; c < g1; c++) {
                const int64_t x = c - g0;
                if (!up[x]) continue;
                while (j < start[x] && up[x]) { /* into the bucket below: its recent items, after its main ones */
                    const int64_t bb = --bucket[x], rc = recent_counts[c * buckets + bb];
                    up[x] -= rc;
                    for (int64_t k = 0; k < rc; k++)
                        store_item(items, item_bytes, row_at(map, start[x] + up[x] + k) * columns + c,
                                   load_item(recent, item_bytes, c * recent_size + up[x] + k));
                    start[x] -= main_counts[c * buckets + bb];
                }
                if (!up[x]) active--;
                else store_item(items, item_bytes, row_at(map, j + up[x]) * columns + c,
                                load_item(items, item_bytes, from + c));
            }
        }
    }
    return 0;
}

/* merge_orders of columns c0 .. c1-1 (of `columns`) with the slot's pool rows read from its block table row
 * `table` (blocks of block_size positions): each column's merge reads and writes that column only, so threads
 * may merge disjoint column ranges at once (extend_layers.c, one range per thread's heads). */
int lsh_merge_columns(int64_t columns, int64_t c0, int64_t c1, int64_t buckets, int64_t main_len, int64_t recent_len,
                      int64_t recent_size, void *items, int64_t item_bytes, int64_t pool_rows, const int64_t *table,
                      int64_t block_size, const int32_t *main_counts, const int16_t *recent_counts, const void *recent) {
    if (block_size < 1 || c0 < 0 || c1 > columns) return BAD_INDEX;
    int64_t shift = -1;
    if (!(block_size & (block_size - 1)))
        for (shift = 0; (INT64_C(1) << shift) < block_size; shift++) {
        }
    const RowMap map = {table, block_size, shift};
    return merge_orders(columns, c0, c1, buckets, main_len, recent_len, recent_size, items, item_bytes, pool_rows,
                        &map, main_counts, recent_counts, recent);
}

/* lsh_merge_columns over every column */
int lsh_merge_blocks(int64_t columns, int64_t buckets, int64_t main_len, int64_t recent_len, int64_t recent_size,
                     void *items, int64_t item_bytes, int64_t pool_rows, const int64_t *table, int64_t block_size,
                     const int32_t *main_counts, const int16_t *recent_counts, const void *recent) {
    return lsh_merge_columns(columns, 0, columns, buckets, main_len, recent_len, recent_size, items, item_bytes,
                             pool_rows, table, block_size, main_counts, recent_counts, recent);
}

/* ---- a decode step's writes: the new keys and values, and each LSH index's recent order --------------- */

/* rows (B,) positions' pool rows; key and value (B, heads, dim) float32, stored as the pools' kind at the
 * (position, head) rows at * heads + h, `stride` elements apart; norms (pool, heads) or NULL: the float32
 * key's length-normalisation factor rsqrt(mean(k * k) + eps) / sqrt(dim), as model/decoding/cache.py key_norm
 * computes it. Heads 0..successor-1 are successor-value heads (model/lsh/successor.py): a position's value
 * slot holds the next position's value, so their values go to rows prev_at (B,) (the positions before) and
 * the new rows' values in those heads are 0 until the next step; prev_at may be NULL when successor is 0.
 * Returns 0, or BAD_INDEX for a row outside the pool or a successor count outside 0..heads. */
int decode_write(int64_t rows, int64_t heads, int64_t dim, int64_t kind, int64_t pool_rows, int64_t stride,
                 const int64_t *at, const float *key, const float *value, void *keys, void *values, float *norms,
                 float eps, float sqrt_dim, int64_t successor, const int64_t *prev_at) {
    if (!kind_ok(kind)) return BAD_KIND;
    if (successor < 0 || successor > heads || (successor && !prev_at)) return BAD_INDEX;
    for (int64_t b = 0; b < rows; b++)
        if (at[b] < 0 || at[b] >= pool_rows || (successor && (prev_at[b] < 0 || prev_at[b] >= pool_rows)))
            return BAD_INDEX;
    const int64_t row = heads * dim, bytes = kind_bytes((int)kind);
    for (int64_t b = 0; b < rows; b++) {
        for (int64_t h = 0; h < heads; h++) {
            store_row(keys, (int)kind, at[b] * heads + h, stride, key + b * row + h * dim, dim);
            if (h < successor) /* zero bits are +0 in every kind */
                memset((char *)values + (at[b] * heads + h) * stride * bytes, 0, (size_t)(dim * bytes));
            else
                store_row(values, (int)kind, at[b] * heads + h, stride, value + b * row + h * dim, dim);
        }
        /* after the new row's zeros: a padding row's previous position may be its own (position 0) */
        for (int64_t h = 0; h < successor; h++)
            store_row(values, (int)kind, prev_at[b] * heads + h, stride, value + b * row + h * dim, dim);
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
                /* items at .. n-1 one place up (an extend inserts every row, 256-item orders: a moved block) */
                char *from = (char *)items + (base + at) * item_bytes;
                memmove(from + item_bytes, from, (size_t)((n - at) * item_bytes));
                store_item(items, item_bytes, base + at, m[META_POSITION] + shift);
                rc[bk]++;
            }
        }
    }
    return 0;
}
