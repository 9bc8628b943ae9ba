/* One row of x against Q4_0 or Q4_1 weights on AVX512-VNNI, eight blocks at a time (included
 * by qdot_body.c in its AVX512-VNNI copy, inside its IF naming; qdot_row32.c is the AVX2
 * form of the same idea).
 *
 * row32 spends a block's own scale work on every block (its fp16 scale converted and
 * broadcast, a conversion and an fma), about as many instructions as its products: a 7B
 * Q4_0 projection at one row ran no faster than the fp32 kernel. Here four blocks' 16 bytes
 * of nibbles fill one 512-bit vector, the low nibbles of all four against one 64-byte load
 * of x and the high ones against the next (two vpdpbusd, exact in int32), each block's four
 * lanes summed by two adds and a permute into eight blocks' sums in order, so that the
 * scales (Q4_0's eight fp16 d taken from two 64-byte loads by one word permute), x's scales
 * and sums, the conversion and the fmas are done once for eight blocks. x is read in the
 * order oct_order puts it in: in each 128 bytes (four blocks of 32, each its low nibbles'
 * x then its high nibbles'), the four blocks' first halves, then their second halves. */

/* x's one quantized row into row32_oct's order (done once a call): its whole groups of
 * eight blocks; the blocks after them stay in order */
static void IF(oct_order)(acts_t *a) {
    for (int64_t c = 0; c < a->nb / 8 * 256; c += 128) {
        int8_t *q = a->q + c;
        const __m512i x0 = _mm512_loadu_si512((const void *)q);
        const __m512i x1 = _mm512_loadu_si512((const void *)(q + 64));
        /* blocks 0, 1 | 2, 3 as [0 lo, 0 hi, 1 lo, 1 hi]: the 16-byte pieces 0, 2, 4, 6 of
         * the 128 bytes, then 1, 3, 5, 7 */
        const __m512i lo = _mm512_permutex2var_epi64(x0, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), x1);
        const __m512i hi = _mm512_permutex2var_epi64(x0, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), x1);
        _mm512_storeu_si512((void *)q, lo);
        _mm512_storeu_si512((void *)(q + 64), hi);
    }
}

/* four blocks' 16 bytes of nibbles (at p + k * bytes, k = 0..3) side by side */
static inline __m512i IF(oct_four)(const uint8_t *p, int64_t bytes) {
    const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    const __m512i v1 = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + bytes)), 1);
    const __m512i v2 = _mm512_inserti32x4(v1, _mm_loadu_si128((const __m128i *)(p + 2 * bytes)), 2);
    return _mm512_inserti32x4(v2, _mm_loadu_si128((const __m128i *)(p + 3 * bytes)), 3);
}

/* the fp16 halves at p + k * bytes for k = 0..7, as fp32 in that order: for Q4_0 (18-byte
 * blocks) all eight lie in the first 128 bytes at word offsets 9k, one word permute of two
 * loads; otherwise gathered */
static inline __m256 IF(oct_halves)(const uint8_t *p, int64_t bytes) {
    if (bytes == 18) {
        const __m512i w = _mm512_permutex2var_epi16(
            _mm512_loadu_si512((const void *)p),
            _mm512_castsi128_si512(_mm_setr_epi16(0, 9, 18, 27, 36, 45, 54, 63)),
            _mm512_loadu_si512((const void *)(p + 64)));
        return _mm256_cvtph_ps(_mm512_castsi512_si128(w));
    }
    return _mm256_cvtph_ps(_mm_setr_epi16(
        (short)rd16(p), (short)rd16(p + bytes), (short)rd16(p + 2 * bytes),
        (short)rd16(p + 3 * bytes), (short)rd16(p + 4 * bytes), (short)rd16(p + 5 * bytes),
        (short)rd16(p + 6 * bytes), (short)rd16(p + 7 * bytes)));
}

/* the weight row at p (row_bytes, Q4_0 or Q4_1) against x's one row (oct_order'ed) */
static inline float IF(row32_oct)(const uint8_t *p, int64_t row_bytes, int qtype,
                                  const acts_t *a) {
    const int64_t nb = a->nb, bytes = row_bytes / nb;
    const int q4_1 = qtype == Q4_1, nibbles = q4_1 ? 4 : 2;
    const __m512i low = _mm512_set1_epi8(15);
    /* lanes 0, 4, .., 28 of a vector of 32 int32: (block k's sum) at lane 4 k' */
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const int64_t whole = nb / 8 * 8;
    for (int64_t b = 0; b < whole; b += 8) {
        const uint8_t *blk = p + b * bytes;
        __builtin_prefetch(blk + 1024), __builtin_prefetch(blk + 1088);
        __builtin_prefetch(blk + 1152);
        __m512i r[2];
        for (int i = 0; i < 2; i++) {
            const __m512i v = IF(oct_four)(blk + 4 * i * bytes + nibbles, bytes);
            const int8_t *x = a->q + 32 * (b + 4 * i);
            r[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, low),
                                       _mm512_loadu_si512((const void *)x));
            r[i] = _mm512_dpbusd_epi32(r[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                       _mm512_loadu_si512((const void *)(x + 64)));
        }
        /* in each 128-bit lane L: r0's block L and r1's block 4 + L, four partials each */
        const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(r[0], r[1]),
                                           _mm512_unpackhi_epi64(r[0], r[1]));
        const __m512i t = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
        const __m256i sums = _mm512_castsi512_si256(_mm512_permutexvar_epi32(pick, t));
        const __m256 d = IF(oct_halves)(blk, bytes);
        const __m256 dx = _mm256_loadu_ps(a->d + b), sx = _mm256_loadu_ps(a->s + b);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), acc);
        /* the offsets: Q4_1's m against s = dx sum(qx); Q4_0's -8 d, the -8 applied last */
        accm = _mm256_fmadd_ps(q4_1 ? IF(oct_halves)(blk + 2, bytes) : d, sx, accm);
    }
    return IF(oct_finish)(p, bytes, whole, qtype, a, acc, accm);
}
