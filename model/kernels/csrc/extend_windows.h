/* extend_windows.c and extend_attend.c's shared definitions: an extend's LSH rows in blocks, their windows (a
 * walk over counts as of each row) and the scratch a thread keeps them in. */
#ifndef EXTEND_WINDOWS_H
#define EXTEND_WINDOWS_H

#include "window_rows.h"

#define SHARE_ROWS 1024 /* rows a block (scratch of about 9 bytes per window slot each) */
#define SLOT_ABSENT 1
#define SLOT_SELF 2

typedef struct {
    const StepLayer *L;
    int64_t h, H, R, NB, C, W, n, slot, top;
    const int64_t *table;
    int64_t table_width, block_size, block_shift;
    int32_t *fen, *cnt;    /* round r's counts as of the current row: a Fenwick tree (NB + 1) and plain (NB) */
    int64_t *fst;          /* round r's final order: bucket bb's items start at fst[r * (NB + 1) + bb] */
    int32_t *fin;          /* round r's final order as pool indices (pool row * heads + h), `len` apart */
    int64_t len;           /* the final item count (the last row's position + 1) */
    int64_t chunks;        /* the most chunks a round has (the last row's) */
} Walk;


/* Scratch of one thread's call (sizes in extend_lsh_heads). */
typedef struct {
    int64_t *order, *first;
    int32_t *flat; /* pool indices (extend_lsh_base: they fit 31 bits) */
    uint8_t *flag, *dead, *quiet;
    int32_t *tally; /* the counting sort's counts: rounds * chunks + 1 */
    float *score, *lse, *row, *zero;
} Scratch;

/* extend_attend.c: a block's scores and values in round r, rows in s->order's order */
HIDDEN void block_scores(const Walk *w, int64_t b0, int64_t rows, int64_t r, const float *q, float self_mask,
                         float mask, Scratch *s);
HIDDEN void block_values(const Walk *w, int64_t b0, int64_t rows, int64_t r, float *out, Scratch *s);

#endif
