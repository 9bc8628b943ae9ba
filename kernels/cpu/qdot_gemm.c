/* Many rows of x against Q4_K, Q5_K and Q6_K weights with 512-bit `vpdpbusd` (AVX512-VNNI):
 * batched decode steps and prefill chunks, at every row count from 5 on CPUs without AMX
 * (AMD Zen 4, or RADIXFLOW_QUANT_AMX=0), below the bf16 tile pass (64 rows) with it (qdot.c's
 * thresholds). Included by qdot_body.c in its AVX512-VNNI copy only (IDOT_ZMM), after the
 * row kernels, whose activations (acts_t) it shares. The 32-block types (Q4_0 .. Q8_0,
 * Q4_1R) take the same scheme on x's blocks of 32 in qdot_gemm32.c, included after this
 * file (its constants and gemm_f16 shared), up to 40 or 63 rows where AMX-INT8 is (qdot.c).
 *
 * Why: the row kernels unpack a weight row for every 4 rows of x and spend a maddubs and a
 * vpdpwssd on each 64 weights and row; from a few rows on, the weights are better unpacked
 * once and the rows of x run over them. Here a panel of 16 weight rows (features) is unpacked
 * once per block of x's rows into an int8 scratch laid out for vpdpbusd: quad g of a block
 * (k = 4g .. 4g + 3) of all 16 features in one vector, feature l in 32-bit lane l, so one
 * vpdpbusd with four bytes of a row of x broadcast adds 64 products into 16 outputs. Per
 * sub-block (32 values; Q6_K 16) and row the int32 sums take one convert and one fma by the
 * features' d * sc_j; the minima (Q6_K's -32 offset) one vpdpwssd per two sub-blocks.
 *
 * Numerics: the same integer products as the row kernels (each sub-block's sum exact in
 * int32); only the fp32 order differs (d * sc_j rounded once, sub-blocks summed in fp32), so
 * the result is `linear_int8`'s within the tests' 2e-6 of the largest value.
 *
 * Cache: x is read once per panel, so its rows are taken in blocks of about GEMM_XBYTES (in
 * L2 beside the panel) and each panel is unpacked once per such block. A 1 MB block ran 256
 * and 512 rows of 7B's shapes 1.15x faster than 384 KB (more unpacking), level with 4 MB:
 * a panel's 16 products a byte of x leave the reads of x from L3 cheap. */

#define GEMM_MR 8 /* rows of x a panel's vectors are loaded for: 8 x 3 accumulators in zmm */

/* one 256-block of a 16-feature panel, unpacked */
typedef struct {
    __m512i q[64]; /* quad g of every feature (u8: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) */
    __m512 sc[16]; /* d * sc_j per feature: sub-blocks of 32 (Q4_K, Q5_K: 8) or 16 (Q6_K) */
    __m512i mn[8]; /* int16 pairs (mn_2i, mn_2i+1) (Q4_K, Q5_K: 4), Q6_K (sc_2i, sc_2i+1) */
    __m512 dm;     /* what those pairs' sums are scaled by: -dmin, Q6_K -32 d */
} gemm_blk_t;

/* a 16 x 16 matrix of dwords (r[i] = row i) transposed in place: in-lane 4 x 4 transposes,
 * then the 4 x 4 matrix of 128-bit lanes of every fourth vector */
static inline void IF(gemm_t16)(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        const __m512i a = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        const __m512i b = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        const __m512i c = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        const __m512i d = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
        t[i] = _mm512_unpacklo_epi64(a, c), t[i + 1] = _mm512_unpackhi_epi64(a, c);
        t[i + 2] = _mm512_unpacklo_epi64(b, d), t[i + 3] = _mm512_unpackhi_epi64(b, d);
    } /* t[4a + c] lane L: column 4L + c of rows 4a .. 4a + 3 */
    for (int c = 0; c < 4; c++) {
        const __m512i u0 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x44);
        const __m512i u1 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xee);
        const __m512i u2 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(u0, u2, 0x88), r[4 + c] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
}

/* 16 dwords at p of each of the panel's rows (row l at p + l * stride; rows from nf read as
 * zero), transposed into r: r[i] lane l = dword i of row l. The bit fields are then split in
 * lanes, as the unpacking is the same for every byte: no shuffles per value. */
static inline void IF(gemm_load_t16)(const uint8_t *p, int64_t stride, int nf, __m512i r[16]) {
    for (int l = 0; l < 16; l++)
        r[l] = l < nf ? _mm512_loadu_si512((const void *)(p + l * stride)) : _mm512_setzero_si512();
    IF(gemm_t16)(r);
}

/* Q4_K, Q5_K: qs dword i holds values 4i' .. 4i' + 3 of sub-blocks 2c (low nibbles) and
 * 2c + 1 (high), c = i / 8, i' = i % 8: quads 16c + i' and 16c + 8 + i'; Q5_K's fifth bits
 * of both: bits 2c and 2c + 1 of qh dword i' */
static inline void IF(gemm_q4k)(const uint8_t *p, int64_t stride, int nf, int five,
                                gemm_blk_t *o) {
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    __m512i h[16], t[16];
    if (five) IF(gemm_load_t16)(p + 16, stride, nf, h);
    for (int e = 0; e < 2; e++) {
        IF(gemm_load_t16)(p + (five ? 48 : 16) + 64 * e, stride, nf, t);
        for (int i = 0; i < 16; i++) {
            const int c = 2 * e + (i >> 3), q = i & 7;
            __m512i lo = _mm512_and_si512(t[i], low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi32(t[i], 4), low);
            if (five) {
                const __m512i hb = _mm512_srlv_epi32(h[q], _mm512_set1_epi32(2 * c));
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(hb, one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(
                    _mm512_and_si512(_mm512_srli_epi32(hb, 1), one), 4));
            }
            o->q[16 * c + q] = lo, o->q[16 * c + 8 + q] = hi;
        }
    }
}

/* Q6_K: quad g (half h = g / 32, r = g % 32) takes its low 4 bits from ql dword 16h + r % 16
 * (the high nibbles from r = 16), its top 2 from qh dword 8h + r % 8 >> 2 (r / 8) */
static inline void IF(gemm_q6k)(const uint8_t *p, int64_t stride, int nf, gemm_blk_t *o) {
    const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    __m512i ql[32], qh[16];
    IF(gemm_load_t16)(p, stride, nf, ql);
    IF(gemm_load_t16)(p + 64, stride, nf, ql + 16);
    IF(gemm_load_t16)(p + 128, stride, nf, qh);
    for (int g = 0; g < 64; g++) {
        const int h = g >> 5, r = g & 31;
        const __m512i l4 = _mm512_srlv_epi32(ql[16 * h + (r & 15)], _mm512_set1_epi32(4 * (r >> 4)));
        const __m512i h2 = _mm512_srlv_epi32(qh[8 * h + (r & 7)], _mm512_set1_epi32(2 * (r >> 3)));
        o->q[g] = _mm512_or_si512(_mm512_and_si512(l4, low),
                                  _mm512_slli_epi32(_mm512_and_si512(h2, three), 4));
    }
}

/* fp16 in the low (hi = 0) or high half of each dword, as floats */
static inline __m512 IF(gemm_f16)(__m512i v, int hi) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

/* the panel's block scales gathered, feature l in lane l (k4_packed's fields, per lane) */
static inline void IF(gemm_scales)(const uint8_t *p, __m512i idx, __mmask16 mask, int qtype,
                                   gemm_blk_t *o) {
    const __m512i z = _mm512_setzero_si512();
#define GATHER(off) _mm512_mask_i32gather_epi32(z, mask, idx, (const void *)(p + (off)), 1)
    if (qtype == Q6_K) {
        const __m512 d = IF(gemm_f16)(GATHER(206), 1); /* d: bytes 208, 209 */
        for (int i = 0; i < 4; i++) {
            const __m512i v = GATHER(192 + 4 * i);
            __m512i s[4];
            for (int t = 0; t < 4; t++)
                s[t] = _mm512_srai_epi32(_mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * t)), 24);
            for (int t = 0; t < 4; t++) o->sc[4 * i + t] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s[t]));
            const __m512i lo16 = _mm512_set1_epi32(0xffff);
            o->mn[2 * i] = _mm512_or_si512(_mm512_and_si512(s[0], lo16), _mm512_slli_epi32(s[1], 16));
            o->mn[2 * i + 1] = _mm512_or_si512(_mm512_and_si512(s[2], lo16),
                                               _mm512_slli_epi32(s[3], 16));
        }
        o->dm = _mm512_mul_ps(d, _mm512_set1_ps(-32.f));
        return;
    }
    const __m512i dd = GATHER(0), wa = GATHER(4), wb = GATHER(8), wc = GATHER(12);
#undef GATHER
    const __m512 d = IF(gemm_f16)(dd, 0);
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
    __m512i mn[8];
    for (int j = 0; j < 8; j++) {
        const __m512i s8 = _mm512_set1_epi32(8 * (j & 3)), s6 = _mm512_set1_epi32(8 * (j & 3) + 6);
        __m512i sc;
        if (j < 4) {
            sc = _mm512_and_si512(_mm512_srlv_epi32(wa, s8), m63);
            mn[j] = _mm512_and_si512(_mm512_srlv_epi32(wb, s8), m63);
        } else {
            const __m512i c = _mm512_srlv_epi32(wc, s8);
            sc = _mm512_or_si512(_mm512_and_si512(c, m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(wa, s6), m3), 4));
            mn[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), m15),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(wb, s6), m3), 4));
        }
        o->sc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    }
    for (int i = 0; i < 4; i++) o->mn[i] = _mm512_or_si512(mn[2 * i], _mm512_slli_epi32(mn[2 * i + 1], 16));
    o->dm = _mm512_sub_ps(_mm512_setzero_ps(), IF(gemm_f16)(dd, 1));
}

/* features n0 .. n0 + nf - 1 (nf <= 16; the rest zero) of every block, unpacked into o;
 * the next panel's (nn features) fetched meanwhile, so that its reads from memory overlap
 * this panel's products instead of stalling its unpacking */
static void IF(gemm_unpack)(const uint8_t *w, int64_t row_bytes, int64_t nb, int qtype,
                            int64_t n0, int nf, int nn, void *blocks) {
    gemm_blk_t *o = blocks;
    const int64_t stride = qtype == Q6_K ? 210 : qtype == Q5_K ? 176 : 144;
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)row_bytes));
    const __mmask16 mask = (__mmask16)((1u << nf) - 1);
    for (int64_t b = 0; b < nb; b++, o++) {
        const uint8_t *p = w + n0 * row_bytes + b * stride;
        for (int l = 0; l < nn; l++)
            for (int64_t at = 0; at < stride; at += 64)
                __builtin_prefetch(p + (16 + l) * row_bytes + at, 0, 2);
        IF(gemm_scales)(p, idx, mask, qtype, o);
        if (qtype == Q6_K)
            IF(gemm_q6k)(p, row_bytes, nf, o);
        else
            IF(gemm_q4k)(p, row_bytes, nf, qtype == Q5_K, o);
    }
}

/* rows m0 .. m0 + mr - 1 of x against the unpacked panel: tot[m] = its 16 outputs. xp: for
 * Q4_K/Q5_K x's sums over 32 as int16 (8 a block and row), Q6_K reads x's sums over 16. */
static inline __attribute__((always_inline)) void IF(gemm_rows)(
    const int mr, const int six, const gemm_blk_t *o, const acts_t *a, const int16_t *xp,
    int64_t m0, __m512 tot[GEMM_MR]) {
    const int nsub = six ? 16 : 8, quads = six ? 4 : 8;
    const int64_t nb = a->nb, K = a->K;
    for (int m = 0; m < mr; m++) tot[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, o++) {
        __m512 fb[GEMM_MR];
        for (int m = 0; m < mr; m++) fb[m] = _mm512_setzero_ps();
        const uint8_t *xq = (const uint8_t *)a->q + m0 * K + 256 * b;
        for (int j = 0; j < nsub; j++) {
            __m512i is[GEMM_MR];
            for (int m = 0; m < mr; m++) is[m] = _mm512_setzero_si512();
            for (int g = 0; g < quads; g++) {
                const __m512i wq = o->q[j * quads + g];
                for (int m = 0; m < mr; m++)
                    is[m] = _mm512_dpbusd_epi32(
                        is[m], wq, _mm512_set1_epi32((int)rd32(xq + m * K + 4 * (j * quads + g))));
            }
            for (int m = 0; m < mr; m++)
                fb[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[m]), o->sc[j], fb[m]);
        }
        for (int m = 0; m < mr; m++) {
            const int16_t *pairs = six ? a->bs + (m0 + m) * (K / 16) + 16 * b
                                       : xp + ((m0 + m) * nb + b) * 8;
            __m512i im = _mm512_setzero_si512();
            for (int i = 0; i < nsub / 2; i++)
                im = _mm512_dpwssd_epi32(im, o->mn[i],
                                         _mm512_set1_epi32((int)rd32((const uint8_t *)(pairs + 2 * i))));
            fb[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), o->dm, fb[m]);
            tot[m] = _mm512_fmadd_ps(fb[m], _mm512_set1_ps(a->d[(m0 + m) * nb + b]), tot[m]);
        }
    }
}

/* mr rows' sums tot (+ bias) into out's features n0 .. n0 + nf - 1 from row m0 */
static inline __attribute__((always_inline)) void IF(gemm_put)(
    const int mr, const __m512 *tot, int64_t m0, int64_t n0, int nf, const float *bias,
    float *out, int64_t ldo) {
    const __mmask16 mask = (__mmask16)((1u << nf) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mr; m++)
        _mm512_mask_storeu_ps(out + (m0 + m) * ldo + n0, mask, _mm512_add_ps(tot[m], bv));
}

/* mr rows from m0 into out's features n0 .. n0 + nf - 1 */
static inline __attribute__((always_inline)) void IF(gemm_store)(
    const int mr, const int six, const gemm_blk_t *o, const acts_t *a, const int16_t *xp,
    int64_t m0, int64_t n0, int nf, const float *bias, float *out, int64_t ldo) {
    __m512 tot[GEMM_MR];
    IF(gemm_rows)(mr, six, o, a, xp, m0, tot);
    IF(gemm_put)(mr, tot, m0, n0, nf, bias, out, ldo);
}

#define GEMM_CASE(r, six)                                                                  \
    case r: IF(gemm_store)(r, six, o, a, xp, m0, n0, nf, bias, out, ldo); break
/* rows m0 .. m1 - 1 against the unpacked panel, GEMM_MR at a time */
static void IF(gemm_panel)(int six, const void *blocks, const acts_t *a, const void *sums,
                           int64_t m0, int64_t m1, int64_t n0, int nf, const float *bias,
                           float *out, int64_t ldo) {
    const gemm_blk_t *o = blocks;
    const int16_t *xp = sums;
    for (; m0 < m1; m0 += GEMM_MR) {
        const int64_t mr = m1 - m0 < GEMM_MR ? m1 - m0 : GEMM_MR;
        if (six) switch (mr) {
            GEMM_CASE(8, 1); GEMM_CASE(7, 1); GEMM_CASE(6, 1); GEMM_CASE(5, 1);
            GEMM_CASE(4, 1); GEMM_CASE(3, 1); GEMM_CASE(2, 1); default: GEMM_CASE(1, 1);
            }
        else switch (mr) {
            GEMM_CASE(8, 0); GEMM_CASE(7, 0); GEMM_CASE(6, 0); GEMM_CASE(5, 0);
            GEMM_CASE(4, 0); GEMM_CASE(3, 0); GEMM_CASE(2, 0); default: GEMM_CASE(1, 0);
            }
    }
}
#undef GEMM_CASE

/* out = x w^T (+ bias) for a K type, x already quantized (a, in k order); -2 on no memory */
static int IF(qlinear_gemm)(const acts_t *a, int64_t M, const uint8_t *w, int64_t N,
                            int64_t row_bytes, int qtype, const float *bias, float *out,
                            int64_t ldo, int threads) {
    static const IF(gemm_kind_t) kind = {sizeof(gemm_blk_t), 16, GEMM_MR, IF(gemm_unpack),
                                         IF(gemm_panel)};
    const int six = qtype == Q6_K;
    int16_t *xp = six ? NULL : IF(gemm_sums32)(a, M);
    if (!six && !xp) return -2;
    const int status =
        IF(gemm_drive)(&kind, six, xp, a, M, w, N, row_bytes, qtype, bias, out, ldo, threads);
    free(xp);
    return status;
}
