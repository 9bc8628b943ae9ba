/* One instruction set's copy of the integer path (qdot.c includes it three times, each
 * under its #pragma GCC target with IDOT_SUFFIX, IDOT and, for AVX512-VNNI, IDOT_ZMM
 * defined): x's quantization, the weight unpacking, the row kernels of each block family and
 * qlinear_int over them. No include guard: one copy per inclusion. */
#define IF(name) CAT(name, IDOT_SUFFIX)

static inline float IF(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float IF(h16)(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* bytes of IF(acts_into)'s buffer for M rows of K in blocks of `block` */
static inline size_t IF(acts_bytes)(int64_t M, int64_t K, int block) {
    const size_t bytes = (size_t)(M * K) + (size_t)(M * (K / block)) * 8 +
                         (size_t)(M * (K / 16)) * 2 + 64;
    return (bytes + 63) / 64 * 64;
}

static void IF(acts_into)(const float *x, int64_t M, int64_t ldx, int64_t K, int block,
                          acts_t *a, uint8_t *mem);

/* x (M rows) -> a: blocks of `block`; one allocation (a->q, freed by the caller) holds all */
static int IF(acts)(const float *x, int64_t M, int64_t ldx, int64_t K, int block, acts_t *a) {
    uint8_t *mem = aligned_alloc(64, IF(acts_bytes)(M, K, block));
    if (!mem) return -2;
    IF(acts_into)(x, M, ldx, K, block, a, mem);
    return 0;
}

/* x -> a in `mem` (IF(acts_bytes) of it, 64-byte aligned) */
static void IF(acts_into)(const float *x, int64_t M, int64_t ldx, int64_t K, int block,
                          acts_t *a, uint8_t *mem) {
    const int64_t nb = K / block, n32 = K / 32;
    a->q = (int8_t *)mem, a->K = K, a->nb = nb;
    a->d = (float *)(mem + M * K);
    a->s = a->d + M * nb;
    a->bs = (int16_t *)(a->s + M * nb);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * block;
            __m256 mx = _mm256_setzero_ps();
            for (int c = 0; c < block; c += 8)
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + c)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float d = _mm_cvtss_f32(h) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            const __m256 vid = _mm256_set1_ps(id);
            int8_t *q = a->q + m * K + b * block;
            int32_t total = 0;
            for (int c = 0; c < block; c += 32) {
                __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + c), vid));
                __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + c + 8), vid));
                __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + c + 16), vid));
                __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + c + 24), vid));
                /* sums over 16: elements c .. c + 15 are i0, i1; c + 16 .. c + 31 are i2, i3 */
                __m256i s01 = _mm256_add_epi32(i0, i1), s23 = _mm256_add_epi32(i2, i3);
                __m128i t01 = _mm_add_epi32(_mm256_castsi256_si128(s01),
                                            _mm256_extracti128_si256(s01, 1));
                __m128i t23 = _mm_add_epi32(_mm256_castsi256_si128(s23),
                                            _mm256_extracti128_si256(s23, 1));
                __m128i t = _mm_hadd_epi32(t01, t23); /* (a, a, b, b) partial pairs */
                t = _mm_hadd_epi32(t, t);             /* sum c..c+15, sum c+16..c+31 */
                const int32_t lo = _mm_cvtsi128_si32(t), hi = _mm_extract_epi32(t, 1);
                total += lo + hi;
                if (block == 256) {
                    a->bs[m * (K / 16) + (b * block + c) / 16] = (int16_t)lo;
                    a->bs[m * (K / 16) + (b * block + c) / 16 + 1] = (int16_t)hi;
                }
                __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                               _mm256_packs_epi32(i2, i3));
                _mm256_storeu_si256((__m256i *)(q + c), _mm256_permutevar8x32_epi32(p, order));
            }
            a->d[m * nb + b] = d;
            a->s[m * nb + b] = d * (float)total;
        }
    (void)n32;
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones */
static inline __m256i IF(nibbles)(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
/* 32 bits -> byte j = 16 where bit j is set, else 0 */
static inline __m256i IF(bit4)(const uint8_t *p) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(p)), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* Q6_K: half h (128 weights) of the block at p as 4 x 32 values 0..63, in k order: element
 * r takes its low 4 bits from ql[64 h + r % 64] (low nibble for r < 64) and its top 2 from
 * qh[32 h + r % 32] >> 2 (r / 32) */
static inline void IF(q6k_half)(const uint8_t *p, int h, __m256i v[4]) {
    const __m256i low = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    v[0] = _mm256_or_si256(_mm256_and_si256(q0, low),
                           _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
    v[1] = _mm256_or_si256(_mm256_and_si256(q1, low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4));
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_1R: one weight row against mr rows of x (32-blocks).
 * A block contributes (d dx) (q . qx) + off * s, s = dx sum(qx), off = -8 d (Q4_0), -16 d
 * (Q5_0), m (Q4_1, Q5_1), 0 (Q8_0). */
static inline __attribute__((always_inline)) void IF(row32)(
    const int mr, const uint8_t *p, int64_t row_bytes, int qtype, const acts_t *a,
    float s[IDOT_ROWS]) {
    __m256 acc[IDOT_ROWS];
    float c[IDOT_ROWS];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps(), c[m] = 0.f;
    const int64_t nb = a->nb, K = a->K;
    const int64_t bytes = qtype == Q4_1R ? 0 : row_bytes / nb;
    const uint8_t *blk = p;
    for (int64_t b = 0; b < nb; b++, blk += bytes) {
        float d, off;
        __m256i u, sx = _mm256_setzero_si256();
        if (qtype == Q4_1R) {
            d = IF(h16)(p + 2 * b), off = IF(h16)(p + 2 * (nb + b));
            u = IF(nibbles)(p + 4 * nb + 16 * b);
            if ((b & 3) == 0) __builtin_prefetch(p + 4 * nb + 16 * b + 1024);
        } else {
            __builtin_prefetch(blk + 1024);
            d = IF(h16)(blk);
            switch (qtype) {
            case Q4_0: off = -8.f * d, u = IF(nibbles)(blk + 2); break;
            case Q4_1: off = IF(h16)(blk + 2), u = IF(nibbles)(blk + 4); break;
            case Q5_0:
                off = -16.f * d;
                u = _mm256_or_si256(IF(nibbles)(blk + 6), IF(bit4)(blk + 2));
                break;
            case Q5_1:
                off = IF(h16)(blk + 2);
                u = _mm256_or_si256(IF(nibbles)(blk + 8), IF(bit4)(blk + 4));
                break;
            default: /* Q8_0: |w| against x with w's signs */
                off = 0.f, sx = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u = _mm256_sign_epi8(sx, sx);
            }
        }
        for (int m = 0; m < mr; m++) {
            __m256i qx = _mm256_loadu_si256((const __m256i *)(a->q + m * K + 32 * b));
            if (qtype == Q8_0) qx = _mm256_sign_epi8(qx, sx);
            __m256i dot = IDOT(_mm256_setzero_si256(), u, qx);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                     _mm256_set1_ps(d * a->d[m * nb + b]), acc[m]);
            c[m] += off * a->s[m * nb + b];
        }
    }
    for (int m = 0; m < mr; m++) s[m] = IF(hsum)(acc[m]) + c[m];
}

/* Q4_K, Q5_K: a 256-block is 8 sub-blocks of 32, each (d sc_j) q - dmin mn_j. Per block and
 * row, sum_j sc_j (q . qx)_j in int32 lanes (maddubs, then madd by sc_j broadcast), and
 * sum_j mn_j sum(qx)_j from x's sums over 16 (pairs added, madd by the mins): two fp32 fmas. */
static inline __attribute__((always_inline)) void IF(row_qk)(
    const int mr, const uint8_t *p, int qtype, const acts_t *a, float s[IDOT_ROWS]) {
    __m256 acc[IDOT_ROWS];
    __m128 accm[IDOT_ROWS];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps(), accm[m] = _mm_setzero_ps();
    const int five = qtype == Q5_K, stride = five ? 176 : 144;
    const int64_t nb = a->nb, K = a->K;
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++, p += stride) {
        __builtin_prefetch(p + 1024), __builtin_prefetch(p + 1024 + 64);
        __builtin_prefetch(p + 1024 + 128);
        const float d = IF(h16)(p), dmin = IF(h16)(p + 2);
        uint64_t scales, mins;
        k4_packed(p + 4, &scales, &mins);
        const __m256i sc16 = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales)));
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mins));
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        __m256i isum[IDOT_ROWS];
        for (int m = 0; m < mr; m++) isum[m] = _mm256_setzero_si256();
        const __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)qh) : low;
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
            }
            /* sc_{2j} and sc_{2j+1} in every int16 lane: bytes 4j, 4j + 1 and 4j + 2, 4j + 3 */
            const __m256i sl = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0404 * j)));
            const __m256i sh = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0302 + 0x0404 * j)));
            for (int m = 0; m < mr; m++) {
                const int8_t *qx = a->q + m * K + 256 * b + 64 * j;
                __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)qx));
                __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(qx + 32)));
                isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(_mm256_madd_epi16(pl, sl),
                                                                     _mm256_madd_epi16(ph, sh)));
            }
        }
        for (int m = 0; m < mr; m++) {
            const int16_t *bs = a->bs + m * (K / 16) + 16 * b;
            const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs),
                                                 _mm_loadu_si128((const __m128i *)(bs + 8)));
            const float dx = a->d[m * nb + b];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * dx), acc[m]);
            accm[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, pairs)),
                                   _mm_set1_ps(dmin * dx), accm[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        __m128 t = _mm_add_ps(accm[m], _mm_movehl_ps(accm[m], accm[m]));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        s[m] = IF(hsum)(acc[m]) - _mm_cvtss_f32(t);
    }
}

/* Q6_K: 16 groups of 16 weights, each (d sc_g) (q - 32) with q in 0..63: sum_g sc_g (q . qx)_g
 * - 32 sum_g sc_g sum(qx)_g, all in int32 lanes, one fp32 fma a block */
static inline __attribute__((always_inline)) void IF(row_q6k)(
    const int mr, const uint8_t *p, const acts_t *a, float s[IDOT_ROWS]) {
    __m256 acc[IDOT_ROWS];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
    const int64_t nb = a->nb, K = a->K;
    for (int64_t b = 0; b < nb; b++, p += 210) {
        __builtin_prefetch(p + 1024), __builtin_prefetch(p + 1024 + 64);
        __builtin_prefetch(p + 1024 + 128), __builtin_prefetch(p + 1024 + 192);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(p + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const float d = IF(h16)(p + 208);
        __m256i isum[IDOT_ROWS];
        for (int m = 0; m < mr; m++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(a->bs + m * (K / 16) + 16 * b));
            isum[m] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5); /* 32 sum sc_g sum_g */
            isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[m]);
        }
        for (int h = 0; h < 2; h++) {
            __m256i v[4];
            IF(q6k_half)(p, h, v);
            for (int i = 0; i < 4; i++) {
                /* sc_g in lanes 0-7, sc_{g+1} in 8-15, g = 8h + 2i */
                const int g = 8 * h + 2 * i;
                const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                    sc8, _mm_set_epi64x(0x0101010101010101ll * (g + 1), 0x0101010101010101ll * g)));
                for (int m = 0; m < mr; m++) {
                    const int8_t *qx = a->q + m * K + 256 * b + 128 * h + 32 * i;
                    __m256i pr = _mm256_maddubs_epi16(v[i], _mm256_loadu_si256((const __m256i *)qx));
                    isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(pr, scale));
                }
            }
        }
        for (int m = 0; m < mr; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]),
                                     _mm256_set1_ps(d * a->d[m * nb + b]), acc[m]);
    }
    for (int m = 0; m < mr; m++) s[m] = IF(hsum)(acc[m]);
}

/* row32_oct (qdot_row32.c below AVX512-VNNI, qdot_row32_zmm.c on it): one row of x against
 * Q4_0 or Q4_1 eight blocks a step, for a row with a group of eight blocks at least (the
 * blocks past the last whole group, as SmolLM2's K = 576 leaves two, go one at a time) */
static inline int IF(oct_type)(int qtype, int64_t nb) {
    return (qtype == Q4_0 || qtype == Q4_1) && nb >= 8;
}

/* row32_oct's end: the blocks from `whole` on one at a time (x in order), added to the
 * groups' sums (acc) and offsets (accm: Q4_1's m, Q4_0's d against s = dx sum(qx)) */
static inline float IF(oct_finish)(const uint8_t *p, int64_t bytes, int64_t whole, int qtype,
                                   const acts_t *a, __m256 acc, __m256 accm) {
    const int q4_1 = qtype == Q4_1, nibbles = q4_1 ? 4 : 2;
    const __m256i ones = _mm256_set1_epi16(1);
    float offset = 0.f;
    for (int64_t b = whole; b < a->nb; b++) {
        const uint8_t *blk = p + b * bytes;
        const float d = IF(h16)(blk);
        const __m256i dot = _mm256_madd_epi16(
            _mm256_maddubs_epi16(IF(nibbles)(blk + nibbles),
                                 _mm256_loadu_si256((const __m256i *)(a->q + 32 * b))),
            ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a->d[b]), acc);
        offset += (q4_1 ? IF(h16)(blk + 2) : d) * a->s[b];
    }
    return IF(hsum)(acc) + (q4_1 ? 1.f : -8.f) * (IF(hsum)(accm) + offset);
}

#ifdef IDOT_ZMM
/* Q4_K, Q5_K on 512-bit vectors: the sub-block pairs (0, 1) and (2, 3) of a block in one
 * vector (their 64 bytes of nibbles), low nibbles = sub-blocks 0 and 2, high = 1 and 3, x's
 * matching 32-byte halves put side by side; madd by the scales and the sum in one vpdpwssd.
 * The same integers and sums as row_qk: a 7B Q4_K projection at one row ran 1.3x faster. */
/* x's quantized rows as row_qk_zmm reads them: in each 128 values, the 32-byte pieces 1
 * and 2 swapped ([0, 2, 1, 3]), so that the low nibbles' x (pieces 0 and 2) and the high
 * nibbles' (1 and 3) are each one 64-byte load; done once a call instead of two inserts per
 * 128 weights and row of x */
static void IF(qk_zmm_order)(acts_t *a, int64_t M) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < a->K; c += 128) {
            int8_t *q = a->q + m * a->K + c;
            const __m256i one = _mm256_loadu_si256((const __m256i *)(q + 32));
            _mm256_storeu_si256((__m256i *)(q + 32), _mm256_loadu_si256((const __m256i *)(q + 64)));
            _mm256_storeu_si256((__m256i *)(q + 64), one);
        }
}

static inline __attribute__((always_inline)) void IF(row_qk_zmm)(
    const int mr, const uint8_t *p, int qtype, const acts_t *a, float s[IDOT_ROWS]) {
    __m512 acc[IDOT_ROWS];
    __m128 accm[IDOT_ROWS];
    for (int m = 0; m < mr; m++) acc[m] = _mm512_setzero_ps(), accm[m] = _mm_setzero_ps();
    const int five = qtype == Q5_K, stride = five ? 176 : 144;
    const int64_t nb = a->nb, K = a->K;
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    /* int16 lane l of the scale vectors: sub-block (l < 16 ? 0 : 2) + 4 h (low nibbles) or
     * that + 1 (high), for the two 64-byte halves h of the block */
    const __m512i pick_lo0 = _mm512_set_epi64(0x0002000200020002ll, 0x0002000200020002ll,
        0x0002000200020002ll, 0x0002000200020002ll, 0, 0, 0, 0);
    const __m512i step1 = _mm512_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, p += stride) {
        __builtin_prefetch(p + 1024), __builtin_prefetch(p + 1024 + 64);
        __builtin_prefetch(p + 1024 + 128);
        const float d = IF(h16)(p), dmin = IF(h16)(p + 2);
        uint64_t scales, mins;
        k4_packed(p + 4, &scales, &mins);
        const __m512i sc16 = _mm512_castsi128_si512(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales)));
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mins));
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        const __m512i hbits = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh))
                                   : low;
        __m512i isum[IDOT_ROWS];
        for (int m = 0; m < mr; m++) isum[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * h));
            __m512i lo = _mm512_and_si512(v, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (five) { /* sub-block j's fifth bits: bit j of qh; halves: j = 4h (+2), +1 */
                const long long a2 = 0x0001000100010001ll * (4 * h + 2),
                                a0 = 0x0001000100010001ll * (4 * h);
                const __m512i sl = _mm512_set_epi64(a2, a2, a2, a2, a0, a0, a0, a0);
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(
                    _mm512_and_si512(_mm512_srlv_epi16(hbits, sl), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(
                    _mm512_srlv_epi16(hbits, _mm512_add_epi16(sl, step1)), one), 4));
            }
            const __m512i ilo = _mm512_add_epi16(pick_lo0, _mm512_set1_epi16((short)(4 * h)));
            const __m512i slo = _mm512_permutexvar_epi16(ilo, sc16);
            const __m512i shi = _mm512_permutexvar_epi16(_mm512_add_epi16(ilo, step1), sc16);
            for (int m = 0; m < mr; m++) { /* x in zmm order (qk_zmm_order) */
                const int8_t *qx = a->q + m * K + 256 * b + 128 * h;
                const __m512i xlo = _mm512_loadu_si512((const void *)qx);
                const __m512i xhi = _mm512_loadu_si512((const void *)(qx + 64));
                isum[m] = _mm512_dpwssd_epi32(isum[m], _mm512_maddubs_epi16(lo, xlo), slo);
                isum[m] = _mm512_dpwssd_epi32(isum[m], _mm512_maddubs_epi16(hi, xhi), shi);
            }
        }
        for (int m = 0; m < mr; m++) {
            const int16_t *bs = a->bs + m * (K / 16) + 16 * b;
            const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs),
                                                 _mm_loadu_si128((const __m128i *)(bs + 8)));
            const float dx = a->d[m * nb + b];
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_set1_ps(d * dx), acc[m]);
            accm[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, pairs)),
                                   _mm_set1_ps(dmin * dx), accm[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        __m128 t = _mm_add_ps(accm[m], _mm_movehl_ps(accm[m], accm[m]));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        s[m] = _mm512_reduce_add_ps(acc[m]) - _mm_cvtss_f32(t);
    }
}
#include "qdot_drive.c" /* the panels' driver: x's row blocks, the threads */
#include "qdot_gemm.c" /* many rows: Q4_K, Q5_K, Q6_K panels unpacked once for vpdpbusd */
#include "qdot_gemm32.c" /* and the 32-block types' */
#include "qdot_row32_zmm.c" /* one row of x against Q4_0, Q4_1: eight blocks at a time */
#else
#include "qdot_drive.c"
#include "qdot_gemm8.c" /* many rows: Q4_K, Q5_K, Q6_K panels of 8 features for maddubs */
#include "qdot_gemm8_32.c" /* and the 32-block types' with 4- or 5-bit quants */
#include "qdot_row32.c" /* one row of x against Q4_0, Q4_1: eight blocks at a time */
#endif

static inline __attribute__((always_inline)) void IF(row)(
    const int mr, const uint8_t *p, int64_t row_bytes, int qtype, const acts_t *a,
    float s[IDOT_ROWS]) {
    if (qtype == Q4_K || qtype == Q5_K)
#ifdef IDOT_ZMM
        IF(row_qk_zmm)(mr, p, qtype, a, s);
#else
        IF(row_qk)(mr, p, qtype, a, s);
#endif
    else if (qtype == Q6_K)
        IF(row_q6k)(mr, p, a, s);
    else
        IF(row32)(mr, p, row_bytes, qtype, a, s);
}

#include "qdot_calls.c" /* qlinear_int and its team form over the kernels above */

#undef IF
#undef IDOT_SUFFIX
#undef IDOT
