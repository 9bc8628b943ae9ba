/* GGUF's 256-weight K types, Q4_K, Q5_K and Q6_K, in one ISA copy (quant_body.c): each
 * type's dequantization of a row (the reference's formulas), then their fused few-row
 * kernels (fused_row_k for Q4_K and Q5_K, fused_row_q6k). The 6-bit scale unpacking
 * (scale_min_k4) is quant.c's: qdot_amx.c uses it too. */

/* ---- one row of K weights (K / 256 blocks) -> fp32 ---- */

/* Q4_K and Q5_K: 8 sub-blocks of 32, each (d * sc) * q - dmin * mn; sub-block j's nibbles are
 * the low (j even) or high (j odd) halves of bytes 32 * (j / 2) ..; Q5_K's fifth bit of
 * element l of sub-block j is bit j of qh[l]. */
static inline void FN(deq_qk)(const uint8_t *p, int64_t K, float *out, int five) {
    const int stride = five ? 176 : 144;
    for (int64_t b = 0; b < K; b += 256, p += stride, out += 256) {
        float d = half(p), dmin = half(p + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            /* ds * q - dm as fma(ds, q, -dm): the product is exact, so one rounding either way */
            vf vds = splat(d * (float)sc[j]), vdm = splat(-(dmin * (float)mn[j]));
            const uint8_t *q = qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            for (int c = 0; c < 32; c += VW) {
                vi v = (ldb(q + c) >> shift) & 15;
                if (five) v |= ((ldb(qh + c) >> j) & 1) << 4;
                st(out + 32 * j + c, FMA(vds, tof(v), vdm)); /* exact product */
            }
        }
    }
}

/* Q6_K: halves of 128; in half h, element r takes its low 4 bits from ql[64 h + r % 64]
 * (low nibble for r < 64, else high) and its top 2 from qh[32 h + r % 32] >> 2 (r / 32);
 * (d * scales[e / 16]) * (q - 32). */
static inline void FN(deq_q6_k)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 256, p += 210, out += 256) {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *scales = (const int8_t *)(p + 192);
        float d = half(p + 208);
        for (int e = 0; e < 256; e += VW) {
            int h = e / 128, r = e % 128;
            vi lo = ldb(ql + 64 * h + r % 64);
            lo = r < 64 ? lo & 15 : lo >> 4;
            vi hi = (ldb(qh + 32 * h + r % 32) >> (2 * (r / 32))) & 3;
            st(out + e, (d * (float)scales[e / 16]) * (tof(lo | (hi << 4)) - 32.f));
        }
    }
}

/* ---- fused: a few rows of x against one weight row (quant_body.c's FUSED_ROWS) ---- */

/* Q4_K and Q5_K, fused: sub-block j (32 weights) contributes (d sc_j) (q . x) - (dmin mn_j)
 * sum(x), xs holding x's sums over 32; sub-blocks 2i and 2i + 1 share their bytes (low and
 * high nibbles), so they are taken together. */
#define KSTEP(m)                                                                            \
    if (mr > m) {                                                                           \
        l##m = FMA(wl, ld(xb + m * ldx + c), l##m);                                         \
        h##m = FMA(wh, ld(xb + m * ldx + 32 + c), h##m);                                    \
    }
#define KEND(m)                                                                             \
    if (mr > m) {                                                                           \
        a##m = FMA(splat(dl), l##m, a##m), a##m = FMA(splat(dh), h##m, a##m);               \
        c##m -= ml * xs[m * nb + sb] + mh * xs[m * nb + sb + 1];                            \
    }
static inline __attribute__((always_inline)) void FN(fused_row_k)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xs, const uint8_t *p,
    int qtype, float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    const int five = qtype == Q5_K, stride = five ? 176 : 144;
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < K / 256; b++, p += stride) {
        __builtin_prefetch(p + 4096), __builtin_prefetch(p + 4096 + 64);
        const float d = half(p), dmin = half(p + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        for (int j = 0; j < 8; j += 2) {
            const uint8_t *q = qs + 16 * j;
            const float *xb = x + b * 256 + 32 * j;
            const int64_t sb = b * 8 + j;
            vf l0 = {}, l1 = {}, l2 = {}, l3 = {}, h0 = {}, h1 = {}, h2 = {}, h3 = {};
            for (int c = 0; c < 32; c += VW) {
                vi v = ldb(q + c), lo = v & 15, hi = v >> 4;
                if (five) {
                    vi vh = ldb(qh + c);
                    lo |= ((vh >> j) & 1) << 4, hi |= ((vh >> (j + 1)) & 1) << 4;
                }
                vf wl = tof(lo), wh = tof(hi);
                KSTEP(0) KSTEP(1) KSTEP(2) KSTEP(3)
            }
            const float dl = d * (float)sc[j], dh = d * (float)sc[j + 1];
            const float ml = dmin * (float)mn[j], mh = dmin * (float)mn[j + 1];
            KEND(0) KEND(1) KEND(2) KEND(3)
        }
    }
    FUSED_SUMS
}
#undef KSTEP
#undef KEND

/* Q6_K, fused: each group of 16 weights contributes (d sc_g) ((q - 32) . x) */
#define QSTEP(m)                                                                            \
    if (mr > m) t##m = FMA(w, ld(xb + m * ldx + c), t##m);
#define QEND(m)                                                                             \
    if (mr > m) a##m = FMA(ds, t##m, a##m);
static inline __attribute__((always_inline)) void FN(fused_row_q6k)(
    const int mr, const float *x, int64_t ldx, int64_t K, const uint8_t *p,
    float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t b = 0; b < K / 256; b++, p += 210) {
        __builtin_prefetch(p + 4096), __builtin_prefetch(p + 4096 + 64);
        __builtin_prefetch(p + 4096 + 128), __builtin_prefetch(p + 4096 + 192);
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float d = half(p + 208);
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, r0 = 16 * (g % 8);
            const float *xb = x + b * 256 + 16 * g;
            vf t0 = {}, t1 = {}, t2 = {}, t3 = {};
            for (int c = 0; c < 16; c += VW) {
                const int r = r0 + c;
                vi lo = ldb(ql + 64 * h + r % 64);
                lo = r < 64 ? lo & 15 : lo >> 4;
                vi hi = (ldb(qh + 32 * h + r % 32) >> (2 * (r / 32))) & 3;
                vf w = tof((lo | (hi << 4)) - 32);
                QSTEP(0) QSTEP(1) QSTEP(2) QSTEP(3)
            }
            vf ds = splat(d * (float)scales[g]);
            QEND(0) QEND(1) QEND(2) QEND(3)
        }
    }
    const float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f; /* no scalar terms: Q6_K has no mins */
    FUSED_SUMS
}
#undef QSTEP
#undef QEND
