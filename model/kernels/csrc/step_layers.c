/* A CPU decode step's layers in one call: the embeddings, then for every layer its layer norm, projections,
 * cache write, (LSH) hash and insert into the recent order, attention and tail, then the final layer norm and
 * the LM head,
 * calling the same C functions model/decoding/steps/torch_step.py calls one by one (model/decoding/steps/fused.py builds the layer
 * descriptions and calls it; model/kernels/bindings.py builds it into the same library as window_attend.c and
 * step_linear.c).
 *
 * Why: with every product, hash and attention in C, what was left of a step was Python between those calls
 * (about ten calls, views and argument checks per layer): about half of the shipped model's step. Each row
 * is still computed alone (every function called here works row by row), so a row's bits do not depend on
 * the batch.
 *
 * StepLayer is read by model/decoding/steps/fused.py as a flat array of int64 (every field is 8 bytes: pointers and
 * int64_t, in this order; step_layer_words() returns the count, which the Python side checks) plus four
 * floats per layer in `floats`: the attention's and the feed-forward's layer-norm epsilons, the self mask
 * and the padding mask.
 *
 * A step's rows may hash with different bucket counts (automatic counts follow each row's length): row b
 * hashes with count group_of[b] (-1: it does not hash; its buckets are 0, as model/decoding/steps/torch_step.py leaves them),
 * whose rotations, halves' sum, number of factors and factors for layer i are hashes[(i * groups + g) * 4 ..].
 * Each row is hashed alone, which gives the bits of a batched hash (lsh_hash computes every row alone).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "step_kernels.h"



int64_t step_layer_words(void) { return (int64_t)(sizeof(StepLayer) / sizeof(int64_t)); }


int64_t step_embedding_words(void) { return (int64_t)(sizeof(StepEmbedding) / sizeof(int64_t)); }

/* x (m, hidden) = each row's token and position embeddings, one float32 sum per element, as the PyTorch
 * step adds them. Returns 0, or BAD_INDEX for a token or position outside the tables. */
int step_embed(const StepEmbedding *E, int64_t m, int64_t hidden, const int64_t *tokens, const int64_t *meta,
                 float *x) {
    for (int64_t b = 0; b < m; b++) {
        const int64_t tok = tokens[b], t = meta[b * META_COLUMNS + META_POSITION];
        const int64_t p0 = E->pos1 ? t / E->s1 : t;
        if (tok < 0 || tok >= E->word_rows || t < 0 || p0 >= E->pos0_rows) return BAD_INDEX;
        const float *w = E->word + tok * hidden, *a = E->pos0 + p0 * E->d0;
        float *y = x + b * hidden;
        for (int64_t j = 0; j < E->d0; j++) y[j] = w[j] + a[j];
        if (E->pos1) {
            const float *c = E->pos1 + (t % E->s1) * E->d1;
            for (int64_t j = 0; j < E->d1; j++) y[E->d0 + j] = w[E->d0 + j] + c[j];
        }
    }
    return 0;
}

/* A local layer's window as model/decoding/steps/torch_step.py's _local_window builds it: flat (m, heads, w) pool indices
 * into its rings and absent (m, w), w = (before + 1) * chunk. Returns 0 or BAD_INDEX. */
int step_local_window(const StepLayer *L, int64_t m, const int64_t *meta, int64_t *flat, uint8_t *absent) {
    const int64_t c = L->chunk, w = (L->before + 1) * c;
    for (int64_t b = 0; b < m; b++) {
        const int64_t slot = meta[b * META_COLUMNS + META_SLOT], t = meta[b * META_COLUMNS + META_POSITION], dense = meta[b * META_COLUMNS + META_LOCAL_DENSE];
        int64_t start = dense ? 0 : (t / c - L->before) * c; /* t >= 0: division is floor */
        if (start < 0) start = 0;
        for (int64_t j = 0; j < w; j++) {
            const int64_t p = start + j;
            const int gone = p > t;
            const int64_t row = ring_row(L, slot, gone ? 0 : p);
            if (row < 0) return BAD_INDEX;
            absent[b * w + j] = (uint8_t)gone;
            for (int64_t h = 0; h < L->heads; h++) flat[(b * L->heads + h) * w + j] = row * L->heads + h;
        }
    }
    return 0;
}

/* This thread's share [*begin, *end) of n pieces (the whole of them outside a parallel region) */
void step_share(int64_t n, int64_t *begin, int64_t *end) {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    *begin = n * t / nt;
    *end = n * (t + 1) / nt;
}


/* y = x W^T + b split by panels between the region's threads, then a barrier: every element is computed
 * as step_linear computes it, whichever thread computes it. */
void step_product(int64_t wkind, int64_t m, int64_t n, int64_t k, const float *x, const void *w, const float *b,
                    float *y) {
    int64_t p0, p1;
    step_share((n + PANEL - 1) / PANEL, &p0, &p1);
    step_linear_panels_w(wkind, m, n, k, x, k, w, b, y, p0, p1);
#pragma omp barrier
}

/* This thread's share of LSH layer i's hash of the step's new query-keys key (m, heads * dim): every (row,
 * head) is hashed alone, by lsh_hash over that head's packed rotations, into bucket_of (m, heads, rounds); a
 * row that does not hash gets buckets 0. Split between the threads because the rotations are float32 (4 MB
 * a layer at google/reformer-enwik8's shape: 8 heads x 4 rounds x 256 x 128), read once a step: on one
 * thread, the other waited for them. Nothing is hashed once `status` is set. */
static void lsh_hash_share(const StepLayer *L, int64_t i, int64_t m, int64_t groups, const int64_t *group_of,
                           const int64_t *hashes, const float *key, int64_t *bucket_of, int *status) {
    int failed;
#pragma omp atomic read
    failed = *status; /* another thread may be setting it */
    if (failed) return;
    const int64_t att = L->heads * L->dim, per_row = L->heads * L->rounds;
    int64_t begin, end;
    step_share(m * L->heads, &begin, &end);
    int st = 0;
    for (int64_t item = begin; item < end && !st; item++) {
        const int64_t b = item / L->heads, h = item % L->heads, g = group_of[b];
        int64_t *out = bucket_of + b * per_row + h * L->rounds;
        if (g < 0 || g >= groups) {
            memset(out, 0, (size_t)L->rounds * sizeof(int64_t));
            continue;
        }
        const int64_t *hp = hashes + (i * groups + g) * 4;
        const int64_t panels = (L->rounds * hp[1] + PANEL - 1) / PANEL; /* lsh_hash's per-head packing */
        st = lsh_hash(1, 1, L->rounds, L->dim, hp[1], hp[2], (const int64_t *)(intptr_t)hp[3], key + b * att + h * L->dim,
                      (const float *)(intptr_t)hp[0] + h * panels * L->dim * PANEL, out);
    }
    if (st) {
#pragma omp atomic
        *status |= st;
    }
}

/* A layer's tail after its attention `att` (m, att_dim), in place on the reversible pair x1, x2 (m, hidden):
 *   x1 += att W_out^T (+ b_out);  x2 += act(layer_norm(x1) W_dense^T + b_dense) W_ff^T + b_ff,
 * the weights packed as step_linear reads them (NULL biases: none), y and h (m, hidden) and u (m, ff) as
 * scratch. Inside a parallel region its products and activation are split between the threads; outside
 * one it runs on the caller's. */
void step_layer_tail(int64_t wkind, int64_t m, int64_t hidden, int64_t att_dim, int64_t ff, const float *att,
                       const void *w_out, const float *b_out, float *x1, float *x2, const float *ln_w,
                       const float *ln_b, float eps, const void *w_dense, const float *b_dense, int64_t act,
                       const void *w_ff, const float *b_ff, float *y, float *h, float *u) {
    step_product(wkind, m, hidden, att_dim, att, w_out, b_out, y);
#pragma omp single
    {
        for (int64_t j = 0; j < m * hidden; j++) x1[j] += y[j];
        layer_norm_rows(m, hidden, x1, ln_w, ln_b, eps, h);
    }
    step_product(wkind, m, ff, hidden, h, w_dense, b_dense, u);
    int64_t begin, end;
    step_share(m * ff, &begin, &end);
    step_activate(u + begin, end - begin, act);
#pragma omp barrier
    step_product(wkind, m, hidden, ff, u, w_ff, b_ff, y);
#pragma omp single
    for (int64_t j = 0; j < m * hidden; j++) x2[j] += y[j];
}

/* layer_tail on the caller's thread with its own scratch (model/decoding/steps/linear.py's per-layer path), the
 * weights packed as `wkind` (step_linear_q.c). Returns 0, NO_MEMORY when its buffer could not be allocated, or
 * BAD_KIND for an unknown kind. */
int step_tail(int64_t m, int64_t hidden, int64_t att_dim, int64_t ff, const float *att, const void *w_out,
              const float *b_out, float *x1, float *x2, const float *ln_w, const float *ln_b, float eps,
              const void *w_dense, const float *b_dense, int64_t act, const void *w_ff, const float *b_ff,
              int64_t wkind) {
    if (wkind != WEIGHTS_F32 && wkind != WEIGHTS_BF16 && wkind != WEIGHTS_INT8) return BAD_KIND;
    float *buf = malloc((size_t)(m * (2 * hidden + ff)) * sizeof(float));
    if (!buf) return NO_MEMORY;
    step_layer_tail(wkind, m, hidden, att_dim, ff, att, w_out, b_out, x1, x2, ln_w, ln_b, eps, w_dense, b_dense, act, w_ff,
               b_ff, buf, buf + m * hidden, buf + 2 * m * hidden);
    free(buf);
    return 0;
}

/* x1, x2 (m, hidden): two buffers that get the step's embeddings of `tokens` (m,) and are updated in place
 * through every layer; logits (m, vocab) from the final layer norm of [x1, x2] and the LM head. meta (m, META_COLUMNS) as model/decoding/step.py
 * builds it; an LSH layer's new key goes to the block-table row of (slot, t) (meta's first two columns), a local
 * layer's to its ring row slot * ring + t % ring (StepLayer.ring). `threads`:
 * the products are split by panels, the LSH hashes and the attention by (row, head) between that many
 * OpenMP threads, the rest runs on one; every value is computed as on one thread, so the bits do not depend on `threads`.
 * `wkind`: how every packed weight (projections, tails, LM head) is kept (WEIGHTS_*, step_linear_q.c).
 * Returns 0, NO_MEMORY, BAD_KIND, or a called function's non-zero status (an error does not stop the other threads
 * early: every thread meets every barrier; the functions check their indices, so the rest is only wasted). */
int decode_layers(int64_t m, int64_t hidden, int64_t nlayers, const StepLayer *layers, const float *floats,
                  int64_t groups, const int64_t *group_of, const int64_t *hashes, const StepEmbedding *embedding,
                  const int64_t *tokens, float *x1, float *x2, const int64_t *meta, const int64_t *table,
                  int64_t table_width, int64_t table_rows, int64_t block_size, int64_t scratch_slot,
                  const float *final_w, const float *final_b, float final_eps, const void *head_w,
                  const float *head_b, int64_t vocab, float *logits, int64_t threads, int64_t wkind) {
    if (wkind != WEIGHTS_F32 && wkind != WEIGHTS_BF16 && wkind != WEIGHTS_INT8) return BAD_KIND;
    int64_t most_att = 1, most_proj = 1, most_window = 1, most_flat = 1, most_rounds = 1, most_ff = 1;
    for (int64_t i = 0; i < nlayers; i++) {
        const StepLayer *L = layers + i;
        const int64_t att = L->heads * L->dim, proj = (L->lsh ? 2 : 3) * att;
        if (att > most_att) most_att = att;
        if (proj > most_proj) most_proj = proj;
        if (L->ff > most_ff) most_ff = L->ff;
        const int64_t w = (L->before + 1) * L->chunk;
        if (!L->lsh && w > most_window) most_window = w;
        if (!L->lsh && L->heads * w > most_flat) most_flat = L->heads * w;
        if (L->lsh && L->heads * L->rounds > most_rounds) most_rounds = L->heads * L->rounds;
    }
    const size_t floats_n = (size_t)(m * (2 * hidden + most_proj + 3 * most_att + most_ff) + m * 2 * hidden);
    float *fbuf = malloc(floats_n * sizeof(float));
    int64_t *ibuf = malloc((size_t)(m * (3 + most_rounds + most_flat)) * sizeof(int64_t));
    uint8_t *absent = malloc((size_t)(m * most_window));
    int status = 0;
    if (!fbuf || !ibuf || !absent) {
        free(fbuf);
        free(ibuf);
        free(absent);
        return NO_MEMORY;
    }
    float *h = fbuf, *y = h + m * hidden, *qkv = y + m * hidden, *key = qkv + m * most_proj;
    float *value = key + m * most_att, *out = value + m * most_att, *u = out + m * most_att, *joined = u + m * most_ff;
    /* new_rows: the new positions' rows in the LSH layers' block pools; prev_rows: the rows of the positions
     * before them, where successor-value heads write; ring_rows: the new positions' rows in a local layer's
     * rings */
    int64_t *new_rows = ibuf, *prev_rows = ibuf + m, *ring_rows = ibuf + 2 * m, *bucket_of = ibuf + 3 * m;
    int64_t *flat = bucket_of + m * most_rounds;
    status = step_embed(embedding, m, hidden, tokens, meta, x1);
    memcpy(x2, x1, (size_t)(m * hidden) * sizeof(float));
    /* every row's rows in every layer's pools checked before anything is written */
    for (int64_t i = 0; i < nlayers; i++) {
        const StepLayer *L = layers + i;
        for (int64_t b = 0; b < m; b++) {
            const int64_t slot = meta[b * META_COLUMNS + META_SLOT], t = meta[b * META_COLUMNS + META_POSITION];
            if (!L->lsh) {
                if (ring_row(L, slot, t) < 0) status |= BAD_INDEX;
                continue;
            }
            const int64_t before = t - 1; /* a padding row's is its own, 0 */
            if (table_row(table, table_width, table_rows, block_size, slot, t, L->pool_rows) < 0
                || table_row(table, table_width, table_rows, block_size, slot, before < 0 ? 0 : before, L->pool_rows) < 0)
                status |= BAD_INDEX;
        }
    }
    for (int64_t b = 0; b < m && !status; b++) {
        const int64_t slot = meta[b * META_COLUMNS + META_SLOT], t = meta[b * META_COLUMNS + META_POSITION];
        new_rows[b] = table_row(table, table_width, table_rows, block_size, slot, t, INT64_MAX);
        prev_rows[b] = table_row(table, table_width, table_rows, block_size, slot, t < 1 ? 0 : t - 1, INT64_MAX);
    }
    if (threads < 1) threads = 1;
    if (status) goto done; /* a token, position or new row outside the tables: the cache is left untouched */
#pragma omp parallel num_threads((int)threads) if (threads > 1)
    {
        for (int64_t i = 0; i < nlayers; i++) {
            const StepLayer *L = layers + i;
            const float *fl = floats + 4 * i;
            const int64_t att = L->heads * L->dim, parts = L->lsh ? 2 : 3, proj = parts * att;
#pragma omp single
            layer_norm_rows(m, hidden, x2, L->ln_w, L->ln_b, fl[0], h);
            step_product(wkind, m, proj, hidden, h, L->proj_w, L->proj_b, qkv);
#pragma omp single
            {
                /* LSH: the query-key is the query and the key; local: query, key / sqrt(D), value */
                const float scale = sqrtf((float)L->dim);
                for (int64_t b = 0; b < m; b++) {
                    const float *row = qkv + b * proj;
                    for (int64_t j = 0; j < att; j++) {
                        key[b * att + j] = L->lsh ? row[j] : row[att + j] / scale;
                        value[b * att + j] = row[(parts - 1) * att + j];
                    }
                }
                if (!L->lsh)
                    for (int64_t b = 0; b < m; b++)
                        ring_rows[b] = ring_row(L, meta[b * META_COLUMNS + META_SLOT], meta[b * META_COLUMNS + META_POSITION]);
                int st = status ? status
                                : decode_write(m, L->heads, L->dim, L->kind, L->pool_rows, L->stride,
                                               L->lsh ? new_rows : ring_rows, key, value, L->keys, L->values,
                                               L->lsh ? L->norms : NULL, KEY_NORM_EPS, scale, L->lsh ? L->successor : 0,
                                               prev_rows);
                if (!L->lsh) {
                    if (!st) st = step_local_window(L, m, meta, flat, absent);
                    /* the query, contiguous, where the value was (written to the pools already) */
                    for (int64_t b = 0; b < m; b++) memcpy(value + b * att, qkv + b * proj, (size_t)att * sizeof(float));
                }
                status |= st;
            }
            if (L->lsh) {
                lsh_hash_share(L, i, m, groups, group_of, hashes, key, bucket_of, &status);
#pragma omp barrier
#pragma omp single
                if (!status)
                    status |= lsh_append(m, L->heads, L->rounds, L->buckets, L->recent_size, meta, bucket_of,
                                         L->recent_counts, L->items, L->item_bytes, L->shift, L->recent_offset);
            }
            int64_t begin, end;
            step_share(m * L->heads, &begin, &end);
            int st = 0;
            if (L->lsh)
                st = lsh_attend_items(L->heads, L->rounds, L->buckets, L->chunk, L->before, L->after, L->dim,
                                      L->recent_size, L->kind, key, L->keys, L->norms, L->values, L->pool_rows,
                                      L->stride, meta, bucket_of, L->main_counts, L->recent_counts, L->items,
                                      L->items_len, L->item_bytes, L->shift, L->recent_offset, table, L->order_table,
                                      table_width, block_size, scratch_slot, fl[2], fl[3], L->successor, out, begin, end);
            else {
                const int64_t w = (L->before + 1) * L->chunk;
                st = window_attend_items(L->heads, 1, w, L->dim, L->kind, value, L->keys, NULL, L->values,
                                         L->pool_rows * L->heads, L->stride, flat, absent, w, L->heads > 1 ? 0 : w,
                                         NULL, NULL, NULL, 0.0f, fl[3], out, begin, end);
            }
            if (st) {
#pragma omp atomic
                status |= st;
            }
#pragma omp barrier
            step_layer_tail(wkind, m, hidden, att, L->ff, out, L->w_out, L->b_out, x1, x2, L->ff_ln_w, L->ff_ln_b, fl[1],
                       L->w_dense, L->b_dense, L->act, L->w_ff, L->b_ff, y, h, u);
        }
#pragma omp single
        {
            for (int64_t b = 0; b < m; b++) {
                memcpy(joined + b * 2 * hidden, x1 + b * hidden, (size_t)hidden * sizeof(float));
                memcpy(joined + b * 2 * hidden + hidden, x2 + b * hidden, (size_t)hidden * sizeof(float));
            }
            layer_norm_rows(m, 2 * hidden, joined, final_w, final_b, final_eps, joined);
        }
        step_product(wkind, m, vocab, 2 * hidden, joined, head_w, head_b, logits);
    }
done:
    free(fbuf);
    free(ibuf);
    free(absent);
    return status;
}
