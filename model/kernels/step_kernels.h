/* The functions one kernel file calls in another (the C files in model/kernels are built into one library by
 * model/cpu_kernels.py); each defining file includes this too, so the compiler checks the two agree. */
#ifndef STEP_KERNELS_H
#define STEP_KERNELS_H

#include <stdint.h>

#define PANEL 32 /* step_linear.c's columns per packed panel (model/cpu_kernels.py's PANEL) */

/* every kernel's status codes (model/cpu_kernels.py's check_status reads them) */
#define NO_MEMORY 1
#define BAD_INDEX 2
#define BAD_KIND 4 /* pools of a kind this build does not read */

/* The pool row of `position` of `slot` through a block table (width blocks a slot, block_size positions a
 * block), or -1 outside the table or the pools' pool_rows rows. The slot itself is the caller's to check. */
static inline int64_t block_pool_row(const int64_t *table, int64_t width, int64_t block_size, int64_t slot,
                                     int64_t position, int64_t pool_rows) {
    if (position < 0 || position >= width * block_size) return -1;
    const int64_t row = table[slot * width + position / block_size] * block_size + position % block_size;
    return row >= 0 && row < pool_rows ? row : -1;
}

void step_linear_panels(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                        const float *bias, float *y, int64_t p0, int64_t p1);
void step_activate(float *u, int64_t n, int64_t act);
int lsh_hash(int64_t m, int64_t heads, int64_t rounds, int64_t dim, int64_t half, int64_t nfactors,
             const int64_t *factors, const float *q, const float *packed, int64_t *buckets);
void layer_norm_rows(int64_t m, int64_t n, const float *x, const float *w, const float *b, float eps, float *y);
int decode_write(int64_t rows, int64_t heads, int64_t dim, int64_t kind, int64_t pool_rows, int64_t stride,
                 const int64_t *at, const float *key, const float *value, void *keys, void *values, float *norms,
                 float eps, float sqrt_dim);
int lsh_append(int64_t rows, int64_t heads, int64_t rounds, int64_t buckets, int64_t recent_size,
               const int64_t *meta, const int64_t *bucket_of, int16_t *recent_counts, void *items,
               int64_t item_bytes, int64_t shift, int64_t recent_offset);
int lsh_attend_items(int64_t heads, int64_t rounds, int64_t buckets, int64_t chunk, int64_t before, int64_t after,
                     int64_t dim, int64_t recent_size, int64_t kind, const float *q, const void *keys,
                     const float *norms, const void *values, int64_t pool_rows, int64_t stride, const int64_t *meta,
                     const int64_t *bucket_of, const int32_t *main_counts, const int16_t *recent_counts,
                     const void *items, int64_t items_len, int64_t item_bytes, int64_t shift, int64_t recent_offset,
                     const int64_t *block_table, int64_t table_width, int64_t block_size, int64_t skip_slot,
                     float self_mask, float mask, float *out, int64_t begin, int64_t end);
int window_attend_items(int64_t heads, int64_t rounds, int64_t width, int64_t dim, int64_t kind, const float *q,
                        const void *keys, const float *norms, const void *values, int64_t pool_len, int64_t stride,
                        const int64_t *flat, const uint8_t *absent, int64_t absent_row_stride,
                        int64_t absent_head_stride, const int64_t *pos, const int64_t *t, const uint8_t *dead,
                        float self_mask, float mask, float *out, int64_t begin, int64_t end);

#endif
