/* An extend's LSH attention with the windows shared between its rows (extend_layers.c calls it for every LSH
 * layer but the last, once every row's key, value and index insert is stored): the bits lsh_attend_items
 * gives each row, one row at a time, right after its own insert.
 *
 * Windows. A decode step at position t sees, in each (head, round) order, the items of positions <= t: per
 * bucket, the first f_t(bucket) items of (the bucket's main items ++ its recent items) as the final state
 * holds them (every item of a bucket is in position order, main before recent, and the main/recent split
 * never changes a window). f_t = the counts before the extend's first row (`base`) plus the rows up to t.
 * So, per (head, round), a Fenwick tree over the buckets starts from `base`; the rows are added in order, and
 * a row's rank and the bucket holding any rank are found in O(log buckets). The final order of each round is
 * read once a call into pool indices (final_orders: the main items then the recent ones, bucket by bucket),
 * so a window chunk is a few runs of it, one per bucket it spans; the row's own slot is at its own rank in
 * each round. Every rule of lsh_attend.c's lsh_slots is kept: a row shorter than a chunk
 * attends every position in round 0, the other rounds dead; chunks counted along all rounds end to end,
 * wrapping mod rounds * chunks (chunk 0 of round r reads round r-1's last, possibly partial, chunk); ranks
 * past the position absent.
 *
 * Attention, in blocks of SHARE_ROWS rows of one head, attend_slots' arithmetic in three passes: the scores
 * (extend_attend.c; per round, rows in the order of their window's first chunk, a counting sort, so
 * neighbours read the same key rows while they are in cache; a slot's score is dots16's or dot_row's, as
 * attend_slots computes it, then the masks); per row the rounds' weights (round_weights, attend_slots' own
 * code); the values (per round, rows in that order again, each row's sum kept in `out` between rounds and
 * updated by the multiply-adds attend_slots runs, its slots in order, zero-probability slots left out: every
 * row's sum sees the same operations in the same order as attend_slots' registers; with 32-element float32
 * heads four rows' sums run side by side in registers). A successor-value head's own slot reads a zero row,
 * as the step reads it (its next position's value is written later). Rows of a block and threads change
 * which rows run together, never a row's arithmetic: the bits do not depend on them. */
#include <stdlib.h>

#include "extend_windows.h"

/* the pool row of the slot's position, or -1 (lsh_attend.c's pool_row) */
static inline int64_t walk_row(const Walk *w, int64_t position) {
    return block_pool_row_shift(w->table, w->table_width, w->block_size, w->block_shift, w->slot, position,
                                w->L->pool_rows);
}

/* the order row holding sorted index j of the slot's main order, or -1 (lsh_attend.c's order_row: through
 * the order table, which a fork's differs from its block table on the positions it shares) */
static inline int64_t walk_order_row(const Walk *w, int64_t j) {
    return block_pool_row_shift(w->L->order_table, w->table_width, w->block_size, w->block_shift, w->slot, j,
                                w->L->recent_offset / (w->H * w->R));
}

static inline int64_t item_value(const StepLayer *L, int64_t item) {
    return L->item_bytes == 2 ? ((const int16_t *)L->items)[item] : ((const int32_t *)L->items)[item];
}

static inline int64_t fen_prefix(const int32_t *f, int64_t k) {
    int64_t s = 0;
    for (; k > 0; k -= k & -k) s += f[k];
    return s;
}

/* the bucket holding rank p (the last bucket starting at or before p, as seek finds it) and its first rank */
static inline int64_t fen_find(const int32_t *f, int64_t nb, int64_t top, int64_t p, int64_t *start) {
    int64_t at = 0, rem = p;
    for (int64_t step = top; step; step >>= 1)
        if (at + step <= nb && f[at + step] <= rem) {
            at += step;
            rem -= f[at];
        }
    *start = p - rem;
    return at;
}

/* Row mb's windows in every round for head w->h (lsh_slots' rules), the counts already holding the row:
 * flat (pool indices), flag (SLOT_*) and dead per round; first[r]: round r's window's first (round, rank). */
static __attribute__((noinline)) int row_window(const Walk *w, const int64_t *mb, const int64_t *bk_of, int32_t *flat, uint8_t *flag,
                      uint8_t *dead, int64_t *first) {
    const StepLayer *L = w->L;
    const int64_t H = w->H, R = w->R, NB = w->NB, C = w->C, W = w->W, h = w->h;
    const int64_t t = mb[META_POSITION], nch = mb[META_LSH_CHUNKS], wc = L->before + 1 + L->after;
    if (!mb[META_HASHED]) { /* shorter than a chunk: every position so far, in round 0 */
        for (int64_t r = 0; r < R; r++) {
            dead[r] = r != 0;
            first[r] = 0;
            for (int64_t k = 0; k < W; k++) {
                const int64_t i = r * W + k;
                const int live = r == 0 && k <= t;
                const int64_t row = live ? walk_row(w, k) : 0;
                if (row < 0) return BAD_INDEX;
                flag[i] = !live ? SLOT_ABSENT : k == t ? SLOT_SELF : 0;
                flat[i] = (int32_t)(row * H + h);
            }
        }
        return 0;
    }
    if (nch < 1 || nch > w->chunks) return BAD_INDEX;
    const int64_t total = nch * R;
    int64_t own_rank[MAX_ROUNDS]; /* the row's rank in each round's order: the last of its bucket */
    for (int64_t r = 0; r < R; r++) own_rank[r] = fen_prefix(w->fen + r * (NB + 1), bk_of[r] + 1) - 1;
    for (int64_t r = 0; r < R; r++) {
        dead[r] = 0;
        const int64_t s = own_rank[r];
        const int64_t s_chunk = s >= 0 ? s / C : -((-s + C - 1) / C);
        for (int64_t o = 0; o < wc; o++) {
            int64_t g = (r * nch + s_chunk + o - L->before) % total;
            if (g < 0) g += total;
            const int64_t r2 = g / nch, rank0 = (g - r2 * nch) * C, i0 = r * W + o * C;
            if (o == 0) first[r] = r2 * w->chunks + rank0 / C; /* its first chunk, numbered as a sort key */
            const int32_t *cnt = w->cnt + r2 * NB, *fin = w->fin + r2 * w->len;
            const int64_t *fst = w->fst + r2 * (NB + 1);
            /* ranks past t are absent; the others, bucket by bucket, are runs of the final order (a bucket's
             * first counts are the row's view of it) */
            const int64_t live = t - rank0 + 1 < 0 ? 0 : t - rank0 + 1 < C ? t - rank0 + 1 : C;
            int64_t start = 0, bb = live ? fen_find(w->fen + r2 * (NB + 1), NB, w->top, rank0, &start) : 0;
            for (int64_t k = 0, p = rank0; k < live;) {
                while (bb < NB && p >= start + cnt[bb]) start += cnt[bb++];
                if (bb >= NB) return BAD_INDEX;
                const int64_t run = live - k < start + cnt[bb] - p ? live - k : start + cnt[bb] - p;
                memcpy(flat + i0 + k, fin + fst[bb] + p - start, (size_t)run * sizeof(int32_t));
                k += run;
                p += run;
            }
            memset(flag + i0, 0, (size_t)live);
            memset(flag + i0 + live, SLOT_ABSENT, (size_t)(C - live));
            memset(flat + i0 + live, 0, (size_t)(C - live) * sizeof(int32_t));
            /* the row's own position: in round r2's order at its own rank there */
            if (own_rank[r2] >= rank0 && own_rank[r2] < rank0 + live) flag[i0 + own_rank[r2] - rank0] = SLOT_SELF;
        }
    }
    return 0;
}

/* The main items of column k (`add` its place in an items row) at sorted indices j0 .. stop-1, order rows
 * orow[j - j0], into fin through its bucket cursor (a bucket's main items start at fin[j + o], j in it) */
#define FINAL_RUN(T)                                                                                            \
    do {                                                                                                        \
        const T *it = (const T *)L->items + add;                                                               \
        for (int64_t j = j0; j < stop; j++) {                                                                   \
            while (j >= e) { /* into the next bucket holding main items */                                      \
                o += rc[b];                                                                                     \
                e += mc[++b];                                                                                   \
            }                                                                                                   \
            const int64_t row = walk_row(w, it[orow[j - j0] * HR] - L->shift);                                 \
            if (row < 0) return BAD_INDEX;                                                                      \
            f[j + o] = (int32_t)(row * H + h);                                                                  \
        }                                                                                                       \
    } while (0)

/* The final orders of heads [h0, h1), every round, as pool indices (lsh_slots' reads, once a layer): per
 * column (head, round), bucket by bucket, the main items then the recent ones; column k = (h - h0) * R + r at
 * fin + k * len, its bucket starts at fst + k * (NB + 1). A row of the items holds every column's item of one
 * sorted index side by side, so a pass over the main order per column read each row once per column (16 times
 * a layer; at 64K positions the items, 2 to 4 MB a layer, leave the near caches between passes); here the
 * columns take FINAL_WINDOW sorted indices in turn, the window's order rows looked up once and its items rows
 * (8 to 16 KB) read from far once, each column's loop tight (its bucket cursor in registers: main item j lands
 * at j plus the recent items of the buckets before its own). extend_lsh_heads asks for one head's rounds at a
 * time, which keeps its scratch at one head's orders: all of a thread's heads at once measured no faster. */
#define FINAL_GROUP 16
#define FINAL_WINDOW 256
static int final_orders(const Walk *w, int64_t h0, int64_t h1, int64_t *fst, int32_t *fin) {
    const StepLayer *L = w->L;
    const int64_t H = w->H, R = w->R, NB = w->NB, HR = H * R, len = w->len, cols = (h1 - h0) * R;
    int64_t orow[FINAL_WINDOW];
    for (int64_t g0 = 0; g0 < cols; g0 += FINAL_GROUP) {
        const int64_t g1 = cols - g0 < FINAL_GROUP ? cols : g0 + FINAL_GROUP;
        int64_t mains[FINAL_GROUP], bucket[FINAL_GROUP], end[FINAL_GROUP], off[FINAL_GROUP], most = 0;
        for (int64_t k = g0; k < g1; k++) { /* the counts checked, the bucket starts, the recent items */
            const int64_t h = h0 + k / R, column = (w->slot * H + h) * R + k % R;
            const int32_t *mc = L->main_counts + column * NB;
            const int16_t *rc = L->recent_counts + column * NB;
            int64_t *f = fst + k * (NB + 1), jr = 0, m = 0;
            f[0] = 0;
            for (int64_t bb = 0; bb < NB; bb++) {
                f[bb + 1] = f[bb] + mc[bb] + rc[bb];
                if (f[bb + 1] > len || mc[bb] < 0 || rc[bb] < 0) return BAD_INDEX;
                m += mc[bb];
                for (int64_t i = 0; i < rc[bb]; i++) {
                    const int64_t item = L->recent_offset + column * L->recent_size + jr++;
                    if (item < 0 || item >= L->items_len) return BAD_INDEX;
                    const int64_t row = walk_row(w, item_value(L, item) - L->shift);
                    if (row < 0) return BAD_INDEX;
                    fin[k * len + f[bb] + mc[bb] + i] = (int32_t)(row * H + h);
                }
            }
            if (f[NB] != len) return BAD_INDEX;
            mains[k - g0] = m;
            bucket[k - g0] = 0;
            end[k - g0] = mc[0];
            off[k - g0] = 0;
            if (m > most) most = m;
        }
        for (int64_t j0 = 0; j0 < most; j0 += FINAL_WINDOW) {
            const int64_t j1 = most - j0 < FINAL_WINDOW ? most : j0 + FINAL_WINDOW;
            for (int64_t j = j0; j < j1; j++) { /* the window's order rows, once for every column */
                orow[j - j0] = walk_order_row(w, j);
                if (orow[j - j0] < 0 || orow[j - j0] * HR + h0 * R + g1 > L->items_len) return BAD_INDEX;
            }
            for (int64_t k = g0; k < g1; k++) {
                const int64_t x = k - g0, h = h0 + k / R, column = (w->slot * H + h) * R + k % R;
                const int64_t stop = j1 < mains[x] ? j1 : mains[x], add = h0 * R + k;
                const int32_t *mc = L->main_counts + column * NB;
                const int16_t *rc = L->recent_counts + column * NB;
                int64_t b = bucket[x], e = end[x], o = off[x];
                int32_t *f = fin + k * len;
                if (L->item_bytes == 2) FINAL_RUN(int16_t);
                else FINAL_RUN(int32_t);
                bucket[x] = b;
                end[x] = e;
                off[x] = o;
            }
        }
    }
    return 0;
}

/* A block's windows: its rows added to the counts in order, each row's windows read after its own add */
static __attribute__((noinline)) int block_windows(Walk *w, int64_t b0, int64_t rows, const int64_t *meta,
                                                   const int64_t *bucket_of, Scratch *s) {
    const int64_t H = w->H, R = w->R, NB = w->NB, n = w->n, h = w->h;
    for (int64_t lr = 0; lr < rows; lr++) {
        const int64_t b = b0 + lr, *bk = bucket_of + (b * H + h) * R;
        for (int64_t r = 0; r < R; r++) {
            if (bk[r] < 0 || bk[r] >= NB) return BAD_INDEX;
            w->cnt[r * NB + bk[r]]++;
            for (int64_t x = bk[r] + 1; x <= NB; x += x & -x) w->fen[r * (NB + 1) + x]++;
        }
        const int st = row_window(w, meta + b * META_COLUMNS, bk, s->flat + lr * n, s->flag + lr * n,
                                  s->dead + lr * R, s->first + lr * R);
        if (st) return st;
    }
    const int64_t keys = R * w->chunks;
    for (int64_t r = 0; r < R; r++) { /* rows by their window's first chunk (a counting sort: stable) */
        int64_t *order = s->order + r * rows;
        memset(s->tally, 0, (size_t)(keys + 1) * sizeof(int32_t));
        for (int64_t lr = 0; lr < rows; lr++) s->tally[s->first[lr * R + r] + 1]++;
        for (int64_t k = 0; k < keys; k++) s->tally[k + 1] += s->tally[k];
        for (int64_t lr = 0; lr < rows; lr++) order[s->tally[s->first[lr * R + r]]++] = lr;
    }
    return 0;
}

/* One head's rows 0 .. m-1 in blocks (see the top of the file). q, out (m, heads * dim). */
static int head_rows(Walk *w, int64_t m, const int64_t *meta, const float *q, const int64_t *bucket_of,
                     const float *fl, float *out, Scratch *s) {
    const StepLayer *L = w->L;
    const int64_t R = w->R, n = w->n, D = L->dim, att = w->H * D;
    const int successor = w->h < L->successor;
    const float mask = fl[3], self_mask = successor ? fl[3] : fl[2];
    for (int64_t b0 = 0; b0 < m; b0 += SHARE_ROWS) {
        const int64_t rows = m - b0 < SHARE_ROWS ? m - b0 : SHARE_ROWS;
        const int st = block_windows(w, b0, rows, meta, bucket_of, s);
        if (st) return st;
        for (int64_t r = 0; r < R; r++) block_scores(w, b0, rows, r, q, self_mask, mask, s);
        for (int64_t lr = 0; lr < rows; lr++) {
            round_weights(s->score + lr * n, R, w->W, s->dead + lr * R, s->lse);
            /* a successor-value head with nothing but itself to attend: exactly 0 (lsh_attend.c) */
            s->quiet[lr] = successor && !saw_key(s->lse, R, mask);
            memset(out + (b0 + lr) * att + w->h * D, 0, (size_t)D * sizeof(float));
        }
        for (int64_t r = 0; r < R; r++) block_values(w, b0, rows, r, out, s);
    }
    return 0;
}

/* The counts of heads [h0, h1) of layer L's index of `slot` before the extend's first row, at position t0:
 * base[((h - h0) * R + r) * NB + bucket] = main + recent. Returns NULL (the caller attends row by row) where
 * this file's windows do not apply: a column's items are not exactly positions 0 .. t0-1, a padding slot, too
 * many rounds, or no memory. */
int32_t *extend_lsh_base(const StepLayer *L, int64_t slot, int64_t t0, int64_t h0, int64_t h1, int64_t skip_slot) {
    const int64_t R = L->rounds, NB = L->buckets;
    if (slot == skip_slot || R > MAX_ROUNDS || NB < 1 || !kind_ok(L->kind) || L->pool_rows * L->heads > INT32_MAX)
        return NULL;
    int32_t *base = malloc((size_t)((h1 - h0) * R * NB) * sizeof(int32_t));
    if (!base) return NULL;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t column = (slot * L->heads + h) * R + r;
            int32_t *to = base + ((h - h0) * R + r) * NB;
            int64_t total = 0;
            for (int64_t bb = 0; bb < NB; bb++) {
                to[bb] = L->main_counts[column * NB + bb] + L->recent_counts[column * NB + bb];
                total += to[bb];
            }
            if (total != t0) {
                free(base);
                return NULL;
            }
        }
    return base;
}

/* Heads [h0, h1) of LSH layer L for the m rows (one slot, consecutive positions), every row's key, value and
 * insert already stored; base from extend_lsh_base; *keep: the thread's scratch of *kept bytes (NULL, 0 at
 * first), grown as needed. Returns 0, NO_MEMORY or BAD_INDEX. */
int extend_lsh_heads(const StepLayer *L, const float *fl, int64_t m, int64_t h0, int64_t h1, const int64_t *meta,
                     const float *q, const int64_t *bucket_of, const int32_t *base, const int64_t *table,
                     int64_t table_width, int64_t block_size, float *out, void **keep, size_t *kept) {
    const int64_t R = L->rounds, NB = L->buckets, W = (L->before + 1 + L->after) * L->chunk, n = R * W;
    const int64_t rows = m < SHARE_ROWS ? m : SHARE_ROWS, D = L->dim;
    const int64_t len = meta[(m - 1) * META_COLUMNS + META_POSITION] + 1;
    /* the most chunks a row's rounds have: the last row's (nch grows with the position) */
    const int64_t chunks = meta[(m - 1) * META_COLUMNS + META_LSH_CHUNKS] > 0 ? meta[(m - 1) * META_COLUMNS + META_LSH_CHUNKS] : 1;
    int64_t shift = -1, top = 1;
    if (block_size > 0 && !(block_size & (block_size - 1)))
        for (shift = 0; (INT64_C(1) << shift) < block_size; shift++) {
        }
    while (top * 2 <= NB) top *= 2;
    const size_t bytes = (size_t)(2 * rows * R + R * (NB + 1)) * sizeof(int64_t)
                         + (size_t)(rows * n + 2 * R + 2 * D + 16) * sizeof(float)
                         + (size_t)(rows * n + R * len + R * (2 * NB + 1 + chunks) + 1) * sizeof(int32_t)
                         + (size_t)(rows * n + rows * R + rows);
    if (*kept < bytes + 64) { /* the thread's scratch, kept from layer to layer (extend_layers frees it) */
        free(*keep);
        *kept = 0;
        if (!(*keep = malloc(bytes + 64))) return NO_MEMORY;
        *kept = bytes + 64;
    }
    Scratch s;
    s.order = (int64_t *)*keep;
    s.first = s.order + rows * R;
    int64_t *fst = s.first + rows * R;
    s.score = (float *)(fst + R * (NB + 1));
    s.lse = s.score + rows * n;
    s.row = s.lse + 2 * R;
    s.zero = s.row + D; /* D zero floats: a zero row of any kind */
    memset(s.zero, 0, (size_t)D * sizeof(float));
    s.flat = (int32_t *)(s.zero + D + 16);
    int32_t *fin = s.flat + rows * n, *fen = fin + R * len, *cnt = fen + R * (NB + 1);
    s.tally = cnt + R * NB;
    s.flag = (uint8_t *)(s.tally + R * chunks + 1);
    s.dead = s.flag + rows * n;
    s.quiet = s.dead + rows * R;
    const int64_t slot = meta[META_INDEX_SLOT];
    int st = 0;
    for (int64_t h = h0; h < h1 && !st; h++) {
        Walk w = {L, h, L->heads, R, NB, L->chunk, W, n, slot, top, table, table_width, block_size, shift,
                  fen, cnt, fst, fin, len, chunks};
        for (int64_t r = 0; r < R; r++) {
            int32_t *f = fen + r * (NB + 1);
            f[0] = 0;
            for (int64_t bb = 0; bb < NB; bb++) cnt[r * NB + bb] = f[bb + 1] = base[((h - h0) * R + r) * NB + bb];
            for (int64_t x = 1; x <= NB; x++) /* a Fenwick tree in O(NB) */
                if (x + (x & -x) <= NB) f[x + (x & -x)] += f[x];
        }
        st = final_orders(&w, h, h + 1, fst, fin); /* every round's at once */
        if (!st) st = head_rows(&w, m, meta, q, bucket_of, fl, out, &s);
    }
    return st;
}

