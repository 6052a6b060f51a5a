/* An exact extend on the CPU: S new tokens of one request processed in one call, leaving what S decode steps
 * (decode_layers, one token each) leave, bit for bit: the last row's logits and every cached tensor (keys,
 * values, key factors, local rings, each LSH index's orders and counts, merges included).
 * model/decoding/steps/fused_extend.py builds the call from the fused step's layer descriptions.
 *
 * Why it is exact: it runs decode_layers' layer-synchronous loop with the S rows (consecutive positions of one
 * slot) as its batch, and each piece computes a row alone:
 *  - the layer norms, products (one chain of multiply-adds per element, step_linear.c), the LSH hashes and the
 *    tails work row by row, so S rows give each row the bits one row gets;
 *  - a decode step at position p sees the index and the local ring as positions < p left them. Per layer:
 *    - an LSH layer first makes every row's writes in order as the steps make them (extend_merge.c: key/value
 *      write, successor values into the row before, insert into the recent order; the merges the steps make
 *      are put off to one merge after the last row, which leaves the same orders and counts), then attends
 *      (extend_windows.c, extend_attend.c): a row's window is read from the final orders through the bucket
 *      counts as they stood at its position (the counts before the call plus the rows up to it), and the
 *      attention is attend_slots' arithmetic, slot by slot, run per (head, round) over blocks of 1,024 rows
 *      taken in the order of their windows, so that rows whose windows overlap read the same key and value
 *      rows while they are in cache (each row's scores, weights and sums are still its own);
 *    - a local layer (extend_local.c) copies the positions its rows' windows cover (the ring as the call finds
 *      it, then the rows' own keys and values) side by side, attends every row from the copy, then writes the
 *      ring row by row (a later row's write would overwrite a ring row an earlier row's window reads);
 *    - where those do not apply (a pool kind or head size extend_local.c does not take, an index whose counts
 *      do not hold exactly the positions before the call, 16-bit count overflow), the rows go one by one: row
 *      b's merge when due, write, insert, then its attention through the step's own kernels (lsh_attend_items,
 *      window_attend_items), reading exactly the cache a step at its position reads.
 *    Heads are independent (a head's attention reads only its own keys, values, index columns and counts), so
 *    the threads split the heads and each takes all the rows for its own heads: no thread waits for another
 *    within a layer's attention.
 *  - the last layer writes and inserts every row but attends, and runs its tail, the final layer norm and the
 *    LM head, for the last row only: no later layer reads the other rows' outputs. With all_rows (prompt
 *    scoring: model/decoding/extend.py `extend(all_logits=True)`) the last layer attends like the others and the
 *    final layer norm and LM head run on every row, each row's logits the bits a step at its position returns
 *    (the layer norm and the product work row by row).
 * tests/model/decoding/test_extend.py checks every cached tensor and the logits against the steps with
 * torch.equal (bench/prefill/extend_cost.py times it against the one-piece prefill).
 *
 * Fixed bucket counts only (every row hashes with hashes[i * 4 ..] of layer i); index_len (nlayers) holds each
 * layer's main-order length and is updated by the merges. Returns decode_layers' statuses.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "step_kernels.h"

/* Heads [h0, h1) of layer L for rows 0 .. m-1, leaving what decode steps at their positions leave (the top of
 * the file): an LSH layer whose every row attends, every row's writes then the shared windows; the last LSH
 * layer, every row's writes then the last row's attention; a local layer, extend_local_heads where it applies.
 * Otherwise row by row, each as a step does it: LSH, the merge when due, the key/value write, the insert, then
 * the attention (rows from `first` on); local, the ring write, then the attention over the row's window. A
 * head's work reads and writes only that head's pool rows, key factors, index columns and counts, so threads
 * owning disjoint heads run without waiting for each other. q: LSH the query-keys, local the queries (m, att);
 * flat and absent: this thread's scratch for a local window; keep, kept: its scratch for the others. */
static int heads_work(const StepLayer *L, const float *fl, int64_t m, int64_t first, int64_t h0, int64_t h1,
                      const int64_t *meta, const float *q, const float *key, const float *value,
                      const int64_t *new_rows, const int64_t *prev_rows, const int64_t *bucket_of, int64_t *len,
                      const int64_t *table, int64_t table_width, int64_t block_size, int64_t scratch_slot,
                      int64_t *flat, uint8_t *absent, float *out, void **keep, size_t *kept) {
    const int64_t H = L->heads, R = L->rounds, att = H * L->dim, w = (L->before + 1) * L->chunk;
    const float scale = sqrtf((float)L->dim);
    int st = 0;
    if (L->lsh && first == 0) { /* every row attends: windows shared (extend_windows.c), after every row's writes */
        int32_t *base = extend_lsh_base(L, meta[META_INDEX_SLOT], meta[META_POSITION], h0, h1, scratch_slot);
        if (base) {
            st = lsh_store_rows(L, m, h0, h1, meta, key, value, new_rows, prev_rows, bucket_of, len, table,
                                table_width, block_size);
            if (!st)
                st = extend_lsh_heads(L, fl, m, h0, h1, meta, q, bucket_of, base, table, table_width, block_size, out,
                                      keep, kept);
            free(base);
            return st;
        }
    }
    if (!L->lsh) { /* every row's window from one copy, then the ring writes (extend_local.c), where it applies */
        st = extend_local_heads(L, fl, m, first, h0, h1, meta, q, key, value, out, keep, kept);
        if (st >= 0) return st;
        st = 0;
    }
    if (L->lsh && m > 1 && first == m - 1) { /* the last layer: every row's writes, then the last row's attention */
        st = lsh_store_rows(L, m, h0, h1, meta, key, value, new_rows, prev_rows, bucket_of, len, table, table_width,
                            block_size);
        if (!st)
            st = lsh_attend_items(H, R, L->buckets, L->chunk, L->before, L->after, L->dim, L->recent_size, L->kind, q,
                                  L->keys, L->norms, L->values, L->pool_rows, L->stride, meta, bucket_of,
                                  L->main_counts, L->recent_counts, L->items, L->items_len, L->item_bytes, L->shift,
                                  L->recent_offset, table, L->order_table, table_width, block_size, scratch_slot,
                                  fl[2], fl[3], L->successor, out, first * H + h0, first * H + h1);
        return st;
    }
    for (int64_t b = 0; b < m && !st; b++) {
        const int64_t *mb = meta + b * META_COLUMNS;
        if (!L->lsh) {
            const int64_t ring = ring_row(L, mb[META_SLOT], mb[META_POSITION]);
            for (int64_t h = h0; h < h1 && !st; h++) {
                const int64_t at = ring * H + h;
                st = decode_write(1, 1, L->dim, L->kind, L->pool_rows * H, L->stride, &at, key + b * att + h * L->dim,
                                  value + b * att + h * L->dim, L->keys, L->values, NULL, KEY_NORM_EPS, scale, 0, NULL);
            }
            if (st || b < first) continue;
            st = step_local_window(L, 1, mb, flat, absent);
            if (!st)
                st = window_attend_items(H, 1, w, L->dim, L->kind, q + b * att, L->keys, NULL, L->values,
                                         L->pool_rows * H, L->stride, flat, absent, w, H > 1 ? 0 : w, NULL, NULL, NULL,
                                         0.0f, fl[3], out + b * att, h0, h1);
            continue;
        }
        st = lsh_store_row(L, b, h0, h1, meta, key, value, new_rows, prev_rows, bucket_of, len, table, table_width,
                           block_size, NULL);
        if (!st && b >= first)
            st = lsh_attend_items(H, R, L->buckets, L->chunk, L->before, L->after, L->dim, L->recent_size, L->kind, q,
                                  L->keys, L->norms, L->values, L->pool_rows, L->stride, meta, bucket_of,
                                  L->main_counts, L->recent_counts, L->items, L->items_len, L->item_bytes, L->shift,
                                  L->recent_offset, table, L->order_table, table_width, block_size, scratch_slot, fl[2], fl[3],
                                  L->successor, out, b * H + h0, b * H + h1);
    }
    return st;
}

/* This thread's share of layer i's hashes of the m rows' query-keys, in blocks of HASH_ROWS rows (lsh_hash
 * hashes each row alone: the bits do not depend on the blocks). */
#define HASH_ROWS 64
static int hash_share(const StepLayer *L, int64_t i, int64_t m, const int64_t *hashes, const float *key,
                      int64_t *bucket_of) {
    const int64_t *hp = hashes + i * 4, att = L->heads * L->dim;
    int64_t begin, end;
    step_share((m + HASH_ROWS - 1) / HASH_ROWS, &begin, &end);
    for (int64_t blk = begin; blk < end; blk++) {
        const int64_t r0 = blk * HASH_ROWS, rows = m - r0 < HASH_ROWS ? m - r0 : HASH_ROWS;
        const int st = lsh_hash(rows, L->heads, L->rounds, L->dim, hp[1], hp[2], (const int64_t *)(intptr_t)hp[3],
                                key + r0 * att, (const float *)(intptr_t)hp[0],
                                bucket_of + r0 * L->heads * L->rounds);
        if (st) return NO_MEMORY;
    }
    return 0;
}

/* this thread's number in the parallel region (0 outside one) */
static inline int64_t step_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#define FAIL(st)                                                                                                  \
    do {                                                                                                          \
        const int st_ = (st);                                                                                     \
        if (st_) {                                                                                                \
            _Pragma("omp atomic") status |= st_;                                                                  \
        }                                                                                                         \
    } while (0)

/* m rows (consecutive positions of one slot, meta (m, META_COLUMNS) as model/decoding/facts.py row_facts builds
 * them) through every layer; logits (vocab,) of the last row, or with all_rows nonzero (m, vocab) of every row.
 * x1, x2 (m, hidden) scratch. The other arguments are decode_layers' (one bucket-count group: hashes[i * 4 ..]
 * is layer i's). index_len (nlayers): each LSH layer's main-order length, updated by the merges. */
int extend_layers(int64_t m, int64_t hidden, int64_t nlayers, const StepLayer *layers, const float *floats,
                  const int64_t *hashes, const StepEmbedding *embedding, const int64_t *tokens, float *x1, float *x2,
                  const int64_t *meta, int64_t *index_len, const int64_t *table, int64_t table_width,
                  int64_t table_rows, int64_t block_size, int64_t scratch_slot, const float *final_w,
                  const float *final_b, float final_eps, const void *head_w, const float *head_b, int64_t vocab,
                  float *logits, int64_t threads, int64_t wkind, int64_t all_rows) {
    if (wkind != WEIGHTS_F32 && wkind != WEIGHTS_BF16 && wkind != WEIGHTS_INT8) return BAD_KIND;
    if (m < 1) return BAD_INDEX;
    int64_t most_att = 1, most_proj = 1, most_window = 1, most_flat = 1, most_rounds = 1, most_ff = 1;
    for (int64_t i = 0; i < nlayers; i++) {
        const StepLayer *L = layers + i;
        const int64_t att = L->heads * L->dim, proj = (L->lsh ? 2 : 3) * att, w = (L->before + 1) * L->chunk;
        if (att > most_att) most_att = att;
        if (proj > most_proj) most_proj = proj;
        if (L->ff > most_ff) most_ff = L->ff;
        if (!L->lsh && w > most_window) most_window = w;
        if (!L->lsh && L->heads * w > most_flat) most_flat = L->heads * w;
        if (L->lsh && L->heads * L->rounds > most_rounds) most_rounds = L->heads * L->rounds;
    }
    float *fbuf = malloc((size_t)(m * (2 * hidden + most_proj + 4 * most_att + most_ff) + 2 * hidden) * sizeof(float));
    if (threads < 1) threads = 1;
    /* flat and absent: a local window's scratch, one per thread */
    int64_t *ibuf = malloc((size_t)(m * (2 + most_rounds) + threads * most_flat) * sizeof(int64_t));
    uint8_t *absent = malloc((size_t)(threads * most_window));
    if (!fbuf || !ibuf || !absent) {
        free(fbuf);
        free(ibuf);
        free(absent);
        return NO_MEMORY;
    }
    float *h = fbuf, *y = h + m * hidden, *qkv = y + m * hidden, *q = qkv + m * most_proj, *key = q + m * most_att;
    float *value = key + m * most_att, *out = value + m * most_att, *u = out + m * most_att, *joined = u + m * most_ff;
    int64_t *new_rows = ibuf, *prev_rows = ibuf + m, *bucket_of = ibuf + 2 * m, *flat = bucket_of + m * most_rounds;
    int status = step_embed(embedding, m, hidden, tokens, meta, x1);
    memcpy(x2, x1, (size_t)(m * hidden) * sizeof(float));
    const int64_t slot = meta[META_SLOT];
    int any_lsh = 0;
    for (int64_t i = 0; i < nlayers; i++) any_lsh |= layers[i].lsh != 0;
    for (int64_t b = 0; b < m && !status; b++) { /* one slot, consecutive positions, rows in every pool */
        const int64_t *mb = meta + b * META_COLUMNS, t = mb[META_POSITION];
        if (mb[META_SLOT] != slot || t != meta[META_POSITION] + b
            || (any_lsh && (!mb[META_KEEPS_INDEX] || mb[META_INDEX_SLOT] != slot))) /* merges need its own index */
            status |= BAD_INDEX;
        for (int64_t i = 0; i < nlayers; i++) {
            const StepLayer *L = layers + i;
            if (!L->lsh ? ring_row(L, slot, t) < 0
                        : table_row(table, table_width, table_rows, block_size, slot, t, L->pool_rows) < 0
                              || table_row(table, table_width, table_rows, block_size, slot, t < 1 ? 0 : t - 1,
                                           L->pool_rows) < 0)
                status |= BAD_INDEX;
        }
        new_rows[b] = table_row(table, table_width, table_rows, block_size, slot, t, INT64_MAX);
        prev_rows[b] = table_row(table, table_width, table_rows, block_size, slot, t < 1 ? 0 : t - 1, INT64_MAX);
    }
    if (status) goto done; /* nothing written */
#pragma omp parallel num_threads((int)threads) if (threads > 1)
    {
        void *keep = NULL; /* this thread's scratch for extend_windows.c, kept from layer to layer */
        size_t kept = 0;
        for (int64_t i = 0; i < nlayers; i++) {
            const StepLayer *L = layers + i;
            const float *fl = floats + 4 * i;
            const int64_t att = L->heads * L->dim, parts = L->lsh ? 2 : 3, proj = parts * att;
            /* the last layer's outputs matter at the last row only (no later layer reads the others), unless
             * every row's logits are asked for */
            const int64_t first = i == nlayers - 1 && !all_rows ? m - 1 : 0;
            int64_t r0, r1; /* this thread's rows of the row-by-row pieces: each row's bits are its own */
            step_share(m, &r0, &r1);
            layer_norm_rows(r1 - r0, hidden, x2 + r0 * hidden, L->ln_w, L->ln_b, fl[0], h + r0 * hidden);
#pragma omp barrier
            step_product(wkind, m, proj, hidden, h, L->proj_w, L->proj_b, qkv);
            {
                const float scale = sqrtf((float)L->dim);
                for (int64_t b = r0; b < r1; b++) {
                    const float *row = qkv + b * proj;
                    for (int64_t j = 0; j < att; j++) {
                        q[b * att + j] = row[j];
                        key[b * att + j] = L->lsh ? row[j] : row[att + j] / scale;
                        value[b * att + j] = row[(parts - 1) * att + j];
                    }
                }
            }
#pragma omp barrier
            if (L->lsh) {
                FAIL(hash_share(L, i, m, hashes, key, bucket_of));
#pragma omp barrier
            }
            int64_t h0, h1, len = index_len[i];
            step_share(L->heads, &h0, &h1);
            int failed; /* a failed hash (or an earlier layer's failure): nothing more is written */
#pragma omp atomic read
            failed = status;
            if (h0 < h1 && !failed)
                FAIL(heads_work(L, fl, m, first, h0, h1, meta, q, key, value, new_rows, prev_rows, bucket_of, &len,
                                table, table_width, block_size, scratch_slot, flat + step_thread() * most_flat,
                                absent + step_thread() * most_window, out, &keep, &kept));
#pragma omp barrier
            /* after every thread has read it: every thread merged at the same rows */
            if (h0 == 0 && h1 > 0) index_len[i] = len;
            step_layer_tail(wkind, m - first, hidden, att, L->ff, out + first * att, L->w_out, L->b_out,
                            x1 + first * hidden, x2 + first * hidden, L->ff_ln_w, L->ff_ln_b, fl[1], L->w_dense,
                            L->b_dense, L->act, L->w_ff, L->b_ff, y, h, u);
        }
        /* every row's [x1, x2] (all_rows: in h and y, side by side, free once the last tail is done), or the
         * last row's, through the final layer norm and the LM head */
        const int64_t first = all_rows ? 0 : m - 1, n = m - first;
        float *rows = all_rows ? h : joined;
#pragma omp single
        {
            for (int64_t b = first; b < m; b++) {
                memcpy(rows + (b - first) * 2 * hidden, x1 + b * hidden, (size_t)hidden * sizeof(float));
                memcpy(rows + (b - first) * 2 * hidden + hidden, x2 + b * hidden, (size_t)hidden * sizeof(float));
            }
            layer_norm_rows(n, 2 * hidden, rows, final_w, final_b, final_eps, rows);
        }
        step_product(wkind, n, vocab, 2 * hidden, rows, head_w, head_b, logits);
        free(keep);
    }
done:
    free(fbuf);
    free(ibuf);
    free(absent);
    return status;
}
