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

/* How many sorted indices from j down, j included (at most `most`), lie in consecutive pool rows: to the start
 * of j's block, and on through the blocks before it while each lies right below the next, as a request's
 * blocks mostly do (block_shift >= 0) */
static inline int64_t rows_down(const RowMap *map, int64_t j, int64_t most) {
    int64_t k = j >> map->block_shift, got = (j & (map->block_size - 1)) + 1;
    while (got < most && k > 0 && map->table[k - 1] == map->table[k] - 1) {
        got += map->block_size;
        k--;
    }
    return got < most ? got : most;
}

/* one column's items of a main item run: sorted indices src_end - count .. src_end - 1 move up by `up`,
 * from the last down (up > 0, so none is overwritten before it is read). With a power-of-two block size, in
 * stretches whose source rows and destination rows are each consecutive: a stretch's rows looked up once, not
 * two table reads an item (the blocks of 8 positions of a request's order are mostly side by side in the pool),
 * its items moved in the same order as item by item; a short run (a short order: few items a bucket) item by
 * item, where finding the stretches costs more than it saves. The loop written once per item type. */
#define SHORT_RUN 16
#define MOVE_RUN(T)                                                                                           \
    do {                                                                                                      \
        T *it = (T *)items;                                                                                   \
        if (count < SHORT_RUN) {                                                                              \
            for (int64_t j = src_end - 1; j >= src_end - count; j--)                                          \
                it[SHIFTED_ROW(j + up) * columns + c] = it[SHIFTED_ROW(j) * columns + c];                     \
            break;                                                                                            \
        }                                                                                                     \
        for (int64_t j = src_end - 1; j >= src_end - count;) {                                                \
            const int64_t len = rows_down(map, j + up, rows_down(map, j, j - (src_end - count) + 1));         \
            T *to = it + SHIFTED_ROW(j + up) * columns + c;                                                   \
            const T *from = it + SHIFTED_ROW(j) * columns + c;                                                \
            for (int64_t i = 0; i < len; i++) to[-i * columns] = from[-i * columns];                          \
            j -= len;                                                                                         \
        }                                                                                                     \
    } while (0)
#define SHIFTED_ROW(j) ((map->table[(j) >> shift] << shift) + ((j) & mask))

static void move_run(void *items, int64_t item_bytes, const RowMap *map, int64_t columns, int64_t c,
                     int64_t src_end, int64_t count, int64_t up) {
    const int64_t shift = map->block_shift, mask = map->block_size - 1;
    if (shift >= 0) {
        if (item_bytes == 2) MOVE_RUN(int16_t);
        else MOVE_RUN(int32_t);
    } else {
        for (int64_t j = src_end - 1; j >= src_end - count; j--)
            store_item(items, item_bytes, row_at(map, j + up) * columns + c,
                       load_item(items, item_bytes, row_at(map, j) * columns + c));
    }
}

/* For columns c0 .. c1-1 of the `columns` (head, round) columns of one slot: the main order (sorted index j
 * at items[row j * columns + c], j < main_len, row j as `map` gives it) and the recent order (recent[c *
 * recent_size + k], k < recent_len), both sorted by (bucket, position) with bucket counts main_counts and recent_counts
 * (columns, buckets), become one main order of main_len + recent_len items: bucket by bucket, the bucket's
 * main items then its recent ones (every recent position is later than every main one). In place, from the
 * last bucket down: an item only ever moves to a later sorted index, so none is overwritten before it is
 * read. The main items between two buckets that receive recent items move up by the same count, as one run.
 * Returns 0, or BAD_INDEX when a row is outside the pool or the counts do not add up to the lengths (the
 * order is then undefined). */
static int merge_orders(int64_t columns, int64_t c0, int64_t c1, int64_t buckets, int64_t main_len,
                        int64_t recent_len, int64_t recent_size, void *items, int64_t item_bytes, int64_t pool_rows,
                        const RowMap *map, const int32_t *main_counts, const int16_t *recent_counts, const void *recent) {
    const int64_t n = main_len + recent_len;
    if (recent_len > recent_size || !rows_ok(map, n, pool_rows)) return BAD_INDEX;
    for (int64_t c = c0; c < c1; c++) {
        const int32_t *mc = main_counts + c * buckets;
        const int16_t *rc = recent_counts + c * buckets;
        int64_t total_main = 0, total_recent = 0;
        for (int64_t bb = 0; bb < buckets; bb++) {
            total_main += mc[bb];
            total_recent += rc[bb];
        }
        if (total_main != main_len || total_recent != recent_len) return BAD_INDEX;
        /* src_main: the main items not yet moved are 0 .. src_main-1; run: the main items after them, up to
         * the last recent item placed, which all move up by the recent items still to place */
        int64_t src_main = main_len, src_recent = recent_len, run = 0;
        for (int64_t bb = buckets - 1; bb >= 0 && src_recent > 0; bb--) {
            if (rc[bb]) {
                move_run(items, item_bytes, map, columns, c, src_main + run, run, src_recent);
                run = 0;
                for (int64_t k = 0; k < rc[bb]; k++) {
                    src_recent--;
                    store_item(items, item_bytes, row_at(map, src_main + src_recent) * columns + c,
                               load_item(recent, item_bytes, c * recent_size + src_recent));
                }
            }
            src_main -= mc[bb];
            run += mc[bb];
        }
        /* the main items of the buckets before the first that receives recent items stay where they are */
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
