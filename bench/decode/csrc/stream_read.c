/* The memory-bandwidth anchor of bench/decode/decode_weights.py: one pass over a buffer, every 8-byte word read once
 * and folded into an XOR, split between the OpenMP threads in contiguous halves as the decode step's products
 * split their weights. A decode step of one row reads each weight once, so the time of this pass over as many
 * bytes as the packed weights is the least a step can take on this machine: the floor the step is compared to.
 * Built by bench/decode/stream_read.py with the kernels' own flags; not part of the package. */
#include <stddef.h>
#include <stdint.h>

/* XOR of the n words of buf, on `threads` threads (the result only keeps the compiler from dropping the reads) */
uint64_t stream_read(const uint64_t *buf, int64_t n, int threads) {
    uint64_t acc = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(^ : acc)
    for (int64_t i = 0; i < n; i++) acc ^= buf[i];
    return acc;
}
