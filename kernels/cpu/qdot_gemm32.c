/* Many rows of x against the 32-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_1R, Q4_1 as
 * held where the kernels run AVX-512) with 512-bit `vpdpbusd`: qdot_gemm.c's panels for x
 * quantized in blocks of 32. Included by qdot_body.c in its AVX512-VNNI copy only, after
 * qdot_gemm.c, whose GEMM_MR, f16 helper and stores it shares (and qdot_drive.c's driver:
 * x's row blocks, threads, prefetch of the next panel); taken
 * from INT_GEMM_ROWS where qdot.c's int_rows_for sends those types' rows to the integer path
 * (without AMX-INT8 every row count; with it up to 40 or 63 rows: see there, and the
 * figures that set it).
 *
 * A panel is 16 weight rows (features) unpacked once per block of x's rows: per 32-block,
 * the 8 quads of all 16 features as u8 (feature l in 32-bit lane l: Q4 0..15, Q5 0..31,
 * Q8_0 w + 128) and the features' d and m as floats. Loading: 16 bytes of each feature's
 * block, feature 4j + k in 128-bit lane j of vector k, so that the in-lane 4 x 4 dword
 * transposes leave the features in order; the nibbles are then split per byte in place.
 * Per block and row of x: 8 vpdpbusd (4 bytes of x broadcast each), the integer offset
 * (Q4_0 8, Q5_0 16, Q8_0 128) times x's block sum subtracted in int32 (exact), one convert
 * and one fma by d dx; Q4_1 / Q5_1 / Q4_1R add m * dx sum(x) (a->s) as the row kernels do.
 *
 * Numerics: every block's integer dot exact in int32 (|sum| < 2^21), d * dx rounded once,
 * blocks summed in fp32: `linear_int8`'s result within the tests' 2e-6 of the largest. */

typedef struct {
    __m512i q[8]; /* quad g (k = 4g .. 4g + 3) of every feature, u8 */
    __m512 d, m;  /* per feature: d, and m where the type has a minimum */
} g32_blk_t;

/* 16 bytes at p + l * stride for each of the panel's rows l (from nf: zero) as 4 dwords
 * across the features: t[i] lane l = dword i of row l */
static inline void IF(g32_load4)(const uint8_t *p, int64_t stride, int nf, __m512i t[4]) {
#define LD(l) ((l) < nf ? _mm_loadu_si128((const __m128i *)(p + (l) * stride)) : _mm_setzero_si128())
    __m512i r[4];
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_castsi128_si512(LD(k));
        v = _mm512_inserti32x4(v, LD(4 + k), 1);
        v = _mm512_inserti32x4(v, LD(8 + k), 2);
        r[k] = _mm512_inserti32x4(v, LD(12 + k), 3);
    }
#undef LD
    const __m512i a = _mm512_unpacklo_epi32(r[0], r[1]), b = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i c = _mm512_unpacklo_epi32(r[2], r[3]), d = _mm512_unpackhi_epi32(r[2], r[3]);
    t[0] = _mm512_unpacklo_epi64(a, c), t[1] = _mm512_unpackhi_epi64(a, c);
    t[2] = _mm512_unpacklo_epi64(b, d), t[3] = _mm512_unpackhi_epi64(b, d);
}

/* features n0 .. n0 + nf - 1 (nf <= 16; the rest zero) of every block, unpacked into o; the
 * next panel's nn features fetched meanwhile (as qdot_gemm.c's gemm_unpack) */
static void IF(g32_unpack)(const uint8_t *w, int64_t row_bytes, int64_t nb, int qtype,
                           int64_t n0, int nf, int nn, void *blocks) {
    g32_blk_t *o = blocks;
    const uint8_t *p0 = w + n0 * row_bytes;
    const int rep = qtype == Q4_1R, five = qtype == Q5_0 || qtype == Q5_1;
    const int64_t bytes = rep ? 0 : row_bytes / nb;
    const int nib = qtype == Q4_0 || qtype == Q8_0 ? 2 : qtype == Q5_1 ? 8 : qtype == Q5_0 ? 6 : 4;
    const __m512i low = _mm512_set1_epi8(15), x80 = _mm512_set1_epi8((char)0x80);
    const __m512i spread = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *blk = p0 + b * bytes;
        __m512i h[4], t[4];
        if (rep) {
            for (int l = 0; l < nn && (b & 3) == 0; l++) {
                const uint8_t *q = p0 + (16 + l) * row_bytes;
                __builtin_prefetch(q + 4 * nb + 16 * b, 0, 2);
                if ((b & 31) == 0)
                    __builtin_prefetch(q + 2 * b, 0, 2), __builtin_prefetch(q + 2 * nb + 2 * b, 0, 2);
            }
            IF(g32_load4)(p0 + 2 * nb + 2 * b, row_bytes, nf, h);
            o->m = IF(gemm_f16)(h[0], 0);
            IF(g32_load4)(p0 + 2 * b, row_bytes, nf, h);
            IF(g32_load4)(p0 + 4 * nb + 16 * b, row_bytes, nf, t);
        } else {
            if (((b * bytes) & 63) < bytes)
                for (int l = 0; l < nn; l++) __builtin_prefetch(blk + (16 + l) * row_bytes, 0, 2);
            IF(g32_load4)(blk, row_bytes, nf, h);
            IF(g32_load4)(blk + nib, row_bytes, nf, t);
            o->m = IF(gemm_f16)(h[0], 1); /* Q4_1, Q5_1: m at bytes 2, 3 */
        }
        o->d = IF(gemm_f16)(h[0], 0);
        if (qtype == Q8_0) {
            for (int c = 0; c < 4; c++) o->q[c] = _mm512_xor_si512(t[c], x80);
            IF(g32_load4)(blk + 18, row_bytes, nf, t);
            for (int c = 0; c < 4; c++) o->q[4 + c] = _mm512_xor_si512(t[c], x80);
            continue;
        }
        for (int c = 0; c < 4; c++) { /* dword c of the nibbles: values 4c .., 16 + 4c .. */
            o->q[c] = _mm512_and_si512(t[c], low);
            o->q[4 + c] = _mm512_and_si512(_mm512_srli_epi32(t[c], 4), low);
        }
        if (five) { /* value k's fifth bit: bit k of qh (Q5_0 bytes 2..5, Q5_1 4..7) */
            const __m512i qh = qtype == Q5_1 ? h[1]
                : _mm512_or_si512(_mm512_srli_epi32(h[0], 16), _mm512_slli_epi32(h[1], 16));
            const __m512i sixteen = _mm512_set1_epi8(16);
            for (int g = 0; g < 8; g++) { /* quad g's bits: byte g / 2 of qh, from bit 4 (g & 1) */
                const __m512i by = _mm512_shuffle_epi8(qh, _mm512_add_epi8(spread, _mm512_set1_epi8((char)(g >> 1))));
                const __mmask64 k = _mm512_test_epi8_mask(
                    by, _mm512_set1_epi32(g & 1 ? (int)0x80402010 : 0x08040201));
                o->q[g] = _mm512_mask_add_epi8(o->q[g], k, o->q[g], sixteen);
            }
        }
    }
}

/* rows m0 .. m0 + mr - 1 of x against the unpacked panel: tot[m] = its 16 outputs. mins:
 * the type's minimum (m * a->s), else xo: the integer offset times x's block sums. */
static inline __attribute__((always_inline)) void IF(g32_rows)(
    const int mr, const int mins, const g32_blk_t *o, const acts_t *a, const int32_t *xo,
    int64_t m0, __m512 tot[GEMM_MR]) {
    const int64_t nb = a->nb, K = a->K;
    for (int m = 0; m < mr; m++) tot[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *xq = (const uint8_t *)a->q + m0 * K + 32 * b;
        __m512i is[GEMM_MR];
        for (int m = 0; m < mr; m++) is[m] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {
            const __m512i wq = o->q[g];
            for (int m = 0; m < mr; m++)
                is[m] = _mm512_dpbusd_epi32(is[m], wq, _mm512_set1_epi32((int)rd32(xq + m * K + 4 * g)));
        }
        for (int m = 0; m < mr; m++) {
            const int64_t i = (m0 + m) * nb + b;
            if (!mins) is[m] = _mm512_sub_epi32(is[m], _mm512_set1_epi32(xo[i]));
            tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[m]),
                                     _mm512_mul_ps(o->d, _mm512_set1_ps(a->d[i])), tot[m]);
            if (mins) tot[m] = _mm512_fmadd_ps(o->m, _mm512_set1_ps(a->s[i]), tot[m]);
        }
    }
}

static inline __attribute__((always_inline)) void IF(g32_store)(
    const int mr, const int mins, const g32_blk_t *o, const acts_t *a, const int32_t *xo,
    int64_t m0, int64_t n0, int nf, const float *bias, float *out, int64_t ldo) {
    __m512 tot[GEMM_MR];
    IF(g32_rows)(mr, mins, o, a, xo, m0, tot);
    IF(gemm_put)(mr, tot, m0, n0, nf, bias, out, ldo);
}

#define G32_CASE(r, mins)                                                                  \
    case r: IF(g32_store)(r, mins, o, a, xo, m0, n0, nf, bias, out, ldo); break
/* rows m0 .. m1 - 1 against the unpacked panel, GEMM_MR at a time */
static void IF(g32_panel)(int mins, const void *blocks, const acts_t *a, const void *sums,
                          int64_t m0, int64_t m1, int64_t n0, int nf, const float *bias,
                          float *out, int64_t ldo) {
    const g32_blk_t *o = blocks;
    const int32_t *xo = sums;
    for (; m0 < m1; m0 += GEMM_MR) {
        const int64_t mr = m1 - m0 < GEMM_MR ? m1 - m0 : GEMM_MR;
        if (mins) switch (mr) {
            G32_CASE(8, 1); G32_CASE(7, 1); G32_CASE(6, 1); G32_CASE(5, 1);
            G32_CASE(4, 1); G32_CASE(3, 1); G32_CASE(2, 1); default: G32_CASE(1, 1);
            }
        else switch (mr) {
            G32_CASE(8, 0); G32_CASE(7, 0); G32_CASE(6, 0); G32_CASE(5, 0);
            G32_CASE(4, 0); G32_CASE(3, 0); G32_CASE(2, 0); default: G32_CASE(1, 0);
            }
    }
}
#undef G32_CASE

/* out = x w^T (+ bias) for a 32-block type, x already quantized (a); -2 on no memory */
static int IF(qlinear_gemm32)(const acts_t *a, int64_t M, const uint8_t *w, int64_t N,
                              int64_t row_bytes, int qtype, const float *bias, float *out,
                              int64_t ldo, int threads) {
    static const IF(gemm_kind_t) kind = {sizeof(g32_blk_t), 16, GEMM_MR, IF(g32_unpack),
                                         IF(g32_panel)};
    const int off = g32_offset(qtype);
    int32_t *xo = IF(g32_sums)(a, M, off);
    if (off && !xo) return -2;
    const int status =
        IF(gemm_drive)(&kind, !off, xo, a, M, w, N, row_bytes, qtype, bias, out, ldo, threads);
    free(xo);
    return status;
}
