/* Many rows of x against the 32-block types with a 4- or 5-bit quant (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q4_1R) on AVX2 (`maddubs`, no AVX512-VNNI): qdot_gemm32.c's panels in 256-bit
 * vectors, 8 features a panel, on qdot_gemm8.c's loads and qdot_drive.c's driver. Included
 * by qdot_body.c in its AVX2 and AVX-VNNI copies after qdot_gemm8.c; taken from
 * gemm8_rows() rows where qdot.c's int_rows_for sends these types' rows to the integer path
 * (int8 mode; `auto-big`'s batches). Q8_0 stays on the row kernels: its u8 values (w + 128)
 * times x would overflow maddubs' int16 pairs, which the row kernels avoid by moving w's
 * sign onto x, a trick a panel (x broadcast across the features) cannot use.
 *
 * Per block and row: 8 maddubs (4 bytes of x broadcast each) added in int16 (Q4 values
 * 0..15: 8 quads, 30,480 at most; Q5 0..31: 4 quads, then a madd), one madd by ones into
 * int32, the integer offset (Q4_0 8, Q5_0 16) times x's block sum subtracted (exact), one
 * convert and one fma by d dx; the types with a minimum add m dx sum(x) (a->s). The same
 * integers as the row kernels: `linear_int8` within the tests' 2e-6. */

#ifndef G8_32_DEFINED /* once for both copies */
#define G8_32_DEFINED
typedef struct {
    __m256i q[8]; /* quad g (k = 4g .. 4g + 3) of every feature, u8 */
    __m256 d, m;  /* per feature: d, and m where the type has a minimum */
} g8b_blk_t;
static inline int g8b_type(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q4_1R;
}
#endif

/* 16 bytes at p of each of the panel's rows (as g8_load_t8) as 4 dwords across the features:
 * t[i] lane l = dword i of row l */
static inline void IF(g8_load_t4)(const uint8_t *p, int64_t stride, int nf, __m256i t[4]) {
    __m256i v[4];
    for (int k = 0; k < 4; k++) /* row k in the low 128-bit lane, row 4 + k in the high */
        v[k] = _mm256_loadu2_m128i((const __m128i *)(p + (4 + k < nf ? 4 + k : nf - 1) * stride),
                                   (const __m128i *)(p + (k < nf ? k : nf - 1) * stride));
    const __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), b = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i c = _mm256_unpacklo_epi32(v[2], v[3]), d = _mm256_unpackhi_epi32(v[2], v[3]);
    t[0] = _mm256_unpacklo_epi64(a, c), t[1] = _mm256_unpackhi_epi64(a, c);
    t[2] = _mm256_unpacklo_epi64(b, d), t[3] = _mm256_unpackhi_epi64(b, d);
}

/* features n0 .. n0 + nf - 1 (nf <= 8) of every block, unpacked into o; the next panel's nn
 * features fetched meanwhile */
static void IF(g8b_unpack)(const uint8_t *w, int64_t row_bytes, int64_t nb, int qtype,
                           int64_t n0, int nf, int nn, void *blocks) {
    g8b_blk_t *o = blocks;
    const uint8_t *p0 = w + n0 * row_bytes;
    const int rep = qtype == Q4_1R, five = qtype == Q5_0 || qtype == Q5_1;
    const int mins = qtype == Q4_1 || qtype == Q5_1 || rep;
    const int64_t bytes = rep ? 0 : row_bytes / nb;
    const int nib = qtype == Q4_0 ? 2 : qtype == Q5_1 ? 8 : qtype == Q5_0 ? 6 : 4;
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    idx = _mm256_mullo_epi32(_mm256_min_epi32(idx, _mm256_set1_epi32(nf - 1)),
                             _mm256_set1_epi32((int)row_bytes));
    const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
    const __m256i spread = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0,
                                             0x04040404, 0x08080808, 0x0c0c0c0c);
#define GATHER(at) _mm256_i32gather_epi32((const int *)(at), idx, 1)
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *blk = p0 + b * bytes;
        __m256i t[4];
        if (rep) { /* Q4_1R: a row's d's, then its m's, then its nibbles, 16 bytes a block */
            for (int l = 0; l < nn && (b & 3) == 0; l++)
                __builtin_prefetch(p0 + (8 + l) * row_bytes + 4 * nb + 16 * b, 0, 2);
            o->d = IF(g8_f16)(GATHER(p0 + 2 * b), 0);
            o->m = IF(g8_f16)(GATHER(p0 + 2 * nb + 2 * b), 0);
            IF(g8_load_t4)(p0 + 4 * nb + 16 * b, row_bytes, nf, t);
        } else {
            if (((b * bytes) & 63) < bytes)
                for (int l = 0; l < nn; l++) __builtin_prefetch(blk + (8 + l) * row_bytes, 0, 2);
            const __m256i head = GATHER(blk); /* d, and m for Q4_1 / Q5_1 */
            o->d = IF(g8_f16)(head, 0);
            if (mins) o->m = IF(g8_f16)(head, 1);
            IF(g8_load_t4)(blk + nib, row_bytes, nf, t);
        }
        for (int c = 0; c < 4; c++) { /* dword c of the nibbles: values 4c .., 16 + 4c .. */
            o->q[c] = _mm256_and_si256(t[c], low);
            o->q[4 + c] = _mm256_and_si256(_mm256_srli_epi32(t[c], 4), low);
        }
        if (five) { /* value k's fifth bit: bit k of qh (Q5_0 bytes 2..5, Q5_1 4..7) */
            const __m256i qh = GATHER(blk + (qtype == Q5_1 ? 4 : 2));
            for (int g = 0; g < 8; g++) { /* quad g's bits: byte g / 2 of qh, from bit 4 (g & 1) */
                const __m256i by = _mm256_shuffle_epi8(qh, _mm256_add_epi8(spread, _mm256_set1_epi8((char)(g >> 1))));
                const __m256i bit = _mm256_set1_epi32(g & 1 ? (int)0x80402010 : 0x08040201);
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(by, bit), bit);
                o->q[g] = _mm256_add_epi8(o->q[g], _mm256_and_si256(set, sixteen));
            }
        }
    }
#undef GATHER
}

/* rows m0 .. m0 + mr - 1 of x against the unpacked panel into out's features n0 .. n0 + nf
 * - 1 (+ bias). mins: the type's minimum (m * a->s), else xo: the integer offset times x's
 * block sums. run: quads whose int16 pairs are added before the madd. */
static inline __attribute__((always_inline)) void IF(g8b_rows)(
    const int mr, const int mins, const int run, const g8b_blk_t *o, const acts_t *a,
    const int32_t *xo, int64_t m0, int64_t n0, int nf, const float *bias, float *out,
    int64_t ldo) {
    const int64_t nb = a->nb, K = a->K;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 tot[G8_MR];
    for (int m = 0; m < mr; m++) tot[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *xq = (const uint8_t *)a->q + m0 * K + 32 * b;
        __m256i is[G8_MR];
        for (int m = 0; m < mr; m++) is[m] = _mm256_setzero_si256();
        for (int g0 = 0; g0 < 8; g0 += run) {
            __m256i s16[G8_MR];
            for (int m = 0; m < mr; m++) s16[m] = _mm256_setzero_si256();
            for (int g = g0; g < g0 + run; g++) {
                const __m256i wq = o->q[g];
                for (int m = 0; m < mr; m++)
                    s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(
                        wq, _mm256_set1_epi32((int)rd32(xq + m * K + 4 * g))));
            }
            for (int m = 0; m < mr; m++)
                is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(s16[m], ones));
        }
        for (int m = 0; m < mr; m++) {
            const int64_t i = (m0 + m) * nb + b;
            if (!mins) is[m] = _mm256_sub_epi32(is[m], _mm256_set1_epi32(xo[i]));
            tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]),
                                     _mm256_mul_ps(o->d, _mm256_set1_ps(a->d[i])), tot[m]);
            if (mins) tot[m] = _mm256_fmadd_ps(o->m, _mm256_set1_ps(a->s[i]), tot[m]);
        }
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nf), lanes);
    const __m256 bv = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
    for (int m = 0; m < mr; m++)
        _mm256_maskstore_ps(out + (m0 + m) * ldo + n0, mask, _mm256_add_ps(tot[m], bv));
}

#define G8B_CASES(mins, run)                                                               \
    switch (mr) {                                                                          \
    case 4: IF(g8b_rows)(4, mins, run, o, a, xo, m0, n0, nf, bias, out, ldo); break;       \
    case 3: IF(g8b_rows)(3, mins, run, o, a, xo, m0, n0, nf, bias, out, ldo); break;       \
    case 2: IF(g8b_rows)(2, mins, run, o, a, xo, m0, n0, nf, bias, out, ldo); break;       \
    default: IF(g8b_rows)(1, mins, run, o, a, xo, m0, n0, nf, bias, out, ldo); break;      \
    }
/* rows m0 .. m1 - 1 against the unpacked panel, G8_MR at a time (`qtype` names the type) */
static void IF(g8b_panel)(int qtype, const void *blocks, const acts_t *a, const void *sums,
                          int64_t m0, int64_t m1, int64_t n0, int nf, const float *bias,
                          float *out, int64_t ldo) {
    const g8b_blk_t *o = blocks;
    const int32_t *xo = sums;
    for (; m0 < m1; m0 += G8_MR) {
        const int64_t mr = m1 - m0 < G8_MR ? m1 - m0 : G8_MR;
        if (qtype == Q5_0)
            G8B_CASES(0, 4)
        else if (qtype == Q5_1)
            G8B_CASES(1, 4)
        else if (qtype == Q4_0)
            G8B_CASES(0, 8)
        else
            G8B_CASES(1, 8)
    }
}
#undef G8B_CASES

/* out = x w^T (+ bias) over AVX2's panels, x already quantized (a): a K type's (qdot_gemm8.c,
 * x's sums over 32 for Q4_K / Q5_K's minima) or a g8b_type's (x's block sums times the
 * type's offset); -2 on no memory */
static int IF(qlinear_gemm8)(const acts_t *a, int64_t M, const uint8_t *w, int64_t N,
                             int64_t row_bytes, int qtype, const float *bias, float *out,
                             int64_t ldo, int threads) {
    static const IF(gemm_kind_t) k_kind = {sizeof(g8_blk_t), 8, G8_MR, IF(g8_unpack),
                                           IF(g8_panel)};
    static const IF(gemm_kind_t) kind32 = {sizeof(g8b_blk_t), 8, G8_MR, IF(g8b_unpack),
                                           IF(g8b_panel)};
    const int k = idot_block(qtype) == 256, off = g32_offset(qtype);
    void *sums = k ? (qtype == Q6_K ? NULL : (void *)IF(gemm_sums32)(a, M))
                   : (void *)IF(g32_sums)(a, M, off);
    if (!sums && (k ? qtype != Q6_K : off != 0)) return -2;
    const int status = IF(gemm_drive)(k ? &k_kind : &kind32, qtype, sums, a, M, w, N,
                                      row_bytes, qtype, bias, out, ldo, threads);
    free(sums);
    return status;
}
