/* Many rows of x against Q4_K, Q5_K and Q6_K weights on AVX2 (`maddubs`, no AVX512-VNNI):
 * qdot_gemm.c's scheme in 256-bit vectors, for batched decode steps and prefill chunks on
 * CPUs such as AMD Zen 2 / Zen 3. Included by qdot_body.c in its AVX2 and AVX-VNNI copies
 * (which have AVX2's maddubs), after qdot_drive.c; taken from gemm8_rows() rows through
 * qlinear_gemm8 (in qdot_gemm8_32.c, the entry of both families' panels).
 *
 * Why: the row kernels unpack a weight row for every 4 rows of x and spend two multiplies on
 * each 32 weights and row (maddubs, then madd by the sub-block scales). Here a panel of 8
 * weight rows (features) is unpacked once per block of x's rows, quad g (k = 4g .. 4g + 3)
 * of all 8 in one vector (feature l in 32-bit lane l), so a maddubs with four bytes of a row
 * of x broadcast makes 32 products into the 8 features' int16 pairs. Those pairs are added
 * in int16 over as many quads as cannot overflow (a pair is at most 2 x 127 x the largest
 * value: Q4_K 15 -> 8 quads, Q5_K 31 -> 4, Q6_K 63 -> 2), and one madd by ones gives the
 * features' int32 sums: about one multiply per 32 products.
 *
 * Numerics: qdot_gemm.c's, the same integers (each sub-block's sum exact in int32), d * sc_j
 * rounded once, sub-blocks summed in fp32: `linear_int8` within the tests' 2e-6. */

#ifndef G8_MR /* once for both copies */
#define G8_MR 4 /* rows of x a panel's vectors are loaded for */

/* one 256-block of an 8-feature panel, unpacked */
typedef struct {
    __m256i q[64]; /* quad g of every feature (u8: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) */
    __m256i sc[16]; /* sc_j per feature, twice (int16 pairs): sub-blocks of 32 (Q4_K, Q5_K:
                     * 8) or 16 (Q6_K) */
    __m256 d;       /* per feature */
    __m256i mn[8]; /* int16 pairs (mn_2i, mn_2i+1) (Q4_K, Q5_K: 4), Q6_K (sc_2i, sc_2i+1) */
    __m256 dm;     /* what those pairs' sums are scaled by: -dmin, Q6_K -32 d */
} g8_blk_t;
#endif

/* 32 bytes at p of each of the panel's rows (row l at p + l * stride; rows from nf repeat
 * row nf - 1, whose outputs are not stored), transposed: r[i] lane l = dword i of row l */
static inline void IF(g8_load_t8)(const uint8_t *p, int64_t stride, int nf, __m256i r[8]) {
    __m256i t[8];
    for (int l = 0; l < 8; l++)
        t[l] = _mm256_loadu_si256((const __m256i *)(p + (l < nf ? l : nf - 1) * stride));
    for (int i = 0; i < 8; i += 4) { /* in each 128-bit lane, rows i .. i + 3 as columns */
        const __m256i a = _mm256_unpacklo_epi32(t[i], t[i + 1]);
        const __m256i b = _mm256_unpackhi_epi32(t[i], t[i + 1]);
        const __m256i c = _mm256_unpacklo_epi32(t[i + 2], t[i + 3]);
        const __m256i d = _mm256_unpackhi_epi32(t[i + 2], t[i + 3]);
        t[i] = _mm256_unpacklo_epi64(a, c), t[i + 1] = _mm256_unpackhi_epi64(a, c);
        t[i + 2] = _mm256_unpacklo_epi64(b, d), t[i + 3] = _mm256_unpackhi_epi64(b, d);
    } /* t[i + c] lanes: dword c (low half) and 4 + c (high half) of rows i .. i + 3 */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(t[c], t[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(t[c], t[4 + c], 0x31);
    }
}

/* fp16 in the low (hi = 0) or high half of each dword, as floats */
static inline __m256 IF(g8_f16)(__m256i v, int hi) {
    v = hi ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

static inline __m256i IF(g8_shr)(__m256i v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }

/* the panel's block scales, feature l in lane l (qdot_gemm.c's gemm_scales in 8 lanes) */
static inline void IF(g8_scales)(const uint8_t *p, __m256i idx, int qtype, g8_blk_t *o) {
#define GATHER(off) _mm256_i32gather_epi32((const int *)(p + (off)), idx, 1)
    if (qtype == Q6_K) {
        const __m256 d = IF(g8_f16)(GATHER(206), 1); /* d: bytes 208, 209 */
        const __m256i lo16 = _mm256_set1_epi32(0xffff);
        for (int i = 0; i < 4; i++) {
            const __m256i v = GATHER(192 + 4 * i);
            __m256i s[4];
            for (int t = 0; t < 4; t++)
                s[t] = _mm256_srai_epi32(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * t)), 24);
            for (int t = 0; t < 4; t++)
                o->sc[4 * i + t] = _mm256_or_si256(_mm256_and_si256(s[t], lo16), _mm256_slli_epi32(s[t], 16));
            o->mn[2 * i] = _mm256_or_si256(_mm256_and_si256(s[0], lo16), _mm256_slli_epi32(s[1], 16));
            o->mn[2 * i + 1] = _mm256_or_si256(_mm256_and_si256(s[2], lo16), _mm256_slli_epi32(s[3], 16));
        }
        o->d = d, o->dm = _mm256_mul_ps(d, _mm256_set1_ps(-32.f));
        return;
    }
    const __m256i dd = GATHER(0), wa = GATHER(4), wb = GATHER(8), wc = GATHER(12);
#undef GATHER
    const __m256 d = IF(g8_f16)(dd, 0);
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3);
    __m256i mn[8];
    for (int j = 0; j < 8; j++) {
        const int s8 = 8 * (j & 3);
        __m256i sc;
        if (j < 4) {
            sc = _mm256_and_si256(IF(g8_shr)(wa, s8), m63);
            mn[j] = _mm256_and_si256(IF(g8_shr)(wb, s8), m63);
        } else { /* low (scale) or high (min) nibble of c, with a's or b's top 2 bits above */
            const __m256i c = IF(g8_shr)(wc, s8);
            sc = _mm256_or_si256(_mm256_and_si256(c, m15),
                                 _mm256_slli_epi32(_mm256_and_si256(IF(g8_shr)(wa, s8 + 6), m3), 4));
            mn[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), m15),
                                    _mm256_slli_epi32(_mm256_and_si256(IF(g8_shr)(wb, s8 + 6), m3), 4));
        }
        o->sc[j] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
    }
    for (int i = 0; i < 4; i++) o->mn[i] = _mm256_or_si256(mn[2 * i], _mm256_slli_epi32(mn[2 * i + 1], 16));
    o->d = d, o->dm = _mm256_sub_ps(_mm256_setzero_ps(), IF(g8_f16)(dd, 1));
}

/* features n0 .. n0 + nf - 1 (nf <= 8) of every block, unpacked into o (the quads' layout:
 * qdot_gemm.c's gemm_q4k and gemm_q6k); the next panel's nn features fetched meanwhile */
static void IF(g8_unpack)(const uint8_t *w, int64_t row_bytes, int64_t nb, int qtype,
                          int64_t n0, int nf, int nn, void *blocks) {
    g8_blk_t *o = blocks;
    const int64_t stride = qtype == Q6_K ? 210 : qtype == Q5_K ? 176 : 144;
    const int five = qtype == Q5_K;
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    idx = _mm256_mullo_epi32(_mm256_min_epi32(idx, _mm256_set1_epi32(nf - 1)),
                             _mm256_set1_epi32((int)row_bytes));
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *p = w + n0 * row_bytes + b * stride;
        for (int l = 0; l < nn; l++)
            for (int64_t at = 0; at < stride; at += 64)
                __builtin_prefetch(p + (8 + l) * row_bytes + at, 0, 2);
        IF(g8_scales)(p, idx, qtype, o);
        if (qtype == Q6_K) { /* quad g (half h, r = g % 32): ql dword 16h + r % 16 from bit
                              * 4 (r / 16), qh dword 8h + r % 8 from bit 2 (r / 8) */
            __m256i ql[32], qh[16];
            for (int i = 0; i < 4; i++) IF(g8_load_t8)(p + 32 * i, row_bytes, nf, ql + 8 * i);
            for (int i = 0; i < 2; i++) IF(g8_load_t8)(p + 128 + 32 * i, row_bytes, nf, qh + 8 * i);
            const __m256i top = _mm256_set1_epi8(0x30);
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++) { /* quads r = i and i + 16 of half h */
                    const __m256i l = ql[16 * h + i];
                    const __m256i t = i < 8 ? qh[8 * h + i] : _mm256_srli_epi32(qh[8 * h + i - 8], 2);
                    o->q[32 * h + i] = _mm256_or_si256(
                        _mm256_and_si256(l, low), _mm256_and_si256(_mm256_slli_epi32(t, 4), top));
                    o->q[32 * h + 16 + i] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi32(l, 4), low), _mm256_and_si256(t, top));
                }
            continue;
        }
        /* Q4_K, Q5_K: qs dword 8c + i holds values 4i .. 4i + 3 of sub-blocks 2c (low
         * nibbles) and 2c + 1 (high): quads 16c + i and 16c + 8 + i; Q5_K's fifth bits of
         * both: bits 2c and 2c + 1 of qh dword i */
        __m256i h[8], t[8];
        if (five) IF(g8_load_t8)(p + 16, row_bytes, nf, h);
        for (int c = 0; c < 4; c++) {
            IF(g8_load_t8)(p + (five ? 48 : 16) + 32 * c, row_bytes, nf, t);
            for (int i = 0; i < 8; i++) {
                __m256i lo = _mm256_and_si256(t[i], low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi32(t[i], 4), low);
                if (five) {
                    const __m256i hb = IF(g8_shr)(h[i], 2 * c);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(hb, one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(
                        _mm256_and_si256(_mm256_srli_epi32(hb, 1), one), 4));
                }
                o->q[16 * c + i] = lo, o->q[16 * c + 8 + i] = hi;
            }
        }
    }
}

/* rows m0 .. m0 + mr - 1 of x against the unpacked panel into out's features n0 .. n0 + nf
 * - 1 (+ bias). xp: Q4_K / Q5_K x's sums over 32 as int16 (8 a block and row); Q6_K reads
 * x's sums over 16. run: quads whose int16 pairs are added before the madd by the scales. */
static inline __attribute__((always_inline)) void IF(g8_rows)(
    const int mr, const int six, const int run, const g8_blk_t *o, const acts_t *a,
    const int16_t *xp, int64_t m0, int64_t n0, int nf, const float *bias, float *out,
    int64_t ldo) {
    const int nsub = six ? 16 : 8, quads = six ? 4 : 8;
    const int64_t nb = a->nb, K = a->K;
    __m256 tot[G8_MR];
    for (int m = 0; m < mr; m++) tot[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *xq = (const uint8_t *)a->q + m0 * K + 256 * b;
        __m256i is[G8_MR]; /* the block's sum_j sc_j (q . x)_j: exact (< 2^28) */
        for (int m = 0; m < mr; m++) is[m] = _mm256_setzero_si256();
        for (int j = 0; j < nsub; j++) {
            for (int g0 = 0; g0 < quads; g0 += run) {
                __m256i s16[G8_MR];
                for (int m = 0; m < mr; m++) s16[m] = _mm256_setzero_si256();
                for (int g = g0; g < g0 + run; g++) {
                    const __m256i wq = o->q[j * quads + g];
                    for (int m = 0; m < mr; m++)
                        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(
                            wq, _mm256_set1_epi32((int)rd32(xq + m * K + 4 * (j * quads + g)))));
                }
                for (int m = 0; m < mr; m++)
                    is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(s16[m], o->sc[j]));
            }
        }
        for (int m = 0; m < mr; m++) {
            const int16_t *pairs = six ? a->bs + (m0 + m) * (K / 16) + 16 * b
                                       : xp + ((m0 + m) * nb + b) * 8;
            __m256i im = _mm256_setzero_si256();
            for (int i = 0; i < nsub / 2; i++)
                im = _mm256_add_epi32(im, _mm256_madd_epi16(o->mn[i], _mm256_set1_epi32(
                    (int)rd32((const uint8_t *)(pairs + 2 * i)))));
            const __m256 dx = _mm256_set1_ps(a->d[(m0 + m) * nb + b]);
            tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_mul_ps(o->d, dx), tot[m]);
            tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(o->dm, dx), tot[m]);
        }
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nf), lanes);
    const __m256 bv = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
    for (int m = 0; m < mr; m++)
        _mm256_maskstore_ps(out + (m0 + m) * ldo + n0, mask, _mm256_add_ps(tot[m], bv));
}

#define G8_CASES(six, run)                                                                 \
    switch (mr) {                                                                          \
    case 4: IF(g8_rows)(4, six, run, o, a, xp, m0, n0, nf, bias, out, ldo); break;         \
    case 3: IF(g8_rows)(3, six, run, o, a, xp, m0, n0, nf, bias, out, ldo); break;         \
    case 2: IF(g8_rows)(2, six, run, o, a, xp, m0, n0, nf, bias, out, ldo); break;         \
    default: IF(g8_rows)(1, six, run, o, a, xp, m0, n0, nf, bias, out, ldo); break;        \
    }
/* rows m0 .. m1 - 1 against the unpacked panel, G8_MR at a time (qtype in `qtype`) */
static void IF(g8_panel)(int qtype, const void *blocks, const acts_t *a, const void *sums,
                         int64_t m0, int64_t m1, int64_t n0, int nf, const float *bias,
                         float *out, int64_t ldo) {
    const g8_blk_t *o = blocks;
    const int16_t *xp = sums;
    for (; m0 < m1; m0 += G8_MR) {
        const int64_t mr = m1 - m0 < G8_MR ? m1 - m0 : G8_MR;
        if (qtype == Q6_K)
            G8_CASES(1, 2)
        else if (qtype == Q5_K)
            G8_CASES(0, 4)
        else
            G8_CASES(0, 8)
    }
}
#undef G8_CASES
