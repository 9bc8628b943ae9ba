/* One row of x against Q4_0 or Q4_1 weights, eight blocks at a time (included by
 * qdot_body.c in its copies below AVX512-VNNI, inside its IF naming).
 *
 * row32 spends a block's own scale work on every block: its fp16 scale converted and
 * broadcast, an int32 -> fp32 conversion and an fma of 8 lanes, besides its unpacking and
 * products, about 18 instructions for 32 weights; a 7B Q4_0 projection at one row was bound
 * by them, not by the memory it reads. Here two blocks are unpacked into one vector (their
 * 16 bytes of nibbles each, side by side), their products summed in int16 (at most
 * 2 x 2 x 15 x 127) and in int32 pairs, and eight blocks' sums brought into one vector by
 * three hadds (blocks 0, 2, 4, 6, 1, 3, 5, 7), so the fp16 scales, x's scales and sums, the
 * conversion and the fmas are done once for eight blocks (4096 x 11008, 2 threads of an
 * AMD EPYC, Zen 3: Q4_0 1.56 -> 0.90-0.99 ms, Q4_1 1.84-1.96 -> 0.98 ms). x is read in the
 * order oct_order puts it in: in each 64 bytes (two blocks), the middle 16-byte pieces
 * swapped, so that the low nibbles' x of both blocks (elements 0-15 of each) is one load
 * and the high nibbles' another. */

/* x's one quantized row into row32_oct's order (done once a call): its whole groups of
 * eight blocks; the blocks after them stay in order */
static void IF(oct_order)(acts_t *a) {
    for (int64_t c = 0; c < a->nb / 8 * 256; c += 64) {
        int8_t *q = a->q + c;
        const __m128i one = _mm_loadu_si128((const __m128i *)(q + 16));
        _mm_storeu_si128((__m128i *)(q + 16), _mm_loadu_si128((const __m128i *)(q + 32)));
        _mm_storeu_si128((__m128i *)(q + 32), one);
    }
}

/* the fp16 halves at p + k * bytes for k = 0, 2, 4, 6, 1, 3, 5, 7, as fp32 */
static inline __m256 IF(oct_halves)(const uint8_t *p, int64_t bytes) {
    return _mm256_cvtph_ps(_mm_setr_epi16(
        (short)rd16(p), (short)rd16(p + 2 * bytes), (short)rd16(p + 4 * bytes),
        (short)rd16(p + 6 * bytes), (short)rd16(p + bytes), (short)rd16(p + 3 * bytes),
        (short)rd16(p + 5 * bytes), (short)rd16(p + 7 * bytes)));
}

/* the weight row at p (row_bytes, Q4_0 or Q4_1) against x's one row (oct_order'ed) */
static inline float IF(row32_oct)(const uint8_t *p, int64_t row_bytes, int qtype,
                                  const acts_t *a) {
    const int64_t nb = a->nb, bytes = row_bytes / nb;
    const int q4_1 = qtype == Q4_1, nibbles = q4_1 ? 4 : 2;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const int64_t whole = nb / 8 * 8;
    for (int64_t b = 0; b < whole; b += 8) {
        const uint8_t *blk = p + b * bytes;
        __builtin_prefetch(blk + 1024), __builtin_prefetch(blk + 1088);
        __builtin_prefetch(blk + 1152);
        __m256i r[4];
        for (int i = 0; i < 4; i++) {
            const uint8_t *q = blk + 2 * i * bytes + nibbles;
            const __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)),
                _mm_loadu_si128((const __m128i *)(q + bytes)), 1);
            const int8_t *x = a->q + 32 * (b + 2 * i);
            const __m256i lo = _mm256_maddubs_epi16(
                _mm256_and_si256(v, low), _mm256_loadu_si256((const __m256i *)x));
            const __m256i hi = _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                _mm256_loadu_si256((const __m256i *)(x + 32)));
            r[i] = _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
        }
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]),
                                               _mm256_hadd_epi32(r[2], r[3]));
        const __m256 d = IF(oct_halves)(blk, bytes);
        const __m256 dx = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a->d + b), order);
        const __m256 sx = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a->s + b), order);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), acc);
        /* the offsets: Q4_1's m against s = dx sum(qx); Q4_0's -8 d, the -8 applied last */
        accm = _mm256_fmadd_ps(q4_1 ? IF(oct_halves)(blk + 2, bytes) : d, sx, accm);
    }
    return IF(oct_finish)(p, bytes, whole, qtype, a, acc, accm);
}
