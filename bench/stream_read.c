/* The memory bandwidth probe of bench/bandwidth.py: every 8-byte word of a buffer read once,
 * on `threads` threads (static halves), folded with xor so that nothing can be skipped; the
 * compiler turns the loop into full-width vector loads. */
#include <stdint.h>

uint64_t rf_stream_read(const uint64_t *p, int64_t n, int threads) {
    uint64_t fold = 0;
#pragma omp parallel for schedule(static) reduction(^ : fold) num_threads(threads)
    for (int64_t i = 0; i < n; i++) fold ^= p[i];
    return fold;
}
