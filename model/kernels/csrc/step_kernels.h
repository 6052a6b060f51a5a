/* The kernels' shared definitions: the columns of a decode step's row facts, the fused step's structs, and every
 * function one kernel file calls in another or Python calls (the C files are built into one library,
 * model/kernels/build.py). Each defining file includes this, so the compiler checks a definition against its
 * declaration; model/kernels/abi.py is the Python side, and tests/model/kernels/test_abi.py checks the two agree. */
#ifndef STEP_KERNELS_H
#define STEP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* the epsilon of an LSH key's length factor (model/attention.py KEY_NORM_EPS; abi.KEY_NORM_EPS) */
#define KEY_NORM_EPS 1e-6f

#define PANEL 32 /* step_linear.c's columns per packed panel (abi.PANEL) */

/* calls fn(rows, ...) with rows a constant 1..8 (8 for more): one inlined copy per row count, so a tile's
 * accumulators stay in registers (step_linear.c, step_linear_q.c) */
#define DISPATCH(fn, rows, ...)                                                                                    \
    switch (rows) { /* one copy per row count, so the accumulators stay in registers */                           \
    case 1: fn(1, __VA_ARGS__); break;                                                                             \
    case 2: fn(2, __VA_ARGS__); break;                                                                             \
    case 3: fn(3, __VA_ARGS__); break;                                                                             \
    case 4: fn(4, __VA_ARGS__); break;                                                                             \
    case 5: fn(5, __VA_ARGS__); break;                                                                             \
    case 6: fn(6, __VA_ARGS__); break;                                                                             \
    case 7: fn(7, __VA_ARGS__); break;                                                                             \
    default: fn(8, __VA_ARGS__); break;                                                                            \
    }

/* AVX2 (callers include immintrin.h): a[i][0..4) += x[i][k] * (w0, w1, w2, w3), one fused multiply-add each,
 * for rows i < rows: a tile's 32 columns as four vectors of 8 (step_linear.c, step_linear_q.c) */
#define FMA_ROWS4(a, rows, x, x_stride, k, w0, w1, w2, w3)                                                         \
    for (int i_ = 0; i_ < (rows); i_++) {                                                                          \
        const __m256 xv_ = _mm256_set1_ps((x)[i_ * (x_stride) + (k)]);                                             \
        (a)[i_][0] = _mm256_fmadd_ps(xv_, (w0), (a)[i_][0]);                                                       \
        (a)[i_][1] = _mm256_fmadd_ps(xv_, (w1), (a)[i_][1]);                                                       \
        (a)[i_][2] = _mm256_fmadd_ps(xv_, (w2), (a)[i_][2]);                                                       \
        (a)[i_][3] = _mm256_fmadd_ps(xv_, (w3), (a)[i_][3]);                                                       \
    }

/* how a step's linear weights are packed (step_linear_q.c; abi.WEIGHTS, REFORMER_DECODE_WEIGHTS) */
#define WEIGHTS_F32 0
#define WEIGHTS_BF16 1
#define WEIGHTS_INT8 2

/* every kernel's status codes (abi.py; bindings.check_status reads them) */
#define NO_MEMORY 1
#define BAD_INDEX 2
#define BAD_KIND 4 /* pools of a kind this build does not read */

/* The pool row of `position` of `slot` through a block table (width blocks a slot, block_size positions a
 * block), or -1 outside the table or the pools' pool_rows rows. The slot itself is the caller's to check. */
/* a decode step's facts of one row, META_COLUMNS int64 each (abi.Meta; model/decoding/facts.py row_facts) */
#define META_SLOT 0        /* the row's request slot */
#define META_POSITION 1    /* the new position */
#define META_HASHED 2      /* its LSH layers hash (padded length past one chunk) */
#define META_LSH_CHUNKS 3  /* chunks of its padded length at the LSH chunk size */
#define META_LOCAL_DENSE 4 /* its local layers attend every position */
#define META_INDEX_SLOT 5  /* the slot whose LSH index it appends to */
#define META_KEEPS_INDEX 6 /* it keeps an LSH index */
#define META_COLUMNS 7

/* One layer of a fused decode step (abi.StepLayer): every field one 8-byte word. */
typedef struct {
    int64_t lsh;                      /* 1: LSH layer (query-key, value), 0: local (query, key, value) */
    int64_t heads, dim, kind, pool_rows; /* pool_rows: positions in the pools, each heads rows of dim elements */
    int64_t stride;                   /* elements from one (position, head) row of the pools to the next */
    int64_t ring;                     /* local: positions per slot of its pools' rings (position p of slot s
                                         at row s * ring + p % ring, model/decoding/local_ring.py); LSH: 0 */
    const float *ln_w, *ln_b;         /* the attention's layer norm (NULL: none) */
    const void *proj_w;               /* the projections packed side by side (step_linear_q.c's kinds) */
    const float *proj_b;              /* their bias */
    void *keys, *values;              /* the layer's pools */
    float *norms;                     /* LSH: each key's length factor (pool_rows, heads) */
    /* LSH: the hash rounds and the index (the hash's rotations come per step: `hashes` below) */
    int64_t rounds, buckets, recent_size, items_len, item_bytes, shift, recent_offset;
    const int32_t *main_counts;
    int16_t *recent_counts;
    void *items;
    int64_t chunk, before, after;     /* the attention's chunk and windows */
    int64_t successor;                /* LSH: heads 0..successor-1 are successor-value heads (decode_write) */
    /* the tail (step_tail) */
    int64_t ff, act;
    const void *w_out;                /* packed as proj_w, as are w_dense and w_ff */
    const float *b_out, *ff_ln_w, *ff_ln_b;
    const void *w_dense;
    const float *b_dense;
    const void *w_ff;
    const float *b_ff;
    /* LSH layers: the order table ((slots, table_width), as the block table): where each slot's main bucket order
     * lives (sorted index j at the items row of position j through it; model/decoding/cache.py order_table) */
    const int64_t *order_table;
} StepLayer;

/* The token and position embeddings (model/embeddings.py), read as 8 int64 words as StepLayer is: a token's
 * row of `word` plus its position's row of `pos0` (a plain table of hidden columns: pos1 NULL), or axial,
 * [pos0[t / s1], pos1[t % s1]] of d0 and d1 columns. */
typedef struct {
    const float *word;
    int64_t word_rows;
    const float *pos0;
    int64_t pos0_rows, d0;
    const float *pos1;
    int64_t s1, d1;
} StepEmbedding;

static inline int64_t block_pool_row(const int64_t *table, int64_t width, int64_t block_size, int64_t slot,
                                     int64_t position, int64_t pool_rows) {
    if (position < 0 || position >= width * block_size) return -1;
    const int64_t row = table[slot * width + position / block_size] * block_size + position % block_size;
    return row >= 0 && row < pool_rows ? row : -1;
}

/* block_pool_row with a shift and a mask in place of the division when the block size is a power of two
 * (`shift` its log2, else -1): a window resolves up to two rows per slot, and a 64-bit division by a size known
 * only at run time takes several times a shift's cycles. `table` is a block table or an order table. */
static inline int64_t block_pool_row_shift(const int64_t *table, int64_t width, int64_t block_size, int64_t shift,
                                           int64_t slot, int64_t position, int64_t rows) {
    if (position < 0 || position >= width * block_size) return -1;
    const int64_t block = shift >= 0 ? position >> shift : position / block_size;
    const int64_t offset = shift >= 0 ? position & (block_size - 1) : position % block_size;
    const int64_t row = table[slot * width + block] * block_size + offset;
    return row >= 0 && row < rows ? row : -1;
}

/* pool row of `position` of `slot`, or -1 outside the block table (its rows too) or the pools */
static inline int64_t table_row(const int64_t *table, int64_t width, int64_t table_rows, int64_t block_size,
                                int64_t slot, int64_t position, int64_t pool_rows) {
    if (slot < 0 || slot >= table_rows) return -1;
    return block_pool_row(table, width, block_size, slot, position, pool_rows);
}

/* pool row of `position` (>= 0) of `slot` in a local layer's rings (model/decoding/local_ring.py), or -1 outside
 * its pools (a slot out of range, or a layer without rings) */
static inline int64_t ring_row(const StepLayer *L, int64_t slot, int64_t position) {
    if (L->ring <= 0 || slot < 0 || position < 0 || slot >= L->pool_rows / L->ring) return -1;
    return slot * L->ring + position % L->ring;
}

void step_linear_panels(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                        const float *bias, float *y, int64_t p0, int64_t p1);
void step_linear_panels_w(int64_t wkind, int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride,
                          const void *packed, const float *bias, float *y, int64_t p0, int64_t p1);
void step_activate(float *u, int64_t n, int64_t act);
int lsh_hash(int64_t m, int64_t heads, int64_t rounds, int64_t dim, int64_t half, int64_t nfactors,
             const int64_t *factors, const float *q, const float *packed, int64_t *buckets);
void layer_norm_rows(int64_t m, int64_t n, const float *x, const float *w, const float *b, float eps, float *y);
int decode_write(int64_t rows, int64_t heads, int64_t dim, int64_t kind, int64_t pool_rows, int64_t stride,
                 const int64_t *at, const float *key, const float *value, void *keys, void *values, float *norms,
                 float eps, float sqrt_dim, int64_t successor, const int64_t *prev_at);
int lsh_append(int64_t rows, int64_t heads, int64_t rounds, int64_t buckets, int64_t recent_size,
               const int64_t *meta, const int64_t *bucket_of, int16_t *recent_counts, void *items,
               int64_t item_bytes, int64_t shift, int64_t recent_offset);
int lsh_attend_items(int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before, int64_t after,
                     int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
                     const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
                     const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
                     const void *items, int64_t items_len, int64_t item_bytes, int64_t shift, int64_t recent_offset,
                     const int64_t *block_table, const int64_t *order_table, int64_t table_width, int64_t block_size,
                     int64_t skip_slot, float self_mask, float mask, int64_t successor, float *out, int64_t begin,
                     int64_t end);
int window_attend_items(int64_t heads, int64_t rounds, int64_t width, int64_t dim, int64_t kind, const float *q,
                        const void *keys, const float *norms, const void *values, int64_t pool_len, int64_t stride,
                        const int64_t *flat, const uint8_t *absent, int64_t absent_row_stride,
                        int64_t absent_head_stride, const int64_t *pos, const int64_t *t, const uint8_t *dead,
                        float self_mask, float mask, float *out, int64_t begin, int64_t end);

/* step_layers.c's pieces of a step that extend_layers.c runs too: the embeddings, a local layer's window, a
 * thread's share of n pieces, a product split by panels and a layer's tail (the last two inside a parallel
 * region: they meet its barriers) */
int step_embed(const StepEmbedding *E, int64_t m, int64_t hidden, const int64_t *tokens, const int64_t *meta,
               float *x);
int step_local_window(const StepLayer *L, int64_t m, const int64_t *meta, int64_t *flat, uint8_t *absent);
void step_share(int64_t n, int64_t *begin, int64_t *end);
void step_product(int64_t wkind, int64_t m, int64_t n, int64_t k, const float *x, const void *w, const float *b,
                  float *y);
void step_layer_tail(int64_t wkind, int64_t m, int64_t hidden, int64_t att_dim, int64_t ff, const float *att,
                     const void *w_out, const float *b_out, float *x1, float *x2, const float *ln_w,
                     const float *ln_b, float eps, const void *w_dense, const float *b_dense, int64_t act,
                     const void *w_ff, const float *b_ff, float *y, float *h, float *u);
int lsh_merge_columns(int64_t columns, int64_t c0, int64_t c1, int64_t buckets, int64_t main_len, int64_t recent_len,
                      int64_t recent_size, void *items, int64_t item_bytes, int64_t pool_rows, const int64_t *table,
                      int64_t block_size, const int32_t *main_counts, const int16_t *recent_counts, const void *recent);

/* extend_windows.c: an extend's LSH attention with windows shared between its rows (extend_layers.c) */
__attribute__((visibility("hidden"))) int32_t *extend_lsh_base(const StepLayer *L, int64_t slot, int64_t t0,
                                                               int64_t h0, int64_t h1, int64_t skip_slot);
__attribute__((visibility("hidden"))) int extend_lsh_heads(const StepLayer *L, const float *fl, int64_t m, int64_t h0,
                                                           int64_t h1, const int64_t *meta, const float *q,
                                                           const int64_t *bucket_of, const int32_t *base,
                                                           const int64_t *table, int64_t table_width,
                                                           int64_t block_size, float *out, void **keep,
                                                           size_t *kept);
/* extend_local.c: an extend's local-layer attention from one copy of the windows (-1: not here) */
__attribute__((visibility("hidden"))) int extend_local_heads(const StepLayer *L, const float *fl, int64_t m,
                                                             int64_t first, int64_t h0, int64_t h1,
                                                             const int64_t *meta, const float *q, const float *key,
                                                             const float *value, float *out, void **keep,
                                                             size_t *kept);
/* extend_merge.c: an extend's writes into an LSH layer, row by row or with the merges put off to the end */
__attribute__((visibility("hidden"))) int lsh_store_row(const StepLayer *L, int64_t b, int64_t h0, int64_t h1,
                                                        const int64_t *meta, const float *key, const float *value,
                                                        const int64_t *new_rows, const int64_t *prev_rows,
                                                        const int64_t *bucket_of, int64_t *len, const int64_t *table,
                                                        int64_t table_width, int64_t block_size, void *aside);
__attribute__((visibility("hidden"))) int lsh_store_rows(const StepLayer *L, int64_t m, int64_t h0, int64_t h1,
                                                         const int64_t *meta, const float *key, const float *value,
                                                         const int64_t *new_rows, const int64_t *prev_rows,
                                                         const int64_t *bucket_of, int64_t *len, const int64_t *table,
                                                         int64_t table_width, int64_t block_size);

#endif
